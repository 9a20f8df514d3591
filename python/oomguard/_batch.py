"""Batches as users have them, split into micro-batches along the leading dimension.

This module owns the batch's structure: a tensor, a tuple/list/namedtuple, a dict (a Hugging
Face collator's dict, `BatchEncoding`, a `ModelOutput`), a dataclass, nested in any way, with non-tensor
leaves (strings, numbers, None) passed to every micro-batch unchanged. Invariant: rows
`a..b` of every tensor leaf, put back into the same structure, are the micro-batch; every
tensor leaf has the same number of rows.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Callable, List, Tuple

import torch

Rebuild = Callable[[List[torch.Tensor]], Any]


class Rows:
    """`batch`'s tensor leaves and how to put slices of them back together."""

    def __init__(self, batch: Any):
        self.leaves: List[torch.Tensor] = []
        self.paths: List[str] = []
        seqs: List[Tuple[str, int]] = []
        self._rebuild = _walk(batch, self.leaves, self.paths, "batch", seqs)
        if not self.leaves:
            raise TypeError(
                f"batch must hold tensors (a tensor, or a tuple, list or dict of them), not {type(batch).__name__} without any"
            )
        self.rows = _rows(self.leaves, self.paths)
        # Lists or arrays without tensors, one entry a row by their length (`lengths` for
        # pack_padded_sequence): passed whole to every micro-batch, so a split says so.
        self._per_row = [p for p, n in seqs if n == self.rows > 1]
        # An inference tensor (a batch made under torch.inference_mode(), as evaluation loops
        # and Lightning's make them) has no version counter: nothing to compare, None.
        self._versions = [None if t.is_inference() else t._version for t in self.leaves]

    def changed(self) -> List[str]:
        """The leaves changed in place since the batch was taken (by `loss_fn`, say)."""
        return [p for t, p, v in zip(self.leaves, self.paths, self._versions) if v is not None and t._version != v]

    def take(self, start: int, stop: int, mark_dynamic: bool = False) -> Any:
        """Rows `start..stop` of every leaf (views, no copy), in the batch's structure. With
        `mark_dynamic`, the leading dimension is marked dynamic for torch.compile, so that
        a new micro-batch size does not compile again."""
        if self._per_row and stop - start < self.rows:
            warnings.warn(
                f"oomguard: {', '.join(self._per_row)} has one entry per row but is not a tensor: every micro-batch "
                f"gets it whole (rows {start}..{stop} of {self.rows} here); make it a tensor to have it split",
                stacklevel=3,
            )
            self._per_row = []
        parts = [t[start:stop] for t in self.leaves]
        if mark_dynamic:
            for p in parts:
                _maybe_mark_dynamic(p)
        return self._rebuild(parts)


def _maybe_mark_dynamic(t: torch.Tensor) -> None:
    """Marks the rows dynamic when torch.compile is in use (dynamo imported: a loop that
    never compiles does not pay for importing it)."""
    dynamo = sys.modules.get("torch._dynamo")
    mark = getattr(dynamo, "maybe_mark_dynamic", None) if dynamo is not None else None
    if mark is not None and t.dim() > 0:
        mark(t, 0)


def _walk(obj: Any, leaves: List[torch.Tensor], paths: List[str], path: str, seqs: List[Tuple[str, int]]) -> Rebuild:
    """`obj`'s tensor leaves into `leaves` (their paths into `paths`) and how to rebuild it;
    sequences without tensors, with their lengths, into `seqs`."""
    n = len(leaves)
    rebuild = _walk_node(obj, leaves, paths, path, seqs)
    if len(leaves) == n and not isinstance(obj, (str, bytes, Mapping)) and hasattr(obj, "__len__"):
        try:
            seqs.append((path, len(obj)))
        except TypeError:  # a 0-dim array
            pass
    return rebuild


def _walk_node(obj: Any, leaves: List[torch.Tensor], paths: List[str], path: str, seqs: List[Tuple[str, int]]) -> Rebuild:
    if isinstance(obj, torch.Tensor):
        i = len(leaves)
        leaves.append(obj)
        paths.append(path)
        return lambda ts: ts[i]
    if isinstance(obj, Mapping):
        items = [(k, _walk(v, leaves, paths, f"{path}[{k!r}]", seqs)) for k, v in obj.items()]
        make = _mapping_maker(obj)
        return lambda ts: make({k: f(ts) for k, f in items})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        fs = [_walk(v, leaves, paths, f"{path}.{name}", seqs) for name, v in zip(obj._fields, obj)]
        kind = type(obj)
        return lambda ts: kind(*[f(ts) for f in fs])
    if isinstance(obj, (tuple, list)):
        fs = [_walk(v, leaves, paths, f"{path}[{i}]", seqs) for i, v in enumerate(obj)]
        kind = tuple if isinstance(obj, tuple) else list
        return lambda ts: kind(f(ts) for f in fs)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj) if f.init]
        walked = [(k, _walk(getattr(obj, k), leaves, paths, f"{path}.{k}", seqs)) for k in names]
        return lambda ts: dataclasses.replace(obj, **{k: f(ts) for k, f in walked})
    return lambda ts: obj  # a string, a number, None: the same in every micro-batch


def _mapping_maker(obj: Mapping) -> Callable[[dict], Any]:
    """How to make a mapping of `obj`'s kind from a dict: a dataclass mapping such as
    `transformers.ModelOutput` by its fields, one whose constructor takes a dict (dict,
    OrderedDict, `BatchEncoding`) by that, anything else as a plain dict."""
    kind = type(obj)
    if kind is dict:
        return lambda d: d
    if dataclasses.is_dataclass(obj):
        return lambda d: kind(**d)
    try:
        kind(dict(obj))
    except Exception:  # noqa: BLE001 - a mapping we cannot rebuild: a plain dict
        return lambda d: d
    return lambda d: kind(d)


def _rows(leaves: List[torch.Tensor], paths: List[str]) -> int:
    for t, p in zip(leaves, paths):
        if t.dim() == 0:
            raise ValueError(f"{p} is a 0-dim tensor: every tensor needs a leading batch dimension")
    first = leaves[0].shape[0]
    for t, p in zip(leaves[1:], paths[1:]):
        if t.shape[0] != first:
            raise ValueError(
                f"the batch's leading dimensions disagree: {paths[0]} has {first} rows, {p} has {t.shape[0]}"
            )
    return first
