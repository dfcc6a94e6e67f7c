"""Primitives of JAX versions newer than the installed one, checked with stand-ins: a
primitive of the same name and params as the newer JAX's, so that what nimblejax keys
by that name runs here (on the newer JAX the real primitive is used, and the records
in tests/helpers/primitive_table.py run it too).

- log2 (jax 0.11: lax.log2, jnp.log2): an elementwise rule; its kernel is compiled with
  NVRTC and run on the CPU (tests/helpers/kernel_emulator.py) against NumPy.
- eval_jaxpr (jax after 0.11.0: closed_call's successor, a `call_jaxpr` param;
  custom_vjp's forward emits it): inlined while tracing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive

from tests.helpers import on_host
from tests.helpers import kernel_emulator
import nimblejax as nimble
from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx

r = np.random.default_rng(7)


def log2_function():
    """lax.log2 where this JAX has it; else a stand-in primitive named log2 with the
    `accuracy` param JAX's transcendental primitives take."""
    if hasattr(lax, "log2"):
        return lax.log2
    from jax._src.core import ShapedArray

    p = Primitive("log2")
    p.def_impl(lambda x, **_: jnp.log2(x))
    p.def_abstract_eval(lambda x, **_: ShapedArray(x.shape, x.dtype, weak_type=x.weak_type))
    return lambda x: p.bind(x, accuracy=None)


LOG2 = log2_function()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_log2_kernel(dtype):
    def f(x):
        return LOG2(x) * 3.0

    # Powers of two (exact in every type), values around them and a spread.
    x = np.concatenate([2.0 ** np.arange(-6, 7), r.uniform(0.01, 50.0, 51)]).astype(np.float32)
    x = jnp.asarray(x, dtype)
    want = np.log2(np.asarray(x, np.float64)) * 3.0
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)

    nf = nimble.jit(f, backend="interpret")
    np.testing.assert_allclose(np.asarray(nf(x), np.float64), want, **tol)
    plan = nf.plan(x)
    sources = [k.source for t in plan.tasks if t.kernel for k in t.kernel.launches]
    # log(x) / ln2 as XLA computes it: times 1/ln2, ln2 and its reciprocal in x's type
    # (elementwise._expansion)
    assert len(sources) == 1 and "__fmul_rn(" in sources[0] and "logf(" in sources[0], sources
    if available_compiler() is not None:
        compile_to_ptx(sources[0], "log2.cu", arch="sm_90")
    if kernel_emulator.compiler() is not None:  # the kernel itself, on the CPU
        (out,), emulated = kernel_emulator.run(plan, [x])
        assert emulated == 1
        np.testing.assert_allclose(np.asarray(out, np.float64).reshape(want.shape), want, **tol)


def eval_jaxpr_primitive() -> Primitive:
    """JAX's own where it takes `call_jaxpr` (after 0.11.0); else a stand-in with that
    param (0.10's eval_jaxpr takes `jaxpr` and is staged as closed_call)."""
    from jax._src import core

    real = getattr(core, "eval_jaxpr_p", None)
    if real is not None:
        return real
    p = Primitive("eval_jaxpr")
    p.multiple_results = True
    p.def_impl(lambda *args, call_jaxpr: core.jaxpr_as_fun(call_jaxpr)(*args))
    p.def_abstract_eval(lambda *args, call_jaxpr: call_jaxpr.out_avals)
    return p


def test_eval_jaxpr_is_inlined():
    body = jax.make_jaxpr(lambda x, y: (jnp.sin(x) * y + 1.0, x - y))(
        jax.ShapeDtypeStruct((4, 3), jnp.float32), jax.ShapeDtypeStruct((4, 3), jnp.float32))
    call = eval_jaxpr_primitive()

    def f(x, y):
        a, b = call.bind(x, y, call_jaxpr=body)
        return a * b

    x, y = (on_host(r.standard_normal((4, 3)), jnp.float32) for _ in range(2))
    nf = nimble.jit(f, backend="interpret")
    np.testing.assert_allclose(nf(x, y), (jnp.sin(x) * y + 1.0) * (x - y), rtol=1e-6)
    assert "eval_jaxpr" not in {n.name for n in nf.plan(x, y).graph.nodes}


def test_checkpoint_name_is_an_identity():
    from jax.ad_checkpoint import checkpoint_name

    def f(x):
        return jnp.sum(checkpoint_name(jnp.sin(x), "hidden") * x)

    x = on_host(r.standard_normal(9), jnp.float32)
    g = jax.grad(f)
    np.testing.assert_allclose(nimble.jit(f, backend="interpret")(x), jax.jit(f)(x), rtol=1e-6)
    np.testing.assert_allclose(nimble.jit(g, backend="interpret")(x), jax.jit(g)(x), rtol=1e-6)
