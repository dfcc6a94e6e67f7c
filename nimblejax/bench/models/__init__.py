"""Benchmark models: name → ModelSpec.

Each model is written once as ``forward(cfg, ctx, x)`` (see layers.py) and exposed as a
pure function ``fn(params, x)``, params being a flat dict name → array:

    spec = MODELS["resnet50"]
    fn, (params, x) = spec.build(batch=32, dtype=jnp.float32, rng=np.random.default_rng(0))
    fn, (params, x) = spec.build(2, tiny=True)          # the small test configuration
    fn, (aparams, ax) = spec.abstract(32)                # ShapeDtypeStructs, no weights
    spec.param_count()                                   # from shapes only
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from nimblejax.bench.models import (bert, efficientnet, gpt, inception_v3, layers, lstm, mlp,
                                    mobilenet_v2, nasnet, resnet)


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model. ``build(batch, dtype, rng) -> (fn, (params, x))`` with random
    weights at the published size; ``tiny=True`` (or ``config=``) picks a small one."""

    name: str
    build: Callable[..., tuple]
    description: str
    module: Optional[ModuleType] = field(default=None, repr=False)
    abstract: Optional[Callable[..., tuple]] = field(default=None, repr=False)

    def config(self, tiny: bool = False) -> Any:
        return self.module.TINY if tiny else self.module.FULL

    def specs(self, batch: int = 1, dtype: Any = jnp.float32, tiny: bool = False, config: Any = None):
        """(name → layers.ParamSpec, output ShapeDtypeStruct), by abstract tracing."""
        cfg = config if config is not None else self.config(tiny)
        x = jax.ShapeDtypeStruct(self.module.input_shape(cfg, batch), jnp.dtype(dtype))
        return _specs(self.module, cfg, x)

    def param_count(self, tiny: bool = False, config: Any = None) -> int:
        return layers.count_params(self.specs(1, tiny=tiny, config=config)[0])

    def output_shape(self, batch: int = 1, tiny: bool = False, config: Any = None) -> tuple:
        return tuple(self.specs(batch, tiny=tiny, config=config)[1].shape)


def _specs(module: ModuleType, cfg: Any, x: jax.ShapeDtypeStruct):
    return layers.param_specs(lambda ctx, v: module.forward(cfg, ctx, v), x)


def _model_fn(module: ModuleType, cfg: Any) -> Callable:
    def forward(ctx, x):
        return module.forward(cfg, ctx, x)

    fn = layers.bind(forward)
    fn.__name__ = fn.__qualname__ = f"{module.__name__.rsplit('.', 1)[-1]}_forward"
    return fn


def _from_module(name: str, module: ModuleType, description: str) -> ModelSpec:
    def pick(tiny: bool, config: Any) -> Any:
        return config if config is not None else (module.TINY if tiny else module.FULL)

    def build(batch: int, dtype: Any = jnp.float32, rng: Optional[np.random.Generator] = None,
              *, tiny: bool = False, config: Any = None) -> tuple:
        cfg = pick(tiny, config)
        rng = rng if rng is not None else np.random.default_rng(0)
        dtype = jnp.dtype(dtype)
        x_spec = jax.ShapeDtypeStruct(module.input_shape(cfg, batch), dtype)
        specs, _ = _specs(module, cfg, x_spec)
        params = layers.init_params(specs, rng, dtype)
        x = layers.on_device(rng.standard_normal(x_spec.shape, dtype=np.float32), dtype)
        return _model_fn(module, cfg), (params, x)

    def abstract(batch: int, dtype: Any = jnp.float32, *, tiny: bool = False,
                 config: Any = None) -> tuple:
        """(fn, (params, x)) as jax.ShapeDtypeStruct: enough for nimble's planner."""
        cfg = pick(tiny, config)
        dtype = jnp.dtype(dtype)
        x_spec = jax.ShapeDtypeStruct(module.input_shape(cfg, batch), dtype)
        specs, _ = _specs(module, cfg, x_spec)
        return _model_fn(module, cfg), (layers.abstract_params(specs, dtype), x_spec)

    return ModelSpec(name, build, description, module, abstract)


MODELS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    MODELS[spec.name] = spec
    return spec


for _name, _module, _desc in (
        ("mlp", mlp, "branchy MLP: 8 branches × 6 × dense 256 + tanh, summed"),
        ("bert", bert, "BERT-base encoder: 12 layers, hidden 768, 12 heads, seq 128"),
        ("lstm", lstm, "LSTM: 32 unrolled steps, hidden 512"),
        ("resnet50", resnet, "ResNet-50, 224×224"),
        ("mobilenet_v2", mobilenet_v2, "MobileNetV2, 224×224"),
        ("efficientnet_b0", efficientnet, "EfficientNet-B0, 224×224"),
        ("inception_v3", inception_v3, "Inception-v3, 299×299 (no aux head)"),
        ("nasnet_mobile", nasnet, "NASNet-A Mobile (4 @ 1056), 224×224")):
    register(_from_module(_name, _module, _desc))

# The suite: what `--models all` (the default) runs and its geomeans cover.
SUITE = tuple(MODELS)

register(_from_module("gpt", gpt, "GPT-style decoder: 4 pre-LN layers, hidden 512, 8 heads, "
                                  "seq 128, causal jax.nn.dot_product_attention (not in the suite)"))

__all__ = ["MODELS", "SUITE", "ModelSpec", "register", "layers"]
