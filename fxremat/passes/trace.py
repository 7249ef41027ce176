"""Trace an ``nn.Module`` into a ``torch.fx.GraphModule`` whose call nodes are the DAG's nodes.

- Submodules given in ``leaf_modules`` (classes or qualified names) become single nodes.
- A submodule that torch.fx cannot trace (data-dependent control flow) is traced as a leaf
  automatically, with a warning naming it; a failure in the top-level ``forward`` raises
  :class:`fxremat.TraceError`.
- In-place ops (``ReLU(inplace=True)``, ``x += y``, ``x.relu_()``) are rewritten out of place
  when no later node reads the mutated value, so that a recomputed segment never mutates a
  value that another segment keeps.
"""

from __future__ import annotations

import copy
import logging
import operator
import warnings

import torch
import torch.fx as fx

from ..errors import TraceError

__all__ = ["trace", "normalize_inplace"]

log = logging.getLogger("fxremat")

_MAX_AUTO_LEAVES = 64
_INPLACE_METHODS = frozenset({
    "add_", "sub_", "mul_", "div_", "relu_", "sigmoid_", "tanh_", "clamp_", "clamp_min_",
    "clamp_max_", "neg_", "exp_", "sqrt_", "pow_", "masked_fill_", "hardtanh_", "abs_",
})
_INPLACE_FUNCTIONS = {torch.relu_: torch.relu, torch.sigmoid_: torch.sigmoid, torch.tanh_: torch.tanh}
_INPLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.iand: operator.and_, operator.ior: operator.or_,
}


class _LeafTracer(fx.Tracer):
    """An fx.Tracer that keeps the configured leaves and remembers the module being traced."""

    def __init__(self, leaf_classes: tuple = (), leaf_names: frozenset = frozenset()):
        # Defaults: unpickling a GraphModule re-creates its tracer class with no arguments.
        super().__init__()
        self.leaf_classes = leaf_classes
        self.leaf_names = leaf_names
        self.stack: list[str] = []
        self.record_stack_traces = True

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        if qualname in self.leaf_names or (self.leaf_classes and isinstance(m, self.leaf_classes)):
            return True
        return super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        # On an exception the stack is left as is: its last entry names the failing submodule.
        self.stack.append(self.path_of_module(m))
        out = super().call_module(m, forward, args, kwargs)
        self.stack.pop()
        return out


def _split_leaves(leaf_modules) -> tuple[tuple, frozenset]:
    classes, names = [], []
    for leaf in leaf_modules:
        if isinstance(leaf, str):
            names.append(leaf)
        elif isinstance(leaf, type) and issubclass(leaf, torch.nn.Module):
            classes.append(leaf)
        else:
            raise TypeError(
                f"fxremat.compile: leaf_modules entries must be nn.Module classes or qualified "
                f"names (str), got {leaf!r}"
            )
    return tuple(classes), frozenset(names)


def trace(model: torch.nn.Module, *, leaf_modules=(), concrete_args=None) -> fx.GraphModule:
    """Symbolically trace ``model``; untraceable submodules become leaves (with a warning)."""
    classes, names = _split_leaves(leaf_modules)
    for _ in range(_MAX_AUTO_LEAVES):
        tracer = _LeafTracer(classes, names)
        try:
            graph = tracer.trace(model, concrete_args=concrete_args)
        except Exception as exc:  # torch.fx raises many types (TraceError, TypeError, ...)
            failing = tracer.stack[-1] if tracer.stack else ""
            if not failing or failing in names:
                raise TraceError(failing, exc) from exc
            warnings.warn(
                f"fxremat: torch.fx could not trace submodule {failing!r} ({type(exc).__name__}: "
                f"{exc}); treating it as one leaf node (it is kept or recomputed whole). "
                f"Pass leaf_modules=({failing!r},) to silence this warning.",
                stacklevel=3,
            )
            names = names | {failing}
            continue
        name = type(model).__name__
        return normalize_inplace(fx.GraphModule(tracer.root, graph, name))
    raise TraceError("", RuntimeError(f"more than {_MAX_AUTO_LEAVES} submodules failed to trace"))


def _mutated_input(gm: fx.GraphModule, node: fx.Node):
    """If ``node`` is an in-place op, return (its out-of-place rewrite kind, mutated arg node)."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if getattr(mod, "inplace", False) is True and node.args and isinstance(node.args[0], fx.Node):
            return "module", node.args[0]
    elif node.op == "call_function":
        if node.target in _INPLACE_OPERATORS and isinstance(node.args[0], fx.Node):
            return "operator", node.args[0]
        if node.target in _INPLACE_FUNCTIONS and isinstance(node.args[0], fx.Node):
            return "function", node.args[0]
        if node.kwargs.get("inplace") is True and node.args and isinstance(node.args[0], fx.Node):
            return "kwarg", node.args[0]
    elif node.op == "call_method":
        if node.target in _INPLACE_METHODS:
            return "method", node.args[0]
    return None


def _read_after(node: fx.Node, value: fx.Node) -> bool:
    """Whether some user of ``value`` other than ``node`` comes after ``node`` in the graph."""
    later = set()
    cur = node.next
    while cur.op != "root":
        later.add(cur)
        cur = cur.next
    return any(u in later for u in value.users if u is not node)


def normalize_inplace(gm: fx.GraphModule) -> fx.GraphModule:
    """Return a copy of ``gm`` with in-place ops made out of place where that is safe."""
    gm = fx.GraphModule(gm, copy.deepcopy(gm.graph), gm.__class__.__name__)
    for node in list(gm.graph.nodes):
        found = _mutated_input(gm, node)
        if found is None:
            continue
        kind, value = found
        if value.op in ("placeholder", "get_attr") or _read_after(node, value):
            log.debug("fxremat: keeping in-place %s (its input is read later)", node.name)
            continue
        if kind == "module":
            mod = copy.copy(gm.get_submodule(node.target))
            mod.inplace = False
            new_target = node.target.replace(".", "_") + "_outofplace"
            gm.add_submodule(new_target, mod)
            node.target = new_target
        elif kind == "operator":
            node.target = _INPLACE_OPERATORS[node.target]
        elif kind == "function":
            node.target = _INPLACE_FUNCTIONS[node.target]
        elif kind == "kwarg":
            node.kwargs = {**node.kwargs, "inplace": False}
        else:
            node.target = node.target[:-1]
    gm.graph.lint()
    gm.recompile()
    return gm
