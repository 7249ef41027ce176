"""Profile the nets of Kusumoto et al. (NeurIPS 2019) once and save their graphs as JSON fixtures.

Each model is built and run under ``FakeTensorMode`` (no memory is allocated), traced with
:func:`fxremat.passes.trace.trace`, profiled with ``cost_model="flops"`` and turned into a
:class:`~fxremat.core.CostGraph` written to ``benchmarks/fixtures/<name>.json`` with
:func:`~fxremat.core.save_graph`. :mod:`benchmarks.solver_speed` then needs neither the models
nor torchvision.

Batch sizes are those of the paper's Table 1 (224×224 inputs; Inception-v3 at 299×299, which
the paper does not list). U-Net and PSPNet come from ``examples/``; the torchvision nets need
torchvision, which does not import beside every torch build (see the README), so they are made
in a separate environment::

    PYTHONPATH=. python benchmarks/make_fixtures.py                # all nets
    PYTHONPATH=. python benchmarks/make_fixtures.py unet pspnet    # only these

Nets whose model cannot be built (torchvision missing) are skipped with a message.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxremat.core import save_graph
from fxremat.passes.lower import build_graph
from fxremat.passes.profile import profile
from fxremat.passes.trace import trace

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")

# name -> (source, constructor, input shape); source "examples" or "torchvision"
NETS = {
    "unet": ("examples", "unet", None),
    "pspnet": ("examples", "pspnet", None),
    "resnet50": ("torchvision", "resnet50", (96, 3, 224, 224)),
    "resnet152": ("torchvision", "resnet152", (48, 3, 224, 224)),
    "vgg19": ("torchvision", "vgg19", (64, 3, 224, 224)),
    "densenet161": ("torchvision", "densenet161", (32, 3, 224, 224)),
    "googlenet": ("torchvision", "googlenet", (256, 3, 224, 224)),
    "inception_v3": ("torchvision", "inception_v3", (32, 3, 299, 299)),
}


def build(name: str):
    """``(model, input shape)`` for ``name``; raises ImportError when torchvision is missing."""
    source, ctor, shape = NETS[name]
    if source == "examples":
        sys.path.insert(0, EXAMPLES)
        module = importlib.import_module(ctor)
        return module.build_model("paper"), module.PAPER_INPUT
    import torchvision.models as tvm

    kwargs = {"aux_logits": False, "init_weights": False} if ctor in ("googlenet", "inception_v3") else {}
    return getattr(tvm, ctor)(weights=None, **kwargs), shape


def make(name: str) -> str:
    """Profile ``name`` on fake tensors and write its fixture; returns the path."""
    with FakeTensorMode():
        model, shape = build(name)
        model.train()
        x = torch.randn(*shape)
        gm = trace(model)
        graph = build_graph(gm, profile(gm, (x,), cost_model="flops"))
    path = os.path.join(FIXTURES, f"{name}.json")
    save_graph(graph, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nets", nargs="*", help=f"any of {', '.join(NETS)} (default: all)")
    args = parser.parse_args()
    unknown = sorted(set(args.nets) - set(NETS))
    if unknown:
        parser.error(f"unknown net(s) {unknown}; known: {', '.join(NETS)}")
    os.makedirs(FIXTURES, exist_ok=True)
    for name in args.nets or NETS:
        start = time.perf_counter()
        try:
            path = make(name)
        except ImportError as err:
            print(f"{name}: skipped ({err}); install torchvision to make it")
            continue
        size_kb = os.path.getsize(path) / 1024
        print(f"{name}: {path} ({size_kb:.0f} KB) in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
