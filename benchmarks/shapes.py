"""Changing input shapes: a small transformer trained on 10 cycling sequence lengths (issue 13, item 4).

More distinct lengths than ``max_plans`` (default 8) used to replan on every step. Now the sizes
of one graph share a segmentation (re-checked by simulation per size). This harness warms up on
every length once (planning), then times rounds of the 10 lengths in a cycle against the same
steps with the shape fixed (the step after one of the same shape), interleaved, and
measures each length's peak against its plan's budget. It writes ``shapes.md``.

    python -m benchmarks.shapes [--rounds 3] [--budget 0.5]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxremat

from .harness import add_machine_options, set_up_machine

LENGTHS = tuple(range(16, 161, 16))  # 10 lengths
VOCAB = 1000


class SmallLM(nn.Module):
    def __init__(self, d=128, layers=4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
                                    for _ in range(layers))
        self.out = nn.Linear(d, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def step(model, ids):
    out = model(ids)
    F.cross_entropy(out.flatten(0, 1), ids.flatten()).backward()


def timed(model, ids) -> float:
    start = time.perf_counter()
    step(model, ids)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--batch", type=int, default=8)
    add_machine_options(parser)
    args = parser.parse_args(argv)
    out = set_up_machine(parser, args, "benchmarks.shapes").out
    torch.manual_seed(0)
    model = SmallLM()
    plain = copy.deepcopy(model)
    compiled = fxremat.compile(model, args.budget)
    inputs = {n: torch.randint(0, VOCAB, (args.batch, n)) for n in LENGTHS}

    start = time.perf_counter()
    for n in LENGTHS:  # warm-up: plans every length
        step(compiled, inputs[n])
    warm = time.perf_counter() - start

    rows = []
    for n in LENGTHS:
        plan = compiled._prepare((inputs[n],))[0]
        _, peak = fxremat.measure_peak(step, compiled, inputs[n])
        rows.append([n, plan.strategy, plan.budget_bytes, peak, 0.0, 0.0, 0.0])
    # Rounds interleave the variants, so drift on a shared machine hits them alike: a cycle over
    # the lengths (each step after a different shape), then per length an untimed step and a
    # timed one of the same shape (fixed), then the plain model the same way.
    for _ in range(args.rounds):
        for i, n in enumerate(LENGTHS):
            rows[i][4] += timed(compiled, inputs[n])
        for i, n in enumerate(LENGTHS):
            timed(compiled, inputs[n])
            rows[i][5] += timed(compiled, inputs[n])
            timed(plain, inputs[n])
            rows[i][6] += timed(plain, inputs[n])
    total_cyc, total_fixed, total_plain = (sum(r[k] for r in rows) for k in (4, 5, 6))
    over = [r for r in rows if r[3] > 1.05 * r[2]]

    lines = [
        "# Changing input shapes (benchmarks/shapes.py)", "",
        f"SmallLM (d=128, 4 encoder layers, vocab {VOCAB}), batch {args.batch}, lengths {LENGTHS[0]}..{LENGTHS[-1]} "
        f"({len(LENGTHS)} lengths, max_plans=8), budget {args.budget} of each length's baseline, "
        f"cost_model measured, {args.rounds} rounds, device {args.device}, {args.threads} thread(s).", "",
        f"Warm-up (first step of every length, planning included): {warm:.2f} s.", "",
        f"**Cycling / fixed shape: {total_cyc / total_fixed:.3f}x** (cycling {total_cyc:.3f} s, fixed "
        f"{total_fixed:.3f} s, plain {total_plain:.3f} s, summed over all steps). Lengths over 1.05x their "
        f"budget: {len(over)}.", "",
        "| length | strategy | budget MiB | measured peak MiB | peak / budget | cycling s | fixed s | plain s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, strat, budget, peak, cyc, fixed, pl in rows:
        lines.append(f"| {n} | {strat} | {budget / 2**20:.2f} | {peak / 2**20:.2f} | {peak / budget:.3f} | "
                     f"{cyc:.3f} | {fixed:.3f} | {pl:.3f} |")
    text = "\n".join(lines) + "\n"
    (out / "shapes.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
