"""Random module graphs compile at random budgets: either they train exactly within the budget,
or they raise InfeasibleBudgetError and the minimum it states is feasible."""

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import fxremat
from _models import assert_same_state, pair, with_grads

# planning: plans come from the DP kernels, so the pure-Python kernels' pass runs these too
pytestmark = pytest.mark.solver

D = 16
OPS = ("linear", "add", "cat", "mul", "relu_", "dropout", "view", "shared")


@st.composite
def specs(draw):
    n = draw(st.integers(2, 9))
    nodes = []
    for v in range(n):
        op = draw(st.sampled_from(OPS)) if v else "linear"  # so that something needs a gradient
        a = draw(st.integers(-1, v - 1))  # -1 is the graph input
        b = draw(st.integers(-1, v - 1))
        nodes.append((op, a, b))
    extra_output = draw(st.integers(-1, n - 2))
    return tuple(nodes), extra_output


class RandomNet(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.nodes, self.extra = spec
        self.lin = nn.ModuleList(nn.Linear(D, D) for _ in self.nodes)
        self.fuse = nn.ModuleList(nn.Linear(2 * D, D) for _ in self.nodes)
        self.shared = nn.Linear(D, D)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        vals = []
        for i, (op, a, b) in enumerate(self.nodes):
            va, vb = (x if a < 0 else vals[a]), (x if b < 0 else vals[b])
            if op == "linear":
                out = torch.tanh(self.lin[i](va))
            elif op == "add":
                out = va + vb
            elif op == "cat":
                out = self.fuse[i](torch.cat([va, vb], dim=1))
            elif op == "mul":
                out = va * torch.sigmoid(vb)
            elif op == "relu_":
                out = self.lin[i](va).relu_()
            elif op == "dropout":
                out = self.drop(self.lin[i](va))
            elif op == "view":
                out = self.lin[i](va).view(-1, 4, D // 4).transpose(1, 2).reshape(-1, D)
            else:
                out = torch.tanh(self.shared(va))
            vals.append(out)
        extra = x if self.extra < 0 else vals[self.extra]
        return vals[-1], extra.sum(dim=1)


# No shrink phase: a pure-Python pass once ran > 5 min here, not reproduced. Hypothesis shrinks a
# failing example for up to MAX_SHRINKING_SECONDS = 300, one compile (~1 s, more on a loaded
# machine) per try; without shrinking, a failure is reported as drawn, at once.
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(spec=specs(), fraction=st.floats(0.15, 1.0), seed=st.integers(0, 2**16))
def test_random_graphs_train_exactly_within_budget(spec, fraction, seed):
    torch.manual_seed(seed)
    plain, model = pair(RandomNet(spec))
    x = torch.randn(64, D, requires_grad=True)
    try:
        compiled = fxremat.compile(model, fraction, example_inputs=(x,), cost_model="flops")
    except fxremat.InfeasibleBudgetError as err:
        compiled = fxremat.compile(model, err.min_feasible_bytes, example_inputs=(x,), cost_model="flops")
        assert compiled.plan.predicted_peak_bytes <= err.min_feasible_bytes
    with_grads(plain), with_grads(compiled)

    def step(m):
        x.grad = None
        torch.manual_seed(seed + 1)
        out, extra = m(x)
        (out.pow(2).mean() + extra.mean()).backward()
        return out.detach()

    out_a, _ = fxremat.measure_peak(step, plain)
    x_grad_plain = x.grad
    out_b, peak = fxremat.measure_peak(step, compiled)
    assert torch.equal(out_a, out_b)
    assert_same_state(plain, compiled)
    assert torch.equal(x.grad, x_grad_plain)
    # the input is outside the budget, and so is its gradient (plus one accumulation buffer)
    assert peak <= compiled.plan.budget_bytes * 1.05 + 2 * x.numel() * 4

