"""The result of planning: :class:`Plan` (frozen) and its views.

:meth:`Plan.summary` (the segment table), :meth:`Plan.explain` (every kept and recomputed value
with its bytes, module and source line), :meth:`Plan.timeline` (the predicted memory over the
forward and backward), :meth:`Plan.plot_timeline` (drawn by :mod:`fxremat.plots`) and
:meth:`Plan.save` (JSON, read back by :func:`fxremat.load_plan`).

This module holds the records, their text views and their JSON form (written and checked field
by field here; checking a plan against a model is :mod:`fxremat.identity`'s job). It imports
nothing from fxremat but :mod:`fxremat.errors` (and the leaf :mod:`fxremat.plots` when a plot is
drawn): saving a plan loads neither the planner nor the tracer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass, field

from .core import Timeline
from .errors import format_bytes

__all__ = ["Plan", "Segment", "NodeInfo", "Trial", "explain", "save_plan", "read_plan", "validate_plan",
           "PLAN_FORMAT", "PLAN_STRATEGIES", "PLAN_COST_MODELS"]

PLAN_FORMAT = "fxremat-plan/1"
# The values a saved plan may hold; fxremat.planner.STRATEGIES and fxremat.passes.profile.COST_MODELS
# are built from them.
PLAN_STRATEGIES = ("exact", "approx", "rotor", "chen", "hong", "sequential", "none")
PLAN_COST_MODELS = ("measured", "flops", "compiled", "uniform")


@dataclass(frozen=True)
class Segment:
    """One V_i of the strategy: its FX node names, whether it is recomputed in the backward, and
    the values of it kept for later segments (names and bytes).

    ``inner``: for a recomputed segment with nested checkpoints (the rotor strategy), the
    segments its recomputation runs, in the same form; empty when it is recomputed plainly.
    ``recompute_cost`` counts every forward run again, up to torch's early stop (nodes after the
    last one that saves something are not rerun), nested recomputations included; for a compiled
    step, the nodes its one backward reads and what they come from
    (:func:`fxremat.simulate.partitioned_rerun_time`).
    """

    nodes: tuple[str, ...]
    recomputed: bool
    kept: tuple[str, ...]
    kept_bytes: int
    recompute_cost: float
    inner: tuple["Segment", ...] = ()


@dataclass(frozen=True)
class NodeInfo:
    """Where one FX call node comes from and what it allocates, for :meth:`Plan.explain`.

    ``out_bytes``: bytes of the new storages of its output (0 for a view of ``root``'s);
    ``module``: the qualified name and class of the submodule it runs in (``"down.0.1
    (BatchNorm2d)"``); ``source``: ``file:line`` of the user code that created it and ``code``
    that line's text; ``mutated_buffers``: buffers it updates (re-emitting a saved plan needs
    them); ``draws_random``: whether it draws random numbers (a recomputed segment holding one
    restores the RNG state before its recomputation; others need not).
    """

    name: str
    out_bytes: int
    root: str
    module: str = ""
    source: str = ""
    code: str = ""
    mutated_buffers: tuple[str, ...] = ()
    draws_random: bool = False


@dataclass(frozen=True)
class Trial:
    """One candidate plan that ``autotune`` timed for real: its strategy, predicted peak and
    overhead, and the overhead measured over a plain step (median of interleaved steps)."""

    strategy: str
    predicted_peak_bytes: int
    predicted_overhead: float
    measured_overhead: float
    chosen: bool = False


@dataclass(frozen=True)
class Plan:
    """A recomputation plan for one model and input signature.

    ``strategy`` is the solver that produced it (``"exact"``, ``"approx"``, or ``"none"`` when
    the budget needs no recomputation); ``objective`` is ``"time-centric"`` (least overhead
    within the budget) or ``"memory-centric"`` (``budget="min"``). Bytes are the activation
    peak of one forward + backward beyond what was allocated before the step.
    ``predicted_overhead`` is the predicted recomputation time as a fraction of one plain step;
    ``solve_seconds`` the time spent in the solver proper. ``nodes`` describes every call node
    (:class:`NodeInfo`), ``timeline_bytes``/``backward_start`` the predicted memory timeline,
    ``graph_key`` the hash of the traced graph and input signature the plan was made for
    (:func:`fxremat.identity.graph_key`); these are empty on plans built without them.
    ``autotune``: the candidates timed when planning with ``autotune=`` (:class:`Trial`, the
    chosen one marked), empty otherwise.
    """

    strategy: str
    objective: str
    budget_bytes: int
    baseline_peak_bytes: int
    predicted_peak_bytes: int
    predicted_overhead: float
    solve_seconds: float
    segments: tuple[Segment, ...]
    cost_model: str
    num_nodes: int
    num_lower_sets: int
    nodes: tuple[NodeInfo, ...] = field(default=(), repr=False)
    timeline_bytes: tuple[int, ...] = field(default=(), repr=False)
    backward_start: int = 0
    graph_key: str = ""
    notes: tuple[str, ...] = ()
    autotune: tuple[Trial, ...] = ()

    @property
    def recomputed_nodes(self) -> tuple[str, ...]:
        return tuple(n for s in self.segments if s.recomputed for n in s.nodes)

    def summary(self) -> str:
        """A table of the segments and the headline numbers."""
        reduction = 1 - self.predicted_peak_bytes / max(self.baseline_peak_bytes, 1)
        head = [
            f"fxremat plan: strategy={self.strategy} ({self.objective}), cost model={self.cost_model}",
            f"  budget            {format_bytes(self.budget_bytes):>12}",
            f"  baseline peak     {format_bytes(self.baseline_peak_bytes):>12}  (no recomputation)",
            f"  predicted peak    {format_bytes(self.predicted_peak_bytes):>12}  ({-100 * reduction:+.1f}%)",
            f"  predicted overhead {100 * self.predicted_overhead:>10.1f}%  of a plain training step",
            f"  solve time        {self.solve_seconds:>11.3f}s  ({self.num_nodes} nodes, "
            f"{self.num_lower_sets} lower sets)",
            *[f"  note: {note}" for note in self.notes],
            *([f"  autotune: {len(self.autotune)} candidates timed (overhead predicted -> measured):"] if self.autotune else []),
            *[f"    {'*' if t.chosen else ' '} {t.strategy:<10} {format_bytes(t.predicted_peak_bytes):>10}  "
              f"{100 * t.predicted_overhead:+6.1f}% -> {100 * t.measured_overhead:+6.1f}%" for t in self.autotune],
            "",
            f"  {'seg':>4} {'nodes':>6}  {'mode':<10} {'kept':>10}  first .. last  | kept values",
        ]
        rows = []
        for i, s in enumerate(self.segments):
            mode = "recompute" if s.recomputed else "keep"
            span = f"{s.nodes[0]} .. {s.nodes[-1]}" if s.nodes else "-"
            kept = ", ".join(s.kept[:4]) + (f", +{len(s.kept) - 4}" if len(s.kept) > 4 else "")
            rows.append(f"  {i:>4} {len(s.nodes):>6}  {mode:<10} {format_bytes(s.kept_bytes):>10}  {span}  | {kept}")
        return "\n".join(head + rows)

    def explain(self) -> str:
        """Every value kept at a segment boundary and every recomputed value: node name, bytes,
        the module and the source line it comes from (like JAX's ``print_saved_residuals``)."""
        return explain(self)

    def timeline(self) -> Timeline:
        """The predicted memory after each event of one forward + backward."""
        return Timeline(self.timeline_bytes, self.backward_start)

    def plot_timeline(self, path=None, *, measured: Timeline | None = None):
        """Plot the predicted timeline (and ``measured`` beside it); save to ``path`` if given.
        Returns the matplotlib figure; needs ``pip install matplotlib`` (``fxremat[plot]``)."""
        from .plots import plot_timeline

        return plot_timeline(self, path, measured=measured)

    def save(self, path, *, sources: bool = False) -> None:
        """Write the plan as JSON, keyed by ``graph_key``, atomically; read it with
        :func:`fxremat.load_plan`. Source files and lines of ``nodes`` are written only with
        ``sources=True`` (they hold this machine's absolute paths)."""
        save_plan(self, path, sources=sources)

    def __str__(self) -> str:
        return self.summary()


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
# JSON: save, read, check field by field
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


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


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


_EXPECTED = {_nonneg_int: "an int >= 0", _nonneg_number: "a finite number >= 0", _is_number: "a finite number",
             _is_bool: "true or false",
             _is_str: "a string", _str_list: "a list of strings", _int_list: "a list of ints >= 0"}
_SEGMENT_FIELDS = {"nodes": _str_list, "recomputed": _is_bool, "kept": _str_list, "kept_bytes": _nonneg_int,
                   "recompute_cost": _nonneg_number}
_NODE_FIELDS = {"name": _is_str, "out_bytes": _nonneg_int, "root": _is_str, "module": _is_str, "source": _is_str,
                "code": _is_str, "mutated_buffers": _str_list, "draws_random": _is_bool}
_TRIAL_FIELDS = {"strategy": _one_of(set(PLAN_STRATEGIES)), "predicted_peak_bytes": _nonneg_int,
                 "predicted_overhead": _nonneg_number, "measured_overhead": _is_number, "chosen": _is_bool}
_PLAN_FIELDS = {
    "strategy": _one_of(set(PLAN_STRATEGIES)), "objective": _one_of({"time-centric", "memory-centric"}),
    "budget_bytes": _nonneg_int, "baseline_peak_bytes": _nonneg_int, "predicted_peak_bytes": _nonneg_int,
    "predicted_overhead": _nonneg_number, "solve_seconds": _nonneg_number, "cost_model": _one_of(set(PLAN_COST_MODELS)),
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
    trials = data.get("autotune", ())
    if not isinstance(trials, (list, tuple)):
        raise _Invalid("plan.autotune", f"must be a list, got {type(trials).__name__}")
    for i, trial in enumerate(trials):
        _check_record(trial, Trial, _TRIAL_FIELDS, f"plan.autotune[{i}]")


def validate_plan(plan: Plan, *, origin: str = "the plan") -> None:
    """Check the type and value of every field of ``plan`` (a Plan built or edited in Python);
    raise ``ValueError`` naming the field."""
    try:
        _check_plan_dict(dataclasses.asdict(plan))
    except _Invalid as exc:
        raise ValueError(f"fxremat: {origin}: field {exc.field} {exc.problem}; plan again with fxremat.plan "
                         "rather than editing a Plan") from None


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


def read_plan(path) -> Plan:
    """Read a plan written by :func:`save_plan`, checking the type and value of every field
    (``ValueError`` naming the file and the field); :func:`fxremat.load_plan` also checks it
    against a model."""
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
    fields["autotune"] = tuple(Trial(**t) for t in fields.get("autotune", ()))
    plan = Plan(**{k: _tuples(v) if k not in ("segments", "nodes", "autotune") else v for k, v in fields.items()})
    return plan


def _build_segment(data: dict) -> Segment:
    data = dict(data)
    data["inner"] = tuple(_build_segment(s) for s in data.get("inner", ()))
    return Segment(**{k: _tuples(v) if k != "inner" else v for k, v in data.items()})
