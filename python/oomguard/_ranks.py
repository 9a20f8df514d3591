"""The ranks of a `torch.distributed` job agreeing on every attempt, and the collectives that
run inside one.

This module owns the agreement and the wrappers around collectives. An attempt that fails on
one rank must never leave another rank waiting in a collective the first has left. So, while
an attempt runs, every collective it issues through `torch.distributed` (FSDP2's all-gathers
and reduce-scatters, DDP's buffer broadcast, one in your `loss_fn`) is preceded by a
*checkpoint*: the ranks' agreement vector all-reduced with MAX, in which every rank says
"still going". A rank that failed votes the same vector once, saying what failed; a rank at
a checkpoint that reads a failure leaves its attempt (`PeerFailed`) without entering the
collective. Invariant: every vote has the same shape and each rank votes exactly once per
checkpoint and once at the attempt's end (or once when it fails), so the votes always match
as collectives and every rank decodes the same outcome.
"""

from __future__ import annotations

import functools
import os
import secrets
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from ._memory import forget, oom_of
from ._native import Exchange, agreed, vote

# How long a rank waits for its neighbours when the exchange connects (at `Guard(...)`);
# each vote then waits as long as the process group's collectives (`_group_timeout`).
EXCHANGE_TIMEOUT_S = 300.0
_GUARDS = 0  # guards made with an exchange in this process: each rendezvous has its own keys

# Collectives every rank of the group calls: each gets a checkpoint first inside an attempt.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "broadcast",
    "_broadcast_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)
# Point-to-point messages (pipeline stages): not every rank takes part, so no checkpoint
# can match them. Inside an attempt they are refused.
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


class PeerFailed(Exception):
    """Another rank's attempt failed: this rank leaves its own at a checkpoint. Carries the
    agreed outcome (the vote this rank took part in)."""

    def __init__(self, outcome: dict):
        super().__init__("another rank's attempt failed")
        self.outcome = outcome


class PeerStopped(RuntimeError):
    """Another rank stopped with an error, read in a vote this rank took part in: this rank
    stops with it, and votes no more (the other rank voted once)."""


class Unsupported(RuntimeError):
    """A collective the guard cannot make safe ran inside an attempt (a point-to-point
    message, a collective over some of the ranks only)."""

    __module__ = "oomguard"


# The guard whose attempt is running in this process (one at a time: its thread is inside
# `backward`, `step` or `evaluate`; autograd's threads run its hooks meanwhile).
_ACTIVE: Optional["Ranks"] = None


def _attempts(ranks: "Ranks") -> bool:
    """Whether a collective called now belongs to the running attempt: called on the thread
    that runs it, or on one of libtorch's own threads (autograd's engine, running FSDP2's
    and DDP's backward hooks), which Python sees as dummy threads. A thread of Python's
    own (a checkpoint saved in the background, `dcp.async_save`) is not the attempt's: its
    collectives pass as they are, neither voted on nor refused."""
    return threading.get_ident() == ranks.thread or isinstance(threading.current_thread(), threading._DummyThread)
_ORIGINAL: Dict[str, Callable] = {}


def _installed() -> bool:
    return bool(_ORIGINAL)


def install() -> None:
    """Wraps torch.distributed's collectives once per process (a call outside an attempt
    costs one global read)."""
    if _installed():
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in COLLECTIVES + POINT_TO_POINT:
        fn = getattr(dist, name, None) or getattr(c10d, name, None)
        if fn is None:
            continue
        _ORIGINAL[name] = fn
        wrapped = _checkpointed(name, fn) if name in COLLECTIVES else _refused(name, fn)
        for module in (dist, c10d):
            if getattr(module, name, None) is fn:
                setattr(module, name, wrapped)


def _checkpointed(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        ranks = _ACTIVE
        if ranks is None or ranks.voting or ranks.inside or not _attempts(ranks):
            return fn(*args, **kwargs)
        if ranks.probe:
            _probe(args, kwargs)
        ranks.checkpoint(name, kwargs.get("group", args[0] if name == "_broadcast_coalesced" and args else None))
        ranks.inside = True  # a collective calling another (all_gather_single) is one
        try:
            return fn(*args, **kwargs)
        finally:
            ranks.inside = False

    collective.__oomguard_original__ = fn  # type: ignore[attr-defined]
    return collective


def _probe(args: tuple, kwargs: dict) -> None:
    """Before a CPU collective's checkpoint, under an address-space limit: the memory Gloo
    will allocate inside it (a copy of its input or output, measured), taken and given back,
    so that a rank short of it fails here, before the ranks agree, rather than inside the
    collective after they did (where its peer would wait in a collective it left). Without
    such a limit an allocation does not fail (a cgroup kills instead), so no probe is taken
    (it cost 3% of an FSDP2 step on the CPU); CUDA's collectives (NCCL) allocate nothing
    through PyTorch's allocator."""
    size = 0
    for t in list(args) + list(kwargs.values()):
        for x in t if isinstance(t, (list, tuple)) else (t,):
            if isinstance(x, torch.Tensor) and x.device.type == "cpu":
                size += x.numel() * x.element_size()
    if size:
        torch.empty(size, dtype=torch.uint8)


def _refused(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def p2p(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE is not None and _attempts(_ACTIVE):
            raise Unsupported(
                f"torch.distributed.{name} ran inside the guarded step: point-to-point messages (pipeline "
                "stages) are not supported, since a rank that ran out of memory could leave its peer waiting. "
                "Keep them outside guard.backward, or train pipeline stages without the guard"
            )
        return fn(*args, **kwargs)

    p2p.__oomguard_original__ = fn  # type: ignore[attr-defined]
    return p2p


def _group_timeout(dist: Any, pg: Any) -> float:
    """The seconds `pg`'s collectives wait (`init_process_group(timeout=...)`, else torch's
    default for its backend), read from its backend's options; torch's default for Gloo
    (30 minutes) where they do not say."""
    group = pg if pg is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            seconds = group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - no backend for that device, or no options to read
            continue
        if seconds > 0:
            return float(seconds)
    return float(dist.distributed_c10d.default_pg_timeout.total_seconds())


class Ranks:
    """This rank among the guard's: its agreement vector (allocated once, up front, so that
    voting never needs memory an OOM took) and the group it is all-reduced over."""

    def __init__(self, process_group: Any, param_device: torch.device):
        import torch.distributed as dist

        self.dist = dist
        self.pg = process_group
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self._exchange = self._open_exchange()
        if self._exchange is not None:
            # Votes go through the exchange; the group serves the rare exchanges of a vector
            # per parameter (which ranks have a gradient), on its own backend's device.
            nccl = "nccl" in str(dist.get_backend(process_group)).lower()
            self.group, self.device = process_group, param_device if nccl else torch.device("cpu")
        else:
            self.group, self.device = self._agreement_group(process_group, param_device)
        self._vector = torch.zeros(len(vote(0)), dtype=torch.float64, device=self.device)
        self._pair = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.voting = False
        self.inside = False
        self.solo = False
        self.thread = threading.get_ident()  # the running attempt's (`_Attempt`)
        self.probe = False  # set while the process runs under an address-space limit
        self.checkpoints = 0
        self.checkpoint_s = 0.0
        # Whether any collective ever ran inside an attempt (`checkpoints` counts a step's).
        self.collectives_seen = False
        self._inject: Optional[Callable[[str], None]] = None
        install()

    def _open_exchange(self):
        """The ranks' exchange (oomguard._native.Exchange, the runtime's own: a tree of TCP
        connections), rendezvoused through the job's c10d store; None where there is no store
        or MASTER_ADDR, or the group is not the whole job: votes then go through c10d."""
        dist = self.dist
        addr = os.environ.get("MASTER_ADDR")
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no default store (another init): c10d votes
            return None
        if not addr or self.world < 2 or self.world != dist.get_world_size():
            return None
        global _GUARDS
        _GUARDS += 1
        prefix = f"oomguard/guard/{_GUARDS}/"

        def share(key: str, value: Optional[bytes]) -> bytes:
            if value is not None:
                store.set(prefix + key, bytes(value))
            return bytes(store.get(prefix + key))

        token = os.environ.get("OOMGUARD_RUN_TOKEN")
        if not token:
            token = share("token", secrets.token_hex(16).encode() if self.rank == 0 else None).decode()
        exchange = Exchange(self.rank, self.world, addr, token, EXCHANGE_TIMEOUT_S, share)
        # A vote waits as long as the group's own collectives would (init_process_group's
        # timeout): a rank saving or evaluating alone between steps is waited for.
        exchange.set_timeout(_group_timeout(dist, self.pg))
        return exchange

    def _agreement_group(self, pg: Any, device: torch.device):
        """Where votes go: a Gloo group and a CPU tensor when the job has one (no device
        synchronisation: a checkpoint never waits for the GPU's queue), else the group's
        own backend on the parameters' device."""
        dist = self.dist
        backend = str(dist.get_backend(pg)).lower()
        if "gloo" in backend:
            return pg, torch.device("cpu")
        whole = pg is None or self.world == dist.get_world_size()
        if whole:
            try:
                return dist.new_group(backend="gloo"), torch.device("cpu")
            except Exception:  # noqa: BLE001 - no Gloo in this build: the parameters' device
                pass
        return pg, device

    def vote(self, values: List[float]) -> dict:
        """Every rank's vote, maximised element-wise (one exchange, or one all-reduce),
        decoded."""
        if self._exchange is not None:
            self.voting = True
            try:
                return agreed(self._exchange.max(values))
            finally:
                self.voting = False
        v = self._vector
        v.copy_(torch.tensor(values, dtype=torch.float64), non_blocking=False)
        self.voting = True
        try:
            _ORIGINAL.get("all_reduce", self.dist.all_reduce)(v, op=self.dist.ReduceOp.MAX, group=self.group)
        finally:
            self.voting = False
        return agreed(v.tolist())

    def units(self, units: float) -> float:
        """The sum of every rank's loss units (one exchange, or one all-reduce)."""
        if self._exchange is not None:
            return float(self._exchange.units(float(units)))
        self._pair.copy_(torch.tensor([float(units), 0.0], dtype=torch.float64))
        _ORIGINAL.get("all_reduce", self.dist.all_reduce)(self._pair, op=self.dist.ReduceOp.SUM, group=self.group)
        return float(self._pair[0])

    def checkpoint(self, name: str, group: Any = None) -> None:
        """Before a collective inside an attempt: every rank still going? Raises PeerFailed
        when another rank's attempt failed (this rank has voted with it)."""
        if group is not None and group is not self.pg and group is not self.group:
            size = self.dist.get_world_size(group)
            if size != self.world:
                raise Unsupported(
                    f"torch.distributed.{name} over a group of {size} of the {self.world} ranks ran inside "
                    "the guarded step: a collective that not every rank takes part in cannot be agreed on "
                    "(HSDP's replica groups, tensor or pipeline parallel groups). Use a 1-D FSDP2 mesh or DDP"
                )
        if self.solo:
            raise Unsupported(
                f"torch.distributed.{name} ran in a retry of the optimizer's step on some ranks only: an "
                "optimizer whose step runs collectives cannot be retried alone"
            )
        if self._inject is not None:
            self._inject(name)
        t0 = time.perf_counter()
        outcome = self.vote(vote(self.rank))
        self.checkpoints += 1
        self.collectives_seen = True
        self.checkpoint_s += time.perf_counter() - t0
        if outcome["error_rank"] is not None or outcome["oom_rank"] is not None:
            raise PeerFailed(outcome)

    def attempt(self, injector: Optional[Callable[[str], None]], solo: bool = False):
        """A context: collectives inside it get checkpoints (and the test hook's injections).
        `solo`: only some ranks run it (a retry), so a collective in it is refused."""
        return _Attempt(self, injector, solo)


class _Attempt:
    def __init__(self, ranks: Ranks, injector: Optional[Callable[[str], None]], solo: bool):
        self.ranks, self.injector, self.solo = ranks, injector, solo

    def __enter__(self) -> None:
        global _ACTIVE
        self.previous = _ACTIVE
        _ACTIVE = self.ranks
        self.previous_thread, self.ranks.thread = self.ranks.thread, threading.get_ident()
        self.ranks._inject = self.injector
        self.ranks.solo = self.solo

    def __exit__(self, *exc: Any) -> None:
        global _ACTIVE
        _ACTIVE = self.previous
        self.ranks.thread = self.previous_thread
        self.ranks._inject = None
        self.ranks.solo = False


# --- what the guard can see through ----------------------------------------------------------


def fsdp_modules(model: Optional[torch.nn.Module]) -> List[torch.nn.Module]:
    """The FSDP2 (`fully_shard`) modules in `model`, outermost first."""
    if model is None:
        return []
    kind = _fsdp2_type()
    return [] if kind is None else [m for m in model.modules() if isinstance(m, kind)]


def reshard(fsdp: List[torch.nn.Module]) -> None:
    """FSDP2's modules put back to their sharded parameters. After a forward without a
    backward (an evaluation, a sanity check under no_grad) the root stays unsharded, and
    `parameters()` then gives its unsharded tensors, not the ones that train: a guard that
    took those would drop and divide gradients that are not the model's. Local, no collective."""
    for m in fsdp:
        m.reshard()


def _fsdp2_type():
    try:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # torch < 2.6

            return FSDPModule
        except ImportError:
            return None


def param_groups(state: Any) -> list:
    """An FSDP2 state's parameter groups: `_fsdp_param_groups` (torch >= 2.12, one per mesh)
    or the single `_fsdp_param_group` before it (None for a module without parameters)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = getattr(state, "_fsdp_param_group", None)
    return [] if one is None else [one]


def ddp_left_out(ddp: torch.nn.Module) -> Optional[str]:
    """What of a DDP module's own reduction the guard's average does not run: a communication
    hook (fp16 or bf16 compression, PowerSGD, or DDP's mixed precision, which works through
    one). The guard's sync is a plain all-reduce of every gradient, once a step: exact, the
    average the hook approximates, but without the bandwidth it would save."""
    hooks = [getattr(h, "__qualname__", None) or repr(h) for h, _ in getattr(ddp, "_comm_hooks", None) or []]
    if getattr(ddp, "mixed_precision", None) is not None:
        hooks.append("mixed_precision")
    if not hooks:
        return None
    return (
        f"DDP's communication hook ({', '.join(hooks)}) is not run: the guard averages the gradients itself, "
        "once a step, with an exact all-reduce in their own dtype (the average the hook approximates, without "
        "the bandwidth it saves)"
    )


def ddp_wrapping(params: List[torch.nn.Parameter]) -> Optional[torch.nn.Module]:
    """The DistributedDataParallel whose module trains exactly `params`: a Guard given
    `ddp.module` (nanoGPT's `raw_model`) or its parameters, while `loss_fn` calls the wrapper.
    The guard takes it as its model (its `no_sync()`, its own average): left unseen, every
    micro-batch's backward ran DDP's all-reduces outside any vote. Raises `Unsupported` for a
    DDP over only some of them, or over more. One scan of the live objects, at `Guard()`."""
    import gc

    ddp = torch.nn.parallel.DistributedDataParallel
    ours = {id(p) for p in params}
    gc.collect()  # a wrapper dropped before (DDP holds reference cycles) is not the one
    found = []
    for o in gc.get_objects():
        try:
            if not isinstance(o, ddp):
                continue
            theirs = {id(p) for p in o.module.parameters() if p.requires_grad}
        except Exception:  # noqa: BLE001 - an object that refuses isinstance or a half-built one
            continue
        if not theirs & ours:
            continue
        if theirs == ours:
            found.append(o)
            continue
        raise Unsupported(
            "the guard's parameters are part of a DistributedDataParallel's (or it trains others besides): its "
            "all-reduces would run in every micro-batch's backward, outside the ranks' votes. Give the guard the "
            "DDP model itself: Guard(ddp_model, ...)"
        )
    if len(found) > 1:
        raise Unsupported(
            f"{len(found)} DistributedDataParallel wrappers train the guard's parameters: give the guard the one "
            "loss_fn calls, Guard(ddp_model, ...)"
        )
    return found[0] if found else None


def refuse_unsafe(model: Optional[torch.nn.Module], params: List[torch.nn.Parameter]) -> None:
    """Raises at construction for a model whose steps the guard cannot make safe."""
    if model is None:
        return
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:
        FSDP1 = None
    if FSDP1 is not None and any(isinstance(m, FSDP1) for m in model.modules()):
        raise TypeError(
            "the model is wrapped in FullyShardedDataParallel (FSDP1), whose state cannot be reset after a "
            "failed attempt: shard it with torch.distributed.fsdp.fully_shard (FSDP2), which the guard supports"
        )
    for m in fsdp_modules(model):
        state = m._get_fsdp_state()
        for group in param_groups(state):
            mesh_info = group.mesh_info
            if type(mesh_info).__name__ == "HSDPMeshInfo":
                raise TypeError(
                    "the model is sharded with HSDP (a 2-D mesh: replicas of shards), whose replica all-reduce "
                    "runs over a subgroup the guard cannot agree on: shard it over a 1-D mesh"
                )
            for fp in group.fsdp_params:
                if getattr(fp, "is_dtensor", False) or getattr(fp, "_tp_spec", None) is not None:
                    raise TypeError(
                        f"parameter {fp._module_info.param_name} is sharded by tensor parallelism as well as "
                        "FSDP2: its collectives run inside the model's operators, where no rank can be stopped "
                        "before them. The guard supports FSDP2 over a 1-D mesh and DDP"
                    )
    if not fsdp_modules(model):
        dtensor = _dtensor_type()
        if dtensor is not None and any(isinstance(p, dtensor) for p in params):
            raise TypeError(
                "the model's parameters are DTensors (tensor parallelism): their collectives run inside the "
                "model's operators, where no rank can be stopped before them. The guard supports FSDP2 "
                "(fully_shard over a 1-D mesh) and DDP"
            )
    try:
        from torch.distributed.pipelining import PipelineStage
    except ImportError:
        PipelineStage = None
    if PipelineStage is not None and isinstance(model, PipelineStage):
        raise TypeError(
            "the model is a pipeline stage: its point-to-point messages cannot be agreed on. Train pipeline "
            "stages without the guard"
        )


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor

        return DTensor
    except ImportError:
        return None


def reset_fsdp(modules: List[torch.nn.Module]) -> None:
    """FSDP2's per-iteration state after a failed attempt: in-flight collectives waited on,
    every group resharded, the trackers cleared (`reset_iter_state`, torch >= 2.13; the same
    steps by hand before it), and the unsharded gradients a backward left dropped, so that
    the next attempt accumulates from nothing."""
    for m in modules:
        state = m._get_fsdp_state()
        if getattr(state, "_is_root", None):
            if hasattr(m, "reset_iter_state"):
                m.reset_iter_state()
            else:
                _reset_by_hand(state)
    for fp in _fsdp_params(modules):
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None
        if hasattr(fp, "unsharded_accumulated_grad"):
            fp.unsharded_accumulated_grad = None


def _fsdp_params(modules: List[torch.nn.Module]) -> Iterator[Any]:
    """Every FSDPParam of FSDP2's modules."""
    for m in modules:
        for group in param_groups(m._get_fsdp_state()):
            yield from group.fsdp_params


def sync_off(modules: List[torch.nn.Module]) -> bool:
    """Whether a user turned FSDP2's gradient reduction off on any of its modules
    (`set_requires_gradient_sync(False)`: this backward's gradients wait unreduced)."""
    for m in modules:
        for group in param_groups(m._get_fsdp_state()):
            if not getattr(group, "reduce_grads", True):
                return True
    return False


def pending_grads(modules: List[torch.nn.Module]) -> list:
    """FSDP2's unsharded gradients that a user's earlier backward left waiting for the syncing
    one (`set_requires_gradient_sync(False)`: accumulation across calls), copied: an attempt
    accumulates into them in place, and `reset_fsdp` drops them, so a failed attempt puts
    the copies back (`restore_grads`). Nothing, at no cost, when none wait."""
    kept = []
    for fp in _fsdp_params(modules):
        unsharded = getattr(fp, "_unsharded_param", None)
        grad = None if unsharded is None else unsharded.grad
        acc = getattr(fp, "unsharded_accumulated_grad", None)
        if grad is not None or acc is not None:
            kept.append((fp, *[None if t is None else _kept_copy(t) for t in (grad, acc)]))
    return kept


def _kept_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` on its device, else, where that runs out of memory, in host memory (a
    copy the size of the model's waiting gradients: a smaller micro-batch cannot make room)."""
    try:
        return t.detach().clone()
    except BaseException as exc:  # noqa: BLE001 - only an OOM is handled
        if oom_of(exc) is None or t.device.type == "cpu":
            raise
        forget(exc)
        del exc
    return t.detach().to("cpu", copy=True)


def restore_grads(kept: list) -> None:
    """`pending_grads`' copies back in place of what a failed attempt left (copied again: a
    later failure restores them too)."""
    for fp, grad, acc in kept:
        device = fp._unsharded_param.device
        if grad is not None:
            fp._unsharded_param.grad = grad.to(device, copy=True)
        if acc is not None:
            fp.unsharded_accumulated_grad = acc.to(device, copy=True)


def _reset_by_hand(state: Any) -> None:
    """What torch 2.13's FSDPState._reset_iter_state does, for older versions."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    ctx = state._comm_ctx
    for attr in ("all_gather_state", "reduce_scatter_state"):
        if hasattr(ctx, attr):
            setattr(ctx, attr, None)
    if hasattr(ctx, "reduce_scatter_states"):
        ctx.reduce_scatter_states.clear()
    if hasattr(ctx, "post_forward_order"):
        ctx.post_forward_order.clear()
    for s in state._state_ctx.all_states:
        if hasattr(s, "_modules_to_run_forward"):
            s._modules_to_run_forward.clear()
        s._training_state = TrainingState.IDLE
        for g in param_groups(s):
            result = getattr(g, "_all_gather_result", None)
            work = getattr(result, "all_gather_work", None)
            if work is not None and hasattr(work, "wait"):
                work.wait()
            for attr in ("_all_gather_result", "_post_reduce_event", "_reshard_after_forward_event", "_partial_reduce_output"):
                if hasattr(g, attr):
                    setattr(g, attr, None)
            g._post_forward_indices.clear()
            g._training_state = TrainingState.IDLE
            g._to_sharded()
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False
