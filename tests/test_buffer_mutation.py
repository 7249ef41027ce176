"""Model state is never changed behind the user's back (issue 12, item 1).

Buffers written by functions rather than modules (``F.batch_norm`` on a module's own buffers,
as timm's ``BatchNormAct2d`` does; it does not bump their version counters), buffers updated by
Python code (``self.num_batches_tracked.add_(1)``, which ran once at trace time and never in
training), Python values computed from buffers (``1 / float(num_batches_tracked)``), and
``compile``/``plan`` themselves: each trained beside a plain twin, every buffer compared.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxremat
from _models import assert_same_state, pair, train_step, with_grads

X = torch.randn(2, 8, 16, 16)


class FunctionalBN(nn.BatchNorm2d):
    """timm's BatchNormAct2d style: F.batch_norm on its own buffers, counter bumped in Python."""

    def forward(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            self.training, self.momentum, self.eps)


class CumulativeBN(nn.BatchNorm2d):
    """momentum=None: the factor 1 / num_batches_tracked is a Python float computed from a buffer."""

    def forward(self, x):
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked)
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, factor, self.eps)


def _net(norm=FunctionalBN, n=6):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), norm(8), nn.ReLU()) for _ in range(n)])


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same_dict(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} changed"


def _trains_like_plain(norm, budget, steps=2):
    plain, model = pair(_net(norm))
    before = _state(model)
    remat = fxremat.compile(model, budget, example_inputs=(X,), cost_model="flops")
    _assert_same_dict(before, _state(model))  # compiling changed nothing
    assert any(s.recomputed for s in remat.plan.segments), "the test needs a recomputed segment"
    with_grads(plain), with_grads(remat)
    for step in range(steps):
        assert torch.equal(train_step(plain, X, seed=step), train_step(remat, X, seed=step))
    assert_same_state(plain, remat)
    return remat


@pytest.mark.parametrize("budget", [0.6, "min"])
def test_functional_batch_norm_updates_running_statistics_once(budget):
    remat = _trains_like_plain(FunctionalBN, budget)
    recomputed = {n for s in remat.plan.segments if s.recomputed for n in s.nodes}
    # the running statistics F.batch_norm writes are known (restored after a recomputation)
    assert any(b.endswith("running_mean") for i in remat.plan.nodes if i.name in recomputed for b in i.mutated_buffers)
    assert int(remat.get_submodule("1.1").num_batches_tracked) == 2


def test_cumulative_batch_norm_is_a_leaf_with_a_warning_that_names_the_cause():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trains_like_plain(CumulativeBN, "min")
    text = "\n".join(str(w.message) for w in caught)
    assert "CumulativeBN" in text and "num_batches_tracked" in text and "float()" in text
    assert "autocast" not in text


class WritesAtTopLevel(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.body = _net(nn.BatchNorm2d, n=6)

    def forward(self, x):
        self.calls += 1
        return self.body(x)


def test_buffer_updated_by_python_code_is_in_the_graph():
    plain, model = pair(WritesAtTopLevel())
    before = _state(model)
    remat = fxremat.compile(model, 0.6, example_inputs=(X,), cost_model="flops")
    _assert_same_dict(before, _state(model))
    for step in range(3):
        assert torch.equal(train_step(plain, X, seed=step), train_step(remat, X, seed=step))
    assert int(model.calls) == int(plain.calls) == 3
    assert_same_state(plain, remat)


def test_compile_and_plan_leave_the_state_dict_unchanged():
    model = nn.Sequential(_net(nn.BatchNorm2d, n=2), _net(FunctionalBN, n=2), _net(CumulativeBN, n=1))
    before = _state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxremat.compile(model, 0.8, cost_model="flops")
        _assert_same_dict(before, _state(model))
        fxremat.compile(copy.deepcopy(model), 0.8, example_inputs=(X,), cost_model="flops")
        fxremat.compile(model, "min", example_inputs=(X,), cost_model="flops")
        _assert_same_dict(before, _state(model))
        fxremat.plan(model, 0.8, example_inputs=(X,), cost_model="flops")
    _assert_same_dict(before, _state(model))


class _CapturedDeadBranch(nn.Module):
    """A ``*args`` forward (captured with torch.export) that computes an auxiliary head and a
    dropout it then drops, as UperNet's auxiliary head without labels: eager still updates that
    BatchNorm's running statistics and draws the dropout's numbers."""

    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.aux = nn.Sequential(nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4))

    def forward(self, *args):
        h = self.main(args[0])
        self.aux(h)
        F.dropout(h, 0.5)
        return F.dropout(h, 0.5).mean((2, 3))


@pytest.mark.parametrize("budget", [1.0, "min"])
def test_a_captured_forward_keeps_the_calls_whose_results_it_drops(budget):
    """The capture's dead-code pass dropped them (``aten.batch_norm``'s schema does not say it
    writes the running statistics): aux's stayed at 0 and 1, and the next dropout's mask moved."""
    plain, model = pair(_CapturedDeadBranch())
    remat = fxremat.compile(model, budget, example_inputs=(X,), cost_model="flops")
    assert remat._remat.traced is None  # captured
    with_grads(plain), with_grads(remat)
    for step in range(2):
        assert torch.equal(train_step(plain, X, seed=step), train_step(remat, X, seed=step))
    assert_same_state(plain, remat)
    assert not torch.equal(remat.aux[1].running_mean, torch.zeros(4))
