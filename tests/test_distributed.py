"""Data parallelism on CPU with the gloo backend: a compiled module inside
DistributedDataParallel and under FSDP2 (``fully_shard``) trains like one process on the whole
batch. Two ranks run in spawned processes; rank 0 writes its gradients and weights to a file."""

import os
import socket
import sys
import time
import traceback

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxremat

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORLD = 2
BATCH = (8, 3, 16, 16)
STEPS = 2
RANK_TIMEOUT_S = 300


class Net(nn.Module):
    """Residual conv blocks without BatchNorm or dropout, and a root-level parameter used outside
    any submodule call (a ``get_attr`` node, which FSDP2 replaces during its forward)."""

    def __init__(self, c=8, n=4):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.gain = nn.Parameter(torch.ones(1, c, 1, 1))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU()) for _ in range(n))
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        h = self.stem(x) * self.gain
        for block in self.blocks:
            h = block(h) + h
        return self.head(h.mean(dim=(2, 3)))


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(*BATCH, generator=gen), torch.randint(0, 5, (BATCH[0],), generator=gen)


def _net():
    torch.manual_seed(0)
    return Net()


def _train(model, params, x, y):
    """STEPS SGD steps; returns the gradients of the last step (before its update)."""
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad.detach().clone() for p in params]
        opt.step()
    return grads


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _build(kind, x):
    """The module each rank trains, with the order that works: fxremat.compile first, then wrap."""
    from torch.nn.parallel import DistributedDataParallel

    model = _net()
    if kind == "ddp":
        remat = fxremat.compile(model, "min", example_inputs=(x,), cost_model="flops")
        return remat, DistributedDataParallel(remat)
    from torch.distributed.fsdp import fully_shard

    if kind == "fsdp-leaves":  # every submodule that holds parameters is a unit, and a graph node
        remat = fxremat.compile(model, "min", example_inputs=(x,), cost_model="flops")
        for module in model.modules():
            if module is not model and any(True for _ in module.parameters(recurse=False)):
                fully_shard(module)
    else:  # "fsdp-blocks": the sharded blocks are graph nodes through leaf_modules=
        remat = fxremat.compile(model, "min", example_inputs=(x,), cost_model="flops",
                                leaf_modules=tuple(f"blocks.{i}" for i in range(len(model.blocks))))
        for block in model.blocks:
            fully_shard(block)
    fully_shard(remat)  # the root unit: the compiled module, whose forward runs the emitted graph
    return remat, remat


def _worker(rank, kind, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        x, y = (t.chunk(WORLD)[rank] for t in _data())
        remat, top = _build(kind, x)
        params = list(remat.parameters())
        grads = _train(top, params, x, y)
        result = {"grads": [_full(g) for g in grads], "params": [_full(p.detach()) for p in params],
                  "recomputed": sum(s.recomputed for s in remat.plan.segments)}
    except Exception:  # reported to the test through the result file
        result = {"error": traceback.format_exc()}
    dist.barrier()
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    # Leave without tearing the process group down: its destructor can deadlock on the GIL (gloo's
    # worker thread frees a finished work's thread-local state, which holds a Python object, while
    # the main thread, holding the GIL, joins that thread), seen here as a rank that never exits.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(kind, tmp_path):
    out = tmp_path / f"{kind}.pt"
    ranks = torch.multiprocessing.spawn(_worker, args=(kind, _free_port(), str(out)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while not ranks.join(timeout=1):  # raises if a rank failed
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"{kind}: the {WORLD} ranks did not finish within {RANK_TIMEOUT_S} s (killed)")
    result = torch.load(out)
    assert "error" not in result, result.get("error")
    return result


def _check_against_one_process(result):
    x, y = _data()
    model = _net()
    grads = _train(model, list(model.parameters()), x, y)
    assert result["recomputed"] >= 1
    names = [n for n, _ in model.named_parameters()]
    # Averaging over ranks sums in another order than one process: equal up to float rounding.
    for name, a, b in zip(names, grads, result["grads"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")
    for name, a, b in zip(names, model.parameters(), result["params"]):
        torch.testing.assert_close(b, a.detach(), rtol=1e-5, atol=1e-6, msg=f"parameter {name}")


def test_ddp_of_a_compiled_module_matches_one_process(tmp_path):
    _check_against_one_process(_run_two_ranks("ddp", tmp_path))


def _fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _fsdp2_available(), reason="torch.distributed.fsdp.fully_shard (FSDP2) is not in this torch")
@pytest.mark.parametrize("kind", ["fsdp-leaves", "fsdp-blocks"])
def test_fsdp2_fully_shard_of_a_compiled_module_matches_one_process(kind, tmp_path):
    _check_against_one_process(_run_two_ranks(kind, tmp_path))


@pytest.fixture
def one_rank_group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_wrapping_before_compiling_raises_a_clear_error(one_rank_group):
    from torch.nn.parallel import DistributedDataParallel

    x = _data()[0]
    with pytest.raises((fxremat.TraceError, TypeError)):
        fxremat.compile(DistributedDataParallel(_net()), "min", example_inputs=(x,), cost_model="flops")
    if not _fsdp2_available():
        return
    from torch.distributed.fsdp import fully_shard

    model = _net()
    fully_shard(model)
    with pytest.raises(TypeError, match="compile first, then shard"):
        fxremat.compile(model, "min", example_inputs=(x,), cost_model="flops")
