"""Predict the peak memory of a segmentation as PyTorch executes it.

:func:`simulate` replays one forward + backward over a :class:`~fxremat.core.CostGraph` with
PyTorch's liveness rules (Hong et al., ``shared/seeds/004_ac913870907ea453.txt``: a value dies as
soon as nothing needs it; gradient buffers count):

- forward: a node allocates its output, plus a transient while it runs; a value is freed once its
  forward consumers ran and nothing holds it. In a plain segment autograd holds what each node
  saves until that node's backward; in a checkpointed segment only the segment's inputs are held
  (by the checkpoint) until the segment's backward ends.
- backward, segments in reverse: nodes in reverse order allocate their inputs' gradients and
  release their output's gradient and their saved values. A checkpointed segment is recomputed
  when the first of its nodes that saves something reaches its backward (the nodes after the
  last such node go first; what that node's backward made before it unpacks, the base-sized
  gradients of a write into a view, lives through the recomputation), and only up to that
  node: torch's non-reentrant checkpoint stops once every tensor the segment saved is saved
  again (its early stop), so the nodes after it are not run again. Its saved values are held
  until their node's backward, the others die as in the forward, except the segment's
  outputs, which live until the recomputation stops (the segment returns them); so do values
  whose readers come after the stop. Gradient buffers are reference counted:
  ``cat``/``stack``/same-shape ``add`` hand their inputs views of their own gradient, which
  lives until the last view dies; a second gradient for the same value is accumulated in place
  (a transient).
Graph outputs stay alive throughout (the caller holds the loss); when the backward starts, the
loss is assumed to need ``graph.loss_bytes`` on top of the outputs' gradients.

Beyond values: what a module keeps from its call (a forward pre-hook's weight, ``held_bytes``)
stays to the end of the step; the copies a checkpoint takes of the mutated buffers it reads live
from its forward to its backward's end, and those its recomputation takes while it runs
(:func:`_backward_nested`).
"""

from __future__ import annotations

from .core import CostGraph, Schedule, Timeline, boundary

__all__ = ["simulate", "predicted_timeline", "rerun_time", "partitioned_rerun_time", "mechanism_time"]


class _Grads:
    """Gradient buffers shared by reference: ``of[v]`` is the buffer holding v's gradient;
    ``shared`` the shared parameters' gradients."""

    def __init__(self, mem, graph: CostGraph):
        self.mem = mem
        self.of: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.shared = _SharedParams(graph, mem)

    def give(self, v: int, nbytes: int, share_from: int | None = None) -> None:
        """v's first gradient: a new buffer, or a view of ``share_from``'s."""
        buf = self.of.get(share_from) if share_from is not None else None
        if buf is None:
            buf = len(self.refs)
            self.refs[buf] = 0
            self.mem.alloc(("g", buf), nbytes)
        self.refs[buf] += 1
        self.of[v] = buf

    def resum(self, v: int, nbytes: int) -> None:
        """v's gradient after a second one was added out of place: a new buffer replaces its
        old one (which dies unless views of it live on elsewhere)."""
        self.drop(v)
        del self.of[v]
        self.give(v, nbytes)

    def held_elsewhere(self, v: int) -> bool:
        """Whether v's gradient buffer is also another node's (views handed to the inputs of an
        ``add`` or ``cat``), so that it stays alive whatever v's backward lets go."""
        buf = self.of.get(v)
        return buf is not None and self.refs[buf] > 1

    def drop(self, v: int) -> None:
        buf = self.of.get(v)
        if buf is None:
            return
        self.refs[buf] -= 1
        if self.refs[buf] == 0:
            self.mem.free(("g", buf))


class _SharedParams:
    """Gradients of parameters read by two or more call nodes (``graph.shared_params``) that the
    backward reaches: autograd keeps the first one in the parameter's accumulation buffer from
    its first reader's backward to its last's, adding the others to it out of place."""

    def __init__(self, graph: CostGraph, mem: _Memory):
        self.mem = mem
        # v -> (param, bytes, first, last); empty where no shared parameter is reached twice
        self.at: dict[int, tuple[tuple[int, int, bool, bool], ...]] = graph.shared_param_steps
        self.cast = set(graph.cast_shared)

    def summed(self, v: int) -> list[int]:
        """Bytes of the sums v's backward makes into shared parameters' buffers (not those of casts
        it ends: :meth:`cast_ends`)."""
        return [nbytes for i, nbytes, first, last in self.at.get(v, ()) if not first and not (last and i in self.cast)]

    def cast_ends(self, v: int) -> list[tuple[int, int]]:
        """``(index, bytes)`` of the shared casts (autocast's, ``graph.cast_shared``) whose gradient
        v's backward completes: once v's op has let go of what it saved, its own gradient is added
        to the sum so far (out of place), which then goes, and the new sum is copied to the
        parameter's dtype; that copy is in v's transient (measured on its own, on its own gradient,
        beside which the sum so far is not held again)."""
        return [(i, nbytes) for i, nbytes, first, last in self.at.get(v, ()) if last and not first and i in self.cast]

    def after(self, v: int) -> None:
        for i, nbytes, first, last in self.at.get(v, ()):
            if first:
                self.mem.alloc(("p", i), nbytes)
            elif last:
                self.mem.free(("p", i))


class _Casts:
    """Autocast's cached casts of parameters and of inputs that require grad (``graph.cast_bytes``).
    Each autocast region, the forward's and each recomputation's (a checkpoint recomputes in a
    region of its own, which casts again: the forward's cache is gone by then), makes a cast at the
    first of its nodes that reads it; the cache holds it until the region exits, then the region's
    kept nodes whose backwards save it hold it until the last of those backwards. A weight read by
    several calls (a shared layer) has one cast in a region, held while any of its kept savers
    lives: counted at its first saver alone, it went where that call was recomputed while later
    calls kept it (Hugging Face ALBERT under bf16, its one layer called 4 times: 1.06x the budget at
    0.5), and a recomputation of a later call alone was not seen to cast."""

    def __init__(self, graph: CostGraph, mem: _Memory):
        self.graph, self.mem = graph, mem
        self.made: dict[tuple, set[int]] = {}  # region -> the casts it made
        self.savers: dict[tuple, set[int]] = {}  # (region, cast) -> kept nodes whose backward has not run
        self.held: dict[int, list[tuple]] = {}  # kept node -> the (region, cast) it holds

    def run(self, region: tuple, v: int, transient: int = 0) -> None:
        """v runs in ``region``: it casts what it reads that the region has not cast yet."""
        made = self.made.setdefault(region, set())
        for c in self.graph.cast_reads[v]:
            if c not in made:
                made.add(c)
                self.mem.hold(("c", region, c), self.graph.cast_bytes[c])
        self.mem.note(transient)

    def exit(self, region: tuple, kept) -> None:
        """``region`` exits: its cache lets go of the casts that none of its ``kept`` nodes saves."""
        for v in kept:
            for c in self.graph.cast_saves[v]:
                self.savers.setdefault((region, c), set()).add(v)
                self.held.setdefault(v, []).append((region, c))
        for c in self.made.pop(region, ()):
            if not self.savers.get((region, c)):
                self.mem.free(("c", region, c))

    def release(self, v: int) -> None:
        """v's backward is done: it lets go of the casts it saved."""
        for region, c in self.held.pop(v, ()):
            self.savers[region, c].discard(v)
            if not self.savers[region, c]:
                self.mem.free(("c", region, c))


class _Memory:
    """Live bytes keyed by value ("f", v) forward copy, ("r", v) recomputed copy, ("g", v) grad.
    The bytes after each event are kept (``timeline``) only where ``record``; the peak always."""

    __slots__ = ("live", "total", "peak", "timeline")

    def __init__(self, record: bool = True):
        self.live: dict = {}
        self.total = 0
        self.peak = 0
        self.timeline: list[int] | None = [] if record else None

    def alloc(self, key, nbytes: int, transient: int = 0) -> None:
        if key not in self.live:
            self.live[key] = nbytes
            self.total += nbytes
        self.note(transient)

    def hold(self, key, nbytes: int) -> None:
        """Allocate without an event of its own: the allocation that follows at once notes it."""
        if key not in self.live:
            self.live[key] = nbytes
            self.total += nbytes

    def free(self, key) -> None:
        self.total -= self.live.pop(key, 0)

    def shrink(self, key, nbytes: int) -> None:
        """Let go of ``nbytes`` of a live allocation, without an event of its own."""
        self.live[key] -= nbytes
        self.total -= nbytes

    def note(self, transient: int = 0) -> None:
        now = self.total + transient
        if now > self.peak:
            self.peak = now
        if self.timeline is not None:
            self.timeline.append(now)


# Who holds a value in the backward, as set members: a node's backward (the node's index, >= 0)
# or a checkpoint's (``~i`` of its segment's index i, < 0).


def _segment_of(graph: CostGraph, schedule: Schedule) -> list[int]:
    """Each node's segment; ``ValueError`` where the schedule misses a node or names one the graph
    does not have."""
    n = graph.n
    seg_of = [-1] * n
    for i, seg in enumerate(schedule.segments):
        for v in seg:
            if not 0 <= v < n:
                raise ValueError(f"fxremat.simulate: segment {i} of the schedule holds node {v!r}, but the graph "
                                 f"has nodes 0..{n - 1}; plan on this graph (a schedule made for another graph "
                                 "does not fit it)")
            seg_of[v] = i
    if -1 in seg_of:
        missing = [v for v in range(n) if seg_of[v] == -1]
        shown = ", ".join(f"{v} ({graph.names[v]})" for v in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"fxremat.simulate: the schedule runs no segment holding node {shown} "
                         f"({len(missing)} of {n} nodes missing); every node of the graph must be in one "
                         "segment (Schedule.plain, Schedule.from_lower_sets, or a plan of this graph)")
    if schedule.inner:
        _check_inner(graph, schedule, ())
    return seg_of


def _check_inner(graph: CostGraph, schedule: Schedule, path: tuple[int, ...]) -> None:
    """``ValueError`` where a nested schedule (a recomputed segment's ``inner``, at any depth) does
    not run exactly its segment's nodes, each once."""
    for i, seg in enumerate(schedule.segments):
        inner = schedule.inner_of(i)
        if inner is None:
            continue
        ran = [v for sub in inner.segments for v in sub]
        if sorted(ran) != sorted(seg):
            where = ".".join(map(str, path + (i,)))
            missing, extra = sorted(set(seg) - set(ran)), sorted(set(ran) - set(seg))
            what = (f"misses node {missing[0]} ({graph.names[missing[0]]})" if missing else
                    f"runs node {extra[0]}, not in the segment")
            raise ValueError(f"fxremat.simulate: the nested schedule of segment {where} {what} "
                             f"({len(missing)} missing, {len(extra)} not its own); a segment's inner schedule runs "
                             "exactly that segment's nodes (a plan of this graph)")
        if inner.inner:
            _check_inner(graph, inner, path + (i,))


def _holders(graph: CostGraph, schedule: Schedule, seg_of: list[int]):
    """For every owner, its backward holders (``None``: none): the nodes of kept segments that save
    it, and the checkpoints whose segments read it from outside; and, per checkpointed segment,
    the owners it holds (ascending)."""
    holds: list[set[int] | None] = [None] * graph.n
    held_by: dict[int, set[int]] = {}
    recomputed, saved, pred_roots = schedule.recomputed, graph.saved, graph.pred_roots
    for v, s in enumerate(seg_of):
        if not recomputed[s]:
            for o in saved[v]:
                h = holds[o]
                if h is None:
                    holds[o] = h = set()
                h.add(v)
        else:
            for r in pred_roots[v]:
                if seg_of[r] != s:
                    h = holds[r]
                    if h is None:
                        holds[r] = h = set()
                    h.add(~s)
                    held_by.setdefault(s, set()).add(r)
    return holds, {s: sorted(rs) for s, rs in held_by.items()}


def _held_by_others(holders: set[int] | None, v: int) -> bool:
    """Whether anything beyond v's backward holds a value (``holders`` as :func:`_holders` gives)."""
    return holders is not None and len(holders) > (v in holders)


def simulate(graph: CostGraph, schedule: Schedule, *, timeline: bool = False):
    """Return the predicted peak bytes (and the memory timeline if ``timeline``; without it the
    timeline is not built). ``ValueError`` where ``schedule`` does not run every node of
    ``graph`` once."""
    seg_of = _segment_of(graph, schedule)
    holds, held_by = _holders(graph, schedule, seg_of)
    mem = _Memory(timeline)
    pending = list(graph.reader_counts)  # readers of each owner's value still to run in the forward
    outputs = graph.output_roots
    casts = _forward(graph, schedule, mem, holds, pending, outputs)
    grads = _Grads(mem, graph)
    for v in graph.gradient_outputs():
        grads.give(v, graph.grad_bytes[v])
    mem.note(graph.loss_bytes)
    for s in reversed(range(len(schedule.segments))):
        _backward_segment(graph, schedule, s, mem, grads, casts, holds, pending, outputs, held_by.get(s, ()))
    return (mem.peak, mem.timeline) if timeline else mem.peak


def _forward(graph: CostGraph, schedule: Schedule, mem: _Memory, holds, pending: list[int], outputs) -> _Casts:
    """The forward over ``schedule``'s segments (see the module docstring); returns autocast's
    cached casts as the backward finds them."""
    unsaved = graph.unsaved_item_bytes
    shrunk = set()

    def maybe_free(r):
        if pending[r] or r in outputs:
            return
        h = holds[r]
        if not h:
            mem.free(("f", r))
        elif unsaved and r not in shrunk and all(k >= 0 for k in h):
            shrunk.add(r)  # only backwards hold it, which save none of its unsaved items: those go
            mem.shrink(("f", r), unsaved[r])

    snapshots = _snapshots(graph, schedule)
    casts = _Casts(graph, mem)
    dropped = graph.dropped_after
    gone = set()
    cast_bytes, held_bytes, saved, pred_roots = graph.cast_bytes, graph.held_bytes, graph.saved, graph.pred_roots
    out_bytes, extra_bytes, transient_bytes = graph.out_bytes, graph.extra_bytes, graph.transient_bytes
    for seg, rec in zip(schedule.segments, schedule.recomputed):
        for v in seg:
            if snapshots:  # copies of the buffers a checkpoint starting at v reads
                for path, nbytes in snapshots.get(v, ()):
                    mem.hold(("snap", path), nbytes)
            # the node's transient (its peak beyond what it leaves: out, cached casts, extra saved
            # buffers) is counted on top of all it leaves, with its last allocation; in a recomputed
            # segment its extra buffers are made too, and go when the checkpoint drops them
            transient = transient_bytes[v] + (extra_bytes[v] if rec else 0)
            if held_bytes:  # what its module keeps from its call (a hook's weight) stays to the end
                mem.hold(("h", v), held_bytes[v])
            if not rec:
                mem.alloc(("f", v), out_bytes[v])
                if cast_bytes:
                    casts.run((), v)
                mem.alloc(("x", v), extra_bytes[v], transient)
            elif cast_bytes:
                mem.alloc(("f", v), out_bytes[v])
                casts.run((), v, transient)
            else:
                mem.alloc(("f", v), out_bytes[v], transient)
            for r in pred_roots[v]:
                pending[r] -= 1
                if not pending[r]:
                    maybe_free(r)
            if not pending[v]:
                maybe_free(v)
            if v in dropped:  # what no output descends from goes with its autograd record
                for d in dropped[v]:
                    gone.add(d)
                    mem.free(("x", d))
                    for o in saved[d]:
                        if holds[o] is not None:
                            holds[o].discard(d)
                        maybe_free(o)
    if cast_bytes:  # autocast's cache goes when the forward's autocast region exits
        # the loss is computed inside that region, beside the cache (a VAE's float32 log-softmax and
        # targets at its forward's end: 1.05x its budget at "min" where the cache had gone first)
        mem.note(graph.loss_forward_bytes)
        # (a node gone with its autograd record saves nothing)
        casts.exit((), [v for seg, rec in zip(schedule.segments, schedule.recomputed) if not rec for v in seg
                        if v not in gone])
    return casts


def _checkpoints(seg, inner: Schedule | None, path: tuple) -> list[tuple[tuple, tuple[int, ...]]]:
    """``(path, members)`` of the checkpoint over ``seg`` (at ``path``) and of every checkpoint nested
    in it (``inner``'s recomputed segments, at any depth): all of them run their forwards when it
    runs its own."""
    found = [(path, tuple(seg))]
    for i, (sub, rec) in enumerate(zip(inner.segments, inner.recomputed) if inner is not None else ()):
        if rec:
            found += _checkpoints(sub, inner.inner_of(i), path + (i,))
    return found


def _snapshots(graph: CostGraph, schedule: Schedule, path: tuple = ()) -> dict[int, list[tuple[tuple, int]]]:
    """Node -> ``(path, bytes)`` of the checkpoints of ``schedule`` (nested ones included) whose
    forwards start at it and copy the mutated buffers they read (``reads=``; the copies live
    until the checkpoint's backward ends). Empty where the step mutates no buffer."""
    starts: dict[int, list[tuple[tuple, int]]] = {}
    if not graph.state_bytes:
        return starts
    for i, (seg, rec) in enumerate(zip(schedule.segments, schedule.recomputed)):
        if rec:
            for where, members in _checkpoints(seg, schedule.inner_of(i), path + (i,)):
                starts.setdefault(members[0], []).append((where, graph.snapshot_bytes(members)))
    return starts


def _released(graph: CostGraph, v: int, grads: _Grads) -> int:
    """What v's backward lets go of its gradient early (``graph.bwd_released_bytes``) where
    another node holds that buffer: it stays alive beside v's backward."""
    return graph.bwd_released_bytes[v] if graph.bwd_released_bytes and grads.held_elsewhere(v) else 0


def _held_on(graph: CostGraph, v: int, survives) -> int:
    """Bytes of the inputs that v's backward lets go before its peak (``graph.bwd_freed_inputs``,
    which its transient does not hold) that the step keeps alive through it: ``survives(o)``,
    another holder or reader of o."""
    if not graph.bwd_freed_inputs:
        return 0
    return sum(graph.out_bytes[o] for o in graph.bwd_freed_inputs[v] if survives(o))


def _grad_step(graph: CostGraph, v: int, mem: _Memory, grads: _Grads, casts: _Casts, held_on: int = 0) -> None:
    """Node v's backward: its inputs' gradients appear, its output's gradient goes.

    While it runs, v's backward holds its results (its inputs' gradients, new buffers unless it
    hands on views of its own, and its parameters' gradients) and its transient
    (``bwd_transient``) at once. Then autograd hands the results on: a second gradient for an
    input is added to the first out of place (as it is under a dispatch mode, which every
    measurement here runs under; without one PyTorch adds in place, one buffer less) while all
    of v's results are alive, its incoming gradient already let go; so is a shared parameter's
    (:class:`_SharedParams`). What of its incoming gradient v's backward lets go early
    (``CopySlices``, once the view's backward spread it over the base) stays alive beside its
    transient where another node holds the same buffer (:func:`_released`). ``held_on``: what of
    the inputs v saves its transient lets go and the step keeps (:func:`_held_on`).
    """
    of = grads.of
    if v not in of:  # a node no gradient reaches runs no backward (a dropped branch's split)
        _no_grad_step(graph, v, mem, casts)
        return
    share = v if graph.grad_alias[v] else None
    released = _released(graph, v, grads) if graph.bwd_released_bytes else 0
    grad_bytes = graph.grad_bytes
    again = []  # inputs that already have a gradient
    shared = v in grads.shared.at  # it reads a shared parameter
    for p in graph.preds[v]:
        nbytes = grad_bytes[p]
        if nbytes:
            if p in of:
                again.append(p)
            else:
                grads.give(p, nbytes, share)
    incoming = 0 if share is not None else sum(grad_bytes[p] for p in again)
    # a shared cast whose gradient v completes: the sum so far is let go when v's own has been added
    # to it, after v's op (whose transient, measured alone, holds the copy of that new sum); v's op
    # makes its own gradients of the casts it read beside it (a Linear called thrice, its first call
    # recomputed: 1.06x the budget at "min" where the sum was let go first)
    ends = grads.shared.cast_ends(v) if shared else []
    if ends:
        mem.note(incoming + sum(graph.cast_bytes[c] for c in graph.cast_reads[v]))
    for i, _ in ends:
        mem.free(("p", i))
    mem.note(incoming + graph.bwd_transient_bytes[v] + released + held_on)
    sums = [grad_bytes[p] for p in again]
    if shared:
        sums += grads.shared.summed(v)
    grads.drop(v)  # the backward returned: its incoming gradient and extra buffers are let go
    mem.free(("x", v))
    if graph.cast_bytes:
        casts.release(v)
    for _, nbytes in ends:  # the old sum, v's own gradient and the new sum at once
        mem.note(incoming + 3 * nbytes)
    if sums:
        params = min(graph.param_grad_bytes[v], graph.bwd_transient_bytes[v])
        mem.note(incoming + params + max(sums))
    for p in again:
        grads.resum(p, grad_bytes[p])
    if shared:
        grads.shared.after(v)
    if graph.param_grads_held and graph.param_grad_bytes[v]:
        # one compiled backward graph: v's parameter gradients wait for its end (an upper bound
        # for a parameter read by several nodes, whose gradients the graph sums into one)
        mem.alloc(("pg", v), graph.param_grad_bytes[v])


def _no_grad_step(graph: CostGraph, v: int, mem: _Memory, casts: _Casts) -> None:
    """:func:`_grad_step` of a node no gradient reaches: it runs no backward, what it saved goes."""
    mem.free(("x", v))
    if graph.cast_bytes:
        casts.release(v)
    if graph.param_grads_held and graph.param_grad_bytes[v]:
        mem.alloc(("pg", v), graph.param_grad_bytes[v])


def _tail(graph: CostGraph, v: int, mem: _Memory) -> None:
    """The tail of v's backward (``graph.bwd_tail_bytes``: the gradient path through a forward
    pre-hook's weight), once v's own op let go of its incoming gradient and of what it saved."""
    if graph.bwd_tail_bytes and graph.bwd_tail_bytes[v]:
        mem.note(graph.bwd_tail_bytes[v])


def _stop(graph: CostGraph, inner: Schedule) -> tuple[int, bool] | None:
    """Where the recomputation of a checkpoint running ``inner`` stops (torch's early stop):
    ``(k, runs)`` with ``k`` the position, in the concatenated segments, of the node at which the
    last tensor saved at this level is saved again, ``runs`` whether that node runs before (its
    own output or extra buffers are saved after it computes, its inputs before); ``None`` when
    nothing is saved at this level, so nothing is recomputed. A nested checkpoint saves its
    inputs when it starts, before its first node runs."""
    found, pos = None, 0
    for sub, rec in zip(inner.segments, inner.recomputed):
        if rec:
            found = (pos, False)
        else:
            saving = graph.saving
            for k, v in enumerate(sub):
                if saving[v]:
                    found = (pos + k, graph.saves_after_running(v))
        pos += len(sub)
    return found


def mechanism_time(graph: CostGraph, seg, inner: Schedule | None = None) -> int:
    """The checkpoint mechanism's time for a checkpoint over ``seg`` (``graph.checkpoint_time``
    plus each node's ``graph.hook_time``), nested checkpoints (``inner``) included."""
    total = graph.checkpoint_time + sum(graph.hook_time[v] for v in seg)
    for i, (sub, rec) in enumerate(zip(inner.segments, inner.recomputed) if inner else ()):
        if rec:
            total += mechanism_time(graph, sub, inner.inner_of(i))
    return total


def rerun_time(graph: CostGraph, seg, inner: Schedule | None = None) -> int:
    """Forward cost that the backward of a checkpoint over ``seg`` runs again: its nodes up to
    the early stop (:func:`_stop`), plus what the checkpoints nested in it (``inner``) run again
    in their own backwards. In one compiled backward (``graph.param_grads_held``) the nodes the
    backward needs (:func:`partitioned_rerun_time`)."""
    if graph.param_grads_held and inner is None:
        return partitioned_rerun_time(graph, seg)
    inner = inner or Schedule((tuple(seg),), (False,))
    stop = _stop(graph, inner)
    if stop is None:
        return 0
    k, runs = stop
    order = [v for sub in inner.segments for v in sub]
    total = sum(graph.time[v] for v in order[:k + 1 if runs else k])
    for i, (sub, rec) in enumerate(zip(inner.segments, inner.recomputed)):
        if rec:
            total += rerun_time(graph, sub, inner.inner_of(i))
    return total


def partitioned_rerun_time(graph: CostGraph, seg) -> int:
    """Forward cost that a compiled backward runs again for a recomputed ``seg``, as AOTAutograd's
    partitioner recomputes a checkpoint region whose outputs read outside it are saved (what
    :func:`fxremat.passes.partition.keep_segment_outputs` makes it do): the segment's nodes whose
    values a node of the segment saves, and the nodes of the segment they are computed from, up
    to those outputs. A kept output's extra buffers (a dropout's mask, a norm's statistics) are
    saved with it; another node saving extra buffers is run again for them, without its inputs
    where only the buffers are needed (a mask comes from the random state). Not torch's early
    stop, which runs a prefix of the segment: on the 4-block transformer at 0.7 a plan of two
    whole blocks ran 71 M matrix-product FLOPs again in the partitioned backward; the prefix up to
    its dropout's mask charged it 116 M cost units (FLOPs plus fused traffic), this count 64 M."""
    members = set(seg)
    kept = {v for v in seg if graph.is_output[v] or any(s not in members for s in graph.succs[v])}
    wanted = [w for u in seg for w in graph.saved[u] if w in members]
    needed: set[int] = set()
    while wanted:
        w = wanted.pop()
        if w not in kept and w not in needed:
            needed.add(w)
            wanted.extend(p for p in graph.preds[w] if p in members)
    needed |= {u for u in seg if graph.extra_bytes[u] > 0 and u not in kept}
    return sum(graph.time[v] for v in needed)


def _backward_nested(graph: CostGraph, seg, inner: Schedule, mem: _Memory, grads: _Grads, casts: _Casts,
                     depth: int, parent=None, path: tuple = ()) -> None:
    """Run the backward of the checkpointed segment ``seg``, recomputed following ``inner``.

    As in torch's non-reentrant checkpoint, the recomputation starts only when the backward first
    unpacks a tensor saved at this level (or a nested checkpoint needs its inputs), after ``parent``
    (the enclosing checkpoint's recomputation) has run; the backward of the nodes after the last
    saving one runs before it. It is a forward over ``inner``'s segments with copies
    ("r", depth, v): a plain inner segment keeps what its nodes save, a recomputed one only its
    inputs (held by its checkpoint until its backward ends). It stops as soon as the last tensor
    saved at this level is saved again (:func:`_stop`): what nothing saved dies then, and the
    nodes after it are not run again. The inner segments' backwards then run in reverse, a
    recomputed one recursing one level deeper. Values outside ``seg`` are held by the levels
    above until ``seg``'s backward ends.

    ``path`` names the checkpoint (its segment's index at each level): the copies of the mutated
    buffers it reads, taken when its forward ran, go when its backward ends; while it is
    recomputed it copies them and those it mutates (:meth:`~fxremat.core.CostGraph.restore_bytes`),
    and the checkpoints nested in it whose forwards the recomputation runs copy theirs again,
    all let go when it stops.
    """
    members = set(seg)
    sub_of = {v: i for i, sub in enumerate(inner.segments) for v in sub}
    # per member: how many of its readers in seg are still to run again (one more where seg returns
    # it), and its backward holders as in _holders (nodes of kept inner segments, inner checkpoints)
    needed = dict.fromkeys(seg, 0)
    holds: dict[int, set[int]] = {v: set() for v in seg}
    held_by: dict[int, list[int]] = {}  # inner checkpoint -> the members it holds
    pred_roots, saved, saving = graph.pred_roots, graph.saved, graph.saving
    for v in seg:
        i = sub_of[v]
        rec = inner.recomputed[i]
        for r in pred_roots[v]:
            if r in members:
                needed[r] += 1
                if rec and sub_of[r] != i and ~i not in holds[r]:
                    holds[r].add(~i)
                    held_by.setdefault(i, []).append(r)
        if not rec:
            for o in saved[v]:
                if o in members:
                    holds[o].add(v)
    # what the segment returns is read once its recomputation ends
    for r in boundary(graph, members):
        if r in members:
            needed[r] += 1
    order = [v for sub in inner.segments for v in sub]
    stop = _stop(graph, inner)
    recomputed = False

    def maybe_free(r):
        if not needed[r] and not holds[r]:
            mem.free(("r", depth, r))

    def recompute():
        nonlocal recomputed
        if recomputed or stop is None:
            return
        recomputed = True
        if parent is not None:
            parent()
        k, runs = stop
        ran = order[:k + 1] if runs else order[:k]
        # the node it stops at before running (a kept one: it saves its inputs) under autocast has
        # made its casts of the weights first, the early stop coming as it saves them: they are
        # held, as a node that ran holds them, until its backward (a 1024x512x3x3 convolution
        # recomputed alone in HRNet: its bf16 weight beside its backward, 1.26x the budget at "min")
        cast_only = order[k] if graph.cast_bytes and not runs and not inner.recomputed[sub_of[order[k]]] else None
        if graph.state_bytes:
            mem.alloc(("rs", path), graph.restore_bytes(seg))
        # the nested checkpoints it runs take their copies again (a nested segment runs whole or not at all)
        snapshots = {v: found for v, found in _snapshots(graph, inner, path).items() if v in ran}
        for v in ran:
            for where, nbytes in snapshots.get(v, ()):
                mem.hold(("rsnap", path, where), nbytes)
            kept = not inner.recomputed[sub_of[v]]
            last = "x" if kept else "c" if graph.cast_bytes else "f"
            # on top of all the node leaves, as in the forward: in a nested checkpoint, which drops
            # them, its extra buffers too (a node saving a wide hidden value, run again by the
            # outer recomputation beside the outer segment's incoming gradient: 0.76x measured)
            transient = graph.transient_bytes[v] + (0 if kept else graph.extra_bytes[v])
            if graph.held_bytes and graph.held_bytes[v]:
                # its module's attributes made again (a hook's weight) while it still holds the forward's
                mem.note(graph.held_bytes[v])
            mem.alloc(("r", depth, v), graph.out_bytes[v], transient if last == "f" else 0)
            if graph.cast_bytes:  # the recomputation runs in an autocast region of its own
                casts.run(path, v, transient if last == "c" else 0)
            if kept:
                mem.alloc(("x", v), graph.extra_bytes[v], transient)
            for r in pred_roots[v]:
                if r in members:
                    needed[r] -= 1
                    maybe_free(r)
            maybe_free(v)
        if cast_only is not None:
            casts.run(path, cast_only)
        for v in ran:  # the early stop: consumers after it never run
            needed[v] = 0
            maybe_free(v)
        mem.free(("rs", path))
        for found in snapshots.values():
            for where, _ in found:
                mem.free(("rsnap", path, where))
        if graph.cast_bytes:  # its region exits: what a node kept saves of the cache stays
            ran_or_cast = ran + [cast_only] * (cast_only is not None)
            casts.exit(path, [v for v in ran_or_cast if not inner.recomputed[sub_of[v]]])

    for i in reversed(range(len(inner.segments))):
        sub = inner.segments[i]
        if inner.recomputed[i]:
            deeper = inner.inner_of(i) or Schedule((sub,), (False,))
            _backward_nested(graph, sub, deeper, mem, grads, casts, depth + 1, recompute, path + (i,))
            mem.free(("snap", path + (i,)))
            for r in held_by.get(i, ()):
                holds[r].discard(~i)
                maybe_free(r)
            continue
        for v in reversed(sub):
            if saving[v]:
                # what v's backward made before its first unpack lives through the recomputation
                # that unpack starts (CopySlices' base-sized gradients; see CostGraph)
                early = 0 if recomputed else (
                    (graph.bwd_unpack_bytes[v] if graph.bwd_unpack_bytes else 0) + _released(graph, v, grads))
                if early:
                    mem.alloc(("u", v), early)
                recompute()
                mem.free(("u", v))
            _grad_step(graph, v, mem, grads, casts, _held_on(
                graph, v, lambda o: o not in members or needed[o] or _held_by_others(holds[o], v)))
            for o in saved[v]:
                if o in members:
                    holds[o].discard(v)
                    maybe_free(o)
            _tail(graph, v, mem)


def _backward_segment(graph, schedule, s, mem, grads, casts, holds, pending, outputs, held) -> None:
    """Segment s's backward; ``held``: the owners its checkpoint holds (:func:`_holders`)."""
    seg = schedule.segments[s]
    if schedule.recomputed[s]:
        nested = schedule.inner_of(s) or Schedule((seg,), (False,))
        _backward_nested(graph, seg, nested, mem, grads, casts, 1, path=(s,))
        mem.free(("snap", (s,)))
        _release_segment(s, held, holds, pending, outputs, mem)
        return
    saved, freed_inputs = graph.saved, graph.bwd_freed_inputs
    for v in reversed(seg):
        held_on = _held_on(graph, v, lambda o: pending[o] or o in outputs or _held_by_others(holds[o], v)) \
            if freed_inputs else 0
        _grad_step(graph, v, mem, grads, casts, held_on)
        for o in saved[v]:
            h = holds[o]
            h.discard(v)
            if not pending[o] and not h and o not in outputs:
                mem.free(("f", o))
        _tail(graph, v, mem)
    _release_segment(s, held, holds, pending, outputs, mem)


def _release_segment(s, held, holds, pending, outputs, mem) -> None:
    """Segment s's backward ended: its checkpoint lets go of its inputs (``held``)."""
    for r in held:
        h = holds[r]
        h.discard(~s)
        if not pending[r] and not h and r not in outputs:
            mem.free(("f", r))


def predicted_timeline(graph: CostGraph, schedule: Schedule) -> Timeline:
    """The simulator's memory after each event, and where the backward starts.

    :func:`fxremat.simulate.simulate` records one event per forward allocation (two per node of
    a plain segment: its output and its extra saved buffers; under autocast's cache one more, its
    casts, then one for the loss's forward, before the cache goes), one per output gradient, then
    the loss: that event is ``backward_start``.
    """
    _, events = simulate(graph, schedule, timeline=True)
    cache = 1 if graph.cast_bytes else 0
    forward = sum(len(seg) * ((1 if rec else 2) + cache) for seg, rec in zip(schedule.segments, schedule.recomputed))
    forward += cache  # the loss's forward, before the cache goes
    out_grads = len(graph.gradient_outputs())
    return Timeline(tuple(events), forward + out_grads)
