"""`import oomguard` in a user's FSDP2 loop (tests/python/fsdp_loop.py: `fully_shard` on each
block and the root, its own AdamW): real Gloo ranks, an OOM on some ranks at every place in
the step (the test hook, and a real RLIMIT_AS cap), no hang, and the parameters of a clean
FSDP2 run at the size the guarded run settled at."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import max_diff, records, run_ranks

FSDP = Path(__file__).with_name("fsdp_loop.py")
EXACT = 1e-12  # float64 parameters: the same sums in another order


def sizes(out: str) -> list:
    """Every rank's micro-batch per step, rank after rank."""
    return [int(m) for m in re.findall(r"^step \d+ loss \S+ micro_batch (\d+)$", out, re.M)]


def last_sizes(out: str) -> list:
    """Each rank's micro-batch at its last step."""
    return [sizes(part)[-1] for part in out.split("--- rank ")[1:]]


def fsdp(tmp: Path, name: str, *args: str, world: int = 2, env=None, timeout: float = 240):
    r = run_ranks(tmp, name, *args, extra_env=env, world=world, script=FSDP, timeout=timeout)
    assert r.code == 0, r.out
    return r


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Plain FSDP2 loops (no guard): 2 ranks at micro-batch 32 and 64, 3 ranks at 32."""
    tmp = tmp_path_factory.mktemp("fsdp-clean")
    return {
        (2, 32): fsdp(tmp, "c2-32", "--micro-batch", "32"),
        (2, 64): fsdp(tmp, "c2-64", "--micro-batch", "64"),
        (3, 32): fsdp(tmp, "c3-32", "--micro-batch", "32", "--global-batch", "384", world=3),
    }


# rank:step:site[:k] of the guard's hook: every place an FSDP2 step can run out, on one rank or
# two at once. `gather` and `reduce` raise just before FSDP2's k-th all-gather or reduce-scatter
# of the attempt (as when their buffer's allocation fails): 4 sharded modules, 2 micro-batches
# of 64 rows, so gathers 1-4 are the first forward, 5-8 its backward, reduce-scatters 1-4 the
# first backward and 5-8 the second. `backward:2` runs out after the last backward finished,
# while the other rank, done too, waits in the attempt's last vote.
CASES = {
    "forward": "1:1:forward",
    "gather-in-forward": "1:1:gather:3",
    "gather-in-backward": "1:1:gather:6",
    "backward": "1:1:backward",
    "reduce-scatter-first": "1:1:reduce:1",
    "reduce-scatter-last": "0:1:reduce:8",
    "after-the-last-backward": "1:1:backward:2",
    "two-ranks-at-once": "0:1:gather:2,1:1:gather:2",
    "two-ranks-two-places": "0:1:forward,1:1:reduce:3",
}


@pytest.mark.parametrize("case", CASES)
def test_an_oom_anywhere_in_an_fsdp2_step_is_recovered_exactly(case, tmp_path, clean):
    run_dir = tmp_path / "run"
    r = fsdp(
        tmp_path,
        case,
        "--guard",
        "--micro-batch",
        "64",
        "--run-dir",
        str(run_dir),
        env={"OOMGUARD_TEST_OOM_AT": CASES[case]},
    )
    # Both ranks went to 32 at step 1 and stayed there (the policy's cooldown).
    assert r.out.count("step 1 loss") == 2 and sizes(r.out) == [64, 32, 32, 32] * 2, r.out
    assert max_diff(clean[(2, 32)].params, r.params) < EXACT
    # No hang, nothing lost waiting: within the clean run's time and a few seconds.
    assert r.train_s() < clean[(2, 64)].train_s() + 5, r.out
    ooms = [x for x in records(run_dir) if x["event"] == "oom"]
    assert [(o["step"], o["old_micro_batch_size"], o["new_micro_batch_size"]) for o in ooms] == [(1, 64, 32)]
    assert ooms[0]["rank"] == int(CASES[case].split(":")[0])


@pytest.mark.parametrize("spec", ["2:1:gather:4", "1:1:backward:2", "0:2:reduce:2,2:2:forward"])
def test_three_ranks(spec, tmp_path, clean):
    r = fsdp(
        tmp_path, "three", "--guard", "--micro-batch", "64", "--global-batch", "384", world=3,
        env={"OOMGUARD_TEST_OOM_AT": spec},
    )
    assert last_sizes(r.out) == [32] * 3, r.out
    assert max_diff(clean[(3, 32)].params, r.params) < EXACT


@pytest.mark.parametrize("spec", ["1:3:backward", "0:3:gather:2", "1:2:forward"])
def test_accumulation_across_calls_with_the_sync_off(spec, tmp_path, clean):
    """The user's own accumulation: two `guard.backward` calls a step, FSDP2's gradient sync
    off for the first. Its gradients wait unsharded, outside `.grad`; an OOM in the second
    call (calls 1 and 3) keeps them, as one in the first (call 2) keeps nothing."""
    r = fsdp(
        tmp_path, "calls", "--guard", "--micro-batch", "32", "--calls", "2",
        env={"OOMGUARD_TEST_OOM_AT": spec},
    )
    assert "out of memory" in r.out.lower(), r.out
    assert max_diff(clean[(2, 32)].params, r.params) < EXACT


@pytest.mark.parametrize("spec", ["1:1:reduce:3", "0:1:optimizer"])
def test_a_grad_scaler_under_fsdp2_recovers_exactly(spec, tmp_path):
    """A user's GradScaler scales every micro-batch's loss and steps the sharded optimizer
    (its found-inf check reduced over the ranks through DTensor): an OOM on one rank in a
    reduce-scatter, or in the optimizer's step, is recovered on both, with the parameters of
    a clean scaled FSDP2 run (the scale a power of two: exact in float64)."""
    plain = fsdp(tmp_path, "plain", "--micro-batch", "32", "--scaler")
    r = fsdp(tmp_path, "scaled", "--guard", "--guard-step", "--micro-batch", "64", "--scaler", env={"OOMGUARD_TEST_OOM_AT": spec})
    assert "out of memory" in r.out.lower() or "OOM in the optimizer's step" in r.out, r.out
    assert max_diff(plain.params, r.params) < EXACT, r.out


def test_an_oom_in_the_optimizers_sharded_step_is_retried(tmp_path, clean):
    # AdamW's state exists from step 0; the hook raises before step 1's update changed
    # anything: guard.optimizer_step hands the memory back and retries, on every rank together.
    r = fsdp(
        tmp_path, "optim", "--guard", "--guard-step", "--micro-batch", "32",
        env={"OOMGUARD_TEST_OOM_AT": "1:1:optimizer"},
    )
    assert "OOM in the optimizer's step (rank 1)" in r.out and "retrying once" in r.out
    assert sizes(r.out) == [32] * 8
    assert max_diff(clean[(2, 32)].params, r.params) < EXACT


def test_a_real_oom_under_a_cap_on_one_rank(tmp_path):
    # Rank 1 gets 16 MiB of address space above what it holds after step 0 (its threads and
    # AdamW's state exist): the 128-row micro-batch's activations (4096 doubles a row in
    # each of 3 blocks) do not fit; the run settles where they do.
    args = ("--hidden", "4096")
    r = fsdp(tmp_path, "capped", "--guard", "--cap-mb", "16", "--cap-rank", "1", *args)
    assert "can't allocate memory" in r.out
    settled = sizes(r.out)[-1]
    assert settled < 128 and sizes(r.out)[3] == sizes(r.out)[7] == settled, r.out
    ref = fsdp(tmp_path, "uncapped", "--micro-batch", str(settled), *args)
    assert max_diff(ref.params, r.params) < EXACT


@pytest.mark.parametrize("reshard,spec", [("1", "1:1:gather:2"), ("0", "0:1:reduce:2")])
def test_a_transformers_gpt2_sharded_with_fsdp2(reshard, spec, tmp_path):
    args = ("--model", "gpt2", "--blocks", "2", "--global-batch", "32", "--reshard-after-forward", reshard)
    ref = fsdp(tmp_path, "gpt2-clean", *args, "--micro-batch", "8")
    r = fsdp(tmp_path, "gpt2", *args, "--guard", "--micro-batch", "16", env={"OOMGUARD_TEST_OOM_AT": spec})
    assert sizes(r.out) == [16, 8, 8, 8] * 2, r.out
    assert max_diff(ref.params, r.params) < 1e-10


def test_compiled_blocks_under_fsdp2(tmp_path):
    # Each block compiled with inductor, then sharded (torchtitan's order); an OOM on rank 1
    # in the second all-gather of step 1: recovered, and the compiled blocks equal the clean
    # compiled run at the settled size.
    args = ("--compile", "--blocks", "2", "--hidden", "64", "--global-batch", "64")
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    ref = fsdp(tmp_path, "compiled-clean", *args, "--micro-batch", "8", env=env, timeout=600)
    r = fsdp(tmp_path, "compiled", *args, "--guard", "--micro-batch", "16", env={**env, "OOMGUARD_TEST_OOM_AT": "1:1:gather:2"}, timeout=600)
    assert sizes(r.out) == [16, 8, 8, 8] * 2, r.out
    assert max_diff(ref.params, r.params) < 1e-10
