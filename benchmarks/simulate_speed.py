"""Time the memory simulator (:func:`fxremat.simulate.simulate`) on the schedules the planner
simulates, and the planner calls that make them.

Reads the graph fixtures in ``benchmarks/fixtures/`` (no torchvision needed). For each net it
records every schedule ``planner.choose`` simulates for ``budget="min"`` and for half the plain
peak, then times one simulation of each (median over ``--repeats`` rounds of all of them, per
simulation) and each ``choose`` call (median, on a fresh copy of the graph: nothing cached from
the round before). It checks that ``simulate(..., timeline=True)``'s peak is the peak alone.
Writes ``benchmarks/results/simulate_speed.md``. A benchmark, not a test: nothing fails on a
slow machine. ``--baseline DIR`` measures the fxremat of another checkout (its ``_dp`` built)
too, in a subprocess, net by net beside this one, on the same schedules (recorded with this
version), and checks that both simulate the same peaks.

Usage: ``python benchmarks/simulate_speed.py [--nets unet,resnet152] [--repeats 5] [--baseline DIR]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import subprocess
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")
RESULTS = os.path.join(HERE, "results", "simulate_speed.md")
NETS = ("unet", "pspnet", "resnet50", "resnet152", "vgg19", "densenet161", "googlenet", "inception_v3")


def recorded_schedules(graph, budgets) -> list:
    """Every schedule ``planner.choose`` simulates for each of ``budgets``, in order."""
    from fxremat import planner
    from fxremat.budget import parse_budget

    seen = []
    real = planner.simulate

    def recording(g, schedule, **kwargs):
        seen.append(schedule)
        return real(g, schedule, **kwargs)

    planner.simulate = recording
    try:
        for budget in budgets:
            planner.choose(dataclasses.replace(graph), parse_budget(budget), least_if_below=True)
    finally:
        planner.simulate = real
    return seen


def measure(net: str, repeats: int, schedules=None) -> dict:
    from fxremat import planner
    from fxremat.budget import parse_budget
    from fxremat.core import Schedule, load_graph
    from fxremat.simulate import simulate

    graph = load_graph(os.path.join(FIXTURES, f"{net}.json"))
    if schedules is None:
        schedules = recorded_schedules(graph, ("min", 0.5))
    else:  # (segments, recomputed, inner) from the other version: rebuilt with this one's classes
        def build(t):
            return None if t is None else Schedule(t[0], t[1], tuple(build(i) for i in t[2]))
        schedules = [build(t) for t in schedules]
    for schedule in schedules[:50]:
        peak, events = simulate(graph, schedule, timeline=True)
        assert simulate(graph, schedule) == peak == max(events), net
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for schedule in schedules:
            simulate(graph, schedule)
        rounds.append((time.perf_counter() - start) / len(schedules))
    choose = {}
    for label, budget in (("min", "min"), ("0.5", 0.5)):
        times = []
        for _ in range(max(1, repeats // 2)):
            fresh = dataclasses.replace(graph)
            start = time.perf_counter()
            planner.choose(fresh, parse_budget(budget), least_if_below=True)
            times.append(time.perf_counter() - start)
        choose[label] = statistics.median(times)
    return {"net": net, "nodes": graph.n, "schedules": len(schedules), "per_sim_ms": statistics.median(rounds) * 1e3,
            "choose_min_s": choose["min"], "choose_half_s": choose["0.5"],
            "peaks": [simulate(graph, schedule) for schedule in schedules]}


def _plain(schedule):
    return None if schedule is None else (schedule.segments, schedule.recomputed,
                                          tuple(_plain(i) for i in schedule.inner))


def baseline(directory: str, net: str, repeats: int, schedules: list) -> dict:
    """:func:`measure` run with the fxremat of ``directory``, in a subprocess."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(directory)}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", net, "--repeats", str(repeats)],
                          input=pickle.dumps([_plain(s) for s in schedules]), capture_output=True, env=env,
                          cwd=os.path.abspath(directory), check=True)
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", default=",".join(NETS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="another checkout's root, measured beside this one")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args.repeats, pickle.loads(sys.stdin.buffer.read()))))
        return
    rows = []
    for net in args.nets.split(","):
        from fxremat.core import load_graph

        schedules = recorded_schedules(load_graph(os.path.join(FIXTURES, f"{net}.json")), ("min", 0.5))
        base = baseline(args.baseline, net, args.repeats, schedules) if args.baseline else None
        row = measure(net, args.repeats)
        if base is not None:
            assert base["peaks"] == row["peaks"], f"{net}: the baseline simulates other peaks"
            row["base"] = base
        rows.append(row)
        print(f"{net:14s} {row['nodes']:4d} nodes {row['schedules']:5d} simulations: {row['per_sim_ms']:.3f} ms each"
              + (f" (baseline {base['per_sim_ms']:.3f})" if base else "")
              + f"; choose min {row['choose_min_s']:.2f} s, 0.5 {row['choose_half_s']:.2f} s", flush=True)
    try:
        load = "load average " + " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "load unknown"
    lines = [
        "# Memory simulator: time per simulation and per planner call",
        "",
        f"Generated by `python benchmarks/simulate_speed.py --repeats {args.repeats}` on {time.strftime('%Y-%m-%d')}: "
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()} ({load} at the end). "
        "Graphs: `benchmarks/fixtures/*.json`. *simulations*: the schedules `planner.choose` simulates for "
        "'min' and 0.5 (half the plain peak; the least peak where that is below it); *per simulation*: median over the rounds of the mean over them; "
        "*choose*: median wall time of one `planner.choose` on a fresh copy of the graph.",
        "",
    ]
    if args.baseline:
        lines[2] = lines[2].replace("`python benchmarks/simulate_speed.py", "`python benchmarks/simulate_speed.py "
                                    f"--baseline {args.baseline}")
        lines += [f"Baseline: {args.baseline} at commit {_commit(args.baseline)}, measured in a subprocess net by net "
                  f"just before this version ({_commit(HERE)}), on the same schedules; the same peaks (checked).", "",
                  "| net | nodes | simulations | per simulation ms, baseline | this | speed-up | choose('min') s, "
                  "baseline | this | choose(0.5) s, baseline | this |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['net']} | {r['nodes']} | {r['schedules']} | {r['base']['per_sim_ms']:.3f} | "
                  f"{r['per_sim_ms']:.3f} | {r['base']['per_sim_ms'] / r['per_sim_ms']:.2f}x | "
                  f"{r['base']['choose_min_s']:.2f} | {r['choose_min_s']:.2f} | {r['base']['choose_half_s']:.2f} | "
                  f"{r['choose_half_s']:.2f} |" for r in rows]
    else:
        lines += ["| net | nodes | simulations | per simulation ms | choose('min') s | choose(0.5) s |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['net']} | {r['nodes']} | {r['schedules']} | {r['per_sim_ms']:.3f} | {r['choose_min_s']:.2f} | "
                  f"{r['choose_half_s']:.2f} |" for r in rows]
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)


def _commit(path: str) -> str:
    done = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
