"""Chains, the setting of Beaumont et al.'s Figure 3: ``python -m benchmarks.chain [--quick] [--out DIR]``.

On a ResNet-style chain and a transformer stack (both ``nn.Sequential``), one process measures,
with the same training step and interleaved timing repeats:

- ``plain`` PyTorch;
- ``checkpoint_sequential`` with every segment count from 2 to 2√L (torch's own function);
- fxremat ``auto`` (what ``fxremat.compile`` does by default), ``rotor``, ``exact`` (Kusumoto),
  ``chen`` and ``hong`` at the measured peak of every ``checkpoint_sequential`` row (equal
  memory) and at ``budget="min"``, planned with ``--cost-model`` (default ``measured``, the
  default of ``fxremat.compile``: every compile times the nodes again).

Writes ``chain.md`` (table, and per sequential row the speed-up of the best fxremat plan that
peaks no higher) and ``chain_<net>.png`` (step time vs measured peak, a line per strategy, a
dot for plain) into ``--out`` (default ``benchmarks/results``). Also times the rotor DP on a
339-stage chain with 500 slots (ResNet-1001's length).
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
from fxremat.solvers.rotor import ChainCosts, solve_rotor

from .baselines import SequentialCheckpoint
from .nets import resnet_chain, resnet_stages, transformer_stack
from .harness import MIB, add_machine_options, load_average, plot, set_up_machine, step, timed_step, with_grads
STRATEGIES = ("auto", "rotor", "exact", "chen", "hong")
SUMMARY_FAMILIES = ("auto", "rotor", "exact")


def nets(quick: bool):
    depth = 12 if quick else 24
    return [
        ("resnet_chain", lambda: resnet_chain(depth=depth, channels=32), (8, 3, 48, 48)),
        ("resnet50_stages", lambda: resnet_stages(width=16 if quick else 32), (8, 3, 128, 128)),
        ("transformer", lambda: transformer_stack(depth=depth, dim=64, heads=4), (8, 128, 64)),
    ]


def _compile(base, budget, strategy, x, cost_model):
    try:
        return fxremat.compile(copy.deepcopy(base), budget, example_inputs=(x,), strategy=strategy,
                               cost_model=cost_model)
    except fxremat.InfeasibleBudgetError:
        return None


def variants(base, x):
    torch.manual_seed(0)
    out = [("plain", "plain", copy.deepcopy(base))]
    for k in SequentialCheckpoint.segment_counts(len(base)):
        out.append((f"sequential {k}", "sequential", SequentialCheckpoint(copy.deepcopy(base), k)))
    return out


def measure(models, x, repeats):
    peaks, times = {}, {label: [] for label, _, _ in models}
    for label, _, model in models:
        with_grads(model)
        step(model, x)  # warm-up
        peaks[label] = fxremat.measure_peak(step, model, x)[1]
    for _ in range(repeats):
        for label, _, model in models:
            times[label].append(timed_step(model, x, step))
    return peaks, {k: statistics.median(v) for k, v in times.items() if v}


def run_net(name, build, shape, repeats, cost_model="measured", device="cpu"):
    torch.manual_seed(0)
    base, x = build().to(device), torch.randn(*shape, device=device)
    models = variants(base, x)
    # fxremat at the peak of each checkpoint_sequential row (measured first, alone) and at min
    seq_peaks, _ = measure([m for m in models if m[1] == "sequential"], x, 0)
    budgets = sorted(set(seq_peaks.values())) + ["min"]
    for strategy in STRATEGIES:
        for budget in budgets:
            compiled = _compile(base, budget, strategy, x, cost_model)
            if compiled is not None:
                label = f"{strategy} {budget if budget == 'min' else f'{budget / MIB:.2f}MiB'}"
                models.append((label, strategy, compiled))
    peaks, times = measure(models, x, repeats)
    rows = []
    for label, family, model in models:
        plan = model.plan if isinstance(model, fxremat.RematModule) else None
        rows.append({"net": name, "variant": label, "family": family, "peak": peaks[label],
                     "time": times[label], "ratio": times[label] / times["plain"], "plan": plan,
                     "plain_peak": peaks["plain"]})
    return rows


def equal_memory(rows, family="rotor"):
    """Per sequential row: the fastest ``family`` row peaking no higher, and its speed-up."""
    out = []
    for s in (r for r in rows if r["family"] == "sequential"):
        fits = [r for r in rows if r["net"] == s["net"] and r["family"] == family and r["peak"] <= s["peak"]]
        if fits:
            best = min(fits, key=lambda r: r["time"])
            out.append((s, best, s["time"] / best["time"] - 1))
    return out


def table(rows) -> str:
    lines = ["| net | variant | measured peak MiB | vs plain | step time / plain | predicted peak (err) | "
             "predicted overhead | plan | solve s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plan = r["plan"]
        if plan:
            err = 100 * (plan.predicted_peak_bytes / r["peak"] - 1)
            nested = sum(1 for s in plan.segments if s.inner)
            extra = (f"{plan.predicted_peak_bytes / MIB:.2f} ({err:+.1f}%) | {100 * plan.predicted_overhead:.0f}% | "
                     f"{plan.strategy}, {sum(s.recomputed for s in plan.segments)} ck"
                     f"{f', {nested} nested' if nested else ''} | {plan.solve_seconds:.3f}")
        else:
            extra = " | | | "
        lines.append(f"| {r['net']} | {r['variant']} | {r['peak'] / MIB:.2f} | "
                     f"{100 * (r['peak'] / r['plain_peak'] - 1):+.0f}% | {r['ratio']:.3f} | {extra} |")
    return "\n".join(lines)


def summary(rows) -> str:
    """Per family, the equal-memory speed-ups, and the ceiling: what a plan that recomputes
    nothing at that peak would gain (the sequential row's own overhead)."""
    lines = ["| net | sequential row (peak MiB, time/plain) | fastest fxremat row within its peak | "
             "throughput gain | ceiling |", "|---|---|---|---|---|"]
    gains = {family: [] for family in SUMMARY_FAMILIES}
    for family in SUMMARY_FAMILIES:
        for s, best, gain in equal_memory(rows, family):
            gains[family].append(gain)
            lines.append(f"| {s['net']} | {s['variant']} ({s['peak'] / MIB:.2f}, {s['ratio']:.3f}) | {best['variant']} "
                         f"({best['peak'] / MIB:.2f}, {best['ratio']:.3f}) | {100 * gain:+.1f}% | "
                         f"{100 * (s['ratio'] - 1):+.1f}% |")
    head = ["Median throughput gain over checkpoint_sequential at equal memory, over the sequential rows of "
            "both nets that the family fits under:"]
    for family, found in gains.items():
        head.append(f"- {family}: {100 * statistics.median(found):+.1f}% ({len(found)} rows)" if found
                    else f"- {family}: no row fits a sequential row's peak")
    return "\n".join(head) + "\n\n" + "\n".join(lines)


STYLES = (("auto", "x-"), ("rotor", "o-"), ("exact", "D-"), ("chen", "v:"), ("hong", "P"), ("sequential", "s--"), ("plain", "*"))


def rotor_dp_seconds(stages=339, slots=500, repeats=3) -> float:
    """Median time of one rotor solve on a ResNet-1001-length chain with varied stage costs."""
    uf = [1 + (i * 7) % 5 for i in range(stages)]
    wa = [4 + (i * 3) % 7 for i in range(stages + 1)]
    costs = ChainCosts(uf=uf, ub=[2 * u for u in uf], wa=wa, wabar=[wa[i + 1] * 3 for i in range(stages)],
                       of=[1] * stages, ob=[2] * stages)
    memory = sum(costs.wa) // 3
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        solve_rotor(costs, memory, slots=slots)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="12-deep nets, fewer repeats")
    parser.add_argument("--cost-model", default="measured", choices=("measured", "flops"),
                        help="how fxremat costs the nodes (measured: timed on this machine, per compile)")
    add_machine_options(parser)
    args = parser.parse_args(argv)
    machine = set_up_machine(parser, args, "benchmarks.chain")
    out = machine.out
    repeats = 5 if args.quick else 11
    all_rows = []
    for name, build, shape in nets(args.quick):
        rows = run_net(name, build, shape, repeats, args.cost_model, machine.device)
        plot(rows, out / f"chain_{name}.png", STYLES)
        all_rows += rows
        print(table(rows))
    dp = rotor_dp_seconds()
    text = (f"# Chains: rotor vs checkpoint_sequential, Kusumoto, Chen, Hong ({machine.device.upper()})\n\n"
            f"{machine.environment()}\n\n"
            f"Step times are medians of {repeats} interleaved repeats, each right after an untimed step of the "
            f"same variant (`benchmarks.harness.timed_step`), as ratios to plain in the same "
            f"loop; peaks are measured (`fxremat.measure_peak`, gradients pre-allocated). fxremat rows "
            f"are planned ({args.cost_model} costs) at each checkpoint_sequential row's measured peak and at `min`. "
            f"The ceiling column is the gain of a plan as fast as plain within that peak: fxremat cannot beat "
            f"a sequential row by more. "
            f"Load average at the end: {load_average()} on {os.cpu_count()} cores (a shared machine: times are noisy).\n\n"
            f"## Equal memory\n\n{summary(all_rows)}\n\n## All rows\n\n{table(all_rows)}\n\n"
            f"## Rotor DP time\n\n339 stages, 500 slots: {dp:.2f} s (median of 3; target ≤ 2 s).\n")
    (out / "chain.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
