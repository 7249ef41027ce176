"""The torchvision classification zoo at small inputs and budget 0.5: one training step each,
outputs, gradients and buffers equal to the plain model, measured peak within the budget.

Optional: skipped without torchvision (``pip install -e ".[zoo]"``). Marked ``zoo``
(``-m "not zoo"`` leaves it out). By default it runs a representative subset (1-2 min on two
CPU cores); ``FXREMAT_ZOO=all`` runs every classification model torchvision lists (80 in
torchvision 0.29: 10-25 min on two cores, depending on load; ~12 GB of memory for vit_h_14 and
regnet_y_128gf). The README's zoo table comes from this test's check().
"""

import copy
import gc
import os
import time
import warnings

import pytest
import torch

import fxremat
from _models import with_grads

tv_models = pytest.importorskip("torchvision.models")

pytestmark = pytest.mark.zoo

BUDGET = 0.5
BATCH = 2
SIZE = 64
SUBSET = ("resnet18", "mobilenet_v2", "densenet121", "googlenet", "vit_b_16")
VITS = {"vit_b_16": 32, "vit_b_32": 32, "vit_l_16": 32, "vit_l_32": 32, "vit_h_14": 28}
# The smallest inputs these architectures accept in training mode (inception_v3's auxiliary
# head needs 299; maxvit_t's window partitions need 224; a ViT is built for its image size).
SIZES = {"inception_v3": 299, "maxvit_t": 224, **VITS}
# Constructor arguments: ViTs at small images (positional embeddings are sized by image_size);
# explicit init_weights silences GoogLeNet's and Inception's FutureWarning.
KWARGS = {
    **{name: {"image_size": size} for name, size in VITS.items()},
    "googlenet": {"init_weights": True},
    "inception_v3": {"init_weights": True},
}
EXACT = {"rtol": 1e-4, "atol": 1e-5}


def zoo_models() -> list[str]:
    names = tv_models.list_models(module=tv_models)
    if os.environ.get("FXREMAT_ZOO") == "all":
        return names
    return [n for n in SUBSET if n in names]


def _loss(out) -> torch.Tensor:
    """Cross-entropy of every logits tensor (GoogLeNet and Inception add auxiliary heads)."""
    logits = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]
    return sum(torch.nn.functional.cross_entropy(t, torch.zeros(t.shape[0], dtype=torch.long)) for t in logits)


def _step(model, x):
    torch.manual_seed(0)
    out = model(x)
    _loss(out).backward()
    return tuple(t.detach() for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor))


def _compare(plain, compiled, outs_a, outs_b) -> bool:
    """Assert outputs, gradients and buffers agree; return whether they are bitwise equal."""
    pairs = list(zip(outs_a, outs_b))
    for (name, p), q in zip(plain.named_parameters(), compiled.parameters()):
        pairs.append((p.grad, q.grad))
        assert (p.grad is None) == (q.grad is None), f"gradient of {name}: one is None"
    pairs = [(a, b) for a, b in pairs if a is not None]
    pairs += [(a, b) for a, b in zip(plain.buffers(), compiled.buffers())]
    for a, b in pairs:
        scale = max(a.abs().max().item(), 1.0) if a.is_floating_point() and a.numel() else 1.0
        torch.testing.assert_close(b, a, rtol=EXACT["rtol"], atol=EXACT["atol"] * scale)
    return all(torch.equal(a, b) for a, b in pairs)


def check(name: str) -> dict:
    """Compile torchvision's ``name``, train one step beside the plain model and compare."""
    start = time.perf_counter()
    torch.manual_seed(0)
    model = tv_models.get_model(name, weights=None, **KWARGS.get(name, {}))
    plain = copy.deepcopy(model)
    size = SIZES.get(name, SIZE)
    x = torch.randn(BATCH, 3, size, size)
    budget = BUDGET
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiled = fxremat.compile(model, budget, example_inputs=(x,), cost_model="flops")
        except fxremat.InfeasibleBudgetError as exc:
            # At small inputs the weight-gradient buffers of the widest layers can outweigh the
            # activations: the error names the least feasible budget, which must then hold.
            budget = exc.min_feasible_bytes
            compiled = fxremat.compile(model, budget, example_inputs=(x,), cost_model="flops")
    leaves = [str(w.message) for w in caught if "treating it as one leaf" in str(w.message)]
    with_grads(plain), with_grads(compiled)
    outs_a, _ = fxremat.measure_peak(_step, plain, x)
    outs_b, peak = fxremat.measure_peak(_step, compiled, x)
    bitwise = _compare(plain, compiled, outs_a, outs_b)
    the_plan = compiled.plan
    assert peak <= the_plan.budget_bytes * 1.05, f"measured {peak} B over the budget {the_plan.budget_bytes} B"
    return {
        "name": name, "input": tuple(x.shape), "budget": budget, "leaves": leaves, "bitwise": bitwise,
        "peak_bytes": peak,
        "budget_bytes": the_plan.budget_bytes, "baseline_bytes": the_plan.baseline_peak_bytes,
        "strategy": the_plan.strategy, "nodes": the_plan.num_nodes, "seconds": time.perf_counter() - start,
    }


@pytest.fixture(autouse=True)
def _collect_garbage():
    yield
    # A GraphModule and its Graph reference each other: without a collection, the models of
    # earlier tests (up to GBs each) stay alive until Python's next full collection.
    gc.collect()


@pytest.mark.parametrize("name", zoo_models())
def test_torchvision_model_trains_exactly_within_budget(name):
    check(name)
