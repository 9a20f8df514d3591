"""`oomguard.lightning.GuardedModule` in a user's Lightning script (tests/python/lightning_loop.py):
`lightning.Trainer` with DDP over Gloo on 2 ranks, an OOM on one rank recovered inside
`training_step`, the result equal to Lightning's own `accumulate_grad_batches` at the size the
guarded run settled at; metrics.jsonl in the Trainer's log_dir, and the guard's state in its
checkpoints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import max_diff, records, run_ranks

LOOP = Path(__file__).with_name("lightning_loop.py")


def sizes(out: str) -> list:
    return [int(m) for m in re.findall(r"^step \d+ loss \S+ micro_batch (\d+)$", out, re.M)]


def test_an_oom_in_training_step_on_one_rank_equals_lightnings_accumulation(tmp_path):
    root = tmp_path / "guarded"
    r = run_ranks(tmp_path, "guarded", "--root", str(root), script=LOOP, extra_env={"OOMGUARD_TEST_OOM_AT": "1:1:forward"})
    assert r.code == 0, r.out
    assert sizes(r.out) == [16, 8, 8, 8], r.out
    log_dir = root / "lightning_logs" / "version_0"
    ooms = [x for x in records(log_dir) if x["event"] == "oom"]
    assert [(o["step"], o["rank"], o["new_micro_batch_size"]) for o in ooms] == [(1, 1, 8)]
    # The Trainer's logger (here its CSVLogger) gets the guard's state at each step.
    import csv

    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    logged = [(float(x["oomguard/micro_batch_size"]), float(x["oomguard/oom_count"])) for x in rows
              if x.get("oomguard/micro_batch_size")]
    assert logged == [(16, 0), (8, 1), (8, 1), (8, 1)], rows
    ref = run_ranks(tmp_path, "plain", "--plain", "--micro-batch", "8", "--root", str(tmp_path / "plain"), script=LOOP)
    assert ref.code == 0, ref.out
    assert max_diff(ref.params, r.params) < 1e-12
    # Lightning's checkpoint carries the guard's state; resumed from it, the size is restored.
    ckpt = next((log_dir / "checkpoints").glob("*.ckpt"))
    state = torch.load(ckpt, weights_only=False)["oomguard"]
    assert state["step"] == 4, state
    again = run_ranks(
        tmp_path, "again", "--root", str(tmp_path / "again"), "--steps", "6", "--resume", str(ckpt), script=LOOP
    )
    assert again.code == 0, again.out
    assert "restored at step 4; micro_batch_size=8" in again.out and sizes(again.out) == [8, 8], again.out


def test_one_process_hooks_after_backward_and_a_module_fit_again_from_a_checkpoint(tmp_path, monkeypatch):
    """`on_after_backward` runs once a step, as under `manual_backward`; a module fit a second
    time from a checkpoint starts at the micro-batch the checkpoint saved, as a fresh one does."""
    import lightning as L
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import ModelCheckpoint

    from oomguard.lightning import GuardedModule

    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 16, generator=g, dtype=torch.float64)
    data = torch.utils.data.TensorDataset(x, x[:, :1].sin())

    class Guarded(GuardedModule):
        oomguard_options = {"verbose": False, "cache": False}

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()
            self.after_backward = 0

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def training_step(self, b, i):
            opt = self.optimizers()
            self.guarded_backward(b, lambda mb: F.mse_loss(self.net(mb[0]), mb[1]))
            opt.step()
            opt.zero_grad()

        def on_after_backward(self):
            assert all(p.grad is not None for p in self.parameters())
            self.after_backward += 1

    def fit(module, steps, ckpt=None, **kw):
        kw = {"logger": False, "enable_checkpointing": False, **kw}
        L.Trainer(accelerator="cpu", devices=1, max_steps=steps, default_root_dir=str(tmp_path),
                  enable_progress_bar=False, enable_model_summary=False, **kw).fit(
            module, torch.utils.data.DataLoader(data, batch_size=32), ckpt_path=ckpt)

    monkeypatch.setenv("OOMGUARD_TEST_OOM_AT", "0:0:forward")
    a = Guarded()
    fit(a, 2, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=str(tmp_path), filename="last")])
    monkeypatch.delenv("OOMGUARD_TEST_OOM_AT")
    assert a.guard.micro_batch_size == 16 and a.after_backward == 2
    again = Guarded()
    fit(again, 1)  # its guard made, at 32
    fit(again, 4, ckpt=str(tmp_path / "last.ckpt"))
    assert again.guard.micro_batch_size == 16 and again.guard.step == 4
    # A module fit once copies (StochasticWeightAveraging deepcopies it); the copy makes its
    # own guard at its first step, the original keeps its.
    import copy

    twin = copy.deepcopy(again)
    assert twin.guard is None and again.guard.step == 4
    assert max_diff(list(twin.parameters()), list(again.parameters())) == 0
    fit(twin, 1)
    assert twin.guard is not again.guard and twin.guard.step == 1


def test_batches_that_vary_in_rows_fit_under_the_loaders_or_the_declared_batch_size(tmp_path):
    """A bucketing sampler's batches grow after the first: the guard takes the declared
    `oomguard_global_batch_size`; a plain loader's `batch_size` is taken without it."""
    import lightning as L
    import torch.nn.functional as F

    from oomguard.lightning import GuardedModule

    x = torch.randn(64, 4, dtype=torch.float64)
    data = torch.utils.data.TensorDataset(x, x[:, :1].cos())

    class Guarded(GuardedModule):
        oomguard_options = {"verbose": False, "cache": False}

        def __init__(self, most=None):
            super().__init__()
            self.oomguard_global_batch_size = most
            self.net = torch.nn.Linear(4, 1).double()
            self.rows = []

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

        def training_step(self, b, i):
            self.rows.append(len(b[0]))
            self.guarded_backward(b, lambda mb: F.mse_loss(self.net(mb[0]), mb[1]))
            self.optimizers().step()
            self.optimizers().zero_grad()

    def fit(module, loader):
        L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                  default_root_dir=str(tmp_path), enable_progress_bar=False, enable_model_summary=False).fit(module, loader)

    buckets = [list(range(8)), list(range(8, 40))]  # 8 rows, then 32
    m = Guarded(most=32)
    fit(m, torch.utils.data.DataLoader(data, batch_sampler=buckets))
    assert m.rows == [8, 32] and m.guard.global_batch_size == 32
    plain = Guarded()
    fit(plain, torch.utils.data.DataLoader(data, batch_size=16))
    assert plain.guard.global_batch_size == 16


def test_each_fit_and_batch_size_trial_gets_its_guard_writing_where_the_launcher_says(tmp_path, monkeypatch):
    """The BatchSizeFinder's trials and a later fit with a larger loader each get a guard at
    their loader's batch size (a guard kept from the first refused the larger batches); under
    the launcher or a sweep (`OOMGUARD_RUN_DIR`) the metrics go to its run directory, where the
    sweep reads them, not to the Trainer's log_dir, validations' `val_loss` with them (the
    sanity check's left out)."""
    import json

    import lightning as L
    import torch.nn.functional as F
    from lightning.pytorch.tuner import Tuner

    from oomguard.lightning import GuardedModule

    x = torch.randn(256, 16, dtype=torch.float64)
    data = torch.utils.data.TensorDataset(x, x[:, :1].sin())

    class Guarded(GuardedModule):
        oomguard_options = {"verbose": False, "cache": False}

        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(16, 1).double()
            self.batch_size = 4

        def train_dataloader(self):
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

        def training_step(self, b, i):
            self.guarded_backward(b, lambda mb: F.mse_loss(self.net(mb[0]), mb[1]))
            self.optimizers().step()
            self.optimizers().zero_grad()

        def val_dataloader(self):
            return torch.utils.data.DataLoader(data, batch_size=32)

        def validation_step(self, b, i):
            self.log("val_loss", F.mse_loss(self.net(b[0]), b[1]))

    def trainer(steps, **kw):
        return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path), enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=2, **kw)

    m = Guarded()
    found = Tuner(trainer(2)).scale_batch_size(m, mode="power", steps_per_trial=1, max_trials=3)
    assert m.batch_size == found >= 8  # past the first trial's size: each trial had its guard
    launched = tmp_path / "launched"
    monkeypatch.setenv("OOMGUARD_RUN_DIR", str(launched))
    m.batch_size = 64
    fit = trainer(2, val_check_interval=1)
    fit.fit(m)
    assert m.guard.global_batch_size == 64
    written = [json.loads(l) for l in (launched / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in written if r["event"] == "step"]
    assert [s["num_samples"] for s in steps] == [64, 64], steps
    evals = [(r["step"], r["val_loss"]) for r in written if r["event"] == "eval"]
    assert [s for s, _ in evals] == [0, 1] and evals[-1][1] == pytest.approx(float(fit.callback_metrics["val_loss"])), written
