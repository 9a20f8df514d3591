"""A loop written the way nanoGPT's train.py is (tests/python/nanogpt/train.py: DDP with
require_backward_grad_sync, autocast and GradScaler, clipping, torch.compile), and the same
file with oomguard put in (train_guarded.py): a handful of changed lines, two Gloo ranks, one
of them under a real memory cap, the result equal to the plain loop's."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from conftest import max_diff, run_ranks

HERE = Path(__file__).with_name("nanogpt")


def nanogpt(tmp: Path, name: str, script: str, *args: str, env=None):
    # The script reads --key=value (nanoGPT's configurator); --out is given as --out=PATH.
    out = tmp / f"{name}.pt"
    r = run_ranks(
        tmp, name, *args, f"--out={out}", script=HERE / script, timeout=600, out_flag=False,
        extra_env={"TORCHINDUCTOR_COMPILE_THREADS": "1", **(env or {})},
    )
    assert r.code == 0, r.out
    return r


def test_the_guard_goes_in_with_at_most_six_changed_lines():
    plain = (HERE / "train.py").read_text().splitlines()
    guarded = (HERE / "train_guarded.py").read_text().splitlines()
    added = [l for l in difflib.ndiff(plain, guarded) if l.startswith("+ ")]
    code = [l for l in added if not l[2:].startswith(('"""', "(tests/python"))]
    assert 0 < len(code) <= 6, "\n".join(code)
    assert all(l.endswith("# oomguard") for l in code), "\n".join(code)


def test_a_nanogpt_loop_capped_on_one_rank_equals_the_plain_loop(tmp_path):
    # float32: fp16 autocast on the CPU runs through oneDNN, whose kernels for each new shape
    # need fresh address space that an RLIMIT_AS cap this tight cannot give (measured: "could
    # not create a primitive" at every size); the fp16 path is the next test's.
    # The heap's threshold fixed from the start: otherwise glibc's adaptive threshold keeps
    # iteration 0's freed 4 MiB logits in its arenas, whose address space iteration 1 reused
    # under a 1 MiB cap without failing (stop 58's CI). Fixed, it is deterministic (measured:
    # 2 MiB fits no size, 4 settles at 2 rows, 8 at 4, 16 at 16).
    plain = nanogpt(tmp_path, "plain", "train.py", "--dtype=float32")
    fixed = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    r = nanogpt(tmp_path, "guarded", "train_guarded.py", "--dtype=float32", "--cap_mb=8", env=fixed)
    assert "can't allocate memory" in r.out and "OOM at step 1" in r.out, r.out
    assert re.findall(r"micro_batch_size=(\d+)", r.out)[-1] != "32", r.out
    assert max_diff(plain.params, r.params) < 1e-5


def test_a_nanogpt_loop_in_float16_with_gradscaler_after_an_oom(tmp_path):
    # An OOM on rank 1 at iteration 0 (the hook): the run settles at 16 rows a micro-batch, as
    # the plain loop configured with --batch_size=16 runs; compiled off to keep it short.
    args = ("--dtype=float16", "--compile=False")
    plain = nanogpt(tmp_path, "plain16", "train.py", *args, "--batch_size=16", "--gradient_accumulation_steps=8")
    r = nanogpt(tmp_path, "guarded16", "train_guarded.py", *args, env={"OOMGUARD_TEST_OOM_AT": "1:0:backward"})
    assert "micro-batch 32 -> 16" in r.out
    assert max_diff(plain.params, r.params) < 1e-6
