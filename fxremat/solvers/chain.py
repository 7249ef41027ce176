"""A DAG as a heterogeneous chain for rotor: stages, their costs, schedules back on the DAG.

The articulation nodes of the DAG (:func:`fxremat.solvers.chen.cut_points`: every path from the
inputs to the outputs passes through them) cut it into a chain of *stages*; a stage may be a
whole residual or inception block, which rotor runs as one unit. Stage ℓ (paper numbering,
1..L) reads only the output of stage ℓ-1 (and graph inputs and parameters), by construction
of the cut points.

Per-stage parameters (Beaumont et al., Section 5.1), from the :class:`~fxremat.core.CostGraph`:

- u_f: the stage's forward cost (sum of its nodes' ``time``); u_b: twice that (every schedule
  runs each B^ℓ exactly once, so u_b does not change which schedule is fastest).
- ω_a^ℓ: bytes of the stage's values read by later stages (its boundary output); ω_a^0 = 0,
  the chain input is the graph input, which the caller holds anyway.
- ω_ā^ℓ: what autograd keeps when the stage runs normally: the storages its nodes save inside
  the stage, their extra saved buffers, and its boundary output.
- o_f: the forward's transient above input and output, from a liveness walk over the stage
  (intermediate values die once their consumers in the stage ran); o_b: the largest
  gradient working set of one node (its output gradient, its inputs' gradients and its
  transient) beyond the stage's own δ^ℓ and δ^{ℓ-1}.

The rotor schedule's nested form (:meth:`RotorSchedule.nested`) becomes a
:class:`~fxremat.core.Schedule` whose recomputed segments carry their own inner schedule;
the liveness simulator checks it and the rewrite pass emits nested checkpoints.
"""

from __future__ import annotations

from ..core import CostGraph, Schedule
from ..lowersets import bits
from .chen import cut_points, stage_bytes
from .rotor import ChainCosts, CheckpointSegment, PlainStage

__all__ = ["chain_stages", "chain_costs", "schedule_from_nested"]


def chain_stages(graph: CostGraph, points=None) -> list[tuple[int, ...]]:
    """The stages (node tuples in topological order) between consecutive cut points (which
    follow the ordering edges too, so stages keep the traced order where it matters)."""
    points = points if points is not None else cut_points(graph)
    full = (1 << graph.n) - 1
    stages, prev = [], 0
    for low in [low for _, low in points] + [full]:
        stages.append(tuple(bits(low & ~prev)))
        prev = low
    return [s for s in stages if s]


def _forward_transient(graph: CostGraph, stage: tuple[int, ...], exit_roots: set[int]) -> int:
    """Peak bytes of running the stage alone, saving nothing, above its boundary output."""
    members = set(stage)
    needed = {v: {u for u in graph.succs[v] if u in members} for v in stage}
    live: dict[int, int] = {}
    peak = 0
    for v in stage:
        live[v] = graph.out_bytes[v]
        peak = max(peak, sum(live.values()) + graph.transient_bytes[v])
        for p in graph.preds[v]:
            if p in needed:
                needed[p].discard(v)
                if not needed[p] and graph.root[p] not in exit_roots:
                    live.pop(p, None)
        if not needed[v] and graph.root[v] not in exit_roots:
            live.pop(v, None)
    return max(0, peak - sum(graph.out_bytes[r] for r in exit_roots))


def _backward_transient(graph: CostGraph, stage: tuple[int, ...], grad_in: int, grad_out: int) -> int:
    """The largest gradient working set of one node of the stage (its output's gradient, its
    inputs' and its transient), less δ^ℓ and δ^{ℓ-1}, which rotor's B^ℓ already counts."""
    work = 0
    for v in stage:
        ins = {graph.root[p] for p in graph.preds[v]}
        work = max(work, graph.grad_bytes[v] + sum(graph.grad_bytes[r] for r in ins) + graph.bwd_transient_bytes[v])
    return max(0, work - grad_in - grad_out)


def chain_costs(graph: CostGraph, stages: list[tuple[int, ...]]) -> ChainCosts:
    """The rotor :class:`~fxremat.solvers.rotor.ChainCosts` of ``stages`` (module docstring)."""
    uf, ub, wa, wabar, of, ob = [], [], [0], [], [], []
    for ell, stage in enumerate(stages):
        out, keep, exit_roots = stage_bytes(graph, set(stage))
        time = sum(graph.time[v] for v in stage)
        uf.append(time)
        ub.append(2 * time)
        wa.append(out)
        wabar.append(keep)
        of.append(_forward_transient(graph, stage, exit_roots))
        ob.append(_backward_transient(graph, stage, wa[-2], out))
    return ChainCosts(uf=uf, ub=ub, wa=wa, wabar=wabar, of=of, ob=ob)


def schedule_from_nested(nodes, stages: list[tuple[int, ...]]) -> Schedule:
    """The :class:`Schedule` of a rotor nested tree over ``stages`` (paper numbers 1..L).

    Consecutive plain stages form one kept segment; a checkpointed sub-chain is a recomputed
    segment whose inner schedule is its body's (``None`` when the body is all plain stages).
    """
    segments, recomputed, inner = [], [], []
    run: list[int] = []

    def flush():
        if run:
            segments.append(tuple(run))
            recomputed.append(False)
            inner.append(None)
            run.clear()

    for node in nodes:
        if isinstance(node, PlainStage):
            run.extend(stages[node.index - 1])
            continue
        if not isinstance(node, CheckpointSegment):
            raise TypeError(f"schedule_from_nested: unexpected node {node!r}")
        flush()
        segments.append(tuple(v for ell in range(node.first, node.last + 1) for v in stages[ell - 1]))
        recomputed.append(True)
        nested = any(isinstance(b, CheckpointSegment) for b in node.body)
        inner.append(schedule_from_nested(node.body, stages) if nested else None)
    flush()
    return Schedule(tuple(segments), tuple(recomputed), tuple(inner))
