"""`oomguard.hf.Trainer`, the Hugging Face Trainer with its steps under the guard, in a user's
script (tests/python/hf_train.py: GPT-2 or Llama from tiny configs, float64): an OOM on one
rank of two (the test hook, and a real RLIMIT_AS cap) recovered in-process; the parameters and
the Trainer's log_history equal the plain `transformers.Trainer` at the size the guarded run
settled at; its checkpoints carry the guard's state, and a resumed run ends where one run does."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import transformers
import torch

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


# --- in this process: losses the Trainer weighs its own way ------------------------------------

VOCAB, SEQ = 64, 12


class Rows64(torch.utils.data.Dataset):
    """64 rows of token ids, with a causal LM's labels or a sequence classifier's."""

    def __init__(self, kind: str):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, VOCAB, (64, SEQ), generator=g)
        self.y = {"lm": self.ids.clone(), "regression": torch.randn(64, generator=g, dtype=torch.float64)}[kind]

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.y[i]}


def tiny(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2, pad_token_id=0,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
    if kind == "lm":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**common)).double()
    cfg = transformers.GPT2Config(num_labels=1, problem_type="regression", **common)
    return transformers.GPT2ForSequenceClassification(cfg).double()


def in_process(monkeypatch, tmp_path, trainer_cls, kind: str, oom=None, model_init=False, trains=1, **trainer_kw):
    import oomguard.hf

    guarded = issubclass(trainer_cls, oomguard.hf.Trainer)
    if oom:
        monkeypatch.setenv("OOMGUARD_TEST_OOM_AT", oom)
    else:
        monkeypatch.delenv("OOMGUARD_TEST_OOM_AT", raising=False)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"{trainer_cls.__name__}-{oom}"), per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_steps=4, learning_rate=0.1, optim="sgd", max_grad_norm=0.0,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
    )
    model = dict(model_init=lambda: tiny(kind)) if model_init else dict(model=tiny(kind))
    extra = {"oomguard": {"verbose": False, "cache": False}} if guarded else {}
    t = trainer_cls(args=args, train_dataset=Rows64(kind), **model, **extra, **trainer_kw)
    for _ in range(trains):
        t.train()
    return t, [p.detach().clone() for p in t.model.parameters()], losses(t.state.log_history)


def test_a_stock_classifiers_own_mean_is_weighed_as_the_plain_trainer_weighs_it(monkeypatch, tmp_path):
    # GPT2ForSequenceClassification's regression loss is its own mean, though the Trainer
    # passes num_items_in_batch: the plain Trainer adds its 2 batches' means. After the OOM
    # (micro-batch 4 -> 2) the guard's 4 micro-batches must still add up to that.
    import oomguard.hf

    _, want, want_losses = in_process(monkeypatch, tmp_path, transformers.Trainer, "regression")
    t, got, got_losses = in_process(monkeypatch, tmp_path, oomguard.hf.Trainer, "regression", oom="0:1:forward")
    assert t.guard.micro_batch_size == 2 and t.guard.oom_count == 1
    assert max_diff(got, want) < 1e-12
    assert max(abs(a - b) for a, b in zip(got_losses, want_losses)) < 1e-5, (got_losses, want_losses)


def test_a_compute_loss_declared_unscaled_is_divided_as_the_plain_trainer_divides_it(monkeypatch, tmp_path):
    import torch.nn.functional as F

    import oomguard.hf

    class MeanLoss:
        loss_is_scaled_for_ga = False  # transformers' flag: a mean the Trainer divides by accumulation

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(input_ids=inputs["input_ids"])
            logits = out.logits[:, :-1].reshape(-1, VOCAB)
            loss = F.cross_entropy(logits, inputs["labels"][:, 1:].reshape(-1))
            return (loss, out) if return_outputs else loss

    class Plain(MeanLoss, transformers.Trainer):
        pass

    class Guarded(MeanLoss, oomguard.hf.Trainer):
        pass

    _, want, want_losses = in_process(monkeypatch, tmp_path, Plain, "lm")
    t, got, got_losses = in_process(monkeypatch, tmp_path, Guarded, "lm", oom="0:1:forward")
    assert t.guard.oom_count == 1
    assert max_diff(got, want) < 1e-12
    assert max(abs(a - b) for a, b in zip(got_losses, want_losses)) < 1e-5, (got_losses, want_losses)


def test_a_compute_loss_func_that_ignores_the_count_is_weighed_as_the_plain_trainer_weighs_it(monkeypatch, tmp_path):
    # Trainer(compute_loss_func=...) pops `labels` from the batch it is given: the guard's
    # probe of the loss's normalisation must give each call its own row, or the second sees
    # no labels, fails, and a per-batch mean is taken for a sum (gradients x2 after the OOM).
    import torch.nn.functional as F

    import oomguard.hf

    def mean_of_the_batch(out, labels, num_items_in_batch=None):
        return F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))

    # ... and a sum over the step's count with a term of its own on top (a router's loss),
    # 6% of the probe's loss: still a sum, not a mean (a loss at twice the count is not half).
    def summed_with_a_term(out, labels, num_items_in_batch=None):
        logits, targets = out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)
        ce = F.cross_entropy(logits, targets, reduction="sum")
        # The step's count is 8 rows x 11 targets: the term is 0.064 of a row's sum over it.
        return ce / num_items_in_batch + (0.064 * 11 / 88) * F.cross_entropy(logits, targets)

    for fn, normalised in ((mean_of_the_batch, False), (summed_with_a_term, True)):
        _, want, want_losses = in_process(monkeypatch, tmp_path, transformers.Trainer, "lm", compute_loss_func=fn)
        t, got, got_losses = in_process(
            monkeypatch, tmp_path, oomguard.hf.Trainer, "lm", oom="0:1:forward", compute_loss_func=fn
        )
        assert t.guard.oom_count == 1 and t._oomguard_honours is normalised, fn.__name__
        if not normalised:
            assert max_diff(got, want) < 1e-12
            assert max(abs(a - b) for a, b in zip(got_losses, want_losses)) < 1e-5, (got_losses, want_losses)


def test_each_train_call_guards_the_model_it_trains(monkeypatch, tmp_path):
    # model_init makes a new model at each train() (hyperparameter_search's trials): the guard
    # must follow it, or an OOM part-way through a backward keeps the old model's gradients.
    import oomguard.hf

    _, want, _ = in_process(monkeypatch, tmp_path, transformers.Trainer, "lm", model_init=True, trains=2)
    t, got, _ = in_process(monkeypatch, tmp_path, oomguard.hf.Trainer, "lm", oom="0:1:backward", model_init=True, trains=2)
    params = {id(p) for p in t.model.parameters()}
    assert {id(p) for p in t.guard._params} == params
    assert t.guard.step == t.state.global_step == 4
    assert max_diff(got, want) < 1e-12


def test_a_hyperparameter_trial_over_the_batch_size_trains_as_the_plain_trainers(monkeypatch, tmp_path):
    # hyperparameter_search sets a trial's values on the Trainer's args in train(): a device's
    # batch and the accumulation as the user means them, which the guard folds into a step's
    # rows again (a larger batch than the constructor's raised before).
    from transformers.trainer_utils import HPSearchBackend

    import oomguard.hf

    def trial_run(cls, oom=None):
        if oom:
            monkeypatch.setenv("OOMGUARD_TEST_OOM_AT", oom)
        else:
            monkeypatch.delenv("OOMGUARD_TEST_OOM_AT", raising=False)
        out = str(tmp_path / f"{cls.__module__}-trial")
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
            learning_rate=0.1, optim="sgd", max_grad_norm=0.0, save_strategy="no", report_to=[], seed=0,
            use_cpu=True, disable_tqdm=True,
        )
        extra = {"oomguard": {"verbose": False, "cache": False}} if cls is oomguard.hf.Trainer else {}
        t = cls(args=args, train_dataset=Rows64("lm"), model_init=lambda trial=None: tiny("lm"), **extra)
        t.hp_search_backend = HPSearchBackend.WANDB
        t._report_to_hp_search = lambda *a, **k: None  # W&B's sweep, without a W&B run
        t._get_output_dir = lambda trial=None: out
        t.train(trial={"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2})
        return t, [p.detach().clone() for p in t.model.parameters()]

    _, want = trial_run(transformers.Trainer)
    t, got = trial_run(oomguard.hf.Trainer, oom="0:1:forward")
    assert t.oomguard_rows == 16 and t.guard.oom_count == 1 and t.guard.micro_batch_size == 4
    assert max_diff(got, want) < 1e-12


# --- a sweep whose trials are Trainer scripts ---------------------------------------------------

TRIAL = '''
import argparse, os, torch, transformers
import oomguard.hf

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float)
args = p.parse_args()
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))

class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.x = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}

targs = transformers.TrainingArguments(
    output_dir=os.path.join(os.environ["OOMGUARD_RUN_DIR"], "hf"), per_device_train_batch_size=8, max_steps=4,
    learning_rate=args.lr, eval_strategy="steps", eval_steps=2, save_strategy="no", report_to=[], use_cpu=True,
    disable_tqdm=True, seed=0)
oomguard.hf.Trainer(model=model, args=targs, train_dataset=Tokens(64, 1), eval_dataset=Tokens(16, 2)).train()
'''


def test_a_sweep_of_trainer_scripts_ranks_them_by_their_evaluations(tmp_path):
    """`oomguard sweep` over a user's Trainer script (under `oomguard launch`) with W&B's
    `val_loss` metric: each trial's evaluations reach its metrics.jsonl (an OOM in each
    recovered), the sweep ranks the trials by them, and the report names the same best."""
    import subprocess
    import sys

    from conftest import launcher

    (tmp_path / "train.py").write_text(TRIAL)
    (tmp_path / "sweep.yaml").write_text(
        "program: train.py\n"
        "command: ['${env}', '${interpreter}', oomguard, launch, --nproc-per-node, 1, '${program}', '${args}']\n"
        "method: grid\nmetric: {name: val_loss, goal: minimize}\nparameters:\n  lr: {values: [1.0e-4, 3.0e-2]}\n"
    )
    child = env({"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OOMGUARD_TEST_OOM_AT": "0:1:backward"})
    run = lambda *a: subprocess.run([str(launcher()), *a], cwd=tmp_path, env=child, capture_output=True, text=True, timeout=600)  # noqa: E731
    p = run("sweep", "sweep.yaml", "--out", "sw")
    assert p.returncode == 0, p.stdout + p.stderr
    results = [json.loads(l) for l in (tmp_path / "sw" / "results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in results] == ["ok", "ok"] and {r["metric"] for r in results} == {"final_eval_loss"}
    for r in results:
        written = records(tmp_path / "sw" / r["run_dir"])
        evals = [x for x in written if x["event"] == "eval"]
        assert [e["step"] for e in evals] == [1, 3] and r["final_eval_loss"] == evals[-1]["val_loss"], written
        assert r["ooms"] == 1, written
    best = min(results, key=lambda r: r["final_eval_loss"])
    assert f"best by final_eval_loss: {best['trial']}" in p.stdout, p.stdout
    report = run("report", "sw")
    assert report.returncode == 0 and re.search(rf"^best\s+{best['trial']}", report.stdout, re.M), report.stdout
