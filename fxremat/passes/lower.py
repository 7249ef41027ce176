"""Lowering: a traced ``GraphModule`` and its profile become a :class:`~fxremat.core.CostGraph`.

Call nodes are numbered in FX graph order; data edges follow ``all_input_nodes``; the ordering
edges (:func:`fxremat.core.order_edges`) keep in traced order the consumers of each value, of
each graph input and attribute, the calls of a shared module, the readers of a shared parameter,
and the nodes that draw random numbers, so that every strategy gives bitwise-equal gradients and
dropout masks. The nodes holding an activation that some node writes in place (the value, its
views, the in-place results) are tied into one group (:func:`fxremat.core.merged_anchors`),
and they and their readers are kept in traced order: a write through a view
(``zeros[:, 1:].copy_(ids)`` in a captured graph) is not ordered before the later readers of
``zeros`` by any data edge. Every in-place write is also tied to the producer of the value it
writes (a buffer's ``running_mean.mul_(m).add_(x)`` is never cut between the two), and a write
into a view to the nodes that read what it wrote (:func:`_written_first`).
"""

from __future__ import annotations

from dataclasses import replace

import torch.fx as fx
from torch.utils._pytree import tree_flatten

from ..core import TIME_RESOLUTION, CostGraph, anchors, merged_anchors, order_edges
from .profile import GraphCosts
from .rewrite import buffers_read
from .trace import CALL_OPS, writes_in_place, written_inputs

__all__ = ["build_graph", "with_mechanism", "LOSS_OUTPUT_COPIES"]

LOSS_OUTPUT_COPIES = 2  # beside its log-softmax, a cross-entropy's backward makes that gradient and its input's


def _call_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if a.op in CALL_OPS]


def _output_nodes(graph: fx.Graph) -> set[fx.Node]:
    out = next(n for n in graph.nodes if n.op == "output")
    return {a for a in out.all_input_nodes if a.op in CALL_OPS}


def build_graph(gm: fx.GraphModule, costs: GraphCosts) -> CostGraph:
    """Combine the traced graph and its profile into a :class:`~fxremat.core.CostGraph`.

    ``loss_bytes``: what a cross-entropy per differentiable output holds at its peak beyond them
    and their gradients (:func:`_loss_bytes`), unless the model returns its loss (one one-element
    output that takes a gradient: ``loss_output``).
    """
    calls = [n for n in gm.graph.nodes if n.op in CALL_OPS]
    index = {n.name: i for i, n in enumerate(calls)}
    by_name = {c.name: c for c in costs.nodes}
    if set(by_name) != set(index):
        raise AssertionError("fxremat.passes.lower: the profile and the graph disagree on the call nodes")
    outputs = _output_nodes(gm.graph)
    node_costs = [by_name[n.name] for n in calls]
    roots = tuple(index.get(c.root, v) for v, c in enumerate(node_costs))
    preds = _written_first(gm, calls, roots,
                           [sorted({index[a.name] for a in _call_inputs(n)}) for n in calls])
    succs: list[list[int]] = [[] for _ in calls]
    for v, ps in enumerate(preds):
        for p in ps:
            succs[p].append(v)
    total = sum(c.fwd_cost for c in node_costs) or 1.0
    unit = total / TIME_RESOLUTION
    out_nodes = [v for v, n in enumerate(calls) if n in outputs and node_costs[v].grad_bytes]
    saved = []
    for v, c in enumerate(node_costs):
        owners = {index[s] for s in c.saved_inputs if s in index} | ({v} if c.saves_output else set())
        saved.append(tuple(sorted(owners)))
    shared, cast_shared = _shared_params(gm, node_costs)
    cast_bytes, cast_reads, cast_saves = _casts(node_costs)
    # The loss is the output node the backward starts from: after ``loss += 0.4 * aux_loss`` (in
    # place, as UperNet's) that is the write, not the storage's first node, whose backward alone
    # would leave the auxiliary branch without a gradient (the prediction then missed its
    # backward: 131 KB under on UperNet, and the compiled peak 1.13x its budget).
    last = {roots[v]: v for v in out_nodes}  # the latest output node of each storage
    # one element: a returned loss (CLIP's, beside its 2x2 logits, which in bf16 are 8 bytes, as
    # many as a float64 loss: counted by bytes, two "losses" were found and none taken, and the plain
    # peak was predicted +2.6% under autocast)
    scalars = [v for r, v in last.items() if node_costs[r].grad_numel == 1]
    loss_output = scalars[0] if len(scalars) == 1 else None
    written = _written_storages(gm, calls, node_costs, index)
    # an in-place write stays with the producer of what it writes: a segment boundary between them
    # would hand the write a checkpoint input (a buffer's `mul_` result to its `add_`), which the
    # write changes before the checkpoint recomputes from it
    in_place = [(index[p.name], index[u.name]) for u in calls for p in written_inputs(gm, u) if p.name in index]
    # a write into a view stays with its readers: its backward (CopySlices) starts before the
    # recomputation its own saved tensors start, so a boundary right after it ran both at once
    # (1.09x the budget on an attention with a masked slice)
    into_views = [(w, *succs[w]) for p, w in in_place
                  if roots[w] == roots[p] != p and not writes_in_place(gm, calls[p]) and succs[w]]
    anchor = merged_anchors(preds, anchors(preds, [c.tensor_output and c.root == c.name for c in node_costs]),
                            [holders for holders, _ in written] + in_place + into_views)
    state_bytes, state_reads, state_writes = _state(gm, calls, node_costs)
    chains = ((tuple(v for v, c in enumerate(node_costs) if c.uses_rng),) + _order_chains(gm.graph, index)
              + tuple(readers for _, readers in shared) + tuple(touched for _, touched in written))
    return CostGraph(
        names=tuple(n.name for n in calls),
        preds=preds,
        succs=tuple(tuple(s) for s in succs),
        order_preds=order_edges(preds, anchor, chains),
        anchor=anchor,
        is_output=tuple(n in outputs for n in calls),
        time=tuple(round(c.fwd_cost / unit) for c in node_costs),
        out_bytes=tuple(c.out_bytes for c in node_costs),
        root=roots,
        saved=tuple(saved),
        extra_bytes=tuple(c.extra_bytes for c in node_costs),
        grad_bytes=tuple(c.grad_bytes for c in node_costs),
        grad_alias=tuple(c.grad_alias for c in node_costs),
        transient_bytes=tuple(c.fwd_transient_bytes for c in node_costs),
        bwd_transient_bytes=tuple(c.bwd_transient_bytes for c in node_costs),
        param_grad_bytes=tuple(c.param_grad_bytes for c in node_costs),
        cast_bytes=cast_bytes,
        cast_reads=cast_reads,
        cast_saves=cast_saves,
        bwd_unpack_bytes=(tuple(c.bwd_unpack_bytes for c in node_costs)
                          if any(c.bwd_unpack_bytes for c in node_costs) else ()),
        bwd_released_bytes=(tuple(c.bwd_released_bytes for c in node_costs)
                            if any(c.bwd_released_bytes for c in node_costs) else ()),
        held_bytes=tuple(c.held_bytes for c in node_costs) if any(c.held_bytes for c in node_costs) else (),
        unsaved_item_bytes=(tuple(c.unsaved_item_bytes for c in node_costs)
                            if any(c.unsaved_item_bytes for c in node_costs) else ()),
        bwd_tail_bytes=(tuple(c.bwd_tail_bytes for c in node_costs)
                        if any(c.bwd_tail_bytes for c in node_costs) else ()),
        state_bytes=state_bytes,
        state_reads=state_reads,
        state_writes=state_writes,
        bwd_freed_inputs=(tuple(tuple(sorted(index[a] for a in c.bwd_freed_inputs if a in index)) for c in node_costs)
                          if any(c.bwd_freed_inputs for c in node_costs) else ()),
        shared_params=shared,
        cast_shared=cast_shared,
        loss_bytes=0 if loss_output is not None else _loss_bytes(_output_order(gm.graph, index), node_costs),
        loss_forward_bytes=0 if loss_output is not None else _loss_forward_bytes(_output_order(gm.graph, index),
                                                                                 node_costs),
        loss_output=loss_output,
        **_mechanism_times(costs, node_costs, unit),
        time_unit=unit,
        step_cost=costs.step_cost,
        cost_unit=costs.cost_unit,
    )


def with_mechanism(graph: CostGraph, costs: GraphCosts) -> CostGraph:
    """``graph``, built from a profile of the same nodes and forward times, with the checkpoint
    mechanism of ``costs`` (as :func:`build_graph` would make it, without building it again)."""
    by_name = {c.name: c for c in costs.nodes}
    return replace(graph, **_mechanism_times(costs, [by_name[name] for name in graph.names], graph.time_unit))


def _mechanism_times(costs: GraphCosts, node_costs, unit: float) -> dict:
    """The graph's ``checkpoint_time`` and per-node ``hook_time`` from ``costs.mechanism`` (0 without one)."""
    mechanism = costs.mechanism
    return dict(checkpoint_time=round(mechanism.per_checkpoint / unit) if mechanism else 0,
                hook_time=tuple(round(mechanism.of_node(c.saved_count, c.saved_bytes) / unit) if mechanism else 0
                                for c in node_costs))


def _state(gm: fx.GraphModule, calls, node_costs):
    """``(state_bytes, state_reads, state_writes)`` of :class:`~fxremat.core.CostGraph`: the buffers
    the step mutates (in name order) and their bytes, and for each node those of them it reads as
    a recomputed segment's ``reads=`` names them (:func:`~fxremat.passes.rewrite.buffers_read`) and
    those it mutates (its ``restore=``); all three empty where the step mutates none."""
    written = sorted({b for c in node_costs for b in c.mutated_buffers})
    if not written:
        return (), (), ()
    index = {name: i for i, name in enumerate(written)}
    state_bytes = tuple(b.numel() * b.element_size() for b in map(gm.get_buffer, written))
    reads = tuple(tuple(sorted(index[b] for b in buffers_read(gm, [n], set(written)))) for n in calls)
    writes = tuple(tuple(sorted(index[b] for b in c.mutated_buffers)) for c in node_costs)
    return state_bytes, reads, writes
def _output_order(graph: fx.Graph, index: dict) -> list[int]:
    """The call nodes the graph returns, in the order of its flattened output (repeats kept): the
    order in which a loss over the outputs meets them."""
    out = next(n for n in graph.nodes if n.op == "output")
    return [index[a.name] for a in tree_flatten(out.args)[0] if isinstance(a, fx.Node) and a.name in index]


def _loss_bytes(order, node_costs) -> int:
    """What the assumed loss holds at its peak beyond the outputs and their gradients (which the
    simulator gives at once when the backward starts): a cross-entropy per output, summed
    (:func:`fxremat.passes.profile._loss_part`). Autograd runs the parts' backwards one at a
    time, the last output's first (their nodes were made last) and all before the model's: when
    part k runs, each output before it still holds its log-softmax and target, each after it its
    gradient, and part k its log-softmax, the gradient of that and its output's gradient
    (``LOSS_OUTPUT_COPIES`` buffers of its log-softmax's size; its target is gone). Counted as
    two buffers of every output at once beside all the gradients, the plain peak of OWL-ViT (nine
    outputs) was over-predicted by 5.6%; without the targets, RAFT's (twelve flows, two classes:
    each target as large as its flow) was under-predicted by 2.6%."""
    last = {v: k for k, v in enumerate(order)}
    held = targets = peak = 0
    for k, v in enumerate(order):
        c = node_costs[v]
        if not c.loss_held_bytes:  # a part that is not a cross-entropy's: its gradient counted whole
            continue
        held += c.loss_held_bytes - (c.grad_bytes if last[v] == k else 0)
        peak = max(peak, held + LOSS_OUTPUT_COPIES * c.loss_held_bytes + targets)
        targets += c.loss_target_bytes
    return max(0, peak, held + targets)  # (the loss's forward holds every log-softmax and target)


def _loss_forward_bytes(order, node_costs) -> int:
    """The peak of the assumed loss's forward beyond the outputs (``CostGraph.loss_forward_bytes``):
    the parts run in output order, each making its target, then (a bf16 output under autocast) a
    float32 copy of its output, from which its log-softmax is made and which then goes; each
    part's log-softmax and target stay for the backward."""
    held = peak = 0
    for v in dict.fromkeys(order):
        c = node_costs[v]
        if not c.loss_held_bytes:
            continue
        peak = max(peak, held + c.loss_target_bytes + c.loss_cast_bytes + c.loss_held_bytes)
        held += c.loss_held_bytes + c.loss_target_bytes
    return peak


def _written_first(gm: fx.GraphModule, calls, roots, preds) -> tuple[tuple[int, ...], ...]:
    """The data edges, where a node reads a value that an in-place op wrote after it was made, from
    that write: ``attn.mul_(mask)`` whose result is dropped, then ``attn.softmax(-1)``. The read
    is of the written value, and its gradient goes through the write's backward (for a write into
    a view, ``CopySlices``, which allocates a gradient the size of the base); from ``attn``'s node
    it went around it, and the write's backward was not in the prediction (-12.5% on the plain
    peak, 1.33x the budget at "min")."""
    writes: dict[int, list[int]] = {}
    for w, n in enumerate(calls):
        if roots[w] != w and writes_in_place(gm, n):
            writes.setdefault(roots[w], []).append(w)
    edges = []
    for u, ps in enumerate(preds):
        latest = {p: max((w for w in writes.get(roots[p], ()) if p < w < u), default=p) for p in ps}
        edges.append(tuple(sorted(set(latest.values()))))
    return tuple(edges)


def _shared_params(gm: fx.GraphModule, node_costs) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], tuple[int, ...]]:
    """(gradient bytes, reader nodes in order) of each parameter read by two or more call nodes,
    and the indices of those read through autocast's cache (``CostGraph.cast_shared``).
    Where every reader reads it through autocast's cache (one bf16 cast of a weight, reused by
    each call of its module), the gradient held from reader to reader is the cast's, in its dtype:
    autograd sums the readers' gradients at the cast's node and copies the sum to the parameter's
    dtype once, after the last (HF-style DiT, whose timestep embedding is called by each block:
    its cast's bf16 gradients were not held at all, -4.2% on the plain peak)."""
    readers: dict[str, list[int]] = {}
    cast: dict[str, list[int]] = {}
    for v, c in enumerate(node_costs):
        for name in c.params:
            readers.setdefault(name, []).append(v)
        for name, nbytes in c.cast_params:
            cast.setdefault(name, []).append(nbytes)
    params = dict(gm.named_parameters())
    shared, through_cache = [], []
    for name, r in readers.items():
        if len(r) >= 2:
            if len(cast.get(name, ())) == len(r):
                through_cache.append(len(shared))
            shared.append((cast[name][0] if len(cast.get(name, ())) == len(r)
                           else params[name].numel() * params[name].element_size(), tuple(r)))
    return tuple(shared), tuple(through_cache)


def _casts(node_costs) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Autocast's cached casts of parameters, numbered as first read (``CostGraph.cast_bytes``),
    and the ones each node reads and saves (``cast_reads``, ``cast_saves``); all empty where there
    are none."""
    index: dict[str, int] = {}
    nbytes: list[int] = []
    for c in node_costs:
        for name, size in c.cast_params:
            if name not in index:
                index[name] = len(nbytes)
                nbytes.append(size)
    if not nbytes:
        return (), (), ()
    reads = tuple(tuple(sorted(index[name] for name, _ in c.cast_params)) for c in node_costs)
    saves = tuple(tuple(sorted(index[name] for name in c.cast_saved)) for c in node_costs)
    return tuple(nbytes), reads, saves


def _written_storages(gm: fx.GraphModule, calls, node_costs, index: dict):
    """For each activation storage that a node writes in place: ``(holders, touched)``, the
    nodes holding it (the value, its views, the in-place results) and those plus every node
    reading one of them. Data edges alone do not order a write through a view before the readers
    of the base (``zeros[:, 1:].copy_(ids)``; later readers read ``zeros``): the holders are tied
    into one group, and everything touched is kept in traced order."""
    holders: dict[str, list[int]] = {}
    for v, c in enumerate(node_costs):
        if c.root:  # "" is a graph input's or an attribute's storage: ordered by _order_chains
            holders.setdefault(c.root, []).append(v)
    written = []
    for members in holders.values():
        if not any(writes_in_place(gm, calls[v]) for v in members):
            continue
        touched = set(members)
        for v in members:
            touched.update(index[u.name] for u in calls[v].users if u.name in index)
        written.append((tuple(members), tuple(sorted(touched))))
    return written


def _order_chains(graph: fx.Graph, index: dict) -> tuple[tuple[int, ...], ...]:
    """The consumers of each graph input and attribute, and the calls of each shared module."""
    chains = []
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            users = sorted(index[u.name] for u in node.users if u.name in index)
            if len(users) >= 2:
                chains.append(tuple(users))
    calls: dict[str, list[int]] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls.setdefault(node.target, []).append(index[node.name])
    chains += [tuple(c) for c in calls.values() if len(c) >= 2]
    return tuple(chains)
