"""Choose a strategy for a budget: Kusumoto DP candidates checked by the liveness simulator.

The DP's per-step memory is an upper bound of what PyTorch allocates, so a plan solved for the
budget B itself fits, but often with room to spare. :func:`choose` therefore bisects the DP
budget B' ≥ B, keeping the fastest plan whose *simulated* peak is within B. ``budget="min"``
takes the least simulated peak among the memory-centric plan and time-centric plans near it;
that peak is the smallest feasible budget reported by :class:`~fxremat.InfeasibleBudgetError`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .budget import Budget
from .errors import InfeasibleBudgetError
from .graph import CostGraph
from .lowersets import all_lower_sets, bits, pruned_family
from .simulate import Schedule, simulate
from .solvers import kusumoto

__all__ = ["Choice", "choose", "STRATEGIES", "DEFAULT_EXACT_CAP"]

log = logging.getLogger("fxremat")

STRATEGIES = ("auto", "exact", "approx")
DEFAULT_EXACT_CAP = 2_000
_BISECT_STEPS = 8
_MIN_LADDER = (1.02, 1.05, 1.1, 1.2, 1.35, 1.5)


@dataclass(frozen=True)
class Choice:
    """What the planner chose: a schedule with its simulated peak and recompute time."""

    schedule: Schedule
    strategy: str
    objective: str
    budget_bytes: int
    baseline_peak_bytes: int
    peak_bytes: int
    recompute_time: int
    solve_seconds: float
    num_lower_sets: int


@dataclass(frozen=True)
class _Candidate:
    schedule: Schedule
    peak_bytes: int
    recompute_time: int


def _family(graph: CostGraph, strategy: str, cap: int):
    if strategy not in STRATEGIES:
        raise ValueError(f"fxremat: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "approx":
        return pruned_family(graph.preds, anchor=graph.anchor), "approx"
    family = all_lower_sets(graph.preds, cap=cap, anchor=graph.anchor)
    if family is not None:
        return family, "exact"
    if strategy == "exact":
        raise ValueError(
            f"fxremat: strategy='exact' needs more than exact_cap={cap} lower sets for this graph "
            f"({graph.n} nodes); raise exact_cap= or use strategy='approx' or 'auto'"
        )
    log.info("fxremat: more than %d lower sets; using the approximate DP", cap)
    return pruned_family(graph.preds, anchor=graph.anchor), "approx"


def _schedule(lower_sets) -> Schedule:
    segments, prev = [], 0
    for mask in lower_sets:
        segments.append(tuple(bits(mask & ~prev)))
        prev = mask
    return Schedule(tuple(segments), tuple([True] * (len(segments) - 1) + [False]))


def _candidate(graph: CostGraph, solution) -> _Candidate | None:
    if solution is None:
        return None
    sched = _schedule(solution.lower_sets)
    rtime = sum(graph.time[v] for seg, r in zip(sched.segments, sched.recomputed) if r for v in seg)
    return _Candidate(sched, simulate(graph, sched), rtime)


class _Solver:
    """Runs DP solves over one family and accumulates the time spent in them."""

    def __init__(self, graph: CostGraph, family):
        self.graph = graph
        self.tables = kusumoto.build_tables(graph, family)
        self.seconds = 0.0

    def __call__(self, budget=None, objective="time"):
        """Return ``(dp_solution, simulated candidate)``, both ``None`` when infeasible."""
        start = time.perf_counter()
        sol = kusumoto.solve(self.graph, self.tables, budget=budget, objective=objective)
        self.seconds += time.perf_counter() - start
        return sol, _candidate(self.graph, sol)


def _better(a: _Candidate | None, b: _Candidate | None) -> _Candidate | None:
    if a is None or b is None:
        return a or b
    return min(a, b, key=lambda c: (c.recompute_time, c.peak_bytes))


def _least_peak(solver: _Solver) -> _Candidate:
    """The least simulated peak among the memory-centric plan and time-centric ones near it."""
    sol, best = solver(objective="memory")
    for factor in _MIN_LADDER:
        _, cand = solver(int(sol.peak_bytes * factor))
        if cand is not None and (cand.peak_bytes, cand.recompute_time) < (best.peak_bytes, best.recompute_time):
            best = cand
    return best


def _fastest_within(solver: _Solver, budget: int, least: _Candidate) -> _Candidate:
    """Bisect the DP budget in [budget, DP peak of no recomputation] for the fastest plan that
    the simulator puts within ``budget``."""
    best = least if least.peak_bytes <= budget else None
    plain_sol, _ = solver()
    lo, hi = budget, max(budget, plain_sol.peak_bytes)
    _, cand = solver(lo)
    if cand is not None and cand.peak_bytes <= budget:
        best = _better(best, cand)
    for _ in range(_BISECT_STEPS):
        if hi - lo <= max(1, budget // 256):
            break
        mid = (lo + hi) // 2
        _, cand = solver(mid)
        if cand is not None and cand.peak_bytes <= budget:
            best, lo = _better(best, cand), mid
        else:
            hi = mid
    return best


def choose(graph: CostGraph, budget: Budget, *, strategy: str = "auto", exact_cap: int = DEFAULT_EXACT_CAP) -> Choice:
    """Plan ``graph`` under ``budget`` (see the module docstring)."""
    plain = Schedule((tuple(range(graph.n)),), (False,))
    baseline = simulate(graph, plain)
    target = budget.resolve(baseline)
    family, used = _family(graph, strategy, exact_cap)
    if target is not None and target >= baseline:
        return Choice(plain, "none", "time-centric", target, baseline, baseline, 0, 0.0, len(family))
    solver = _Solver(graph, family)
    least = _least_peak(solver)
    if target is None:
        return Choice(least.schedule, used, "memory-centric", least.peak_bytes, baseline,
                      least.peak_bytes, least.recompute_time, solver.seconds, len(family))
    if target < least.peak_bytes:
        raise InfeasibleBudgetError(target, least.peak_bytes)
    best = _fastest_within(solver, target, least)
    return Choice(best.schedule, used, "time-centric", target, baseline, best.peak_bytes,
                  best.recompute_time, solver.seconds, len(family))
