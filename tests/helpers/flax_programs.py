"""Programs as flax.linen / optax users write them: each entry builds (fn, args) where
fn is what a user would put under jax.jit. tests/end_to_end/test_flax.py runs them under
nimble.jit (interpret backend on the CPU, cuda under `-m gpu`) against jax.jit."""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from tests.helpers import jit_init, on_host


# ---- models ------------------------------------------------------------------------
class Inception(nn.Module):
    """A small CNN with inception blocks (parallel 1x1 / 3x3 / pooled branches,
    concatenated), BatchNorm and a dense head."""

    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool):
        def conv_bn(y, c, k):
            y = nn.Conv(c, (k, k), padding="SAME", use_bias=False)(y)
            y = nn.BatchNorm(use_running_average=not train, momentum=0.9)(y)
            return nn.relu(y)

        x = conv_bn(x, 16, 3)
        for width in (8, 12):
            a = conv_bn(x, width, 1)
            b = conv_bn(conv_bn(x, width, 1), width, 3)
            c = conv_bn(nn.avg_pool(x, (3, 3), strides=(1, 1), padding="SAME"), width, 1)
            x = jnp.concatenate([a, b, c], axis=-1)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(64)(x))
        x = nn.LayerNorm()(x)
        return nn.Dense(10)(x)


class EncoderBlock(nn.Module):
    dim: int = 32
    heads: int = 4
    causal: bool = False
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = False):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2])) if self.causal else None
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads, dropout_rate=self.dropout,
                                            deterministic=not train)(y, y, mask=mask)
        x = x + nn.Dropout(self.dropout, deterministic=not train)(y)
        y = nn.LayerNorm()(x)
        y = nn.Dense(self.dim)(nn.gelu(nn.Dense(2 * self.dim)(y)))
        return x + y


class TextEncoder(nn.Module):
    vocab: int = 50
    dim: int = 32
    classes: int = 3

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
        x = EncoderBlock(self.dim)(x, train)
        x = EncoderBlock(self.dim)(x, train)
        return nn.Dense(self.classes)(jnp.mean(x, axis=1))


# ---- programs ----------------------------------------------------------------------
def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def inception_inference():
    model = Inception()
    x = on_host(_rng().normal(size=(2, 16, 16, 3)), jnp.float32)
    variables = jit_init(model, jax.random.PRNGKey(0), x, train=False)
    return (lambda v, x: model.apply(v, x, train=False)), (variables, x)


def inception_sgd_step():
    """SGD training step with BatchNorm statistics updated (concatenate's gradient is
    `split`)."""
    model = Inception()
    r = _rng(1)
    x = on_host(r.normal(size=(4, 16, 16, 3)), jnp.float32)
    labels = on_host(r.integers(0, 10, (4,)), jnp.int32)
    variables = jit_init(model, jax.random.PRNGKey(1), x, train=False)
    opt = optax.sgd(0.05, momentum=0.9)
    state = opt.init(variables["params"])

    def step(params, stats, state, x, labels):
        def loss_fn(p):
            logits, new = model.apply({"params": p, "batch_stats": stats}, x, train=True,
                                      mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), new

        (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), new["batch_stats"], state, loss

    return step, (variables["params"], variables["batch_stats"], state, x, labels)


def integer_label_step(model: nn.Module, opt) -> Callable:
    """step(params, opt_state, x, labels) -> (params, opt_state, loss): one optax step on
    the mean integer-label softmax cross-entropy of `model`."""

    def step(params, state, x, labels):
        def loss_fn(p):
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def adamw_mlp_step():
    """adamw MLP training step with integer labels (gather in the loss)."""
    model = MLP()
    r = _rng(2)
    x = on_host(r.normal(size=(16, 20)), jnp.float32)
    labels = on_host(r.integers(0, 10, (16,)), jnp.int32)
    params = jit_init(model, jax.random.PRNGKey(2), x)
    opt = optax.adamw(1e-3, weight_decay=1e-2)
    state = opt.init(params)

    return integer_label_step(model, opt), (params, state, x, labels)


def _text_batch(seed: int):
    r = _rng(seed)
    tokens = on_host(r.integers(0, 50, (4, 12)), jnp.int32)
    labels = on_host(r.integers(0, 3, (4,)), jnp.int32)
    return tokens, labels


def encoder_inference():
    model = TextEncoder()
    tokens, _ = _text_batch(3)
    params = jit_init(model, jax.random.PRNGKey(3), tokens)
    return (lambda p, t: model.apply(p, t)), (params, tokens)


def encoder_adam_step():
    """Embedding + transformer encoder, adam step: the embedding's gradient is a
    scatter-add."""
    model = TextEncoder()
    tokens, labels = _text_batch(4)
    params = jit_init(model, jax.random.PRNGKey(4), tokens)
    opt = optax.adam(1e-3)
    state = opt.init(params)

    return integer_label_step(model, opt), (params, state, tokens, labels)


def dropout_train():
    """An encoder block in train mode: dropout masks from `rngs=`, a key per call."""
    model = EncoderBlock(dropout=0.25)
    x = on_host(_rng(5).normal(size=(2, 8, 32)), jnp.float32)
    params = jit_init(model, jax.random.PRNGKey(5), x)

    def fn(params, x, key):
        return model.apply(params, x, train=True, rngs={"dropout": key})

    return fn, (params, x, jax.random.key(7))


def causal_attention():
    model = EncoderBlock(causal=True)
    x = on_host(_rng(6).normal(size=(2, 10, 32)), jnp.float32)
    params = jit_init(model, jax.random.PRNGKey(6), x)
    return (lambda p, x: model.apply(p, x)), (params, x)


def top_k_sampling():
    """Sample the next token from the top-k logits of a language-model head."""
    r = _rng(7)
    logits = on_host(r.normal(size=(4, 50)), jnp.float32)

    def sample(logits, key, temperature):
        values, index = jax.lax.top_k(logits / temperature, 5)
        choice = jax.random.categorical(key, values, axis=-1)
        return jnp.take_along_axis(index, choice[:, None], axis=-1)[:, 0], values

    return sample, (logits, jax.random.PRNGKey(8), jnp.float32(0.8))


PROGRAMS: dict[str, Callable] = {
    "inception_inference": inception_inference,
    "inception_sgd_step": inception_sgd_step,
    "adamw_mlp_step": adamw_mlp_step,
    "encoder_inference": encoder_inference,
    "encoder_adam_step": encoder_adam_step,
    "dropout_train": dropout_train,
    "causal_attention": causal_attention,
    "top_k_sampling": top_k_sampling,
}
