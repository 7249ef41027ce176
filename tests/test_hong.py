"""Hong et al.'s dynamic checkpoint selection (fxremat.solvers.hong) against brute force."""

from itertools import combinations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxremat.passes.lower import build_graph
from fxremat.lowersets import bits
from fxremat.passes.profile import profile
from fxremat.passes.trace import trace
from fxremat.core import Schedule
from fxremat.simulate import simulate
from fxremat.solvers.chen import cut_points
from fxremat.solvers.hong import hong_candidates, hong_chain, hong_peak, hong_quadratic, stage_sizes

# planning: plans come from the DP kernels, so the pure-Python kernels' pass runs these too
pytestmark = pytest.mark.solver

FAST = settings(max_examples=150, deadline=None)


def algorithm4_peak(d, checkpoints, held=None):
    """Replay Hong et al.'s Algorithm 4 step by step and return its peak (the oracle).

    Forward: d_i is allocated, d_{i-1} freed unless a checkpoint. Backward, i from n to 1: at a
    checkpoint, the segment back to the previous checkpoint h is recomputed (a recomputed layer
    holds ``held[k]``), the previous output-gradient buffer is released and one of
    max(d_h..d_{i-1}) allocated; then layer i's backward runs and d_i is released.
    """
    w = d if held is None else held
    n = len(d) - 1
    cps = sorted(set(checkpoints) | {0, n})
    live = {0: d[0]}
    peak = d[0]
    for i in range(1, n + 1):
        live[i] = d[i]
        peak = max(peak, sum(live.values()))
        if i - 1 not in cps:
            del live[i - 1]
    buffer = 0
    for i in range(n, 0, -1):
        if i in cps:
            h = max(c for c in cps if c < i)
            for k in range(h + 1, i):
                live[k] = w[k]
            buffer = max(d[h:i])
        peak = max(peak, sum(live.values()) + buffer)  # layer i's backward, d_i still live
        del live[i]
    return peak


def brute_force(d, held=None):
    """Least Algorithm 4 peak over every checkpoint subset (d_0 and d_n always checkpoints)."""
    inner = range(1, len(d) - 1)
    return min(algorithm4_peak(d, set(c), held)
               for r in range(len(inner) + 1) for c in combinations(inner, r))


@st.composite
def chains(draw, max_len=9, max_size=20):
    d = draw(st.lists(st.integers(0, max_size), min_size=1, max_size=max_len))
    extra = draw(st.lists(st.integers(0, max_size), min_size=len(d), max_size=len(d)))
    return d, [x + e for x, e in zip(d, extra)]


@FAST
@given(chains())
def test_linear_algorithm_matches_brute_force(chain):
    d, held = chain
    for w in (None, held):
        peak, cps = hong_chain(d, w)
        assert peak == brute_force(d, w)
        assert cps[0] == 0 and cps[-1] == len(d) - 1 and list(cps) == sorted(set(cps))
        assert algorithm4_peak(d, cps, w) == peak  # the selection achieves the claimed peak
        assert hong_peak(d, cps, w) == peak


@FAST
@given(chains(max_len=7), st.data())
def test_peak_formula_is_algorithm4(chain, data):
    d, held = chain
    cps = data.draw(st.sets(st.integers(0, len(d) - 1)))
    for w in (None, held):
        assert hong_peak(d, cps, w) == algorithm4_peak(d, cps, w)


@settings(max_examples=300, deadline=None)
@given(chains(max_len=60, max_size=1000))
def test_linear_equals_quadratic(chain):
    d, held = chain
    for w in (None, held):
        fast, slow = hong_chain(d, w), hong_quadratic(d, w)
        assert fast[0] == slow[0]
        assert hong_peak(d, fast[1], w) == fast[0]


@given(st.integers(1, 40), st.integers(1, 30))
@settings(max_examples=50, deadline=None)
def test_flat_chains_with_zero_sizes(n, size):
    """Zero sizes make the queue's ties and evictions matter (Algorithm 6 lines 4 and 15)."""
    for d in ([size] * (n + 1), [0] * (n + 1), [size, 0] * n, [0, size] * n):
        assert hong_chain(d)[0] == hong_quadratic(d)[0]


def test_hand_example():
    # d = (0, 10, 1, 10): keeping the small d_2 gives m(2) = 1 + 10 + 10 = 21, m(3) = 11 + 1;
    # no checkpoint: 10 + (10 + 1) + 10 = 31; keeping d_1 too: m(3) = 21 + 1.
    assert hong_chain([0, 10, 1, 10]) == (21, (0, 2, 3))
    assert hong_peak([0, 10, 1, 10], [0, 3]) == 31
    assert hong_peak([0, 10, 1, 10], [0, 1, 2, 3]) == 22
    # a recomputed d_1 holding 30 makes recomputing it cost more than keeping it
    assert hong_chain([0, 10, 1, 10], [0, 30, 1, 10]) == (22, (0, 1, 2, 3))


def test_trivial_chains_and_errors():
    assert hong_chain([5]) == (5, (0,))
    assert hong_chain([3, 4]) == (3 + 4 + 3, (0, 1))
    with pytest.raises(ValueError, match="held"):
        hong_chain([1, 2, 3], [1, 1, 3])
    with pytest.raises(ValueError, match="at least"):
        hong_chain([])


# ---------------------------------------------------------------------------------------------
# On real graphs
# ---------------------------------------------------------------------------------------------

class Residual(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(x + self.b(torch.relu(self.a(x))))


def deep_chain(depth=16, width=32):
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def res_net(blocks=6, width=32):
    return torch.nn.Sequential(torch.nn.Linear(width, width), *[Residual(width) for _ in range(blocks)],
                               torch.nn.Linear(width, 4))


def conv_net():
    layers = [torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()]
    for _ in range(5):
        layers += [torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 2))


def graph_of(model, x):
    torch.manual_seed(0)
    gm = trace(model)
    return build_graph(gm, profile(gm, (x,), cost_model="flops"))


@pytest.fixture(scope="module")
def graphs():
    torch.manual_seed(0)
    return {
        "chain": graph_of(deep_chain(), torch.randn(256, 32)),
        "residual": graph_of(res_net(), torch.randn(256, 32)),
        "conv": graph_of(conv_net(), torch.randn(4, 3, 16, 16)),
    }


def schedule_of(lower_sets):
    segments, prev = [], 0
    for mask in lower_sets:
        segments.append(tuple(bits(mask & ~prev)))
        prev = mask
    return Schedule(tuple(segments), tuple([True] * (len(segments) - 1) + [False]))


def plain_peak(graph):
    return simulate(graph, Schedule((tuple(range(graph.n)),), (False,)))


@pytest.mark.parametrize("name", ["chain", "residual", "conv"])
def test_candidates_are_lower_set_sequences(graphs, name):
    graph = graphs[name]
    full = (1 << graph.n) - 1
    lows = {low for _, low in cut_points(graph)}
    cands = hong_candidates(graph)
    assert 1 <= len(cands) <= 2
    for seq in cands:
        assert seq[-1] == full
        assert all(a & ~b == 0 and a != b for a, b in zip(seq, seq[1:]))  # strictly increasing
        for mask in seq[:-1]:
            assert mask in lows
            for v in bits(mask):
                assert all(mask >> p & 1 for p in graph.preds[v])  # closed under predecessors
        assert sorted(v for seg in schedule_of(seq).segments for v in seg) == list(range(graph.n))


@pytest.mark.parametrize("name", ["chain", "residual", "conv"])
def test_stage_sizes(graphs, name):
    graph = graphs[name]
    sizes, held, lows = stage_sizes(graph)
    assert len(sizes) == len(held) == len(lows) + 1 == len(cut_points(graph)) + 2
    assert sizes[0] == held[0] == 0
    assert all(0 < s <= h for s, h in zip(sizes[1:], held[1:]))
    if name == "residual":  # a residual block keeps more than its output
        assert any(h > s for s, h in zip(sizes, held))


def test_deep_chain_peak_is_reduced(graphs):
    graph = graphs["chain"]
    sizes, _, _ = stage_sizes(graph)
    assert len(sizes) > 20  # every layer is a stage
    plain = plain_peak(graph)
    peaks = [simulate(graph, schedule_of(seq)) for seq in hong_candidates(graph)]
    assert all(p <= plain for p in peaks)
    assert min(peaks) < 0.75 * plain  # a deep chain keeps far fewer activations
    assert all(len(seq) > 2 for seq in hong_candidates(graph))  # several checkpoints


@pytest.mark.parametrize("name", ["residual", "conv"])
def test_peak_not_above_plain(graphs, name):
    graph = graphs[name]
    assert min(simulate(graph, schedule_of(seq)) for seq in hong_candidates(graph)) <= plain_peak(graph)
