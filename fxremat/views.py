"""Views of a plan: explain, timeline, tradeoff curve, plots, and saving/loading plans.

- :func:`explain`: every value kept at a segment boundary and every recomputed value, with its
  bytes, module and source line (JAX's ``print_saved_residuals`` for fxremat).
- :func:`predicted_timeline` (what :meth:`Plan.timeline` holds) and :func:`measure_timeline`;
  :func:`plot_timeline` draws both over the forward and backward (Hong et al., Figure 5).
- :func:`tradeoff`: the memory/overhead Pareto curve of a graph; :func:`plot_tradeoff`.
- :func:`save_plan` / :func:`load_plan`: JSON keyed by :func:`graph_key`, the hash of the
  traced graph and the input signature; :func:`check_plan` refuses a plan made for another
  graph with :class:`PlanMismatchError`.

Plotting needs matplotlib (``pip install 'fxremat[plot]'``); nothing else here does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from .budget import Budget
from .errors import format_bytes
from .graph import CostGraph
from .measure import LiveStorageTracker
from .passes.profile import CALL_OPS, COST_MODELS, GraphCosts
from .plan import NodeInfo, Plan, Segment, Timeline
from .planner import DEFAULT_EXACT_CAP, STRATEGIES, choose
from .simulate import Schedule, simulate

__all__ = ["graph_key", "check_plan", "validate_plan", "plan_schedule", "PlanMismatchError", "node_infos", "predicted_timeline",
           "measure_timeline", "default_loss", "explain", "save_plan", "load_plan", "TradeoffPoint",
           "tradeoff", "write_csv", "plot_timeline", "plot_tradeoff", "PLAN_FORMAT"]

PLAN_FORMAT = "fxremat-plan/1"
_TORCH_DIR = os.path.dirname(torch.__file__)
_FXREMAT_DIR = os.path.dirname(os.path.abspath(__file__))
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\s*$')


# --------------------------------------------------------------------------------------------
# Graph key: which traced graph and input signature a plan belongs to
# --------------------------------------------------------------------------------------------

class PlanMismatchError(ValueError):
    """A saved plan was made for another graph or input signature than the one it is used on."""


def _input_signature(example_inputs) -> list:
    leaves = tree_flatten(tuple(example_inputs))[0]
    return [
        [list(x.shape), str(x.dtype), x.device.type, x.requires_grad] if isinstance(x, torch.Tensor)
        else [type(x).__name__, repr(x)]
        for x in leaves
    ]


def _with_defaults(gm: fx.GraphModule, inputs: tuple) -> tuple:
    """``inputs`` followed by the defaults of the forward's remaining parameters."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return (*inputs, *(p.args[0] for p in placeholders[len(inputs):] if p.args))


def graph_key(gm: fx.GraphModule, example_inputs) -> str:
    """Hash of a traced graph and its input signature (hex sha256).

    It covers the graph's code, the class of every submodule, the name, shape and dtype of every
    parameter and buffer, and each input's shape, dtype, device type and ``requires_grad``
    (values of non-tensor inputs by ``repr``; omitted trailing inputs count as their defaults).
    Two models with the same code but other layer widths get different keys; the same model
    traced twice gets the same key.

    >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 4))
    >>> graph_key(gm, (torch.ones(2, 3),)) == graph_key(gm, (torch.zeros(2, 3),))
    True
    >>> graph_key(gm, (torch.ones(2, 3),)) == graph_key(gm, (torch.ones(5, 3),))
    False
    """
    content = {
        "code": gm.code,
        "modules": [[name, type(m).__qualname__] for name, m in gm.named_modules()],
        "tensors": [[name, list(t.shape), str(t.dtype)]
                    for name, t in [*gm.named_parameters(), *gm.named_buffers()]],
        "inputs": _input_signature(_with_defaults(gm, tuple(example_inputs))),
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def check_plan(plan: Plan, gm: fx.GraphModule, example_inputs, *, origin: str = "the plan") -> None:
    """Raise :class:`PlanMismatchError` unless ``plan`` was made for ``gm`` on these inputs."""
    key = graph_key(gm, example_inputs)
    if not plan.graph_key:
        raise PlanMismatchError(
            f"fxremat: {origin} has no graph key, so it cannot be checked against this model; "
            "plan again with fxremat.plan or the fxremat command line and save that plan"
        )
    if plan.graph_key != key:
        shapes = ", ".join("x".join(map(str, s[0])) for s in _input_signature(example_inputs) if len(s) == 4)
        raise PlanMismatchError(
            f"fxremat: {origin} was made for another graph or input signature (plan key "
            f"{plan.graph_key[:12]}, this model on inputs [{shapes}] has key {key[:12]}); plan this "
            "model and input again (fxremat.plan(...).save(path)) and load that plan"
        )


# --------------------------------------------------------------------------------------------
# What the Plan records per node and over time (called from fxremat.api._plan_from)
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
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, cls = list(stack.values())[-1]
        name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        return f"{path} ({name.rsplit('.', 1)[-1]})"
    if node.op == "call_module":
        return f"{node.target} ({type(gm.get_submodule(node.target)).__name__})"
    return ""


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
                              mutated_buffers=cost.mutated_buffers))
    return tuple(infos)


def predicted_timeline(graph: CostGraph, schedule: Schedule) -> Timeline:
    """The simulator's memory after each event, and where the backward starts.

    :func:`fxremat.simulate.simulate` records one event per forward allocation (two per node of
    a plain segment: its output and its extra saved buffers), one per output gradient, then the
    loss: that event is ``backward_start``.
    """
    _, events = simulate(graph, schedule, timeline=True)
    forward = sum(len(seg) * (1 if rec else 2) for seg, rec in zip(schedule.segments, schedule.recomputed))
    out_grads = len(graph.gradient_outputs())
    return Timeline(tuple(events), forward + out_grads)


def default_loss(out) -> torch.Tensor:
    """A cross-entropy against class 0 for every float output with a class dimension, a sum for
    other outputs (fxremat's prediction assumes a cross-entropy-like loss)."""
    parts = []
    for t in tree_flatten(out)[0]:
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            continue
        if t.is_floating_point() and t.dim() >= 2:
            target = torch.zeros(t.shape[0], *t.shape[2:], dtype=torch.long, device=t.device)
            parts.append(F.cross_entropy(t, target))
        else:
            parts.append(t.float().sum())
    if not parts:
        raise ValueError("fxremat: the model's output has no tensor that requires grad; nothing to backpropagate")
    return sum(parts[1:], parts[0])


class _TimelineTracker(LiveStorageTracker):
    def __init__(self):
        super().__init__()
        self.events: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.events.append(self.live_bytes)
        return out


def measure_timeline(model, *inputs, loss_fn=default_loss) -> Timeline:
    """Run one forward + backward of ``model`` and return the live bytes after every op.

    Parameters without ``.grad`` get a zero one first, so parameter gradients stay outside the
    measurement as they are outside the plan's budget; the backward accumulates into ``.grad``.
    """
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    tracker = _TimelineTracker()
    with tracker:
        loss = loss_fn(model(*inputs))
        start = len(tracker.events)
        loss.backward()
        del loss
    return Timeline(tuple(tracker.events), start)


# --------------------------------------------------------------------------------------------
# explain
# --------------------------------------------------------------------------------------------

def _short_source(info: NodeInfo | None) -> str:
    if info is None or not info.source:
        return ""
    path, _, line = info.source.rpartition(":")
    where = f"{os.path.basename(path)}:{line}"
    return f"{where}  {info.code}" if info.code else where


def _bytes_of(info: NodeInfo | None) -> str:
    if info is None:
        return "?"
    if info.out_bytes == 0 and info.root != info.name:
        return f"view of {info.root}"
    return format_bytes(info.out_bytes)


def _rows(plan: Plan, pick) -> list[tuple]:
    infos = {n.name: n for n in plan.nodes}
    rows = []
    for i, seg in enumerate(plan.segments):
        for name in pick(seg):
            info = infos.get(name)
            rows.append((str(i), name, _bytes_of(info), info.module if info else "", _short_source(info)))
    return rows


def _table(title: str, rows: list[tuple]) -> list[str]:
    if not rows:
        return [title, "  (none)"]
    head = ("seg", "value", "bytes", "module", "source")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    fmt = "  {:>%d}  {:<%d}  {:>%d}  {:<%d}  {}" % tuple(widths)
    return [title, *(fmt.format(*r).rstrip() for r in [head, *rows])]


def _total(plan: Plan, names) -> int:
    infos = {n.name: n for n in plan.nodes}
    return sum(infos[n].out_bytes for n in names if n in infos)


def explain(plan: Plan) -> str:
    """What the plan keeps and what it recomputes, value by value (see :meth:`Plan.explain`).

    Kept values stay in memory from their forward to their segment's backward; recomputed ones
    are dropped after the forward and computed again just before their segment's backward.
    Views show the value whose storage they share.
    """
    kept = _rows(plan, lambda s: s.kept)
    dropped = _rows(plan, lambda s: [n for n in s.nodes if n not in set(s.kept)] if s.recomputed else [])
    kept_bytes = sum(s.kept_bytes for s in plan.segments)
    dropped_bytes = _total(plan, [r[1] for r in dropped])
    lines = [
        f"fxremat explain: {len(kept)} values kept at segment boundaries ({format_bytes(kept_bytes)}), "
        f"{len(dropped)} values recomputed in the backward ({format_bytes(dropped_bytes)})",
        "",
        *_table("kept (held from the forward until their segment's backward):", kept),
        "",
        *_table("recomputed (dropped after the forward, computed again before their segment's backward):", dropped),
    ]
    if not plan.nodes:
        lines.append("\n(this plan carries no per-node details: bytes, modules and sources are unknown)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------

def save_plan(plan: Plan, path, *, sources: bool = False) -> None:
    """Write ``plan`` as JSON (see :func:`load_plan`), atomically: a temporary file in the same
    folder replaces ``path`` only once complete. Source files and lines (``NodeInfo.source``,
    ``.code``: absolute paths of this machine) are left out unless ``sources=True``."""
    if not plan.graph_key:
        raise ValueError(
            "fxremat: Plan.save needs a plan with a graph_key (the hash of the graph and input it "
            "was made for); plans from fxremat.plan/fxremat.compile and the command line have one"
        )
    if not sources:
        plan = dataclasses.replace(plan, nodes=tuple(dataclasses.replace(n, source="", code="") for n in plan.nodes))
    text = json.dumps({"format": PLAN_FORMAT, "graph_key": plan.graph_key, "plan": dataclasses.asdict(plan)})
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".fxremat-plan-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class _Invalid(ValueError):
    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _nonneg_int(v) -> bool:
    return _is_int(v) and v >= 0


def _nonneg_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and v >= 0


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_str(v) -> bool:
    return isinstance(v, str)


def _str_list(v) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)


def _int_list(v) -> bool:
    return isinstance(v, (list, tuple)) and all(_nonneg_int(x) for x in v)


def _one_of(values):
    check = lambda v: isinstance(v, str) and v in values  # noqa: E731
    check.expected = f"one of {sorted(values)}"
    return check


_EXPECTED = {_nonneg_int: "an int >= 0", _nonneg_number: "a finite number >= 0", _is_bool: "true or false",
             _is_str: "a string", _str_list: "a list of strings", _int_list: "a list of ints >= 0"}
_SEGMENT_FIELDS = {"nodes": _str_list, "recomputed": _is_bool, "kept": _str_list, "kept_bytes": _nonneg_int,
                   "recompute_cost": _nonneg_number}
_NODE_FIELDS = {"name": _is_str, "out_bytes": _nonneg_int, "root": _is_str, "module": _is_str, "source": _is_str,
                "code": _is_str, "mutated_buffers": _str_list}
_PLAN_FIELDS = {
    "strategy": _one_of(set(STRATEGIES) - {"auto"}), "objective": _one_of({"time-centric", "memory-centric"}),
    "budget_bytes": _nonneg_int, "baseline_peak_bytes": _nonneg_int, "predicted_peak_bytes": _nonneg_int,
    "predicted_overhead": _nonneg_number, "solve_seconds": _nonneg_number, "cost_model": _one_of(set(COST_MODELS)),
    "num_nodes": _nonneg_int, "num_lower_sets": _nonneg_int, "timeline_bytes": _int_list,
    "backward_start": _nonneg_int, "graph_key": _is_str, "notes": _str_list,
}


def _check_record(data, cls, checks: dict, where: str) -> None:
    if not isinstance(data, dict):
        raise _Invalid(where, f"must be an object with the fields of {cls.__name__}, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        raise _Invalid(where, f"unknown {cls.__name__} fields {sorted(unknown)}; was it written by a newer fxremat?")
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Invalid(f"{where}.{name}", "is missing")
            continue
        check = checks.get(name)
        if check is not None and not check(data[name]):
            expected = getattr(check, "expected", None) or _EXPECTED[check]
            raise _Invalid(f"{where}.{name}", f"must be {expected}, got {data[name]!r}")


def _check_segments(segments, where: str) -> None:
    if not isinstance(segments, (list, tuple)) or not segments:
        raise _Invalid(where, f"must be a non-empty list of segments, got {segments!r}")
    for i, seg in enumerate(segments):
        _check_record(seg, Segment, _SEGMENT_FIELDS, f"{where}[{i}]")
        if not seg["nodes"]:
            raise _Invalid(f"{where}[{i}].nodes", "must name at least one node")
        inner = seg.get("inner", ())
        if inner:
            if not seg["recomputed"]:
                raise _Invalid(f"{where}[{i}].inner", "nested segments need recomputed: true")
            _check_segments(inner, f"{where}[{i}].inner")


def _check_plan_dict(data) -> None:
    _check_record(data, Plan, _PLAN_FIELDS, "plan")
    _check_segments(data["segments"], "plan.segments")
    nodes = data.get("nodes", ())
    if not isinstance(nodes, (list, tuple)):
        raise _Invalid("plan.nodes", f"must be a list, got {type(nodes).__name__}")
    for i, node in enumerate(nodes):
        _check_record(node, NodeInfo, _NODE_FIELDS, f"plan.nodes[{i}]")


def validate_plan(plan: Plan, *, origin: str = "the plan") -> None:
    """Check the type and value of every field of ``plan`` (a Plan built or edited in Python);
    raise ``ValueError`` naming the field."""
    try:
        _check_plan_dict(dataclasses.asdict(plan))
    except _Invalid as exc:
        raise ValueError(f"fxremat: {origin}: field {exc.field} {exc.problem}; plan again with fxremat.plan "
                         "rather than editing a Plan") from None


def plan_schedule(plan: Plan, graph: CostGraph, *, origin: str = "the plan") -> Schedule:
    """The :class:`~fxremat.simulate.Schedule` of ``plan``'s segments on ``graph``, checked: every
    call node in exactly one segment, every segment after the segments its inputs come from, nested
    segments covering their parent. Raises :class:`PlanMismatchError` naming the segment."""
    index = {name: v for v, name in enumerate(graph.names)}
    return _schedule_of(plan.segments, index, graph, set(index.values()), origin, "segments")


def _schedule_of(segments, index, graph: CostGraph, expected: set, origin: str, where: str) -> Schedule:
    done, seen, parts, inner = set(), set(), [], []
    for i, seg in enumerate(segments):
        unknown = [n for n in seg.nodes if n not in index]
        if unknown:
            raise PlanMismatchError(f"fxremat: {origin}: field plan.{where}[{i}].nodes names {unknown[:3]}, not call "
                                    "nodes of this graph; plan this model again")
        ids = tuple(sorted(index[n] for n in seg.nodes))
        twice = [graph.names[v] for v in ids if v in seen] or (
            [n for n in seg.nodes if seg.nodes.count(n) > 1])
        outside = [graph.names[v] for v in ids if v not in expected]
        if twice or outside:
            raise PlanMismatchError(f"fxremat: {origin}: field plan.{where}[{i}].nodes has "
                                    f"{(twice or outside)[:3]} {'more than once' if twice else 'outside its parent'}; "
                                    "plan this model again")
        seen.update(ids)
        members = set(ids)
        late = [(graph.names[p], graph.names[v]) for v in ids for p in graph.preds[v]
                if p in expected and p not in done and p not in members]
        if late:
            raise PlanMismatchError(f"fxremat: {origin}: field plan.{where}[{i}] runs {late[0][1]} before its input "
                                    f"{late[0][0]} (in a later segment); plan this model again")
        done |= members
        parts.append(ids)
        nested = _schedule_of(seg.inner, index, graph, members, origin, f"{where}[{i}].inner") if seg.inner else None
        inner.append(nested)
    missing = sorted(expected - seen)
    if missing:
        raise PlanMismatchError(f"fxremat: {origin}: field plan.{where} leaves out {len(missing)} call nodes "
                                f"({[graph.names[v] for v in missing[:3]]}); plan this model again")
    recomputed = tuple(seg.recomputed for seg in segments)
    return Schedule(tuple(parts), recomputed, tuple(inner) if any(x is not None for x in inner) else ())


def _read_json(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise OSError(exc.errno, f"fxremat.load_plan: cannot read {path}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        ends_early = exc.pos >= len(text.rstrip()) or not text.rstrip().endswith(("}", "]"))
        truncated = " (the file ends early: truncated?)" if ends_early else ""
        raise ValueError(f"fxremat.load_plan: {path} is not valid JSON{truncated}: {exc.msg} at line {exc.lineno} "
                         f"column {exc.colno}; save the plan again with Plan.save") from None


def load_plan(path, *, model: torch.nn.Module | None = None, example_inputs=None, leaf_modules=()) -> Plan:
    """Read a plan written by :meth:`Plan.save`, checking the type and value of every field
    (``ValueError`` naming the file and the field).

    With ``model`` and ``example_inputs`` it also checks that the plan was made for them (the
    model is traced as :func:`fxremat.compile` traces it, with ``leaf_modules``) and raises
    :class:`PlanMismatchError` otherwise. What the current model determines (mutated buffers,
    kept bytes, peaks) is derived again when the plan is used (``plan=``).
    """
    data = _read_json(path)
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"fxremat.load_plan: {path} is not an fxremat plan (format {found!r}, "
                         f"expected {PLAN_FORMAT!r}); write plans with Plan.save")
    try:
        _check_plan_dict(data.get("plan"))
        if data.get("graph_key") != data["plan"]["graph_key"]:
            raise _Invalid("graph_key", f"{data.get('graph_key')!r} differs from plan.graph_key")
    except _Invalid as exc:
        raise ValueError(f"fxremat.load_plan: {path}: field {exc.field} {exc.problem}; the file was edited or "
                         "damaged: save the plan again with Plan.save") from None
    fields = dict(data["plan"])
    fields["segments"] = tuple(_build_segment(s) for s in fields["segments"])
    fields["nodes"] = tuple(NodeInfo(**{k: _tuples(v) for k, v in n.items()}) for n in fields.get("nodes", ()))
    plan = Plan(**{k: _tuples(v) if k not in ("segments", "nodes") else v for k, v in fields.items()})
    if model is not None or example_inputs is not None:
        if model is None or example_inputs is None:
            raise TypeError("fxremat.load_plan: pass both model= and example_inputs= to check the plan, or neither")
        from .passes.trace import trace

        inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
        check_plan(plan, trace(model, leaf_modules=leaf_modules), inputs, origin=f"plan {path}")
    return plan


def _build_segment(data: dict) -> Segment:
    data = dict(data)
    data["inner"] = tuple(_build_segment(s) for s in data.get("inner", ()))
    return Segment(**{k: _tuples(v) if k != "inner" else v for k, v in data.items()})


# --------------------------------------------------------------------------------------------
# tradeoff
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TradeoffPoint:
    """One plan on the memory/overhead curve."""

    budget_bytes: int
    predicted_peak_bytes: int
    predicted_overhead: float
    strategy: str
    num_segments: int
    recomputed_nodes: int


def _point(graph: CostGraph, budget: Budget, strategy: str, exact_cap: int) -> TradeoffPoint:
    choice = choose(graph, budget, strategy=strategy, exact_cap=exact_cap)
    recomputed = sum(len(s) for s, r in zip(choice.schedule.segments, choice.schedule.recomputed) if r)
    return TradeoffPoint(choice.budget_bytes, choice.peak_bytes,
                         choice.recompute_time * graph.time_unit / graph.step_cost, choice.strategy,
                         len(choice.schedule.segments), recomputed)


def _pareto(points) -> tuple[TradeoffPoint, ...]:
    front, best_peak = [], None
    for p in sorted(points, key=lambda p: (p.predicted_overhead, p.predicted_peak_bytes)):
        if best_peak is None or p.predicted_peak_bytes < best_peak:
            front.append(p)
            best_peak = p.predicted_peak_bytes
    return tuple(front)


def tradeoff(graph: CostGraph, *, points: int = 12, strategy: str = "auto", exact_cap: int = DEFAULT_EXACT_CAP,
             on_point=None) -> tuple[TradeoffPoint, ...]:
    """The least predicted peak for each predicted overhead: plans for ``points`` budgets spaced
    evenly from the smallest feasible peak to the peak without recomputation, keeping those no
    other plan beats on both. Sorted by overhead (the plain plan first). ``on_point()`` is
    called after each solve (for progress bars)."""
    if points < 2:
        raise ValueError(f"fxremat.views.tradeoff: points must be at least 2, got {points}")
    least = _point(graph, Budget(minimum=True), strategy, exact_cap)
    plain = _point(graph, Budget(fraction=1.0), strategy, exact_cap)
    found = [least, plain]
    lo, hi = least.predicted_peak_bytes, plain.predicted_peak_bytes
    for i in range(1, points - 1):
        found.append(_point(graph, Budget(bytes=lo + (hi - lo) * i // (points - 1)), strategy, exact_cap))
        if on_point is not None:
            on_point()
    return _pareto(found)


def write_csv(points, path) -> None:
    """Write tradeoff points as CSV, one row per plan."""
    names = [f.name for f in dataclasses.fields(TradeoffPoint)]
    with open(path, "w") as f:
        f.write(",".join(names) + "\n")
        for p in points:
            f.write(",".join(str(getattr(p, n)) for n in names) + "\n")


# --------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------

def _figure(width: float, height: float):
    """A matplotlib ``Figure`` with one axes, outside pyplot (no backend or global state)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("fxremat: plotting needs matplotlib; pip install 'fxremat[plot]' (or matplotlib)") from None
    fig = Figure(figsize=(width, height))
    return fig, fig.add_subplot()


def _phase_axis(timeline: Timeline) -> list[float]:
    """Event positions with the forward on [0, 1] and the backward on [1, 2]."""
    n, b = len(timeline.bytes), timeline.backward_start
    fwd = [i / max(b, 1) for i in range(b)]
    bwd = [1 + (i - b) / max(n - 1 - b, 1) for i in range(b, n)]
    return fwd + bwd


def plot_timeline(plan: Plan, path=None, *, measured: Timeline | None = None):
    """Predicted memory over the forward and backward (and ``measured`` beside it); returns the
    figure, saved to ``path`` when given."""
    if not plan.timeline_bytes:
        raise ValueError("fxremat: this plan has no predicted timeline; plan again with fxremat.plan")
    fig, ax = _figure(8, 4)
    predicted = plan.timeline()
    ax.plot(_phase_axis(predicted), [b / 2**20 for b in predicted.bytes], label="predicted")
    if measured is not None:
        ax.plot(_phase_axis(measured), [b / 2**20 for b in measured.bytes], label="measured", alpha=0.8)
    ax.axhline(plan.budget_bytes / 2**20, color="gray", linestyle="--", label="budget")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([0, 1, 2], ["forward start", "backward start", "end"])
    ax.set_ylabel("activation memory (MiB)")
    ax.set_title(f"fxremat plan ({plan.strategy}, {plan.objective}): peak "
                 f"{format_bytes(plan.predicted_peak_bytes)}, baseline {format_bytes(plan.baseline_peak_bytes)}")
    ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig


def plot_tradeoff(points, path=None, *, title: str = "fxremat memory/overhead tradeoff"):
    """Predicted peak against predicted overhead, one marker per plan; saved to ``path``."""
    fig, ax = _figure(6, 4)
    xs = [100 * p.predicted_overhead for p in points]
    ys = [p.predicted_peak_bytes / 2**20 for p in points]
    ax.step(xs, ys, where="post", marker="o")
    ax.set_xlabel("predicted overhead (% of a plain training step)")
    ax.set_ylabel("predicted peak (MiB)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig
