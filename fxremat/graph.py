"""The DAG of call nodes with their costs: :func:`build_graph` and :class:`CostGraph`.

:class:`CostGraph` is what the solvers see: plain ints in tuples, nodes numbered in topological
(FX graph) order, no torch objects. :func:`to_networkx` gives the same DAG as a
``networkx.DiGraph`` with the costs as node attributes, for analysis and tests.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

import networkx as nx
import torch.fx as fx

from .passes.profile import CALL_OPS, GraphCosts

__all__ = ["CostGraph", "build_graph", "to_networkx", "save_graph", "load_graph", "TIME_RESOLUTION",
           "LOSS_OUTPUT_COPIES"]

# Forward costs are scaled to integers summing to about this many units, so that solvers work
# on exact integer arithmetic (identical answers from the Python and Cython kernels).
TIME_RESOLUTION = 100_000
LOSS_OUTPUT_COPIES = 2
_MAX_SCALAR_BYTES = 8  # one element of at most float64: a returned loss


@dataclass(frozen=True)
class CostGraph:
    """Call nodes ``0..n-1`` in topological order with integer costs.

    ``root[v]`` is the node owning the storage ``v``'s output lives in (``v`` itself unless it
    is a view); ``saved[v]`` the owners of the storages autograd saves for ``v``'s backward
    (``v`` included when it saves its own output). ``grad_alias[v]``: its backward passes views
    of its output's gradient to its inputs instead of new buffers. ``anchor[v]`` ties a view or
    a non-tensor node to the group of its latest predecessor: lower sets contain both or
    neither (see :mod:`fxremat.lowersets`). ``uses_rng[v]``: v draws random numbers.
    ``order_chains``: call nodes whose relative order decides a float sum outside the graph's
    edges — the consumers of one graph input or attribute, the calls of one shared module
    (their gradients accumulate into the same ``.grad``). ``time[v] * time_unit`` is its forward cost
    in ``cost_unit``; ``step_cost`` is one plain forward + backward in the same unit.
    ``loss_bytes`` is what the loss computed from the outputs is assumed to allocate while the
    backward starts: ``LOSS_OUTPUT_COPIES`` buffers the size of the differentiable outputs (a
    cross-entropy keeps its log-softmax and allocates its gradient). ``loss_output``: the index of
    a one-element differentiable output when the model returns its loss (Hugging Face models
    given ``labels=``): the backward starts from it alone (``loss.backward()``), the other
    outputs get no gradient and ``loss_bytes`` is 0; -1 when the loss is computed from the
    outputs.
    ``transient_bytes[v]``: what v needs while its forward runs beyond its output (its
    parameters' gradient for graphs saved earlier); ``bwd_transient_bytes[v]``: what its backward
    needs beyond the gradients it hands its inputs (temporaries, and its parameters' gradients
    until each is accumulated into ``.grad``); ``param_grad_bytes[v]``: the gradients of the
    parameters v reads, all alive while v's backward hands on its results.
    ``shared_params``: ``(bytes, readers)`` of each parameter that two or more call nodes read
    (tied weights, a module called twice): autograd holds its gradient from the backward of its
    first reader (in backward order) to that of its last, then accumulates it into ``.grad``.
    ``data_succs``: set only on a graph whose ``preds``/``succs`` carry extra precedence edges
    (:func:`fxremat.planner.ordered_preds`): the successors along data edges alone.
    """

    names: tuple[str, ...]
    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    is_output: tuple[bool, ...]
    time: tuple[int, ...]
    out_bytes: tuple[int, ...]
    root: tuple[int, ...]
    saved: tuple[tuple[int, ...], ...]
    extra_bytes: tuple[int, ...]
    grad_bytes: tuple[int, ...]
    transient_bytes: tuple[int, ...]
    time_unit: float
    step_cost: float
    cost_unit: str
    loss_bytes: int = 0
    loss_output: int = -1
    anchor: tuple[int, ...] = ()
    uses_rng: tuple[bool, ...] = ()
    order_chains: tuple[tuple[int, ...], ...] = ()
    grad_alias: tuple[bool, ...] = ()
    data_succs: tuple[tuple[int, ...], ...] = ()
    bwd_transient_bytes: tuple[int, ...] = ()
    param_grad_bytes: tuple[int, ...] = ()
    shared_params: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def n(self) -> int:
        return len(self.names)

    def gradient_outputs(self) -> tuple[int, ...]:
        """The outputs the backward starts from with a gradient: the loss output alone when the
        model returns its loss (``loss_output``), else every differentiable output."""
        if self.loss_output >= 0:
            return (self.loss_output,)
        return tuple(v for v in range(self.n) if self.is_output[v] and self.grad_bytes[v])

    def step_transient(self, v: int) -> int:
        """The larger of v's forward and backward transients, plus the gradients of shared
        parameters that may be held across v's backward (:meth:`held_grad_bytes`): what the
        solvers' step terms use."""
        return max(self.transient_bytes[v], self.bwd_transient(v)) + self.held_grad_bytes(v)

    def held_grad_bytes(self, v: int) -> int:
        """An upper bound of the shared parameters' gradient bytes held while v's backward runs:
        each one whose readers span v, twice at a reader that adds its own (summed out of place)."""
        held = 0
        for nbytes, readers in self.shared_params:
            if readers[0] <= v <= readers[-1]:
                held += 2 * nbytes if v in readers[:-1] else nbytes
        return held

    def bwd_transient(self, v: int) -> int:
        """Bytes node v's backward needs beyond its inputs' gradients (``transient_bytes`` for
        graphs saved before the backward was measured)."""
        return self.bwd_transient_bytes[v] if self.bwd_transient_bytes else self.transient_bytes[v]

    def __post_init__(self):
        for v, ps in enumerate(self.preds):
            assert all(p < v for p in ps), f"node {self.names[v]} has a predecessor after it: {ps}"


def _call_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if a.op in CALL_OPS]


def _output_nodes(graph: fx.Graph) -> set[fx.Node]:
    out = next(n for n in graph.nodes if n.op == "output")
    return {a for a in out.all_input_nodes if a.op in CALL_OPS}


def build_graph(gm: fx.GraphModule, costs: GraphCosts) -> CostGraph:
    """Combine the traced graph and its profile into a :class:`CostGraph`."""
    calls = [n for n in gm.graph.nodes if n.op in CALL_OPS]
    index = {n.name: i for i, n in enumerate(calls)}
    by_name = {c.name: c for c in costs.nodes}
    assert set(by_name) == set(index), "profile and graph disagree on the call nodes"
    outputs = _output_nodes(gm.graph)
    preds = [tuple(sorted({index[a.name] for a in _call_inputs(n)})) for n in calls]
    succs = [[] for _ in calls]
    for v, ps in enumerate(preds):
        for p in ps:
            succs[p].append(v)
    node_costs = [by_name[n.name] for n in calls]
    total = sum(c.fwd_cost for c in node_costs) or 1.0
    unit = total / TIME_RESOLUTION
    roots = tuple(index.get(c.root, v) for v, c in enumerate(node_costs))
    out_roots = {roots[v] for v, n in enumerate(calls) if n in outputs and node_costs[v].grad_bytes}
    saved = []
    for v, c in enumerate(node_costs):
        owners = {index[s] for s in c.saved_inputs if s in index} | ({v} if c.saves_output else set())
        saved.append(tuple(sorted(owners)))
    shared = _shared_params(gm, node_costs)
    # A model that returns its loss: one output of one element that takes a gradient (and others).
    scalars = [r for r in out_roots if node_costs[r].grad_bytes <= _MAX_SCALAR_BYTES]
    loss_output = scalars[0] if len(scalars) == 1 else -1
    return CostGraph(
        names=tuple(n.name for n in calls),
        preds=tuple(preds),
        succs=tuple(tuple(s) for s in succs),
        is_output=tuple(n in outputs for n in calls),
        time=tuple(round(c.fwd_cost / unit) for c in node_costs),
        out_bytes=tuple(c.out_bytes for c in node_costs),
        root=roots,
        saved=tuple(saved),
        extra_bytes=tuple(c.extra_bytes for c in node_costs),
        grad_bytes=tuple(c.grad_bytes for c in node_costs),
        transient_bytes=tuple(c.fwd_transient_bytes for c in node_costs),
        bwd_transient_bytes=tuple(c.bwd_transient_bytes for c in node_costs),
        param_grad_bytes=tuple(c.param_grad_bytes for c in node_costs),
        shared_params=shared,
        time_unit=unit,
        step_cost=costs.step_cost,
        cost_unit=costs.cost_unit,
        grad_alias=tuple(c.grad_alias for c in node_costs),
        uses_rng=tuple(c.uses_rng for c in node_costs),
        order_chains=_order_chains(gm.graph, index) + tuple(readers for _, readers in shared),
        anchor=_anchors(preds, [c.tensor_output and c.root == c.name for c in node_costs]),
        loss_bytes=0 if loss_output >= 0 else LOSS_OUTPUT_COPIES * sum(node_costs[r].out_bytes for r in out_roots),
        loss_output=loss_output,
    )


def _shared_params(gm: fx.GraphModule, node_costs) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(gradient bytes, reader nodes in order) of each parameter read by two or more call nodes."""
    readers: dict[str, list[int]] = {}
    for v, c in enumerate(node_costs):
        for name in c.params:
            readers.setdefault(name, []).append(v)
    params = dict(gm.named_parameters())
    return tuple((params[name].numel() * params[name].element_size(), tuple(r))
                 for name, r in readers.items() if len(r) >= 2)


def _order_chains(graph: fx.Graph, index: dict) -> tuple[tuple[int, ...], ...]:
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


def _anchors(preds, owns_storage) -> tuple[int, ...]:
    """Tie every node that owns no storage (views, ints, sizes) to the latest group head among
    its predecessors. Heads precede their members, so the quotient DAG stays acyclic."""
    head: list[int] = []
    for v, ps in enumerate(preds):
        head.append(v if owns_storage[v] or not ps else max(head[p] for p in ps))
    return tuple(head)


def to_networkx(graph: CostGraph) -> nx.DiGraph:
    """The DAG as a ``networkx.DiGraph`` (nodes are indices, costs are node attributes)."""
    g = nx.DiGraph()
    for v, name in enumerate(graph.names):
        g.add_node(v, name=name, time=graph.time[v], out_bytes=graph.out_bytes[v])
    g.add_edges_from((p, v) for v, ps in enumerate(graph.preds) for p in ps)
    return g


def save_graph(graph: CostGraph, path) -> None:
    """Write ``graph`` as JSON (a fixture that needs neither torch nor the model to load)."""
    with open(path, "w") as f:
        json.dump(asdict(graph), f)


def load_graph(path) -> CostGraph:
    """Read a graph written by :func:`save_graph`."""
    with open(path) as f:
        data = json.load(f)
    known = {f.name for f in fields(CostGraph)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"fxremat.graph.load_graph: {path} has unknown fields {sorted(unknown)}")
    nested = {"preds", "succs", "saved"}
    if "shared_params" in data:
        data["shared_params"] = [(nbytes, tuple(readers)) for nbytes, readers in data["shared_params"]]
    return CostGraph(**{k: tuple(tuple(x) for x in v) if k in nested else tuple(v) if isinstance(v, list) else v
                        for k, v in data.items()})
