"""The public API: :func:`compile`, :func:`plan` and :class:`RematModule`.

The pipeline, one stage per module: trace (:mod:`fxremat.passes.trace`) → profile
(:mod:`fxremat.passes.profile`) → DAG with costs (:mod:`fxremat.graph`) → strategy
(:mod:`fxremat.planner`, solvers in :mod:`fxremat.solvers`) → GraphModule
(:mod:`fxremat.passes.rewrite`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import difflib
import functools
import inspect
import logging
import math
import operator
import os
import re
import sys
import time
import types
import warnings
import weakref
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from .budget import parse_budget
from .errors import InfeasibleBudgetError, PlanBudgetError, TraceError, format_bytes
from .measure import allocated_peak, default_loss
from .core import CostGraph, Schedule
from .passes.calibrate import calibrate
from .passes.lower import build_graph, with_mechanism
from .passes.profile import COST_MODELS, GraphCosts, PlainForward, forward_bytes, preserved_state, profile, step_times
from .passes import partition
from .passes.rewrite import rewrite
from .passes.capture import capture_call, value_facts
from .passes.trace import (CALL_OPS, DifferentiatesInForward, HookWatch, ModeCall, SettingsWatch, has_hooks,
                           hooked_modules, is_library_hook, module_of, output_rebuilder, trace, unpacked,
                           varargs_reason, written_inputs)
from .identity import check_plan, graph_key, plan_schedule
from .planner import DEFAULT_EXACT_CAP, DEFAULT_ROTOR_SLOTS, STRATEGIES, Choice, choose, recompute_time
from .records import NodeInfo, Plan, Segment, Trial, read_plan, validate_plan
from .runtime import attribute_bindings, parameter_slots, rebind
from .simulate import predicted_timeline, rerun_time, simulate

__all__ = ["compile", "plan", "planned", "Planned", "cost_graph", "RematModule", "load_plan", "node_infos", "emitted_code"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_FXREMAT_DIR = os.path.dirname(os.path.abspath(__file__))
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\s*$')

log = logging.getLogger("fxremat")

# Dynamo leaves the decorated function's frames to Python and compiles the frames it calls (where
# it traces a caller, a graph break there). Not torch.compiler.disable(recursive=False), which
# leaves its own wrapper's frame to Python and compiles the function it wraps. Every function a
# RematModule's training call runs under torch.compile is so marked, or runs under _without_dynamo
# (none of its frames compiled), or is the emitted code: only that is compiled.
_left_to_python = torch._dynamo.decorators.skip
_without_dynamo = torch.compiler.disable

_OPTIONS = {"exact_cap": DEFAULT_EXACT_CAP, "max_plans": 8, "profile_repeats": 3, "plan": None,
            "rotor_slots": DEFAULT_ROTOR_SLOTS, "autotune": 0, "dp_early_stop": False, "fit_compiled_peak": None}
AUTOTUNE_CANDIDATES = 4  # autotune=True times this many candidate plans
AUTOTUNE_STEPS = 5  # timed steps per candidate (after an untimed one), interleaved
FIT_REPLANS = 2  # fit_compiled_peak: plans made again, at most, for a compiled step over (or well under) its budget
FIT_SLACK = 0.1  # fit_compiled_peak: a compiled step this far under its budget is planned again for more
FIT_GAIN = 0.01  # ... where that plan is predicted at least this fraction of a step faster


@dataclass(frozen=True)
class _Config:
    budget: object
    strategy: str
    cost_model: str
    exact_cap: int | None
    max_plans: int
    profile_repeats: int
    plan: Plan | None
    rotor_slots: int
    autotune: int = 0
    dp_early_stop: bool | None = False  # None: by the device (_early_stop)
    fit_compiled_peak: bool | None = None  # None: on with a compiler backend (compile)
    leaf_modules: tuple = ()
    nested: bool = True  # False with a compiler backend: "auto" plans without nested checkpoints
    one_backward: bool = False  # True with a compiler backend: the backward is one graph (CostGraph.param_grads_held)
    backend: object = "eager"  # the torch.compile backend the steps run under (autotune compiles its candidates)


def _positive_int(api: str, name: str, value, *, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = " or None (the default)" if allow_none else ""
        raise ValueError(f"fxremat.{api}: {name} must be a positive int{extra}, got {value!r}")


def _config(budget, strategy, cost_model, options, *, api: str = "compile", leaf_modules=()) -> _Config:
    """Validate every argument and option of :func:`compile` / :func:`plan` at the call."""
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"fxremat.{api}: unknown option(s) {sorted(unknown)}; known: {sorted(_OPTIONS)}")
    if strategy not in STRATEGIES:
        raise ValueError(f"fxremat.{api}: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if cost_model not in COST_MODELS:
        raise ValueError(f"fxremat.{api}: cost_model must be one of {COST_MODELS}, got {cost_model!r}")
    merged = {**_OPTIONS, **options}
    if merged["plan"] is not None and not isinstance(merged["plan"], Plan):
        raise TypeError(f"fxremat.{api}: plan= takes a fxremat.Plan (fxremat.load_plan(path)), got "
                        f"{type(merged['plan']).__name__}")
    if merged["plan"] is not None:
        validate_plan(merged["plan"], origin=f"the plan passed to fxremat.{api}")
    for name in ("max_plans", "rotor_slots", "profile_repeats"):
        _positive_int(api, name, merged[name])
    tune = merged["autotune"]
    if isinstance(tune, bool):
        merged["autotune"] = AUTOTUNE_CANDIDATES if tune else 0
    elif not isinstance(tune, int) or tune < 0 or tune == 1:
        raise ValueError(f"fxremat.{api}: autotune takes True/False or the number of candidate plans to time "
                         f"(an int >= 2; 0 is off), got {tune!r}")
    _positive_int(api, "exact_cap", merged["exact_cap"], allow_none=True)
    if merged["fit_compiled_peak"] is not None and not isinstance(merged["fit_compiled_peak"], bool):
        raise TypeError(f"fxremat.{api}: fit_compiled_peak takes True or False, got {merged['fit_compiled_peak']!r}")
    if merged["fit_compiled_peak"] and api != "compile":
        raise TypeError(f"fxremat.{api}: fit_compiled_peak=True measures compiled steps, which only "
                        "fxremat.compile(..., backend=...) runs; leave it out here")
    if merged["dp_early_stop"] is not None and not isinstance(merged["dp_early_stop"], bool):
        raise TypeError(f"fxremat.{api}: dp_early_stop takes True, False or None (by the device the steps run "
                        f"on), got {merged['dp_early_stop']!r}")
    return _Config(parse_budget(budget), strategy, cost_model, **merged, leaf_modules=tuple(leaf_modules))


def _check_leaf_modules(model: torch.nn.Module, leaf_modules, api: str) -> tuple:
    """``leaf_modules`` as a tuple, each entry an nn.Module class or a qualified submodule name."""
    if isinstance(leaf_modules, (str, type)):
        shown = leaf_modules.__name__ if isinstance(leaf_modules, type) else repr(leaf_modules)
        raise TypeError(f"fxremat.{api}: leaf_modules takes a tuple of classes or qualified names, got "
                        f"{shown} alone; write leaf_modules=({shown},)")
    if not isinstance(leaf_modules, (tuple, list, set, frozenset)):
        raise TypeError(f"fxremat.{api}: leaf_modules takes a tuple of nn.Module classes or qualified submodule "
                        f"names, got {type(leaf_modules).__name__} {leaf_modules!r}")
    names = [name for name, _ in model.named_modules(remove_duplicate=False) if name]
    for leaf in leaf_modules:
        if isinstance(leaf, type) and issubclass(leaf, torch.nn.Module):
            continue
        if not isinstance(leaf, str):
            raise TypeError(f"fxremat.{api}: leaf_modules entries must be nn.Module classes or qualified submodule "
                            f"names (str), got {type(leaf).__name__} {leaf!r}")
        if leaf in names:
            continue
        by_class = [n for n, m in model.named_modules() if n and type(m).__name__ == leaf]
        hint = (f"it is the class of {by_class[:3]}: pass the class itself, leaf_modules=({leaf},)" if by_class
                else f"close names: {difflib.get_close_matches(leaf, names, n=3)}" if difflib.get_close_matches(leaf, names)
                else "see model.named_modules() for the qualified names")
        raise ValueError(f"fxremat.{api}: leaf_modules entry {leaf!r} is not a submodule of "
                         f"{type(model).__name__}; {hint}")
    return tuple(leaf_modules)


@contextlib.contextmanager
def _stage(name: str, detail: str = ""):
    """Log a pipeline stage at INFO on the ``fxremat`` logger: when it starts and how long it took.
    The records carry ``fxremat_stage`` (the CLI turns them into progress-bar stages)."""
    log.info("fxremat: %s%s ...", name, f" {detail}" if detail else "", extra={"fxremat_stage": name})
    start = time.perf_counter()
    yield
    log.info("fxremat: %s done in %.2fs", name, time.perf_counter() - start, extra={"fxremat_stage_done": name})


def _check_inputs(gm: torch.nn.Module, inputs: tuple, api: str = "compile") -> None:
    """Refuse, before profiling, inputs fxremat cannot run: meta tensors, or a device that is not
    the model's."""
    tensors = [(i, x) for i, x in enumerate(tree_flatten(inputs)[0]) if isinstance(x, torch.Tensor)]
    state = [t for t in (*gm.parameters(), *gm.buffers())]
    if any(t.is_meta for t in state):
        raise ValueError(
            f"fxremat.{api}: the model's parameters or buffers are on the meta device; fxremat runs the model "
            "to profile it: materialise them first (model.to_empty(device=...) and initialise), or build the "
            "model under torch._subclasses.fake_tensor.FakeTensorMode to plan without allocating"
        )
    for i, x in tensors:
        if x.is_meta:
            raise ValueError(
                f"fxremat.{api}: input {i} (shape {tuple(x.shape)}) is on the meta device; fxremat runs the model "
                "to profile it: pass real tensors, or fake tensors made under "
                "torch._subclasses.fake_tensor.FakeTensorMode to plan without allocating"
            )
    _refuse_written_inputs(gm, inputs, api, {id(t) for t in state})
    devices = {t.device for t in state}
    if len(devices) == 1:
        (device,) = devices
        for i, x in tensors:
            if x.device != device:
                raise ValueError(
                    f"fxremat.{api}: input {i} (shape {tuple(x.shape)}) is on {x.device} but the model's "
                    f"parameters are on {device}; move the inputs with .to({str(device)!r}) (or the model "
                    f"with .to({str(x.device)!r})) before the call"
                )


# Ops whose result is a view of their first argument: an in-place write through one writes the input.
_VIEW_METHODS = frozenset({"view", "view_as", "permute", "transpose", "t", "squeeze", "unsqueeze", "expand",
                           "expand_as", "narrow", "select", "unflatten", "detach", "as_strided", "unbind"})


def _writes_by_name(method: str) -> bool:
    """Whether a tensor method writes its tensor, by torch's naming (``zero_``, ``fill_``), not a flag
    (``requires_grad_``)."""
    return method.endswith("_") and not method.startswith("_") and method != "requires_grad_"


def _written_bases(gm: fx.GraphModule):
    """``(node, base)`` for every call of ``gm`` that writes in place a node ``base`` (a placeholder,
    a ``get_attr`` or another value), directly or through views of it (getitem, the view methods,
    ``.data``)."""
    for node in gm.graph.nodes:
        if node.op not in CALL_OPS:
            continue
        written = written_inputs(gm, node)
        method = node.target if node.op == "call_method" else None
        if node.op == "call_module" and isinstance(mode_call := gm.get_submodule(node.target), ModeCall):
            method = mode_call.method  # x.mul_(2) under the forward's own no_grad()/autocast region
        if not written and method is not None and _writes_by_name(method) and node.args:
            written = [node.args[0]]  # x[:, 0].zero_(), x.fill_(0), x.copy_(y): by the method's name
        for written in [w for w in written if isinstance(w, fx.Node)]:
            base = written
            while base.op not in ("placeholder", "get_attr") and base.args and isinstance(base.args[0], fx.Node) and (
                    base.target in (operator.getitem, unpacked)
                    or (base.op == "call_method" and base.target in _VIEW_METHODS)
                    or (base.target is getattr and base.args[1:] == ("data",))):  # w.data.clamp_(-c, c)
                base = base.args[0]
            yield node, base


def _refuse_written_inputs(gm: torch.nn.Module, inputs: tuple, api: str, state: set[int]) -> None:
    """Refuse a forward that writes a tensor input in place (``x.mul_(2)``, ``x /= 255``, or
    through a view of it). Eager runs the write once per step on the caller's tensor; here
    profiling runs the forward several times on it (the example input came back multiplied by 8)
    and a recomputed segment reads it after the write, which the backward then refuses with
    torch's bare "modified by an inplace operation" error. (``state``: ids of the model's parameters
    and buffers, which a BatchNorm writes as it should, wherever a graph takes them as inputs.)

    Refuse as well a forward that writes one of the model's parameters in place
    (``with torch.no_grad(): self.conv.weight.mul_(0.99)``, a clip or decay inside the model): eager
    writes it once per call; planning ran the forward three times (the weight came back x0.9703),
    and a recomputed segment holding the write would make it again in the backward. Buffers are
    not refused: their writes are planned (put back after profiling and after each recomputation)."""
    if not isinstance(gm, fx.GraphModule):
        return
    _refuse_renormed_embeddings(gm, api)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensor_inputs = {p for p, x in zip(placeholders, inputs) if isinstance(x, torch.Tensor) and id(x) not in state}
    params = {id(p) for p in gm.parameters()}
    param_inputs = {p for p, x in zip(placeholders, inputs) if id(x) in params}
    for node, base in _written_bases(gm):
        source, code = _user_frame(node.meta.get("stack_trace") or "")
        where = f" at {source}: {code}" if source else ""
        op = getattr(node.target, "__name__", node.target)
        if node.op == "call_module" and isinstance(mode_call := gm.get_submodule(node.target), ModeCall):
            op = mode_call.method or getattr(mode_call.function, "__name__", op)
        if base in tensor_inputs:
            raise ValueError(
                f"fxremat.{api}: the forward writes its input {base.target!r} in place ({op}"
                f"{where}); fxremat runs the forward more than once on its inputs (profiling, recomputation), "
                f"so the write would be repeated. Write to a new tensor instead ({base.target} = "
                f"{base.target} * 2 rather than {base.target}.mul_(2) or *=), or make the write in the caller")
        if base in param_inputs or (base.op == "get_attr" and id(_attr_or_none(gm, base.target)) in params):
            raise ValueError(
                f"fxremat.{api}: the forward writes the parameter {base.target!r} in place ({op}{where}); eager "
                f"PyTorch writes it once per call, but fxremat runs the forward more than once while planning and "
                f"again in the backward where it recomputes, so the write would be repeated (silently different "
                f"weights). Make the write outside the forward, in the training loop (with torch.no_grad(): "
                f"model.{base.target}.{op}(...) just before calling the model, or after optimizer.step()), or "
                f"compute the changed weight as a new tensor in the forward instead of writing the parameter")


def _refuse_renormed_embeddings(gm: fx.GraphModule, api: str) -> None:
    """Refuse an ``nn.Embedding``/``nn.EmbeddingBag`` with ``max_norm`` that the graph calls (as a
    node or inside a leaf): its forward renormalizes the looked-up rows of its weight in place, a
    parameter write that profiling made on the example input's rows (weights changed before the
    first step) and a nested recomputation made again ("parameter 'emb.weight' was written in
    place between the forward and the backward")."""
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        for path, m in gm.get_submodule(node.target).named_modules(prefix=node.target):
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None:
                raise ValueError(
                    f"fxremat.{api}: {path!r} is an nn.{type(m).__name__} with max_norm={m.max_norm}: its forward "
                    f"renormalizes the rows it looks up in place, in its weight (a parameter write), which fxremat "
                    f"would repeat (profiling, recomputation). Set {path}.max_norm = None and renormalize in the "
                    f"training loop before each step (with torch.no_grad(): torch.embedding_renorm_("
                    f"model.{path}.weight, indices.flatten(), {m.max_norm}, {m.norm_type}): what its forward does)")


def _attr_or_none(gm: torch.nn.Module, target: str):
    """The attribute ``target`` (dotted) of ``gm``, or None where it is not there."""
    try:
        return operator.attrgetter(target)(gm)
    except AttributeError:
        return None


def _as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(
            f"fxremat: example_inputs must be a tensor or a tuple of the model's positional inputs, "
            f"got {type(example_inputs).__name__}"
        )
    return tuple(example_inputs)


def _segments_of(graph: CostGraph, schedule) -> tuple[Segment, ...]:
    """Plan segments of a schedule, nested schedules of recomputed segments included."""
    segments = []
    for i, (seg, rec) in enumerate(zip(schedule.segments, schedule.recomputed)):
        members = set(seg)
        kept = [v for v in seg if graph.is_output[v] or any(s not in members for s in graph.succs[v])]
        kept_roots = {graph.root[v] for v in kept}
        nested = schedule.inner_of(i) if rec else None
        inner = _segments_of(graph, nested) if nested is not None else ()
        segments.append(Segment(
            nodes=tuple(graph.names[v] for v in seg),
            recomputed=rec,
            kept=tuple(graph.names[v] for v in kept),
            kept_bytes=sum(graph.out_bytes[r] for r in kept_roots),
            recompute_cost=rerun_time(graph, seg, nested) * graph.time_unit if rec else 0.0,
            inner=inner,
        ))
    return tuple(segments)


def _plan_from(graph: CostGraph, choice: Choice, cost_model: str, *, nodes=(), key: str = "") -> Plan:
    """The Plan of ``choice``; ``nodes`` (:func:`node_infos`) and ``key``
    (:func:`fxremat.identity.graph_key`) feed :meth:`Plan.explain` and :meth:`Plan.save`."""
    segments = _segments_of(graph, choice.schedule)
    timeline = predicted_timeline(graph, choice.schedule)
    return Plan(
        strategy=choice.strategy,
        objective=choice.objective,
        budget_bytes=choice.budget_bytes,
        baseline_peak_bytes=choice.baseline_peak_bytes,
        predicted_peak_bytes=choice.peak_bytes,
        # an empty batch costs nothing: no overhead rather than 0/0
        predicted_overhead=choice.recompute_time * graph.time_unit / graph.step_cost if graph.step_cost else 0.0,
        solve_seconds=choice.solve_seconds,
        segments=tuple(segments),
        cost_model=cost_model,
        num_nodes=graph.n,
        num_lower_sets=choice.num_lower_sets,
        notes=choice.notes,
        nodes=tuple(nodes),
        timeline_bytes=timeline.bytes,
        backward_start=timeline.backward_start,
        graph_key=key,
    )


def _lowered(gm: fx.GraphModule, inputs: tuple, config: _Config, *,
             any_budget: bool = False) -> tuple[CostGraph, GraphCosts]:
    """Profile and lower: the :class:`~fxremat.core.CostGraph` of a traced graph and its profile,
    the checkpoint mechanism calibrated on it where a plan under ``config`` may recompute (or, with
    ``any_budget``, for plans at every budget)."""
    _check_inputs(gm, inputs)
    with _stage("profiling", f"{sum(n.op.startswith('call') for n in gm.graph.nodes)} nodes, "
                             f"cost model {config.cost_model}"):
        costs = profile(gm, inputs, cost_model=config.cost_model, repeats=config.profile_repeats)
        graph = build_graph(gm, costs)
    if costs.mechanism is not None and (any_budget or _may_recompute(config)):
        with _stage("calibrating", "the checkpoint mechanism on this model"):
            costs = replace(costs, mechanism=calibrate(gm, inputs, graph, costs, config.profile_repeats))
            graph = with_mechanism(graph, costs)
    return replace(graph, param_grads_held=config.one_backward), costs


def _may_recompute(config: _Config) -> bool:
    """Whether a plan under ``config`` may recompute anything at some input size: not with
    ``strategy="none"`` nor with a budget of the whole baseline or more (a fraction >= 1), where
    calibrating the checkpoint mechanism would only cost steps (about a second)."""
    whole = config.budget.fraction is not None and config.budget.fraction >= 1
    return config.strategy != "none" and not whole


def _plain_peak(graph: CostGraph, plain: PlainForward | None) -> int | None:
    """The model's own plain peak (see :class:`~fxremat.passes.profile.PlainForward`), or ``None``
    where its forward was not measured (the graph's simulated plain peak then stands)."""
    if plain is None:
        return None
    return max(simulate(graph, Schedule.plain(graph.n)) + plain.extra_bytes, plain.peak_bytes)


def _plain_forward(model: torch.nn.Module, args: tuple, kwargs: dict) -> PlainForward:
    """A traced model's own forward, called as the user calls it (:class:`PlainForward`), without
    its user hooks, as its graph is profiled."""
    return PlainForward(peak_bytes=forward_bytes(model, model, args, kwargs, hooks=False)[1])


def _early_stop(config: _Config, gm: fx.GraphModule, inputs: tuple) -> bool:
    """Whether the DP also charges a recomputed segment only up to its last saved-tensor reader:
    ``config.dp_early_stop``, or where it is ``None`` (the default with a compiler backend), on for
    steps on the CPU and off for steps on CUDA. Under Inductor on this repository's CPU its plans
    ran faster (at 0.5: ResNet chain 1.12x -> 1.04x plain Inductor, U-Net 1.20x -> 1.15x); on an
    H200 they ran slower (transformer at 0.7: 1.15x against 0.94x with whole segments, one loop;
    U-Net at 0.7: 1.12x at 532 MiB against 1.08x at 511 MiB in an earlier session), see
    ``benchmarks/results/cuda/compile_inductor_*.md``."""
    if config.dp_early_stop is not None:
        return config.dp_early_stop
    tensors = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)] + list(gm.parameters())
    return not any(t.device.type == "cuda" for t in tensors)


def _plan_graph(gm: fx.GraphModule, inputs: tuple, config: _Config, origin: str,
                plain: PlainForward | None = None, *, later: "_Later | None" = None) -> tuple[Plan, GraphCosts | None]:
    """The pipeline after tracing, for :func:`compile`, :func:`plan` and the CLI: a saved plan
    (``config.plan``) checked and re-derived, or profile → lower → choose → :class:`Plan`.
    ``plain``: the model's own forward, measured (the baseline is the model's, see
    :func:`_plain_peak`); ``later``: a signature planned at a training step (:func:`_choose`).
    Returns the plan and the profile its times came from (``None`` for a saved plan)."""
    if config.plan is not None:
        return _saved_plan(gm, inputs, config, origin, plain), None
    graph, costs = _lowered(gm, inputs, config)
    return _chosen(gm, inputs, graph, costs, config, _plain_peak(graph, plain), later=later), costs


@dataclass
class _Later:
    """An input signature planned at a training step after the module planned one (the budget was
    checked then): ``inputs`` describes it; ``state`` is the module's, warned once."""

    inputs: str
    state: "_State"


def least_fraction(share: float) -> float:
    """The fraction budget to advise for a least feasible peak of ``share`` of the plain peak: ``share``
    rounded *up* to two decimals, as the warning prints it (rounded to nearest, a least of 0.502 was
    advised as "at least 0.50" to a user who had passed 0.5: Hugging Face Qwen2 trained without labels)."""
    return math.ceil(round(share * 100, 6)) / 100


def _choose(graph: CostGraph, config: _Config, gm: fx.GraphModule, inputs: tuple,
            plain_peak_bytes: int | None, later: _Later | None = None, costs: GraphCosts | None = None) -> Choice:
    """:func:`~fxremat.planner.choose` under ``config``. A fraction budget is a fraction of each
    input signature's own plain peak; where a signature first seen at a training step
    (``later``) cannot reach it (under autocast the bf16 copies of the weights are a larger part of
    the peak: timm's ConvNeXt-V2 atto, compiled at 0.5 in fp32, has a least of 0.56 of its plain
    peak under bf16 autocast, and its first autocast step raised), it is planned at its least, with
    a warning, rather than the step failing. A byte budget there is
    still refused, with what to pass to :func:`compile`. Where one leaf node of ``costs`` holds
    most of the least feasible peak, the error names it too (:func:`_leaf_hint`)."""
    kwargs = dict(strategy=config.strategy, exact_cap=config.exact_cap, rotor_slots=config.rotor_slots,
                  plain_peak_bytes=plain_peak_bytes, nested=config.nested, early_stop=_early_stop(config, gm, inputs))
    fraction = later is not None and config.budget.fraction is not None
    try:
        choice = choose(graph, config.budget, least_if_below=fraction, **kwargs)
    except InfeasibleBudgetError as exc:
        leaf = None if costs is None else _leaf_hint(gm, costs, exc.min_feasible_bytes, config.leaf_modules)
        if later is None and leaf is None:
            raise
        hint = exc.ADVICE if later is None else (
            f"this is input signature {later.inputs}, planned at a training step (the budget was checked "
            f"at compile on other inputs or another autocast state): pass fxremat.compile a budget of at "
            f"least {exc.min_feasible_bytes} bytes, budget='min', or a fraction (0.5), which a signature "
            f"that cannot reach it is planned at its least for")
        raise InfeasibleBudgetError(exc.budget_bytes, exc.min_feasible_bytes,
                                    hint + (f". {leaf}" if leaf else "")) from None
    if not fraction or choice.objective != "memory-centric":
        return choice
    target = config.budget.resolve(choice.baseline_peak_bytes)
    share = choice.peak_bytes / choice.baseline_peak_bytes
    note = (f"budget {config.budget} ({format_bytes(target)}) is below this signature's least feasible peak "
            f"{format_bytes(choice.peak_bytes)}; planned at that least")
    if not later.state.warned_fraction:
        later.state.warned_fraction = True
        warnings.warn(
            f"fxremat.RematModule: budget {config.budget} is {format_bytes(target)} for input signature "
            f"{later.inputs} (a fraction of its own plain peak, {format_bytes(choice.baseline_peak_bytes)}), below "
            f"its least feasible peak {format_bytes(choice.peak_bytes)} ({share:.3f} of its plain peak); it is "
            f"planned at that least. Pass fxremat.compile budget='min', or a fraction of at least "
            f"{least_fraction(share):.2f}, to plan every signature so. (Shown once.)", stacklevel=5)
    return replace(choice, notes=choice.notes + (note,))


def _chosen(gm: fx.GraphModule, inputs: tuple, graph: CostGraph, costs: GraphCosts, config: _Config,
            plain_peak_bytes: int | None = None, *, later: _Later | None = None) -> Plan:
    """Solve a lowered graph under ``config`` (autotuning where it asks) and make the Plan;
    ``plain_peak_bytes``: the baseline, where it is not the graph's simulated plain peak;
    ``later``: see :func:`_choose`."""
    with _stage("solving", f"strategy {config.strategy}, budget {config.budget}"):
        choice = _choose(graph, config, gm, inputs, plain_peak_bytes, later, costs)
    nodes, key = node_infos(gm, costs), graph_key(gm, inputs)
    if config.autotune and len(choice.alternatives) > 1:
        return _autotuned(gm, inputs, graph, choice, costs, config.autotune, nodes, key, config.backend)
    return _plan_from(graph, choice, costs.cost_model, nodes=nodes, key=key)


_LEAF_SHARE = 0.5  # of the least feasible peak, held inside one leaf node: named in InfeasibleBudgetError


def _leaf_hint(gm: fx.GraphModule, costs: GraphCosts, least_bytes: int, leaf_modules=()) -> str | None:
    """Where one leaf module's node (``call_module``) holds at least half the least feasible peak
    inside it — what its forward saves for its backward beyond its inputs and output, and its
    temporaries, which no plan recomputes away while it runs whole — a sentence naming it and how
    to plan inside it; else ``None``. (A whole ``nn.TransformerEncoder`` kept as one node held 94%
    of it, and the error said only to raise the budget.)"""
    calls = {n.name: n for n in gm.graph.nodes if n.op == "call_module"}
    inside = {c.name: c.extra_bytes + max(c.fwd_transient_bytes, c.bwd_transient_bytes)
              for c in costs.nodes if c.name in calls}
    name = max(inside, key=inside.get, default=None)
    if name is None or inside[name] < _LEAF_SHARE * least_bytes:
        return None
    cost = next(c for c in costs.nodes if c.name == name)
    # the gradient of its weights, made by its backward before it is added to .grad: the weights'
    # size whatever the inputs (hrnet_w18_small's last downsampling Conv2d: 18.0 MiB, 99%)
    weight_grads = min(cost.param_grad_bytes, cost.bwd_transient_bytes)
    module = gm.get_submodule(calls[name].target)
    module = module.inner if isinstance(module, ModeCall) and module.inner is not None else module
    path, cls = module_of(gm, calls[name])[0] or calls[name].target, type(module).__name__
    classes = tuple(leaf for leaf in leaf_modules if isinstance(leaf, type))
    if path in leaf_modules or isinstance(module, classes):
        how = "it is in leaf_modules: leave it out to plan inside it"
    elif has_hooks(module):
        how = "a module with hooks is called whole: remove its hooks while training to plan inside it"
    elif type(module).__module__.startswith("torch.nn.") and weight_grads >= _LEAF_SHARE * inside[name]:
        how = (f"{format_bytes(weight_grads)} of it is the gradient of its weights, which its backward makes "
               f"before adding it to their .grad: that is the size of its weights whatever the inputs, so no plan "
               f"and no smaller input lowers it")
    elif type(module).__module__.startswith("torch.nn."):
        how = (f"torch.fx cannot trace into torch.nn's {cls}, so only smaller inputs (batch, sequence) lower what "
               "it holds")
    else:
        how = (f"its forward could not be traced (a warning said why when it was made a leaf): make that code "
               f"traceable to plan inside it, or compile it apart (model.{path} = fxremat.compile(model.{path}, ...))")
    return (f"Of that peak, {format_bytes(inside[name])} ({inside[name] / least_bytes:.0%}) is held inside the leaf "
            f"node {name!r} (submodule {path!r}, {cls}): what it saves for its backward and its temporaries, "
            f"which no plan recomputes away while it runs as one node; {how}")


def _autotuned(gm: fx.GraphModule, inputs: tuple, graph: CostGraph, choice: Choice, costs: GraphCosts,
               count: int, nodes, key: str, backend="eager") -> Plan:
    """The fastest measured of the ``count`` best candidates of ``choice`` (every strategy's
    best plan within the budget, by predicted time): each is emitted and timed for real beside
    the traced graph run plainly (:func:`fxremat.passes.profile.step_times`); the model's
    buffers and RNG states are put back. The plan lists what was tried (``Plan.autotune``).
    With a compiler ``backend`` each of them (the plain graph too) is compiled by it and timed as
    it will train: a plan's compiled speed is not its eager speed (AOTAutograd recomputes inside
    its backward graph, without the checkpoint mechanism, and fuses what it recomputes)."""
    plans = []
    for strategy, schedule, peak, rtime in choice.alternatives[:count]:
        alt = replace(choice, strategy=strategy, schedule=schedule, peak_bytes=peak, recompute_time=rtime)
        plans.append(_plan_from(graph, alt, costs.cost_model, nodes=nodes, key=key))
    modules = [gm] + [_emit(gm, p) for p in plans]
    if backend != "eager":  # each compiled on its first, untimed, step
        modules = [torch.compile(m, backend=backend, dynamic=False) for m in modules]
    with _stage("autotuning", f"timing {len(plans)} candidate plans"
                + ("" if backend == "eager" else f", each compiled by backend {_backend_name(backend)}")), \
            preserved_state(gm), partition.keeping_segment_outputs():
        plain, *times = step_times(modules, inputs, AUTOTUNE_STEPS)
    fastest = min(range(len(plans)), key=lambda i: times[i])
    trials = tuple(Trial(p.strategy, p.predicted_peak_bytes, p.predicted_overhead, t / plain - 1, i == fastest)
                   for i, (p, t) in enumerate(zip(plans, times)))
    return replace(plans[fastest], autotune=trials)


def _backend_name(backend) -> str:
    return repr(backend) if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)


def _saved_plan(gm: fx.GraphModule, inputs: tuple, config: _Config, origin: str,
                plain: PlainForward | None = None) -> Plan:
    """``config.plan`` checked against this graph and re-derived from it: the graph key, every
    segment's nodes (each call node once, dependencies in order), then one profile of the
    current model (``"uniform"`` costs, or the plan's ``"flops"``: no timing) gives the mutated
    buffers, the kept bytes, the baseline and the predicted peak (the plan's schedule simulated
    again), which must fit ``config.budget``. Times of a ``"measured"`` plan are kept as saved."""
    saved = config.plan
    _check_inputs(gm, inputs)
    check_plan(saved, gm, inputs, origin=origin)
    cost_model = saved.cost_model if saved.cost_model != "measured" else "uniform"
    with _stage("checking the saved plan", f"{saved.strategy}, {len(saved.segments)} segments"):
        costs = profile(gm, inputs, cost_model=cost_model, repeats=1)
        graph = replace(build_graph(gm, costs), param_grads_held=config.one_backward)
        schedule = plan_schedule(saved, graph, origin=origin)
        own = _plain_peak(graph, plain)
        baseline = simulate(graph, Schedule.plain(graph.n)) if own is None else own
        peak = simulate(graph, schedule)
    target = config.budget.resolve(baseline)
    if target is None and saved.objective != "memory-centric":
        raise PlanBudgetError(origin, None, peak, saved.budget_bytes)
    if target is not None and peak > target:
        raise PlanBudgetError(origin, target, peak, saved.budget_bytes)
    choice = Choice(schedule=schedule, strategy=saved.strategy, objective=saved.objective,
                    budget_bytes=peak if target is None else target, baseline_peak_bytes=baseline, peak_bytes=peak,
                    recompute_time=recompute_time(graph, schedule), solve_seconds=saved.solve_seconds,
                    num_lower_sets=saved.num_lower_sets, notes=saved.notes)
    the_plan = _plan_from(graph, choice, saved.cost_model, nodes=node_infos(gm, costs), key=saved.graph_key)
    if saved.cost_model == "measured":  # timings are not re-derived: keep the saved ones
        the_plan = dataclasses.replace(the_plan, predicted_overhead=saved.predicted_overhead,
                                       segments=_with_costs(the_plan.segments, saved.segments))
    return the_plan


def _with_costs(segments, saved) -> tuple[Segment, ...]:
    return tuple(dataclasses.replace(s, recompute_cost=o.recompute_cost, inner=_with_costs(s.inner, o.inner))
                 for s, o in zip(segments, saved))


def emitted_code(gm: fx.GraphModule, title: str) -> str:
    """The emitted forward's source followed by each recomputed segment's source (nested
    checkpoints of a segment, ``seg_i.seg_j``, after it)."""
    parts = [f"# fxremat: {title}, recomputed segments are seg_*\n"
             f"# (their interior is dropped after the forward and recomputed in the backward)",
             gm.code.strip("\n")]
    for name, seg in gm.named_modules():
        if name.rpartition(".")[2].startswith("seg_") and isinstance(seg, fx.GraphModule):
            nested = " (nested: its recomputation checkpoints seg_* again)" if any(
                c.startswith("seg_") for c, _ in seg.named_children()) else ""
            parts.append(f"# {name}: recomputed during the backward{nested}\n" + seg.code.strip("\n"))
    return "\n\n".join(parts) + "\n"


def _nested_args(segments):
    """``rewrite``'s ``(segments, recomputed, inner)`` for plan segments."""
    return ([list(s.nodes) for s in segments], [s.recomputed for s in segments],
            [_nested_args(s.inner) if s.inner else None for s in segments])


def _emit(gm: fx.GraphModule, the_plan: Plan) -> fx.GraphModule:
    mutated = {n.name: n.mutated_buffers for n in the_plan.nodes}
    random = {n.name for n in the_plan.nodes if n.draws_random}
    views = {n.name for n in the_plan.nodes if n.root != n.name}
    segments, recomputed, inner = _nested_args(the_plan.segments)
    with _stage("emitting", f"{sum(recomputed)} recomputed segments"):
        return rewrite(gm, segments, recomputed, mutated, inner, random=random, views=views)


def _wrappers() -> list[tuple[type, str, str]]:
    """(class, attribute holding the wrapped model, how to wrap the compiled one) of the wrappers
    fxremat must not trace through. FSDP1 and torch.compile are only looked up once imported (a
    model cannot be wrapped by them otherwise), so this costs no import."""
    found = [(torch.nn.parallel.DistributedDataParallel, "module", "DistributedDataParallel(remat)"),
             (torch.nn.DataParallel, "module", "DataParallel(remat)")]
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    if fsdp is not None:
        found.append((fsdp.FullyShardedDataParallel, "module", "FullyShardedDataParallel(remat)"))
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None:
        found.append((dynamo.OptimizedModule, "_orig_mod", "torch.compile(remat)"))
    return found


def _check_unwrapped(model: torch.nn.Module, api: str) -> None:
    """Refuse a model already wrapped by DDP, DataParallel, FSDP or torch.compile, or compiled by
    fxremat already (compiled again, it was captured whole and nested, silently)."""
    if isinstance(model, RematModule):
        raise TypeError(
            f"fxremat.{api}: got a RematModule ({type(model._remat.model).__name__} compiled by "
            f"fxremat.compile already); pass the model it was compiled from to plan it for another budget "
            f"(the two share their parameters), or use the RematModule as it is")
    for cls, inner, wrap in _wrappers():
        if isinstance(model, cls):
            kind = type(model)
            raise TypeError(
                f"fxremat.{api}: got a {kind.__module__}.{kind.__qualname__}, a wrapper around the model "
                f"(its .{inner}); fxremat must see the model itself. Compile the inner model, then wrap "
                f"it: remat = fxremat.{api}(model, budget, ...), then {wrap}"
                + ("; with DDP pass cost_model='flops' so every rank makes the same plan"
                   if wrap.startswith("Distributed") else "")
            )
    _check_scripted(model, api)
    _check_materialized(model, api)


def _check_materialized(model: torch.nn.Module, api: str) -> None:
    """Refuse a model with lazy modules (``nn.LazyLinear``) not yet run: their parameters have no
    shape until the first forward, and compiling failed inside fxremat on torch's "Attempted to use
    an uninitialized parameter in <method 'numel' ...>"."""
    for name, p in model.named_parameters():
        if torch.nn.parameter.is_lazy(p):
            owner = name.rpartition(".")[0]
            cls = type(model.get_submodule(owner)).__name__ if owner else type(model).__name__
            raise ValueError(
                f"fxremat.{api}: parameter {name!r} of {cls} is not initialized yet (a lazy module, whose "
                f"parameters get their shape at its first forward); run one forward of the model on a batch "
                f"(with torch.no_grad(): model(example)) before fxremat.{api}, as torch's lazy modules require "
                f"before their parameters are used")


def _check_scripted(model: torch.nn.Module, api: str) -> None:
    """Refuse a TorchScript submodule (``torch.jit.script``) that holds buffers. torch.fx calls it
    whole (``body._c.forward``), and what its compiled code writes (a BatchNorm's running
    statistics) is not seen: profiling changed them for good and nothing is restored after a
    recomputation. One without buffers is called whole as written."""
    for path, module in model.named_modules():
        if isinstance(module, torch.jit.ScriptModule):
            buffers = [f"{path}.{name}" for name, _ in module.named_buffers()]
            if buffers:
                raise TypeError(
                    f"fxremat.{api}: submodule {path!r} is a TorchScript module (torch.jit.script) with buffers "
                    f"({', '.join(buffers[:3])}{', ...' if len(buffers) > 3 else ''}); fxremat cannot see what its "
                    f"compiled code writes into them, so profiling and recomputation would update them again. "
                    f"Pass the module before torch.jit.script (fxremat traces it), or script the model without "
                    f"fxremat")


@dataclass(frozen=True)
class Planned:
    """One run of the pipeline on a model and its example inputs (:func:`planned`): the traced
    (or captured) graph module, the inputs it was planned for, and the plan."""

    graph_module: fx.GraphModule
    inputs: tuple
    plan: Plan

    def emit(self) -> fx.GraphModule:
        """The GraphModule that runs the plan (recomputed segments as checkpointed submodules)."""
        return _emit(self.graph_module, self.plan)

    def code(self, title: str) -> str:
        """The emitted code a person reads (:func:`emitted_code`)."""
        return emitted_code(self.emit(), title)


def _traced_call(model: torch.nn.Module, example_inputs, leaf_modules, api: str,
                 measure_plain: bool = True) -> tuple[fx.GraphModule, tuple, PlainForward | None]:
    """``(graph module, its positional inputs, the model's own forward measured)`` for ``model``
    called with ``example_inputs`` (the last ``None`` where not ``measure_plain``, for a traced
    model; see :func:`_plain_peak`)."""
    inputs = None if isinstance(example_inputs, dict) else _as_tuple(example_inputs)
    gm = _traced(model, leaf_modules, api, can_capture=True, example_inputs=example_inputs)
    args, kwargs = _example_call(example_inputs)
    if gm is None:  # captured per call: example_inputs as a dict are keyword inputs
        captured = capture_call(model, args, kwargs, leaf_modules=leaf_modules)
        return captured.graph_module, captured.inputs(args, kwargs), captured.plain
    if inputs is None:  # keyword inputs of a traced forward: its placeholders in order
        bound = inspect.signature(model.forward).bind(**example_inputs)
        bound.apply_defaults()
        inputs = tuple(bound.arguments.values())
    if not measure_plain:
        return gm, inputs, None
    _check_inputs(gm, inputs, api)
    return gm, inputs, _plain_forward(model, args, kwargs)


def planned(model: torch.nn.Module, budget, *, example_inputs, strategy: str = "auto", cost_model: str = "measured",
            leaf_modules=(), api: str = "plan", **options) -> Planned:
    """The whole pipeline on ``model`` and ``example_inputs``: trace (or capture), profile,
    lower, choose, and the :class:`Planned` result (see :func:`compile` for the arguments;
    ``api`` names the caller in errors). :func:`plan` and the command line use it."""
    _check_unwrapped(model, api)
    leaf_modules = _check_leaf_modules(model, leaf_modules, api)
    config = _config(budget, strategy, cost_model, options, api=api, leaf_modules=leaf_modules)
    with _planning_modes(), _training_mode(model):  # plan what is trained, also for a model in eval()
        gm, inputs, plain = _traced_call(model, example_inputs, leaf_modules, api)
        the_plan, _ = _plan_graph(gm, inputs, config, f"the plan passed to fxremat.{api}", plain)
    return Planned(gm, inputs, the_plan)


def cost_graph(model: torch.nn.Module, *, example_inputs, cost_model: str = "measured", leaf_modules=(),
               api: str = "cost_graph", profile_repeats: int = _OPTIONS["profile_repeats"]) -> CostGraph:
    """The pipeline up to the solver: ``model`` traced (or captured), profiled and lowered to its
    :class:`~fxremat.core.CostGraph` (what :func:`fxremat.planner.tradeoff` sweeps)."""
    _check_unwrapped(model, api)
    leaf_modules = _check_leaf_modules(model, leaf_modules, api)
    config = _config(1.0, "auto", cost_model, {"profile_repeats": profile_repeats}, api=api, leaf_modules=leaf_modules)
    with _planning_modes(), _training_mode(model):
        gm, inputs, _ = _traced_call(model, example_inputs, leaf_modules, api, measure_plain=False)
        return _lowered(gm, inputs, config, any_budget=True)[0]


def plan(model: torch.nn.Module, budget, *, example_inputs, strategy: str = "auto", cost_model: str = "measured",
         leaf_modules=(), **options) -> Plan:
    """Plan recomputation for ``model`` on ``example_inputs`` under ``budget`` without rewriting.

    See :func:`compile` for the arguments. Raises :class:`fxremat.InfeasibleBudgetError` when
    no plan fits the budget.
    """
    return planned(model, budget, example_inputs=example_inputs, strategy=strategy, cost_model=cost_model,
                   leaf_modules=leaf_modules, api="plan", **options).plan


def _traced(model: torch.nn.Module, leaf_modules, api: str, can_capture: bool,
            example_inputs=None) -> fx.GraphModule | None:
    """``model`` traced with torch.fx (the parameters of its forward that default to ``None`` and
    that ``example_inputs`` leave out traced as ``None``: :func:`_none_defaults`), or ``None`` for
    a model captured per input signature with
    torch.export (:mod:`fxremat.passes.capture`): one whose forward takes ``*args``, as the
    decorated forwards of Hugging Face models do, which torch.fx cannot make placeholders for, or,
    where ``can_capture`` (example inputs are captured at once, so a failure still raises at the
    call), one whose top-level forward torch.fx cannot trace
    (a loss module built in ``forward``, as DeBERTa-v2's; a check of the input's shape, as
    CrossViT's), which torch.export, running the code on tensors of known shapes, can. Either way
    the ``leaf_modules`` are kept whole in the capture too."""
    reason = varargs_reason(model)
    if reason is not None:  # (leaf_modules are kept whole in the capture too)
        log.info("fxremat: %s; capturing each input signature with torch.export", reason)
        return None
    with _stage("tracing", type(model).__name__), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            traced = trace(model, leaf_modules=leaf_modules)
            none = tuple(name for name in _none_defaults(model, example_inputs)
                         if any(n.op == "placeholder" and n.target == name and n.users for n in traced.graph.nodes))
            if none:  # the graph reads them: traced again with them None, as the calls give them
                traced = trace(model, leaf_modules=leaf_modules, concrete_args=dict.fromkeys(none))
                traced.meta[_NONE_ARGS] = none
        except TraceError as exc:
            # torch.export fails on a backward inside the forward too, less clearly
            if exc.qualified_name or not can_capture or isinstance(exc.__cause__, DifferentiatesInForward):
                _warn_again(said)
                raise
            # what the failed trace said (submodules made leaves) is not true of the capture: logged only
            log.info("fxremat: torch.fx could not trace the top-level forward of %s (%s; it said: %s); capturing "
                     "each input signature with torch.export", type(model).__name__, exc,
                     "; ".join(str(w.message) for w in said) or "nothing else")
            return None
    kept = _transformers_kept_whole(model, traced, leaf_modules)
    hooked = kept is not None and any(p == kept or p.startswith(kept + ".") for p in hooked_modules(model))
    if kept is not None and not hooked:  # (a capture would run hooks inside it once)
        # torch.fx made a leaf of most of the model: nothing inside it could be recomputed (a user's
        # wrapper of a Qwen2 causal LM saved 14% at "min"); the capture records its ATen ops. Without
        # example inputs, as the transformers model alone: captured at the first training call
        log.info("fxremat: torch.fx kept %r of %s whole (%s); capturing each input signature with torch.export, "
                 "which sees inside it", kept, type(model).__name__, "; ".join(str(w.message) for w in said))
        return None
    _warn_again(said)
    return traced


def _transformers_kept_whole(model: torch.nn.Module, traced: fx.GraphModule, leaf_modules) -> str | None:
    """The qualified name of a Hugging Face transformers module that the trace of ``model`` kept
    whole by itself (not named by ``leaf_modules``) and that holds half of the model's parameters
    or more (its mask code branches on values, which torch.fx cannot trace), else ``None``."""
    total = sum(p.numel() for p in model.parameters())
    classes = tuple(leaf for leaf in leaf_modules if isinstance(leaf, type))
    for node in traced.graph.nodes:
        if node.op != "call_module" or node.target in leaf_modules:
            continue
        module = traced.get_submodule(node.target)
        if (type(module).__module__.startswith("transformers.") and not isinstance(module, classes) and total
                and 2 * sum(p.numel() for p in module.parameters()) >= total):
            return node.target
    return None


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_NONE_ARGS = "fxremat_none_args"  # a traced GraphModule's: the forward's parameters traced as None


def _none_defaults(model: torch.nn.Module, example_inputs) -> tuple[str, ...]:
    """The parameters of ``model.forward`` that default to ``None`` and that ``example_inputs``
    leave out (none without example inputs). Where the traced graph reads one, it is traced again
    as ``None``, so that ``if mask is not None:`` takes the branch the calls take (traced as an
    input, it took the other one, and the first call ran ``mask.view(...)`` on ``None``: timm's
    Hiera); only then: traced as ``None`` everywhere, Hugging Face forwards got further in torch.fx
    and made graphs that ran wrong (UperNet handed its decode head ``None``) instead of failing
    and being captured. A call that passes one is refused by :meth:`RematModule._bind`."""
    if example_inputs is None:
        return ()
    args, kwargs = _example_call(example_inputs)
    signature = inspect.signature(model.forward)
    try:
        given = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:  # the call itself is wrong: the trace or the first call says so
        return ()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(name for name, p in signature.parameters.items()
                 if p.kind in kinds and p.default is None and name not in given)


def _warn_again(said) -> None:
    """Issue the recorded warnings again under the caller's filters: fxremat's own at the user's
    line that called into fxremat (issued with a fixed ``stacklevel``, they named a line of
    ``fxremat/api.py``), the others where they were first issued."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame = frame.f_back
    for w in said:
        if frame is not None and os.path.abspath(w.filename).startswith(_PACKAGE_DIR + os.sep):
            warnings.warn_explicit(w.message, w.category, frame.f_code.co_filename, frame.f_lineno,
                                   module=frame.f_globals.get("__name__"),
                                   registry=frame.f_globals.setdefault("__warningregistry__", {}))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def _example_call(example_inputs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``example_inputs``: a dict holds keyword inputs, anything else the
    positional ones."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    return _as_tuple(example_inputs), {}


BACKENDS_HINT = "'eager' (the default), 'inductor', or another torch.compile backend name"


def compile(model: torch.nn.Module, budget, *, example_inputs=None, strategy: str = "auto",
            cost_model: str | None = None, leaf_modules=(), backend="eager", **options) -> "RematModule":
    """Return a :class:`RematModule` that trains ``model`` with its activation peak within ``budget``.

    ``budget``: int bytes, a string with a unit (``"800MiB"``), a fraction in (0, 1] of the
    peak without recomputation, or ``"min"``. ``example_inputs``: the positional inputs to plan
    for now; with ``None`` planning happens on the first training-mode forward. ``strategy``:
    ``"auto"`` (exact DP while the lower sets are at most ``exact_cap``, else approximate),
    ``"exact"``, ``"approx"``, ``"rotor"``, ``"chen"``, ``"hong"``, ``"sequential"`` or
    ``"none"``. ``cost_model``: ``"measured"`` (the default in eager), ``"flops"``,
    ``"compiled"`` (the default with a compiler backend) or ``"uniform"``.
    ``leaf_modules``: classes or qualified names of submodules to keep as single nodes.
    ``backend``: ``"eager"`` runs the emitted code as it is; ``"inductor"`` (or any
    ``torch.compile`` backend name or function) compiles the returned module in place
    (``nn.Module.compile``: same object, same ``state_dict`` keys), so AOTAutograd recomputes each
    planned segment in the compiled backward (keeping the segments' outputs as the plan does:
    :mod:`fxremat.passes.partition`), and plans with ``cost_model="compiled"`` unless
    another is given, and ``strategy="auto"`` leaves out rotor's nested checkpoints (measured
    under Inductor, a plan with them was not kept: 10.4 MiB against a 3.9 MiB plan on a
    transformer stack). Numerics are then Inductor's (fused kernels round differently from eager).
    Options: ``exact_cap`` (default 20,000 lower sets with the compiled kernels, 2,000 with the
    pure-Python reference), ``max_plans`` (input signatures cached, default 8),
    ``profile_repeats`` (default 3), ``rotor_slots`` (rotor's memory discretisation, default 500
    slots up to the no-recomputation peak; more is finer and slower), ``plan`` (a :class:`Plan` from :func:`fxremat.load_plan`:
    used as is, without profiling or solving, after checking it was made for this graph and
    input signature), ``autotune`` (off by default; ``True`` or a count: time that many of the
    best candidate plans — each strategy's fastest predicted within the budget — for a few real
    steps on the example inputs and keep the fastest measured; ``plan.autotune`` lists them; with a
    compiler ``backend`` each candidate is compiled by it and timed compiled),
    ``fit_compiled_peak`` (on by default with a compiler ``backend`` and ``example_inputs``:
    measure one compiled step on the example inputs and, where the compiler's own buffers take it
    over the budget, plan again under a budget lowered by the excess; ``plan.notes`` says what was
    measured; see :func:`_fit_compiled_peak`),
    ``dp_early_stop`` (also solve the DP with a recomputed segment charged only up to its last
    node whose saved tensors the backward reads, which finds plans that end segments in
    convolutions and matrix products; ``None``, the default with a compiler backend, whose
    AOTAutograd backward recomputes no more than it reads, turns it on for steps on the CPU
    (under Inductor at 0.5: the ResNet chain 1.12x -> 1.04x plain Inductor, the U-Net 1.20x ->
    1.15x, ``benchmarks/results/compile_inductor_*.md``) and off on CUDA, where such plans ran
    slower (``benchmarks/results/cuda/``); off in eager, where they ran slower through torch's
    checkpoint, see ``benchmarks/results/early_stop.md``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fxremat.compile: model must be a torch.nn.Module, got {type(model).__name__}")
    _check_unwrapped(model, "compile")
    if not callable(backend) and (not isinstance(backend, str) or not backend):
        raise TypeError(f"fxremat.compile: backend takes a name, {BACKENDS_HINT}, or a torch.compile backend "
                        f"function; got {backend!r}")
    if isinstance(backend, str) and backend != "eager" and backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"fxremat.compile: backend {backend!r} is not a torch.compile backend; use {BACKENDS_HINT} "
                         f"(torch._dynamo.list_backends() lists them)")
    if options.get("plan") is not None and (strategy != "auto" or cost_model is not None):
        given = ", ".join(f"{k}={v!r}" for k, v in (("strategy", strategy), ("cost_model", cost_model))
                          if v not in ("auto", None))
        raise TypeError(f"fxremat.compile: {given} has no effect with plan= (the plan fixes the segments and "
                        f"nothing is planned again); leave it out, or plan with it instead of passing plan=")
    if cost_model is None:
        cost_model = "measured" if backend == "eager" else "compiled"
    options.setdefault("dp_early_stop", None if backend != "eager" else False)
    if options.get("fit_compiled_peak") and backend == "eager":
        raise ValueError("fxremat.compile: fit_compiled_peak=True measures the compiled step, and backend is 'eager'; "
                         "pass backend='inductor' (or another torch.compile backend), or leave fit_compiled_peak out")
    if options.get("fit_compiled_peak") and example_inputs is None:
        raise ValueError("fxremat.compile: fit_compiled_peak=True measures a compiled step on the example inputs; "
                         "pass example_inputs=(x,) too")
    unsaid = "fit_compiled_peak" not in options
    options.setdefault("fit_compiled_peak", backend != "eager")
    leaf_modules = _check_leaf_modules(model, leaf_modules, "compile")
    config = replace(_config(budget, strategy, cost_model, options, leaf_modules=leaf_modules),
                     nested=backend == "eager", one_backward=backend != "eager", backend=backend)
    if backend != "eager" and example_inputs is None and unsaid and _fits(config):
        warnings.warn(f"fxremat.compile: with backend {_backend_name(backend)} and no example_inputs, the compiled "
                      "step's peak is not measured, and a compiler keeps memory the plan does not see (Inductor on "
                      "the CPU: PSPNet 1.10-1.17x its budget). Pass example_inputs=(x,) to fit the plan to the "
                      "measured peak, or fit_compiled_peak=False to plan without it.", stacklevel=2)
    _warn_trainer_checkpoints(model)
    with _planning_modes():
        with _training_mode(model):
            traced = _traced(model, leaf_modules, "compile", can_capture=example_inputs is not None,
                             example_inputs=example_inputs)
        remat = _remat_class(type(model))(model, traced, config, leaf_modules=leaf_modules)
        if example_inputs is not None:
            args, kwargs = _example_call(example_inputs)
            if traced is None:
                remat._prepare_call(args, kwargs)
            else:
                remat._prepare(remat._bind(args, kwargs))
        if backend != "eager":
            remat.compile(backend=backend)
            if example_inputs is not None and config.fit_compiled_peak:
                _fit_compiled_peak(remat, args, kwargs, switch_layout=True)
                remat._remat.fit_signatures = _fits(config)
    return remat


def _warn_trainer_checkpoints(model: torch.nn.Module) -> None:
    """Warn at compile when Hugging Face's Trainer is loaded and ``model``, a ``PreTrainedModel`` or
    ``PeftModel`` with tied parameters, would stop it at its first checkpoint: Trainer calls
    ``save_pretrained`` only on a model that is an instance of those classes (a RematModule is
    not), and otherwise writes the bare ``state_dict`` with safetensors, which refuses tensors
    that share memory. (No library route exists: accelerate unwraps only its own wrappers and
    torch.compile's ``OptimizedModule``; see README, "Libraries that inspect the model".)"""
    if "transformers.trainer" not in sys.modules:
        return
    saved_by_library = tuple(getattr(sys.modules[name], cls) for name, cls in
                             (("transformers", "PreTrainedModel"), ("peft", "PeftModel")) if name in sys.modules)
    if not isinstance(model, saved_by_library):
        return
    names = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    tied = next((found for found in names.values() if len(found) > 1), None)
    if tied is None:
        return
    warnings.warn(
        f"fxremat.compile: {type(model).__name__} ties {' and '.join(tied)}, and Hugging Face's Trainer is "
        f"loaded: Trainer saves a RematModule (not a PreTrainedModel) as its bare state_dict, which safetensors "
        f"refuses for tied tensors, so training would stop at the first checkpoint. Have Trainer save the model "
        f"you compiled: class RematTrainer(Trainer): def save_model(self, output_dir=None, _internal_call=False): "
        f"remat, self.model = self.model, model; then super().save_model(output_dir, _internal_call) and "
        f"self.model = remat in a finally (README, \"Libraries that inspect the model\"); "
        f"train(resume_from_checkpoint=...) then loads into the compiled module.", stacklevel=3)


def _compiled_step_peak(remat: "RematModule", args: tuple, kwargs: dict) -> int:
    """The allocated peak (:func:`fxremat.measure.allocated_peak`) of one training step of the
    compiled ``remat`` on these inputs (in training mode whatever its mode), after an untimed one
    that compiles it, the output held to its end as the prediction assumes: every parameter has
    a ``.grad`` (zeros), accumulated in place as in training, so gradients count as in the plan;
    the model's buffers, RNG states and ``.grad`` are put back."""
    params = [p for p in remat.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)] + params
    device = next((t.device for t in tensors if t.device.type == "cuda"), None)

    def step():  # written as the plan assumes: the output held until the step ends
        out = remat(*args, **kwargs)
        default_loss(out).backward()
        return out

    was_training = remat.training
    try:  # a training step, also for a model compiled in eval(): what the plan is for
        with preserved_state(remat._remat.model), _training_mode(remat._remat.model), torch.enable_grad():
            remat.training = True
            for p in params:
                p.grad = torch.zeros_like(p)
            step()  # compiles
            return allocated_peak(step, device=device)
    finally:
        remat.training = was_training
        for p, g in zip(params, grads):
            p.grad = g


def _fits(config: _Config) -> bool:
    """Whether :func:`_fit_compiled_peak` measures a plan under ``config``: not a saved plan, nor a
    budget where nothing is recomputed (the least peak is measured, not moved)."""
    return config.plan is None and _may_recompute(config)


def _fit_compiled_peak(remat: "RematModule", args: tuple, kwargs: dict, switch_layout: bool = False) -> None:
    """Make the example inputs' plan honour the budget as the compiled step measures it.

    A compiler keeps buffers of its own that the plan's simulator does not see (Inductor's layout
    copies on the CPU, its kernels' temporaries), and may free some the simulator keeps (AOTAutograd
    recomputes a region's output for its later readers rather than save it, unless fxremat's pass
    keeps them, as it does for a RematModule: :mod:`fxremat.passes.partition`): one compiled step on
    the example inputs is measured (:func:`_compiled_step_peak`) and, where it exceeds the budget,
    the plan is made again for a budget lowered by the excess (the least feasible one where that
    is below it), where it stays more than :data:`FIT_SLACK` under it (and the plan was not
    autotuned), for a budget raised by the slack (a plan that recomputes less); the graph's
    profile is reused, without autotune, up to :data:`FIT_REPLANS` times (at ``budget="min"`` it is
    only measured), and a new plan is only compiled and measured where it is predicted
    :data:`FIT_GAIN` of a step faster than every one measured within the budget. Kept: the fastest
    predicted plan that measured within the budget, else the one that measured least (a warning
    past 1.05x the budget). With ``switch_layout`` (the first fit, in :func:`compile`: the choice
    holds for the whole module) and Inductor's layout optimization on, where even the plan kept
    measured over the budget, the first plan is also measured with the optimization off and kept
    so where that measures less (:func:`_kept_layout`). ``plan.notes`` says what was measured."""
    state = remat._remat
    config = state.config
    if not _fits(config):
        return
    if state.traced is None:  # captured per call (torch.export): the entry holds the capture
        key = _call_key(state.model, args, kwargs)
        captured = state.cache[key][3]
        gm, inputs = captured.graph_module, captured.inputs(args, kwargs)
        made = {_segmentation(state.cache[key][0].segments): state.cache[key][1:3]}

        def install(the_plan):
            seg = _segmentation(the_plan.segments)
            if seg not in made:
                emitted = _emit(gm, the_plan)
                made[seg] = (emitted, attribute_bindings(emitted, state.model))
            state.cache[key] = state.last = (the_plan, *made[seg], captured)

        def lowered():  # its profile was not kept: profiled again, once, where a plan is made again
            rebind(attribute_bindings(gm, state.model))
            with _training_mode(state.model):
                return _lowered(gm, inputs, config)
    else:
        inputs = remat._bind(args, kwargs)
        key, gm = _signature(inputs), state.traced

        def install(the_plan):
            state.install(key, the_plan)

        def lowered():
            costs = state.timed[_layout(key)]
            return replace(build_graph(gm, costs), param_grads_held=config.one_backward), costs
    plan = state.cache[key][0]
    target, baseline = plan.budget_bytes, plan.baseline_peak_bytes
    graph_costs = None
    tried = []  # (plan, measured peak, Inductor's layout optimization on)
    with _stage("fitting", f"the compiled step's peak to the budget ({_backend_name(config.backend)})"):
        while True:
            peak = _compiled_step_peak(remat, args, kwargs)
            tried.append((plan, peak, True))
            # within the budget: done, unless well under it (not with autotune, which chose by the clock)
            if peak <= target and (config.autotune or peak >= (1 - FIT_SLACK) * target) or len(tried) > FIT_REPLANS:
                break
            if config.budget.minimum:  # no plan reaches less
                break
            moved = plan.predicted_peak_bytes + (target - peak)  # lowered by the excess, raised by the slack
            graph_costs = graph_costs or lowered()
            try:
                new = _chosen(gm, inputs, *graph_costs, replace(config, budget=parse_budget(max(2, moved)),
                                                                autotune=0), baseline)
            except InfeasibleBudgetError:  # below the least feasible peak: the least, once
                new = _chosen(gm, inputs, *graph_costs, replace(config, budget=parse_budget("min"), autotune=0),
                              baseline)
            if any(_segmentation(new.segments) == _segmentation(t[0].segments) for t in tried):
                break
            fitting = [t[0].predicted_overhead for t in tried if t[1] <= target]
            if fitting and new.predicted_overhead > min(fitting) - FIT_GAIN:
                break  # not enough faster than a plan that fits: not worth a compile
            plan = replace(new, budget_bytes=target)
            install(plan)
        fitting = [t for t in tried if t[1] <= target]
        kept = min(fitting, key=lambda t: t[0].predicted_overhead) if fitting else min(tried, key=lambda t: t[1])
        if switch_layout and kept[1] > target and _layout_optimized(config):
            kept = _kept_layout(remat, args, kwargs, install, tried, kept)
    plan, peak = kept[0], kept[1]
    measured = ", ".join(f"{format_bytes(m)} (predicted {format_bytes(p.predicted_peak_bytes)}"
                         f"{'' if on else ', layout optimization off'})" for p, m, on in tried)
    kept_note = f"; kept the plan that measured {format_bytes(peak)}" if len(tried) > 1 else ""
    if not kept[2]:
        kept_note += ", with Inductor's layout optimization off"
    note = (f"compiled step ({_backend_name(config.backend)}) measured {measured} for a budget of "
            f"{format_bytes(target)}{kept_note}")
    install(replace(plan, notes=plan.notes + (note,)))
    if peak > 1.05 * target:
        advice = ("budget='min' is the least peak fxremat's plans reach, and this compiler needs more on top of it"
                  if config.budget.minimum else "Lower the budget, or use budget='min'")
        warnings.warn(f"fxremat.compile: under backend {_backend_name(config.backend)} the compiled step's peak "
                      f"is {format_bytes(peak)}, {peak / target:.2f}x the budget {format_bytes(target)} (plans "
                      f"tried: {measured}); the compiler keeps buffers the plan cannot lower. {advice}.",
                      stacklevel=3)


def _layout_optimized(config: _Config) -> bool:
    """Whether the compiled step runs Inductor with its layout optimization on (its default; not
    where the user switched it off): convolutions in channels-last, with channels-last copies of
    their weights kept from the forward to the backward (PSPNet on the CPU: 2.2 MiB beyond the
    plan's 13.1 at ``"min"``)."""
    import torch._inductor.config as inductor_config

    return config.backend == "inductor" and inductor_config.layout_optimization


def _kept_layout(remat: "RematModule", args: tuple, kwargs: dict, install, tried: list, kept: tuple) -> tuple:
    """Where the plan the fit kept (``kept``, a row of ``tried``) still measured over the budget
    under Inductor's layout optimization, the first plan tried compiled and measured again with it
    off (``tried`` gets the row), and kept so where it measured less; otherwise the module is
    compiled back with it on. Returns the row kept."""
    first = tried[0][0]
    install(first)
    remat.compile(backend="inductor", options={"layout_optimization": False})
    row = (first, _compiled_step_peak(remat, args, kwargs), False)
    tried.append(row)
    if row[1] < kept[1]:
        return row
    install(kept[0])
    remat.compile(backend="inductor")
    return kept


def _call_key(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The plan-cache key of a call of a model captured per call: the call's signature, then the
    values its capture depends on besides shapes (:func:`~fxremat.passes.capture.value_facts`)."""
    return ("call",) + _signature((tuple(args), dict(kwargs))) + value_facts(model, args, kwargs)


def _signature(inputs: tuple) -> tuple:
    """The plan-cache key: input structure, the autocast state of the inputs' device types, then
    per leaf shape/dtype/device/requires_grad for tensors and the value for other leaves (its
    identity where it is unhashable)."""
    if all(isinstance(x, torch.Tensor) for x in inputs):  # the usual call: no structure to flatten
        leaves, key = inputs, [len(inputs)]  # (str(spec) costs ~60 µs a step, cold)
    else:
        leaves, spec = tree_flatten(inputs)
        key = [str(spec)]
    for device_type in sorted({x.device.type for x in leaves if isinstance(x, torch.Tensor)}):
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            key.append(("autocast", device_type, torch.get_autocast_dtype(device_type)))
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
            continue
        try:
            hash(x)
            key.append((type(x), x))
        except TypeError:
            key.append((type(x), id(x)))
    return tuple(key)


# --------------------------------------------------------------------------------------------
# Modes and hooks: plan what is trained, call hooks as eager PyTorch does
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _planning_modes():
    """Inference mode off while compiling or planning: the graph traced and profiled is the one
    that trains, also when the call sits in an eval script's ``torch.inference_mode()`` (the trace
    marked every node ``inference_mode`` and profiling crashed on the missing ``grad_fn``). Grad
    mode is set where each stage needs it (``torch.enable_grad()`` does not leave inference mode).
    Saved-tensor hooks on (:func:`_saved_tensor_hooks_on`)."""
    with torch.inference_mode(False), _saved_tensor_hooks_on():
        yield


@contextlib.contextmanager
def _saved_tensor_hooks_on():
    """Saved-tensor hooks enabled for the block, inside a caller's
    ``torch.autograd.graph.disable_saved_tensors_hooks(msg)``: profiling notes what each node
    saves through them (compiling there raised the caller's ``msg``); disabled again after."""
    disabled = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    if disabled is None:
        yield
        return
    torch._C._autograd._saved_tensors_hooks_enable()
    try:
        yield
    finally:
        torch._C._autograd._saved_tensors_hooks_disable(disabled)


@contextlib.contextmanager
def _training_mode(model: torch.nn.Module):
    """Put ``model`` in training mode for the block when it is in eval mode (what is traced and
    profiled is the graph that trains: dropout on, BatchNorm on batch statistics, ``if
    self.training:`` branches); every module's own flag comes back after it. A model already in
    training mode is left as it is (a submodule the user froze with ``.eval()`` stays so)."""
    if model.training:
        yield
        return
    flags = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _call_with_hooks(model: torch.nn.Module, run, args, kwargs):
    """``model(*args, **kwargs)`` with ``run`` in place of ``model.forward``: the hooks registered on
    the model itself run around fxremat's emitted forward, as they do around the plain one."""
    own = model.__dict__.get("forward")
    model.forward = run
    try:
        return model(*args, **kwargs)
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


@_left_to_python
def _root_has_hooks(model: torch.nn.Module) -> bool:
    return bool(model._forward_hooks or model._forward_pre_hooks or model._backward_hooks
                or model._backward_pre_hooks)


# --------------------------------------------------------------------------------------------
# Other sizes of a planned graph: reuse its segmentation, re-check the peak by simulation
# --------------------------------------------------------------------------------------------

# Input signatures remembered per kept plan (emitted module): a signature costs a Plan (no tensors).
_SIGNATURES_PER_PLAN = 8


def _layout(signature: tuple) -> tuple:
    """``signature`` (:func:`_signature`) with every tensor's shape replaced by its number of
    dimensions: inputs of one layout run one traced graph whatever their sizes, so one
    segmentation serves them all."""
    return tuple((len(e[0]),) + e[1:] if isinstance(e, tuple) and len(e) == 4 and isinstance(e[0], tuple)
                 and isinstance(e[1], torch.dtype) else e for e in signature)


def _segmentation(segments) -> tuple:
    """What identifies an emitted module: the nodes of each segment, whether it is recomputed, and
    its nested segments (not the bytes, which depend on the input sizes)."""
    return tuple((s.nodes, s.recomputed, _segmentation(s.inner)) for s in segments)


def _schedule_of(graph: CostGraph, segments) -> Schedule:
    """The :class:`~fxremat.simulate.Schedule` of plan segments over ``graph``'s node indices."""
    index = {name: v for v, name in enumerate(graph.names)}
    inner = tuple(_schedule_of(graph, s.inner) if s.inner else None for s in segments)
    return Schedule(tuple(tuple(index[n] for n in s.nodes) for s in segments),
                    tuple(s.recomputed for s in segments), inner if any(x is not None for x in inner) else ())


def _sized_costs(timed: GraphCosts, sized: GraphCosts) -> GraphCosts:
    """Bytes of ``sized`` (profiled at the new sizes without timing) with the time costs of
    ``timed`` (the profile of the first sizes planned for this layout)."""
    by_name = {c.name: c for c in timed.nodes}
    nodes = tuple(replace(c, fwd_cost=by_name[c.name].fwd_cost, bwd_cost=by_name[c.name].bwd_cost,
                          flops=by_name[c.name].flops) for c in sized.nodes)
    return replace(timed, nodes=nodes)


_REUSED = ("segmentation reused from a plan of this graph for other input sizes; its peak was "
           "checked by simulation on bytes profiled for these sizes (time costs from the first sizes)")


def _plan_resized(gm: fx.GraphModule, inputs: tuple, config: _Config, timed: GraphCosts, kept,
                  plain: PlainForward, *, later: _Later | None = None) -> Plan:
    """The plan for new sizes of a planned layout: the fastest of the ``kept`` segmentations
    (plan segments) whose simulated peak fits the budget at these sizes; if none fits, or for
    ``budget="min"``, the solvers run again on these bytes (no timing, no measured profiling;
    ``later``: see :func:`_choose`)."""
    costs = _sized_costs(timed, profile(gm, inputs, cost_model="uniform", repeats=1))
    graph = build_graph(gm, costs)
    baseline = _plain_peak(graph, plain)
    target = config.budget.resolve(baseline)
    best = None
    for plan_ in kept if target is not None else ():
        schedule = _schedule_of(graph, plan_.segments)
        peak = simulate(graph, schedule)
        if peak <= target:
            cand = (recompute_time(graph, schedule), peak, schedule, plan_)
            best = cand if best is None or cand[:2] < best[:2] else best
    if best is None:
        choice = _choose(graph, config, gm, inputs, baseline, later)
    else:
        rtime, peak, schedule, plan_ = best
        choice = Choice(schedule=schedule, strategy=plan_.strategy, objective=plan_.objective, budget_bytes=target,
                        baseline_peak_bytes=baseline, peak_bytes=peak, recompute_time=rtime, solve_seconds=0.0,
                        num_lower_sets=plan_.num_lower_sets,
                        notes=tuple(n for n in plan_.notes if n != _REUSED) + (_REUSED,))
    return _plan_from(graph, choice, costs.cost_model, nodes=node_infos(gm, costs), key=graph_key(gm, inputs))


def _describe_inputs(signature: tuple) -> str:
    """The shapes of a signature's tensors, and the values of its Python numbers."""
    shapes = ["x".join(map(str, e[0])) or "scalar" if len(e) == 4 else f"{e[0].__name__} {e[1]!r}"
              for e in signature if isinstance(e, tuple) and (
                  (len(e) == 4 and isinstance(e[0], tuple)) or (len(e) == 2 and e[0] in (int, float)))]
    return "[" + ", ".join(shapes) + "]"


def _number_arguments_hint(signature: tuple) -> str:
    """Where the signature holds Python numbers (a diffusion timestep passed as ``int``): each value
    is a signature of its own, planned anew (a step with a new ``t`` planned again, 6x slower
    steps on a toy), so say how to plan once."""
    if not any(isinstance(e, tuple) and len(e) == 2 and e[0] in (int, float) for e in signature):
        return ""
    return (" Each value of a Python number argument (int, float) is a signature of its own (it may set a "
            "shape): pass one that changes at every step (a timestep, a scale) as a tensor, torch.tensor(t), "
            "to plan once.")


def _describe_signature(signature: tuple) -> str:
    """The input shapes, the autocast state and the input values' facts of a plan-cache key."""
    amp = [f"autocast {e[1]} {str(e[2]).removeprefix('torch.')}" for e in signature
           if isinstance(e, tuple) and len(e) == 3 and e[0] == "autocast"]
    facts = dict(e for e in signature if isinstance(e, tuple) and len(e) == 2 and e[0] in _FACT_NAMES)
    said = []
    if "masks all ones" in facts:
        ones = facts["masks all ones"]
        said.append("no attention mask" if not ones else "attention masks all ones" if all(ones) else
                    "padded attention masks" if not any(ones) else "attention masks " + "/".join(
                        "of ones" if one else "padded" for one in ones))
    if "positions step by one" in facts:
        said.append("one sequence a row" if facts["positions step by one"] else "packed sequences")
    return (_describe_inputs(signature) + (f" under {', '.join(amp)}" if amp else "")
            + (f" ({', '.join(said)})" if said else ""))


_FACT_NAMES = ("masks all ones", "positions step by one")  # :func:`~fxremat.passes.capture.value_facts`'s


class _State:
    """RematModule's own state, kept out of nn.Module registration (so out of state_dict).

    ``cache``: input signature -> (plan, emitted module, attribute bindings), least recently used
    first out beyond ``_SIGNATURES_PER_PLAN * max_plans``; ``emitted``: (layout, segmentation) ->
    (emitted module, bindings), at most ``max_plans``, shared by the signatures of one layout
    whose sizes the segmentation fits; ``timed``: layout -> the measured profile of its first
    sizes (time costs for other sizes); ``hooks``: the submodules with hooks when traced, watched
    (:class:`~fxremat.passes.trace.HookWatch`).
    """

    # Defaults of what later versions added, so that a RematModule pickled before them loads.
    warned_eval = False  # a backward ran through a call in eval mode (:func:`_warn_eval_backward`)

    def __init__(self, model, traced, config, leaf_modules=()):
        self.model = model
        self.traced = traced
        self.config = config
        self.leaf_modules = tuple(leaf_modules)
        self.hooks = HookWatch(model)
        self.settings = SettingsWatch(model, traced)
        self.deleted: str | None = None  # an attribute deleted since the last training step
        self.params = parameter_slots(model)
        self.trained: dict = {}  # cache key -> which parameters required gradients when it was planned
        self.signature = inspect.signature(model.forward)
        # forward's parameters when all are positional without defaults: a call with that many
        # arguments and no keywords binds as it is (Signature.bind costs ~45 µs a step, cold)
        plain = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
                    for p in self.signature.parameters.values())
        self.positional = len(self.signature.parameters) if plain else None
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.emitted: collections.OrderedDict = collections.OrderedDict()
        self.timed: collections.OrderedDict = collections.OrderedDict()
        self.planned: set = set()  # hashes of every signature planned, to see planning repeat
        self.warned = False
        self.planned_once = False  # a signature was planned (the budget checked): later ones are "later"
        self.warned_fraction = False  # a later signature could not reach a fraction budget (_choose)
        self.fit_signatures = False  # the example inputs' plan was fitted: so should later signatures' be
        self.fitting = False  # inside RematModule.fit_compiled_peak
        self.warned_unfitted = False
        self.warned_hooks = False
        self.warned_saved_hooks = False  # user saved-tensor hooks around a step that recomputes
        self.warned_eval = False
        self.compiled_checked: set = set()  # ids of plans checked for a torch.compile by hand
        self.last = None
        self.traced_bindings = attribute_bindings(traced, model) if traced is not None else ()
        self._rebuilding(traced)

    def _rebuilding(self, traced: fx.GraphModule | None) -> None:
        """``rebuild``: ``None``, or what makes a traced graph's plain dict output the forward's own
        type again (a ``ModelOutput``: :func:`~fxremat.passes.trace.output_rebuilder`); ``finish``:
        the same, run without Dynamo (a training call under torch.compile)."""
        self.rebuild = output_rebuilder(traced) if traced is not None else None
        # forward's parameters that default to None, traced as inputs and read by the graph's own
        # code (a leaf module given one runs as written, None included)
        none = traced.meta.get(_NONE_ARGS, ()) if traced is not None else ()
        self.read_optional = tuple(
            n.target for n in (traced.graph.nodes if traced is not None else ()) if n.op == "placeholder"
            and any(u.op != "call_module" for u in n.users) and n.target not in none
            and n.target in self.signature.parameters and self.signature.parameters[n.target].default is None)
        self.finish = _same if self.rebuild is None else _without_dynamo(self.rebuild)

    def entry(self, key: tuple):
        """The cache entry of ``key``, unless it no longer fits what trains: a parameter's dtype
        changed since it was planned (``model.double()``, ``.half()``, ``.to(torch.bfloat16)``
        after compiling a model of token ids, whose input signature stays the same: the float32
        plan trained at 1.84x the budget in float64, 0.54x in bfloat16), then every plan and
        profile is dropped, each measured in the old dtypes; or a parameter that was frozen when
        it was planned requires gradients now (unfreezing a backbone after a plan made with it
        frozen trained at 1.8x the budget: its gradients were not in the plan), then this one is
        dropped. Either way it is planned again, which is not an eviction (no warning). Freezing
        more keeps the plan: it holds fewer gradients than planned."""
        entry, then = self.cache.get(key), self.trained.get(key)
        if entry is None or then is None:
            return entry
        now = self._trains()
        if now == then:
            return entry
        changed = [(qualified, was[0], is_[0]) for (_, _, qualified), was, is_ in zip(self.params, then, now)
                   if was[0] != is_[0]]
        if changed:
            name, was, is_ = changed[0]
            log.info("fxremat: %d parameters of %s changed dtype since they were planned (%s: %s -> %s); profiling "
                     "and planning again", len(changed), type(self.model).__name__, name, was, is_)
            self.retrace(self.traced)  # the same graph; every plan and profile made in the old dtypes dropped
            return None
        if any(is_[1] and not was[1] for was, is_ in zip(then, now)):
            log.info("fxremat: parameters of %s that were frozen when it was planned train now; planning again",
                     type(self.model).__name__)
            del self.cache[key]
            self.planned.discard(hash(key))  # planned again for what trains now, not evicted
            return None
        return entry

    def _trains(self) -> list[tuple]:
        """``(dtype, requires_grad)`` of each parameter (one pass: it runs at every training step)."""
        return [(d[name].dtype, d[name].requires_grad) for d, name, _ in self.params]

    def put(self, key: tuple, entry) -> None:
        self.cache[key] = entry
        self.trained[key] = self._trains()

    def trace_again(self) -> fx.GraphModule:
        """The model traced as it was first (the parameters defaulting to ``None`` as ``None``)."""
        with _training_mode(self.model):
            none = self.traced.meta.get(_NONE_ARGS, ())
            traced = trace(self.model, leaf_modules=self.leaf_modules, concrete_args=dict.fromkeys(none) or None)
            traced.meta[_NONE_ARGS] = none
        return traced

    def retrace(self, traced: fx.GraphModule | None = None) -> None:
        """Trace again (or take ``traced``, a new trace) and forget every plan: the submodules with
        hooks or the traced code changed."""
        if traced is None and self.traced is not None:  # (a model captured per call has no trace)
            traced = self.trace_again()
        self.traced = traced
        self.hooks = HookWatch(self.model)
        self.settings = SettingsWatch(self.model, traced)
        self.params = parameter_slots(self.model)
        self.traced_bindings = attribute_bindings(self.traced, self.model) if self.traced is not None else ()
        self._rebuilding(self.traced)
        for store in (self.cache, self.emitted, self.timed, self.planned, self.trained):
            store.clear()
        self.last = None

    def plan_for(self, key: tuple, inputs: tuple):
        """Plan a new input signature: ``(plan, emitted module, bindings)``."""
        if hash(key) in self.planned and not self.warned:
            self.warned = True
            warnings.warn(
                f"fxremat.RematModule: planning again for inputs {_describe_inputs(key)} of "
                f"{type(self.model).__name__}, planned before and evicted: there are more distinct input "
                f"signatures than the cache keeps ({self.config.max_plans} plans, max_plans="
                f"{self.config.max_plans}, each for up to {_SIGNATURES_PER_PLAN} input shapes), so steps "
                "keep planning. Raise max_plans= in fxremat.compile, or pad or bucket the inputs to fewer "
                f"shapes.{_number_arguments_hint(key)} (Shown once.)", stacklevel=4)
        self.planned.add(hash(key))
        layout = _layout(key)
        _check_inputs(self.traced, inputs)
        plain = _plain_forward(self.model, *self.call_of(inputs))
        later = _Later(_describe_signature(key), self) if self.planned_once else None
        if self.config.plan is None and layout in self.timed:
            kept = [entry[0] for (lay, _), entry in self.emitted.items() if lay == layout]
            the_plan = _plan_resized(self.traced, inputs, self.config, self.timed[layout], kept, plain, later=later)
            self.timed.move_to_end(layout)
        else:
            the_plan, costs = _plan_graph(self.traced, inputs, self.config, "the plan passed to fxremat.compile",
                                          plain, later=later)
            if costs is not None:
                self.timed[layout] = costs
            while len(self.timed) > self.config.max_plans:
                self.timed.popitem(last=False)
        self.planned_once = True
        return (the_plan, *self._emitted(layout, the_plan))

    def call_of(self, inputs: tuple) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of the model's call whose traced graph's inputs are ``inputs``
        (what :meth:`RematModule._bind` made of the call; ``**kwargs`` were empty)."""
        params = [p for p in self.signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        spread = len(inputs) - len(params) + 1  # the values of a *args
        values, args, kwargs = iter(inputs), [], {}
        for p in params:
            if p.kind is inspect.Parameter.VAR_POSITIONAL:
                args.extend(next(values) for _ in range(spread))
            elif p.kind is inspect.Parameter.KEYWORD_ONLY:
                kwargs[p.name] = next(values)
            else:
                args.append(next(values))
        return tuple(args), kwargs

    def install(self, key: tuple, the_plan: Plan) -> None:
        """Make ``the_plan`` the plan of input signature ``key`` (emitted once per segmentation)."""
        self.cache[key] = (the_plan, *self._emitted(_layout(key), the_plan))
        self.last = self.cache[key]

    def _emitted(self, layout: tuple, the_plan: Plan):
        seg = (layout, _segmentation(the_plan.segments))
        entry = self.emitted.get(seg)
        if entry is None:
            gm = _emit(self.traced, the_plan)
            entry = self.emitted[seg] = (the_plan, gm, attribute_bindings(gm, self.model))
            while len(self.emitted) > self.config.max_plans:
                _, (_, old, _) = self.emitted.popitem(last=False)
                for k in [k for k, e in self.cache.items() if e[1] is old]:
                    del self.cache[k]
        self.emitted.move_to_end(seg)
        return entry[1:]

    def __deepcopy__(self, memo):
        # Everything, emitted modules included (what each segment restores is in their code);
        # pickling alone drops them (__getstate__).
        import copy

        new = object.__new__(_State)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __getstate__(self):
        # Pickling a GraphModule re-traces its code, which would inline torch.utils.checkpoint
        # and silently drop the recomputation: keep no emitted modules, re-plan after loading.
        # torch drops nn.Module.compile's wrapper when pickling, so the loaded module runs eagerly
        # and autotune times it so (a backend may be a function that does not pickle).
        return {**self.__dict__, "config": replace(self.config, backend="eager"), "cache": collections.OrderedDict(),
                "emitted": collections.OrderedDict(), "timed": collections.OrderedDict(), "planned": set(),
                "trained": {}, "last": None}

    def __setstate__(self, state):
        # What later versions added comes from the class's defaults; ``trained`` goes with the cache,
        # empty after loading (a pickle of an older version kept it, in another form).
        self.__dict__.update(state)
        self.trained = {}


def _traced_for_first_call(state: "_State", args: tuple, kwargs: dict) -> None:
    """A model compiled without example inputs was traced with every parameter of its forward as
    an input, those defaulting to ``None`` too (timm's ``VisionTransformer.forward(x,
    attn_mask=None, is_causal=False)`` took the ``if attn_mask is not None:`` branch), and its first
    training call, ``model(x)`` as the README's quickstart writes it, was refused ("traced with a
    value for attn_mask ... this call leaves it None"). Where that first call, before any plan,
    leaves one of them ``None``, the model is traced again as :func:`compile` traces it with that
    call as its example inputs: those parameters ``None``, or captured per call with torch.export
    where torch.fx then fails (the ViT: ``if attn_mask is not None or is_causal:``)."""
    if state.traced is None or state.planned_once or state.cache or _NONE_ARGS in state.traced.meta:
        return
    try:
        given = state.signature.bind(*args, **kwargs).arguments
    except TypeError:  # the call is wrong: RematModule._bind says so, naming the forward
        return
    every = dict(given)
    for name, p in state.signature.parameters.items():
        every.setdefault(name, p.default)
    if not any(every.get(name, 0) is None for name in state.read_optional):
        return
    if any(state.signature.parameters[name].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
           for name in given):
        return
    log.info("fxremat: the first call of %s leaves %s None: traced again as with it as example inputs",
             type(state.model).__name__, ", ".join(n for n in state.read_optional if every.get(n, 0) is None))
    with _planning_modes(), _training_mode(state.model):
        traced = _traced(state.model, state.leaf_modules, "compile", can_capture=True, example_inputs=dict(given))
    state.__init__(state.model, traced, state.config, leaf_modules=state.leaf_modules)


def _called_modules(gm: fx.GraphModule) -> dict:
    return {n.target: id(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"}


def _retrace_after_change(remat: "RematModule", what: str) -> None:
    """After an attribute of the model was set or deleted through ``remat``, or a setting the
    trace baked in changed (:class:`~fxremat.passes.trace.SettingsWatch`): trace the model
    again; when its graph or the modules it calls changed (torch.fx bakes Python values such as
    ``self.scale = 2.0`` into the graph), use the new graph and drop the plans, which are made
    again on the next training step."""
    state = remat._remat
    if state.traced is None:  # captured per call: capture again on the next training step
        state.retrace()
        return
    new = state.trace_again()
    if new.code == state.traced.code and _called_modules(new) == _called_modules(state.traced):
        # the same graph; the modules' dicts watched anew (a container's edit may have replaced them)
        state.settings = SettingsWatch(state.model, state.traced)
        return
    log.info("fxremat: %s on %s changed the traced graph; planning again on the next training step",
             what, type(state.model).__name__)
    state.retrace(new)


def _eager_between_graphs(fn):
    """``fn`` run eagerly under ``torch.compile`` (Dynamo does not trace into it: a graph break)
    and called as it is otherwise. ``torch.compiler.disable``'s own wrapper costs 60-80 µs a call
    right after a forward pass (measured on this machine's CPU, two calls a step: 2% of the 4-block
    transformer's forward), so it is entered only while Dynamo traces."""
    disabled = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def _check_compiled_by_hand(state: "_State", key: tuple, plan: Plan) -> None:
    """Warn, once per plan, where a RematModule made for eager steps (no ``backend=``) runs under
    ``torch.compile`` with a plan that will not hold there: one that nests checkpoints (AOTAutograd
    keeps none of the nesting: a transformer stack measured 10.4 MiB for a 3.9 MiB plan), or whose
    peak with every parameter gradient held to the end of the one compiled backward (what the
    plans for ``backend=`` count) is over 1.05x the budget."""
    if state.config.backend != "eager" or id(plan) in state.compiled_checked:
        return
    state.compiled_checked.add(id(plan))
    reasons = []
    if any(seg.inner for seg in plan.segments):
        reasons.append("it nests checkpoints, which AOTAutograd does not keep")
    costs = state.timed.get(_layout(key)) if state.traced is not None else None  # (none kept when captured)
    if not reasons and costs is not None:
        graph = build_graph(state.traced, costs)
        schedule = plan_schedule(plan, graph)
        held = plan.predicted_peak_bytes * simulate(replace(graph, param_grads_held=True), schedule) \
            / max(1, simulate(graph, schedule))
        if held > 1.05 * plan.budget_bytes:
            reasons.append(f"its one compiled backward holds every parameter gradient to its end: "
                           f"{format_bytes(int(held))} predicted, {held / plan.budget_bytes:.2f}x the budget")
    if reasons:
        warnings.warn(
            f"fxremat.RematModule: torch.compile runs the plan of {type(state.model).__name__} for inputs "
            f"{_describe_inputs(key[1:] if key and key[0] == 'call' else key)}, made for eager steps "
            f"(fxremat.compile without backend=), and under torch.compile {'; '.join(reasons)}. Compile with "
            "fxremat.compile(model, budget, backend='inductor', example_inputs=...) instead: it plans for the "
            "compiled step and measures its peak.", stacklevel=4)


@_left_to_python
def _same(value):
    return value


@_left_to_python
def _dynamo_runs() -> bool:
    """Whether Dynamo compiles the frames that this call's frame calls: torch.compile runs it and
    left its frame to Python (:data:`_left_to_python`)."""
    return torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False)


@_left_to_python
def _keeping(gm: fx.GraphModule, inputs):
    """``gm(*inputs)`` within :func:`fxremat.passes.partition.keeping_segment_outputs`, in a frame
    Dynamo leaves to Python: under torch.compile the emitted code is compiled as a frame of its own
    (by the backend the user chose) with the segment outputs the plan keeps kept."""
    with partition.keeping_segment_outputs():
        return gm(*inputs)


def _run_emitted(gm: fx.GraphModule, inputs):
    """``gm(*inputs)``; while Dynamo traces (the model has hooks of its own: fxremat's steps are
    traced), through :func:`_keeping` (a graph break), so that AOTAutograd keeps the segment
    outputs the plan keeps."""
    if torch.compiler.is_compiling():
        return _keeping(gm, inputs)
    return gm(*inputs)


# Modules whose saved-tensor hooks keep values exact around a recomputed segment: a checkpoint of
# the user's around the compiled module (checkpoints nest), fxremat's own.
_EXACT_SAVED_HOOKS = ("torch.utils.checkpoint.", "fxremat.")


def _check_saved_tensor_hooks(state: "_State", the_plan: Plan) -> None:
    """Before a training step: refuse one run under
    ``torch.autograd.graph.disable_saved_tensors_hooks(msg)`` where the plan recomputes (the
    checkpoint of a recomputed segment pushes saved-tensor hooks, and the step raised the user's own
    ``msg`` from inside torch.utils.checkpoint); warn once where saved-tensor hooks of the user's
    are active (``saved_tensors_hooks(pack, unpack)``, ``save_on_cpu``): what a recomputed segment
    saves goes through the checkpoint's hooks, not theirs, so a lossy hook (activations packed to
    bf16) is applied to fewer tensors than in eager and every gradient differs, and an offloading
    one leaves those tensors on the device (as with torch.utils.checkpoint). Two calls into
    autograd's state a step; the plan is looked at only where either is set. (Not under Dynamo,
    which traces this step where the model itself has hooks: it would break the graph here.)"""
    if torch.compiler.is_compiling():
        return
    disabled = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    top = None if disabled is not None or state.warned_saved_hooks else (
        torch._C._autograd._top_saved_tensors_default_hooks(False))
    if disabled is None and top is None:
        return
    if not any(s.recomputed for s in the_plan.segments):
        return  # nothing checkpointed: the step saves tensors as eager does
    name = type(state.model).__name__
    if disabled is not None:
        raise RuntimeError(
            f"fxremat.RematModule: {name} is called for a training step inside "
            f"torch.autograd.graph.disable_saved_tensors_hooks({disabled!r}), but its plan recomputes "
            f"{sum(s.recomputed for s in the_plan.segments)} segment(s), and recomputation "
            f"(torch.utils.checkpoint) works through saved-tensor hooks. Call the compiled module outside that "
            f"region, or, inside it, call the uncompiled model (eager, without recomputation), or compile with a "
            f"budget of 1.0 (nothing recomputed)")
    module = getattr(top[0], "__module__", None) or ""
    if f"{module}.".startswith(_EXACT_SAVED_HOOKS):
        return
    state.warned_saved_hooks = True
    warnings.warn(
        f"fxremat.RematModule: {name} is trained under saved-tensor hooks of your own "
        f"({getattr(top[0], '__name__', type(top[0]).__name__)} from torch.autograd.graph.saved_tensors_hooks or "
        f"save_on_cpu); the tensors its recomputed segments save for the backward go through the recomputation's "
        f"hooks, not yours (as with torch.utils.checkpoint): a hook that changes values (compressing activations "
        f"to bf16) makes the gradients differ from eager, one that moves them (offloading to the CPU) leaves "
        f"those on the device. Compile with a budget of 1.0 (nothing recomputed) to have every saved tensor "
        f"go through your hooks.", UserWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The ``stacklevel`` at which a warning its caller issues names the user's line: the first
    frame outside fxremat and torch (a step reaches fxremat through several frames of each)."""
    frame, level = sys._getframe(1).f_back, 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            (_PACKAGE_DIR + os.sep, _TORCH_DIR + os.sep)):
        frame, level = frame.f_back, level + 1
    return level


def _warn_hooks_recomputed(state: "_State", the_plan: Plan) -> None:
    """Warn once when a submodule with forward (pre-)hooks of the user's is in a recomputed
    segment: its hooks fire again in the backward, and what they keep alive or make (a feature
    list for an auxiliary loss, a rescaled input) is not in the plan, which is profiled without
    them (1.14-1.29x the budget measured)."""
    if state.warned_hooks or not the_plan.recomputed_nodes:
        return
    recomputed = set(the_plan.recomputed_nodes)
    modules = {info.module.split(" (")[0] for info in the_plan.nodes if info.name in recomputed}
    hooked = []
    for name in sorted(state.hooks.names & modules):
        module = state.model.get_submodule(name)
        if any(not is_library_hook(h) for h in (*module._forward_hooks.values(), *module._forward_pre_hooks.values())):
            hooked.append(name)
    if not hooked:
        return
    state.warned_hooks = True
    warnings.warn(
        f"fxremat.RematModule: {type(state.model).__name__}'s submodules {hooked[:4]}{' ...' if len(hooked) > 4 else ''} "
        f"have forward hooks and are recomputed: their hooks fire again in the backward, and the memory they "
        f"keep alive or make is not in the plan (profiling runs without user hooks), so the step may peak above "
        f"the budget. Keep the hook light (read, do not hold, the tensors), or remove it while training. "
        f"(Shown once.)", stacklevel=4)


def _warn_eval_backward(state: "_State", grad_outputs):
    """A backward reached the output of a call made in ``eval()``: warn once. fxremat plans the
    graph that trains (its trace bakes in ``self.training``: dropout on, BatchNorm on batch
    statistics), so in eval mode it calls the model plainly, without recomputation, and that
    backward holds every activation of the plain model."""
    if state.warned_eval:
        return None
    state.warned_eval = True
    warnings.warn(
        f"fxremat.RematModule: a backward ran through a call of {type(state.model).__name__} in eval mode "
        f"(after .eval(), with gradients enabled). In eval mode the compiled module runs the model plainly, without "
        f"recomputation: its plans are made for training mode, whose trace bakes in self.training (dropout, "
        f"BatchNorm's batch statistics), so this backward keeps every activation of the plain model, not the "
        f"budget. To train within the budget call .train() on the compiled module (to keep some layers in eval "
        f"behaviour, such as frozen BatchNorm statistics, call .eval() on those submodules only: the plan follows "
        f"them); to evaluate without a backward, call it under torch.no_grad() or torch.inference_mode(). "
        f"(Shown once.)", UserWarning, stacklevel=_user_stacklevel())
    return None


def _warn_unfitted(state: "_State", key: tuple) -> None:
    """Warn once when a signature is planned at a training step after the example inputs' plan
    was fitted to the compiled step's peak: this one is not measured, and the compiler's own
    memory (what the fit corrects) comes on top of its plan."""
    if not state.fit_signatures or state.fitting or state.warned_unfitted:
        return
    state.warned_unfitted = True
    warnings.warn(
        f"fxremat.RematModule: planned inputs {_describe_inputs(key)} of {type(state.model).__name__} at a "
        f"training step; under backend {_backend_name(state.config.backend)} only the example inputs' compiled "
        "step was measured and fitted to the budget (fit_compiled_peak), and the compiler may keep memory this "
        "plan does not see. Call model.fit_compiled_peak(*inputs) with inputs of these shapes before training "
        "on them.", stacklevel=4)


class _ModelForward(property):
    """:attr:`RematModule.forward`, a property; read on the class made for a model class
    (:func:`_remat_class`), that class's own ``forward``, for libraries that inspect it (Hugging
    Face's Trainer finds a model's label names in ``inspect.signature(type(model).forward)``).
    Assignable on an instance, as a module's ``forward`` is (``remat.forward = f``: calls run
    ``f``; ``del remat.forward`` brings fxremat's back): torch.export's capture of a model holding
    a RematModule keeps it whole so (:mod:`fxremat.passes.capture`), and so do libraries that
    wrap a submodule's forward (the assignment raised "property 'forward' ... has no setter")."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return owner.__dict__.get("_model_forward", self)
        own = obj.__dict__.get("forward")
        return super().__get__(obj, owner) if own is None else own

    def __set__(self, obj, value) -> None:
        obj.__dict__["forward"] = value

    def __delete__(self, obj) -> None:
        if obj.__dict__.pop("forward", None) is None:
            raise AttributeError(f"{type(obj).__name__}.forward is fxremat's own; only a forward assigned to the "
                                 f"instance can be deleted")


class RematModule(torch.nn.Module):
    """``model`` with recomputation: same parameters, buffers and ``state_dict`` (shared, not
    copied), trained with its activation peak within the budget.

    In training mode with gradients enabled, it runs the emitted GraphModule for the input
    signature (planning on first sight of a signature); in ``eval()`` or under
    ``torch.no_grad()`` it runs the original model plainly (a backward through a call made in
    ``eval()`` is warned about, once). A model holding a RematModule, compiled in its turn, calls
    it as one node.
    """

    fxremat_compiled = True  # (:func:`fxremat.passes.trace.is_compiled`)

    def __init__(self, model: torch.nn.Module, traced: fx.GraphModule, config: _Config, *, leaf_modules=()):
        super().__init__()
        self._check_not_sharded(model)
        # Share the model's registries: identical state_dict keys, order and tensors.
        for name in _REGISTRIES:
            self.__dict__[name] = model.__dict__[name]
        self.training = model.training
        self._remat = _State(model, traced, config, leaf_modules)

    def _share_registries(self) -> None:
        """Share the model's registries again where it replaced one: ``nn.Sequential``'s ``del
        seq[i]`` and ``pop`` make a new ``_modules`` dict (renumbered), and the RematModule's
        ``state_dict`` kept the deleted module."""
        model = self._remat.model
        for name in _REGISTRIES:
            if self.__dict__[name] is not model.__dict__[name]:
                self.__dict__[name] = model.__dict__[name]

    def _edited(self, what: str) -> None:
        """After an edit of the model's submodules through a container method (``remat.append(m)``,
        ``del remat[i]``): the registries shared again, the model traced again at the next training
        step (where the graph changed, planned again; an edit may be one of several)."""
        self._share_registries()
        self._remat.deleted = what

    @staticmethod
    def _check_not_sharded(model: torch.nn.Module) -> None:
        if not torch.distributed.is_available():
            return
        from torch.distributed.fsdp import FSDPModule

        sharded = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        if sharded:
            raise TypeError(
                f"fxremat.compile: {type(model).__name__} is already sharded with fully_shard "
                f"(modules {sharded[:3]}); compile first, then shard: remat = fxremat.compile(model, "
                f"budget, example_inputs=...); fully_shard each module that holds parameters (or each "
                f"block passed in leaf_modules=); fully_shard(remat)"
            )

    def train(self, mode: bool = True):
        super().train(mode)
        self._remat.model.training = mode
        return self

    # Attribute access: like torch.compile's OptimizedModule, names RematModule does not define
    # itself are the original model's. Methods come bound to the original model and run plainly;
    # only forward (calling the RematModule) is recomputed.

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules (shared registries)
        except AttributeError:
            state = self.__dict__.get("_remat")
            if state is None or (name.startswith("__") and name.endswith("__")):
                raise
        return getattr(state.model, name)

    def _owns(self, name: str) -> bool:
        return "_remat" not in self.__dict__ or name == "_remat" or name in self.__dict__ or hasattr(type(self), name)

    def _registered(self, name: str) -> bool:
        """A parameter or buffer: the registries are the model's own (shared), and replacing one
        changes no graph (``get_attr`` copies are rebound before each step; FSDP2 does this)."""
        return "_remat" in self.__dict__ and (name in self._parameters or name in self._buffers)

    def __setattr__(self, name: str, value) -> None:
        if self._owns(name) or self._registered(name):
            super().__setattr__(name, value)
            if name == "training" and "_remat" in self.__dict__:
                self._remat.model.training = value
            return
        model = self._remat.model
        existed = hasattr(model, name)
        setattr(model, name, value)
        # A name the model did not have cannot be in the traced graph (FSDP2's flags, say); one it
        # had may be (torch.fx bakes Python values such as ``self.scale = 2.0`` into the code).
        if existed:
            _retrace_after_change(self, f"setting {name!r}")

    def __delattr__(self, name: str) -> None:
        if self._owns(name):
            super().__delattr__(name)
            return
        delattr(self._remat.model, name)
        # traced again at the next training step: the forward may read the name, and the usual
        # next line sets it again (``del remat.head; remat.head = new_head``)
        self._remat.deleted = f"deleting {name!r}"

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(dir(self._remat.model)))

    def _bind(self, args, kwargs) -> tuple:
        """The traced graph's positional inputs for a call. torch.fx traces ``*args`` as one
        placeholder per value given and ``**kwargs`` as empty: keywords that would land in
        ``**kwargs`` are refused, since the graph was traced without them."""
        if not kwargs and len(args) == self._remat.positional:
            return tuple(args)
        try:
            bound = self._remat.signature.bind(*args, **kwargs)
        except TypeError as exc:  # as eager's call would fail, naming the forward
            raise TypeError(f"fxremat.RematModule: {type(self._remat.model).__name__}.forward() {exc}") from None
        for name in self._remat.traced.meta.get(_NONE_ARGS, ()):
            if bound.arguments.get(name) is not None:
                model = type(self._remat.model).__name__
                raise ValueError(
                    f"fxremat.RematModule: {model}.forward was traced with {name}=None, its default (the "
                    f"example_inputs given to fxremat.compile left it out), and this call passes {name}; pass "
                    f"{name} in example_inputs too (a dict of keyword inputs) to trace it as an input")
        bound.apply_defaults()
        for name in self._remat.read_optional:
            if bound.arguments.get(name, 0) is None:
                model = type(self._remat.model).__name__
                raise ValueError(
                    f"fxremat.RematModule: {model}.forward was traced with a value for {name} (it defaults to "
                    f"None) and reads it, and this call leaves it None, where the forward may take another "
                    f"branch (`if {name} is not None:`) that the graph does not have; pass {name}, or compile "
                    f"a second module for calls without it (example_inputs that leave {name} out trace it "
                    f"as None)")
        inputs = []
        for name, value in bound.arguments.items():
            kind = bound.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                if value:
                    raise TypeError(
                        f"fxremat.RematModule: keyword arguments {sorted(value)} go to "
                        f"{type(self._remat.model).__name__}.forward's **{name}, which torch.fx traced "
                        f"empty, so the compiled graph would ignore them; give forward named "
                        f"parameters for them, or call it without them")
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                inputs.extend(value)
            else:
                inputs.append(value)
        return tuple(inputs)

    @_eager_between_graphs  # planning runs eagerly under torch.compile; Dynamo traces the emitted module
    def _prepare(self, inputs: tuple, compiling: bool = False):
        """The cache entry ``(plan, emitted module, bindings)`` of ``inputs``' signature, planned on
        first sight; ``compiling``: the step runs under torch.compile (Dynamo traced the call)."""
        state = self._remat
        key = _signature(inputs)
        entry = state.entry(key)
        if entry is None:
            start = time.perf_counter()
            rebind(state.traced_bindings)
            with _training_mode(state.model), _saved_tensor_hooks_on():  # compile(example_inputs=) in eval()
                entry = state.plan_for(key, inputs)
            log.info("fxremat: planned %s for a new input signature in %.2fs: %s%s",
                     type(state.model).__name__, time.perf_counter() - start, entry[0].strategy,
                     " (segmentation reused)" if _REUSED in entry[0].notes else "")
            _warn_unfitted(state, key)
            _warn_hooks_recomputed(state, entry[0])
            state.put(key, entry)
            while len(state.cache) > _SIGNATURES_PER_PLAN * state.config.max_plans:
                state.cache.popitem(last=False)
        state.cache.move_to_end(key)
        state.last = entry
        rebind(entry[2])
        if compiling:
            _check_compiled_by_hand(state, key, entry[0])
        return entry

    @_ModelForward
    def forward(self):
        """In training with gradients enabled, the call of the emitted code (:func:`_training_call`,
        a frame Dynamo leaves to Python); otherwise the model itself. (A property rather than a
        method with two branches: Dynamo would compile that method's frame, guarded on each module
        and input signature, before the emitted code.)"""
        if self.training and torch.is_grad_enabled():
            if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
                return self._transformed_call
            return self._training_call
        if torch.is_grad_enabled() and not self._remat.warned_eval and not torch.compiler.is_compiling():
            return self._eval_call
        return self._plain_forward

    def _eval_call(self, *args, **kwargs):
        """A call in ``eval()`` with gradients enabled: the model plainly, as in eval mode; where a
        backward may run through it (a parameter requires gradients), the first backward that
        does warns (:func:`_warn_eval_backward`). Until then a call costs a look at each parameter."""
        state = self._remat
        out = state.model(*args, **kwargs)
        if torch._C._functorch.peek_interpreter_stack() is not None:  # torch.func differentiates it itself
            return out
        if not any(d[name].requires_grad for d, name, _ in state.params):
            return out  # frozen (feature extraction, an attack on the inputs): nothing of the model trains
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and x.grad_fn is not None:
                x.grad_fn.register_prehook(functools.partial(_warn_eval_backward, state))
        return out

    def _transformed_call(self, *args, **kwargs):
        """A call inside a ``torch.func`` transform (``grad``, ``vjp``, ``jacrev``, ``vmap``): the
        model plainly, as eager runs it. torch.func does not support the saved-tensor hooks a
        checkpoint needs ("don't yet support saved tensor hooks"), and planning inside a transform
        failed on its wrapped inputs."""
        warnings.warn(
            f"fxremat.RematModule: {type(self._remat.model).__name__} is called inside a torch.func transform "
            f"(grad, vjp, jacrev, vmap), which does not support torch.utils.checkpoint: it runs plainly, "
            f"without recomputation, so its peak is the plain model's. Call the module outside the transform "
            f"(torch.autograd.grad or .backward()) to train within the budget.", stacklevel=3)
        return self._remat.model(*args, **kwargs)

    def _plain_forward(self, *args, **kwargs):
        return self._remat.model(*args, **kwargs)

    def _get_name(self) -> str:
        # the model's class name: libraries read it (Hugging Face's Trainer shifts the labels of a
        # causal LM's smoothed loss only when the name is one); the repr still says RematModule
        return self._remat.model._get_name()

    def __repr__(self) -> str:
        return f"RematModule({super().__repr__()})"

    def __reduce_ex__(self, protocol):
        # the class is made per model class (:func:`_remat_class`): pickle names it by that class
        reduced = super().__reduce_ex__(protocol)
        if type(self).__dict__.get("_model_class") is None:
            return reduced
        return (_new_remat, (type(self)._model_class,)) + tuple(reduced[2:])

    @_left_to_python
    def _training_call(self, *args, **kwargs):
        """A training call: a frame Dynamo leaves to Python, whose callees it compiles as frames of
        their own. Under torch.compile fxremat's own steps (hooks check, binding, planning) then
        run without Dynamo and only the emitted module is compiled, on its own code: not every
        RematModule and input signature on fxremat's code, guarded per module and signature (beyond
        ``torch._dynamo.config.recompile_limit``, 8, Dynamo ran the later ones eagerly, emitted
        code included). With hooks on the model itself, the hooks and fxremat's steps are traced
        as before."""
        if _dynamo_runs() and not _root_has_hooks(self._remat.model):
            gm, inputs, finish = _without_dynamo(self._emitted_call)(args, kwargs)
            return finish(_keeping(gm, inputs))
        return self._training_forward(args, kwargs)

    def _training_forward(self, args: tuple, kwargs: dict):
        model = self._remat.model
        self._check_hooks()
        _traced_for_first_call(self._remat, args, kwargs)
        if _root_has_hooks(model):  # the model's own hooks run around the emitted forward
            return _call_with_hooks(model, self._compiled_forward, args, kwargs)
        return self._compiled_forward(*args, **kwargs)

    def _emitted_call(self, args: tuple, kwargs: dict):
        """``(emitted module, its inputs, what makes the call's output of its output)`` of a call
        that torch.compile runs (planned on first sight of its signature)."""
        self._check_hooks()
        _traced_for_first_call(self._remat, args, kwargs)
        if self._remat.traced is None:  # captured per call (torch.export)
            _, gm, _, captured = self._prepare_call(args, kwargs, True)
            return gm, captured.inputs(args, kwargs), captured.output
        inputs = self._bind(args, kwargs)
        return self._prepare(inputs, True)[1], inputs, self._remat.finish

    @_eager_between_graphs
    def _check_hooks(self) -> None:
        """Trace and plan again when hooks were added to or removed from submodules since the
        trace (a submodule with hooks must be a leaf, called by the emitted graph), or parameters
        were moved out of their slots (pruning, parametrizations). Trace again,
        and plan again where the graph changed, when a setting the trace baked in changed
        (:class:`~fxremat.passes.trace.SettingsWatch`: ``block.drop_prob = 0.2``, ``block.eval()``,
        a submodule replaced)."""
        state = self._remat
        if self.__dict__["_modules"] is not state.model.__dict__["_modules"]:
            # the model's own container method made a new dict (``del model[i]`` on an nn.Sequential)
            self._edited("the model's submodules replaced")
        if state.hooks.changed():
            log.info("fxremat: the submodules of %s with hooks changed; tracing and planning again",
                     type(state.model).__name__)
            state.retrace()
            return
        if any(name not in slots for slots, name, _ in state.params):
            # pruned (``weight`` becomes ``weight_orig`` and a mask) or parametrized since the trace:
            # the next step raised a bare KeyError
            log.info("fxremat: parameters of %s were moved (pruning, a parametrization); tracing and planning "
                     "again", type(state.model).__name__)
            state.retrace()
            return
        changed = state.settings.changed()
        if changed is not None and changed[1] and state.deleted is None:
            log.info("fxremat: %s on %s; planning again", changed[0], type(state.model).__name__)
            state.retrace(state.traced)  # the same graph, measured again
        elif changed is not None or state.deleted is not None:
            what, state.deleted = changed[0] if changed else state.deleted, None
            _retrace_after_change(self, what)

    def _compiled_forward(self, *args, **kwargs):
        if self._remat.traced is None:  # captured per call (torch.export)
            the_plan, gm, _, captured = self._prepare_call(args, kwargs, torch.compiler.is_compiling())
            _check_saved_tensor_hooks(self._remat, the_plan)
            return captured.output(_run_emitted(gm, captured.inputs(args, kwargs)))
        inputs = self._bind(args, kwargs)
        the_plan, gm = self._prepare(inputs, torch.compiler.is_compiling())[:2]
        _check_saved_tensor_hooks(self._remat, the_plan)
        out = _run_emitted(gm, inputs)
        return out if self._remat.rebuild is None else self._remat.rebuild(out)

    @_eager_between_graphs
    def _prepare_call(self, args: tuple, kwargs: dict, compiling: bool = False):
        """The cache entry ``(plan, emitted module, bindings, capture)`` of ``model(*args,
        **kwargs)`` for a model captured per call: captured and planned on first sight of the
        call's signature."""
        state = self._remat
        key = _call_key(state.model, args, kwargs)
        entry = state.entry(key)
        if entry is None:
            start = time.perf_counter()
            with _training_mode(state.model), _saved_tensor_hooks_on():
                with _stage("capturing", f"{type(state.model).__name__} with torch.export"):
                    captured = capture_call(state.model, args, kwargs, leaf_modules=state.config.leaf_modules)
                state.settings.refresh()  # the capture ran the forward's Python
                gm, inputs = captured.graph_module, captured.inputs(args, kwargs)
                rebind(attribute_bindings(gm, state.model))
                later = _Later(_describe_signature(key[1:]), state) if state.planned_once else None
                the_plan, _ = _plan_graph(gm, inputs, state.config, "the plan passed to fxremat.compile",
                                          captured.plain, later=later)
                state.planned_once = True
            emitted = _emit(gm, the_plan)
            entry = (the_plan, emitted, attribute_bindings(emitted, state.model), captured)
            key = _call_key(state.model, args, kwargs)  # without facts where the capture read no mask
            log.info("fxremat: captured and planned %s for a new input signature in %.2fs: %s",
                     type(state.model).__name__, time.perf_counter() - start, the_plan.strategy)
            _warn_unfitted(state, key[1:])
            state.put(key, entry)
            while len(state.cache) > state.config.max_plans:
                state.cache.popitem(last=False)
        state.cache.move_to_end(key)
        state.last = entry
        rebind(entry[2])
        if compiling:
            _check_compiled_by_hand(state, key, entry[0])
        return entry

    def _require_plan(self):
        """The most recent signature's cache entry, if it still holds for the model as it is now:
        the checks of a training step run first (a container edit such as ``remat.append(m)``, a
        hook added, a setting the trace baked in, a parameter's dtype or frozen state changed), so
        a plan made for the model before the change is not shown as the one that will train."""
        state = self._remat
        if state.last is not None:
            self._check_hooks()
            if state.last is not None and state.cache and state.entry(next(reversed(state.cache))) is None:
                state.last = None  # a parameter's dtype or frozen state changed since it was planned
        if state.last is None:
            if state.planned_once:
                raise RuntimeError(
                    f"fxremat.RematModule: the model ({type(state.model).__name__}) changed since its last plan "
                    "(a submodule added, removed or replaced, a hook, a setting its trace depends on, or a "
                    "parameter's dtype or requires_grad), so that plan no longer describes what trains; the "
                    "model is planned again at its next training step: run one, then read the plan")
            raise RuntimeError(
                "fxremat.RematModule: no plan yet; pass example_inputs= to fxremat.compile or run "
                "one forward in training mode first"
            )
        return state.last

    @property
    def plan(self) -> Plan:
        """The plan of the most recent input signature."""
        return self._require_plan()[0]

    @property
    def graph_module(self) -> fx.GraphModule:
        """The emitted GraphModule of the most recent input signature."""
        return self._require_plan()[1]

    @property
    def code(self) -> str:
        """Python source of the emitted forward, followed by each recomputed segment's code."""
        return emitted_code(self.graph_module, type(self._remat.model).__name__)

    def fit_compiled_peak(self, *args, **kwargs) -> Plan:
        """Fit the plan of the input signature of ``self(*args, **kwargs)`` to the compiled step's
        measured peak, as :func:`compile` does for its ``example_inputs``: the signature is planned
        if it is new, one compiled step is measured on these inputs (buffers, RNG states, ``.grad``
        and training mode put back) and the plan is made again where it exceeds the budget. For
        input shapes a model will also train on (a last, smaller batch; other sequence lengths),
        called before training on them. Returns the plan kept for the signature."""
        state = self._remat
        config = state.config
        if config.backend == "eager":
            raise ValueError("RematModule.fit_compiled_peak: this module was compiled with backend='eager', so no "
                             "compiled step is measured; pass backend='inductor' (or another torch.compile backend) "
                             "to fxremat.compile")
        if not _fits(config):
            raise ValueError("RematModule.fit_compiled_peak: nothing to fit under this configuration (a saved plan= "
                             "is kept as it is; a budget of the whole baseline recomputes nothing)")
        state.fitting = True
        try:
            if state.traced is None:
                self._prepare_call(args, kwargs)
            else:
                self._prepare(self._bind(args, kwargs))
        finally:
            state.fitting = False
        _fit_compiled_peak(self, args, kwargs)
        state.fit_signatures = True
        return self.plan


# --------------------------------------------------------------------------------------------
# What the Plan records per node; loading a saved plan
# --------------------------------------------------------------------------------------------

def _user_frame(stack_trace: str) -> tuple[str, str]:
    """``("file:line", code)`` of the innermost frame outside torch and fxremat."""
    lines = stack_trace.splitlines()
    found = ("", "")
    for i, text in enumerate(lines):
        match = _FRAME.match(text)
        if match is None:
            continue
        path = os.path.abspath(match["file"])
        if path.startswith((_TORCH_DIR + os.sep, _FXREMAT_DIR + os.sep)):
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
        found = (f"{match['file']}:{match['line']}", code)
    return found


def _module_of(gm: fx.GraphModule, node: fx.Node) -> str:
    path, cls = module_of(gm, node)
    return f"{path} ({cls})" if cls else path


def node_infos(gm: fx.GraphModule, costs: GraphCosts) -> tuple[NodeInfo, ...]:
    """A :class:`NodeInfo` per call node of ``gm``, in graph order."""
    by_name = {c.name: c for c in costs.nodes}
    infos = []
    for node in gm.graph.nodes:
        if node.op not in CALL_OPS:
            continue
        cost = by_name[node.name]
        source, code = _user_frame(node.meta.get("stack_trace") or "")
        infos.append(NodeInfo(name=node.name, out_bytes=cost.out_bytes, root=cost.root,
                              module=_module_of(gm, node) or cost.module, source=source, code=code,
                              mutated_buffers=cost.mutated_buffers, draws_random=cost.uses_rng))
    return tuple(infos)


def load_plan(path, *, model: torch.nn.Module | None = None, example_inputs=None, leaf_modules=()) -> Plan:
    """Read a plan written by :meth:`Plan.save`, checking the type and value of every field
    (``ValueError`` naming the file and the field).

    With ``model`` and ``example_inputs`` it also checks that the plan was made for them (the
    model is traced as :func:`fxremat.compile` traces it, with ``leaf_modules``) and raises
    :class:`PlanMismatchError` otherwise. What the current model determines (mutated buffers,
    kept bytes, peaks) is derived again when the plan is used (``plan=``).
    """
    plan = read_plan(path)
    if model is not None or example_inputs is not None:
        if model is None or example_inputs is None:
            raise TypeError("fxremat.load_plan: pass both model= and example_inputs= to check the plan, or neither")
        inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
        check_plan(plan, trace(model, leaf_modules=leaf_modules), inputs, origin=f"plan {path}")
    return plan


# The RematModule class made for each model class (:func:`_remat_class`).
_REMAT_CLASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SIGNED_CALLS = ("_training_call", "_plain_forward", "_transformed_call",  # what RematModule.forward returns
                 "_eval_call")
_REGISTRIES = ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set")  # shared with the model
# Container methods Python looks up on the class (``remat[0]``, ``len(remat)``, ``for m in remat``,
# ``remat += [m]``): forwarded to the model where its class has them. Those that edit its submodules
# (the dunder ones whatever the class; the named ones of torch's containers, which otherwise reach
# the model through __getattr__) make the RematModule trace again at the next training step.
_CONTAINER_DUNDERS = ("__getitem__", "__setitem__", "__delitem__", "__len__", "__iter__", "__reversed__",
                      "__contains__", "__add__", "__radd__", "__iadd__", "__mul__", "__rmul__", "__imul__")
_EDITING_DUNDERS = frozenset(("__setitem__", "__delitem__", "__iadd__", "__imul__"))
_CONTAINER_EDITS = {torch.nn.Sequential: ("append", "insert", "extend", "pop"),
                    torch.nn.ModuleList: ("append", "insert", "extend", "pop"),
                    torch.nn.ModuleDict: ("pop", "clear", "update")}


def _remat_class(model_class: type) -> type:
    """:class:`RematModule` for models of ``model_class``: a subclass whose ``forward``, read on
    the class or on an instance, has ``model_class.forward``'s parameters, as libraries read them.
    Hugging Face's Trainer finds the label names in ``type(model).forward`` (a plain RematModule's
    ``forward`` property failed its construction) and drops the dataset columns that
    ``model.forward`` does not name (``(*args, **kwargs)`` dropped every input). The container
    methods of ``model_class`` are forwarded (:func:`_container_methods`): a compiled
    ``nn.Sequential`` is indexed, counted, iterated and edited as the model."""
    cls = _REMAT_CLASSES.get(model_class)
    if cls is not None:
        return cls
    try:
        signature = inspect.signature(model_class.forward)
    except (TypeError, ValueError):  # a forward inspect cannot read: libraries cannot read it either
        signature = None
    forwarded = _container_methods(model_class)
    if signature is None and not forwarded:
        return RematModule
    namespace = {"_model_class": model_class, "__module__": RematModule.__module__, "__doc__": RematModule.__doc__,
                 **forwarded}
    if signature is not None:
        namespace["_model_forward"] = model_class.forward
        for name in _SIGNED_CALLS:
            namespace[name] = _signed(getattr(RematModule, name), signature)
    cls = _REMAT_CLASSES[model_class] = type(f"RematModule[{model_class.__name__}]", (RematModule,), namespace)
    return cls


def _container_methods(model_class: type) -> dict:
    """``{name: method}`` forwarding the container methods ``model_class`` has (see
    :data:`_CONTAINER_DUNDERS`, :data:`_CONTAINER_EDITS`) to a RematModule's model."""
    methods = {name: _forwarded(name, name in _EDITING_DUNDERS)
               for name in _CONTAINER_DUNDERS if getattr(model_class, name, None) is not None}
    for container, names in _CONTAINER_EDITS.items():
        if issubclass(model_class, container):
            methods.update((name, _forwarded(name, True)) for name in names)
    return methods


def _forwarded(name: str, edits: bool):
    """RematModule's method ``name``: the model's, called; where it returns the model (``append``,
    ``+=``), the RematModule instead (``remat += [m]`` rebound ``remat`` to the plain model)."""
    def method(self, *args, **kwargs):
        model = self._remat.model
        result = getattr(model, name)(*args, **kwargs)
        if edits:
            self._edited(f"{type(model).__name__}.{name} on the compiled module")
        else:
            self._share_registries()
        return self if result is model else result

    method.__name__ = name
    method.__qualname__ = f"RematModule.{name}"
    method.__doc__ = f"The model's ``{name}`` (:func:`_forwarded`)."
    return method


def _signed(fn, signature: inspect.Signature):
    """A copy of the function ``fn`` (its code, so Dynamo's marks on it hold) that ``inspect``
    reports with ``signature``."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__dict__.update(fn.__dict__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    copy.__signature__ = signature
    return copy


def _new_remat(model_class: type) -> "RematModule":
    """An empty RematModule of ``model_class``'s class, for pickle to fill (:meth:`RematModule.__reduce_ex__`)."""
    cls = _remat_class(model_class)
    return cls.__new__(cls)
