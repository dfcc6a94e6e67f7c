"""The default stream cap (compiler/streams/schedule.py STREAM_CAP): a program of more
independent chains than the cap (an unrolled scan of 256 steps had 258 streams before
its input projections were merged into one GEMM) plans at most that many streams, its
plan verifies, and it computes what jax.jit does on the interpreter under random
interleavings."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
from jax import lax

import nimblejax as nimble
from nimblejax.compiler.memory import plan_memory
from nimblejax.compiler.pipeline import verify_plan
from nimblejax.compiler.streams import STREAM_CAP, make_schedule, verify
from nimblejax.runtime import interpret
from tests.helpers.graphs import missing_dependencies


def rnn(wx, wh, b, xs):
    def cell(h, x):
        h = jnp.tanh(x @ wx + h @ wh + b)
        return h, h
    return lax.scan(cell, jnp.zeros((1, wh.shape[0]), jnp.float32), xs)


def rnn_args(rng, steps: int, hidden: int):
    return (rng.normal(size=(hidden, hidden)).astype(np.float32) * 0.2,
            rng.normal(size=(hidden, hidden)).astype(np.float32) * 0.2,
            rng.normal(size=(hidden,)).astype(np.float32) * 0.1,
            rng.normal(size=(steps, 1, hidden)).astype(np.float32))


def chains(xs, ws, vs):
    """len(xs) independent GEMM → tanh → GEMM chains (nothing to merge or pack)."""
    return sum(jnp.sum(jnp.tanh(x @ w) @ v) for x, w, v in zip(xs, ws, vs))


def chains_args(rng, n: int, width: int):
    def mats():
        return [rng.normal(size=(width, width)).astype(np.float32) * 0.3 for _ in range(n)]
    return mats(), mats(), mats()


def test_more_chains_than_the_cap_plan_at_most_the_cap_and_verify():
    args = chains_args(np.random.default_rng(0), STREAM_CAP + 36, 8)
    plan = nimble.jit(chains, backend="interpret").plan(*args)
    uncapped = nimble.jit(chains, backend="interpret", max_streams=10_000).plan(*args)
    assert uncapped.schedule.num_streams > STREAM_CAP
    assert plan.schedule.num_streams <= STREAM_CAP
    assert len(set(plan.schedule.stream.values())) == plan.schedule.num_streams
    assert not missing_dependencies(plan.schedule, plan.dag)
    verify_plan(plan)
    assert plan.num_events < uncapped.num_events  # packed chains need fewer events


def test_capped_chains_compute_what_jax_does():
    args = chains_args(np.random.default_rng(1), STREAM_CAP + 36, 8)
    plan = nimble.jit(chains, backend="interpret").plan(*args)
    assert plan.schedule.num_streams == STREAM_CAP
    want = jax.jit(chains)(*args)
    flat = jax.tree_util.tree_leaves(args)
    for seed in (0, 1):  # two random interleavings the streams and events allow
        (got,) = interpret.run(plan, flat, seed=seed)
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-4)


def test_rnn_scan_of_256_steps_plans_within_the_cap_and_computes_what_jax_does():
    args = rnn_args(np.random.default_rng(1), 256, 16)
    plan = nimble.jit(rnn, backend="interpret").plan(*args)
    assert plan.schedule.num_streams <= STREAM_CAP
    want = jax.jit(rnn)(*args)
    got = interpret.run(plan, list(args), seed=0)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, np.asarray(w), rtol=1e-5, atol=1e-5)


def test_make_schedule_caps_a_wide_dag_by_default_and_explicit_caps_win():
    wide = nx.DiGraph()
    for i in range(3 * STREAM_CAP):  # independent two-task chains between a root and a sink
        wide.add_edges_from([("root", ("a", i)), (("a", i), ("b", i)), (("b", i), "sink")])
    capped = make_schedule(wide)
    assert capped.num_streams == STREAM_CAP
    assert not missing_dependencies(capped, wide)
    assert make_schedule(wide, 4 * STREAM_CAP).num_streams == 3 * STREAM_CAP
    assert make_schedule(wide, 3).num_streams == 3
    sizes = {v: 64 for v in wide}
    reads = {v: list(wide.predecessors(v)) for v in wide}
    writes = {v: [v] for v in wide}
    memory = plan_memory(capped, sizes, reads, writes, pinned=["sink"])
    assert verify(capped, memory, sizes, reads, writes) == []
