"""Capture a model whose ``forward`` torch.fx cannot make placeholders for: :func:`capture_call`.

Hugging Face transformers wraps every model's ``forward`` in decorators whose wrapper takes
``(self, *args, **kwargs)``; torch.fx gives such a wrapper one ``*args`` placeholder, which the
wrapper's body cannot unpack, and the whole model is untraceable. Symbolic tracing with the
decorators unwrapped does not help either: the models' mask builders and loss code branch on
values (measured on GPT-2, BERT, Llama, T5 and ViT from transformers 5.24: torch.fx fails inside
the base model on all five, so nothing inside could be recomputed).

Such a model is captured per call instead, with ``torch.export.export(model, args, kwargs,
strict=False)``, which runs the Python code as written on fake tensors and records the ATen ops
it reaches (all five models above: 142 to 469 nodes). The exported program is unlifted into a
GraphModule whose ``get_attr`` nodes read the model's parameters and buffers under their
qualified names (so :func:`fxremat.runtime.attribute_bindings` keeps them the model's own), with
flat positional placeholders and a flat tuple output; :class:`Captured` keeps the pytrees to
flatten a call's ``(args, kwargs)`` into those placeholders and to rebuild the output
(a ``ModelOutput``, a dict, a tuple) from the graph's results.

The captured graph is not always the code eager PyTorch runs: libraries take other paths when
they see they are being exported (Hugging Face's loss's upcast logits; its attention masks, which
eager leaves out where the attention mask is all ones, reading its values, and an export never
does: the capture follows eager there, keyed by those values, :func:`value_facts`), and with
``use_cache=False`` it builds no key/value cache, so it may keep more or fewer bytes than the model run plainly. :func:`capture_call` therefore runs the call
once plainly and the graph once, and measures how much more the plain forward keeps, and its
peak (``Captured.plain``), so that the plain peak fxremat reports and budgets are fractions of
is the model's own (measured on GPT-2, Llama, T5, ViT: the captured
graph keeps -4.6 KB to +47 KB less, 1.4-2.6% of the plain peak).

A custom ``torch.autograd.Function`` (Bloom's GELU, a straight-through estimator) would not
survive the capture as written: export records the ops of its ``forward`` and autograd would
differentiate those instead of running its ``backward``. While capturing, each
``SomeFunction.apply(...)`` is therefore recorded as one opaque op (``fxremat::function_apply``,
whose fake kernel runs the forward on export's fake tensors), and that op is then replaced by a
call of ``SomeFunction.apply`` itself, as in a traced model: it runs, and is recomputed, with its
own backward.

Export cannot capture code that branches on a tensor's value (``if not torch.isfinite(h).all():``
in every encoder layer of DETR, Conditional DETR and Mask2Former in training; ``Gumbel(...)``'s
argument check in GroupViT; the random size choice and the detection code of torchvision's
Faster R-CNN). Where the failing line runs inside a submodule, the submodules of its class become
opaque and the call is captured again (:func:`capture_call`, with a ``UserWarning`` naming them,
the line and the cause): each call of one is recorded as one ``fxremat::module_call`` op, whose
fake kernel returns outputs shaped as that call's outputs in a plain run of the model (made once
beforehand, state put back), and the op then becomes a ``call_module`` node of the submodule, a
leaf as in a traced model: it runs as written, and is kept or recomputed whole. The innermost
submodule whose code was running is chosen, so the rest of the model stays a graph of ATen ops.
A failure in the top-level ``forward``'s own code (a check of the labels' values, as Hugging
Face's CTC heads make) still raises :class:`fxremat.TraceError`, naming the line.

The graph is specialised to the call's input shapes and to its non-tensor arguments, so
:class:`fxremat.RematModule` captures once per input signature. A forward with a ``use_cache``
parameter that the call does not set gets ``use_cache=False``, as Hugging Face's own training
with checkpointing does (the output then has no key/value cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import io
import logging
import operator
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx._pytree import tree_flatten_spec
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_flatten_with_path, tree_map_only, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import TraceError
from .profile import PlainForward, is_fake, forward_bytes, preserved_state
from .trace import (function_call, functions_routed, hooked_modules, is_compiled, is_library_hook,
                    own_checkpoint_warning, own_checkpoints_seen, python_draws_warned, restore_modes, trace, user_line,
                    user_stack_line, varargs_reason)

__all__ = ["Captured", "capture_call", "tensor_leaves"]

log = logging.getLogger("fxremat")

# Nodes of an exported program that check the inputs against what export saw; the plan cache is
# keyed by the same properties (shapes, dtypes, devices), so the emitted graph does without them.
_CHECK_TARGETS = (torch.ops.aten._assert_tensor_metadata.default,)


@dataclass(frozen=True)
class Captured:
    """One captured call: ``graph_module`` takes the call's flattened inputs at ``kept``
    (tensors and other values the graph reads) and returns the flattened output."""

    graph_module: fx.GraphModule
    in_spec: TreeSpec
    out_spec: TreeSpec
    kept: tuple[int, ...]
    added_kwargs: dict = field(default_factory=dict)
    plain: PlainForward = PlainForward(peak_bytes=0)  # the model's own forward beside the graph's

    def inputs(self, args: tuple, kwargs: dict) -> tuple:
        """The graph's positional inputs for a call with ``args``/``kwargs``."""
        flat = tree_flatten_spec((tuple(args), {**kwargs, **self.added_kwargs}), self.in_spec)
        return tuple(flat[i] for i in self.kept)

    def output(self, flat) -> object:
        """The forward's output (its own pytree: ``ModelOutput``, dict, tuple) from the graph's."""
        return tree_unflatten(list(flat), self.out_spec)


def _added_kwargs(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """Keywords the capture sets that the call left out: ``use_cache=False`` in training, where
    ``forward`` names ``use_cache``, or takes ``**kwargs`` on a model whose ``config`` has one (a
    wrapper passing them down: PEFT's ``PeftModel``, whose capture failed on the cache returned)."""
    params = inspect.signature(model.forward).parameters
    if "use_cache" in kwargs:
        return {}
    if "use_cache" not in params:
        passes_down = any(p.kind is p.VAR_KEYWORD for p in params.values())
        return {"use_cache": False} if passes_down and hasattr(getattr(model, "config", None), "use_cache") else {}
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if "use_cache" in names[:len(args)]:
        return {}
    return {"use_cache": False}


def _flat_graph(exported: torch.export.ExportedProgram) -> tuple[fx.GraphModule, tuple[int, ...]]:
    """The unlifted program with the default codegen: positional placeholders, tuple output,
    no input checks; placeholders nothing reads are dropped (their indices are not kept). Only
    what the checks alone read goes with them: a call whose result the forward drops stays, as it
    ran in eager (a BatchNorm whose output is unused still updates its running statistics, which
    ``aten.batch_norm``'s schema does not say; an unused dropout still draws its numbers)."""
    unlifted = exported.module()
    graph = unlifted.graph
    graph._codegen = fx.graph.CodeGen()
    read: list[fx.Node] = []
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" or node.target in _CHECK_TARGETS:
            read += node.all_input_nodes
            graph.erase_node(node)
    gone: set[fx.Node] = set()
    while read:  # what only the checks read (sizes of the inputs)
        node = read.pop()
        if node.op == "call_function" and not node.users and node not in gone:
            read += node.all_input_nodes
            gone.add(node)
            graph.erase_node(node)
    kept = []
    for i, node in enumerate([n for n in graph.nodes if n.op == "placeholder"]):
        if node.users or isinstance(node.meta.get("val"), torch.Tensor):
            kept.append(i)
        else:
            graph.erase_node(node)
    graph.lint()
    gm = fx.GraphModule(unlifted, graph, type(unlifted).__name__)
    return gm, tuple(kept)


@dataclass
class _FunctionCall:
    """One ``SomeFunction.apply(*args, **kwargs)`` met while capturing: the call's flattened
    arguments (fake tensors and constants) and, once its fake kernel ran, its flattened output."""

    cls: type
    run: object  # applies the Function as torch does
    leaves: list
    spec: TreeSpec
    out_leaves: list | None = None
    out_spec: TreeSpec | None = None

    def arguments(self, tensors) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of the call with its tensors replaced by ``tensors``, in order."""
        it = iter(tensors)
        return tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in self.leaves], self.spec)


_CALLS: dict[int, _FunctionCall] = {}  # the calls of the capture in progress, by the op's first argument


@torch.library.custom_op("fxremat::function_apply", mutates_args=())
def _function_apply(call: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stands for the custom Function call ``_CALLS[call]`` (its tensor arguments ``tensors``, its
    tensor outputs returned) in a graph being captured; replaced by :func:`_functions_kept_whole`
    before the graph runs."""
    raise RuntimeError("fxremat: a captured autograd.Function call was left unconverted")


@_function_apply.register_fake
def _function_apply_fake(call: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = _CALLS[call]
    args, kwargs = entry.arguments(tensors)
    with torch.no_grad():
        out = entry.run(*args, **kwargs)
    entry.out_leaves, entry.out_spec = tree_flatten(out)
    # an op's outputs are new tensors: a forward that returns an input (or a view of one) is cloned
    return [x.clone() for x in entry.out_leaves if isinstance(x, torch.Tensor)]


def _as_one_op(cls, run, args, kwargs):
    """While capturing, a custom Function's ``apply`` is recorded as one ``fxremat::function_apply``
    op; torch's own Functions run as written."""
    if cls.__module__.startswith("torch."):
        return run(*args, **kwargs)
    key = len(_CALLS)
    leaves, spec = tree_flatten((args, kwargs))
    _CALLS[key] = entry = _FunctionCall(cls, run, leaves, spec)
    outputs = iter(_function_apply(key, [x for x in leaves if isinstance(x, torch.Tensor)]))
    return tree_unflatten([next(outputs) if isinstance(x, torch.Tensor) else x for x in entry.out_leaves],
                          entry.out_spec)


def _functions_kept_whole(model: torch.nn.Module, gm: fx.GraphModule, calls: dict[int, _FunctionCall]) -> None:
    """Each ``fxremat::function_apply`` node of ``gm`` becomes a call of its Function's ``apply``
    (a :class:`~fxremat.passes.trace.ModeCall` after :func:`restore_modes`); in place."""
    graph = gm.graph
    ops = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.fxremat.function_apply.default]
    paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
    for node in ops:
        entry = calls[node.args[0]]
        args, kwargs = entry.arguments(node.args[1])
        with graph.inserting_before(node):
            # a module among its arguments (Reformer hands its ModuleList of layers to its reversible
            # Function): read from gm by its path, as torch.fx does; as a constant, its repr was
            # pasted into the code (SyntaxError)
            args, kwargs = tree_map_only(torch.nn.Module, lambda m: _module_argument(model, gm, paths, m, entry.cls),
                                         (args, kwargs))
        single = entry.out_spec.is_leaf()
        if not single and not (entry.out_spec.type in (tuple, list) and entry.out_spec.num_children == len(entry.out_leaves)
                               and all(isinstance(x, torch.Tensor) for x in entry.out_leaves)):
            raise TraceError("", RuntimeError(
                f"the custom torch.autograd.Function {entry.cls.__module__}.{entry.cls.__qualname__} returns a "
                f"{entry.out_spec.type.__name__}, not a tensor or a flat tuple of tensors, which fxremat cannot keep "
                "whole in a torch.export capture"),
                module_class=type(model).__name__, hint=(
                    "return a tensor or a tuple of tensors from its forward, or train this model without fxremat"))
        with graph.inserting_before(node):
            call = function_call(graph, entry.cls, args, kwargs)
        if single:  # the op's outputs are a list, read by getitem: a single tensor is the call itself
            for user in list(node.users):
                user.replace_all_uses_with(call)
                graph.erase_node(user)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    if ops:
        restore_modes(gm)


def _module_argument(model: torch.nn.Module, gm: fx.GraphModule, paths: dict, module: torch.nn.Module,
                     cls: type) -> fx.Node:
    """A ``get_attr`` node (at the graph's insertion point) reading ``module``, a submodule of ``model``
    passed to the custom Function ``cls``, installed in ``gm`` under its qualified name."""
    path = paths.get(id(module))
    if not path:
        raise TraceError("", RuntimeError(
            f"the custom torch.autograd.Function {cls.__module__}.{cls.__qualname__} is passed a "
            f"{type(module).__name__} that is not a submodule of {type(model).__name__}"),
            module_class=type(model).__name__, hint=(
                "register that module as a submodule of the model (an attribute set in __init__), or pass "
                "leaf_modules= naming the submodule that calls the Function, so it runs whole"))
    gm.add_submodule(path, module)  # as a module kept whole: the model's own, its parameters under their names
    return gm.graph.get_attr(path)


@dataclass(frozen=True)
class _TensorMeta:
    """What the captured graph needs of a tensor an opaque submodule returned: its metadata."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> "_TensorMeta":
        return _TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


@dataclass
class _PlainCall:
    """One call of an opaque submodule in the plain run: its tensor inputs' and outputs' metadata,
    and its output's structure (its non-tensor leaves as they were)."""

    inputs: dict  # see _argument_shapes
    out_leaves: list  # a _TensorMeta for each tensor, the value itself for the rest
    out_spec: TreeSpec


@dataclass
class _ModuleCall:
    """One call of an opaque submodule met while capturing: its path, its flattened arguments
    (fake tensors and constants) and the plain call it stands for."""

    path: str
    leaves: list
    spec: TreeSpec
    plain: _PlainCall


_MODULE_CALLS: dict[int, _ModuleCall] = {}  # the opaque calls of the capture in progress


@torch.library.custom_op("fxremat::module_call", mutates_args=())
def _module_call(call: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stands for the opaque submodule call ``_MODULE_CALLS[call]`` in a graph being captured;
    replaced by a ``call_module`` node (:func:`_modules_kept_whole`) before the graph runs."""
    raise RuntimeError("fxremat: a captured opaque submodule call was left unconverted")


@_module_call.register_fake
def _module_call_fake(call: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    outs = [m for m in _MODULE_CALLS[call].plain.out_leaves if isinstance(m, _TensorMeta)]
    return [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device) for m in outs]


class _OpaqueMismatch(Exception):
    """An opaque submodule (``path``) was called while capturing otherwise than in the plain run."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


# What an opaque submodule's call may take besides tensors: values a graph holds as constants. (An
# object holding tensors, as torchvision's ImageList, would be held with the tensors of the capture.)
_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
              torch.memory_format, enum.Enum)
# What it may return besides tensors: no Python number, which may come from tensor values and which
# a graph would hold fixed, and no object.
_RETURNED_CONSTANTS = (type(None), str, torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum)


def _argument_shapes(forward, args: tuple, kwargs: dict) -> dict[str, list]:
    """``{argument name: [(shape, dtype) of each tensor in it]}`` of a call of ``forward``. A call
    while capturing is compared with its plain call by name: Hugging Face passes a mask under
    export where its plain forward passes ``None`` (DETR's encoder layers)."""
    try:
        bound = inspect.signature(forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature to bind to: the tensors in order
        bound = {"*": (args, kwargs)}
    return {name: [(tuple(x.shape), x.dtype) for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor)]
            for name, value in bound.items()}


def tensor_leaves(out) -> tuple:
    """The tensors of an opaque submodule's output (a ``ModelOutput``, a dict, nested tuples), in
    pytree order: what the captured graph read of it."""
    return tuple(x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor))


@contextlib.contextmanager
def _forwards_replaced(modules: dict, make):
    """Each module of ``modules`` (path -> module) has ``make(path, its forward)`` as its forward
    for the duration of the block (an instance attribute; whatever the instance held comes back)."""
    held = {}
    for path, module in modules.items():
        held[path] = module.__dict__.get("forward")
        module.forward = make(path, module.forward)
    try:
        yield
    finally:
        for path, module in modules.items():
            if held[path] is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = held[path]


# The functions that draw random numbers into a new tensor (or in place, for the methods), whose
# values a branch may read: not dropout, whose draw changes values and never the work done.
_RANDOM_DRAWS = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
                 torch.randperm, torch.bernoulli, torch.normal, torch.poisson, torch.multinomial,
                 torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.bernoulli_, torch.Tensor.random_,
                 torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.cauchy_, torch.Tensor.log_normal_,
                 torch.Tensor.bernoulli, torch.Tensor.multinomial}
# What turns a tensor's value into a Python value, on which the code may branch.
_READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__,
          torch.Tensor.__index__, torch.Tensor.tolist}


class _RandomBranches(TorchFunctionMode):
    """While active, tensors computed from a random draw (:data:`_RANDOM_DRAWS`, then every op
    that reads one) are followed, and the first place the code reads one's value as a Python
    value is kept in ``where`` (``file:line (function: code)``): a LayerDrop's ``if torch.rand([])
    < p: continue``, which export cannot capture, so its module is kept whole, and whose memory
    then depends on the draw (the plan holds for the profiled call's)."""

    def __init__(self):
        super().__init__()
        self.drawn = WeakIdKeyDictionary()
        self.where: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        from_draw = any(x in self.drawn for x in inputs)
        if from_draw and func in _READS and self.where is None:
            self.where = user_stack_line() or "its forward"
        out = func(*args, **kwargs)
        if func in _RANDOM_DRAWS or from_draw:
            for x in tree_flatten(out)[0]:
                if isinstance(x, torch.Tensor):
                    self.drawn[x] = True
        return out


def _plain_calls(model: torch.nn.Module, modules: dict, args: tuple, kwargs: dict,
                 random_branches: dict | None = None) -> dict[str, list[_PlainCall]]:
    """The calls of ``modules`` in one plain run of ``model(*args, **kwargs)`` (no gradients; its
    buffers and the RNG states put back): what each took and returned. Where a module's code
    branched on a random draw, ``random_branches[its path]`` is the line (see
    :class:`_RandomBranches`)."""
    calls: dict[str, list[_PlainCall]] = {path: [] for path in modules}

    def recording(path, forward):
        def call(*a, **k):
            with _RandomBranches() as seen:
                out = forward(*a, **k)
            if seen.where is not None and random_branches is not None:
                random_branches.setdefault(path, seen.where)
            leaves, spec = tree_flatten(out)
            inputs = _argument_shapes(forward, a, k)
            calls[path].append(_PlainCall(inputs, [_TensorMeta.of(x) if isinstance(x, torch.Tensor) else x
                                                   for x in leaves], spec))
            return out
        return call

    with preserved_state(model), torch.no_grad(), _forwards_replaced(modules, recording):
        model(*args, **kwargs)
    return calls


def _plain_error(model: torch.nn.Module, args: tuple, kwargs: dict) -> Exception | None:
    """The error ``model(*args, **kwargs)`` raises run plainly (with gradients, as it trains: a
    forward registering a tensor hook fails without them; its state put back), or ``None``: a
    capture that failed in the top-level forward on the model's own error (a T5 config without
    ``decoder_start_token_id``, needed to shift the labels) was reported as code torch.export
    cannot capture, with advice to make the line work on unknown values."""
    try:
        _run_plainly(model, args, kwargs)
    except Exception as exc:  # whatever the model's own code raises is the user's to see
        return exc
    return None


def _run_plainly(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """``model(*args, **kwargs)`` run once as it trains (gradients on: a forward registering a
    tensor hook fails without them, gradient checkpointing turns transformers' cache off only with
    them), its state put back and the output dropped."""
    with preserved_state(model), torch.enable_grad():
        model(*args, **kwargs)


def _opaque(modules: dict, plain: dict[str, list[_PlainCall]]):
    """``make`` for :func:`_forwards_replaced` while capturing: the n-th call of a module is one
    ``fxremat::module_call`` op shaped as its n-th plain call."""
    seen = dict.fromkeys(modules, 0)

    def make(path, forward):
        def call(*a, **k):
            n, seen[path] = seen[path], seen[path] + 1
            if n >= len(plain[path]):
                raise _OpaqueMismatch(path, f"it was called {n + 1} times while captured and {len(plain[path])} "
                                            "times when run plainly")
            record = plain[path][n]
            leaves, spec = tree_flatten((a, k))
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            shapes = _argument_shapes(forward, a, k)
            differ = [name for name in shapes.keys() & record.inputs.keys()
                      if shapes[name] and record.inputs[name] and shapes[name] != record.inputs[name]]
            if differ:
                raise _OpaqueMismatch(path, f"its call {n} took {differ[0]!r} of shapes {shapes[differ[0]]} while "
                                            f"captured and {record.inputs[differ[0]]} when run plainly")
            odd = next((x for x in leaves if not isinstance(x, (torch.Tensor, *_CONSTANTS))), None)
            if odd is not None:
                raise _OpaqueMismatch(path, f"its call {n} takes an object of type {type(odd).__name__}, which a "
                                            "graph would hold as it was while captured")
            odd = next((x for x in record.out_leaves if not isinstance(x, (_TensorMeta, *_RETURNED_CONSTANTS))), None)
            if odd is not None:
                what = (f"the Python number {odd!r}" if isinstance(odd, (bool, int, float, complex))
                        else f"an object of type {type(odd).__name__}")
                raise _OpaqueMismatch(path, f"its call {n} returns {what}, which a graph would hold fixed")
            key = len(_MODULE_CALLS)
            _MODULE_CALLS[key] = _ModuleCall(path, leaves, spec, record)
            outs = iter(_module_call(key, tensors))
            return tree_unflatten([next(outs) if isinstance(m, _TensorMeta) else m for m in record.out_leaves],
                                  record.out_spec)
        return call

    return make


def _modules_kept_whole(gm: fx.GraphModule, calls: dict[int, _ModuleCall], modules: dict) -> None:
    """Each ``fxremat::module_call`` node of ``gm`` becomes a ``call_module`` node of its submodule
    (installed in ``gm`` under its qualified name); in place."""
    graph = gm.graph
    ops = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.fxremat.module_call.default]
    for path in {calls[n.args[0]].path for n in ops}:
        gm.add_submodule(path, modules[path])
    for node in ops:
        entry = calls[node.args[0]]
        it = iter(node.args[1])
        args, kwargs = tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in entry.leaves],
                                      entry.spec)
        out_leaves, out_spec = entry.plain.out_leaves, entry.plain.out_spec
        at = [i for i, m in enumerate(out_leaves) if isinstance(m, _TensorMeta)]  # the op's i-th output's leaf
        with graph.inserting_before(node):
            call = graph.call_module(entry.path, tuple(args), kwargs)
            call.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
            if out_spec.is_leaf():
                single = call
            elif out_spec.type in (tuple, list) and out_spec.num_children == len(out_leaves):
                single = None
            else:  # a ModelOutput, a dict, nested tuples: its tensors in pytree order
                single = graph.call_function(tensor_leaves, (call,))
                at = list(range(len(at)))
        for user in list(node.users):
            if single is call:
                user.replace_all_uses_with(call)
                graph.erase_node(user)
                continue
            with graph.inserting_before(user):
                picked = graph.call_function(operator.getitem, (single or call, at[user.args[1]]))
            picked.meta.update(user.meta)
            user.replace_all_uses_with(picked)
            graph.erase_node(user)
        graph.erase_node(node)
    if ops:
        graph.lint()
        gm.recompile()


def _failing_submodule(model: torch.nn.Module, exc: BaseException) -> str:
    """The qualified name of the innermost submodule of ``model`` whose code was running where
    ``exc`` (or the exception it was raised from) came from; ``""`` for the top-level forward's own."""
    paths = {id(m): path for path, m in model.named_modules()}
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found, tb = None, exc.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and id(owner) in paths:
                found = paths[id(owner)]
            tb = tb.tb_next
        if found:
            return found
        exc = exc.__cause__ or exc.__context__
    return ""


_MAX_OPAQUE_ROUNDS = 16


def _cause_of_type(exc: BaseException | None, cls: type):
    """``exc`` or the first exception it was raised from (or during) that is a ``cls``, or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, cls):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class _TensorHookNotCaptured(RuntimeError):
    """The captured code registered a hook on a tensor (``h.register_hook(fn)``: Grad-CAM's
    gradient store, a gradient scaling): torch.export records no hook, so the captured graph would
    never call it (the gradients silently differed from eager's, or the hook's store stayed empty)."""


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


@contextlib.contextmanager
def _tensor_hooks_refused():
    """``Tensor.register_hook`` called by the model's code (not torch's) raises
    :class:`_TensorHookNotCaptured` while the block runs: the submodule that does it is kept whole
    (it runs as written, and its hook fires), the top-level forward is refused."""
    original = torch.Tensor.register_hook

    def register_hook(self, hook):
        if sys._getframe(1).f_code.co_filename.startswith(_TORCH_DIR):
            return original(self, hook)
        raise _TensorHookNotCaptured(
            f"the forward registers a hook on a tensor ({getattr(hook, '__name__', type(hook).__name__)}), which "
            f"torch.export does not record: the captured graph would never call it")

    torch.Tensor.register_hook = register_hook
    try:
        yield
    finally:
        torch.Tensor.register_hook = original


# Transformers' mask builders leave a mask out where eager SDPA can do without it (``is_causal``,
# grouped key/value heads as they are): they read the attention mask's values for that, and never
# leave it out while exported, as an exported program serves any shape. A capture is specialised
# to the call's shapes, and to the facts below, so it takes eager's path (:func:`_masks_as_eager`).
_MASK_NAMES = ("attention_mask", "decoder_attention_mask", "encoder_attention_mask")
_NAMED_INTEGERS = ("input_ids", "labels", "token_type_ids", "decoder_input_ids", "position_ids") + _MASK_NAMES
_MASKING_NAMES = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa", "find_packed_sequence_indices",
                  "is_torchdynamo_exporting", "_preprocess_mask_arguments")
_TRANSFORMERS_MODELS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # model -> it holds a transformers module
# model -> whether one of its captures decided on the facts (left a mask out, or looked for packed
# sequences, or might have): where none did (a decoder layer compiled alone, eager attention), no
# facts are read at its calls (each costs a device sync) and they are no part of its plan-cache key
_READS_MASKS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# patching masking_utils' globals and exporting is one step at a time (DataParallel's replicas
# make their first calls, and so their captures, in threads of their own)
_EXPORT_LOCK = threading.RLock()


def _holds_transformers(model: torch.nn.Module) -> bool:
    """Whether ``model`` is or holds a Hugging Face transformers module (looked up once a model)."""
    held = _TRANSFORMERS_MODELS.get(model)
    if held is None:
        held = _TRANSFORMERS_MODELS[model] = any(type(m).__module__.startswith("transformers.")
                                                 for m in model.modules())
    return held


def _named_tensors(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """The call's tensors with the last name on their way in: the forward's parameter, or the key
    in a dict (a batch passed as one dict) or the attribute that holds them."""
    try:
        named = dict(inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments)
    except TypeError:  # a forward that takes its inputs in another way: the keywords only
        named = dict(kwargs, **{f"argument {i}": a for i, a in enumerate(args)})
    leaves, _ = tree_flatten_with_path(named)
    out = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
            out.append((next((n for n in reversed(names) if n), ""), leaf))
    return out


def _named_masks(named: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """The 2-D attention masks among ``named`` (:func:`_named_tensors`), in order."""
    return [t for n, t in named if n in _MASK_NAMES and t.dim() == 2]


def _one_sequence_a_row(positions: torch.Tensor) -> bool:
    """Whether each row of ``positions`` (any number of dimensions: Qwen2-VL's are 3-D) steps by
    one (transformers finds no packed sequences)."""
    return positions.shape[-1] < 2 or bool((positions.diff(dim=-1) == 1).all())


def _packed_positions(values: torch.Tensor) -> bool:
    """Whether ``values`` (2-D integers) could be position ids of packed sequences: each element
    one more than the one before it or 0, and a row that steps up and starts again at 0 (token
    ids are not so, nor a tensor of zeros)."""
    if values.shape[-1] < 3 or values.dtype == torch.bool:
        return False
    later, earlier = values[:, 1:], values[:, :-1]
    up, reset = later == earlier + 1, later == 0
    return bool((up | reset).all() & up.any() & reset.any())


def value_facts(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The values besides shapes that a capture of ``model(*args, **kwargs)`` depends on, part of
    its plan-cache key: for a model holding transformers modules (with its ``masking_utils``
    loaded, and unless none of its captures decided on them), whether each 2-D attention mask given
    (a tensor named as in ``_MASK_NAMES``: an argument, a dict key) is all ones; and whether the
    position ids are one sequence a row: those named ``position_ids`` step by one in each row,
    or, none given, no 2-D integer tensor named otherwise than in ``_NAMED_INTEGERS`` looks like
    packed position ids (it could be position ids under another name; token ids do not look so).
    Eager transformers reads the same values at each call to choose its attention path; ``()``
    for other models."""
    if not _READS_MASKS.get(model, True):
        return ()
    return _facts(model, args, kwargs)


def _facts(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """:func:`value_facts` read whatever the model's captures did."""
    if "transformers.masking_utils" not in sys.modules or not _holds_transformers(model):
        return ()
    named = [(n, t) for n, t in _named_tensors(model, args, kwargs) if not is_fake(t)]
    positions = [t for n, t in named if n == "position_ids" and t.dim() >= 1]
    if positions:
        steps = all(_one_sequence_a_row(t) for t in positions)
    else:  # position ids under another name: those with a row that starts again at 0 (packed sequences)
        steps = not any(_packed_positions(t) for n, t in named
                        if n not in _NAMED_INTEGERS and t.dim() == 2 and not t.is_floating_point())
    return (("masks all ones", tuple(bool(m.all()) for m in _named_masks(named))),
            ("positions step by one", steps))


def _eager_looks_for_packing(model: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``model(*args, **kwargs)`` run plainly as it trains (gradients on, its state put
    back) looks for packed sequences in its position ids: transformers does only where it builds
    no key/value cache, which depends on the model (BERT builds none unless a decoder; Qwen2 one
    where ``use_cache`` is left to its config; none under gradient checkpointing, which turns
    ``use_cache`` off only with gradients on: run without them, a Qwen2 with gradient
    checkpointing built a cache, and its capture attended across packed sequences, loss 0.0095 off)."""
    masking = sys.modules["transformers.masking_utils"]
    original, calls = masking.find_packed_sequence_indices, []

    def counted(position_ids):
        calls.append(1)
        return original(position_ids)

    with _EXPORT_LOCK:
        masking.find_packed_sequence_indices = counted
        try:
            _run_plainly(model, args, kwargs)
        finally:
            masking.find_packed_sequence_indices = original
    return bool(calls)


@contextlib.contextmanager
def _masks_as_eager(model: torch.nn.Module, facts: tuple, packing_looked: bool = True):
    """Transformers' mask builders (``masking_utils``) decide as eager does while ``facts``
    (:func:`value_facts`) hold: a causal or bidirectional mask is left out (SDPA's ``is_causal``,
    and ``enable_gqa`` for grouped key/value heads) where the padding mask is absent, or is one of
    the call's own attention masks (the very tensor, as the model hands it on) that is all ones,
    and the shapes allow it; position ids stepping by one are no packed sequences, nor any where
    eager does not look for them (``packing_looked``: it builds a cache). Exported as they are,
    the masks stayed explicit: Qwen2, Mistral and Llama trained with 18 of 27 gradients ~1e-8 off
    eager's on batches without padding. Any other mask (one the model builds, one under another
    name) keeps the export's path. Also records in ``_READS_MASKS`` whether a decision was made."""
    masking = sys.modules.get("transformers.masking_utils")
    if not facts or masking is None or not all(hasattr(masking, n) for n in _MASKING_NAMES):
        yield
        return
    known = dict((fact[0], fact[1:]) for fact in facts)
    ones = known["masks all ones"][0]
    steps = known["positions step by one"][0] or not packing_looked
    original: dict = {}  # read under the lock, as the patch is made
    given: list[torch.Tensor] = []  # the call's all-ones masks, as the export hands them to the forward
    marked: list[torch.Tensor] = []  # those as masking_utils prepared them
    decided = []  # a decision the facts could change was made

    def seen(module, args, kwargs):
        masks = _named_masks(_named_tensors(module, args, kwargs))
        given.extend(m for m, one in zip(masks, ones) if one)

    def prepared(*args, **kwargs):
        out = original["_preprocess_mask_arguments"](*args, **kwargs)
        mask = args[2] if len(args) > 2 else kwargs.get("attention_mask")
        if any(mask is m for m in given) and isinstance(out[1], torch.Tensor):
            marked.append(out[1])
        return out

    def padding(mask):  # the padding mask eager's decision sees: None where it is all ones
        return None if mask is not None and any(mask is m for m in marked) else mask

    def causal(padding_mask, *rest, **options):
        decided.append(1)
        return original["_ignore_causal_mask_sdpa"](padding(padding_mask), *rest, **options)

    def bidirectional(padding_mask, *rest, **options):
        decided.append(1)
        return original["_ignore_bidirectional_mask_sdpa"](padding(padding_mask), *rest, **options)

    def packed(position_ids):
        decided.append(1)
        if steps and is_fake(position_ids):
            return None
        return original["find_packed_sequence_indices"](position_ids)

    replaced = {"_ignore_causal_mask_sdpa": causal, "_ignore_bidirectional_mask_sdpa": bidirectional,
                "find_packed_sequence_indices": packed, "is_torchdynamo_exporting": lambda: False,
                "_preprocess_mask_arguments": prepared}
    with _EXPORT_LOCK:
        original.update((n, getattr(masking, n)) for n in _MASKING_NAMES)
        hook = model.register_forward_pre_hook(seen, with_kwargs=True)
        for name, function in replaced.items():
            setattr(masking, name, function)
        try:
            yield
        finally:
            hook.remove()
            for name, function in original.items():
                setattr(masking, name, function)
    _READS_MASKS[model] = _READS_MASKS.get(model, False) or bool(decided)  # once it did, keys keep them


_DISTRIBUTIONS_DIR = os.path.join(os.path.dirname(torch.__file__), "distributions") + os.sep


def _in_distributions(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) went through torch.distributions' code:
    a ``Normal(mu, std)`` in forward checks its arguments' values (``validate_args``, on by default),
    which torch.fx and torch.export cannot (a VAE's reparameterization failed to capture with
    "Could not guard on data-dependent expression")."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.startswith(_DISTRIBUTIONS_DIR):
                return True
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def _partial_graphs_logged():
    """torch.export prints the partial graph of a capture that failed on a data-dependent value to
    stderr (pages of generated code, twice, for each failed round, even when fxremat then keeps
    the submodule whole and compiles the model); fxremat handles that failure itself (a warning or
    a refusal naming the line), so the graph goes to its DEBUG log instead. Anything else written
    to stderr meanwhile is passed on when the export returns."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException as exc:
        text, graph = held.getvalue(), getattr(exc, "partial_fx_graph", None)
        if graph:  # printed once by each of export's nested entry points
            text = text.replace(graph + "\n", "")
            log.debug("torch.export's partial graph of the failed capture:\n%s", graph)
        sys.stderr.write(text)
        raise
    sys.stderr.write(held.getvalue())


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, opaque: dict, random_branches: dict,
            facts: tuple = ((), True)) -> tuple:
    """``(exported program, its custom Function calls, its opaque submodule calls, the model's own
    checkpoint calls)``: one ``torch.export`` of the call with the submodules ``opaque`` (path ->
    module) recorded as one op each; those that branch on a random draw go in ``random_branches``;
    ``facts``: the call's :func:`value_facts` and whether eager looks for packed sequences
    (:func:`_masks_as_eager`)."""
    checkpoints: list[str] = []
    held = _hooks_held_out(model)  # they run at each call of the graph's module nodes, not here
    try:
        with held:
            plain = _plain_calls(model, opaque, args, kwargs, random_branches) if opaque else {}
    except Exception as exc:  # the model's own code on real tensors: no capture involved
        raise _PlainRunFailed() from exc
    try:
        with (_EXPORT_LOCK, _hooks_held_out(model), functions_routed(_as_one_op), own_checkpoints_seen(checkpoints),
              python_draws_warned(model, "torch.export"), _forwards_replaced(opaque, _opaque(opaque, plain)),
              _tensor_hooks_refused(), _partial_graphs_logged(), _masks_as_eager(model, *facts)):
            exported = torch.export.export(model, tuple(args), kwargs, strict=False)
    finally:
        calls, module_calls = dict(_CALLS), dict(_MODULE_CALLS)
        _CALLS.clear()
        _MODULE_CALLS.clear()
    return exported, calls, module_calls, checkpoints


@contextlib.contextmanager
def _hooks_held_out(model: torch.nn.Module):
    """The user hooks of ``model``'s submodules (each kept whole by the capture, or inside one that
    is) taken off while the block runs and put back after: the export records one op of such a
    module, and its hooks run around that op's module call at each training step, once, as in
    eager PyTorch (run by the export too, they were recorded into the graph as well)."""
    modules = [model.get_submodule(path) for path in hooked_modules(model) if path != "<global>"]
    saved = [(m, name, getattr(m, name)) for m in modules for name in _MODULE_HOOK_DICTS]
    for module, name, hooks in saved:  # torch's and transformers' own stay: part of the computation
        setattr(module, name, type(hooks)((key, hook) for key, hook in hooks.items() if is_library_hook(hook)))
    try:
        yield
    finally:
        for module, name, hooks in saved:  # with those the block added (transformers installs its own)
            hooks.update((key, hook) for key, hook in getattr(module, name).items() if key not in hooks)
            setattr(module, name, hooks)


_MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class _PlainRunFailed(Exception):
    """The plain run of the model that shapes its opaque submodules' calls (:func:`_plain_calls`)
    raised: the model fails on the example inputs itself, which no submodule kept whole mends
    (its ``__cause__`` is the model's error)."""


def _model_error(exc: BaseException, model: torch.nn.Module) -> BaseException:
    """``exc``, raised by ``model`` run plainly on the example inputs, with a note saying so: it is
    the model's own error, as eager PyTorch raises it (smp's PAN at 64x64 pools a 1x1 map), not a
    capture failure (it was reported as one, with a hint to compile a submodule instead)."""
    exc.add_note(f"fxremat: {type(model).__name__} raised this when run plainly on the example inputs (fxremat "
                 "runs it once without gradients before capturing it with torch.export): the model fails on "
                 "these inputs without fxremat too; check that the model runs on them (their shapes, their "
                 "dtypes)")
    return exc


def _compilable_child(model: torch.nn.Module, tries: int = 3) -> str | None:
    """The name of the child of ``model`` with the most parameters (of the ``tries`` largest) that
    ``fxremat.compile`` takes without example inputs: one captured per call (its forward takes
    ``*args``) or one whose top-level forward torch.fx traces (Faster R-CNN's ``roi_heads`` does
    not; its ``backbone`` does)."""
    children = sorted(((sum(p.numel() for p in m.parameters()), name, m) for name, m in model.named_children()),
                      key=lambda c: -c[0])
    for size, name, child in children[:tries]:
        if not size:
            break
        if varargs_reason(child) is not None:
            return name
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trace(child)
        except TraceError:
            continue
        return name
    return None


def _refused_hint(model: torch.nn.Module, failing: str, kept: bool = True) -> str:
    """What to do when the capture fails in the top-level forward's own code (``failing == ""``), in
    a submodule kept whole already (``kept``), or in one that cannot be kept whole (``not kept``)."""
    biggest = _compilable_child(model)
    instead = ("compile the submodule that does the work in place"
               + (f" (model.{biggest} = fxremat.compile(model.{biggest}, budget): the same parameters and "
                  f"state_dict keys; the rest of the forward then runs plainly{_layerdrop_first(model, biggest)})"
                  if biggest else ""))
    if failing and kept:
        return f"{failing!r} is kept whole already and the capture still failed there; {instead}"
    if failing:
        return f"torch.export could not capture its code at that line, and it cannot be kept whole either; {instead}"
    return ("torch.export could not capture this call either, and the line is in the top-level forward's own code "
            "(a submodule's would be kept whole); make the code at that line work on tensors whose values are "
            "unknown (no Python branch on a tensor's value), or compute it outside the model (a check of the "
            f"labels, the loss), or {instead}")


def _layerdrop_first(model: torch.nn.Module, child: str) -> str:
    """Where ``model.child`` skips layers at random (a LayerDrop above 0: a submodule's
    ``layerdrop`` or ``layer_drop``, or its Hugging Face config's ``layerdrop``, 0.1 by default
    in Wav2Vec2's), what to set first: compiled with it, the module that draws is kept as one leaf
    (a branch on a draw cannot be captured) and "min" saved 3.8% where it saves 53% with it at 0."""
    for path, module in model.get_submodule(child).named_modules():
        config = getattr(module, "config", None)
        for owner, name in [(module, "layerdrop"), (module, "layer_drop")] + [
                (config, n) for n in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")]:
            value = getattr(owner, name, None)
            if isinstance(value, float) and value > 0:
                where = (f"model.{'.'.join(filter(None, (child, path)))}" + (".config" if owner is config else "")
                         + f".{name}")
                return (f"; first set {where} = 0: layers skipped at random ({name}={value}) are a branch on a "
                        f"draw that no graph holds, so the module that draws would be kept whole")
    return ""


def _exported(model: torch.nn.Module, args: tuple, kwargs: dict, given: dict, facts: tuple = ((), True)) -> tuple:
    """:func:`_export` with the submodules ``given`` opaque, and those whose code export cannot
    capture, each class at once (one line of its code failed: its other instances run it too),
    warned about."""
    opaque: dict[str, torch.nn.Module] = dict(given)
    said = []  # (failing path, its class, the paths made opaque, line, cause) of each round
    random_branches: dict[str, str] = {}  # path -> the line that branches on a random draw
    for _ in range(_MAX_OPAQUE_ROUNDS):
        random_branches.clear()
        try:
            result = _export(model, args, kwargs, opaque, random_branches, facts)
            break
        except Exception as exc:  # torch.export raises many types (UserError, GuardOnDataDependent, ...)
            if isinstance(exc, _PlainRunFailed):
                raise _model_error(exc.__cause__, model) from None
            mismatch = _cause_of_type(exc, _OpaqueMismatch)
            if mismatch is not None:
                where = next((w for _, _, paths, w, _ in said if mismatch.path in paths), None)
                hint = _refused_hint(model, mismatch.path, kept=False)
                if mismatch.path in hooked_modules(model):
                    hint = ("it is kept whole because it has user hooks (torch.export would run them once, on fake "
                            "tensors, and never at a training step); remove its hooks while training under fxremat, "
                            "or call the model without that object (use_cache=False for a transformers model), "
                            "or " + hint)
                raise TraceError(mismatch.path, mismatch, module_class=type(opaque[mismatch.path]).__name__,
                                 where=where, hint=hint) from exc
            failing = _failing_submodule(model, exc)
            where = user_line(exc)
            if not failing and not opaque:  # the model itself may fail there, run plainly
                own = _plain_error(model, args, kwargs)
                if own is not None:
                    raise _model_error(own, model) from None
            if not failing or failing in opaque:
                hook = _cause_of_type(exc, _TensorHookNotCaptured)
                hint = _refused_hint(model, failing) if hook is None or failing else (
                    "move the code that registers the hook into a submodule (kept whole, it runs as written and its "
                    "hook fires as in eager), or register the hook in the training loop on a tensor the model returns")
                if hook is None and _in_distributions(exc):
                    hint = ("the line builds a torch.distributions object, whose argument check (validate_args) reads "
                            "tensor values; pass validate_args=False to it (or call torch.distributions.Distribution."
                            "set_default_validate_args(False) once), as eager does without the check; or " + hint)
                raise TraceError(failing, hook or exc, module_class=type(model.get_submodule(failing)).__name__,
                                 where=where, hint=hint) from exc
            cls = type(model.get_submodule(failing))
            same = {p: m for p, m in model.named_modules() if type(m) is cls and p
                    and not any(p.startswith(o + ".") for o in opaque)}
            hooked = sorted(same.keys() & hooked_modules(model))
            if hooked:  # export ran its hooks into the graph around the call, which would run them again
                raise TraceError(hooked[0], exc, module_class=cls.__name__, where=where, hint=(
                    "torch.export could not capture its code, and fxremat would keep it whole, but it has user hooks, "
                    "which the captured graph would run twice; remove its hooks, or compile the submodules that do "
                    "the work")) from exc
            opaque.update(same)
            cause = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            said.append((failing, cls.__name__, tuple(same), where, cause))
    else:
        raise TraceError("", RuntimeError(f"more than {_MAX_OPAQUE_ROUNDS} classes of submodules failed to capture"),
                         module_class=type(model).__name__)
    for failing, cls, paths, where, cause in said:
        warnings.warn(
            f"fxremat: torch.export could not capture submodule {failing!r} ({cls}) at {where} ({cause[:300]}); "
            + ("it is kept as one leaf node" if len(paths) == 1 else
               f"the {len(paths)} {cls} submodules are kept as one leaf node each "
               f"({', '.join(map(repr, paths[:8]))}{', ...' if len(paths) > 8 else ''})")
            + f": run as written, kept or recomputed whole, the rest of the model captured around them. Pass "
            f"leaf_modules=({cls},) to silence this warning.", stacklevel=4)
    for path, where in random_branches.items():
        warnings.warn(_random_branch_warning(model, path, where), UserWarning, stacklevel=4)
    return (*result, opaque)


def _random_branch_warning(model: torch.nn.Module, path: str, where: str) -> str:
    """The warning for a submodule kept whole whose code branches on a random draw at ``where``:
    the plan is made for the draw of the profiled call, and a step that draws otherwise does other
    work (a LayerDrop that skips fewer layers keeps more activations: Hugging Face's BioGPT with
    layerdrop=0.5 measured up to 1.95x the budget, silently)."""
    module = model.get_submodule(path)
    layerdrop = next((name for name in ("layerdrop", "layer_drop")
                      if isinstance(getattr(module, name, None), float) and getattr(module, name)), None)
    fix = (f"set model.{path}.{layerdrop} = 0 (and model.config.{layerdrop} = 0, where the model has a config) "
           f"while training under fxremat" if layerdrop else
           "draw nothing to branch on while training under fxremat (LayerDrop or stochastic depth set to 0)")
    return (f"fxremat: submodule {path!r} ({type(module).__name__}) is kept as one leaf node and its code branches "
            f"on a random draw at {where}: the work it does, and so its memory, varies with the draw (a LayerDrop "
            f"skips a different number of layers at each step), and the plan holds only for the draw of the "
            f"profiled call; a training step that draws otherwise may go over the budget, unseen. To keep the "
            f"budget, {fix}, or compile the layers it runs apart (each fxremat.compile'd, the branch left in "
            f"the plain code around them).")


def capture_call(model: torch.nn.Module, args: tuple, kwargs: dict, *, leaf_modules=()) -> Captured:
    """Capture ``model(*args, **kwargs)`` in training mode with ``torch.export`` (see the module
    docstring), the submodules ``leaf_modules`` names (classes or qualified names) and those whose
    code it cannot capture kept whole. Raises :class:`fxremat.TraceError` naming the module's
    class and the line of its code that failed."""
    added = _added_kwargs(model, args, kwargs)
    if added:
        log.info("fxremat: %s captured with %s (training)", type(model).__name__, added)
    classes = tuple(leaf for leaf in leaf_modules if isinstance(leaf, type))
    # compiled submodules (RematModules) are kept whole too: each runs its own plan; and those with
    # user hooks, as in a traced model: torch.export would run a hook once, on fake tensors, and
    # never at a training step (a probe's hook on a Qwen2 layer was called 0 times a step)
    hooked = hooked_modules(model)
    if "<global>" in hooked:
        raise TypeError(
            f"fxremat: a global module hook is set (torch.nn.modules.module.register_module_forward_hook or its "
            f"pre-/backward kin) while {type(model).__name__} is captured with torch.export, which would run it "
            f"once per module, on fake tensors, and never at a training step (the captured graph calls no "
            f"submodules); remove the global hook while training under fxremat (register it on the submodules "
            f"you watch: they are then kept whole, and it fires at each step)")
    given = {path: m for path, m in model.named_modules()
             if path and (path in leaf_modules or isinstance(m, classes) or is_compiled(m) or path in hooked)}
    given = {p: m for p, m in given.items() if not any(p.startswith(o + ".") for o in given)}  # outermost
    facts = _facts(model, args, kwargs)
    # packed position ids, and use_cache left to the config: plainly the call may build a cache, and
    # then it does not look for packed sequences
    packed = not dict(facts).get("positions step by one", True)
    looked = not (packed and "use_cache" in added) or _eager_looks_for_packing(model, args, kwargs)
    facts = (facts, looked)
    distinct_args, distinct_kwargs = _distinct_inputs(args, {**kwargs, **added})
    exported, calls, module_calls, checkpoints, opaque = _exported(model, distinct_args, distinct_kwargs, given,
                                                                   facts)
    if checkpoints:
        warnings.warn(own_checkpoint_warning(model, checkpoints[0]), stacklevel=3)
    gm, kept = _flat_graph(exported)
    _functions_kept_whole(model, gm, calls)
    _modules_kept_whole(gm, module_calls, opaque)
    spec = exported.call_spec
    captured = Captured(gm, spec.in_spec, spec.out_spec, kept, added)
    # a model that checkpoints itself keeps less at its forward's end than the graph, which holds
    # the functions plainly: counted, its plain peak was predicted -43%; the warning says a
    # fraction budget is of the peak without its checkpoints, which is the graph's
    plain = (PlainForward(peak_bytes=0) if checkpoints
             else _plain_forward(model, captured, args, kwargs))
    return dataclasses.replace(captured, plain=plain)


def _distinct_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with each tensor that shares its memory with one before it (the same
    tensor given twice: ``model(input_ids=ids, labels=ids)``) replaced by a copy. torch.export
    makes one fake tensor of both, and the graph read the token ids from whichever placeholder
    it chose: a Qwen2's embedding looked up ``labels``, and the next call with ``-100`` in its
    labels failed with "index out of range" (other labels than the ids: wrong values, silently).
    Copies give each input a placeholder of its own, right for calls that share and that do not."""
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    seen, out = set(), []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and not is_fake(leaf) and leaf.layout == torch.strided:
            memory = (leaf.device, leaf.untyped_storage().data_ptr())
            if memory in seen and leaf.untyped_storage().nbytes():
                leaf = leaf.detach().clone().requires_grad_(leaf.requires_grad)
            seen.add(memory)
        out.append(leaf)
    return tree_unflatten(out, spec)


def _plain_forward(model: torch.nn.Module, captured: Captured, args: tuple, kwargs: dict) -> PlainForward:
    """The model's plain forward, called as the user calls it, beside the captured graph's (run
    with ``use_cache=False``, it builds no key/value cache): its peak, and how much more it keeps
    at its end; both measured. Where the two compute other values, a warning says so; on fake
    tensors (a model planned under ``FakeTensorMode``, nothing allocated) there are no values to
    compare (``torch.equal`` raised ``DataDependentOutputException`` there)."""
    outputs: list = []
    kept, peak = forward_bytes(model, model, args, kwargs, outputs=outputs)
    graph_kept = forward_bytes(model, captured.graph_module, captured.inputs(args, kwargs), {}, outputs=outputs)[0]
    if is_fake(outputs):
        return PlainForward(peak_bytes=peak, extra_bytes=kept - graph_kept)
    differs = _first_difference(outputs[0], captured.output(outputs[1]))
    if differs is not None:
        warnings.warn(_other_values_warning(model, *differs), UserWarning, stacklevel=4)
    else:
        try:  # one plain step and one of the graph: a model too big for its device may not fit them
            _check_gradients(model, captured, args, kwargs, _matched(outputs[0], captured.output(outputs[1])))
        except torch.OutOfMemoryError:
            log.info("fxremat: %s: its gradients and the captured graph's were not compared (out of device "
                     "memory); its outputs were, and are equal", type(model).__name__)
    return PlainForward(peak_bytes=peak, extra_bytes=kept - graph_kept)


def _matched(plain, graph) -> list:
    """The keys (a ``ModelOutput``, a dict: the plain call may return a cache besides) or
    positions of the outputs of the captured graph found in the plain forward's."""
    if isinstance(plain, dict) and isinstance(graph, dict):
        return [k for k in graph if k in plain]
    return list(range(min(len(tensor_leaves(plain)), len(tensor_leaves(graph)))))


def _picked(out, keys: list) -> list:
    return [out[k] for k in keys] if isinstance(out, dict) else [tensor_leaves(out)[i] for i in keys]


def _gradient_prints(model: torch.nn.Module, call) -> dict[str, tuple[int, float]] | None:
    """``name -> (sum of the bit patterns, sum)`` of the gradient of each trainable parameter of
    ``model`` for the sum of the outputs ``call()`` returns, under :func:`preserved_state` (the
    same dropout draws each time, no buffer change): two numbers a parameter, so that no
    gradient outlives the comparison. ``None`` where nothing differentiable comes out."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    with preserved_state(model), torch.enable_grad():
        leaves = [t for t in tree_flatten(call())[0] if isinstance(t, torch.Tensor) and t.requires_grad
                  and t.is_floating_point()]
        if not params or not leaves:
            return None
        total = sum(t.double().sum() for t in leaves)
        grads = torch.autograd.grad(total, [p for _, p in params], allow_unused=True)
    prints = {}
    for (name, _), g in zip(params, grads):
        if g is not None:
            flat = g.detach().reshape(-1)
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size())
            pattern = int(flat.view(bits).sum(dtype=torch.int64)) if bits is not None else 0
            prints[name] = (pattern, float(flat.double().sum()))
    return prints


def _check_gradients(model: torch.nn.Module, captured: Captured, args: tuple, kwargs: dict, keys: list) -> None:
    """Warn where the captured graph's outputs equal the plain forward's but the gradients of the
    parameters (for the sum of the outputs ``keys`` names) do not: a path torch.export takes whose
    backward adds up in another order. Transformers' SDPA attention on a batch without padding
    was one: eager calls SDPA with ``is_causal`` and its grouped key/value heads as they are
    (``enable_gqa``), the export with an explicit mask and the heads repeated (Qwen2, Mistral,
    Llama at sequence 48: 18 parameters' gradients off by ~1e-8 at every step, silently); the
    capture now follows eager there (:func:`_masks_as_eager`), and this still warns where a mask
    reaches the model in a way :func:`value_facts` does not see. A
    gradient that differs from the plain model's own, run again, is nondeterminism (atomics on
    CUDA), not the capture's."""
    def plain_call():
        return _picked(model(*args, **kwargs), keys)

    def graph_call():
        return _picked(captured.output(captured.graph_module(*captured.inputs(args, kwargs))), keys)

    plain = _gradient_prints(model, plain_call)
    if plain is None:
        return
    graph = _gradient_prints(model, graph_call) or {}
    differ = [name for name, value in plain.items() if graph.get(name) != value]
    if not differ or _gradient_prints(model, plain_call) != plain:
        return
    name = differ[0]
    relative = (abs(plain[name][1] - graph[name][1]) / max(abs(plain[name][1]), 1e-30)) if name in graph else None
    warnings.warn(_other_gradients_warning(model, name, len(differ), len(plain), relative), UserWarning,
                  stacklevel=5)


def _other_gradients_warning(model: torch.nn.Module, name: str, count: int, total: int,
                             relative: float | None) -> str:
    """The warning for a captured graph whose outputs equal the plain forward's while the
    gradients of its parameters do not."""
    configs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "num_key_value_heads")]
    config = configs[0] if configs else None
    heads, groups = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    attention = getattr(config, "_attn_implementation", None)
    how = f" (their sums {relative:.1e} apart)" if relative is not None else ""
    cause = ("its code takes another path while it is exported, whose backward adds up in another order")
    fix = "To train as eager does, compile the submodules that take one path"
    if attention == "sdpa" and heads and groups and groups < heads:
        cause = (f"transformers' SDPA attention takes another path while it is exported: eager leaves the mask out "
                 f"where the attention mask is all ones and calls scaled_dot_product_attention with is_causal and "
                 f"its {groups} key/value heads as they are (enable_gqa), the export keeps an explicit mask and "
                 f"repeats the heads to {heads}, whose gradients add up in another order (fxremat follows eager "
                 f"for the very 2-D masks passed to the forward as {', '.join(_MASK_NAMES)}, and for "
                 f"position_ids; this call's mask came in another way, or was computed in the forward)")
        fix = ('For gradients bitwise equal to eager\'s, pass the batch\'s mask to the forward under one of those '
               'names and hand it on as it is (a mask the forward computes, as ids.ne(pad), keeps the explicit '
               'path), or load the model with attn_implementation="eager" (one path, traced and plain)')
    return (f"fxremat: the graph torch.export captured of {type(model).__name__} computes the same outputs as its "
            f"forward run plainly, but other gradients: {count} of {total} parameters' ({name} first{how}); "
            f"{cause}. Training runs the captured graph, so its gradients differ from eager's in the last bits "
            f"at each step. {fix}.")


def _first_difference(plain, graph) -> tuple[str, float] | None:
    """``(name, largest difference)`` of the first output tensor of the captured graph not bitwise
    equal to the plain forward's, matched by field (a ``ModelOutput``, a dict: the plain call may
    return a cache besides) or by position; ``None`` where all are equal."""
    keys = _matched(plain, graph)
    for key, a, b in zip(keys, _picked(plain, keys), _picked(graph, keys)):
        name = repr(key) if isinstance(key, str) else f"output {key}"
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and not torch.equal(a, b):
            return name, (a.double() - b.double()).abs().max().item()
    return None


def _other_values_warning(model: torch.nn.Module, name: str, largest: float) -> str:
    """The warning for a captured graph whose outputs differ from the plain forward's."""
    return (f"fxremat: the graph torch.export captured of {type(model).__name__} computes other values than its "
            f"forward run plainly ({name} differs by up to {largest:.3g}): its code takes another path while it is "
            f"exported (a branch on torch.compiler.is_exporting(), as transformers' is_torchdynamo_exporting() in "
            f"the gated delta rule of Qwen3-Next and Qwen3.5, which builds a triangular inverse by forward "
            f"substitution there). Training runs the captured graph: its outputs and gradients differ from eager's, "
            f"and its memory is the graph's, which may exceed the plain peak fxremat reports. Make that branch "
            f"take the plain path while compiling and training (for transformers, set the module's "
            f"is_torchdynamo_exporting to a function returning False), or compile the submodules that do not "
            f"branch.")
