"""`import oomguard` in a user's own loop: real processes, real allocation failures (RLIMIT_AS),
results compared with a plain loop's parameters. Run by `make test` (scripts/setup.sh has
built and installed the package into the venv first)."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import oomguard
from conftest import launcher, max_diff, records, run_loop, run_ranks

STEPS = 6
GLOBAL = 1024


def micro_batches(out: str, rank_marker: str = "") -> list:
    """Per step, the micro-batch the loop printed."""
    return [int(m) for m in re.findall(r"^step \d+ loss \S+ micro_batch (\d+)$", out, re.M)]


# --- one process, a real allocation failure --------------------------------------------------


def test_a_real_oom_is_recovered_and_the_parameters_equal_an_uncapped_run(tmp_path, reference):
    run_dir = tmp_path / "run"
    # 60 MiB above the set-up's address space: the whole batch of 1024 needs about 300 MiB.
    r = run_loop(tmp_path, "capped", "--guard", "--cap-mb", "60", "--run-dir", str(run_dir))
    assert r.code == 0, r.out
    assert "can't allocate memory" in r.out  # the allocator's own failure, recovered
    sizes = micro_batches(r.out)
    assert len(sizes) == STEPS and sizes[-1] < GLOBAL, r.out
    assert max_diff(reference.params, r.params) < 1e-5
    recs = records(run_dir)
    ooms = [x for x in recs if x["event"] == "oom"]
    steps = [x for x in recs if x["event"] == "step"]
    assert ooms and all(
        o["source"] == "cpu" and o["new_micro_batch_size"] * 2 == o["old_micro_batch_size"] for o in ooms
    )
    assert [s["micro_batch_size"] for s in steps] == sizes
    assert [s["grad_accum_steps"] for s in steps] == [-(-GLOBAL // m) for m in sizes]
    assert [s["tokens_per_s"] for s in steps] == pytest.approx([GLOBAL / s["step_time_s"] for s in steps])
    # The launcher's relaunch contract: the last size printed is the one the run settled at.
    assert re.findall(r"micro_batch_size=(\d+)", r.out)[-1] == str(sizes[-1])


def test_a_second_run_starts_at_the_size_the_first_settled_at(tmp_path):
    cache = tmp_path / "cache"
    first = run_loop(tmp_path, "first", "--guard", "--cap-mb", "60", extra_env={"OOMGUARD_CACHE": str(cache)})
    assert first.code == 0, first.out
    settled = micro_batches(first.out)[-1]
    # The runtime's cache file, its format: a JSON map from key to size.
    known = json.loads((cache / "micro_batch.json").read_text())
    assert list(known.values()) == [settled] and list(known)[0].startswith("python:"), known
    second = run_loop(tmp_path, "second", "--guard", "--cap-mb", "60", extra_env={"OOMGUARD_CACHE": str(cache)})
    assert second.code == 0, second.out
    assert f"starting at micro_batch_size={settled}" in second.out
    # Its first step runs at the learned size, without the OOMs the first run had there (a
    # later step may still run out: the heap fragments differently run to run).
    assert "OOM at step 0" not in second.out and micro_batches(second.out)[0] == settled, second.out
    assert max_diff(first.params, second.params) < 1e-5


def test_infeasible_exits_with_what_would_fit(tmp_path):
    # Each sample's loss allocates 400 MiB more: even micro-batch 1 cannot fit 60 MiB.
    r = run_loop(tmp_path, "infeasible", "--guard", "--cap-mb", "60", "--sample-mb", "400", "--steps", "1")
    assert r.code == 1, r.out
    # Printed as oomguard.Infeasible: the line `oomguard launch` reads as exit 3.
    assert "oomguard.Infeasible: step 0: the step does not fit in memory even at micro-batch 1" in r.out
    assert "the failed allocation wanted 400.0 MiB" in r.out
    halvings = re.findall(r"micro-batch (\d+) -> (\d+|none left)", r.out)
    assert [int(a) for a, _ in halvings[:11]] == [1024 >> i for i in range(11)]
    assert halvings[-1] == ("1", "none left")


# --- in-process: exactness, bad input, nothing half-applied ----------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32, dtype=torch.float64), torch.nn.Tanh(), torch.nn.Linear(32, 1, dtype=torch.float64)
    )


def _data(n=32):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 8, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)


def test_gradients_equal_one_backward_of_the_whole_batch_added_to_those_before():
    m = _model()
    x, y = _data()
    loss_fn = lambda b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    loss_fn((x[:3], y[:3])).backward()  # gradients already there: backward adds to them
    before = [p.grad.clone() for p in m.parameters()]
    full = loss_fn((x, y))
    want = [b + g for b, g in zip(before, torch.autograd.grad(full, list(m.parameters())))]
    guard = oomguard.Guard(m, global_batch_size=32, micro_batch_size=5, verbose=False)  # 5 does not divide 32
    loss = guard.backward((x, y), loss_fn)
    assert abs(loss - full.item()) < 1e-12
    assert max_diff([p.grad for p in m.parameters()], want) < 1e-12


def _whole_batch():
    """The model, the batch, its loss and the gradients of one backward of all of it."""
    m = _model()
    x, y = _data()
    full = torch.nn.functional.mse_loss(m(x), y)
    return m, x, y, full, torch.autograd.grad(full, list(m.parameters()))


def test_an_oom_in_a_later_micro_batchs_forward_keeps_the_micro_batches_done():
    """One process: micro-batch 0 fits, and its gradients, once allocated, leave too little
    room for micro-batch 1's forward (a real failure of the CPU allocator, as the gradients'
    first allocation causes in the own-loop bench). The rows already done stay in `.grad`;
    only the rest is redone, at half the size, then a quarter; the gradients are exact."""
    m, x, y, full, want = _whole_batch()
    calls = []

    def loss_fn(b):
        calls.append(len(b[0]))
        if len(b[0]) > 4 and m[0].weight.grad is not None:
            torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the allocator refuses
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    # cache=False: the size it settles at is this test's alone (the same model's tests share a cache).
    guard = oomguard.Guard(m, global_batch_size=32, micro_batch_size=16, verbose=False, cache=False)
    loss = guard.backward((x, y), loss_fn)
    assert calls == [16, 16, 8, 4, 4, 4, 4], calls
    assert guard.micro_batch_size == 4 and guard.policy.num_ooms == 2
    assert abs(loss - full.item()) < 1e-12
    assert max_diff([p.grad for p in m.parameters()], list(want)) < 1e-12


def test_an_oom_after_a_micro_batchs_backward_keeps_that_micro_batch(monkeypatch):
    """One process: the hook's OOM comes after micro-batch 1's backward has finished (its
    gradients complete). That micro-batch stays in `.grad` with micro-batch 0's; only the
    rows after it run again, at half the size; exact. Before, the whole step was redone."""
    monkeypatch.setenv("OOMGUARD_TEST_OOM_AT", "0:0:backward:2")
    m, x, y, full, want = _whole_batch()
    calls = []

    def loss_fn(b):
        calls.append(len(b[0]))
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    guard = oomguard.Guard(m, global_batch_size=32, micro_batch_size=8, verbose=False, cache=False)
    loss = guard.backward((x, y), loss_fn)
    assert calls == [8, 8, 4, 4, 4, 4], calls
    assert guard.micro_batch_size == 4 and guard.policy.num_ooms == 1
    assert abs(loss - full.item()) < 1e-12
    assert max_diff([p.grad for p in m.parameters()], list(want)) < 1e-12


class _HungryBackward(torch.autograd.Function):
    """Identity forward; its backward allocates 1 PiB (the allocator refuses) for a micro-batch
    above `above` rows once `first`'s gradient exists, as the gradients' first allocation
    leaves too little room for a large micro-batch's backward in the own-loop bench."""

    @staticmethod
    def forward(ctx, x, first, above):
        ctx.rows, ctx.first, ctx.above = x.shape[0], first, above
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.rows > ctx.above and ctx.first.grad is not None:
            torch.empty(1 << 50, dtype=torch.uint8)
        return g, None, None


def test_an_oom_part_way_through_a_backward_keeps_what_it_finished():
    """Micro-batch 1's backward completes the last layer's gradients, then runs out before
    the first layer's. The rows of micro-batch 0 stay, the last layer keeps micro-batch 1's
    rows, and only the first layer's share of them is redone (two halves); exact."""
    m = _model()
    x, y = _data()

    def forward(rows):
        h = _HungryBackward.apply(m[0](rows), m[0].weight, 8)
        return m[2](m[1](h))

    full = torch.nn.functional.mse_loss(forward(x), y)
    want = torch.autograd.grad(full, list(m.parameters()))
    calls, last_layer = [], []
    m[2].weight.register_post_accumulate_grad_hook(lambda p: last_layer.append(1))

    def loss_fn(b):
        calls.append(len(b[0]))
        return torch.nn.functional.mse_loss(forward(b[0]), b[1])

    guard = oomguard.Guard(m, global_batch_size=32, micro_batch_size=16, verbose=False, cache=False)
    loss = guard.backward((x, y), loss_fn)
    assert calls == [16, 16, 8, 8], calls
    assert len(last_layer) == 2, "the last layer's gradient was computed again"
    assert guard.policy.num_ooms == 1
    assert abs(loss - full.item()) < 1e-12
    assert max_diff([p.grad for p in m.parameters()], list(want)) < 1e-12


def test_reentrant_checkpointing_refusing_the_partial_redo_redoes_the_attempt_whole():
    """As above, with the layer between under reentrant activation checkpointing (HF's
    gradient checkpointing default), which refuses `backward(inputs=...)`: the redo of what
    the first layer missed cannot run, so the attempt runs again whole at the new size,
    and later OOMs keep no backward part-way; exact."""
    from torch.utils.checkpoint import checkpoint

    m, ref = _model(), _model()
    x, y = _data()

    def forward(net, rows):
        h = _HungryBackward.apply(net[0](rows), net[0].weight, 8 if net is m else len(rows))
        return net[2](checkpoint(net[1], h, use_reentrant=True))

    full = torch.nn.functional.mse_loss(forward(ref, x), y)
    full.backward()  # reentrant checkpointing refuses autograd.grad
    want = [p.grad for p in ref.parameters()]
    calls = []

    def loss_fn(b):
        calls.append(len(b[0]))
        return torch.nn.functional.mse_loss(forward(m, b[0]), b[1])

    guard = oomguard.Guard(m, global_batch_size=32, micro_batch_size=16, verbose=False, cache=False)
    loss = guard.backward((x, y), loss_fn)
    assert calls == [16, 16, 8, 8, 8, 8, 8], calls
    assert guard.policy.num_ooms == 1
    assert abs(loss - full.item()) < 1e-12
    assert max_diff([p.grad for p in m.parameters()], list(want)) < 1e-12


def test_an_oom_part_way_through_redoing_such_rows_keeps_what_each_backward_finished():
    """Three layers. Micro-batch 1's backward (16 rows) completes the last layer, then runs
    out; redoing its rows at 8, the backward completes the middle layer over the first 8 and
    runs out before the first layer; at 4 the first layer gets them, and the middle and first
    layers get the last 8. Each layer's gradient is computed over each row once; exact."""
    torch.manual_seed(0)
    lin = [torch.nn.Linear(a, b, dtype=torch.float64) for a, b in ((8, 16), (16, 16), (16, 1))]
    m = torch.nn.Sequential(*lin)
    x, y = _data()

    def forward(rows):
        h = torch.tanh(_HungryBackward.apply(lin[0](rows), lin[0].weight, 4))
        h = torch.tanh(_HungryBackward.apply(lin[1](h), lin[0].weight, 8))
        return lin[2](h)

    full = torch.nn.functional.mse_loss(forward(x), y)
    want = torch.autograd.grad(full, list(m.parameters()))
    calls, counts = [], {1: [], 2: []}
    for i in counts:
        lin[i].weight.register_post_accumulate_grad_hook(lambda p, i=i: counts[i].append(1))

    def loss_fn(b):
        calls.append(len(b[0]))
        return torch.nn.functional.mse_loss(forward(b[0]), b[1])

    guard = oomguard.Guard(m, global_batch_size=32, micro_batch_size=16, verbose=False, cache=False)
    loss = guard.backward((x, y), loss_fn)
    assert calls == [16, 16, 8, 4, 4, 4, 4], calls
    assert (len(counts[2]), len(counts[1])) == (2, 4), counts
    assert guard.policy.num_ooms == 2
    assert abs(loss - full.item()) < 1e-12
    assert max_diff([p.grad for p in m.parameters()], list(want)) < 1e-12


def test_a_round_after_a_membership_change_records_it(tmp_path, monkeypatch):
    """Under an elastic `oomguard launch`, a script restarted at a smaller world (its own
    checkpoint restored, the guard's state with it) records the launcher's change after its
    first step: the worlds, the cause, the seconds since it was seen, the steps done again."""
    m = _model()
    x, y = _data()
    loss_fn = lambda b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"event":"step","step":{s}}}\n' for s in range(10)))
    seen = int(time.time() * 1000) - 1500  # the launcher saw the change 1.5 s ago
    change = {"old_world": 3, "new_world": 2, "cause": "node 1's launcher is gone", "detected_unix_ms": seen}
    monkeypatch.setenv("OOMGUARD_MEMBERSHIP", json.dumps(change))
    guard = oomguard.Guard(m, global_batch_size=32, run_dir=str(tmp_path), verbose=False, cache=False)
    guard.load_state_dict({"step": 8, "policy": guard.state_dict()["policy"]})  # its checkpoint's
    guard.backward((x, y), loss_fn)
    guard.backward((x, y), loss_fn)
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    found = [r for r in records if r["event"] == "membership"]
    assert len(found) == 1, records
    r = found[0]
    assert (r["step"], r["old_world"], r["new_world"], r["steps_recomputed"]) == (8, 3, 2, 2), r
    assert r["cause"] == change["cause"] and r["source"] == "checkpoint"
    assert 1.0 < r["seconds"] < 60.0, r
    # The resume itself, as `oomguard train` records it (what `oomguard report` counts), and
    # the records the resumed run redoes set aside.
    kept = [(r["event"], r["step"]) for r in records if r["event"] in ("step", "resumed")]
    assert kept == [("step", s) for s in range(8)] + [("resumed", 8), ("step", 8), ("step", 9)], records


def test_two_guards_writing_one_directory_lose_no_record(tmp_path):
    """Two models in one loop, one run directory that an earlier run wrote: the first guard's
    first record sets the earlier run's aside (the file rewritten whole), and the second
    guard's records still land; a resume's checkpoint given as a Path is recorded as text."""
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"event":"step","step":{s}}}\n' for s in range(3)))
    x, y = _data()
    guards = []
    for _ in range(2):
        m = _model()
        g = oomguard.Guard(m, global_batch_size=32, run_dir=str(tmp_path), verbose=False, cache=False)
        guards.append((g, lambda b, m=m: torch.nn.functional.mse_loss(m(b[0]), b[1])))
    for g, loss_fn in guards:
        g.backward((x, y), loss_fn)
    guards[0][0].load_state_dict(guards[0][0].state_dict(), checkpoint=tmp_path / "ckpt")
    guards[1][0].backward((x, y), guards[1][1])
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in records] == [("step", 0), ("step", 0), ("resumed", 1), ("step", 1)], records
    assert records[2]["checkpoint"] == str(tmp_path / "ckpt")
    replaced = (tmp_path / "metrics.replaced.jsonl").read_text().splitlines()
    assert len(replaced) == 3, replaced


def test_bad_input_names_both_numbers_and_leaves_grads_alone():
    m = _model()
    x, y = _data()
    loss_fn = lambda b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    loss_fn((x, y)).backward()
    before = [p.grad.clone() for p in m.parameters()]
    guard = oomguard.Guard(m, global_batch_size=32, micro_batch_size=8, verbose=False)
    with pytest.raises(ValueError, match=r"batch\[0\] has 32 rows, batch\[1\] has 31"):
        guard.backward((x, y[:31]), loss_fn)
    with pytest.raises(ValueError, match=r"the batch has 33 rows but global_batch_size is 32"):
        guard.backward((torch.cat([x, x[:1]]), torch.cat([y, y[:1]])), loss_fn)
    with pytest.raises(TypeError, match=r"batch must hold tensors.*str"):
        guard.backward("rows", loss_fn)
    calls = []

    def vector_on_second_call(b):
        calls.append(len(b[0]))
        out = (m(b[0]) - b[1]) ** 2
        return out.mean() if len(calls) == 1 else out  # micro-batch 0's backward has run by then

    with pytest.raises(TypeError, match=r"scalar tensor.*shape \(8, 1\)"):
        guard.backward((x, y), vector_on_second_call)
    assert calls == [8, 8]
    assert max_diff([p.grad for p in m.parameters()], before) == 0.0
    assert guard.step == 0


def test_infeasible_in_process_restores_grads_and_says_why():
    m = _model()
    x, y = _data()
    loss_fn = lambda b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    loss_fn((x, y)).backward()
    before = [p.grad.clone() for p in m.parameters()]

    def too_big(b):
        torch.ones(len(b[0]) << 27, dtype=torch.float64).sum()  # 1 GiB a sample, really allocated
        return loss_fn(b)

    guard = oomguard.Guard(m, global_batch_size=32, micro_batch_size=32, verbose=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), hard))
    try:
        with pytest.raises(oomguard.Infeasible) as e:
            guard.backward((x, y), too_big)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert e.value.phase == "forward" and e.value.requested_bytes == 1 << 30
    assert "even at micro-batch 1" in str(e.value) and "can't allocate memory" in e.value.oom_message
    assert guard.micro_batch_size == 1
    assert max_diff([p.grad for p in m.parameters()], before) == 0.0


def test_the_example_runs(tmp_path):
    from conftest import ROOT, env

    run_dir = tmp_path / "own"
    # Twice into one directory, as a sweep reruns an interrupted trial that saved nothing:
    # the second run's metrics.jsonl reads as its own, the first's records set aside.
    for again in (False, True):
        p = subprocess.run(
            [sys.executable, str(ROOT / "examples/python/own_loop.py")],
            env=env({"OOMGUARD_RUN_DIR": str(run_dir)}),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stderr
        losses = [float(l.split()[3]) for l in p.stdout.splitlines() if l.startswith("step ")]
        steps = [x for x in records(run_dir) if x["event"] == "step"]
        assert [s["step"] for s in steps] == list(range(20))
        assert [round(s["loss"], 4) for s in steps] == losses
    replaced = [json.loads(l) for l in (run_dir / "metrics.replaced.jsonl").read_text().splitlines()]
    assert [r["step"] for r in replaced if r["event"] == "step"] == list(range(20))


def test_the_pages_ten_lines_run():
    from conftest import ROOT, env

    page = (ROOT / "docs" / "own-loop.md").read_text()
    code = page.split("## Ten lines", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 11, code
    p = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert [l.split()[1] for l in p.stdout.splitlines() if l.startswith("step ")] == [str(i) for i in range(20)]


def test_what_counts_as_an_oom():
    cpu = (
        "[enforce fail at alloc_cpu.cpp:127] err == 0. "
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 16777216 bytes."
    )
    assert oomguard.classify_oom(cpu)[0:3:2] == ("cpu", 16777216)
    assert oomguard.is_oom(RuntimeError(cpu))
    assert oomguard.is_oom(RuntimeError("could not create a primitive descriptor for a matmul primitive"))
    assert oomguard.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert oomguard.is_oom(MemoryError())
    assert not oomguard.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"))
    assert not oomguard.is_oom(ValueError("can't allocate memory"))  # not an error torch raises for memory


def test_it_grows_back_after_clean_steps_and_the_cooldown(monkeypatch):
    monkeypatch.setenv("OOMGUARD_TEST_OOM_AT", "0:0:backward")
    m = _model()
    x, y = _data()
    loss_fn = lambda b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    guard = oomguard.Guard(m, global_batch_size=32, verbose=False, cache=False, grow_after_steps=2, cooldown_steps=5)
    sizes = []
    for _ in range(9):
        want = torch.autograd.grad(loss_fn((x, y)), list(m.parameters()))
        guard.backward((x, y), loss_fn)
        assert max_diff([p.grad for p in m.parameters()], list(want)) < 1e-12
        m.zero_grad(set_to_none=True)
        sizes.append(guard.micro_batch_size)
    # 32 ran out at step 0 -> 16; two clean steps are enough, but 32 cools down until step 5.
    assert sizes == [16, 16, 16, 16, 16, 32, 32, 32, 32]
    assert guard.policy.num_ooms == 1


def test_pip_install_gives_import_oomguard_and_the_command(tmp_path):
    """`make wheel`'s wheel, pip-installed in a venv with nothing else: the policy works and the
    guard asks for torch; `oomguard train` says it needs oomguard-torch (exit 2). With torch
    added, `oomguard launch` runs a guarded script on 2 ranks under the venv's own Python (the
    system's python3 first on PATH has no torch), and `oomguard report` draws the run."""
    from conftest import LOOP, ROOT, env

    built = subprocess.run(
        ["bash", str(ROOT / "scripts" / "wheel.sh"), str(tmp_path / "dist")], capture_output=True, text=True, timeout=600
    )
    assert built.returncode == 0, built.stderr
    wheel = built.stdout.split()[-1]
    # Its tag's glibc covers the bundled command's (which maturin does not audit).
    import re, zipfile
    with zipfile.ZipFile(wheel) as z:
        (member,) = [n for n in z.namelist() if n.endswith("_bin/oomguard")]
        (tmp_path / "bundled").write_bytes(z.read(member))
    needs = subprocess.run(["objdump", "-T", str(tmp_path / "bundled")], capture_output=True, text=True).stdout
    most = max(int(m) for m in re.findall(r"GLIBC_2\.(\d+)", needs))
    assert int(re.search(r"manylinux_2_(\d+)", wheel).group(1)) >= most, wheel
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*pip, "--disable-pip-version-check", wheel], check=True)
    code = (
        "import oomguard\n"
        "p = oomguard.Policy(24)\n"
        "print([p.on_oom(s, False, None) for s in range(7)])\n"
        "print(oomguard.classify_oom('CUDA out of memory. Tried to allocate 2.00 GiB')[:3])\n"
        "try:\n    oomguard.Guard\nexcept ImportError as e:\n    print('needs', e.name)\n"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # The runtime's halving (crates/policy's own test: 24 -> 12, 6, 3, 2, 1, then up to 8
    # retries at 1 for different failures, and give up).
    assert out.stdout.splitlines() == [
        "[12, 6, 3, 2, 1, 1, 1]",
        "('cuda', 'CUDA out of memory. Tried to allocate 2.00 GiB', 2147483648)",
        "needs torch",
    ]
    command = venv / "bin" / "oomguard"
    bare_path = {"PATH": "/usr/bin:/bin"}
    t = subprocess.run([str(command), "train", "configs/demo.yaml"], capture_output=True, text=True, env=env(bare_path))
    assert t.returncode == 2 and "_bin/oomguard-torch (install it beside oomguard)" in t.stderr, t.stderr

    # The user's torch: the set-up's, seen from the venv (its own site-packages come first).
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "users_torch.pth").write_text(str(Path(torch.__file__).parents[1]) + "\n")
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [str(command), "launch", "--nproc-per-node", "2", "--run-dir", str(run_dir), str(LOOP), "--guard",
         "--out", str(tmp_path / "out.pt")],
        env=env({**bare_path, "OOMGUARD_TEST_OOM_AT": "1:1:forward", "OOMGUARD_MICRO_BATCH_SIZE": "256"}),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stdout
    steps = [x for x in records(run_dir) if x["event"] == "step"]
    assert [s["micro_batch_size"] for s in steps] == [256, 128, 128, 128, 128, 128], p.stdout
    png = tmp_path / "report.png"
    rep = subprocess.run([str(command), "report", str(run_dir), "--out", str(png)], capture_output=True, text=True)
    assert rep.returncode == 0, rep.stderr
    assert png.stat().st_size > 10_000


_DDP_ONE_RANK = """
import sys, torch, torch.distributed as dist, oomguard

class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(8, 4, dtype=torch.float64)
        self.unused = torch.nn.Linear(8, 4, dtype=torch.float64)

    def forward(self, x):
        return self.used(x)

torch.manual_seed(0)
m = TwoHeads()
x = torch.randn(12, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
want = torch.autograd.grad(m(x).pow(2).mean(), list(m.used.parameters()))
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
try:
    ddp = torch.nn.parallel.DistributedDataParallel(m)
    guard = oomguard.Guard(ddp, global_batch_size=12, micro_batch_size=5, verbose=False, cache=False)
    guard.backward(x, lambda b: ddp(b).pow(2).mean())
finally:
    dist.destroy_process_group()
diff = max((p.grad - w).abs().max().item() for p, w in zip(m.used.parameters(), want))
print("diff", diff, "unused", [p.grad for p in m.unused.parameters()])
"""


def test_ddp_averages_in_place_and_leaves_unused_parameters_without_grad(tmp_path):
    # In a process of its own (a process group in pytest's own process would outlive an
    # interrupted test and meet the state earlier tests left there), under a timeout.
    from conftest import env

    p = subprocess.run(
        [sys.executable, "-c", _DDP_ONE_RANK, str(tmp_path / "store")],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    diff, unused = p.stdout.split("diff ")[1].split(" unused ")
    assert float(diff) < 1e-12, p.stdout
    assert unused.strip() == "[None, None]", p.stdout


_DDP_RANK_BRANCH = """
import sys, torch, torch.distributed as dist, oomguard

rank = int(sys.argv[2])

class Branch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(8, 4, dtype=torch.float64)
        self.rank1 = torch.nn.Linear(8, 4, dtype=torch.float64)
        self.nobody = torch.nn.Linear(8, 4, dtype=torch.float64)

    def forward(self, x):
        y = self.used(x)
        return y + self.rank1(x) if rank == 1 else y

torch.manual_seed(0)
m = Branch()
xs = [torch.randn(12, 8, generator=torch.Generator().manual_seed(3 + r), dtype=torch.float64) for r in range(2)]
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
try:
    ddp = torch.nn.parallel.DistributedDataParallel(m, find_unused_parameters=True)
    guard = oomguard.Guard(ddp, global_batch_size=12, micro_batch_size=4, verbose=False, cache=False)
    guard.backward(xs[rank], lambda b: ddp(b).pow(2).mean())
    got = {n: p.grad for n, p in m.named_parameters()}
    mb = guard.micro_batch_size
finally:
    dist.destroy_process_group()
# Each rank's own gradients, averaged: rank 1's branch over 2 (rank 0 adds zeros).
want = {}
for r in range(2):
    params = [(n, p) for n, p in m.named_parameters() if n.startswith("used") or (r == 1 and n.startswith("rank1"))]
    out = m.used(xs[r]) + (m.rank1(xs[r]) if r == 1 else 0)
    grads = torch.autograd.grad(out.pow(2).mean(), [p for _, p in params])
    for (n, _), g in zip(params, grads):
        want[n] = want.get(n, 0) + g / 2
diff = max((got[n] - w).abs().max().item() for n, w in want.items())
print("RESULT", diff, got["nobody.weight"] is None, mb)
"""


def test_a_parameter_one_ddp_rank_lacks_averages_with_zeros_after_an_oom_there(tmp_path):
    """Rank 1 uses a branch rank 0 does not: rank 0's zeros for it are allocated before the
    ranks agree (an OOM there, injected, is voted and recovered, where one met after the vote
    left the other rank waiting in the all-reduce), the branch's gradient is rank 1's over 2,
    and a parameter no rank used keeps `.grad` None."""
    from conftest import env

    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _DDP_RANK_BRANCH, str(tmp_path / "store"), str(r)],
            env=env({"OOMGUARD_TEST_OOM_AT": "0:0:sync"}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        diff, nobody, mb = out.split("RESULT ")[1].split()
        assert float(diff) < 1e-12, out
        assert nobody == "True", out
        assert mb == "2", f"the OOM in sync halved the micro-batch on both ranks: {out}"


# --- two Gloo ranks with DDP: an OOM on one rank shrinks both -------------------------------


@pytest.fixture(scope="module")
def clean_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    r = run_ranks(tmp, "clean", "--guard")
    assert r.code == 0, r.out
    return r


def test_two_clean_ranks_equal_the_plain_loop(clean_ranks, reference, tmp_path):
    plain = run_ranks(tmp_path, "plain")  # plain DDP, no guard: the uncapped 2-rank run
    assert plain.code == 0, plain.out
    assert max_diff(plain.params, clean_ranks.params) < 1e-5
    assert max_diff(reference.params, clean_ranks.params) < 1e-5
    assert micro_batches(clean_ranks.out) == [GLOBAL // 2] * STEPS * 2


@pytest.mark.parametrize("phase", ["forward", "backward", "sync"])
def test_an_oom_on_one_rank_shrinks_both(phase, tmp_path, clean_ranks, reference):
    run_dir = tmp_path / "run"
    r = run_ranks(
        tmp_path, phase, "--guard", "--run-dir", str(run_dir), extra_env={"OOMGUARD_TEST_OOM_AT": f"1:2:{phase}"}
    )
    assert r.code == 0, r.out
    half = GLOBAL // 2
    # Both ranks: 512 for steps 0-1, then 256 from the step rank 1 ran out at.
    assert micro_batches(r.out) == ([half] * 2 + [half // 2] * 4) * 2, r.out
    assert max_diff(reference.params, r.params) < 1e-5
    # The training loops' time (start-up, torch's import and the group's forming, is noise
    # on a shared 2-core machine): within the clean run's plus a few seconds.
    assert r.train_s() < clean_ranks.train_s() + 3.0, (r.train_s(), clean_ranks.train_s())
    ooms = [x for x in records(run_dir) if x["event"] == "oom"]
    assert [(o["step"], o["phase"], o["rank"], o["old_micro_batch_size"], o["new_micro_batch_size"]) for o in ooms] == [
        (2, phase, 1, half, half // 2)
    ]


def test_a_real_oom_on_one_rank_shrinks_both(tmp_path, reference):
    # Rank 1 under a 40 MiB cap (its half batch of 512 needs about 150 MiB), rank 0 free.
    r = run_ranks(tmp_path, "capped", "--guard", "--cap-mb", "40", "--cap-rank", "1")
    assert r.code == 0, r.out
    assert "can't allocate memory" in r.out
    per_rank = r.out.split("--- rank 1")
    assert micro_batches(per_rank[0]) == micro_batches(per_rank[1])
    assert micro_batches(per_rank[0])[-1] < GLOBAL // 2
    assert max_diff(reference.params, r.params) < 1e-5


def test_under_the_launcher(tmp_path, reference):
    binary = launcher()
    if binary is None:
        pytest.skip("no oomguard binary (OOMGUARD_BIN, or target/release/oomguard: `cargo build --release`)")
    run_dir = tmp_path / "run"
    out_file = tmp_path / "launched.pt"
    from conftest import LOOP, env

    p = subprocess.run(
        # The launcher names the run directory (OOMGUARD_RUN_DIR for the workers' Guard).
        [str(binary), "launch", "--nproc-per-node", "2", "--standalone", "--run-dir", str(run_dir), str(LOOP), "--guard",
         "--out", str(out_file)],
        env=env(
            {
                "OOMGUARD_TEST_OOM_AT": "0:1:backward",
                "OOMGUARD_MICRO_BATCH_SIZE": "256",
                "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            }
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout
    steps = [x for x in records(run_dir) if x["event"] == "step"]
    # Started at the launcher's size, halved once by the OOM rank 0 had at step 1.
    assert [s["micro_batch_size"] for s in steps] == [256, 128, 128, 128, 128, 128]
    assert max_diff(reference.params, torch.load(out_file)) < 1e-5
    # oomguard report draws it.
    png = tmp_path / "report.png"
    rep = subprocess.run([str(binary), "report", str(run_dir), "--out", str(png)], capture_output=True, text=True)
    assert rep.returncode == 0, rep.stderr
    assert png.stat().st_size > 10_000
    assert re.search(r"OOMs?\D+1\b", rep.stdout), rep.stdout


def _children(pid: int) -> list:
    """The processes a launcher started (its workers, each the leader of its process group)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _listening(port: int) -> bool:
    """Whether a socket listens at this port (from /proc/net/tcp: no stranger's connection)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":
                    return True
    return False


def test_an_elastic_job_loses_a_node_and_the_script_resumes_at_the_smaller_world(tmp_path):
    """Two nodes of an elastic `oomguard launch --nnodes 1:2` (separate launchers on loopback),
    each running the user's script with the guard and its own per-step checkpoint. One node is
    killed -9 mid-run: the other's launcher restarts the script at world 1, which resumes
    from the checkpoint, the guard records the change, and the run ends where one process
    ends."""
    binary = launcher()
    if binary is None:
        pytest.skip("no oomguard binary (OOMGUARD_BIN, or target/release/oomguard: `cargo build --release`)")
    from conftest import LOOP, env, free_port

    steps = 14
    single = run_loop(tmp_path, "single", "--steps", str(steps))
    assert single.code == 0, single.out
    run_dir, out_file = tmp_path / "run", tmp_path / "elastic.pt"
    port = free_port()
    # Several nodes need a secret of the user's, the same on each (docs/launcher.md).
    node_env = env({"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PET_RDZV_CONF": "last_call_timeout=1",
                    "OOMGUARD_RUN_TOKEN": "py-elastic-secret-8c41d2e7"})

    def node() -> subprocess.Popen:
        return subprocess.Popen(
            [str(binary), "launch", "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "py-elastic", "--monitor-interval", "0.05",
             "--run-dir", str(run_dir), str(LOOP), "--guard", "--steps", str(steps), "--step-pause", "0.3",
             "--checkpoint", str(tmp_path / "state.pt"), "--out", str(out_file)],
            env=node_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    host = node()
    t0 = time.time()
    while not _listening(port):  # the first launcher hosts the rendezvous
        assert time.time() - t0 < 30, "no rendezvous"
        time.sleep(0.01)
    other = node()
    try:
        t0 = time.time()
        while len([r for r in records(run_dir) if r["event"] == "step"] if (run_dir / "metrics.jsonl").exists() else []) < 3:
            assert time.time() - t0 < 120, "no progress"
            time.sleep(0.05)
        for w in _children(other.pid):
            os.killpg(w, 9)
        other.kill()
        other.wait()
        out, _ = host.communicate(timeout=180)
    finally:
        for p in (host, other):
            if p.poll() is None:
                p.kill()
    assert host.returncode == 0, out
    assert "node 1's launcher is gone" in out, out
    assert "resumed at step" in out, out
    recs = records(run_dir)
    changes = [r for r in recs if r["event"] == "membership"]
    assert [(r["old_world"], r["new_world"]) for r in changes] == [(2, 1)], recs
    assert changes[0]["steps_recomputed"] <= 1 and changes[0]["seconds"] < 30, changes
    worlds = [r["world_size"] for r in recs if r["event"] == "step"]
    assert worlds[0] == 2 and worlds[-1] == 1, worlds
    # A step redone after the change replaces its old record (moved to metrics.replaced.jsonl).
    assert [r["step"] for r in recs if r["event"] == "step"] == list(range(steps)), recs
    replaced = run_dir / "metrics.replaced.jsonl"
    lines = replaced.read_text().splitlines() if replaced.exists() else []
    redone = [r["step"] for r in map(json.loads, lines) if r["event"] == "step"]
    assert len(redone) == changes[0]["steps_recomputed"], (redone, changes)
    assert max_diff(single.params, torch.load(out_file)) < 1e-5


def test_an_oom_outside_the_guard_is_relaunched_at_half(tmp_path, reference):
    """The launcher's relaunch stays the fallback: an OOM where no guard is (here at step 2,
    after backward) kills the worker; the launcher reads the `micro_batch_size=512` it printed
    and restarts both ranks with OOMGUARD_MICRO_BATCH_SIZE=256, where the guard starts."""
    binary = launcher()
    if binary is None:
        pytest.skip("no oomguard binary (OOMGUARD_BIN, or target/release/oomguard: `cargo build --release`)")
    from conftest import LOOP, env

    out_file = tmp_path / "relaunched.pt"
    p = subprocess.run(
        [
            str(binary),
            "launch",
            "--nproc-per-node",
            "2",
            "--standalone",
            "--max-restarts",
            "1",
            str(LOOP),
            "--guard",
            "--oom-outside-at",
            "2",
            "--out",
            str(out_file),
        ],
        env=env({"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout
    assert "relaunching with OOMGUARD_MICRO_BATCH_SIZE=256" in p.stdout, p.stdout
    # Each rank: steps 0-1 at 512 in the first attempt, then the whole run again at 256.
    for rank in (0, 1):
        mine = [l.split(":", 1)[1] for l in p.stdout.splitlines() if l.startswith(f"[default{rank}]:")]
        assert micro_batches("\n".join(mine)) == [512, 512] + [256] * STEPS, p.stdout
    assert max_diff(reference.params, torch.load(out_file)) < 1e-5


# --- what DDP does inside an attempt, and errors that are not OOMs -------------------------------


def test_ddp_broadcasting_batchnorm_buffers_recovers_and_restores_them(tmp_path):
    # DDP's default broadcast_buffers=True broadcasts rank 0's BatchNorm statistics at every
    # forward: a collective inside the attempt, agreed on first. Rank 1 runs out in micro-batch
    # 1's forward at step 0, after micro-batch 0's forward updated (and broadcast) statistics.
    args = ("--guard", "--batchnorm", "--micro-batch", "256")
    r = run_ranks(tmp_path, "bn", *args, extra_env={"OOMGUARD_TEST_OOM_AT": "1:0:forward:2"})
    assert r.code == 0, r.out
    assert micro_batches(r.out) == [128] * STEPS * 2, r.out
    clean = run_ranks(tmp_path, "bn-clean", "--guard", "--batchnorm", "--micro-batch", "128")
    assert clean.code == 0, clean.out
    # Parameters, running statistics and num_batches_tracked all equal the clean run at 128.
    assert max_diff(clean.params, r.params) < 1e-12


def test_an_error_on_one_rank_stops_every_rank_without_a_hang(tmp_path):
    t0 = time.perf_counter()
    r = run_ranks(tmp_path, "error", "--guard", "--micro-batch", "256", extra_env={}, timeout=60, *["--error-at", "1:1"])
    assert time.perf_counter() - t0 < 40
    rank0, rank1 = r.out.split("--- rank 1")
    assert "(exit 1)" in rank0 and "exit 1" in rank1.splitlines()[0], r.out
    assert "ValueError: a bug in rank 1's loss_fn at step 1" in rank1
    assert "rank 1 stopped with an error that is not an OOM (see its output); this rank stops with it" in rank0


def test_what_the_guard_cannot_make_safe_is_refused_by_name(tmp_path):
    from conftest import env, free_port

    p = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("refusals.py"))],
        env=env({"MASTER_PORT": str(free_port())}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout
    got = {r["case"]: r for r in map(json.loads, (l for l in p.stdout.splitlines() if l.startswith("{")))}
    # At construction: a model whose collectives the guard cannot put a checkpoint before.
    assert got["tensor parallel"]["error"] == "TypeError" and "tensor parallelism" in got["tensor parallel"]["message"]
    assert got["fsdp1"]["error"] == "TypeError" and "fully_shard (FSDP2)" in got["fsdp1"]["message"]
    assert got["hsdp"]["error"] == "TypeError" and "1-D mesh" in got["hsdp"]["message"]
    # In the step: a point-to-point message is refused (.grad untouched), a collective every
    # rank makes is agreed on and runs.
    assert got["send in loss_fn"]["error"] == "Unsupported" and "torch.distributed.send" in got["send in loss_fn"]["message"]
    assert got["all_reduce in loss_fn"]["error"] is None


def launched(script: str, nproc: int, restarts: int) -> subprocess.CompletedProcess:
    """tests/python/SCRIPT under `oomguard launch --standalone` (skipped without the binary)."""
    binary = launcher()
    if binary is None:
        pytest.skip("no oomguard binary (OOMGUARD_BIN, or target/release/oomguard: `cargo build --release`)")
    from conftest import env

    return subprocess.run(
        [str(binary), "launch", "--nproc-per-node", str(nproc), "--standalone", "--max-restarts", str(restarts),
         str(Path(__file__).with_name(script))],
        env=env({"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180,
    )


def test_an_oom_in_the_users_own_optimizer_step_is_not_relaunched(tmp_path):
    """tests/python/optim_oom.py: AdamW's first step runs out of memory in the user's own
    `opt.step()`. A relaunch at half the micro-batch cannot help there: the guard's line
    tells the launcher so, and it exits 3 at once, with restarts left."""
    p = launched("optim_oom.py", nproc=1, restarts=3)
    assert p.returncode == 3, p.stdout
    assert "oomguard.Infeasible: out of memory in the optimizer's step (optim/adam" in p.stdout, p.stdout
    assert "relaunching" not in p.stdout and p.stdout.count("micro_batch_size=4") == 2, p.stdout


def test_a_ddp_rank_where_nothing_fits_ends_the_launch_infeasible(tmp_path):
    """tests/python/infeasible_ddp.py: rank 1 cannot fit micro-batch 1. Its traceback comes
    behind torch's `[rank1]: ` (a process group exists), and the launcher still reads
    oomguard.Infeasible in it: exit 3 and no relaunch, with restarts left (it was exit 1
    after spending every restart)."""
    p = launched("infeasible_ddp.py", nproc=2, restarts=2)
    assert p.returncode == 3, p.stdout
    assert "[rank1]: oomguard.Infeasible" in p.stdout, p.stdout
    assert "no restart can help" in p.stdout and "relaunching" not in p.stdout, p.stdout

