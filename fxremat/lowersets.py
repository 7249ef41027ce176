"""Lower sets of a DAG as bitsets (Python ints: bit ``v`` set when node ``v`` is in the set).

A set L of nodes is a *lower set* when every predecessor of a node of L is in L (Kusumoto et al.
2019, Sec. 2). :func:`all_lower_sets` enumerates them; :func:`pruned_family` gives the
approximate DP's family {L^v}: for every node v, v and all its ancestors.

Both accept ``anchor``: ``anchor[v] = a`` ties v to node a (v belongs to a lower set exactly
when a does). fxremat ties views and non-tensor nodes (``x.size()``, integer arithmetic) to
the group of their latest predecessor, so shape arithmetic does not multiply the lower sets.
Ties are resolved by enumerating the lower sets of the quotient DAG of tied groups, which must
be acyclic (true when each group's anchor precedes all its members in topological order).

The enumeration runs in a kernel (:func:`enumerate_lower_sets` here, the reference; the
compiled one in ``fxremat._dp``, picked by :mod:`fxremat._kernels`). Kernels see bitsets
packed as rows of ``words(n)`` unsigned 64-bit words, least significant word first
(:func:`pack`, :func:`unpack`).
"""

from __future__ import annotations

import heapq
import sys
from array import array

from . import _kernels
from .core import ancestor_masks

__all__ = ["all_lower_sets", "pruned_family", "bits", "popcount", "words", "pack", "unpack",
           "enumerate_lower_sets"]


def bits(mask: int):
    """Indices of the set bits of ``mask``, ascending."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def popcount(mask: int) -> int:
    return mask.bit_count()


# --------------------------------------------------------------------------- packed bitsets


def words(n: int) -> int:
    """64-bit words per packed bitset of ``n`` bits (at least one, so rows are never empty)."""
    return max(1, (n + 63) // 64)


def pack(masks, width: int) -> array:
    """Bitsets as a flat ``array('Q')``: ``width`` words per set, least significant first."""
    out = array("Q", b"".join(m.to_bytes(8 * width, "little") for m in masks))
    if sys.byteorder == "big":
        out.byteswap()
    return out


def unpack(packed, width: int) -> list[int]:
    """Inverse of :func:`pack` (``packed``: any buffer of uint64 words)."""
    row = array("Q", packed)
    if sys.byteorder == "big":
        row.byteswap()
    data, size = row.tobytes(), 8 * width
    return [int.from_bytes(data[i:i + size], "little") for i in range(0, len(data), size)]


def _by_size(masks) -> list[int]:
    return sorted(masks, key=lambda m: (m.bit_count(), m))


# --------------------------------------------------------------------------- tied groups


def _pred_masks(preds) -> list[int]:
    return [sum(1 << p for p in ps) for ps in preds]


def _groups(preds, anchor):
    """Quotient DAG of tied nodes: (node bitset per group, group preds), groups numbered in
    topological order (by least anchor when several are ready)."""
    n = len(preds)
    anchor = list(anchor) if anchor is not None else list(range(n))

    def find(v):
        while anchor[v] != v:
            anchor[v] = anchor[anchor[v]]
            v = anchor[v]
        return v

    heads = sorted({find(v) for v in range(n)})
    gid = {h: i for i, h in enumerate(heads)}
    group = [gid[find(v)] for v in range(n)]
    members = [0] * len(heads)
    gpreds = [set() for _ in heads]
    for v in range(n):
        members[group[v]] |= 1 << v
        gpreds[group[v]].update(group[p] for p in preds[v] if group[p] != group[v])
    order = _topological(gpreds)
    rank = {g: i for i, g in enumerate(order)}
    return [members[g] for g in order], [tuple(sorted(rank[p] for p in gpreds[g])) for g in order]


def _topological(gpreds) -> list[int]:
    """Kahn's order of the groups, least index first; raises if the quotient has a cycle."""
    succs = [[] for _ in gpreds]
    missing = [len(ps) for ps in gpreds]
    for g, ps in enumerate(gpreds):
        for p in ps:
            succs[p].append(g)
    ready = [g for g, k in enumerate(missing) if k == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        g = heapq.heappop(ready)
        order.append(g)
        for s in succs[g]:
            missing[s] -= 1
            if missing[s] == 0:
                heapq.heappush(ready, s)
    if len(order) != len(gpreds):
        raise ValueError("fxremat.lowersets: the anchors tie nodes into a cyclic quotient DAG; "
                         "each group's anchor must precede its members (see fxremat.core.anchors)")
    return order


def _expand(mask: int, members) -> int:
    out = 0
    for g in bits(mask):
        out |= members[g]
    return out


# --------------------------------------------------------------------------- all lower sets


def all_lower_sets(preds, *, cap: int | None = None, anchor=None) -> list[int] | None:
    """Every lower set, the empty one included, sorted by size then value.

    Returns ``None`` when there are more than ``cap`` of them (the caller falls back to the
    approximate family).

    >>> all_lower_sets([(), (0,), (0,)])  # a fork 0 -> 1, 0 -> 2
    [0, 1, 3, 5, 7]
    """
    if cap is not None and cap < 0:
        return None
    members, gpreds = _groups(preds, anchor)
    n_groups, n = len(members), len(preds)
    kernel = _kernels.pick(enumerate_lower_sets, "enumerate_lower_sets")
    found = kernel(pack(_pred_masks(gpreds), words(n_groups)), pack(members, words(n)),
                   n_groups, n, -1 if cap is None else min(cap, sys.maxsize))
    return None if found is None else unpack(found, words(n))


def enumerate_lower_sets(group_preds, members, n_groups: int, n_nodes: int, cap: int):
    """Kernel: the lower sets of a quotient DAG, expanded to node bitsets and sorted.

    ``group_preds``: per group (numbered in topological order) the bitset of its predecessor
    groups, ``words(n_groups)`` words each; ``members``: per group its node bitset,
    ``words(n_nodes)`` words each. Returns the lower sets as packed node bitsets sorted by
    size then value, or ``None`` when there are more than ``cap`` (``cap < 0``: no cap).
    This is the reference (breadth-first, one level per size); ``fxremat._dp`` has the
    compiled kernel with the same signature and results.
    """
    gpred = unpack(group_preds, words(n_groups))
    groups = unpack(members, words(n_nodes))
    level, found = {0}, [0]
    while level:
        nxt = set()
        for low in level:
            for g in range(n_groups):
                if not (low >> g) & 1 and (gpred[g] & ~low) == 0:
                    nxt.add(low | (1 << g))
        if 0 <= cap < len(found) + len(nxt):
            return None
        found.extend(nxt)
        level = nxt
    return pack(_by_size(_expand(m, groups) for m in found), words(n_nodes))


# --------------------------------------------------------------------------- pruned family


def pruned_family(preds, *, anchor=None) -> list[int]:
    """{∅} ∪ {L^v | v} ∪ {V}: the approximate DP's lower sets, sorted by size then value.

    Linear in the number of nodes, so it needs no compiled kernel.
    """
    members, gpreds = _groups(preds, anchor)
    return _by_size({_expand(m, members) for m in _pruned(gpreds)})


def _pruned(preds) -> list[int]:
    full = (1 << len(preds)) - 1
    return [0, full, *ancestor_masks(preds)]
