"""fxremat.compile(..., backend=...) measures the compiled step on the example inputs and, where the
compiler keeps memory the plan does not see, plans again under a budget lowered by the excess
(``fit_compiled_peak``, on by default with a compiler backend)."""

import copy
import functools
import pathlib
import sys
import warnings

import pytest
import torch

import fxremat
from fxremat import api
from fxremat.errors import format_bytes
from fxremat.measure import allocated_peak, default_loss

from _models import without_the_segment_output_pass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.nets import transformer_stack  # noqa: E402

pytestmark = pytest.mark.compiler


def _transformer():
    torch.manual_seed(0)
    return transformer_stack(depth=4, dim=64, heads=4), torch.randn(4, 128, 64)


@functools.lru_cache(maxsize=None)
def _dynamo_graphs_run_checkpoints() -> bool:
    """Whether a checkpoint region that Dynamo traced is still checkpointed when a backend runs
    Dynamo's graph itself (no AOTAutograd). torch 2.13 runs it under ``checkpoint``; torch 2.11
    runs it as plain code and keeps every activation (here 6 MiB of forward peak instead of 2)."""

    def region(x):
        return torch.utils.checkpoint.checkpoint(lambda t: t.exp().exp().exp().exp().exp().exp(), x,
                                                 use_reentrant=False)

    run, x, held = torch.compile(region, backend="eager"), torch.randn(2**18, requires_grad=True), []
    run(x)
    return allocated_peak(lambda: held.append(run(x))) < 4 * x.nbytes


def _holding(extra_bytes: int):
    """A torch.compile backend that runs the captured graph eagerly and, like a compiler's own
    buffers, keeps ``extra_bytes`` allocated from the forward to the end of the backward: added to
    the first weight matrix (times a zero that requires grad), whose gradient comes last. Skips
    the test where this torch runs the graph's checkpoint regions without recomputing them."""
    if not _dynamo_graphs_run_checkpoints():
        pytest.skip(f"torch {torch.__version__} runs the checkpoint regions of a Dynamo graph that a backend "
                    "runs itself without recomputation, so this test backend keeps every activation")

    def holding(gm, example_inputs):
        def run(*args):
            args = list(args)
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and a.requires_grad and a.dim() == 2:
                    zero = torch.zeros((), requires_grad=True)
                    args[i] = a + (torch.ones(extra_bytes // 4) * zero).sum()
                    break
            return gm.forward(*args)

        return run

    return holding


def _measured(compiled, x) -> int:
    for p in compiled.parameters():
        p.grad = torch.zeros_like(p)

    def step():  # the output held to the end, as the plan assumes
        out = compiled(x)
        default_loss(out).backward()
        return out

    step()
    return allocated_peak(step)


@pytest.mark.parametrize("fraction", [0.7, 0.5])
def test_a_compiler_that_keeps_more_gets_a_lower_plan_within_the_budget(fraction):
    model, x = _transformer()
    plain = fxremat.compile(copy.deepcopy(model), fraction, example_inputs=(x,), backend="aot_eager",
                            fit_compiled_peak=False).plan
    backend = _holding(plain.budget_bytes // 4)
    torch._dynamo.reset()
    unfitted = fxremat.compile(copy.deepcopy(model), fraction, example_inputs=(x,), backend=backend,
                               fit_compiled_peak=False)
    over = _measured(unfitted, x)
    assert over > 1.05 * unfitted.plan.budget_bytes
    torch._dynamo.reset()
    twin = copy.deepcopy(model).eval()  # compiled in eval(): the fit measures a training step all the same
    fitted = fxremat.compile(twin, fraction, example_inputs=(x,), backend=backend)  # on by default
    assert all(p.grad is None for p in twin.parameters())  # the measured steps wrote no gradient
    assert not fitted.training and not any(m.training for m in twin.modules())
    fitted.train()
    plan = fitted.plan
    assert plan.budget_bytes == unfitted.plan.budget_bytes
    assert plan.predicted_peak_bytes < unfitted.plan.predicted_peak_bytes
    assert "compiled step" in plan.notes[-1] and "kept the plan that measured" in plan.notes[-1]
    assert _measured(fitted, x) <= plan.budget_bytes
    torch._dynamo.reset()


class _Varargs(torch.nn.Module):
    """A forward that takes ``*args``, as decorated Hugging Face forwards do: captured per call
    with torch.export rather than traced."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, *args):
        return self.body(args[0])


def test_a_model_captured_per_call_is_fitted_too():
    body, x = _transformer()
    model = _Varargs(body)
    budget = fxremat.plan(copy.deepcopy(model), 0.7, example_inputs=(x,), cost_model="compiled").budget_bytes
    torch._dynamo.reset()
    compiled = fxremat.compile(copy.deepcopy(model), 0.7, example_inputs=(x,), backend=_holding(budget // 4))
    assert compiled._remat.traced is None  # captured
    plan = compiled.plan
    assert "kept the plan that measured" in plan.notes[-1]
    assert _measured(compiled, x) <= plan.budget_bytes
    torch._dynamo.reset()


def test_a_compiled_step_well_under_its_budget_tries_a_plan_that_recomputes_less(monkeypatch):
    """AOTAutograd recomputes a region's output for its later readers rather than save it, unless
    fxremat's pass keeps it: without the pass the transformer's compiled step at 0.6 measures well
    under the plan (aot_eager), so a plan for more memory is tried, and what is kept measures
    within the budget."""
    without_the_segment_output_pass(monkeypatch)
    model, x = _transformer()
    torch._dynamo.reset()
    compiled = fxremat.compile(copy.deepcopy(model), 0.6, example_inputs=(x,), backend="aot_eager")
    note = compiled.plan.notes[-1]
    first = float(note.split("measured ")[1].split(" MiB")[0]) * 2**20
    assert first < (1 - api.FIT_SLACK) * compiled.plan.budget_bytes
    assert note.count("predicted") >= 2
    assert _measured(compiled, x) <= compiled.plan.budget_bytes
    torch._dynamo.reset()


def test_a_compiled_peak_no_plan_can_fit_warns():
    model, x = _transformer()
    budget = fxremat.plan(copy.deepcopy(model), 0.5, example_inputs=(x,), cost_model="compiled").budget_bytes
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"compiled step's peak is .*x the budget .*Lower the budget"):
        compiled = fxremat.compile(copy.deepcopy(model), 0.5, example_inputs=(x,), backend=_holding(budget))
    least = fxremat.compile(copy.deepcopy(model), "min", example_inputs=(x,), backend="aot_eager",
                            fit_compiled_peak=False).plan
    note = compiled.plan.notes[-1]
    assert note.count("predicted") == 2  # the plan, then the least feasible one (lowered below it)
    assert f"(predicted {format_bytes(least.predicted_peak_bytes)})" in note
    torch._dynamo.reset()


def test_the_least_peak_is_measured_and_a_compiler_over_it_warns():
    model, x = _transformer()
    least = fxremat.plan(copy.deepcopy(model), "min", example_inputs=(x,), cost_model="compiled")
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"compiled step's peak is .*x the budget .*budget='min' is the least peak"):
        compiled = fxremat.compile(copy.deepcopy(model), "min", example_inputs=(x,),
                                   backend=_holding(least.predicted_peak_bytes // 2))
    assert compiled.plan.notes[-1].count("predicted") == 1  # measured, not planned again
    torch._dynamo.reset()


def test_fit_compiled_peak_is_checked_at_the_call():
    model, x = _transformer()
    with pytest.raises(ValueError, match="fit_compiled_peak=True measures the compiled step, and backend is 'eager'"):
        fxremat.compile(model, 0.5, example_inputs=(x,), fit_compiled_peak=True)
    with pytest.raises(TypeError, match="fit_compiled_peak takes True or False, got 'yes'"):
        fxremat.compile(model, 0.5, example_inputs=(x,), backend="aot_eager", fit_compiled_peak="yes")
    with pytest.raises(TypeError, match="only fxremat.compile"):
        fxremat.plan(model, 0.5, example_inputs=(x,), fit_compiled_peak=True)
    with pytest.raises(ValueError, match=r"fit_compiled_peak=True measures a compiled step on the example inputs; "
                                         r"pass example_inputs=\(x,\) too"):
        fxremat.compile(model, 0.5, backend="aot_eager", fit_compiled_peak=True)
    # by default, without example inputs: nothing to measure, and it says so at the call
    with pytest.warns(UserWarning, match="compiled step's peak is not measured.*Pass example_inputs"):
        fxremat.compile(model, 0.5, backend="aot_eager")
    with warnings.catch_warnings():  # nor where it has nothing to fit
        warnings.simplefilter("error")
        fxremat.compile(model, 0.5, backend="aot_eager", fit_compiled_peak=False)
        fxremat.compile(model, 1.0, backend="aot_eager")
    torch._dynamo.reset()


def test_a_shape_planned_at_a_training_step_warns_and_is_fitted_on_request():
    """compile measures the example inputs' compiled step only: a shape first seen at a training
    step gets a plan the compiler's own memory comes on top of, and says so (once), naming
    ``fit_compiled_peak``; called with inputs of that shape, the method fits its plan too."""
    model, x = _transformer()
    wide = torch.randn(8, 128, 64)
    budget = fxremat.plan(copy.deepcopy(model), 0.7, example_inputs=(x,), cost_model="compiled").budget_bytes
    torch._dynamo.reset()
    compiled = fxremat.compile(copy.deepcopy(model), 0.7, example_inputs=(x,), backend=_holding(budget // 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        over = _measured(compiled, wide)  # planned at a training step, not fitted
        _measured(compiled, torch.randn(2, 128, 64))
    said = [w for w in caught if "fit_compiled_peak(*inputs)" in str(w.message)]
    assert len(said) == 1 and "8x128x64" in str(said[0].message)
    compiled(wide)
    unfitted = compiled.plan
    assert over > 1.05 * unfitted.budget_bytes
    plan = compiled.fit_compiled_peak(wide)
    assert plan.budget_bytes == unfitted.budget_bytes and plan.predicted_peak_bytes < unfitted.predicted_peak_bytes
    assert "compiled step" in plan.notes[-1]
    assert _measured(compiled, wide) <= plan.budget_bytes
    assert compiled.plan is plan or compiled.plan.segments == plan.segments
    eager = fxremat.compile(copy.deepcopy(model), 0.7, example_inputs=(x,))
    with pytest.raises(ValueError, match="backend='eager'"):
        eager.fit_compiled_peak(x)
    torch._dynamo.reset()


@pytest.mark.parametrize("off_extra, kept_off", [(0, True), (2, False)])
def test_a_plan_over_its_budget_under_inductor_tries_the_layout_optimization_off(monkeypatch, off_extra, kept_off):
    """Inductor's layout optimization keeps channels-last copies of convolution weights from the
    forward to the backward (PSPNet on the CPU at "min": 15.3 MiB for a 13.1 MiB plan, 13.1 with it
    off; the U-Net needs more with it off). Where even the fitted plan measures over the budget,
    the fit measures the first plan with it off and keeps whichever measured less. The compiler is
    simulated here (a real Inductor compile of a net where this shows takes minutes on the CPU):
    each measured step reads the plan's predicted peak plus what the layout setting adds."""
    model, x = _transformer()
    options = []  # the Inductor options of each compile of the module, in order
    monkeypatch.setattr(fxremat.RematModule, "compile", lambda self, **kw: options.append(kw.get("options")))
    extra = {True: 2**20, False: off_extra * 2**20}  # layout optimization on / off
    monkeypatch.setattr(api, "_compiled_step_peak", lambda remat, args, kwargs: remat.plan.predicted_peak_bytes
                        + extra[options[-1] is None])
    compiled = fxremat.compile(copy.deepcopy(model), "min", example_inputs=(x,), backend="inductor")
    plan, note = compiled.plan, compiled.plan.notes[-1]
    assert "layout optimization off)" in note  # measured both ways
    kept = plan.predicted_peak_bytes + extra[not kept_off]
    assert f"kept the plan that measured {format_bytes(kept)}" in note
    assert note.endswith("with Inductor's layout optimization off") == kept_off
    # with it off, the module stays compiled so; otherwise it is compiled back with it on
    assert options == [None, {"layout_optimization": False}] + ([] if kept_off else [None])
    options.clear()
    with torch._inductor.config.patch(layout_optimization=False):  # the user's own setting stays
        with pytest.warns(UserWarning, match="compiled step's peak"):
            fxremat.compile(copy.deepcopy(model), "min", example_inputs=(x,), backend="inductor")
    assert options == [None]
