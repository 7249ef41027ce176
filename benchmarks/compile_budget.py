"""torch.compile's activation memory budget as a benchmark row, measured exactly on CPU.

``torch._functorch.config.activation_memory_budget`` (a fraction, default 1.0) bounds the bytes
torch.compile's min-cut partitioner *saves for backward*; a knapsack over the forward's ops then
decides what the backward recomputes. Its peak is not monotonic in the fraction, so the harness
sweeps it (:data:`FRACTIONS`).

How it is measured. A dispatch-mode tracker does not see Inductor's kernels, and torch.compile
falls back to eager under an active dispatch mode, so this row compiles the model the way
Inductor's front half does and runs the result eagerly:

- ``aot_module_simplified`` (AOTAutograd, what ``torch.compile``'s ``aot_autograd`` backends call)
  traces the joint forward/backward graph with Inductor's decomposition table;
- the partitioner is ``min_cut_rematerialization_partition(compiler="inductor")`` with the
  budget set, so the saved set and the recomputation are the ones Inductor receives (Inductor's
  joint-graph pattern passes, which run before it, are skipped);
- the forward and backward compilers return the partitioned FX graphs as eager code with the
  boxed calling convention (inputs released as soon as they are dead, as Inductor's generated
  code does), so every aten op runs under :class:`fxremat.measure.LiveStorageTracker`.

The measured peak is therefore that of the partitioned graphs run op by op, unfused. Inductor's
fusion can remove intermediate buffers, never saved ones: ``live after forward`` (the bytes
alive when the forward returns: the saved set plus the output) is a floor for Inductor's own
peak (up to the joint-graph passes skipped here). Step times are those of the eager replay of decomposed graphs, not of Inductor's kernels:
``step / plain`` includes the slowdown of unfused decompositions, ``step / compile 1.0`` isolates
what the budget's recomputation costs.

Calibration against Inductor itself: ``python -m benchmarks.compile_budget --net NET`` compiles a
net of the CPU table with real ``torch.compile`` (Inductor) at a few fractions and measures every
variant with the profiler's allocation events (every CPU allocation, op workspaces included, a
different metric from the tracker's op outputs), beside plain eager, the replay and fxremat, with
step times interleaved. It writes ``compile_inductor_<net>.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import functools
import os
import pathlib
import statistics
import sys
import time
import types

import torch
from torch import nn

from fxremat import measure
from fxremat.measure import LiveStorageTracker

from .harness import ROOT, caching_heap, load_average, step, timed_step, with_grads
from .nets import cpu_nets

__all__ = ["FRACTIONS", "CompileBudget", "variants", "describe", "allocated_peak", "calibrate"]

FRACTIONS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)
FAMILY = "torch.compile replay"  # its partitioned graphs, run eagerly
MIB = 2**20


class _TupleOutput(nn.Module):
    """AOTAutograd's simplified entry point wants tuple outputs."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return (self.model(x),)


def _boxed_code(gm: torch.fx.GraphModule):
    """The graph as Python code taking one list of inputs that it clears (boxed convention)."""
    boxed_codegen = getattr(torch.fx.graph, "_BoxedCodeGen", None)
    if boxed_codegen is None:  # older torch: the interpreter frees values after their last use
        interpreter = torch.fx.Interpreter(gm)
        return interpreter.boxed_run
    gm.graph.set_codegen(boxed_codegen())
    gm.recompile()
    return gm.forward


def _eager_compiler(graphs: dict, kind: str):
    """An AOTAutograd compiler that keeps the partitioned graph's code and runs it eagerly."""

    def compiler(gm: torch.fx.GraphModule, example_inputs):
        graphs[kind] = gm.code
        graphs[f"{kind}_nodes"] = len(gm.graph.nodes)
        run = _boxed_code(gm)

        def boxed(args):
            return run(args)

        boxed._boxed_call = True
        return boxed

    return compiler


class CompileBudget(nn.Module):
    """``model`` compiled by AOTAutograd with torch.compile's partitioner at ``fraction``.

    Shares ``model``'s parameters (so ``.grad`` accumulates on them as in eager). Compiling
    happens here, with ``step(self, example_input)`` run once so that the backward graph is
    compiled too; ``compile_seconds`` covers both, ``graphs`` holds the partitioned code.
    """

    def __init__(self, model: nn.Module, fraction: float, example_input: torch.Tensor, step):
        super().__init__()
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._inductor.compile_fx import select_decomp_table

        self.model, self.fraction, self.graphs = model, fraction, {}
        start = time.perf_counter()
        with torch._functorch.config.patch(activation_memory_budget=fraction, enable_autograd_cache=False):
            self._compiled = aot_module_simplified(
                _TupleOutput(model), (example_input,),
                fw_compiler=_eager_compiler(self.graphs, "forward"),
                bw_compiler=_eager_compiler(self.graphs, "backward"),
                partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
                decompositions=select_decomp_table(),
            )
            step(self, example_input)
        self.compile_seconds = time.perf_counter() - start
        self.fractions = [fraction]  # every fraction that gave this same partition

    def forward(self, x):
        return self._compiled(x)[0]

    def partition_key(self) -> str:
        return self.graphs["forward"] + self.graphs["backward"]


def live_after_forward(module: nn.Module, x: torch.Tensor, loss_fn) -> int:
    """Bytes allocated by the forward and still alive when it returns (saved set + output)."""
    tracker = LiveStorageTracker()
    with tracker:
        out = module(x)
        live = tracker.live_bytes
        loss_fn(out).backward()
    return live


def variants(model: nn.Module, x: torch.Tensor, step, loss_fn, fractions=FRACTIONS) -> list:
    """``(label, family, module)`` per distinct partition over ``fractions``, for the harness.

    Fractions whose partitioned graphs are identical share one row labelled with all of them.
    """
    by_key: dict[str, CompileBudget] = {}
    for fraction in fractions:
        module = CompileBudget(copy.deepcopy(model), fraction, x, step)
        key = module.partition_key()
        if key in by_key:
            by_key[key].fractions.append(fraction)
            continue
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
        module.live_after_forward = live_after_forward(module, x, loss_fn)
        by_key[key] = module
    out = []
    for module in by_key.values():
        label = f"{FAMILY} {'/'.join(f'{f:g}' for f in module.fractions)}"
        out.append((label, FAMILY, module))
    return out


def _fastest_fxremat_within(rows, net: str, peak: int):
    fits = [r for r in rows if r["net"] == net and r["family"] == "fxremat" and r["peak"] <= peak]
    return min(fits, key=lambda r: r["ratio"]) if fits else None


def describe(rows) -> str:
    """A markdown section for the torch.compile rows in ``rows`` (the harness's CPU rows, each
    with its ``model``), beside the fastest fxremat row that fits in the same measured peak."""
    compiled = [r for r in rows if r["family"] == FAMILY]
    if not compiled:
        return ""
    lines = [
        "## torch.compile `activation_memory_budget` (AOTAutograd's partitioned graphs replayed under "
        "the tracker)",
        "",
        "Each row: the model compiled by `aot_module_simplified` with Inductor's decompositions and "
        "`min_cut_rematerialization_partition(compiler=\"inductor\")` at the budget fractions listed "
        "(fractions giving identical partitioned graphs share a row); the partitioned forward and "
        "backward graphs run eagerly, with boxed inputs, under the same live-storage tracker and with "
        "the same pre-allocated gradients as every other row. `live after fw` is what the forward "
        "leaves alive (saved set + output): fusion cannot go below it, so Inductor's own peak lies at "
        "or above it (up to the joint-graph passes skipped here). Step times are those of the unfused eager replay (noisy, see above); `/ compile "
        "1.0` divides by the replay at budget 1.0, i.e. the cost of the budget's recomputation alone; "
        "Inductor's fused code is faster than eager on this CPU, see `compile_inductor_<net>.md` "
        "(`python -m benchmarks.compile_budget`), which also compares the replay's peak with Inductor's. "
        "The last columns give the fastest fxremat row of the table whose measured peak is no higher.",
        "",
        "| net | budgets | measured peak MiB | vs plain | live after fw MiB | step / plain | "
        "step / compile 1.0 | compile s | fastest fxremat within that peak: row, peak MiB, step / plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in compiled:
        module = r["model"]
        base = next((c for c in compiled if c["net"] == r["net"] and 1.0 in c["model"].fractions), None)
        vs_one = f"{r['ratio'] / base['ratio']:.3f}" if base else "n/a"
        fx = _fastest_fxremat_within(rows, r["net"], r["peak"])
        fx_text = f"{fx['variant']}, {fx['peak'] / MIB:.1f}, {fx['ratio']:.3f}" if fx else "none fits"
        lines.append(
            f"| {r['net']} | {'/'.join(f'{f:g}' for f in module.fractions)} | {r['peak'] / MIB:.1f} | "
            f"{100 * (r['peak'] / r['plain_peak'] - 1):+.0f}% | {module.live_after_forward / MIB:.1f} | "
            f"{r['ratio']:.3f} | {vs_one} | {module.compile_seconds:.1f} | {fx_text} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Calibration of the replay against Inductor's compiled code (minutes: Inductor compiles on CPU).


def allocated_peak(fn, *args) -> int:
    """:func:`fxremat.measure.allocated_peak` of ``fn(*args)`` on the device of the first CUDA
    tensor among ``args`` (the CPU without one): every allocation, op workspaces and Inductor's
    own buffers included, so the metric under which Inductor and eager can be compared."""
    cuda = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
    return measure.allocated_peak(fn, *args, device=cuda)


def _own_code(model: nn.Module, tag: str) -> nn.Module:
    """``model`` made an instance of a subclass whose ``forward`` has a code object of its own.
    Dynamo caches compiled graphs per code object: two copies of one class compiled at two
    budgets would otherwise share the first one's graph, so they could not be compiled side by
    side and timed in one loop."""
    cls = type(model)
    code = cls.forward.__code__
    renamed = {"co_name": f"{code.co_name}_{tag}"}
    if hasattr(code, "co_qualname"):
        renamed["co_qualname"] = f"{code.co_qualname}_{tag}"
    forward = types.FunctionType(code.replace(**renamed), cls.forward.__globals__, renamed["co_name"],
                                 cls.forward.__defaults__, cls.forward.__closure__)
    model.__class__ = type(cls.__name__, (cls,), {"forward": forward})
    return model


def _inductor(model: nn.Module, fraction: float, x: torch.Tensor, step) -> tuple[nn.Module, float]:
    """``torch.compile(model)`` (Inductor) compiled at ``fraction`` on its first step, caches off
    so it really is; beside what is compiled already (its forward gets a code object of its own)."""
    compiled = torch.compile(_own_code(model, f"budget_{fraction:g}".replace(".", "_")))
    start = time.perf_counter()
    with torch._functorch.config.patch(activation_memory_budget=fraction, enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):
        step(compiled, x)
    return compiled, time.perf_counter() - start


def _measure(variants, x, step, with_grads, repeats) -> dict:
    """``label -> (tracker peak or None, allocated peak, step times)``; steps interleaved."""
    import fxremat

    peaks, times = {}, {label: [] for label, _, _ in variants}
    for label, model, _ in variants:
        with_grads(model)
        step(model, x)
        tracked = None if label.startswith("torch.compile") else fxremat.measure_peak(step, model, x)[1]
        peaks[label] = (tracked, allocated_peak(step, model, x))
    for _ in range(repeats):
        for label, model, _ in variants:
            times[label].append(timed_step(model, x, step))
    return {label: (*peaks[label], times[label]) for label in peaks}


def _ratio(times, plain_times) -> float:
    return statistics.median(times) / statistics.median(plain_times)


def _fxremat_inductor(model: nn.Module, budget, x: torch.Tensor, step, **options) -> tuple[nn.Module, float]:
    """``fxremat.compile(model, budget, backend="inductor", **options)``, planned with the compiled
    cost model and compiled by Inductor on its first step (caches off; its emitted GraphModule's
    code is its own, so it compiles beside the others)."""
    import fxremat

    start = time.perf_counter()
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):
        compiled = fxremat.compile(model, budget, example_inputs=(x,), backend="inductor", **options)
        step(compiled, x)
    return compiled, time.perf_counter() - start


@contextlib.contextmanager
def _exclusive(path):
    """An exclusive ``flock`` on ``path`` while the block runs (nothing with ``path`` None): the
    processes of one device session compile side by side and time one at a time."""
    if path is None:
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def calibrate(build, x, step, with_grads, *, fractions=(1.0, 0.3), fxremat_budgets=(0.5, "min"), repeats=7,
              inductor_budgets=(), whole_segments=False, autotune=0, compiled_only=False, timing_lock=None,
              unfitted=False, early_stop=False):
    """Rows ``(label, tracker peak or None, allocated peak, step / plain, compile s[, step / plain
    Inductor])``. Each fxremat + Inductor budget is also planned, and timed in the same loop, with
    ``dp_early_stop=False`` where ``whole_segments`` (the DP charging whole segments, the eager
    default), and with ``autotune=N`` where ``autotune`` is N >= 2 (its candidates compiled by
    Inductor and timed), with ``fit_compiled_peak=False`` where ``unfitted`` (the plan as made,
    not fitted to the compiled step's measured peak; a fitted row's compile seconds include the
    fit's measured steps and compiles), and with ``dp_early_stop=True`` where ``early_stop`` (on
    CUDA the default plans without it). ``compiled_only`` leaves out the eager fxremat and replay
    rows (and their loop); with ``timing_lock`` (a path) the eager rows and each timing loop run
    under an exclusive lock on it, the compiles outside it, so that several processes can share
    one device.

    Plain eager, fxremat and the replays are timed in one interleaved loop; then every compiled
    variant (torch.compile at each fraction, fxremat + Inductor at each budget) is compiled beside
    the others (each with code objects of its own: :func:`_own_code`) and all are timed in a second
    loop with plain eager, so each one's step over plain Inductor (the fraction 1.0 row) comes from
    one loop.
    """
    torch.manual_seed(0)
    base = build().to(x.device)
    plain = ("plain eager", copy.deepcopy(base), 0.0)
    rows = [] if compiled_only else _eager_rows(base, plain, x, step, with_grads, fractions, fxremat_budgets,
                                                repeats, timing_lock)
    torch._dynamo.reset()
    return rows + _compiled_rows(base, plain, x, step, with_grads, fractions, inductor_budgets, whole_segments,
                                 autotune, repeats, timing_lock, with_plain=compiled_only, unfitted=unfitted,
                                 early_stop=early_stop)


def _eager_rows(base, plain, x, step, with_grads, fractions, fxremat_budgets, repeats, timing_lock):
    """Plain eager, fxremat (eager) at each budget and the replay at each fraction, in one loop."""
    import fxremat

    variants = [plain]
    for budget in fxremat_budgets:
        start = time.perf_counter()
        try:
            with _exclusive(timing_lock):  # the measured cost model times the graph's nodes
                compiled = fxremat.compile(copy.deepcopy(base), budget, example_inputs=(x,))
        except fxremat.InfeasibleBudgetError as exc:  # (on CUDA the convolutions' workspaces count)
            print(f"fxremat {budget}: {exc}", flush=True)
            continue
        variants.append((f"fxremat {budget}", compiled, time.perf_counter() - start))
    for fraction in fractions:
        replay = CompileBudget(copy.deepcopy(base), fraction, x, step)
        variants.append((f"replay {fraction:g}", replay, replay.compile_seconds))
    with _exclusive(timing_lock):
        measured = _measure(variants, x, step, with_grads, repeats)
    return [(label, tracked, allocated, _ratio(times, measured["plain eager"][2]), seconds)
            for (label, _, seconds), (tracked, allocated, times) in zip(variants, measured.values())]


def _compiled_rows(base, plain, x, step, with_grads, fractions, inductor_budgets, whole_segments, autotune,
                   repeats, timing_lock, with_plain=False, unfitted=False, early_stop=False):
    """Every compiled variant, compiled beside the others, timed in one loop with plain eager (its
    row first where ``with_plain``)."""
    import fxremat

    compiled = []
    for fraction in sorted(set(fractions) | {1.0}, reverse=True):
        model, seconds = _inductor(copy.deepcopy(base), fraction, x, step)
        compiled.append((f"{INDUCTOR} {fraction:g}", model, seconds))
    infeasible = []
    planned = ({},) + (({"dp_early_stop": False},) if whole_segments else ()) + \
        (({"autotune": autotune},) if autotune else ()) + (({"fit_compiled_peak": False},) if unfitted else ()) + \
        (({"dp_early_stop": True},) if early_stop else ())
    for budget, options in [(b, o) for b in inductor_budgets for o in planned]:
        try:
            with _exclusive(timing_lock if "autotune" in options else None):  # autotune times its candidates
                model, seconds = _fxremat_inductor(copy.deepcopy(base), budget, x, step, **options)
        except fxremat.InfeasibleBudgetError as exc:
            if not options:
                infeasible.append((f"torch.compile(fxremat {budget}): below the least feasible peak "
                                   f"({exc.min_feasible_bytes / MIB:.1f} MiB)", None, None, None, 0.0))
            continue
        how = "".join({"dp_early_stop": ", early stop" if options.get("dp_early_stop") else ", whole segments",
                       "autotune": f", autotune {autotune}", "fit_compiled_peak": ", not fitted"}[k] for k in options)
        label = (f"torch.compile(fxremat {budget}{how}) (Inductor; plan budget {model.plan.budget_bytes / MIB:.1f} "
                 f"MiB, {sum(s.recomputed for s in model.plan.segments)} recomputed segments)")
        compiled.append((label, model, seconds))
    with _exclusive(timing_lock):
        together = _measure([plain, *compiled], x, step, with_grads, repeats)
    inductor_times = together[f"{INDUCTOR} 1"][2]
    rows = []
    for label, _, seconds in [plain, *compiled] if with_plain else compiled:
        tracked, allocated, times = together[label]
        rows.append((label, tracked, allocated, _ratio(times, together["plain eager"][2]), seconds,
                     _ratio(times, inductor_times)))
    return rows + infeasible


INDUCTOR = "torch.compile (Inductor)"




def calibration_table(rows) -> str:
    """Rows of :func:`calibrate`: the compiled ones (with a sixth field) are timed in one loop with
    plain Inductor (the ``torch.compile (Inductor) 1`` row), the eager ones in another."""
    tracked_plain, allocated_plain = rows[0][1], rows[0][2]
    lines = ["| variant | tracker peak MiB (vs plain) | allocated peak MiB (vs plain) | step / plain eager | "
             "step / plain Inductor | compile s |", "|---|---|---|---|---|---|"]
    for label, tracked, allocated, ratio, seconds, *beside in rows:
        if allocated is None:
            lines.append(f"| {label} | — | — | — | — | — |")
            continue
        tracked_text = (f"{tracked / MIB:.1f} ({100 * (tracked / tracked_plain - 1):+.0f}%)" if tracked is not None
                        else "not visible")
        allocated_text = f"{allocated / MIB:.1f} ({100 * (allocated / allocated_plain - 1):+.0f}%)"
        vs_inductor = f"{beside[0]:.2f}" if beside else "—"
        lines.append(f"| {label} | {tracked_text} | {allocated_text} | {ratio:.2f} | {vs_inductor} | {seconds:.1f} |")
    return "\n".join(lines)


def _transformer(size="small"):
    from .nets import transformer_stack

    return transformer_stack(depth=4, dim=64, heads=4)


def _cores(spec: str) -> set[int]:
    """``"2-4,7"`` -> ``{2, 3, 4, 7}``; an empty set for a malformed list."""
    cores = set()
    for part in spec.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or not (high or low).isdigit():
            return set()
        cores.update(range(int(low), int(high or low) + 1))
    return cores


def main(argv=None) -> int:
    nets = {name: (build, shape) for name, build, shape, _ in cpu_nets(full=False)}
    nets["transformer"] = (_transformer, (4, 128, 64))
    parser = argparse.ArgumentParser(description="Calibrate the torch.compile replay against Inductor.")
    parser.add_argument("--net", choices=sorted(nets), default="unet", help="a net of the CPU trade-off table")
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.3])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--fxremat-inductor", nargs="*", default=["0.7", "0.5", "0.3", "min"], metavar="BUDGET",
                        help="budgets of torch.compile(fxremat.compile(..., backend='inductor')) rows")
    parser.add_argument("--out", default=None, help="default benchmarks/results (benchmarks/results/cuda with "
                        "--device cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the steps run; on cuda the allocated peak is torch.cuda.max_memory_allocated")
    parser.add_argument("--batch-scale", type=int, default=1, help="multiply the net's batch (GPU-sized steps)")
    parser.add_argument("--whole-segments", action="store_true",
                        help="also plan each fxremat + Inductor budget with dp_early_stop=False, in the same loop")
    parser.add_argument("--autotune", type=int, default=0, metavar="N",
                        help="also plan each fxremat + Inductor budget with autotune=N (N >= 2), in the same loop")
    parser.add_argument("--early-stop", action="store_true",
                        help="also plan each fxremat + Inductor budget with dp_early_stop=True (off by default on "
                        "CUDA), in the same loop")
    parser.add_argument("--unfitted", action="store_true",
                        help="also plan each fxremat + Inductor budget with fit_compiled_peak=False, in the same loop")
    parser.add_argument("--compiled-only", action="store_true",
                        help="leave out the eager fxremat and replay rows: plain eager and the compiled rows only")
    parser.add_argument("--timing-lock", default=None, metavar="PATH",
                        help="time (and plan with measured costs) only while holding an exclusive lock on PATH, "
                        "compile outside it: several processes (one net each) can then share one device; peaks "
                        "stay exact, step ratios are disturbed by the others' compiles (see the header it writes)")
    parser.add_argument("--cores", default=None, metavar="LIST",
                        help="run on these CPU cores only (e.g. 2-4 or 0,1; Inductor's compile workers too)")
    args = parser.parse_args(argv)
    if args.cores is not None:
        cores = _cores(args.cores)
        if not cores or not cores <= os.sched_getaffinity(0):
            parser.error(f"--cores {args.cores!r}: give cores of this machine, a subset of "
                         f"{sorted(os.sched_getaffinity(0))} (e.g. 0-3 or 0,2)")
        os.sched_setaffinity(0, cores)
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(len(cores)))
    # every fxremat + Inductor row is one more entry in Dynamo's cache of fxremat's forward: with
    # the default limit (8) the later rows ran eagerly (fxremat.compile warns of it)
    torch._dynamo.config.recompile_limit = 64
    allocator = caching_heap()  # steps timed right after another variant's would follow its heap otherwise
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False here; leave --device at cpu")
    if args.batch_scale < 1:
        parser.error(f"--batch-scale must be a positive integer, got {args.batch_scale}")
    build, shape = nets[args.net]
    shape = (shape[0] * args.batch_scale, *shape[1:])
    torch.manual_seed(0)
    x = torch.randn(*shape, device=args.device)
    budgets = tuple(b if b == "min" else float(b) for b in args.fxremat_inductor)
    rows = calibrate(lambda: build("small"), x, step, with_grads, fractions=tuple(args.fractions),
                     repeats=args.repeats, inductor_budgets=budgets, whole_segments=args.whole_segments,
                     autotune=args.autotune, compiled_only=args.compiled_only, timing_lock=args.timing_lock,
                     unfitted=args.unfitted, early_stop=args.early_stop)
    gpu = f", GPU: {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    text = (f"# torch.compile: the replay against Inductor ({args.net} {'x'.join(map(str, shape))}, "
            f"{args.device.upper()})\n\n"
            f"Command: `python -m benchmarks.compile_budget {' '.join(sys.argv[1:])}`  \n"
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{gpu}  \nCPU allocator: {allocator}\n\n"
            + ("On CUDA the allocated peak is `torch.cuda.max_memory_allocated` during one step, above what was "
               "allocated before it (cuDNN / cuBLAS workspaces included).\n\n" if args.device == "cuda" else "")
            + "Tracker peak: op outputs under `fxremat.measure_peak` (what the CPU trade-off table reports; it does "
            "not see Inductor's buffers). Allocated peak: the running sum of the profiler's CPU allocation events, "
            "op workspaces included, so higher than the tracker's for the same run. Replay: the partitioned graphs "
            "run eagerly (`benchmarks/compile_budget.py`). Step times: medians of interleaved repeats, each "
            "timed right after an untimed step of the same variant (`harness.timed_step`), on a shared "
            f"machine, noisy (load average {load_average()} at the end). The eager rows are timed in one "
            "interleaved loop; every compiled row (torch.compile at each fraction, fxremat + Inductor at each "
            "budget, each compiled with code objects of its own so that Dynamo keeps their graphs apart) in a "
            "second one with plain eager, so step / plain Inductor compares rows of one loop.\n\n"
            + ("This run compiled beside other processes on the same machine (`--timing-lock`, each process on "
               "cores of its own: `--cores`) and timed only while it held the lock, alone on the device but not on "
               "the machine: the others' compiles went on, so its step ratios are disturbed (on an H200, the "
               "transformer's fxremat 0.5 row read 1.16x plain Inductor so and 0.97x in a run alone). Its peaks are "
               "exact.\n\n" if args.timing_lock else "")
            + calibration_table(rows) + "\n")
    out = pathlib.Path(args.out) if args.out else ROOT / "benchmarks" / "results" / (
        "cuda" if args.device == "cuda" else "")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"compile_inductor_{args.net}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
