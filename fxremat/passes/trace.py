"""Trace an ``nn.Module`` into a ``torch.fx.GraphModule`` whose call nodes are the DAG's nodes.

- Submodules given in ``leaf_modules`` (classes or qualified names) become single nodes; so does
  every other torch.nn module (torch.fx's default), except torch's transformer modules in training
  mode (``nn.TransformerEncoder``, ``nn.Transformer``, their layers), which are traced through down
  to their norms, linears, dropouts and ``nn.MultiheadAttention`` (``_TRACED_TORCH_MODULES``).
- A submodule that torch.fx cannot trace (data-dependent control flow) is traced as a leaf
  automatically, with a warning naming it; a failure in the top-level ``forward`` raises
  :class:`fxremat.TraceError`.
- In-place ops (``ReLU(inplace=True)``, ``x.add_(y)``, ``x.relu_()``) stay in place, as the model
  wrote them (:func:`writes_in_place` finds them): lowering ties the value they write and every
  node holding it into one group that no segment boundary splits, so a recomputed segment never
  writes a value that another segment keeps. (torch.fx records ``x += y`` on a traced tensor as
  ``x + y``: a proxy has no ``__iadd__``.)
- A value unpacked (``q, k, v = qkv``) is one call of :func:`unpacked`, which iterates it as
  Python does (a tensor: one ``unbind(0)``), and its items; torch.fx records ``qkv[0]``, ...,
  three selects, each of whose backwards makes a zero gradient of all of ``qkv``.
- Calls made under ``torch.no_grad()`` / ``torch.inference_mode()`` inside a ``forward`` (which
  torch.fx does not record) run under that mode again: the tracer notes the grad mode of every
  call node it creates, and such nodes call a :class:`ModeCall` wrapper with
  ``fxremat_grad_mode=...``.
- Likewise for ``torch.autocast(...)`` inside a ``forward``: the model is traced twice, under two
  probe autocast states that differ in every setting (for every device type autocast off,
  bfloat16, weight cache on; autocast on, float16, cache off). A setting of a call node that is the
  same in both traces was set by the model's own code, one that follows the probe is the
  caller's; such nodes call the wrapper with ``fxremat_autocast=((device_type, enabled, dtype,
  cache_enabled), ...)``, ``None`` meaning "as the caller's". Regions that turn autocast off or
  change its dtype are found too, which a single trace outside autocast cannot see. A submodule
  whose traced graph depends on the caller's autocast state (``if torch.is_autocast_enabled():``)
  becomes a leaf, with a warning; such code in the top-level ``forward`` raises
  :class:`fxremat.TraceError`.
- A submodule whose calls run hooks (forward, forward pre- or backward hooks of its own, or any
  global module hook, which every module runs) stays one leaf node (:func:`has_hooks`): the
  emitted graph calls it, so its hooks run at each call as in eager PyTorch, and never while
  tracing (where they would see proxies, and an output they return would be baked into the graph).
- A custom ``torch.autograd.Function`` applied to traced values is one call node of its
  ``apply``, run and recomputed as written, its own ``backward`` included (:func:`functions_routed`
  routes the calls while tracing). Traced through, its forward's ops were recorded under the
  ``no_grad`` torch runs it in, which cut the gradient of everything before it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import dis
import functools
import inspect
import itertools
import linecache
import logging
import operator
import os
import random
import re
import sys
import traceback
import warnings

import torch
import torch.fx as fx
import torch.utils.checkpoint

from ..errors import TraceError
from .state import kept_state

__all__ = ["trace", "functions_routed", "python_rng_put_back", "function_call", "CALL_OPS", "module_of", "has_hooks", "hooked_modules", "HookWatch", "is_library_hook", "writes_in_place", "SettingsWatch", "restore_modes", "output_rebuilder", "ModeCall", "GradModeCall", "GRAD_MODE_KWARG",
           "AUTOCAST_KWARG", "unpacked"]

log = logging.getLogger("fxremat")

_MAX_AUTO_LEAVES = 64
CALL_OPS = ("call_module", "call_function", "call_method")  # the ops that run code: the graph's nodes
# node.meta key: the grad mode a call node was traced under, when it is not the default one.
_GRAD_MODE_META = "fxremat_grad_mode"
# The keyword a GraphModule passes to ModeCall: the grad mode of that call.
GRAD_MODE_KWARG = "fxremat_grad_mode"
_GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
# node.meta keys: the raw autocast state a call node was traced under, and the autocast settings
# the model's own code chose for it (a ModeCall record, set only where there are some).
_AUTOCAST_STATE_META = "fxremat_autocast_state"
_AUTOCAST_META = "fxremat_autocast"
# The keyword a GraphModule passes to ModeCall: ((device_type, enabled, dtype, cache_enabled), ...).
AUTOCAST_KWARG = "fxremat_autocast"
_AUTOCAST_DEVICE_CANDIDATES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "ipu")
_INPLACE_METHODS = frozenset({
    "add_", "sub_", "mul_", "div_", "relu_", "sigmoid_", "tanh_", "clamp_", "clamp_min_",
    "clamp_max_", "neg_", "exp_", "sqrt_", "pow_", "masked_fill_", "hardtanh_", "abs_",
})
_INPLACE_FUNCTIONS = frozenset({torch.relu_, torch.sigmoid_, torch.tanh_})
_AUGMENTED = ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior", "ixor",
              "ilshift", "irshift")


def _augmented(name: str):
    """The call an augmented assignment (``x *= y``) on a traced value records: ``operator.imul``
    applied as a function, which writes a tensor in place, as eager Python does, and gives a
    number a new value without touching the names bound to the old one. (``operator.imul`` as the
    node's target would be emitted as the statement ``x *= y``, which rebinds the name ``x`` that
    later nodes may read as the old number.)"""
    op = getattr(operator, name)

    def augmented(target, value):
        return op(target, value)

    augmented.__name__ = augmented.__qualname__ = name
    augmented.__module__ = __name__
    augmented.__doc__ = f"``operator.{name}(target, value)``: an augmented assignment of the traced forward."
    return augmented


# Module attributes, so that a pickled GraphModule finds them again by name.
globals().update({name: _augmented(name) for name in _AUGMENTED})
_INPLACE_OPERATORS = frozenset([operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.iand,
                                operator.ior] + [globals()[name] for name in _AUGMENTED])


# torch.nn's transformer modules: torch.fx keeps every torch.nn module whole (its default
# is_leaf_module), and a whole nn.TransformerEncoder was one node holding all a classifier's
# activations ("min" saved 0.0%, budget 0.5 was infeasible). In training mode they are traced
# through, down to their norms, linears, dropouts and nn.MultiheadAttention (which stays one node:
# its forward branches on its input's number of dimensions). Their Python on traced values is made
# traceable while tracing (_transformers_traceable): the fast path's conditions are skipped (it is
# never taken in training mode, and the graph only runs in training: in eval() the compiled module
# calls the model itself, fast path included; one in eval() inside a training model stays a leaf,
# where eager may take it), and the helpers that read a mask's dtype or a tensor's size become
# nodes of the graph; nn.Transformer's own forward is replaced by its two calls
# (_transformer_forward).
_TRACED_TORCH_MODULES = (torch.nn.Transformer, torch.nn.TransformerEncoder, torch.nn.TransformerDecoder,
                         torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)


def _transformer_forward(module: torch.nn.Transformer, *args, **kwargs):
    """``nn.Transformer.forward`` while tracing: its encoder's and decoder's calls, as it makes
    them, without its checks of the inputs' sizes (``src.size(0) != tgt.size(0)``: Python on
    traced values; a wrong size still fails, in the attention)."""
    bound = inspect.signature(torch.nn.Transformer.forward).bind(module, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    memory = module.encoder(a["src"], mask=a["src_mask"], src_key_padding_mask=a["src_key_padding_mask"],
                            is_causal=a["src_is_causal"])
    return module.decoder(a["tgt"], memory, tgt_mask=a["tgt_mask"], memory_mask=a["memory_mask"],
                          tgt_key_padding_mask=a["tgt_key_padding_mask"],
                          memory_key_padding_mask=a["memory_key_padding_mask"],
                          tgt_is_causal=a["tgt_is_causal"], memory_is_causal=a["memory_is_causal"])


def _recorded(fn, when):
    """``fn`` as the transformer modules call it while tracing: a call node of ``fn`` itself where
    ``when(arguments)`` says its Python would read a traced value, else ``fn`` run as written."""
    signature = inspect.signature(fn)

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        proxies = [v for v in bound.arguments.values() if isinstance(v, fx.Proxy)]
        if not proxies or not when(bound.arguments):
            return fn(*args, **kwargs)
        return proxies[0].tracer.create_proxy("call_function", fn, args, kwargs)

    call.__wrapped__ = fn
    return call


def _helpers_recorded() -> list[tuple[object, str, object]]:
    """``(module, name, wrapper)`` of the helpers of torch's transformer modules that read a traced
    value's dtype or size (``F._canonical_mask``: a boolean mask becomes a float one)."""
    functional, transformer = torch.nn.functional, torch.nn.modules.transformer
    proxy = lambda v: isinstance(v, fx.Proxy)  # noqa: E731
    return [
        (functional, "_canonical_mask", _recorded(functional._canonical_mask, lambda a: proxy(a["mask"]))),
        (functional, "_none_or_dtype", _recorded(functional._none_or_dtype, lambda a: proxy(a["input"]))),
        (transformer, "_get_seq_len", _recorded(transformer._get_seq_len, lambda a: proxy(a["src"]))),
        # it compares a mask with a causal one only where is_causal is None
        (transformer, "_detect_is_causal_mask", _recorded(
            transformer._detect_is_causal_mask,
            lambda a: proxy(a["is_causal"]) or (a["is_causal"] is None and proxy(a["mask"])))),
    ]


@contextlib.contextmanager
def _transformers_traceable():
    """While in it, torch's transformer modules are traceable (see ``_TRACED_TORCH_MODULES``):
    the attention fast path is off and their helpers record call nodes. Gives the helpers (the
    targets of those nodes)."""
    fast = torch.backends.mha.get_fastpath_enabled()
    patched = [(module, name, wrapper.__wrapped__, wrapper) for module, name, wrapper in _helpers_recorded()]
    torch.backends.mha.set_fastpath_enabled(False)
    for module, name, _, wrapper in patched:
        setattr(module, name, wrapper)
    try:
        yield frozenset(original for _, _, original, _ in patched)
    finally:
        for module, name, original, _ in patched:
            setattr(module, name, original)
        torch.backends.mha.set_fastpath_enabled(fast)


def _drop_unused_helpers(graph: fx.Graph, helpers: frozenset) -> None:
    """Erase the calls of ``helpers`` and the attribute reads (``src.dtype``) that torch's
    transformer modules made while traced and that nothing uses (where no mask is given)."""
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        stack = list(node.meta.get("nn_module_stack", {}).values())
        inside = bool(stack) and isinstance(stack[-1], tuple) and stack[-1][1] in _TRACED_TORCH_MODULES
        if node.target in helpers or (node.target is getattr and inside):
            graph.erase_node(node)


class _LeafTracer(fx.Tracer):
    """An fx.Tracer that keeps the configured leaves and remembers the module being traced.

    Buffer reads are ``get_attr`` nodes (``proxy_buffer_attributes``), so in-place updates of
    buffers (``self.num_batches_tracked.add_(1)``) are graph nodes rather than writes made once,
    at trace time.
    """

    proxy_buffer_attributes = True

    def __init__(self, leaf_classes: tuple = (), leaf_names: frozenset = frozenset(), autocast_devices: tuple = ()):
        # Defaults: unpickling a GraphModule re-creates its tracer class with no arguments.
        super().__init__()
        self.leaf_classes = leaf_classes
        self.leaf_names = leaf_names
        self.stack: list[str] = []
        self.record_stack_traces = True
        self.autocast_devices = autocast_devices  # whose autocast state each call node notes
        # Names of the attributes (tensor constants) this tracer sets on the root. fx numbers them
        # with a counter shared by all tracers; one per tracer makes two traces of a model name
        # them alike.
        self.created_attrs: list[str] = []
        # What the trace did, in order: ("enter"/"exit", path) of each traced (non-leaf) module's
        # forward and ("node", node) for each node created.
        self.events: list[tuple] = []
        # The parameters and buffers the traced code wrote on the real tensors (name ->
        # fxremat.passes.state.StateWrite; put back after the trace).
        self.state_writes: dict = {}
        self._qualname_counter = collections.defaultdict(int)
        self._arg_depth = 0
        self._outer_arg_type: type | None = None  # the type of the last value lowered at the top level
        self.output_type: type | None = None  # the type of what the traced forward returned

    def get_fresh_qualname(self, prefix: str) -> str:
        name = super().get_fresh_qualname(prefix)
        self.created_attrs.append(name)
        return name

    def drop_created_attrs(self) -> None:
        """Remove from the traced model the attributes this trace set on it."""
        root = getattr(self, "root", None)
        for name in self.created_attrs:
            if root is not None and name in root.__dict__:
                delattr(root, name)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def to_bool(self, obj: fx.Proxy) -> bool:
        raise _PythonValueError(self, obj.node, "bool")

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        if (qualname in self.leaf_names or (self.leaf_classes and isinstance(m, self.leaf_classes)) or has_hooks(m)
                or is_compiled(m)):
            return True
        if type(m) in _TRACED_TORCH_MODULES and m.training:  # torch.nn's, traced through (see there)
            return False
        return super().is_leaf_module(m, qualname)

    def create_arg(self, a):
        # torch.fx lowers a dict subclass (a Hugging Face ModelOutput, an OrderedDict) to a plain
        # dict: the type of the value the forward returns is remembered (see output_rebuilder).
        if not self._arg_depth:
            self._outer_arg_type = type(a)
        self._arg_depth += 1
        try:
            return super().create_arg(a)
        finally:
            self._arg_depth -= 1

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        if (kind, target) in _DIFFERENTIATING:
            what = "torch.autograd.grad" if target is torch.autograd.grad else (
                "torch.autograd.backward" if target is torch.autograd.backward else ".backward()")
            raise DifferentiatesInForward(
                f"the forward calls {what}, a backward pass inside the forward, which torch.fx records as one "
                f"graph node that fxremat cannot profile, split or recompute by parts")
        if kind == "output":
            self.output_type = self._outer_arg_type
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        # The tracer runs the Python forward, so `with torch.no_grad():` and `with torch.autocast(...)`
        # really change the state while the nodes of their body are created; torch.fx itself
        # records nothing of them.
        if kind in CALL_OPS:
            if torch.is_inference_mode_enabled():
                node.meta[_GRAD_MODE_META] = "inference_mode"
            elif not torch.is_grad_enabled():
                node.meta[_GRAD_MODE_META] = "no_grad"
            node.meta[_AUTOCAST_STATE_META] = _autocast_state(self.autocast_devices)
        self.events.append(("node", node))
        return node

    def call_module(self, m, forward, args, kwargs):
        # On an exception the stack is left as is: its last entry names the failing submodule.
        path = self.path_of_module(m)
        self.stack.append(path)
        traced = not self.is_leaf_module(m, path)
        if traced:
            self.events.append(("enter", path))
            if type(m) is torch.nn.Transformer:  # its own forward checks the inputs' sizes in Python
                forward = functools.partial(_transformer_forward, m)
        out = super().call_module(m, forward, args, kwargs)
        if traced:
            self.events.append(("exit", path))
        self.stack.pop()
        return out


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an :class:`fxremat.RematModule` (its class says so): a model holding
    one, compiled in its turn, calls it whole, as one node that runs its own plan. Traced through,
    its forward (a property choosing the training call) ran fxremat's planning on proxies and
    failed, and the submodule was kept whole only after a warning; captured, keeping it whole
    failed on its ``forward``, then a property without a setter."""
    return getattr(type(module), "fxremat_compiled", False) is True


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether a call of ``module`` runs hooks: forward, forward pre- or backward hooks of its own,
    or a global one (``torch.nn.modules.module.register_module_forward_hook`` and the like)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks
                or any(getattr(torch.nn.modules.module, name) for name in _GLOBAL_HOOKS))


def is_library_hook(hook) -> bool:
    """Whether ``hook`` is a library's, not the user's: defined inside torch (FSDP2,
    ``weight_norm``), or transformers' own output capturing (installed on the first call, it hands
    a layer's output to the model's ``hidden_states``): part of the module's computation rather
    than a user's observer."""
    fn = getattr(hook, "func", hook)  # functools.partial
    fn = getattr(fn, "__func__", fn)  # bound methods
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return module == "torch" or module.startswith(("torch.",) + _LIBRARY_HOOK_MODULES)


# transformers' output capturing (5.x; in utils.generic before): a held-out hook of it left
# SegFormer's decode head an empty tuple of hidden states
_LIBRARY_HOOK_MODULES = ("transformers.utils.output_capturing", "transformers.utils.generic")


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooked_modules(model: torch.nn.Module) -> frozenset[str]:
    """Qualified names of the submodules of ``model`` (the root excluded: its hooks run around the
    whole forward and never inside the trace) with user hooks (not defined inside torch), and
    whether a global user hook is set: the fingerprint compared at each training step. Hooks
    torch adds after compiling (FSDP2's ``fully_shard`` of a compiled module's leaves) are part
    of the computation and change nothing; a user hook anywhere is seen and leads to a retrace.

    It runs at every training step, so it walks the ``_modules`` dicts itself and looks at hook
    dicts only where one is non-empty (``named_modules`` and a check per module cost ~65 µs on a
    4-block transformer, 1% of its forward)."""
    found = []
    seen = {id(model)}
    stack = [("", name, child) for name, child in reversed(model._modules.items())]
    while stack:  # preorder, each module once under its first path, as named_modules()
        prefix, name, module = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        hooked = ((module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                   or module._backward_pre_hooks) and any(_user_hooks(getattr(module, d)) for d in _MODULE_HOOKS))
        if hooked or module._modules:  # a path is built only where it is needed
            path = f"{prefix}.{name}" if prefix else name
            if hooked:
                found.append(path)
            stack.extend((path, child_name, child) for child_name, child in reversed(module._modules.items()))
    if any(_user_hooks(getattr(torch.nn.modules.module, d)) for d in _GLOBAL_HOOKS):
        found.append("<global>")
    return frozenset(found)


def _user_hooks(hooks) -> bool:
    return any(not is_library_hook(h) for h in hooks.values())


# Submodules set on any module since import, counted by a global module-registration hook that
# HookWatch installs on first use (a submodule set in place of another may come with hooks).
_submodules_set = 0


def _count_submodule(module, name, submodule):
    global _submodules_set
    _submodules_set += 1


@functools.lru_cache(maxsize=1)
def _watch_submodules() -> None:
    torch.nn.modules.module.register_module_module_registration_hook(_count_submodule)


def _stamp() -> tuple:
    """What moves whenever a hook could have come: torch's count of hook handles made anywhere
    (``torch.utils.hooks.RemovableHandle.next_id``: every ``register_*hook``) and of submodules set."""
    return torch.utils.hooks.RemovableHandle.next_id, _submodules_set


class HookWatch:
    """:func:`hooked_modules` of ``model`` (``names``), looked at again at each training step for
    the cost of a few lookups: the module tree is walked again only when a hook handle was made
    anywhere or a submodule was set since the last walk (:func:`_stamp`), or when one of the hook
    dicts that held a user hook (or a global one) changed size, a hook removed. The walk costs
    ~0.5 µs a module, more right after a step (~400 µs a step on a 137-module ResNet chain, 5% of
    its step at a small batch). Not seen: hooks written into a module's hook dict by hand."""

    def __init__(self, model: torch.nn.Module):
        _watch_submodules()
        self.model = model
        self.names = self._walk()

    def _walk(self) -> frozenset[str]:
        self.stamp = _stamp()
        names = hooked_modules(self.model)
        dicts = [getattr(torch.nn.modules.module, d) for d in _GLOBAL_HOOKS]
        for name in names - {"<global>"}:
            module = self.model.get_submodule(name)
            dicts.extend(getattr(module, d) for d in _MODULE_HOOKS)
        self.sizes = tuple((d, len(d)) for d in dicts)
        return names

    def changed(self) -> bool:
        """Whether the submodules with user hooks differ from ``names`` (which then follow them)."""
        if self.stamp == _stamp() and all(len(d) == n for d, n in self.sizes):
            return False
        names = self._walk()
        changed, self.names = names != self.names, names
        return changed


_SETTING_TYPES = (bool, int, float, str, type(None))


def _is_setting(value) -> bool:
    return isinstance(value, _SETTING_TYPES) or (
        isinstance(value, tuple) and len(value) <= 8 and all(isinstance(v, _SETTING_TYPES) for v in value))


class SettingsWatch:
    """The Python settings a plan depends on, looked at again at each training step.

    - Baked into the graph by the trace: ``training`` and the public number, string and flag
      attributes (``drop_prob``, ``scale``) of the model and of every submodule torch.fx traced
      through, and which submodules are set (``remat.block.conv = nn.Conv2d(...)``). torch.fx
      records such values as constants, so a schedule that set ``drop_prob`` each epoch, a
      ``block.eval()`` or a new submodule trained the graph of the compile, silently.
    - Read by a leaf (a ``call_module`` node) when it is called, but measured into the plan:
      its ``training`` and its float attributes (``Dropout.p``: at 0 dropout keeps no mask, and a
      plan made then measured 1.33x its budget at ``p=0.5``).
    - How many submodules each module traced through holds: one added (``seq.append(block)``,
      ``layers.extend(...)``) is no value watched above, and the compiled graph, without it,
      trained silently.

    Costs ~0.1 µs a watched value a step (a few hundred on timm's ResNet-50 or ViT-S)."""

    # Defaults of what later versions added, for a watch pickled (with its RematModule) before them.
    counted: tuple = ()
    counts: list = []  # (never changed in place: replaced by each look)

    def __init__(self, model: torch.nn.Module, traced: fx.GraphModule | None):
        leaves = {n.target for n in traced.graph.nodes if n.op == "call_module"} if traced is not None else set()
        self.where, self.leaf = [], []  # ((module.__dict__, name), "path.name"), whether a leaf's
        self.counted: list[tuple[dict, str]] = []  # (module._modules, path) of each module traced through
        for path, module in model.named_modules():
            if isinstance(module, torch.jit.ScriptModule):
                # TorchScript compiled its settings in, and torch.fx calls it whole (``mid._c``'s
                # ``forward``); its ``_modules`` is no dict (iterating it raised ``KeyError: 0``)
                continue
            leaf = path in leaves
            prefix = f"{path}." if path else ""
            for name, value in vars(module).items():
                if not name.startswith("_") and (isinstance(value, float) or name == "training" if leaf
                                                 else _is_setting(value)):
                    self.where.append(((vars(module), name), prefix + name))
                    self.leaf.append(leaf)
            if not leaf:  # its submodules: the values of module._modules, and how many there are
                self.where += [((module._modules, name), prefix + name) for name in module._modules]
                self.leaf += [False] * len(module._modules)
                self.counted.append((module._modules, path or "the model"))
        self.keys = [key for key, _ in self.where]
        self.values = self._now()
        self.counts = self._counts()

    def _now(self) -> list:
        return [d.get(name) for d, name in self.keys]

    def _counts(self) -> list[int]:
        return [len(d) for d, _ in self.counted]

    def refresh(self) -> None:
        """Take the values as they are now: after code that runs the forward's Python (a trace, a
        capture), whose side effects (``self.calls += 1``) change no graph."""
        self.values = self._now()
        self.counts = self._counts()

    def changed(self) -> tuple[str, bool] | None:
        """What changed since the last look (``"blocks.0.drop_prob = 0.2"``) and whether only
        leaves' settings did, or None. (Two lists built and compared: ~0.1 µs a value.)"""
        now, counts = self._now(), self._counts()
        if now == self.values and counts == self.counts:
            return None
        moved = [i for i, (a, b) in enumerate(zip(now, self.values)) if a is not b and a != b]
        grown = [i for i, (a, b) in enumerate(zip(counts, self.counts)) if a != b]
        was, self.values, self.counts = self.counts, now, counts
        if moved:
            first = moved[0]
            return f"{self.where[first][1]} = {now[first]!r}"[:200], all(self.leaf[i] for i in moved)
        if grown:
            first = grown[0]
            return f"{self.counted[first][1]} holds {counts[first]} submodules (was {was[first]})", False
        return None


class _PythonValueError(fx.proxy.TraceError, TypeError):
    """Traced code turned a traced value into a Python value (``bool``, ``int``, ``float``):
    ``float(self.num_batches_tracked)``, ``if x.sum() > 0:``. The message names the value, the
    buffers, parameters or inputs it comes from, and the source line."""

    def __init__(self, tracer: fx.Tracer, node: fx.Node, kind: str):
        self.node = node
        self.sources = _sources(tracer.root, node)
        self.site = _user_site()
        super().__init__(
            f"{kind}() of the traced value {node.name!r} ({self.sources}) at {self.site}: a graph "
            f"cannot hold a Python value computed from tensors (it would keep the value it had when "
            f"traced, while the code computes it anew on every call)"
        )


class _Proxy(fx.Proxy):
    """A ``torch.fx.Proxy`` whose conversions to Python numbers raise :class:`_PythonValueError`,
    and which records augmented assignments (``x *= y``) as such. A plain ``torch.fx.Proxy`` has
    no ``__imul__``, so Python records ``x = x * y``: out of place, where eager PyTorch writes
    ``x`` in place, and through it the tensor ``x`` is a view of (Funnel's ``attn *= mask`` on a
    slice): a later read of that tensor got the value before the write."""

    def __float__(self):
        raise _PythonValueError(self.tracer, self.node, "float")

    def __int__(self):
        raise _PythonValueError(self.tracer, self.node, "int")

    def __index__(self):
        raise _PythonValueError(self.tracer, self.node, "int")

    def __iter__(self):
        # ``a, b, c = value`` (UNPACK_SEQUENCE): torch.fx records ``value[0]``, ``value[1]``,
        # ``value[2]``, which on a tensor are three selects, each of whose backward makes a zero
        # gradient of the whole tensor (``q, k, v = qkv`` before an attention: 1.08x eager's
        # peak). Python iterates instead: on a tensor ``Tensor.__iter__`` is one ``unbind(0)``,
        # whose backward is one ``stack``. The node calls :func:`unpacked`, which iterates as
        # Python does, and the items are taken from its tuple. Other iterations are torch.fx's.
        frame = inspect.currentframe().f_back
        length = _unpack_length(frame)
        if length is None:
            return self.tracer.iter(self)
        if _returns_tuple(self.node):  # torch.fx's items, as Python's: no node in between
            return iter([self[i] for i in range(length)])
        items = self.tracer.create_proxy("call_function", unpacked, (self, length), {})
        return iter([items[i] for i in range(length)])


def _unpack_length(frame) -> int | None:
    """How many names the instruction ``frame`` is at unpacks a value into (``a, b, c = value``:
    3), or None where it is not an unpacking (a ``for`` loop, ``a, *rest = value``)."""
    if frame is None:
        return None
    for instruction in dis.get_instructions(frame.f_code):
        if instruction.offset == frame.f_lasti:
            return instruction.argval if instruction.opname == "UNPACK_SEQUENCE" else None
    return None


# torch ops (functions and tensor methods) whose result, where it is unpacked, is always a tuple
# (``b, n, d = x.size()``: a torch.Size), never a tensor
_TUPLE_OPS = frozenset({"size", "chunk", "split", "tensor_split", "unbind", "topk", "sort", "hsplit", "vsplit",
                        "dsplit"})


def _returns_tuple(node: fx.Node) -> bool:
    """Whether ``node`` calls a torch op that returns a tuple (``x.chunk(3, -1)``, ``x.topk(k)``)."""
    if node.op == "call_method":
        return node.target in _TUPLE_OPS
    name = getattr(node.target, "__name__", None)
    return node.op == "call_function" and name in _TUPLE_OPS and node.target is getattr(torch, name, None)


def unpacked(value, length: int) -> tuple:
    """``a, b, c = value`` of the traced forward, as Python unpacks it: a tensor by iterating it
    (one ``unbind(0)``, as in eager PyTorch), a tuple as it is; ``length`` is the number of names,
    checked as Python checks it."""
    if isinstance(value, fx.Proxy):  # a trace of a graph calling it (unpickling a GraphModule traces its code)
        return value.tracer.create_proxy("call_function", unpacked, (value, length), {})
    items = tuple(value)
    if len(items) != length:
        more = "too many values to unpack" if len(items) > length else "not enough values to unpack"
        got = "" if len(items) > length else f", got {len(items)}"
        raise ValueError(f"{more} (expected {length}{got})")
    return items


for _name in _AUGMENTED:
    setattr(_Proxy, f"__{_name}__", lambda self, other, _name=_name: self.tracer.create_proxy(
        "call_function", globals()[_name], (self, other), {}))
del _name


_SHAPE_METHODS = frozenset({"size", "dim", "numel", "ndimension"})
_SHAPE_ATTRIBUTES = frozenset({"shape", "ndim"})
_MAX_SOURCES = 6  # named in the message; the rest counted


def _shape_of(n: fx.Node) -> fx.Node | None:
    """The tensor whose shape ``n`` reads (``x.shape``, ``x.size(1)``, ``x.dim()``), or None."""
    if n.op == "call_method" and n.target in _SHAPE_METHODS and n.args and isinstance(n.args[0], fx.Node):
        return n.args[0]
    if (n.op == "call_function" and n.target is getattr and len(n.args) == 2 and n.args[1] in _SHAPE_ATTRIBUTES
            and isinstance(n.args[0], fx.Node)):
        return n.args[0]
    return None


def _sources(root: torch.nn.Module, node: fx.Node) -> str:
    """Which buffers, parameters and forward inputs ``node``'s value is computed from; a shape read
    (``x.shape``) is named as the shape of that value, not as everything the value is computed
    from (a shape check deep in a net named every parameter before it: 3.6 KB on timm's MobileViT)."""
    buffers = dict(root.named_buffers())
    seen, stack, found = set(), [node], []
    while stack and len(seen) < 1000:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        shaped = _shape_of(n)
        if shaped is not None:
            found.append(f"the shape of {shaped.name!r}")
            continue
        if n.op == "get_attr":
            found.append(f"buffer {n.target!r}" if n.target in buffers else f"attribute {n.target!r}")
        elif n.op == "placeholder":
            default = n.args[0] if n.args else None  # torch.fx keeps a parameter's default there
            found.append(f"input {n.target!r}, a Python {type(default).__name__} by default ({default!r}) that "
                         f"torch.fx traces as a tensor of unknown value" if isinstance(default, _FLAG_TYPES)
                         else f"input {n.target!r}")
        stack.extend(n.all_input_nodes)
    found = sorted(set(found))
    if not found:
        return "computed from no input"
    more = f" and {len(found) - _MAX_SOURCES} more" if len(found) > _MAX_SOURCES else ""
    return "computed from " + ", ".join(found[:_MAX_SOURCES]) + more


_FX_DIR = os.path.dirname(fx.__file__)
_FLAG_TYPES = (bool, int, float, str)  # defaults of a forward's flags (sample_posterior=False, scale=1.0)


def _defaulted_settings(module: torch.nn.Module) -> list[str]:
    """``name=default`` of each parameter of ``module.forward`` whose default is ``None`` or a
    Python flag (``class_labels=None``, ``return_dict=True``): torch.fx traces each as a tensor of
    unknown value, so ``if flag:`` cannot be traced and ``if x is not None:`` takes the branch
    for a value given (diffusers' UNet2DModel then raised its own "class_embedding needs to be
    initialized" with no class labels passed)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin forward has no signature to read
        return []
    return [f"{p.name}={p.default!r}" for p in parameters
            if p.default is None or isinstance(p.default, _FLAG_TYPES)]


def _user_site() -> str:
    """``file:line (`source`)`` of the innermost frame outside torch.fx and this module."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_FX_DIR) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "an unknown line"
    code, line = frame.f_code, frame.f_lineno
    text = linecache.getline(code.co_filename, line).strip()
    return f"{code.co_filename}:{line} (`{text}`)" if text else f"{code.co_filename}:{line}"


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


def _autocast_devices() -> tuple[str, ...]:
    """The device types this build of torch keeps an autocast state for (a custom backend too)."""
    names = _AUTOCAST_DEVICE_CANDIDATES + (torch._C._get_privateuse1_backend_name(),)
    return tuple(d for d in dict.fromkeys(names) if torch.amp.is_autocast_available(d))


def _autocast_state(devices) -> tuple:
    """``((enabled, dtype) for each device type) + (weight cache enabled,)``."""
    per_device = tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices)
    return per_device + (torch.is_autocast_cache_enabled(),)


def _set_autocast_state(devices, state: tuple) -> None:
    for device, (enabled, dtype) in zip(devices, state):
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)
    torch.set_autocast_cache_enabled(state[-1])


@contextlib.contextmanager
def _autocast_set_to(devices, state: tuple):
    """Set the autocast state (as :func:`_autocast_state` gives it) for the duration of the
    block; the previous one comes back after it."""
    saved = _autocast_state(devices)
    try:
        _set_autocast_state(devices, state)
        yield
    finally:
        _set_autocast_state(devices, saved)


def _probe_dtypes(device: str) -> tuple:
    """Two dtypes ``torch.autocast(device)`` accepts, different where it accepts two (a region
    that inherits the caller's dtype must get a valid one in both traces)."""
    if device == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return torch.float16, torch.float16
    backend = getattr(torch, device, None) if device == torch._C._get_privateuse1_backend_name() else None
    supported = list(backend.get_amp_supported_dtype()) if hasattr(backend, "get_amp_supported_dtype") else []
    return (supported[0], supported[-1]) if supported else (torch.bfloat16, torch.float16)


def _probe_states(devices) -> tuple[tuple, tuple]:
    """The two autocast states the model is traced under, as :func:`_autocast_state` gives them:
    every device type's autocast off, then on, with another dtype where the device type takes
    two, and the weight cache on, then off. The graph traced under the first is the one kept."""
    dtypes = [_probe_dtypes(device) for device in devices]
    return (tuple((False, low) for low, _ in dtypes) + (True,),
            tuple((True, high) for _, high in dtypes) + (False,))


class _AutocastDependent(Exception):
    """The traced graph depends on the caller's autocast state in a way a record cannot replay."""

    def __init__(self, owner: str, reason: str):
        super().__init__(reason)
        self.owner = owner


def _chosen(kept, probed, probes: tuple, what: str):
    """The value the model's own code set (the same under both probe states), or ``None`` where
    it is the caller's (each trace saw its probe's value)."""
    if kept == probed:
        return kept
    if (kept, probed) == probes:
        return None
    raise ValueError(
        f"{what} was {kept} where the caller's was {probes[0]} and {probed} where the caller's "
        f"was {probes[1]}"
    )


def _autocast_record(kept: tuple, probed: tuple, devices, probes: tuple) -> tuple:
    """The ``fxremat_autocast`` record of a call node from its states in the two traces."""
    entries = []
    for i, device in enumerate(devices):
        (enabled_a, dtype_a), (enabled_b, dtype_b) = kept[i], probed[i]
        (off, low), (on, high) = probes[0][i], probes[1][i]
        enabled = _chosen(enabled_a, enabled_b, (off, on), f"autocast enabled for {device!r}")
        # Without autocast the dtype setting does nothing (a nested autocast inherits it, and that
        # nested region's own nodes carry the dtype they ran with).
        dtype = None if enabled is False else _chosen(
            dtype_a, dtype_b, (low, high), f"the autocast dtype for {device!r}")
        if enabled is not None or dtype is not None:
            entries.append((device, enabled, dtype))
    if not entries:  # the weight cache alone changes no value
        return ()
    cache = _chosen(kept[-1], probed[-1], (probes[0][-1], probes[1][-1]), "the autocast weight cache flag")
    return tuple((device, enabled, dtype, cache) for device, enabled, dtype in entries)


def _event_key(event) -> tuple:
    kind, what = event
    if kind != "node":
        return event
    args = fx.node.map_arg((what.args, what.kwargs), lambda n: n.name)
    return kind, what.op, what.name, what.target, repr(args)


def _describe(event) -> str:
    if event is None:
        return "the end of the trace"
    kind, what = event
    if kind == "node":
        return f"node {what.format_node()}"
    return f"a call of {what!r}" if kind == "enter" else f"the return from {what!r}"


def _record_autocast(kept: _LeafTracer, probed: _LeafTracer, probes: tuple) -> None:
    """Note in ``node.meta`` of the call nodes ``kept`` traced the autocast settings the model's
    own code chose, comparing each with the same node of ``probed`` (traced under the other probe).

    Raises :class:`_AutocastDependent` where the two traces differ or a setting is neither the
    model's own nor the caller's, naming the module whose forward was running there: all that
    ran between the last event the traces share and the first they do not is its code.
    """
    stack: list[str] = []  # the traced modules whose forward is running, outermost first
    for a, b in itertools.zip_longest(kept.events, probed.events):
        owner = stack[-1] if stack else ""
        if a is None or b is None or _event_key(a) != _event_key(b):
            raise _AutocastDependent(
                owner, f"its traced graph changes with the caller's autocast state: {_describe(a)} "
                       f"with autocast off, {_describe(b)} with it on",
            )
        kind, what = a
        if kind == "enter":
            stack.append(what)
        elif kind == "exit":
            stack.pop()
        elif _AUTOCAST_STATE_META in what.meta:
            state = what.meta.pop(_AUTOCAST_STATE_META)
            try:
                record = _autocast_record(state, b[1].meta[_AUTOCAST_STATE_META], kept.autocast_devices, probes)
            except ValueError as exc:
                raise _AutocastDependent(owner, f"at node {what.name!r}, {exc}") from None
            if record:
                what.meta[_AUTOCAST_META] = record


class _StateWrittenWhileTracing(Exception):
    """A submodule's code changed parameters or buffers on the real tensors while it was traced."""

    def __init__(self, owner: str, message: str):
        super().__init__(message)
        self.owner = owner


class DifferentiatesInForward(Exception):
    """The traced code calls ``torch.autograd.grad`` (or ``.backward()``): forces as ``-dE/dx`` in an
    ML potential, an input-gradient penalty computed inside the model. torch.fx records the call as
    one graph node, which fxremat can neither profile (its backward runs on tensors the graph does
    not hold: "The differentiated Tensor ... appears to not have been used in the graph") nor split
    into segments; torch.export, tried next at the top level, fails on it as well ("fake tensor in
    the exported program constant's list"). A submodule that does it becomes a leaf (it runs as
    written, kept or recomputed whole, as ``torch.utils.checkpoint`` supports); the top-level
    forward is refused, naming the line."""


_DIFFERENTIATING = {(  # (op, target) of the calls that run a backward inside the forward
    "call_function", torch.autograd.grad), ("call_function", torch.autograd.backward), ("call_method", "backward")}


_FUNCTION_META = "fxremat_autograd_function"  # the torch.autograd.Function a call node applies


def _autograd_function_apply(*args, **kwargs):
    """The target of a traced ``SomeFunction.apply(...)`` call until :func:`restore_modes` makes it a
    :class:`ModeCall` of the Function (named in the node's meta); never called."""
    raise RuntimeError("fxremat: a traced autograd.Function call was left unconverted (restore_modes)")


@contextlib.contextmanager
def functions_routed(route):
    """While in it, ``SomeFunction.apply(*args, **kwargs)`` of any ``torch.autograd.Function``
    returns ``route(SomeFunction, run, args, kwargs)``, where ``run(*args, **kwargs)`` applies it
    as torch does."""
    function = torch.autograd.Function
    original = function.__dict__["apply"]  # a classmethod (a C one on torch 2.14)

    def apply(cls, *args, **kwargs):
        return route(cls, original.__get__(None, cls), args, kwargs)

    function.apply = classmethod(apply)
    try:
        yield
    finally:
        function.apply = original


def function_call(graph: fx.Graph, cls: type, args: tuple, kwargs: dict) -> fx.Node:
    """A node of ``graph`` (placed at its insertion point) that applies the custom
    ``torch.autograd.Function`` ``cls`` to ``args``/``kwargs`` (nodes and constants) as one call:
    :func:`restore_modes` makes it a :class:`ModeCall` of ``cls.apply``."""
    node = graph.create_node("call_function", _autograd_function_apply, args, kwargs, name=cls.__name__.lower())
    node.meta[_FUNCTION_META] = cls
    return node


def _kept_whole(cls, run, args, kwargs):
    """While tracing, a ``torch.autograd.Function`` applied to traced values becomes one call node
    of its ``apply`` (a leaf, like a module with hooks), instead of the ops of its ``forward``:
    torch runs that forward under ``no_grad``, so tracing through it recorded ops whose gradient
    was cut, and its own ``backward`` (a straight-through estimator, a fused or rounded-differently
    derivative) would be lost. Calls without traced arguments run as written."""
    proxies = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, fx.Proxy)]
    if not proxies:
        return run(*args, **kwargs)
    if cls.__module__ == "torch.utils.checkpoint" and cls.__name__ == "_NoopSaveInputs":
        # the bookkeeping of a model's own non-reentrant checkpoint (torch < 2.13): without a
        # gradient function the checkpoint runs its function plainly, which is then traced (kept
        # whole, its backward raised "Did not expect to backward on this graph")
        return torch.empty((0,))
    proxy = proxies[0].tracer.create_proxy("call_function", _autograd_function_apply, args, kwargs,
                                           name=cls.__name__.lower())
    proxy.node.meta[_FUNCTION_META] = cls
    return proxy


def _python_rng_states() -> tuple:
    """The states of the random number generators Python code draws from outside torch: the
    ``random`` module's and, where numpy is imported, numpy's global one (``None`` where not)."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), (numpy.random.get_state() if numpy is not None else None)


def _python_rngs_drawn(before: tuple) -> bool:
    """Whether Python's or numpy's generator was drawn from since ``before`` (:func:`_python_rng_states`)."""
    python, numpy = _python_rng_states()
    if python != before[0]:
        return True
    # (name, key, position, has_gauss, cached_gaussian): a normal draw may be served from the cache
    return numpy is not None and (before[1] is None or numpy[2:] != before[1][2:]
                                  or not sys.modules["numpy"].array_equal(numpy[1], before[1][1]))


@contextlib.contextmanager
def python_rng_put_back():
    """Put the generators Python code draws from outside torch (the ``random`` module's and, where
    numpy is imported, numpy's global one) back as they were when the block exits (it is given
    those states, :func:`_python_rng_states`), as
    :func:`~fxremat.passes.profile.preserved_state` does torch's: compiling drew from them (each
    trace or export of a model whose forward draws, and its plain run), so a seeded training run
    compiled drew other numbers than the same run plain, and the plain run of a captured model drew
    another SpecAugment mask than the one its export baked in, which then differed from it
    (Hugging Face Wav2Vec2: a false warning that its code branched on is_exporting())."""
    states = python_state, numpy_state = _python_rng_states()
    try:
        yield states
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            sys.modules["numpy"].random.set_state(numpy_state)


@contextlib.contextmanager
def python_draws_warned(model: torch.nn.Module, how: str):
    """Warn where the forward drew from Python's ``random`` (or numpy's) while ``how`` ran it:
    the draw is a Python value, which the trace records as a constant, so every training step takes
    the trace's branch (a LayerDrop written ``if random.random() < p: return x`` skipped its layer
    on every step, or on none, silently, where eager skips it on some). The generators are put back
    after (:func:`python_rng_put_back`)."""
    with python_rng_put_back() as before:
        yield
        drew = _python_rngs_drawn(before)
    if drew:
        warnings.warn(
            f"fxremat: {type(model).__name__}'s forward drew from Python's random module (or numpy's) while "
            f"{how} ran it: the value drawn is baked into the graph as a constant, so every training step takes "
            "the branch of that draw (eager draws again each step). Draw with torch instead (torch.rand(...), "
            "applied as a tensor: x * mask), or pass the submodule that draws as leaf_modules=(...) so that its "
            "Python runs at each call.", UserWarning, stacklevel=2)


def _trace_under(tracer: _LeafTracer, model: torch.nn.Module, concrete_args, probe: tuple) -> fx.Graph:
    # Grad enabled, as in the training forward the graph replaces (also when compile is called
    # under no_grad): only the model's own no_grad regions are marked. Tracing never changes the
    # model's state: what the traced code writes on real tensors is put back (and reported).
    with python_draws_warned(model, "torch.fx"), torch.enable_grad(), functions_routed(_kept_whole), _autocast_set_to(
        tracer.autocast_devices, probe
    ), kept_state(model, owner=lambda: tracer.stack[-1] if tracer.stack else "") as writes, \
            _transformers_traceable() as helpers:
        tracer.state_writes = writes.written
        graph = tracer.trace(model, concrete_args=concrete_args)
        _drop_unused_helpers(graph, helpers)
        _write_back_assigned_buffers(model, tracer, graph)
        _warn_assigned_values(model, tracer)
        return graph


def _warn_assigned_values(model: torch.nn.Module, tracer: fx.Tracer) -> None:
    """Warn where the traced forward assigned a traced value to a module attribute
    (``self.feat = h``, ``self.attn_map = attn``): the graph does not replay Python assignments,
    so the attribute kept what one call at compile time left there (a tensor of the example input),
    and a loss or a log reading it after a step read that, silently (with a backward through it,
    torch's bare "modified by an inplace operation")."""
    assigned = [f"{prefix}.{name}" if prefix else name
                for prefix, module in model.named_modules()
                for name, value in vars(module).items()
                if isinstance(value, fx.Proxy) and value.tracer is tracer]
    if assigned:
        shown = ", ".join(f"self.{a}" if "." not in a else a for a in assigned[:3])
        warnings.warn(
            f"fxremat: {type(model).__name__}'s forward assigns traced values to module attributes ({shown}"
            f"{', ...' if len(assigned) > 3 else ''}): the compiled graph does not replay Python assignments, so "
            "after a training step they hold a value of the call at compile time, not of the step. Return the "
            "value from forward, or collect it with a forward hook on the submodule that makes it.",
            UserWarning, stacklevel=2)


def _write_back_assigned_buffers(model: torch.nn.Module, tracer: fx.Tracer, graph: fx.Graph) -> None:
    """``self.calls += 1`` on a buffer: torch.fx records ``calls + 1`` and the assignment puts the
    proxy in the module's buffers, outside the graph. Add ``calls.copy_(result)`` at the end of
    the graph, so that the compiled model updates the buffer as the plain one does (the tensor
    itself is put back in the module by :func:`kept_state`)."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for prefix, module in model.named_modules():
        for attr, value in module._buffers.items():
            if isinstance(value, fx.Proxy) and value.tracer is tracer:
                with graph.inserting_before(out):
                    target = graph.get_attr(f"{prefix}.{attr}" if prefix else attr)
                    graph.call_method("copy_", (target, value.node))


def _check_state_writes(model: torch.nn.Module, tracers, names: frozenset) -> None:
    """Report the writes on real parameters and buffers the traces made (already put back):
    none of them is in the graph, so training would never make them.

    Raises :class:`_StateWrittenWhileTracing` for the first submodule whose code made some (it
    must run as written: a leaf); warns about writes of the top-level forward or of no visible op.
    """
    writes = {}
    for tracer in tracers:
        for name, write in tracer.state_writes.items():
            writes.setdefault(name, write)
    buffers = dict(model.named_buffers())

    def what(write) -> str:
        kind = "buffer" if write.name in buffers else "parameter"
        how = "by an operation torch did not dispatch" if write.op == "unseen" else f"with {write.op}"
        return f"{kind} {write.name!r} ({how})"

    owners = sorted({w.owner for w in writes.values() if w.owner and w.owner not in names})
    if owners:
        owner = owners[0]
        changed = ", ".join(what(w) for w in writes.values() if w.owner == owner)
        cls = type(model.get_submodule(owner)).__name__
        raise _StateWrittenWhileTracing(owner, (
            f"fxremat: submodule {owner!r} ({cls}) changed {changed} on the real tensor while it was "
            f"traced, outside the traced graph, so the graph would never make that change; treating it "
            f"as one leaf node (it runs as written, and fxremat put the value back after tracing). Pass "
            f"leaf_modules=({owner!r},) to silence this warning."
        ))
    for write in writes.values():
        where = f"{type(model).__name__}.forward" if write.owner == "" else "code run while tracing"
        warnings.warn(
            f"fxremat: {where} changed {what(write)} on the real tensor, outside the traced graph: "
            f"fxremat put its value back, but the compiled model will not make that change when it "
            f"trains, while the plain model makes it on every call. Move the code that changes it "
            f"into a submodule and pass that submodule in leaf_modules=.",
            stacklevel=4,
        )


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


_MAX_LEAF_WARNINGS = 3


def _warn_untraceable(untraceable: list[tuple[str, str]]) -> None:
    """One warning per submodule made a leaf, or one for all past a few (smp's MiT encoder: 30
    blocks with the same ``if x.ndim == 4:``)."""
    if len(untraceable) <= _MAX_LEAF_WARNINGS:
        for _, message in untraceable:
            warnings.warn(message, stacklevel=4)
        return
    names = tuple(name for name, _ in untraceable)
    warnings.warn(
        f"fxremat: {len(names)} submodules are treated as one leaf node each ({', '.join(map(repr, names[:8]))}"
        f"{', ...' if len(names) > 8 else ''}). The first: "
        f"{untraceable[0][1].removeprefix('fxremat: ').split(' Pass leaf_modules=')[0]} "
        f"Pass leaf_modules={names!r} to silence this warning.", stacklevel=4)


def own_checkpoint_warning(model: torch.nn.Module, caller: str) -> str:
    """The warning for a model that calls ``torch.utils.checkpoint`` itself (at ``caller``)."""
    return (
        f"fxremat: {type(model).__name__} calls torch.utils.checkpoint ({caller}); fxremat traces through "
        f"it and plans what is recomputed itself, so that checkpoint is not applied: the function runs "
        f"once in the forward, and a BatchNorm in it updates its statistics once per step (eager "
        f"PyTorch's checkpoint updates them again when it recomputes); a fraction budget is of the peak "
        f"without it. Turn the model's own checkpointing off (timm: model.set_grad_checkpointing(False); "
        f"Hugging Face: model.gradient_checkpointing_disable(); diffusers: "
        f"model.disable_gradient_checkpointing()) to silence this warning.")


def _warn_inlined_checkpoints(model: torch.nn.Module, gm: fx.GraphModule) -> None:
    """Warn where the model's own ``torch.utils.checkpoint`` calls were traced through (nodes made
    under ``torch/utils/checkpoint.py``): the graph holds their functions plainly, and the plan
    decides what is recomputed."""
    for node in gm.graph.nodes:
        frames = re.findall(r'File "(.*?)", line (\d+)', node.meta.get("stack_trace") or "")
        at = next((i for i, (path, _) in enumerate(frames) if path.endswith(_CHECKPOINT_FILE)), None)
        if at is None:
            continue
        warnings.warn(own_checkpoint_warning(model, ":".join(frames[at - 1]) if at else "its forward"), stacklevel=4)
        return


@contextlib.contextmanager
def own_checkpoints_seen(seen: list[str]):
    """While in it, each non-reentrant ``torch.utils.checkpoint`` that runs appends the line of
    the model's code that called it to ``seen``: a torch.export capture runs the model's Python
    code, but its nodes' stack traces leave torch's frames out, so the trace's check of them
    finds nothing there (a diffusers model with ``enable_gradient_checkpointing()``)."""
    hook = torch.utils.checkpoint._checkpoint_hook  # entered once per checkpointed call
    own = hook.__dict__.get("__init__")
    inherited = hook.__init__

    def init(self, *args, **kwargs):
        seen.append(_user_frame(traceback.extract_stack()) or "its forward")
        inherited(self, *args, **kwargs)

    hook.__init__ = init
    try:
        yield
    finally:
        if own is None:
            del hook.__init__
        else:
            hook.__init__ = own


def trace(model: torch.nn.Module, *, leaf_modules=(), concrete_args=None) -> fx.GraphModule:
    """Symbolically trace ``model``; untraceable submodules become leaves (with a warning)."""
    classes, names = _split_leaves(leaf_modules)
    devices = _autocast_devices()
    probes = _probe_states(devices)
    untraceable = []  # (submodule, warning) of those made leaves, warned about once traced
    for _ in range(_MAX_AUTO_LEAVES):
        tracer = _LeafTracer(classes, names, devices)
        tracer.record_stack_traces = False  # the probe's graph is compared with the kept one, never kept
        try:
            # The probe trace first: it leaves the model as it found it, so that the kept trace
            # names its tensor constants alike.
            try:
                _trace_under(tracer, model, concrete_args, probes[1])
            finally:
                tracer.drop_created_attrs()
            probed, tracer = tracer, _LeafTracer(classes, names, devices)
            graph = _trace_under(tracer, model, concrete_args, probes[0])
            _record_autocast(tracer, probed, probes)
            _check_state_writes(model, (probed, tracer), names)
        except _StateWrittenWhileTracing as exc:
            warnings.warn(str(exc), stacklevel=3)
            names = names | {exc.owner}
            continue
        except _AutocastDependent as exc:
            if not exc.owner or exc.owner in names:
                code = f"{type(model).__name__}.forward" if not exc.owner else f"the forward of {exc.owner!r}"
                raise TraceError(exc.owner, RuntimeError(str(exc)), hint=(
                    f"move the code in {code} that reads the autocast state (torch.is_autocast_enabled(), "
                    "torch.get_autocast_dtype(), ...) into a submodule and pass that submodule in "
                    "leaf_modules=, so that it runs as written under the caller's autocast state"
                )) from None
            warnings.warn(
                f"fxremat: submodule {exc.owner!r} depends on the caller's autocast state in a way "
                f"the traced graph cannot replay ({exc}); treating it as one leaf node (it runs as "
                f"written and is kept or recomputed whole). Pass leaf_modules=({exc.owner!r},) to "
                f"silence this warning.",
                stacklevel=3,
            )
            names = names | {exc.owner}
            continue
        except Exception as exc:  # torch.fx raises many types (TraceError, TypeError, ...)
            failing = tracer.stack[-1] if tracer.stack else ""
            if not failing or failing in names:
                raise _trace_error(model, failing, exc) from exc
            if isinstance(exc, DifferentiatesInForward):  # no warning: the leaf is the way it runs
                names = names | {failing}
                continue
            untraceable.append((failing, _untraceable_message(model, failing, exc)))
            names = names | {failing}
            continue
        gm = restore_modes(fx.GraphModule(tracer.root, graph, type(model).__name__))
        if tracer.output_type is not dict and issubclass(tracer.output_type, dict):
            gm.meta[_OUTPUT_TYPE_META] = tracer.output_type
        _warn_inlined_checkpoints(model, gm)
        _warn_untraceable(untraceable)
        return gm
    raise TraceError("", RuntimeError(f"more than {_MAX_AUTO_LEAVES} submodules failed to trace"))


_OUTPUT_TYPE_META = "fxremat_output_type"  # a traced GraphModule's: the dict subclass its forward returned


def output_rebuilder(gm: fx.GraphModule):
    """``None``, or the function that makes the plain dict a traced ``gm`` (and the modules emitted
    from it) returns the forward's own output again: the Hugging Face ``ModelOutput`` (a dataclass,
    rebuilt from its fields, so ``out.loss`` and ``out[0]`` work as in eager) or other dict
    subclass (rebuilt from the items) it returned."""
    cls = gm.meta.get(_OUTPUT_TYPE_META)
    if cls is None:
        return None
    if dataclasses.is_dataclass(cls):
        return lambda out: cls(**out)
    return lambda out: cls(out)


def varargs_reason(module: torch.nn.Module) -> str | None:
    """Why torch.fx cannot make placeholders for ``module.forward`` (``None`` where it can): its
    code takes ``*args`` (a decorator's ``wrapper(self, *args, **kwargs)``, as around every
    Hugging Face model's forward), which becomes one placeholder the code cannot unpack."""
    fn = type(module).forward
    code = getattr(fn, "__code__", None)
    if code is None or not code.co_flags & inspect.CO_VARARGS:
        return None
    wrapped = inspect.unwrap(fn)
    if wrapped is not fn and getattr(wrapped, "__code__", None) is not None:
        inner = wrapped.__code__
        return (f"{type(module).__name__}.forward is wrapped by a decorator whose wrapper takes (*args, **kwargs) "
                f"(the forward is at {inner.co_filename}:{inner.co_firstlineno})")
    return f"{type(module).__name__}.forward takes *{code.co_varnames[code.co_argcount]}"


def user_line(exc: BaseException) -> str | None:
    """``file:line (function: code)`` of the innermost frame of ``exc``'s traceback outside torch
    and fxremat: the model's code that failed."""
    return _user_frame(traceback.extract_tb(exc.__traceback__))


def user_stack_line() -> str | None:
    """``file:line (function: code)`` of the innermost frame of the running stack outside torch
    and fxremat: the model's code that called in."""
    return _user_frame(traceback.extract_stack())


def _user_frame(frames: traceback.StackSummary) -> str | None:
    """``file:line (function: code)`` of the innermost of ``frames`` outside torch and fxremat."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    own_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frames = [f for f in frames if not f.filename.startswith((torch_dir, own_dir))]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno} ({f.name}: {(f.line or '').strip()})"


def _trace_error(model: torch.nn.Module, failing: str, exc: Exception) -> TraceError:
    """The TraceError for a failure in ``failing`` (``""``: the top-level forward), naming the
    module's class, the line of its code that failed, and a hint that fits the cause."""
    module = model.get_submodule(failing) if failing else model
    hint = None
    if isinstance(exc, DifferentiatesInForward):
        hint = ("move the code that differentiates into a submodule (it then runs as written, kept or recomputed "
                "whole; pass it in leaf_modules= to say so), or compile the model without it (the energy model, "
                "fxremat.compile(energy, ...)) and call torch.autograd.grad(..., create_graph=True) on the compiled "
                "model's output in a plain wrapper")
    settings = _defaulted_settings(module) if not failing and hint is None else []
    if settings:
        hint = (f"torch.fx traces every parameter of {type(module).__name__}.forward as a tensor of unknown value, "
                f"also those that default to None or a Python value ({', '.join(settings[:6])}), so that code "
                f"checking them (`if flag:`, `if x is not None:`) cannot be traced or takes the branch for a value "
                f"given; pass example_inputs= (the inputs of a call to plan for): fxremat then traces those "
                f"defaulting to None that the call leaves out as None, and captures a forward torch.fx still cannot trace "
                f"with torch.export")
    varargs = varargs_reason(module)
    if varargs is not None:
        hint = (f"{varargs}; torch.fx gives *args one placeholder that the code cannot unpack. "
                + (f"Pass leaf_modules=({failing!r},)" if failing else
                   "Compile a module whose forward names its inputs (for a Hugging Face model, its "
                   "base model's layers, e.g. a wrapper calling model.model.layers), or see the "
                   "README's 'Real models'"))
    return TraceError(failing, exc, hint, module_class=type(module).__name__, where=user_line(exc))


def _untraceable_message(model: torch.nn.Module, failing: str, exc: Exception) -> str:
    """The warning for a submodule torch.fx could not trace, which becomes a leaf."""
    cls = type(model.get_submodule(failing)).__name__
    if isinstance(exc, _PythonValueError):
        cause = f"its forward needs a Python value computed from a tensor: {exc}"
    else:
        cause = f"torch.fx could not trace it ({type(exc).__name__}: {exc})"
    return (f"fxremat: submodule {failing!r} ({cls}) is treated as one leaf node: {cause}. As a leaf it "
            f"runs as written and is kept or recomputed whole (the buffers it updates are put back "
            f"after a recomputation). Pass leaf_modules=({failing!r},) to silence this warning.")


def _mutated_input(gm: fx.GraphModule, node: fx.Node):
    """If ``node`` is an in-place op, return (how it is written: module, operator, function, kwarg or
    method; the mutated arg node)."""
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


def _schema_writes(node: fx.Node) -> list[tuple[int, object]]:
    """``(position, argument)`` of each argument an aten op's schema marks written (``Tensor(a!)``)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    return [(i, a) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def written_inputs(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The input nodes ``node`` writes in place (see :func:`writes_in_place`)."""
    values = [node.args[i] if i < len(node.args) and not a.kwarg_only else node.kwargs.get(a.name)
              for i, a in _schema_writes(node)]
    written = [v for v in values if isinstance(v, fx.Node)]
    if written:
        return written
    found = _mutated_input(gm, node)
    return [found[1]] if found is not None and isinstance(found[1], fx.Node) else []


def writes_in_place(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` writes one of its inputs in place: an aten op whose schema marks an
    argument written (``Tensor(a!)``: ``copy_``, ``fill_``, ``add_``, ``out=``), or an in-place
    module, function, operator or method of traced code (:func:`_mutated_input`)."""
    return bool(_schema_writes(node)) or _mutated_input(gm, node) is not None


class ModeCall(torch.nn.Module):
    """A call of the traced graph that the original forward made under ``torch.no_grad()``,
    ``torch.inference_mode()`` or a ``torch.autocast(...)`` state of its own.

    ``ModeCall(module)`` calls the module (its calls outside such a region go through the same
    wrapper, without the keywords, so they keep their order); ``ModeCall(function=f)`` and
    ``ModeCall(method="name")`` call a function or a tensor method. A call with
    ``fxremat_grad_mode="no_grad"`` or ``"inference_mode"`` runs under that mode, and one with
    ``fxremat_autocast=((device_type, enabled, dtype, cache_enabled), ...)`` under
    ``torch.autocast`` with those arguments (``None``: the caller's setting), exactly as the
    plain forward did; without them, under the caller's modes.
    """

    def __init__(self, module: torch.nn.Module | None = None, *, function=None, method: str | None = None):
        super().__init__()
        if (module is None) + (function is None) + (method is None) != 2:
            raise TypeError("ModeCall takes exactly one of module, function= or method=")
        self.inner = module
        self.function = function
        self.method = method

    def forward(self, *args, **kwargs):
        mode = kwargs.pop(GRAD_MODE_KWARG, None)
        autocast = kwargs.pop(AUTOCAST_KWARG, ())
        with _GRAD_MODES[mode]() if mode is not None else contextlib.nullcontext():
            return self._call(autocast, args, kwargs)

    def _call(self, autocast: tuple, args, kwargs):
        if autocast:  # one torch.autocast per device type, nested
            (device, enabled, dtype, cache), rest = autocast[0], autocast[1:]
            if enabled is None:
                enabled = torch.is_autocast_enabled(device)
            with torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache):
                return self._call(rest, args, kwargs)
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        if self.function is not None:
            return self.function(*args, **kwargs)
        return getattr(args[0], self.method)(*args[1:], **kwargs)

    def extra_repr(self) -> str:
        if self.function is not None:
            owner = getattr(self.function, "__self__", None)  # SomeFunction.apply: name the Function
            name = f"{owner.__qualname__}.{self.function.__name__}" if isinstance(owner, type) else \
                getattr(self.function, "__qualname__", self.function)
            return f"function={name!r}"
        return f"method={self.method!r}" if self.method is not None else ""


GradModeCall = ModeCall  # its name before it handled autocast too (pickles refer to it)


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


def restore_modes(gm: fx.GraphModule) -> fx.GraphModule:
    """Make the call nodes traced under ``no_grad``/``inference_mode`` or an autocast state the
    model's own code set run under it again.

    Each becomes a ``call_module`` of a :class:`ModeCall` with ``fxremat_grad_mode=...`` and/or
    ``fxremat_autocast=...``; every call of a module that is called at least once that way goes
    through one wrapper (one target, so calls of a shared module keep their order and their
    buffers are found). Calls with no node input (factories such as ``torch.zeros``) depend on
    neither and are left as they are. A traced ``SomeFunction.apply(...)`` (a custom
    ``torch.autograd.Function``, kept whole by the trace) becomes a ``call_module`` of a
    :class:`ModeCall` of ``SomeFunction.apply`` first. ``gm`` is changed in place and returned.
    """
    metas = ((_GRAD_MODE_META, GRAD_MODE_KWARG), (_AUTOCAST_META, AUTOCAST_KWARG))
    functions = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _autograd_function_apply]
    for node in functions:  # SomeFunction.apply, called through a module: fx would name the base class's
        name = _free_name(gm, f"{node.name}_apply")
        gm.add_submodule(name, ModeCall(function=node.meta[_FUNCTION_META].apply))
        node.op, node.target = "call_module", name
    marked = [n for n in gm.graph.nodes
              if n.op in CALL_OPS and n.all_input_nodes and any(m in n.meta for m, _ in metas)]
    if not marked:
        if functions:
            gm.graph.lint()
            gm.recompile()
        return gm
    wrappers: dict[str, str] = {}
    for node in marked:
        if node.op == "call_module" and node.target not in wrappers:
            name = _free_name(gm, node.target.replace(".", "_") + "_mode")
            gm.add_submodule(name, ModeCall(gm.get_submodule(node.target)))
            wrappers[node.target] = name
    for node in gm.graph.nodes:  # every call of a wrapped module, in either mode
        if node.op == "call_module" and node.target in wrappers:
            node.target = wrappers[node.target]
    _drop_unused_paths(gm, wrappers)
    for node in marked:
        if node.op == "call_function":
            name = _free_name(gm, f"{node.name}_mode")
            gm.add_submodule(name, ModeCall(function=node.target))
            node.op, node.target = "call_module", name
        elif node.op == "call_method":
            name = _free_name(gm, f"{node.name}_mode")
            gm.add_submodule(name, ModeCall(method=node.target))
            node.op, node.target = "call_module", name
        node.kwargs = {**node.kwargs, **{kwarg: node.meta[m] for m, kwarg in metas if m in node.meta}}
    log.debug("fxremat: %d call node(s) traced under no_grad/inference_mode or the model's own "
              "autocast state run under it again", len(marked))
    gm.graph.lint()
    gm.recompile()
    return gm


def module_of(gm: fx.GraphModule, node: fx.Node) -> tuple[str, str]:
    """``(qualified name, class name)`` of the innermost submodule a node ran in, from the trace's
    ``nn_module_stack``; for a node without one, its own module (a ``call_module``) or ``("", "")``."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        key, value = list(stack.items())[-1]
        if isinstance(value, tuple):
            path, cls = value
            name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
            return path, name.rsplit(".", 1)[-1]
        return str(key), ""
    if node.op == "call_module":
        return node.target, type(gm.get_submodule(node.target)).__name__
    return "", ""
