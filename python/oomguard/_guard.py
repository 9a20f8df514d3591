"""The guard around a user's own step: backward in micro-batches that fit, the optimizer's
step, evaluation.

This module owns one step's attempts: splitting the batch (oomguard._batch), the scaled
backward passes, dropping a failed attempt (oomguard._memory, oomguard._buffers, FSDP2's
state), the ranks' votes (oomguard._ranks) and DDP's gradient average. Every decision (the
size after an OOM, growing back, giving up) is `oomguard._native.Policy`'s, the runtime's
own policy, and the agreement vector's meaning is `oomguard._native`'s too. Invariant: when
`backward` returns, every `.grad` is what it was before the call plus one backward of the
whole batch's mean (averaged over ranks under DDP and FSDP2); when it raises, every `.grad`
and every watched buffer is what it was before, on every rank, and no rank is left in a
collective.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import weakref
import zlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from . import _memory, _ranks, _trackers
from ._batch import Rows
from ._buffers import Buffers
from ._memory import Heap, Peak, forget, human, oom_of, warn
from ._native import Policy, agreed, cached_micro_batch, left_behind, memory_step, remember_micro_batch, vote
from ._ranks import Unsupported  # noqa: F401 - oomguard.Unsupported
from ._records import Records, finite, membership, membership_record

MICRO_BATCH_VAR = "OOMGUARD_MICRO_BATCH_SIZE"
FAILED_MICRO_BATCH_VAR = "OOMGUARD_FAILED_MICRO_BATCH_SIZE"
RUN_DIR_VAR = "OOMGUARD_RUN_DIR"
TEST_OOM_VAR = "OOMGUARD_TEST_OOM_AT"
MEMBERSHIP_VAR = "OOMGUARD_MEMBERSHIP"

# Where the test hook can raise: the guard's own phases, and the collectives FSDP2 (or any
# code) issues inside an attempt: `gather` (all-gathers), `reduce` (reduce-scatters),
# `collective` (any other).
HOOK_SITES = ("forward", "backward", "sync", "optimizer", "eval", "gather", "reduce", "collective")
# Gradient buckets of DDP's average: at most this share of the gradients, and never more
# than DDP's own bucket cap (25 MiB by default), at least 1 MiB.
BUCKET_SHARE = 1 / 32


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` is an out-of-memory error: torch.OutOfMemoryError, or an error the
    runtime's classifier calls one (the CPU allocator's "can't allocate memory", oneDNN's
    "could not create a primitive", Python's MemoryError)."""
    return oom_of(exc) is not None


class Infeasible(RuntimeError):
    """The step cannot run in this memory: even micro-batch 1 does not fit, or the part that
    ran out (the optimizer's update) does not get smaller with the micro-batch.

    `step`, `phase`, `requested_bytes` (the failed allocation, when known) and `oom_message`
    (what PyTorch said) tell what would have to change.
    """

    # Printed as `oomguard.Infeasible: ...`, which `oomguard launch` reads as exit 3 (the
    # runtime's "does not fit at micro-batch 1"): no restart, and a sweep records it infeasible.
    __module__ = "oomguard"

    def __init__(self, message: str, *, step: int, phase: str, requested_bytes: Optional[int], oom_message: str):
        super().__init__(message)
        self.step = step
        self.phase = phase
        self.requested_bytes = requested_bytes
        self.oom_message = oom_message


_EXCEPTHOOK_INSTALLED = False


def _install_excepthook() -> None:
    """An OOM that escapes the guard from the optimizer's own code (your `optimizer.step()`,
    not `guard.optimizer_step`) ends the process with one more line, `oomguard.Infeasible:
    ...`, which `oomguard launch` reads as exit 3: relaunching at half the micro-batch cannot
    help there, so it does not."""
    global _EXCEPTHOOK_INSTALLED
    if _EXCEPTHOOK_INSTALLED:
        return
    _EXCEPTHOOK_INSTALLED = True
    previous = sys.excepthook

    def hook(kind, exc, tb):
        previous(kind, exc, tb)
        try:
            where = _optimizer_frame(tb) if oom_of(exc) is not None else None
        except Exception:  # noqa: BLE001 - the report is a courtesy; the traceback is out
            where = None
        if where is not None:
            print(
                f"oomguard.Infeasible: out of memory in the optimizer's step ({where}): a smaller micro-batch "
                "cannot help there (its memory is the parameters', the gradients' and the optimizer state's). "
                "Call guard.optimizer_step(optimizer) to retry it with the memory handed back, or shard the "
                "optimizer state (FSDP2, ZeroRedundancyOptimizer), use foreach=False or an 8-bit optimizer",
                file=sys.stderr,
                flush=True,
            )

    sys.excepthook = hook


def _optimizer_frame(tb) -> Optional[str]:
    """`file:line` of the innermost frame in torch.optim when the traceback passes through
    an optimizer's step (and not through the guard's own, which says it itself; an
    integration's frames, `oomguard.hf.Trainer.train`'s, do not count)."""
    found = None
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
        if path.endswith("/oomguard/_guard.py"):
            return None
        if "/torch/optim/" in path:
            found = f"{path.split('/torch/', 1)[1]}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


class _InjectedOom:
    """OOMGUARD_TEST_OOM_AT=rank:step:site[:k][,...]: raises a real torch.OutOfMemoryError
    (CUDA) or the CPU allocator's RuntimeError once, on the first attempt of that step, at
    that site's k-th occurrence (default 1st): forward (after loss_fn returned), backward
    (after a micro-batch's backward), sync (after DDP's buffers were allocated), optimizer
    (in `guard.optimizer_step`, before the update), eval (after an evaluation micro-batch), gather /
    reduce / collective (just before such a collective inside an attempt, as when its
    buffer's allocation fails). A test hook: an OOM on one rank only, at a chosen place."""

    def __init__(self, spec: str, rank: int):
        self.points: Dict[Tuple[int, str], int] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            fields = part.split(":")
            if len(fields) not in (3, 4) or fields[2] not in HOOK_SITES:
                raise ValueError(f"{TEST_OOM_VAR}: {part!r} is not rank:step:site[:k] with site one of {HOOK_SITES}")
            if int(fields[0]) == rank:
                self.points[(int(fields[1]), fields[2])] = int(fields[3]) if len(fields) == 4 else 1
        self.seen: Dict[str, int] = {}
        self.step = -1
        self.attempts: Dict[str, int] = {}
        self.first = False
        self.fired = False

    def at_step(self, step: int) -> None:
        if step != self.step:
            self.step, self.attempts, self.fired = step, {}, False

    def begin_attempt(self, kind: str) -> None:
        """Occurrences count from each attempt's start; only the step's first attempt of a
        kind (`backward`, `optimizer`, `eval`) fires."""
        self.seen = {}
        self.attempts[kind] = self.attempts.get(kind, 0) + 1
        self.first = self.attempts[kind] == 1

    def check(self, site: str, cuda: bool) -> None:
        self.seen[site] = self.seen.get(site, 0) + 1
        if not self.first or self.points.get((self.step, site)) != self.seen[site]:
            return
        del self.points[(self.step, site)]
        self.fired = True
        where = f"({TEST_OOM_VAR}: {site} at step {self.step})"
        if cuda:
            raise (getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError)(
                f"CUDA out of memory. Tried to allocate 2.00 MiB {where}"
            )
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
            f"you tried to allocate 2097152 bytes. Error code 12 (Cannot allocate memory) {where}"
        )

    def collective(self, name: str, cuda: bool) -> None:
        site = "gather" if "gather" in name else "reduce" if "reduce_scatter" in name else "collective"
        self.check(site, cuda)


class Guard:
    """The allocation guard for your own loop.

    `model`: an nn.Module (plain, DistributedDataParallel-wrapped, or sharded with FSDP2's
    `fully_shard`) or its parameters. `global_batch_size`: the most rows `backward` gets
    (this rank's). `micro_batch_size`: the largest micro-batch to try (default: the whole
    batch); under `oomguard launch` the run starts at OOMGUARD_MICRO_BATCH_SIZE when that is
    set. `run_dir` (or OOMGUARD_RUN_DIR): where rank 0 writes metrics.jsonl in the runtime's
    schema, and CUDA OOM snapshots. `scaler`: a `torch.amp.GradScaler` every `backward`
    scales with (fp16). The policy's knobs (`grow_after_steps`, `grow_headroom`,
    `cooldown_steps`, `thrash_steps`, `retries_at_one`) default to `oomguard train`'s memory.*
    defaults. `tokens_per_sample`: when given, step records carry `tokens_per_s`. `cache`:
    start at the size the runtime's micro-batch cache knows for this model, samples and
    device, and record the size a step settled at after an OOM. `trackers`: "wandb",
    "mlflow" or both, which rank 0's records are also logged to, under HF Trainer's metric
    names (default: OOMGUARD_TRACKERS; none when unset).
    """

    def __init__(
        self,
        model: Union[torch.nn.Module, Iterable[torch.nn.Parameter]],
        global_batch_size: int,
        micro_batch_size: Optional[int] = None,
        *,
        run_dir: Optional[str] = None,
        process_group: Any = None,
        verbose: bool = True,
        snapshot: bool = True,
        cache: bool = True,
        tokens_per_sample: Optional[int] = None,
        scaler: Any = None,
        trackers: Optional[Union[str, Iterable[str]]] = None,
        **policy: Any,
    ):
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size is {global_batch_size}; it must be at least 1")
        configured = global_batch_size if micro_batch_size is None else micro_batch_size
        if not 1 <= configured <= global_batch_size:
            raise ValueError(
                f"micro_batch_size is {configured}; it must be in [1, global_batch_size = {global_batch_size}]"
            )
        self.global_batch_size = global_batch_size
        self._model = _uncompiled(model) if isinstance(model, torch.nn.Module) else None
        _ranks.reshard(_ranks.fsdp_modules(self._model))
        params = model.parameters() if isinstance(model, torch.nn.Module) else model
        self._params: List[torch.nn.Parameter] = [p for p in params if p.requires_grad]
        if not self._params:
            raise ValueError("the model has no parameters that require grad")
        _ranks.refuse_unsafe(self._model, self._params)
        self._fsdp = _ranks.fsdp_modules(self._model)
        self._fsdp_waiting: list = []
        ddp = torch.nn.parallel.DistributedDataParallel
        import torch.distributed as dist

        adopted = None
        if not isinstance(self._model, ddp) and not self._fsdp and dist.is_available() and dist.is_initialized():
            adopted = _ranks.ddp_wrapping(self._params)
            if adopted is not None:
                self._model = adopted
        self._ddp = isinstance(self._model, ddp)
        self._device = self._params[0].device
        self._cuda = self._device.type == "cuda"
        self.policy = Policy(configured, **policy)
        self.step = 0
        self._verbose = verbose
        self._tokens_per_sample = tokens_per_sample
        self._scaler = self._checked_scaler(scaler)
        self._units_scale: Optional[float] = None  # see `_units_weight`
        self._last_scaler: Any = self._scaler  # the last `backward`'s: `optimizer_step`'s default
        self._said_changed = False

        self._ranks: Optional[_ranks.Ranks] = None
        if dist.is_available() and dist.is_initialized():
            if process_group is None and self._ddp:
                process_group = self._model.process_group
            self._ranks = _ranks.Ranks(process_group, self._device)
            self.rank, self.world_size = self._ranks.rank, self._ranks.world
        else:
            self.rank, self.world_size = 0, 1
        left_out = _ranks.ddp_left_out(self._model) if self._ddp else None
        if left_out and self.rank == 0:
            warn(left_out)
        if self._ddp and getattr(self._model, "broadcast_buffers", False):
            # DDP broadcasts rank 0's buffers at each forward: a collective inside the
            # attempt, checkpointed like the others (torch.distributed._broadcast_coalesced).
            pass
        # One process: which parameters a micro-batch's backward completed, so that one which
        # ran out part-way keeps what it finished (`_touched`, filled by each parameter's
        # post-accumulate hook: AccumulateGrad adds a parameter's whole gradient at once).
        self._touched: Optional[set] = None
        self._span: Tuple[int, int, Optional[frozenset]] = (0, 0, None)
        # Off once a redo through `backward(inputs=...)` met reentrant checkpointing, which
        # refuses it: a backward that ran out part-way is then redone whole.
        self._partial_ok = True
        self._hooks: list = []
        self._track(self._params)
        self._bucket_cap = int(getattr(self._model, "bucket_bytes_cap", 25 << 20)) if self._ddp else 0
        self._buffers = Buffers(self._model)
        self._heap = Heap(verbose) if self._device.type == "cpu" else None
        # Every tensor `_sync` handed to a collective, held until the next `backward` begins:
        # a backend's worker thread may drop its own reference just after the collective
        # completes; were it the last, that thread would free the tensor's Python object and
        # need the GIL, which at interpreter exit (right after a last step) aborts the
        # process ("terminate called without an active exception", seen with Gloo).
        self._handed: List[torch.Tensor] = []
        # ...but no longer than the optimizer's step after it (long past the collectives): by
        # then `.grad` holds the gradients itself, and a `zero_grad(set_to_none=True)` before an
        # evaluation or a save frees them, as under plain DDP.
        self._step_hook = None
        if self._ddp:
            this = weakref.ref(self)

            def drop_handed(*_: Any) -> None:
                guard = this()
                if guard is not None:
                    guard._handed = []

            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._step_hook = register_optimizer_step_post_hook(drop_handed)

        start = _env_int(MICRO_BATCH_VAR)
        self.cache_key: Optional[str] = None
        self._use_cache = cache and start is None
        if start is not None and start < configured:
            self.policy.relaunched(_env_int(FAILED_MICRO_BATCH_VAR), max(start, 1), 0)
        spec = os.environ.get(TEST_OOM_VAR)
        self._inject = _InjectedOom(spec, self.rank) if spec else None

        run_dir = run_dir or os.environ.get(RUN_DIR_VAR)
        self.run_dir = run_dir
        if trackers is None:
            chosen, where = _trackers.names(os.environ.get(_trackers.ENV), _trackers.ENV), _trackers.ENV
        else:
            chosen, where = _trackers.names(trackers, "Guard(trackers=...)"), "Guard(trackers=...)"
        self._records = Records(run_dir, self.rank, chosen, where)
        self._membership = (
            membership(os.environ.get(MEMBERSHIP_VAR), self._records.path) if self.rank == 0 else None
        )
        self._oom_count = 0
        self.last_cleanup_s = 0.0  # the last failed attempt's cleanup (gc, cache, trim), seconds
        self._snapshots = bool(snapshot and run_dir and self._cuda)
        if self._snapshots:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._limit = torch.cuda.mem_get_info(self._device)[1] if self._cuda else None
        self._peak = Peak(self._device) if self._cuda else None
        self._pending_record: Optional[Tuple[dict, torch.Tensor, Any]] = None
        self._eval_policy: Optional[Policy] = None
        self._t0 = time.perf_counter()
        _install_excepthook()
        if adopted is not None and self.rank == 0:
            self._say("oomguard: the model is a DistributedDataParallel's module: the guard runs it through that wrapper")
        self._say(f"oomguard: micro_batch_size={self.policy.current}")

    def __del__(self) -> None:
        self._unhook()
        if getattr(self, "_step_hook", None) is not None:
            try:
                self._step_hook.remove()
            except Exception:  # noqa: BLE001 - at interpreter exit torch may be gone
                pass

    def _unhook(self) -> None:
        for h in getattr(self, "_hooks", ()):
            try:
                h.remove()
            except Exception:  # noqa: BLE001 - at interpreter exit torch may be gone
                pass
        self._hooks = []

    def _track(self, params: List[torch.nn.Parameter]) -> None:
        """What the guard keeps per trainable parameter: the hooks that see a backward's
        progress (one process), the groups by dtype and device, the ranks' gradient flags."""
        self._unhook()
        self._params = params
        if self._ranks is None and hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            me = weakref.ref(self)

            def accumulated(p: torch.Tensor) -> None:
                g = me()
                if g is not None and g._touched is not None:
                    g._touched.add(id(p))

            self._hooks = [p.register_post_accumulate_grad_hook(accumulated) for p in params]
        groups: dict = {}
        for p in params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        self._groups = list(groups.items())
        self._has = (
            torch.zeros(len(params), dtype=torch.float64, device=self._ranks.device) if self._ranks is not None else None
        )
        self._zeroed: List[int] = []  # the gradients `_prepare_sync` filled with zeros

    def _retrack(self) -> None:
        """A model's parameters frozen or unfrozen since the last call (progressive
        unfreezing): the guard follows them, as the optimizer's step does."""
        if self._model is None:
            return
        _ranks.reshard(self._fsdp)
        now = [p for p in self._model.parameters() if p.requires_grad]
        if len(now) == len(self._params) and all(a is b for a, b in zip(now, self._params)):
            return
        if not now:
            raise ValueError("the model has no parameters that require grad")
        _ranks.refuse_unsafe(self._model, now)
        self._track(now)

    # --- the API ---------------------------------------------------------------------------

    @property
    def micro_batch_size(self) -> int:
        """The micro-batch size the next attempt runs with."""
        return self.policy.current

    @property
    def oom_count(self) -> int:
        """The OOMs this guard has met (and recovered from, or raised) in this run, those
        before a `load_state_dict` counted."""
        return self._oom_count

    def state_dict(self) -> dict:
        """The step and the policy's state (its serde form, as `oomguard train` checkpoints it)."""
        return {"step": self.step, "policy": self.policy.to_json(), "oom_count": self._oom_count}

    def load_state_dict(self, state: dict, checkpoint: Optional[str] = None) -> None:
        """Continues from `state_dict()`: the step and the policy. The restored size is
        announced (`micro_batch_size=N`, what the launcher halves on a relaunch), and rank 0's
        metrics.jsonl sets aside the records of the steps this run redoes and records the
        resume (`{"event": "resumed", "step", "checkpoint"}`; `checkpoint`: where the state
        came from, if given)."""
        self.step = int(state["step"])
        self._oom_count = int(state.get("oom_count", self._oom_count))  # snapshots number on from it
        before = self.policy.current
        self.policy.load_json(state["policy"])
        start = _env_int(MICRO_BATCH_VAR)
        if start is not None and start < self.policy.current:
            # A relaunch after an OOM the guard could not recover: the launcher's halved size
            # wins over the one saved before that OOM.
            self.policy.relaunched(_env_int(FAILED_MICRO_BATCH_VAR), max(start, 1), self.step)
        self._records.resumed(self.step)
        where = None if checkpoint is None else os.fspath(checkpoint)
        self._records.write({"event": "resumed", "step": self.step, "checkpoint": where})
        if self.policy.current != before:
            self._say(f"oomguard: restored at step {self.step}; micro_batch_size={self.policy.current}")

    def log_eval(self, val_loss: float, eval_batch_size: Optional[int] = None) -> None:
        """Records an evaluation (`{"event": "eval", "step", "val_loss"}` in metrics.jsonl, as
        `oomguard train` writes it): what `oomguard report` draws and `oomguard sweep`'s
        val_loss metric reads. Rank 0's call is the one written."""
        record = {"event": "eval", "step": max(self.step - 1, 0), "val_loss": finite(float(val_loss))}
        if eval_batch_size is not None:
            record["eval_batch_size"] = int(eval_batch_size)
        self._records.write(record)

    def backward(
        self,
        batch: Any,
        loss_fn: Callable[[Any], Any],
        scaler: Any = None,
        *,
        as_tensor: bool = False,
    ) -> Union[float, torch.Tensor]:
        """Gradients of `loss_fn`'s mean over the whole `batch`, in micro-batches that fit.

        `batch`: a tensor, or a tuple/list/dict (nested in any way) of tensors whose leading
        dimension is its rows, at most `global_batch_size`. `loss_fn(micro_batch)` returns the
        mean loss over its micro-batch (a scalar tensor), or `(mean_loss, units)`: the loss
        units it averaged over (tokens not padded), so that each micro-batch weighs by its
        units and a padded or masked mean stays exact when split. `scaler`: a GradScaler
        (default: the guard's). Returns the whole batch's mean loss, a float (with
        `as_tensor=True`, a 0-dim tensor: no host synchronisation). On an OOM the attempt is
        dropped, the micro-batch halved and the same samples redone; `Infeasible` when even
        micro-batch 1 does not fit. `.grad` is as before the call when anything raises.
        """
        with self._keeping_waiting_grads():
            return self._backward_call(batch, loss_fn, scaler, as_tensor)

    def _backward_call(self, batch: Any, loss_fn, scaler, as_tensor: bool) -> Union[float, torch.Tensor]:
        self._flush_pending()
        self._handed = []
        # Under ranks the cache's vote is the first call's on every rank, whatever its batch: a
        # rank stopped by bad input votes its error there instead, and votes no cache later.
        first = self._use_cache
        if self._ranks is not None:
            self._use_cache = False
        try:
            scaler = self._checked_scaler(scaler) if scaler is not None else self._scaler
            self._last_scaler = scaler
            self._retrack()
            rows = Rows(batch)
            n = rows.rows
            if not 1 <= n <= self.global_batch_size:
                raise ValueError(
                    f"the batch has {n} rows but global_batch_size is {self.global_batch_size} "
                    "(this rank's most rows: the leading dimension of every tensor)"
                )
            if first:
                self._use_cache = False
                self._start_from_cache(rows)
            if self._heap is not None:
                self._heap.check()
                if self._ranks is not None:
                    self._ranks.probe = self._heap.rlimit
            # Copies of the watched buffers: an OOM here (a large queue buffer) stops every
            # rank alike, `.grad` not yet touched.
            self._buffers.begin()
        except BaseException as exc:
            self._stop_everywhere(exc, undo=False)
            raise
        if self._inject is not None:
            self._inject.at_step(self.step)
        t_call = time.perf_counter()
        stashed = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        committed = False
        try:
            loss_t, mb, failures, outcome = self._backward(rows, n, loss_fn, scaler, stashed)
            committed = True
        finally:
            if not committed:
                self._restore(stashed)
        step = self.step
        try:
            loss = self._finish_step(loss_t, mb, n, t_call, failures, outcome, as_tensor)
        except BaseException as exc:  # noqa: BLE001 - an OOM in the bookkeeping is survived
            oom = oom_of(exc)
            if oom is None:
                raise
            forget(exc)
            del exc
            # The gradients are whole and every rank agreed: the step stands, its record
            # (or the cache's line) is what is lost.
            _memory.drop(self._cuda, full_gc=True)
            warn(f"out of memory in the guard's bookkeeping after step {step} (its record is lost; the step stands): {oom[1]}")
            self.step = step + 1
            loss = None if as_tensor else float(loss_t)
        return loss_t if as_tensor else loss

    def optimizer_step(self, optimizer: Any, scaler: Any = None, *, update: bool = True) -> bool:
        """`optimizer.step()` (with a scaler: `scaler.step(optimizer)` then `scaler.update()`)
        under the guard. An OOM in it is retried after the memory is handed back when the
        update had changed nothing (the optimizer's state allocated on its first step, say);
        otherwise, or when it runs out again, `Infeasible` (phase `optimizer`) says what could
        help: a smaller micro-batch cannot. Under several ranks every rank retries or stops
        together. The scaler defaults to the one the last `backward` scaled by. Several
        optimizers: `update=False` on all but the last (the scaler updates once a step).
        Returns whether the update was applied (False: the scaler skipped it)."""
        scaler = self._checked_scaler(scaler) if scaler is not None else self._last_scaler
        if self._inject is not None:
            self._inject.at_step(max(self.step - 1, 0))
        tensors = self._optimizer_tensors(optimizer)
        versions = None
        had_state = {id(p) for p in optimizer.state}
        done = partial = False
        scale_before = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
        rounds = 0
        while True:
            oom, outcome = None, None
            if not done:
                if self._inject is not None:
                    self._inject.begin_attempt("optimizer")
                try:
                    # A retry runs on the ranks that failed only: a collective in it could not
                    # be matched, so it is refused there (`solo`).
                    with self._attempt_context(solo=rounds > 0):
                        if versions is None:
                            # The gradients unscaled once, in place, before the update: a
                            # retried `scaler.step` then updates from the same gradients.
                            _unscale_once(scaler, optimizer)
                            versions = [t._version for t in tensors]
                        if self._inject is not None:
                            self._inject.check("optimizer", self._cuda)
                        if scaler is not None:
                            scaler.step(optimizer)
                        else:
                            optimizer.step()
                    done = True
                except _ranks.PeerFailed as pf:
                    # Stopped at a collective inside the optimizer: its update may be partial,
                    # so it is not run again (that would apply its local part twice): the next
                    # round votes the error, and every rank stops.
                    outcome, partial, done = pf.outcome, True, True
                except BaseException as exc:  # noqa: BLE001 - OOMs are handled, the rest re-raised
                    oom = oom_of(exc)
                    if oom is None:
                        self._stop_everywhere(exc, undo=False)
                        raise
                    forget(exc)
                    del exc
                    partial = versions is None or not all(t._version == v for t, v in zip(tensors, versions))
                    if not partial:
                        for p in [p for p in optimizer.state if id(p) not in had_state]:
                            del optimizer.state[p]
                    _memory.drop(self._cuda, full_gc=True)
            if oom is not None:
                sig = zlib.crc32(f"optimizer|{oom[1]}".encode())
                give_up = partial or rounds >= 1
                outcome = self._vote(vote(self.rank, oom=(False, sig, "optimizer", 0), error=give_up))
            elif outcome is None:
                outcome = self._vote(vote(self.rank, error=partial))
            if outcome["oom"] is None and outcome["error_rank"] is None:
                break
            if outcome["error_rank"] is not None:
                r = outcome["error_rank"]
                line = oom[1] if oom is not None else f"rank {r} ran out of memory in the optimizer's update"
                raise self._optimizer_infeasible(r, line, oom, not partial, outcome["oom"] is not None)
            rounds += 1
            if oom is not None:
                self._say(
                    f"oomguard WARNING: OOM in the optimizer's step (rank {self.rank}): {oom[1]}; "
                    "retrying once with the memory handed back"
                )
            mb = self.micro_batch_size
            line = oom[1] if oom is not None else f"rank {outcome.get('oom_rank')} ran out of memory in the optimizer's step"
            self._record_oom("optimizer", 0, oom, line, outcome.get("oom_rank"), mb, mb)
        skipped = _found_inf(scaler, optimizer) if scale_before is not None else False
        if scaler is not None and update:
            scaler.update()
        if skipped is None:  # a scaler without its flags: by its scale
            skipped = update and scaler.get_scale() < scale_before
        return not skipped

    def evaluate(
        self,
        batch: Any,
        fn: Callable[[Any], Any],
        micro_batch_size: Optional[int] = None,
        *,
        as_tensor: bool = False,
    ) -> Union[float, torch.Tensor]:
        """`fn(micro_batch)`'s mean over `batch` under `torch.no_grad()`, in micro-batches
        that fit: `fn` returns a micro-batch's mean (or `(mean, units)`, weighed as in
        `backward`). Evaluation has its own size (default: the training micro-batch's), halved
        on an OOM and never grown back; `Infeasible` (phase `eval`) when even 1 does not fit.
        Training's state, `.grad` and the policy are untouched. Every rank of a distributed
        job calls it (FSDP2's all-gathers run in it)."""
        with self._keeping_waiting_grads():
            return self._evaluate_call(batch, fn, micro_batch_size, as_tensor)

    def _evaluate_call(self, batch: Any, fn, micro_batch_size: Optional[int], as_tensor: bool) -> Union[float, torch.Tensor]:
        self._handed = []  # the last step's collectives are done (`_handed`)
        try:
            rows = Rows(batch)
            n = rows.rows
            if n < 1:
                raise ValueError("the evaluation batch has no rows (the leading dimension of its tensors is 0)")
        except BaseException as exc:
            self._stop_everywhere(exc, undo=False)
            raise
        if self._eval_policy is None or (micro_batch_size and micro_batch_size != self._eval_policy.configured):
            self._eval_policy = Policy(max(1, micro_batch_size or self.policy.current))
        policy = self._eval_policy
        if self._inject is not None:
            self._inject.at_step(max(self.step - 1, 0))
        equal = self._rows_everywhere(n)
        while True:
            mb = min(policy.current, n)
            oom = outcome = None
            if self._inject is not None:
                self._inject.begin_attempt("eval")
            total = units_total = None
            try:
                with self._attempt_context(), torch.no_grad():
                    for index, (start, stop) in enumerate(_split(0, n, mb, equal, policy.current, self._strict())):
                        self._where = ("eval", index)
                        loss, units = _loss_and_units(fn(rows.take(start, stop, mark_dynamic=True)))
                        if self._inject is not None:
                            self._inject.check("eval", self._cuda)
                        w = units if units is not None else (stop - start)
                        part = _counted(loss.detach().double() * w, units)
                        total = part if total is None else total + part
                        units_total = w if units_total is None else units_total + w
                        del loss, part
            except _ranks.PeerFailed as pf:
                outcome = pf.outcome
            except BaseException as exc:  # noqa: BLE001
                oom = oom_of(exc)
                if oom is None:
                    self._stop_everywhere(exc, undo=False)
                    raise
                forget(exc)
                del exc
                total = None
                self._reset_sharding()
                _memory.drop(self._cuda, full_gc=mb == 1)
            if outcome is None:
                phase, index = getattr(self, "_where", ("eval", 0))
                sig = zlib.crc32(f"eval|{index}|{oom[1]}".encode()) if oom else 0
                outcome = self._vote(vote(self.rank, oom=(False, sig, "eval", index) if oom else None))
            if outcome["error_rank"] is not None:
                raise RuntimeError(f"oomguard: rank {outcome['error_rank']} failed in evaluation (see its output)")
            if outcome["oom"] is None:
                mean = total / units_total
                return mean if as_tensor else float(mean)
            if oom is None:
                total = None
                self._reset_sharding()
                _memory.drop(self._cuda, full_gc=mb == 1)
            new = policy.on_oom(self.step, False, outcome["oom"][1])
            line = oom[1] if oom else f"rank {outcome['oom_rank']} ran out of memory"
            self._say(f"oomguard WARNING: OOM in evaluation (micro-batch {mb}): {line}; eval micro-batch {mb} -> {new or 'none left'}")
            self._record_oom("eval", index if oom else 0, oom, line, outcome["oom_rank"], mb, new)
            if new == 0:
                raise Infeasible(
                    f"step {self.step}: evaluation does not fit in memory even at micro-batch 1 (rank "
                    f"{outcome['oom_rank']}). To fit: evaluate shorter sequences, a smaller model or on a device with "
                    f"more memory. PyTorch said: {line}",
                    step=self.step,
                    phase="eval",
                    requested_bytes=oom[2] if oom else None,
                    oom_message=line,
                )

    # --- one step ----------------------------------------------------------------------------

    def _backward(self, rows: Rows, n: int, loss_fn, scaler, stashed):
        failures = 0
        # What `.grad` holds already, kept from failed attempts (one process): every
        # parameter's gradient over rows `..done` (their weighted loss and units) and, in
        # `_pending`, segments [(end, ids), ...] following `done`: the parameters that a
        # backward which ran out part-way completed over those rows. The next attempt redoes
        # each segment's rows for the other parameters only, then the rest: every row reaches
        # every parameter once, so the gradients stay exact.
        self._done: Tuple[int, Any, Any] = (0, None, None)
        self._pending: List[Tuple[int, frozenset]] = []
        self._units_mode: Optional[bool] = None
        self._units_step: Any = None  # this step's units weight (`_units_weight`), fixed at its first
        self._equal = self._rows_everywhere(n)
        while True:
            start, carried, carried_units = self._done
            mb = min(self.policy.current, n)
            base = self._peak.start() if self._peak is not None else None
            if self._inject is not None:
                self._inject.begin_attempt("backward")
            t0 = time.perf_counter()
            self._where = ("forward", 0)
            loss_sum = units = prepared = oom = outcome = None
            after = snap = None
            try:
                with self._attempt_context():
                    loss_sum, units = self._attempt(rows, loss_fn, scaler, mb, n, start, carried, carried_units)
                    if self._ddp and self._ranks is not None:
                        prepared = self._prepare_sync()
            except _ranks.PeerFailed as pf:
                outcome = pf.outcome
            except _Reentrant as exc:
                # The kept rows' gradients cannot be finished: the whole attempt again, at the
                # same size, and no backward kept part-way from now on.
                forget(exc)
                del exc
                self._touched, self._partial_ok = None, False
                self._done, self._pending = (0, None, None), []
                self._drop_attempt(mb, keep_grads=False)
                continue
            except BaseException as exc:  # noqa: BLE001 - OOMs are handled, the rest re-raised
                oom = oom_of(exc)
                if oom is None:
                    self._touched = None
                    self._stop_everywhere(exc)
                    raise
                forget(exc)
                del exc
            if oom is not None:
                loss_sum = units = prepared = None
                phase, index = self._where
                snap = self._snapshot() if self._snapshots else None
                t_drop = time.perf_counter()
                keep = self._keep(phase)
                if not keep:
                    self._done, self._pending = (0, None, None), []
                try:
                    self._drop_attempt(mb, keep_grads=keep)
                except BaseException as failed:
                    # Putting the attempt back failed (FSDP2's waiting gradients copied back
                    # into a device that is still short): the others wait in this attempt's
                    # vote, so they are told there, and every rank stops.
                    self._stop_everywhere(failed, undo=False)
                    raise
                if self._heap is not None and oom[0] == "cpu" and not (self._inject and self._inject.fired):
                    self._heap.bound("the process ran out of host memory")
                self.last_cleanup_s = time.perf_counter() - t_drop
                after = self._kept_aside(base)
                severe = self._cuda and after is not None and base is not None and left_behind(max(0, after - base), base)
                sig = zlib.crc32(f"{phase}|{index}|{oom[1]}".encode())
                outcome = self._vote(vote(self.rank, oom=(severe, sig, phase, index), limit_bytes=self._limit))
            elif outcome is None:
                peak, retries = self._peak.end() if self._peak is not None else (None, None)
                if prepared is not None:
                    missing = bool(self._zeroed)
                else:
                    missing = self._ranks is not None and any(p.grad is None for p in self._params)
                outcome = self._vote(
                    vote(
                        self.rank,
                        peak_bytes=peak or 0,
                        baseline_bytes=base or 0,
                        limit_bytes=self._limit,
                        alloc_retries=retries,
                        missing_grads=missing,
                    )
                )
            failed_elsewhere = outcome["oom"] is not None or outcome["error_rank"] is not None
            if failed_elsewhere and oom is None:
                # Another rank failed (read at a checkpoint, or in the attempt's last vote
                # after this rank had finished): this rank's attempt is dropped too.
                loss_sum = units = prepared = None
                self._touched = None
                self._done, self._pending = (0, None, None), []
                self._drop_attempt(mb, keep_grads=False)
                after = self._kept_aside(base)
            if outcome["error_rank"] is not None:
                raise RuntimeError(
                    f"oomguard: rank {outcome['error_rank']} stopped with an error that is not an OOM (see its "
                    "output); this rank stops with it"
                )
            if outcome["oom"] is not None:
                severe, sig, phase, index = outcome["oom"]
                new = self.policy.on_oom(self.step, severe, sig)
                rank = outcome["oom_rank"]
                line = oom[1] if oom is not None else f"rank {rank} ran out of memory"
                self._on_oom_event(phase, index, oom, line, base, after, mb, new, time.perf_counter() - t0, rank, snap)
                if new == 0:
                    raise Infeasible(
                        self._infeasible_message(phase, rank, oom[2] if oom else None, base, line),
                        step=self.step,
                        phase=phase,
                        requested_bytes=oom[2] if oom else None,
                        oom_message=line,
                    )
                failures += 1
                continue
            divisor = None
            if units is not None and self._units_mode:
                # The sums were weighed by units / `_units_step`: their mean over the units.
                divisor = self._units_divisor(units) / self._units_step
                loss_sum = loss_sum * self._units_step / _at_least_one_unit(units)
                if prepared is not None:
                    # DDP: each rank's own weight comes off before the ranks' average.
                    _divide_grads(self._params, divisor)
                    divisor = None
            if prepared is not None:
                self._sync(prepared, outcome["missing_grads"])
            if divisor is not None:
                _divide_grads(self._params, divisor)
            for p, s in zip(self._params, stashed):
                if s is not None:
                    if p.grad is None:
                        p.grad = s
                    else:
                        p.grad.add_(s)
            self._buffers.end()
            return loss_sum, mb, failures, outcome

    def _finish_step(self, loss_t, mb, n, t_call, failures, outcome, as_tensor) -> Optional[float]:
        """After the ranks agreed on a clean attempt: the policy's look at memory, the cache,
        the step's record and a resize, if any. Returns the loss as a float, unless it stays
        on the device (`as_tensor` on CUDA)."""
        kind, size = self.policy.after_step(
            self.step, outcome["baseline_bytes"], outcome["peak_bytes"], outcome["limit_bytes"], outcome["alloc_retries"]
        )
        # A test hook's OOM is not this model's memory: it never writes the shared cache.
        if failures and self.cache_key is not None and self._inject is None:
            if os.environ.get("LOCAL_RANK", "0") == "0":
                problem = remember_micro_batch(self.cache_key, mb)
                if problem:
                    warn(problem)
        record = self._step_record(mb, n, time.perf_counter() - t_call)
        loss = None
        if as_tensor and self._cuda:
            host = loss_t.detach().to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending_record = (record, host, event)
        else:
            loss = float(loss_t)
            record["loss"] = finite(loss)
            self._write_step(record)
        if kind != "keep":
            self._on_resize(kind, mb, size)
        self.step += 1
        return loss

    def _flush_pending(self) -> None:
        """A step record whose loss stayed on the device (`as_tensor=True`) is written once
        the copy has landed, at the next call: no synchronisation the loop did not have."""
        if self._pending_record is not None:
            record, host, event = self._pending_record
            self._pending_record = None
            event.synchronize()
            record["loss"] = finite(float(host))
            self._write_step(record)

    def close(self) -> None:
        """Writes what is still pending (a step record held for `as_tensor=True`) and ends
        the trackers' runs."""
        self._flush_pending()
        self._records.close()

    def _attempt_context(self, solo: bool = False):
        if self._ranks is None:
            return contextlib.nullcontext()
        inject = self._inject
        cuda = self._cuda
        return self._ranks.attempt((lambda name: inject.collective(name, cuda)) if inject is not None else None, solo)

    def _vote(self, values: List[float]) -> dict:
        return self._ranks.vote(values) if self._ranks is not None else agreed(values)

    def _stop_everywhere(self, exc: BaseException, undo: bool = True) -> None:
        """An error that is not an OOM (or bad input) on this rank: the others are told in
        the vote they are waiting in, so they stop too instead of waiting. Raising is the
        caller's."""
        self._touched = None
        if self._ranks is not None and not isinstance(exc, (_ranks.PeerFailed, _ranks.PeerStopped)):
            try:
                self._vote(vote(self.rank, error=True))
            except Exception:  # noqa: BLE001 - the group itself failed: the original error matters
                pass
        self._reset_sharding()
        if undo:
            self._buffers.undo()

    def _attempt(self, rows: Rows, loss_fn, scaler, mb: int, n: int, first: int = 0, total=None, units_total=None):
        """Rows `first..n` in micro-batches of `mb`, accumulating into `.grad` (which holds
        rows `..first` already, whose weighted loss is `total`, and `_pending`'s rows for its
        parameters); `self._done` follows each micro-batch finished."""
        inject = self._inject
        peak = self._peak
        changed = rows.changed()
        if changed and not self._said_changed:
            self._said_changed = True
            warn(
                f"loss_fn changed its batch in place ({', '.join(changed)}): the rows redone after the OOM "
                "see the changed values, so unless that change gives the same result twice (masking "
                "padding, say) the retry is not the same samples; change a copy (x = x / 255, not x.div_(255))"
            )
        ctx = self._model.no_sync() if self._ddp else contextlib.nullcontext()
        if self._ddp and self._ranks is not None:
            # As a plain DDP step: its first forward broadcasts rank 0's buffers (DDP stops
            # after a forward under no_sync, and every forward here is under it).
            self._model.require_forward_param_sync = True
        spans, at = [], first
        for end, ids in self._pending:
            spans += [(s, e, ids) for s, e in _split(at, end, mb)]
            at = end
        spans += [(s, e, None) for s, e in _split(at, n, mb, self._equal, self.policy.current, self._strict())]
        with ctx:
            for index, (start, stop, ids) in enumerate(spans):
                self._where = ("forward", index)
                size = stop - start
                # Rows a backward ran out part-way through: the parameters it did not reach.
                inputs = None if ids is None else [p for p in self._params if id(p) not in ids]
                self._span = (start, stop, ids)
                loss, units = _loss_and_units(loss_fn(rows.take(start, stop, mark_dynamic=True)))
                if self._units_mode is None:
                    self._units_mode = units is not None
                    if self._units_mode and self._fsdp and (self._fsdp_waiting or _ranks.sync_off(self._fsdp)):
                        raise ValueError(_UNITS_UNSYNCED)
                elif self._units_mode != (units is not None):
                    raise TypeError("loss_fn returned (loss, units) for some micro-batches and a bare loss for others")
                if inject is not None:
                    inject.check("forward", self._cuda)
                if peak is not None:
                    peak.sample()
                self._where = ("backward", index)
                self._touched = set() if self._hooks else None
                if units is not None:
                    # Divided by all the units at the end; weighed by a power of two near the
                    # step's units meanwhile, so fp16 sums and scaled gradients stay in range.
                    if self._units_step is None:
                        self._units_step = self._units_weight(units, size, n)
                    part = loss * (units / self._units_step)
                elif size == n:
                    part = loss
                else:
                    part = loss * (size / n)
                scaled = scaler.scale(part) if scaler is not None else part
                if units is not None and not self._fsdp and _known_zero(units):
                    # No units: nothing to learn, and a mean over none (0/0) would make every
                    # gradient nan. FSDP2's backward runs anyway (its collectives).
                    pass
                elif inputs is None:
                    scaled.backward()
                elif inputs:
                    try:
                        scaled.backward(inputs=inputs)
                    except RuntimeError as e:
                        if "use_reentrant" not in str(e):
                            raise
                        raise _Reentrant() from None
                del scaled
                self._touched = None
                # Summed in float32 at least: a bf16 model's sum would round at every add.
                part = _counted(_widened(part.detach()), units)
                total = part if total is None else total + part
                if units is not None:
                    units_total = units if units_total is None else units_total + units
                del part, loss
                # The micro-batch is done: an OOM from here on (the hook's `backward` site
                # included) keeps it, in one process, and redoes only what follows.
                self._done = (stop, total, units_total)
                self._pending = [(e, i) for e, i in self._pending if e > stop]
                if peak is not None:
                    peak.sample()
                if inject is not None:
                    inject.check("backward", self._cuda)
        return total, units_total

    def _keep(self, phase: str) -> bool:
        """After an OOM in `phase` (one process): whether `.grad` keeps what the attempt
        finished, `_pending` updated. A forward leaves `.grad` as it was; a backward that ran
        out part-way completed some parameters' gradients over its rows (`_touched`), which
        `_pending` records, splitting the segment those rows were in."""
        touched, self._touched = self._touched, None
        # Several ranks redo the whole attempt together; so does a model whose forward
        # changes buffers (BatchNorm's statistics), which are put back to the step's start.
        if self._ranks is not None or self._buffers.watched:
            return False
        if phase == "forward":
            return True
        if phase == "backward" and touched is None and self._done[0] >= self._span[1]:
            return True  # after its backward: the micro-batch is in `_done`, `.grad` holds it
        if phase != "backward" or touched is None or not self._partial_ok:
            return False
        _, stop, ids = self._span
        rest = self._pending  # starts at this span's rows, when they were a segment's
        if ids is None:
            self._pending = [(stop, frozenset(touched))]
        else:
            end = rest[0][0]
            self._pending = [(stop, ids | touched)] + ([(end, ids)] if stop < end else []) + rest[1:]
        return True

    def _drop_attempt(self, mb: int, keep_grads: bool) -> None:
        """The failed attempt's gradients, FSDP2 state and buffer updates undone, and the
        memory handed back (the exception's frames are cleared already)."""
        if not keep_grads:
            for p in self._params:
                p.grad = None
        self._reset_sharding()
        self._buffers.undo()
        _memory.drop(self._cuda, full_gc=mb == 1)

    def _reset_sharding(self) -> None:
        if self._fsdp:
            _ranks.reset_fsdp(self._fsdp)
            _ranks.restore_grads(self._fsdp_waiting)

    @contextlib.contextmanager
    def _keeping_waiting_grads(self):
        """FSDP2's gradients from the user's earlier no-sync calls, kept for this call's
        failed attempts to put back (`_ranks.pending_grads`), and let go at its end."""
        try:
            self._fsdp_waiting = _ranks.pending_grads(self._fsdp) if self._fsdp else []
        except BaseException as exc:
            # Before any vote of this call: the other ranks are told, not left waiting.
            self._stop_everywhere(exc, undo=False)
            raise
        try:
            yield
        finally:
            self._fsdp_waiting = []

    def _kept_aside(self, base: Optional[int]) -> Optional[int]:
        """Live bytes after the cleanup, less the gradients kept from the attempt (expected
        memory, not a leak, when severity is judged)."""
        if not self._cuda:
            return None
        live = torch.cuda.memory_allocated(self._device)
        kept = sum(p.grad.numel() * p.grad.element_size() for p in self._params if p.grad is not None)
        return max(0, live - kept)

    def _restore(self, stashed) -> None:
        for p, s in zip(self._params, stashed):
            p.grad = s

    # --- DDP's gradient average -----------------------------------------------------------

    def _prepare_sync(self):
        """Phase sync, before the ranks agree: one bucket per (dtype, device) for DDP's
        all-reduce (a share of the gradients, not a second copy of them), so that an OOM
        allocating it happens before any rank enters the collective."""
        self._where = ("sync", 0)
        # Zeros for the gradients this rank has none of, allocated before the vote (another
        # rank may have them: then they enter the average); `_sync` drops those no rank has.
        self._zeroed = [i for i, p in enumerate(self._params) if p.grad is None]
        for i in self._zeroed:
            self._params[i].grad = torch.zeros_like(self._params[i])
        buckets = []
        for (dtype, device), ps in self._groups:
            total = sum(p.numel() for p in ps)
            elem = torch.empty((), dtype=dtype).element_size()
            cap = max(1 << 20, int(total * elem * BUCKET_SHARE))
            if self._bucket_cap:
                cap = min(cap, self._bucket_cap)
            numel = max(1, min(total, cap // elem))
            buckets.append((ps, torch.empty(numel, dtype=dtype, device=device)))
        if self._inject is not None:
            self._inject.check("sync", self._cuda)
        return buckets

    def _rows_everywhere(self, n: int) -> Optional[Tuple[int, int]]:
        """Over several ranks: the most and the fewest rows any rank splits, in a vote (a rank
        stopped by bad input meanwhile is seen here too); else None. With it every rank runs
        as many micro-batches (`_split`), so a collective inside them (FSDP2's, SyncBatchNorm's,
        the user's own in `loss_fn`) meets the same one on every rank, checkpoints included."""
        if self._ranks is None:
            return None
        outcome = self._vote(vote(self.rank, peak_bytes=n, baseline_bytes=_BIG - n))
        if outcome["error_rank"] is not None:
            raise _ranks.PeerStopped(f"oomguard: rank {outcome['error_rank']} stopped (see its output); this rank stops with it")
        return int(outcome["peak_bytes"]), int(_BIG - outcome["baseline_bytes"])

    def _strict(self) -> bool:
        """Whether every rank must run as many micro-batches even where a rank has too few rows
        for that (`_split` raises then): under FSDP2 (its forward and backward are
        collectives), or once a collective ran inside an attempt (SyncBatchNorm, the user's
        own); else a rank short of rows runs its own split (no collective meets it)."""
        return self._fsdp or (self._ranks is not None and self._ranks.collectives_seen)

    def _units_weight(self, units: Any, size: int, n: int) -> Any:
        """What this step's units are divided by as each micro-batch's loss is weighed: the
        power of two at or above the step's units as its first micro-batch foretells them
        (exact arithmetic; on the device, nothing read back). Under FSDP2's ranks it must be
        the same on every rank (its reduce-scatter sums what each rank weighed): the last
        step's units over the ranks, 1 at the first."""
        if self._fsdp and self._ranks is not None:
            return self._units_scale or 1.0
        if size == n:
            # One micro-batch for the step: its own units, a weight of exactly 1, so the
            # gradients are the plain loop's (under autocast a weight of 111/128 rounded them).
            return torch.clamp(units, min=1) if isinstance(units, torch.Tensor) else max(units, 1)
        return _power_of_two(units * (n / size))

    def _units_divisor(self, units: Any) -> Any:
        """What the gradients of the units' sums are divided by. Reduced over the ranks (DDP's
        average, FSDP2's reduce-scatter), they become the mean over every rank's units, the
        same on each: the global batch's, as `oomguard train` and HF Trainer's
        `average_tokens_across_devices` take it (each rank dividing by its own count would
        leave the replicas apart when counts differ). One process: its own units."""
        if self._ranks is not None and (self._ddp or self._fsdp):
            total = self._ranks.units(float(units))
            if self._fsdp:
                self._units_scale = _power_of_two(total / self.world_size)  # the same on every rank
            # No unit anywhere: nothing was learned (the sums are zero).
            return total / self.world_size if total > 0 else 1.0
        if isinstance(units, torch.Tensor) and _any_dtensor(self._params):
            return float(_at_least_one_unit(units))
        # No unit in the batch (every label masked): nothing was learned; a mean over none
        # is taken as over one, as `n.clamp(min=1)` in a plain loop (0 / 0 is NaN).
        return _at_least_one_unit(units)

    def _sync(self, buckets, missing: bool) -> None:
        """DDP's gradient average after the ranks agreed, bucket by bucket through the buffers
        allocated before the agreement (a gradient larger than its bucket is averaged in
        place). A parameter no rank computed a gradient for keeps `.grad` None, as under DDP;
        which those are is exchanged only when some rank lacks one."""
        dist = self._ranks.dist
        all_reduce = _ranks._ORIGINAL.get("all_reduce", dist.all_reduce)
        pg, world = self._ranks.pg, self.world_size
        if missing:
            has = self._has
            has.fill_(1.0)
            for i in self._zeroed:
                has[i] = 0.0
            all_reduce(has, group=self._ranks.group)
            for p, h in zip(self._params, has.tolist()):
                if h == 0:
                    p.grad = None  # no rank computed one: None, as under DDP
        for ps, buf in buckets:
            grads = [p.grad for p in ps if p.grad is not None]
            chunk: List[torch.Tensor] = []
            used = 0
            for g in grads + [None]:
                if g is not None and g.numel() > buf.numel():
                    # Divided before the sum, as DDP does: fp16 sums stay in range.
                    self._handed.append(g)
                    g.div_(world)
                    all_reduce(g, group=pg)
                    continue
                if g is None or used + g.numel() > buf.numel():
                    if chunk:
                        flat = buf[:used]
                        off = 0
                        for c in chunk:
                            # Into a view of c's shape: a non-contiguous gradient (channels_last)
                            # is copied with no temporary, which could fail past the agreement.
                            flat[off : off + c.numel()].view(c.shape).copy_(c)
                            off += c.numel()
                        self._handed.append(flat)
                        flat.div_(world)
                        all_reduce(flat, group=pg)
                        off = 0
                        for c in chunk:
                            c.copy_(flat[off : off + c.numel()].view_as(c))
                            off += c.numel()
                    chunk, used = [], 0
                if g is not None:
                    chunk.append(g)
                    used += g.numel()

    # --- the optimizer's step -------------------------------------------------------------

    def _optimizer_tensors(self, optimizer) -> List[torch.Tensor]:
        out = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                out.append(p)
                if p.grad is not None:
                    out.append(p.grad)
                for v in optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        out.append(v)
        return out

    def _optimizer_infeasible(self, rank, line, oom, unchanged, was_oom) -> BaseException:
        if not was_oom:
            return RuntimeError(f"oomguard: rank {rank} stopped in the optimizer's step (see its output)")
        why = (
            "it ran out again with the memory handed back"
            if unchanged
            else "it ran out part-way through the update (the parameters were partly updated), so it "
            "cannot be redone exactly"
        )
        return Infeasible(
            f"step {max(self.step - 1, 0)}: the optimizer's step does not fit in memory on rank {rank}: {why}. A "
            "smaller micro-batch cannot help (its memory is the parameters', the gradients' and the optimizer "
            "state's). To fit: shard the optimizer state (FSDP2's fully_shard, ZeroRedundancyOptimizer), use "
            "an optimizer with smaller state or temporaries (foreach=False, an 8-bit optimizer), or a smaller "
            f"model. PyTorch said: {line}",
            step=max(self.step - 1, 0),
            phase="optimizer",
            requested_bytes=oom[2] if oom else None,
            oom_message=line,
        )

    # --- checks at construction -------------------------------------------------------------

    def _checked_scaler(self, scaler: Any) -> Any:
        """A GradScaler (torch.amp's, or one with its `scale`/`step`/`update`/`unscale_`) on
        the parameters' device type; anything else raises TypeError or ValueError."""
        if scaler is None:
            return None
        for name in ("scale", "step", "update", "unscale_"):
            if not callable(getattr(scaler, name, None)):
                raise TypeError(
                    f"scaler must be a torch.amp.GradScaler (it has no {name}()), not {type(scaler).__name__}"
                )
        device = getattr(scaler, "_device", None)
        enabled = scaler.is_enabled() if callable(getattr(scaler, "is_enabled", None)) else True
        if enabled and device is not None and torch.device(device).type != self._device.type:
            raise ValueError(
                f"the scaler is for {device} but the parameters are on {self._device}: make it with "
                f"torch.amp.GradScaler({self._device.type!r})"
            )
        return scaler

    def _start_from_cache(self, rows: Rows) -> None:
        """The cache's size for this model (parameter shapes and dtypes), these samples (shape
        and dtype beyond the batch dimension), the batch, the device and its memory, when it is
        below the current size; ranks take the smallest any of them read."""
        what = ";".join(f"{tuple(p.shape)}{p.dtype}" for p in self._params)
        what += "|" + ";".join(f"{tuple(t.shape[1:])}{t.dtype}" for t in rows.leaves) + f"|G{self.global_batch_size}"
        self.cache_key = f"python:{zlib.crc32(what.encode()):08x}|{self._device}|{memory_step(self._limit) if self._limit else 0}"
        known = cached_micro_batch(self.cache_key) or self.policy.current
        if self._ranks is not None:
            # The smallest any rank read, in a vote (its "peak" slot carries BIG - size under
            # MAX), so that a rank stopped by bad input meanwhile is seen here too.
            outcome = self._ranks.vote(vote(self.rank, peak_bytes=_BIG - known))
            if outcome["error_rank"] is not None:
                raise _ranks.PeerStopped(
                    f"oomguard: rank {outcome['error_rank']} stopped (see its output); this rank stops with it"
                )
            known = _BIG - outcome["peak_bytes"]
        if known < self.policy.current:
            self.policy.current = known
            self._say(
                f"oomguard: starting at micro_batch_size={known}: an earlier run of this model on this "
                "memory ran out above it (the micro-batch cache)"
            )

    # --- records ------------------------------------------------------------------------

    def _say(self, line: str) -> None:
        if self._verbose:
            print(line, flush=True)

    def _step_record(self, mb: int, n: int, step_time: float) -> dict:
        record = {
            "event": "step",
            "step": self.step,
            "loss": None,
            "micro_batch_size": mb,
            "grad_accum_steps": -(-n // mb),
            "num_samples": n * self.world_size,
            "world_size": self.world_size,
            "step_time_s": step_time,
            "elapsed_s": time.perf_counter() - self._t0,
            "memory": self._memory_record(),
            "device": str(self._device),
        }
        if self._tokens_per_sample:
            record["tokens_per_s"] = self._tokens_per_sample * n * self.world_size / step_time
        if self._ranks is not None and self._ranks.checkpoints:
            record["checkpoints"] = self._ranks.checkpoints
            record["agree_s"] = self._ranks.checkpoint_s
            self._ranks.checkpoints, self._ranks.checkpoint_s = 0, 0.0
        return record

    def _write_step(self, record: dict) -> None:
        self._records.write(record, keep_none=True)  # a NaN loss is null, as the runtime writes it
        if self._membership is not None:
            change, last = self._membership
            self._membership = None
            self._records.write(membership_record(change, last, record["step"]))

    def _memory_record(self) -> dict:
        if self._cuda:
            stats = torch.cuda.memory_stats(self._device)
            return {
                "live_bytes": stats.get("allocated_bytes.all.current", 0),
                "peak_bytes": stats.get("allocated_bytes.all.peak", 0),
                "reserved_bytes": stats.get("reserved_bytes.all.current", 0),
                "limit_bytes": self._limit,
                "alloc_retries": stats.get("num_alloc_retries", 0),
            }
        rss = _memory.rss_anon()
        return {} if rss is None else {"host_rss_anon_bytes": rss}

    def _snapshot(self) -> Optional[str]:
        """CUDA: PyTorch's memory snapshot at the OOM, before the failed attempt is freed,
        as RUN_DIR/oom/NNN/snapshot.pickle (snapshot.rankR.pickle on other ranks)."""
        folder = f"oom/{self._oom_count + 1:03d}"
        try:
            path = os.path.join(self.run_dir, folder)
            os.makedirs(path, exist_ok=True)
            name = "snapshot.pickle" if self.rank == 0 else f"snapshot.rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(os.path.join(path, name))
            return folder
        except Exception as e:  # noqa: BLE001 - a snapshot that fails is only a warning
            warn(f"cannot write the memory snapshot: {e}")
            return None

    def _on_oom_event(self, phase, index, oom, line, base, after, mb, new, lost, rank, snap) -> None:
        shown = "none left" if new == 0 else str(new)
        self._say(
            f"oomguard WARNING: OOM at step {self.step} ({phase}, micro-batch {index}, rank {rank}): {line}; "
            f"micro-batch {mb} -> {shown}" + ("" if new == 0 else f"; micro_batch_size={new}")
        )
        self._record_oom(
            phase, index, oom, line, rank, mb, new,
            memory_before=base, memory_after_cleanup=after, time_lost_s=lost, snapshot=snap,
        )

    def _record_oom(self, phase, index, oom, line, rank, old, new, **more) -> None:
        """An OOM counted in `oom_count` and recorded in metrics.jsonl: the step's
        (`_on_oom_event`, with its memory and snapshot in `more`), or one outside its
        micro-batches (evaluation, the optimizer's step)."""
        self._oom_count += 1
        self._records.write(
            {
                "event": "oom",
                "step": self.step,
                "phase": phase,
                "micro_batch_index": index,
                "source": oom[0] if oom is not None else None,
                "requested_bytes": oom[2] if oom is not None else None,
                "limit_bytes": self._limit,
                "old_micro_batch_size": old,
                "new_micro_batch_size": new,
                "message": line,
                "rank": rank,
                **more,
            }
        )

    def _on_resize(self, kind: str, old: int, new: int) -> None:
        reason = "headroom" if kind == "grow" else "alloc_retries"
        self._say(f"oomguard: micro-batch {old} -> {new} ({reason}) from step {self.step + 1}; micro_batch_size={new}")
        self._records.write(
            {
                "event": kind,
                "step": self.step,
                "old_micro_batch_size": old,
                "new_micro_batch_size": new,
                "reason": reason,
            }
        )

    def _infeasible_message(self, phase, rank, requested, base, line) -> str:
        wanted = f", the failed allocation wanted {human(requested)}" if requested else ""
        in_use = f" with {human(base)} in use before the step" if base is not None else ""
        return (
            f"step {self.step}: the step does not fit in memory even at micro-batch 1 "
            f"({phase} phase, rank {rank}{wanted}{in_use}). To fit: free memory (a smaller model, "
            f"shorter sequences, a lower-precision model or optimizer state) or use a device with more "
            f"memory. PyTorch said: {line}"
        )


_BIG = 1 << 52


class _Reentrant(Exception):
    """A redo through `backward(inputs=...)` refused by reentrant activation checkpointing."""


def _split(
    first: int, n: int, mb: int, equal: Optional[Tuple[int, int]] = None, cap: int = 0, strict: bool = True
) -> List[Tuple[int, int]]:
    """Rows `first..n` in micro-batches of at most `mb`. `equal`: the most and the fewest rows
    over the ranks (`first` is 0): every rank then runs as many micro-batches as the one with
    the most at `cap` rows: its own rows in micro-batches of `mb` where that makes as many,
    else split evenly among them. A rank with fewer rows than that raises on every rank alike
    when `strict` (collectives run inside the micro-batches), else every rank splits its own."""
    plain = [(s, min(s + mb, n)) for s in range(first, n, mb)]
    if equal is None:
        return plain
    most, fewest = equal
    k = -(-most // max(1, min(cap, most)))
    if fewest < k and not strict:
        return plain
    if fewest < k:
        raise ValueError(
            f"over several ranks with collectives inside the step (FSDP2's forward and backward, SyncBatchNorm, "
            f"your own in loss_fn) every rank runs as many micro-batches: at "
            f"{min(cap, most)} rows a micro-batch (the guard's size now; an OOM halves it, so rows that ran before "
            f"may not after one) the rank with the most rows ({most}) runs {k}, and a rank has only "
            f"{fewest}: give every rank the same number of rows (as DistributedSampler does)"
        )
    if len(plain) == k:
        return plain  # as with one rank: equal counts split as before
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def _known_zero(units: Any) -> bool:
    """Whether a micro-batch's units are 0, where that reads nothing back from a device."""
    if isinstance(units, torch.Tensor):
        return units.device.type == "cpu" and not bool(units > 0)
    return not units > 0


def _counted(part: torch.Tensor, units: Any) -> torch.Tensor:
    """A micro-batch's weighed loss as the step's sum takes it: 0 where it had no units (its
    mean over none is nan), decided on the device."""
    if units is None:
        return part
    if isinstance(units, torch.Tensor):
        return torch.where(units > 0, part, torch.zeros_like(part))
    return part if units > 0 else torch.zeros_like(part)


def _widened(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _power_of_two(x: Any) -> Any:
    """The least power of two at or above `x` (> 0; else 1), a number or on `x`'s device."""
    if isinstance(x, torch.Tensor):
        x = x.float()
        return torch.where(x > 0, torch.exp2(torch.ceil(torch.log2(x))), torch.ones_like(x))
    return 2.0 ** math.ceil(math.log2(x)) if x > 0 else 1.0


_UNITS_UNSYNCED = (
    "loss_fn returns (loss, units) while FSDP2's gradient sync is off (set_requires_gradient_sync(False)) or "
    "gradients from such a call wait unreduced: the guard divides a call's gradients by its units once they are "
    "reduced, and FSDP2 reduces the waiting ones together with the syncing call's, so they cannot be divided apart. "
    "Give the step's rows to one guard.backward call with the sync on (the guard splits them into micro-batches "
    "and accumulates), or return a mean loss"
)


def _divide_grads(params: List[torch.Tensor], divisor: Any) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.div_(divisor)


def _found_inf(scaler: Any, optimizer: Any) -> Optional[bool]:
    """Whether the scaler skipped `optimizer`'s step (inf/nan gradients), by its own flags,
    read before `update()` clears them; None for a scaler without them."""
    states = getattr(scaler, "_per_optimizer_states", None)
    found = states[id(optimizer)].get("found_inf_per_device") if states is not None else None
    if not found:
        return None
    return sum(float(f) for f in found.values()) > 0


def _unscale_once(scaler: Any, optimizer: Any) -> None:
    """`scaler.unscale_(optimizer)` unless this step's gradients are unscaled already (the
    user's clipping did it) or the optimizer unscales inside its own step (fused kernels)."""
    if scaler is None or not scaler.is_enabled() or getattr(optimizer, "_step_supports_amp_scaling", False):
        return
    try:
        from torch.amp.grad_scaler import OptState
    except ImportError:  # torch < 2.3
        from torch.cuda.amp.grad_scaler import OptState

    states = getattr(scaler, "_per_optimizer_states", None)  # torch's GradScaler and its subclasses
    if states is not None and states[id(optimizer)]["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


def _loss_and_units(out: Any) -> Tuple[torch.Tensor, Any]:
    """`loss_fn`'s result: a scalar tensor, or `(scalar tensor, units)` with units an int,
    float or 0-dim tensor."""
    units = None
    if isinstance(out, tuple) and len(out) == 2:
        out, units = out
        if isinstance(units, torch.Tensor):
            if units.numel() != 1:
                raise TypeError(f"loss_fn's units must be a number or a 1-element tensor, not shape {tuple(units.shape)}")
            if units.requires_grad:
                # A count never needs a gradient: this is a model output (logits, an auxiliary
                # loss), which taken as units would divide the loss by it.
                raise TypeError(
                    "loss_fn returned (loss, x) with x requiring grad: the second item of a pair is the units the loss "
                    "is a mean over (tokens, rows), a count; return the loss alone (an auxiliary loss added into it)"
                )
            units = units.detach().reshape(())
            # On the CPU the sign is read for free (a device's would cost a sync).
            if units.device.type == "cpu" and not bool(units >= 0):
                raise ValueError(f"loss_fn's units are {units.item()}: the count its mean is over (tokens, rows), 0 or more")
        elif not isinstance(units, (int, float)) or isinstance(units, bool):
            raise TypeError(f"loss_fn's units must be a number or a 1-element tensor, not {type(units).__name__}")
        elif not units >= 0:
            raise ValueError(f"loss_fn's units are {units}: the count its mean is over (tokens, rows), 0 or more")
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        what = type(out).__name__ if not isinstance(out, torch.Tensor) else f"shape {tuple(out.shape)}"
        raise TypeError(
            f"loss_fn must return a scalar tensor (the micro-batch's mean loss) or (loss, units), not {what}"
        )
    return (out if out.dim() == 0 else out.reshape(())), units


def _at_least_one_unit(units: Any) -> Any:
    """`units`, or 1 where there are none (a tensor stays on its device: no sync)."""
    if isinstance(units, torch.Tensor):
        return torch.where(units > 0, units, torch.ones_like(units))
    return units if units > 0 else 1


def _uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module under `torch.compile`'s wrapper (`torch.compile(DDP(m))`, as PyTorch's
    recipe and Accelerate write it): its DDP or FSDP2 is what the guard drives."""
    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod
    return model


def _any_dtensor(params: List[torch.nn.Parameter]) -> bool:
    dtensor = _ranks._dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in params)


def _env_int(name: str) -> Optional[int]:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None
