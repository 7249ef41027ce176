"""What the emitted code calls at run time: :func:`recompute`.

``recompute(segment, *inputs)`` runs a segment under non-reentrant
``torch.utils.checkpoint.checkpoint``: its interior is dropped after the forward and recomputed
just before its backward, with the RNG state (dropout masks; segments emitted with ``rng=False``
draw none) and autocast state of the original forward. Buffers the segment mutates (BatchNorm running statistics, ``num_batches_tracked``),
named in the call (``restore=``, so they are part of the emitted code and travel with it through
``copy.deepcopy``), are restored after the recomputation: they are updated exactly once per step.

:func:`attribute_bindings` and :func:`rebind` keep the ``get_attr`` values of GraphModules
derived from a model (parameters and buffers used outside a submodule call, held by copies of
the model's attribute paths) identical to the model's own: ``.to()``/``.half()`` replace buffers,
``load_state_dict(assign=True)`` and FSDP2 replace parameters, and a stale copy would silently
train the old tensors.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

__all__ = ["recompute", "attribute_bindings", "rebind"]


@contextlib.contextmanager
def _restore_buffers(segment: torch.nn.Module, names: tuple[str, ...]):
    buffers = [b for name in names for b in _named(segment, name)]
    with torch.no_grad():
        saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, old in zip(buffers, saved):
                b.copy_(old)


def _named(segment: torch.nn.Module, name: str) -> list[torch.Tensor]:
    """The buffer ``name`` of ``segment``, or every buffer of its submodule ``name``."""
    prefix, _, last = name.rpartition(".")
    owner = segment.get_submodule(prefix)
    if last in owner._buffers:
        return [owner._buffers[last]]
    return list(segment.get_submodule(name).buffers(recurse=False))


def _contexts(segment: torch.nn.Module, restore: tuple[str, ...]):
    return contextlib.nullcontext(), _restore_buffers(segment, restore)


def recompute(segment: torch.nn.Module, *inputs, restore: tuple[str, ...] = (), rng: bool = True):
    """Run ``segment(*inputs)``, keeping only its inputs and outputs for the backward;
    ``restore``: what it mutates, put back after its recomputation — qualified names (in
    ``segment``) of buffers, or of submodules all of whose own buffers it mutates (a BatchNorm);
    ``rng=False``: the segment draws no random numbers, so its recomputation need not save and
    restore the RNG states (the emitted code says so where profiling found no random op).

    Under ``torch.compile`` Dynamo turns the checkpoint into its own higher-order op, which takes
    no custom ``context_fn``; none is needed there, since AOTAutograd recomputes the functionalized
    segment in the backward graph and applies buffer mutations once, in the forward.
    """
    if torch.compiler.is_compiling():
        return checkpoint(segment, *inputs, use_reentrant=False, preserve_rng_state=rng)
    return checkpoint(segment, *inputs, use_reentrant=False, preserve_rng_state=rng,
                      context_fn=lambda: _contexts(segment, restore))


def attribute_bindings(gm: fx.GraphModule, model: torch.nn.Module) -> tuple:
    """``(holder, owner, name)`` for every ``get_attr`` of ``gm`` and of its own GraphModule
    descendants (nested segments) whose holding module is a copy (``holder``) of a module of ``model`` (``owner``)."""
    own = {id(m) for m in model.modules()}
    graphs = [m for m in gm.modules() if isinstance(m, fx.GraphModule) and id(m) not in own]
    found = {}
    for g in graphs:
        for node in g.graph.nodes:
            if node.op != "get_attr":
                continue
            prefix, _, name = node.target.rpartition(".")
            holder, owner = g.get_submodule(prefix), _submodule_or_none(model, prefix)
            if owner is not None and holder is not owner and hasattr(owner, name):
                found[(id(holder), name)] = (holder, owner, name)
    return tuple(found.values())


def _submodule_or_none(model: torch.nn.Module, path: str):
    try:
        return model.get_submodule(path)
    except AttributeError:  # a module of the emitted graph only (seg_i)
        return None


def rebind(bindings) -> None:
    """Point every binding's ``holder.name`` at the model's current ``owner.name``."""
    for holder, owner, name in bindings:
        live = getattr(owner, name)
        if getattr(holder, name) is live:
            continue
        holder._parameters.pop(name, None)
        holder._buffers.pop(name, None)
        if isinstance(live, torch.nn.Parameter):
            holder._parameters[name] = live
        elif isinstance(live, torch.Tensor):
            holder._buffers[name] = live
        else:
            holder.__dict__[name] = live
