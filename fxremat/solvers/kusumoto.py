"""The graph DP of Kusumoto et al. (NeurIPS 2019), ``shared/seeds/003_cbecfbcc99b65757.txt``.

Symbols (defined once here):
- V: call nodes; L ⊆ V a lower set; a strategy is L_1 ⊊ ... ⊊ L_k = V and V_i = L_i \\ L_{i-1}.
- ∂(L): nodes of L with a successor outside L, or that are graph outputs; they are kept.
- canonical strategy: run V_i, keep ∂(L_i), drop the rest of V_i; in the backward, recompute
  V_i from what is kept before back-propagating through it. Here every V_i except the last is a
  non-reentrant checkpoint, and V_k runs plainly (it is back-propagated right after its forward,
  so recomputing it would only cost time).
- T(V_i): cost of recomputing V_i, in one of two weightings (:func:`build_tables`'s
  ``early_stop``). Whole segments (the default): Σ_{v ∈ V_i} (forward + saved-tensor hooks), a
  difference of prefix sums, so a label's time is that of its set. As torch does it
  (:func:`segment_time`, ``early_stop=True``): the forwards of V_i's nodes up to its last node
  that saves a tensor, that node's own forward only if it saves after
  running (its output, a mask; a node saving only its inputs saves them before its kernel runs,
  and torch's non-reentrant checkpoint stops right there), plus the checkpoint's saved-tensor
  hooks of every node in it — what :func:`fxremat.simulate.rerun_time` and
  :func:`~fxremat.simulate.mechanism_time` charge. So a segment that ends in a matrix product
  or convolution does not pay for it; T is then not a difference of prefix sums, and the
  DP's pruning uses the prefix sums of a per-node floor (:func:`time_floor`: the hooks, plus
  the forward of a node that saves after running, which every segment holding it pays). The
  overhead of a strategy is Σ_{i<k} T(V_i). The fixed cost per checkpoint
  (``graph.checkpoint_time``) is left to the planner, which merges segments where that pays.
- m: bytes kept by the strategy so far (the paper's M(U_{i-1})).
- memory of step i (the paper's Eq. 2, re-derived for PyTorch as Hong et al. advise):
  m + K_i + S(V_i) + E(V_i) + G(V_i) + G(∂(L_{i-1})) + W(V_i), where K_i are the bytes of
  V_i's outputs kept for later segments, S the bytes of V_i's values autograd saves
  (recomputed), E its extra saved buffers, G gradient buffers and W the largest transient.
  The last step adds the loss's buffers (``graph.loss_bytes``).
  This is an upper bound of PyTorch's peak (values die as soon as unused);
  :mod:`fxremat.simulate` gives the exact-liveness prediction of a chosen strategy.

:func:`solve` is Algorithm 1 of the paper with its two speed-ups: a sparse table (one dict per
lower set) and skipping dominated (L, t) entries. The family decides exact (all lower sets) vs
approximate ({L^v}); ``objective="time"`` is the time-centric strategy, ``"memory"`` finds the
least peak (the memory-centric budget). Identical inputs give identical outputs (integer
arithmetic only), which the Cython kernels must reproduce.

The work is done by three kernels on plain arrays, :func:`set_tables`, :func:`solve_dp` and
:func:`completion_bounds` (the pure-Python references, below); ``fxremat/_dp.pyx`` has
compiled twins with the same signatures and results, and :mod:`fxremat._kernels` picks one.
:func:`solve` also bounds the search with the approximate family's answer, which provably
leaves the answer unchanged.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, replace

from .. import _kernels
from ..core import CostGraph
from ..lowersets import bits, pack, pruned_family, unpack, words

__all__ = ["Reach", "Solution", "Tables", "build_tables", "completion", "solve", "set_tables", "solve_dp",
           "completion_bounds"]

OBJECTIVES = ("time", "memory")
UNREACHABLE = 2 ** 63 - 1  # completion_bounds: no label of the set can reach V


@dataclass(frozen=True)
class Solution:
    """A strategy: ``lower_sets`` = (L_1, ..., L_k = V) as bitsets, its DP time and peak."""

    lower_sets: tuple[int, ...]
    time: int
    peak_bytes: int


@dataclass(frozen=True)
class Reach:
    """What each set of a family needs to reach V (:func:`completion_bounds`, under ``limit``),
    for the solves of ``budget`` (``None``: unbounded). Sizes only: it serves every time
    weighting of the family, and any budget ≤ ``limit``."""

    budget: int | None
    limit: int | None
    needs: array

    @property
    def least_peak(self) -> int | None:
        """peak* under ``budget``; ``None`` if no strategy fits it."""
        return None if self.needs[0] == UNREACHABLE else self.needs[0]


@dataclass(frozen=True)
class Tables:
    """Per-lower-set quantities of the DP, packed for the kernels.

    ``sets`` is the family (bitsets sorted by size then value, ∅ first, V last). The kernels'
    inputs are flat machine arrays kept as bytes. Bitsets, ``words(n)`` uint64 words per set
    (see :func:`fxremat.lowersets.pack`): ``set_words`` the sets themselves, ``keep_words``
    the storage owners of ∂(L), ``top_words`` the maximal nodes of L (no successor in L; a
    lower set contains L iff it contains them). Int64 per set: ``grad_boundary`` G(∂(L)),
    ``prefix_time`` Σ_{v ∈ L} of :func:`time_floor` (T(V_i) ≥ its difference over the step, the
    bound the compiled kernel prunes with), ``prefix_saved`` Σ_{v ∈ L} (S + E + G). ``coarse`` holds the same
    for the approximate family {L^v} inside ``sets`` (``None`` when that is all of it); its
    solutions bound the search over ``sets`` (see :func:`solve`).
    """

    sets: tuple[int, ...]
    n: int
    set_words: bytes
    keep_words: bytes
    top_words: bytes
    grad_boundary: bytes
    prefix_time: bytes
    prefix_saved: bytes
    early_stop: bool = False
    coarse: Tables | None = None

    @property
    def keep_roots(self) -> tuple[int, ...]:
        """The storage owners of ∂(L) per set, as bitsets."""
        return tuple(unpack(self.keep_words, words(self.n)))


def _view(data: bytes, fmt: str) -> memoryview:
    return memoryview(data).cast(fmt)


def build_tables(graph: CostGraph, family, early_stop: bool = False) -> Tables:
    """Precompute the per-set sums the transitions need (kernel :func:`set_tables`).

    ``early_stop``: segment times as torch runs them (see the module docstring); by default
    every segment is charged all its nodes (T(V_i) = Σ forward + hooks, as if torch recomputed
    the whole segment), so a label's time is T(L) whatever its chain and solves are much
    faster."""
    n, family = graph.n, tuple(family)
    saved_any = [0] * n
    for owners in graph.saved:
        for o in owners:
            saved_any[o] = graph.out_bytes[o]
    additive = [s + e + g for s, e, g in zip(saved_any, graph.extra_bytes, graph.grad_bytes)]
    succ = [sum(1 << s for s in ss) for ss in graph.succs]
    set_words = pack(family, words(n))
    kernel = _kernels.pick(set_tables, "set_tables")
    keep, tops, grad_boundary, prefix_time, prefix_saved = kernel(
        set_words, pack(succ, words(n)), array("B", graph.is_output), array("q", graph.root),
        array("q", graph.grad_bytes), array("q", additive), array("q", [time_floor(graph, v, early_stop) for v in range(n)]))
    tables = Tables(family, n, set_words.tobytes(), keep.tobytes(), tops.tobytes(),
                    grad_boundary.tobytes(), prefix_time.tobytes(), prefix_saved.tobytes(), early_stop)
    coarse = _coarse_indices(graph, family)
    return tables if coarse is None else replace(tables, coarse=_select(tables, coarse))


def time_floor(graph: CostGraph, v: int, early_stop: bool) -> int:
    """What every recomputed segment holding v pays for it: its hooks, and its forward if it
    saves after running (such a node is never past the early stop) or without the early stop
    (then the floor is the whole cost, and T(V_i) the difference of the prefix sums)."""
    return graph.hook_time[v] + (graph.time[v] if not early_stop or graph.stop_kind(v) == 2 else 0)


def segment_time(graph: CostGraph, seg) -> int:
    """T of a recomputed segment (node indices), as the DP counts it: see the module docstring."""
    stops = [v for v in seg if graph.stop_kind(v)]
    hooks = sum(graph.hook_time[v] for v in seg)
    if not stops:
        return hooks
    s = max(stops)
    return hooks + sum(graph.time[v] for v in seg if v < s) + (graph.time[s] if graph.stop_kind(s) == 2 else 0)


def _coarse_indices(graph: CostGraph, family) -> list[int] | None:
    """Indices of ∅, V and the L^v in ``family``; ``None`` when they are all of it."""
    if not family:
        return None
    pruned = set(pruned_family(graph.preds, anchor=graph.anchor))
    last = len(family) - 1
    chosen = [i for i, mask in enumerate(family) if mask in pruned or i in (0, last)]
    return None if len(chosen) == len(family) else chosen


def _select(tables: Tables, rows: list[int]) -> Tables:
    """The sub-table of ``rows`` (ascending, so still sorted by size)."""
    wide = 8 * words(tables.n)

    def pick(data: bytes, size: int) -> bytes:
        return b"".join(data[size * i:size * (i + 1)] for i in rows)

    return Tables(tuple(tables.sets[i] for i in rows), tables.n, pick(tables.set_words, wide),
                  pick(tables.keep_words, wide), pick(tables.top_words, wide),
                  pick(tables.grad_boundary, 8), pick(tables.prefix_time, 8), pick(tables.prefix_saved, 8),
                  tables.early_stop)


def completion(graph: CostGraph, tables: Tables, budget: int | None = None) -> Reach:
    """:func:`completion_bounds` of ``tables`` under the least peak within ``budget`` of the
    approximate family inside it (≥ peak*, so its ``needs[0]`` is peak*), else ``budget``."""
    coarse = None if tables.coarse is None else _run(graph, tables.coarse, budget, "memory", None)
    limit = budget if coarse is None else coarse[2]
    kernel = _kernels.pick(completion_bounds, "completion_bounds")
    return Reach(budget, limit, kernel(*_arrays(graph, tables), limit))


def solve(graph: CostGraph, tables: Tables, *, budget: int | None = None, objective: str = "time",
          time_bound: int | None = None, reach: Reach | None = None):
    """Algorithm 1 over ``tables.sets``; returns a :class:`Solution` or ``None`` if infeasible.

    ``objective="time"``: least overhead with every step's memory ≤ ``budget``.
    ``objective="memory"``: least peak (``budget``, if given, still bounds every step).
    Segment times follow ``tables.early_stop`` (see :func:`build_tables`). ``time_bound``
    (time objective): the time of some chain known to fit ``budget``, which bounds t* (the
    planner passes the whole-segment solution's time under the early stop, see below).
    ``reach``: :func:`completion` of this family (any time weighting), reused across solves.

    Bounds shrink the search without changing the answer (the same for both kernels):

    - time objective: a chain of the approximate family inside ``sets`` (``tables.coarse``) is
      a chain of ``sets`` with the same step costs, so its least time t_c under the same budget
      bounds t*. Times never decrease along a chain (node times ≥ 0, checked), so the optimal
      chain's labels all have t ≤ t_c; a label with t > t_c can only dominate labels with a
      larger t, so dropping all of them (``time_limit``) leaves every label with t ≤ t_c,
      back-pointers included, as it was, and the answer with it. With the early stop a label's
      time depends on its chain and each set keeps a front of them, so a smaller limit saves
      much: from ``time_bound`` (or t_c) the limit starts at a sixteenth and doubles while the
      solve finds nothing (a solve under limit L finds the answer if t* ≤ L, else nothing).
    - memory objective: likewise any P ≥ peak* used as the budget gives the same answer (a
      label with peak > P only dominates labels with a larger peak, and the answer's chain has
      peak* everywhere). :func:`completion` (under the approximate family's least peak, ≥
      peak*) gives what each set needs to reach V, ∅'s being peak* itself, the P used: a label
      whose kept bytes m plus what its set needs exceed P can never complete. Dropping those
      changes no other label: they hold the largest m of their set, so they dominate no label
      that can complete, and what they lead to cannot complete either. The one solve so keeps
      only labels on chains of peak* (GoogLeNet with aux heads, 14,700 lower sets: four
      bisection probes and a solve at 1.03 peak* took ~7 s of CPU, this ~1.6 s). A
      time-objective solve drops them too where its budget is ≤ ``reach.limit``.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"fxremat.solvers.kusumoto.solve: objective must be 'time' or 'memory', got {objective!r}")
    time_limit = None
    timed = objective == "time" and min(graph.time + graph.hook_time, default=0) >= 0
    if tables.coarse is not None and timed:
        coarse = _run(graph, tables.coarse, budget, "time", None)
        time_limit = None if coarse is None else coarse[1]
    if objective == "memory":
        reach = reach if reach is not None and reach.budget == budget else completion(graph, tables, budget)
        if reach.least_peak is None:
            return None
        budget = reach.least_peak
    elif reach is not None and not (budget is not None and reach.limit is not None and budget <= reach.limit):
        reach = None
    if timed and time_bound is not None:
        time_limit = time_bound if time_limit is None else min(time_limit, time_bound)
    limits = [time_limit]
    if timed and tables.early_stop and time_limit is not None:
        while limits[0] > 16:
            limits.insert(0, limits[0] // 2)
        limits = limits[-5:]
    for limit in limits:
        found = _run(graph, tables, budget, objective, limit, None if reach is None else reach.needs)
        if found is not None:
            break
    if found is None:
        return None
    chain, time, peak = found
    return Solution(tuple(tables.sets[j] for j in chain), time, peak)


def _stop_kinds(graph: CostGraph, early_stop: bool) -> list[int]:
    """Per node, :meth:`~fxremat.core.CostGraph.stop_kind`; without the early stop every node
    counts as saving after it runs (kind 2), so a segment pays all its forwards."""
    return [graph.stop_kind(v) if early_stop else 2 for v in range(graph.n)]


def _arrays(graph: CostGraph, tables: Tables) -> tuple:
    """The kernels' leading arguments, from ``sets`` to ``loss_bytes``."""
    return (_view(tables.set_words, "Q"), _view(tables.keep_words, "Q"),
            _view(tables.top_words, "Q"), _view(tables.grad_boundary, "q"),
            _view(tables.prefix_time, "q"), _view(tables.prefix_saved, "q"),
            array("q", graph.out_bytes), array("q", [graph.step_transient(v) for v in range(graph.n)]),
            array("q", graph.time), array("q", graph.hook_time), array("B", _stop_kinds(graph, tables.early_stop)),
            graph.loss_bytes)


def _run(graph: CostGraph, tables: Tables, budget, objective: str, time_limit, reach=None):
    kernel = _kernels.pick(solve_dp, "solve_dp")
    return kernel(*_arrays(graph, tables), budget, objective, time_limit, reach)


# --------------------------------------------------------------------------- reference kernels
# Pure Python, on plain arrays; fxremat/_dp.pyx has compiled kernels with the same signatures
# and identical integer results (tests/test_kernels.py compares them).


class _ChunkTable:
    """Sum (or max) of per-node weights over a bitset, 8 bits at a time."""

    def __init__(self, weights, combine):
        self.combine = combine
        self.nbytes = (len(weights) + 7) // 8
        self.tables = []
        for c in range(self.nbytes):
            chunk = [weights[v] if v < len(weights) else 0 for v in range(8 * c, 8 * c + 8)]
            self.tables.append([combine([chunk[b] for b in range(8) if (x >> b) & 1] or [0]) for x in range(256)])

    def __call__(self, mask: int) -> int:
        data = mask.to_bytes(self.nbytes, "little")
        return self.combine([tab[b] for tab, b in zip(self.tables, data) if b] or [0])


def _boundary(succ, is_output, mask: int) -> int:
    out = 0
    for v in bits(mask):
        if is_output[v] or succ[v] & ~mask:
            out |= 1 << v
    return out


def set_tables(sets, succ, is_output, root, grad, additive, time):
    """Kernel: per packed lower set, ``(keep, tops, grad_boundary, prefix_time, prefix_saved)``.

    ``sets``, ``succ`` (successor bitset per node): packed bitsets; ``is_output`` uint8,
    ``root``, ``grad`` (G), ``additive`` (S + E + G), ``time`` (T): int64 per node. Returns the
    packed bitsets of the storage owners of ∂(L) and int64 arrays of G(∂(L)), T(L) and
    Σ_{v ∈ L} additive[v]; ``tops`` packs the maximal nodes of each set (no successor in it).
    """
    width = words(len(time))
    succ_masks = unpack(succ, width)
    grad_sum, add_sum, time_sum = _ChunkTable(grad, sum), _ChunkTable(additive, sum), _ChunkTable(time, sum)
    keep, tops, grad_boundary, prefix_time, prefix_saved = [], [], array("q"), array("q"), array("q")
    for mask in unpack(sets, width):
        bnd = _boundary(succ_masks, is_output, mask)
        keep.append(sum({1 << root[v] for v in bits(bnd)}))
        tops.append(sum(1 << v for v in bits(mask) if not succ_masks[v] & mask))
        grad_boundary.append(grad_sum(bnd))
        prefix_time.append(time_sum(mask))
        prefix_saved.append(add_sum(mask))
    return pack(keep, width), pack(tops, width), grad_boundary, prefix_time, prefix_saved


def _front(labels: dict, objective: str) -> list:
    """Undominated labels of one set as ``(key, t, m, peak)``, in extension order.

    Time objective: key t -> (m, peak, back); an entry is dominated by one with smaller t and
    no larger m. Memory objective: key (peak, m) -> (t, back); dominated by smaller peak and no
    larger m.
    """
    out, best = [], None
    for key in sorted(labels):
        if objective == "time":
            t, (m, peak, _) = key, labels[key]
        else:
            (peak, m), t = key, labels[key][0]
        if best is None or m < best:
            out.append((key, t, m, peak))
            best = m
    return out


def _relax(target: dict, objective: str, t: int, m: int, peak: int, back) -> None:
    if objective == "time":
        old = target.get(t)
        if old is None or m < old[0] or (m == old[0] and peak < old[1]):
            target[t] = (m, peak, back)
        return
    old = target.get((peak, m))
    if old is None or t < old[0]:
        target[(peak, m)] = (t, back)


def _steps(sets, keep_roots, grad_boundary, prefix_saved, out_bytes, transient, loss_bytes: int):
    """``step(j, k)``: ``(kept, memory)`` of the step L_j -> L_k above m (the paper's Eq. 2 less
    m, the loss's buffers included when L_k = V), or ``None`` if L_j ⊄ L_k."""
    out_sum, transient_max = _ChunkTable(out_bytes, sum), _ChunkTable(transient, max)
    last = len(sets) - 1

    def step(j: int, k: int):
        if sets[j] & ~sets[k]:
            return None
        seg = sets[k] & ~sets[j]
        kept = out_sum(keep_roots[k] & seg)
        memory = kept + prefix_saved[k] - prefix_saved[j] + grad_boundary[j] + transient_max(seg)
        return kept, memory + (loss_bytes if k == last else 0)

    return step


def completion_bounds(sets, keep, tops, grad_boundary, prefix_time, prefix_saved, out_bytes, transient,
                      time, hook, stop, loss_bytes: int, budget: int | None):
    """Kernel: per set L_j, the bytes ``needs[j]`` a label there needs above its kept bytes m to
    reach V within ``budget`` (``UNREACHABLE`` when none can); an int64 array whose first entry,
    ∅'s, is the least peak of any strategy.

    j descending from V (needs[V] = 0): over the steps L_j -> L_k whose memory is ≤ the budget,
    the least max(step memory, kept + needs[k]); ``UNREACHABLE`` if that exceeds the budget.
    A label reaching V takes such steps, so its m + needs[j] ≤ budget, and the DP may drop
    the others (:func:`solve_dp`'s ``reach``). Arguments as :func:`solve_dp`'s (times unused)."""
    width = words(len(out_bytes))
    sets = unpack(sets, width)
    step = _steps(sets, unpack(keep, width), grad_boundary, prefix_saved, out_bytes, transient, loss_bytes)
    limit = budget if budget is not None else float("inf")
    needs = array("q", [UNREACHABLE] * len(sets))
    needs[-1] = 0
    for j in reversed(range(len(sets) - 1)):
        values = [max(found[1], found[0] + needs[k]) for k in range(j + 1, len(sets))
                  if needs[k] != UNREACHABLE and (found := step(j, k)) and found[1] <= limit]
        best = min(values, default=None)
        if best is not None and best <= limit:
            needs[j] = best
    return needs


def solve_dp(sets, keep, tops, grad_boundary, prefix_time, prefix_saved, out_bytes, transient,
             time, hook, stop, loss_bytes: int, budget: int | None, objective: str, time_limit: int | None = None,
             reach=None):
    """Kernel: Algorithm 1 over a packed family; ``(chain, t, peak)`` or ``None``.

    ``sets``/``keep``: packed bitsets (L and the storage owners of ∂(L)) sorted by size, ∅
    first and V last; ``grad_boundary``, ``prefix_time``, ``prefix_saved``: int64 per set (see
    :class:`Tables`); ``out_bytes``, ``transient``, ``time`` (forward), ``hook``: int64 per node;
    ``stop``: uint8 per node (:meth:`~fxremat.core.CostGraph.stop_kind`). A step's time is
    :func:`segment_time` of the segment, from these. ``chain`` holds the indices of L_1, ...,
    L_k = V in ``sets``. Labels with a time above ``time_limit`` are dropped, and with ``reach``
    (:func:`completion_bounds` under a budget ≥ this one) those whose kept bytes plus what their
    set needs exceed the budget: they never reach V and dominate no label that does, so the
    answer stays. ``tops`` (packed subsets of each set, e.g. its maximal nodes) and
    ``prefix_time`` only speed up the compiled kernel's search for supersets; this reference
    tests every pair.
    """
    width = words(len(out_bytes))
    sets = unpack(sets, width)
    step_memory = _steps(sets, unpack(keep, width), grad_boundary, prefix_saved, out_bytes, transient, loss_bytes)
    time_sum, hook_sum = _ChunkTable(time, sum), _ChunkTable(hook, sum)
    stops = sum(1 << v for v, kind in enumerate(stop) if kind)

    def step_time(seg: int) -> int:
        last = seg & stops
        if not last:
            return hook_sum(seg)
        s = last.bit_length() - 1
        return hook_sum(seg) + time_sum(seg & ((1 << s) - 1)) + (time[s] if stop[s] == 2 else 0)

    count = len(sets)
    labels: list[dict] = [dict() for _ in range(count)]
    labels[0][0 if objective == "time" else (0, 0)] = (0, 0, None) if objective == "time" else (0, None)
    limit = budget if budget is not None else float("inf")
    for j in range(count):
        front = _front(labels[j], objective)
        if not front:
            continue
        for k in range(j + 1, count):
            found = step_memory(j, k)
            if found is None:
                continue
            kept, step = found
            dt = 0 if k == count - 1 else step_time(sets[k] & ~sets[j])
            for key, t, m, peak in front:
                mem = m + step
                if (mem <= limit and (time_limit is None or t + dt <= time_limit)
                        and (reach is None or reach[k] != UNREACHABLE and m + kept + reach[k] <= limit)):
                    _relax(labels[k], objective, t + dt, m + kept, max(peak, mem), (j, key))
    return _best(labels, objective)


def _best(labels, objective: str):
    final = labels[-1]
    if not final:
        return None
    if objective == "time":
        key = min(final)
        t, peak = key, final[key][1]
    else:
        key = min(final, key=lambda pm: (pm[0], final[pm][0], pm[1]))
        t, peak = final[key][0], key[0]
    chain, j = [], len(labels) - 1
    while j != 0:
        chain.append(j)
        j, key = labels[j][key][-1]
    return tuple(reversed(chain)), t, peak
