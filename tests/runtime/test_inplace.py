"""Which operands and results the XLA call path re-points instead of copying
(runtime/inplace.py): a pure decision on the plan, checked here without a GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from nimblejax.runtime import inplace
from tests.helpers import on_host


def plan_of(f, *shapes, **jit_kwargs):
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return nimble.jit(f, backend="interpret", **jit_kwargs).plan(*specs)


def root(plan, v):
    return plan.storage.get(v, v)


def test_kernel_only_buffers_are_in_place_and_their_sites_name_them():
    plan = plan_of(lambda x, y: jnp.tanh(x) * y + 1.0, (64, 32), (64, 32))
    ip = inplace.analyze(plan)
    assert ip.inputs == {0, 1}
    assert ip.outputs == set(plan.graph.outputs)
    for buf, sites in ip.sites.items():
        assert sites
        for s in sites:  # each site's parameter is a value held in that buffer
            assert root(plan, s.task.kernel.params[s.param]) == buf


def test_buffers_a_library_call_touches_are_copied():
    plan = plan_of(lambda x, w: jnp.tanh(x @ w), (8, 16), (16, 32))
    ip = inplace.analyze(plan)
    gemm = [t for t in plan.tasks if t.kind == "gemm"]
    assert gemm, "a float32 dot is a GEMM task"
    assert ip.inputs == set()  # both operands feed the GEMM
    assert ip.outputs == set(plan.graph.outputs)  # tanh's kernel writes the result


def test_a_gemm_result_is_copied_out():
    plan = plan_of(lambda x, w: (x @ w, x * 2.0), (8, 16), (16, 32))
    ip = inplace.analyze(plan)
    mm, doubled = plan.graph.outputs
    assert mm not in ip.outputs and doubled in ip.outputs


def test_donated_operands_are_copied():
    plan = plan_of(lambda x, y: (x * 2.0, y + 1.0), (8,), (8,), donate_argnums=0)
    assert inplace.analyze(plan, donated=frozenset({0})).inputs == {1}


def test_a_buffer_holding_two_results_is_copied():
    plan = plan_of(lambda x: (jnp.sin(x), jnp.sin(x).reshape(4, 4)), (16,))
    ip = inplace.analyze(plan)
    roots = {root(plan, a) for a in plan.graph.outputs}
    assert len(roots) == 1  # the reshape is a view of the same buffer
    assert ip.outputs == set()


def test_an_operand_a_result_views_is_copied_in():
    """A result that is a view of an operand (a reshape of it, or a reduction over unit
    axes) is copied out of the operand's arena slot, so the operand must be copied in
    (seen on the GPU: `jnp.any(a, axis=())` returned False for True)."""
    plan = plan_of(lambda x, y: (x.reshape(-1), jnp.tanh(x) * y), (8, 4), (8, 4))
    ip = inplace.analyze(plan)
    assert 0 not in ip.inputs and 1 in ip.inputs
    plan = plan_of(lambda x: (jnp.sum(x, axis=()), -x), ())  # a reshape of a scalar
    assert plan.storage and inplace.analyze(plan).inputs == set()


def test_small_buffers_read_by_many_kernels_are_copied_large_ones_not():
    def fan_out(x):
        return [jnp.sort(x * float(k)) for k in range(inplace.MAX_PATCHED_NODES + 2)]

    # (unpacked: horizontal fusion would read x in one kernel)
    small = plan_of(fan_out, (256,), horizontal=False)
    assert 0 not in inplace.analyze(small).inputs
    big = plan_of(fan_out, (inplace.ALWAYS_BELOW_BYTES // 4,), horizontal=False)
    assert 0 in inplace.analyze(big).inputs


def test_passthrough_and_constant_outputs_are_not_buffers():
    plan = plan_of(lambda x: (x, jnp.ones(3), x + 1.0), (3,))
    ip = inplace.analyze(plan)
    kinds = [plan.output_kind(a) for a in plan.graph.outputs]
    assert kinds[0] == "input"
    assert ip.outputs == {a for a, k in zip(plan.graph.outputs, kinds) if k == "buffer"}


def test_interpreter_and_analysis_agree_on_values():
    """The interpreter ignores placement; a plan with in-place buffers still computes
    what jax.jit does (a smoke check that analysis does not change the plan)."""
    f = lambda x, y: (jnp.tanh(x) * y, jnp.sum(x, axis=1))  # noqa: E731
    r = np.random.default_rng(0)
    x, y = (on_host(r.normal(size=(16, 8)), jnp.float32) for _ in range(2))
    got = nimble.jit(f, backend="interpret")(x, y)
    for g, w in zip(got, jax.jit(f)(x, y)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
