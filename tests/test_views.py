"""Plan views: explain, timeline, tradeoff, plots, save/load keyed by the graph."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fxremat
from fxremat import identity, measure, planner, plots, simulate
from fxremat.budget import parse_budget
from fxremat.passes.lower import build_graph
from fxremat.passes.profile import profile
from fxremat.passes.trace import trace
from fxremat.core import Timeline
from fxremat.records import Plan
from fxremat.planner import choose

from _models import small_unet

PNG_HEADER = b"\x89PNG\r\n\x1a\n"
SHAPE = (2, 3, 32, 32)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return small_unet()


@pytest.fixture(scope="module")
def x():
    return torch.randn(SHAPE)


@pytest.fixture(scope="module")
def plan(model, x) -> Plan:
    return fxremat.plan(model, 0.5, example_inputs=(x,), cost_model="flops")


@pytest.fixture(scope="module")
def graph(model, x):
    gm = trace(model)
    return build_graph(gm, profile(gm, (x,), cost_model="flops"))


# --------------------------------------------------------------------------------------------
# explain
# --------------------------------------------------------------------------------------------

def test_explain_lists_every_kept_and_recomputed_value(plan):
    text = plan.explain()
    kept = [n for s in plan.segments for n in s.kept]
    recomputed = [n for s in plan.segments if s.recomputed for n in s.nodes if n not in s.kept]
    assert kept and recomputed
    assert f"{len(kept)} values kept" in text and f"{len(recomputed)} values recomputed" in text
    lines = text.splitlines()
    for name in kept + recomputed:
        row = next(line for line in lines if line.split()[1:2] == [name])
        assert "unet.py:" in row, row  # the source line in the example, not in torch or fxremat
    conv = next(line for line in lines if line.split()[1:2] == ["down_0_0"])
    assert "down.0.0 (Conv2d)" in conv and "KiB" in conv


def test_node_infos_name_module_and_user_source(plan):
    infos = {n.name: n for n in plan.nodes}
    assert len(infos) == plan.num_nodes
    cat = infos["cat"]
    assert cat.module.endswith("(UpBlock)") and cat.source.rsplit(":", 1)[0].endswith("unet.py")
    assert "torch.cat" in cat.code
    assert any(info.mutated_buffers for info in infos.values())  # BatchNorm running statistics


def test_explain_without_node_details(plan):
    bare = dataclasses.replace(plan, nodes=())
    assert "no per-node details" in bare.explain()


# --------------------------------------------------------------------------------------------
# timeline
# --------------------------------------------------------------------------------------------

def test_timeline_peak_is_the_predicted_peak(plan):
    tl = plan.timeline()
    assert tl.peak_bytes == plan.predicted_peak_bytes
    assert 0 < tl.backward_start < len(tl.bytes)


def test_backward_starts_at_the_loss(graph):
    choice = choose(graph, parse_budget(0.6))
    tl = simulate.predicted_timeline(graph, choice.schedule)
    assert graph.loss_bytes > 0
    assert tl.bytes[tl.backward_start] - tl.bytes[tl.backward_start - 1] == graph.loss_bytes
    assert tl.peak_bytes == choice.peak_bytes


def test_measured_timeline_of_the_compiled_model(model):
    x = torch.randn(1, 3, 16, 16)
    compiled = fxremat.compile(model, "min", example_inputs=(x,), cost_model="flops")
    measured = measure.measure_timeline(compiled, x)
    assert 0 < measured.backward_start < len(measured.bytes)
    assert 0 < measured.peak_bytes <= 1.05 * compiled.plan.predicted_peak_bytes
    for p in model.parameters():
        p.grad = None


def test_plot_timeline_writes_png(plan, tmp_path):
    pytest.importorskip("matplotlib")
    measured = Timeline((0, 10, 2**20, 5), backward_start=2)
    fig = plan.plot_timeline(tmp_path / "timeline.png", measured=measured)
    assert fig.axes and (tmp_path / "timeline.png").read_bytes()[:8] == PNG_HEADER


def test_default_loss():
    logits = torch.randn(2, 3, 4, requires_grad=True)
    vector = torch.randn(5, requires_grad=True)
    loss = measure.default_loss((logits, vector))
    assert loss.dim() == 0 and loss.requires_grad
    with pytest.raises(ValueError, match="requires grad"):
        measure.default_loss(torch.randn(2, 3))


# --------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------

def test_save_load_round_trip(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path, sources=True)
    loaded = fxremat.load_plan(path)
    assert loaded == plan
    assert loaded.summary() == plan.summary() and loaded.explain() == plan.explain()


def test_saved_plan_has_no_paths_or_source_lines_by_default(plan, tmp_path):
    assert any(n.source for n in plan.nodes)  # the in-memory plan knows its sources
    path = tmp_path / "plan.json"
    plan.save(path)
    text = path.read_text()
    assert "/" not in text.replace('"format": "fxremat-plan/1"', "") and ".py:" not in text
    loaded = fxremat.load_plan(path)
    assert loaded.summary() == plan.summary()
    assert [(n.name, n.mutated_buffers) for n in loaded.nodes] == [(n.name, n.mutated_buffers) for n in plan.nodes]
    assert all(n.source == "" and n.code == "" for n in loaded.nodes)
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left behind


def test_load_checks_the_graph(plan, model, x, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    assert fxremat.load_plan(path, model=model, example_inputs=x).summary() == plan.summary()
    with pytest.raises(identity.PlanMismatchError, match="another graph or input signature"):
        fxremat.load_plan(path, model=model, example_inputs=torch.randn(4, 3, 32, 32))
    again = fxremat.plan(model, 0.5, example_inputs=(x,), cost_model="flops")
    assert again.graph_key == plan.graph_key  # same model, same input: same key
    with pytest.raises(TypeError, match="both"):
        fxremat.load_plan(path, model=model)


def test_plan_for_another_graph_is_refused(plan, x, tmp_path):
    import cli_models

    path = tmp_path / "plan.json"
    plan.save(path)
    with pytest.raises(identity.PlanMismatchError, match=r"plan .*plan\.json was made for another graph"):
        fxremat.load_plan(path, model=cli_models.wide_unet(), example_inputs=(x,))


def test_graph_key_covers_code_widths_and_inputs(model, x):
    gm = trace(model)
    key = identity.graph_key(gm, (x,))
    assert key == identity.graph_key(trace(model), (x.clone(),))
    assert key != identity.graph_key(gm, (x.double(),))
    assert key != identity.graph_key(gm, (x[:1],))
    import cli_models

    assert key != identity.graph_key(trace(cli_models.wide_unet()), (x,))


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x, scale=2):
        return self.linear(x) * scale


def test_graph_key_counts_omitted_inputs_as_their_defaults():
    gm, x = trace(_Scaled()), torch.randn(2, 3)
    assert identity.graph_key(gm, (x,)) == identity.graph_key(gm, (x, 2)) != identity.graph_key(gm, (x, 3))


def test_check_plan_without_key(plan, model, x):
    with pytest.raises(identity.PlanMismatchError, match="no graph key"):
        identity.check_plan(dataclasses.replace(plan, graph_key=""), trace(model), (x,))
    with pytest.raises(ValueError, match="graph_key"):
        dataclasses.replace(plan, graph_key="").save("unused.json")


def test_load_rejects_other_files(plan, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not an fxremat plan"):
        fxremat.load_plan(other)
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    data["plan"]["from_the_future"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="from_the_future"):
        fxremat.load_plan(path)


# --------------------------------------------------------------------------------------------
# tradeoff
# --------------------------------------------------------------------------------------------

def test_tradeoff_is_a_pareto_curve(graph, tmp_path):
    points = planner.tradeoff(graph, points=6)
    least = choose(graph, parse_budget("min"))
    assert points[0].strategy == "none" and points[0].predicted_overhead == 0.0
    assert points[-1].predicted_peak_bytes == least.peak_bytes
    for a, b in zip(points, points[1:]):
        assert a.predicted_overhead <= b.predicted_overhead and a.predicted_peak_bytes > b.predicted_peak_bytes
    planner.write_csv(points, tmp_path / "curve.csv")
    assert len((tmp_path / "curve.csv").read_text().splitlines()) == len(points) + 1
    with pytest.raises(ValueError, match="points"):
        planner.tradeoff(graph, points=1)


def test_plot_tradeoff_writes_png(graph, tmp_path):
    pytest.importorskip("matplotlib")
    points = planner.tradeoff(graph, points=3)
    plots.plot_tradeoff(points, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == PNG_HEADER
