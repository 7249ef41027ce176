"""Profile every call node of a traced module on example inputs.

:func:`profile` runs the graph once through an FX interpreter and records, per node,
- ``out_bytes``: bytes of new storages its output creates (0 for views, which alias ``root``);
- what autograd saves for its backward, measured with ``saved_tensors_hooks`` and deduplicated
  by storage: the producers of saved inputs, whether it saves its own output, and
  ``extra_bytes`` of buffers that alias nothing (dropout masks, pooling indices, BN statistics);
- ``fwd_transient_bytes``: memory it needs while running beyond what stays allocated after (on
  CUDA the larger of the tensors' account and the allocator's, which also sees the workspaces
  cuDNN and cuBLAS take: :class:`fxremat.measure.AllocatorPeak`; likewise the backward's);
- ``bwd_transient_bytes``: memory its backward needs beyond the gradients it hands its inputs
  (temporaries of LayerNorm, GELU, attention; its parameters' gradients before they are
  accumulated), measured by running the node's forward again on detached inputs and its backward
  alone under the tracker;
- ``held_bytes``: tensors its call leaves on its module as plain attributes (neither parameters
  nor buffers) that are still there when the forward ends: a forward pre-hook's weight
  (``torch.nn.utils.prune``'s ``weight_orig * weight_mask``, the hook-based ``weight_norm`` and
  ``spectral_norm``), made again at every call and held by the module until its next one, across
  the step's end (not in ``extra_bytes`` where its backward saves it too);
- ``grad_bytes``: the size of its output's gradient (the tensor's size, views included);
- ``grad_alias``: whether its backward hands its inputs views of its output's gradient
  (``cat``, ``stack``, same-shape ``add``, ``view``/``reshape``/``permute``, ``sum``: an
  expand) instead of new buffers, in every autograd node the call creates (``narrow``/``slice``
  allocate their input's size; a ``Linear`` on 3-d inputs ends in a view but its ``addmm``
  allocates);
- ``uses_rng``: whether it draws random numbers (dropout masks): an aten op tagged
  ``nondeterministic_seeded`` ran (also on fake tensors), or the CPU/CUDA generators moved; such
  nodes must keep their relative order, or the RNG stream hands them other masks, and only the
  recomputed segments holding one restore the RNG state;
- its forward and backward cost: median wall time over repeated training steps (``"measured"``,
  each node timed where the step runs it, CUDA kernels waited for, the forwards then scaled to
  the forward timed whole where that is shorter: a step overlaps launches and kernels; the
  backward of a node is the time from its output's ``grad_fn`` starting to the next node's
  starting), FLOPs plus a memory-traffic term (``"flops"``, works under
  ``FakeTensorMode``; backward twice the forward), FLOPs plus an eighth of that term
  (``"compiled"``: the step runs under Inductor, which fuses pointwise ops into the kernels
  around them, so recomputing them costs little while a matmul or convolution costs its FLOPs)
  or 1 and 2 (``"uniform"``).
Parameters, buffers and graph inputs are outside the budget and are never attributed to nodes.
Buffers and the RNG state are restored afterwards, so profiling leaves the model untouched.
User hooks (module and global forward/backward hooks not defined inside torch) do not run while
profiling (:func:`user_hooks_disabled`): the nodes run many times here, and a hook's side effects
(appending features to a list, counting calls) must happen in training steps only. Hooks defined
by torch itself (FSDP2's all-gather, ``weight_norm``) are part of the computation and still run.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import statistics
import time
import warnings
import weakref
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only
from torch.utils.flop_counter import FlopCounterMode

from ..measure import AllocatorPeak, LiveStorageTracker
from ..records import PLAN_COST_MODELS
from ..runtime import module_generators, put_back
from .state import StateWrites
from .trace import CALL_OPS, is_library_hook, module_of, python_rng_put_back, unpacked, written_inputs

__all__ = ["NodeCost", "GraphCosts", "PlainForward", "profile", "forward_bytes", "user_hooks_disabled",
           "COST_MODELS"]

log = logging.getLogger("fxremat")

COST_MODELS = PLAN_COST_MODELS
# FLOP-equivalents charged per byte read or written, so memory-bound ops (BN, ReLU, pooling)
# are not free under cost_model="flops" (roughly an accelerator's flop/byte balance).
FLOPS_PER_BYTE = 4
# cost_model="compiled" (a step compiled by Inductor): a recomputed pointwise or reduction op is
# fused into a kernel that reads its inputs anyway, so it is charged this fraction of its traffic;
# matrix products and convolutions keep their FLOPs.
FUSED_TRAFFIC = 1 / 8


@dataclass(frozen=True)
class NodeCost:
    """Measured costs of one FX call node (names are FX node names)."""

    name: str
    out_bytes: int
    root: str
    saved_inputs: tuple[str, ...]
    saves_output: bool
    extra_bytes: int
    fwd_transient_bytes: int
    grad_bytes: int
    param_grad_bytes: int
    fwd_cost: float
    flops: int
    module: str
    mutated_buffers: tuple[str, ...] = ()
    grad_alias: bool = False
    tensor_output: bool = True
    bwd_cost: float = 0.0
    uses_rng: bool = False
    bwd_transient_bytes: int = 0
    params: tuple[str, ...] = ()
    saved_count: int = 0  # tensors its forward hands autograd to save (each a pack/unpack in a checkpoint)
    saved_bytes: int = 0  # ... their bytes, parameters and buffers left out (what a recomputation makes again)
    cast_params: tuple[tuple[str, int], ...] = ()  # (leaf, bytes of its cast) it read through autocast's cache: a
    # parameter by its name or an input that requires grad by its placeholder's (made by this call or, read again from
    # the cache, by an earlier one; the first reader makes it)
    cast_saved: tuple[str, ...] = ()  # ... the leaves among them whose cast its backward saves (not in extra_bytes)
    bwd_unpack_bytes: int = 0  # what its backward holds when it first unpacks a saved tensor (see _backward_transient)
    bwd_released_bytes: int = 0  # ... the gradient it was handed that it lets go before its peak or that unpack
    held_bytes: int = 0  # tensors its call left on its module as attributes, held there until its next call
    bwd_tail_bytes: int = 0  # what its backward holds once its own op let go of what it saved (a hook weight's path)
    bwd_freed_inputs: tuple[str, ...] = ()  # producers of saved inputs its backward lets go before its peak
    loss_held_bytes: int = 0  # a graph output's log-softmax in the assumed loss (0: none; see _loss_part)
    loss_target_bytes: int = 0  # ... and that cross-entropy's int64 class-index target
    loss_cast_bytes: int = 0  # ... and the copy of the output in the loss's dtype it makes first (bf16 output)
    unsaved_item_bytes: int = 0  # items of its tuple output that no backward saves (see settled_costs)
    grad_numel: int = 0  # elements of what grad_bytes counts: one for a returned loss, whatever its dtype


@dataclass(frozen=True)
class GraphCosts:
    """Per-node costs of a graph, in graph order, and the cost of one plain training step."""

    nodes: tuple[NodeCost, ...]
    step_cost: float
    cost_model: str
    cost_unit: str
    mechanism: "CheckpointCosts | None" = None  # the checkpoint mechanism's own costs (measured clocks only)


def _storage_key(t: torch.Tensor):
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return None
    return t.untyped_storage()._cdata


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _unread_outputs(n: fx.Node, out) -> set[int]:
    """Storage keys of the tensors in ``n``'s tuple output that no node reads (every user takes an
    element by index, or unpacks it: :func:`_items_read`). One its backward saves is a buffer
    beyond its values, held to its backward alone, as pooling indices are: ``values, _ =
    x.max(dim)``'s indices, where its values are read and let go (as part of the value the node's
    output was, it was held while the indices were: +3.0% on the plain peak of Hugging Face
    Hiera's pooling)."""
    return {_storage_key(t) for t in _tensors(out)} - {_storage_key(t) for t in _read_tensors(n, out)} - {None}


def _read_tensors(n: fx.Node, out) -> list[torch.Tensor]:
    """The tensors of ``n``'s output that some node reads, the ones a gradient reaches in the step
    (an item dropped, as ``y, _ = mha(x, x, x)`` drops the attention weights, gets none: seeded,
    its backward path counted, nn.MultiheadAttention's plain peak was predicted +16.6%)."""
    read = _items_read(n) if isinstance(out, (tuple, list)) and out else None
    if read is None:
        return _tensors(out)
    read = {i % len(out) for i in read if -len(out) <= i < len(out)}  # (``n[-1]``)
    return _tensors([t for i, t in enumerate(out) if i in read])


def _items_read(n: fx.Node) -> set[int] | None:
    """The indices of the items of ``n``'s tuple that some node reads: ``n[i]`` read, or unpacked
    (``a, b = n``, :func:`~fxremat.passes.trace.unpacked`) and read; ``None`` where a node takes
    the whole tuple."""
    read = set()
    for u in n.users:
        if u.op == "call_function" and u.target is unpacked:
            items = _items_read(u)
            if items is None:
                return None
            read |= items
        elif u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int):
            if u.users:
                read.add(u.args[1])
        else:
            return None
    return read


class _SeededOps(TorchDispatchMode):
    """Notes whether an op that draws from a random number generator ran (aten's
    ``nondeterministic_seeded`` tag: dropout, bernoulli, rand*, randperm, multinomial, rrelu):
    on fake tensors too, and whatever module or function called it."""

    def __init__(self):
        super().__init__()
        self.drew = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.drew = True
        return func(*args, **(kwargs or {}))


def _rng_states():
    """The CPU and (where initialised) CUDA generators' states, to see whether a call drew."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])


def _same_states(a, b) -> bool:
    return torch.equal(a[0], b[0]) and len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


class _SavedRecorder:
    """saved_tensors_hooks pack hook recording (storage key, nbytes) of every saved tensor, and
    how many tensors were packed with how many bytes (``stored``: storages left out of the bytes,
    the parameters and buffers)."""

    def __init__(self, stored=frozenset()):
        self.saved: dict[int, int] = {}
        self.stored = stored
        self.count = 0
        self.nbytes = 0

    def pack(self, t):
        key = _storage_key(t)
        self.count += 1
        if key is not None:
            self.saved[key] = t.untyped_storage().nbytes()
            if key not in self.stored:
                self.nbytes += t.numel() * t.element_size()
        # A detached alias (same storage): keeping ``t`` itself would make the cycle
        # tensor -> grad_fn -> saved tensor, which runs through C++ where gc cannot free it.
        return t.detach()

    @staticmethod
    def unpack(t):
        return t


class _AutocastCasts(TorchDispatchMode):
    """The casts that autocast keeps in its cache (``aten._to_copy`` from float32 to another dtype,
    while autocast runs with its cache on, of a leaf that requires grad, not a view: a parameter, or
    an input that requires grad, ``leaf_keys``): they stay alive until the autocast region exits,
    however soon their readers are done, so a recomputed segment does not let them go (1.49x the
    budget at "min" on a net with large weights under bf16 autocast where they were counted as
    freed; 1.17x on a Linear whose input requires grad, where only parameters' casts were).
    Storage key -> bytes, per node."""

    def __init__(self, leaf_keys):
        super().__init__()
        self.leaf_keys = leaf_keys
        self.made: dict = {}
        self.leaf_of: dict = {}  # cast's storage key -> its leaf's
        self.dtype_of: dict = {}  # cast's storage key -> its dtype
        self.storages: list[weakref.ref] = []  # weak references to the casts' storages
        # (read here: inside a dispatch mode autocast reads as off)
        self.caching = torch.is_autocast_cache_enabled() and any(
            torch.is_autocast_enabled(d) for d in ("cpu", "cuda", "xpu", "mps") if torch.amp.is_autocast_available(d))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (self.caching and func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor)
                and args[0].requires_grad and args[0].is_leaf and not args[0]._is_view()
                and _storage_key(args[0]) in self.leaf_keys
                and args[0].dtype == torch.float32 and out.dtype != torch.float32):
            self.made[_storage_key(out)] = out.untyped_storage().nbytes()
            self.leaf_of[_storage_key(out)] = _storage_key(args[0])
            self.dtype_of[_storage_key(out)] = out.dtype
            self.storages.append(weakref.ref(out.untyped_storage()))
        return out


def _loss_part(out) -> tuple[int, int, int]:
    """What the loss a plain step is assumed to take holds for a graph output ``out``: a
    cross-entropy of each of its floating tensors of two or more dimensions that takes a gradient,
    classes along dim 1 (:func:`fxremat.measure.default_loss`). ``(log-softmax bytes, target
    bytes, cast bytes)``: the log-softmax is in the dtype the loss computes in (under autocast a
    bf16 output's is float32: autocast runs ``cross_entropy`` in float32, on a copy of the output
    in that dtype, the cast bytes, alive until the log-softmax is made), the target is int64 class
    indices."""
    held = target = cast = 0
    for t in _tensors(out):
        if t.requires_grad and t.is_floating_point() and t.dim() >= 2:
            probe = torch.nn.functional.cross_entropy(torch.zeros((1, 1), dtype=t.dtype, device=t.device),
                                                      torch.zeros(1, dtype=torch.long, device=t.device))
            held += t.numel() * probe.element_size()
            target += t.numel() // t.shape[1] * 8 if t.shape[1] else 0
            cast = max(cast, t.numel() * probe.element_size() if probe.dtype != t.dtype else 0)
    return held, target, cast


def _noting_storages(refs: list):
    """A pack hook that saves a detached alias (see :class:`_SavedRecorder`) and appends a weak
    reference to its storage to ``refs``."""

    def pack(t):
        if t.layout == torch.strided:
            refs.append(weakref.ref(t.untyped_storage()))
        return t.detach()

    return pack


def _track_held(tracker: LiveStorageTracker, refs, left_out, fake: bool) -> int:
    """Have ``tracker`` count the storages of ``refs`` (weak references) that are still alive,
    those keyed in ``left_out`` left out (values: a node's outputs, inputs, parameters), until
    they are freed; their bytes. (A function, so that no local holds one.)"""
    held = {s._cdata: s for s in (ref() for ref in refs) if s is not None and s._cdata not in left_out}
    for s in held.values():
        tracker.track_storage(s, fake=fake)
    return sum(s.nbytes() for s in held.values())


@contextlib.contextmanager
def _autocast_cache_off():
    """Autocast without its cache: each cast of a parameter is held by what reads it only, as
    in the step's backward, which runs after the forward's autocast region (and its cache) is
    gone."""
    on = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(on)


_PERMUTING_METHODS = frozenset({"transpose", "permute", "t", "swapaxes", "swapdims", "movedim"})
_PERMUTING_FUNCTIONS = frozenset({torch.transpose, torch.permute, torch.t, torch.swapaxes, torch.swapdims,
                                  torch.movedim, torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
                                  torch.ops.aten.t.default})


def _permuted_reader(n: fx.Node):
    """Where ``n``'s only reader is a transpose or permutation of it (with constant arguments), a
    function taking ``n``'s output to that view; else ``None``. The step's gradient reaches ``n``
    through the view's backward, in the view's layout."""
    if len(n.users) != 1:
        return None
    u = next(iter(n.users))
    rest = (u.args[1:], u.kwargs)
    if u.args[:1] != (n,) or any(isinstance(a, fx.Node) for a in tree_flatten(rest)[0]):
        return None
    if u.op == "call_method" and u.target in _PERMUTING_METHODS:
        return lambda t: getattr(t, u.target)(*rest[0], **rest[1])
    if u.op == "call_function" and u.target in _PERMUTING_FUNCTIONS:
        return lambda t: u.target(t, *rest[0], **rest[1])
    return None


class _Seed(torch.autograd.Function):
    """A root for one node's backward alone: its backward hands each of the node's outputs a new
    gradient of ones that nothing but autograd holds (allocated under the tracker), as the
    gradient a node receives in training; weak references to their storages go to ``made``."""

    @staticmethod
    def forward(ctx, made, *outs):
        ctx.made = made
        ctx.like = [(t.shape, t.new_empty(0)) for t in outs]
        return outs[0].new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        grads = tuple(template.new_ones(shape) for shape, template in ctx.like)
        ctx.made.extend(weakref.ref(g.untyped_storage()) for g in grads)
        return (None, *grads)


class _BackwardTracker(LiveStorageTracker):
    """:class:`LiveStorageTracker` of one node's backward alone that also keeps ``own_peak``, the
    most bytes alive beyond the gradients handed to it (:class:`_Seed`'s, weak references in
    ``made``) that are still alive: a backward whose first autograd node lets its gradient go
    (``CopySlices`` after a view's backward spread it over the base) peaks without it here, while
    in a step another reader of the same gradient (the other input of an ``add``) may hold it."""

    def __init__(self, made: list):
        super().__init__()
        self.made = made
        self.own_peak = 0
        self.alive_at_peak: set[int] = set()

    def alive_keys(self) -> set[int]:
        """The storages it holds alive now (by key)."""
        return set(self._alive)

    def alive_bytes_of(self, keys: set[int]) -> int:
        """Bytes of those of the storages ``keys`` that are still alive."""
        return sum(s.nbytes() for s in (ref() for key, ref in self._alive.items() if key in keys) if s is not None)

    def handed_bytes(self) -> int:
        """Bytes of the gradients handed to the backward that are still alive."""
        return sum(g.nbytes() for g in (ref() for ref in self.made) if g is not None)

    def mark_peak(self) -> None:
        """Note the storages alive now, as those alive at the peak (``alive_at_peak``) until a
        later allocation makes a higher one."""
        self.alive_at_peak = set(self._alive)

    def track(self, tensor: torch.Tensor) -> None:
        super().track(tensor)
        if self.live_bytes >= self.peak_bytes:
            self.mark_peak()
        if self.made:  # (the seeds themselves, made before their references are, are not its own)
            self.own_peak = max(self.own_peak, self.live_bytes - self.handed_bytes())


class _Capture(torch.autograd.Function):
    """Identity on a node's input whose backward keeps the gradient that reaches it (as the
    nodes before would hold it) and hands nothing on, so the input needs no ``.grad``."""

    @staticmethod
    def forward(ctx, t, arrived):
        ctx.arrived = arrived
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        ctx.arrived.append(grad)
        return None, None


def _stand_in(p: torch.Tensor, stand_ins: dict, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A leaf sharing ``p``'s storage whose ``.grad`` exists (allocated here, outside any tracker):
    its gradient is accumulated in place, as a parameter's is in every step after the first,
    without running ``p``'s own accumulation or its hooks. One per parameter (``stand_ins``,
    by identity), so that a parameter read twice gets one accumulation. With ``dtype``: a leaf
    copy of ``p`` in that dtype, standing for autocast's cached cast of it that an earlier call
    made (the call's backward hands the cast its gradient in that dtype; it is copied to ``p``'s
    dtype once, after the cast's first reader, not in this call's backward)."""
    key = id(p) if dtype is None else (id(p), dtype)
    if key not in stand_ins:
        alias = p.detach().requires_grad_() if dtype is None else p.detach().to(dtype).requires_grad_()
        alias.grad = torch.zeros_like(alias)
        stand_ins[key] = alias
    return stand_ins[key]


def _attribute_tensors(module: torch.nn.Module) -> dict[int, int]:
    """Storage key -> bytes of the tensors that ``module`` and its submodules with forward
    pre-hooks hold as plain attributes, neither parameters nor buffers: where such a hook puts the
    weight it makes at each call (``torch.nn.utils.prune``, the hook-based ``weight_norm`` and
    ``spectral_norm``). (Not a module that caches a value of its own on its first call: made
    once, it is not made again in each step.)"""
    found = {}
    for m in module.modules():
        if not m._forward_pre_hooks:
            continue
        for value in vars(m).values():
            key = _storage_key(value)
            if key is not None:
                found[key] = value.untyped_storage().nbytes()
    return found


@contextlib.contextmanager
def _attributes_kept(module: torch.nn.Module):
    """Put back the tensor attributes of ``module`` and its submodules (:func:`_attribute_tensors`)
    on exit: a forward pre-hook that sets its weight at each call, run here on stand-ins, leaves
    the module holding the forward's weight as it did. Yields a list that holds, on exit, the
    attribute tensors the block made that take a gradient (that hook's weight)."""
    kept = [(m, name, value) for m in module.modules() for name, value in vars(m).items()
            if isinstance(value, torch.Tensor)]
    made: list[torch.Tensor] = []
    try:
        yield made
    finally:
        before = {id(value) for _, _, value in kept}
        made.extend(value for m in module.modules() for value in vars(m).values()
                    if isinstance(value, torch.Tensor) and id(value) not in before and value.grad_fn is not None)
        for m, name, value in kept:
            m.__dict__[name] = value


def is_fake(values) -> bool:
    return any(isinstance(t, FakeTensor) for t in _tensors(values))


def _mutable(value):
    """``value`` with torch.fx's immutable lists and dicts (a node's arguments) made the plain
    ones the traced code built at each call: a wrapped function may fill in the list it is given
    (torchvision's ``_get_window_and_shift_size``: swin3d_t failed to profile). A value another node
    returned is handed on as it is, as the generated code does: a Hugging Face ``ModelOutput`` (a
    dict) made a plain dict lost its fields, and a wrapper of a leaf ``Qwen2Model`` failed to
    profile on ``outputs.last_hidden_state``."""
    if isinstance(value, immutable_list):
        return [_mutable(v) for v in value]
    if isinstance(value, tuple):  # a tuple's own type kept (a torch.Size, a named tuple)
        items = [_mutable(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, immutable_dict):
        return {k: _mutable(v) for k, v in value.items()}
    return value


class _GraphInterpreter(fx.Interpreter):
    """An ``fx.Interpreter`` that hands calls their arguments as the generated code does (new
    lists and dicts), not the node's own (:func:`_mutable`)."""

    def fetch_args_kwargs_from_env(self, n: fx.Node):
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return _mutable(args), _mutable(kwargs)


class _ProfilingInterpreter(_GraphInterpreter):
    """Runs the graph once, recording storage ownership and saved tensors per call node."""

    def __init__(self, gm: fx.GraphModule, cost_model: str, repeats: int, allocator_device: torch.device | None):
        # Values stay alive during profiling so that storage keys are never reused.
        super().__init__(gm, garbage_collect_values=False)
        self.cost_model = cost_model
        self.repeats = repeats
        self.owner: dict[int, str] = {}  # storage key -> producing node name ("" = external)
        self.param_keys = {_storage_key(p): p.numel() * p.element_size() for p in gm.parameters()}
        self.param_names = {_storage_key(p): name for name, p in gm.named_parameters()}
        # the leaves whose casts autocast caches, by name: the parameters, and the inputs that require
        # grad (added as the placeholders run)
        self.leaf_names = dict(self.param_names)
        for b in gm.buffers():
            self.owner[_storage_key(b)] = ""
        for k in self.param_keys:
            self.owner[k] = ""
        self.stored_keys = frozenset(self.owner)  # parameters and buffers
        # autocast's cached casts made so far: storage key -> (leaf name, bytes); a later call of the
        # same module (or another reader of the leaf) reads the cast from the cache
        self.cached_casts: dict[int, tuple[str, int]] = {}
        self.cast_dtypes: dict[str, torch.dtype] = {}  # leaf name -> the dtype of its cached cast
        self.costs: list[NodeCost] = []
        self.items: dict[str, dict[int, int]] = {}  # tuple-output node -> storage key -> bytes of its items
        self.saved_storages: set[int] = set()  # the storages some node's backward saves
        # per call_module node: storage key -> (bytes, saved by its backward) of the tensors its call
        # left on its module as attributes (:func:`_attribute_tensors`; see :meth:`settled_costs`)
        self.left_on_module: dict[str, dict[int, tuple[int, bool]]] = {}
        self.buffers = list(gm.named_buffers())
        self.fake = is_fake(list(gm.parameters()) + list(gm.buffers()))
        self.tracker = LiveStorageTracker()
        # The buffers each node writes, found from the ops' schemas and values (F.batch_norm
        # writes running statistics without bumping their version counters).
        self.buffer_writes = StateWrites(self.buffers)
        # On CUDA the allocator also sees the workspaces ops take (cuDNN, cuBLAS), which are not
        # tensors: each node's transients are the larger of the two accounts.
        self.allocator_device = allocator_device

    def run_node(self, n: fx.Node):
        if n.op not in CALL_OPS:
            out = super().run_node(n)
            for t in _tensors(out):
                self.owner.setdefault(_storage_key(t), "")
            if n.op == "placeholder":
                leaves = [t for t in _tensors(out) if t.requires_grad and t.is_leaf and not t._is_view()]
                for i, t in enumerate(leaves):
                    self.leaf_names.setdefault(_storage_key(t), n.name if len(leaves) == 1 else f"{n.name}[{i}]")
            return out
        versions = {name: b._version for name, b in self.buffers}
        attributes = _attribute_tensors(self.module.get_submodule(n.target)) if n.op == "call_module" else {}
        # autograd nodes of the inputs before the call: a call that returns an input unchanged
        # (nn.Identity) adds none, and its gradient passes through as it is
        before = {t.grad_fn for t in _tensors(self._fetch_args(n)) if t.grad_fn is not None}
        self.sequence_start = _next_sequence_nr()
        rng_before = None if self.fake else _rng_states()
        seeded = _SeededOps()
        recorder = _SavedRecorder(self.stored_keys)
        flop_counter = FlopCounterMode(display=False) if self.cost_model in ("flops", "compiled") else None
        live_before = self.tracker.live_bytes
        self.tracker.peak_bytes = live_before
        self.buffer_writes.clear()
        allocator = AllocatorPeak(self.allocator_device)
        casts = _AutocastCasts(self.leaf_names)
        # buffer_writes below the tracker: the copies it compares values with are not counted.
        with self.buffer_writes, seeded, self.tracker, allocator, torch.autograd.graph.saved_tensors_hooks(
            recorder.pack, recorder.unpack
        ), (flop_counter or contextlib.nullcontext()), casts:
            out = super().run_node(n)
        transient = max(0, self.tracker.peak_bytes - self.tracker.live_bytes, allocator.transient_bytes)
        flops = flop_counter.get_total_flops() if flop_counter else 0
        uses_rng = (_draws_random(self.module, n) or seeded.drew
                    or (rng_before is not None and not _same_states(rng_before, _rng_states())))
        mutated = {name for name, b in self.buffers if b._version != versions[name]}
        mutated = tuple(sorted(mutated | set(self.buffer_writes.written)))
        made = {key: (self.leaf_names[casts.leaf_of[key]], nbytes) for key, nbytes in casts.made.items()}
        self.saved_storages.update(recorder.saved)
        cost = replace(self._node_cost(n, out, recorder.saved, transient, flops, before, made), mutated_buffers=mutated,
                       uses_rng=uses_rng, saved_count=recorder.count, saved_bytes=recorder.nbytes)
        self.cached_casts.update(made)
        self.cast_dtypes.update({self.leaf_names[casts.leaf_of[key]]: dtype for key, dtype in casts.dtype_of.items()})
        # the casts it read from the cache, made by an earlier call: its backward hands them their gradient
        reused = {name for name, _ in cost.cast_params} - {name for name, _ in made.values()}
        if n.op == "call_module":  # (after _node_cost, which makes the outputs' storages the node's)
            left = _attribute_tensors(self.module.get_submodule(n.target))
            self.left_on_module[n.name] = {key: (nbytes, key in recorder.saved) for key, nbytes in left.items()
                                           if key not in attributes and self.owner.get(key) is None}
        if any(u.op == "output" for u in n.users):
            held, target, cast = _loss_part(out)
            cost = replace(cost, loss_held_bytes=held, loss_target_bytes=target, loss_cast_bytes=cast)
        if cost.root == n.name:  # views and in-place ops hand back views or one new gradient
            transient, unpack, released, tail, freed = self._backward_transient(n, reused=reused)
            cost = replace(cost, bwd_transient_bytes=transient, bwd_unpack_bytes=unpack, bwd_released_bytes=released,
                           bwd_tail_bytes=tail, bwd_freed_inputs=freed)
        elif (view := self._written_view(n)) is not None:  # but not a write into a view
            transient, unpack, released, tail, freed = self._backward_transient(n, view, reused=reused)
            cost = replace(cost, bwd_transient_bytes=transient, bwd_unpack_bytes=unpack, bwd_released_bytes=released,
                           bwd_tail_bytes=tail, bwd_freed_inputs=freed)
        self.costs.append(cost)
        return out

    def settled_costs(self) -> tuple[NodeCost, ...]:
        """The nodes' costs once the forward has run: what a call left on its module that a module
        still holds now is the node's ``held_bytes``, and out of its ``extra_bytes`` where its
        backward saves it (prune's weight: counted only as saved, it was let go at the node's
        backward or not held at all where the node is recomputed, while its module holds it until
        the next step's call: 1.34x the budget at "min" on an MLP of pruned Linears). A module
        called twice holds only the last call's; the first's is saved by its backward, if at all.

        And the items of a tuple output that no backward saves, neither the node's nor a reader's,
        are its ``unsaved_item_bytes``: they go once its readers ran, while the items saved are
        held to their savers' backwards (nn.MultiheadAttention(average_attn_weights=False) whose
        per-head weights a loss reads: its backward and the loss's save the weights, and its
        output, held with them as one value, was over-predicted through the backward: +5.5%)."""
        held = _attribute_tensors(self.module)
        costs = []
        for c in self.costs:
            unsaved = sum(nbytes for key, nbytes in self.items.get(c.name, {}).items() if key not in self.saved_storages)
            if unsaved:
                c = replace(c, unsaved_item_bytes=unsaved)
            left = [value for key, value in self.left_on_module.get(c.name, {}).items() if key in held]
            if left:
                c = replace(c, held_bytes=sum(nbytes for nbytes, _ in left),
                            extra_bytes=c.extra_bytes - sum(nbytes for nbytes, saved in left if saved))
            costs.append(c)
        return tuple(costs)

    def _written_view(self, n: fx.Node) -> torch.Tensor | None:
        """The view that ``n`` writes in place, if it writes one (``attn[..., :k] *= mask``)."""
        views = [t for t in _tensors([self.env.get(w) for w in written_inputs(self.module, n)])
                 if t.requires_grad and t._is_view()]
        return views[0] if len(views) == 1 else None

    def _backward_transient(self, n: fx.Node, view: torch.Tensor | None = None, *,
                            reused: frozenset[str] | set[str] = frozenset()) -> tuple[int, int, int, int, tuple]:
        """Peak bytes of the node's backward alone beyond the gradients it hands its inputs, run as
        a training step runs it: the forward again on detached inputs and on stand-ins for its
        parameters (:func:`_stand_in`: their ``.grad`` exists, so each parameter's gradient is
        accumulated in place and freed as soon as it is ready, not held until the whole node's
        backward returns), then ``torch.autograd.backward`` of its outputs under the tracker,
        from gradients that only autograd holds (:class:`_Seed`), so that they die when the
        node's backward lets them go. The incoming gradients and the inputs' gradients (taken as
        they reach the inputs) are subtracted; the model's parameters and ``.grad`` are not
        touched.

        A write into a view (``view``: the written input) is run on that view of a copy of its
        base. Its backward then runs as in the step: the view's gradient is spread over a
        base-sized one, which the in-place op's autograd node (``CopySlices``) copies before it
        runs the op's own backward on a slice of the copy; it hands a base-sized gradient on (1.33x
        the budget where that was not counted). Here the simulator hands the written input a
        gradient of the view's size, so the transient is what the base's gradient costs beyond
        that.

        The second value is what the backward holds when it first unpacks a tensor its forward
        saved, beyond the gradients it was handed: in a recomputed segment that unpack starts the
        recomputation, which then runs beside those bytes. Most backwards unpack before they
        allocate (0); ``CopySlices`` has made the base-sized gradient, its copy and the clone of
        the slice's before the op's own backward unpacks (Funnel's ``positional_attn *=
        cls_mask``, whose reader, an add, saves nothing: its segment was recomputed beside them,
        1.25x the budget at "min"). The third is what of those handed gradients the backward
        had let go by its peak or by that unpack (``CopySlices`` again: the view's backward
        spreads the gradient over the base and drops it): where another node holds the same
        gradient in the step (the other input of that add), it adds to both
        (:class:`_BackwardTracker`; the plain peak was -6.6% on a block whose peak it is).

        The fourth is the backward's tail, and the first its head only, where a forward pre-hook
        made the module's weight (``torch.nn.utils.prune``'s ``weight_orig * weight_mask``, the
        hook-based ``weight_norm``): the weight's gradient then goes through the hook's ops
        (the mask's multiply) after the module's own op has let go of what it saved and of its
        incoming gradient. The tail, from the moment that gradient is ready, is the most it holds
        beyond the inputs' gradients; counted with the head, beside the saved input, a pruned
        Linear's plain step was over-predicted by that input (+1 MiB of 6.5).

        The fifth is the producers of the inputs it saves that its backward lets go before its
        peak (:meth:`_own_copy`), which the transient does not hold: where the step holds one
        longer (another node saves it too), the simulator adds it back."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        env_values = (args, kwargs)
        leaves, stand_ins, arrived, made, copies = [], {}, [], [], {}
        written = None
        if view is not None:
            base = view._base.detach().requires_grad_()
            leaves.append(base)
            base_copy = _Capture.apply(base, arrived).clone()
            written = base_copy.as_strided(view.size(), view.stride(), view.storage_offset() - view._base.storage_offset())

        # one tensor passed twice is one input here too (self-attention's query, key and value, which
        # nn.MultiheadAttention projects at once only where they are the same tensor: as three
        # leaves, its backward was another's, and their three gradients were subtracted, not one:
        # the plain peak of an attention on a computed input was predicted -5.8%)
        detached = {}

        def detach(t):
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) not in detached:
                detached[id(t)] = detached_once(t)
            return detached[id(t)]

        def detached_once(t):
            if t is view:
                return written
            if not t.requires_grad:
                return self._own_copy(t, t, copies)
            if t.is_leaf and _storage_key(t) in self.param_keys:  # a parameter, not a view of one
                return self._param_stand_in(t, stand_ins, reused)
            leaf = t.detach().requires_grad_()
            leaves.append(leaf)
            return self._own_copy(t, _Capture.apply(leaf, arrived), copies)

        args, kwargs = tree_map(detach, (args, kwargs))
        tracker, allocator = _BackwardTracker(made), AllocatorPeak(self.allocator_device)
        at_unpack = []  # (live bytes, those beyond the handed gradients) at the first unpack of a saved tensor

        def unpack(t):
            if not at_unpack:
                at_unpack.append((tracker.live_bytes, tracker.live_bytes - tracker.handed_bytes()))
            return t

        casts = _AutocastCasts(self.leaf_names)
        hooked = []  # the weights a forward pre-hook made from the stand-ins
        saved: list[weakref.ref] = []  # the storages its forward hands autograd to save
        with (torch.autograd.graph.saved_tensors_hooks(_noting_storages(saved), unpack), casts,
              _autocast_cache_off() if casts.caching else contextlib.nullcontext()):
            if n.op == "call_module":
                mod = self.module.get_submodule(n.target)
                params = {name: self._param_stand_in(p, stand_ins, reused)
                          for name, p in mod.named_parameters(remove_duplicate=False) if p.requires_grad}
                with _attributes_kept(mod) as hooked:
                    out = torch.func.functional_call(mod, params, args, kwargs)
            else:
                out = getattr(self, n.op)(n.target, args, kwargs)
        del args, kwargs  # the copies of the inputs are autograd's alone now
        detached.clear()
        read = _read_tensors(n, out)
        outs = [t for t in read if t.requires_grad and t.grad_fn is not None]
        permuted = _permuted_reader(n)
        if permuted is not None and len(outs) == 1 and outs[0] is out:
            # read only through a transpose: its gradient arrives transposed, not contiguous, and a
            # backward that needs it contiguous (a linear layer's matrix product) copies it first
            # (an MLP-Mixer's token mixing at "min": 1.10x the budget where a contiguous seed hid it)
            outs = [permuted(out)]
        # the items no node reads are autograd's alone, as in the step: one its backward saves (the
        # per-head attention weights of nn.MultiheadAttention(average_attn_weights=False), a view of
        # the probabilities) is an extra buffer (:func:`_unread_outputs`), tracked below and let go
        # where the backward lets go of it; held here as a value, what came after that counted on top
        # of it (+8.3% on the plain peak)
        del out
        wrt = leaves + list(stand_ins.values())
        if not outs or not wrt:
            return 0, 0, 0, 0, ()
        head = []  # the tracker's peaks when the gradient of a hook's weight is ready (the fourth value)

        def tail_starts(_grads):
            if not head:
                # what it saved and still holds here (the hook's weight, alive in `hooked`, is the
                # module's: ``held_bytes``) is not the tail's
                head.append((tracker.peak_bytes, tracker.own_peak, tracker.alive_bytes_of(saved_keys),
                             tracker.alive_at_peak))
                tracker.peak_bytes = tracker.live_bytes

        for weight in hooked:
            weight.grad_fn.register_prehook(tail_starts)
        root = _Seed.apply(made, *outs)
        seed = torch.ones_like(root)
        # Autocast's casts of the parameters that the backward saves (made without the cache, so
        # that only autograd holds them): counted as live from the start, so that the tracker sees
        # them go when the node's own backward releases what it saved, before its parameters'
        # gradients are cast back to their dtype (ToCopyBackward, a copy of each weight's
        # gradient in the parameter's dtype) and accumulated. The simulator holds them
        # (``CostGraph.cast_saves``) until the node's backward is done; counted as held through the
        # copies, a convolution of 128 channels at 16x16 under bf16 autocast over-predicted the
        # plain peak by its bf16 weight (+7.2%).
        # So are the buffers it saves beyond values (``extra_bytes``: attention probabilities, a
        # dropout mask), which the simulator also holds until the node's backward is done, while
        # each of its autograd nodes lets go of its own as it returns: an attention's backward
        # makes its largest buffers once the probabilities' dropout mask is gone; counted on top
        # of them all, the plain peak of an attention with dropout was over-predicted by 18%.
        # And so are the inputs it saves, copied (:meth:`_own_copy`): each autograd node lets go of
        # those it saved as it returns; under autocast a linear layer's bf16 input goes before the
        # copy of its weight's gradient to float32, its peak (HF ViT under bf16 autocast: +2.5%).
        values = {_storage_key(t) for t in _tensors((read, env_values, list(stand_ins.values())))}
        held = _track_held(tracker, casts.storages + saved, values, self.fake)
        saved_keys = tracker.alive_keys()  # (the tracker has seen nothing else yet)
        saved_copies = {key: owner for key, (ref, owner) in copies.items() if ref() is not None}
        tracker.mark_peak()
        with tracker, allocator:
            torch.autograd.backward(root, seed, inputs=wrt)
        incoming = sum(t.numel() * t.element_size() for t in outs)
        views_of_incoming = {ref()._cdata for ref in made if ref() is not None}  # alive through `arrived`
        kept = sum(tracker.sizes_of(g for g in arrived if g.untyped_storage()._cdata not in views_of_incoming))
        if view is not None:
            kept -= (view._base.numel() - view.numel()) * view.element_size()
        # the backward's tail: the gradient path through a hook's weight, after the op that read it
        # let go of what it saved and of its incoming gradient (the allocator's peak, which cannot
        # be split, stays with the head)
        tail = max(0, tracker.peak_bytes - kept - head[0][2]) if head else 0
        peak, own_peak = head[0][:2] if head else (tracker.peak_bytes, tracker.own_peak)
        # (the allocator counts the casts from the start: they were allocated before it began)
        transient = max(0, peak - incoming - kept - held, allocator.peak_bytes - incoming - kept)
        released = max(0, own_peak - kept - transient - held)
        unpack = 0
        if at_unpack:  # (the casts are alive there: what the node saved goes after its backward)
            live, own = at_unpack[0]
            unpack = max(0, live - incoming - held)
            released = max(released, own - held - unpack)
        # (with a tail, at the head's peak, which the transient is: the tail's comes after the node's
        # own op let go of its saved inputs, and counting them freed there added one back beside
        # the head: a hook-based weight_norm MLP's plain peak +9.8%)
        alive_at_peak = head[0][3] if head else tracker.alive_at_peak
        freed = tuple(sorted({owner for key, owner in saved_copies.items() if key not in alive_at_peak}))
        return transient, unpack, released, tail, freed

    def _param_stand_in(self, p: torch.Tensor, stand_ins: dict, reused) -> torch.Tensor:
        """:func:`_stand_in` of parameter ``p``; in its cast's dtype where the call reads autocast's
        cast of it from the cache (``reused``: made by an earlier call of the same module). Run on
        the parameter, each such call's backward copied its gradient to float32, which the step
        does once, after the cast's first reader (part of the +86% on the plain peak of a Linear
        called three times under bf16 autocast)."""
        name = self.param_names.get(_storage_key(p))
        return _stand_in(p, stand_ins, self.cast_dtypes[name] if name in reused else None)

    def _own_copy(self, t: torch.Tensor, value: torch.Tensor, copies: dict) -> torch.Tensor:
        """``value`` (the node's input ``t`` as the node reads it) copied into a storage of its own
        where ``t`` is the whole storage an earlier node made, so that the node's backward lets it
        go as the step's does where nothing else holds it; ``copies``: the copy's storage key ->
        (a weak reference to that storage, the producer's name). Views are read as they are."""
        key = _storage_key(t)
        owner = self.owner.get(key) if key is not None else None
        if not owner or t._is_view() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            return value
        copy = value.clone()
        copies[_storage_key(copy)] = (weakref.ref(copy.untyped_storage()), owner)
        return copy

    def _node_params(self, n: fx.Node, out, before) -> dict[str, torch.Tensor]:
        """The parameters (that require grad) whose gradient the node's backward hands over, by
        qualified name: its module's for ``call_module``; for the other calls, those its own
        autograd nodes reach (:func:`_params_reached`). Not an argument's storage: a view of a
        parameter (``w.t()``, a reshape) shares it, and ``h.reshape_as(w)`` reads ``w`` for its
        shape only; counted so, each over-predicted the plain peak by the parameter's size (timm's
        weight-standardized convolutions: NFNet-L0 +24%)."""
        if n.op == "call_module":
            mod = self.module.get_submodule(n.target)
            return {self.param_names[_storage_key(p)]: p for p in mod.parameters() if p.requires_grad}
        return {self.param_names[_storage_key(t)]: t for t in _params_reached(out, before, self.sequence_start)
                if _storage_key(t) in self.param_names}


    def _node_cost(self, n, out, saved, transient, flops, before=frozenset(), casts=None) -> NodeCost:
        """``casts``: autocast's cached casts the call made, storage key -> (parameter name, bytes)."""
        casts = {k: c for k, c in (casts or {}).items()  # an explicit cast (a captured graph's) is a value
                 if k not in {_storage_key(t) for t in _tensors(out)}}
        unread = _unread_outputs(n, out)
        out_bytes, root, items = 0, n.name, {}
        for t in _tensors(out):
            key = _storage_key(t)
            if key is None:
                continue
            if key in self.owner:
                root = self.owner[key] or root
            else:
                self.owner[key] = n.name
                if not (key in unread and key in saved):  # (one its backward saves is an extra buffer)
                    items[key] = t.untyped_storage().nbytes()
                    out_bytes += items[key]
        if isinstance(out, (tuple, list)):
            self.items[n.name] = items
        saved_inputs, saves_output, extra, cast_saved = set(), False, 0, set()
        read = dict(casts.values())  # parameter -> bytes of its cast, read through autocast's cache
        for key, nbytes in saved.items():
            who = self.owner.get(key)
            if key in casts or key in self.cached_casts:
                # A cast in autocast's cache, this call's or an earlier call's of the same weight (a
                # module called again, which reuses the cast): one storage, held by the cache to
                # the forward's end and then by the calls that save it; not bytes of its own per
                # call (as extra bytes of each later call it was one weight per call too many:
                # +86% on the plain peak of a Linear called 3 times)
                name, _ = casts[key] if key in casts else self.cached_casts[key]
                cast_saved.add(name)
                if key in self.cached_casts:
                    read.setdefault(*self.cached_casts[key])
            elif who is None or key in unread:
                extra += nbytes
            elif who == n.name:
                saves_output = True
            elif who:
                saved_inputs.add(who)
        grad_alias = _grad_alias(out, self._fetch_args(n), before)
        params = self._node_params(n, out, before)
        if self.cached_casts:  # casts it reads from the cache but does not save (its input takes no gradient)
            cast_bytes = dict(self.cached_casts.values())
            for p in _cast_reads(out, before, self.sequence_start):
                name = self.leaf_names.get(_storage_key(p))
                if name in cast_bytes:
                    read.setdefault(name, cast_bytes[name])
        for name in read.keys() & self.param_names.values():  # a cast made before the call is not among
            params.setdefault(name, self.module.get_parameter(name))  # the autograd nodes it made
        moved = sum(t.untyped_storage().nbytes() for t in _tensors((self._fetch_args(n), out)))
        return NodeCost(
            name=n.name, out_bytes=out_bytes, root=root, saved_inputs=tuple(sorted(saved_inputs)),
            saves_output=saves_output, extra_bytes=extra, fwd_transient_bytes=transient,
            grad_bytes=sum(t.numel() * t.element_size() for t in _read_tensors(n, out) if t.requires_grad),
            grad_numel=sum(t.numel() for t in _read_tensors(n, out) if t.requires_grad),
            param_grad_bytes=sum(p.numel() * p.element_size() for p in params.values()),
            params=tuple(sorted(params)),
            fwd_cost=_flop_cost(self.cost_model, flops, moved),
            flops=flops, module=module_of(self.module, n)[0], grad_alias=grad_alias,
            tensor_output=bool(_tensors(out)), cast_params=tuple(sorted(read.items())),
            cast_saved=tuple(sorted(cast_saved)),
        )

    def _fetch_args(self, n: fx.Node):
        return tree_map(lambda a: self.env.get(a) if isinstance(a, fx.Node) else a, (n.args, n.kwargs))


# Backward functions that hand their inputs views of the incoming gradient (no new buffer).
_RANDOM_FUNCTIONS = {
    torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout,
    torch.nn.functional.rrelu, torch.dropout, torch.bernoulli, torch.rand, torch.randn, torch.rand_like,
    torch.randn_like, torch.randint, torch.randint_like, torch.randperm, torch.normal, torch.multinomial,
}
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_",
                   "log_normal_", "cauchy_", "multinomial"}


def _draws_random(root: torch.nn.Module, n: fx.Node) -> bool:
    """Random ops recognised by name (needed on fake tensors, where the RNG does not move)."""
    if n.op == "call_module":
        mod = root.get_submodule(n.target)
        return any(isinstance(m, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU)) for m in mod.modules())
    if n.op == "call_function":
        return n.target in _RANDOM_FUNCTIONS
    return n.target in _RANDOM_METHODS


_ALIAS_GRAD_FNS = (
    "CatBackward", "StackBackward", "AddBackward0", "ViewBackward", "ReshapeAliasBackward",
    "UnsafeViewBackward", "PermuteBackward", "TransposeBackward", "TBackward", "SqueezeBackward",
    "UnsqueezeBackward", "AliasBackward", "CloneBackward", "SumBackward",
)


def _params_reached(out, boundary, start: int | None = None) -> list[torch.Tensor]:
    """The leaf tensors whose gradient the autograd nodes that made ``out`` accumulate: the graph is
    walked from ``out``'s ``grad_fn``s and not into ``boundary``, the inputs' ``grad_fn``s before
    the call (earlier nodes'; taken before it, as an in-place call replaces its input's), nor into
    nodes numbered below ``start`` (:func:`_next_sequence_nr` before the call): an in-place write
    into a view (Funnel's ``mul_`` on a slice) reaches the history of the view's base, and every
    parameter before it was counted as its own (+18.8% on the plain peak)."""
    leaves = []

    def descend(fn) -> bool:
        leaf = getattr(fn, "variable", None)  # an AccumulateGrad
        if leaf is not None:
            leaves.append(leaf)
            return False
        return start is None or fn._sequence_nr() >= start

    _walk_autograd(out, boundary, descend)
    return leaves


def _cast_reads(out, boundary, start: int) -> list[torch.Tensor]:
    """The leaves whose cast, made before the call (an autograd node numbered below ``start``:
    ``ToCopyBackward`` of a parameter or of an input that requires grad), the autograd nodes that
    made ``out`` read: under autocast, a cast an earlier call put in autocast's cache
    (:func:`_params_reached` does not walk into nodes that old). Walked as there, ``boundary``
    excluded."""
    found = []

    def descend(fn) -> bool:
        if getattr(fn, "variable", None) is not None:
            return False
        if fn._sequence_nr() < start:
            nexts = [f for f, _ in fn.next_functions if f is not None]
            if fn.name().startswith("ToCopyBackward") and len(nexts) == 1 and hasattr(nexts[0], "variable"):
                found.append(nexts[0].variable)
            return False
        return True

    _walk_autograd(out, boundary, descend)
    return found


def _walk_autograd(out, boundary, descend) -> None:
    """Visit once each autograd node reached from ``out``'s ``grad_fn``s, not into ``boundary``,
    going on into a node's next functions where ``descend(node)`` says so."""
    stack = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
    seen = set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen or fn in boundary:
            continue
        seen.add(fn)
        if descend(fn):
            stack.extend(next_fn for next_fn, _ in fn.next_functions)


def _next_sequence_nr() -> int:
    """The sequence number autograd gives the next node it creates on this thread: the nodes a
    call creates are numbered from it on, those that existed before below it."""
    with torch.enable_grad():
        return torch.empty((), requires_grad=True).view(()).grad_fn._sequence_nr() + 1


def _grad_alias(out, args, before=frozenset()) -> bool:
    """Whether every autograd node the call created passes views of its incoming gradient on
    (a module whose last op is a view, such as ``Linear`` on 3-d inputs, does not: its ``addmm``
    allocates the input's gradient). A call that created none (it returned an input, whose
    autograd node is in ``before``) passes its gradient on as it is."""
    outs = _tensors(out)
    if len(outs) != 1 or outs[0].grad_fn is None:
        return False
    if outs[0].grad_fn in before:
        return True
    inputs = _tensors(args)
    stops = {t.grad_fn for t in inputs if t.grad_fn is not None}
    leaves = {id(t) for t in inputs if t.grad_fn is None}
    name = outs[0].grad_fn.name()
    if name.startswith("AddBackward0"):  # broadcasting adds reduce the gradient: a new buffer
        # (into .grad for a parameter, a bias broadcast over the batch, which the node's parameter
        # gradients count: the other input's gradient is still a view)
        if not all(t.shape == outs[0].shape and t.dtype == outs[0].dtype for t in inputs if id(t) not in leaves):
            return False
    if name.startswith("SumBackward"):  # an expand of the incoming gradient, unless a cast follows
        if not all(t.dtype == outs[0].dtype for t in inputs if id(t) not in leaves):
            return False
    return _passes_views(outs[0].grad_fn, stops, leaves, depth=8)


def _passes_views(fn, stops, leaves, depth: int) -> bool:
    if not fn.name().startswith(_ALIAS_GRAD_FNS) or depth == 0:
        return False
    for nxt, _ in fn.next_functions:
        if nxt is None or nxt in stops:
            continue
        if nxt.name() == "torch::autograd::AccumulateGrad" and id(nxt.variable) in leaves:
            continue
        if not _passes_views(nxt, stops, leaves, depth - 1):
            return False
    return True


def _synchronize() -> None:
    """Wait for queued CUDA kernels, so that wall times measure them and not their launch."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _now() -> float:
    _synchronize()
    return time.perf_counter()


def _scalar_loss(out) -> torch.Tensor | None:
    parts = [t.float().sum() for t in _tensors(out) if t.requires_grad]
    return torch.stack(parts).sum() if parts else None


class _ForwardClock(_GraphInterpreter):
    """Runs the graph's forward as training runs it, timing each call node where it runs: after
    its producers, with what they left in the caches and the allocator (a node timed again and
    again on its own inputs runs on hot caches and measured up to 1.4x faster on CPU). ``kind``
    names each node's computation (:func:`_computation`). ``events`` collects, once the backward
    of the forward it ran starts, the time at which each node's backward (the ``grad_fn`` of its
    outputs) begins."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.ms: dict[str, float] = {}
        self.kind: dict[str, object] = {}
        self.events: list[tuple[float, str | None]] = []

    def run(self, *args):
        """The forward's output; the interpreter's values are dropped. Its ``env`` kept the output,
        whose ``grad_fn`` pre-hooks hold this clock: a cycle through autograd's C++ nodes, which
        Python's garbage collector does not see, so each profiled step's output (and its graph)
        outlived fxremat.compile."""
        try:
            return super().run(*args)
        finally:
            self.env.clear()

    def run_node(self, n: fx.Node):
        if n.op not in CALL_OPS:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        self.kind[n.name] = _computation(self.module, n, args, kwargs)
        start = _now()
        out = super().run_node(n)
        self.ms[n.name] = (_now() - start) * 1e3
        for fn in {t.grad_fn for t in _tensors(out) if t.grad_fn is not None}:
            fn.register_prehook(lambda _g, name=n.name: self.events.append((_now(), name)))
        return out


def _value_key(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, value.device.type, value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple(_value_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _value_key(v)) for k, v in value.items()))
    return value


def _computation(root: torch.nn.Module, n: fx.Node, args, kwargs):
    """What node ``n`` computes, as a hashable key: nodes with the same key run the same op on
    inputs of the same shapes (a chain of identical blocks) and cost the same. A module counts
    by its torch.nn class, settings and parameter shapes; a module of any other class, or a
    value with no hash, keys by the node itself."""
    if n.op == "call_module":
        mod = root.get_submodule(n.target)
        if not type(mod).__module__.startswith("torch.nn.modules"):
            return n.name
        what = (type(mod), mod.extra_repr(), mod.training,
                tuple((k, tuple(p.shape), p.dtype) for k, p in mod.named_parameters()))
    else:
        what = (n.op, n.target)
    key = (what, _value_key(args), _value_key(kwargs))
    try:
        hash(key)
    except TypeError:
        return n.name
    return key


def _time_steps(gm: fx.GraphModule, inputs, repeats: int) -> tuple[dict[str, float], dict[str, float], float]:
    """Median forward and backward milliseconds per call node over ``repeats`` training steps
    (after one untimed step, which pays one-off costs): the forward timed node by node
    (:class:`_ForwardClock`), the backward from pre-hooks on each node's ``grad_fn`` (from one
    starting to the next one starting). Nodes that compute the same thing (:func:`_computation`:
    the sixteen identical blocks of a chain) share one forward median over all their samples:
    equal work gets an equal cost, so the plan does not follow the noise among them, and each
    median rests on more samples.

    Both are timed inside whole steps, so each forward finds the allocator as the step before it
    left it. Timed apart (forwards freed all at once, a backward run again and again on a graph
    kept alive), glibc's default heap trimmed itself between them and paged the activations in
    again: the ResNet chain's forward measured 166 and 171 ms that way (87 in a third process)
    against 84-93 ms inside steps (one thread), and the plan changed with the heap's history.

    The third value is the median plain step (no clock: :func:`step_times`' way), each one timed
    right after a clocked step, so that the step every cost is read against comes from the same
    seconds as the nodes' costs (timed in rounds of their own after them, one U-Net's profiled
    nodes came to 0.84 of its step, its predicted overhead 42% for 66% measured)."""
    fwd: dict[str, list[float]] = {}
    bwd: dict[str, list[float]] = {}
    kind: dict[str, object] = {}
    steps: list[float] = []
    params = [p for p in gm.parameters() if p.requires_grad]
    for i in range(repeats + 1):
        if i:
            steps.append(_step_ms(gm, inputs, params))
        clock = _ForwardClock(gm)
        loss = _scalar_loss(clock.run(*inputs))
        if loss is not None and params:
            torch.autograd.grad(loss, params, allow_unused=True)
            clock.events.append((_now(), None))
        del loss
        kind = clock.kind
        if i:
            for name, ms in clock.ms.items():
                fwd.setdefault(name, []).append(ms)
            for (t0, name), (t1, _) in zip(clock.events, clock.events[1:]):
                bwd.setdefault(name, []).append((t1 - t0) * 1e3)
    pooled: dict[object, list[float]] = {}
    for name, values in fwd.items():
        pooled.setdefault(kind[name], []).extend(values)
    return ({name: statistics.median(pooled[kind[name]]) for name in fwd},
            {name: statistics.median(v) for name, v in bwd.items()}, statistics.median(steps))


def _whole_forward_ms(gm: fx.GraphModule, inputs, repeats: int) -> float:
    """Median milliseconds of the whole forward (as training runs it, with autograd recording),
    waited for at its ends only, after one untimed forward."""
    samples = []
    for i in range(repeats + 1):
        start = _now()
        out = gm(*inputs)
        elapsed = (_now() - start) * 1e3
        del out
        if i:
            samples.append(elapsed)
    return statistics.median(samples)


def _overlapped(fwd: dict[str, float], whole_ms: float) -> dict[str, float]:
    """Per-node forward times scaled to the forward timed whole, where that is shorter. On a GPU
    each node timed alone waits for its kernels and pays its launch in full, while a training step
    (and a recomputation in its backward) queues the next launch as a kernel runs."""
    total = sum(fwd.values())
    if total <= 0 or whole_ms >= total:
        return fwd
    return {name: ms * whole_ms / total for name, ms in fwd.items()}


def _tanh_chain(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    for _ in range(k):
        x = torch.tanh(x)  # saves its output: one tensor
    return x


def _norm_chain(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    for _ in range(k):
        x = torch.layer_norm(x, x.shape[-1:], w, w)  # saves input, weight, bias, mean, rstd
    return x


@dataclass(frozen=True)
class CheckpointCosts:
    """Milliseconds the non-reentrant checkpoint adds beyond the forward it runs again: per
    checkpoint (its set-up, RNG state, the early stop), per tensor saved inside it (a pack hook in
    the forward, one in the recomputation, an unpack in the backward), and per MiB of those
    tensors (the recomputed values are made again in the backward, where the cache holds the
    backward's own data: measured here, a saved 4 MiB tensor costs ~25 µs more than a 1 KiB one)."""

    per_checkpoint: float
    per_saved_tensor: float
    per_saved_mib: float

    def of_node(self, saved_count: int, saved_bytes: int) -> float:
        """What a node saving ``saved_count`` tensors of ``saved_bytes`` adds inside a checkpoint."""
        return self.per_saved_tensor * saved_count + self.per_saved_mib * saved_bytes / 2**20


_MACHINE_COSTS: dict[str, CheckpointCosts] = {}


def machine_checkpoint_costs(device: torch.device) -> CheckpointCosts:
    """:func:`checkpoint_costs` on ``device``, measured once per process: it is a property of the
    machine, not of a model, and every plan made in one process then counts the mechanism alike."""
    key = str(device)
    if key not in _MACHINE_COSTS:
        _MACHINE_COSTS[key] = checkpoint_costs(device)
    return _MACHINE_COSTS[key]


def checkpoint_costs(device: torch.device, repeats: int = 11) -> CheckpointCosts:
    """The checkpoint mechanism's costs on ``device`` (:class:`CheckpointCosts`), fitted by least
    squares on chains of 4 and 32 ops that save one tensor each (``tanh``) or five
    (``layer_norm``), on 1 KiB and 1 MiB tensors (and 16 MiB off the CPU): each chain's
    checkpointed step less its plain step and its forward. Every cost is at least 0 (a term the
    fit makes negative is left out and the rest fitted again)."""
    from torch.utils.checkpoint import checkpoint

    def median_ms(fn) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            start = _now()
            fn()
            _synchronize()
            samples.append((_now() - start) * 1e3)
        return statistics.median(samples)

    rows, extra = [], []
    # On a GPU a 1 MiB tensor is launch-bound like a 1 KiB one, so the per-MiB term would be
    # fitted to noise and then multiplied by the GiB a GPU-sized segment saves: 16 MiB tensors too.
    sizes = (256, 2**18) if device.type == "cpu" else (256, 2**18, 2**22)
    for chain in (_tanh_chain, _norm_chain):
        for numel in sizes:
            x = torch.randn(numel // 64, 64, device=device, requires_grad=True)
            w = torch.randn(64, device=device, requires_grad=True)
            for k in (4, 32):
                recorder = _SavedRecorder(frozenset({_storage_key(w)}))
                with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
                    chain(x, w, k)
                plain = median_ms(lambda: chain(x, w, k).sum().backward())
                checkpointed = median_ms(
                    lambda: checkpoint(chain, x, w, k, use_reentrant=False).sum().backward())
                forward = median_ms(lambda: chain(x, w, k))
                rows.append((1.0, float(recorder.count), recorder.nbytes / 2**20))
                extra.append(checkpointed - plain - forward)
    return CheckpointCosts(*nonnegative_fit(rows, extra))


def nonnegative_fit(rows, targets) -> list[float]:
    """Least squares of ``targets`` on ``rows`` (one coefficient per column) with every
    coefficient at least 0: columns fitted negative are left out and the rest fitted again (the
    first column alone if none is left); left-out columns get 0."""
    terms = list(range(len(rows[0])))
    while True:
        a = torch.tensor([[r[t] for t in terms] for r in rows], dtype=torch.float64)
        fit = torch.linalg.lstsq(a, torch.tensor(targets, dtype=torch.float64).unsqueeze(1)).solution.squeeze(1)
        if (fit >= 0).all() or len(terms) == 1:
            break
        terms = [t for t, c in zip(terms, fit.tolist()) if c >= 0] or [0]
    out = [0.0] * len(rows[0])
    for t, c in zip(terms, fit.tolist()):
        out[t] = max(0.0, c)
    return out


def step_times(modules, inputs, repeats: int) -> list[float]:
    """Median milliseconds of one forward + backward (gradients not accumulated) of each of
    ``modules`` on the same ``inputs``, timed side by side: a step of each in turn, ``repeats``
    rounds after an untimed one (a shared, noisy machine drifts between rounds, not within)."""
    params = [[p for p in m.parameters() if p.requires_grad] for m in modules]
    samples: list[list[float]] = [[] for _ in modules]
    for r in range(repeats + 1):
        for i, m in enumerate(modules):
            ms = _step_ms(m, inputs, params[i])
            if r:
                samples[i].append(ms)
    return [statistics.median(s) for s in samples]


def _step_ms(module, inputs, params: list[torch.Tensor]) -> float:
    """Milliseconds of one forward + backward of ``module`` (gradients not accumulated)."""
    start = _now()
    loss = _scalar_loss(module(*inputs))
    if loss is not None and params:
        torch.autograd.grad(loss, params, allow_unused=True)
    del loss
    return (_now() - start) * 1e3


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module):
    """Restore the module's buffers, the CPU/CUDA RNG state, the module's own generators'
    (:func:`~fxremat.runtime.module_generators`) and Python's and numpy's global ones
    (:func:`~fxremat.passes.trace.python_rng_put_back`) on exit, and let go of autocast's cached casts:
    planning inside the caller's autocast region (the first step of a new input signature) left
    the profile's bf16 cast of a parameter in the cache, and the step then read that cast, whose
    autograd node was older than its own: Hugging Face BART's tied ``shared.weight`` (three
    readers) summed its gradient's terms in another order (7.5e-9 off eager on the first step).

    The parameters' ``.grad`` are set aside meanwhile and put back: a custom
    ``torch.autograd.Function`` handed a module (Reformer's reversible layers get their ModuleList)
    runs that module's backward itself, into its real parameters, whatever stand-ins the profile
    gives the node; the user's step then added the profile's gradients to its own (set aside, not
    copied: a copy of every gradient would double their memory while planning).

    Buffers go back as objects, into their slots, with their values: a forward that assigns a new
    tensor (``self.count = self.count + 1``, in a leaf module) left the profile's last tensor in
    the module (a call counter at 122 after compiling, where the plain model's was 0)."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    slots = [(m._buffers, dict(m._buffers)) for m in module.modules() if m._buffers]
    grads = [(p, p.grad) for p in module.parameters()]
    for p, _ in grads:
        p.grad = None
    generators = [(g, g.get_state()) for g in module_generators(module)]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        with python_rng_put_back():
            yield
    finally:
        for held, before in slots:
            if held.keys() != before.keys() or any(held[name] is not b for name, b in before.items()):
                held.clear()
                held.update(before)
        with torch.no_grad():
            for b, saved in buffers:
                put_back(b, saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for g, state in generators:
            g.set_state(state)
        torch.clear_autocast_cache()
        for p, grad in grads:
            p.grad = grad


@dataclass(frozen=True)
class PlainForward:
    """The model's own forward, called as the user calls it, beside its graph's: ``peak_bytes``,
    the most it holds at once, which its graph may not (a Python local holds a value until its
    function returns, where the graph frees it at its last use: smp's UNet++ decoder loop, -4.9%),
    and ``extra_bytes``, what it keeps at its end beyond the graph's (a captured model's, see
    :mod:`fxremat.passes.capture`; 0 for a traced one, whose graph is its code). The plain peak
    fxremat reports, and budgets are fractions of, is the larger of the graph's simulated plain
    step plus ``extra_bytes`` and ``peak_bytes``."""

    peak_bytes: int
    extra_bytes: int = 0


def forward_bytes(model: torch.nn.Module, fn, args: tuple, kwargs: dict, hooks: bool = True,
                  outputs: list | None = None) -> tuple[int, int]:
    """``(kept, peak)``: the bytes ``fn(*args, **kwargs)`` (a forward of ``model``) allocates that
    are alive at its end (what it keeps for the backward, and its outputs), and the most alive at
    once. ``model``'s buffers and the RNG states are put back; its user hooks run only with
    ``hooks`` (a traced model is profiled without them; a captured one's forward may need them:
    Hugging Face records hidden states with forward hooks, and UperNet's decoder read ``None``).
    The output, its tensors detached, is appended to ``outputs`` where given."""
    tracker = LiveStorageTracker()
    with (preserved_state(model), user_hooks_disabled(model) if not hooks else contextlib.nullcontext(),
          torch.enable_grad(), tracker):
        out = fn(*args, **kwargs)
        if outputs is not None:
            outputs.append(tree_map_only(torch.Tensor, torch.Tensor.detach, out))
        # autocast's cached casts (a call inside the caller's autocast region) are let go when the
        # region exits, before the backward; counted, the plain peak was predicted +50.8%
        torch.clear_autocast_cache()
        kept = tracker.live_bytes
        del out
    return kept, tracker.peak_bytes


_MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks")


@contextlib.contextmanager
def user_hooks_disabled(root: torch.nn.Module):
    """Remove the user hooks of every module of ``root`` and the global module hooks for the
    duration of the block (hooks defined inside torch stay); each comes back in its place after."""
    dicts = [getattr(m, name) for m in root.modules() for name in _MODULE_HOOK_DICTS]
    dicts += [getattr(torch.nn.modules.module, name) for name in _GLOBAL_HOOK_DICTS]
    removed = []
    for hooks in dicts:
        users = {k: h for k, h in hooks.items() if not is_library_hook(h)}
        if users:
            removed.append((hooks, dict(hooks), users))
            for k in users:
                del hooks[k]
    try:
        yield
    finally:
        for hooks, before, users in removed:
            added = {k: h for k, h in hooks.items() if k not in before}
            kept = dict(hooks)
            hooks.clear()
            hooks.update((k, h) for k, h in before.items() if k in users or k in kept)
            hooks.update(added)


def _flop_cost(cost_model: str, flops: int, moved: int) -> float:
    """A node's forward cost without a clock: FLOPs plus its bytes moved (``"flops"``), plus a
    fused kernel's share of them (``"compiled"``), or 1 (``"uniform"``)."""
    if cost_model == "flops":
        return float(flops + FLOPS_PER_BYTE * moved)
    if cost_model == "compiled":
        return float(flops + FLOPS_PER_BYTE * FUSED_TRAFFIC * moved)
    return 1.0


def resolve_cost_model(cost_model: str, example_inputs, gm: fx.GraphModule) -> str:
    """Validate ``cost_model``; on fake tensors "measured" becomes "flops" (with a warning)."""
    if cost_model not in COST_MODELS:
        raise ValueError(f"fxremat: cost_model must be one of {COST_MODELS}, got {cost_model!r}")
    if cost_model == "measured" and (is_fake(example_inputs) or is_fake(list(gm.parameters()))):
        warnings.warn(
            "fxremat: cost_model='measured' cannot time fake tensors; using cost_model='flops'. "
            "Pass cost_model='flops' to silence this warning.",
            stacklevel=4,
        )
        return "flops"
    return cost_model


def _allocator_device(gm: fx.GraphModule, example_inputs) -> torch.device | None:
    """The CUDA device whose caching allocator the graph's real (not fake) tensors use, or None."""
    for t in [*_tensors(example_inputs), *gm.parameters(), *gm.buffers()]:
        if t.is_cuda and not isinstance(t, FakeTensor):
            return t.device
    return None


def profile(gm: fx.GraphModule, example_inputs, *, cost_model: str = "measured", repeats: int = 3) -> GraphCosts:
    """Profile every call node of ``gm`` on ``example_inputs`` (see the module docstring).

    Profiling holds every value of the forward and runs plain steps, so it needs more memory than
    the plain step: a model that does not fit on its device (why it is compiled) ran out of memory
    inside ``fxremat.compile``. Then it is profiled again on fake tensors (a copy of ``gm`` and its
    inputs under ``FakeTensorMode``: the same bytes, nothing allocated), with flop counts for time
    where the clock was asked for, and a warning says so."""
    try:
        return _profile(gm, example_inputs, cost_model, repeats)
    except torch.OutOfMemoryError as exc:
        if is_fake(example_inputs):
            raise
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    # (out of the except block: the exception's frames held the step's tensors)
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    fallback = "flops" if cost_model == "measured" else cost_model
    warnings.warn(
        f"fxremat: profiling {type(gm).__name__} ran out of device memory ({cause[:160]}); profiled again on "
        f"fake tensors (the same bytes, nothing allocated), with cost_model={fallback!r}. Planning needs more "
        f"memory than a plain step; the compiled module itself trains within its plan", stacklevel=3)
    mode = FakeTensorMode()
    with FakeCopyMode(mode):
        fake_gm = copy.deepcopy(gm)
    fake_inputs = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, example_inputs)
    with mode:
        return _profile(fake_gm, fake_inputs, fallback, repeats)


def _profile(gm: fx.GraphModule, example_inputs, cost_model: str, repeats: int) -> GraphCosts:
    cost_model = resolve_cost_model(cost_model, example_inputs, gm)
    with preserved_state(gm), torch.enable_grad(), user_hooks_disabled(gm):
        interp = _ProfilingInterpreter(gm, cost_model, repeats, _allocator_device(gm, example_inputs))
        for t in _tensors(example_inputs):
            interp.owner.setdefault(_storage_key(t), "")
        interp.run(*example_inputs)
        costs = interp.settled_costs()
        interp.env.clear()  # the clocks below time steps as training runs them, nothing else held
        if cost_model == "measured":
            fwd, bwd, step = _time_steps(gm, example_inputs, repeats)
            if interp.allocator_device is not None:
                fwd = _overlapped(fwd, _whole_forward_ms(gm, example_inputs, repeats))
            costs = tuple(replace(c, fwd_cost=fwd[c.name], bwd_cost=bwd.get(c.name, 0.0)) for c in costs)
            devices = {t.device for t in _tensors(example_inputs)} or {torch.device("cpu")}
            mechanism = machine_checkpoint_costs(next(iter(devices)))
        else:
            costs = tuple(replace(c, bwd_cost=2.0 * c.fwd_cost) for c in costs)
            mechanism = None  # no clock: the mechanism is not modelled
        total_fwd = sum(c.fwd_cost for c in costs)
        if cost_model != "measured":
            step = 3.0 * total_fwd  # backward ~ twice the forward
    unit = {"measured": "ms", "flops": "flop-equivalents", "compiled": "flop-equivalents", "uniform": "nodes"}[cost_model]
    log.debug("fxremat: profiled %d nodes (%s), step cost %.3g %s", len(costs), cost_model, step, unit)
    return GraphCosts(nodes=costs, step_cost=max(step, total_fwd), cost_model=cost_model, cost_unit=unit,
                      mechanism=mechanism)
