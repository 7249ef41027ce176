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
they see they are being exported (Hugging Face's attention masks and grouped-query attention,
its loss's upcast logits), and with ``use_cache=False`` it builds no key/value cache, so it may
keep more or fewer bytes than the model run plainly. :func:`capture_call` therefore runs the call
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

The graph is specialised to the call's input shapes and to its non-tensor arguments, so
:class:`fxremat.RematModule` captures once per input signature. A forward with a ``use_cache``
parameter that the call does not set gets ``use_cache=False``, as Hugging Face's own training
with checkpointing does (the output then has no key/value cache).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx._pytree import tree_flatten_spec
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..errors import TraceError
from .profile import PlainForward, forward_bytes
from .trace import (function_call, functions_routed, own_checkpoint_warning, own_checkpoints_seen, restore_modes,
                    user_line)

__all__ = ["Captured", "capture_call"]

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
    """Keywords the capture sets that the call left out: ``use_cache=False`` in training."""
    params = inspect.signature(model.forward).parameters
    if "use_cache" not in params or "use_cache" in kwargs:
        return {}
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
    for node in ops:
        entry = calls[node.args[0]]
        args, kwargs = entry.arguments(node.args[1])
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


def capture_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> Captured:
    """Capture ``model(*args, **kwargs)`` in training mode with ``torch.export`` (see the module
    docstring). Raises :class:`fxremat.TraceError` naming the model's class and the line of its
    code that failed."""
    added = _added_kwargs(model, args, kwargs)
    if added:
        log.info("fxremat: %s captured with %s (training)", type(model).__name__, added)
    checkpoints: list[str] = []
    try:
        with functions_routed(_as_one_op), own_checkpoints_seen(checkpoints):
            exported = torch.export.export(model, tuple(args), {**kwargs, **added}, strict=False)
    except Exception as exc:  # torch.export raises many types (UserError, GuardOnDataDependent, ...)
        where = user_line(exc)
        raise TraceError("", exc, module_class=type(model).__name__, where=where, hint=(
            "torch.export could not capture this call either; make the code at that line work on "
            "tensors whose values are unknown (no Python branch on a tensor's value), or compile "
            "the submodules that do the work")) from exc
    finally:
        calls = dict(_CALLS)
        _CALLS.clear()
    if checkpoints:
        warnings.warn(own_checkpoint_warning(model, checkpoints[0]), stacklevel=3)
    gm, kept = _flat_graph(exported)
    _functions_kept_whole(model, gm, calls)
    spec = exported.call_spec
    captured = Captured(gm, spec.in_spec, spec.out_spec, kept, added)
    # a model that checkpoints itself keeps less at its forward's end than the graph, which holds
    # the functions plainly: counted, its plain peak was predicted -43%; the warning says a
    # fraction budget is of the peak without its checkpoints, which is the graph's
    plain = (PlainForward(peak_bytes=0) if checkpoints
             else _plain_forward(model, gm, args, kwargs, captured.inputs(args, kwargs)))
    return dataclasses.replace(captured, plain=plain)


def _plain_forward(model: torch.nn.Module, gm: fx.GraphModule, args: tuple, kwargs: dict, graph_inputs) -> PlainForward:
    """The model's plain forward, called as the user calls it, beside the captured graph's (run
    with ``use_cache=False``, it builds no key/value cache): its peak, and how much more it keeps
    at its end; both measured."""
    kept, peak = forward_bytes(model, model, args, kwargs)
    return PlainForward(peak_bytes=peak, extra_bytes=kept - forward_bytes(model, gm, tuple(graph_inputs), {})[0])
