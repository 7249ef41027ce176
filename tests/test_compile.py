"""End to end: compiled U-Net and PSPNet train exactly like the plain models, within budget."""

import pytest
import torch

import fxremat
from _models import assert_same_state, loss_of, pair, small_pspnet, small_unet, train_step, with_grads

# planning: plans come from the DP kernels, so the pure-Python kernels' pass runs these too
pytestmark = pytest.mark.solver

NETS = {"unet": (small_unet, (2, 3, 64, 64)), "pspnet": (small_pspnet, (2, 3, 64, 64))}


@pytest.mark.parametrize("budget", [0.5, "min"])
@pytest.mark.parametrize("net", sorted(NETS))
def test_exact_and_within_budget(net, budget):
    build, shape = NETS[net]
    torch.manual_seed(0)
    plain, model = pair(build())
    x = torch.randn(*shape)
    compiled = fxremat.compile(model, budget, example_inputs=(x,), cost_model="flops")
    assert compiled.plan.strategy in ("exact", "approx", "rotor", "chen", "hong", "sequential")
    assert any(s.recomputed for s in compiled.plan.segments)
    with_grads(plain), with_grads(compiled)
    opt_a = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(compiled.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        out_a, peak_a = fxremat.measure_peak(train_step, plain, x, seed=step)
        out_b, peak_b = fxremat.measure_peak(train_step, compiled, x, seed=step)
        assert torch.equal(out_a, out_b), "outputs differ (dropout masks or numerics)"
        assert_same_state(plain, compiled)
        opt_a.step(), opt_b.step()
        opt_a.zero_grad(set_to_none=False), opt_b.zero_grad(set_to_none=False)
    assert_same_state(plain, compiled)
    assert peak_b <= compiled.plan.budget_bytes * 1.05
    assert peak_b < peak_a
    error = abs(compiled.plan.predicted_peak_bytes - peak_b) / peak_b
    assert error <= 0.05, f"predicted {compiled.plan.predicted_peak_bytes} vs measured {peak_b}"


def test_measured_cost_model_and_no_recomputation_budget():
    torch.manual_seed(0)
    plain, model = pair(small_unet())
    x = torch.randn(2, 3, 32, 32)
    compiled = fxremat.compile(model, 1.0, example_inputs=(x,))
    assert compiled.plan.strategy == "none" and compiled.plan.cost_model == "measured"
    assert not any(s.recomputed for s in compiled.plan.segments)
    assert "recompute" not in compiled.graph_module.code
    train_step(plain, x), train_step(compiled, x)
    assert_same_state(plain, compiled)


def test_state_dict_shared_and_identical():
    model = small_unet()
    compiled = fxremat.compile(model, 0.5, example_inputs=(torch.randn(2, 3, 32, 32),), cost_model="flops")
    assert list(compiled.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(compiled.parameters(), model.parameters()))
    other = small_unet()
    compiled.load_state_dict(other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_eval_and_no_grad_run_the_original_model():
    torch.manual_seed(0)
    plain, model = pair(small_unet())
    compiled = fxremat.compile(model, "min", example_inputs=(torch.randn(2, 3, 32, 32),), cost_model="flops")
    x = torch.randn(2, 3, 32, 32)

    def run(model):
        torch.manual_seed(1)
        return model(x)

    with torch.no_grad():
        assert torch.equal(run(compiled), run(plain))  # training mode, no grad: plain path
    assert all(v.recomputed is False for v in compiled.plan.segments[-1:])
    compiled.eval(), plain.eval()
    assert not compiled.training and not model.training
    assert torch.equal(compiled(x), plain(x))
    assert_same_state(plain, compiled)


def test_lazy_planning_per_signature_and_bounded_cache(caplog):
    torch.manual_seed(0)
    plain, model = pair(small_unet())
    compiled = fxremat.compile(model, 0.6, cost_model="flops", max_plans=2)
    with pytest.raises(RuntimeError, match="no plan yet"):
        compiled.plan
    with caplog.at_level("INFO", logger="fxremat"):
        for size in (32, 48, 64, 32):
            x = torch.randn(2, 3, size, size)
            assert torch.equal(train_step(plain, x), train_step(compiled, x))
            assert compiled.plan.budget_bytes > 0
    planned = [r for r in caplog.records if "new input signature" in r.getMessage()]
    assert len(planned) == 3  # 32 is remembered: sizes of one graph share plans (up to 8 per plan)
    assert len(compiled._remat.cache) == 3 and len(compiled._remat.emitted) <= 2
    assert_same_state(plain, compiled)


def test_fake_tensor_mode_end_to_end():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = small_unet()
        x = torch.randn(8, 3, 256, 256)
        compiled = fxremat.compile(model, "min", example_inputs=(x,), cost_model="flops")
        with_grads(compiled)
        _, peak = fxremat.measure_peak(lambda: loss_of(compiled(x)).backward())
    assert compiled.plan.predicted_peak_bytes < compiled.plan.baseline_peak_bytes / 2
    assert peak <= compiled.plan.budget_bytes * 1.05


def test_saved_plan_is_reused_without_solving_and_checked(tmp_path, monkeypatch):
    torch.manual_seed(0)
    plain, model = pair(small_unet())
    x = torch.randn(2, 3, 32, 32)
    path = tmp_path / "plan.json"
    fxremat.plan(model, 0.5, example_inputs=(x,), cost_model="flops").save(path)
    loaded = fxremat.load_plan(path)

    def no_solving(*args, **kwargs):
        raise AssertionError("a saved plan must not be solved again")

    monkeypatch.setattr(fxremat.api, "choose", no_solving)
    compiled = fxremat.compile(model, 0.5, example_inputs=(x,), plan=loaded)
    # re-derived from the current graph (mutated buffers, peaks), but the same decision
    assert compiled.plan.segments == loaded.segments
    assert compiled.plan.predicted_peak_bytes == loaded.predicted_peak_bytes
    assert [s.nodes for s in compiled.plan.segments if s.recomputed]
    train_step(plain, x), train_step(compiled, x)
    assert_same_state(plain, compiled)
    with pytest.raises(ValueError, match="another graph or input signature"):
        fxremat.compile(small_unet(), 0.5, example_inputs=(torch.randn(2, 3, 64, 64),), plan=loaded)
    with pytest.raises(TypeError, match="plan= takes a fxremat.Plan"):
        fxremat.compile(model, 0.5, plan=str(path))


class _VarKwargs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))

    def forward(self, x, **kwargs):
        return self.body(x)


@pytest.mark.parametrize("example", [False, True])
def test_forward_with_var_kwargs_trains_and_refuses_keywords_it_would_ignore(example):
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    plain, model = pair(_VarKwargs())
    remat = fxremat.compile(model, "min", example_inputs=(x,) if example else None, cost_model="flops")
    plain(x).sum().backward()
    remat(x).sum().backward()
    assert_same_state(plain, remat)
    with pytest.raises(TypeError, match=r"\['mask'\] go to _VarKwargs.forward's \*\*kwargs"):
        remat(x, mask=None)


def test_compiling_and_training_leave_no_step_of_the_profile_alive():
    """The measured profile times whole training steps; none of their outputs (nor the autograd
    graphs behind them) may outlive the compiled module. Its forward clock held each output in a
    cycle through grad_fn pre-hooks, which Python's garbage collector does not see: 4 outputs
    (a segmentation net's logits on a GPU: GiBs) stayed after the module was gone."""
    import gc
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1021))
    x = torch.randn(64, 64)

    def outputs_alive():
        gc.collect()
        return sum(isinstance(o, torch.Tensor) and o.shape == (64, 1021) for o in gc.get_objects())

    before = outputs_alive()
    remat = fxremat.compile(model, "min", example_inputs=(x,), cost_model="measured")
    loss_of(remat(x)).backward()
    gone = weakref.ref(remat)
    del remat
    assert outputs_alive() == before and gone() is None
