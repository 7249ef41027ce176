"""Emit the recomputing ``GraphModule`` for a schedule: :func:`rewrite`.

Every recomputed segment V_i becomes a submodule ``seg_<i>`` (a GraphModule holding exactly
V_i's nodes) called as ``recompute(self.seg_<i>, *inputs, restore=(...))`` in the top-level
code, ``restore`` naming the buffers the segment mutates (put back after its recomputation), and
``rng=False`` where no node of the segment draws random numbers (its recomputation need not
restore the RNG state); the last segment's nodes run inline, plainly. Inputs of a segment are the values it reads from earlier
segments or graph inputs; its outputs are the values later segments or the graph output read.
The input GraphModule is not modified; submodules, parameters and buffers are shared with it.

A recomputed segment may carry its own recomputation schedule (``inner``, rotor's nested
checkpoints): its submodule is then itself rewritten, so ``seg_<i>`` calls
``recompute(self.seg_<j>, ...)`` on the parts of it that are checkpointed again inside it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..runtime import recompute

__all__ = ["rewrite"]


def _segment_io(graph: fx.Graph, members: set[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """Values read by ``members`` from outside (in graph order) and values read outside."""
    inputs, seen = [], set()
    outputs = []
    for node in graph.nodes:
        if node not in members:
            continue
        for a in node.all_input_nodes:
            if a not in members and a.op != "get_attr" and a not in seen:
                seen.add(a)
                inputs.append(a)
        if any(u not in members for u in node.users):
            outputs.append(node)
    return inputs, outputs


def _segment_module(gm: fx.GraphModule, nodes: list[fx.Node], inputs, outputs) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
    for node in nodes:
        for a in node.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = graph.get_attr(a.target)
        env[node] = graph.node_copy(node, lambda a: env[a])
    # A segment whose values nothing reads still runs (for its side effects) and returns ().
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    graph.lint()
    return fx.GraphModule(gm, graph, "Segment")


def rewrite(gm: fx.GraphModule, segments, recomputed, mutated_buffers: dict[str, tuple[str, ...]],
            inner=None, *, random: set[str] | None = None) -> fx.GraphModule:
    """Return a new GraphModule running ``gm`` segment by segment (see the module docstring).

    ``segments`` are lists of call-node names in graph order, given in the order of the lower
    sets (so every segment only reads earlier segments); ``recomputed`` is a flag per segment,
    ``mutated_buffers`` the buffers each node mutates (from profiling). ``inner`` (optional) has
    one entry per segment: ``None`` or, for a recomputed segment, ``(segments, recomputed,
    inner)`` of the same form over that segment's nodes, its nested checkpoints.
    """
    inner = inner or [None] * len(segments)
    by_name = {n.name: n for n in gm.graph.nodes}
    top = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, object] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = top.node_copy(node)
    for i, (names, rec, nested) in enumerate(zip(segments, recomputed, inner)):
        members = [by_name[name] for name in names]
        if rec:
            _emit_segment(top, gm, i, members, env, attrs, mutated_buffers, nested, random)
            continue
        for node in members:
            env[node] = _copy_inline(top, node, env, gm, attrs)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    _copy_inline(top, out, env, gm, attrs)
    top.lint()
    return fx.GraphModule(attrs, top, "RematGraph")


def _copy_inline(top: fx.Graph, node: fx.Node, env, gm: fx.GraphModule, attrs) -> fx.Node:
    for a in node.all_input_nodes:
        if a.op == "get_attr" and a not in env:
            attrs[a.target] = _resolve(gm, a.target)
            env[a] = top.node_copy(a)
    if node.op == "call_module":
        attrs[node.target] = _resolve(gm, node.target)
    return top.node_copy(node, lambda a: env[a])


def _resolve(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _emit_segment(top, gm, i, members, env, attrs, mutated_buffers, nested=None, random=None) -> None:
    inputs, outputs = _segment_io(gm.graph, set(members))
    mutated = {b for n in members for b in mutated_buffers.get(n.name, ())}
    name = f"seg_{i}"
    seg = _segment_module(gm, members, inputs, outputs)
    if nested is not None:
        sub_segments, sub_recomputed, sub_inner = nested
        flat, seg = seg, rewrite(seg, sub_segments, sub_recomputed, mutated_buffers, sub_inner, random=random)
        for buffer in mutated:  # restored around this segment's recomputation: reachable from it
            _attach(seg, flat, buffer.rpartition(".")[0])
    attrs[name] = seg
    fn = top.get_attr(name)
    args = (fn, *[env[a] for a in inputs])
    call_name = outputs[0].name if len(outputs) == 1 else f"{name}_out"
    kwargs = {"restore": _restore_names(gm, mutated)} if mutated else {}
    if random is not None and not any(n.name in random for n in members):
        kwargs["rng"] = False
    call = top.create_node("call_function", recompute, args, kwargs, name=call_name)
    if len(outputs) == 1:
        env[outputs[0]] = call
        return
    for k, o in enumerate(outputs):
        env[o] = top.create_node("call_function", operator.getitem, (call, k), name=o.name)


def _restore_names(gm: fx.GraphModule, mutated: set[str]) -> tuple[str, ...]:
    """``mutated`` (buffer names) as the emitted code names them: a module whose own buffers are
    all in it by its path (``'down.0.1'`` for a BatchNorm's three), other buffers by name."""
    by_module: dict[str, set[str]] = {}
    for name in mutated:
        prefix, _, last = name.rpartition(".")
        by_module.setdefault(prefix, set()).add(last)
    names = []
    for prefix, owned in by_module.items():
        own = set(gm.get_submodule(prefix)._buffers)
        names += [prefix] if prefix and owned == own else [f"{prefix}.{b}" if prefix else b for b in owned]
    return tuple(sorted(names))


def _attach(dst: torch.nn.Module, src: torch.nn.Module, path: str) -> None:
    """Make ``dst.get_submodule(path)`` the module ``src.get_submodule(path)``, adding empty
    containers on the way where ``dst`` lacks them (a nested segment's top level only holds
    the modules its own code calls)."""
    parts = path.split(".") if path else []
    holder = dst
    for i, part in enumerate(parts):
        if not hasattr(holder, part):
            holder.add_module(part, src.get_submodule(path) if i == len(parts) - 1 else torch.nn.Module())
        holder = getattr(holder, part)
