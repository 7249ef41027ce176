"""The step-time model: the checkpoint mechanism's own time is counted per recomputed segment
(nested ones included) and per node in it that saves tensors; measured costs come from a clock."""

from __future__ import annotations

import dataclasses
import os

import torch

from fxremat.core import Schedule, load_graph
from fxremat.passes.profile import checkpoint_costs
from fxremat.planner import choose, recompute_time
from fxremat.budget import parse_budget
from fxremat.simulate import _packs, rerun_time

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "fixtures")


def test_mechanism_time_counts_segments_and_saving_nodes():
    graph = load_graph(os.path.join(FIXTURES, "unet.json"))
    sched = choose(graph, parse_budget(0.5), strategy="exact").schedule
    recomputed = [seg for seg, rec in zip(sched.segments, sched.recomputed) if rec]
    assert recomputed
    rerun = sum(rerun_time(graph, seg) for seg in recomputed)
    assert recompute_time(graph, sched) == rerun  # the fixture was profiled without a clock
    costly = dataclasses.replace(graph, checkpoint_time=1000, saving_node_time=7)
    saving = sum(_packs(graph, v) for seg in recomputed for v in seg)
    assert saving > 0
    assert recompute_time(costly, sched) == rerun + 1000 * len(recomputed) + 7 * saving


def test_nested_checkpoints_pay_the_mechanism_again():
    graph = dataclasses.replace(load_graph(os.path.join(FIXTURES, "vgg19.json")), checkpoint_time=100,
                                saving_node_time=0)
    seg = tuple(range(10))
    inner = Schedule((seg[:5], seg[5:]), (True, False))
    flat = Schedule((seg, tuple(range(10, graph.n))), (True, False))
    nested = Schedule((seg, tuple(range(10, graph.n))), (True, False), (inner, None))
    mech = lambda s: recompute_time(graph, s) - sum(  # noqa: E731
        rerun_time(graph, g, s.inner_of(i)) for i, (g, r) in enumerate(zip(s.segments, s.recomputed)) if r)
    assert mech(flat) == 100 and mech(nested) == 200


def test_checkpoint_costs_are_measured_and_not_negative():
    per_checkpoint, per_node = checkpoint_costs(torch.device("cpu"), repeats=5)
    assert per_checkpoint >= 0 and per_node >= 0
    assert per_checkpoint + per_node > 0  # a checkpoint costs something on any clock
