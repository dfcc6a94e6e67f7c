"""Shared plain-JAX layers for the benchmark models, and the parameter machinery.

A model is written once, as ``forward(cfg, ctx, x)``: every layer asks ``ctx`` for its
parameters by name. The same code serves three purposes:

- recording: ``param_specs`` runs ``forward`` under ``jax.eval_shape`` with a recording
  context, which returns zeros and notes every parameter's shape and initializer. Nothing
  is materialized, so full-size specs (ResNet-50, BERT-base) cost only a trace;
- initialization: ``init_params`` draws each recorded parameter from a numpy Generator;
- applying: the model function ``fn(params, x)`` runs ``forward`` with a context that
  reads ``params`` (a flat dict name → array), so ``fn`` is a pure function of its inputs.

Conventions: NHWC activations, HWIO convolution weights, batch norm in inference form
(a folded per-channel scale and shift), dense weights (in, out).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

DIMS = ("NHWC", "HWIO", "NHWC")


# ---- parameters -----------------------------------------------------------------------

@dataclass(frozen=True)
class ParamSpec:
    """A parameter's shape and how to draw it: ('normal', std) | ('bn_scale', s) |
    ('bn_shift', s) | ('zeros', 0) | ('ones', 0)."""

    shape: tuple[int, ...]
    init: str
    scale: float = 1.0

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class Context:
    """Hands out parameters by name; records them when `params` is None."""

    def __init__(self, params: Optional[dict] = None, dtype: Any = jnp.float32) -> None:
        self.params = params
        self.dtype = dtype
        self.specs: dict[str, ParamSpec] = {}
        self._scopes: list[str] = []
        self._counts: dict[str, int] = {}

    @property
    def recording(self) -> bool:
        return self.params is None

    def unique(self, prefix: str) -> str:
        """The next unique layer name under the current scope: conv_0, conv_1, ..."""
        base = "/".join(self._scopes + [prefix])
        n = self._counts.get(base, 0)
        self._counts[base] = n + 1
        return f"{base}_{n}"

    def scope(self, name: str) -> "_Scope":
        return _Scope(self, name)

    def param(self, name: str, shape: Sequence[int], init: str, scale: float = 1.0):
        shape = tuple(int(d) for d in shape)
        if self.recording:
            if name in self.specs:
                raise ValueError(f"parameter {name!r} defined twice")
            self.specs[name] = ParamSpec(shape, init, float(scale))
            return jnp.zeros(shape, self.dtype)
        p = self.params[name]
        if tuple(p.shape) != shape:
            raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)}, model wants {shape}")
        return p


class _Scope:
    def __init__(self, ctx: Context, name: str) -> None:
        self.ctx, self.name = ctx, name

    def __enter__(self) -> Context:
        self.ctx._scopes.append(self.name)
        return self.ctx

    def __exit__(self, *exc) -> None:
        self.ctx._scopes.pop()


Forward = Callable[[Context, Any], Any]  # forward(ctx, x) with the config bound


def param_specs(forward: Forward, x_spec: jax.ShapeDtypeStruct) -> tuple[dict[str, ParamSpec], Any]:
    """Trace `forward` abstractly: (name → ParamSpec, output ShapeDtypeStruct)."""
    ctx = Context(None, x_spec.dtype)
    out = jax.eval_shape(lambda x: forward(ctx, x), x_spec)
    return dict(ctx.specs), out


def abstract_params(specs: dict[str, ParamSpec], dtype: Any) -> dict:
    """name → jax.ShapeDtypeStruct: what `plan` needs, no weights."""
    return {k: jax.ShapeDtypeStruct(s.shape, dtype) for k, s in specs.items()}


def init_params(specs: dict[str, ParamSpec], rng: np.random.Generator, dtype: Any) -> dict:
    """Random weights drawn from `rng`, in a fixed (name) order."""
    out = {}
    for name in sorted(specs):
        s = specs[name]
        if s.init == "normal":
            a = rng.standard_normal(s.shape, dtype=np.float32) * np.float32(s.scale)
        elif s.init == "bn_scale":  # gamma / sqrt(var + eps), around `scale`
            a = s.scale * (1.0 + 0.1 * rng.standard_normal(s.shape, dtype=np.float32))
        elif s.init == "bn_shift":  # beta - mean * scale
            a = s.scale * 0.1 * rng.standard_normal(s.shape, dtype=np.float32)
        elif s.init == "zeros":
            a = np.zeros(s.shape, np.float32)
        elif s.init == "ones":
            a = np.ones(s.shape, np.float32)
        else:
            raise ValueError(f"unknown initializer {s.init!r} for {name!r}")
        out[name] = on_device(a, dtype)
    return out


def on_device(values, dtype) -> jax.Array:
    """NumPy values as a jax.Array of `dtype`, cast by NumPy (round to nearest even, as
    XLA converts): `jnp.asarray(values, dtype)` compiles a small program for each new
    shape and dtype, 11 ms each on a CPU, a few seconds over a model's parameters (the
    tests' arrays come through here too: tests/helpers.on_host)."""
    return jax.device_put(np.asarray(values).astype(jnp.dtype(dtype)))


def count_params(specs: dict[str, ParamSpec]) -> int:
    return sum(s.size for s in specs.values())


def bind(forward: Forward) -> Callable:
    """The pure model function fn(params, x)."""

    def fn(params, x):
        return forward(Context(params, x.dtype), x)

    return fn


# ---- dense layers ---------------------------------------------------------------------

def dense(ctx: Context, x, features: int, bias: bool = True, name: str = "dense", std: Optional[float] = None):
    n = ctx.unique(name)
    fan_in = x.shape[-1]
    w = ctx.param(f"{n}/w", (fan_in, features), "normal", std if std is not None else 1.0 / math.sqrt(fan_in))
    y = jnp.matmul(x, w)
    if bias:
        y = y + ctx.param(f"{n}/b", (features,), "bn_shift", 1.0)
    return y


def heads_qkv(ctx: Context, x, heads: int) -> tuple:
    """An attention layer's query, key and value projections of x (b, s, d), each split
    into heads: (b, s, heads, d // heads)."""
    b, s, d = x.shape
    return tuple(dense(ctx, x, d, name=n).reshape(b, s, heads, d // heads)
                 for n in ("query", "key", "value"))


def layer_norm(ctx: Context, x, eps: float = 1e-12, name: str = "ln"):
    n = ctx.unique(name)
    c = x.shape[-1]
    g = ctx.param(f"{n}/scale", (c,), "bn_scale", 1.0)
    b = ctx.param(f"{n}/shift", (c,), "bn_shift", 1.0)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * g + b


def gelu(x):
    """BERT's exact (erf) GELU."""
    return 0.5 * x * (1.0 + lax.erf(x * (1.0 / math.sqrt(2.0))))


def softmax(x, axis: int = -1):
    m = lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    e = jnp.exp(x - m)
    return e / jnp.sum(e, axis=axis, keepdims=True)


# ---- convolutional layers -------------------------------------------------------------

Padding = Union[str, int, tuple]


def _padding(padding: Padding):
    """'SAME' / 'VALID' (TensorFlow's rules), an int p (p on every side), (ph, pw)
    (symmetric per dimension) or ((top, bottom), (left, right))."""
    if isinstance(padding, str):
        return padding
    if isinstance(padding, int):
        return ((padding, padding), (padding, padding))
    ph, pw = padding
    if isinstance(ph, int):
        return ((ph, ph), (pw, pw))
    return (tuple(ph), tuple(pw))


def _pair(k) -> tuple[int, int]:
    return (k, k) if isinstance(k, int) else tuple(k)


def conv(ctx: Context, x, features: int, kernel, stride: int = 1, padding: Padding = "SAME",
         groups: int = 1, bias: bool = False, name: str = "conv", gain: float = 2.0):
    """lax.conv_general_dilated, NHWC × HWIO. `groups` = feature_group_count (depthwise
    when it equals the input channels). He-normal weights (`gain` 2 for ReLU)."""
    n = ctx.unique(name)
    kh, kw = _pair(kernel)
    cin = x.shape[-1]
    assert cin % groups == 0 and features % groups == 0, (cin, features, groups)
    fan_in = kh * kw * cin // groups
    w = ctx.param(f"{n}/w", (kh, kw, cin // groups, features), "normal", math.sqrt(gain / fan_in))
    y = lax.conv_general_dilated(x, w, window_strides=_pair(stride), padding=_padding(padding),
                                 dimension_numbers=DIMS, feature_group_count=groups)
    if bias:
        y = y + ctx.param(f"{n}/b", (features,), "bn_shift", 1.0)
    return y


def batch_norm(ctx: Context, x, scale: float = 1.0, name: str = "bn"):
    """Inference batch norm folded into a per-channel scale and shift."""
    n = ctx.unique(name)
    c = x.shape[-1]
    return x * ctx.param(f"{n}/scale", (c,), "bn_scale", scale) + ctx.param(f"{n}/shift", (c,), "bn_shift", 1.0)


def conv_bn(ctx: Context, x, features: int, kernel, stride: int = 1, padding: Padding = "SAME",
            groups: int = 1, act: Optional[Callable] = None, bn_scale: float = 1.0):
    y = batch_norm(ctx, conv(ctx, x, features, kernel, stride, padding, groups), scale=bn_scale)
    return act(y) if act is not None else y


def depthwise(ctx: Context, x, kernel, stride: int = 1, padding: Padding = "SAME"):
    c = x.shape[-1]
    return conv(ctx, x, c, kernel, stride, padding, groups=c, name="dwconv")


def separable_conv(ctx: Context, x, features: int, kernel, stride: int = 1, padding: Padding = "SAME"):
    """Depthwise k×k (depth multiplier 1) then pointwise 1×1, no bias."""
    return conv(ctx, depthwise(ctx, x, kernel, stride, padding), features, 1, name="pwconv")


def relu(x):
    return jnp.maximum(x, 0)


def relu6(x):
    return jnp.clip(x, 0, 6)


def sigmoid(x):
    return jax.nn.sigmoid(x)


def swish(x):
    return x * jax.nn.sigmoid(x)


def max_pool(x, window: int, stride: int, padding: Padding = "VALID"):
    init = np.array(-np.inf, x.dtype)  # a concrete identity: lax picks reduce_window_max
    return lax.reduce_window(x, init, lax.max, (1, window, window, 1), (1, stride, stride, 1),
                             _window_padding(padding))


def avg_pool(x, window: int, stride: int, padding: Padding = "VALID", count_include_pad: bool = True):
    """Average pooling. With padding, `count_include_pad=True` divides by the full window
    (PyTorch's default); False divides by the in-bounds count (TensorFlow's SAME pool)."""
    zero = np.array(0, x.dtype)  # concrete: reduce_window_sum
    pad = _window_padding(padding, x.shape, window, stride)
    total = lax.reduce_window(x, zero, lax.add, (1, window, window, 1), (1, stride, stride, 1), pad)
    if count_include_pad or pad == "VALID":
        return total / np.asarray(window * window, dtype=x.dtype)
    (h_lo, _), (w_lo, _) = pad[1], pad[2]
    counts = np.outer(_window_counts(x.shape[1], total.shape[1], window, stride, h_lo),
                      _window_counts(x.shape[2], total.shape[2], window, stride, w_lo))
    # shapes only: a constant at trace time
    return total / jnp.asarray(counts[None, :, :, None], dtype=x.dtype)


def _window_counts(n: int, out: int, window: int, stride: int, lo: int) -> np.ndarray:
    """In-bounds elements of each pooling window along one dimension."""
    start = np.arange(out) * stride - lo
    return (np.minimum(start + window, n) - np.maximum(start, 0)).astype(np.float32)


def _window_padding(padding: Padding, shape=None, window: int = 1, stride: int = 1):
    p = _padding(padding)
    if isinstance(p, str):
        if p == "VALID" or shape is None:
            return p
        p = tuple(_same_pads(n, window, stride) for n in shape[1:3])  # TensorFlow's SAME
    return ((0, 0),) + tuple(p) + ((0, 0),)


def _same_pads(n: int, window: int, stride: int) -> tuple[int, int]:
    out = -(-n // stride)
    total = max((out - 1) * stride + window - n, 0)
    return (total // 2, total - total // 2)


def global_avg_pool(x):
    return jnp.mean(x, axis=(1, 2))


def make_divisible(v: float, divisor: int = 8, min_value: Optional[int] = None) -> int:
    """Round channels to a multiple of `divisor`, not below 90% of `v` (MobileNet rule)."""
    min_value = min_value or divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return int(new_v)
