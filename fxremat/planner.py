"""Choose a strategy for a budget: Kusumoto DP candidates checked by the liveness simulator.

The DP's per-step memory is an upper bound of what PyTorch allocates, so a plan solved for the
budget B itself fits, but often with room to spare. :func:`choose` therefore bisects the DP
budget B' ≥ B, keeping the fastest plan whose *simulated* peak is within B. ``budget="min"``
takes the least simulated peak among the memory-centric plan and time-centric plans near it;
that peak is the smallest feasible budget reported by :class:`~fxremat.InfeasibleBudgetError`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

from .budget import Budget
from .errors import InfeasibleBudgetError
from .core import CostGraph, Schedule
from .lowersets import all_lower_sets, pruned_family
from .records import PLAN_STRATEGIES
from .simulate import mechanism_time, rerun_time, simulate
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
    # every strategy's best plan at no more memory: (strategy, schedule, peak, recompute time),
    # by predicted time, the chosen one first; what autotune times for real
    alternatives: tuple[tuple[str, Schedule, int, int], ...] = ()


@dataclass(frozen=True)
class _Candidate:
    schedule: Schedule
    peak_bytes: int
    recompute_time: int


def resolve_exact_cap(cap: int | None) -> int:
    """The cap on lower sets for the exact DP: ``cap``, or the default of the kernels in use."""
    return _EXACT_CAP[_kernels.current()] if cap is None else cap


def _family(graph: CostGraph, strategy: str, cap: int | None) -> tuple[list[int], str, str | None]:
    """The lower sets the DP searches: ``(family, "exact" or "approx", note)``; the note says why
    ``"exact"`` fell back to the approximate family (more than ``cap`` lower sets)."""
    cap = resolve_exact_cap(cap)
    preds = graph.ordered_preds
    if strategy == "approx":
        return pruned_family(preds, anchor=graph.anchor), "approx", None
    family = all_lower_sets(preds, cap=cap, anchor=graph.anchor)
    if family is not None:
        return family, "exact", None
    if strategy == "exact":
        raise ValueError(
            f"fxremat: strategy='exact' needs more than exact_cap={cap} lower sets for this graph "
            f"({graph.n} nodes); raise exact_cap= or use strategy='approx' or 'auto'"
        )
    log.info("fxremat: more than exact_cap=%d lower sets in this graph; using the approximate DP", cap)
    note = (f"the exact DP was skipped: this graph has more than exact_cap={cap} lower sets "
            "(raise exact_cap= to force it)")
    return pruned_family(preds, anchor=graph.anchor), "approx", note


def recompute_time(graph: CostGraph, sched: Schedule) -> int:
    """What the schedule adds to a step: the forward cost run again in the backward (every
    recomputed segment up to torch's early stop, plus what its nested checkpoints run again,
    :func:`~fxremat.simulate.rerun_time`) and the checkpoint mechanism's own time
    (:func:`~fxremat.simulate.mechanism_time`)."""
    return sum(rerun_time(graph, seg, sched.inner_of(i)) + mechanism_time(graph, seg, sched.inner_of(i))
               for i, (seg, rec) in enumerate(zip(sched.segments, sched.recomputed)) if rec)


def _candidate(graph: CostGraph, sched: Schedule) -> _Candidate:
    return _Candidate(sched, simulate(graph, sched), recompute_time(graph, sched))


# Of a step: plans closer than this by the measured model are told apart by fewer checkpoints,
# then the lower peak (a merge of two checkpoints may cost this much), not by the noise.
MERGE_SLACK = 0.015


def _on_clock(graph: CostGraph) -> bool:
    """Whether ``graph``'s times were measured on a clock (``cost_model="measured"``)."""
    return graph.cost_unit == "ms" and graph.time_unit > 0


def _slack(graph: CostGraph) -> int:
    """``MERGE_SLACK`` of a step in ``time`` units where the costs are measured on a clock, 0
    otherwise (FLOP and uniform costs do not move between runs)."""
    if not _on_clock(graph):
        return 0
    return int(MERGE_SLACK * graph.step_cost / graph.time_unit)


def _pick(cands, slack: int = 0, fastest: int | None = None) -> _Candidate | None:
    """The fastest of ``cands`` (``None`` entries skipped); of those within ``slack`` of the
    fastest (closer than a measured profile resolves), the one with the lower peak. Measured
    from the fastest (``fastest``: a recompute time known to be reached), not pair by pair: a
    chain of near ties does not drift to a slow plan."""
    cands = [c for c in cands if c is not None]
    if not cands:
        return None
    least_time = min(c.recompute_time for c in cands)
    limit = max(least_time, (least_time if fastest is None else fastest) + slack)
    return min((c for c in cands if c.recompute_time <= limit), key=lambda c: (c.peak_bytes, c.recompute_time))


def _fewer_checkpoints(graph: CostGraph, cand: _Candidate, budget: int) -> _Candidate:
    """``cand`` with adjacent recomputed segments merged into one checkpoint (fewer, larger
    segments) wherever the simulated peak stays within ``budget`` and the recompute time stays
    within ``MERGE_SLACK`` of a step above ``cand``'s; nested schedules are left as they are.

    A merge saves one checkpoint's fixed cost; when the DP still prefers the split, the two plans
    are closer than a measured profile resolves, and a plan that followed the noise would change
    from one run to the next (measured on the 4-block transformer at 0.6: one segment of 57
    nodes or 54 + 3, with the fitted per-checkpoint cost between 0.06 and 0.12 ms). The one
    with fewer checkpoints is then every run's pick. Only costs measured on a clock are merged
    (also where the calibration fitted the mechanism to 0: with glibc's default heap its steps
    spread more than a checkpoint costs)."""
    if not _on_clock(graph) or any(x is not None for x in cand.schedule.inner or ()):
        return cand
    limit = cand.recompute_time + _slack(graph)
    best = cand
    while True:
        segs, rec = best.schedule.segments, best.schedule.recomputed
        trials = [_candidate(graph, Schedule(segs[:i] + (tuple(sorted(segs[i] + segs[i + 1])),) + segs[i + 2:],
                                             rec[:i] + (True,) + rec[i + 2:]))
                  for i in range(len(segs) - 1) if rec[i] and rec[i + 1]]
        fits = [t for t in trials if t.peak_bytes <= budget and t.recompute_time <= limit]
        if not fits:
            return best
        best = min(fits, key=lambda t: (t.recompute_time, t.peak_bytes))


class _Source:
    """Where a strategy's candidate plans come from. Every source answers the same two
    questions — its least simulated peak, and its fastest plan within a budget — and counts the
    seconds spent in its solver (``seconds``)."""

    seconds: float = 0.0
    fastest_time: int | None = None  # the least recompute time fastest_within saw (before ties)

    def least(self) -> _Candidate | None:
        """The candidate with the least simulated peak (then the least recompute time)."""
        raise NotImplementedError

    def fastest_within(self, budget: int, least: _Candidate) -> _Candidate | None:
        """The least recompute time among candidates simulated within ``budget`` (``least`` is
        this source's :meth:`least`, which fits)."""
        raise NotImplementedError


# The early-stop weighting searches the exact family only up to this many lower sets (its
# solves keep a front per set and cost tens of ms there); beyond, the approximate family's.
EARLY_STOP_CAP = 1000
GRID_UNITS = 1000  # the early-stop DP's time grid: one plain step is this many units


def on_time_grid(graph: CostGraph, units: int = GRID_UNITS) -> CostGraph:
    """``graph`` with forward and hook times on a grid of ``units`` per plain step.

    With the early stop a label's time depends on its whole chain, so the DP keeps a front of
    (time, kept bytes) per lower set, as long as the number of distinct times; on this grid it
    is at most ``units`` (a resolution of 1/``units`` of a step), which keeps solves fast. Times
    are rounded as prefix sums in graph order, so any run of consecutive nodes is off by less
    than one unit. Candidates are then simulated on ``graph`` itself."""
    step = graph.step_cost / graph.time_unit if graph.time_unit > 0 else 0
    if step <= 0:
        return graph

    def snap(values):
        ends = [round(p * units / step) for p in itertools.accumulate(values)]
        return tuple(max(0, b - a) for a, b in zip([0] + ends[:-1], ends))

    return dataclasses.replace(graph, time=snap(graph.time), hook_time=snap(graph.hook_time))


class _KusumotoDP(_Source):
    """The Kusumoto DP over one family of lower sets. Its per-step memory is an upper bound, so
    the DP budget is searched: the simulator decides what fits. With ``early_stop`` each search
    runs under both of the DP's time weightings (:func:`fxremat.solvers.kusumoto.build_tables`):
    the early stop is what torch does, but where the memory bound is loose, the chain it prefers
    at a DP budget can simulate higher than the one whole-segment costs prefer (the 4-block
    transformer's least peak: 6.6 MiB against 4.3 with its ladder), so each search keeps the
    better simulated of the two. The early-stop solves run on :func:`on_time_grid`."""

    def __init__(self, graph: CostGraph, family, early_stop: bool = True):
        self.graph, self.early_stop, self.seconds = graph, early_stop, 0.0
        self.whole_segments: _Candidate | None = None  # see fastest_within
        self.reach: kusumoto.Reach | None = None  # of the least-peak solve, for the solves after it
        start = time.perf_counter()
        self.weightings = {False: (graph, kusumoto.build_tables(graph, family, early_stop=False))}
        if early_stop:
            grid = on_time_grid(graph)
            self.weightings[True] = (grid, kusumoto.build_tables(grid, family, early_stop=True))
        self.seconds += time.perf_counter() - start

    def _solve(self, budget=None, objective="time", early_stop=False, bound=None):
        """Return ``(dp_solution, simulated candidate)``, both ``None`` when infeasible.
        ``bound`` (whole segments, time objective): the DP time of a chain known to fit
        ``budget`` (one solved at a smaller budget), which bounds the answer's
        (:func:`fxremat.solvers.kusumoto.solve`'s ``time_bound``)."""
        start = time.perf_counter()
        graph, tables = self.weightings[early_stop]
        if early_stop and objective == "time":
            # the whole-segment chain fits the same DP budget: its time under the early stop
            # bounds the answer's, which keeps the fronts short (kusumoto.solve)
            whole = kusumoto.solve(self.graph, self.weightings[False][1], budget=budget, reach=self.reach)
            if whole is None:
                self.seconds += time.perf_counter() - start
                return None, None
            bound = sum(kusumoto.segment_time(graph, seg) for seg in Schedule.from_lower_sets(whole.lower_sets).segments[:-1])
        if objective == "memory" and self.reach is None:
            self.reach = kusumoto.completion(self.graph, self.weightings[False][1])
        sol = kusumoto.solve(graph, tables, budget=budget, objective=objective, time_bound=bound, reach=self.reach)
        self.seconds += time.perf_counter() - start
        if sol is None:
            return None, None
        return sol, _candidate(self.graph, Schedule.from_lower_sets(sol.lower_sets))

    def least(self) -> _Candidate:
        """The memory-centric plan, or a time-centric one near it that simulates lower. The
        ladder's budgets rise, so each solution fits the next budget and bounds its time; what
        each lower set needs to reach V (``reach``, from the first solve) cuts them all."""
        sol, best = self._solve(objective="memory")
        bound = sol.time
        for factor in _MIN_LADDER:
            found, cand = self._solve(int(sol.peak_bytes * factor), bound=bound)
            bound = found.time
            if cand is not None and (cand.peak_bytes, cand.recompute_time) < (best.peak_bytes, best.recompute_time):
                best = cand
        if self.early_stop:  # the same least DP peak, its chain picked by time as torch runs it
            _, cand = self._solve(objective="memory", early_stop=True)
            best = min(best, cand, key=lambda c: (c.peak_bytes, c.recompute_time))
        return best

    def fastest_within(self, budget: int, least: _Candidate) -> _Candidate | None:
        """Bisect the DP budget in [budget, DP peak of no recomputation], under each weighting.
        With the early stop, the fastest plan found under the whole-segment weighting alone is
        kept too (``whole_segments``): a candidate for ``autotune`` where the two disagree."""
        fits = [least] if least.peak_bytes <= budget else []
        whole = []
        plain_sol, _ = self._solve()
        for early_stop in self.weightings:
            lo, hi = budget, max(budget, plain_sol.peak_bytes)
            first, cand = self._solve(lo, early_stop=early_stop)
            found = [cand]
            # every budget tried is at least lo: the chain solved there fits it and bounds its time
            bound = None if early_stop or first is None else first.time
            for _ in range(_BISECT_STEPS):
                if hi - lo <= max(1, budget // 256):
                    break
                mid = (lo + hi) // 2
                _, cand = self._solve(mid, early_stop=early_stop, bound=bound)
                found.append(cand)
                if cand is not None and cand.peak_bytes <= budget:
                    lo = mid
                else:
                    hi = mid
            for cand in found:
                if cand is not None and cand.peak_bytes <= budget:
                    fits.append(cand)
                    if not early_stop and self.early_stop:
                        whole.append(cand)
        self.whole_segments = _pick(whole, _slack(self.graph))
        self.fastest_time = min((c.recompute_time for c in fits), default=None)
        return _pick(fits, _slack(self.graph))


class _Enumerated(_Source):
    """A source with a finite list of candidates (:meth:`candidates`), each simulated once."""

    def candidates(self) -> list[_Candidate]:
        raise NotImplementedError

    def least(self) -> _Candidate | None:
        return min(self.candidates(), key=lambda c: (c.peak_bytes, c.recompute_time), default=None)

    def fastest_within(self, budget: int, least: _Candidate) -> _Candidate | None:
        fits = [c for c in self.candidates() if c.peak_bytes <= budget]
        fits += [least] if least not in fits and least.peak_bytes <= budget else []  # merged by choose
        self.fastest_time = min((c.recompute_time for c in fits), default=None)
        return _pick(fits, _slack(self.graph))


class _Chain(_Enumerated):
    """The chain baselines (Chen, Hong, ``checkpoint_sequential``): lower-set sequences given
    up front."""

    def __init__(self, graph: CostGraph, sequences):
        start = time.perf_counter()
        self.graph = graph
        self.cands = [_candidate(graph, Schedule.from_lower_sets(seq)) for seq in sequences]
        self.seconds = time.perf_counter() - start

    def candidates(self) -> list[_Candidate]:
        return self.cands


class _Rotor(_Enumerated):
    """Rotor (Beaumont et al.) on the articulation chain. One DP table serves every memory
    budget up to the no-recomputation peak, in ``slots`` steps; since the chain model is an
    estimate, the schedule of every step is simulated (each distinct one once) and the
    simulator decides."""

    def __init__(self, graph: CostGraph, slots: int = DEFAULT_ROTOR_SLOTS):
        start = time.perf_counter()
        self.graph = graph
        self.stages = chain_stages(graph)
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
            self.by_ops[sol.ops] = _candidate(self.graph, schedule_from_nested(sol.nested(), self.stages))
        return self.by_ops[sol.ops]

    def candidates(self) -> list[_Candidate]:
        """The simulated schedule of every slot count from the least feasible one up (built once)."""
        if self.cands is None:
            start = time.perf_counter()
            first = None if self.solver is None else self.solver.least_slots()
            cands = [] if first is None else [self._at(m) for m in range(first, self.solver.slots + 1)]
            self.cands = [c for c in cands if c is not None]
            self.seconds += time.perf_counter() - start
        return self.cands


def _sources(graph: CostGraph, strategy: str, exact_cap: int | None, rotor_slots: int = DEFAULT_ROTOR_SLOTS,
             nested: bool = True, early_stop: bool = False):
    """The strategy's candidate sources by name, the number of lower sets searched, and notes."""
    sources: dict[str, _Source] = {}
    sets, notes, used = 0, (), None
    if strategy in _KUSUMOTO:
        family, used, note = _family(graph, strategy, exact_cap)
        notes = (note,) if note else ()
        capped = used == "exact" and len(family) > EARLY_STOP_CAP
        sources[used], sets = _KusumotoDP(graph, family, early_stop and not capped), len(family)
    if strategy == "auto" and used == "exact":
        # The DP optimises an upper bound of the peak, so the approximate family's optimum can
        # simulate lower than the exact one's; it is cheap, so auto looks at both.
        sources["approx"] = _KusumotoDP(graph, _family(graph, "approx", exact_cap)[0], early_stop)
    if strategy == "rotor" or (strategy == "auto" and nested):
        sources["rotor"] = _Rotor(graph, rotor_slots)
    if strategy in ("auto", "chen"):
        sources["chen"] = _Chain(graph, chen.chen_candidates(graph))
    if strategy in ("auto", "hong"):
        sources["hong"] = _Chain(graph, hong.hong_candidates(graph))
    if strategy in ("auto", "sequential"):
        sources["sequential"] = _Chain(graph, chen.sequential_candidates(graph))
    return sources, sets, notes


def choose(graph: CostGraph, budget: Budget, *, strategy: str = "auto", exact_cap: int | None = DEFAULT_EXACT_CAP,
           rotor_slots: int = DEFAULT_ROTOR_SLOTS, plain_peak_bytes: int | None = None, nested: bool = True,
           early_stop: bool = False, least_if_below: bool = False) -> Choice:
    """Plan ``graph`` under ``budget`` (see the module docstring).

    ``least_if_below``: a budget below the least feasible peak plans for that least (as
    ``budget="min"``) instead of raising :class:`~fxremat.InfeasibleBudgetError`; the caller
    tells by ``Choice.objective`` (``"memory-centric"``).

    ``plain_peak_bytes``: the model's own peak without fxremat, where it is not the graph's
    (a captured model whose plain code takes other paths, see :mod:`fxremat.passes.capture`):
    a fraction budget is a fraction of it, and it is the reported ``baseline_peak_bytes``.
    ``nested=False``: ``"auto"`` leaves out rotor's nested checkpoints (a compiled step does not
    keep them: see :func:`fxremat.compile`'s ``backend``).
    ``early_stop=True``: the Kusumoto sources also solve with torch's early stop charged
    (:class:`_KusumotoDP`; an exact family above ``EARLY_STOP_CAP`` lower sets does not, and then
    only ``"auto"``'s approximate source carries it). Off by default here; :func:`fxremat.compile`
    turns it on with a compiler backend, whose AOTAutograd backward recomputes no more than it
    reads and has no checkpoint mechanism (under Inductor on this CPU the ResNet chain at 0.5 ran
    1.04x plain Inductor against 1.12x). By the cost models the plans it adds are far cheaper
    (DenseNet-161 at 0.6: 2.5% against 13.6%), but through torch's checkpoint in eager they ran
    slower: the mechanism of their many small segments is undercounted (the ResNet chain at 0.6:
    +28.0% for +17.3% predicted, against +17.5% for the whole-segment plan;
    benchmarks/results/early_stop.md).

    ``strategy``: ``"exact"``/``"approx"`` (Kusumoto DP), ``"rotor"`` (Beaumont et al. on the
    articulation chain, nested checkpoints), ``"chen"``, ``"hong"``, ``"sequential"`` (chain
    baselines), ``"none"``, or ``"auto"``: the least predicted overhead within the budget (the
    least peak for ``"min"``) among all of them; ``Choice.strategy`` names the winner.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"fxremat: strategy must be one of {STRATEGIES}, got {strategy!r}")
    plain = Schedule.plain(graph.n)
    plain_peak = simulate(graph, plain)
    baseline = plain_peak if plain_peak_bytes is None else plain_peak_bytes
    target = budget.resolve(baseline)
    if strategy == "none" or (target is not None and target >= plain_peak):
        if target is not None and target < plain_peak:
            raise InfeasibleBudgetError(target, plain_peak)
        return Choice(schedule=plain, strategy="none", objective="time-centric", budget_bytes=target or plain_peak,
                      baseline_peak_bytes=baseline, peak_bytes=plain_peak, recompute_time=0, solve_seconds=0.0,
                      num_lower_sets=0)
    sources, sets, notes = _sources(graph, strategy, exact_cap, rotor_slots, nested, early_stop)
    least = {name: src.least() for name, src in sources.items()}
    if not any(least.values()):
        raise ValueError(f"fxremat: strategy={strategy!r} found no plan for this graph: it has fewer than two "
                         "chain stages (no articulation nodes) or, for 'rotor', no schedule fits in rotor_slots="
                         f"{rotor_slots} slots; use strategy='auto' or 'exact', or raise rotor_slots")
    if target is None or target < min(c.peak_bytes for c in least.values() if c):
        # Merging checkpoints can lower a plan's peak, and not every source's least by as much:
        # the least peak is the least after merging (timm xception41 at "min": the approximate
        # family's 15.38 MB merged to 13.55 MB, the exact one's 15.32 MB only to 13.75 MB).
        least = {n: None if c is None else _fewer_checkpoints(graph, c, c.peak_bytes) for n, c in least.items()}
    floor_name = min((n for n in least if least[n]), key=lambda n: (least[n].peak_bytes, least[n].recompute_time))
    floor = least[floor_name]
    seconds = lambda: sum(src.seconds for src in sources.values())  # noqa: E731
    if target is not None and target < floor.peak_bytes and least_if_below:
        target = None
    if target is None:
        ties = {n: c for n, c in least.items() if c is not None and c.peak_bytes <= floor.peak_bytes}
        floor_name = min(ties, key=lambda n: (ties[n].recompute_time, ties[n].peak_bytes))
        floor = ties[floor_name]
        return Choice(schedule=floor.schedule, strategy=floor_name, objective="memory-centric",
                      budget_bytes=floor.peak_bytes, baseline_peak_bytes=baseline, peak_bytes=floor.peak_bytes,
                      recompute_time=floor.recompute_time, solve_seconds=seconds(), num_lower_sets=sets, notes=notes,
                      alternatives=_alternatives(ties.items()))
    if target < floor.peak_bytes:
        raise InfeasibleBudgetError(target, floor.peak_bytes)
    picks = {name: src.fastest_within(target, least[name]) for name, src in sources.items()
             if least[name] is not None and least[name].peak_bytes <= target}
    picks = {n: _fewer_checkpoints(graph, c, target) for n, c in picks.items() if c}
    reached = [src.fastest_time for n, src in sources.items() if n in picks and src.fastest_time is not None]
    best = _pick(picks.values(), _slack(graph), min(reached, default=None))
    name = next(n for n, c in picks.items() if c is best)
    whole = [(n, _fewer_checkpoints(graph, src.whole_segments, target)) for n, src in sources.items()
             if n in picks and isinstance(src, _KusumotoDP) and src.whole_segments is not None]
    return Choice(schedule=best.schedule, strategy=name, objective="time-centric", budget_bytes=target,
                  baseline_peak_bytes=baseline, peak_bytes=best.peak_bytes, recompute_time=best.recompute_time,
                  solve_seconds=seconds(), num_lower_sets=sets, notes=notes,
                  alternatives=_alternatives([*picks.items(), *whole]))


def _alternatives(picks) -> tuple[tuple[str, Schedule, int, int], ...]:
    """Distinct schedules of ``picks`` (``(strategy, candidate)`` pairs) by (recompute time, peak):
    the first is the choice."""
    seen, found = set(), []
    for name, c in sorted(picks, key=lambda p: (p[1].recompute_time, p[1].peak_bytes)):
        key = (c.schedule.segments, c.schedule.recomputed, c.schedule.inner)
        if key not in seen:
            seen.add(key)
            found.append((name, c.schedule, c.peak_bytes, c.recompute_time))
    return tuple(found)


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
