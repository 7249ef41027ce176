"""Side-by-side benchmarks: ``python -m benchmarks.run [--quick|--full] [--out DIR]``.

Two scales, every row measured the same way in the same run:

1. Paper scale, memory only, on fake tensors (Kusumoto et al. Table 1 settings): plain PyTorch,
   hand-placed per-block checkpoints, fxremat at ``budget="min"`` (auto and approximate DP); the
   peaks are measured with :func:`fxremat.measure_peak` while the models really run forward and
   backward on fake tensors. The paper's numbers are printed beside them.
2. Real steps on this machine (small inputs): step time vs measured peak for plain, hand
   per-block checkpoints, ``checkpoint_sequential`` (chain nets, every segment count from 2 to
   2√L), fxremat at several budgets and torch.compile's ``activation_memory_budget`` swept over
   fractions (its partitioned graphs replayed under the same tracker: ``compile_budget.py``).
   Step times are medians of interleaved repeats, each timed after an untimed step of the same
   variant, on one torch thread with glibc keeping freed memory (:func:`caching_heap`), reported
   as ratios to plain measured in the same loop. Rockmate, when ``--rockmate-python`` names an
   interpreter where it is installed, is tried on the U-Net at half the plain peak in a child
   process with a time limit.

Writes ``paper_scale.md`` (``paper_scale_quick.md`` with ``--quick``: U-Net and PSPNet only, so a
quick run leaves the full table alone), ``cpu_tradeoff.md`` and ``cpu_tradeoff_<net>.png`` (with
matplotlib) into ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

import fxremat

from . import compile_budget
from .baselines import SequentialCheckpoint, checkpoint_blocks, rockmate_rows, rockmate_table
from .harness import (GIB, MIB, add_machine_options, load_average, loss_of, plot, set_up_machine, step, timed_step,
                      with_grads)
from .nets import cpu_nets, pspnet, unet

QUICK_FRACTIONS = (1.0, 0.5, 0.3, 0.1, 0.0)
# Kusumoto et al. Table 1 (GB, parameters included): vanilla, best of their DP columns, Chen's.
PAPER = {
    "pspnet": (9.4, 2.7, 4.0), "pspnet101": (9.4, 2.7, 4.0), "unet": (9.1, 4.7, 7.4), "resnet50": (8.9, 3.4, 3.7),
    "resnet152": (9.2, 2.3, 2.4), "vgg19": (7.0, 4.5, 4.7), "densenet161": (8.5, 1.6, 1.8),
    "googlenet": (8.5, 5.2, 6.5),
}


def _torchvision(name, **kwargs):
    import torchvision

    return lambda **extra: getattr(torchvision.models, name)(**kwargs, **extra)


def paper_nets(include_zoo: bool):
    nets = [("unet", lambda: unet.build_model("paper"), unet.PAPER_INPUT),
            ("pspnet", lambda: pspnet.build_model("paper"), pspnet.PAPER_INPUT)]
    if not include_zoo:
        return nets
    # Zhao et al.'s ResNet-101 backbone: 373 nodes, the paper's PSPNet has 385
    nets.append(("pspnet101", lambda: pspnet.PSPNet(layers=(3, 4, 23, 3)), pspnet.PAPER_INPUT))
    try:
        import torchvision  # noqa: F401
    except ImportError:
        print("torchvision not installed: paper-scale rows for the torchvision nets are skipped")
        return nets
    return nets + [
        ("resnet50", _torchvision("resnet50"), (96, 3, 224, 224)),
        ("resnet152", _torchvision("resnet152"), (48, 3, 224, 224)),
        ("vgg19", _torchvision("vgg19"), (64, 3, 224, 224)),
        ("densenet161", _torchvision("densenet161"), (32, 3, 224, 224)),
        ("googlenet", _torchvision("googlenet", aux_logits=False, init_weights=False), (256, 3, 224, 224)),
    ]


def _fake_peak(model, x) -> int:
    with_grads(model)
    return fxremat.measure_peak(step, model, x)[1]


def paper_row(name, build, shape) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    row = {"net": name, "input": "x".join(map(str, shape))}
    with FakeTensorMode():
        x = torch.randn(*shape)
        model = build()
        row["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        row["plain"] = _fake_peak(model, x)
        if name.startswith("densenet"):  # its layers read a list that grows: use torchvision's own
            hand, row["hand_blocks"] = build(memory_efficient=True), "memory_efficient"
        else:
            hand = build()
            row["hand_blocks"] = checkpoint_blocks(hand, extra=_hand_extra(name, hand))
        row["hand"] = _fake_peak(hand, x)
        for key, strategy in (("auto", "auto"), ("approx", "approx")):
            start = time.perf_counter()
            compiled = fxremat.compile(build(), "min", example_inputs=(x,), cost_model="flops", strategy=strategy,
                                       exact_cap=50_000)
            row[f"{key}_compile_s"] = time.perf_counter() - start
            row[key] = _fake_peak(compiled, x)
            row[f"{key}_plan"] = compiled.plan
    return row


def _hand_extra(name, model):
    """Blocks that are not classes of their own: U-Net's conv pairs (one per level)."""
    if name == "unet":
        return tuple(f"down.{i}" for i in range(len(model.down))) + ("bottleneck",)
    return ()


def _red(value, base) -> str:
    return f"{value / GIB:.2f} ({100 * (value / base - 1):+.0f}%)"


def paper_table(rows) -> str:
    head = ("| net | input | plain act. GiB | hand per-block GiB | fxremat min GiB (strategy) | "
            "fxremat approx min GiB | predicted vs measured | solve s | paper vanilla → best GB (Chen) | "
            "ours with params+grads GiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        plan = r["auto_plan"]
        err = 100 * (plan.predicted_peak_bytes / r["auto"] - 1)
        vanilla, best, chen = PAPER.get(r["net"], (None, None, None))
        paper = f"{vanilla} → {best} ({100 * (best / vanilla - 1):+.0f}%), Chen {chen}" if vanilla else "n/a"
        total = r["auto"] + 2 * r["param_bytes"]
        total_base = r["plain"] + 2 * r["param_bytes"]
        lines.append(
            f"| {r['net']} | {r['input']} | {r['plain'] / GIB:.2f} | {_red(r['hand'], r['plain'])} "
            f"[{r['hand_blocks']}] | {_red(r['auto'], r['plain'])} ({plan.strategy}, "
            f"{plan.num_lower_sets} sets) | {_red(r['approx'], r['plain'])} | {err:+.1f}% | "
            f"{plan.solve_seconds:.2f} | {paper} | {_red(total, total_base)} |"
        )
    return "\n".join(lines)


def _variants(name, build, x, chain: bool, budgets, fractions):
    torch.manual_seed(0)
    base = build("small").to(x.device)
    variants = [("plain", "plain", copy.deepcopy(base))]
    hand = copy.deepcopy(base)
    checkpoint_blocks(hand)
    variants.append(("hand per-block", "hand", hand))
    if chain:
        for k in SequentialCheckpoint.segment_counts(len(base)):
            variants.append((f"sequential {k}", "sequential", SequentialCheckpoint(copy.deepcopy(base), k)))
    for budget in budgets:
        try:
            compiled = fxremat.compile(copy.deepcopy(base), budget, example_inputs=(x,))
        except fxremat.InfeasibleBudgetError as err:
            print(f"{name}: budget {budget} infeasible (min {err.min_feasible_bytes / MIB:.1f} MiB), row skipped")
            continue
        variants.append((f"fxremat {budget}", "fxremat", compiled))
    variants += compile_budget.variants(base, x, step, loss_of, fractions)  # its sweep, one row per partition
    return variants


def cpu_rows(name, build, shape, chain, budgets, repeats, fractions=compile_budget.FRACTIONS, device="cpu"):
    x = torch.randn(*shape, device=device)
    variants = _variants(name, build, x, chain, budgets, fractions)
    peaks, times = {}, {label: [] for label, _, _ in variants}
    for label, _, model in variants:
        with_grads(model)
        step(model, x)  # warm-up
        peaks[label] = fxremat.measure_peak(step, model, x)[1]
    for _ in range(repeats):  # interleaved, so machine noise hits every variant alike
        for label, _, model in variants:
            times[label].append(timed_step(model, x))
    plain_t = statistics.median(times["plain"])
    rows = []
    for label, family, model in variants:
        plan = getattr(model, "plan", None) if isinstance(model, fxremat.RematModule) else None
        rows.append({"net": name, "variant": label, "family": family, "peak": peaks[label],
                     "ratio": statistics.median(times[label]) / plain_t, "plan": plan,
                     "plain_peak": peaks["plain"], "step_s": statistics.median(times[label]), "model": model})
    return rows


def cpu_table(rows) -> str:
    lines = ["| net | variant | measured peak MiB | vs plain | step time / plain | predicted peak (err) | "
             "predicted overhead | solve s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plan = r["plan"]
        pred = (f"{plan.predicted_peak_bytes / MIB:.1f} ({100 * (plan.predicted_peak_bytes / r['peak'] - 1):+.1f}%)"
                if plan else "")
        extra = f"{100 * plan.predicted_overhead:.0f}% | {plan.solve_seconds:.3f}" if plan else " | "
        lines.append(f"| {r['net']} | {r['variant']} | {r['peak'] / MIB:.1f} | "
                     f"{100 * (r['peak'] / r['plain_peak'] - 1):+.0f}% | {r['ratio']:.3f} | {pred} | {extra} |")
    return "\n".join(lines)


TRADEOFF_STYLES = (("fxremat", "o-"), ("sequential", "s--"), (compile_budget.FAMILY, "d:"), ("hand", "^"),
                   ("plain", "*"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores (default)")
    mode.add_argument("--full", action="store_true", help="torchvision nets at paper scale, larger CPU inputs")
    parser.add_argument("--only", choices=("paper", "cpu"), help="run one of the two scales")
    parser.add_argument("--rockmate-python", default=sys.executable,
                        help="interpreter with rockmate and rkgb installed (a venv of its own)")
    parser.add_argument("--rockmate-timeout", type=float, default=None, help="seconds per Rockmate solve")
    add_machine_options(parser)
    args = parser.parse_args(argv)
    machine = set_up_machine(parser, args, "benchmarks.run")
    out, env = machine.out, machine.environment()
    if args.only in (None, "paper"):
        rows = [paper_row(*net) for net in paper_nets(include_zoo=args.full)]
        text = f"# Paper scale (fake tensors)\n\n{env}\n\n{paper_table(rows)}\n"
        (out / ("paper_scale.md" if args.full else "paper_scale_quick.md")).write_text(text)
        print(text)
    if args.only in (None, "cpu"):
        budgets = ["min", 0.3, 0.5, 0.7] if not args.full else ["min", 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.85]
        repeats = 5 if not args.full else 15
        # --quick sweeps torch.compile's budget over fewer fractions: each one compiles again
        fractions = compile_budget.FRACTIONS if args.full else QUICK_FRACTIONS
        load_before = load_average()
        memory = ("Memory columns are exact (live-storage tracker)." if machine.device == "cpu" else
                  "Measured peaks are `torch.cuda.max_memory_allocated` during a step above what was allocated "
                  "before it (cuDNN and cuBLAS workspaces included; the plan counts them: `AllocatorPeak`).")

        def write(all_rows, rockmate) -> str:
            noise = (f"{memory} Step times are medians of {repeats} interleaved "
                     f"repeats, each right after an untimed step of the same variant (`timed_step`), on a shared "
                     f"machine, load average {load_before} before and {load_average()} after this section on "
                     f"{os.cpu_count()} cores: noisy (two runs of one comparison differed by up to 15% here), compare "
                     f"ratios within one net only.")
            text = (f"# Real steps on {machine.device.upper()}\n\n{env}\n\n{noise}\n\n{cpu_table(all_rows)}\n\n"
                    f"{compile_budget.describe(all_rows)}\n## Rockmate (optional; `--rockmate-python`)\n\n"
                    f"{rockmate_table(rockmate) if rockmate else 'not run yet'}\n")
            (out / "cpu_tradeoff.md").write_text(text)  # after each net, so a run cut short keeps its rows
            return text

        all_rows = []
        for name, build, shape, chain in cpu_nets(args.full):
            rows = cpu_rows(name, build, machine.shape(shape), chain, budgets, repeats, fractions, machine.device)
            plot(rows, out / f"cpu_tradeoff_{name}.png", TRADEOFF_STYLES)
            all_rows += rows
            print(cpu_table(rows), flush=True)
            write(all_rows, None)
        rockmate = rockmate_rows(args.rockmate_python, timeout_s=args.rockmate_timeout or (1800 if args.full else 120))
        print(write(all_rows, rockmate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
