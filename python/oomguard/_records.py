"""What the Python guard writes: metrics.jsonl in the runtime's schema (docs/reports-and-
metrics.md) and the lines it prints.

This module owns the records' fields. Invariant: each record is one JSON line, flushed as
written; a run resumed at step k first moves the records of steps >= k aside
(`oomguard._native.metrics_resume`, the runtime's own rule), and so does a run started afresh
in a directory an earlier run wrote (its first record's step, 0: a trial a sweep reruns from
scratch), so metrics.jsonl reads as one uninterrupted run and nothing written is lost; a
write that fails warns once and never stops training.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Dict, Optional, Tuple

from . import _trackers
from ._memory import warn
from ._native import metrics_resume


# metrics.jsonl files this process writes: how many writers each has open (a second guard
# writing beside one still open, two models in one loop, sets nothing aside at its start),
# and how often it was rewritten whole (a writer whose handle is older reopens it).
_WRITERS: Dict[str, int] = {}
_REWRITES: Dict[str, int] = {}


def finite(x: float) -> Optional[float]:
    """NaN and infinities as null, as the runtime writes them."""
    return x if math.isfinite(x) else None


class Records:
    """metrics.jsonl in `run_dir` (rank 0 writes; other ranks hold None)."""

    def __init__(self, run_dir: Optional[str], rank: int, trackers: Optional[list] = None, where: str = ""):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl") if run_dir else None
        self._file = None
        self._failed = False
        self.trackers = None
        # Until a resume or the first record says where this run starts.
        self._settled = True
        self._key: Optional[str] = None
        self._rewrites = 0
        if trackers and not run_dir:
            raise ValueError(f"{where} names trackers, which log a run's records: give the guard a run_dir (or set OOMGUARD_RUN_DIR)")
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            if rank == 0:
                self._key = os.path.realpath(self.path)
                self._settled = _WRITERS.get(self._key, 0) > 0
                _WRITERS[self._key] = _WRITERS.get(self._key, 0) + 1
                self._open()
                if trackers:
                    self.trackers = _trackers.Trackers(trackers, run_dir, None, where)

    def _open(self) -> None:
        try:
            self._file = open(self.path, "a", buffering=1)
            self._rewrites = _REWRITES.get(self._key, 0)
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        if not self._failed:
            self._failed = True
            warn(f"cannot write {self.path}: {e}; training goes on without its records")
        self._file = None

    def write(self, record: dict, keep_none: bool = False) -> None:
        """One record; its None fields are left out unless `keep_none`."""
        if self._file is None:
            return
        if not self._settled and isinstance(record.get("step"), int):
            # The first record of a run not resumed: an earlier run's records of this step
            # and later (all of them, at step 0) go to metrics.replaced.jsonl.
            self.resumed(record["step"])
        if self._file is not None and self._rewrites != _REWRITES.get(self._key, 0):
            # Another writer in this process rewrote the file (a resume): this handle's is gone.
            self._file.close()
            self._open()
        if self._file is None:
            return
        if not keep_none:
            record = {k: v for k, v in record.items() if v is not None}
        try:
            # A path-like value (a checkpoint's Path) as its text.
            self._file.write(json.dumps(record, default=os.fspath) + "\n")
        except (OSError, TypeError, ValueError) as e:
            if not isinstance(e, OSError):
                warn(f"a record for {self.path} is not JSON ({e}); left out: {record!r}")
                return
            self._fail(e)
            return
        if self.trackers is not None:
            self.trackers.log(record)

    def close(self) -> None:
        """Ends the trackers' runs (metrics.jsonl needs nothing: every line is flushed)."""
        if self.trackers is not None:
            self.trackers.close()
        if self._key is not None:
            _WRITERS[self._key] -= 1
            self._key = None

    def resumed(self, next_step: int) -> int:
        """The run goes on at `next_step`: later records move to metrics.replaced.jsonl."""
        self._settled = True
        if self._file is None:
            return 0
        try:
            self._file.close()
            moved = metrics_resume(self.run_dir, next_step)
        except OSError as e:
            self._fail(e)
            return 0
        if moved:
            _REWRITES[self._key] = _REWRITES.get(self._key, 0) + 1
        self._open()
        return moved


def membership(raw: Optional[str], metrics: Optional[str]) -> Optional[Tuple[dict, Optional[int]]]:
    """OOMGUARD_MEMBERSHIP (the launcher's description of an elastic job's change), and the
    last step the run's metrics recorded before this round; None outside such a round, or
    when unreadable."""
    if not raw or not metrics:
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


def membership_record(change: dict, last: Optional[int], step: int) -> dict:
    return {
        "event": "membership",
        "step": step,
        "old_world": change["old_world"],
        "new_world": change["new_world"],
        "cause": change["cause"],
        "seconds": max(0.0, time.time() - change["detected_unix_ms"] / 1000),
        "steps_recomputed": 0 if last is None else max(0, last + 1 - step),
        "source": "checkpoint",  # the script's own: it resumed itself
    }
