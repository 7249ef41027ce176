"""Choose a strategy for a budget: Kusumoto DP candidates checked by the liveness simulator.

The DP's per-step memory is an upper bound of what PyTorch allocates, so a plan solved for the
budget B itself fits, but often with room to spare. :func:`choose` therefore bisects the DP
budget B' ≥ B, keeping the fastest plan whose *simulated* peak is within B. ``budget="min"``
takes the least simulated peak among the memory-centric plan and time-centric plans near it;
that peak is the smallest feasible budget reported by :class:`~fxremat.InfeasibleBudgetError`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from .budget import Budget
from .errors import InfeasibleBudgetError
from .graph import CostGraph
from .lowersets import all_lower_sets, bits, pruned_family
from .records import PLAN_STRATEGIES
from .simulate import Schedule, rerun_time, simulate
from . import _kernels
from .solvers import chen, hong, kusumoto, rotor
from .solvers.chain import chain_costs, chain_stages, schedule_from_nested

__all__ = ["Choice", "choose", "STRATEGIES", "DEFAULT_EXACT_CAP", "DEFAULT_ROTOR_SLOTS", "TradeoffPoint", "tradeoff",
           "write_csv"]

log = logging.getLogger("fxremat")

STRATEGIES = ("auto", *PLAN_STRATEGIES)
_KUSUMOTO = ("auto", "exact", "approx")  # strategies that run the Kusumoto DP
DEFAULT_ROTOR_SLOTS = 500  # Beaumont et al.'s S
DEFAULT_EXACT_CAP = None  # 20,000 lower sets with the compiled kernels, 2,000 with the reference
_EXACT_CAP = {"cython": 20_000, "python": 2_000}
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
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Candidate:
    schedule: Schedule
    peak_bytes: int
    recompute_time: int


def _group_ancestors(gpreds: dict, g: int) -> set:
    seen, stack = set(), [g]
    while stack:
        for p in gpreds.get(stack.pop(), ()):
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def ordered_preds(graph: CostGraph) -> tuple[tuple[int, ...], ...]:
    """Predecessors plus precedence edges that keep, for every value with two or more
    consumers, its consumers in traced order. Autograd sums a value's gradient contributions in
    the order its consumers ran; with three or more terms another order changes the float sum,
    so strategies whose lower sets respect these edges give bitwise-equal gradients. So are the
    consumers of a graph input or parameter and the calls of a shared module
    (``graph.order_chains``), and the nodes that draw random numbers (dropout masks). An
    edge that would close a cycle among tied groups is left out."""
    anchor = graph.anchor or tuple(range(graph.n))
    preds = [set(ps) for ps in graph.preds]
    gpreds: dict[int, set] = {}
    for v, ps in enumerate(graph.preds):
        gpreds.setdefault(anchor[v], set()).update(anchor[p] for p in ps if anchor[p] != anchor[v])
    chains = [sorted(graph.succs[v]) for v in range(graph.n) if len(graph.succs[v]) >= 2]  # a consumer may use a value twice
    chains.append([v for v in range(graph.n) if graph.uses_rng and graph.uses_rng[v]])
    chains += [list(c) for c in graph.order_chains]
    for users in chains:
        for a, b in zip(users, users[1:]):
            ga, gb = anchor[a], anchor[b]
            if ga == gb or gb in _group_ancestors(gpreds, ga):
                continue
            preds[b].add(a)
            gpreds.setdefault(gb, set()).add(ga)
    return tuple(tuple(sorted(ps)) for ps in preds)


def _ordered_graph(graph: CostGraph) -> CostGraph:
    """``graph`` with :func:`ordered_preds` as its edges (for choosing lower sets only)."""
    preds = ordered_preds(graph)
    succs = [[] for _ in preds]
    for v, ps in enumerate(preds):
        for p in ps:
            succs[p].append(v)
    return dataclasses.replace(graph, preds=preds, succs=tuple(tuple(x) for x in succs),
                               data_succs=graph.data_succs or graph.succs)


def resolve_exact_cap(cap: int | None) -> int:
    """The cap on lower sets for the exact DP: ``cap``, or the default of the kernels in use."""
    return _EXACT_CAP[_kernels.current()] if cap is None else cap


def _family(graph: CostGraph, strategy: str, cap: int | None):
    cap = resolve_exact_cap(cap)
    preds = ordered_preds(graph)
    if strategy == "approx":
        return pruned_family(preds, anchor=graph.anchor), "approx"
    family = all_lower_sets(preds, cap=cap, anchor=graph.anchor)
    if family is not None:
        return family, "exact"
    if strategy == "exact":
        raise ValueError(
            f"fxremat: strategy='exact' needs more than exact_cap={cap} lower sets for this graph "
            f"({graph.n} nodes); raise exact_cap= or use strategy='approx' or 'auto'"
        )
    log.info("fxremat: more than exact_cap=%d lower sets in this graph; using the approximate DP", cap)
    return pruned_family(preds, anchor=graph.anchor), "approx (exact capped)"


def _schedule(lower_sets) -> Schedule:
    segments, prev = [], 0
    for mask in lower_sets:
        segments.append(tuple(bits(mask & ~prev)))
        prev = mask
    return Schedule(tuple(segments), tuple([True] * (len(segments) - 1) + [False]))


def recompute_time(graph: CostGraph, sched: Schedule) -> int:
    """Forward cost run again in the backward: every recomputed segment up to torch's early
    stop, plus what its nested checkpoints run again (:func:`~fxremat.simulate.rerun_time`)."""
    return sum(rerun_time(graph, seg, sched.inner_of(i))
               for i, (seg, rec) in enumerate(zip(sched.segments, sched.recomputed)) if rec)


def _candidate(graph: CostGraph, solution) -> _Candidate | None:
    if solution is None:
        return None
    sched = _schedule(solution.lower_sets)
    return _Candidate(sched, simulate(graph, sched), recompute_time(graph, sched))


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


class _Fixed:
    """Candidates given up front (the chain baselines), each simulated once."""

    def __init__(self, graph: CostGraph, sequences):
        start = time.perf_counter()
        self.cands = [_candidate(graph, kusumoto.Solution(seq, 0, 0)) for seq in sequences]
        self.seconds = time.perf_counter() - start

    def least(self) -> _Candidate | None:
        return min(self.cands, key=lambda c: (c.peak_bytes, c.recompute_time), default=None)

    def fastest_within(self, budget: int) -> _Candidate | None:
        best = None
        for c in self.cands:
            if c.peak_bytes <= budget:
                best = _better(best, c)
        return best


class _Rotor:
    """Rotor (Beaumont et al.) on the articulation chain. One DP table serves every memory
    budget up to the no-recomputation peak, in ``slots`` steps; since the chain model is an
    estimate, the schedule of every step is simulated (each distinct one once) and the
    simulator decides."""

    def __init__(self, graph: CostGraph, ordered: CostGraph, slots: int = DEFAULT_ROTOR_SLOTS):
        start = time.perf_counter()
        self.graph = graph
        self.stages = chain_stages(ordered)
        self.costs = chain_costs(graph, self.stages)
        self.solver = None
        self.by_ops: dict = {}
        self.cands: list[_Candidate] | None = None
        if len(self.stages) >= 2:
            c = self.costs
            # Enough for F_all everywhere: every ā, the boundary values, the largest transients.
            top = sum(c.wabar) + sum(c.wa) + max(c.of) + max(c.ob) + 1
            self.solver = rotor.RotorSolver(c, top, slots=slots)
        self.seconds = time.perf_counter() - start

    def _at(self, m: int) -> _Candidate | None:
        sol = self.solver.at_slots(m)
        if sol is None:
            return None
        if sol.ops not in self.by_ops:
            sched = schedule_from_nested(sol.nested(), self.stages)
            self.by_ops[sol.ops] = _Candidate(sched, simulate(self.graph, sched), recompute_time(self.graph, sched))
        return self.by_ops[sol.ops]

    def _all(self) -> list[_Candidate]:
        """The simulated schedule of every slot count from the least feasible one up (built once:
        ``least`` and ``fastest_within`` both read it)."""
        if self.cands is None:
            start = time.perf_counter()
            first = None if self.solver is None else self.solver.least_slots()
            cands = [] if first is None else [self._at(m) for m in range(first, self.solver.slots + 1)]
            self.cands = [c for c in cands if c is not None]
            self.seconds += time.perf_counter() - start
        return self.cands

    def least(self) -> _Candidate | None:
        return min(self._all(), key=lambda c: (c.peak_bytes, c.recompute_time), default=None)

    def fastest_within(self, budget: int) -> _Candidate | None:
        best = None
        for cand in self._all():
            if cand.peak_bytes <= budget:
                best = _better(best, cand)
        return best


def _sources(graph: CostGraph, strategy: str, exact_cap: int | None, rotor_slots: int = DEFAULT_ROTOR_SLOTS):
    """The strategy's candidate sources by name, and the number of lower sets searched."""
    sources, sets, notes = {}, 0, ()
    used = None
    if strategy in _KUSUMOTO:
        family, used = _family(graph, strategy, exact_cap)
        if used == "approx (exact capped)":
            used = "approx"
            notes = (f"the exact DP was skipped: this graph has more than exact_cap={resolve_exact_cap(exact_cap)} "
                     "lower sets (raise exact_cap= to force it)",)
        sources[used], sets = _Solver(graph, family), len(family)
    if strategy == "auto" and used == "exact":
        # The DP optimises an upper bound of the peak, so the approximate family's optimum can
        # simulate lower than the exact one's; it is cheap, so auto looks at both.
        sources["approx"] = _Solver(graph, _family(graph, "approx", exact_cap)[0])
    ordered = _ordered_graph(graph) if strategy in ("auto", "rotor", "chen", "hong", "sequential") else graph
    if strategy in ("auto", "rotor"):
        sources["rotor"] = _Rotor(graph, ordered, rotor_slots)
    if strategy in ("auto", "chen"):
        sources["chen"] = _Fixed(graph, chen.chen_candidates(ordered))
    if strategy in ("auto", "hong"):
        sources["hong"] = _Fixed(graph, hong.hong_candidates(ordered))
    if strategy in ("auto", "sequential"):
        sources["sequential"] = _Fixed(graph, chen.sequential_candidates(ordered))
    return sources, sets, notes


def _least(source) -> _Candidate | None:
    return _least_peak(source) if isinstance(source, _Solver) else source.least()


def _within(source, target: int, least: _Candidate | None) -> _Candidate | None:
    if least is None or least.peak_bytes > target:
        return None
    return _fastest_within(source, target, least) if isinstance(source, _Solver) else source.fastest_within(target)


def choose(graph: CostGraph, budget: Budget, *, strategy: str = "auto", exact_cap: int | None = DEFAULT_EXACT_CAP,
           rotor_slots: int = DEFAULT_ROTOR_SLOTS) -> Choice:
    """Plan ``graph`` under ``budget`` (see the module docstring).

    ``strategy``: ``"exact"``/``"approx"`` (Kusumoto DP), ``"rotor"`` (Beaumont et al. on the
    articulation chain, nested checkpoints), ``"chen"``, ``"hong"``, ``"sequential"`` (chain
    baselines), ``"none"``, or ``"auto"``: the least predicted overhead within the budget (the
    least peak for ``"min"``) among all of them; ``Choice.strategy`` names the winner.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"fxremat: strategy must be one of {STRATEGIES}, got {strategy!r}")
    plain = Schedule((tuple(range(graph.n)),), (False,))
    baseline = simulate(graph, plain)
    target = budget.resolve(baseline)
    if strategy == "none" or (target is not None and target >= baseline):
        if target is not None and target < baseline:
            raise InfeasibleBudgetError(target, baseline)
        return Choice(plain, "none", "time-centric", target or baseline, baseline, baseline, 0, 0.0, 0)
    sources, sets, notes = _sources(graph, strategy, exact_cap, rotor_slots)
    least = {name: _least(src) for name, src in sources.items()}
    if not any(least.values()):
        raise ValueError(f"fxremat: strategy={strategy!r} found no plan for this graph: it has fewer than two "
                         "chain stages (no articulation nodes) or, for 'rotor', no schedule fits in rotor_slots="
                         f"{rotor_slots} slots; use strategy='auto' or 'exact', or raise rotor_slots")
    floor_name = min((n for n in least if least[n]), key=lambda n: (least[n].peak_bytes, least[n].recompute_time))
    floor = least[floor_name]
    seconds = lambda: sum(src.seconds for src in sources.values())  # noqa: E731
    if target is None:
        return Choice(floor.schedule, floor_name, "memory-centric", floor.peak_bytes, baseline,
                      floor.peak_bytes, floor.recompute_time, seconds(), sets, notes)
    if target < floor.peak_bytes:
        raise InfeasibleBudgetError(target, floor.peak_bytes)
    picks = {name: _within(src, target, least[name]) for name, src in sources.items()}
    name = min((n for n in picks if picks[n]), key=lambda n: (picks[n].recompute_time, picks[n].peak_bytes))
    best = picks[name]
    return Choice(best.schedule, name, "time-centric", target, baseline, best.peak_bytes,
                  best.recompute_time, seconds(), sets, notes)


# --------------------------------------------------------------------------------------------
# the memory/overhead trade-off sweep
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
        raise ValueError(f"fxremat.planner.tradeoff: points must be at least 2, got {points}")
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
