"""The guard around a user's own backward pass.

This module owns the torch work of one optimizer step's gradients: splitting the batch into
micro-batches, the scaled backward passes, dropping a failed attempt, the ranks' agreement
and DDP's gradient all-reduce. Every decision (the size after an OOM, growing back, giving
up) is `oomguard._native.Policy`'s, the runtime's own policy. Invariant: when `backward`
returns, every `.grad` is what it was before the call plus one backward of the whole batch's
mean (averaged over ranks under DDP); when it raises, every `.grad` is what it was before.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
import traceback
import weakref
import zlib
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from ._native import Policy, classify_oom, malloc_trim, memory_step

Batch = Union[torch.Tensor, Sequence[torch.Tensor]]

MICRO_BATCH_VAR = "OOMGUARD_MICRO_BATCH_SIZE"
FAILED_MICRO_BATCH_VAR = "OOMGUARD_FAILED_MICRO_BATCH_SIZE"
RUN_DIR_VAR = "OOMGUARD_RUN_DIR"
TEST_OOM_VAR = "OOMGUARD_TEST_OOM_AT"
MEMBERSHIP_VAR = "OOMGUARD_MEMBERSHIP"

PHASES = ("forward", "backward", "sync")
# The agreement vector's slots (one float64 tensor, all-reduced MAX once per attempt).
FAILED, SEVERE, SIGNATURE, PHASE, RANK, INDEX, PEAK, BASELINE, NEG_LIMIT, RETRIES = range(10)


class Infeasible(RuntimeError):
    """Even micro-batch 1 does not fit: the step cannot run in this memory.

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


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` is an out-of-memory error: torch.OutOfMemoryError, or a RuntimeError
    the runtime's classifier calls one (the CPU allocator's "can't allocate memory", oneDNN's
    "could not create a primitive"), or Python's MemoryError."""
    return _oom_of(exc) is not None


def _oom_of(exc: BaseException) -> Optional[Tuple[str, str, Optional[int]]]:
    """(source, line, requested_bytes) of an OOM, None for any other error."""
    if isinstance(exc, MemoryError):
        return ("cpu", f"MemoryError: {exc}", None)
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    if not isinstance(exc, (RuntimeError, oom_type)):
        return None
    c = classify_oom(str(exc))
    if c is None:
        if isinstance(exc, oom_type):
            return ("cuda", str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory", None)
        return None
    source, line, requested, _capacity, _free = c
    return (source, line, requested)


def _forget(exc: Optional[BaseException]) -> None:
    """Drops what an exception keeps alive: its traceback's frames hold the failed forward's
    tensors (pytorch #18853), and so do the exceptions it chains."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


_STATM = None
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_anon() -> Optional[int]:
    """The process's anonymous resident memory (statm's resident less shared: RssAnon), read
    through a descriptor kept open (a few microseconds)."""
    global _STATM
    try:
        if _STATM is None:
            _STATM = os.open("/proc/self/statm", os.O_RDONLY)
        fields = os.pread(_STATM, 256, 0).split()
        return (int(fields[1]) - int(fields[2])) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def _human(n: Optional[float]) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


class _InjectedOom:
    """OOMGUARD_TEST_OOM_AT=rank:step:phase[,rank:step:phase...]: raises a real
    torch.OutOfMemoryError (CUDA) or the CPU allocator's RuntimeError once, on the first
    attempt of that step, at that phase (forward: after loss_fn returned; backward: after the
    first micro-batch's backward; sync: after the gradient buffers were allocated). A test
    hook: an OOM on one rank only, at a chosen place."""

    def __init__(self, spec: str, rank: int):
        self.points = set()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            r, s, ph = part.split(":")
            if ph not in PHASES:
                raise ValueError(f"{TEST_OOM_VAR}: phase {ph!r} is not one of {PHASES}")
            if int(r) == rank:
                self.points.add((int(s), ph))

    def check(self, step: int, phase: str, cuda: bool) -> None:
        if (step, phase) in self.points:
            self.points.discard((step, phase))
            if cuda:
                raise (getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError)(
                    f"CUDA out of memory. Tried to allocate 2.00 MiB ({TEST_OOM_VAR}: {phase} at step {step})"
                )
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                f"you tried to allocate 2097152 bytes. Error code 12 (Cannot allocate memory) "
                f"({TEST_OOM_VAR}: {phase} at step {step})"
            )


def _cache_path() -> Optional[str]:
    """The runtime's micro-batch cache (src/plan/search.rs): OOMGUARD_CACHE, else
    XDG_CACHE_HOME/oomguard, else ~/.cache/oomguard; micro_batch.json, a map key -> size."""
    base = os.environ.get("OOMGUARD_CACHE")
    if not base and os.environ.get("XDG_CACHE_HOME"):
        base = os.path.join(os.environ["XDG_CACHE_HOME"], "oomguard")
    if not base and os.environ.get("HOME"):
        base = os.path.join(os.environ["HOME"], ".cache", "oomguard")
    return os.path.join(base, "micro_batch.json") if base else None


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def cached_micro_batch(key: str) -> Optional[int]:
    """The largest micro-batch known to fit for `key`, from the shared cache."""
    path = _cache_path()
    value = _read_cache(path).get(key) if path else None
    return value if isinstance(value, int) and value > 0 else None


def remember_micro_batch(key: str, size: int) -> None:
    """Records that `size` fits for `key`, as the runtime does: under the file's lock
    (micro_batch.lock), the file replaced whole (a temporary .micro_batch.json.PID.tmp beside
    it, fsynced, renamed, the folder fsynced). A failure is only a warning."""
    path = _cache_path()
    if not path:
        return
    folder = os.path.dirname(path)
    try:
        import fcntl

        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "micro_batch.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = _read_cache(path)
            data[key] = size
            tmp = os.path.join(folder, f".micro_batch.json.{os.getpid()}.tmp")
            with open(tmp, "w") as f:
                f.write(json.dumps(data, indent=2, sort_keys=True))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            dir_fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    except OSError as e:
        print(f"oomguard WARNING: cannot write the micro-batch cache {path}: {e}", file=sys.stderr, flush=True)


class Guard:
    """The allocation guard for your own loop.

    `model`: an nn.Module (DistributedDataParallel-wrapped or not) or its parameters.
    `global_batch_size`: the rows `backward` gets (this rank's). `micro_batch_size`: the
    largest micro-batch to try (default: the whole batch); under `oomguard launch` the run
    starts at OOMGUARD_MICRO_BATCH_SIZE when that is set. `run_dir` (or OOMGUARD_RUN_DIR):
    where rank 0 writes metrics.jsonl in the runtime's schema, and CUDA OOM snapshots.
    The policy's knobs (`grow_after_steps`, `grow_headroom`, `cooldown_steps`,
    `thrash_steps`, `retries_at_one`) default to `oomguard train`'s memory.* defaults.
    `tokens_per_sample`: when given, step records carry `tokens_per_s` (the report's panel).
    `cache`: start at the size the runtime's micro-batch cache knows for this model, samples
    and device, and record the size a step settled at after an OOM.
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
        self._model = model if isinstance(model, torch.nn.Module) else None
        params = model.parameters() if isinstance(model, torch.nn.Module) else model
        self._params: List[torch.nn.Parameter] = [p for p in params if p.requires_grad]
        if not self._params:
            raise ValueError("the model has no parameters that require grad")
        ddp = torch.nn.parallel.DistributedDataParallel
        self._ddp = isinstance(self._model, ddp)
        self._cuda = self._params[0].is_cuda
        self._device = self._params[0].device
        self.policy = Policy(configured, **policy)
        self.step = 0
        self._verbose = verbose
        self._tokens_per_sample = tokens_per_sample

        import torch.distributed as dist

        self._dist = dist if dist.is_available() and dist.is_initialized() else None
        if self._dist is not None:
            if process_group is None and self._ddp:
                process_group = self._model.process_group
            self._pg = process_group
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
            on_cuda = "nccl" in str(dist.get_backend(process_group)).lower()
            agree_device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        else:
            self._pg, self.rank, self.world_size = None, 0, 1
            agree_device = torch.device("cpu")
        # One process: which parameters a micro-batch's backward completed, so that one which
        # ran out part-way keeps what it finished (`_touched`, filled by each parameter's
        # post-accumulate hook: AccumulateGrad adds a parameter's whole gradient at once).
        self._touched: Optional[set] = None
        self._span: Tuple[int, int, Optional[frozenset]] = (0, 0, None)
        self._hooks = []
        if self._dist is None and hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            me = weakref.ref(self)

            def accumulated(p: torch.Tensor) -> None:
                g = me()
                if g is not None and g._touched is not None:
                    g._touched.add(id(p))

            self._hooks = [p.register_post_accumulate_grad_hook(accumulated) for p in self._params]
        # Allocated once, up front: the agreement never needs memory an OOM took.
        self._agree = torch.zeros(10, dtype=torch.float64, device=agree_device)
        # Gradient groups for DDP's all-reduce: one flat buffer per (dtype, device).
        groups: dict = {}
        for p in self._params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        self._groups = list(groups.items())

        start = _env_int(MICRO_BATCH_VAR)
        # The micro-batch cache is read at the first step (its key needs the samples' shape),
        # unless the launcher named the size.
        self.cache_key: Optional[str] = None
        self._use_cache = cache and start is None
        if start is not None and start < configured:
            self.policy.relaunched(_env_int(FAILED_MICRO_BATCH_VAR), max(start, 1), 0)
        self._inject = _InjectedOom(os.environ[TEST_OOM_VAR], self.rank) if os.environ.get(TEST_OOM_VAR) else None

        run_dir = run_dir or os.environ.get(RUN_DIR_VAR)
        self.run_dir = run_dir
        self._metrics = None
        # An elastic job's round that a membership change began (the launcher says which):
        # recorded after its first step, with the steps the metrics show done before it.
        self._membership = None
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            if self.rank == 0:
                path = os.path.join(run_dir, "metrics.jsonl")
                self._membership = _membership(os.environ.get(MEMBERSHIP_VAR), path)
                self._metrics = open(path, "a", buffering=1)
        self._oom_count = 0
        self.last_cleanup_s = 0.0  # the last failed attempt's cleanup (gc, cache, trim), seconds
        self._snapshots = bool(snapshot and run_dir and self._cuda)
        if self._snapshots:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._limit = torch.cuda.mem_get_info(self._device)[1] if self._cuda else None
        self._t0 = time.perf_counter()
        self._say(f"oomguard: micro_batch_size={self.policy.current}")

    def __del__(self) -> None:
        for h in getattr(self, "_hooks", ()):
            try:
                h.remove()
            except Exception:  # noqa: BLE001 - at interpreter exit torch may be gone
                pass

    @property
    def micro_batch_size(self) -> int:
        """The micro-batch size the next attempt runs with."""
        return self.policy.current

    def state_dict(self) -> dict:
        """The step and the policy's state (its serde form, as `oomguard train` checkpoints it)."""
        return {"step": self.step, "policy": self.policy.to_json()}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.policy.load_json(state["policy"])

    def log_eval(self, val_loss: float, eval_batch_size: Optional[int] = None) -> None:
        """Records an evaluation (`{"event": "eval", "step", "val_loss"}` in metrics.jsonl, as
        `oomguard train` writes it): what `oomguard report` draws and `oomguard sweep`'s
        val_loss metric reads. Rank 0's call is the one written."""
        loss = float(val_loss)
        # The step it follows, numbered as step records are (the runtime's order).
        record = {"event": "eval", "step": max(self.step - 1, 0), "val_loss": loss if math.isfinite(loss) else None}
        if eval_batch_size is not None:
            record["eval_batch_size"] = int(eval_batch_size)
        self._write(record)

    def backward(self, batch: Batch, loss_fn: Callable[[Batch], torch.Tensor]) -> float:
        """Gradients of `loss_fn`'s mean over the whole `batch`, in micro-batches that fit.

        `batch`: a tensor or a tuple/list of tensors whose leading dimension is
        `global_batch_size`. `loss_fn(micro_batch)` returns the mean loss over its micro-batch
        (a scalar tensor). Returns the whole batch's mean loss. On an OOM the attempt is
        dropped, the micro-batch halved and the same samples redone; `Infeasible` when even
        micro-batch 1 does not fit. `.grad` is as before the call when anything raises.
        """
        tensors, rebuild = _parts(batch)
        n = _rows(tensors)
        if n != self.global_batch_size:
            raise ValueError(
                f"the batch has {n} rows but global_batch_size is {self.global_batch_size} "
                "(this rank's rows: the leading dimension of every tensor)"
            )
        if self._use_cache:
            self._use_cache = False
            self._start_from_cache(tensors)
        t_call = time.perf_counter()
        stashed = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        failures = 0
        # What `.grad` holds already, kept from failed attempts (one process): every
        # parameter's gradient over rows `..done` (their weighted loss `total`) and, in
        # `_pending`, segments [(end, ids), ...] following `done`: the parameters that a
        # backward which ran out part-way completed over those rows. The next attempt redoes
        # each segment's rows for the other parameters only, then the rest: every row reaches
        # every parameter once, so the gradients stay exact.
        self._done, self._pending = (0, None), []
        while True:
            start, carried = self._done
            mb = min(self.policy.current, n - start)
            base = self._memory_now()
            if self._cuda:
                torch.cuda.reset_peak_memory_stats(self._device)
            t0 = time.perf_counter()
            self._where = ("forward", 0)
            loss_sum = flats = oom = None
            try:
                loss_sum = self._attempt(batch, tensors, rebuild, loss_fn, mb, n, start, carried)
                if self._ddp:
                    flats = self._prepare_sync()
            except BaseException as exc:  # noqa: BLE001 - OOMs are handled, the rest re-raised
                oom = _oom_of(exc)
                if oom is None:
                    self._restore(stashed)
                    raise
                _forget(exc)
                del exc
            a = [0.0] * 10
            a[NEG_LIMIT] = -math.inf if self._limit is None else -float(self._limit)
            a[RETRIES] = -1.0
            if oom is not None:
                loss_sum = flats = None
                phase, index = self._where
                snap = self._snapshot(phase) if self._snapshots else None
                t_drop = time.perf_counter()
                keep = self._keep(phase)
                if not keep:
                    self._done, self._pending = (0, None), []
                self._drop(full_gc=mb == 1, keep_grads=keep)
                self.last_cleanup_s = time.perf_counter() - t_drop
                after = self._memory_now()
                severe = self._cuda and after is not None and base is not None and after > base
                sig = zlib.crc32(f"{phase}|{index}|{oom[1]}".encode())
                a[FAILED], a[SEVERE], a[SIGNATURE] = 1.0, float(severe), float(sig)
                a[PHASE], a[RANK], a[INDEX] = float(PHASES.index(phase) + 1), float(self.rank + 1), float(index)
            else:
                peak, retries = self._peak_and_retries()
                a[PEAK], a[BASELINE] = float(peak or 0), float(base or 0)
                a[RETRIES] = -1.0 if retries is None else float(retries)
            if self._dist is not None:
                a = self._agreed(a)
            if a[FAILED] > 0:
                if oom is None:  # another rank ran out: drop this rank's attempt too
                    loss_sum = flats = None
                    self._done, self._pending = (0, None), []
                    self._drop(full_gc=mb == 1)
                    after, snap = self._memory_now(), None
                phase = PHASES[int(a[PHASE]) - 1]
                new = self.policy.on_oom(self.step, a[SEVERE] > 0, int(a[SIGNATURE]))
                rank = int(a[RANK]) - 1
                line = oom[1] if oom is not None else f"rank {rank} ran out of memory"
                requested = oom[2] if oom is not None else None
                self._on_oom_event(
                    phase, int(a[INDEX]), oom, line, base, after, mb, new, time.perf_counter() - t0, rank, snap
                )
                if new == 0:
                    self._restore(stashed)
                    raise Infeasible(
                        self._infeasible_message(phase, rank, requested, base, line),
                        step=self.step,
                        phase=phase,
                        requested_bytes=requested,
                        oom_message=line,
                    )
                failures += 1
                continue
            if flats is not None:
                self._sync(flats)
                flats = None
            for p, s in zip(self._params, stashed):
                if s is not None:
                    if p.grad is None:
                        p.grad = s
                    else:
                        p.grad.add_(s)
            loss = float(loss_sum)
            limit = None if math.isinf(a[NEG_LIMIT]) else int(-a[NEG_LIMIT])
            kind, size = self.policy.after_step(
                self.step, int(a[BASELINE]), int(a[PEAK]), limit, None if a[RETRIES] < 0 else int(a[RETRIES])
            )
            if failures and self.cache_key is not None and os.environ.get("LOCAL_RANK", "0") == "0":
                remember_micro_batch(self.cache_key, mb)
            self._record_step(loss, mb, n, time.perf_counter() - t_call, a)
            if kind != "keep":
                self._on_resize(kind, mb, size)
            self.step += 1
            return loss

    def _start_from_cache(self, tensors: List[torch.Tensor]) -> None:
        """The cache's size for this model (parameter shapes and dtypes), these samples (shape
        and dtype beyond the batch dimension), the batch, the device and its memory, when it is
        below the current size; ranks take the smallest any of them read."""
        what = ";".join(f"{tuple(p.shape)}{p.dtype}" for p in self._params)
        what += "|" + ";".join(f"{tuple(t.shape[1:])}{t.dtype}" for t in tensors) + f"|G{self.global_batch_size}"
        self.cache_key = f"python:{zlib.crc32(what.encode()):08x}|{self._device}|{memory_step(self._limit) if self._limit else 0}"
        known = cached_micro_batch(self.cache_key) or self.policy.current
        if self._dist is not None:
            known = int(-self._agreed([-float(known)] + [0.0] * 9)[0])
        if known < self.policy.current:
            self.policy.current = known
            self._say(
                f"oomguard: starting at micro_batch_size={known}: an earlier run of this model on this "
                "memory ran out above it (the micro-batch cache)"
            )

    def _agreed(self, values: List[float]) -> List[float]:
        """Every rank's `values`, maximised element-wise, in the tensor allocated up front."""
        v = self._agree
        for i, x in enumerate(values):
            v[i] = x
        self._dist.all_reduce(v, op=self._dist.ReduceOp.MAX, group=self._pg)
        return v.tolist()

    # --- one attempt -------------------------------------------------------------------

    def _attempt(
        self,
        batch: Batch,
        tensors: List[torch.Tensor],
        rebuild: Callable,
        loss_fn: Callable,
        mb: int,
        n: int,
        first: int = 0,
        total=None,
    ):
        """Rows `first..n` in micro-batches of `mb`, accumulating into `.grad` (which holds
        rows `..first` already, whose weighted loss is `total`, and `_pending`'s rows for its
        parameters); `self._done` follows each micro-batch finished."""
        inject = self._inject
        ctx = self._model.no_sync() if self._ddp else contextlib.nullcontext()
        spans, at = [], first
        for end, ids in self._pending:
            spans += [(s, min(s + mb, end), ids) for s in range(at, end, mb)]
            at = end
        spans += [(s, min(s + mb, n), None) for s in range(at, n, mb)]
        with ctx:
            for index, (start, stop, ids) in enumerate(spans):
                self._where = ("forward", index)
                size = stop - start
                # Rows a backward ran out part-way through: the parameters it did not reach.
                inputs = None if ids is None else [p for p in self._params if id(p) not in ids]
                self._span = (start, stop, ids)
                part = batch if size == n else rebuild([t[start : start + size] for t in tensors])
                loss = loss_fn(part)
                del part
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"shape {tuple(loss.shape)}"
                    raise TypeError(f"loss_fn must return a scalar tensor (the micro-batch's mean loss), not {what}")
                if inject is not None:
                    inject.check(self.step, "forward", self._cuda)
                self._where = ("backward", index)
                self._touched = set() if self._hooks else None
                weight = size / n
                if size == n and inputs is None:  # one micro-batch: the loss as it is
                    loss.backward()
                elif inputs is None:
                    (loss * weight).backward()
                elif inputs:
                    (loss * weight).backward(inputs=inputs)
                self._touched = None
                part = loss.detach() if size == n else loss.detach() * weight
                total = part if total is None else total + part
                del part
                if inject is not None:
                    inject.check(self.step, "backward", self._cuda)
                del loss
                self._done = (stop, total)
                self._pending = [(e, i) for e, i in self._pending if e > stop]
        return total

    def _keep(self, phase: str) -> bool:
        """After an OOM in `phase` (one process): whether `.grad` keeps what the attempt
        finished, `_pending` updated. A forward leaves `.grad` as it was; a backward that ran
        out part-way completed some parameters' gradients over its rows (`_touched`), which
        `_pending` records, splitting the segment those rows were in."""
        touched, self._touched = self._touched, None
        if self._dist is not None:
            return False
        if phase == "forward":
            return True
        if phase != "backward" or touched is None:
            return False
        _, stop, ids = self._span
        rest = self._pending  # starts at this span's rows, when they were a segment's
        if ids is None:
            self._pending = [(stop, frozenset(touched))]
        else:
            end = rest[0][0]
            self._pending = [(stop, ids | touched)] + ([(end, ids)] if stop < end else []) + rest[1:]
        return True

    def _prepare_sync(self):
        """Phase sync, before the ranks agree: the flat buffers of DDP's all-reduce (each
        group's gradients, then one slot per parameter counting the ranks that have its
        gradient), so an OOM allocating them happens before any rank enters the collective."""
        self._where = ("sync", 0)
        flats = []
        for (dtype, device), ps in self._groups:
            flat = torch.empty(sum(p.numel() for p in ps) + len(ps), dtype=dtype, device=device)
            flat[-len(ps) :].copy_(torch.tensor([0.0 if p.grad is None else 1.0 for p in ps], dtype=dtype))
            flats.append((ps, flat))
        if self._inject is not None:
            self._inject.check(self.step, "sync", self._cuda)
        return flats

    def _sync(self, flats) -> None:
        """DDP's gradient average, in place in the buffers allocated before the agreement. A
        parameter no rank computed a gradient for keeps `.grad` None, as under DDP."""
        for ps, flat in flats:
            views = []
            off = 0
            for p in ps:
                view = flat[off : off + p.numel()].view_as(p)
                off += p.numel()
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                views.append(view)
            has = flat[off:]  # filled by _prepare_sync
            self._dist.all_reduce(flat, group=self._pg)
            flat.div_(self.world_size)
            present = has.tolist()
            for p, view, h in zip(ps, views, present):
                if p.grad is not None:
                    p.grad.copy_(view)
                elif h > 0:
                    p.grad = view

    def _restore(self, stashed) -> None:
        for p, s in zip(self._params, stashed):
            p.grad = s

    def _drop(self, full_gc: bool, keep_grads: bool = False) -> None:
        """The failed attempt's gradients and references, and the memory they held, freed:
        the allocator's cache (CUDA) or glibc's arenas (the CPU) handed back. The exception's
        frames are cleared already, so the young generations hold what cycles the attempt
        made; a full collection (70 to 150 ms with torch imported) runs only at micro-batch 1,
        before the policy would give up. `keep_grads`: `.grad` holds finished micro-batches."""
        if not keep_grads:
            for p in self._params:
                p.grad = None
        gc.collect() if full_gc else gc.collect(1)
        if self._cuda:
            torch.cuda.empty_cache()
        else:
            malloc_trim()

    # --- memory -------------------------------------------------------------------------

    def _memory_now(self) -> Optional[int]:
        return torch.cuda.memory_allocated(self._device) if self._cuda else None

    def _peak_and_retries(self) -> Tuple[Optional[int], Optional[int]]:
        if not self._cuda:
            return None, None
        stats = torch.cuda.memory_stats(self._device)
        return stats.get("allocated_bytes.all.peak"), stats.get("num_alloc_retries")

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
        rss = _rss_anon()
        return {} if rss is None else {"host_rss_anon_bytes": rss}

    def _snapshot(self, phase: str) -> Optional[str]:
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
            self._say(f"oomguard WARNING: cannot write the memory snapshot: {e}")
            return None

    # --- records ------------------------------------------------------------------------

    def _say(self, line: str) -> None:
        if self._verbose:
            print(line, flush=True)

    def _write(self, record: dict) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")

    def _record_step(self, loss: float, mb: int, n: int, step_time: float, a: list) -> None:
        if self._metrics is None:
            return
        record = {
            "event": "step",
            "step": self.step,
            "loss": loss if math.isfinite(loss) else None,  # NaN as null, as the runtime writes it
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
        self._write(record)
        if self._membership is not None:
            change, last = self._membership
            self._membership = None
            self._write(
                {
                    "event": "membership",
                    "step": self.step,
                    "old_world": change["old_world"],
                    "new_world": change["new_world"],
                    "cause": change["cause"],
                    "seconds": max(0.0, time.time() - change["detected_unix_ms"] / 1000),
                    "steps_recomputed": 0 if last is None else max(0, last + 1 - self.step),
                    "source": "checkpoint",  # the script's own: it resumed itself
                }
            )

    def _on_oom_event(self, phase, index, oom, line, base, after, mb, new, lost, rank, snap) -> None:
        self._oom_count += 1
        shown = "none left" if new == 0 else str(new)
        self._say(
            f"oomguard WARNING: OOM at step {self.step} ({phase}, micro-batch {index}, rank {rank}): {line}; "
            f"micro-batch {mb} -> {shown}" + ("" if new == 0 else f"; micro_batch_size={new}")
        )
        record = {
            "event": "oom",
            "step": self.step,
            "phase": phase,
            "micro_batch_index": index,
            "source": oom[0] if oom is not None else None,
            "requested_bytes": oom[2] if oom is not None else None,
            "memory_before": base,
            "memory_after_cleanup": after,
            "limit_bytes": self._limit,
            "old_micro_batch_size": mb,
            "new_micro_batch_size": new,
            "time_lost_s": lost,
            "message": line,
            "rank": rank,
        }
        if snap is not None:
            record["snapshot"] = snap
        self._write({k: v for k, v in record.items() if v is not None})

    def _on_resize(self, kind: str, old: int, new: int) -> None:
        reason = "headroom" if kind == "grow" else "alloc_retries"
        self._say(f"oomguard: micro-batch {old} -> {new} ({reason}) from step {self.step + 1}; micro_batch_size={new}")
        self._write(
            {
                "event": kind,
                "step": self.step,
                "old_micro_batch_size": old,
                "new_micro_batch_size": new,
                "reason": reason,
            }
        )

    def _infeasible_message(self, phase, rank, requested, base, line) -> str:
        wanted = f", the failed allocation wanted {_human(requested)}" if requested else ""
        in_use = f" with {_human(base)} in use before the step" if base is not None else ""
        return (
            f"step {self.step}: the step does not fit in memory even at micro-batch 1 "
            f"({phase} phase, rank {rank}{wanted}{in_use}). To fit: free memory (a smaller model, "
            f"shorter sequences, a lower-precision model or optimizer state) or use a device with more "
            f"memory. PyTorch said: {line}"
        )


def _membership(raw: Optional[str], metrics: str) -> Optional[Tuple[dict, Optional[int]]]:
    """OOMGUARD_MEMBERSHIP (the launcher's description of the change), and the last step the
    run's metrics recorded before this round; None outside such a round, or when unreadable."""
    if not raw:
        return None
    try:
        change = json.loads(raw)
        for key in ("old_world", "new_world", "cause", "detected_unix_ms"):
            change[key]
    except (ValueError, KeyError, TypeError):
        return None
    last = None
    try:
        with open(metrics) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if r.get("event") == "step" and isinstance(r.get("step"), int):
                    last = r["step"] if last is None else max(last, r["step"])
    except OSError:
        pass
    return change, last


def _env_int(name: str) -> Optional[int]:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _parts(batch: Batch) -> Tuple[List[torch.Tensor], Callable[[List[torch.Tensor]], Batch]]:
    if isinstance(batch, torch.Tensor):
        return [batch], lambda ts: ts[0]
    if isinstance(batch, (tuple, list)) and batch and all(isinstance(t, torch.Tensor) for t in batch):
        kind = type(batch)
        return list(batch), (lambda ts: tuple(ts)) if kind is tuple else (lambda ts: list(ts))
    raise TypeError(f"batch must be a tensor or a non-empty tuple/list of tensors, not {type(batch).__name__}")


def _rows(tensors: List[torch.Tensor]) -> int:
    rows = []
    for i, t in enumerate(tensors):
        if t.dim() == 0:
            raise ValueError(f"batch[{i}] is a 0-dim tensor: every tensor needs a leading batch dimension")
        rows.append(t.shape[0])
    for i, r in enumerate(rows[1:], 1):
        if r != rows[0]:
            raise ValueError(
                f"the batch's leading dimensions disagree: batch[0] has {rows[0]} rows, batch[{i}] has {r}"
            )
    return rows[0]
