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
Within :func:`keeping_segment_outputs` every AOTAutograd backend runs the pass. A
``RematModule`` calls its emitted code in it under ``torch.compile`` (``fxremat.compile(...,
backend=...)`` and ``torch.compile(remat)`` by hand, any backend), and autotune times its compiled
candidates in it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import operator
import sys

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["keep_segment_outputs", "keeping_segment_outputs"]

_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _region(node: fx.Node):
    """The checkpoint region (its ``ac_graph_id``) ``node`` belongs to, or None: also where it is
    marked saved, so that a second run of the pass (it runs under functorch's and Inductor's joint
    pass alike) does not take the region nodes read by the ones it marked for outputs read
    outside, and keep the whole region (the U-Net at 0.7 under Inductor: 37.7 MiB where one run
    measures 31.7)."""
    if node.meta.get("recompute") is not None:
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
        if node.meta.get("recompute") not in _RECOMPUTED:
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


@functools.lru_cache(maxsize=1)
def _inductor_takes_a_list() -> bool:
    """Whether Inductor's custom-pass settings take a list of passes (torch 2.12 on); before,
    ``joint_custom_pre_pass`` is one callable."""
    import torch._inductor.custom_graph_pass as custom

    return hasattr(custom, "get_custom_graph_passes")


@functools.lru_cache(maxsize=8)  # entered at each compiled step: one pass per user's pass, not one a step
def _before(keep, user):
    """``keep``, then the user's own Inductor ``joint_custom_pre_pass`` ``user``, as one pass (for
    the torches whose setting takes one callable). Its ``uuid`` joins both; where the user's pass has
    none, it has none either, and Inductor's caches stay off, as they would for the user's pass alone."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class KeepSegmentOutputsFirst(CustomGraphPass):
        fxremat_keeps = True

        def __call__(self, graph: fx.Graph) -> None:
            keep(graph)
            user(graph)

        def uuid(self):
            theirs = user.uuid() if hasattr(user, "uuid") else None
            return None if theirs is None else f"{keep.uuid()}+{theirs}"

    return KeepSegmentOutputsFirst()


def _joint_custom_pass(user):
    """:func:`keep_segment_outputs`, then the user's own ``torch._functorch.config.joint_custom_pass``
    (``user``, where one is set), in that config's form."""

    def joint_pass(gm: fx.GraphModule, joint_inputs):
        keep_segment_outputs(gm.graph)
        return user(gm, joint_inputs) if callable(user) else gm

    joint_pass.fxremat_keeps = True
    return joint_pass


_KEEP_ONLY = _joint_custom_pass(None)


@contextlib.contextmanager
def keeping_segment_outputs():
    """Within it, every joint graph AOTAutograd partitions runs :func:`keep_segment_outputs` first,
    whatever the ``torch.compile`` backend: through ``torch._functorch.config.joint_custom_pass``
    (every AOTAutograd backend; the user's own pass still runs, after it) and, where Inductor is
    imported, its ``joint_custom_pre_pass`` too (a pass with a ``uuid``, so that Inductor's caches,
    which do not key on the former, tell its graphs apart). Compiles started inside it (Dynamo
    compiles a frame when it is first entered) partition with the pass; nothing else changes.
    The two settings are set and put back as attributes (``config.patch`` costs ~40 µs, and this
    is entered at each compiled step)."""
    functorch = torch._functorch.config
    inductor_config = sys.modules.get("torch._inductor.config")
    saved = []
    user = functorch.joint_custom_pass
    if not getattr(user, "fxremat_keeps", False):
        saved.append((functorch, "joint_custom_pass", user))
        functorch.joint_custom_pass = _KEEP_ONLY if user is None else _joint_custom_pass(user)
    if inductor_config is not None:
        keep, current = _joint_pass(), inductor_config.joint_custom_pre_pass
        if _inductor_takes_a_list():
            listed = [] if current is None else list(current) if isinstance(current, (list, tuple)) else [current]
            if keep not in listed:
                saved.append((inductor_config, "joint_custom_pre_pass", current))
                inductor_config.joint_custom_pre_pass = [keep] + listed
        elif current is not keep and not getattr(current, "fxremat_keeps", False):
            saved.append((inductor_config, "joint_custom_pre_pass", current))
            inductor_config.joint_custom_pre_pass = keep if current is None else _before(keep, current)
    try:
        yield
    finally:
        for config, name, value in reversed(saved):
            setattr(config, name, value)
