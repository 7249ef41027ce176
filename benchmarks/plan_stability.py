"""Plan stability: does the default cost model (``"measured"``) give the same plan run after run
on one machine (issue 15)? Each net and budget is planned in ``--runs`` fresh processes, one after
another; the table counts the distinct plans (segments and which are recomputed) and gives the
range of the predicted overhead.

Each pair is planned under two CPU allocator settings (``--heap``): glibc's ``default`` malloc,
which maps and unmaps large blocks and trims its heap (so a step pays page faults that vary with
the heap's history: three fresh processes measured the ResNet chain's forward at 84, 146 and
151 ms), and a ``kept`` heap (``GLIBC_TUNABLES`` raises the mmap threshold to 32 MiB and stops
trimming, as the timing benchmarks' ``caching_heap`` does and as a caching allocator behaves:
78-81 ms in three processes).

    PYTHONPATH=. python -m benchmarks.plan_stability            # writes benchmarks/results/plan_stability.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

import torch

from .harness import ROOT, load_average

BUDGETS = ("0.6", "0.4", "min")
KEPT_HEAP = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967295"


def _nets():
    from .nets import resnet_chain, transformer_stack
    from .nets import unet

    return {
        "resnet_chain16": (lambda: resnet_chain(depth=16), (4, 3, 64, 64)),
        "unet": (unet.build_model, (4, 3, 128, 128)),
        "transformer4": (lambda: transformer_stack(depth=4, dim=64, heads=4), (4, 128, 64)),
    }


def plan_once(net: str, budget: str) -> dict:
    """Plan ``net`` at ``budget`` in this process: the plan's fingerprint, strategy, overhead."""
    import fxremat

    torch.set_num_threads(1)
    build, shape = _nets()[net]
    torch.manual_seed(0)
    model, x = build(), torch.randn(*shape)
    plan = fxremat.plan(model, budget if budget == "min" else float(budget), example_inputs=(x,))
    layout = json.dumps([[list(s.nodes), s.recomputed] for s in plan.segments])
    return {"plan": hashlib.sha1(layout.encode()).hexdigest()[:10], "strategy": plan.strategy,
            "overhead": plan.predicted_overhead, "segments": sum(s.recomputed for s in plan.segments)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--heap", choices=("default", "kept", "both"), default="both")
    parser.add_argument("--one", nargs=2, metavar=("NET", "BUDGET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(plan_once(*args.one)))
        return
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    lines = ["| allocator | net | budget | runs | distinct plans | strategies | recomputed segments | "
             "predicted overhead (min .. max) |", "|---|---|---|---|---|---|---|---|"]
    heaps = ("default", "kept") if args.heap == "both" else (args.heap,)
    stable = {h: 0 for h in heaps}
    total = 0
    for heap in heaps:
        env = {**base, "GLIBC_TUNABLES": KEPT_HEAP} if heap == "kept" else base
        for net in _nets():
            for budget in BUDGETS:
                found = []
                for _ in range(args.runs):
                    out = subprocess.run([sys.executable, "-m", "benchmarks.plan_stability", "--one", net, budget],
                                         env=env, cwd=ROOT, capture_output=True, text=True, check=True)
                    found.append(json.loads(out.stdout.strip().splitlines()[-1]))
                plans = {f["plan"] for f in found}
                overheads = [f["overhead"] for f in found]
                stable[heap] += len(plans) == 1
                total += heap == heaps[0]
                lines.append(f"| {heap} | {net} | {budget} | {args.runs} | {len(plans)} "
                             f"| {', '.join(sorted({f['strategy'] for f in found}))} "
                             f"| {', '.join(str(f['segments']) for f in found)} "
                             f"| {min(overheads):.1%} .. {max(overheads):.1%} |")
                print(lines[-1], flush=True)
    counts = "; ".join(f"{h} heap: {stable[h]} of {total}" for h in heaps)
    text = (f"# Plan stability of the default cost model\n\n"
            f"Command: `PYTHONPATH=. python -m benchmarks.plan_stability {' '.join(sys.argv[1:])}`  \n"
            f"torch {torch.__version__}, one thread, each plan in a fresh process; load average at the end: "
            f"{load_average()}; kept heap: `GLIBC_TUNABLES={KEPT_HEAP}`\n\n"
            f"Net/budget pairs that gave one plan in all {args.runs} runs: {counts}.\n\n"
            + "\n".join(lines) + "\n")
    path = ROOT / "benchmarks" / "results" / "plan_stability.md"
    path.write_text(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
