"""`oomguard.lightning.GuardedModule`: the guard in a LightningModule's `training_step`.

Keeps: the guard runs inside Lightning's own step, on manual optimization (Lightning's
automatic optimization runs the backward in its closure, where a failed attempt cannot be
redone on the same rows); a step trains on exactly the rows of its batch, whatever micro-batch
the guard settles at. Its state rides in Lightning's checkpoints; `metrics.jsonl` goes into the
Trainer's `log_dir`. Nothing is decided here: the guard (its Rust policy) decides.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

try:
    import lightning.pytorch as pl
except ImportError as first:  # pragma: no cover - the message is the point
    if first.name is None or first.name.split(".")[0] != "lightning":
        raise  # Lightning is there and failed to import: its own error says why
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] != "pytorch_lightning":
            raise
        raise ImportError("oomguard.lightning needs Lightning: pip install lightning", name=e.name) from e

from ._guard import RUN_DIR_VAR, Guard

__all__ = ["GuardedModule"]

CHECKPOINT_KEY = "oomguard"


class GuardedModule(pl.LightningModule):
    """A LightningModule whose `training_step` calls `self.guarded_backward(batch, loss_fn)`
    where it would call `self.manual_backward(loss)`. Set `automatic_optimization = False`
    (this class does) and step the optimizer yourself:

        def training_step(self, batch, idx):
            opt = self.optimizers()
            loss = self.guarded_backward(batch, lambda mb: F.mse_loss(self(mb[0]), mb[1]))
            opt.step(); opt.zero_grad()

    The batch is a step's rows on this rank (the loader's `batch_size`: Lightning's
    `accumulate_grad_batches` stays 1), split into micro-batches that fit, starting at
    `oomguard_micro_batch_size` (default: the whole batch). The Trainer's loggers get
    `oomguard/micro_batch_size` and `oomguard/oom_count` each step."""

    oomguard_micro_batch_size: Optional[int] = None
    #: The most rows a batch may have (default: the train loader's `batch_size`, or the
    #: first batch's rows, whichever is larger): set it for samplers whose batches vary.
    oomguard_global_batch_size: Optional[int] = None
    oomguard_options: dict = {}
    #: The validation metric (as `self.log`ged) written into metrics.jsonl as an `eval`
    #: record after each validation: what `oomguard report` draws and a sweep's `val_loss` reads.
    oomguard_eval_metric: str = "val_loss"

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.automatic_optimization = False
        self.guard: Optional[Guard] = None
        self._oomguard_state: Optional[dict] = None
        self._oomguard_made_for: Any = None

    def guarded_backward(self, batch: Any, loss_fn: Callable[[Any], Any], **kw: Any) -> Any:
        """`Guard.backward(batch, loss_fn)`: the gradients of the batch's mean loss, in
        micro-batches that fit. Returns the mean loss as a 0-dim tensor (for `self.log`)."""
        from ._batch import Rows

        if self.automatic_optimization:
            raise RuntimeError(
                "oomguard.lightning: guarded_backward needs automatic_optimization = False (manual optimization: "
                "Lightning's automatic step runs the backward in a closure that cannot be redone on the same rows)"
            )
        trainer = self.trainer
        # A guard serves one Trainer at one loader batch size: another fit, or the
        # BatchSizeFinder's next trial, gets a fresh one (from a checkpoint's state if one
        # was loaded since).
        made_for = (id(trainer), self.oomguard_global_batch_size or _loader_batch_size(trainer))
        if self.guard is not None and self._oomguard_made_for != made_for:
            self.guard.close()
            self.guard = None
        if self.guard is None:
            rows = Rows(batch).rows
            # Under DDP the strategy's wrapper: the guard drives it (agreement, its own sync).
            model = trainer.strategy.model if trainer.world_size > 1 else self
            options = {
                # The launcher's or sweep's run directory (`--run-dir`) first, where it reads metrics.
                "run_dir": os.environ.get(RUN_DIR_VAR) or trainer.log_dir,
                "verbose": trainer.is_global_zero,
                "trackers": (),  # the Trainer's loggers log; the guard's state goes through them below
                # precision="16-mixed": the precision plugin's GradScaler, which opt.step() steps with.
                "scaler": getattr(trainer.precision_plugin, "scaler", None),
                **self.oomguard_options,
            }
            most = self.oomguard_global_batch_size or max(rows, made_for[1])
            self.guard = Guard(model, global_batch_size=most, micro_batch_size=self.oomguard_micro_batch_size, **options)
            self._oomguard_made_for = made_for
            if self._oomguard_state is not None:
                self.guard.load_state_dict(self._oomguard_state, checkpoint=getattr(trainer, "ckpt_path", None))
                self._oomguard_state = None  # loaded once: a later fit without a checkpoint starts clean
        loss = self.guard.backward(batch, loss_fn, as_tensor=True, **kw)
        # As manual_backward's precision plugin does once the gradients are there.
        call = _trainer_call()
        if call is not None:
            call._call_callback_hooks(self.trainer, "on_after_backward")
            call._call_lightning_module_hook(self.trainer, "on_after_backward")
        # To the Trainer's loggers (W&B, MLflow, TensorBoard), as the step's own metrics.
        state = {"oomguard/micro_batch_size": float(self.guard.micro_batch_size), "oomguard/oom_count": float(self.guard.oom_count)}
        self.log_dict(state, on_step=True, on_epoch=False, rank_zero_only=True)
        return loss

    def on_validation_end(self) -> None:
        """The validation's `oomguard_eval_metric` (from the Trainer's callback metrics) as an
        `eval` record; nothing during the sanity check or before the guard's first step.
        An override calls `super().on_validation_end()`."""
        trainer = self.trainer
        value = trainer.callback_metrics.get(self.oomguard_eval_metric)
        if self.guard is not None and value is not None and not trainer.sanity_checking:
            self.guard.log_eval(float(value))

    def on_train_end(self) -> None:
        """The last step's record, held while its loss stayed on the device (CUDA), is
        written. An override calls `super().on_train_end()`."""
        if self.guard is not None:
            self.guard._flush_pending()

    def __getstate__(self) -> dict:
        """A copy or a pickle (`copy.deepcopy`, `torch.save(module)`, StochasticWeightAveraging)
        leaves the guard behind (its policy and open metrics file are this run's); the copy
        makes its own at its first step."""
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["guard"], state["_oomguard_made_for"] = None, None
        return state

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.guard is not None:
            checkpoint[CHECKPOINT_KEY] = self.guard.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._oomguard_state = checkpoint.get(CHECKPOINT_KEY)
        if self.guard is not None and self._oomguard_state is not None:
            self.guard.close()  # a module fit again: the next step's guard starts from the checkpoint
            self.guard = None


def _loader_batch_size(trainer: Any) -> int:
    """The train loader's `batch_size` (its batch sampler's), 0 where it has none."""
    try:
        loader = trainer.train_dataloader
    except Exception:  # noqa: BLE001 - not every Trainer state has one
        return 0
    for source in (loader, getattr(loader, "batch_sampler", None)):
        size = getattr(source, "batch_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return 0


def _trainer_call() -> Any:
    """Lightning's hook dispatch (`trainer.call`), where this Lightning has it."""
    try:
        from lightning.pytorch.trainer import call
    except ImportError:
        try:
            from pytorch_lightning.trainer import call  # type: ignore[no-redef]
        except ImportError:
            return None
    return call
