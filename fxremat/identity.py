"""Which graph a plan belongs to, and whether a plan fits a graph.

:func:`graph_key` hashes a traced graph and its input signature; :func:`check_plan` refuses a plan
made for another graph with :class:`PlanMismatchError`; :func:`plan_schedule` checks a plan's
segments against the graph's nodes and edges and gives the :class:`~fxremat.simulate.Schedule`.
"""

from __future__ import annotations

import hashlib
import json
import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from .records import Plan
from .core import Schedule

__all__ = ["graph_key", "check_plan", "plan_schedule", "PlanMismatchError"]


class PlanMismatchError(ValueError):
    """A saved plan was made for another graph or input signature than the one it is used on."""


def _input_signature(example_inputs) -> list:
    leaves = tree_flatten(tuple(example_inputs))[0]
    return [
        [list(x.shape), str(x.dtype), x.device.type, x.requires_grad] if isinstance(x, torch.Tensor)
        else [type(x).__name__, repr(x)]
        for x in leaves
    ]


def _with_defaults(gm: fx.GraphModule, inputs: tuple) -> tuple:
    """``inputs`` followed by the defaults of the forward's remaining parameters."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return (*inputs, *(p.args[0] for p in placeholders[len(inputs):] if p.args))


def graph_key(gm: fx.GraphModule, example_inputs) -> str:
    """Hash of a traced graph and its input signature (hex sha256).

    It covers the graph's code, the class of every submodule, the name, shape and dtype of every
    parameter and buffer, and each input's shape, dtype, device type and ``requires_grad``
    (values of non-tensor inputs by ``repr``; omitted trailing inputs count as their defaults).
    Two models with the same code but other layer widths get different keys; the same model
    traced twice gets the same key.

    >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 4))
    >>> graph_key(gm, (torch.ones(2, 3),)) == graph_key(gm, (torch.zeros(2, 3),))
    True
    >>> graph_key(gm, (torch.ones(2, 3),)) == graph_key(gm, (torch.ones(5, 3),))
    False
    """
    content = {
        "code": gm.code,
        "modules": [[name, type(m).__qualname__] for name, m in gm.named_modules()],
        "tensors": [[name, list(t.shape), str(t.dtype)]
                    for name, t in [*gm.named_parameters(), *gm.named_buffers()]],
        "inputs": _input_signature(_with_defaults(gm, tuple(example_inputs))),
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def check_plan(plan: Plan, gm: fx.GraphModule, example_inputs, *, origin: str = "the plan") -> None:
    """Raise :class:`PlanMismatchError` unless ``plan`` was made for ``gm`` on these inputs."""
    key = graph_key(gm, example_inputs)
    if not plan.graph_key:
        raise PlanMismatchError(
            f"fxremat: {origin} has no graph key, so it cannot be checked against this model; "
            "plan again with fxremat.plan or the fxremat command line and save that plan"
        )
    if plan.graph_key != key:
        shapes = ", ".join(f"{'x'.join(map(str, s[0])) or 'scalar'} {s[1].removeprefix('torch.')} {s[2]}"
                           + (" requiring grad" if s[3] else "")
                           for s in _input_signature(example_inputs) if len(s) == 4)
        raise PlanMismatchError(
            f"fxremat: {origin} was made for another graph or input signature (plan key "
            f"{plan.graph_key[:12]}, this model on inputs [{shapes}] has key {key[:12]}); plan this "
            "model and input again (fxremat.plan(...).save(path)) and load that plan (a plan is for one "
            "input signature: with a DataLoader whose last batch is smaller, pass drop_last=True)"
        )


def plan_schedule(plan: Plan, graph, *, origin: str = "the plan") -> Schedule:
    """The :class:`~fxremat.simulate.Schedule` of ``plan``'s segments on ``graph``, checked: every
    call node in exactly one segment, every segment after the segments its inputs come from, nested
    segments covering their parent. Raises :class:`PlanMismatchError` naming the segment."""
    index = {name: v for v, name in enumerate(graph.names)}
    return _schedule_of(plan.segments, index, graph, set(index.values()), origin, "segments")


def _schedule_of(segments, index, graph, expected: set, origin: str, where: str) -> Schedule:
    done, seen, parts, inner = set(), set(), [], []
    for i, seg in enumerate(segments):
        unknown = [n for n in seg.nodes if n not in index]
        if unknown:
            raise PlanMismatchError(f"fxremat: {origin}: field plan.{where}[{i}].nodes names {unknown[:3]}, not call "
                                    "nodes of this graph; plan this model again")
        ids = tuple(sorted(index[n] for n in seg.nodes))
        twice = [graph.names[v] for v in ids if v in seen] or (
            [n for n in seg.nodes if seg.nodes.count(n) > 1])
        outside = [graph.names[v] for v in ids if v not in expected]
        if twice or outside:
            raise PlanMismatchError(f"fxremat: {origin}: field plan.{where}[{i}].nodes has "
                                    f"{(twice or outside)[:3]} {'more than once' if twice else 'outside its parent'}; "
                                    "plan this model again")
        seen.update(ids)
        members = set(ids)
        late = [(graph.names[p], graph.names[v]) for v in ids for p in graph.preds[v]
                if p in expected and p not in done and p not in members]
        if late:
            raise PlanMismatchError(f"fxremat: {origin}: field plan.{where}[{i}] runs {late[0][1]} before its input "
                                    f"{late[0][0]} (in a later segment); plan this model again")
        done |= members
        parts.append(ids)
        nested = _schedule_of(seg.inner, index, graph, members, origin, f"{where}[{i}].inner") if seg.inner else None
        inner.append(nested)
    missing = sorted(expected - seen)
    if missing:
        raise PlanMismatchError(f"fxremat: {origin}: field plan.{where} leaves out {len(missing)} call nodes "
                                f"({[graph.names[v] for v in missing[:3]]}); plan this model again")
    recomputed = tuple(seg.recomputed for seg in segments)
    return Schedule(tuple(parts), recomputed, tuple(inner) if any(x is not None for x in inner) else ())
