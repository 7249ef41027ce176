"""The DP kernels: compiled (fxremat._dp) vs pure-Python reference, and both vs oracles.

- Cython vs Python on random DAGs and costs: identical lower sets, tables and solutions.
- Lower sets vs networkx: each one is the down-closure of an antichain.
- Exact DP vs brute force (tests/brute_dp.py) on graphs of ≤ 6 nodes, through both kernels.
- The bounds that shrink the search do not change any answer.
"""

import inspect
import os
import warnings

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import brute_dp as brute
from fxremat import _kernels
from fxremat.core import CostGraph, anchors, load_graph, merged_anchors
from fxremat.lowersets import all_lower_sets, enumerate_lower_sets, pruned_family
from fxremat.solvers import kusumoto

# Not marked `solver`: the tests here pick their kernels themselves (dp_impl, run_both, the
# compiled module by name), so the FXREMAT_PURE_PYTHON=1 pass ran them again as the first pass
# did; the two on the default kernels check oracles that test_lower_sets_identical and
# test_tables_and_solutions_identical carry over to the reference.

# dp_impl switches the kernels once per test, for all its examples
FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "fixtures")

needs_compiled = pytest.mark.skipif(not _kernels.compiled_available(),
                                    reason=f"fxremat._dp is not built ({_kernels.BUILD_HINT})")


# --------------------------------------------------------------------------- random graphs


@st.composite
def cost_graphs(draw, max_nodes=6, max_bytes=9, min_nodes=0, reach=None):
    """A random CostGraph that keeps build_graph's invariants: preds before their node,
    root[v] is v or a predecessor's root, saved owners are roots of v or of its inputs, and
    anchors follow fxremat.core.anchors (or tie nothing); no ordering edges."""
    n = draw(st.integers(min_nodes, max_nodes))
    preds, roots = [], []
    for v in range(n):
        first = 0 if reach is None else max(0, v - reach)
        ps = tuple(sorted(draw(st.sets(st.integers(first, v - 1), max_size=3)))) if v else ()
        preds.append(ps)
        view_of = draw(st.sampled_from((None,) + ps))
        roots.append(v if view_of is None else roots[view_of])
    succs = [[] for _ in range(n)]
    for v, ps in enumerate(preds):
        for p in ps:
            succs[p].append(v)
    saved = []
    for v in range(n):
        owners = sorted({roots[p] for p in preds[v]} | ({v} if roots[v] == v else set()))
        saved.append(tuple(draw(st.sets(st.sampled_from(owners), max_size=len(owners)))) if owners else ())
    ints = lambda hi: draw(st.lists(st.integers(0, hi), min_size=n, max_size=n))  # noqa: E731
    owns = [roots[v] == v and draw(st.booleans()) for v in range(n)]
    anchor = anchors(preds, owns) if draw(st.booleans()) else tuple(range(n))
    transient = tuple(ints(4))
    return CostGraph(
        names=tuple(f"n{v}" for v in range(n)), preds=tuple(preds), succs=tuple(tuple(s) for s in succs),
        order_preds=((),) * n, anchor=anchor,
        is_output=tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n))), time=tuple(ints(5)),
        out_bytes=tuple(ints(max_bytes)), root=tuple(roots), saved=tuple(tuple(sorted(s)) for s in saved),
        extra_bytes=tuple(ints(3)), grad_bytes=tuple(ints(max_bytes)), grad_alias=(False,) * n,
        transient_bytes=transient, bwd_transient_bytes=transient, param_grad_bytes=(0,) * n, shared_params=(),
        loss_bytes=draw(st.integers(0, max_bytes)), loss_output=None, checkpoint_time=0, hook_time=tuple(ints(3)), time_unit=1.0, step_cost=1.0,
        cost_unit="units",
    )


def exact_family(graph):
    return all_lower_sets(graph.preds, anchor=graph.anchor)


def approx_family(graph):
    return pruned_family(graph.preds, anchor=graph.anchor)


def budgets_for(graph, tables):
    """None, and budgets from below the least peak to above the plain one."""
    least = kusumoto.solve(graph, tables, objective="memory").peak_bytes
    plain = kusumoto.solve(graph, tables).peak_bytes
    return [None, least - 1, least, (least + plain) // 2, plain, plain + 5]


def run_both(fn):
    """``fn()`` with the reference kernels and with the compiled ones."""
    with _kernels.use("python"):
        ref = fn()
    with _kernels.use("cython"):
        fast = fn()
    return ref, fast


# --------------------------------------------------------------------------- compiled vs reference


@needs_compiled
@FAST
@given(cost_graphs(max_nodes=12), st.one_of(st.none(), st.integers(0, 60)))
def test_lower_sets_identical(graph, cap):
    ref, fast = run_both(lambda: all_lower_sets(graph.preds, cap=cap, anchor=graph.anchor))
    assert ref == fast


@needs_compiled
@FAST
@given(cost_graphs(max_nodes=9), st.booleans())
def test_tables_and_solutions_identical(graph, exact):
    family = exact_family(graph) if exact else approx_family(graph)
    for early_stop in (True, False):
        tables, fast_tables = run_both(lambda: kusumoto.build_tables(graph, family, early_stop))
        assert tables == fast_tables
        for budget in budgets_for(graph, tables):
            for objective in kusumoto.OBJECTIVES:
                ref, fast = run_both(lambda: kusumoto.solve(graph, tables, budget=budget, objective=objective))
                assert ref == fast, (budget, objective, early_stop)


@needs_compiled
@settings(max_examples=15, deadline=None)
@given(cost_graphs(min_nodes=60, max_nodes=150, max_bytes=1000, reach=4))
def test_large_graphs_identical(graph):
    """Several words per bitset, more than 64 sets: the compiled word loops."""
    family = all_lower_sets(graph.preds, cap=250, anchor=graph.anchor) or approx_family(graph)
    ref_tables, fast_tables = run_both(lambda: kusumoto.build_tables(graph, family))
    assert ref_tables == fast_tables
    least = kusumoto.solve(graph, ref_tables, objective="memory").peak_bytes
    for budget, objective in [(None, "memory"), (least + least // 4, "time"), (None, "time")]:
        ref, fast = run_both(lambda: kusumoto.solve(graph, ref_tables, budget=budget, objective=objective))
        assert ref == fast


@needs_compiled
def test_kernel_signatures_match():
    from fxremat import _dp

    from fxremat.solvers.rotor import rotor_table

    pairs = [(enumerate_lower_sets, _dp.enumerate_lower_sets), (kusumoto.set_tables, _dp.set_tables),
             (kusumoto.solve_dp, _dp.solve_dp), (kusumoto.completion_bounds, _dp.completion_bounds),
             (rotor_table, _dp.rotor_table)]
    for ref, fast in pairs:
        assert list(inspect.signature(ref).parameters) == list(inspect.signature(fast).parameters)


@needs_compiled
@pytest.mark.parametrize("name", ["unet", "pspnet", "vgg19"])
def test_fixture_graphs_identical(name):
    graph = load_graph(os.path.join(FIXTURES, f"{name}.json"))
    family = approx_family(graph) if name == "pspnet" else exact_family(graph)
    ref_tables, fast_tables = run_both(lambda: kusumoto.build_tables(graph, family))
    assert ref_tables == fast_tables
    least = kusumoto.solve(graph, ref_tables, objective="memory").peak_bytes
    for budget, objective in [(None, "memory"), (int(least * 1.3), "time")]:
        ref, fast = run_both(lambda: kusumoto.solve(graph, ref_tables, budget=budget, objective=objective))
        assert ref == fast


@st.composite
def chain_tables(draw):
    """Arguments of rotor_table: a random chain in slot units and a slot count."""
    n = draw(st.integers(0, 6))
    ints = lambda hi, size=n: draw(st.lists(st.integers(0, hi), min_size=size, max_size=size))  # noqa: E731
    times = st.floats(0, 10, allow_nan=False) | st.integers(0, 10)
    wa = ints(4, n + 1)
    wabar = [wa[i + 1] + extra for i, extra in enumerate(ints(4))]
    uf = draw(st.lists(times, min_size=n, max_size=n))
    ub = draw(st.lists(times, min_size=n, max_size=n))
    return uf, ub, wa, wabar, ints(3), ints(3), draw(st.integers(0, 30))


@needs_compiled
@FAST
@given(chain_tables())
def test_rotor_table_identical(args):
    from fxremat import _dp
    from fxremat.solvers.rotor import rotor_table

    assert _dp.rotor_table(*args) == rotor_table(*args)


@needs_compiled
@pytest.mark.parametrize("seed, n, slots, int_times", [(0, 30, 200, False), (1, 30, 200, True),
                                                       (2, 21, 64, True), (3, 60, 150, False)])
def test_rotor_table_identical_long_chains(seed, n, slots, int_times):
    """Chains long enough for the kernel's blocks of stages and of slots, with ties (int times)."""
    import random

    from fxremat import _dp
    from fxremat.solvers.rotor import rotor_table

    rng = random.Random(seed)
    wa = [rng.randint(0, 8) for _ in range(n + 1)]
    args = ([rng.randint(0, 3) if int_times else rng.uniform(0, 10) for _ in range(n)],
            [rng.randint(0, 3) if int_times else rng.uniform(0, 10) for _ in range(n)],
            wa, [wa[i + 1] + rng.randint(0, 12) for i in range(n)],
            [rng.randint(0, 3) for _ in range(n)], [rng.randint(0, 3) for _ in range(n)], slots)
    cost, choice = rotor_table(*args)
    assert _dp.rotor_table(*args) == (cost, choice)
    assert sum(c > 0 for c in choice) > n  # the F_ck splits are exercised


# --------------------------------------------------------------------------- oracles


def tie_consistent(graph, mask):
    return all((mask >> v) & 1 == (mask >> a) & 1 for v, a in enumerate(graph.anchor))


@FAST
@given(cost_graphs(max_nodes=10))
def test_lower_sets_are_antichain_closures(dp_impl, graph):
    dag = nx.DiGraph()
    dag.add_nodes_from(range(graph.n))
    dag.add_edges_from((p, v) for v, ps in enumerate(graph.preds) for p in ps)
    closures = set()
    for antichain in nx.antichains(dag):
        mask = 0
        for v in antichain:
            for u in nx.ancestors(dag, v) | {v}:
                mask |= 1 << u
        closures.add(mask)
    expected = sorted((m for m in closures if tie_consistent(graph, m)), key=lambda m: (m.bit_count(), m))
    assert exact_family(graph) == expected
    assert set(approx_family(graph)) <= set(expected)


@FAST
@given(cost_graphs(max_nodes=10, min_nodes=1), st.data())
def test_merged_groups_are_convex_and_acyclic(graph, data):
    """merged_anchors ties a node set into one group with everything on paths between its
    members: old groups stay whole, heads come first, the quotient stays acyclic (networkx),
    and every lower set of the new groups keeps the set together."""
    together = data.draw(st.sets(st.integers(0, graph.n - 1), min_size=2, max_size=4)) if graph.n >= 2 else set()
    head = merged_anchors(graph.preds, graph.anchor, [sorted(together)] if together else [])
    assert len({head[v] for v in together}) <= 1
    for v, a in enumerate(graph.anchor):
        assert head[v] == head[a] and head[v] <= v and head[head[v]] == head[v]
    dag = nx.DiGraph()
    dag.add_nodes_from(range(graph.n))
    dag.add_edges_from((p, v) for v, ps in enumerate(graph.preds) for p in ps)
    quotient = nx.quotient_graph(dag, lambda u, v: head[u] == head[v])
    assert nx.is_directed_acyclic_graph(quotient)
    for mask in all_lower_sets(graph.preds, anchor=head):
        assert len({mask >> v & 1 for v in together}) <= 1


@FAST
@given(cost_graphs(max_nodes=10, min_nodes=1))
def test_approximate_never_better_than_exact(graph):
    """With the default kernels only: the reference gives the same tables and solutions on
    both families (test_tables_and_solutions_identical), and through it this took 17x as long."""
    exact = kusumoto.build_tables(graph, exact_family(graph))
    approx = kusumoto.build_tables(graph, approx_family(graph))
    least_exact = kusumoto.solve(graph, exact, objective="memory")
    least_approx = kusumoto.solve(graph, approx, objective="memory")
    assert least_exact.peak_bytes <= least_approx.peak_bytes
    for budget in budgets_for(graph, approx) + budgets_for(graph, exact):
        a = kusumoto.solve(graph, approx, budget=budget)
        e = kusumoto.solve(graph, exact, budget=budget)
        if a is not None:
            assert e is not None and e.time <= a.time


@FAST
@given(cost_graphs(max_nodes=brute.MAX_NODES, min_nodes=1), st.data(), st.booleans())
def test_exact_dp_matches_brute_force(dp_impl, graph, data, early_stop):
    """Least peak and least time of the DP equal the oracle's, under either time weighting; with
    the early stop a segment's time is what the simulator charges it (tests/brute_dp.py)."""
    tables = kusumoto.build_tables(graph, exact_family(graph), early_stop)
    assert sorted(tables.sets) == brute.lower_sets(graph)
    least = brute.least_peak(graph)
    memory = kusumoto.solve(graph, tables, objective="memory")
    assert memory.peak_bytes == least
    cost = brute.chain_cost(graph, memory.lower_sets, early_stop)
    assert (cost.time, cost.peak_bytes) == (memory.time, memory.peak_bytes)
    budgets = [None, least - 1, least] + data.draw(st.lists(st.integers(least, least + 40), max_size=3))
    for budget in budgets:
        found = kusumoto.solve(graph, tables, budget=budget)
        best = brute.least_time(graph, budget, early_stop)
        if best is None:
            assert found is None
            continue
        assert found is not None and found.time == best
        cost = brute.chain_cost(graph, found.lower_sets, early_stop)
        assert (cost.time, cost.peak_bytes) == (found.time, found.peak_bytes)
        assert budget is None or cost.peak_bytes <= budget


@FAST
@given(cost_graphs(max_nodes=8, min_nodes=1))
def test_bounds_do_not_change_answers(dp_impl, graph):
    for early_stop in (True, False):
        check_bounds(graph, kusumoto.build_tables(graph, exact_family(graph), early_stop))


def check_bounds(graph, tables):
    for budget in budgets_for(graph, tables):
        for objective in kusumoto.OBJECTIVES:
            plain = kusumoto._run(graph, tables, budget, objective, None)
            found = kusumoto.solve(graph, tables, budget=budget, objective=objective)
            if plain is None:
                assert found is None
            else:
                chain, time, peak = plain
                assert found == kusumoto.Solution(tuple(tables.sets[j] for j in chain), time, peak)
                if objective == "time":  # any bound at or above t* (a known chain's time) changes nothing
                    for bound in (time, 2 * time + 1, 40 * time + 17):
                        assert kusumoto.solve(graph, tables, budget=budget, time_bound=bound) == found
                # dropping the labels that cannot reach V within the budget changes nothing
                for reach in (kusumoto.completion(graph, tables), kusumoto.completion(graph, tables, budget)):
                    assert kusumoto.solve(graph, tables, budget=budget, objective=objective, reach=reach) == found


@needs_compiled
def test_least_peak_is_one_pruned_solve(monkeypatch):
    """The memory-centric solve: what each set needs to reach V (completion_bounds) gives peak*,
    and one DP run keeps only labels that can reach V (ResNet-50's graph took 12 DP runs by
    bisection, then 6); its answer is the unbounded solve's."""
    graph = load_graph(os.path.join(FIXTURES, "resnet50.json"))
    tables = kusumoto.build_tables(graph, exact_family(graph))
    runs, run = [], kusumoto._run
    monkeypatch.setattr(kusumoto, "_run", lambda *args: runs.append(args[1]) or run(*args))
    with _kernels.use("cython"):
        found = kusumoto.solve(graph, tables, objective="memory")
    assert [t is tables for t in runs] == [False, True]  # the approximate family's, then one
    chain, time, peak = run(graph, tables, None, "memory", None)
    assert found == kusumoto.Solution(tuple(tables.sets[j] for j in chain), time, peak)


# --------------------------------------------------------------------------- edge cases and the switch


def test_tiny_graphs(dp_impl):
    assert all_lower_sets([]) == [0]
    assert all_lower_sets([(), (0,), (0,)]) == [0, 1, 3, 5, 7]
    assert all_lower_sets([(), (0,), (0,)], cap=4) is None
    assert all_lower_sets([(), (0,), (0,)], cap=5) == [0, 1, 3, 5, 7]
    assert all_lower_sets([(), ()], anchor=[0, 0]) == [0, 3]


def test_empty_graph_solves(dp_impl):
    graph = CostGraph(names=(), preds=(), succs=(), order_preds=(), anchor=(), is_output=(), time=(), out_bytes=(),
                      root=(), saved=(), extra_bytes=(), grad_bytes=(), grad_alias=(), transient_bytes=(),
                      bwd_transient_bytes=(), param_grad_bytes=(), shared_params=(), loss_bytes=0, loss_output=None,
                      checkpoint_time=0, hook_time=(),
                      time_unit=1.0, step_cost=1.0, cost_unit="units")
    tables = kusumoto.build_tables(graph, exact_family(graph))
    assert kusumoto.solve(graph, tables) == kusumoto.Solution((), 0, 0)
    assert kusumoto.solve(graph, tables, objective="memory") == kusumoto.Solution((), 0, 0)


def test_cyclic_ties_are_rejected(dp_impl):
    with pytest.raises(ValueError, match="cyclic quotient"):
        all_lower_sets([(), (0,), (1,)], anchor=[0, 1, 0])  # {0, 2} -> {1} -> {0, 2}


def test_env_switch_forces_reference(monkeypatch):
    monkeypatch.setenv("FXREMAT_PURE_PYTHON", "1")
    assert _kernels.current() == "python"
    assert _kernels.pick(kusumoto.solve_dp, "solve_dp") is kusumoto.solve_dp


def test_missing_extension_warns_once(monkeypatch):
    monkeypatch.delenv("FXREMAT_PURE_PYTHON", raising=False)
    monkeypatch.setattr(_kernels, "_state", {"forced": None, "warned": False, "module": None,
                                             "error": ImportError("no module"), "loaded": True})
    with pytest.warns(RuntimeWarning, match="pip install -e ."):
        assert _kernels.current() == "python"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _kernels.current() == "python"
    with pytest.raises(ImportError, match="pip install -e ."):
        with _kernels.use("cython"):
            pass


def test_use_rejects_unknown_implementation():
    with pytest.raises(ValueError, match="python"):
        with _kernels.use("fortran"):
            pass
