"""Lower sets of a DAG as bitsets (Python ints: bit ``v`` set when node ``v`` is in the set).

A set L of nodes is a *lower set* when every predecessor of a node of L is in L (Kusumoto et al.
2019, Sec. 2). :func:`all_lower_sets` enumerates them breadth-first; :func:`pruned_family` gives
the approximate DP's family {L^v}: for every node v, v and all its ancestors.
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


def all_lower_sets(preds, *, cap: int | None = None) -> list[int] | None:
    """Every lower set, the empty one included, sorted by size then value.

    Returns ``None`` when there are more than ``cap`` of them (the caller falls back to the
    approximate family).

    >>> all_lower_sets([(), (0,), (0,)])  # a fork 0 -> 1, 0 -> 2
    [0, 1, 3, 5, 7]
    """
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


def pruned_family(preds) -> list[int]:
    """{∅} ∪ {L^v | v} ∪ {V}: the approximate DP's lower sets, sorted by size then value."""
    ancestors: list[int] = []
    for v, ps in enumerate(preds):
        mask = 1 << v
        for p in ps:
            mask |= ancestors[p]
        ancestors.append(mask)
    full = (1 << len(preds)) - 1
    return sorted({0, full, *ancestors}, key=lambda m: (m.bit_count(), m))
