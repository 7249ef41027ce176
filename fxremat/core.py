"""The plain data every stage of fxremat shares: :class:`CostGraph`, :class:`Schedule`,
:class:`Timeline`, and the graph helpers the solvers and the simulator have in common.

Nothing here imports torch or another fxremat module: a graph is tuples of ints (as in torch's
``_activation_checkpointing/knapsack.py``), built from a traced model by
:mod:`fxremat.passes.lower` or read from JSON (:func:`load_graph`), so solvers and their tests
run on fixtures without a model.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from functools import cached_property

import networkx as nx

__all__ = ["CostGraph", "Schedule", "Timeline", "anchors", "merged_anchors", "order_edges", "exits", "boundary", "ancestor_masks",
           "to_networkx", "save_graph", "load_graph", "TIME_RESOLUTION"]

# Forward costs are scaled to integers summing to about this many units, so that solvers work
# on exact integer arithmetic (identical answers from the Python and Cython kernels).
TIME_RESOLUTION = 100_000


@dataclass(frozen=True)
class CostGraph:
    """Call nodes ``0..n-1`` in topological order with integer costs.

    Edges: ``preds``/``succs`` are the data edges (v reads p's output). ``order_preds[v]``: the
    ordering edges into v beyond the data edges — nodes that must run before v for bitwise
    results (see :func:`order_edges`); :attr:`ordered_preds` / :attr:`ordered_succs` are both
    kinds together, what a strategy's lower sets must respect.

    ``root[v]`` is the node owning the storage ``v``'s output lives in (``v`` itself unless it
    is a view); ``saved[v]`` the owners of the storages autograd saves for ``v``'s backward
    (``v`` included when it saves its own output). ``grad_alias[v]``: its backward passes views
    of its output's gradient to its inputs instead of new buffers. ``anchor[v]`` ties a view or
    a non-tensor node to the group of its latest predecessor: lower sets contain both or
    neither (:func:`anchors`, :mod:`fxremat.lowersets`); ``anchor[v] == v`` for a node tied to
    nothing. ``time[v] * time_unit`` is its forward cost in ``cost_unit``; ``step_cost`` is one
    plain forward + backward in the same unit.

    Memory: ``out_bytes[v]`` its output's new storages; ``extra_bytes[v]`` buffers its backward
    saves beyond values (dropout masks, indices); ``grad_bytes[v]`` its output's gradient (0 when
    it takes none). ``transient_bytes[v]``: what v needs while its forward runs beyond its output;
    ``bwd_transient_bytes[v]``: what its backward needs beyond the gradients it hands its inputs
    (temporaries, and its parameters' gradients until each is accumulated into ``.grad``);
    ``param_grad_bytes[v]``: the gradients of the parameters v reads, all alive while v's backward
    hands on its results. ``shared_params``: ``(bytes, readers)`` of each parameter that two or
    more call nodes read (tied weights, a module called twice): autograd holds its gradient from
    the backward of its first reader (in backward order) to that of its last. ``cast_shared``
    (empty: none): the indices in ``shared_params`` of those read through autocast's cache (one
    cast of the weight for all its readers, the bytes are the cast's): their gradient is summed in
    the cast's dtype and copied to the parameter's once, after its last reader's own is added.

    The checkpoint mechanism's own time, in ``time`` units: ``checkpoint_time`` per recomputed
    segment (RNG state, set-up, early stop) and ``hook_time[v]`` for each node v in it (the
    saved-tensor hooks of the tensors v saves, and making them again in the backward; 0 when the
    costs are not measured on a clock).

    The loss: ``loss_bytes`` is what a loss computed from the outputs is assumed to hold at its
    peak, while the backward starts, beyond the outputs' gradients (a cross-entropy per output:
    :func:`fxremat.passes.lower._loss_bytes`); ``loss_forward_bytes`` the peak of that loss's
    forward beyond the outputs (log-softmaxes, targets, and the float32 copy of a bf16 output it
    makes first), which under autocast's cache runs before the cache goes (the loss is computed
    inside the autocast region, as the usual recipe does); ``loss_output`` the index of a one-element
    differentiable output when the model returns its loss (Hugging Face models given
    ``labels=``), from which alone the backward starts (``loss_bytes`` is then 0), else ``None``.

    ``cast_bytes[c]`` (empty: none anywhere): the bytes of autocast's cached cast c of a leaf that
    requires grad (a bf16 copy of a weight, or of an input that requires grad), one per leaf read
    through the cache; ``cast_reads[v]`` the
    casts v reads, ``cast_saves[v]`` those of them v's backward saves (not in ``extra_bytes``). In
    each autocast region, the forward's and each recomputation's, the first node that reads a
    cast makes it, and the cache holds it until the region exits, whether its readers are
    recomputed or not; then the region's kept nodes that save it hold it until their backwards.

    ``bwd_unpack_bytes[v]`` (empty: 0 everywhere): what v's backward holds when it first unpacks
    a tensor v saved, beyond the gradient it was handed. In a recomputed segment whose
    recomputation v's backward starts, the recomputation runs beside them: ``CopySlices``, the
    backward of an in-place write into a view, has made a base-sized gradient, its copy and a
    clone of the slice's before the write's own backward unpacks. ``bwd_released_bytes[v]``
    (empty: 0 everywhere): what of its gradient v's backward lets go before its peak or that
    unpack (``CopySlices`` drops the view-sized one): where another node holds the same
    gradient buffer (the other input of an ``add``), it adds to both.
    ``bwd_freed_inputs[v]`` (empty: none anywhere): the owners of the inputs v saves that its
    backward lets go before its peak, which ``bwd_transient_bytes[v]`` does not hold (under
    autocast a linear layer's bf16 input, before its weight's gradient is copied to float32):
    where something else keeps one alive through v's backward, it is held on top.

    ``held_bytes[v]`` (empty: 0 everywhere): tensors v's call leaves on its module as attributes (a
    forward pre-hook's weight: ``torch.nn.utils.prune``, the hook-based ``weight_norm``), alive from
    v's forward to the step's end, since the module holds them until its next call; a
    recomputation of v makes them again beside the ones it replaces (not in ``extra_bytes``).
    ``unsaved_item_bytes[v]`` (empty: 0 everywhere): the part of ``out_bytes[v]``, the items of a
    tuple output, that no backward saves: they go once v's readers ran, where only backwards (v's
    own, its readers') hold the rest (nn.MultiheadAttention's output beside its per-head weights).
    ``bwd_tail_bytes[v]`` (empty: 0 everywhere): what v's backward holds beyond its inputs'
    gradients once its own op has let go of what it saved and of its incoming gradient: the
    gradient path through such a hook's weight (prune's mask multiply), after
    ``bwd_transient_bytes``, which then counts the backward up to it.

    The buffers the step mutates (empty: none): ``state_bytes[b]`` the bytes of buffer b, and per
    node ``state_reads[v]`` those v reads and ``state_writes[v]`` those it mutates. A recomputed
    segment copies the ones its nodes read when its forward runs and holds the copies until its
    backward ends (``reads=``: its recomputation reads them as its forward did), and copies those
    and the ones its nodes mutate again while it is recomputed (``restore=``: put back after):
    :meth:`snapshot_bytes`, :meth:`restore_bytes`.

    ``param_grads_held``: the backward runs as one compiled graph (AOTAutograd under
    ``torch.compile``), which returns every parameter's gradient when it ends, so each stays alive
    from its node's backward to the end of the backward instead of going into ``.grad`` at once
    (measured under Inductor on the transformer stack at "min": the plan's 4.32 MiB peak became
    4.79 MiB, the extra being the block's weight gradients and one fused buffer).
    """

    names: tuple[str, ...]
    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    order_preds: tuple[tuple[int, ...], ...]
    anchor: tuple[int, ...]
    is_output: tuple[bool, ...]
    time: tuple[int, ...]
    out_bytes: tuple[int, ...]
    root: tuple[int, ...]
    saved: tuple[tuple[int, ...], ...]
    extra_bytes: tuple[int, ...]
    grad_bytes: tuple[int, ...]
    grad_alias: tuple[bool, ...]
    transient_bytes: tuple[int, ...]
    bwd_transient_bytes: tuple[int, ...]
    param_grad_bytes: tuple[int, ...]
    shared_params: tuple[tuple[int, tuple[int, ...]], ...]
    loss_bytes: int
    loss_output: int | None
    checkpoint_time: int
    hook_time: tuple[int, ...]
    time_unit: float
    step_cost: float
    cost_unit: str
    param_grads_held: bool = False
    cast_bytes: tuple[int, ...] = ()
    cast_reads: tuple[tuple[int, ...], ...] = ()
    cast_saves: tuple[tuple[int, ...], ...] = ()
    bwd_unpack_bytes: tuple[int, ...] = ()
    bwd_released_bytes: tuple[int, ...] = ()
    held_bytes: tuple[int, ...] = ()
    unsaved_item_bytes: tuple[int, ...] = ()
    bwd_tail_bytes: tuple[int, ...] = ()
    state_bytes: tuple[int, ...] = ()
    state_reads: tuple[tuple[int, ...], ...] = ()
    state_writes: tuple[tuple[int, ...], ...] = ()
    bwd_freed_inputs: tuple[tuple[int, ...], ...] = ()
    cast_shared: tuple[int, ...] = ()
    loss_forward_bytes: int = 0

    def __post_init__(self):
        n = len(self.names)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("cast_reads", "cast_saves", "bwd_unpack_bytes", "bwd_released_bytes",
                          "held_bytes", "unsaved_item_bytes", "bwd_tail_bytes", "state_reads", "state_writes",
                          "bwd_freed_inputs") and not value:
                continue  # no autocast cache; no backward that allocates before it unpacks or frees early; no hook's weight
            if f.name in ("state_bytes", "cast_shared", "cast_bytes"):  # one entry per mutated buffer, per cast
                continue
            if isinstance(value, tuple) and f.name != "shared_params" and len(value) != n:
                raise ValueError(f"fxremat.core.CostGraph: {f.name} has {len(value)} entries for {n} nodes")
        for v in range(n):
            if any(p >= v for p in (*self.preds[v], *self.order_preds[v])):
                raise ValueError(f"fxremat.core.CostGraph: node {self.names[v]} has a predecessor after it")
            if self.anchor[v] > v:
                raise ValueError(f"fxremat.core.CostGraph: node {self.names[v]} is tied to a later node")

    @property
    def n(self) -> int:
        return len(self.names)

    def __getstate__(self) -> dict:
        """The fields alone: what the cached properties derive from them is made again after
        loading, not pickled beside them."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __setstate__(self, state: dict) -> None:
        names = {f.name for f in fields(self)}  # (a pickle from before this held derived data too)
        self.__dict__.update({name: value for name, value in state.items() if name in names})

    # -- per-node data derived from the fields, computed once per graph (a CostGraph is frozen:
    # dataclasses.replace makes a new one, with nothing cached) and read by each simulation

    @cached_property
    def pred_roots(self) -> tuple[tuple[int, ...], ...]:
        """The owners of the values each node reads (each once)."""
        return tuple(tuple({self.root[p] for p in ps}) for ps in self.preds)

    @cached_property
    def reader_counts(self) -> tuple[int, ...]:
        """How many nodes read a value owned by each node (through views)."""
        counts = [0] * self.n
        for rs in self.pred_roots:
            for r in rs:
                counts[r] += 1
        return tuple(counts)

    @cached_property
    def output_roots(self) -> frozenset[int]:
        """The owners of the graph's outputs."""
        return frozenset(self.root[v] for v in range(self.n) if self.is_output[v])

    @cached_property
    def saving(self) -> tuple[bool, ...]:
        """:meth:`saves_tensors` of each node."""
        return tuple(self.saves_tensors(v) for v in range(self.n))

    @cached_property
    def reached(self) -> frozenset[int]:
        """Nodes whose backward runs: the outputs with a gradient (:meth:`gradient_outputs`) and,
        backwards, their inputs that take one."""
        reached = set(self.gradient_outputs())
        for v in reversed(range(self.n)):
            if v in reached:
                reached.update(p for p in self.preds[v] if self.grad_bytes[p])
        return frozenset(reached)

    @cached_property
    def shared_param_steps(self) -> dict[int, tuple[tuple[int, int, bool, bool], ...]]:
        """Node -> ``(index, bytes, first, last)`` of each shared parameter (``shared_params``) it
        reads, where two or more of its readers are :attr:`reached`: whether the node's backward
        is the first or the last of theirs (the backward runs its readers in reverse)."""
        at: dict[int, list[tuple[int, int, bool, bool]]] = {}
        for i, (nbytes, readers) in enumerate(self.shared_params):
            readers = [v for v in readers if v in self.reached]
            if len(readers) < 2:
                continue
            for v in readers:
                at.setdefault(v, []).append((i, nbytes, v == readers[-1], v == readers[0]))
        return {v: tuple(steps) for v, steps in at.items()}

    @cached_property
    def ordered_preds(self) -> tuple[tuple[int, ...], ...]:
        """Data and ordering edges into each node."""
        return tuple(tuple(sorted({*ps, *os})) for ps, os in zip(self.preds, self.order_preds))

    @cached_property
    def ordered_succs(self) -> tuple[tuple[int, ...], ...]:
        """Data and ordering edges out of each node."""
        return _successors(self.ordered_preds)

    @cached_property
    def dropped_after(self) -> dict[int, list[int]]:
        """Node -> the nodes whose autograd records go once it has run in the forward: those whose
        values no output descends from through autograd (a call whose result the forward drops, as a
        captured graph keeps: smp's EfficientNet encoder runs one stage more than PSPNet reads). A
        node's record lives while its value does (until its last reader ran) and while the record of
        a node that takes its gradient from it lives; with nothing downstream alive it goes, and what
        it saved with it, long before any backward (held to its backward, PSPNet's plain peak was
        predicted +7.4%)."""
        end = [0] * self.n
        changed = True
        while changed:  # a write into a value (or a view of it) lives as long as that value's record:
            changed = False  # the value's root comes first, so a pass may raise a later node's end
            for v in reversed(range(self.n)):
                links = [end[s] for s in self.succs[v] if self.grad_bytes[v] and self.grad_bytes[s]]
                new = self.n if self.is_output[v] else max([v, end[v], end[self.root[v]], *self.succs[v], *links])
                changed |= new != end[v]
                end[v] = new
        dropped: dict[int, list[int]] = {}
        for v in range(self.n):
            if end[v] < self.n:
                dropped.setdefault(end[v], []).append(v)
        return dropped

    def gradient_outputs(self) -> tuple[int, ...]:
        """The outputs the backward starts from with a gradient: the loss output alone when the
        model returns its loss (``loss_output``), else every differentiable output."""
        if self.loss_output is not None:
            return (self.loss_output,)
        return tuple(v for v in range(self.n) if self.is_output[v] and self.grad_bytes[v])

    def saves_tensors(self, v: int) -> bool:
        """Whether v's forward may hand autograd a tensor to save. The profile records saved
        values of other nodes, v's own output and extra buffers; a node reading no other node may
        save only graph inputs or parameters, which it does not record, so it counts as saving."""
        return bool(self.saved[v]) or self.extra_bytes[v] > 0 or not self.preds[v]

    def saves_after_running(self, v: int) -> bool:
        """Whether v hands autograd its tensors to save only after its kernel has run (its own
        output, extra buffers such as dropout masks); a node saving only its inputs saves them
        before, so a recomputation that torch stops early at v never runs v's kernel."""
        return v in self.saved[v] or self.extra_bytes[v] > 0

    def stop_kind(self, v: int) -> int:
        """0: v saves nothing; 1: it saves before its kernel runs; 2: after (see
        :meth:`saves_after_running`). What the solvers need to cost torch's early stop."""
        if not self.saves_tensors(v):
            return 0
        return 2 if self.saves_after_running(v) else 1

    def recompute_cost(self, v: int) -> int:
        """What v costs inside a recomputed segment, beyond the segment's fixed
        ``checkpoint_time``: its forward (``time``) and the checkpoint's hooks for what it saves
        (``hook_time``)."""
        return self.time[v] + self.hook_time[v]

    def step_transient(self, v: int) -> int:
        """The largest of v's forward and backward transients (its backward's head or tail), plus
        the gradients of shared parameters that may be held across v's backward
        (:meth:`held_grad_bytes`), plus what the modules hold through the whole backward (every
        node's ``held_bytes``): what the solvers' step terms use."""
        tail = self.bwd_tail_bytes[v] if self.bwd_tail_bytes else 0
        return (max(self.transient_bytes[v], self.bwd_transient_bytes[v], tail) + self.held_grad_bytes(v)
                + self.module_held_bytes)

    def snapshot_bytes(self, members) -> int:
        """What a recomputed segment over ``members`` copies when its forward runs, and holds until
        its backward ends: the mutated buffers its nodes read (``reads=``)."""
        if not self.state_bytes:
            return 0
        return sum(self.state_bytes[b] for b in {b for v in members for b in self.state_reads[v]})

    def restore_bytes(self, members) -> int:
        """What a recomputation of a segment over ``members`` copies while it runs: the buffers its
        nodes read or mutate, put back after it (``reads=``, ``restore=``)."""
        if not self.state_bytes:
            return 0
        copied = {b for v in members for b in (*self.state_reads[v], *self.state_writes[v])}
        return sum(self.state_bytes[b] for b in copied)

    @cached_property
    def module_held_bytes(self) -> int:
        """What the modules hold from their calls to the step's end (``held_bytes``), all of it
        alive once the forward is done."""
        return sum(self.held_bytes)

    def held_grad_bytes(self, v: int) -> int:
        """An upper bound of the shared parameters' gradient bytes held while v's backward runs:
        each one whose readers span v, twice at a reader that adds its own (summed out of place)."""
        held = 0
        for nbytes, readers in self.shared_params:
            if readers[0] <= v <= readers[-1]:
                held += 2 * nbytes if v in readers[:-1] else nbytes
        return held


def _successors(preds) -> tuple[tuple[int, ...], ...]:
    succs: list[list[int]] = [[] for _ in preds]
    for v, ps in enumerate(preds):
        for p in ps:
            succs[p].append(v)
    return tuple(tuple(s) for s in succs)


@dataclass(frozen=True)
class Schedule:
    """Segments (tuples of node indices, in order) and which of them are recomputed.

    ``inner`` (optional, one entry per segment): the schedule a recomputed segment follows when
    it is recomputed — a :class:`Schedule` over exactly that segment's nodes whose own
    recomputed segments are nested checkpoints (rotor's F_ck inside a recomputation), or
    ``None``: the segment is recomputed plainly, keeping what autograd saves.
    """

    segments: tuple[tuple[int, ...], ...]
    recomputed: tuple[bool, ...]
    inner: tuple["Schedule | None", ...] = ()

    def __post_init__(self):
        flat = [v for seg in self.segments for v in seg]
        if len(flat) != len(set(flat)):  # a step would run a node twice (a dropout drawing twice)
            twice = sorted({v for v in flat if flat.count(v) > 1})
            raise AssertionError(f"fxremat.core.Schedule: nodes {twice[:8]} are in two segments; a solver made "
                                 "overlapping segments (please report this with the model)")

    def inner_of(self, i: int) -> "Schedule | None":
        return self.inner[i] if self.inner else None

    @property
    def depth(self) -> int:
        """1 for a flat schedule, plus one per level of nested checkpoints."""
        return 1 + max((s.depth for s in self.inner if s is not None), default=0)

    @classmethod
    def plain(cls, n: int) -> "Schedule":
        """One kept segment of every node: no recomputation."""
        return cls((tuple(range(n)),), (False,))

    @classmethod
    def from_lower_sets(cls, lower_sets) -> "Schedule":
        """The segments between consecutive lower sets (bitsets ending with V); every segment
        but the last is recomputed (the canonical strategy of Kusumoto et al.)."""
        segments, prev = [], 0
        for mask in lower_sets:
            # (what came before stays before: the chain baselines' cut points do not always grow,
            # e.g. a captured graph's num_batches_tracked.add_(1), which no later node descends
            # from; taken as they came, a plan held it in two segments and ran it twice)
            mask |= prev
            segments.append(tuple(v for v in range(mask.bit_length()) if (mask & ~prev) >> v & 1))
            prev = mask
        return cls(tuple(segments), tuple([True] * (len(segments) - 1) + [False]))


@dataclass(frozen=True)
class Timeline:
    """Memory in bytes after each event of one forward + backward; the backward starts at
    index ``backward_start`` (the loss). Predicted by :mod:`fxremat.simulate` for a plan, or
    measured by :func:`fxremat.measure.measure_timeline`."""

    bytes: tuple[int, ...]
    backward_start: int

    @property
    def peak_bytes(self) -> int:
        return max(self.bytes, default=0)


# -- helpers on edges ------------------------------------------------------------------------

def anchors(preds, owns_storage) -> tuple[int, ...]:
    """Tie every node that owns no storage (views, ints, sizes) to the latest group head among
    its predecessors. Heads precede their members, so the quotient DAG stays acyclic."""
    head: list[int] = []
    for v, ps in enumerate(preds):
        head.append(v if owns_storage[v] or not ps else max(head[p] for p in ps))
    return tuple(head)


def merged_anchors(preds, anchor, together) -> tuple[int, ...]:
    """``anchor`` with each node set of ``together`` tied into one group, with every group on a
    path between two of its members in the quotient DAG (its convex hull there, so the quotient
    stays acyclic); the group's head is its first node. For values written in place through a
    view, whose readers and writers only keep their traced order when they run in one segment."""
    head = list(anchor)
    succs = _successors(preds)
    for nodes in together:
        groups = {head[v] for v in nodes}
        while True:
            below = _group_closure(groups, head, succs)
            above = _group_closure(groups, head, preds)
            grown = groups | (below & above)
            if grown == groups:
                break
            groups = grown
        first = min(groups)
        head = [first if h in groups else h for h in head]
    return tuple(head)


def _group_closure(groups, head, edges) -> set[int]:
    """The groups reachable from ``groups`` along ``edges`` in the quotient DAG of ``head``."""
    members: dict[int, list[int]] = {}
    for v, h in enumerate(head):
        members.setdefault(h, []).append(v)
    seen, stack = set(groups), list(groups)
    while stack:
        for v in members[stack.pop()]:
            for w in edges[v]:
                if head[w] not in seen:
                    seen.add(head[w])
                    stack.append(head[w])
    return seen


def _reaches(gpreds: dict, start: int, target: int) -> bool:
    """Whether group ``target`` is an ancestor of group ``start``."""
    seen, stack = set(), [start]
    while stack:
        for p in gpreds.get(stack.pop(), ()):
            if p == target:
                return True
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return False


def order_edges(preds, anchor, chains=()) -> tuple[tuple[int, ...], ...]:
    """Ordering edges that keep, for every value with two or more consumers, its consumers in
    traced order: autograd sums a value's gradient contributions in the order its consumers ran,
    and with three or more terms another order changes the float sum. ``chains`` are more node
    sequences to keep in order (the consumers of a graph input or parameter, the calls of a
    shared module, the nodes that draw random numbers). An edge that would close a cycle among
    tied groups (``anchor``) is left out. Returns, per node, the edges beyond ``preds``."""
    succs = _successors(preds)
    merged = [set(ps) for ps in preds]
    gpreds: dict[int, set] = {}
    for v, ps in enumerate(preds):
        gpreds.setdefault(anchor[v], set()).update(anchor[p] for p in ps if anchor[p] != anchor[v])
    sequences = [sorted(succs[v]) for v in range(len(preds)) if len(succs[v]) >= 2]
    sequences += [list(c) for c in chains]

    def add(a: int, b: int) -> bool:
        ga, gb = anchor[a], anchor[b]
        if ga == gb or _reaches(gpreds, ga, gb):
            return False
        merged[b].add(a)
        gpreds.setdefault(gb, set()).add(ga)
        return True

    for users in sequences:
        for a, b in zip(users, users[1:]):
            if not add(a, b) and anchor[b] != b and anchor[a] != anchor[b]:
                # b is tied to the value's own group (a view of it, taken after a): the emitted code
                # takes it (and the views of it tied there too) after a (fxremat.passes.rewrite),
                # where their readers run after a
                tied, readers = [b], set()
                while tied:
                    for u in succs[tied.pop()]:
                        if anchor[u] == anchor[b]:
                            tied.append(u)
                        else:
                            readers.add(u)
                for u in sorted(readers):
                    add(a, u)
    return tuple(tuple(sorted(m - set(ps))) for m, ps in zip(merged, preds))


def exits(graph: CostGraph, members) -> list[int]:
    """The nodes of ``members`` (a set) whose output leaves it: graph outputs, and values a node
    outside ``members`` reads (along data edges)."""
    return [v for v in sorted(members) if graph.is_output[v] or any(u not in members for u in graph.succs[v])]


def boundary(graph: CostGraph, members) -> set[int]:
    """The storages (owners) of the values :func:`exits` hands out of ``members``."""
    return {graph.root[v] for v in exits(graph, members)}


def ancestor_masks(preds) -> list[int]:
    """Bitset of each node and its ancestors along ``preds``."""
    anc: list[int] = []
    for v, ps in enumerate(preds):
        mask = 1 << v
        for p in ps:
            mask |= anc[p]
        anc.append(mask)
    return anc


# -- views and files ---------------------------------------------------------------------------

def to_networkx(graph: CostGraph) -> nx.DiGraph:
    """The DAG as a ``networkx.DiGraph`` (nodes are indices, costs are node attributes; data
    edges only)."""
    g = nx.DiGraph()
    for v, name in enumerate(graph.names):
        g.add_node(v, name=name, time=graph.time[v], out_bytes=graph.out_bytes[v])
    g.add_edges_from((p, v) for v, ps in enumerate(graph.preds) for p in ps)
    return g


_NESTED = {"preds", "succs", "order_preds", "saved", "state_reads", "state_writes", "bwd_freed_inputs",
           "cast_reads", "cast_saves"}


def save_graph(graph: CostGraph, path) -> None:
    """Write ``graph`` as JSON (a fixture that needs neither torch nor the model to load)."""
    with open(path, "w") as f:
        json.dump(asdict(graph), f)


def load_graph(path) -> CostGraph:
    """Read a graph written by :func:`save_graph` (``ValueError`` naming missing or unknown
    fields)."""
    with open(path) as f:
        data = json.load(f)
    known = {f.name for f in fields(CostGraph)}
    required = {f.name for f in fields(CostGraph) if f.default is MISSING}
    if not set(data) <= known or not required <= set(data):
        raise ValueError(f"fxremat.core.load_graph: {path} has unknown fields {sorted(set(data) - known)} and "
                         f"lacks {sorted(required - set(data))}; write it again with fxremat.core.save_graph")
    data["shared_params"] = [(nbytes, tuple(readers)) for nbytes, readers in data["shared_params"]]
    return CostGraph(**{k: tuple(tuple(x) for x in v) if k in _NESTED else tuple(v) if isinstance(v, list) else v
                        for k, v in data.items()})
