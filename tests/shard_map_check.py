"""nimble functions as the per-device body of shard_map and under jit with sharded
inputs, and a data-parallel training step, each against the same program on one device.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/shard_map_check.py interpret
    python tests/shard_map_check.py cuda          # on the GPUs of the machine

Run as its own process (test_shard_map.py does) because the host device count is fixed
when JAX starts. Exits non-zero on the first mismatch.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import nimblejax as nimble
from nimblejax.bench.data_parallel import cross_entropy, dp_step, shard_map, single_step


def mlp(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def init(rng: np.random.Generator, d_in=12, hidden=16, classes=5) -> dict:
    f = lambda *s: jnp.asarray(rng.normal(0, 0.5, s), jnp.float32)  # noqa: E731
    return dict(w1=f(d_in, hidden), b1=f(hidden), w2=f(hidden, classes), b2=f(classes))


def close(got, want, what: str, rtol=2e-5, atol=2e-6) -> None:
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol, err_msg=what)
    print("ok:", what)


def main(backend: str) -> None:
    devices = jax.devices()
    n = len(devices)
    print(f"{n} device(s): {devices}")
    mesh = Mesh(np.array(devices), ("data",))
    rng = np.random.default_rng(0)
    params = init(rng)
    batch = 8 * n
    x = jnp.asarray(rng.normal(size=(batch, 12)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 5, (batch,)), jnp.int32)

    # 1. shard_map: each device runs the plan for its shard's shapes.
    fwd = nimble.jit(mlp, backend=backend)
    sharded = jax.jit(shard_map(fwd, mesh, in_specs=(P(), P("data")), out_specs=P("data")))
    close(sharded(params, x), jax.jit(mlp)(params, x), "shard_map forward")
    # (the plan was built for the per-device batch)
    assert fwd.plan(params, x[: batch // n]).graph.inputs[-1].shape == (batch // n, 12)

    # 2. jit with sharded inputs.
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    close(jax.jit(fwd)(params, xs), jax.jit(mlp)(params, x), "jit with sharded inputs")

    # 3. Data-parallel SGD: per-device gradients from a nimble plan, pmean, update;
    # three steps, parameters fed back, against the full batch on one device.
    loss = cross_entropy(mlp)
    step = dp_step(nimble.jit(jax.value_and_grad(loss), backend=backend), mesh, lr=0.1)
    ref = single_step(jax.value_and_grad(loss), lr=0.1)
    p_dp = jax.device_put(params, NamedSharding(mesh, P()))
    p_ref = jax.tree_util.tree_map(jnp.copy, params)  # the step donates p_dp's buffers
    for i in range(3):
        xb = jnp.asarray(rng.normal(size=(batch, 12)), jnp.float32)
        lb = jnp.asarray(rng.integers(0, 5, (batch,)), jnp.int32)
        p_dp, l_dp = step(p_dp, jax.device_put(xb, NamedSharding(mesh, P("data"))),
                          jax.device_put(lb, NamedSharding(mesh, P("data"))))
        p_ref, l_ref = ref(p_ref, xb, lb)
        close((p_dp, l_dp), (p_ref, l_ref), f"data-parallel step {i + 1} on {n} device(s)")
    print("ALL OK")


if __name__ == "__main__":
    with jax.default_matmul_precision("highest"):
        main(sys.argv[1] if len(sys.argv) > 1 else "interpret")
