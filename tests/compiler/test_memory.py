"""Arena memory plans: safe under happens-before, compact where that allows."""
import random
import re
import time

import networkx as nx
import pytest

from nimblejax.compiler.memory import plan_memory
from nimblejax.compiler.streams import Schedule, make_schedule, verify


def windowed_dag(n, rng, preds=3, hi=20):
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    for v in range(1, n):
        for _ in range(rng.randint(0, preds)):
            g.add_edge(v - rng.randint(1, min(hi, v)), v)
    return g


def dataflow(dag, rng):
    """Each task writes one output read by its successors; sources read a
    pinned input, some tasks a pinned constant; sink outputs are pinned."""
    sizes = {("out", v): rng.choice([0, 1, 100, 256, 1000, 4096, 10_000]) for v in dag}
    sizes["input"], sizes["const"] = 3000, 512
    writes = {v: [("out", v)] for v in dag}
    reads = {v: [("out", u) for u in dag.predecessors(v)] for v in dag}
    for v in dag:
        if dag.in_degree(v) == 0:
            reads[v].append("input")
        if rng.random() < 0.2:
            reads[v].append("const")
    pinned = ["input", "const"] + [("out", v) for v in dag if dag.out_degree(v) == 0]
    return sizes, reads, writes, pinned


def aligned(n, a=256):
    return -(-n // a) * a


def overlaps(plan, sizes, b1, b2):
    lo = max(plan.offsets[b1], plan.offsets[b2])
    hi = min(plan.offsets[b1] + aligned(sizes[b1]), plan.offsets[b2] + aligned(sizes[b2]))
    return lo < hi


@pytest.mark.parametrize("max_streams", [None, 1, 2, 3])
@pytest.mark.parametrize("seed", range(8))
def test_random_plans_are_safe_and_bounded(seed, max_streams):
    rng = random.Random(seed)
    dag = windowed_dag(rng.randint(1, 120), rng)
    s = make_schedule(dag, max_streams)
    sizes, reads, writes, pinned = dataflow(dag, rng)
    plan = plan_memory(s, sizes, reads, writes, pinned=pinned)
    assert verify(s, plan, sizes, reads, writes) == []
    assert set(plan.offsets) == set(sizes)
    assert all(off % 256 == 0 for off in plan.offsets.values())
    assert all(plan.offsets[b] + aligned(sizes[b]) <= plan.arena_bytes for b in sizes)
    for p in pinned:
        assert not any(overlaps(plan, sizes, p, b) for b in sizes if b != p), p
    assert plan.no_reuse_bytes == sum(aligned(n) for n in sizes.values())
    assert max(aligned(n) for n in sizes.values()) <= plan.arena_bytes <= plan.no_reuse_bytes
    assert plan.peak_live_bytes <= plan.arena_bytes


def chain_schedule(n, stream=0):
    tasks = [f"t{i}" for i in range(n)]
    return tasks, Schedule.from_parts(tasks, {t: stream for t in tasks}, [])


def test_chain_on_one_stream_reuses_memory():
    tasks, s = chain_schedule(6)
    sizes = {f"b{i}": 1000 for i in range(6)}
    writes = {t: [f"b{i}"] for i, t in enumerate(tasks)}
    reads = {t: [f"b{i - 1}"] for i, t in enumerate(tasks) if i}
    plan = plan_memory(s, sizes, reads, writes)
    # Only a producer and its consumer's output are ever live together.
    assert plan.arena_bytes == 2 * 1024 == plan.peak_live_bytes < plan.no_reuse_bytes
    assert verify(s, plan, sizes, reads, writes) == []


def two_stream_case(syncs):
    """a1 -> a2 on stream 0, b1 -> b2 on stream 1, all of a launched first."""
    order = ["a1", "a2", "b1", "b2"]
    s = Schedule.from_parts(order, {"a1": 0, "a2": 0, "b1": 1, "b2": 1}, syncs)
    sizes = {"x": 1000, "y": 1000}
    writes = {"a1": ["x"], "b1": ["y"]}
    reads = {"a2": ["x"], "b2": ["y"]}
    return s, sizes, reads, writes


def test_parallel_streams_do_not_share_without_sync():
    s, sizes, reads, writes = two_stream_case([])
    plan = plan_memory(s, sizes, reads, writes)
    # Launch order puts a2 before b1, but nothing orders their execution.
    assert not overlaps(plan, sizes, "x", "y")
    assert plan.peak_live_bytes == 1024 < plan.arena_bytes == 2048


def test_parallel_streams_share_after_a_sync():
    s, sizes, reads, writes = two_stream_case([("a2", "b1")])
    plan = plan_memory(s, sizes, reads, writes)
    assert plan.offsets["x"] == plan.offsets["y"] and plan.arena_bytes == 1024
    assert verify(s, plan, sizes, reads, writes) == []


def test_pinned_buffers_are_never_shared():
    tasks, s = chain_schedule(4)
    sizes = {f"b{i}": 500 for i in range(4)}
    writes = {t: [f"b{i}"] for i, t in enumerate(tasks)}
    reads = {t: [f"b{i - 1}"] for i, t in enumerate(tasks) if i}
    free = plan_memory(s, sizes, reads, writes)
    assert free.offsets["b0"] == free.offsets["b2"]
    plan = plan_memory(s, sizes, reads, writes, pinned=["b0"])
    assert not any(overlaps(plan, sizes, "b0", b) for b in sizes if b != "b0")


def test_unwritten_buffer_is_live_from_the_start():
    tasks, s = chain_schedule(5)
    sizes = {"in": 1000, "b0": 1000, "b2": 1000}
    reads = {"t0": ["in"], "t3": ["b2"], "t1": ["b0"]}
    writes = {"t0": ["b0"], "t2": ["b2"]}
    plan = plan_memory(s, sizes, reads, writes)
    assert not overlaps(plan, sizes, "in", "b0")   # t0 reads "in" while writing b0
    assert plan.offsets["b2"] in (plan.offsets["in"], plan.offsets["b0"])  # both dead by t2
    assert plan.peak_live_bytes == 2048
    assert verify(s, plan, sizes, reads, writes) == []


def test_zero_size_and_untouched_buffers_get_valid_offsets():
    tasks, s = chain_schedule(2)
    sizes = {"empty": 0, "a": 300, "ghost": 700}
    plan = plan_memory(s, sizes, {"t1": ["a", "empty"]}, {"t0": ["a", "empty"]}, alignment=128)
    assert all(off % 128 == 0 and off <= plan.arena_bytes for off in plan.offsets.values())
    assert plan.no_reuse_bytes == 384 + 768
    assert plan.arena_bytes >= 768


def test_alignment_and_describe():
    tasks, s = chain_schedule(3)
    sizes = {"a": 10, "b": 10, "c": 1_500_000}
    writes = {"t0": ["a"], "t1": ["b"], "t2": ["c"]}
    reads = {"t1": ["a"], "t2": ["b"]}
    plan = plan_memory(s, sizes, reads, writes, alignment=64)
    assert all(off % 64 == 0 for off in plan.offsets.values())
    text = plan.describe()
    assert re.fullmatch(r"arena [\d.]+ ([KMG]i)?B \(no reuse [\d.]+ ([KMG]i)?B, single-stream peak [\d.]+ ([KMG]i)?B\)", text), text
    assert "1.4 MiB" in text  # 1_500_000 bytes, in the binary units of every report


def test_bad_inputs_are_rejected():
    tasks, s = chain_schedule(2)
    with pytest.raises(ValueError):
        plan_memory(s, {"a": 4}, {"t0": ["nope"]}, {})
    with pytest.raises(ValueError):
        plan_memory(s, {"a": 4}, {"zz": ["a"]}, {})
    with pytest.raises(ValueError):
        plan_memory(s, {"a": 4}, {}, {}, pinned=["b"])
    with pytest.raises(ValueError):
        plan_memory(s, {"a": 4}, {}, {}, alignment=0)


@pytest.mark.parametrize("max_streams", [None, 4])
def test_thousands_of_buffers_plan_quickly(max_streams):
    rng = random.Random(77)
    dag = windowed_dag(3000, rng, hi=60)
    s = make_schedule(dag, max_streams)
    sizes, reads, writes, pinned = dataflow(dag, rng)
    t0 = time.perf_counter()
    plan = plan_memory(s, sizes, reads, writes, pinned=pinned)
    elapsed = time.perf_counter() - t0
    print(f"\n{len(sizes)} buffers on {s.num_streams} streams planned in {elapsed:.3f} s: {plan.describe()}")
    assert elapsed < 10
    assert plan.arena_bytes < plan.no_reuse_bytes
