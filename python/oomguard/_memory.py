"""Memory as the guard sees it: which errors are OOMs, dropping what a failed attempt left,
and the figures the grow-back decision reads.

This module owns the cleanup after a failed attempt and the memory readings. Invariant: the
user's own counters are never reset (CUDA's peak statistics are read, not cleared), and
after `drop` nothing of the failed attempt is referenced by the guard.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from typing import Optional, Tuple

import torch

from ._native import bound_heap, classify_oom, malloc_trim

OomInfo = Tuple[str, str, Optional[int]]  # (source, line, requested bytes)


def oom_of(exc: BaseException) -> Optional[OomInfo]:
    """(source, line, requested_bytes) when `exc` is an out-of-memory error, else None: a
    `torch.OutOfMemoryError`, or any error whose `Type: message` the runtime's classifier
    (oomguard_host::oom, shared with `oomguard train`) calls one: the CPU allocator's "can't
    allocate memory", oneDNN's "could not create a primitive", Python's MemoryError."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    if not isinstance(exc, (RuntimeError, MemoryError, oom_type)):
        return None
    c = classify_oom(f"{type(exc).__name__}: {exc}")
    if c is None:
        if isinstance(exc, oom_type):
            text = str(exc).strip()
            return ("cuda", text.splitlines()[0] if text else "out of memory", None)
        return None
    source, line, requested, _capacity, _free = c
    return (source, line, requested)


def forget(exc: Optional[BaseException]) -> None:
    """Drops what an exception keeps alive: its traceback's frames hold the failed forward's
    tensors (pytorch #18853), and so do the exceptions it chains."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


_STATM: Optional[int] = None
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_anon() -> Optional[int]:
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


def _rlimit() -> Optional[str]:
    try:
        import resource

        for name in ("RLIMIT_AS", "RLIMIT_DATA"):
            soft, _ = resource.getrlimit(getattr(resource, name))
            if soft != resource.RLIM_INFINITY:
                return f"{name} {soft} bytes"
    except (ImportError, OSError, ValueError, AttributeError):
        pass
    return None


def _cgroup() -> Optional[str]:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text != "max" and text.isdigit() and int(text) < (1 << 60):
            return f"memory cgroup limit {text} bytes"
    return None


# Under a cap, tensors of this size and more are mapped on their own and unmapped when freed
# (the runtime's 4 MiB kept 1.5 MiB buffers in arenas that an address-space limit then
# could not grow, and every retry failed).
HEAP_THRESHOLD = 128 << 10


class Heap:
    """glibc's heap under a cap: its mmap threshold is fixed (as `oomguard train` does) once
    the process is capped (an address-space or data limit, a memory cgroup) or has run out
    of host memory once, so that a failed attempt's buffers go back to the system instead of
    staying in glibc's arenas, where a retry under an address-space limit could not use them.
    A cap is looked for at the guard's construction and at each step's start until found (a
    loop may set its limit later)."""

    def __init__(self, verbose: bool):
        self.bounded: Optional[int] = None
        self._verbose = verbose
        self.rlimit = _rlimit() is not None  # an address-space or data limit: allocations fail
        why = _cgroup() or _rlimit()
        if why is not None:
            self.bound(why)

    def check(self) -> None:
        if self.bounded is None or not self.rlimit:
            why = _rlimit()
            self.rlimit = why is not None
            if why is not None:
                self.bound(why)

    def bound(self, why: str) -> None:
        if self.bounded is not None:
            return
        self.bounded = bound_heap(HEAP_THRESHOLD) or 0
        malloc_trim()
        if self.bounded and self._verbose:
            print(
                f"oomguard: {why}: freed buffers of {self.bounded >> 10} KiB and more go back to the system "
                "(MALLOC_MMAP_THRESHOLD_ overrides)",
                flush=True,
            )


def drop(cuda: bool, full_gc: bool) -> None:
    """The memory a failed attempt held, handed back: the young garbage-collector generations
    (a full collection costs 70 to 150 ms with torch imported: only when asked), then CUDA's
    cache emptied, or on the CPU glibc's free heap trimmed."""
    gc.collect() if full_gc else gc.collect(1)
    if cuda:
        torch.cuda.empty_cache()
    else:
        malloc_trim()


class Peak:
    """The step's peak live bytes on CUDA, read without resetting PyTorch's peak counter (the
    user's own peak logging stays theirs): when the counter rose during the step, its new
    value is this step's peak; otherwise the step stayed below an earlier peak, and the
    largest live figure the guard sampled (after each micro-batch's forward and backward)
    stands for it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.before = 0
        self.sampled = 0

    def start(self) -> int:
        stats = torch.cuda.memory_stats(self.device)
        self.before = stats.get("allocated_bytes.all.peak", 0)
        live = stats.get("allocated_bytes.all.current", 0)
        self.sampled = live
        return live

    def sample(self) -> None:
        self.sampled = max(self.sampled, torch.cuda.memory_allocated(self.device))

    def end(self) -> Tuple[int, Optional[int]]:
        stats = torch.cuda.memory_stats(self.device)
        peak = stats.get("allocated_bytes.all.peak", 0)
        step_peak = peak if peak > self.before else max(self.sampled, stats.get("allocated_bytes.all.current", 0))
        return step_peak, stats.get("num_alloc_retries")


def human(n: Optional[float]) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def warn(line: str) -> None:
    print(f"oomguard WARNING: {line}", file=sys.stderr, flush=True)
