"""One registry: primitive name → lowering rule.

Rule kinds:
- "elementwise": fusible; `fn(builder, node, idx) -> C value` computes the node's output
  at one index inside any fused kernel (index-only ops such as broadcast, transpose and
  reshape are fusible too: they only rewrite the index).
- "reduction": `fn(dtype) -> Reducer`; producers are fused into the reduction's loop.
- "kernel": a standalone generated kernel; `fn(node) -> Kernel`. A kernel rule registered
  with `fuses=(positions...)` also takes elementwise producers of those operands:
  fusion.py inlines them into its group and the rule is called as `fn(node, inlined)`
  (value → the inlined node that computes it), computing them where it reads them (a
  scatter's operand, indices and updates). One registered with `in_place=k` may compute
  its output in the bytes of operand k when it is that value's only reader and the value
  is a buffer of the plan's own (fusion.py decides, `Group.in_place`): it is then called
  with `in_place=True` and must not read operand k's old bytes except where it writes.
- "gemm": `fn(node) -> GemmCall` (cuBLAS on the GPU).
- "cudnn": `fn(node) -> ConvCall` (a cuDNN convolution on the GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from nimblejax.compiler.ir import Node


@dataclass(frozen=True)
class Rule:
    kind: str
    fn: Callable
    fuses: tuple[int, ...] = ()  # kernel rules: operands whose producers may be inlined
    in_place: Optional[int] = None  # kernel rules: the operand the output may update


RULES: dict[str, Rule] = {}
KINDS = ("elementwise", "reduction", "kernel", "gemm", "cudnn")


def register(*names: str, kind: str, fuses: tuple[int, ...] = (),
             in_place: Optional[int] = None) -> Callable:
    assert kind in KINDS, kind
    assert (not fuses and in_place is None) or kind == "kernel", "only kernel rules"

    def deco(fn: Callable) -> Callable:
        for n in names:
            RULES[n] = Rule(kind, fn, tuple(fuses), in_place)
        return fn

    return deco


class UnsupportedPrimitiveError(NotImplementedError):
    pass


def rule_for(node: Node) -> Rule:
    rule = RULES.get(node.name)
    if rule is None:
        from nimblejax.compiler.support import reason  # why it is not supported, if known

        why = reason(node.name)
        raise UnsupportedPrimitiveError(
            f"nimblejax has no lowering rule for primitive '{node.name}' "
            f"(from {node.source}){f': {why}' if why else ''}. Use "
            f"nimble.jit(..., backend=\"jax\") to run this function with plain jax.jit.")
    return rule


def check_supported(nodes, rewritten: frozenset = frozenset()) -> None:
    """Raise for the first unsupported primitive or dtype, naming the user's line.
    Primitives in `rewritten` need no rule: canonicalization replaces them."""
    from nimblejax.compiler import dtypes

    for node in nodes:
        if node.name not in rewritten:
            rule_for(node)
    for node in nodes:
        for v in list(node.inputs) + list(node.outputs):
            if not dtypes.is_supported(v.dtype):
                raise UnsupportedPrimitiveError(
                    f"nimblejax does not support dtype {v.dtype} in '{node.name}' "
                    f"(from {node.source}). Use nimble.jit(..., backend=\"jax\").")
