"""Trace an ``nn.Module`` into a ``torch.fx.GraphModule`` whose call nodes are the DAG's nodes.

- Submodules given in ``leaf_modules`` (classes or qualified names) become single nodes.
- A submodule that torch.fx cannot trace (data-dependent control flow) is traced as a leaf
  automatically, with a warning naming it; a failure in the top-level ``forward`` raises
  :class:`fxremat.TraceError`.
- In-place ops (``ReLU(inplace=True)``, ``x += y``, ``x.relu_()``) are rewritten out of place
  when no later node reads the mutated value, so that a recomputed segment never mutates a
  value that another segment keeps.
- Calls made under ``torch.no_grad()`` / ``torch.inference_mode()`` inside a ``forward`` (which
  torch.fx does not record) run under that mode again: the tracer notes the grad mode of every
  call node it creates, and such nodes call a :class:`GradModeCall` wrapper with
  ``fxremat_grad_mode=...``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import warnings

import torch
import torch.fx as fx

from ..errors import TraceError

__all__ = ["trace", "normalize_inplace", "restore_grad_modes", "GradModeCall", "GRAD_MODE_KWARG"]

log = logging.getLogger("fxremat")

_MAX_AUTO_LEAVES = 64
_CALL_OPS = ("call_module", "call_function", "call_method")
# node.meta key: the grad mode a call node was traced under, when it is not the default one.
_GRAD_MODE_META = "fxremat_grad_mode"
# The keyword a GraphModule passes to GradModeCall: the mode of that call.
GRAD_MODE_KWARG = "fxremat_grad_mode"
_GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
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

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        # The tracer runs the Python forward, so `with torch.no_grad():` really toggles the mode
        # while the nodes of its body are created; torch.fx itself records nothing of it.
        if kind in _CALL_OPS:
            if torch.is_inference_mode_enabled():
                node.meta[_GRAD_MODE_META] = "inference_mode"
            elif not torch.is_grad_enabled():
                node.meta[_GRAD_MODE_META] = "no_grad"
        return node

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
            # Grad enabled, as in the training forward the graph replaces (also when compile is
            # called under no_grad): only the model's own no_grad regions are marked.
            with torch.enable_grad():
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
        return restore_grad_modes(normalize_inplace(fx.GraphModule(tracer.root, graph, name)))
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


class GradModeCall(torch.nn.Module):
    """A call of the traced graph that the original forward made under ``torch.no_grad()`` or
    ``torch.inference_mode()``.

    ``GradModeCall(module)`` calls the module (its calls outside such a region go through the same
    wrapper, without the keyword, so they keep their order); ``GradModeCall(function=f)`` and
    ``GradModeCall(method="name")`` call a function or a tensor method. A call with
    ``fxremat_grad_mode="no_grad"`` or ``"inference_mode"`` runs under that mode, exactly as the
    plain forward did; without it, under the caller's mode.
    """

    def __init__(self, module: torch.nn.Module | None = None, *, function=None, method: str | None = None):
        super().__init__()
        if (module is None) + (function is None) + (method is None) != 2:
            raise TypeError("GradModeCall takes exactly one of module, function= or method=")
        self.inner = module
        self.function = function
        self.method = method

    def forward(self, *args, **kwargs):
        mode = kwargs.pop(GRAD_MODE_KWARG, None)
        with _GRAD_MODES[mode]() if mode is not None else contextlib.nullcontext():
            if self.inner is not None:
                return self.inner(*args, **kwargs)
            if self.function is not None:
                return self.function(*args, **kwargs)
            return getattr(args[0], self.method)(*args[1:], **kwargs)

    def extra_repr(self) -> str:
        if self.function is not None:
            return f"function={getattr(self.function, '__qualname__', self.function)!r}"
        return f"method={self.method!r}" if self.method is not None else ""


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name = base
    while hasattr(gm, name):
        name += "_"
    return name


def _drop_unused_paths(gm: fx.GraphModule, targets) -> None:
    """Remove the old paths of wrapped modules from ``gm`` where no node refers to them, so each
    buffer has one name in ``gm`` (the wrapper's): profiling names mutated buffers by it."""
    referenced = {n.target for n in gm.graph.nodes if n.op in ("call_module", "get_attr")}
    for target in targets:
        prefixes = {target.rsplit(".", k)[0] for k in range(1, target.count(".") + 1)}
        # A node calling a parent means the parent in gm is the model's own module: keep it whole.
        if prefixes & referenced or any(r == target or r.startswith(target + ".") for r in referenced):
            continue
        gm.delete_submodule(target)


def restore_grad_modes(gm: fx.GraphModule) -> fx.GraphModule:
    """Make the call nodes traced under ``no_grad``/``inference_mode`` run under it again.

    Each becomes a ``call_module`` of a :class:`GradModeCall` with ``fxremat_grad_mode=...``;
    every call of a module that is called at least once that way goes through one wrapper (one
    target, so calls of a shared module keep their order and their buffers are found). Calls
    with no node input (factories such as ``torch.zeros``) do not depend on the grad mode and
    are left as they are. ``gm`` is changed in place and returned.
    """
    marked = [n for n in gm.graph.nodes
              if n.op in _CALL_OPS and _GRAD_MODE_META in n.meta and n.all_input_nodes]
    if not marked:
        return gm
    wrappers: dict[str, str] = {}
    for node in marked:
        if node.op == "call_module" and node.target not in wrappers:
            name = _free_name(gm, node.target.replace(".", "_") + "_grad_mode")
            gm.add_submodule(name, GradModeCall(gm.get_submodule(node.target)))
            wrappers[node.target] = name
    for node in gm.graph.nodes:  # every call of a wrapped module, in either mode
        if node.op == "call_module" and node.target in wrappers:
            node.target = wrappers[node.target]
    _drop_unused_paths(gm, wrappers)
    for node in marked:
        if node.op == "call_function":
            name = _free_name(gm, f"{node.name}_grad_mode")
            gm.add_submodule(name, GradModeCall(function=node.target))
            node.op, node.target = "call_module", name
        elif node.op == "call_method":
            name = _free_name(gm, f"{node.name}_grad_mode")
            gm.add_submodule(name, GradModeCall(method=node.target))
            node.op, node.target = "call_module", name
        node.kwargs = {**node.kwargs, GRAD_MODE_KWARG: node.meta[_GRAD_MODE_META]}
    log.debug("fxremat: %d call node(s) traced under no_grad/inference_mode run under it again", len(marked))
    gm.graph.lint()
    gm.recompile()
    return gm
