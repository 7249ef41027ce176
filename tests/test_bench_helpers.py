"""Helpers of the benchmarks that decide what a table compares."""

import torch

from benchmarks.compile_budget import _own_code


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.a(x))


def _graphs_compiled(copies) -> int:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(2, 4)
    for model in copies:
        torch.compile(model, backend=backend)(x)
    torch._dynamo.reset()
    return len(graphs)


def test_copies_with_code_of_their_own_compile_apart():
    """Dynamo caches a graph per code object: a second copy of one class reuses the first one's
    graph (so two torch.compile budgets could not be compiled side by side) unless its forward
    has a code object of its own."""
    assert _graphs_compiled([_Net(), _Net()]) == 1
    copies = [_own_code(_Net(), "a"), _own_code(_Net(), "b")]
    assert _graphs_compiled(copies) == 2
    assert all(isinstance(m, _Net) and type(m).__name__ == "_Net" for m in copies)
    x = torch.randn(3, 4)
    assert torch.equal(copies[0](x), torch.tanh(copies[0].a(x)))
