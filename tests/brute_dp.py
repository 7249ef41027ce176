"""Brute-force oracle for :mod:`fxremat.solvers.kusumoto` (tests only; graphs of ≤ 6 nodes).

Contract: :func:`least_time` and :func:`least_peak` enumerate *every* strictly increasing chain
of lower sets ∅ ⊊ L_1 ⊊ ... ⊊ L_k = V and cost each with :func:`chain_cost`, which follows the
memory and time model stated in the docstring of :mod:`fxremat.solvers.kusumoto` directly from
its set definitions, without its tables or DP code:

- lower sets: closed under predecessors and under ties (``anchor``), tested on all 2^n subsets;
- ∂(L): nodes of L with a successor outside L, or that are graph outputs;
- m: bytes of the distinct storages (``root``) of U_i = ∪_{j ≤ i} ∂(L_j), kept so far;
  K_i = m_i − m_{i−1}, the bytes of V_i's outputs newly kept for later segments;
- S(V_i): outputs of V_i that some node saves for its backward; E, G: ``extra_bytes``,
  ``grad_bytes`` summed over V_i; G(∂(L_{i−1})); W(V_i): the largest ``step_transient``;
- step i: m_{i−1} + K_i + S(V_i) + E(V_i) + G(V_i) + G(∂(L_{i−1})) + W(V_i), plus
  ``loss_bytes`` for the last step; the peak is the largest step; the overhead Σ_{i<k} T(V_i),
  with T(V_i) what the simulator charges a checkpoint over V_i beyond its fixed cost
  (:func:`fxremat.simulate.rerun_time`, torch's early stop, plus the hooks of
  :func:`fxremat.simulate.mechanism_time`), or with ``early_stop=False`` every node's
  ``recompute_cost`` (the whole segment run again).
"""

from __future__ import annotations

from dataclasses import dataclass

from fxremat.core import CostGraph
from fxremat.simulate import mechanism_time, rerun_time

__all__ = ["ChainCost", "lower_sets", "chains", "chain_cost", "least_time", "least_peak", "MAX_NODES"]

MAX_NODES = 6


@dataclass(frozen=True)
class ChainCost:
    """Overhead, peak and per-step memory of one chain, in the DP's model."""

    time: int
    peak_bytes: int
    steps: tuple[int, ...]


def _members(mask: int):
    return [v for v in range(mask.bit_length()) if (mask >> v) & 1]


def _tie(graph: CostGraph, v: int) -> int:
    while graph.anchor[v] != v:
        v = graph.anchor[v]
    return v


def lower_sets(graph: CostGraph) -> list[int]:
    """All subsets closed under predecessors and ties, by checking every subset."""
    if graph.n > MAX_NODES:
        raise ValueError(f"tests/brute_dp.py: {graph.n} nodes; the oracle handles at most {MAX_NODES}")
    heads = [_tie(graph, v) for v in range(graph.n)]
    found = []
    for mask in range(1 << graph.n):
        inside = [(mask >> v) & 1 for v in range(graph.n)]
        closed = all(inside[p] for v in range(graph.n) if inside[v] for p in graph.preds[v])
        tied = all(inside[v] == inside[heads[v]] for v in range(graph.n))
        if closed and tied:
            found.append(mask)
    return found


def chains(sets: list[int], full: int):
    """Every strictly increasing chain of ``sets`` from (excluded) ∅ up to ``full``."""
    def extend(low: int, prefix: tuple):
        if low == full:
            yield prefix
            return
        for high in sets:
            if high != low and low & ~high == 0:
                yield from extend(high, prefix + (high,))

    yield from extend(0, ())


def _boundary(graph: CostGraph, mask: int) -> set[int]:
    return {v for v in _members(mask)
            if graph.is_output[v] or any(not (mask >> s) & 1 for s in graph.succs[v])}


def chain_cost(graph: CostGraph, chain, early_stop: bool = True) -> ChainCost:
    """Cost of the canonical strategy of ``chain`` (L_1, ..., L_k = V) in the DP's model."""
    saved_owners = {o for owners in graph.saved for o in owners}
    kept: set[int] = set()
    previous, steps, overhead = 0, [], 0
    for i, mask in enumerate(chain):
        seg = _members(mask & ~previous)
        m_before = sum(graph.out_bytes[r] for r in kept)
        kept |= {graph.root[v] for v in _boundary(graph, mask)}
        newly_kept = sum(graph.out_bytes[r] for r in kept) - m_before
        step = (m_before + newly_kept
                + sum(graph.out_bytes[v] for v in seg if v in saved_owners)
                + sum(graph.extra_bytes[v] for v in seg)
                + sum(graph.grad_bytes[v] for v in seg)
                + sum(graph.grad_bytes[v] for v in _boundary(graph, previous))
                + max(graph.step_transient(v) for v in seg))
        if i == len(chain) - 1:
            step += graph.loss_bytes
        else:
            overhead += (rerun_time(graph, seg) + mechanism_time(graph, seg) - graph.checkpoint_time if early_stop
                         else sum(graph.recompute_cost(v) for v in seg))
        steps.append(step)
        previous = mask
    return ChainCost(overhead, max(steps, default=0), tuple(steps))


def _all_costs(graph: CostGraph, early_stop: bool = True):
    full = (1 << graph.n) - 1
    for chain in chains(lower_sets(graph), full):
        yield chain, chain_cost(graph, chain, early_stop)


def least_time(graph: CostGraph, budget: int | None = None, early_stop: bool = True) -> int | None:
    """The least overhead of a chain whose every step is ≤ ``budget``; ``None`` if none is."""
    times = [c.time for _, c in _all_costs(graph, early_stop) if budget is None or c.peak_bytes <= budget]
    return min(times, default=None)


def least_peak(graph: CostGraph, budget: int | None = None) -> int | None:
    """The least peak of a chain (within ``budget`` if given); ``None`` if none is."""
    peaks = [c.peak_bytes for _, c in _all_costs(graph) if budget is None or c.peak_bytes <= budget]
    return min(peaks, default=None)
