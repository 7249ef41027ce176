"""Lower sets of a DAG as bitsets (Python ints: bit ``v`` set when node ``v`` is in the set).

A set L of nodes is a *lower set* when every predecessor of a node of L is in L (Kusumoto et al.
2019, Sec. 2). :func:`all_lower_sets` enumerates them breadth-first; :func:`pruned_family` gives
the approximate DP's family {L^v}: for every node v, v and all its ancestors.

Both accept ``anchor``: ``anchor[v] = a`` ties v to node a (v belongs to a lower set exactly
when a does). fxremat ties views and non-tensor nodes (``x.size()``, integer arithmetic) to
the group of their latest predecessor, so shape arithmetic does not multiply the lower sets.
Ties are resolved by enumerating the lower sets of the quotient DAG of tied groups, which must
be acyclic (true when each group's anchor precedes all its members in topological order).
"""

from __future__ import annotations

__all__ = ["all_lower_sets", "pruned_family", "bits", "popcount"]


def bits(mask: int):
    """Indices of the set bits of ``mask``, ascending."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def popcount(mask: int) -> int:
    return mask.bit_count()


def _pred_masks(preds) -> list[int]:
    return [sum(1 << p for p in ps) for ps in preds]


def _groups(preds, anchor):
    """Quotient DAG of tied nodes: (group of each node, node bitset per group, group preds)."""
    n = len(preds)
    anchor = list(range(n)) if anchor is None else list(anchor)

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
    return members, [tuple(sorted(ps)) for ps in gpreds]


def _expand(mask: int, members) -> int:
    out = 0
    for g in bits(mask):
        out |= members[g]
    return out


def all_lower_sets(preds, *, cap: int | None = None, anchor=None) -> list[int] | None:
    """Every lower set, the empty one included, sorted by size then value.

    Returns ``None`` when there are more than ``cap`` of them (the caller falls back to the
    approximate family).

    >>> all_lower_sets([(), (0,), (0,)])  # a fork 0 -> 1, 0 -> 2
    [0, 1, 3, 5, 7]
    """
    members, gpreds = _groups(preds, anchor)
    found = _lower_sets(gpreds, cap)
    if found is None:
        return None
    return sorted((_expand(m, members) for m in found), key=lambda m: (m.bit_count(), m))


def _lower_sets(preds, cap):
    pmask = _pred_masks(preds)
    n = len(preds)
    level, found = {0}, [0]
    while level:
        nxt = set()
        for low in level:
            for v in range(n):
                if not (low >> v) & 1 and (pmask[v] & ~low) == 0:
                    nxt.add(low | (1 << v))
        if cap is not None and len(found) + len(nxt) > cap:
            return None
        found.extend(sorted(nxt))
        level = nxt
    return found


def pruned_family(preds, *, anchor=None) -> list[int]:
    """{∅} ∪ {L^v | v} ∪ {V}: the approximate DP's lower sets, sorted by size then value."""
    members, gpreds = _groups(preds, anchor)
    return sorted({_expand(m, members) for m in _pruned(gpreds)}, key=lambda m: (m.bit_count(), m))


def _pruned(preds) -> list[int]:
    ancestors: list[int] = []
    for v, ps in enumerate(preds):
        mask = 1 << v
        for p in ps:
            mask |= ancestors[p]
        ancestors.append(mask)
    full = (1 << len(preds)) - 1
    return sorted({0, full, *ancestors}, key=lambda m: (m.bit_count(), m))
