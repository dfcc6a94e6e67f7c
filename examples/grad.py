"""jax.grad through a nimble function: the backward pass is planned as a nimble graph
too, and jax.vmap and jax.jit compose with it as with any JAX operation.

    python examples/grad.py

Runs anywhere (the CPU plan interpreter without a GPU).
"""
import jax
import jax.numpy as jnp

import nimblejax as nimble

BACKEND = "cuda" if jax.default_backend() == "gpu" else "interpret"
# On a GPU both sides multiply float32 matrices in TF32 (JAX's default precision), with
# different kernels summing in different orders: agreement to ~1e-3, not 1e-6.
TOL = 5e-3 if BACKEND == "cuda" else 1e-4


def loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
        logits, y[:, None], axis=-1)[:, 0])


def main() -> None:
    k = jax.random.split(jax.random.key(1), 5)
    params = {"w1": jax.random.normal(k[0], (32, 64)) / 6, "b1": jax.random.normal(k[1], (64,)),
              "w2": jax.random.normal(k[2], (64, 10)) / 8}
    x = jax.random.normal(k[3], (16, 32))
    y = jax.random.randint(k[4], (16,), 0, 10)

    nimble_loss = nimble.jit(loss, backend=BACKEND)
    value, grads = jax.value_and_grad(nimble_loss)(params, x, y)
    want_value, want_grads = jax.jit(jax.value_and_grad(loss))(params, x, y)
    err = max(float(jnp.max(jnp.abs(a - b)))
              for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)))
    print(f"loss {float(value):.4f} (jax.jit {float(want_value):.4f}), "
          f"max gradient difference {err:.1e}")
    assert abs(float(value - want_value)) < TOL and err < TOL

    # Per-example losses: vmap over the batch, the batched function planned as a whole.
    per_example = jax.vmap(nimble_loss, in_axes=(None, 0, 0))(params, x[:, None], y[:, None])
    want = jax.vmap(loss, in_axes=(None, 0, 0))(params, x[:, None], y[:, None])
    print("per-example losses:", per_example[:4], "...")
    assert float(jnp.max(jnp.abs(per_example - want))) < TOL


if __name__ == "__main__":
    main()
