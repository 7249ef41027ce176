"""The result of planning: :class:`Plan` (frozen) and its views.

:meth:`Plan.summary` (the segment table), :meth:`Plan.explain` (every kept and recomputed value
with its bytes, module and source line), :meth:`Plan.timeline` (the predicted memory over the
forward and backward), :meth:`Plan.plot_timeline` and :meth:`Plan.save` (JSON, read back by
:func:`fxremat.load_plan`). The views are implemented in :mod:`fxremat.views`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import format_bytes

__all__ = ["Plan", "Segment", "NodeInfo", "Timeline"]


@dataclass(frozen=True)
class Segment:
    """One V_i of the strategy: its FX node names, whether it is recomputed in the backward, and
    the values of it kept for later segments (names and bytes).

    ``inner``: for a recomputed segment with nested checkpoints (the rotor strategy), the
    segments its recomputation runs, in the same form; empty when it is recomputed plainly.
    ``recompute_cost`` counts every forward run again, up to torch's early stop (nodes after the
    last one that saves something are not rerun), nested recomputations included.
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
    them).
    """

    name: str
    out_bytes: int
    root: str
    module: str = ""
    source: str = ""
    code: str = ""
    mutated_buffers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Timeline:
    """Memory in bytes after each event of one forward + backward; the backward starts at
    index ``backward_start`` (the loss). Predicted by :mod:`fxremat.simulate` for a plan, or
    measured by :func:`fxremat.views.measure_timeline`."""

    bytes: tuple[int, ...]
    backward_start: int

    @property
    def peak_bytes(self) -> int:
        return max(self.bytes, default=0)


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
    (:func:`fxremat.views.graph_key`); these are empty on plans built without them.
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
        from .views import explain

        return explain(self)

    def timeline(self) -> Timeline:
        """The predicted memory after each event of one forward + backward."""
        return Timeline(self.timeline_bytes, self.backward_start)

    def plot_timeline(self, path=None, *, measured: Timeline | None = None):
        """Plot the predicted timeline (and ``measured`` beside it); save to ``path`` if given.
        Returns the matplotlib figure; needs ``pip install matplotlib`` (``fxremat[plot]``)."""
        from .views import plot_timeline

        return plot_timeline(self, path, measured=measured)

    def save(self, path, *, sources: bool = False) -> None:
        """Write the plan as JSON, keyed by ``graph_key``, atomically; read it with
        :func:`fxremat.load_plan`. Source files and lines of ``nodes`` are written only with
        ``sources=True`` (they hold this machine's absolute paths)."""
        from .views import save_plan

        save_plan(self, path, sources=sources)

    def __str__(self) -> str:
        return self.summary()
