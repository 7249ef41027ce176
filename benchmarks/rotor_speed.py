"""Time the pure-Python rotor DP table (fxremat.solvers.rotor.rotor_table).

The paper's largest case is ResNet-1001: a chain of 339 stages with S = 500 slots (its C code
took < 20 s). This script times ``rotor_table`` on random chains of increasing length, fits
time ∝ L^k, and runs the 339-stage chain itself only if the fit predicts it finishes within
``--max-seconds``; otherwise it prints the extrapolation. It prints only; no result files.

Usage: ``python benchmarks/rotor_speed.py [--stages 339] [--slots 500] [--max-seconds 180]``
"""

from __future__ import annotations

import argparse
import math
import random
import time

from fxremat.solvers.rotor import ChainCosts, rotor_table, to_slots


def random_chain(n_stages: int, seed: int = 0) -> ChainCosts:
    """ResNet-like chain: similar stages, activations of 1-32 MiB, ā 1-4 times the output."""
    rng = random.Random(seed)
    mib = 2**20
    wa = [rng.randint(1, 32) * mib for _ in range(n_stages + 1)]
    uf = [rng.uniform(1.0, 10.0) for _ in range(n_stages)]
    return ChainCosts(
        uf=uf, ub=[2 * u for u in uf], wa=wa,
        wabar=[wa[i + 1] * rng.randint(1, 4) for i in range(n_stages)],
        of=[rng.randint(0, 4) * mib for _ in range(n_stages)],
        ob=[rng.randint(0, 8) * mib for _ in range(n_stages)],
    )


def time_table(n_stages: int, slots: int, budget_fraction: float = 0.25) -> float:
    """Seconds for one rotor_table call with a budget of ``budget_fraction`` of store-all."""
    costs = random_chain(n_stages)
    store_all_bytes = costs.wa[0] + sum(costs.wabar) + costs.wa[-1] + max(costs.of + costs.ob)
    sl = to_slots(costs, int(budget_fraction * store_all_bytes), slots)
    start = time.perf_counter()
    rotor_table(list(sl.uf), list(sl.ub), list(sl.wa), list(sl.wabar), list(sl.of), list(sl.ob), slots)
    return time.perf_counter() - start


def fit_exponent(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(time) against log(L)."""
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=339)
    parser.add_argument("--slots", type=int, default=500)
    parser.add_argument("--max-seconds", type=float, default=180.0)
    args = parser.parse_args()

    points = []
    for n in (50, 100, 150):
        seconds = time_table(n, args.slots)
        points.append((n, seconds))
        print(f"rotor_table L={n:4d} S={args.slots}: {seconds:8.2f} s")
    k = fit_exponent(points)
    n_last, t_last = points[-1]
    predicted = t_last * (args.stages / n_last) ** k
    print(f"observed time ~ L^{k:.2f} at fixed S (the DP is O(L^3 S) in the worst case)")
    for s in (args.slots // 2, args.slots * 2):
        print(f"rotor_table L=50 S={s}: {time_table(50, s):8.2f} s (S scaling)")
    print(f"predicted L={args.stages} S={args.slots}: {predicted:.0f} s")
    if predicted <= args.max_seconds:
        print(f"measured  L={args.stages} S={args.slots}: {time_table(args.stages, args.slots):.1f} s")
    else:
        print(f"not run: prediction exceeds --max-seconds {args.max_seconds:.0f}")


if __name__ == "__main__":
    main()
