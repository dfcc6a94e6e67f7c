"""A training step under nimble.jit: the loss, its gradient and an optax update in one
plan, the parameters and optimizer state donated so that each step reuses their memory.

    python examples/train_step.py [--steps 20]

Runs anywhere (the CPU plan interpreter without a GPU). Needs optax.
"""
import argparse

import jax
import jax.numpy as jnp
import optax

import nimblejax as nimble

BACKEND = "cuda" if jax.default_backend() == "gpu" else "interpret"
# On a GPU both sides multiply float32 matrices in TF32 (JAX's default precision), with
# different kernels summing in different orders: agreement to ~1e-3, not 1e-6.
TOL = 5e-3 if BACKEND == "cuda" else 1e-4
optimizer = optax.adam(1e-2)


def loss(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def step(params, opt_state, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    opts = ap.parse_args()

    k = jax.random.split(jax.random.key(2), 5)
    params = {"w1": jax.random.normal(k[0], (8, 32)) / 3, "b1": jnp.zeros(32),
              "w2": jax.random.normal(k[1], (32, 1)) / 6}
    x = jax.random.normal(k[2], (64, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))  # something to fit

    # donate_argnums=(0, 1): the old parameters and optimizer state are consumed, as
    # under jax.jit, and their memory holds the new ones.
    train = nimble.jit(step, donate_argnums=(0, 1), backend=BACKEND)
    reference = jax.jit(step)
    opt_state = optimizer.init(params)

    # The first step against jax.jit, on copies (a donated array cannot be read again).
    copy = lambda tree: jax.tree.map(jnp.array, tree)  # noqa: E731
    want_params, _, want_loss = reference(copy(params), copy(opt_state), x, y)
    params, opt_state, first = train(params, opt_state, x, y)
    err = max(float(jnp.max(jnp.abs(a - b)))
              for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)))
    print(f"step 1: loss {float(first):.4f} (jax.jit {float(want_loss):.4f}), "
          f"max parameter difference {err:.1e}")
    assert err < TOL

    for i in range(2, opts.steps + 1):
        params, opt_state, value = train(params, opt_state, x, y)
    print(f"step {opts.steps}: loss {float(value):.4f}; plans compiled: {train.cache_size}")
    assert float(value) < float(first)


if __name__ == "__main__":
    main()
