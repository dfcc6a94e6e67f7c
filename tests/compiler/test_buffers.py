"""The buffer analysis on its own (compiler/buffers.py): which values share bytes (views,
in-place updates), each task's reads and writes in buffers, the task DAG's edges from a
buffer's last writer to its readers, and the pinned buffers; the plan carries exactly
this analysis, and the interpreter runs such a plan as jax.jit does."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from nimblejax.compiler.buffers import analyze_buffers, task_dag
from nimblejax.compiler.kinds import TaskKind


def shared(a, w, i, u):
    """Two views, one of the other (both over the first GEMM's output, which is pinned
    as the outputs' buffer), and a scatter updating the second GEMM's output in place."""
    y = (a @ w).reshape(4, 24)
    return y, y.reshape(96), jnp.tanh((a @ w.T).at[i].add(u))


def shared_args(rng):
    return (rng.standard_normal((12, 8)).astype(np.float32),
            rng.standard_normal((8, 8)).astype(np.float32),
            rng.integers(0, 12, (5,)).astype(np.int32),
            rng.standard_normal((5, 8)).astype(np.float32))


def analysis(fn, *args):
    """The buffer analysis of fn's plan, made from the stages before it."""
    stages = nimble.jit(fn, backend="interpret").stages(*args)
    return analyze_buffers(stages["canonicalize"].value, stages["lower"].value), stages


def only(tasks, pred):
    (task,) = [t for t in tasks if pred(t)]
    return task


def test_a_view_of_a_view_lives_in_the_first_buffer():
    b, _ = analysis(shared, *shared_args(np.random.default_rng(0)))
    assert len(b.views) == 2 and all(v.kind is TaskKind.VIEW for v in b.views)
    gemm_out = only(b.views, lambda v: v.inputs[0] not in b.storage).inputs[0]
    for v in b.views:  # each view's output is held by the GEMM's output, the chain resolved
        assert b.storage[v.outputs[0]] is gemm_out and b.root(v.outputs[0]) is gemm_out
    assert not set(b.views) & set(b.tasks) and not set(b.views) & set(b.reads)


def test_an_in_place_update_writes_its_operands_buffer():
    b, _ = analysis(shared, *shared_args(np.random.default_rng(0)))
    scatter = only(b.tasks, lambda t: t.aliases)
    ((out, operand),) = scatter.aliases
    assert b.storage[out] is operand
    assert b.writes[scatter] == (operand,) and operand in b.reads[scatter]
    producer = only(b.tasks, lambda t: operand in t.outputs)
    reader = only(b.tasks, lambda t: out in t.inputs)
    assert b.reads[reader] == (operand,)  # it reads the updated value, in the same bytes
    # Two writers of one buffer, chained: the reader waits on the last one only.
    assert set(b.dag.predecessors(scatter)) == {producer}
    assert set(b.dag.predecessors(reader)) == {scatter}


def test_a_task_reading_a_buffer_and_a_view_of_it_reads_the_buffer_once():
    rng = np.random.default_rng(1)
    a, w = (rng.standard_normal(s).astype(np.float32) for s in ((12, 8), (8, 8)))

    def f(a, w):
        y = a @ w
        return y @ y.reshape(8, 12)  # a GEMM of y and a view of y

    b, _ = analysis(f, a, w)
    first, second = b.tasks
    (view,) = b.views
    assert set(second.inputs) == {first.outputs[0], view.outputs[0]}
    assert b.reads[second] == first.outputs


def test_task_dag_has_an_edge_from_the_last_writer_before_each_reader():
    # a writes B; b updates B in place; c reads B, writes C; d reads C and B; e reads
    # only an input (no writer: no edge).
    reads = {"a": (), "b": ("B",), "c": ("B",), "d": ("C", "B"), "e": ("In",)}
    writes = {"a": ("B",), "b": ("B",), "c": ("C",), "d": ("D",), "e": ("E",)}
    dag = task_dag(list("abcde"), reads, writes)
    assert sorted(dag.nodes) == list("abcde")
    assert sorted(dag.edges) == [("a", "b"), ("b", "c"), ("b", "d"), ("c", "d")]


def test_every_dag_edge_carries_a_buffer_and_every_read_of_a_written_buffer_has_one():
    b, _ = analysis(shared, *shared_args(np.random.default_rng(0)))
    order = {t: i for i, t in enumerate(b.tasks)}
    for u, t in b.dag.edges:
        assert order[u] < order[t] and set(b.writes[u]) & set(b.reads[t])
    for t in b.tasks:
        for buf in b.reads[t]:
            writers = [u for u in b.tasks[:order[t]] if buf in b.writes[u]]
            if writers:
                assert b.dag.has_edge(writers[-1], t)


def test_pinned_are_the_inputs_constants_and_the_outputs_buffers():
    table = np.random.default_rng(2).standard_normal((8,)).astype(np.float32)

    def with_const(a, w, i, u):
        y, flat, s = shared(a, w, i, u)
        return y, flat, s + jnp.asarray(table)  # a constant the plan holds

    b, stages = analysis(with_const, *shared_args(np.random.default_rng(0)))
    graph = stages["canonicalize"].value
    assert graph.consts
    outputs = {b.root(v) for v in graph.outputs}
    assert set(b.pinned) == set(graph.inputs) | set(graph.consts) | outputs
    assert list(b.pinned) == [v for v in b.sizes if v in set(b.pinned)]  # in `sizes` order
    # Intermediates (the transposed weight, the scattered GEMM output) are not pinned.
    assert any(v not in set(b.pinned) for v in b.sizes)
    assert all(b.sizes[v] == v.nbytes for v in b.sizes)


def test_the_plan_carries_the_buffers_stage_and_runs_as_jax_does():
    rng = np.random.default_rng(3)
    args = shared_args(rng)
    f = nimble.jit(shared, backend="interpret")
    stages = f.stages(*args)
    b, plan = stages["buffers"].value, stages.plan
    assert plan.storage is b.storage and plan.reads is b.reads and plan.writes is b.writes
    assert plan.dag is b.dag and plan.sizes is b.sizes and plan.views == b.views
    assert set(plan.tasks) == set(b.tasks)
    for got, want in zip(f(*args), jax.jit(shared)(*args)):
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
