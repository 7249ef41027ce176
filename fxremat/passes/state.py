"""Which of a model's parameters and buffers the ops run under a mode write: :class:`StateWrites`.

Version counters cannot tell: ``F.batch_norm`` updates ``running_mean``/``running_var`` in place
without bumping them. :class:`StateWrites` is a ``TorchDispatchMode`` that, for every aten op
whose arguments share storage with a watched tensor, finds the writes
- from the op's schema (arguments annotated ``Tensor(a!)``: in-place ops, ``out=``);
- from the ops that write arguments their schema does not annotate (``native_batch_norm`` and
  its cuDNN/MIOpen kernels update ``running_mean``/``running_var`` in training mode);
- on real tensors, by comparing the watched tensor's value before and after the op (a write of
  an unannotated op not in that list); fake and meta tensors have no values to compare.

:func:`kept_state` uses it around tracing: every buffer and parameter written while the model is
traced is put back afterwards, and the writes are reported with the module whose code made them.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..runtime import put_back

__all__ = ["StateWrites", "StateWrite", "kept_state"]

# Ops that write these arguments (when ``training`` is true) without a Tensor(a!) annotation.
_UNANNOTATED_WRITES = {
    "aten::native_batch_norm": ("running_mean", "running_var"),
    "aten::cudnn_batch_norm": ("running_mean", "running_var"),
    "aten::miopen_batch_norm": ("running_mean", "running_var"),
}


@dataclass(frozen=True)
class StateWrite:
    """One watched tensor written under the mode: its name, the aten op that first wrote it,
    and what ``owner()`` answered then (the module whose code ran, for tracing)."""

    name: str
    op: str
    owner: object = None


def _has_values(t: torch.Tensor) -> bool:
    """Real values to compare: not a fake tensor, not on the meta device."""
    return not isinstance(t, FakeTensor) and t.device.type != "meta"


def _storage_key(t) -> int | None:
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return None
    return t.untyped_storage()._cdata


def _written_args(func, args, kwargs) -> list:
    """The argument values the op's schema (or :data:`_UNANNOTATED_WRITES`) says it writes."""
    schema = func._schema
    unannotated = _UNANNOTATED_WRITES.get(schema.name, ())
    values = {}
    for i, arg in enumerate(schema.arguments):
        values[arg.name] = args[i] if i < len(args) else kwargs.get(arg.name)
    written = [values[a.name] for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if unannotated and values.get("training") is True:
        written += [values[name] for name in unannotated]
    return written


class StateWrites(TorchDispatchMode):
    """Records the watched tensors (``named``: ``(name, tensor)`` pairs) that ops write.

    ``written`` maps each written name to its :class:`StateWrite`, in order of first write;
    ``before`` keeps the value each had before its first write. ``owner`` (optional) is called
    at each write to say who made it. ``clear()`` forgets what was recorded.
    """

    def __init__(self, named, *, owner=None):
        super().__init__()
        self.by_storage: dict[int, list[tuple[str, torch.Tensor]]] = collections.defaultdict(list)
        for name, t in named:
            key = _storage_key(t)
            if key is not None:
                self.by_storage[key].append((name, t))
        self.owner = owner
        self.written: dict[str, StateWrite] = {}
        self.before: dict[str, torch.Tensor] = {}

    def clear(self) -> None:
        self.written.clear()
        self.before.clear()

    def _touched(self, values) -> dict[str, torch.Tensor]:
        found = {}
        for t in tree_flatten(values)[0]:
            for name, watched in self.by_storage.get(_storage_key(t), ()):
                found[name] = watched
        return found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        touched = self._touched((args, kwargs)) if self.by_storage else {}
        if not touched:
            return func(*args, **kwargs)
        declared = set(self._touched(_written_args(func, args, kwargs)))
        # Values before the op: for declared writes (to put back) and, on real tensors, to compare.
        comparable = {n for n, t in touched.items() if _has_values(t)}
        saved = {n: touched[n].detach().clone() for n in declared | comparable if n not in self.written}
        out = func(*args, **kwargs)
        for name, t in touched.items():
            if name in self.written:
                continue
            if name in declared or (name in comparable and not _same(saved[name], t)):
                self.written[name] = StateWrite(name, str(func), self.owner() if self.owner else None)
                self.before[name] = saved[name]
        return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of values (NaNs in the same places count as equal)."""
    if torch.equal(a, b):
        return True
    if not a.is_floating_point() and not a.is_complex():
        return False
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


@contextlib.contextmanager
def kept_state(model: torch.nn.Module, *, owner=None):
    """Run the block with the model's parameters and buffers watched; put back every one that
    the block changed, on exit (also on an exception).

    Yields the :class:`StateWrites` mode; after the block, its ``written`` also lists buffers
    whose value changed without an op it could see (``op`` is then ``"unseen"``), and
    ``before`` holds every changed tensor's previous value.
    """
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    # Buffers are small: keep a copy of each, which also catches writes no aten op made.
    with torch.no_grad():
        copies = {name: b.detach().clone() for name, b in buffers}
    watch = StateWrites(params + buffers, owner=owner)
    try:
        with watch:
            yield watch
    finally:
        for name, b in buffers:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            if module._buffers.get(attr) is not b:  # ``self.calls += 1`` under torch.fx assigns the
                module._buffers[attr] = b  # proxy of the (recorded) in-place op: the tensor goes back
        for name, b in buffers:
            if name not in watch.written and _has_values(b) and not _same(copies[name], b):
                watch.written[name] = StateWrite(name, "unseen")
                watch.before[name] = copies[name]
        tensors = dict(params + buffers)
        with torch.no_grad():
            for name in watch.written:
                put_back(tensors[name], copies.get(name, watch.before[name]))
