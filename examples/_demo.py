"""Shared fxremat training demo used by the example models' ``main()``.

It trains a plain copy of a model and its fxremat-compiled version side by side on the
same random data, and reports measured vs predicted activation peaks, step-time
overhead and how far the two models' parameters drifted apart.
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# Let `python examples/<model>.py` find the package when it is not installed.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fxremat  # noqa: E402

MIB = 2**20
CODE_LINES = 40


def parse_budget(text):
    """``"0.5"`` -> 0.5 (a fraction), ``"1e9"`` -> 10**9 (bytes), anything else stays a string.

    Strings such as ``"min"`` or ``"800MiB"`` are parsed by fxremat itself.
    """
    try:
        value = float(text)
    except ValueError:
        return text
    return int(value) if value > 1 and value.is_integer() else value


def parse_args(description, argv=None):
    """The demo's command-line options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--budget", type=parse_budget, default="0.5",
                        help="fraction of the baseline peak, bytes, a size such as '800MiB', or 'min'")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps (after a warm-up step; "
                        "one more step measures the peak)")
    parser.add_argument("--size", choices=("small", "paper"), default="small", help="model and input size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def preallocate_grads(model):
    """Give every parameter a zero ``.grad`` so step peaks count activations only."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def output_shape(model, x):
    """Shape of ``model(x)``, computed on a throw-away copy so no state changes."""
    with torch.no_grad():
        return copy.deepcopy(model).eval()(x).shape


def random_batch(input_shape, out_shape, seed):
    """Random inputs and integer class targets matching the output's spatial size."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(input_shape, generator=gen)
    target = torch.randint(out_shape[1], (out_shape[0], *out_shape[2:]), generator=gen)
    return x, target


def train_step(model, optimizer, x, target, seed):
    """One SGD step; the RNG is seeded so both models draw the same dropout masks."""
    torch.manual_seed(seed)
    optimizer.zero_grad(set_to_none=False)
    out = model(x)  # held until the step ends, as training loops usually do
    loss = F.cross_entropy(out, target)
    loss.backward()
    optimizer.step()
    return loss.item()


def measured_peak(model, optimizer, batch, seed):
    """Run :func:`train_step` under ``fxremat.measure_peak``; return its peak bytes."""
    return fxremat.measure_peak(train_step, model, optimizer, *batch, seed)[1]


def max_param_diff(reference, other):
    """Largest absolute difference between parameters matched by name.

    ``other`` may nest the parameters under a prefix (``"gm.conv.weight"``).
    """
    others = dict(other.named_parameters())
    worst = 0.0
    for name, p in reference.named_parameters():
        matches = [q for key, q in others.items() if key.endswith("." + name)]
        if name in others:
            matches = [others[name]]
        if not matches:
            raise KeyError(f"compiled model has no parameter matching {name!r}")
        worst = max(worst, (p - matches[0]).abs().max().item())
    return worst


def train_both(models, batches, seed):
    """Warm up on ``batches[0]``; time a step per batch up to the last, interleaved (which model
    goes first alternates, so neither always runs on the heap the other left); measure the peak
    on the last batch. Timing runs without the memory tracker, whose per-op bookkeeping would
    inflate both times. Both models take the same steps, so their parameters stay comparable."""
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}
    stats = {name: {"peak": [], "time": []} for name in models}
    names = list(models)
    for step, batch in enumerate(batches[:-1]):
        for name in names if step % 2 == 0 else reversed(names):
            start = time.perf_counter()
            train_step(models[name], optimizers[name], *batch, seed + step)
            if step > 0:
                stats[name]["time"].append(time.perf_counter() - start)
    last = len(batches) - 1
    for name in names:
        stats[name]["peak"].append(measured_peak(models[name], optimizers[name], batches[last], seed + last))
    return stats


def report(compiled, stats, budget, param_diff):
    """Print the comparison, the plan summary and the start of the emitted code."""
    plan = compiled.plan
    plain_peak, peak = max(stats["plain"]["peak"]), max(stats["compiled"]["peak"])
    error = 100.0 * (plan.predicted_peak_bytes - peak) / peak
    ratio = statistics.median(c / p for c, p in zip(stats["compiled"]["time"], stats["plain"]["time"]))
    baseline = plan.baseline_peak_bytes / MIB
    print(f"plain peak        : {plain_peak / MIB:10.1f} MiB (plan baseline {baseline:.1f} MiB)")
    print(f"compiled peak     : {peak / MIB:10.1f} MiB")
    print(f"budget            : {budget}")
    print(f"predicted peak    : {plan.predicted_peak_bytes / MIB:10.1f} MiB (error {error:+.1f}%)")
    print(f"step time ratio   : {ratio:10.2f}x compiled/plain (median)")
    print(f"solve time        : {plan.solve_seconds:10.2f} s")
    print(f"strategy          : {plan.strategy}")
    print(f"max |param diff|  : {param_diff:10.2e}")
    print("\n" + plan.summary())
    lines = compiled.code.splitlines()
    print(f"\n# emitted code, first {CODE_LINES} of {len(lines)} lines")
    print("\n".join(lines[:CODE_LINES]))


def run(build_model, input_shapes, args):
    """Build, compile, train plain and compiled copies, and print the report."""
    torch.manual_seed(args.seed)
    model = build_model(args.size)
    input_shape = input_shapes[args.size]
    plain = copy.deepcopy(model)
    x = torch.randn(input_shape)
    out_shape = output_shape(plain, x)
    compiled = fxremat.compile(model, args.budget, example_inputs=(x,), strategy="auto")
    models = {"plain": plain, "compiled": compiled}
    for m in models.values():
        preallocate_grads(m)
    batches = [random_batch(input_shape, out_shape, args.seed + i) for i in range(args.steps + 2)]
    stats = train_both(models, batches, args.seed)
    report(compiled, stats, args.budget, max_param_diff(plain, compiled))
