"""Race verifier: clean plans pass, and each seeded bug is reported."""
import dataclasses
import random
from itertools import combinations

import networkx as nx
import pytest

from nimblejax.compiler.memory import plan_memory
from nimblejax.compiler.streams import Schedule, Violation, make_schedule, verify


def dataflow(dag):
    """Task v writes ("out", v), read by its successors; "x" is a pinned input."""
    sizes = {("out", v): 1000 for v in dag}
    sizes["x"] = 1000
    writes = {v: [("out", v)] for v in dag}
    reads = {v: [("out", u) for u in dag.predecessors(v)] for v in dag}
    for v in dag:
        if dag.in_degree(v) == 0:
            reads[v].append("x")
    sinks = [("out", v) for v in dag if dag.out_degree(v) == 0]
    return sizes, reads, writes, ["x"] + sinks


def diamond():
    return nx.DiGraph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])


def branches(n=3, length=4):
    """A root fanning out to n parallel chains that join in a sink."""
    g = nx.DiGraph()
    for i in range(n):
        chain = ["root"] + [f"p{i}_{j}" for j in range(length)] + ["sink"]
        g.add_edges_from(zip(chain, chain[1:]))
    return g


def planned(dag, max_streams=None):
    s = make_schedule(dag, max_streams)
    sizes, reads, writes, pinned = dataflow(dag)
    return s, plan_memory(s, sizes, reads, writes, pinned=pinned), sizes, reads, writes


@pytest.mark.parametrize("make", [diamond, branches])
def test_clean_plan_has_no_violation(make):
    s, plan, sizes, reads, writes = planned(make())
    assert s.syncs and s.num_streams > 1
    assert verify(s, plan, sizes, reads, writes) == []


def test_branches_reuse_memory_within_streams():
    s, plan, sizes, reads, writes = planned(branches(3, 6))
    assert plan.arena_bytes < plan.no_reuse_bytes
    assert verify(s, plan, sizes, reads, writes) == []


@pytest.mark.parametrize("make", [diamond, branches])
def test_removing_any_sync_is_reported(make):
    s, plan, sizes, reads, writes = planned(make())
    for drop in s.syncs:
        weaker = Schedule.from_parts(s.order, s.stream, [e for e in s.syncs if e != drop])
        found = verify(weaker, plan, sizes, reads, writes)
        # The dropped edge carries data, so at least that producer/consumer pair races.
        assert any({v.task_a, v.task_b} == set(drop) for v in found), (drop, found)


def test_buffer_moved_onto_a_live_one_is_reported():
    s, plan, sizes, reads, writes = planned(diamond())
    b, c = ("out", "b"), ("out", "c")  # written concurrently on two streams
    assert s.stream["b"] != s.stream["c"]
    moved = dataclasses.replace(plan, offsets={**plan.offsets, c: plan.offsets[b]})
    found = verify(s, moved, sizes, reads, writes)
    assert any({v.buffer_a, v.buffer_b} == {b, c} for v in found)
    race = next(v for v in found if {v.task_a, v.task_b} == {"b", "c"})
    assert (race.start, race.stop) == (plan.offsets[b], plan.offsets[b] + 1000)


def test_buffer_moved_onto_another_branch_is_reported():
    s, plan, sizes, reads, writes = planned(branches(2, 5))
    for i in range(5):
        for j in range(5):
            mine, theirs = ("out", f"p0_{i}"), ("out", f"p1_{j}")
            moved = dataclasses.replace(plan, offsets={**plan.offsets, mine: plan.offsets[theirs]})
            found = verify(s, moved, sizes, reads, writes)
            assert any({v.buffer_a, v.buffer_b} == {mine, theirs} for v in found), (i, j)


def test_task_reading_and_writing_overlapping_buffers_is_reported():
    s, plan, sizes, reads, writes = planned(branches(2, 5))
    # p0_2 reads p0_1's output while writing its own: same stream, same task.
    first, second = ("out", "p0_1"), ("out", "p0_2")
    moved = dataclasses.replace(plan, offsets={**plan.offsets, second: plan.offsets[first]})
    found = verify(s, moved, sizes, reads, writes)
    assert ("p0_2", "p0_2") in [(v.task_a, v.task_b) for v in found]
    # Everything else stays ordered on one stream: only in-task aliasing is left.
    assert all(v.task_a == v.task_b and str(v).startswith("aliasing: task") for v in found)


def test_reads_and_self_access_are_not_races():
    s = Schedule.from_parts(["r1", "r2", "w"], {"r1": 0, "r2": 1, "w": 2}, [])
    sizes = {"shared": 64, "own": 64}
    offsets = {"shared": 0, "own": 256}
    plan = type("Plan", (), {"offsets": offsets})()
    reads = {"r1": ["shared"], "r2": ["shared"], "w": ["own"]}
    writes = {"w": ["own"]}  # w reads and writes its own buffer
    assert verify(s, plan, sizes, reads, writes) == []
    offsets["own"] = 32  # now the writer overlaps the shared input
    found = verify(s, plan, sizes, reads, writes)
    assert {(v.task_a, v.task_b) for v in found} | {(v.task_b, v.task_a) for v in found} >= {("r1", "w"), ("r2", "w")}
    assert all((v.start, v.stop) == (32, 64) for v in found)


def test_violation_reads_well():
    v = Violation("mm1", "buf3", "write", "add2", "buf7", "read", 512, 768)
    text = str(v)
    for part in ("mm1", "buf3", "add2", "buf7", "[512, 768)", "write", "read"):
        assert part in text


def naive_races(s, plan, sizes, reads, writes):
    """All access pairs against each other: the O(n^2) definition."""
    acc = [(t, b, "read") for t, bs in reads.items() for b in bs]
    acc += [(t, b, "write") for t, bs in writes.items() for b in bs]
    out = set()
    for (t1, b1, m1), (t2, b2, m2) in combinations(acc, 2):
        lo = max(plan.offsets[b1], plan.offsets[b2])
        hi = min(plan.offsets[b1] + sizes[b1], plan.offsets[b2] + sizes[b2])
        if (t1, b1) != (t2, b2) and lo < hi and "write" in (m1, m2):
            if not (s.happens_before(t1, t2) or s.happens_before(t2, t1)):
                out.add(frozenset([(t1, b1), (t2, b2)]))  # one task, two buffers: never ordered
    return out


@pytest.mark.parametrize("seed", range(15))
def test_sweep_finds_exactly_the_naive_races(seed):
    rng = random.Random(seed)
    tasks = list(range(rng.randint(2, 14)))
    k = rng.randint(1, 3)
    pairs = [(u, v) for u in tasks for v in tasks if u < v]
    s = Schedule.from_parts(tasks, {t: rng.randrange(k) for t in tasks}, rng.sample(pairs, rng.randint(0, len(pairs) // 3)))
    bufs = [f"b{i}" for i in range(rng.randint(1, 10))]
    sizes = {b: rng.choice([0, 50, 256, 700]) for b in bufs}
    plan = type("Plan", (), {"offsets": {b: rng.randrange(0, 1024, 64) for b in bufs}})()
    reads = {t: rng.sample(bufs, rng.randint(0, min(2, len(bufs)))) for t in tasks}
    writes = {t: rng.sample(bufs, rng.randint(0, 1)) for t in tasks}
    found = {frozenset([(v.task_a, v.buffer_a), (v.task_b, v.buffer_b)]) for v in verify(s, plan, sizes, reads, writes)}
    assert found == naive_races(s, plan, sizes, reads, writes)
