"""Time truth: where the time of a compiled step goes, and the predicted overhead beside the
measured one (issue 15).

For each net and budget, four variants of one model are timed side by side, interleaved (a step
of each in turn, each timed right after an untimed one of its own; medians over ``--repeats``):

- ``plain``: the model itself;
- ``none``: ``fxremat.compile(model, 1.0)`` — traced, nothing recomputed: what tracing, the
  out-of-place rewrite of in-place ops and ``RematModule``'s dispatch cost;
- ``segmented``: the plan's emitted GraphModule with every ``recompute(seg, ...)`` call replaced by
  a plain ``seg(...)`` call — the plan's structure without checkpoints;
- ``compiled``: ``fxremat.compile(model, budget)``.

The breakdown of ``compiled - plain``: *trace and dispatch* = none - plain; *segment structure* =
segmented - none; *recomputed forward* = the forward of every recomputed segment, timed alone
with the inputs it gets in a step (grad mode on, as the recomputation runs it); *checkpoint
mechanism* = compiled - segmented - recomputed forward (saved-tensor hooks, RNG state, buffer
restore, early-stop bookkeeping, allocator effects; for a rotor plan with nested checkpoints also
the nested recomputations, which the top-level forward does not repeat). All as fractions of the
plain step.

    PYTHONPATH=. python -m benchmarks.time_truth            # CPU, writes benchmarks/results/time_truth.md
    PYTHONPATH=. python -m benchmarks.time_truth --quick    # one budget per net, fewer repeats

With Colossal-AI importable (its own venv: ``benchmarks/peers/colossal.py``'s ``VENV_SETUP``),
the table of every strategy has a ``Colossal-AI rotor`` peer row:
``PYTHONPATH=. /work/venv-cai/bin/python -m benchmarks.time_truth``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.fx as fx

import fxremat
from fxremat.passes import profile
from fxremat.runtime import recompute

from .harness import add_machine_options, load_average, set_up_machine, step, synchronize, timed_step, with_grads
from .nets import resnet_chain, transformer_stack
from .peers import colossal

BUDGETS = (0.6, 0.4, "min")


def _nets():
    from examples import unet

    return [
        ("resnet_chain16", lambda: resnet_chain(depth=16), (4, 3, 64, 64)),
        ("unet", unet.build_model, (4, 3, 128, 128)),
        ("transformer4", lambda: transformer_stack(depth=4, dim=64, heads=4), (4, 128, 64)),
    ]


def _plain_call(segment, *inputs, restore=(), rng=True):
    return segment(*inputs)


def without_checkpoints(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of an emitted GraphModule whose ``recompute(seg, ...)`` calls (nested ones too)
    call ``seg(...)`` plainly."""
    gm = copy.deepcopy(gm)
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function" and node.target is recompute:
                    node.target = _plain_call
            module.recompile()
    return gm


def recomputed_forward_seconds(gm: fx.GraphModule, x: torch.Tensor, repeats: int) -> float:
    """Seconds the forwards of the top-level recomputed segments take when run alone on the
    inputs a step gives them (median over ``repeats`` of their sum)."""
    calls = []

    def recording(segment, *inputs, restore=(), rng=True):
        calls.append((segment, [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                                for t in inputs]))
        return recompute(segment, *inputs, restore=restore, rng=rng)

    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is recompute:
            node.target = recording
    probe = fx.GraphModule(gm, graph)
    step(probe, x)
    states = [{k: v.clone() for k, v in seg.state_dict().items()} for seg, _ in calls]
    totals = []
    for _ in range(repeats):
        synchronize(x.device)
        start = time.perf_counter()
        for seg, inputs in calls:
            seg(*inputs)
        synchronize(x.device)
        totals.append(time.perf_counter() - start)
    for (seg, _), state in zip(calls, states):  # the timing runs updated BatchNorm statistics
        seg.load_state_dict(state)
    return statistics.median(totals)


def measure(name, build, shape, budget, repeats: int, device: str = "cpu", options=None) -> dict:
    torch.manual_seed(0)
    model = build().train().to(device)
    x = torch.randn(*shape, device=device)
    plain = with_grads(copy.deepcopy(model))
    none = with_grads(fxremat.compile(copy.deepcopy(model), 1.0, example_inputs=(x,)))
    compiled = with_grads(fxremat.compile(copy.deepcopy(model), budget, example_inputs=(x,), **(options or {})))
    segmented = without_checkpoints(compiled.graph_module)
    variants = {"plain": plain, "none": none, "segmented": segmented, "compiled": compiled}
    times = {k: [] for k in variants}
    for _ in range(repeats):
        for label, m in variants.items():
            times[label].append(timed_step(m, x))
    t = {k: statistics.median(v) for k, v in times.items()}
    rec = recomputed_forward_seconds(compiled.graph_module, x, repeats)
    plan = compiled.plan
    p = t["plain"]
    costs = next(iter(compiled._remat.timed.values()))  # the profile the plan was made from
    predicted_forward = sum(s.recompute_cost for s in plan.segments if s.recomputed) / costs.step_cost
    machine = profile.machine_checkpoint_costs(torch.device(device))
    per_node = machine.per_saved_tensor + machine.per_saved_mib
    return {
        "calibrated": (costs.mechanism.per_checkpoint,
                       (costs.mechanism.per_saved_tensor + costs.mechanism.per_saved_mib) / per_node if per_node else 0.0),
        "predicted_forward": predicted_forward, "predicted_mechanism": plan.predicted_overhead - predicted_forward,
        "per_node": sum(c.fwd_cost + c.bwd_cost for c in costs.nodes) / costs.step_cost,
        "net": name, "budget": budget, "plain_ms": 1e3 * p, "predicted": plan.predicted_overhead,
        "measured": t["compiled"] / p - 1, "none": t["none"] / p - 1,
        "structure": (t["segmented"] - t["none"]) / p, "recompute": rec / p,
        "mechanism": (t["compiled"] - t["segmented"] - rec) / p,
        "segments": sum(s.recomputed for s in plan.segments), "strategy": plan.strategy,
        "restored": sum(len(n.mutated_buffers) for n in plan.nodes
                        if any(n.name in s.nodes for s in plan.segments if s.recomputed)),
    }


PEERS = ("exact", "approx", "rotor", "chen", "hong", "sequential")
COLOSSAL = "Colossal-AI rotor"  # a peer row where Colossal-AI imports (benchmarks/peers/colossal.py)
SAME_MEMORY = 1.01  # "no more memory": a measured peak within 1% of auto's


def strategies(name, build, shape, budget, repeats: int, device: str = "cpu", options=None) -> list[dict]:
    """Every strategy's plan at ``budget`` (and ``auto``, and ``auto`` with ``autotune=True``),
    trained side by side with the plain model: measured peak and step time of each."""
    torch.manual_seed(0)
    model = build().train().to(device)
    x = torch.randn(*shape, device=device)
    plain = with_grads(copy.deepcopy(model))
    variants = {}
    for label in ("auto", "auto+autotune") + PEERS:
        strategy, tune = ("auto", label.endswith("autotune")) if label.startswith("auto") else (label, False)
        try:
            variants[label] = with_grads(fxremat.compile(copy.deepcopy(model), budget, example_inputs=(x,),
                                                         strategy=strategy, autotune=tune, **(options or {})))
        except (fxremat.InfeasibleBudgetError, ValueError) as exc:
            print(f"  {name} {budget} {label}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
    if "auto" in variants and colossal.installed() and device == "cpu":
        budget_bytes = variants["auto"].plan.budget_bytes
        try:
            variants[COLOSSAL] = with_grads(colossal.rotor_module(copy.deepcopy(model), x, budget_bytes))
        except ValueError as exc:
            print(f"  {name} {budget} {COLOSSAL}: {exc}", flush=True)
    times = {k: [] for k in ("plain", *variants)}
    for _ in range(repeats):
        times["plain"].append(timed_step(plain, x))
        for label, m in variants.items():
            times[label].append(timed_step(m, x))
    p = statistics.median(times["plain"])
    rows = []
    for label, m in variants.items():
        _, peak = fxremat.measure_peak(step, m, x)
        plan = getattr(m, "plan", None)  # the peer's module has none
        rows.append({"net": name, "budget": budget, "variant": label,
                     "strategy": plan.strategy if plan else "chain rotor, uniform costs",
                     "peak": peak, "predicted": plan.predicted_overhead if plan else None,
                     "measured": statistics.median(times[label]) / p - 1,
                     "schedule": _schedule(plan.segments) if plan else None})
    auto = next((r for r in rows if r["variant"] == "auto"), None)
    if auto is not None:
        peers = [r for r in rows if r["variant"] != "auto" and r["peak"] <= SAME_MEMORY * auto["peak"]]
        best = min(peers, key=lambda r: r["measured"], default=None)
        for r in rows:
            r["fastest"] = best is not None and r is best
            r["same_as_auto"] = r is not auto and r["schedule"] == auto["schedule"]
        auto["vs_fastest"] = (1 + auto["measured"]) / (1 + best["measured"]) - 1 if best else 0.0
    return rows


def _schedule(segments) -> tuple:
    """What makes two plans the same schedule: each segment's nodes, whether it is recomputed, and
    its nested segments (costs and predictions differ between compiles of one schedule)."""
    return tuple((s.nodes, s.recomputed, _schedule(s.inner)) for s in segments)


def _strategy_table(rows) -> str:
    mib = 2 ** 20
    lines = ["| net | budget | plan | strategy | measured peak MiB | predicted overhead | measured overhead | "
             "auto vs fastest at ≤ its memory |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = (" (fastest at ≤ auto's memory)" if r.get("fastest") else "") + (", auto's plan" if r.get("same_as_auto") else "")
        vs = f"{r['vs_fastest']:+.1%}" if "vs_fastest" in r else ""
        lines.append(f"| {r['net']} | {r['budget']} | {r['variant']}{mark} | {r['strategy']} | {r['peak'] / mib:.2f} "
                     f"| {'—' if r['predicted'] is None else format(r['predicted'], '+.1%')} | {r['measured']:+.1%} "
                     f"| {vs} |")
    return "\n".join(lines)


def _table(rows) -> str:
    lines = ["| net | budget | strategy | recomputed segs | plain ms | predicted | measured | nothing recomputed "
             "(none) | segment structure | recomputed forward: predicted / measured | checkpoint mechanism: "
             "predicted / measured | mechanism on the model: ms a checkpoint, × machine per node | "
             "profiled nodes / step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['net']} | {r['budget']} | {r['strategy']} | {r['segments']} | {r['plain_ms']:.1f} "
                     f"| {r['predicted']:+.1%} | {r['measured']:+.1%} | {r['none']:+.1%} | {r['structure']:+.1%} "
                     f"| {r['predicted_forward']:+.1%} / {r['recompute']:+.1%} "
                     f"| {r['predicted_mechanism']:+.1%} / {r['mechanism']:+.1%} "
                     f"| {r['calibrated'][0]:.3f}, ×{r['calibrated'][1]:.2f} | {r['per_node']:.2f} |")
    return "\n".join(lines)


def _colossal_note() -> str:
    if not colossal.installed():
        return (f"No `{COLOSSAL}` rows: Colossal-AI does not import in this interpreter (it needs a venv of its "
                f"own, `benchmarks/peers/colossal.py`: `VENV_SETUP`).")
    return (f"`{COLOSSAL}`: Colossal-AI 0.5.0's `CheckpointSolverRotor` with its own tracer, meta profiler and "
            f"checkpoint codegen (`benchmarks/peers/colossal.py`, patched for torch 2.x), given `auto`'s activation "
            f"budget; on CPU its profiler times nothing, so every node costs 1 (uniform costs), and its "
            f"recomputation updates BatchNorm statistics a second time. No row where it finds no schedule within "
            f"the budget (a U-Net's skips make the chain a few large stages).")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="budget 0.4 only, 5 repeats")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--budgets", nargs="+", metavar="BUDGET",
                        help=f"fractions of the plain peak or min (default {' '.join(map(str, BUDGETS))}; "
                             "0.4 with --quick)")
    parser.add_argument("--dp-early-stop", action="store_true",
                        help="plan with dp_early_stop=True (writes time_truth_early_stop.md)")
    add_machine_options(parser)
    args = parser.parse_args(argv)
    machine = set_up_machine(parser, args, "benchmarks.time_truth")
    options = {"dp_early_stop": True} if args.dp_early_stop else {}
    budgets = (tuple(b if b == "min" else float(b) for b in args.budgets) if args.budgets
               else (0.4,) if args.quick else BUDGETS)
    mechanism = profile.machine_checkpoint_costs(torch.device(machine.device))
    print(f"checkpoint mechanism: {mechanism}", flush=True)
    repeats = 5 if args.quick else args.repeats
    path = machine.out / (("time_truth_quick" if args.quick else "time_truth")
                          + ("_early_stop" if args.dp_early_stop else "") + ".md")
    rows, peer_rows = [], []
    for name, build, shape in _nets():
        shape = machine.shape(shape)
        for budget in budgets:
            try:
                row = measure(name, build, shape, budget, repeats, machine.device, options)
            except fxremat.InfeasibleBudgetError as exc:
                print(f"{name} {budget}: {exc}", flush=True)
                continue
            print(_table([row]).splitlines()[-1], flush=True)
            rows.append(row)
            found = strategies(name, build, shape, budget, repeats, machine.device, options)
            print("\n".join(_strategy_table(found).splitlines()[2:]), flush=True)
            peer_rows += found
            # written after each net and budget: a run stopped at its time limit keeps its rows
            path.write_text(_text(machine, mechanism, repeats, rows, peer_rows, partial=True))
    path.write_text(_text(machine, mechanism, repeats, rows, peer_rows))
    print(f"wrote {path}")


def _text(machine, mechanism, repeats, rows, peer_rows, partial=False) -> str:
    return (f"# Time truth: predicted vs measured overhead, and where the time goes\n\n{machine.environment()}  \n"
            + ("**Partial**: the run had not ended when this was written (its rows so far).  \n" if partial else "")
            + f"load average at the end: {load_average()}  \n"
            f"checkpoint mechanism fitted on this machine (synthetic chains): {mechanism.per_checkpoint * 1e3:.1f} µs "
            f"a checkpoint, {mechanism.per_saved_tensor * 1e3:.1f} µs a saved tensor, "
            f"{mechanism.per_saved_mib * 1e3:.2f} µs a saved MiB; each plan counts it as calibrated on its model "
            f"(`fxremat.passes.calibrate`: a cost a checkpoint and a factor on the machine's per-node cost, "
            f"the column before last)\n\n"
            f"Fractions of the plain step (medians of {repeats} interleaved steps; see the script's docstring for "
            f"the variants).\n\n{_table(rows)}\n\n"
            f"## Every strategy at each budget\n\nEach strategy's own plan (`strategy=`), `auto`, and `auto` with "
            f"`autotune=True`, trained side by side with the plain model (medians of {repeats} interleaved steps; "
            f"peaks measured). The last column: `auto`'s step time over the fastest plan whose measured peak is at "
            f"most 1% above auto's (its own or another strategy's); issue 15 asks for at most +3%. `auto's plan`: the "
            f"same schedule as `auto`'s (segments, recomputed ones, nested ones), compiled and measured apart: "
            f"how far one plan's measured time moves in this loop. {_colossal_note()}\n\n"
            f"{_strategy_table(peer_rows)}\n")


if __name__ == "__main__":
    main()
