"""Models and helpers shared by the tests (the example nets at test sizes, a training step)."""

from __future__ import annotations

import copy
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import pspnet  # noqa: E402
import unet  # noqa: E402


def small_unet() -> torch.nn.Module:
    return unet.UNet(in_channels=3, num_classes=3, base_channels=8, depth=3)


def small_pspnet() -> torch.nn.Module:
    return pspnet.PSPNet(num_classes=4, layers=(2, 2, 2, 2), base_width=8)


def with_grads(model: torch.nn.Module) -> torch.nn.Module:
    """Pre-allocate .grad so a measured step's peak is the activation peak."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    return model


def loss_of(out: torch.Tensor) -> torch.Tensor:
    target = torch.zeros(out.shape[0], *out.shape[2:], dtype=torch.long, device=out.device)
    return F.cross_entropy(out, target)


def train_step(model, x, *, seed: int = 0) -> torch.Tensor:
    """One forward + backward with a fixed RNG seed (so dropout masks can be compared)."""
    torch.manual_seed(seed)
    out = model(x)
    loss_of(out).backward()
    return out.detach()


def pair(model: torch.nn.Module):
    """Two independent copies of ``model`` (one stays plain, one gets compiled)."""
    return copy.deepcopy(model), copy.deepcopy(model)


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
        if p.grad is not None or q.grad is not None:
            assert torch.equal(p.grad, q.grad), f"gradient of {name} differs"
    for (name, x), y in zip(a.named_buffers(), b.buffers()):
        assert torch.equal(x, y), f"buffer {name} differs"


def min_cut_replay(graphs: dict | None = None):
    """A torch.compile backend giving what Inductor is given (AOTAutograd, min-cut partition)
    and running its graphs op by op, each input let go at its last use as Inductor's code does;
    ``graphs`` gets the partitioned ``"forward"`` and ``"backward"`` graphs. (A RematModule runs
    fxremat's joint-graph pass before the partition, as under any backend.)"""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def compiler(gm, example_inputs):
        if graphs is not None:
            graphs["backward" if "forward" in graphs else "forward"] = copy.deepcopy(gm.graph)
        gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
        gm.recompile()
        run = gm.forward

        def boxed(args):
            return run(args)

        boxed._boxed_call = True
        return boxed

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition)


def without_the_segment_output_pass(monkeypatch) -> None:
    """Make RematModules run their emitted code under torch.compile without
    :func:`fxremat.passes.partition.keeping_segment_outputs`: what AOTAutograd does on its own."""
    import contextlib

    from fxremat.passes import partition

    monkeypatch.setattr(partition, "keeping_segment_outputs", contextlib.nullcontext)


def matrix_products(graph: torch.fx.Graph) -> int:
    """How many matrix products (mm, bmm, addmm) ``graph`` runs."""
    return sum(n.op == "call_function" and n.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
                                                        torch.ops.aten.addmm.default) for n in graph.nodes)
