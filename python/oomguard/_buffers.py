"""A failed attempt's buffer updates undone: BatchNorm's running statistics and counters, and
any other buffer a forward changes in place.

This module owns the buffers' snapshot. Which buffers change in a step is learnt, not copied
wholesale: those of normalisation layers that track running statistics from the start, then
every buffer whose version counter (bumped by each in-place write) moved during a step. Only
those are copied at a step's start, so a model with large constant buffers (masks, rotary
tables) pays nothing. Invariant: after `undo`, every watched buffer holds what it held when
the step began; a buffer first seen changing in a failed attempt is named, and watched from
then on.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ._memory import warn


class Buffers:
    def __init__(self, module: Optional[torch.nn.Module]):
        self._named: List[Tuple[str, torch.Tensor]] = []
        self._watched: set = set()
        if module is not None:
            seen = set()
            for mod_name, mod in module.named_modules():
                for name, b in mod.named_buffers(recurse=False):
                    if b is None or id(b) in seen:
                        continue
                    seen.add(id(b))
                    if isinstance(mod, torch.nn.modules.batchnorm._NormBase) and mod.track_running_stats:
                        self._watched.add(len(self._named))
                    self._named.append((f"{mod_name}.{name}" if mod_name else name, b))
        self._versions: List[int] = []
        self._saved: Dict[int, torch.Tensor] = {}
        self._warned: set = set()

    def __bool__(self) -> bool:
        return bool(self._named)

    @property
    def watched(self) -> bool:
        """Whether some buffer is known to change in a step."""
        return bool(self._watched)

    def begin(self) -> None:
        """At a step's start: the versions of every buffer, copies of the watched ones."""
        if not self._named:
            return
        self._versions = [b._version for _, b in self._named]
        self._saved = {i: self._named[i][1].detach().clone() for i in self._watched}

    def undo(self) -> None:
        """After a failed attempt: the watched buffers put back (in place, so references
        held elsewhere see it, and their versions are recorded anew)."""
        if not self._named:
            return
        for i, copy in self._saved.items():
            b = self._named[i][1]
            with torch.no_grad():
                b.copy_(copy)
            self._versions[i] = b._version
        for i in self._moved():
            if i not in self._saved:
                self._watched.add(i)
                if i not in self._warned:
                    self._warned.add(i)
                    warn(
                        f"buffer {self._named[i][0]} changed in a failed attempt and could not be put back; "
                        "it is copied at every step's start from now on"
                    )
        for i in self._watched - set(self._saved):
            self._saved[i] = self._named[i][1].detach().clone()
            self._versions[i] = self._named[i][1]._version

    def end(self) -> None:
        """After a step that succeeded: buffers it changed are watched from the next step."""
        if not self._named:
            return
        self._watched.update(self._moved())
        self._saved = {}

    def _moved(self) -> List[int]:
        return [i for i, (_, b) in enumerate(self._named) if b._version != self._versions[i]]
