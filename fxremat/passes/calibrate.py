"""The checkpoint mechanism's cost, measured on the model itself.

:func:`~fxremat.passes.profile.checkpoint_costs` fits the mechanism once per machine on synthetic
chains (``tanh``, ``layer_norm``). On real segments it is several times that: measured on this
CPU, with plans of every strategy, a checkpoint over a ResNet bottleneck cost ~1.6 ms beyond the
forward it runs again, one over a transformer block or a U-Net level 0.8–2 ms with its saved tensors, against ~0.1 ms
and 7 µs a saved tensor fitted on the chains. Where the time goes is spread out: the checkpointed
forward (+0.3 ms a checkpoint), the recomputation running slower inside the backward than the
same nodes timed in the forward (+0.6 ms), and the backward beyond it (+0.9 ms; the ResNet chain,
16 checkpoints). On a GPU the chains are launch-bound, so the fit prices every checkpoint as if
its launches were exposed, which they are not in a step whose kernels take longer than their
launches.

So the model is timed in the context plans run in: :func:`calibrate` emits a few schedules of
the graph itself (contiguous segments of its nodes, in graph order, of about equal forward time,
emitted by the same rewrite a plan is) and times their steps beside the plain step. What each
adds beyond the forward it recomputes (:func:`~fxremat.simulate.rerun_time`, the per-node
profile) is fitted by non-negative least squares to two terms: a cost per checkpoint, and a
factor on the machine's per-node cost of saved tensors and bytes (which keeps the machine fit's
split between small and large tensors). Each is at least 0. The steps are read on the profile's
clock (scaled by its plain step over the plain step timed here), so that what the fit gives is
the overhead measured, as a share of the step, not the machine's speed changing in between.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.fx as fx

from ..core import CostGraph, Schedule, ancestor_masks
from ..simulate import mechanism_time, rerun_time
from .profile import CheckpointCosts, GraphCosts, nonnegative_fit, preserved_state, step_times, user_hooks_disabled
from .rewrite import rewrite

__all__ = ["calibrate", "calibration_schedules"]

log = logging.getLogger("fxremat")

# The schedules timed: (parts of about equal forward time, the parts recomputed). The first two
# recompute the same half of the forward with 1 and 8 checkpoints (the cost a checkpoint, from a
# difference of 7 of them: on a slow step the noise of a few timed steps is as large as one), the
# third 15/16 of it with 15 (the per-node factor).
SCHEDULES = ((2, (0,)), (16, tuple(range(0, 15, 2))), (16, tuple(range(15))))
MIN_SCHEDULES = 2  # fewer distinct schedules (a graph of a few nodes): the machine fit stays
# Rounds of steps timed: enough for about this many milliseconds of steps (a fast step is noisy
# against a mechanism of a fraction of a millisecond), at least ``repeats``, at most MAX_ROUNDS.
CALIBRATION_MS = 1000.0
MAX_ROUNDS = 15


def _closed(graph: CostGraph, mask: int, anc: list[int]) -> int:
    """The least lower set holding ``mask`` that keeps each node with its anchor."""
    while True:
        grown = mask
        for v in range(graph.n):
            if (grown >> v | grown >> graph.anchor[v]) & 1:
                grown |= anc[v] | anc[graph.anchor[v]]
        if grown == mask:
            return mask
        mask = grown


def calibration_schedules(graph: CostGraph) -> list[Schedule]:
    """The schedules :func:`calibrate` times (:data:`SCHEDULES`): the graph's nodes cut, in
    graph order, into parts of about equal forward time (each cut grown to a lower set that
    keeps every tied group whole, as the DP's lower sets do), the listed parts recomputed;
    duplicates and schedules with no recomputed node dropped."""
    anc = ancestor_masks(graph.ordered_preds)
    total = sum(graph.time) or 1
    prefix, acc = [], 0
    for t in graph.time:
        acc += t
        prefix.append(acc)
    full = (1 << graph.n) - 1
    found, seen = [], set()
    for parts, recomputed in SCHEDULES:
        cuts, mask = [], 0
        for k in range(1, parts):
            first = next(v for v in range(graph.n) if prefix[v] * parts >= k * total)
            mask = _closed(graph, mask | (1 << (first + 1)) - 1, anc)
            cuts.append(mask)
        cuts.append(full)
        segments, prev = [], 0
        for m in cuts:
            segments.append(tuple(v for v in range(graph.n) if (m & ~prev) >> v & 1))
            prev = m
        flags = [i in recomputed and i < parts - 1 for i in range(parts)]
        kept = [(s, r) for s, r in zip(segments, flags) if s]
        kept[-1] = (kept[-1][0], False)  # the last segment is never recomputed
        sched = Schedule(tuple(s for s, _ in kept), tuple(r for _, r in kept))
        key = (sched.segments, sched.recomputed)
        if any(sched.recomputed) and key not in seen:
            seen.add(key)
            found.append(sched)
    return found


def calibrate(gm: fx.GraphModule, inputs: tuple, graph: CostGraph, costs: GraphCosts,
              repeats: int) -> CheckpointCosts | None:
    """The mechanism's costs for this model (see the module docstring): ``costs.mechanism``
    refitted on the model's own checkpointed steps; ``costs.mechanism`` itself where there is
    none (no clock) or the graph has fewer than :data:`MIN_SCHEDULES` distinct schedules."""
    machine = costs.mechanism
    if machine is None:
        return None
    schedules = calibration_schedules(graph)
    if len(schedules) < MIN_SCHEDULES:
        return machine
    mutated = {c.name: c.mutated_buffers for c in costs.nodes}
    random = {c.name for c in costs.nodes if c.uses_rng}
    modules = [rewrite(gm, [[graph.names[v] for v in seg] for seg in s.segments], list(s.recomputed), mutated,
                       random=random) for s in schedules]
    rounds = min(MAX_ROUNDS, max(repeats, round(CALIBRATION_MS / (len(schedules) + 1) / max(costs.step_cost, 1e-3))))
    with preserved_state(gm), torch.enable_grad(), user_hooks_disabled(gm):
        plain, *timed = step_times([gm, *modules], inputs, rounds)
    # The steps timed here read on the profile's clock: a machine running slower (or faster)
    # during these seconds than during the profile would otherwise leave its difference times the
    # recomputed forward in the mechanism (one benchmark run fitted a per-node factor of 7.86, the
    # pattern of a machine 1.6x slower for those seconds).
    scale = costs.step_cost / plain if plain > 0 else 1.0
    per_node = replace(graph, checkpoint_time=0)  # hook_time alone: the machine's per-node share
    rows, targets = [], []
    for s, t in zip(schedules, timed):
        segs = [seg for seg, r in zip(s.segments, s.recomputed) if r]
        rows.append([float(len(segs)), sum(mechanism_time(per_node, seg) for seg in segs) * graph.time_unit])
        targets.append((t - plain) * scale - sum(rerun_time(graph, seg) for seg in segs) * graph.time_unit)
    per_checkpoint, factor = nonnegative_fit(rows, targets)
    fitted = CheckpointCosts(per_checkpoint, factor * machine.per_saved_tensor, factor * machine.per_saved_mib)
    log.debug("fxremat: checkpoint mechanism on this model %s (machine fit %s; %d schedules, plain %.3g ms "
              "against %.3g profiled, added beyond the recomputed forward %s ms)", fitted, machine, len(schedules),
              plain, costs.step_cost, [round(x, 3) for x in targets])
    return fitted
