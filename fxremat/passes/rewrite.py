"""Emit the recomputing ``GraphModule`` for a schedule: :func:`rewrite`.

Every recomputed segment V_i becomes a submodule ``seg_<i>`` (a GraphModule holding exactly
V_i's nodes) called as ``recompute(self.seg_<i>, *inputs, restore=(...))`` in the top-level
code, ``restore`` naming the buffers the segment mutates (put back after its recomputation), and
``rng=False`` where no node of the segment draws random numbers (its recomputation need not
restore the RNG state); the last segment's nodes run inline, plainly. Inputs of a segment are the values it reads from earlier
segments or graph inputs; its outputs are the values later segments or the graph output read.
The input GraphModule is not modified; submodules, parameters and buffers are shared with it.

A view is taken where eager PyTorch takes it among the readers of its base. Autograd sums a
value's gradient contributions in the order their backward nodes run, which follows the order the
forward created them in; a view (``y.permute(...)``) is tied to its base's segment, so a reader of
``y`` that ran before the view in the traced code could run after it in the emitted one (CoAtNet's
``avg_pool(y)`` and ``y.permute(...)``): the gradient of ``y`` then took the other term's memory
layout (conv bias gradients differed in the last bits) and, with three terms, another sum. Such a
view is emitted in the segment of the reader of its base that precedes it, where all its own
readers run at or after that segment (the planner's ordering edges see to it,
:func:`fxremat.core.order_edges`). It owns no storage, so memory is the same.

A recomputed segment may carry its own recomputation schedule (``inner``, rotor's nested
checkpoints): its submodule is then itself rewritten, so ``seg_<i>`` calls
``recompute(self.seg_<j>, ...)`` on the parts of it that are checkpointed again inside it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..runtime import recompute

__all__ = ["rewrite", "buffers_read"]


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
            inner=None, *, random: set[str] | None = None, views: set[str] = frozenset()) -> fx.GraphModule:
    """Return a new GraphModule running ``gm`` segment by segment (see the module docstring).

    ``segments`` are lists of call-node names in graph order, given in the order of the lower
    sets (so every segment only reads earlier segments); ``recomputed`` is a flag per segment,
    ``mutated_buffers`` the buffers each node mutates (from profiling). ``inner`` (optional) has
    one entry per segment: ``None`` or, for a recomputed segment, ``(segments, recomputed,
    inner)`` of the same form over that segment's nodes, its nested checkpoints. ``views``: the
    nodes that own no storage (views of their input), taken where eager takes them.
    """
    inner = inner or [None] * len(segments)
    if views:
        segments, recomputed, inner = _views_in_order(gm, segments, recomputed, inner, views)
    by_name = {n.name: n for n in gm.graph.nodes}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    top = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, object] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = top.node_copy(node)
    for i, (names, rec, nested) in enumerate(zip(segments, recomputed, inner)):
        # in traced order: the order of the cost graph may take a view before an earlier reader
        members = sorted((by_name[name] for name in names), key=position.get)
        if rec:
            _emit_segment(top, gm, i, members, env, attrs, mutated_buffers, nested, random, views)
            continue
        for node in members:
            env[node] = _copy_inline(top, node, env, gm, attrs)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    _copy_inline(top, out, env, gm, attrs)
    top.lint()
    # The segments' modules were compiled when made; handed to the constructor, torch.fx compiles
    # every GraphModule child again (and theirs, once per level of nesting): they are set after.
    made = {f"seg_{i}": attrs[f"seg_{i}"] for i, rec in enumerate(recomputed) if rec}
    result = fx.GraphModule({**attrs, **{name: torch.nn.Module() for name in made}}, top, "RematGraph")
    for name, seg in made.items():
        setattr(result, name, seg)
    return result


def _views_in_order(gm: fx.GraphModule, segments, recomputed, inner, views):
    """``(segments, recomputed, inner)`` with each view of ``views`` moved, where eager took it
    after a reader of its base that the schedule emits later, into that reader's segment (in
    graph order there, and in the same nested segment as that reader); not where a reader of the
    view itself runs before that segment. Segments left empty are dropped."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    segments = [list(names) for names in segments]
    inner = list(inner)
    where = {name: i for i, names in enumerate(segments) for name in names}
    last = len(segments)  # the graph's output
    for node in sorted((by_name[v] for v in views if v in where), key=position.get):
        bases = [a for a in node.all_input_nodes if a.op != "get_attr"]
        if len(bases) != 1:  # not a view of one value
            continue
        before = [u for u in bases[0].users if position[u] < position[node] and u.name in where]
        if not before:
            continue
        reader = max(before, key=position.get)
        home, there = where[node.name], where[reader.name]
        chain = _tied_views(node, views, where, home)
        readers = {u.name for v in chain for u in v.users} - {v.name for v in chain}
        if there <= home or any(where.get(u, last) < there for u in readers) \
                or not _reads_after(inner[there], reader.name, readers):
            continue
        for v in chain:
            segments[home].remove(v.name)
            inner[home] = _without(inner[home], v.name)
            segments[there] = sorted(segments[there] + [v.name], key=lambda n: position[by_name[n]])
            inner[there] = _with(inner[there], v.name, reader.name, position, by_name)
            where[v.name] = there
    kept = [i for i, names in enumerate(segments) if names]
    return [segments[i] for i in kept], [recomputed[i] for i in kept], [inner[i] for i in kept]


def _without(nested, name: str):
    """A nested schedule ``(segments, recomputed, inner)`` (or ``None``) without node ``name``."""
    if nested is None:
        return None
    segments, recomputed, inner = nested
    out = ([], [], [])
    for names, rec, sub in zip(segments, recomputed, inner):
        names = [n for n in names if n != name]
        if names:
            out[0].append(names)
            out[1].append(rec)
            out[2].append(_without(sub, name))
    return out


def _tied_views(node: fx.Node, views, where: dict, home: int) -> list[fx.Node]:
    """``node`` and the views of it (and of those) in the same segment."""
    chain, stack = [], [node]
    while stack:
        v = stack.pop()
        chain.append(v)
        stack += [u for u in v.users if u.name in views and where.get(u.name) == home and u not in chain]
    return chain


def _reads_after(nested, beside: str, readers: set[str]) -> bool:
    """Whether no node of ``readers`` runs in a nested segment before the one of ``beside``."""
    if nested is None:
        return True
    segments, _, inner = nested
    at = next(i for i, names in enumerate(segments) if beside in names)
    if any(readers.intersection(names) for names in segments[:at]):
        return False
    return _reads_after(inner[at], beside, readers)


def _with(nested, name: str, beside: str, position, by_name):
    """A nested schedule (or ``None``) with node ``name`` in the innermost segment of ``beside``."""
    if nested is None:
        return None
    segments, recomputed, inner = nested
    segments, inner = [list(s) for s in segments], list(inner)
    for i, names in enumerate(segments):
        if beside in names:
            segments[i] = sorted(names + [name], key=lambda n: position[by_name[n]])
            inner[i] = _with(inner[i], name, beside, position, by_name)
    return segments, list(recomputed), inner


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


def _emit_segment(top, gm, i, members, env, attrs, mutated_buffers, nested=None, random=None, views=frozenset()) -> None:
    inputs, outputs = _segment_io(gm.graph, set(members))
    mutated = {b for n in members for b in mutated_buffers.get(n.name, ())}
    reads = buffers_read(gm, members, {b for names in mutated_buffers.values() for b in names})
    name = f"seg_{i}"
    seg = _segment_module(gm, members, inputs, outputs)
    if nested is not None:
        sub_segments, sub_recomputed, sub_inner = nested
        flat, seg = seg, rewrite(seg, sub_segments, sub_recomputed, mutated_buffers, sub_inner, random=random,
                                 views=views)
        for buffer in mutated | reads:  # restored around this segment's recomputation: reachable from it
            _attach(seg, flat, buffer.rpartition(".")[0])
    attrs[name] = seg
    fn = top.get_attr(name)
    args = (fn, *[env[a] for a in inputs])
    call_name = outputs[0].name if len(outputs) == 1 else f"{name}_out"
    kwargs = {"restore": _restore_names(gm, mutated)} if mutated else {}
    if reads:
        kwargs["reads"] = tuple(sorted(reads))
    if random is not None and not any(n.name in random for n in members):
        kwargs["rng"] = False
    call = top.create_node("call_function", recompute, args, kwargs, name=call_name)
    if len(outputs) == 1:
        env[outputs[0]] = call
        return
    for k, o in enumerate(outputs):
        env[o] = top.create_node("call_function", operator.getitem, (call, k), name=o.name)


# Calls that read running statistics in training only to update them: their output does not
# depend on the values, so their recomputation needs none of the forward's (the update is undone).
_STATISTICS_UPDATES = (torch.nn.functional.batch_norm, torch.batch_norm, torch.nn.functional.instance_norm,
                       torch.ops.aten.batch_norm.default, torch.ops.aten._native_batch_norm_legit.default,
                       torch.ops.aten._native_batch_norm_legit_functional.default,
                       torch.ops.aten.native_batch_norm.default)


def buffers_read(gm: fx.GraphModule, members, written: set[str]) -> set[str]:
    """Buffers of ``written`` (those the step mutates) that ``members`` read: through a ``get_attr``
    (``x * (1 + self.steps)``, ``self.steps.add_(1)``) or inside a leaf module that mutates its own
    (not a normalization layer: in training it only updates its statistics). A recomputation
    that read them as the rest of the step left them (a counter one step ahead) differentiated
    another function than the forward ran: silently wrong gradients. (Also what
    :mod:`fxremat.passes.lower` counts: the recomputation's copies of them.)"""
    reads = set()
    for n in members:
        for a in n.all_input_nodes:
            if (a.op == "get_attr" and a.target in written
                    and not (n.op == "call_function" and n.target in _STATISTICS_UPDATES)):
                reads.add(a.target)
        if n.op == "call_module" and not isinstance(gm.get_submodule(n.target), torch.nn.modules.batchnorm._NormBase):
            reads.update(b for b in written if b.startswith(f"{n.target}."))
    return reads


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
