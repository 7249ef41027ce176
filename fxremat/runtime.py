"""What the emitted code calls at run time: :func:`recompute`.

``recompute(segment, *inputs)`` runs a segment under non-reentrant
``torch.utils.checkpoint.checkpoint``: its interior is dropped after the forward and recomputed
just before its backward, with the RNG state (dropout masks; segments emitted with ``rng=False``
draw none; the model's own ``torch.Generator``s too, :func:`module_generators`) and autocast state
of the original forward. Buffers the segment mutates (BatchNorm running statistics, ``num_batches_tracked``),
named in the call (``restore=``, so they are part of the emitted code and travel with it through
``copy.deepcopy``), are restored after the recomputation: they are updated exactly once per step.
Buffers it reads that the step mutates (``reads=``: a step counter, an EMA read back) hold the
values of its forward while it is recomputed. The recomputation reads the buffer tensors its
forward read: each buffer slot of the segment's modules (:func:`buffer_slots`) holds, while it is
recomputed, the tensor it held when the forward ran (``torch.func.functional_call``'s buffers, a
tensor a leaf module assigned anew), and what it holds now afterwards.

:func:`attribute_bindings` and :func:`rebind` keep the ``get_attr`` values of GraphModules
derived from a model (parameters and buffers used outside a submodule call, held by copies of
the model's attribute paths) identical to the model's own: ``.to()``/``.half()`` replace buffers,
``load_state_dict(assign=True)`` and FSDP2 replace parameters, and a stale copy would silently
train the old tensors.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

__all__ = ["recompute", "attribute_bindings", "rebind", "parameter_slots", "buffer_slots", "put_back",
           "module_generators"]


def put_back(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``tensor.copy_(value)`` (its callers hold ``no_grad``), resized first where it changed size since
    ``value`` was taken: a quantization observer's ``min_val`` has shape ``[0]`` until its first
    forward (``prepare_qat`` then compile: "The size of tensor a (8) must match ... (0)")."""
    if tensor.shape != value.shape:
        tensor.resize_(value.shape)
    tensor.copy_(value)


_GENERATORS: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def module_generators(module: torch.nn.Module) -> list[torch.Generator]:
    """The ``torch.Generator`` objects of ``module`` other than torch's default ones: attributes of
    its submodules (``self.gen = torch.Generator()``) and arguments of its graphs' calls
    (``torch.rand(shape, generator=self.gen)`` traced: the object is a constant of the node).
    checkpoint saves and restores the default generators only: a mask drawn from such a generator
    was drawn again, differently, by the recomputation (silently wrong gradients)."""
    found: dict[int, torch.Generator] = {}
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Generator):
                found[id(value)] = value
        if isinstance(m, fx.GraphModule):
            for node in m.graph.nodes:
                fx.node.map_aggregate((node.args, node.kwargs), lambda a: found.setdefault(id(a), a)
                                      if isinstance(a, torch.Generator) else a)
    return list(found.values())


def _segment_generators(segment: torch.nn.Module) -> list[torch.Generator]:
    """:func:`module_generators` of a segment, once."""
    gens = _GENERATORS.get(segment)
    if gens is None:
        gens = _GENERATORS[segment] = module_generators(segment)
    return gens


@dataclass(frozen=True)
class _BufferSlots:
    """Where a segment's buffers sit: ``slots``, ``(submodule._buffers, name)`` of every buffer
    slot of its modules; ``reads`` and ``restore``, the indices in ``slots`` of those its call
    names as read back (``reads=``) and as written (``restore=``)."""

    slots: tuple[tuple[dict, str], ...]
    reads: tuple[int, ...]
    restore: tuple[int, ...]


class _Snapshot:
    """The forward's context of one checkpointed call: takes the tensors in the segment's buffer
    slots as its forward finds them (``torch.func.functional_call``'s, or a tensor a leaf module
    assigned anew, ``self.count = self.count + 1``), the values of those the step also mutates
    (``reads=``), and the parameters it read (the tensors in its modules' parameter slots, with
    their versions, when its forward returns)."""

    def __init__(self, segment: torch.nn.Module, slots: _BufferSlots):
        self.segment = segment
        self.slots = slots
        self.buffers: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor] = []
        self.params: list[tuple[dict, str, torch.Tensor, int, str]] = []
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []

    def __enter__(self):
        self.buffers = [table.get(name) for table, name in self.slots.slots]
        with torch.no_grad():
            self.values = [self.buffers[i].clone() for i in self.slots.reads]
        self.generators = [(g, g.get_state()) for g in _segment_generators(self.segment)]

    def __exit__(self, *exc):
        self.params = [(slots, name, slots[name], slots[name]._version, path)
                       for slots, name, path in _parameter_slots(self.segment)]
        return False


class _Recomputation:
    """The recomputation's context of one checkpointed call: the segment's buffer slots hold the
    tensors its forward found there (:class:`_Snapshot`), those it reads back with their values of
    the forward; afterwards the slots hold again what they held before, and the tensors it wrote
    (``restore=``) and read back their values of before. Under ``torch.func.functional_call`` with
    buffers passed in, the recomputation updated the module's own running statistics (all 18 of
    a ResNet-ish net's) and restored the call's. Its modules hold the parameters the forward read:
    a call under ``torch.func.functional_call`` (MAML's fast weights, per-sample gradients) swapped
    its own in for the forward only, and the recomputation read the module's (silently wrong
    gradients). Parameter objects are left to their owner: FSDP2 puts its unsharded ones back for
    the backward itself (swapped in by fxremat, they mixed with its sharded ones). A parameter
    written in place since the forward (an optimizer step before the backward) is refused, as
    eager PyTorch refuses it. Re-entered for each recomputation (``retain_graph=True``, a
    ``create_graph=True`` gradient penalty)."""

    def __init__(self, snapshot: _Snapshot):
        self.snapshot = snapshot
        self.held: list[tuple] = []

    def _written(self) -> list[torch.Tensor]:
        """The forward's tensors of the slots read back and written, each once."""
        found = {}
        for i in self.snapshot.slots.reads + self.snapshot.slots.restore:
            t = self.snapshot.buffers[i]
            if t is not None:
                found.setdefault(id(t), t)
        return list(found.values())

    def __enter__(self):
        swapped = []
        for slots, name, param, version, path in self.snapshot.params:
            now = slots.get(name)
            if now is not param:
                # a tensor put in for the forward only (functional_call's); a Parameter object that
                # was swapped is the module's own management (FSDP2 unshards for the backward itself)
                if not isinstance(param, torch.nn.Parameter):
                    swapped.append((slots, name, now))
                    slots[name] = param
            elif param._version != version:
                raise RuntimeError(
                    f"fxremat.recompute: parameter {path!r} was written in place after the forward read it (version "
                    f"{version} -> {param._version}), and the backward recomputes from it. Written between the "
                    f"forward and the backward (an optimizer step), eager PyTorch refuses this too (\"modified by an "
                    f"inplace operation\"): call backward before changing parameters. Written by the model's own "
                    f"code in forward (a leaf module that decays or clips its weight), which fxremat runs again when "
                    f"it recomputes: make that write in the training loop instead")
        slots, forward = self.snapshot.slots, self.snapshot.buffers
        occupants = [table.get(name) for table, name in slots.slots]
        for (table, name), t in zip(slots.slots, forward):
            table[name] = t
        with torch.no_grad():
            self.held.append((occupants, [(b, b.clone()) for b in self._written()], swapped,
                              [(g, g.get_state()) for g, _ in self.snapshot.generators]))
            for i, value in zip(slots.reads, self.snapshot.values):
                put_back(forward[i], value)
        for g, state in self.snapshot.generators:  # the module's own generators draw as in the forward
            g.set_state(state)

    def __exit__(self, *exc):
        occupants, values, swapped, generators = self.held.pop()
        with torch.no_grad():
            for b, value in values:
                put_back(b, value)
        for (table, name), t in zip(self.snapshot.slots.slots, occupants):
            if table.get(name) is not t:
                table[name] = t
        for slots, name, param in swapped:
            slots[name] = param
        for g, state in generators:
            g.set_state(state)
        return False


_NESTED = re.compile(r"^(seg_\d+\.)+")  # the path of a nested segment in its parent: not the model's
_SLOTS: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def parameter_slots(module: torch.nn.Module) -> list[tuple[dict, str, str]]:
    """``(submodule._parameters, name, qualified name)`` of every parameter slot of ``module``:
    read through them, a replaced parameter (``load_state_dict(assign=True)``, FSDP2,
    ``torch.func.functional_call``) is the one in place now. (A nested segment's path in its
    parent, ``seg_0.``, is left out of the name.)"""
    return [(m._parameters, name, _NESTED.sub("", f"{path}.{name}" if path else name))
            for path, m in module.named_modules() for name, p in m._parameters.items() if p is not None]


def _parameter_slots(segment: torch.nn.Module) -> list[tuple[dict, str, str]]:
    """:func:`parameter_slots` of a segment, once (walking its modules each step cost ~1 µs a module)."""
    slots = _SLOTS.get(segment)
    if slots is None:
        slots = _SLOTS[segment] = parameter_slots(segment)
    return slots


def buffer_slots(module: torch.nn.Module) -> list[tuple[dict, str]]:
    """``(submodule._buffers, name)`` of every buffer slot of ``module`` and its submodules (each
    module once): read through them, a buffer swapped in (``torch.func.functional_call``) or
    assigned anew (``self.count = self.count + 1``) is the one in place now."""
    return [(m._buffers, name) for m in module.modules() for name, b in m._buffers.items() if b is not None]


def _named_slots(segment: torch.nn.Module, name: str) -> list[tuple[dict, str]]:
    """The slot of the buffer ``name`` of ``segment``, or the slots of the buffers of its submodule ``name``."""
    prefix, _, last = name.rpartition(".")
    owner = segment.get_submodule(prefix)
    if last in owner._buffers:
        return [(owner._buffers, last)]
    sub = segment.get_submodule(name)
    return [(sub._buffers, n) for n, b in sub._buffers.items() if b is not None]


_BUFFER_SLOTS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _segment_buffer_slots(segment: torch.nn.Module, restore: tuple[str, ...], reads: tuple[str, ...]) -> _BufferSlots:
    """The :class:`_BufferSlots` of a segment's call, once (found by walking its modules)."""
    cached = _BUFFER_SLOTS.get(segment)
    if cached is None:
        cached = _BUFFER_SLOTS[segment] = {}
    found = cached.get((restore, reads))
    if found is None:
        slots = buffer_slots(segment)
        read_back = _slot_indices(segment, reads, slots)  # (may append to slots)
        written = _slot_indices(segment, restore, slots)
        found = cached[(restore, reads)] = _BufferSlots(tuple(slots), read_back, written)
    return found


def _slot_indices(segment: torch.nn.Module, names: tuple[str, ...], slots: list[tuple[dict, str]]) -> tuple[int, ...]:
    """The indices in ``slots`` of the slots of ``names`` (:func:`_named_slots`), each once; a slot
    not in ``slots`` (empty, ``None``, when the segment was first called) is appended to it."""
    index = {(id(table), name): i for i, (table, name) in enumerate(slots)}
    out = []
    for n in names:
        for table, name in _named_slots(segment, n):
            if (id(table), name) not in index:
                index[(id(table), name)] = len(slots)
                slots.append((table, name))
            out.append(index[(id(table), name)])
    return tuple(dict.fromkeys(out))


def _contexts(segment: torch.nn.Module, restore: tuple[str, ...], reads: tuple[str, ...]):
    snapshot = _Snapshot(segment, _segment_buffer_slots(segment, restore, reads))
    return snapshot, _Recomputation(snapshot)


def recompute(segment: torch.nn.Module, *inputs, restore: tuple[str, ...] = (), reads: tuple[str, ...] = (),
              rng: bool = True):
    """Run ``segment(*inputs)``, keeping only its inputs and outputs for the backward;
    ``restore``: what it mutates, put back after its recomputation — qualified names (in
    ``segment``) of buffers, or of submodules all of whose own buffers it mutates (a BatchNorm);
    ``reads``: buffers it reads that the step also mutates (a step counter), which its
    recomputation reads with the values they had when it ran in the forward;
    ``rng=False``: the segment draws no random numbers, so its recomputation need not save and
    restore the RNG states (the emitted code says so where profiling found no random op).

    Under ``torch.compile`` Dynamo turns the checkpoint into its own higher-order op, which takes
    no custom ``context_fn``; none is needed there, since AOTAutograd recomputes the functionalized
    segment in the backward graph and applies buffer mutations once, in the forward.
    """
    if torch.compiler.is_compiling():
        return checkpoint(segment, *inputs, use_reentrant=False, preserve_rng_state=rng)
    return checkpoint(segment, *inputs, use_reentrant=False, preserve_rng_state=rng,
                      context_fn=lambda: _contexts(segment, restore, reads))


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
