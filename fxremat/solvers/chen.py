"""Baselines on the articulation chain of a DAG: ``checkpoint_sequential`` and Chen et al.

Chen, Xu, Zhang, Guestrin, *Training Deep Nets with Sublinear Memory Cost* (2016),
``shared/seeds/001_fa916fdc9b89d8bf.txt``.

- cut points: nodes every path from the inputs to the outputs passes through; with A_v = v and
  its ancestors, v is a cut point when no data edge leaves A_v except from v (views and shape
  nodes tied to v count as v). A_v follows the ordering edges too (``ordered_preds``), but an
  ordering edge leaving A_v does not prevent a cut: stages run in chain order, so it is
  satisfied anyway (the dropouts of successive blocks are chained by such edges). They split the DAG into a chain of stages; a stage may be a whole
  residual or inception block.
- :func:`sequential`: what ``torch.utils.checkpoint.checkpoint_sequential`` does — the chain cut
  into ``segments`` runs of (nearly) equal numbers of stages.
- :func:`chen_greedy`: Chen et al.'s Algorithm 3 — walk the chain, accumulating the bytes a
  segment keeps, and cut when they exceed a per-segment budget B; :func:`chen_candidates` sweeps
  B (the search over B is done by the planner, which simulates each candidate).

Each returns the strategy as a sequence of lower sets (bitsets ending with V), as the Kusumoto
solvers do, so the same simulator and rewrite pass serve them.
"""

from __future__ import annotations

import math

from ..core import CostGraph, ancestor_masks, boundary
from ..lowersets import bits

__all__ = ["cut_points", "stage_bytes", "sequential", "chen_greedy", "chen_candidates", "sequential_candidates"]


def cut_points(graph: CostGraph) -> list[tuple[int, int]]:
    """Cut points (group heads) in topological order, each with its lower set A_v: the group's
    members and all their ancestors, each lower set holding the one before (a chain). A node
    computed from parameters alone (YOLOS's position embeddings, interpolated in every layer)
    has a lower set of its own that holds no earlier cut's: taken as a cut, rotor's stages
    overlapped, a plan ran their nodes twice (a dropout drew twice: outputs not eager's), and a
    nested segment holding one twice failed to emit."""
    anc = ancestor_masks(graph.ordered_preds)
    members: dict[int, int] = {}
    for v in range(graph.n):
        members[graph.anchor[v]] = members.get(graph.anchor[v], 0) | 1 << v
    succ = [sum(1 << s for s in ss) for ss in graph.succs]
    full = (1 << graph.n) - 1
    out = []
    for head in sorted(members):
        low = 0
        for u in bits(members[head]):
            low |= anc[u]
        if low == full:
            continue
        leaving = [u for u in bits(low) if succ[u] & ~low]
        if all((members[head] >> u) & 1 for u in leaving) and (not out or out[-1][1] & ~low == 0):
            out.append((head, low))
    return out


def stage_bytes(graph: CostGraph, members: set) -> tuple[int, int, set]:
    """A stage's memory on the chain: ``(out, held, exit_roots)``. ``out``: bytes of the storages
    of its values that later stages read, or graph outputs (``exit_roots``); ``held``: what
    autograd keeps when the stage runs normally — those, the storages its nodes save inside the
    stage, and their extra saved buffers. Used by rotor's chain (ω_a, ω_ā) and Hong's sizes."""
    exit_roots = boundary(graph, members)
    kept = exit_roots | {o for v in members for o in graph.saved[v] if o in members}
    held = sum(graph.out_bytes[r] for r in kept) + sum(graph.extra_bytes[v] for v in members)
    return sum(graph.out_bytes[r] for r in exit_roots), held, exit_roots


def _chain(lows: list[int], cuts: list[int], full: int) -> tuple[int, ...]:
    return tuple(lows[c] for c in cuts) + (full,)


def sequential(graph: CostGraph, segments: int, points=None) -> tuple[int, ...]:
    """``checkpoint_sequential``: ``segments`` runs of equally many stages (lower sets)."""
    if segments < 1:
        raise ValueError(f"fxremat: sequential needs segments >= 1, got {segments}")
    lows = [low for _, low in (points if points is not None else cut_points(graph))]
    stages = len(lows) + 1
    segments = min(segments, stages)
    cuts = sorted({round(stages * i / segments) - 1 for i in range(1, segments)} - {-1})
    return _chain(lows, cuts, (1 << graph.n) - 1)


def _kept_bytes(graph: CostGraph, v: int) -> int:
    return graph.out_bytes[graph.root[v]]


def chen_greedy(graph: CostGraph, budget_bytes: int, points=None) -> tuple[int, ...]:
    """Chen et al. Alg. 3: cut when the bytes a segment keeps exceed ``budget_bytes``."""
    points = points if points is not None else cut_points(graph)
    cuts, acc, prev = [], 0, 0
    for i, (v, low) in enumerate(points):
        seg = low & ~prev
        acc += sum(graph.out_bytes[u] for u in range(graph.n) if (seg >> u) & 1)
        if acc > budget_bytes:
            cuts.append(i)
            acc, prev = 0, low
    return _chain([low for _, low in points], cuts, (1 << graph.n) - 1)


def chen_candidates(graph: CostGraph) -> list[tuple[int, ...]]:
    """Strategies for the search over B: √n equal segments and the greedy at a sweep of B."""
    points = cut_points(graph)
    total = sum(graph.out_bytes)
    out = {sequential(graph, max(1, round(math.sqrt(len(points) + 1))), points)}
    for k in range(1, 33):
        out.add(chen_greedy(graph, total * k // 64, points))
    return sorted(out, key=len)


def sequential_candidates(graph: CostGraph) -> list[tuple[int, ...]]:
    """``checkpoint_sequential`` with every segment count from 2 to 2√L (L stages)."""
    points = cut_points(graph)
    stages = len(points) + 1
    return sorted({sequential(graph, k, points) for k in range(2, max(3, int(2 * math.sqrt(stages)) + 1))}, key=len)
