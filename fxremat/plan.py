"""The result of planning: :class:`Plan` (frozen) and its readable :meth:`Plan.summary`."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import format_bytes

__all__ = ["Plan", "Segment"]


@dataclass(frozen=True)
class Segment:
    """One V_i of the strategy: its FX node names, whether it is recomputed in the backward, and
    the values of it kept for later segments (names and bytes)."""

    nodes: tuple[str, ...]
    recomputed: bool
    kept: tuple[str, ...]
    kept_bytes: int
    recompute_cost: float


@dataclass(frozen=True)
class Plan:
    """A recomputation plan for one model and input signature.

    ``strategy`` is the solver that produced it (``"exact"``, ``"approx"``, or ``"none"`` when
    the budget needs no recomputation); ``objective`` is ``"time-centric"`` (least overhead
    within the budget) or ``"memory-centric"`` (``budget="min"``). Bytes are the activation
    peak of one forward + backward beyond what was allocated before the step.
    ``predicted_overhead`` is the predicted recomputation time as a fraction of one plain step;
    ``solve_seconds`` the time spent in the solver proper.
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

    def __str__(self) -> str:
        return self.summary()
