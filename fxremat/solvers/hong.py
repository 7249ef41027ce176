"""Hong et al.'s minimum-peak checkpoint selection on the articulation chain.

Hong, Tsai, Wang, Liu, Wu, *GPU Memory Usage Optimization for Backward Propagation in Deep
Network Training*, ``shared/seeds/004_ac913870907ea453.txt``, Section 4 ("dynamic checkpoint
selection"): the memory model of their Algorithm 4 (how PyTorch releases memory) and its
dynamic programme, Eq. 13, solved in O(n²) by Algorithm 5 and in linear time by Algorithm 6.

The chain and its symbols (paper notation, used only in this module):

- d_0 … d_n: the data of a chain, d_0 the network input, d_i the output of layer i; d_i also
  names its size in bytes. C: the checkpoints, d_0 and d_n always among them (Section 3.1).
- Algorithm 4's memory at the backward step of checkpoint i, h the checkpoint before it
  (Eq. 9, 11, 12): m(i) = Σ_{c ∈ C, c ≤ i} d_c + s(h, i), with
  s(h, i) = Σ_{h<k<i} d_k + max_{h≤k<i} d_k — the live checkpoints, the recomputed segment
  between h and i, and one output-gradient buffer as large as the largest data of the segment
  and its left checkpoint. The peak of C is max over its checkpoints i > 0 of m(i); Hong et al.
  show the other steps (and the forward) never exceed it.
- M(i): the least peak over [i, n] given d_i is a checkpoint, with the checkpoints before i
  left out (they add the same constant to every term): Eq. 13/16,
  M(i) = d_i + min_{i<j≤n} max(M(j), U(i, j)), U(i, j) = s(i, j) + d_j (Eq. 15), M(n) = d_n.
  The answer is M(0).

Interpretations (the paper's text is loose in three places):

- Section 4 numbers the data 1..n with M(1) the answer, Section 3 0..n with d_0 the input and a
  checkpoint. We read the first element as d_0: the input, a checkpoint by definition. The
  paper's reported subsets (e.g. {3, 6, 24} for VGG-19) list n but never a first layer, which
  fits that reading.
- Eq. 13 writes i < j < n; Algorithm 5 loops j up to n, which the recursion needs (d_n is a
  checkpoint, so M(n-1) has j = n only). We take i < j ≤ n.
- Algorithm 6 line 13 compares j with "j + 1"; Lemma 3 only restricts the search to the
  monotonic queue Q, so we read j + 1 as the element after j in Q (the literal index may have
  left Q and is then not the crossing). Line 4 starts at j*(i+1); when a zero-size d_{i+1}
  evicted it from Q, every element before it went too, and the search starts at the head.
  U(i, j) is O(1) from a prefix sum and a sparse-table range maximum (O(n log n) to build):
  the incremental update in Theorem 3's proof cannot shrink a window's maximum in O(1).

Extension (``held=``): on fxremat's chain a *stage* may be a whole residual block whose
recomputation keeps more than its output. ``held[k]`` ≥ ``sizes[k]`` then replaces d_k in the
segment sum Σ_{h<k<i} of Eq. 11 (checkpoints and gradient buffers stay output-sized). Lemma 1
(U increasing in j) needs held[j] ≥ d_j and Lemma 4 (U decreasing in i) held ≥ 0, so
Algorithm 6 stays exact; ``held=None`` is the paper's model.

On a :class:`~fxremat.core.CostGraph` the layers are the stages between consecutive cut points
(:func:`fxremat.solvers.chen.cut_points`); checkpoint k (0 < k < n) is the lower set A_k of the
k-th cut point, and the strategy is those lower sets followed by V — every segment but the last
is recomputed, as in Algorithm 4. The input is free: d_0 = 0 (the caller holds it).
"""

from __future__ import annotations

from ..core import CostGraph
from .chen import cut_points, stage_bytes

__all__ = ["hong_chain", "hong_quadratic", "hong_peak", "stage_sizes", "hong_candidates"]


def _check(sizes, held) -> tuple[list, list]:
    d = list(sizes)
    w = d if held is None else list(held)
    if not d:
        raise ValueError("fxremat.hong: the chain needs at least its input d_0; got no sizes")
    if len(w) != len(d):
        raise ValueError(f"fxremat.hong: held has {len(w)} entries for {len(d)} sizes; give one per datum")
    bad = [k for k in range(len(d)) if d[k] < 0 or w[k] < d[k]]
    if bad:
        k = bad[0]
        raise ValueError(f"fxremat.hong: need 0 <= sizes[k] <= held[k]; at k={k} sizes={d[k]}, held={w[k]}")
    return d, w


class _Segments:
    """U(i, j) = Σ_{i<k<j} w_k + max_{i≤k<j} d_k + d_j in O(1) (Eq. 11, 15)."""

    def __init__(self, d, w):
        self.d = d
        self.prefix = [0]
        for x in w:
            self.prefix.append(self.prefix[-1] + x)
        self.table = [list(d)]  # table[p][k] = max(d[k : k + 2**p])
        while 2 << (len(self.table) - 1) <= len(d):
            prev, half = self.table[-1], 1 << (len(self.table) - 1)
            self.table.append([max(prev[k], prev[k + half]) for k in range(len(prev) - half)])

    def range_max(self, lo: int, hi: int):
        """max(d[lo..hi]) for lo ≤ hi."""
        p = (hi - lo + 1).bit_length() - 1
        return max(self.table[p][lo], self.table[p][hi - (1 << p) + 1])

    def u(self, i: int, j: int):
        return self.prefix[j] - self.prefix[i + 1] + self.range_max(i, j - 1) + self.d[j]


def _path(nxt: list, n: int) -> tuple[int, ...]:
    out = [0]
    while out[-1] != n:
        out.append(nxt[out[-1]])
    return tuple(out)


def hong_chain(sizes, held=None) -> tuple[int, tuple[int, ...]]:
    """Algorithm 6: the least peak of Algorithm 4 over checkpoint sets, in linear time.

    ``sizes`` = (d_0, …, d_n); ``held`` (optional, see the module docstring) what a recomputed
    layer keeps. Returns ``(M(0), C)``: the least peak and a checkpoint set achieving it, the
    indices in increasing order from 0 to n.
    """
    d, w = _check(sizes, held)
    n = len(d) - 1
    if n == 0:
        return d[0], (0,)
    seg = _Segments(d, w)
    m = [0] * (n + 1)
    nxt = [n] * (n + 1)
    m[n] = d[n]
    queue = [n]  # Q, tail first: indices decrease and M strictly increases along the list
    star, star_pos = n, 0  # j*(i + 1) and its position in queue
    for i in range(n - 1, -1, -1):
        p = star_pos if star_pos < len(queue) and queue[star_pos] == star else len(queue) - 1
        while p < len(queue) - 1 and seg.u(i, queue[p]) >= m[queue[p]]:
            p += 1  # Algorithm 6 lines 8-12: back towards the head until U(i, j) < M(j)
        best, best_pos = max(m[queue[p]], seg.u(i, queue[p])), p
        if p > 0:  # line 13: the element after j in Q
            after = max(m[queue[p - 1]], seg.u(i, queue[p - 1]))
            if after < best:
                best, best_pos = after, p - 1
        m[i] = d[i] + best
        star, star_pos = queue[best_pos], best_pos
        nxt[i] = star
        while queue and m[queue[-1]] >= m[i]:  # line 15: drop what M(i) dominates
            queue.pop()
        queue.append(i)
    return m[0], _path(nxt, n)


def hong_quadratic(sizes, held=None) -> tuple[int, tuple[int, ...]]:
    """Algorithm 5: the same recursion (Eq. 13) in O(n²) time, the reference for Algorithm 6."""
    d, w = _check(sizes, held)
    n = len(d) - 1
    if n == 0:
        return d[0], (0,)
    m = [0] * (n + 1)
    nxt = [n] * (n + 1)
    m[n] = d[n]
    for i in range(n - 1, -1, -1):
        best, inner, top = None, 0, d[i]  # inner = Σ_{i<k<j} w_k, top = max_{i≤k<j} d_k
        for j in range(i + 1, n + 1):
            cost = max(m[j], inner + top + d[j])
            if best is None or cost < best:
                best, nxt[i] = cost, j
            inner += w[j]
            top = max(top, d[j])
        m[i] = d[i] + best
    return m[0], _path(nxt, n)


def hong_peak(sizes, checkpoints, held=None):
    """The peak of Algorithm 4 for a checkpoint set (Eq. 12 maximised over its checkpoints)."""
    d, w = _check(sizes, held)
    cps = sorted(set(checkpoints) | {0, len(d) - 1})
    peak, kept = d[0], d[0]
    for h, i in zip(cps, cps[1:]):
        kept += d[i]
        peak = max(peak, kept + sum(w[h + 1:i]) + max(d[h:i]))
    return peak


def stage_sizes(graph: CostGraph, points=None) -> tuple[list[int], list[int], list[int]]:
    """The chain of a graph: ``(sizes, held, lows)``.

    ``sizes[k]`` (k ≥ 1): bytes of stage k's output — the storages of its values that later
    stages read, or graph outputs; ``sizes[0] = 0``: the input. ``held[k]``: what autograd
    keeps when the stage runs normally — the storages its nodes save inside the stage, their
    extra saved buffers, and its output. ``lows[k-1]``: the lower set closing stage k (the
    last is V).
    """
    points = points if points is not None else cut_points(graph)
    full = (1 << graph.n) - 1
    lows = [low for _, low in points] + [full]
    sizes, held, prev = [0], [0], 0
    for low in lows:
        out, kept, _ = stage_bytes(graph, {v for v in range(graph.n) if (low & ~prev) >> v & 1})
        sizes.append(out)
        held.append(kept)
        prev = low
    return sizes, held, lows


def hong_candidates(graph: CostGraph) -> list[tuple[int, ...]]:
    """Hong et al.'s selections as lower-set sequences (each ends with V), for the planner.

    Their method has no parameter and no time/memory trade-off: it returns one minimum-peak set.
    Stages are not single layers, so two readings of a stage's size are offered: the paper's
    (each stage counted by its output) and with ``held`` (a recomputed stage counted by what
    autograd keeps for it). The planner simulates both and keeps the better.
    """
    if graph.n == 0:
        return []
    sizes, held, lows = stage_sizes(graph)
    out = set()
    for extra in (None, held):
        _, cps = hong_chain(sizes, extra)
        out.add(tuple(lows[k - 1] for k in cps[1:]))
    return sorted(out, key=len)
