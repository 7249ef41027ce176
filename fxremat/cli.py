"""The ``fxremat`` command line: ``plan``, ``tradeoff`` and ``bench``.

``fxremat plan MODEL --input 2x3x96x96 --budget 0.5`` traces, profiles and plans MODEL and prints
the plan; ``fxremat tradeoff`` prints (and plots) the memory/overhead Pareto curve; ``fxremat
bench`` trains plain and compiled copies and measures peak memory and step time.

MODEL is ``package.module:Callable`` (called with no arguments; the current directory is
importable) or ``torchvision:NAME``. Inputs are ``2x3x96x96`` (float32, random) or
``4x128:int64`` (zeros). Bad arguments print one line and exit with status 2; a model torch.fx
cannot trace exits with status 1. Progress bars (``pip install 'fxremat[cli]'``) appear on
stderr when a run takes more than a second; ``--quiet`` hides them and warnings.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import logging
import os
import statistics
import sys
import threading
import time
import warnings

import torch

from .api import cost_graph, planned
from .budget import parse_budget
from .errors import InfeasibleBudgetError, TraceError, format_bytes
from .measure import default_loss, measure_peak
from .passes.profile import COST_MODELS, preserved_state
from .planner import DEFAULT_EXACT_CAP, STRATEGIES, tradeoff, write_csv
from .plots import plot_timeline, plot_tradeoff

__all__ = ["main", "build_parser"]

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "float64": torch.float64, "int64": torch.int64, "long": torch.int64,
           "int32": torch.int32, "bool": torch.bool}


class UsageError(Exception):
    """A bad command-line argument: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# --------------------------------------------------------------------------------------------
# Argument types
# --------------------------------------------------------------------------------------------

def input_spec(text: str) -> tuple[tuple[int, ...], torch.dtype]:
    """``"2x3x96x96"`` -> ((2, 3, 96, 96), float32); ``"4x128:int64"`` -> ((4, 128), int64)."""
    shape_text, _, dtype_text = text.partition(":")
    dtype = _DTYPES.get(dtype_text or "float32")
    try:
        shape = tuple(int(d) for d in shape_text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(d < 0 for d in shape) or dtype is None:
        raise argparse.ArgumentTypeError(
            f"cannot read input {text!r}; write its shape as 2x3x96x96, optionally with a dtype "
            f"(2x128:int64; dtypes {', '.join(sorted(_DTYPES))})"
        )
    return shape, dtype


def budget_arg(text: str):
    """``--budget``: parsed by :func:`fxremat.budget.parse_budget`, the rule Python uses for a string
    (``"0.5"``/``"50%"`` fractions, ``"800MiB"``/``"2GB"`` bytes, ``"min"``)."""
    try:
        return parse_budget(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("fxremat: ")) from None


def positive_int(text: str, *, least: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer of at least {least}, got {text!r}")
    return value


def points_arg(text: str) -> int:
    return positive_int(text, least=2)


# --------------------------------------------------------------------------------------------
# Model, inputs, progress
# --------------------------------------------------------------------------------------------

def _factory(spec: str):
    """The callable named by MODEL (``package.module:Callable`` or ``torchvision:NAME``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"MODEL must be 'package.module:Callable' or 'torchvision:NAME', got {spec!r}")
    if module_name == "torchvision":
        return _torchvision(attr)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise
        raise UsageError(f"cannot import {module_name!r} for MODEL {spec!r} ({exc}); run from the directory "
                         "that holds it or add that directory to PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"module {module_name!r} has no callable {attr!r} (MODEL {spec!r})")
    return factory


def _torchvision(name: str):
    try:
        import torchvision
    except ImportError:
        raise UsageError(f"MODEL 'torchvision:{name}' needs torchvision; pip install torchvision") from None
    try:
        torchvision.models.get_model_builder(name)
    except ValueError:
        raise UsageError(f"torchvision has no model {name!r}; see torchvision.models.list_models()") from None
    return lambda: torchvision.models.get_model(name, weights=None)


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here; use --device cpu")
    return torch.device(name)


def _build(args) -> tuple[torch.nn.Module, tuple]:
    """Model and random inputs on ``args.device`` (fake tensors with ``--fake``)."""
    device = _device(args.device)
    factory = _factory(args.model)
    with device:  # under FakeTensorMode parameters cannot be moved afterwards
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"MODEL {args.model!r} returned {type(model).__name__}, not a torch.nn.Module")
    if not args.fake:
        model = model.to(device)
    model.train()
    inputs = tuple(torch.randn(shape, dtype=dtype, device=device) if dtype.is_floating_point
                   else torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in args.input)
    _check_runs(args, model, inputs)
    return model, inputs


def _check_runs(args, model, inputs) -> None:
    """One plain forward (no gradients; buffers and RNG restored) so that inputs the model cannot
    take (``--input 2x3x32`` for a 4-d convolution, ``:int64`` for a float layer) are a usage
    error of one line, before any tracing or profiling."""
    try:
        with preserved_state(model), torch.no_grad():
            model(*inputs)
    except Exception as exc:  # the user's model may raise anything on inputs it cannot take
        first = (str(exc).strip().splitlines() or [""])[0]
        specs = " ".join(f"--input {'x'.join(map(str, shape))}:{str(dtype).removeprefix('torch.')}"
                         for shape, dtype in args.input)
        raise UsageError(f"MODEL {args.model!r} cannot run on {specs}: {type(exc).__name__}: {first}; "
                         "give --input the shape and dtype its forward takes (one --input per positional "
                         "argument)") from None


def _check_outputs(args, *names: str) -> None:
    """Refuse output files whose folder does not exist or is not writable, before any work."""
    for name in names:
        path = getattr(args, name, None)
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"--{name} {path}: folder {folder} does not exist; create it or write elsewhere")
        if not os.access(folder, os.W_OK):
            raise UsageError(f"--{name} {path}: folder {folder} is not writable; write elsewhere")
        if os.path.isdir(path):
            raise UsageError(f"--{name} {path} is a folder; give a file name")


def _fake_mode(args):
    if not getattr(args, "fake", False):
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def _cost_model(args) -> str:
    if args.cost_model is None:
        return "flops" if args.fake else "measured"
    if args.fake and args.cost_model == "measured":
        raise UsageError("--cost-model measured cannot time fake tensors; use flops or uniform with --fake")
    return args.cost_model


def _tqdm():
    """tqdm's bar class, or ``None`` when tqdm is not installed (progress bars are optional)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class _Progress:
    """A tqdm bar on stderr that shows itself once a run has taken more than a second.

    The description names the stage and its running time (``profiling 175 nodes 4.1s``),
    refreshed by a ticker thread while a long stage runs, so the bar moves even where the count
    does not. Stages also come from the library's INFO records on the ``fxremat`` logger
    (``fxremat.compile`` inside ``bench``). Without tqdm, or with ``quiet``, or when stderr is not
    a terminal, it does nothing.
    """

    DELAY_S = 1.0

    def __init__(self, total: int, *, quiet: bool):
        bar_class = None if quiet or not sys.stderr.isatty() else _tqdm()
        self.bar = bar_class and bar_class(total=total, delay=self.DELAY_S, leave=False, file=sys.stderr,
                                           bar_format="{desc}: {n}/{total} |{bar}| {elapsed}")
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._name, self._since = "", time.perf_counter()
        self._handler = _StageHandler(self)

    def __enter__(self):
        if self.bar is not None:
            self._ticker.start()
            logging.getLogger("fxremat").addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.bar is not None:
            logging.getLogger("fxremat").removeHandler(self._handler)
            self._ticker.join()
            self.bar.close()

    def _visible(self) -> bool:
        return self.bar.format_dict["elapsed"] >= self.DELAY_S

    def _describe(self, refresh: bool) -> None:
        seconds = time.perf_counter() - self._since
        self.bar.set_description_str(f"{self._name} {seconds:.0f}s" if seconds >= 1 else self._name,
                                     refresh=refresh)

    def _tick(self):
        while not self._stop.wait(0.2):
            if self._visible():
                self._describe(refresh=True)

    def stage(self, name: str) -> None:
        self._name, self._since = name, time.perf_counter()
        if self.bar is not None:
            self._describe(refresh=self._visible())

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)


class _StageHandler(logging.Handler):
    """Turns the library's stage records (``fxremat_stage``) into :meth:`_Progress.stage` calls;
    prints nothing itself."""

    def __init__(self, progress: _Progress):
        super().__init__(level=logging.INFO)
        self.progress = progress

    def emit(self, record):
        stage = getattr(record, "fxremat_stage", None)
        if stage is not None:
            self.progress.stage(record.getMessage().removeprefix("fxremat: ").removesuffix(" ..."))
        elif getattr(record, "fxremat_stage_done", None) is not None:
            self.progress.advance()


def _shapes(args) -> str:
    return ", ".join("x".join(map(str, shape)) for shape, _ in args.input)


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------

def cmd_plan(args) -> int:
    """Plan MODEL and print the plan; write code, JSON and a timeline plot on request."""
    _check_outputs(args, "code", "json", "plot")
    if args.plot:
        _need_matplotlib()
    # trace, profile, solve (and emit): stages from the library's log records
    with _fake_mode(args), _Progress(3 + bool(args.code), quiet=args.quiet) as progress, _library_info(progress):
        model, inputs = _build(args)
        result = planned(model, args.budget, example_inputs=inputs, strategy=args.strategy,
                         cost_model=_cost_model(args), exact_cap=args.exact_cap, api="cli")
        the_plan = result.plan
        code = result.code(type(model).__name__) if args.code else None
    print(f"fxremat plan {args.model} on {_shapes(args)} ({args.device}{', fake' if args.fake else ''})\n")
    print(the_plan.summary())
    if args.explain:
        print("\n" + the_plan.explain())
    _write(args.code, code, "emitted code")
    if args.json:
        the_plan.save(args.json)
        _note(args, f"wrote the plan to {args.json}")
    if args.plot:
        plot_timeline(the_plan, args.plot)
        _note(args, f"wrote the predicted memory timeline to {args.plot}")
    return 0


def _need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib; pip install 'fxremat[plot]' (or matplotlib)") from None


def _write(path, text, what: str) -> None:
    if path:
        with open(path, "w") as f:
            f.write(text)
        print(f"\nwrote the {what} to {path}")


def _note(args, text: str) -> None:
    print(("" if args.quiet else "\n") + text)


def _tradeoff_table(points) -> str:
    rows = [f"  {'budget':>12}  {'predicted peak':>14}  {'overhead':>9}  {'segments':>8}  "
            f"{'recomputed':>10}  strategy"]
    for p in points:
        rows.append(f"  {format_bytes(p.budget_bytes):>12}  {format_bytes(p.predicted_peak_bytes):>14}  "
                    f"{100 * p.predicted_overhead:>8.1f}%  {p.num_segments:>8}  {p.recomputed_nodes:>10}  {p.strategy}")
    return "\n".join(rows)


def cmd_tradeoff(args) -> int:
    """Print (and plot, and write as CSV) the memory/overhead Pareto curve."""
    _check_outputs(args, "csv", "plot")
    if args.plot:
        _need_matplotlib()
    with _fake_mode(args), _Progress(2 + args.points, quiet=args.quiet) as progress:
        model, inputs = _build(args)
        with _library_info(progress):
            graph = cost_graph(model, example_inputs=inputs, cost_model=_cost_model(args), api="cli")
        progress.stage("solving")
        points = tradeoff(graph, points=args.points, strategy=args.strategy, exact_cap=args.exact_cap,
                          on_point=progress.advance)
    print(f"fxremat tradeoff {args.model} on {_shapes(args)}: {graph.n} nodes, cost model {_cost_model(args)}, "
          f"{len(points)} plan{'s' * (len(points) != 1)} on the Pareto curve\n")
    print(_tradeoff_table(points))
    if args.csv:
        write_csv(points, args.csv)
        _note(args, f"wrote the curve to {args.csv}")
    if args.plot:
        plot_tradeoff(points, args.plot, title=f"fxremat tradeoff: {args.model} on {_shapes(args)}")
        _note(args, f"wrote the plot to {args.plot}")
    return 0


def _train_step(model, inputs) -> None:
    torch.manual_seed(0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()
    default_loss(model(*inputs)).backward()


def _measure(model, inputs, steps: int, progress=None, what: str = "") -> tuple[int, float]:
    """Max measured peak and median seconds over ``steps`` steps after one warm-up step."""
    peaks, seconds = [], []
    for step in range(steps + 1):
        if progress is not None:
            progress.stage(f"{what} step {step + 1}/{steps + 1}")
        if inputs[0].is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        _, peak = measure_peak(_train_step, model, inputs)
        if inputs[0].is_cuda:
            torch.cuda.synchronize()
        if step:
            peaks.append(peak)
            seconds.append(time.perf_counter() - start)
        if progress is not None:
            progress.advance()
    return max(peaks), statistics.median(seconds)


@contextlib.contextmanager
def _library_info(progress: _Progress):
    """Let the library's INFO stage records reach the bar's handler (the command line keeps the
    ``fxremat`` logger at WARNING otherwise; the records are not printed)."""
    logger = logging.getLogger("fxremat")
    level, propagate = logger.level, logger.propagate
    if progress.bar is not None:
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        yield
    finally:
        logger.setLevel(level)
        logger.propagate = propagate


def cmd_bench(args) -> int:
    """Train plain and compiled copies; print measured peaks and step times."""
    from .api import compile as fx_compile

    # trace, profile, solve, emit (stages from the library's log records), then the steps
    with _Progress(4 + 2 * (args.steps + 1), quiet=args.quiet) as progress:
        model, inputs = _build(args)
        plain = copy.deepcopy(model)
        with _library_info(progress):
            compiled = fx_compile(model, args.budget, example_inputs=inputs, strategy=args.strategy,
                                  cost_model=args.cost_model or "measured", exact_cap=args.exact_cap,
                                  autotune=args.autotune)
        for m in (plain, compiled):
            for p in m.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        plain_peak, plain_s = _measure(plain, inputs, args.steps, progress, "plain")
        peak, seconds = _measure(compiled, inputs, args.steps, progress, "compiled")
    the_plan = compiled.plan
    print(f"fxremat bench {args.model} on {_shapes(args)} ({args.device}), {args.steps} steps\n")
    print(f"  {'':10} {'measured peak':>14} {'predicted peak':>15} {'step time':>11}")
    print(f"  {'plain':10} {format_bytes(plain_peak):>14} {format_bytes(the_plan.baseline_peak_bytes):>15} "
          f"{1e3 * plain_s:>9.1f}ms")
    print(f"  {'compiled':10} {format_bytes(peak):>14} {format_bytes(the_plan.predicted_peak_bytes):>15} "
          f"{1e3 * seconds:>9.1f}ms")
    print(f"\n  memory {100 * (peak / max(plain_peak, 1) - 1):+.1f}%, step time {100 * (seconds / plain_s - 1):+.1f}% "
          f"(predicted overhead {100 * the_plan.predicted_overhead:.1f}%), strategy {the_plan.strategy}")
    if the_plan.autotune:
        print("\n  autotune (candidates timed while planning; * kept):")
        for t in the_plan.autotune:
            print(f"  {'*' if t.chosen else ' '} {t.strategy:<10} predicted peak {format_bytes(t.predicted_peak_bytes):>10}, "
                  f"overhead predicted {100 * t.predicted_overhead:+.1f}%, measured {100 * t.measured_overhead:+.1f}%")
    return 0


# --------------------------------------------------------------------------------------------
# Parser and entry point
# --------------------------------------------------------------------------------------------

def _common(sub: argparse.ArgumentParser, *, budget: bool, fake: bool) -> None:
    sub.add_argument("model", metavar="MODEL", help="package.module:Callable (called with no arguments) "
                     "or torchvision:NAME")
    sub.add_argument("--input", type=input_spec, action="append", required=True, metavar="SHAPE[:DTYPE]",
                     help="one positional input, e.g. 2x3x96x96 or 4x128:int64; repeat for more inputs")
    if budget:
        sub.add_argument("--budget", type=budget_arg, required=True,
                         help="fraction of the peak without recomputation (0.5 or 50%%), bytes with a "
                              "unit (800MiB, 2GB) or 'min'")
    sub.add_argument("--strategy", choices=STRATEGIES, default="auto")
    sub.add_argument("--cost-model", choices=COST_MODELS, default=None,
                     help="default: measured (flops with --fake)")
    sub.add_argument("--exact-cap", type=positive_int, default=DEFAULT_EXACT_CAP,
                     help="largest number of lower sets for the exact DP under --strategy auto")
    sub.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    if fake:
        sub.add_argument("--fake", action="store_true",
                         help="plan on fake tensors with flop costs: nothing is allocated")
    sub.add_argument("--quiet", "-q", action="store_true", help="no progress bars or warnings")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fxremat", description="Plan, inspect and benchmark activation recomputation.")
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = subs.add_parser("plan", help="plan a model under a budget and print the plan")
    _common(plan, budget=True, fake=True)
    plan.add_argument("--code", metavar="FILE", help="write the emitted GraphModule code")
    plan.add_argument("--json", metavar="FILE", help="write the plan (read it with fxremat.load_plan)")
    plan.add_argument("--plot", metavar="FILE.png", help="plot the predicted memory timeline")
    plan.add_argument("--explain", action="store_true", help="also list every kept and recomputed value")
    plan.set_defaults(func=cmd_plan)
    curve = subs.add_parser("tradeoff", help="the memory/overhead Pareto curve")
    _common(curve, budget=False, fake=True)
    curve.add_argument("--points", type=points_arg, default=12, help="budgets to solve for (default 12)")
    curve.add_argument("--plot", metavar="FILE.png", help="plot the curve (needs matplotlib)")
    curve.add_argument("--csv", metavar="FILE", help="write the curve as CSV")
    curve.set_defaults(func=cmd_tradeoff)
    bench = subs.add_parser("bench", help="train plain and compiled copies; measure peak and step time")
    _common(bench, budget=True, fake=False)
    bench.add_argument("--steps", type=positive_int, default=3, help="measured steps after one warm-up")
    bench.add_argument("--autotune", type=int, default=4, metavar="N",
                       help="time the N best candidate plans for real while planning and keep the fastest "
                            "(default 4; 0 turns it off)")
    bench.set_defaults(func=cmd_bench, fake=False)
    return parser


def _warn_line(message, category, filename, lineno, file=None, line=None):
    print(f"fxremat: warning: {message}", file=sys.stderr)


def main(argv=None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a bad argument already reported on one line
        return exc.code if isinstance(exc.code, int) else 2
    prog = f"fxremat {args.command}"
    logging.getLogger("fxremat").setLevel(logging.ERROR if args.quiet else logging.WARNING)
    with warnings.catch_warnings():
        if args.quiet:
            warnings.simplefilter("ignore")
        else:
            warnings.showwarning = _warn_line
        try:
            return args.func(args)
        except (UsageError, InfeasibleBudgetError) as exc:
            message = str(exc).removeprefix("fxremat: ").replace("budget='min'", "--budget min")
            print(f"{prog}: error: {message}", file=sys.stderr)
            return 2
        except TraceError as exc:
            print(f"{prog}: error: {str(exc).removeprefix('fxremat: ')}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
