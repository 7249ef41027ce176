"""Bad input gets a clear error naming the value and the fix, and nothing half-done."""

import copy
import math

import pytest
import torch

import fxremat
from _models import small_unet

# planning: plans come from the DP kernels, so the pure-Python kernels' pass runs these too
pytestmark = pytest.mark.solver

X = torch.randn(2, 3, 32, 32)


def test_infeasible_budget_reports_the_minimum_which_is_feasible():
    model = small_unet()
    with pytest.raises(fxremat.InfeasibleBudgetError) as info:
        fxremat.plan(model, 1024, example_inputs=(X,), cost_model="flops")
    err = info.value
    assert isinstance(err, ValueError)
    assert str(err.min_feasible_bytes) in str(err) and "budget='min'" in str(err) and "MiB" in str(err)
    at_min = fxremat.plan(model, err.min_feasible_bytes, example_inputs=(X,), cost_model="flops")
    assert at_min.predicted_peak_bytes <= err.min_feasible_bytes
    least = fxremat.plan(model, "min", example_inputs=(X,), cost_model="flops")
    assert least.predicted_peak_bytes == err.min_feasible_bytes


class _Encoded(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.emb = torch.nn.Embedding(32, d)
        layer = torch.nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.1, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, 5)

    def forward(self, ids):
        return self.head(self.enc(self.emb(ids)).mean(1))


def test_an_infeasible_budget_names_the_leaf_that_holds_the_least_peak():
    """A whole nn.TransformerEncoder kept as one node held 94% of the least feasible peak, and the
    error said only to raise the budget."""
    ids = torch.randint(0, 32, (2, 16))
    with pytest.raises(fxremat.InfeasibleBudgetError) as info:
        fxremat.plan(_Encoded(), 0.5, example_inputs=(ids,), cost_model="flops",
                     leaf_modules=(torch.nn.TransformerEncoder,))
    assert "held inside the leaf node 'enc' (submodule 'enc', TransformerEncoder)" in str(info.value)
    assert "it is in leaf_modules: leave it out to plan inside it" in str(info.value)
    fxremat.plan(_Encoded(), 0.5, example_inputs=(ids,), cost_model="flops")  # planned inside it, it fits


@pytest.mark.parametrize("budget, exc", [(-5, ValueError), (0, ValueError), (math.nan, ValueError), (1.5, ValueError),
                                         ("3 furlongs", ValueError), (None, TypeError), ([1], TypeError)])
def test_bad_budgets(budget, exc):
    with pytest.raises(exc, match="budget"):
        fxremat.compile(small_unet(), budget, example_inputs=(X,))


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "greedy"}, "strategy must be one of"),
    ({"cost_model": "vibes"}, "cost_model must be one of"),
    ({"max_plans": 0}, "max_plans"),
    ({"rotor_slots": 0}, "rotor_slots must be a positive int, got 0"),
    ({"rotor_slots": 2.5}, "rotor_slots must be a positive int, got 2.5"),
    ({"bogus_option": 1}, "unknown option"),
])
def test_bad_options(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fxremat.compile(small_unet(), 0.5, example_inputs=(X,), **kwargs)


def test_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        fxremat.compile(lambda x: x, 0.5)


def test_exact_over_the_cap_says_what_to_do():
    with pytest.raises(ValueError, match="exact_cap=.*strategy='approx'"):
        fxremat.plan(small_unet(), 0.5, example_inputs=(X,), cost_model="flops", strategy="exact", exact_cap=3)
    plan = fxremat.plan(small_unet(), 0.5, example_inputs=(X,), cost_model="flops", strategy="approx", exact_cap=3)
    assert plan.strategy == "approx" and not plan.notes
    plan = fxremat.plan(small_unet(), 0.5, example_inputs=(X,), cost_model="flops", strategy="auto", exact_cap=3)
    assert plan.strategy != "exact" and "exact_cap=3" in plan.notes[0] and "exact_cap=3" in plan.summary()


def _decorated(fn):
    import functools

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    return wrapper


class _DecoratedForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    @_decorated
    def forward(self, x, mask=None, **kwargs):
        return self.lin(x)


def test_decorated_forward_is_captured_and_trains_like_plain():
    """forward(*args, **kwargs) wrappers (Hugging Face's decorators) do not trace with torch.fx:
    such a model is captured with torch.export instead, called with keywords."""
    import copy

    torch.manual_seed(0)
    model = _DecoratedForward()
    plain = copy.deepcopy(model)
    x = torch.randn(3, 4)
    remat = fxremat.compile(model, "min", example_inputs={"x": x}, cost_model="flops")
    for m in (plain, remat):
        m(x=x).square().sum().backward()
    for p, q in zip(plain.parameters(), remat.parameters()):
        assert torch.equal(p.grad, q.grad)
    # leaf_modules= are kept whole in the capture too (refused before: export kept no leaves)
    model = _DecoratedForward()
    plain = copy.deepcopy(model)
    remat = fxremat.compile(model, "min", example_inputs={"x": x}, cost_model="flops", leaf_modules=("lin",))
    assert [n.target for n in remat._remat.last[3].graph_module.graph.nodes if n.op == "call_module"] == ["lin"]
    for m in (plain, remat):
        m(x=x).square().sum().backward()
    for p, q in zip(plain.parameters(), remat.parameters()):
        assert torch.equal(p.grad, q.grad)


class _Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x


def test_trace_error_names_the_class_and_the_line():
    with pytest.raises(fxremat.TraceError) as info:
        fxremat.compile(_Branches(), 0.5)
    assert info.value.module_class == "_Branches"
    assert "(_Branches)" in str(info.value) and "test_errors.py:" in str(info.value)
    assert "if x.sum() > 0" in str(info.value)


class _Flagged(torch.nn.Module):
    """diffusers' AutoencoderKL and UNet2DModel: a Python flag and an optional input, both
    checked in the top-level forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, labels=None, sample_posterior: bool = False):
        if labels is not None:
            raise ValueError("no label embedding: labels cannot be used")
        if sample_posterior:
            x = x + torch.randn_like(x)
        return self.lin(x)


class _OnlyFlagged(_Flagged):
    def forward(self, x, sample_posterior: bool = False):
        return self.lin(x + 1 if sample_posterior else x)


def test_a_trace_error_in_a_forward_with_defaulted_parameters_says_how_torch_fx_traced_them():
    # before: "computed from input 'sample_posterior' ... a graph cannot hold a Python value computed
    # from tensors", and the model's own ValueError, with no word on the defaults
    with pytest.raises(fxremat.TraceError) as info:
        fxremat.compile(_Flagged(), 0.5)
    message = str(info.value)
    assert "no label embedding" in message  # `labels is not None` on the traced input
    assert "also those that default to None or a Python value (labels=None, sample_posterior=False)" in message
    assert "pass example_inputs=" in message
    with pytest.raises(fxremat.TraceError, match=r"input 'sample_posterior', a Python bool by default \(False\) "
                                                 r"that torch.fx traces as a tensor of unknown value"):
        fxremat.compile(_OnlyFlagged(), 0.5)
    x = torch.randn(3, 4)  # with example inputs it is captured, and trains as eager
    plain = _Flagged()
    compiled = fxremat.compile(copy.deepcopy(plain), "min", example_inputs=(x,), cost_model="flops")
    for m in (plain, compiled):
        m(x).square().sum().backward()
    for p, q in zip(plain.parameters(), compiled.parameters()):
        assert torch.equal(p.grad, q.grad)


class _WideHead(torch.nn.Module):
    """A small input through a wide Linear: its backward's gradient of the weight (4 MiB, as
    hrnet_w18_small's 18 MiB downsampling Conv2d) is most of the least feasible peak."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(8, 1024)
        self.wide = torch.nn.Linear(1024, 1024)

    def forward(self, x):
        return self.wide(self.stem(x).relu()).sum(-1)


def test_an_infeasible_budget_held_by_a_weight_gradient_says_no_smaller_input_lowers_it():
    # before: "torch.fx cannot trace into torch.nn's Linear, so only smaller inputs (batch,
    # sequence) lower what it holds", which they do not
    with pytest.raises(fxremat.InfeasibleBudgetError) as info:
        fxremat.plan(_WideHead(), 0.5, example_inputs=(torch.randn(2, 8),), cost_model="flops")
    message = str(info.value)
    assert "held inside the leaf node 'wide' (submodule 'wide', Linear)" in message, message
    assert "4.0 MiB of it is the gradient of its weights" in message and "no smaller input lowers it" in message
    assert "only smaller inputs" not in message
