"""Where a compiled step departs from fxremat's plan (issue 16).

For one plan (``fxremat.compile(model, budget, backend="inductor")``'s: no nested checkpoints,
parameter gradients held to the end of the one compiled backward graph), three runs of a
training step, measured as the running sum of the profiler's allocation events (every CPU
allocation: op workspaces and Inductor's buffers included):

- ``eager, same plan``: the emitted code run as it is (``plan=``), also measured as tensors alive
  (``fxremat.measure_peak``, the metric the plan predicts; a compiled module runs eagerly under
  its dispatch mode, so the compiled rows have no such figure). The gap between its two columns
  is what the CPU allocator sees beyond tensors (mkldnn workspaces);
- ``inductor``: ``backend="inductor"``;
- ``inductor, layout_optimization off``: the same with Inductor's CPU layout optimization
  (convolution activations copied to channels-last) switched off.

A torch.compile'd module measured once under a dispatch mode runs eagerly afterwards too (Dynamo
falls back), so each compiled variant here is measured only by the profiler.

    PYTHONPATH=. python -m benchmarks.inductor_departure --net pspnet --budget 0.5 min   # ~3 min
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

import fxremat

from .compile_budget import allocated_peak
from .harness import ROOT, caching_heap, load_average, step, with_grads
from .nets import cpu_nets, transformer_stack

MIB = 2**20


def _timed(model, x, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(model, x)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(build, x, budget, repeats: int = 5) -> tuple[fxremat.Plan, list[tuple]]:
    """The backend's plan and rows ``(variant, tracker peak or None, allocated peak, step s)``."""
    torch.manual_seed(0)
    base = build()
    rows = []
    plan = None
    for label, options in (("inductor", {}), ("inductor, layout_optimization off", {"layout_optimization": False})):
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False, **options), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            model = with_grads(fxremat.compile(copy.deepcopy(base), budget, example_inputs=(x,), backend="inductor"))
            step(model, x)
            plan = plan or model.plan
            same = [s.nodes for s in model.plan.segments] == [s.nodes for s in plan.segments]
            rows.append((label + ("" if same else " (another plan)"), None, allocated_peak(step, model, x),
                         _timed(model, x, repeats)))
    eager = with_grads(fxremat.compile(copy.deepcopy(base), budget, example_inputs=(x,), plan=plan))
    step(eager, x)
    rows.insert(0, ("eager, same plan", fxremat.measure_peak(step, eager, x)[1], allocated_peak(step, eager, x),
                    _timed(eager, x, repeats)))
    return plan, rows


def table(plan, rows) -> str:
    lines = [f"Plan (made for the compiled step: parameter gradients held to the end of the one backward "
             f"graph): {plan.strategy}, budget {plan.budget_bytes / MIB:.2f} MiB, predicted peak "
             f"{plan.predicted_peak_bytes / MIB:.2f} MiB.", "",
             "| variant | tensors alive, peak MiB | allocator events, peak MiB | allocated / budget | step ms |",
             "|---|---|---|---|---|"]
    for label, tracked, allocated, seconds in rows:
        tracked = f"{tracked / MIB:.2f}" if tracked is not None else "—"
        lines.append(f"| {label} | {tracked} | {allocated / MIB:.2f} | {allocated / plan.budget_bytes:.2f} "
                     f"| {seconds * 1e3:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    nets = {name: (build, shape) for name, build, shape, _ in cpu_nets(full=False)}
    nets["transformer"] = (lambda size="small": transformer_stack(depth=4, dim=64, heads=4), (4, 128, 64))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--net", choices=sorted(nets), default="pspnet")
    parser.add_argument("--budget", nargs="+", default=["0.5"], help="fractions or 'min'")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    allocator = caching_heap()
    build, shape = nets[args.net]
    torch.manual_seed(0)
    x = torch.randn(*shape)
    parts = []
    for b in args.budget:
        budget = b if b == "min" else float(b)
        plan, rows = measure(lambda: build("small"), x, budget, args.repeats)
        parts.append(f"## {args.net} at {b}\n\n" + table(plan, rows))
    text = (f"# Where the compiled step departs from the plan ({args.net} {'x'.join(map(str, shape))}, CPU)\n\n"
            f"Command: `python -m benchmarks.inductor_departure {' '.join(argv if argv is not None else sys.argv[1:])}`  \n"
            f"torch {torch.__version__}, 1 thread, {allocator}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"load average at the end {load_average()}; step times are medians of {args.repeats}, not interleaved "
            "(compiled variants are measured one after another): indicative only.\n\n" + "\n\n".join(parts) + "\n")
    out = ROOT / "benchmarks" / "results" / f"inductor_departure_{args.net}.md"
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
