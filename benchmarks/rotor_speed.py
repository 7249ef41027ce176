"""Time the rotor DP (fxremat.solvers.rotor.solve_rotor): the compiled kernel or the reference.

The paper's largest case is ResNet-1001: a chain of 339 stages with S = 500 slots (its C code
took < 20 s). By default this times ``solve_rotor`` (the DP table from the compiled kernel
``fxremat._dp.rotor_table``, then the reconstruction) on a random chain of that size with a
budget of a quarter of its store-all memory, ``--repeats`` times, and prints each time and the
median. ``--impl reference`` times the pure-Python reference instead: on chains of increasing
length, it fits time ∝ L^k and runs the full size only if the fit predicts it finishes within
``--max-seconds``; otherwise it prints the extrapolation. It prints only; no result files.

Usage: ``python benchmarks/rotor_speed.py [--impl compiled|reference] [--stages 339]
[--slots 500] [--repeats 5] [--max-seconds 180]``
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from fxremat import _kernels
from fxremat.solvers.rotor import ChainCosts, solve_rotor


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


def time_solve(n_stages: int, slots: int, budget_fraction: float = 0.25) -> float:
    """Wall seconds of one solve_rotor call with a budget of ``budget_fraction`` of store-all."""
    costs = random_chain(n_stages)
    store_all_bytes = costs.wa[0] + sum(costs.wabar) + costs.wa[-1] + max(costs.of + costs.ob)
    start = time.perf_counter()
    schedule = solve_rotor(costs, int(budget_fraction * store_all_bytes), slots=slots)
    seconds = time.perf_counter() - start
    if schedule is None:
        raise RuntimeError(f"no schedule for L={n_stages} S={slots}; raise budget_fraction")
    return seconds


def fit_exponent(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(time) against log(L)."""
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def run_compiled(args: argparse.Namespace) -> None:
    times = [time_solve(args.stages, args.slots) for _ in range(args.repeats)]
    shown = " ".join(f"{t:.2f}" for t in times)
    print(f"solve_rotor (compiled) L={args.stages} S={args.slots}: runs {shown} s; "
          f"median {statistics.median(times):.2f} s")


def run_reference(args: argparse.Namespace) -> None:
    points = []
    for n in (50, 100, 150):
        seconds = time_solve(n, args.slots)
        points.append((n, seconds))
        print(f"solve_rotor (reference) L={n:4d} S={args.slots}: {seconds:8.2f} s")
    k = fit_exponent(points)
    n_last, t_last = points[-1]
    predicted = t_last * (args.stages / n_last) ** k
    print(f"observed time ~ L^{k:.2f} at fixed S (the DP is O(L^3 S) in the worst case)")
    print(f"predicted L={args.stages} S={args.slots}: {predicted:.0f} s")
    if predicted <= args.max_seconds:
        print(f"measured  L={args.stages} S={args.slots}: {time_solve(args.stages, args.slots):.1f} s")
    else:
        print(f"not run: prediction exceeds --max-seconds {args.max_seconds:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=("compiled", "reference"), default="compiled")
    parser.add_argument("--stages", type=int, default=339)
    parser.add_argument("--slots", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5, help="compiled: runs to take the median of")
    parser.add_argument("--max-seconds", type=float, default=180.0, help="reference: longest run to try")
    args = parser.parse_args()
    if args.impl == "compiled":
        with _kernels.use("cython"):  # raises, naming the build command, if fxremat._dp is not built
            run_compiled(args)
    else:
        with _kernels.use("python"):
            run_reference(args)


if __name__ == "__main__":
    main()
