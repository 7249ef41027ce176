"""Models users bring: timm, Hugging Face transformers and torchvision segmentation nets, built
from configs (no weights, no network), trained beside a plain twin.

For every case and budget (0.5 of the plain peak, and "min"):
- compiling leaves ``state_dict()`` bitwise unchanged;
- two SGD steps: outputs (the loss and every output tensor), gradients, parameters after the
  steps and **every buffer** bitwise equal to the plain model's (CPU);
- the measured peak of a step is at most 1.05x the plan's budget;
- the plain peak predicted (``baseline_peak_bytes``) within 2% of the measured one;
- ``"min"`` lowers the measured peak by at least 10% (40% on transformers at seq >= 128).

Optional: each case skips without its library (``pip install -e ".[real]"``: timm, transformers;
timm needs torchvision, so install ``torch==2.14.1 torchvision==0.29.1`` first, see the README).
By default a quick subset runs (what CI runs, seconds per case); ``FXREMAT_REAL=all`` runs every
case. The README's real-model table comes from :func:`check` (``python tests/test_real_models.py``
prints it).
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

import fxremat

pytestmark = pytest.mark.real

PEAK_SLACK = 1.05
BASELINE_TOLERANCE = 0.02


@dataclass(frozen=True)
class Case:
    """A model users train: ``build()`` returns the model, ``inputs()`` its ``(args, kwargs)``."""

    name: str
    family: str  # a key of _LIBRARY: "timm", "transformers", "torchvision", "smp" or "diffusers"
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], tuple[tuple, dict]]
    quick: bool = False
    long_sequence: bool = False  # a transformer at seq >= 128: "min" must save >= 40%


def _needs(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# -- timm ------------------------------------------------------------------------------------

def _timm(name: str, size: int = 64, **kwargs):
    def build():
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10, **kwargs)

    def inputs():
        return (torch.randn(2, 3, size, size),), {}

    return build, inputs


# -- Hugging Face transformers ---------------------------------------------------------------

def _hf_lm(config_name: str, model_name: str, *, seq: int = 32, vocab: int = 512, labels: bool = True,
           mask: bool = True, **config):
    def build():
        import transformers

        cfg = getattr(transformers, config_name)(vocab_size=vocab, **config)
        return getattr(transformers, model_name)(cfg)

    def inputs():
        ids = torch.randint(0, vocab, (2, seq))
        kwargs = {"input_ids": ids}
        if mask:
            m = torch.ones(2, seq, dtype=torch.long)
            m[1, seq // 2:] = 0  # one padded sequence: the mask matters
            kwargs["attention_mask"] = m
        if labels:
            kwargs["labels"] = ids.clone()
        return (), kwargs

    return build, inputs


def _hf_t5(seq: int = 32, vocab: int = 512):
    def build():
        import transformers

        cfg = transformers.T5Config(vocab_size=vocab, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                    num_heads=4, decoder_start_token_id=0)
        return transformers.T5ForConditionalGeneration(cfg)

    def inputs():
        ids = torch.randint(0, vocab, (2, seq))
        return (), {"input_ids": ids, "attention_mask": torch.ones(2, seq, dtype=torch.long),
                    "labels": torch.randint(0, vocab, (2, seq // 2))}

    return build, inputs


def _hf_vit(size: int = 32):
    def build():
        import transformers

        cfg = transformers.ViTConfig(image_size=size, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128, num_labels=10)
        return transformers.ViTForImageClassification(cfg)

    def inputs():
        return (), {"pixel_values": torch.randn(2, 3, size, size), "labels": torch.randint(0, 10, (2,))}

    return build, inputs


def _image_inputs(size: int, labels):
    """``pixel_values`` of a batch of 2 and ``labels(size)``."""
    def inputs():
        return (), {"pixel_values": torch.randn(2, 3, size, size), "labels": labels(size)}

    return inputs


def _hf_image(config_name: str, model_name: str, *, size: int, labels, **config):
    """A Hugging Face vision model from a tiny config."""
    def build():
        import transformers

        return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))

    return build, _image_inputs(size, labels)


def _hf_upernet(size: int = 64):
    """UperNet on a ConvNeXt backbone with its auxiliary head: ``loss += 0.4 * auxiliary_loss``."""
    def build():
        import transformers

        backbone = transformers.ConvNextConfig(num_stages=4, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1],
                                               out_features=["stage1", "stage2", "stage3", "stage4"])
        cfg = transformers.UperNetConfig(backbone_config=backbone, hidden_size=32, auxiliary_in_channels=32,
                                         auxiliary_channels=16, num_labels=4, use_auxiliary_head=True)
        return transformers.UperNetForSemanticSegmentation(cfg)

    return build, _image_inputs(size, lambda s: torch.randint(0, 4, (2, s, s)))


_GPT2 = dict(n_layer=2, n_embd=64, n_head=4, n_positions=256)
_BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=256)
_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=True)

_GQA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=256)


def _hf_whisper():
    def build():
        import transformers

        cfg = transformers.WhisperConfig(
            vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
            max_source_positions=16, max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=3, suppress_tokens=None, begin_suppress_tokens=None)
        return transformers.WhisperForConditionalGeneration(cfg)

    def inputs():
        return (), {"input_features": torch.randn(2, 80, 32), "labels": torch.randint(4, 512, (2, 16))}

    return build, inputs


def _hf_clip():
    def build():
        import transformers

        cfg = transformers.CLIPConfig(
            text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2),
            vision_config=dict(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4),
            projection_dim=32)
        return transformers.CLIPModel(cfg)

    def inputs():
        ids = torch.randint(3, 512, (2, 32))
        ids[:, -1] = 2  # the end-of-text token, whose state is the text's embedding
        return (), {"input_ids": ids, "attention_mask": torch.ones(2, 32, dtype=torch.long),
                    "pixel_values": torch.randn(2, 3, 32, 32), "return_loss": True}

    return build, inputs


# -- torchvision segmentation ----------------------------------------------------------------

def _segmentation(name: str, size: int = 64, **kwargs):
    def build():
        from torchvision.models import segmentation

        return getattr(segmentation, name)(weights=None, weights_backbone=None, num_classes=4, **kwargs)

    def inputs():
        return (torch.randn(2, 3, size, size),), {}

    return build, inputs


def _smp(arch: str, size: int = 64):
    """A segmentation_models_pytorch net on a ResNet-18 encoder."""
    def build():
        import segmentation_models_pytorch as smp

        return getattr(smp, arch)(encoder_name="resnet18", encoder_weights=None, classes=4)

    def inputs():
        return (torch.randn(2, 3, size, size),), {}

    return build, inputs


def _diffusers_unet(conditioned: bool = False):
    """A diffusers denoising U-Net from a tiny config (``forward(sample, timestep[, encoder_hidden_states])``)."""
    def build():
        import diffusers

        if conditioned:
            return diffusers.UNet2DConditionModel(
                sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                norm_num_groups=8, cross_attention_dim=32, attention_head_dim=8,
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
        return diffusers.UNet2DModel(
            sample_size=32, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            norm_num_groups=8)

    def inputs():
        if conditioned:
            return (torch.randn(2, 4, 16, 16), torch.tensor([10, 500]), torch.randn(2, 7, 32)), {}
        return (torch.randn(2, 3, 32, 32), torch.tensor([10, 500])), {}

    return build, inputs


def _cases() -> list[Case]:
    cases = []
    add = lambda name, family, pair, **kw: cases.append(Case(name, family, *pair, **kw))  # noqa: E731
    add("gpt2", "transformers", _hf_lm("GPT2Config", "GPT2LMHeadModel", **_GPT2), quick=True)
    add("llama-tied", "transformers", _hf_lm("LlamaConfig", "LlamaForCausalLM", **_LLAMA))
    add("bert-mlm", "transformers", _hf_lm("BertConfig", "BertForMaskedLM", **_BERT), quick=True)
    add("t5", "transformers", _hf_t5())
    add("deberta-v2-mlm", "transformers", _hf_lm("DebertaV2Config", "DebertaV2ForMaskedLM", **_BERT))  # loss built in forward
    add("bloom", "transformers", _hf_lm("BloomConfig", "BloomForCausalLM", hidden_size=64, n_layer=2, n_head=4))  # GELU as an autograd.Function
    add("vit-hf", "transformers", _hf_vit(), quick=True)
    add("convnextv2-hf", "transformers", _hf_image(  # GRN: parameters broadcast in adds
        "ConvNextV2Config", "ConvNextV2ForImageClassification", size=32, labels=lambda s: torch.randint(0, 10, (2,)),
        num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10, drop_path_rate=0.1))
    add("upernet-convnext", "transformers", _hf_upernet())  # the loss added to in place
    add("qwen2-gqa", "transformers", _hf_lm("Qwen2Config", "Qwen2ForCausalLM", **_GQA))  # padded: see test_capture_leaves
    add("gemma2-sliding", "transformers", _hf_lm("Gemma2Config", "Gemma2ForCausalLM", head_dim=16, sliding_window=8,
                                                 pad_token_id=0, bos_token_id=2, eos_token_id=1, **_GQA))
    add("albert-shared", "transformers", _hf_lm(  # four layers, one layer's weights
        "AlbertConfig", "AlbertForMaskedLM", embedding_size=32, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, intermediate_size=128, max_position_embeddings=256, pad_token_id=0, bos_token_id=2,
        eos_token_id=3))
    add("whisper", "transformers", _hf_whisper())
    add("clip", "transformers", _hf_clip())  # two towers, a contrastive loss
    add("segformer-hf", "transformers", _hf_image(
        "SegformerConfig", "SegformerForSemanticSegmentation", size=64, labels=lambda s: torch.randint(0, 4, (2, s, s)),
        num_encoder_blocks=2, hidden_sizes=[16, 32], depths=[1, 1], sr_ratios=[2, 1], num_attention_heads=[1, 2],
        patch_sizes=[7, 3], strides=[4, 2], decoder_hidden_size=32, num_labels=4))
    add("mamba", "transformers", _hf_lm("MambaConfig", "MambaForCausalLM", hidden_size=64, num_hidden_layers=2,
                                        state_size=8, mask=False))  # the selective scan's Python loop
    add("gpt2-seq128", "transformers", _hf_lm("GPT2Config", "GPT2LMHeadModel", seq=128, **_GPT2),
        long_sequence=True)
    add("llama-seq128", "transformers", _hf_lm("LlamaConfig", "LlamaForCausalLM", seq=128, **_LLAMA),
        long_sequence=True)
    add("resnet18-droppath", "timm", _timm("resnet18", drop_path_rate=0.1), quick=True)
    add("efficientnet_b0", "timm", _timm("efficientnet_b0"), quick=True)
    add("resnet50-droppath", "timm", _timm("resnet50", drop_path_rate=0.1))
    add("convnext_atto", "timm", _timm("convnext_atto"))
    add("mobilenetv3_small_100", "timm", _timm("mobilenetv3_small_100"))
    add("regnety_002", "timm", _timm("regnety_002"))
    add("densenet121", "timm", _timm("densenet121"))
    add("vit_tiny", "timm", _timm("vit_tiny_patch16_224", size=32, img_size=32))
    add("swin_tiny", "timm", _timm("swin_tiny_patch4_window7_224", size=224))
    add("nfnet_l0", "timm", _timm("nfnet_l0"))  # weight-standardized convolutions: views of parameters
    add("crossvit_tiny", "timm", _timm("crossvit_tiny_240", size=240))  # a shape check in the top-level forward
    add("coatnet_nano_rw", "timm", _timm("coatnet_nano_rw_224", img_size=64))  # a view read after its base's readers
    add("gcvit_xxtiny", "timm", _timm("gcvit_xxtiny", img_size=64))  # the same with a view of a view
    add("hiera_tiny", "timm", _timm("hiera_tiny_224", img_size=64))  # forward(x, mask=None)
    add("maxvit_nano", "timm", _timm("maxvit_nano_rw_256", img_size=64, drop_path_rate=0.1))
    add("levit_128s", "timm", _timm("levit_128s", img_size=64))  # attention biases indexed by a buffer
    add("sequencer2d_s", "timm", _timm("sequencer2d_s", img_size=64))  # bidirectional LSTMs
    add("volo_d1", "timm", _timm("volo_d1_224", img_size=64, drop_path_rate=0.1))  # outlook attention: fold/unfold
    add("smp-unet", "smp", _smp("Unet"))  # a shape check in the top-level forward: captured
    add("smp-upernet", "smp", _smp("UPerNet"))
    add("unet2d", "diffusers", _diffusers_unet())  # a timestep tensor beside the sample
    add("unet2d-condition", "diffusers", _diffusers_unet(conditioned=True))  # cross-attention
    add("lraspp_mobilenet_v3", "torchvision", _segmentation("lraspp_mobilenet_v3_large"), quick=True)
    add("deeplabv3_mobilenet_v3", "torchvision", _segmentation("deeplabv3_mobilenet_v3_large"))
    add("fcn_resnet50", "torchvision", _segmentation("fcn_resnet50"))
    return cases


_LIBRARY = {"timm": "timm", "transformers": "transformers", "torchvision": "torchvision",
            "smp": "segmentation_models_pytorch", "diffusers": "diffusers"}


def selected_cases() -> list[Case]:
    everything = os.environ.get("FXREMAT_REAL") == "all"
    return [c for c in _cases() if everything or c.quick]


# -- one training step -----------------------------------------------------------------------

def _loss(out) -> torch.Tensor:
    """The model's own loss (Hugging Face outputs with labels), else a cross-entropy of every
    floating output with a class dimension (logits, segmentation maps, auxiliary heads)."""
    loss = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else None
    if loss is not None:
        return loss
    parts = []
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point() and t.dim() >= 2:
            target = torch.zeros(t.shape[0], *t.shape[2:], dtype=torch.long)
            parts.append(F.cross_entropy(t, target))
    return sum(parts[1:], parts[0])


def _outputs(out) -> list[torch.Tensor]:
    if hasattr(out, "to_tuple"):  # a ModelOutput: its set fields, in order
        out = out.to_tuple()
    return [t.detach() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _step(model, args, kwargs, optimizer=None):
    torch.manual_seed(1)  # the same dropout masks and drop-path draws in both models
    out = model(*args, **kwargs)
    _loss(out).backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return _outputs(out)


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_bitwise(name: str, plain, compiled, outs_a, outs_b) -> None:
    assert len(outs_a) == len(outs_b), f"{name}: {len(outs_a)} outputs plain, {len(outs_b)} compiled"
    for i, (a, b) in enumerate(zip(outs_a, outs_b)):
        assert torch.equal(a, b), f"{name}: output {i} differs (max {(a - b).abs().max().item():.3g})"
    for (pname, p), q in zip(plain.named_parameters(), compiled.parameters()):
        assert torch.equal(p, q), f"{name}: parameter {pname} differs"
        assert (p.grad is None) == (q.grad is None), f"{name}: gradient of {pname}: one is None"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{name}: gradient of {pname} differs"
    for (bname, a), b in zip(plain.named_buffers(), compiled.buffers()):
        assert torch.equal(a, b), f"{name}: buffer {bname} differs"


def _compiled(model, budget, args, kwargs):
    """Compile as a user would, with the example inputs: positional ones as a tuple, keyword
    ones (input_ids=, labels=, ...) as a dict."""
    assert not (args and kwargs), "a case takes positional or keyword inputs, not both"
    return fxremat.compile(model, budget, example_inputs=kwargs or args, cost_model="flops")


def check(case: Case, budget) -> dict:
    """Compile ``case`` at ``budget``, train two steps beside its plain twin, compare, measure."""
    start = time.perf_counter()
    torch.manual_seed(0)
    model = case.build().train()
    plain = copy.deepcopy(model)
    args, kwargs = case.inputs()
    before = _state(model)
    least = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiled = _compiled(model, budget, args, kwargs)
        except fxremat.InfeasibleBudgetError as exc:
            # The error's minimum must be honest: that budget then compiles and holds (±5%).
            least = exc.min_feasible_bytes
            compiled = _compiled(model, least, args, kwargs)
        solve = time.perf_counter() - start
        for key, value in _state(model).items():
            assert torch.equal(value, before[key]), f"{case.name}: compiling changed {key}"
        opt_a = torch.optim.SGD(plain.parameters(), lr=0.05)
        opt_b = torch.optim.SGD(compiled.parameters(), lr=0.05)
        # Step 1 plans (when no example inputs were given) and allocates every .grad; the
        # optimizers zero them in place, so step 2's peak is the activation peak.
        outs_a = _step(plain, args, kwargs, opt_a)
        outs_b = _step(compiled, args, kwargs, opt_b)
        _assert_bitwise(case.name, plain, compiled, outs_a, outs_b)
        outs_a, plain_peak = fxremat.measure_peak(_step, plain, args, kwargs)
        outs_b, peak = fxremat.measure_peak(_step, compiled, args, kwargs)
        _assert_bitwise(case.name, plain, compiled, outs_a, outs_b)
    plan = compiled.plan
    leaves = [str(w.message) for w in caught if "leaf" in str(w.message)]
    return {
        "name": case.name, "family": case.family, "budget": budget, "plain_peak": plain_peak,
        "peak": peak, "budget_bytes": plan.budget_bytes, "baseline_bytes": plan.baseline_peak_bytes,
        "predicted_bytes": plan.predicted_peak_bytes, "strategy": plan.strategy, "nodes": plan.num_nodes,
        "recomputed": sum(s.recomputed for s in plan.segments), "solve_seconds": plan.solve_seconds,
        "compile_seconds": solve, "seconds": time.perf_counter() - start, "leaves": leaves,
        "least_feasible": least,
    }


def _assert_targets(case: Case, row: dict) -> None:
    name = f"{case.name} at {row['budget']}"
    assert row["peak"] <= PEAK_SLACK * row["budget_bytes"], (
        f"{name}: measured peak {row['peak']} B is over 1.05x the budget {row['budget_bytes']} B")
    if row["least_feasible"] is not None:
        ratio = row["peak"] / row["least_feasible"]
        assert 0.95 <= ratio <= 1.05, (
            f"{name}: InfeasibleBudgetError named {row['least_feasible']} B as the least feasible budget, "
            f"which then measured {row['peak']} B ({ratio - 1:+.1%})")
    error = row["baseline_bytes"] / row["plain_peak"] - 1
    assert abs(error) <= BASELINE_TOLERANCE, (
        f"{name}: plain peak predicted {row['baseline_bytes']} B, measured {row['plain_peak']} B ({error:+.1%})")
    if row["budget"] == "min":
        saving = 1 - row["peak"] / row["plain_peak"]
        least = 0.40 if case.long_sequence else 0.10
        assert saving >= least, f"{name}: 'min' saves {saving:.1%} of the plain peak, expected >= {least:.0%}"


@pytest.fixture(autouse=True)
def _collect_garbage():
    yield
    gc.collect()


@pytest.mark.parametrize("budget", [0.5, "min"], ids=["0.5", "min"])
@pytest.mark.parametrize("case", selected_cases(), ids=lambda c: c.name)
def test_real_model_trains_exactly_within_budget(case, budget):
    if not _needs(_LIBRARY[case.family]):
        pytest.skip(f"{case.family} is not installed (pip install -e '.[real]')")
    torch.set_num_threads(1)
    _assert_targets(case, check(case, budget))


def _table(rows: list[dict]) -> str:
    mib = 2 ** 20
    lines = ["| model | budget | plain MiB | predicted plain | compiled MiB | budget MiB | strategy | nodes | "
             "recomputed segs | solve s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['budget'] if r['least_feasible'] is None else 'least ' + str(r['least_feasible'])} | {r['plain_peak'] / mib:.2f} | {r['baseline_bytes'] / r['plain_peak'] - 1:+.1%} "
            f"| {r['peak'] / mib:.2f} ({r['peak'] / r['plain_peak'] - 1:+.0%}) | {r['budget_bytes'] / mib:.2f} "
            f"| {r['strategy']} | {r['nodes']} | {r['recomputed']} | {r['solve_seconds']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python tests/test_real_models.py [names...]: print the README table
    torch.set_num_threads(1)
    wanted = set(sys.argv[1:])
    rows = []
    for case in _cases():
        if (wanted and case.name not in wanted) or not _needs(_LIBRARY[case.family]):
            continue
        for budget in (0.5, "min"):
            try:
                row = check(case, budget)
                _assert_targets(case, row)
                row["ok"] = "yes"
            except Exception as exc:  # noqa: BLE001 - a report: every failure is printed, none hidden
                print(f"FAIL {case.name} {budget}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            rows.append(row)
            print(_table([row]).splitlines()[-1], flush=True)
    print(_table(rows))
