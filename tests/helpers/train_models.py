"""Small CIFAR-style CNNs and an SGD-with-momentum train step, in plain JAX."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tests.helpers import on_host

NHWC = ("NHWC", "HWIO", "NHWC")


def conv(x, w, stride=1, groups=1):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=NHWC,
                                    feature_group_count=groups)


def batch_norm(x, g, b, eps=1e-5):
    """Training-mode batch norm: statistics of this batch over N, H, W."""
    mean = jnp.mean(x, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(x - mean), axis=(0, 1, 2))
    return (x - mean) * lax.rsqrt(var + eps) * g + b


def _w(rng, *shape):
    fan_in = int(np.prod(shape[:-1]))
    return on_host(rng.standard_normal(shape) * np.sqrt(2.0 / fan_in), jnp.float32)


def _bn(c):
    return {"g": jnp.ones((c,), jnp.float32), "b": jnp.zeros((c,), jnp.float32)}


def resnet_init(rng, width=16, blocks=2, classes=10):
    p = {"stem": _w(rng, 3, 3, 3, width), "stem_bn": _bn(width), "blocks": []}
    for _ in range(blocks):
        p["blocks"].append({"w1": _w(rng, 3, 3, width, width), "bn1": _bn(width),
                            "w2": _w(rng, 3, 3, width, width), "bn2": _bn(width)})
    p["head"] = _w(rng, width, classes)
    return p


def resnet_apply(p, x):
    h = jax.nn.relu(batch_norm(conv(x, p["stem"]), **p["stem_bn"]))
    for blk in p["blocks"]:
        y = jax.nn.relu(batch_norm(conv(h, blk["w1"]), **blk["bn1"]))
        y = batch_norm(conv(y, blk["w2"]), **blk["bn2"])
        h = jax.nn.relu(h + y)
    h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return jnp.mean(h, axis=(1, 2)) @ p["head"]


def mobilenet_init(rng, width=16, expand=4, blocks=2, classes=10):
    p = {"stem": _w(rng, 3, 3, 3, width), "stem_bn": _bn(width), "blocks": []}
    for _ in range(blocks):
        e = width * expand
        p["blocks"].append({"expand": _w(rng, 1, 1, width, e), "bn1": _bn(e),
                            "dw": _w(rng, 3, 3, 1, e), "bn2": _bn(e),
                            "project": _w(rng, 1, 1, e, width), "bn3": _bn(width)})
    p["head"] = _w(rng, width, classes)
    return p


def mobilenet_apply(p, x):
    h = jax.nn.relu6(batch_norm(conv(x, p["stem"], stride=2), **p["stem_bn"]))
    for blk in p["blocks"]:
        y = jax.nn.relu6(batch_norm(conv(h, blk["expand"]), **blk["bn1"]))
        y = jax.nn.relu6(batch_norm(conv(y, blk["dw"], groups=y.shape[-1]), **blk["bn2"]))
        h = h + batch_norm(conv(y, blk["project"]), **blk["bn3"])
    return jnp.mean(h, axis=(1, 2)) @ p["head"]


def make_train_step(apply, lr=0.05, momentum=0.9):
    def loss_fn(params, x, labels):
        logits = apply(params, x)
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))

    def step(params, velocity, x, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, labels)
        velocity = jax.tree_util.tree_map(lambda v, g: momentum * v + g, velocity, grads)
        params = jax.tree_util.tree_map(lambda p, v: p - lr * v, params, velocity)
        return params, velocity, loss

    return step


def batch(rng, n, size=32, classes=10):
    x = on_host(rng.standard_normal((n, size, size, 3)), jnp.float32)
    labels = jax.nn.one_hot(rng.integers(0, classes, n), classes)
    return x, labels


TRAIN_MODELS = {"resnet": (resnet_init, resnet_apply), "mobilenet_v2": (mobilenet_init, mobilenet_apply)}


def tanh_mlp_loss(params, x):
    """Mean square of a tanh MLP's output: `params` a list of (w, b)."""
    h = x
    for w, b in params:
        h = jnp.tanh(h @ w + b)
    return jnp.mean(h ** 2)
