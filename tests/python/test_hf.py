"""`oomguard.hf.Trainer`, the Hugging Face Trainer with its steps under the guard, in a user's
script (tests/python/hf_train.py: GPT-2 or Llama from tiny configs, float64): an OOM on one
rank of two (the test hook, and a real RLIMIT_AS cap) recovered in-process; the parameters and
the Trainer's log_history equal the plain `transformers.Trainer` at the size the guarded run
settled at; its checkpoints carry the guard's state, and a resumed run ends where one run does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from conftest import env, max_diff, records, run_ranks

HF = Path(__file__).with_name("hf_train.py")
EXACT = 1e-10  # float64: the same sums in another order


def hf(tmp: Path, name: str, *args: str, world: int = 2, extra=None):
    out = tmp / name
    r = run_ranks(
        tmp, name, "--output-dir", str(out), "--history", str(tmp / f"{name}.json"), *args,
        extra_env=extra, world=world, script=HF,
    )
    assert r.code == 0, r.out
    r.history = json.loads((tmp / f"{name}.json").read_text())
    r.run_dir = out
    return r


def losses(history: list) -> list:
    return [h["loss"] for h in history if "loss" in h]


def assert_same_training(a, b):
    assert max_diff(a.params, b.params) < EXACT
    la, lb = losses(a.history), losses(b.history)
    # The Trainer logs its float32 running loss: equal to its precision.
    assert len(la) == len(lb) == 4 and max(abs(x - y) for x, y in zip(la, lb)) < 1e-5, (la, lb)
    assert [h["step"] for h in a.history] == [h["step"] for h in b.history]


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_an_oom_on_one_rank_is_recovered_and_equals_the_plain_trainer_at_the_settled_size(model, tmp_path):
    # 8 x 2 rows a step per rank; rank 1 runs out in step 1's forward: both ranks go to 4.
    r = hf(tmp_path, "guarded", "--guard", "--model", model, extra={"OOMGUARD_TEST_OOM_AT": "1:1:forward"})
    steps = [x for x in records(r.run_dir) if x["event"] == "step"]
    assert [s["micro_batch_size"] for s in steps] == [8, 4, 4, 4], r.out
    assert {s["num_samples"] for s in steps} == {32}, "the global batch: 16 rows on each of 2 ranks"
    ooms = [x for x in records(r.run_dir) if x["event"] == "oom"]
    assert [(o["step"], o["rank"], o["new_micro_batch_size"]) for o in ooms] == [(1, 1, 4)]
    # The Trainer's own logs (what report_to sends to W&B or MLflow) carry the guard's state.
    logged = [h for h in r.history if "loss" in h]
    assert [h["micro_batch_size"] for h in logged] == [8, 4, 4, 4] and logged[-1]["oom_count"] == 1, logged
    # The plain Trainer at the settled size: 4 rows x 4 accumulation steps, the same 16 rows.
    ref = hf(tmp_path, "plain", "--model", model, "--per-device", "4", "--accumulation", "4")
    assert_same_training(r, ref)


def test_a_real_cap_on_one_rank(tmp_path):
    # Rank 1 gets 64 MiB of address space above what it holds when training begins: 64 rows
    # of 128 tokens x 2048 logits (float64: 128 MiB) do not fit; the run settles where they do.
    args = ("--per-device", "64", "--accumulation", "1", "--seq", "128", "--vocab", "2048")
    r = hf(tmp_path, "capped", "--guard", "--cap-mb", "64", "--cap-rank", "1", *args)
    # No test hook: only rank 1's real allocation failures (under its cap) shrink the run.
    ooms = [x for x in records(r.run_dir) if x["event"] == "oom"]
    assert ooms and {o["rank"] for o in ooms} == {1}, r.out
    sizes = [s["micro_batch_size"] for s in records(r.run_dir) if s["event"] == "step"]
    settled = sizes[-1]
    assert settled < 64 and sizes[1:] == [settled] * 3, sizes
    ref = hf(tmp_path, "uncapped", "--per-device", str(settled), "--accumulation", str(64 // settled),
             *args[4:])
    assert_same_training(r, ref)


def test_checkpoints_carry_the_guards_state_and_resume_exactly(tmp_path):
    one = hf(tmp_path, "whole", "--guard", world=1)
    part = tmp_path / "part"
    first = hf(tmp_path, "part", "--guard", "--save-steps", "2", world=1, extra={"OOMGUARD_TEST_OOM_AT": "0:1:backward"})
    state = json.loads((part / "checkpoint-2" / "oomguard.json").read_text())
    assert state["step"] == 2 and '"current":4' in state["policy"].replace(" ", ""), state
    # Killed after step 2 (its checkpoint-4 removed): resumed, it starts at the saved size.
    import shutil

    shutil.rmtree(part / "checkpoint-4")
    again = hf(tmp_path, "part", "--guard", "--save-steps", "2", "--resume", world=1)
    assert "restored at step 2; micro_batch_size=4" in again.out, again.out
    assert max_diff(one.params, again.params) < EXACT
    assert losses(again.history)[-2:] == pytest.approx(losses(one.history)[-2:], abs=1e-5)
    assert first.code == 0


def test_misuse_is_refused_at_construction(tmp_path):
    import oomguard.hf

    def refused(ours=None, **kw):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=1))
        with pytest.raises(ValueError) as e:
            oomguard.hf.Trainer(model=model, args=args, **(ours or {}))
        return str(e.value)

    assert refused(auto_find_batch_size=True).startswith(
        "oomguard.hf.Trainer: auto_find_batch_size=True re-runs training at 0.9x the batch"
    )
    both = refused({"micro_batch_size": 2}, gradient_accumulation_steps=4)
    assert "gradient accumulation set on both sides: gradient_accumulation_steps=4 and micro_batch_size=2" in both
    assert "micro_batch_size=16 must be in [1, 8]" in refused({"micro_batch_size": 16})
