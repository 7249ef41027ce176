"""The graph DP of Kusumoto et al. (NeurIPS 2019), ``shared/seeds/003_cbecfbcc99b65757.txt``.

Symbols (defined once here):
- V: call nodes; L ⊆ V a lower set; a strategy is L_1 ⊊ ... ⊊ L_k = V and V_i = L_i \\ L_{i-1}.
- ∂(L): nodes of L with a successor outside L, or that are graph outputs; they are kept.
- canonical strategy: run V_i, keep ∂(L_i), drop the rest of V_i; in the backward, recompute
  V_i from what is kept before back-propagating through it. Here every V_i except the last is a
  non-reentrant checkpoint, and V_k runs plainly (it is back-propagated right after its forward,
  so recomputing it would only cost time).
- T(V_i): cost of recomputing V_i, Σ ``graph.recompute_cost(v)`` (each node's forward, plus the
  checkpoint's saved-tensor hooks for nodes that save tensors); the overhead of a strategy is
  Σ_{i<k} T(V_i), since torch recomputes the whole segment. The fixed cost per checkpoint
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

The work is done by two kernels on plain arrays, :func:`set_tables` and :func:`solve_dp`
(the pure-Python references, below); ``fxremat/_dp.pyx`` has compiled twins with the same
signatures and results, and :mod:`fxremat._kernels` picks one. :func:`solve` also bounds the
search with the approximate family's answer, which provably leaves the answer unchanged.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, replace

from .. import _kernels
from ..core import CostGraph
from ..lowersets import bits, pack, pruned_family, unpack, words

__all__ = ["Solution", "Tables", "build_tables", "solve", "set_tables", "solve_dp"]

OBJECTIVES = ("time", "memory")


@dataclass(frozen=True)
class Solution:
    """A strategy: ``lower_sets`` = (L_1, ..., L_k = V) as bitsets, its DP time and peak."""

    lower_sets: tuple[int, ...]
    time: int
    peak_bytes: int


@dataclass(frozen=True)
class Tables:
    """Per-lower-set quantities of the DP, packed for the kernels.

    ``sets`` is the family (bitsets sorted by size then value, ∅ first, V last). The kernels'
    inputs are flat machine arrays kept as bytes. Bitsets, ``words(n)`` uint64 words per set
    (see :func:`fxremat.lowersets.pack`): ``set_words`` the sets themselves, ``keep_words``
    the storage owners of ∂(L), ``top_words`` the maximal nodes of L (no successor in L; a
    lower set contains L iff it contains them). Int64 per set: ``grad_boundary`` G(∂(L)),
    ``prefix_time`` T(L), ``prefix_saved`` Σ_{v ∈ L} (S + E + G). ``coarse`` holds the same
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
    coarse: Tables | None = None

    @property
    def keep_roots(self) -> tuple[int, ...]:
        """The storage owners of ∂(L) per set, as bitsets."""
        return tuple(unpack(self.keep_words, words(self.n)))


def _view(data: bytes, fmt: str) -> memoryview:
    return memoryview(data).cast(fmt)


def build_tables(graph: CostGraph, family) -> Tables:
    """Precompute the per-set sums the transitions need (kernel :func:`set_tables`)."""
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
        array("q", graph.grad_bytes), array("q", additive), array("q", [graph.recompute_cost(v) for v in range(n)]))
    tables = Tables(family, n, set_words.tobytes(), keep.tobytes(), tops.tobytes(),
                    grad_boundary.tobytes(), prefix_time.tobytes(), prefix_saved.tobytes())
    coarse = _coarse_indices(graph, family)
    return tables if coarse is None else replace(tables, coarse=_select(tables, coarse))


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
                  pick(tables.grad_boundary, 8), pick(tables.prefix_time, 8), pick(tables.prefix_saved, 8))


def solve(graph: CostGraph, tables: Tables, *, budget: int | None = None, objective: str = "time"):
    """Algorithm 1 over ``tables.sets``; returns a :class:`Solution` or ``None`` if infeasible.

    ``objective="time"``: least overhead with every step's memory ≤ ``budget``.
    ``objective="memory"``: least peak (``budget``, if given, still bounds every step).

    Bounds shrink the search without changing the answer (the same for both kernels):

    - time objective: a chain of the approximate family inside ``sets`` (``tables.coarse``) is
      a chain of ``sets`` with the same step costs, so its least time t_c under the same budget
      bounds t*. Times never decrease along a chain (node times ≥ 0, checked), so the optimal
      chain's labels all have t ≤ t_c; a label with t > t_c can only dominate labels with a
      larger t, so dropping all of them (``time_limit``) leaves every label with t ≤ t_c,
      back-pointers included, as it was, and the answer with it.
    - memory objective: likewise any P ≥ peak* used as the budget gives the same answer (a
      label with peak > P only dominates labels with a larger peak, and the answer's chain has
      peak* everywhere). P starts at the approximate family's least peak and is lowered by
      bisection: a time-objective solve with budget ``mid`` fails (peak* > mid) or returns a
      chain whose peak is the new P. The final solve then keeps only labels near peak*. (The
      reference kernel scans every pair in each solve, so it skips the bisection.)
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"fxremat.solvers.kusumoto.solve: objective must be 'time' or 'memory', got {objective!r}")
    time_limit = None
    if tables.coarse is not None and objective == "time" and min(graph.time, default=0) >= 0:
        coarse = _run(graph, tables.coarse, budget, "time", None)
        time_limit = None if coarse is None else coarse[1]
    elif tables.coarse is not None and objective == "memory":
        budget = _peak_bound(graph, tables, budget)
    found = _run(graph, tables, budget, objective, time_limit)
    if found is None:
        return None
    chain, time, peak = found
    return Solution(tuple(tables.sets[j] for j in chain), time, peak)


# Bisection probes per implementation (a compiled probe costs little next to what it saves).
_PEAK_PROBES = {"python": 0, "cython": 12}


def _peak_bound(graph: CostGraph, tables: Tables, budget):
    """A P with peak* ≤ P ≤ ``budget``, close to peak* (see :func:`solve`)."""
    coarse = _run(graph, tables.coarse, budget, "memory", None)
    if coarse is None:
        return budget
    low, high = 0, coarse[2]
    for _ in range(_PEAK_PROBES[_kernels.current()]):
        if high - low <= abs(high) // 1024:
            break
        mid = (low + high) // 2
        found = _run(graph, tables, mid, "time", None)
        if found is None:
            low = mid + 1
        else:
            high = found[2]
    return high


def _run(graph: CostGraph, tables: Tables, budget, objective: str, time_limit):
    kernel = _kernels.pick(solve_dp, "solve_dp")
    return kernel(_view(tables.set_words, "Q"), _view(tables.keep_words, "Q"),
                  _view(tables.top_words, "Q"), _view(tables.grad_boundary, "q"),
                  _view(tables.prefix_time, "q"), _view(tables.prefix_saved, "q"),
                  array("q", graph.out_bytes), array("q", [graph.step_transient(v) for v in range(graph.n)]), graph.loss_bytes,
                  budget, objective, time_limit)


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


def solve_dp(sets, keep, tops, grad_boundary, prefix_time, prefix_saved, out_bytes, transient,
             loss_bytes: int, budget: int | None, objective: str, time_limit: int | None = None):
    """Kernel: Algorithm 1 over a packed family; ``(chain, t, peak)`` or ``None``.

    ``sets``/``keep``: packed bitsets (L and the storage owners of ∂(L)) sorted by size, ∅
    first and V last; ``grad_boundary``, ``prefix_time``, ``prefix_saved``: int64 per set (see
    :class:`Tables`); ``out_bytes``, ``transient``: int64 per node. ``chain`` holds the indices
    of L_1, ..., L_k = V in ``sets``. Labels with a time above ``time_limit`` are dropped.
    ``tops`` (packed subsets of each set, e.g. its maximal nodes) only speed up the compiled
    kernel's search for supersets; this reference tests every pair.
    """
    width = words(len(out_bytes))
    sets, keep_roots = unpack(sets, width), unpack(keep, width)
    out_sum, transient_max = _ChunkTable(out_bytes, sum), _ChunkTable(transient, max)
    full, count = sets[-1], len(sets)
    labels: list[dict] = [dict() for _ in range(count)]
    labels[0][0 if objective == "time" else (0, 0)] = (0, 0, None) if objective == "time" else (0, None)
    limit = budget if budget is not None else float("inf")
    for j in range(count):
        front = _front(labels[j], objective)
        if not front:
            continue
        low, t_low, s_low = sets[j], prefix_time[j], prefix_saved[j]
        for k in range(j + 1, count):
            high = sets[k]
            if low & ~high:
                continue
            seg = high & ~low
            kept = out_sum(keep_roots[k] & seg)
            step = kept + prefix_saved[k] - s_low + grad_boundary[j] + transient_max(seg)
            if high == full:
                dt, step = 0, step + loss_bytes
            else:
                dt = prefix_time[k] - t_low
            for key, t, m, peak in front:
                mem = m + step
                if mem <= limit and (time_limit is None or t + dt <= time_limit):
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
