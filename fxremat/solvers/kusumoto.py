"""The graph DP of Kusumoto et al. (NeurIPS 2019), ``shared/seeds/003_cbecfbcc99b65757.txt``.

Symbols (defined once here):
- V: call nodes; L ⊆ V a lower set; a strategy is L_1 ⊊ ... ⊊ L_k = V and V_i = L_i \\ L_{i-1}.
- ∂(L): nodes of L with a successor outside L, or that are graph outputs; they are kept.
- canonical strategy: run V_i, keep ∂(L_i), drop the rest of V_i; in the backward, recompute
  V_i from what is kept before back-propagating through it. Here every V_i except the last is a
  non-reentrant checkpoint, and V_k runs plainly (it is back-propagated right after its forward,
  so recomputing it would only cost time).
- T(V_i): forward cost of V_i (``graph.time``); the overhead of a strategy is Σ_{i<k} T(V_i),
  since torch recomputes the whole segment.
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
"""

from __future__ import annotations

from dataclasses import dataclass

from ..graph import CostGraph

__all__ = ["Solution", "Tables", "build_tables", "solve"]


@dataclass(frozen=True)
class Solution:
    """A strategy: ``lower_sets`` = (L_1, ..., L_k = V) as bitsets, its DP time and peak."""

    lower_sets: tuple[int, ...]
    time: int
    peak_bytes: int


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
        return self.combine([tab[b] for tab, b in zip(self.tables, data) if b])


@dataclass(frozen=True)
class Tables:
    """Per-lower-set quantities of the DP (lists indexed like ``sets``)."""

    sets: tuple[int, ...]
    keep_roots: tuple[int, ...]   # bitset of the storage owners of ∂(L)
    grad_boundary: tuple[int, ...]  # G(∂(L))
    prefix: tuple[tuple[int, ...], ...]  # per set: (T, S + E + G) summed over L
    full: int


def _boundary(graph: CostGraph, mask: int) -> int:
    out = 0
    for v in range(graph.n):
        if (mask >> v) & 1 and (graph.is_output[v] or any(not (mask >> s) & 1 for s in graph.succs[v])):
            out |= 1 << v
    return out


def build_tables(graph: CostGraph, family) -> Tables:
    """Precompute the per-set sums the transitions need."""
    saved_any = [0] * graph.n
    for owners in graph.saved:
        for o in owners:
            saved_any[o] = graph.out_bytes[o]
    grad = _ChunkTable(graph.grad_bytes, sum)
    additive = _ChunkTable(
        [s + e + g for s, e, g in zip(saved_any, graph.extra_bytes, graph.grad_bytes)], sum
    )
    time = _ChunkTable(graph.time, sum)
    keep, gb, prefix = [], [], []
    for mask in family:
        bnd = _boundary(graph, mask)
        roots = 0
        for v in _bits(bnd):
            roots |= 1 << graph.root[v]
        keep.append(roots)
        gb.append(grad(bnd))
        prefix.append((time(mask), additive(mask)))
    return Tables(tuple(family), tuple(keep), tuple(gb), tuple(prefix), (1 << graph.n) - 1)


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


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


def solve(graph: CostGraph, tables: Tables, *, budget: int | None = None, objective: str = "time"):
    """Algorithm 1 over ``tables.sets``; returns a :class:`Solution` or ``None`` if infeasible.

    ``objective="time"``: least overhead with every step's memory ≤ ``budget``.
    ``objective="memory"``: least peak (``budget``, if given, still bounds every step).
    """
    if objective not in ("time", "memory"):
        raise ValueError(f"fxremat.solvers.kusumoto.solve: objective must be 'time' or 'memory', got {objective!r}")
    out_bytes = _ChunkTable(graph.out_bytes, sum)
    transient = _ChunkTable(graph.transient_bytes, max)
    sets, count = tables.sets, len(tables.sets)
    labels: list[dict] = [dict() for _ in range(count)]
    labels[0][0 if objective == "time" else (0, 0)] = (0, 0, None) if objective == "time" else (0, None)
    limit = budget if budget is not None else float("inf")
    for j in range(count):
        front = _front(labels[j], objective)
        low, (t_low, s_low) = sets[j], tables.prefix[j]
        for k in range(j + 1, count):
            high = sets[k]
            if low & ~high:
                continue
            seg = high & ~low
            keep = out_bytes(tables.keep_roots[k] & seg)
            step = keep + tables.prefix[k][1] - s_low + tables.grad_boundary[j] + transient(seg)
            if high == tables.full:
                dt, step = 0, step + graph.loss_bytes
            else:
                dt = tables.prefix[k][0] - t_low
            for key, t, m, peak in front:
                mem = m + step
                if mem <= limit:
                    _relax(labels[k], objective, t + dt, m + keep, max(peak, mem), (j, key))
    return _best(tables, labels, objective)


def _best(tables: Tables, labels, objective: str):
    final = labels[-1]
    if not final:
        return None
    if objective == "time":
        key = min(final)
        t, peak = key, final[key][1]
    else:
        key = min(final, key=lambda pm: (pm[0], final[pm][0], pm[1]))
        t, peak = final[key][0], key[0]
    seq, j = [], len(tables.sets) - 1
    while j != 0:
        seq.append(tables.sets[j])
        j, key = labels[j][key][-1]
    return Solution(tuple(reversed(seq)), t, peak)
