"""No silent surprises (issue 13, items 3, 5, 6, 8, 10): attributes reach the model, saved plans
are checked and re-derived, options are validated at the call, edge inputs get clear errors,
and the stages of compiling are logged."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import linecache
import logging
import pickle
import random
import sys
import types
import warnings

import pytest
import torch
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F

import fxremat
from fxremat.api import _NONE_ARGS
from fxremat.identity import PlanMismatchError
from _models import assert_same_state, loss_of, pair, train_step, with_grads

X = torch.randn(2, 3, 16, 16)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    """A chain of conv-BN blocks with a plain attribute read by forward, and a helper method."""

    def __init__(self, c=8, n=6, num_classes=4):
        super().__init__()
        self.num_classes = num_classes
        self.scale = 1.0
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*(Block(c) for _ in range(n)))
        self.head = nn.Conv2d(c, num_classes, 1)

    def encode(self, x):
        return self.blocks(self.stem(x))

    def forward(self, x):
        return self.head(self.encode(x)) * self.scale


def _net():
    torch.manual_seed(0)
    return Net()


def _assert_trains_like(plain, remat, x, steps=2):
    for step in range(steps):
        expected, got = train_step(plain, x, seed=step), train_step(remat, x, seed=step)
        assert torch.equal(expected, got)
    assert_same_state(plain, remat)


# --------------------------------------------------------------------------------------------
# item 3: attributes and methods
# --------------------------------------------------------------------------------------------

def test_attributes_and_methods_reach_the_original_model():
    model = _net()
    remat = fxremat.compile(model, 0.5, example_inputs=(X,), cost_model="flops")
    assert remat.num_classes == 4 and remat.scale == 1.0
    assert remat.encode.__self__ is model  # bound to the original model: runs plainly
    assert torch.equal(remat.encode(X), model.encode(X))
    assert "encode" in dir(remat) and "num_classes" in dir(remat)
    assert remat.plan is not None and isinstance(remat.forward.__self__, fxremat.RematModule)  # its own names win
    with pytest.raises(AttributeError, match="no_such_thing"):
        remat.no_such_thing
    assert not hasattr(remat, "no_such_thing")


def test_libraries_inspecting_the_forward_and_the_class_see_the_models():
    # Hugging Face's Trainer keeps the dataset columns model.forward names (it saw (*args, **kwargs)
    # and dropped every input), finds labels in type(model).forward (a property: TypeError), and
    # shifts a causal LM's smoothed labels by model._get_name() (it saw "RematModule")
    model = _net()
    remat = fxremat.compile(model, 0.5, example_inputs=(X,), cost_model="flops")
    assert inspect.signature(remat.forward) == inspect.signature(model.forward)
    assert inspect.signature(type(remat).forward) == inspect.signature(Net.forward)
    assert remat._get_name() == "Net" and repr(remat).startswith("RematModule(Net(")
    copied = pickle.loads(pickle.dumps(remat))
    assert type(copied) is type(remat) and copied._remat.model is not model


def test_compiling_a_tied_hugging_face_model_with_trainer_loaded_warns_at_compile(monkeypatch):
    # Trainer saves a RematModule (not a PreTrainedModel) as its bare state_dict, which safetensors
    # refuses for tied weights: a run stopped at its first checkpoint. Say so at compile instead.
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Trainer not loaded: nothing to say
        fxremat.compile(transformers.GPT2LMHeadModel(config), "min")
    monkeypatch.setitem(sys.modules, "transformers.trainer", types.ModuleType("transformers.trainer"))
    with pytest.warns(UserWarning, match=r"ties transformer\.wte\.weight and lm_head\.weight.*class RematTrainer"):
        fxremat.compile(transformers.GPT2LMHeadModel(config), "min")


def test_setting_an_attribute_sets_it_on_the_model_and_replans():
    plain, model = pair(_net())
    remat = fxremat.compile(model, 0.5, example_inputs=(X,), cost_model="flops")
    remat.scale = 3.0  # torch.fx baked 1.0 into the graph: the graph must follow
    plain.scale = 3.0
    assert model.scale == 3.0 and "scale" not in remat.__dict__
    _assert_trains_like(with_grads(plain), with_grads(remat), X)
    assert remat.plan.strategy != "none"  # planned again for the new graph, still recomputing


def test_replacing_a_submodule_reaches_the_compiled_graph():
    plain, model = pair(_net())
    remat = fxremat.compile(model, 0.5, example_inputs=(X,), cost_model="flops")
    head = nn.Conv2d(8, 4, 1)
    remat.head, plain.head = head, copy.deepcopy(head)
    assert model.head is head
    _assert_trains_like(with_grads(plain), with_grads(remat), X)
    del remat.num_classes
    assert not hasattr(model, "num_classes")


class GainNet(Net):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.full((1, 4, 1, 1), 1.5))

    def forward(self, x):
        return super().forward(x) * self.gain


def test_replacing_a_parameter_or_adding_a_flag_keeps_the_graph(monkeypatch):
    """FSDP2 swaps a compiled module's own parameters and sets new flags on it: no re-trace (the
    graph and plans stay), and training follows the new parameter (get_attr copies are rebound)."""
    torch.manual_seed(0)
    plain, model = pair(GainNet())
    remat = fxremat.compile(model, 0.5, example_inputs=(X,), cost_model="flops")
    monkeypatch.setattr(fxremat.api, "trace", lambda *a, **k: pytest.fail("re-traced"))
    remat.gain = nn.Parameter(torch.full((1, 4, 1, 1), 0.5))
    plain.gain = nn.Parameter(torch.full((1, 4, 1, 1), 0.5))
    remat._is_some_wrapper_flag = True
    assert model._is_some_wrapper_flag and model.gain is remat.gain
    _assert_trains_like(with_grads(plain), with_grads(remat), X)


# --------------------------------------------------------------------------------------------
# item 5: saved plans are checked and re-derived
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    plan = fxremat.plan(_net(), 0.5, example_inputs=(X,), cost_model="flops")
    assert any(s.recomputed for s in plan.segments)
    plan.save(path)
    return plan, path


def _edited(path, tmp_path, edit):
    data = json.loads(path.read_text())
    edit(data["plan"])
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(data))
    return out


def test_saved_plan_is_used_as_planned(saved):
    plan, path = saved
    plain, model = pair(_net())
    remat = fxremat.compile(model, 0.5, example_inputs=(X,), plan=fxremat.load_plan(path))
    assert remat.plan.predicted_peak_bytes == plan.predicted_peak_bytes
    assert remat.plan.segments == plan.segments
    _assert_trains_like(with_grads(plain), with_grads(remat), X)
    _, peak = fxremat.measure_peak(lambda: loss_of(remat(X)).backward())
    assert peak <= plan.budget_bytes


@pytest.mark.parametrize("kwargs", [{"strategy": "exact"}, {"cost_model": "flops"}])
def test_options_a_saved_plan_overrides_are_refused(saved, kwargs):
    _, path = saved
    with pytest.raises(TypeError, match=f"{next(iter(kwargs))}=.* has no effect with plan="):
        fxremat.compile(_net(), 0.5, example_inputs=(X,), plan=fxremat.load_plan(path), **kwargs)


def test_emptied_mutated_buffers_are_derived_again(saved, tmp_path):
    _, path = saved

    def edit(p):
        for node in p["nodes"]:
            node["mutated_buffers"] = []

    plain, model = pair(_net())
    remat = fxremat.compile(model, 0.5, example_inputs=(X,), plan=fxremat.load_plan(_edited(path, tmp_path, edit)))
    assert any(n.mutated_buffers for n in remat.plan.nodes)
    _assert_trains_like(with_grads(plain), with_grads(remat), X)  # BatchNorm updated once per step


def test_edited_segments_report_their_own_peak_and_must_fit_the_budget(saved, tmp_path):
    plan, path = saved

    def keep_all(p):
        for seg in p["segments"]:
            seg["recomputed"] = False
            seg["inner"] = []

    edited = fxremat.load_plan(_edited(path, tmp_path, keep_all))
    with pytest.raises(fxremat.PlanBudgetError) as info:
        fxremat.compile(_net(), 0.5, example_inputs=(X,), plan=edited)
    assert str(plan.baseline_peak_bytes) in str(info.value) and str(plan.budget_bytes) in str(info.value)
    remat = fxremat.compile(_net(), 1.0, example_inputs=(X,), plan=edited)
    assert remat.plan.predicted_peak_bytes == plan.baseline_peak_bytes


def test_budget_given_with_a_plan_is_checked(saved):
    plan, path = saved
    with pytest.raises(fxremat.PlanBudgetError, match=f"at least {plan.predicted_peak_bytes} bytes"):
        fxremat.plan(_net(), plan.predicted_peak_bytes - 1, example_inputs=(X,), plan=fxremat.load_plan(path))
    with pytest.raises(fxremat.PlanBudgetError, match="budget='min'"):
        fxremat.plan(_net(), "min", example_inputs=(X,), plan=fxremat.load_plan(path))
    again = fxremat.plan(_net(), plan.predicted_peak_bytes, example_inputs=(X,), plan=fxremat.load_plan(path))
    assert again.budget_bytes == plan.predicted_peak_bytes and again.predicted_peak_bytes == plan.predicted_peak_bytes


@pytest.mark.parametrize("field, value, needle", [
    ("recomputed", "no", "plan.segments[0].recomputed must be true or false, got 'no'"),
    ("kept_bytes", -3, "plan.segments[0].kept_bytes must be an int >= 0, got -3"),
    ("nodes", "stem", "plan.segments[0].nodes must be a list of strings"),
])
def test_bad_segment_fields_name_file_and_field(saved, tmp_path, field, value, needle):
    _, path = saved
    edited = _edited(path, tmp_path, lambda p: p["segments"][0].__setitem__(field, value))
    with pytest.raises(ValueError) as info:
        fxremat.load_plan(edited)
    assert str(edited) in str(info.value) and needle in str(info.value)


@pytest.mark.parametrize("field, value", [("strategy", "fast"), ("cost_model", "time"), ("budget_bytes", "1GB"),
                                          ("predicted_overhead", float("nan")), ("notes", "note")])
def test_bad_plan_fields_name_the_field(saved, tmp_path, field, value):
    _, path = saved
    edited = _edited(path, tmp_path, lambda p: p.__setitem__(field, value))
    with pytest.raises(ValueError, match=f"field plan.{field} must be"):
        fxremat.load_plan(edited)


def test_missing_and_misplaced_nodes_name_the_segment(saved, tmp_path):
    _, path = saved
    dropped = fxremat.load_plan(_edited(path, tmp_path, lambda p: p["segments"][-1]["nodes"].pop()))
    with pytest.raises(PlanMismatchError, match=r"plan.segments leaves out 1 call nodes"):
        fxremat.compile(_net(), 0.5, example_inputs=(X,), plan=dropped)

    def swap(p):
        p["segments"][0], p["segments"][1] = p["segments"][1], p["segments"][0]

    with pytest.raises(PlanMismatchError, match=r"plan.segments\[0\] runs .* before its input"):
        fxremat.compile(_net(), 0.5, example_inputs=(X,), plan=fxremat.load_plan(_edited(path, tmp_path, swap)))


def test_truncated_file_names_the_file(saved, tmp_path):
    _, path = saved
    cut = tmp_path / "cut.json"
    cut.write_text(path.read_text()[:200])
    with pytest.raises(ValueError, match=r"cut\.json is not valid JSON \(the file ends early: truncated\?\)"):
        fxremat.load_plan(cut)


def test_plan_edited_in_python_is_checked_at_the_call(saved):
    plan, _ = saved
    bad = dataclasses.replace(plan, segments=(dataclasses.replace(plan.segments[0], recomputed="no"),
                                              *plan.segments[1:]))
    with pytest.raises(ValueError, match=r"fxremat.compile: field plan.segments\[0\].recomputed"):
        fxremat.compile(_net(), 0.5, plan=bad)


# --------------------------------------------------------------------------------------------
# item 6: options validated at the call (no example_inputs: nothing runs before the check)
# --------------------------------------------------------------------------------------------

BAD_OPTIONS = {
    "strategy": ({"strategy": "fast"}, ValueError, "strategy must be one of .* got 'fast'"),
    "cost_model": ({"cost_model": "time"}, ValueError, "cost_model must be one of .* got 'time'"),
    "exact_cap negative": ({"exact_cap": -5}, ValueError, "exact_cap must be a positive int or None .* got -5"),
    "exact_cap str": ({"exact_cap": "big"}, ValueError, "exact_cap must be a positive int or None .* got 'big'"),
    "profile_repeats": ({"profile_repeats": 0}, ValueError, "profile_repeats must be a positive int, got 0"),
    "leaf str": ({"leaf_modules": "Block"}, TypeError, r"got 'Block' alone; write leaf_modules=\('Block',\)"),
    "leaf class alone": ({"leaf_modules": Block}, TypeError, r"write leaf_modules=\(Block,\)"),
    "leaf class name": ({"leaf_modules": ("Block",)}, ValueError, "'Block' is not a submodule .* pass the class"),
    "leaf unknown": ({"leaf_modules": ("blocks.9",)}, ValueError, r"'blocks.9' is not a submodule of Net; close"),
    "leaf other": ({"leaf_modules": (3,)}, TypeError, "got int 3"),
}


@pytest.mark.parametrize("api", ["compile", "plan"])
@pytest.mark.parametrize("kwargs, exc, match", BAD_OPTIONS.values(), ids=list(BAD_OPTIONS))
def test_bad_options_fail_at_the_call(api, kwargs, exc, match, monkeypatch):
    import fxremat.api

    monkeypatch.setattr(fxremat.api, "trace", lambda *a, **k: pytest.fail("traced before validating"))
    extra = {"example_inputs": (X,)} if api == "plan" else {}
    with pytest.raises(exc, match=f"fxremat.{api}: .*{match}"):
        getattr(fxremat, api)(_net(), 0.5, **extra, **kwargs)


def test_qualified_leaf_names_are_accepted():
    plan = fxremat.plan(_net(), 0.5, example_inputs=(X,), cost_model="flops", leaf_modules=("blocks.0", Block))
    assert "blocks_0" in {n.name for n in plan.nodes}


# --------------------------------------------------------------------------------------------
# item 8: edges
# --------------------------------------------------------------------------------------------

def test_empty_batch_plans_and_trains_like_eager():
    empty = torch.randn(0, 3, 16, 16)
    plan = fxremat.plan(_net(), 1.0, example_inputs=(empty,), cost_model="flops")
    assert plan.predicted_overhead == 0.0
    plain, model = pair(_net())
    remat = fxremat.compile(model, "min", example_inputs=(empty,), cost_model="flops")
    _assert_trains_like(with_grads(plain), with_grads(remat), empty, steps=1)


def test_meta_input_is_refused_at_the_call():
    with pytest.raises(ValueError, match="fxremat.compile: input 0 .* on the meta device.*FakeTensorMode"):
        fxremat.compile(_net(), 0.5, example_inputs=(X.to("meta"),))
    remat = fxremat.compile(_net(), 0.5)  # planned on the first training step: same check there
    with pytest.raises(ValueError, match="input 0 .* on the meta device"):
        remat(X.to("meta"))


def test_meta_model_is_refused_at_the_call():
    with pytest.raises(ValueError, match="parameters or buffers are on the meta device.*to_empty"):
        fxremat.compile(_net().to("meta"), 0.5, example_inputs=(X,))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_input_on_another_device_is_refused():
    with pytest.raises(ValueError, match=r"input 0 .* is on cpu but the model's parameters are on cuda"):
        fxremat.compile(_net().cuda(), 0.5, example_inputs=(X,))


# --------------------------------------------------------------------------------------------
# item 10: stages are logged
# --------------------------------------------------------------------------------------------

def test_compile_logs_its_stages_with_times(caplog):
    with caplog.at_level(logging.INFO, logger="fxremat"):
        fxremat.compile(_net(), 0.5, example_inputs=(X,), cost_model="flops")
    stages = [r.fxremat_stage for r in caplog.records if hasattr(r, "fxremat_stage")]
    assert stages == ["tracing", "profiling", "solving", "emitting"]
    done = [r.getMessage() for r in caplog.records if hasattr(r, "fxremat_stage_done")]
    assert len(done) == 4 and all(" done in " in m and m.endswith("s") for m in done)


# --------------------------------------------------------------------------------------------
# item 9: reproducible plans
# --------------------------------------------------------------------------------------------

def test_flops_cost_model_gives_the_same_plan_in_every_process():
    """cost_model="flops" is the reproducible choice (README): fresh processes, different hash
    seeds (set and dict orders of strings change), the same plan."""
    import os
    import pathlib
    import subprocess
    import sys

    code = ("import torch, fxremat\n"
            "from _models import small_unet\n"
            "torch.manual_seed(0)\n"
            "p = fxremat.plan(small_unet(), 0.5, example_inputs=(torch.randn(2, 3, 32, 32),), cost_model='flops')\n"
            "print(p.predicted_peak_bytes, p.predicted_overhead, p.strategy, [s.nodes for s in p.segments if s.recomputed])\n")
    here = pathlib.Path(__file__).resolve().parent
    runs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed,
                   PYTHONPATH=os.pathsep.join(filter(None, (str(here), os.environ.get("PYTHONPATH")))))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        runs.add(out.stdout)
    assert len(runs) == 1 and "[(" in runs.pop()


@pytest.mark.compiler
def test_measuring_a_compiled_model_leaves_it_compiled_and_says_what_was_measured():
    """``fxremat.measure_peak`` runs the call under a dispatch-mode tracker, where torch.compile
    does not compile and marks the code it meets to be skipped for good: one measured step left
    a compiled model eager from then on. Now the compiled code runs eagerly for the measurement
    only, with a warning naming ``allocated_peak``, and the next step runs compiled again; the
    same for a model compiled by ``fxremat.compile(..., backend=...)``."""
    calls = []

    def counting(gm, example_inputs):  # a torch.compile backend: counts the compiled graph's runs
        def run(*args):
            calls.append(1)
            return gm.forward(*args)
        return run

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    plain = with_grads(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh()))
    compiled = torch.compile(copy.deepcopy(plain), backend=counting)
    remat = fxremat.compile(copy.deepcopy(plain), "min", example_inputs=(x,), backend=counting,
                            fit_compiled_peak=False)
    plain_peak = [fxremat.measure_peak(train_step, plain, x)[1] for _ in range(2)][-1]  # the first holds more
    for model, eager_peak in ((compiled, plain_peak), (remat, None)):
        train_step(model, x)
        del calls[:]
        train_step(model, x)
        assert calls, "the compiled graph runs"
        with pytest.warns(UserWarning, match=r"measure_peak: .* is compiled .*allocated_peak"):
            _, peak = fxremat.measure_peak(train_step, model, x)
        assert eager_peak is None or peak == eager_peak  # the step run eagerly: its plain twin's
        del calls[:]
        train_step(model, x)
        assert calls, "still compiled after the measurement"


# --------------------------------------------------------------------------------------------
# What users change below the top, or around a step
# --------------------------------------------------------------------------------------------

class Scaled(nn.Module):
    """A block torch.fx traces through, with settings its graph bakes in."""

    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.scale = 1.0
        self.p = 0.2

    def forward(self, x):
        return F.dropout(torch.tanh(self.conv(x)) * self.scale, self.p, self.training) + x


class ScaledNet(nn.Module):
    def __init__(self, c=8, n=4):
        super().__init__()
        self.temperature = 1.0
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*(Scaled(c) for _ in range(n)))
        self.drop = nn.Dropout(0.0)
        self.head = nn.Conv2d(c, 4, 1)

    def forward(self, x):
        return self.head(self.drop(self.blocks(self.stem(x)))) / self.temperature


def _set_scale(m):
    m.blocks[1].scale = 3.0


def _new_conv(m):
    torch.manual_seed(5)
    m.blocks[2].conv = nn.Conv2d(8, 8, 3, padding=1)


def _delete_and_set(m):
    """Through the RematModule: the deletion traced again at once, and failed (the forward reads
    ``head``)."""
    torch.manual_seed(5)
    head = nn.Conv2d(8, 4, 1)
    del m.head
    m.head = head


@pytest.mark.parametrize("change", [
    _set_scale,
    lambda m: m.blocks[1].eval(),
    _new_conv,
    _delete_and_set,
], ids=["attribute", "eval", "submodule", "deleted-and-set"])
def test_a_setting_changed_below_the_top_reaches_the_graph(change):
    """torch.fx bakes Python settings of the modules it traces through into the graph: a
    drop-path schedule, ``block.eval()`` or a new submodule trained the compiled graph, silently."""
    torch.manual_seed(0)
    plain, model = pair(ScaledNet())
    remat = fxremat.compile(model, "min", example_inputs=(X,), cost_model="flops")
    _assert_trains_like(with_grads(plain), with_grads(remat), X, steps=1)
    change(plain)
    change(remat)
    _assert_trains_like(plain, remat, X)


def test_a_setting_changed_on_the_original_model_reaches_the_graph():
    torch.manual_seed(0)
    plain, model = pair(ScaledNet())
    remat = fxremat.compile(model, "min", example_inputs=(X,), cost_model="flops")
    plain.temperature = model.temperature = 2.0  # on the object the user still holds
    _assert_trains_like(with_grads(plain), with_grads(remat), X)


def _peak_over_budget(remat, x) -> float:
    with_grads(remat)
    train_step(remat, x)
    return fxremat.measure_peak(train_step, remat, x)[1] / remat.plan.budget_bytes


def test_a_plan_follows_what_trains_and_what_a_leaf_measures():
    """Unfreezing a frozen stem (its gradients were not in the plan) and raising a dropout's ``p``
    from 0 (where it keeps no mask) plan again: before, 1.8x and 1.33x the budget."""
    torch.manual_seed(0)
    model = ScaledNet()
    model.stem.requires_grad_(False)
    remat = fxremat.compile(model, "min", example_inputs=(X,), cost_model="flops")
    frozen = remat.plan
    assert _peak_over_budget(remat, X) <= 1.05
    model.stem.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # planned again, not evicted: no "planning again ... evicted" warning
        assert _peak_over_budget(remat, X) <= 1.05 and remat.plan is not frozen
    before = remat.plan
    remat.drop.p = 0.5
    assert _peak_over_budget(remat, X) <= 1.05 and remat.plan is not before


class Counted(nn.Module):
    """A step counter (a buffer) read by an activation: updated before the read, or after it."""

    def __init__(self, first: bool):
        super().__init__()
        self.first = first
        self.c1, self.c2, self.c3 = (nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1) for i in range(3))
        self.fc = nn.Linear(8, 5)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        if self.first:
            self.steps.add_(1)
        h = torch.sigmoid(torch.tanh(self.c1(x) + self.steps))  # (no scalar read from it to keep instead)
        y = torch.tanh(self.c3(torch.tanh(self.c2(h)))) + h
        out = self.fc(y.mean((2, 3)))
        if not self.first:
            self.steps.add_(1)
        return out


@pytest.mark.parametrize("first", [True, False], ids=["updated-then-read", "read-then-updated"])
def test_a_recomputation_reads_buffers_as_the_forward_read_them(first):
    """Recomputed, the read saw the counter as the whole step left it: wrong gradients."""
    torch.manual_seed(0)
    plain, model = pair(Counted(first))
    x = torch.randn(4, 3, 16, 16)
    remat = fxremat.compile(model, "min", example_inputs=(x,), cost_model="flops")
    assert "reads = ('steps',)" in remat.code
    for m in (plain, remat):
        for _ in range(2):
            m(x).square().mean().backward()
    assert_same_state(plain, remat)


def test_a_step_backpropagated_twice_recomputes_twice():
    """``retain_graph=True`` and a ``create_graph=True`` gradient penalty enter the recomputation's
    context again (a generator context manager could be entered once)."""
    plain, model = pair(_net())
    remat = fxremat.compile(model, "min", example_inputs=(X,), cost_model="flops")
    for m in (plain, remat):
        out = m(X)
        loss_of(out).backward(retain_graph=True)
        out.square().mean().backward()
        x = X.clone().requires_grad_()
        (g,) = torch.autograd.grad(m(x).square().mean(), x, create_graph=True)
        g.square().sum().backward()
    assert_same_state(plain, remat)


def test_a_recomputation_reads_the_parameters_its_forward_read():
    """Under ``torch.func.functional_call`` the forward reads the call's tensors and the
    recomputation read the module's; a parameter written in place before the backward is refused,
    as eager PyTorch refuses it."""
    plain, model = pair(_net())
    remat = fxremat.compile(model, "min", example_inputs=(X,), cost_model="flops")
    grads = []
    for m in (plain, remat):
        params = {k: v.detach().mul(1.5).requires_grad_() for k, v in m.named_parameters()}
        out = torch.func.functional_call(m, params, (X,))
        grads.append(torch.autograd.grad(out.square().mean(), list(params.values())))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    out = remat(X)
    with torch.no_grad():
        remat.stem.weight.mul_(0.5)
    with pytest.raises(RuntimeError, match=r"'stem.weight' was written in place after the forward read it .* Written "
                                           r"between the forward and the backward \(an optimizer step\), eager PyTorch"):
        out.square().mean().backward()


class Warming(nn.Module):
    """A convolution scaled by a warm-up factor read from a call counter it updates (a leaf)."""

    def __init__(self, c_in, c):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c, 3, padding=1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return torch.tanh(self.conv(x)) * self.calls.clamp(max=4) / 4


def _warming():
    torch.manual_seed(0)
    return nn.Sequential(*(Warming(3 if i == 0 else 8, 8) for i in range(6)))


@pytest.mark.parametrize("net, leaves", [(_net, ()), (_warming, (Warming,))], ids=["batch-norms", "warm-up-leaves"])
def test_a_recomputation_reads_the_buffers_its_forward_read(net, leaves):
    """Under ``torch.func.functional_call`` with buffers passed in, the forward reads and updates the
    call's buffers; the recomputation updated the module's own (all 18 BatchNorm buffers changed,
    eager leaves them alone) and read the module's call counters (wrong gradients)."""
    plain, model = pair(net())
    remat = fxremat.compile(model, "min", example_inputs=(X,), cost_model="flops", leaf_modules=leaves)
    assert remat.plan.recomputed_nodes, "the test needs a recomputed segment"
    results = []
    for m in (plain, remat):
        own = {k: v.clone() for k, v in m.named_buffers()}
        params = {k: v.detach().mul(1.5).requires_grad_() for k, v in m.named_parameters()}
        buffers = {k: v + 1 for k, v in m.named_buffers()}  # apart from the module's own
        for step in range(2):
            out = torch.func.functional_call(m, {**params, **buffers}, (X,))
            grads = torch.autograd.grad(out.square().mean(), list(params.values()))
        assert all(torch.equal(v, own[k]) for k, v in m.named_buffers()), "the module's own buffers changed"
        assert not all(torch.equal(v, own[k] + 1) for k, v in buffers.items()), "the call's buffers did not"
        results.append((out, grads, buffers))
    (out, grads, buffers), (remat_out, remat_grads, remat_buffers) = results
    assert torch.equal(out, remat_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, remat_grads))
    assert all(torch.equal(buffers[k], remat_buffers[k]) for k in buffers)


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))

    def forward(self, x, mask=None):
        out = self.body(x)
        if mask is not None:
            out = out * mask
        return out


def test_an_optional_input_traced_with_a_value_and_left_out_is_refused():
    x, mask = torch.randn(8, 16), torch.ones(8, 4)
    remat = fxremat.compile(Masked(), "min", example_inputs=(x, mask), cost_model="flops")
    with pytest.raises(ValueError, match="traced with a value for mask .* this call leaves it None"):
        remat(x)


class CausalMasked(Masked):
    """timm's ViT: ``forward(x, attn_mask=None, is_causal=False)`` checks both at once; traced with
    ``mask=None``, torch.fx still fails on the flag, and the model is captured per call."""

    def forward(self, x, mask=None, causal: bool = False):
        out = self.body(x)
        if mask is not None or causal:
            out = out * (mask if mask is not None else 1.0)
        return out


@pytest.mark.parametrize("cls", [Masked, CausalMasked])
def test_an_optional_input_left_out_by_the_first_call_without_example_inputs_is_traced_as_none(cls):
    """The README's quickstart (no example inputs) on timm's ViT: its first training call,
    ``model(x)``, was refused ("traced with a value for attn_mask ... this call leaves it None")."""
    torch.manual_seed(0)
    plain, x = cls(), torch.randn(8, 16)
    remat = fxremat.compile(copy.deepcopy(plain), "min", cost_model="flops")
    for m in (plain, remat):
        m(x).square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), remat.parameters()))
    assert torch.equal(plain(x), remat(x))
    if cls is CausalMasked:
        assert remat._remat.traced is None  # captured per call
    else:
        assert remat._remat.traced.meta[_NONE_ARGS] == ("mask",)


class SelfCheckpointed(Net):
    """Hand-placed checkpointing inside the model (timm's ``set_grad_checkpointing``)."""

    def encode(self, x):
        return torch.utils.checkpoint.checkpoint(self.blocks, self.stem(x), use_reentrant=False)


def test_a_models_own_checkpoint_is_named_where_it_is_traced_through():
    """torch.fx traces through ``torch.utils.checkpoint``: eager's second BatchNorm update in the
    recomputation is gone, and the budget is of the peak without it. Said, not silent."""
    torch.manual_seed(0)
    plain, model = pair(SelfCheckpointed())
    with pytest.warns(UserWarning, match=r"SelfCheckpointed calls torch.utils.checkpoint \(.*test_surprises.py:\d+\)"):
        remat = fxremat.compile(model, 0.5, example_inputs=(X,), cost_model="flops")
    # trains as the model does (its BatchNorm statistics aside: eager's checkpoint updates them twice)
    assert torch.equal(train_step(plain, X), train_step(remat, X))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), remat.parameters()))


def test_quantization_aware_training_compiles_before_its_observers_ran():
    """``prepare_qat`` then compile: the observers' ``min_val``/``max_val`` have shape ``[0]``
    until their first forward, and putting them back after profiling failed ("The size of tensor
    a (8) must match ... (0)")."""
    import torch.ao.quantization as Q

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()).train()
    model.qconfig = Q.get_default_qat_qconfig("x86")
    model = Q.prepare_qat(Q.fuse_modules_qat(model, [["0", "1", "2"], ["3", "4", "5"]]))
    assert any(b.numel() == 0 for b in model.buffers())
    plain, model = pair(model)
    remat = fxremat.compile(model, "min", example_inputs=(X,), cost_model="flops")
    _assert_trains_like(with_grads(plain), with_grads(remat), X)


@pytest.mark.parametrize("change", ["prune", "spectral_norm", "weight_norm"])
def test_pruning_or_a_parametrization_after_compiling_trains_as_eager(change):
    """Iterative pruning, or a spectral norm added later, moves the weight out of its parameter
    slot (``weight_orig`` and a mask; ``parametrizations.weight.original``): the next step raised a
    bare ``KeyError: 'weight'``. It is traced and planned again."""
    from torch.nn.utils import parametrizations, prune

    changes = {"prune": lambda m: prune.l1_unstructured(m.blocks[1].conv, "weight", amount=0.3),
               "spectral_norm": lambda m: parametrizations.spectral_norm(m.blocks[1].conv),
               "weight_norm": lambda m: parametrizations.weight_norm(m.head)}
    x = X
    plain, model = pair(_net())
    remat = fxremat.compile(model, "min", example_inputs=(x,), cost_model="flops")
    _assert_trains_like(with_grads(plain), with_grads(remat), x, steps=1)
    for m in (plain, remat):
        torch.manual_seed(5)
        changes[change](m)
    _assert_trains_like(with_grads(plain), with_grads(remat), x)
    assert _peak_over_budget(remat, x) <= 1.05


@pytest.mark.parametrize("normed", [(1,), (1, 3, 5)], ids=["one", "three"])
def test_the_buffers_a_recomputation_reads_are_copied_in_the_plan(normed):
    """A spectral norm updates its power-iteration vectors (buffers) in every training forward, so
    each recomputed segment holding one copies them when its forward runs (``reads=``) and, with
    the BatchNorms' statistics, again while it is recomputed (``restore=``); rotor's "min" nests a
    checkpoint per node, each taking its own copies: 1.11x and 1.21x the budget at 16x16."""
    from torch.nn.utils import parametrizations

    model = _net()
    for i in normed:
        parametrizations.spectral_norm(model.blocks[i].conv)
    plain, model = pair(model)
    remat = fxremat.compile(model, "min", example_inputs=(X,), cost_model="flops")
    assert "reads = (" in remat.code
    _assert_trains_like(with_grads(plain), with_grads(remat), X)
    peak = fxremat.measure_peak(train_step, remat, X)[1]
    assert peak <= 1.01 * remat.plan.budget_bytes, (peak, remat.plan.budget_bytes)
    assert abs(remat.plan.predicted_peak_bytes - peak) <= 0.01 * peak, (remat.plan.predicted_peak_bytes, peak)


def test_a_recomputed_submodule_with_forward_hooks_is_warned_about():
    """A feature hook (an auxiliary loss's) keeps tensors the plan, profiled without user hooks,
    does not count, and fires again in the backward: said once, where the hooked module is
    recomputed; a module that is kept is not warned about."""
    feats = {}
    remat = fxremat.compile(_net(), "min", example_inputs=(X,), cost_model="flops")
    recomputed = set(remat.plan.recomputed_nodes)
    kept = [info.module.split(" (")[0] for info in remat.plan.nodes if info.name not in recomputed and info.module]
    remat.get_submodule(kept[-1]).register_forward_hook(lambda mod, i, o: feats.__setitem__("f", o))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step(remat, X)
    remat = fxremat.compile(_net(), "min", example_inputs=(X,), cost_model="flops")
    remat.blocks[0].bn.register_forward_hook(lambda mod, i, o: feats.__setitem__("f", o))
    with pytest.warns(UserWarning, match=r"submodules \['blocks.0.bn'\] have forward hooks and are recomputed"):
        train_step(remat, X)
    assert "blocks_0_bn" in remat.plan.recomputed_nodes


def test_a_torch_func_transform_runs_the_model_plainly():
    """torch.func cannot run a checkpoint (saved-tensor hooks), and planning inside a transform
    failed on its wrapped inputs: within one, the model runs as eager runs it, with a warning."""
    from torch.func import functional_call, grad, jacrev

    torch.manual_seed(0)
    plain, model = pair(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1),
                                      nn.Flatten(), nn.Linear(4 * 16 * 16, 5)))
    remat = fxremat.compile(model, "min", example_inputs=(X,), cost_model="flops")
    params = {k: v.detach() for k, v in plain.named_parameters()}
    for transform in (lambda m: jacrev(m)(X[:1]),
                      lambda m: grad(lambda p: functional_call(m, p, (X,)).square().sum())(params)):
        with pytest.warns(UserWarning, match="inside a torch.func transform .* runs plainly"):
            got = transform(remat)
        expected = transform(plain)
        leaves = torch.utils._pytree.tree_leaves
        assert all(torch.equal(a, b) for a, b in zip(leaves(expected), leaves(got)))
    _assert_trains_like(with_grads(plain), with_grads(remat), X)  # and trains as compiled after


class SelfCheckpointedCaptured(SelfCheckpointed):
    """The same, with a ``forward(*args)`` torch.fx cannot make placeholders for: captured with
    torch.export, whose nodes' stack traces leave torch's frames out (a diffusers model with
    ``enable_gradient_checkpointing()``)."""

    def forward(self, *args):
        return super().forward(args[0])


def test_a_models_own_checkpoint_is_named_where_it_is_captured():
    """Captured, the checkpoint was dropped without a word, and the plain peak was predicted from
    the checkpointed forward's kept bytes: -43% on a diffusers-like net."""
    torch.manual_seed(0)
    plain, model = pair(SelfCheckpointedCaptured())
    with pytest.warns(UserWarning, match=r"SelfCheckpointedCaptured calls torch.utils.checkpoint \(.*test_surprises.py:\d+"):
        remat = fxremat.compile(model, 0.5, example_inputs=(X,), cost_model="flops")
    unchecked = with_grads(copy.deepcopy(plain))
    unchecked.encode = lambda x: unchecked.blocks(unchecked.stem(x))  # the peak the budget is a fraction of
    train_step(unchecked, X)
    measured = fxremat.measure_peak(lambda: train_step(unchecked, X))[1]
    assert abs(remat.plan.baseline_peak_bytes - measured) <= 0.02 * measured, (remat.plan.baseline_peak_bytes, measured)
    assert torch.equal(train_step(plain, X), train_step(remat, X))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), remat.parameters()))


def test_a_model_too_big_to_profile_on_its_device_is_profiled_on_fake_tensors(monkeypatch):
    """Profiling holds every value and runs plain steps: a model that does not fit on its device
    (why it is compiled) ran out of memory inside ``fxremat.compile``. (The device's error is
    simulated: this machine has none to run out of.)"""
    from fxremat.passes import profile as profiling

    real = profiling._profile

    def tight(gm, inputs, cost_model, repeats):
        if not profiling.is_fake(inputs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(gm, inputs, cost_model, repeats)

    monkeypatch.setattr(profiling, "_profile", tight)
    plain, model = pair(_net())
    with pytest.warns(UserWarning, match="ran out of device memory .* profiled again on fake tensors"):
        remat = fxremat.compile(model, 0.5, example_inputs=(X,))
    assert remat.plan.cost_model == "flops" and remat.plan.strategy != "none"
    monkeypatch.undo()
    _assert_trains_like(with_grads(plain), with_grads(remat), X)
    assert _peak_over_budget(remat, X) <= 1.05


def test_a_compiled_module_is_not_compiled_again_and_a_bad_call_names_the_forward():
    remat = fxremat.compile(_net(), 0.5, example_inputs=(X,), cost_model="flops")
    with pytest.raises(TypeError, match="got a RematModule .*pass the model it was compiled from"):
        fxremat.compile(remat, 0.5)  # was captured whole and nested, silently
    with pytest.raises(TypeError, match=r"fxremat.RematModule: Net.forward\(\) missing a required argument: 'x'"):
        remat()
    assert fxremat.PlanMismatchError is PlanMismatchError  # named by load_plan's docstring


# --------------------------------------------------------------------------------------------
# audit round 3: where compiling and tracing run, and what they cannot replay
# --------------------------------------------------------------------------------------------

def test_compiling_inside_inference_mode_plans_the_graph_that_trains():
    """An eval script's ``torch.inference_mode()`` around ``fxremat.compile``: the trace marked
    every node ``inference_mode`` and profiling crashed ("'NoneType' object has no attribute
    '_sequence_nr'"). Compiling leaves inference mode; the model then trains as eager."""
    plain, model = pair(_net())
    other = _net()  # built outside: parameters made in inference mode cannot train in eager either
    with torch.inference_mode():
        remat = fxremat.compile(model, "min", example_inputs=(X,), cost_model="flops")
        plan = fxremat.plan(other, "min", example_inputs=(X,), cost_model="flops")
    assert plan.predicted_peak_bytes == remat.plan.predicted_peak_bytes
    _assert_trains_like(with_grads(plain), with_grads(remat), X)


def test_a_scripted_submodule_is_called_whole():
    """A ``torch.jit.script``'ed submodule is one call of its compiled ``forward`` in the graph;
    watching the settings of the modules traced through iterated its ``_modules`` (no dict) and
    raised a bare ``KeyError: 0``. One with buffers is refused: what its compiled code writes
    (a BatchNorm's statistics) is not seen, so nothing would put it back."""
    class WithScripted(nn.Module):
        def __init__(self, *body):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.body = torch.jit.script(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), *body, nn.ReLU()))
            self.head = nn.Conv2d(8, 4, 1)

        def forward(self, x):
            return self.head(self.body(torch.relu(self.stem(x))))

    torch.manual_seed(0)
    plain = WithScripted()
    torch.manual_seed(0)  # a scripted module's deepcopy does not train (its copy's .grad stays None)
    model = WithScripted()
    remat = fxremat.compile(model, "min", example_inputs=(X,), cost_model="flops")
    _assert_trains_like(with_grads(plain), with_grads(remat), X)
    with pytest.raises(TypeError, match=r"submodule 'body' is a TorchScript module .* \(body.1.running_mean, "):
        fxremat.compile(WithScripted(nn.BatchNorm2d(8)), "min", cost_model="flops")


def test_a_forward_drawing_from_pythons_random_is_warned_about():
    """``if random.random() < p: return h`` (a LayerDrop) is a Python value at trace time: torch.fx
    bakes the draw in, and every step took one branch, silently, where eager takes each on some."""
    import random

    class LayerDrop(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = torch.relu(self.a(x))
            if self.training and random.random() < 0.5:
                return h
            return torch.relu(self.b(h)) + h

    x = torch.randn(4, 8)
    random.seed(0)  # the two traces (autocast off and on) draw the same branch: traced by torch.fx
    with pytest.warns(UserWarning, match=r"LayerDrop's forward drew from Python's random module .* torch.fx ran"):
        fxremat.compile(LayerDrop(), "min", example_inputs=(x,), cost_model="flops")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a forward that draws with torch is not warned about
        fxremat.compile(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)), "min", example_inputs=(x,),
                        cost_model="flops")


class _NumpyMask(nn.Module):
    """SpecAugment as Hugging Face's Wav2Vec2 writes it: a mask drawn with numpy (and a Python draw)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        import numpy as np

        keep = torch.tensor(np.random.random(x.shape[-1]) < 0.5, dtype=x.dtype)
        return self.b(torch.relu(self.a(x * keep))) * (1 + random.random())


class _CapturedNumpyMask(_NumpyMask):
    def forward(self, *args, **kwargs):  # *args: torch.fx cannot trace it, so it is captured by torch.export
        return super().forward(*args, **kwargs)


@pytest.mark.parametrize("cls", [_NumpyMask, _CapturedNumpyMask], ids=["traced", "captured"])
def test_compiling_a_forward_that_draws_with_numpy_leaves_the_generators_as_they_were(cls):
    """Compiling drew from numpy's and Python's global generators (each trace or export of the
    forward, and its plain run), so a seeded run compiled drew other numbers than the same run
    plain; and a captured model's plain run drew another mask than its export had baked in, so the
    two differed and a second warning blamed a branch on torch.compiler.is_exporting() and said to
    patch transformers (Hugging Face Wav2Vec2 with SpecAugment). The baked draw is still warned about."""
    import numpy as np

    np.random.seed(0)
    random.seed(0)
    numpy_before, python_before = np.random.get_state()[1].copy(), random.getstate()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxremat.compile(cls(), "min", example_inputs=(torch.randn(4, 8),), cost_model="flops")
    messages = [str(w.message) for w in caught]
    assert any("drew from Python's random module (or numpy's)" in m for m in messages), messages
    assert not any("is_exporting" in m for m in messages), messages
    assert (np.random.get_state()[1] == numpy_before).all() and random.getstate() == python_before


class _WritesInput(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.write = write
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, scale: float):
        if self.write == "method":
            x.mul_(2)
        elif self.write == "augmented":
            x /= 255
        elif self.write == "view":
            x[:, 0].zero_()
        elif self.write == "unpacked":  # through an item of the tensor unpacked (one unbind)
            head, _, _, _ = x
            head.add_(1)
        scale *= 2  # a number's augmented assignment writes nothing
        h = self.a(x)
        h.mul_(scale)  # nor does a write into an activation
        return self.b(torch.relu(h))


@pytest.mark.parametrize("write", ["method", "augmented", "view", "unpacked"])
def test_a_forward_writing_its_input_in_place_is_refused(write):
    """``x.mul_(2)`` on the input: eager writes the caller's tensor once a step; profiling ran the
    forward on the example input several times (it came back multiplied by 8), and the backward
    of a recomputed segment failed with torch's bare "modified by an inplace operation"."""
    x = torch.randn(4, 8)
    given = x.clone()
    with pytest.raises(ValueError, match=r"fxremat.compile: the forward writes its input 'x' in place \(\w+ at "):
        fxremat.compile(_WritesInput(write), "min", example_inputs=(x, 1.0), cost_model="flops")
    assert torch.equal(x, given)
    remat = fxremat.compile(_WritesInput(write), "min", cost_model="flops")
    with pytest.raises(ValueError, match="writes its input 'x' in place"):
        remat(x, 1.0)
    plain, model = pair(_WritesInput(None))
    remat = fxremat.compile(model, "min", example_inputs=(x, 1.0), cost_model="flops")
    for step in range(2):
        torch.manual_seed(step)
        expected, got = plain(x, 1.0), remat(x, 1.0)
        loss_of(expected).backward()
        loss_of(got).backward()
        assert torch.equal(expected, got)
    assert_same_state(plain, remat)


def test_a_forward_assigning_a_traced_value_to_an_attribute_is_warned_about():
    """``self.feat = h`` in forward, read by a loss or a log after the step: the graph does not
    replay the assignment, and ``remat.feat`` kept the tensor of the call at compile time (the
    example input's), silently."""
    class Stash(Net):
        def forward(self, x):
            self.feat = self.encode(x)
            return self.head(self.feat)

    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"Stash's forward assigns traced values to module attributes \(self.feat\)"):
        fxremat.compile(Stash(), "min", example_inputs=(X,), cost_model="flops")


@pytest.mark.parametrize("example", [True, False])
def test_a_mask_drawn_from_a_modules_own_generator_is_drawn_once(example):
    """``torch.rand(shape, generator=self.gen)``: checkpoint replays torch's default generators
    only, so the recomputation drew another mask (every gradient differed), and compiling's
    profiling advanced the generator (the first step's output differed). Its state is put back
    after profiling and replayed for each recomputation, as the default generators' are."""
    class OwnGenerator(Net):
        def __init__(self):
            super().__init__()
            self.gen = torch.Generator().manual_seed(7)

        def forward(self, x):
            h = self.encode(x)
            return self.head(h * (torch.rand(h.shape, generator=self.gen) > 0.3) / 0.7)

    torch.manual_seed(0)
    plain, model = pair(OwnGenerator())
    remat = fxremat.compile(model, "min", example_inputs=(X,) if example else None, cost_model="flops")
    _assert_trains_like(with_grads(plain), with_grads(remat), X, steps=3)
    assert remat.plan.recomputed_nodes
    assert torch.equal(plain.gen.get_state(), remat.gen.get_state())


# --------------------------------------------------------------------------------------------
# audit round 4: parameters written in forward, a backward inside forward, saved-tensor hooks
# --------------------------------------------------------------------------------------------

class _WritesParameter(Net):
    def __init__(self, write):
        super().__init__()
        self.write = write

    def forward(self, x):
        if self.write == "no_grad":
            with torch.no_grad():
                self.stem.weight.mul_(0.99)
        elif self.write == "data":
            self.stem.weight.data.clamp_(-0.1, 0.1)
        return super().forward(x)


@pytest.mark.parametrize("write", ["no_grad", "data"])
def test_a_forward_writing_a_parameter_in_place_is_refused(write):
    """``with torch.no_grad(): self.stem.weight.mul_(0.99)`` in forward (a decay, a clip): eager
    writes it once a call; compiling ran the forward three times (the weight came back x0.9703) and
    a recomputed segment holding the write would make it again in the backward."""
    torch.manual_seed(0)
    model = _WritesParameter(write)
    weight = model.stem.weight.detach().clone()
    with pytest.raises(ValueError, match=r"fxremat.compile: the forward writes the parameter 'stem.weight' in place "
                                         r"\((mul_|clamp_) at .*test_surprises.py:\d+: self.stem.weight"):
        fxremat.compile(model, "min", example_inputs=(X,), cost_model="flops")
    assert torch.equal(model.stem.weight, weight)


class _Forces(nn.Module):
    """An ML potential's forces, -dE/dx, computed in forward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, h):
        with torch.enable_grad():
            energy = self.b(torch.tanh(self.a(h))).sum()
            forces, = torch.autograd.grad(energy, h, create_graph=True)
        return -forces


def test_a_backward_inside_forward_runs_whole_in_a_submodule_and_is_refused_at_the_top():
    """``torch.autograd.grad`` in forward: torch.fx recorded it as one node, and compiling failed
    in profiling ("The differentiated Tensor ... not used in the graph") or, through torch.export,
    with "fake tensor in the exported program constant's list ... file an issue"."""
    class Potential(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)))
            self.forces = _Forces()

        def forward(self, x):
            return self.forces(self.enc(x))

    x = torch.randn(32, 8)
    with pytest.raises(fxremat.TraceError, match=r"top-level module \(_Forces\) at .*test_surprises.py:\d+ "
                                                 r"\(forward: forces, = torch.autograd.grad.*calls torch.autograd.grad"):
        fxremat.compile(_Forces(), "min", example_inputs=(x.requires_grad_(),), cost_model="flops")
    torch.manual_seed(0)
    plain, model = pair(Potential())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a leaf without a warning: that is how it runs
        remat = fxremat.compile(model, "min", example_inputs=(x,), cost_model="flops")
    assert remat.plan.recomputed_nodes and "forces" not in remat.plan.recomputed_nodes
    _assert_trains_like(with_grads(plain), with_grads(remat), x)


def _deep(n=6):
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(n)))


def test_a_step_with_saved_tensor_hooks_disabled_names_the_recomputation():
    """Under ``disable_saved_tensors_hooks(msg)`` eager trains; a recomputed segment's checkpoint
    raised the user's own ``msg``. Refused, naming fxremat and what to do; a plan that recomputes
    nothing trains there as eager."""
    x = torch.randn(16, 32)
    remat = fxremat.compile(_deep(), "min", example_inputs=(x,), cost_model="flops")
    assert remat.plan.recomputed_nodes
    with torch.autograd.graph.disable_saved_tensors_hooks("hooks are off here"):
        with pytest.raises(RuntimeError, match=r"fxremat.RematModule: Sequential is called for a training step inside "
                                               r"torch.autograd.graph.disable_saved_tensors_hooks\('hooks are off here'\)"
                                               r", but its plan recomputes \d segment.*uncompiled model"):
            remat(x)
        plain, model = pair(_deep())
        remat = fxremat.compile(model, 1.0, example_inputs=(x,), cost_model="flops")
        assert not remat.plan.recomputed_nodes
        _assert_trains_like(plain, remat, x, steps=1)


def test_saved_tensor_hooks_of_the_users_around_a_recomputing_step_are_warned_about_once():
    """Lossy ``saved_tensors_hooks`` (activations packed to bf16) do not see what recomputed segments
    save (as with torch.utils.checkpoint): every gradient differed from eager's, silently."""
    x = torch.randn(16, 32)
    remat = fxremat.compile(_deep(), "min", example_inputs=(x,), cost_model="flops")
    pack = lambda t: t.to(torch.bfloat16)  # noqa: E731
    unpack = lambda t: t.float()  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        with pytest.warns(UserWarning, match=r"Sequential is trained under saved-tensor hooks of your own \(<lambda>.*"
                                             r"makes the gradients differ from eager") as said:
            remat(x).sum().backward()
        assert said[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            remat(x).sum().backward()  # once
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checkpoint of the user's around the step nests exactly
        remat = fxremat.compile(_deep(), "min", example_inputs=(x,), cost_model="flops")
        torch.utils.checkpoint.checkpoint(remat, x, use_reentrant=False).sum().backward()


def _halved(grad):
    return grad * 0.5


def test_a_tensor_hook_registered_in_a_captured_forward_is_refused():
    """``h.register_hook(fn)`` in forward (Grad-CAM's gradient store, a gradient scaling): torch.fx
    cannot take the function, and torch.export, which then captured the forward, records no hook:
    the hook never fired (the gradients silently differed from eager's). A submodule doing it runs
    whole and its hook fires."""
    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            h.register_hook(_halved)
            return self.b(torch.tanh(h))

    x = torch.randn(4, 8)
    with pytest.raises(fxremat.TraceError, match=r"top-level module \(Hooked\) at .*test_surprises.py:\d+ \(forward: "
                                                 r"h.register_hook\(_halved\)\).*registers a hook on a tensor \(_halved\), "
                                                 r"which torch.export does not record.*into a submodule"):
        fxremat.compile(Hooked(), "min", example_inputs=(x,), cost_model="flops")


def test_an_embedding_with_max_norm_is_refused():
    """``nn.Embedding(max_norm=)`` renormalizes its looked-up rows in place in forward: profiling
    renormalized the example input's rows before the first step, and a nested recomputation
    raised that the weight was "written in place between the forward and the backward"."""
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8, max_norm=1.0)
            self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

        def forward(self, idx):
            return self.body(self.emb(idx))

    torch.manual_seed(0)
    model = Bag()
    weight = model.emb.weight.detach().clone()
    with pytest.raises(ValueError, match=r"fxremat.compile: 'emb' is an nn.Embedding with max_norm=1.0: .*Set "
                                         r"emb.max_norm = None and renormalize in the training loop"):
        fxremat.compile(model, "min", example_inputs=(torch.randint(0, 20, (4, 6)),), cost_model="flops")
    assert torch.equal(model.emb.weight, weight)


def test_a_distribution_checking_its_arguments_in_a_captured_forward_names_validate_args():
    """A VAE's ``Normal(mu, std).rsample()`` in forward: the argument check reads tensor values,
    which neither torch.fx nor torch.export can; the error named only a "data-dependent expression"."""
    class Reparam(nn.Module):
        def __init__(self):
            super().__init__()
            self.mu, self.log_std = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x):
            # (validate_args given: the default is a global, which torch.compile turns off for good)
            return torch.distributions.Normal(self.mu(x), self.log_std(x).exp(), validate_args=True).rsample()

    with pytest.raises(fxremat.TraceError, match=r"torch.distributions object, whose argument check \(validate_args\) "
                                                 r"reads tensor values; pass validate_args=False"):
        fxremat.compile(Reparam(), "min", example_inputs=(torch.randn(4, 8),), cost_model="flops")


def test_planning_again_for_a_python_number_argument_says_to_pass_a_tensor():
    """A diffusion timestep passed as a Python ``int``: each value is a signature, planned anew;
    the warning said only "pad or bucket the inputs to fewer shapes", whose shapes never changed."""
    class Timed(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

        def forward(self, x, t: int):
            return self.body(x * (t / 10))

    x = torch.randn(4, 8)
    remat = fxremat.compile(Timed(), "min", example_inputs=(x, 1), cost_model="flops", max_plans=1)
    remat(x, 2)
    with pytest.warns(UserWarning, match=r"planning again for inputs \[4x8, int 1\] .* Each value of a Python number "
                                         r"argument .* as a tensor, torch.tensor\(t\)"):
        remat(x, 1)


def test_a_lazy_module_not_run_yet_is_refused_naming_the_fix():
    """``nn.LazyLinear`` compiled before its first forward: compiling failed inside fxremat on
    torch's "Attempted to use an uninitialized parameter in <method 'numel' ...>"; after one
    forward it trains as eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"fxremat.compile: parameter '0.weight' of LazyLinear is not initialized "
                                         r"yet .* run one forward of the model on a batch"):
        fxremat.compile(model, "min", example_inputs=(x,), cost_model="flops")
    with torch.no_grad():
        model(x)
    plain, model = pair(model)
    remat = fxremat.compile(model, "min", example_inputs=(x,), cost_model="flops")
    _assert_trains_like(plain, remat, x)


# --------------------------------------------------------------------------------------------
# What the plan cache did not see: dtypes, eval mode, container edits, a compiled submodule
# --------------------------------------------------------------------------------------------

class Tokens(nn.Module):
    """A language-model stack taking token ids: its input signature does not change with its dtype."""

    def __init__(self, vocab=64, d=64, n=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Tanh())
                                      for _ in range(n)))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.blocks(self.emb(ids)))


def _token_step(model, ids, *, seed: int = 0):
    torch.manual_seed(seed)
    out = model(ids)
    out.logsumexp(-1).sum().backward()
    return out.detach()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["double", "bfloat16"])
def test_a_model_of_token_ids_made_double_after_compiling_plans_again(dtype):
    """The plan cache is keyed by the input signature, which ``.double()`` leaves as it was for
    token ids: the float32 plan trained at 1.97x the budget in float64 (0.49x in bfloat16).
    Planned again (no eviction warning: the signature was not evicted): 0.98x both."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 32))
    plain, model = pair(Tokens())
    remat = fxremat.compile(model, 0.5, example_inputs=(ids,), cost_model="flops")
    float32_plan = remat.plan
    plain.to(dtype), remat.to(dtype)
    with_grads(plain), with_grads(remat)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(2):
            assert torch.equal(_token_step(plain, ids, seed=step), _token_step(remat, ids, seed=step))
    assert_same_state(plain, remat)
    assert remat.plan is not float32_plan and remat.plan.budget_bytes != float32_plan.budget_bytes
    _, peak = fxremat.measure_peak(_token_step, remat, ids)
    assert peak <= 1.05 * remat.plan.budget_bytes


def test_a_backward_through_a_call_in_eval_mode_is_warned_about():
    """In ``eval()`` the compiled module runs the model plainly (its plans are for the graph that
    trains): a backward through such a call held every activation, silently. Warned once, at the
    backward; evaluating (no_grad, inference_mode, a call with no backward) or a backward with
    every parameter frozen (gradients of the inputs) is not warned about."""
    plain, model = pair(_net())
    remat = fxremat.compile(model, 0.5, example_inputs=(X,), cost_model="flops")
    plain.eval(), remat.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            remat(X)
        with torch.inference_mode():
            remat(X)
        remat(X)  # a validation step without torch.no_grad(): no backward
        model.requires_grad_(False)
        x = X.clone().requires_grad_()
        loss_of(remat(x)).backward()  # gradients of the inputs only
        model.requires_grad_(True)
    assert x.grad is not None
    said_so = (r"a backward ran through a call of Net in eval mode .* runs the model plainly, without "
               r"recomputation.* call \.train\(\) .* torch\.no_grad\(\)")
    with pytest.warns(UserWarning, match=said_so) as said:
        got = remat(X)
        loss_of(got).backward()
    assert len(said) == 1 and said[0].filename == __file__  # at the user's backward
    assert ".backward()" in linecache.getline(said[0].filename, said[0].lineno)
    assert torch.equal(train_step(plain, X), got)
    assert_same_state(plain, remat)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # shown once
        train_step(remat, X)
    older = copy.deepcopy(remat)  # as pickled before the warning and the watch of submodule counts existed
    del older._remat.__dict__["warned_eval"], older._remat.settings.__dict__["counted"]
    del older._remat.settings.__dict__["counts"]
    loaded = pickle.loads(pickle.dumps(older))
    with pytest.warns(UserWarning, match="in eval mode"):
        train_step(loaded, X)
    train_step(loaded.train(), X)


def _blocks(n, d=16):
    return [nn.Sequential(nn.Linear(d, 128), nn.Tanh(), nn.Linear(128, d), nn.Tanh()) for _ in range(n)]


def test_a_compiled_sequential_is_indexed_counted_and_edited_as_the_model():
    """``fxremat.compile(nn.Sequential(...))`` lacked ``remat[0]``, ``len``, ``iter`` and ``del``,
    and ``remat.append(m)`` reached the model while the compiled graph, without ``m``, trained:
    the container methods are the model's, and an edit (through either object) plans again."""
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    plain, model = pair(nn.Sequential(*_blocks(6)))
    remat = fxremat.compile(model, 0.5, example_inputs=(x,), cost_model="flops")
    assert remat[0] is model[0] and len(remat) == 6 and list(remat) == list(model) and model[2] in remat
    assert isinstance(remat[1:3], nn.Sequential) and list(remat[1:3]) == list(model)[1:3]

    def edit(change, on_model=False):
        before = remat.plan
        change(plain)
        change(model if on_model else remat)
        if not on_model:  # at once (a del on the model itself is seen at the next training step)
            assert remat.state_dict().keys() == plain.state_dict().keys()
        _assert_trains_like(with_grads(plain), with_grads(remat), x)
        assert remat.state_dict().keys() == plain.state_dict().keys() == model.state_dict().keys()
        assert len(remat) == len(plain) and remat.plan is not before
        assert _peak_over_budget(remat, x) <= 1.05

    torch.manual_seed(1)
    head, more = _blocks(1)[0], _blocks(2)
    edit(lambda m: m.append(copy.deepcopy(head)))
    edit(lambda m: m.__delitem__(1))  # renumbers: nn.Sequential makes a new _modules dict
    edit(lambda m: m.insert(2, copy.deepcopy(head)))
    edit(lambda m: m.__setitem__(0, copy.deepcopy(head)))
    edit(lambda m: m.pop(3))
    edit(lambda m: m.extend(copy.deepcopy(more)))
    edit(lambda m: m.__delitem__(0), on_model=True)  # on the object the user still holds
    edit(lambda m: m.append(copy.deepcopy(head)), on_model=True)
    same = remat
    remat += nn.Sequential(copy.deepcopy(head))
    plain += nn.Sequential(copy.deepcopy(head))
    assert remat is same  # not the plain model
    _assert_trains_like(with_grads(plain), with_grads(remat), x)


def test_the_plan_of_a_model_changed_since_is_not_shown_as_what_trains():
    """``remat.plan`` after ``remat.append(head)`` showed the plan without the head (12 nodes where
    13 train) until the next step: reading it now says the model changed and is planned again;
    a change that keeps the graph (eval() and back, a new attribute) keeps the plan."""
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    model = nn.Sequential(*_blocks(4))
    remat = fxremat.compile(model, "min", example_inputs=(x,), cost_model="flops")
    before = remat.plan
    assert before.num_nodes == 4 * 4
    remat.eval()
    remat.train()
    remat.note = "kept"
    assert remat.plan is before
    stale = [lambda: remat.append(_blocks(1)[0]),                        # a container edit
             lambda: model[0].register_forward_hook(lambda *a: None),   # a hook on the original
             lambda: remat.double()]                                     # the parameters' dtype
    for change in stale:
        change()
        for _ in range(2):  # and still, until a step plans again
            with pytest.raises(RuntimeError, match="changed since its last plan.*next training step"):
                remat.plan
            with pytest.raises(RuntimeError, match="changed since its last plan"):
                remat.code
        remat(x.to(next(remat.parameters()).dtype)).sum().backward()
        after = remat.plan
        assert after is not before
        before = after
    assert remat.plan.num_nodes == 4 * 4 - 3 + 4  # the hooked block one leaf, the appended head in

class Holder(nn.Module):
    """A model holding a compiled submodule (``body``) between plain layers."""

    def __init__(self, body):
        super().__init__()
        self.pre = nn.Sequential(*_blocks(4, 32))
        self.body = body
        self.head = nn.Sequential(*_blocks(4, 32))

    def forward(self, x):
        return self.head(self.body(self.pre(x)))


class HolderCaptured(Holder):
    def forward(self, *xs):  # *args: captured with torch.export
        return self.head(self.body(self.pre(xs[0])))


@pytest.mark.parametrize("holder", [Holder, HolderCaptured], ids=["traced", "captured"])
def test_a_model_holding_a_compiled_submodule_calls_it_as_one_node(holder):
    """Traced through, the compiled submodule's forward ran fxremat's planning on proxies and it
    was kept whole only after a warning; captured, export failed assigning its ``forward``. It is
    one node running its own plan, and the outer plan holds (0.5: 0.89x; "min": 0.94x)."""
    x = torch.randn(64, 32)
    torch.manual_seed(0)
    plain = Holder(nn.Sequential(*_blocks(6, 32)))
    for budget in (0.5, "min"):
        model = copy.deepcopy(plain)
        model.__class__ = holder
        model.body = fxremat.compile(model.body, 0.5, example_inputs=(x,), cost_model="flops")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            remat = fxremat.compile(model, budget, example_inputs=(x,), cost_model="flops")
        assert (remat._remat.traced is None) == (holder is HolderCaptured)
        assert [n.module for n in remat.plan.nodes if n.module.startswith("body")] == ["body (RematModule[Sequential])"]
        _assert_trains_like(with_grads(copy.deepcopy(plain)), with_grads(remat), x)
        assert _peak_over_budget(remat, x) <= 1.05
    inner = remat.body
    inner.forward = lambda h: h * 2  # a forward assigned to the instance is the one called
    assert torch.equal(inner(x), x * 2)
    del inner.forward
    assert torch.equal(inner(x), plain.body(x))
