"""Reductions before fusion: one rewrite per reduce primitive.

- A reduction over axes of size 1 only keeps every element: it is a reshape (a view, no
  kernel), as XLA's algebraic simplifier makes it. `jax.grad` of a per-channel
  parameter broadcast to (1, 1, 1, C) emits one after each real reduction: ResNet-50's
  train step had about a hundred such one-element "reductions", each a kernel launch.
- Long reductions with few outputs are split in two (split.py).
"""
from __future__ import annotations

import math

from nimblejax.compiler.canonicalize.registry import rewrites
from nimblejax.compiler.canonicalize.replace import replace_with
from nimblejax.compiler.canonicalize.split import SPLITTABLE, split_reduction
from nimblejax.compiler.ir import Node
from nimblejax.options import Options

# Each one's identity combined with one element is that element, bit for bit.
REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
              "reduce_xor")


@rewrites(*REDUCTIONS)
def canonical_reduction(node: Node, options: Options) -> list[Node]:
    x, out = node.inputs[0], node.outputs[0]
    if math.prod(x.shape) == math.prod(out.shape) and x.dtype == out.dtype:
        return replace_with(node, lambda a: a.reshape(out.shape))
    if node.name in SPLITTABLE:
        return split_reduction(node, options)
    return [node]
