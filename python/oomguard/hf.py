"""`oomguard.hf.Trainer`: Hugging Face's `transformers.Trainer`, its steps under the guard.

Keeps: an optimizer step trains on exactly `per_device_train_batch_size x
gradient_accumulation_steps` rows per rank, the same rows and the same loss normalisation as
the plain Trainer, whatever micro-batch the guard settles at. The Trainer loads the step's rows
as one batch (its own accumulation set to 1) and the guard splits it into micro-batches that
fit; everything else (the optimizer, the scheduler, clipping, logging, checkpoints, evaluation,
callbacks) is the Trainer's own. Nothing is decided here: the guard (its Rust policy) decides.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

try:
    import transformers
except ImportError as e:  # pragma: no cover - the message is the point
    if e.name is None or e.name.split(".")[0] != "transformers":
        raise  # transformers is there and failed to import (a torch it needs, say): its own error
    raise ImportError(
        "oomguard.hf needs Hugging Face transformers (and accelerate, which its Trainer uses): "
        "pip install transformers accelerate",
        name=e.name,
    ) from e

import torch

from ._batch import Rows
from ._guard import RUN_DIR_VAR, Guard

__all__ = ["Trainer", "STATE_FILE"]

# The guard's state in each of the Trainer's checkpoint-N/ folders.
STATE_FILE = "oomguard.json"


def _refusal(args: Any, micro_batch_size: Optional[int]) -> Optional[str]:
    """Why the guard cannot serve these TrainingArguments, or None."""
    if getattr(args, "auto_find_batch_size", False):
        return (
            "auto_find_batch_size=True re-runs training at 0.9x the batch after an OOM and changes the "
            "effective batch; the guard recovers in the step and keeps it: set auto_find_batch_size=False"
        )
    if getattr(args, "deepspeed", None):
        return "DeepSpeed runs its own step (engine.backward, its own accumulation); the guard cannot split it: drop deepspeed="
    if getattr(args, "fsdp", None):
        return (
            "the Trainer's FSDP (fsdp=...) is not served: its own step cannot be split; shard with FSDP2 "
            "(fully_shard) in your own loop, which the guard serves (docs/own-loop.md), or train without fsdp="
        )
    if getattr(args, "n_gpu", 1) > 1:
        return (
            f"this process sees {args.n_gpu} GPUs, which the Trainer would drive with torch.nn.DataParallel (one "
            "batch of per_device_train_batch_size x n_gpu rows); the guard serves one device a process: launch "
            "one process a GPU (oomguard launch --nproc-per-node gpu train.py, or torchrun), or set CUDA_VISIBLE_DEVICES"
        )
    if micro_batch_size is not None and args.gradient_accumulation_steps > 1:
        return (
            f"gradient accumulation set on both sides: gradient_accumulation_steps={args.gradient_accumulation_steps} "
            f"and micro_batch_size={micro_batch_size}; give the step's rows as per_device_train_batch_size x "
            "gradient_accumulation_steps and leave micro_batch_size out, or set gradient_accumulation_steps=1"
        )
    return None


class Trainer(transformers.Trainer):
    """`transformers.Trainer` with every training step under the guard: a drop-in, the same
    constructor. `per_device_train_batch_size x gradient_accumulation_steps` is a step's rows
    on each rank; it stays exact through halvings and grow-backs. The guard starts at
    `per_device_train_batch_size` (or `micro_batch_size=`, with accumulation 1), and writes
    `metrics.jsonl` into `output_dir`. Keyword `oomguard=dict(...)` passes options to
    `oomguard.Guard` (e.g. `snapshot=False`). The Trainer's own `report_to` logs to W&B and
    MLflow, the guard's micro-batch and OOM count among its training logs; the guard opens
    no tracker runs of its own here unless `oomguard=dict(trackers=...)` asks."""

    def __init__(self, *a: Any, micro_batch_size: Optional[int] = None, oomguard: Optional[dict] = None, **kw: Any):
        positional = "args" not in kw and len(a) > 1
        args = a[1] if positional else kw.get("args")
        if args is None:
            # As transformers.Trainer does without args.
            args = transformers.TrainingArguments(output_dir="trainer_output")
        why = _refusal(args, micro_batch_size)
        if why:
            raise ValueError(f"oomguard.hf.Trainer: {why}")
        args = dataclasses.replace(args)
        self._oomguard_micro = micro_batch_size
        self._fold(args)
        if positional:
            a = (a[0], args, *a[2:])
        else:
            kw["args"] = args
        super().__init__(*a, **kw)
        # DeepSpeed or FSDP from Accelerate's config (accelerate launch --config_file),
        # which TrainingArguments' own fields do not show.
        if getattr(self, "is_deepspeed_enabled", False):
            raise ValueError(
                "oomguard.hf.Trainer: DeepSpeed is on (accelerate's config or ACCELERATE_USE_DEEPSPEED): its engine runs "
                "its own backward and step, which the guard cannot split; launch without DeepSpeed"
            )
        if getattr(self, "is_fsdp_enabled", False):
            raise ValueError(
                "oomguard.hf.Trainer: the Trainer's FSDP is on (accelerate's config or ACCELERATE_USE_FSDP): its own step "
                "cannot be split; shard with FSDP2 (fully_shard) in your own loop, which the guard serves (docs/own-loop.md)"
            )
        self._oomguard_honours: Optional[bool] = None
        self._oomguard_options = dict(oomguard or {})
        # The user's word on compute_loss's normalisation (else probed: `_honours_count`).
        self._oomguard_normalised: Optional[bool] = self._oomguard_options.pop("loss_normalised", None)
        self._oomguard_resume: Optional[str] = None
        self.guard: Optional[Guard] = None

    def _fold(self, args: Any) -> None:
        """The Trainer loads a step's rows as one batch (`per_device_train_batch_size x
        gradient_accumulation_steps`, accumulation 1 in `args` from here); the guard
        accumulates instead of it, starting at `micro_batch_size` or a device's batch."""
        per_device, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
        rows = per_device * accum
        start = self._oomguard_micro or per_device
        if not 1 <= start <= rows:
            raise ValueError(f"oomguard.hf.Trainer: micro_batch_size={start} must be in [1, {rows}] (the step's rows)")
        args.per_device_train_batch_size, args.gradient_accumulation_steps = rows, 1
        self.oomguard_rows, self._oomguard_start = rows, start
        self._oomguard_per_device, self._oomguard_accum = per_device, accum

    def _hp_search_setup(self, trial: Any) -> None:
        """A hyperparameter trial's values are the user's (a device's batch, the
        accumulation), as the plain Trainer reads them: they are set on those, then folded into
        a step's rows again before the accelerator is made for the trial."""
        args = self.args
        args.per_device_train_batch_size = self._oomguard_per_device
        args.gradient_accumulation_steps = self._oomguard_accum
        self.create_accelerator_and_postprocess = lambda: None  # made below, once folded
        try:
            super()._hp_search_setup(trial)
        finally:
            del self.create_accelerator_and_postprocess
            self._fold(args)
        if self.hp_search_backend is not None and trial is not None:
            self._train_batch_size = args.train_batch_size
            self.create_accelerator_and_postprocess()

    # --- the step --------------------------------------------------------------------------

    def _guard_for(self, model: Any) -> Guard:
        if self.guard is None:
            options = {
                # The launcher's or sweep's run directory (`--run-dir`) first, where it reads metrics.
                "run_dir": os.environ.get(RUN_DIR_VAR) or self.args.output_dir,
                "verbose": self.args.should_log,
                "trackers": (),  # report_to's integrations log this Trainer's metrics
                # fp16: the Trainer's own GradScaler, which its step unscales and steps with.
                "scaler": getattr(self.accelerator, "scaler", None),
                **self._oomguard_options,
            }
            self.guard = Guard(model, global_batch_size=self.oomguard_rows, micro_batch_size=self._oomguard_start, **options)
            state = self._oomguard_resume and os.path.join(self._oomguard_resume, STATE_FILE)
            if state and os.path.exists(state):
                with open(state) as f:
                    self.guard.load_state_dict(json.load(f), checkpoint=self._oomguard_resume)
        return self.guard

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """The step's rows, through the guard: each micro-batch's loss is the Trainer's own
        `compute_loss` with the step's `num_items_in_batch`, weighed so that the step's loss
        and gradients are the plain Trainer's at the configured sizes (its rule in
        `training_step`, `loss_is_scaled_for_ga`):
        - a loss normalised by the step's count (a sum over it): their sum;
        - a mean the Trainer divides by its accumulation: by rows, the mean of the means;
        - a count passed but ignored (a model's own mean, a sequence classifier's): the sum
          of the configured batches' means, as the plain Trainer's accumulation adds them."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        guard = self._guard_for(model)
        flag = self.loss_is_scaled_for_ga
        if flag is None:
            flag = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None
        honoured = bool(flag) and num_items_in_batch is not None and self._honours_count(model, inputs, num_items_in_batch)

        def loss_fn(mb: Any) -> Any:
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, mb, num_items_in_batch=num_items_in_batch)
            if self.args.n_gpu > 1:
                loss = loss.mean()
            if not flag:
                return loss
            # The guard's mean weighted by rows of (loss x n / r) over micro-batches of r rows
            # (n in all) is the sum of the losses; of (loss x n / P), the sum of P-row means.
            return loss * (guard_rows / (Rows(mb).rows if honoured else self._oomguard_per_device))

        guard_rows = Rows(inputs).rows
        loss = guard.backward(inputs, loss_fn, as_tensor=True)
        every = self.args.torch_empty_cache_steps
        if every is not None and self.state.global_step % every == 0:
            from accelerate.utils.memory import clear_device_cache

            clear_device_cache()
        return loss.detach().to(self.args.device)

    def _honours_count(self, model: Any, inputs: Any, count: Any) -> bool:
        """Whether `compute_loss` divides by `num_items_in_batch` (else it is a mean of its
        own, which the Trainer still sums unscaled): one row's loss at the count and at twice
        it, once a run, in eval mode with the RNG put back, each call on its own copy of the
        row (`compute_loss` pops `labels` when a `compute_loss_func` or label smoother is set).
        The share of the loss that halves with a doubled count decides: about a half, a count
        divides it (an auxiliary term on top, a router's loss, leaves less); about none, a
        mean. `oomguard=dict(loss_normalised=True/False)` says it instead. Unsure (a row with
        no labels, an error): yes, the models' own causal-LM losses do, with a warning."""
        if self._oomguard_normalised is not None:
            return bool(self._oomguard_normalised)
        if self._oomguard_honours is None:
            self._oomguard_honours = True
            was = model.training
            devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
            why = None
            try:
                with torch.random.fork_rng(devices=devices), torch.no_grad(), self.compute_loss_context_manager():
                    model.eval()
                    a = self.compute_loss(model, Rows(inputs).take(0, 1), num_items_in_batch=count).float()
                    b = self.compute_loss(model, Rows(inputs).take(0, 1), num_items_in_batch=count * 2).float()
                if torch.isfinite(a) and torch.isfinite(b) and a != 0:
                    share = float((a - b) / a)
                    self._oomguard_honours = share > 0.25
                    if 0.05 < share < 0.45 or share > 0.55 or share < -0.05:
                        why = f"the loss at twice num_items_in_batch is {float(b):.6g} against {float(a):.6g}, neither a half nor the same"
                else:
                    why = f"the loss of one row was {float(a):.6g} (at twice the count {float(b):.6g})"
            except Exception as e:  # noqa: BLE001 - the probe only informs; the step itself reports errors
                why = f"{type(e).__name__}: {e}"
            finally:
                model.train(was)
            if why is not None:
                import warnings

                warnings.warn(
                    "oomguard.hf.Trainer: cannot tell whether compute_loss divides by num_items_in_batch "
                    f"({why}); taken as {'yes' if self._oomguard_honours else 'no'}. Say which with "
                    "oomguard=dict(loss_normalised=True) (a sum over the step's count) or False (a mean of its own)",
                    stacklevel=2,
                )
        return self._oomguard_honours

    def log(self, logs: dict, *a: Any, **kw: Any) -> None:
        """The Trainer's logs, a training log with the guard's micro-batch and OOM count
        (report_to's W&B shows them as train/micro_batch_size and train/oom_count); an
        evaluation's `eval_loss` also goes into metrics.jsonl as an `eval` record, what
        `oomguard report` draws and a sweep's `val_loss` metric reads."""
        if self.guard is not None and "loss" in logs:
            logs = {**logs, "micro_batch_size": self.guard.micro_batch_size, "oom_count": self.guard.oom_count}
        if self.guard is not None and isinstance(logs.get("eval_loss"), (int, float)):
            self.guard.log_eval(logs["eval_loss"])
        super().log(logs, *a, **kw)

    # --- checkpoints: the guard's state beside the Trainer's ---------------------------------

    def train(self, resume_from_checkpoint: Any = None, *a: Any, **kw: Any) -> Any:
        if resume_from_checkpoint is True:
            # None found: the Trainer's own error says so.
            resume_from_checkpoint = (
                transformers.trainer_utils.get_last_checkpoint(self.args.output_dir) or resume_from_checkpoint
            )
        # Each train() builds its guard afresh: model_init may make a new model, and a resume
        # loads the guard's state from its checkpoint.
        if self.guard is not None:
            self.guard.close()
        self.guard, self._oomguard_honours = None, None
        self._oomguard_resume = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        try:
            out = super().train(resume_from_checkpoint, *a, **kw)
        except BaseException:
            # The last step's record too, unless the device itself failed: the error is the point.
            if self.guard is not None:
                try:
                    self.guard._flush_pending()
                except Exception:  # noqa: BLE001 - the training's own error is re-raised
                    pass
            raise
        # The last step's record, held while its loss stayed on the device (CUDA).
        if self.guard is not None:
            self.guard._flush_pending()
        return out

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.guard is None or not self.args.should_save:
            return
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        if os.path.isdir(folder):
            tmp = os.path.join(folder, STATE_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(self.guard.state_dict(), f)
            os.replace(tmp, os.path.join(folder, STATE_FILE))

