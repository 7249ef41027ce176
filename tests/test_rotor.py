"""Tests of the rotor DP (fxremat.solvers.rotor) against the brute-force oracle."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxremat.solvers.rotor import (
    BWD, FALL, FCK, FN, ChainCosts, CheckpointSegment, PlainStage, RotorSchedule, RotorTable,
    flatten_nested, rotor_row, rotor_table, simulate_schedule, solve_rotor, to_slots,
)
from brute_rotor import brute_force_min_time, brute_force_schedule

# planning: plans come from the DP kernels, so the pure-Python kernels' pass runs these too
pytestmark = pytest.mark.solver

FAST = settings(max_examples=60, deadline=None)


@st.composite
def chains(draw, max_stages=4, max_size=3, min_stages=1):
    n = draw(st.integers(min_stages, max_stages))
    ints = lambda hi: st.lists(st.integers(0, hi), min_size=n, max_size=n)  # noqa: E731
    wa = draw(st.lists(st.integers(0, max_size), min_size=n + 1, max_size=n + 1))
    extra = draw(ints(max_size))
    return ChainCosts(uf=draw(ints(5)), ub=draw(ints(5)), wa=wa,
                      wabar=[wa[i + 1] + extra[i] for i in range(n)], of=draw(ints(2)), ob=draw(ints(2)))


def exact(costs, memory):
    """solve_rotor with one slot per byte, so no rounding."""
    return solve_rotor(costs, memory, slots=memory) if memory > 0 else None


def time_or_inf(schedule):
    return math.inf if schedule is None else schedule.predicted_time


def brute_or_inf(costs, memory):
    best = brute_force_min_time(costs, memory)
    return math.inf if best is None else best


@FAST
@given(chains(min_stages=3), st.lists(st.integers(1, 24), min_size=3, max_size=3, unique=True))
def test_dp_matches_brute_force(costs, memories):
    for memory in memories:
        schedule = exact(costs, memory)
        assert time_or_inf(schedule) == brute_or_inf(costs, memory)
        if schedule is not None:
            time, peak = simulate_schedule(costs, schedule.ops, persistent=True)
            assert time == schedule.predicted_time
            assert peak <= memory


@FAST
@given(chains(max_stages=5))
def test_time_never_increases_with_memory(costs):
    times = [time_or_inf(exact(costs, m)) for m in range(1, 40)]
    assert all(a >= b for a, b in zip(times, times[1:]))
    assert times[-1] == sum(costs.uf) + sum(costs.ub)  # enough memory: no recomputation


@FAST
@given(chains())
def test_smallest_feasible_budget(costs):
    memory = next(m for m in range(1, 100) if exact(costs, m) is not None)
    assert brute_force_min_time(costs, memory) is not None
    if memory > 1:  # a budget of 0 bytes is rejected by solve_rotor
        assert exact(costs, memory - 1) is None
        assert brute_force_min_time(costs, memory - 1) is None
    _, peak = simulate_schedule(costs, exact(costs, memory).ops)
    assert peak == memory or (memory == 1 and peak == 0)  # the least budget is used up


@FAST
@given(chains(max_stages=6), st.integers(1, 40))
def test_nested_round_trip(costs, memory):
    schedule = exact(costs, memory)
    if schedule is None:
        return
    nodes = schedule.nested()
    assert flatten_nested(nodes) == schedule.ops
    assert isinstance(nodes[-1], PlainStage) and nodes[-1].index == costs.length
    assert _covered(nodes) == list(range(1, costs.length + 1))


def _covered(nodes):
    out = []
    for node in nodes:
        if isinstance(node, PlainStage):
            out.append(node.index)
        else:
            assert _covered(node.body) == list(range(node.first, node.last + 1))
            out.extend(range(node.first, node.last + 1))
    return out


@settings(max_examples=25, deadline=None)
@given(chains(max_stages=4, max_size=10**6), st.integers(10**5, 10**7), st.sampled_from([7, 20, 50]))
def test_coarse_slots_respect_budget_and_are_optimal_in_slots(costs, memory_bytes, slots):
    schedule = solve_rotor(costs, memory_bytes, slots=slots)
    in_slots = to_slots(costs, memory_bytes, slots)
    assert time_or_inf(schedule) == brute_or_inf(in_slots, slots)
    if schedule is not None:
        assert simulate_schedule(costs, schedule.ops)[1] <= memory_bytes


def test_paper_example_sequence_nests():
    # Section 3.1's example for L = 4 plus the loss stage 5.
    ops = ((FCK, 1), (FN, 2), (FCK, 3), (FALL, 4), (FALL, 5), (BWD, 5), (BWD, 4), (FALL, 3), (BWD, 3),
           (FALL, 1), (FALL, 2), (BWD, 2), (BWD, 1))
    costs = ChainCosts(uf=[1] * 5, ub=[2] * 5, wa=[1] * 6, wabar=[2] * 5, of=[0] * 5, ob=[0] * 5)
    assert simulate_schedule(costs, ops, persistent=True)[0] == 8 * 1 + 5 * 2  # F^1..F^3 run twice
    nodes = RotorSchedule(ops, 18, 5).nested()
    assert nodes == (
        CheckpointSegment(1, 2, (PlainStage(1), PlainStage(2))),
        CheckpointSegment(3, 3, (PlainStage(3),)),
        PlainStage(4),
        PlainStage(5),
    )
    assert flatten_nested(nodes) == ops


def test_non_algorithm2_sequence_does_not_nest():
    ops = ((FCK, 1), (FALL, 2), (FALL, 1), (BWD, 2), (BWD, 1))  # recomputes stage 1 early
    costs = ChainCosts(uf=[1, 1], ub=[1, 1], wa=[1, 1, 1], wabar=[1, 1], of=[0, 0], ob=[0, 0])
    simulate_schedule(costs, ops, persistent=True)
    with pytest.raises(ValueError, match="nested form"):
        RotorSchedule(ops, 5, 2).nested()


def test_non_persistent_sequence_is_flagged():
    # a^0 is kept by Fck^1, then Fn^1 would drop it before B^1.
    costs = ChainCosts(uf=[1, 1], ub=[1, 1], wa=[1, 1, 1], wabar=[1, 1], of=[0, 0], ob=[0, 0])
    ops = ((FCK, 1), (FALL, 2), (BWD, 2), (FALL, 1), (BWD, 1))
    assert simulate_schedule(costs, ops, persistent=True) == (5, 5)  # B^2: a^0 a^1 ā^2 δ^2 + δ^1
    with pytest.raises(ValueError, match=r"\('Fn', 2\)"):
        simulate_schedule(costs, ((FCK, 1), (FCK, 2), (FN, 2)), persistent=True)


def test_invalid_ops_are_named():
    costs = ChainCosts(uf=[1, 1], ub=[1, 1], wa=[1, 1, 1], wabar=[1, 1], of=[0, 0], ob=[0, 0])
    with pytest.raises(ValueError, match=r"\('B', 2\).*abar\^2"):
        simulate_schedule(costs, ((FCK, 1), (BWD, 2)))
    with pytest.raises(ValueError, match=r"\('Fall', 2\).*a\^1"):
        simulate_schedule(costs, ((FALL, 2),))
    with pytest.raises(ValueError, match="ends before B"):
        simulate_schedule(costs, ((FALL, 1), (FALL, 2), (BWD, 2)))


def test_chain_costs_validation():
    with pytest.raises(ValueError, match="wa has 2 entries"):
        ChainCosts(uf=[1, 1], ub=[1, 1], wa=[1, 1], wabar=[1, 1], of=[0, 0], ob=[0, 0])
    with pytest.raises(ValueError, match="ob has 1 entries"):
        ChainCosts(uf=[1, 1], ub=[1, 1], wa=[1, 1, 1], wabar=[1, 1], of=[0, 0], ob=[0])
    with pytest.raises(ValueError, match="wabar"):
        ChainCosts(uf=[1], ub=[1], wa=[1, 5], wabar=[4], of=[0], ob=[0])
    with pytest.raises(ValueError, match="memory_bytes"):
        solve_rotor(ChainCosts(uf=[1], ub=[1], wa=[1, 1], wabar=[1], of=[0], ob=[0]), 0)


def test_rotor_table_contract():
    cost, choice = rotor_table([1, 2], [3, 4], [1, 1, 1], [2, 2], [0, 0], [0, 0], 6)
    assert len(cost) == len(choice) == 3 * 7  # rows (1, 1), (1, 2), (2, 2) of 7 entries
    assert [rotor_row(2, s, t) for s, t in [(1, 1), (1, 2), (2, 2)]] == [0, 1, 2]
    table = RotorTable(2, 6, cost, choice)
    assert table.cost(1, 2, 0) == math.inf and table.choice(1, 2, 0) == -1
    assert table.cost(1, 2, 6) == 10 and table.choice(1, 2, 6) == 0
    assert cost[1 * 7 + 6] == 10
    with pytest.raises(IndexError):
        table.cost(2, 1, 0)


def test_brute_force_rejects_long_chains():
    costs = ChainCosts(uf=[1] * 6, ub=[1] * 6, wa=[1] * 7, wabar=[1] * 6, of=[0] * 6, ob=[0] * 6)
    with pytest.raises(ValueError, match="L <= 5"):
        brute_force_schedule(costs, 10)


def test_nested_checkpoints_run_in_the_model_order():
    """torch's nested non-reentrant checkpoints execute exactly the schedule's op order."""
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint

    log = []

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, index):
            ctx.index = index
            ctx.save_for_backward(x)
            return 1.5 * x

        @staticmethod
        def backward(ctx, grad):
            log.append((BWD, ctx.index))
            return 1.5 * grad, None

    def run(nodes, x):
        for node in nodes:
            if isinstance(node, PlainStage):
                log.append(("F", node.index))
                x = torch.sin(Scale.apply(x, node.index))
            else:
                x = checkpoint(lambda z, body=node.body: run(body, z), x, use_reentrant=False)
        return x

    n = 8
    costs = ChainCosts(uf=[1] * n, ub=[2] * n, wa=[4] * (n + 1), wabar=[12] * n, of=[0] * n, ob=[0] * n)
    schedule = exact(costs, 40)
    assert any(isinstance(b, CheckpointSegment) for node in schedule.nested()
               if isinstance(node, CheckpointSegment) for b in node.body)  # really nested
    run(schedule.nested(), torch.randn(3, requires_grad=True)).sum().backward()
    assert log == [("F" if kind != BWD else BWD, ell) for kind, ell in schedule.ops]
