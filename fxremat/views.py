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
import os
import re
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from .budget import Budget
from .errors import format_bytes
from .graph import CostGraph
from .measure import LiveStorageTracker
from .passes.profile import CALL_OPS, GraphCosts
from .plan import NodeInfo, Plan, Segment, Timeline
from .planner import DEFAULT_EXACT_CAP, choose
from .simulate import Schedule, simulate

__all__ = ["graph_key", "check_plan", "PlanMismatchError", "node_infos", "predicted_timeline",
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
    out_grads = sum(1 for v in range(graph.n) if graph.is_output[v] and graph.grad_bytes[v])
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

def save_plan(plan: Plan, path) -> None:
    """Write ``plan`` as JSON (see :func:`load_plan`)."""
    if not plan.graph_key:
        raise ValueError(
            "fxremat: Plan.save needs a plan with a graph_key (the hash of the graph and input it "
            "was made for); plans from fxremat.plan/fxremat.compile and the command line have one"
        )
    with open(path, "w") as f:
        json.dump({"format": PLAN_FORMAT, "graph_key": plan.graph_key, "plan": dataclasses.asdict(plan)}, f)


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _build(cls, data: dict, path):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"fxremat.load_plan: {path} has unknown {cls.__name__} fields {sorted(unknown)}; "
                         "was it written by a newer fxremat?")
    return cls(**{k: _tuples(v) for k, v in data.items()})


def _build_segment(data: dict, path) -> Segment:
    data = dict(data)
    data["inner"] = tuple(_build_segment(s, path) for s in data.get("inner", ()))
    return _build(Segment, data, path)


def load_plan(path, *, model: torch.nn.Module | None = None, example_inputs=None, leaf_modules=()) -> Plan:
    """Read a plan written by :meth:`Plan.save`.

    With ``model`` and ``example_inputs`` it also checks that the plan was made for them (the
    model is traced as :func:`fxremat.compile` traces it, with ``leaf_modules``) and raises
    :class:`PlanMismatchError` otherwise.
    """
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"fxremat.load_plan: {path} is not an fxremat plan (format {found!r}, "
                         f"expected {PLAN_FORMAT!r}); write plans with Plan.save")
    fields = dict(data["plan"])
    fields["segments"] = tuple(_build_segment(s, path) for s in fields.get("segments", ()))
    fields["nodes"] = tuple(_build(NodeInfo, n, path) for n in fields.get("nodes", ()))
    plan = _build(Plan, fields, path)
    if model is not None or example_inputs is not None:
        if model is None or example_inputs is None:
            raise TypeError("fxremat.load_plan: pass both model= and example_inputs= to check the plan, or neither")
        from .passes.trace import trace

        inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
        check_plan(plan, trace(model, leaf_modules=leaf_modules), inputs, origin=f"plan {path}")
    return plan


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
