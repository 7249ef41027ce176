"""What a compiled step keeps at the plan's segment boundaries: :func:`keep_segment_outputs`.

Under ``torch.compile`` each ``recompute(...)`` of the emitted code becomes a checkpoint region of
AOTAutograd's joint graph, its nodes tagged to be recomputed. The partitioner cannot save a tagged
node: where a later region reads a region's output it saves it (its ``cleanup_recompute_tags``),
but where the reader is outside every region (a segment the plan keeps, a residual add, a
``Linear`` that saves its input) the output is recomputed in the backward, with the region's
chain behind it. The plan counts that output as kept, as torch's checkpoint keeps it in eager:
on the 4-block transformer at 0.7 the compiled step recomputed 155 M matrix-product FLOPs for
the plan's 85 M and its peak was 6.7 MiB for 8.4 MiB predicted.

:func:`keep_segment_outputs`, a pass over the joint graph before it is partitioned, marks every
region node that the forward reads outside its region (and, where that node is a view or an
item of a tuple, the region node it views or takes it from) as ``MUST_SAVE``: the partitioner
then saves it where the backward needs it, as the plan does, and recomputes the interior only.
:func:`inductor` is Inductor with the pass and :func:`aot_eager` AOTAutograd's eager backend with
it; ``fxremat.compile(..., backend="inductor")`` (or ``"aot_eager"``) compiles with them.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["keep_segment_outputs", "inductor", "aot_eager"]

_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _region(node: fx.Node):
    """The checkpoint region (its ``ac_graph_id``) whose recomputation ``node`` belongs to, or None."""
    if node.meta.get("recompute") in _RECOMPUTED:
        return node.meta.get("ac_graph_id", -1)
    return None


@functools.lru_cache(maxsize=1)
def _op_types():
    from torch._functorch.partitioners import get_default_op_list

    return get_default_op_list()


def _source(node: fx.Node) -> fx.Node | None:
    """The node whose storage ``node`` views, or whose tuple it takes an item of, or None. A
    multi-output node (a norm's output and statistics, a dropout run with the region's random
    state) is saved with its item, else the partitioner recomputes it for its other items."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.target is operator.getitem or _op_types().is_view(node):
        return node.args[0]
    return None


def keep_segment_outputs(graph: fx.Graph) -> int:
    """Mark ``MUST_SAVE`` every node of a checkpoint region that a forward node outside its region
    (or the forward's output) reads, and the region nodes it is a view or an item of; return how
    many.

    Forward nodes are those the forward's outputs depend on (the joint graph's backward starts
    from its ``tangents`` inputs): a region node read only by the backward is left to be
    recomputed, which is what the region is for."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            backward.add(node)
        elif node.op != "output" and any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    forward_outputs = {a for a in output.all_input_nodes if a not in backward}
    forward: set[fx.Node] = set()
    stack = list(forward_outputs)
    while stack:
        node = stack.pop()
        if node not in forward:
            forward.add(node)
            stack.extend(node.all_input_nodes)
    region = {node: _region(node) for node in graph.nodes}
    marked = 0
    for node in graph.nodes:
        if region[node] is None:
            continue
        read_outside = any(u in forward and region[u] != region[node] for u in node.users)
        if node not in forward_outputs and not read_outside:
            continue
        while node is not None and region[node] is not None:
            # a tuple saved with its items: all of them, as the partitioner cannot recompute one
            items = [u for u in node.users if u.target is operator.getitem and region[u] is not None]
            for n in (node, *items):
                if n.meta.get("recompute") is not CheckpointPolicy.MUST_SAVE:
                    n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                    marked += 1
            node = _source(node)
    return marked


@functools.lru_cache(maxsize=1)
def _joint_pass():
    """:func:`keep_segment_outputs` as an Inductor joint-graph pass, with a ``uuid`` from its
    source so that Inductor's caches stay on and tell it apart (built on first use: importing
    Inductor takes most of a second)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class KeepSegmentOutputs(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            keep_segment_outputs(graph)

        def uuid(self) -> str:
            source = "".join(inspect.getsource(f) for f in (keep_segment_outputs, _source, _region))
            return hashlib.sha256(source.encode()).hexdigest()

    return KeepSegmentOutputs()


def inductor(gm: fx.GraphModule, example_inputs):
    """A ``torch.compile`` backend: Inductor, with :func:`keep_segment_outputs` run on the joint
    graph before the passes that the ``joint_custom_pre_pass`` config already names."""
    from torch._inductor.compile_fx import compile_fx

    keep = _joint_pass()
    current = torch._inductor.config.joint_custom_pre_pass
    current = [] if current is None else list(current) if isinstance(current, (list, tuple)) else [current]
    with torch._inductor.config.patch(joint_custom_pre_pass=[keep] + [p for p in current if p is not keep]):
        return compile_fx(gm, example_inputs)


def aot_eager(gm: fx.GraphModule, example_inputs, **kwargs):
    """A ``torch.compile`` backend: ``"aot_eager"`` (AOTAutograd with the min-cut partitioner, its
    graphs run as they are), with :func:`keep_segment_outputs` run on the joint graph first."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint: fx.GraphModule, joint_inputs, **options):
        keep_segment_outputs(joint.graph)
        return min_cut_rematerialization_partition(joint, joint_inputs, **options)

    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition,
                           keep_inference_input_mutations=True)
    return backend(gm, example_inputs, **kwargs)
