"""nimble functions as the per-device body of shard_map and under jit with sharded
inputs, and a data-parallel training step, each against the same program on one device:
the step at tiny sizes, then at realistic ones (MLP 256→512→512→10, 64 rows per device,
whose operands the interpret backend once hung on with several host devices).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
        python tests/helpers/shard_map_check.py interpret
    python tests/helpers/shard_map_check.py cuda           # on the GPUs of the machine
    python tests/helpers/shard_map_check.py interpret 240  # all threads' stacks, exit after 240 s

Run as its own process (test_shard_map.py does) because the host device count is fixed
when JAX starts. Exits non-zero on the first mismatch, or on a hang after the watchdog's
seconds.
"""
from __future__ import annotations

import faulthandler
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import nimblejax as nimble
from nimblejax.bench.data_parallel import cross_entropy, dp_step, shard_map


def single_step(grad_fn, lr: float = 0.01):
    """The same step on one device over the whole batch (the reference)."""

    def step(params, x, labels):
        loss, grads = grad_fn(params, x, labels)
        return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads), loss

    return jax.jit(step)


def mlp(params, x):
    """Dense layers w1/b1, w2/b2, ..., relu between them."""
    n = len(params) // 2
    for i in range(1, n + 1):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        x = jax.nn.relu(x) if i < n else x
    return x


def init(rng: np.random.Generator, sizes=(12, 16, 5), scale=None) -> dict:
    """Parameters of an MLP over `sizes`: N(0, scale), scale 1/sqrt(fan-in) by default."""
    params = {}
    for i, (m, n) in enumerate(zip(sizes, sizes[1:]), 1):
        std = scale if scale is not None else m ** -0.5
        params[f"w{i}"] = jnp.asarray(rng.normal(0, std, (m, n)), jnp.float32)
        params[f"b{i}"] = jnp.asarray(rng.normal(0, std, (n,)), jnp.float32)
    return params


def close(got, want, what: str, rtol=2e-5, atol=2e-6) -> None:
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol, err_msg=what)
    print("ok:", what, flush=True)  # flushed: a hang exits without flushing


def data_parallel(backend: str, mesh: Mesh, rng: np.random.Generator, sizes, rows: int,
                  steps: int = 3, scale=None, lr: float = 0.1, rtol=2e-5, atol=2e-6,
                  segments: int = 1) -> None:
    """Data-parallel SGD: per-device gradients from a nimble plan, pmean, update; `steps`
    steps over `rows` rows per device, parameters fed back, against the full batch on
    one device. `segments`: nimble's plan cut into that many graphs (Options.segments)."""
    n = mesh.devices.size
    batch, d_in, classes = rows * n, sizes[0], sizes[-1]
    params = init(rng, sizes, scale)
    loss = cross_entropy(mlp)
    step = dp_step(nimble.jit(jax.value_and_grad(loss), backend=backend, segments=segments), mesh, lr=lr)
    # jax.jit's own gradients in the same step (the benchmark's baseline): reduced once,
    # not also by shard_map's replication checks (which would apply n x the gradient).
    jax_step = dp_step(jax.value_and_grad(loss), mesh, lr=lr)
    ref = single_step(jax.value_and_grad(loss), lr=lr)
    p_dp = jax.device_put(params, NamedSharding(mesh, P()))
    p_jax = jax.tree_util.tree_map(jnp.copy, p_dp)  # the steps donate their params
    p_ref = jax.tree_util.tree_map(jnp.copy, params)  # (p_dp's may be params' buffers)
    shape = "→".join(map(str, sizes))
    for i in range(steps):
        xb = jnp.asarray(rng.normal(size=(batch, d_in)), jnp.float32)
        lb = jnp.asarray(rng.integers(0, classes, (batch,)), jnp.int32)
        xs, ls = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (xb, lb))
        p_dp, l_dp = step(p_dp, xs, ls)
        p_jax, l_jax = jax_step(p_jax, xs, ls)
        p_ref, l_ref = ref(p_ref, xb, lb)
        close((p_dp, l_dp), (p_ref, l_ref), f"data-parallel step {i + 1} on {n} device(s), "
              f"MLP {shape}, {rows} rows per device" + (f", {segments} segments" if segments > 1 else ""),
              rtol=rtol, atol=atol)
        close((p_jax, l_jax), (p_ref, l_ref), f"jax.jit's data-parallel step {i + 1}",
              rtol=rtol, atol=atol)


def main(backend: str) -> None:
    devices = jax.devices()
    n = len(devices)
    print(f"{n} device(s): {devices}", flush=True)
    mesh = Mesh(np.array(devices), ("data",))
    rng = np.random.default_rng(0)
    params = init(rng, scale=0.5)
    batch = 8 * n
    x = jnp.asarray(rng.normal(size=(batch, 12)), jnp.float32)

    # 1. shard_map: each device runs the plan for its shard's shapes.
    fwd = nimble.jit(mlp, backend=backend)
    sharded = jax.jit(shard_map(fwd, mesh, in_specs=(P(), P("data")), out_specs=P("data")))
    close(sharded(params, x), jax.jit(mlp)(params, x), "shard_map forward")
    # (the plan was built for the per-device batch)
    assert fwd.plan(params, x[: batch // n]).graph.inputs[-1].shape == (batch // n, 12)

    # 1b. Co-execution per device: nimble regions around an eigh that XLA runs.
    def whiten(x):
        s = x.T @ x + 8.0 * jnp.eye(x.shape[1], dtype=x.dtype)
        return jnp.tanh(x * jnp.linalg.eigvalsh(s) * 0.05) * jnp.sum(x, axis=1, keepdims=True)

    co = jax.jit(shard_map(nimble.jit(whiten, backend=backend), mesh, in_specs=P("data"),
                           out_specs=P("data")))
    ref = jax.jit(shard_map(whiten, mesh, in_specs=P("data"), out_specs=P("data")))
    close(co(x), ref(x), "shard_map of a co-executed function (eigh left to XLA)",
          rtol=1e-4, atol=1e-5)

    # 2. jit with sharded inputs.
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    close(jax.jit(fwd)(params, xs), jax.jit(mlp)(params, x), "jit with sharded inputs")

    # 3. Data-parallel SGD at tiny sizes, then at realistic ones: operands of more than
    # about 128 KiB are where a host callback that hands its work back to JAX's CPU
    # client waits forever for the worker threads the devices hold.
    data_parallel(backend, mesh, rng, (12, 16, 5), rows=8, scale=0.5)
    data_parallel(backend, mesh, rng, (256, 512, 512, 10), rows=64, rtol=1e-4, atol=1e-5)
    if backend == "cuda":  # the plan as 3 graphs, XLA's all-reduce between them
        data_parallel(backend, mesh, rng, (256, 512, 512, 10), rows=64, rtol=1e-4, atol=1e-5, segments=3)

    # 4. Where the interpreter's callback cannot bypass JAX's CPU client (a JAX without
    # the pieces it uses), a computation over several host devices is refused when it
    # is traced rather than left to hang.
    if backend == "interpret" and n > 1:
        refused(mesh, params, x)
    print("ALL OK")


def refused(mesh: Mesh, params, x) -> None:
    from nimblejax.runtime import interpret_runner

    saved = interpret_runner._host_callback
    interpret_runner._host_callback = lambda: None
    try:
        f = nimble.jit(lambda p, x: mlp(p, x) * 2, backend="interpret")
        jax.jit(shard_map(f, mesh, in_specs=(P(), P("data")), out_specs=P("data"))).lower(params, x)
    except NotImplementedError as e:
        assert "CPU devices" in str(e), e
        print("ok: refused at trace time without a direct host callback", flush=True)
    else:
        raise AssertionError("a computation that could hang was not refused")
    finally:
        interpret_runner._host_callback = saved


if __name__ == "__main__":
    if len(sys.argv) > 2:  # a hang fails with every thread's stack rather than silently
        faulthandler.dump_traceback_later(float(sys.argv[2]), exit=True)
    with jax.default_matmul_precision("highest"):
        main(sys.argv[1] if len(sys.argv) > 1 else "interpret")
