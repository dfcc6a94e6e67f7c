"""A flax.linen model under nimble.jit: a small CNN whose blocks have parallel branches
(1x1, 3x3 and pooled, as in Inception), inference with BatchNorm's running averages.

    python examples/flax_model.py

Runs anywhere (the CPU plan interpreter without a GPU). Needs flax.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

import nimblejax as nimble

BACKEND = "cuda" if jax.default_backend() == "gpu" else "interpret"
# On a GPU both sides multiply float32 matrices in TF32 (JAX's default precision), with
# different kernels summing in different orders: agreement to ~1e-3, not 1e-6.
TOL = 5e-3 if BACKEND == "cuda" else 1e-4


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        def conv(y, k):
            y = nn.Conv(self.width, (k, k), padding="SAME", use_bias=False)(y)
            return nn.relu(nn.BatchNorm(use_running_average=True)(y))

        a = conv(x, 1)
        b = conv(conv(x, 1), 3)
        c = conv(nn.avg_pool(x, (3, 3), strides=(1, 1), padding="SAME"), 1)
        return jnp.concatenate([a, b, c], axis=-1)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (8, 12):
            x = nn.max_pool(Block(width)(x), (2, 2), strides=(2, 2))
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


def main() -> None:
    model = Net()
    images = jax.random.normal(jax.random.key(3), (4, 16, 16, 3))
    variables = jax.jit(model.init)(jax.random.key(4), images)

    predict = nimble.jit(model.apply, backend=BACKEND)
    logits = predict(variables, images)
    want = jax.jit(model.apply)(variables, images)
    err = float(jnp.max(jnp.abs(logits - want)))
    report = nimble.explain(predict, variables, images)
    print(f"logits {logits.shape}, max difference from jax.jit {err:.1e}")
    print(f"plan: {report.num_tasks} tasks on {report.num_streams} streams, "
          f"{report.num_events} events")
    assert err < TOL


if __name__ == "__main__":
    main()
