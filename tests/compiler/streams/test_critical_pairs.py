"""Step 4 of the stream assignment (compiler/streams/assign.py, `_prefer_critical`): among
assignments with the fewest syncs and streams, the pairs of the longest path (by task
weight) share a stream, where programmatic dependent launch lets a kernel start while
the one before it ends."""
import random

import networkx as nx
import pytest

from nimblejax.compiler.streams import assign_streams, make_schedule
from tests.compiler.streams.test_assign_and_schedule import lexicographic_optimum, windowed_dag
from tests.helpers.graphs import missing_dependencies


def longest_path(dag, weight):
    best, prev = {}, {}
    for v in nx.topological_sort(dag):
        p = max(dag.predecessors(v), key=lambda u: best[u], default=None)
        best[v], prev[v] = weight(v) + (best[p] if p is not None else 0.0), p
    end, path = max(best, key=best.get), []
    while end is not None:
        path.append(end)
        end = prev[end]
    return path[::-1]


def cross_pairs(a, path) -> int:
    return sum(a.stream[u] != a.stream[v] for u, v in zip(path, path[1:]))


def test_the_heavy_branch_of_a_diamond_shares_the_stream():
    dag = nx.DiGraph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    heavy = {"a": 1.0, "b": 1.0, "c": 9.0, "d": 1.0}.__getitem__
    a = assign_streams(dag, weight=heavy)
    assert a.stream["a"] == a.stream["c"] == a.stream["d"] != a.stream["b"]
    assert (a.num_streams, len(a.syncs)) == (2, 2)
    light = {"a": 1.0, "b": 9.0, "c": 1.0, "d": 1.0}.__getitem__
    b = assign_streams(dag, weight=light)
    assert b.stream["a"] == b.stream["b"] == b.stream["d"] != b.stream["c"]


def sgd_steps(steps: int) -> nx.DiGraph:
    """An unrolled SGD loop's tasks: h = f(x, W1); g = f(h, W2); dh = f(g, W2, h);
    W2' = f(W2, h, g); W1' = f(W1, dh); the next step reads W1' and W2'."""
    dag = nx.DiGraph()
    w1, w2 = "W1_0", "W2_0"
    dag.add_nodes_from([w1, w2])
    for i in range(steps):
        h, g, dh, nw1, nw2 = (f"{k}_{i}" for k in ("h", "g", "dh", "W1", "W2"))
        nw1, nw2 = f"W1_{i + 1}", f"W2_{i + 1}"
        dag.add_edges_from([(w1, h), (h, g), (w2, g), (g, dh), (w2, dh), (h, dh),
                            (w2, nw2), (h, nw2), (g, nw2), (w1, nw1), (dh, nw1)])
        w1, w2 = nw1, nw2
    return dag


def test_an_unrolled_sgd_loops_critical_path_stays_on_one_stream():
    dag = sgd_steps(20)
    weight = lambda t: 2.0 if t[0] in "hgd" or t.startswith("W1") else 1.0  # noqa: E731
    plain, weighted = assign_streams(dag), assign_streams(dag, weight=weight)
    path = longest_path(dag, weight)
    assert (weighted.num_streams, len(weighted.syncs)) == (plain.num_streams, len(plain.syncs))
    assert cross_pairs(weighted, path) == 0


@pytest.mark.parametrize("seed", range(12))
def test_weights_keep_the_fewest_syncs_and_streams_and_never_lengthen_the_cut(seed):
    """Random DAGs and weights: the optimum (streams, syncs) is kept, tasks with no path
    between them never share a stream, every dependency holds, and the longest path
    crosses streams no more often than with no weights."""
    rng = random.Random(900 + seed)
    dag = windowed_dag(rng.randint(20, 45), rng, hi=rng.randint(3, 12))
    w = {v: rng.choice([1.0, 1.0, 2.0, 5.0, 20.0]) for v in dag}
    a = assign_streams(dag, weight=w.__getitem__)
    assert (a.num_streams, len(a.syncs)) == lexicographic_optimum(dag)
    closure = nx.transitive_closure_dag(dag)
    for s in set(a.stream.values()):
        chain = [t for t in a.order if a.stream[t] == s]
        assert all(closure.has_edge(u, v) for u, v in zip(chain, chain[1:]))
    assert missing_dependencies(make_schedule(dag, weight=w.__getitem__), dag) == []
    path = longest_path(dag, w.__getitem__)
    assert cross_pairs(a, path) <= cross_pairs(assign_streams(dag), path)


def test_step_four_can_be_left_out(monkeypatch):
    from nimblejax.compiler.streams import assign

    dag = nx.DiGraph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    light = {"a": 1.0, "b": 9.0, "c": 1.0, "d": 1.0}.__getitem__
    monkeypatch.setattr(assign, "PREFER_CRITICAL", False)
    assert assign_streams(dag, weight=light).stream == assign_streams(dag).stream


@pytest.mark.parametrize("seed", range(4))
def test_packed_chains_keep_the_unweighted_assignment(seed):
    """More chains than streams: the packing's events depend on which chains there are,
    so step 4 is left out and the weights change nothing."""
    rng = random.Random(950 + seed)
    dag = windowed_dag(rng.randint(30, 60), rng, hi=rng.randint(3, 12))
    w = {v: rng.choice([1.0, 5.0, 20.0]) for v in dag}
    wide = assign_streams(dag)
    k = max(1, wide.num_streams - 1)
    assert assign_streams(dag, k, weight=w.__getitem__).stream == assign_streams(dag, k).stream
