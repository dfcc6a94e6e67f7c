"""Stream assignment and schedules, checked against networkx and brute force."""
import random
import time

import networkx as nx
import pytest
from hypothesis import given, settings, strategies as st

from nimblejax.compiler.streams import Schedule, assign_streams, critical_path, make_schedule
from tests.helpers.graphs import missing_dependencies


def windowed_dag(n: int, rng: random.Random, preds: int = 3, lo: int = 1, hi: int = 30) -> nx.DiGraph:
    """Each node gets up to `preds` predecessors among the lo..hi nodes before it."""
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    for v in range(1, n):
        for _ in range(rng.randint(0, preds)):
            g.add_edge(v - rng.randint(lo, min(hi, v)), v)
    return g


@st.composite
def small_dags(draw, max_nodes=8):
    n = draw(st.integers(1, max_nodes))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from(draw(st.sets(st.sampled_from(pairs), max_size=len(pairs))) if pairs else [])
    return g


def reduction_matching(dag):
    """(|E(G')|, |maximum matching of G'|), both by networkx."""
    red = nx.transitive_reduction(dag)
    b = nx.Graph()
    left = [("out", v) for v in dag]
    b.add_nodes_from(left)
    b.add_nodes_from(("in", v) for v in dag)
    b.add_edges_from((("out", u), ("in", v)) for u, v in red.edges)
    return red.number_of_edges(), len(nx.bipartite.hopcroft_karp_matching(b, top_nodes=left)) // 2


def dilworth_width(dag):
    closure = nx.transitive_closure_dag(dag)
    b = nx.Graph()
    left = [("out", v) for v in dag]
    b.add_nodes_from(left)
    b.add_nodes_from(("in", v) for v in dag)
    b.add_edges_from((("out", u), ("in", v)) for u, v in closure.edges)
    return len(dag) - len(nx.bipartite.hopcroft_karp_matching(b, top_nodes=left)) // 2


def chain_partitions(dag):
    """Every split of the tasks into streams that are chains of the DAG."""
    closure = nx.transitive_closure_dag(dag)
    nodes = list(nx.topological_sort(dag))

    def rec(i, streams):
        if i == len(nodes):
            yield [list(s) for s in streams]
            return
        v = nodes[i]
        for s in streams:
            if closure.has_edge(s[-1], v):
                s.append(v)
                yield from rec(i + 1, streams)
                s.pop()
        streams.append([v])
        yield from rec(i + 1, streams)
        streams.pop()

    yield from rec(0, [])


def required_syncs(dag, streams) -> int:
    """Cross-stream DAG edges that survive the transitive reduction of
    (stream order + all cross-stream DAG edges): the smallest set of events
    that, with stream order, implies every DAG edge."""
    stream_of = {v: i for i, s in enumerate(streams) for v in s}
    h = nx.DiGraph()
    h.add_nodes_from(dag)
    for s in streams:
        h.add_edges_from(zip(s, s[1:]))
    h.add_edges_from((u, v) for u, v in dag.edges if stream_of[u] != stream_of[v])
    order = list(nx.topological_sort(h))
    reach = {}
    for v in reversed(order):
        reach[v] = {v}.union(*(reach[w] for w in h.successors(v)))
    kept = 0
    for u, v in h.edges:
        if stream_of[u] != stream_of[v]:
            kept += not any(v in reach[w] for w in h.successors(u) if w != v)
    return kept


def stream_lists(a):
    out = {}
    for t in a.order:
        out.setdefault(a.stream[t], []).append(t)
    return out


# --- maximum logical concurrency and sync count ------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_unordered_tasks_never_share_a_stream(seed):
    rng = random.Random(seed)
    dag = windowed_dag(rng.randint(20, 300), rng, hi=rng.randint(2, 40))
    a = assign_streams(dag)
    closure = nx.transitive_closure_dag(dag)
    for tasks in stream_lists(a).values():
        # Consecutive pairs ordered => the whole stream is a chain (transitivity).
        for u, v in zip(tasks, tasks[1:]):
            assert closure.has_edge(u, v), f"{u} and {v} share a stream but are unordered"


@pytest.mark.parametrize("seed", range(12))
def test_syncs_are_reduction_edges_minus_matching(seed):
    rng = random.Random(100 + seed)
    dag = windowed_dag(rng.randint(2, 250), rng, hi=rng.randint(2, 40))
    a = assign_streams(dag)
    edges, matched = reduction_matching(dag)
    assert a.reduced_edges == edges
    assert len(a.syncs) == edges - matched
    red = nx.transitive_reduction(dag)
    assert all(red.has_edge(u, v) and a.stream[u] != a.stream[v] for u, v in a.syncs)
    assert set(a.stream.values()) == set(range(a.num_streams))


def check_against_brute_force(dag):
    a = assign_streams(dag)
    costs = [(required_syncs(dag, p), len(p)) for p in chain_partitions(dag)]
    fewest_syncs = min(c for c, _ in costs)
    assert len(a.syncs) == fewest_syncs
    # Among minimum-sync assignments, ours uses the fewest streams...
    assert a.num_streams == min(k for c, k in costs if c == fewest_syncs)
    # ...and width is Dilworth's minimum over all chain assignments.
    assert a.width == min(k for _, k in costs) == dilworth_width(dag)


@settings(max_examples=150, deadline=None)
@given(small_dags())
def test_brute_force_minimum_syncs_and_streams(dag):
    check_against_brute_force(dag)


@pytest.mark.parametrize("seed", range(150))
def test_brute_force_on_seeded_small_dags(seed):
    rng = random.Random(seed)
    check_against_brute_force(windowed_dag(rng.randint(3, 8), rng, preds=rng.randint(1, 3), hi=rng.randint(2, 5)))


def test_brute_force_needs_a_chain_merge():
    # M pairs a-x-z; y and b are left alone although y reaches b: merging
    # them is what brings 3 chains down to the width, 2.
    dag = nx.DiGraph([("a", "x"), ("y", "x"), ("x", "b"), ("x", "z")])
    check_against_brute_force(dag)
    assert assign_streams(dag).num_streams == 2


# The smallest DAG we found where minimum syncs and minimum streams conflict.
CONFLICT = [(0, 5), (1, 4), (2, 4), (2, 8), (3, 5), (4, 6), (4, 7), (5, 8), (5, 9)]


def test_min_syncs_can_cost_one_stream_over_width():
    dag = nx.DiGraph(CONFLICT)
    a = assign_streams(dag)
    costs = [(required_syncs(dag, p), len(p)) for p in chain_partitions(dag)]
    assert min(c for c, k in costs if k == 4) == 5  # width-many streams need 5 events
    assert min(c for c, _ in costs) == 4            # 4 events need 5 streams
    assert (a.width, a.num_streams, len(a.syncs)) == (4, 5, 4)


def lexicographic_optimum(dag):
    """(streams, syncs) of the best chain cover by networkx's weighted
    matching on the closure: G' pairs first, then as many pairs as possible."""
    red = nx.transitive_reduction(dag)
    closure = nx.transitive_closure_dag(dag)
    big = len(dag) + 1
    b = nx.Graph()
    for u, v in closure.edges:
        b.add_edge(("out", u), ("in", v), weight=1 + big * red.has_edge(u, v))
    m = nx.max_weight_matching(b)
    kept = sum(red.has_edge(x[1], y[1]) if x[0] == "out" else red.has_edge(y[1], x[1]) for x, y in m)
    return len(dag) - len(m), red.number_of_edges() - kept


@pytest.mark.parametrize("seed", range(6))
def test_streams_match_weighted_matching_optimum(seed):
    rng = random.Random(200 + seed)
    dag = windowed_dag(rng.randint(25, 45), rng, hi=rng.randint(3, 12))
    a = assign_streams(dag)
    assert (a.num_streams, len(a.syncs)) == lexicographic_optimum(dag)
    assert a.width == dilworth_width(dag) <= a.num_streams


@pytest.mark.parametrize("seed", range(8))
def test_width_matches_networkx_on_larger_dags(seed):
    rng = random.Random(300 + seed)
    dag = windowed_dag(rng.randint(50, 250), rng, hi=rng.randint(2, 60))
    a = assign_streams(dag)
    # Minimum syncs can cost a stream over Dilworth (see CONFLICT), never fewer.
    assert a.width == dilworth_width(dag) <= a.num_streams


# --- schedules ---------------------------------------------------------------------

@pytest.mark.parametrize("max_streams", [None, 1, 2, 3, 5])
@pytest.mark.parametrize("seed", range(6))
def test_every_dependency_is_enforced(seed, max_streams):
    rng = random.Random(400 + seed)
    dag = windowed_dag(rng.randint(2, 200), rng, hi=rng.randint(2, 30))
    s = make_schedule(dag, max_streams)
    assert missing_dependencies(s, dag) == []
    pos = {t: i for i, t in enumerate(s.order)}
    assert all(pos[u] < pos[v] for u, v in dag.edges)
    if max_streams is not None:
        assert s.num_streams <= max_streams


@pytest.mark.parametrize("max_streams", [None, 1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_each_sync_is_necessary(seed, max_streams):
    rng = random.Random(500 + seed)
    dag = windowed_dag(rng.randint(10, 120), rng, hi=rng.randint(2, 20))
    s = make_schedule(dag, max_streams)
    assert all(s.stream[u] != s.stream[v] for u, v in s.syncs)
    for drop in s.syncs:
        weaker = Schedule.from_parts(s.order, s.stream, [e for e in s.syncs if e != drop])
        assert missing_dependencies(weaker, dag), f"sync {drop} is implied by the others"


@pytest.mark.parametrize("seed", range(4))
def test_limited_streams_use_exactly_k_when_needed(seed):
    rng = random.Random(600 + seed)
    dag = windowed_dag(150, rng, hi=10)
    width = assign_streams(dag).num_streams
    for k in (1, 2, 3, width - 1, width, width + 3):
        a = assign_streams(dag, max_streams=k)
        assert a.num_streams == min(k, width)
        assert set(a.stream.values()) == set(range(a.num_streams))
    one = make_schedule(dag, 1)
    assert one.syncs == () and one.num_streams == 1


def test_longest_chain_stays_on_stream_zero_when_packing():
    dag = nx.DiGraph([(i, i + 1) for i in range(9)])  # a 10-task chain...
    dag.add_edges_from([("x0", "x1"), ("y0", "y1"), ("z0", "z1")])  # ...and short side chains
    a = assign_streams(dag, max_streams=2)
    assert {a.stream[i] for i in range(10)} == {0}
    assert {a.stream[t] for t in ("x0", "x1", "y0", "y1", "z0", "z1")} == {1}


def happens_before_by_search(s: Schedule, u, v) -> bool:
    g = nx.DiGraph()
    g.add_nodes_from(s.order)
    for k in range(s.num_streams):
        tasks = s.tasks_on(k)
        g.add_edges_from(zip(tasks, tasks[1:]))
    g.add_edges_from(s.syncs)
    return u != v and nx.has_path(g, u, v)


@pytest.mark.parametrize("seed", range(10))
def test_vector_clocks_agree_with_graph_search(seed):
    rng = random.Random(700 + seed)
    order = list(range(rng.randint(1, 25)))
    streams = rng.randint(1, 4)
    stream = {t: rng.randrange(streams) for t in order}
    pairs = [(u, v) for u in order for v in order if u < v]
    syncs = rng.sample(pairs, min(len(pairs), rng.randint(0, 8)))
    s = Schedule.from_parts(order, stream, syncs)
    for u in order:
        for v in order:
            assert s.happens_before(u, v) == happens_before_by_search(s, u, v), (u, v)
    for u, v in syncs:
        assert u in s.waits(v) and s.records(u)
    assert not any(s.records(t) for t in order if all(t != u for u, _ in syncs))


def test_schedule_rejects_bad_parts():
    with pytest.raises(ValueError):
        Schedule.from_parts(["a", "a"], {"a": 0}, [])
    with pytest.raises(ValueError):  # waits on an event recorded later
        Schedule.from_parts(["a", "b"], {"a": 0, "b": 1}, [("b", "a")])
    with pytest.raises(ValueError):
        Schedule.from_parts(["a"], {"a": 0, "b": 1}, [])


def test_small_cases_and_errors():
    assert assign_streams(nx.DiGraph()).num_streams == 0
    chain = nx.DiGraph([("a", "b"), ("b", "c"), ("a", "c")])
    a = assign_streams(chain)
    assert (a.num_streams, a.syncs, a.reduced_edges, a.width) == (1, [], 2, 1)
    flat = nx.DiGraph()
    flat.add_nodes_from("pqrs")
    assert assign_streams(flat).num_streams == 4
    assert assign_streams(flat, max_streams=3).num_streams == 3
    with pytest.raises(ValueError):
        assign_streams(nx.DiGraph([(1, 2), (2, 1)]))
    with pytest.raises(ValueError):
        assign_streams(chain, max_streams=0)


def test_critical_path():
    assert critical_path(nx.DiGraph()) == 0
    assert critical_path(nx.DiGraph([(1, 2), (2, 3), (1, 3)])) == 3
    rng = random.Random(9)
    dag = windowed_dag(300, rng)
    assert critical_path(dag) == nx.dag_longest_path_length(dag) + 1


def test_ten_thousand_tasks_plan_fast():
    rng = random.Random(2020)
    dag = nx.DiGraph()
    dag.add_nodes_from(range(10_000))
    for v in range(200, 10_000):
        for _ in range(3):
            dag.add_edge(v - rng.randint(50, 200), v)
    t0 = time.perf_counter()
    a = assign_streams(dag)
    t1 = time.perf_counter()
    s = make_schedule(dag)
    t2 = time.perf_counter()
    print(f"\n10k tasks: assign_streams {t1 - t0:.3f} s, make_schedule {t2 - t1:.3f} s; "
          f"{a.num_streams} streams (width {a.width}), {len(a.syncs)} syncs, "
          f"{a.reduced_edges} reduced edges")
    assert t1 - t0 < 10 and t2 - t1 < 10
    assert a.width <= a.num_streams
    assert missing_dependencies(s, dag) == []
