"""What users do today, for comparison: hand-placed per-block checkpoints and
``torch.utils.checkpoint.checkpoint_sequential``; and Rockmate, the Inria tool, as an optional row
run in a separate interpreter (``python -m benchmarks.baselines rockmate --help``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from .harness import ROOT, step, with_grads

__all__ = ["BLOCK_CLASSES", "checkpoint_blocks", "SequentialCheckpoint", "rockmate_rows", "rockmate_table"]

# Classes a person would wrap in torch.utils.checkpoint by hand: one residual / dense /
# inception block, one U-Net level.
BLOCK_CLASSES = (
    "Bottleneck", "BasicBlock", "_DenseLayer", "Inception", "InceptionA", "InceptionB", "InceptionC",
    "InceptionD", "InceptionE", "UpBlock", "PyramidPooling", "Block", "EncoderBlock",
)


def _wrap(module: torch.nn.Module) -> None:
    forward = module.forward

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def checkpoint_blocks(model: torch.nn.Module, extra=()) -> int:
    """Wrap every outermost submodule whose class is a block (or named in ``extra``) in a
    non-reentrant checkpoint, in place; return how many were wrapped."""
    wrapped: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(w + ".") for w in wrapped):
            continue
        if type(module).__name__ in BLOCK_CLASSES or name in extra:
            _wrap(module)
            wrapped.append(name)
    return len(wrapped)


class SequentialCheckpoint(torch.nn.Module):
    """``checkpoint_sequential(model, segments, x)`` for an ``nn.Sequential`` model."""

    def __init__(self, model: torch.nn.Sequential, segments: int):
        super().__init__()
        self.model, self.segments = model, segments

    def forward(self, x):
        return checkpoint_sequential(self.model, self.segments, x, use_reentrant=False)

    @staticmethod
    def segment_counts(length: int) -> list[int]:
        """Every segment count from 2 to 2√L, as Beaumont et al. sweep it."""
        return list(range(2, max(3, int(2 * math.sqrt(length)) + 1)))


# ---------------------------------------------------------------------------------------------
# Rockmate (``pip install rockmate rkgb``, never a dependency of fxremat). It runs in its own
# interpreter, given by the harness's ``--rockmate-python``, in a child process with a time
# limit: its ILP solves can take many minutes, and an import or CUDA failure must not stop the
# harness. The child prints one JSON line; the parent turns every outcome into a row.

ROCKMATE_MODES = {"rotor": "PureRotor", "hilp": "Rockmate"}  # chain rotor DP / default hierarchical ILP


def rockmate_rows(python: str, *, net: str = "unet", shape=(4, 3, 128, 128), fraction: float = 0.5,
                  modes=("rotor", "hilp"), timeout_s: float = 120.0) -> list[dict]:
    """One row per Rockmate mode on the U-Net example at ``fraction`` of its plain measured peak."""
    rows = []
    for mode in modes:
        row = {"net": net, "mode": f"{mode} ({ROCKMATE_MODES[mode]})", "fraction": fraction,
               "input": "x".join(map(str, shape)), "python": python}
        row.update(_run_rockmate_child(python, mode, shape, fraction, timeout_s))
        rows.append(row)
    return rows


def _run_rockmate_child(python: str, mode: str, shape, fraction: float, timeout_s: float) -> dict:
    if not pathlib.Path(python).exists():
        return {"status": "not installed", "reason": f"no interpreter at {python}"}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    cmd = [python, "-m", "benchmarks.baselines", "rockmate", "--mode", mode, "--fraction", str(fraction),
           "--input", "x".join(map(str, shape))]
    start = time.perf_counter()
    # A session of its own, so that a timeout also ends the ILP solver processes it started.
    child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        return {"status": "timeout", "reason": f"no answer within {timeout_s:g} s (child killed)",
                "wall_s": time.perf_counter() - start}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "failed", "reason": f"exit {child.returncode}: {tail}", "wall_s": time.perf_counter() - start}
    return json.loads(lines[-1])


def _rockmate_child(argv=None) -> dict:
    """Runs in Rockmate's interpreter: plain peak, then Rockmate at ``fraction`` of it."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.baselines rockmate")
    parser.add_argument("--mode", choices=sorted(ROCKMATE_MODES), default="rotor")
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--input", default="4x3x128x128")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if importlib.util.find_spec("rockmate") is None:
        return {"status": "not installed", "reason": "no module named 'rockmate' in this interpreter"}
    try:
        import rockmate
    except Exception as err:  # rkgb 2.0.0 from PyPI lacks its own subpackages
        return {"status": "import failed", "reason": f"import rockmate: {type(err).__name__}: {err}"}

    from fxremat import measure_peak

    from .nets import unet

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    x = torch.randn(*map(int, args.input.split("x")), device=device)
    plain = with_grads(unet.build_model("small").to(device))
    step(plain, x)
    plain_peak = measure_peak(step, plain, x)[1]
    budget = int(args.fraction * plain_peak)
    result = {"device": device, "plain_peak": plain_peak, "budget": budget}
    start = time.perf_counter()
    try:
        model = getattr(rockmate, ROCKMATE_MODES[args.mode])(unet.build_model("small").to(device), (x,), budget=budget)
    except Exception as err:
        return {**result, "status": "failed", "solve_s": time.perf_counter() - start,
                "reason": f"solve on {device}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    result["solve_s"] = time.perf_counter() - start
    if getattr(model, "op_sched", None) is None:
        return {**result, "status": "no plan", "reason": f"no feasible schedule at {args.fraction:g} of plain"}
    try:
        with_grads(model)
        step(model, x)
        result["peak"] = measure_peak(step, model, x)[1]
        times = {"plain": [], "rockmate": []}
        for _ in range(args.repeats):  # interleaved, as the harness does
            for key, module in (("plain", plain), ("rockmate", model)):
                begin = time.perf_counter()
                step(module, x)
                if device == "cuda":
                    torch.cuda.synchronize()
                times[key].append(time.perf_counter() - begin)
    except Exception as err:
        return {**result, "status": "plan, run failed", "reason": f"{type(err).__name__}: {err}"}
    result["ratio"] = statistics.median(times["rockmate"]) / statistics.median(times["plain"])
    return {**result, "status": "plan", "reason": ""}


def rockmate_table(rows) -> str:
    """Markdown for :func:`rockmate_rows`."""
    mib = 2**20
    lines = ["| net | mode | budget | status | solve s | measured peak MiB | step / plain | reason |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        budget = f"{r['fraction']:g} × plain"
        if "budget" in r:
            budget += f" = {r['budget'] / mib:.1f} MiB ({r.get('device')})"
        solve = f"{r['solve_s']:.1f}" if "solve_s" in r else ""
        peak = f"{r['peak'] / mib:.1f}" if "peak" in r else ""
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else ""
        lines.append(f"| {r['net']} {r['input']} | {r['mode']} | {budget} | {r['status']} | {solve} | {peak} | "
                     f"{ratio} | {r['reason']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] != ["rockmate"]:
        sys.exit("usage: python -m benchmarks.baselines rockmate [--mode rotor|hilp] [--fraction F] [--input NxCxHxW]")
    print(json.dumps(_rockmate_child(sys.argv[2:])))
