"""Each stream's cuBLASLt workspace (runtime/launch.py): every GEMM chooses its algorithm
with the full WORKSPACE_BYTES, and each stream then holds what its GEMMs' choices need."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.runtime import launch
from tests.helpers import on_host

pytestmark = pytest.mark.gpu


def three_projections(x, wq, wk, wv):
    return x @ wq, x @ wk, jnp.tanh(x @ wv)


def test_side_stream_gemms_choose_with_the_full_workspace_and_get_what_they_need():
    from nimblejax.runtime.ffi_runner import FfiRunner

    r = np.random.default_rng(0)
    x = on_host(r.normal(size=(128, 512)), jnp.float32)
    ws = [on_host(r.normal(size=(512, 2048)) / 23.0, jnp.float32) for _ in range(3)]
    f = nimble.jit(three_projections)
    got, want = f(x, *ws), jax.jit(three_projections)(x, *ws)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-2, atol=2e-2)  # TF32
    (runner,) = [x for x in f.runners() if isinstance(x, FfiRunner)]
    launchers = runner.exe.launchers
    gemms = launchers.lt
    assert len(gemms) == 3
    assert len({launchers.stream_of[t] for t in gemms}) >= 2  # side streams too
    for t, g in gemms.items():
        assert g.workspace_bytes == launch.WORKSPACE_BYTES
        assert launchers.workspaces[launchers.stream_of[t]].nbytes >= max(g.workspace_needed, 1)
