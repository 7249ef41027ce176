"""Parameter gradients in the memory model (issue 12, items 2-4): parameters read by
``call_function`` nodes (``F.linear(x, self.weight)``, ``torch.addmm`` as in GPT-2's Conv1D,
RMSNorm's ``self.weight * x``), tied weights (embedding = LM head), leaf modules with many
parameters. Every peak here is measured (``fxremat.measure_peak``) in the steady state where
``.grad`` exists, and compared with the plan's prediction and budget."""

from __future__ import annotations

import contextlib
import operator
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxremat
from fxremat import api
from fxremat.core import Schedule
from fxremat.measure import default_loss
from fxremat.passes.capture import capture_call
from fxremat.passes.lower import build_graph
from fxremat.passes.profile import profile
from fxremat.passes.rewrite import rewrite
from fxremat.passes.trace import trace
from fxremat.simulate import simulate
from _models import loss_of as _loss
from _models import with_grads


def _measured(model, x):
    with_grads(model)
    _loss(model(x)).backward()
    return fxremat.measure_peak(lambda: _loss(model(x)).backward())[1]


class FunctionalLinear(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i) / i**0.5)
        self.bias = nn.Parameter(torch.zeros(o))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Conv1D(nn.Module):
    """GPT-2's: ``torch.addmm`` with the weight stored transposed."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(i, o) / i**0.5)
        self.bias = nn.Parameter(torch.zeros(o))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class TransposedLinear(nn.Module):
    """``x @ self.weight.t()``: the matrix product reads a view of the parameter, not the parameter."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i) / i**0.5)

    def forward(self, x):
        return x @ self.weight.t()


class WSConv(nn.Conv2d):
    """timm's weight-standardized convolution (NFNets): the weight goes through ``F.batch_norm``
    as a reshaped view, and the result takes its shape back with ``reshape_as(self.weight)``."""

    def forward(self, x):
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True,
                         momentum=0.0, eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


def _ws_net():
    return nn.Sequential(WSConv(3, 64, 3, padding=1), nn.ReLU(), WSConv(64, 64, 3, padding=1), nn.ReLU(),
                         WSConv(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, 10))


class GRN(nn.Module):
    """ConvNeXt-V2's global response normalization around an MLP: ``w * (h * n) + b + h`` with
    ``w``, ``b`` parameters broadcast over the batch. The add of ``b`` was taken to allocate its
    other input's gradient (a broadcast add reduces the gradient, but only into ``b``'s)."""

    def __init__(self, c=64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.w, self.b = nn.Parameter(torch.zeros(1, 1, 1, 4 * c)), nn.Parameter(torch.zeros(1, 1, 1, 4 * c))

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        g = torch.linalg.vector_norm(h, ord=2, dim=(1, 2), keepdim=True)
        h = self.w * (h * (g / (g.mean(dim=-1, keepdim=True) + 1e-6))) + self.b + h
        return x + self.fc2(h)


class ScaledSlice(nn.Module):
    """An in-place write into a slice (Funnel's attention: ``score[..., :n].mul_(mask)``): the
    write's autograd node leads into the history of the slice's base, and every parameter before
    it was counted as the write's own (+18.8% on Funnel's plain peak)."""

    def __init__(self, d=256):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        v = h[..., : x.shape[-1]]
        v.mul_(torch.sigmoid(x))
        return self.c(v)


class MaskedScores(nn.Module):
    """Attention-like scores masked in place through a slice, and read through the slice after
    (Funnel's ``positional_attn[..., :context_len]`` then ``positional_attn *= cls_mask``): with
    ``mul_`` whose result is dropped, or with ``*=``. The write's backward (``CopySlices``) makes
    gradients the size of the slice's base; it went uncounted (plain -12.5%, "min" 1.33x)."""

    def __init__(self, d=64, blocks=4, augmented=False):
        super().__init__()
        self.augmented = augmented
        self.r = nn.ModuleList(nn.Linear(d, 2 * d) for _ in range(blocks))
        self.o = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))
        self.register_buffer("mask", (torch.arange(d) % 5 != 0).float())

    def forward(self, x):
        b, s, d = x.shape
        for r, o in zip(self.r, self.o):
            att = r(x).reshape(b, s, 2 * d)[..., :d]
            if self.augmented:
                att *= self.mask
            else:
                att.mul_(self.mask)
            x = o(att.softmax(-1) * x) + x
        return x


class MaskedScoreSum(nn.Module):
    """Funnel's relative attention as Hugging Face writes it: the positional scores are masked in
    place through a slice of their base (``positional_attn *= cls_mask``, a mask made in the
    forward, which the write saves), then added to the content scores made before them (an add:
    it saves nothing and hands both inputs its own gradient). Its forward takes ``*args``, so it
    is captured with torch.export. The write's backward (``CopySlices``) drops that gradient once
    the view's backward has spread it over the base, while the content scores' backward still
    holds it; and it makes the base-sized gradients before its own backward unpacks the mask, so
    in a recomputed segment whose recomputation that unpack starts, the recomputation runs beside
    them (Funnel at "min": 1.25x its budget)."""

    def __init__(self, d=64, blocks=3):
        super().__init__()
        self.q = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))
        self.r = nn.ModuleList(nn.Linear(d, 2 * d) for _ in range(blocks))
        self.o = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))

    def forward(self, *args):
        (x,) = args
        b, s, d = x.shape
        mask = F.pad(x.new_ones(s, d - 1), (1, 0))
        for q, r, o in zip(self.q, self.r, self.o):
            content = q(x)
            positional = r(x)[..., :d]
            positional *= mask
            x = o((content + positional).softmax(-1) * x) + x
        return x


def _mlp(layer, width=512, depth=4):
    torch.manual_seed(0)
    mods = []
    for _ in range(depth):
        mods += [RMSNorm(width), layer(width, width), nn.GELU()]
    return nn.Sequential(*mods)


@pytest.mark.parametrize("layer", [FunctionalLinear, Conv1D], ids=["F.linear", "addmm"])
def test_parameters_read_by_functions_are_counted(layer):
    x = torch.randn(4, 16, 512)
    model = _mlp(layer)
    plain = _measured(model, x)
    for budget in (0.6, "min"):
        remat = fxremat.compile(model, budget, example_inputs=(x,), cost_model="flops")
        # never below what is measured (the budget holds); at most one activation above (before:
        # the parameters' gradients were missing, 4.75x over the budget at "min")
        assert 1.0 <= remat.plan.baseline_peak_bytes / plain <= 1.05
        assert _measured(remat, x) <= 1.05 * remat.plan.budget_bytes


class LM(nn.Module):
    def __init__(self, tied, vocab=4096, dim=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(dim, 4 * dim), nn.GELU(),
                                                                   nn.Linear(4 * dim, dim))])
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


def test_tied_weights_hold_the_head_gradient_until_the_embedding():
    """The LM head's weight gradient (the size of the embedding) lives in the accumulation
    buffer through the whole backward: the tied model's plain peak is far above the untied
    one's, and the prediction must not fall below what is measured."""
    ids = torch.randint(0, 4096, (2, 16))
    peaks = {}
    for tied in (False, True):
        torch.manual_seed(0)
        model = LM(tied)
        peaks[tied] = _measured(model, ids)
        for budget in (1.0, "min"):
            remat = fxremat.compile(model, budget, example_inputs=(ids,), cost_model="flops")
            measured = _measured(remat, ids)
            assert measured <= 1.05 * remat.plan.budget_bytes
            assert remat.plan.baseline_peak_bytes >= peaks[tied]
    assert peaks[True] > peaks[False] + 4096 * 64 * 4  # the held gradient is real


class Block(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.a, self.b = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.b(F.gelu(self.a(x)))


@pytest.mark.parametrize("leaves", [(), ("0", "1", "2")], ids=["traced", "leaves"])
def test_leaf_modules_gradients_are_not_all_counted_at_once(leaves):
    """A leaf's parameters' gradients are accumulated into .grad one by one in training; the
    profiler must not hold them all (plain peak was predicted 6.6x too high)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(3)))
    x = torch.randn(2, 8, 256)
    plain = _measured(model, x)
    plan = fxremat.plan(model, 1.0, example_inputs=(x,), cost_model="flops", leaf_modules=leaves)
    assert 1.0 <= plan.baseline_peak_bytes / plain <= 1.03  # was 6.6x with leaves


class TwoBranches(nn.Module):
    """A value read by two branches whose second gradient arrives with a weight gradient."""

    def __init__(self, c=256, o=64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        self.cbr = nn.Conv2d(c, o, 1)
        self.scale = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, o, 1), nn.Sigmoid())

    def forward(self, x):
        high = self.stem(x)
        return (self.cbr(high) * self.scale(high)).permute(0, 2, 3, 1)


def test_second_gradient_with_weight_gradient_stays_within_budget():
    torch.manual_seed(0)
    model, x = TwoBranches(), torch.randn(2, 3, 8, 8)
    plain = _measured(model, x)
    for budget in (1.0, "min"):
        remat = fxremat.compile(model, budget, example_inputs=(x,), cost_model="flops")
        assert remat.plan.baseline_peak_bytes >= plain
        assert _measured(remat, x) <= 1.05 * remat.plan.budget_bytes


def _measured_holding_output(model, x):
    """The plain step with the output held until the backward returns (as the simulator takes
    it: a caller may keep it), so the prediction can be compared byte for byte."""
    def step():
        out = model(x)
        _loss(out).backward()
        return out

    with_grads(model)
    step()
    return fxremat.measure_peak(step)[1]


class Twice(nn.Module):
    """One module called twice: its weight's two gradients meet in the accumulation buffer."""

    def __init__(self, d=256):
        super().__init__()
        self.shared = nn.Linear(d, d)
        self.mid = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return self.shared(self.mid(self.shared(x)))


class LocalHeld(nn.Module):
    """A Python local holds a value past its last use until forward returns (``feats``, as the
    loop variable of smp's UNet++ decoder): the graph frees it there, eager does not, and the
    plain peak was predicted -23.5%."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(16, 8, 3, padding=1)
        self.c3, self.c4 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        h = self.c1(x)
        feats = torch.cat([h, h], dim=1)
        y = self.c2(torch.cat([feats[:, :8], feats[:, 8:]], dim=1).relu())
        return self.c4(F.relu(self.c3(F.relu(y))))


class DroppedAttention(nn.Module):
    """Attention with dropout, as data2vec-audio's (on the CPU the math path: its probabilities,
    their dropout mask and the dropped probabilities are saved). Each autograd node of its
    backward lets go of what it saved as it returns, and the largest buffers come after; counted
    on top of them all, the plain peak was over-predicted by 18% (data2vec-audio +3.1%)."""

    def __init__(self, d=64, h=4, p=0.1):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.h, self.p = h, p

    def forward(self, x):
        b, n, d = x.shape
        split = lambda t: t.view(b, n, self.h, d // self.h).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)),
                                           dropout_p=self.p if self.training else 0.0)
        return self.o(y.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("make,x", [
    (lambda: LM(True), torch.randint(0, 4096, (2, 16))),
    (Twice, torch.randn(2, 8, 256)),
    (TwoBranches, torch.randn(2, 3, 8, 8)),
    (lambda: _mlp(FunctionalLinear), torch.randn(4, 16, 512)),
    # a view of a parameter was counted as the parameter by every node reading it: +50% and +60%
    (lambda: _mlp(TransposedLinear), torch.randn(4, 16, 512)),
    (_ws_net, torch.randn(2, 3, 16, 16)),
    (lambda: nn.Sequential(*[GRN() for _ in range(3)]), torch.randn(2, 8, 8, 64)),
    (MaskedScores, torch.randn(8, 128, 64)),
    (lambda: MaskedScores(augmented=True), torch.randn(8, 128, 64)),
    # the write's backward let go of a gradient the add's other input still held: -6.6%
    (MaskedScoreSum, torch.randn(8, 128, 64)),
    (LocalHeld, torch.randn(2, 8, 64, 64)),
    (DroppedAttention, torch.randn(2, 128, 64)),
], ids=["tied", "called-twice", "two-branches", "F.linear", "weight.t()", "weight-standardized", "broadcast-bias",
        "write-into-slice", "augmented-write-into-slice", "captured-write-into-slice-then-add", "python-local",
        "attention-dropout"])
def test_plain_peak_predicted_within_two_percent(make, x):
    torch.manual_seed(0)
    model = make()
    measured = _measured_holding_output(model, x)
    plan = fxremat.plan(model, 1.0, example_inputs=(x,), cost_model="flops")
    # byte for byte but the loss's own scalar (8 B)
    assert abs(plan.baseline_peak_bytes - measured) <= 0.02 * measured, (plan.baseline_peak_bytes, measured)
    for budget in (1.0, "min"):
        remat = fxremat.compile(model, budget, example_inputs=(x,), cost_model="flops")
        assert _measured_holding_output(remat, x) <= 1.05 * remat.plan.budget_bytes


class FusedQKVAttention(nn.Module):
    """One projection makes the queries, keys and values (timm's ViT, nanoGPT), split as a tensor
    unpacked (``q, k, v = qkv``), with ``qkv.unbind(0)``, or indexed (``qkv[0], qkv[1], qkv[2]``)."""

    def __init__(self, split):
        super().__init__()
        self.split = split
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv(x).view(b, n, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        if self.split == "unpack":
            q, k, v = qkv
        elif self.split == "unbind":
            q, k, v = qkv.unbind(0)
        else:
            q, k, v = qkv[0], qkv[1], qkv[2]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("split", ["unpack", "unbind", "index"])
def test_a_fused_qkv_split_is_traced_and_planned_as_eager_runs_it(split):
    """Eager unpacks a tensor by iterating it, one ``unbind(0)`` whose backward is one ``stack``;
    torch.fx recorded three selects, whose backwards each made a zero gradient of all of ``qkv``:
    compiled at budget 1.0 the step measured 1.08x eager's peak, and the plain peak was predicted
    1.08x too. Indexing (``qkv[0]``) is three selects in eager too, and stays so."""
    torch.manual_seed(0)
    model, x = FusedQKVAttention(split), torch.randn(2, 32, 32)
    plain = FusedQKVAttention(split)
    plain.load_state_dict(model.state_dict())
    selects = [n for n in trace(model).graph.nodes if n.target is operator.getitem and n.args[0].target == "permute"]
    assert len(selects) == (3 if split == "index" else 0)  # (items of an unbind's tuple are no selects)
    remat = fxremat.compile(model, 1.0, example_inputs=(x,), cost_model="flops")
    eager = _measured_holding_output(plain, x)
    assert abs(remat.plan.baseline_peak_bytes - eager) <= 0.02 * eager, (remat.plan.baseline_peak_bytes, eager)
    assert _measured_holding_output(remat, x) <= 1.02 * eager
    assert torch.equal(remat(x), plain(x))
    for (name, p), q in zip(plain.named_parameters(), remat.parameters()):
        assert torch.equal(p.grad, q.grad), name


class HookedMLP(nn.Module):
    """Residual MLP blocks whose weights outweigh their activations."""

    def __init__(self, d=128, n=2):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                     for _ in range(n)])
        self.ln = nn.ModuleList([nn.LayerNorm(d) for _ in range(n)])

    def forward(self, x):
        for ln, block in zip(self.ln, self.blocks):
            x = x + block(ln(x))
        return x


def _hooked_mlp(hook: str) -> HookedMLP:
    from torch.nn.utils import prune

    torch.manual_seed(0)
    model = HookedMLP()
    for block in model.blocks:
        for linear in (block[0], block[2]):
            if hook == "prune":
                prune.l1_unstructured(linear, "weight", 0.5)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # deprecated for the parametrizations
                    getattr(torch.nn.utils, hook)(linear)
    return model


@pytest.mark.parametrize("hook", ["prune", "weight_norm", "spectral_norm"])
def test_a_weight_made_by_a_forward_pre_hook_is_held_by_its_module(hook):
    """``torch.nn.utils.prune`` and the hook-based ``weight_norm`` and ``spectral_norm`` set
    ``module.weight`` at every call, from ``weight_orig``: the module holds it until its next call,
    across the step's end and while its recomputation makes another, and its gradient goes through
    the hook's ops after the Linear's backward let go of its input. Counted only as a buffer the
    Linear saves, "min" measured 1.34x its budget on a bigger MLP, and the plain peak +8%."""
    x = torch.randn(2, 16, 128)
    model = _hooked_mlp(hook)
    measured = _measured_holding_output(model, x)
    plan = fxremat.plan(model, 1.0, example_inputs=(x,), cost_model="flops")
    assert abs(plan.baseline_peak_bytes - measured) <= 0.01 * measured, (plan.baseline_peak_bytes, measured)
    remat = fxremat.compile(_hooked_mlp(hook), "min", example_inputs=(x,), cost_model="flops")
    assert remat.plan.recomputed_nodes
    peak = _measured_holding_output(remat, x)
    assert peak <= 1.01 * remat.plan.budget_bytes, (peak, remat.plan.budget_bytes)
    assert abs(remat.plan.predicted_peak_bytes - peak) <= 0.01 * peak, (remat.plan.predicted_peak_bytes, peak)
    grads = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, remat.parameters()))


def test_a_hook_weights_backward_tail_does_not_hold_the_input_again():
    """The hook-based ``weight_norm``'s backward peaks in its head, the Linear's own backward, beside
    the input it saved; its tail (the weight's gradient through the norm) comes after the Linear let
    go of that input. The inputs a backward lets go before its peak are taken at the head's peak:
    taken at the tail's, the input was held again beside the head (another node saves it too, the
    tanh before), and the plain peak was predicted +12%."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for the parametrizations
        layers = [m for _ in range(2) for m in (torch.nn.utils.weight_norm(nn.Linear(64, 64)), nn.Tanh())]
    model, x = nn.Sequential(*layers, nn.Linear(64, 10)), torch.randn(96, 64)
    measured = _measured_holding_output(model, x)
    predicted = fxremat.plan(model, 1.0, example_inputs=(x,), cost_model="flops").baseline_peak_bytes
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


class Flows(nn.Module):
    """Several outputs, as RAFT's flow at each refinement step (two channels: a cross-entropy's
    class-index target is as large as its flow), and tokens (OWL-ViT, MaskFormer, SAM)."""

    def __init__(self, c=16, steps=4):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.flows = nn.ModuleList(nn.Conv2d(c, 2, 3, padding=1) for _ in range(steps))
        self.refines = nn.ModuleList(nn.Conv2d(c + 2, c, 3, padding=1) for _ in range(steps))

    def forward(self, x):
        h, flows = self.stem(x).relu(), []
        for flow, refine in zip(self.flows, self.refines):
            f = flow(h)
            flows.append(f)
            h = refine(torch.cat([h, f], 1)).relu()
        return flows, h.flatten(2).transpose(1, 2)


class WideMlp(nn.Module):
    """HF ViT's MLP under bf16 autocast, its weights large against its activations (few tokens)."""

    def __init__(self, d=128):
        super().__init__()
        self.block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(x + self.block(x)).float()


def _plain_peaks(model, x, amp: bool) -> tuple[int, int]:
    """``(predicted, measured)`` plain peak of ``model`` on ``x``, the forward and the loss (a
    cross-entropy per output, ``fxremat.measure.default_loss``) under bf16 autocast with ``amp``,
    the output held until the backward returns."""
    region = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if amp else contextlib.nullcontext

    def step():
        with region():
            out = model(x)
            loss = default_loss(out)
        loss.backward()  # (out of the region, as training does: autocast's cache is gone)
        return out

    with_grads(model)
    step()
    measured = fxremat.measure_peak(step)[1]
    with region():
        predicted = fxremat.plan(model, 1.0, example_inputs=(x,), cost_model="flops").baseline_peak_bytes
    return predicted, measured


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_loss_over_several_outputs_is_predicted_byte_for_byte(amp):
    """A cross-entropy per output, summed: autograd runs the parts' backwards one at a time, the
    last output's first, so the loss never holds two buffers of every output at once (the plain
    peak of OWL-ViT's nine outputs was over-predicted by 5.6%), but the parts still to run hold
    their class-index targets (RAFT's twelve flows: -2.6% without them). Under autocast the loss
    computes in float32 beside the bf16 outputs (counted in bf16: -18.9% here)."""
    torch.manual_seed(0)
    predicted, measured = _plain_peaks(Flows(), torch.randn(2, 3, 32, 32), amp)
    # to the byte but the loss's own scalars
    assert measured - 64 <= predicted <= measured + 0.002 * measured, (predicted, measured)


def test_a_linear_under_autocast_lets_its_input_go_before_its_peak():
    """Under bf16 autocast a linear layer's backward peaks while its weight's bf16 gradient is
    copied to float32 (ToCopyBackward), after its matrix products have let go of the bf16 input
    they saved (the GELU's output, which nothing else holds): held through that copy, the plain
    peak was over-predicted by 9.4% here (HF ViT: +2.5%)."""
    torch.manual_seed(0)
    predicted, measured = _plain_peaks(WideMlp(), torch.randn(2, 32, 128), amp=True)
    assert measured - 64 <= predicted <= measured + 0.002 * measured, (predicted, measured)


class DiceTrained(nn.Module):
    """A segmentation net that returns its Dice loss (softmax, one-hot target, per-class sums, as
    segmentation_models_pytorch's DiceLoss): the way to put a loss other than cross-entropy in
    the plan. A sum's backward hands on an expand of its incoming gradient, not a new buffer; the
    plain peak was over-predicted by 7.1%, so "min" bought less than it could."""

    def __init__(self, c=8, k=4):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                                 nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, k, 1))

    def forward(self, x, mask):
        logits = self.net(x)
        bs, k = logits.shape[:2]
        p = logits.log_softmax(dim=1).exp().view(bs, k, -1)
        t = F.one_hot(mask.view(bs, -1), k).permute(0, 2, 1)
        inter, card = (p * t).sum(dim=(0, 2)), (p + t).sum(dim=(0, 2))
        return (1 - 2 * inter / card.clamp_min(1e-7)).mean()


def test_a_loss_returned_by_the_model_is_planned_byte_for_byte():
    torch.manual_seed(0)
    x, mask = torch.randn(2, 3, 64, 64), torch.randint(0, 4, (2, 64, 64))

    def peak(model):
        with_grads(model)
        model(x, mask).backward()
        return fxremat.measure_peak(lambda: model(x, mask).backward())[1]

    model = DiceTrained()
    measured = peak(model)
    plan = fxremat.plan(model, 1.0, example_inputs=(x, mask), cost_model="flops")
    assert abs(plan.baseline_peak_bytes - measured) <= 0.02 * measured, (plan.baseline_peak_bytes, measured)
    remat = fxremat.compile(model, "min", example_inputs=(x, mask), cost_model="flops")
    assert peak(remat) <= 1.05 * remat.plan.budget_bytes
    assert remat.plan.budget_bytes <= 0.5 * measured


def test_a_recomputation_that_a_write_into_a_slice_starts_runs_beside_its_gradients():
    """Every block cut right after its scores' sum, so that in each recomputed segment the write's
    backward (``CopySlices``) is the first to unpack a saved tensor, after it made the base-sized
    gradients: the emitted graph's measured peak is the simulated one (it was 1.21x: the
    simulator recomputed first and ran the write's backward after), and it trains as the plain
    model does, whose own peak is predicted too."""
    torch.manual_seed(0)
    model, x = MaskedScoreSum(), torch.randn(8, 128, 64)
    captured = capture_call(model, (x,), {})
    gm, inputs = captured.graph_module, captured.inputs((x,), {})
    graph = build_graph(gm, profile(gm, inputs, cost_model="flops"))
    writes = {n.name for n in gm.graph.nodes if n.target is torch.ops.aten.mul_.Tensor}
    sums = [v for v in range(graph.n) if any(graph.names[p] in writes for p in graph.preds[v])]
    assert len(sums) == 3
    cuts = [0, *(v + 1 for v in sums), graph.n]
    segments = tuple(tuple(range(a, b)) for a, b in zip(cuts, cuts[1:]))
    recomputed = (True, True, True, False)
    emitted = rewrite(gm, [[graph.names[v] for v in seg] for seg in segments], list(recomputed), {})

    def step(fn):
        def run():  # the output held until the backward returns, as the simulator takes it
            out = fn()
            _loss(out).backward()
            return out

        with_grads(model)
        out = run()
        grads = [p.grad.clone() for p in model.parameters()]
        return fxremat.measure_peak(run)[1], out, grads

    plain_peak, plain_out, plain_grads = step(lambda: model(x))
    peak, out, grads = step(lambda: emitted(*inputs)[0])
    assert torch.equal(out, plain_out) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    predicted = simulate(graph, Schedule(segments, recomputed))
    assert predicted <= peak <= 1.02 * predicted, (peak, predicted)
    assert abs(simulate(graph, Schedule.plain(graph.n)) - plain_peak) <= 0.02 * plain_peak



def test_profiling_leaves_the_models_grads_alone():
    """The leaf backward is measured on stand-ins: the model's own .grad is not touched."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(2)))
    x = torch.randn(2, 8, 256)
    _loss(model(x)).backward()
    before = [p.grad.clone() for p in model.parameters()]
    fxremat.plan(model, 1.0, example_inputs=(x,), cost_model="flops", leaf_modules=("0",))
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))


class AuxLoss(nn.Module):
    """A segmentation net that computes its loss in forward, adding an auxiliary head's loss in
    place (``loss += 0.4 * aux_loss``, as Hugging Face's UperNet), and returns ``(loss, logits)``.
    Its forward takes ``*args``, as Hugging Face's decorated ones: captured with torch.export,
    where ``+=`` is the in-place ``add_`` it is in eager (torch.fx makes it a new ``add``)."""

    def __init__(self, c=16):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU())
        self.head, self.aux = nn.Conv2d(c, 4, 1), nn.Conv2d(c, 4, 1)

    def forward(self, *args):
        x, labels = args
        h = self.body(x)
        logits = F.interpolate(self.head(h), scale_factor=2.0, mode="bilinear")
        loss = F.cross_entropy(logits, labels)
        loss += 0.4 * F.cross_entropy(F.interpolate(self.aux(h), scale_factor=2.0, mode="bilinear"), labels)
        return loss, logits


def test_a_loss_added_to_in_place_in_forward_is_where_the_backward_starts():
    """The backward was taken to start at the loss's first node, the write of ``+=`` left out, so
    the auxiliary branch got no gradient in the prediction: plain peak -6% (one logits map), the
    compiled one over its budget."""
    torch.manual_seed(0)
    model, x, labels = AuxLoss(), torch.randn(2, 3, 32, 32), torch.randint(0, 4, (2, 64, 64))

    def measured(m):
        def step():
            out = m(x, labels)
            out[0].backward()
            return out

        with_grads(m)
        step()
        return fxremat.measure_peak(step)[1]

    plan = fxremat.plan(model, 1.0, example_inputs=(x, labels), cost_model="flops")
    plain = measured(model)
    assert abs(plan.baseline_peak_bytes - plain) <= 0.02 * plain, (plan.baseline_peak_bytes, plain)
    remat = fxremat.compile(model, "min", example_inputs=(x, labels), cost_model="flops")
    assert measured(remat) <= 1.05 * remat.plan.budget_bytes


def test_an_in_place_write_into_a_slice_reads_no_parameter():
    """Its gradient goes to the slice's base, not to the parameters before it: counted as read by
    it too, ``a``'s and ``b``'s weights were shared parameters whose gradients the prediction
    held from the write's backward to their own."""
    x = torch.randn(4, 16, 256)
    model = ScaledSlice()
    graph = api.cost_graph(model, example_inputs=(x,), cost_model="flops")
    assert graph.shared_params == ()
    plan = fxremat.plan(model, 1.0, example_inputs=(x,), cost_model="flops")
    measured = _measured_holding_output(model, x)
    assert abs(plan.baseline_peak_bytes - measured) <= 0.02 * measured, (plan.baseline_peak_bytes, measured)
