"""The DP charges torch's early stop: a recomputed segment pays for its nodes up to its last
saving node, and nothing for that node's kernel when it saves only its inputs.

- the planner finds the cheaper plans this allows (segments ending in a matrix product), which
  the whole-segment DP could not, and their peak, prediction and numerics hold when trained;
- it is opt-in in eager (``dp_early_stop=True``) and on by default with a compiler backend on the CPU;
- ``kusumoto.solve``'s ``time_bound`` does not change its answer.
(The DP against brute force under both weightings: tests/test_kernels.py.)
"""

import copy
import dataclasses
import pathlib
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fxremat
from fxremat.budget import parse_budget
from fxremat.passes.lower import build_graph
from fxremat.passes.profile import profile
from fxremat.passes.trace import trace
from fxremat.planner import choose, recompute_time
from fxremat.simulate import rerun_time
from fxremat.records import Segment
from _models import assert_same_state, matrix_products, min_cut_replay, pair, train_step, with_grads

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.nets import transformer_stack  # noqa: E402

# planning: plans come from the DP kernels, so the pure-Python kernels' pass runs these too
pytestmark = pytest.mark.solver


def _transformer():
    torch.manual_seed(0)
    return transformer_stack(depth=4, dim=64, heads=4), torch.randn(4, 128, 64)  # the benchmarks' stack


@pytest.fixture(scope="module")
def compiled_graph():
    model, x = _transformer()
    gm = trace(model)
    return build_graph(gm, profile(gm, (x,), cost_model="compiled"))


def _whole_only(graph, budget):
    return choose(graph, budget, early_stop=False)


def test_early_stop_finds_cheaper_plans_within_the_same_budget(compiled_graph):
    graph = compiled_graph
    cheaper = 0
    for fraction in (0.85, 0.7, 0.6):
        budget = parse_budget(fraction)
        whole, early = _whole_only(graph, budget), choose(graph, budget, early_stop=True)
        assert early.peak_bytes <= early.budget_bytes and whole.peak_bytes <= whole.budget_bytes
        assert early.recompute_time == recompute_time(graph, early.schedule)
        assert early.recompute_time <= whole.recompute_time
        cheaper += early.recompute_time < 0.8 * whole.recompute_time
    assert cheaper >= 1
    # the plan at 0.7 has a recomputed segment whose recomputation skips some of its kernels
    plan = choose(graph, parse_budget(0.7), early_stop=True).schedule
    assert any(rec and rerun_time(graph, seg) < sum(graph.time[v] for v in seg)
               for seg, rec in zip(plan.segments, plan.recomputed))


def test_early_stop_is_opt_in_for_eager_plans():
    """By default the DP charges whole segments in eager (the early-stop plans ran slower through
    torch's checkpoint on this CPU, benchmarks/results/early_stop.md); ``dp_early_stop=True``
    turns it on, and it takes a bool."""
    model, x = _transformer()
    default = fxremat.plan(model, 0.7, example_inputs=(x,), cost_model="compiled")
    on = fxremat.plan(model, 0.7, example_inputs=(x,), cost_model="compiled", dp_early_stop=True)
    assert on.predicted_overhead < 0.8 * default.predicted_overhead
    with pytest.raises(TypeError, match="dp_early_stop takes True, False or None .*, got 'yes'"):
        fxremat.plan(model, 0.7, example_inputs=(x,), dp_early_stop="yes")


@pytest.mark.compiler
def test_early_stop_is_on_by_default_with_a_compiler_backend_on_the_cpu():
    """With a compiler backend AOTAutograd's backward recomputes only what it reads, so
    ``fxremat.compile(..., backend=...)`` plans CPU steps with the early stop unless told
    otherwise, and CUDA steps without it (its plans ran slower there under Inductor)."""
    from fxremat import api

    model, x = _transformer()
    plans = {}
    for label, options in (("default", {}), ("on", {"dp_early_stop": True}), ("off", {"dp_early_stop": False})):
        compiled = fxremat.compile(model, 0.7, example_inputs=(x,), backend="aot_eager", fit_compiled_peak=False,
                                   **options)  # the plans as made, not fitted to a compiled step
        plans[label] = compiled.plan
        assert compiled._remat.config.dp_early_stop is {"default": None, "on": True, "off": False}[label]
    assert plans["default"].segments == plans["on"].segments
    assert plans["default"].predicted_overhead == plans["on"].predicted_overhead
    assert plans["on"].predicted_overhead < 0.8 * plans["off"].predicted_overhead
    eager = fxremat.compile(model, 0.7, example_inputs=(x,), cost_model="compiled")
    assert eager._remat.config.dp_early_stop is False
    # the device rule, on a CUDA input this CPU can make only as a fake tensor
    default = compiled._remat.config
    gm = compiled._remat.traced
    with FakeTensorMode():
        on_cuda = torch.empty(x.shape, device="cuda")
    assert api._early_stop(dataclasses.replace(default, dp_early_stop=None), gm, (x,)) is True
    assert api._early_stop(dataclasses.replace(default, dp_early_stop=None), gm, (on_cuda,)) is False
    assert api._early_stop(dataclasses.replace(default, dp_early_stop=True), gm, (on_cuda,)) is True
    assert api._early_stop(dataclasses.replace(default, dp_early_stop=False), gm, (x,)) is False


def test_the_whole_segment_plan_stays_a_candidate(compiled_graph):
    """With the early stop the planner keeps the fastest plan of each weighting: the whole-segment
    plan (what the DP picks without the early stop) is among the alternatives autotune times."""
    graph, budget = dataclasses.replace(compiled_graph, param_grads_held=True), parse_budget(0.7)  # as under a backend
    whole, early = choose(graph, budget, nested=False), choose(graph, budget, nested=False, early_stop=True)
    assert early.schedule != whole.schedule
    found = [(name, sched) for name, sched, _, _ in early.alternatives]
    assert found[0] == (early.strategy, early.schedule)
    assert (whole.strategy, whole.schedule) in found


@pytest.mark.compiler
def test_autotune_times_compiled_steps_under_a_compiler_backend(monkeypatch):
    """With ``backend=``, autotune compiles every candidate (and the plain graph) with that backend
    and times those steps, keeping the fastest measured; without a backend they run eagerly."""
    from fxremat import api

    compiled_graphs = []

    def counting_backend(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm.forward

    timed = []

    def step_times(modules, inputs, repeats):
        timed.append(modules)
        for m in modules:  # one step each, as the untimed round does: compiles them
            loss = sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(m(*inputs)))
            loss.backward()
        return [10.0] + [20.0 - i for i in range(len(modules) - 1)]  # the last candidate is fastest

    monkeypatch.setattr(api, "step_times", step_times)
    model, x = _transformer()
    tuned = fxremat.compile(model, 0.7, example_inputs=(x,), backend=counting_backend, autotune=8)
    modules = timed[0]
    assert all(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in modules)
    assert len(compiled_graphs) >= len(modules)  # each compiled by the backend
    trials = tuned.plan.autotune
    assert len(trials) == len(modules) - 1 and trials[-1].chosen
    assert tuned.plan.predicted_overhead == trials[-1].predicted_overhead
    eager = fxremat.compile(model, 0.7, example_inputs=(x,), cost_model="compiled", autotune=2)
    assert eager.plan.autotune and all(not isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
                                       for m in timed[-1])
    torch._dynamo.reset()


@pytest.mark.parametrize("fraction", [0.7, 0.5])
def test_early_stop_plans_train_exactly_within_their_predicted_peak(fraction):
    """FLOP costs use the early-stop DP; the emitted step is exact against the plain model and
    its measured peak is the predicted one."""
    model, x = _transformer()
    plain, twin = pair(model)
    compiled = with_grads(fxremat.compile(twin, fraction, example_inputs=(x,), cost_model="flops", dp_early_stop=True))
    plain = with_grads(plain)
    _, peak = fxremat.measure_peak(train_step, compiled, x)
    plan = compiled.plan
    assert abs(peak / plan.predicted_peak_bytes - 1) <= 0.02, (peak, plan.predicted_peak_bytes)
    assert peak <= 1.05 * plan.budget_bytes
    for m in (plain, compiled):
        for p in m.parameters():
            p.grad = None
    torch.testing.assert_close(train_step(compiled, x), train_step(plain, x), rtol=0, atol=0)
    assert_same_state(plain, compiled)


@pytest.mark.compiler
def test_a_compiled_backward_reruns_only_what_it_reads():
    """In one compiled backward a recomputed segment reruns the nodes whose values its nodes save
    and what they are computed from (:func:`fxremat.simulate.partitioned_rerun_time`), not torch's
    early-stop prefix up to the last saving node: the segment's output (a dropout, with its mask)
    is kept, so the Linear before it is not run again. The partitioner, given the segment with
    fxremat's pass, runs one matrix product more in the backward than the plan that recomputes
    nothing, not two."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32),
                                torch.nn.Dropout(0.1), torch.nn.Linear(32, 32))
    x = torch.randn(16, 32)
    gm = trace(model)
    graph = build_graph(gm, profile(gm, (x,), cost_model="flops"))
    seg = (0, 1, 2, 3)
    assert rerun_time(graph, seg) == sum(graph.time[v] for v in seg)  # eager: up to the dropout's mask
    compiled = dataclasses.replace(graph, param_grads_held=True)
    assert rerun_time(compiled, seg) == graph.time[0] + graph.time[1]  # the dropout's output and mask are kept

    products = {}
    plain_plan = fxremat.plan(copy.deepcopy(model), 1.0, example_inputs=(x,), cost_model="flops")
    segments = (Segment(graph.names[:4], True, (), 0, 0.0), Segment(graph.names[4:], False, (), 0, 0.0))
    for name, plan in (("plain", plain_plan), ("recomputed", dataclasses.replace(plain_plan, segments=segments))):
        torch._dynamo.reset()
        graphs = {}
        compiled_model = fxremat.compile(copy.deepcopy(model), 2 * plan.budget_bytes, example_inputs=(x,), plan=plan,
                                         backend=min_cut_replay(graphs))
        assert [s.recomputed for s in compiled_model.plan.segments] == [s.recomputed for s in plan.segments]
        torch.manual_seed(1)
        compiled_model(x).sum().backward()
        products[name] = matrix_products(graphs["backward"])
    assert products["recomputed"] == products["plain"] + 1
    torch._dynamo.reset()
