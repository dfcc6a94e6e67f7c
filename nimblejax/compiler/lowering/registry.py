"""One registry: primitive name → lowering rule.

Rule kinds, and the signature of their `fn`:
- "elementwise": fusible; `fn(builder: KernelBuilder, node, idx: Index) -> str`, the C
  value of the node's output at one multi-index inside any fused kernel (called by
  codegen.py's `KernelBuilder.value`; index-only ops such as broadcast, transpose and
  reshape are fusible too: they only rewrite the index).
- "reduction": `fn(dtype) -> Reducer` (rules_reduce.py: combine, init, accumulator
  type); producers are fused into the reduction's loop (codegen.reduction_kernel).
- "kernel": a standalone generated kernel; `fn(node) -> Kernel`. A kernel rule registered
  with `fuses=(positions...)` also takes elementwise producers of those operands:
  fusion.py inlines them into its group and the rule is called as `fn(node, inlined)`
  (value → the inlined node that computes it), computing them where it reads them (a
  scatter's operand, indices and updates); with `cheap_fuses` (True, or a predicate of
  the node) only where every elementwise producer it would take is cheap (fusion_costs.py: a
  convolution kernel that reads each input element once per window position). One registered with `in_place=k` may compute
  its output in the bytes of operand k when it is that value's only reader and the value
  is a buffer of the plan's own (fusion.py decides, `Group.in_place`): it is then called
  with `in_place=True` and must not read operand k's old bytes except where it writes.
- "gemm": `fn(node, small_gemm=True) -> GemmCall` (cuBLAS on the GPU), or a `Kernel`
  for integer types and, with `small_gemm` (Options.small_gemm), small-M float GEMMs
  (gemm_small.py).
- "cudnn": `fn(node) -> ConvCall` (a cuDNN convolution on the GPU).

A rule registered with `accepts=fn(node) -> reason or None` takes only some nodes of its
primitive (rules_linalg.py: small float32 matrices); check_supported raises with that
reason for the others, so co-execution leaves them to XLA and `explain` says why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from nimblejax.compiler.errors import UnsupportedPrimitiveError  # noqa: F401 (re-exported)
from nimblejax.compiler.ir import Node
from nimblejax.compiler.kinds import RuleKind


@dataclass(frozen=True)
class Rule:
    kind: RuleKind
    fn: Callable
    fuses: tuple[int, ...] = ()  # kernel rules: operands whose producers may be inlined
    in_place: Optional[int] = None  # kernel rules: the operand the output may update
    # kernel rules that read each element of a fused operand many times (a convolution's
    # window): producers are fused only where all of them are cheap (fusion_costs.py); a
    # predicate of the node where that depends on the kernel the node gets
    cheap_fuses: bool | Callable[[Node], bool] = False
    # Why the rule does not take a node of its primitive (a shape or dtype it has no
    # kernel for), or None when it does; not taken, the node is unsupported (XLA's).
    accepts: Optional[Callable[[Node], Optional[str]]] = None


RULES: dict[str, Rule] = {}


def register(*names: str, kind: RuleKind | str, fuses: tuple[int, ...] = (),
             in_place: Optional[int] = None,
             accepts: Optional[Callable[[Node], Optional[str]]] = None,
             cheap_fuses: bool | Callable[[Node], bool] = False) -> Callable:
    kind = RuleKind(kind)  # a misspelt kind fails here, at import
    if (fuses or in_place is not None) and kind is not RuleKind.KERNEL:
        raise ValueError(f"fuses/in_place are for kernel rules, not {kind} ({names})")

    def deco(fn: Callable) -> Callable:
        for n in names:
            RULES[n] = Rule(kind, fn, tuple(fuses), in_place, cheap_fuses=cheap_fuses, accepts=accepts)
        return fn

    return deco


def only_cheap_fuses(rule: Rule, node: Node) -> bool:
    """`rule` fuses only cheap producers into `node` (Rule.cheap_fuses)."""
    return rule.cheap_fuses(node) if callable(rule.cheap_fuses) else rule.cheap_fuses


def rule_for(node: Node) -> Rule:
    rule = RULES.get(node.name)
    if rule is None:
        from nimblejax.compiler.unsupported import reason  # why it is not supported, if known

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
            rule = rule_for(node)
            why = rule.accepts(node) if rule.accepts is not None else None
            if why is not None:
                raise UnsupportedPrimitiveError(
                    f"nimblejax does not lower this '{node.name}' (from {node.source}): {why}. "
                    f"Use nimble.jit(..., backend=\"jax\") to run this function with plain jax.jit.")
    for node in nodes:
        for v in list(node.inputs) + list(node.outputs):
            if not dtypes.is_supported(v.dtype):
                raise UnsupportedPrimitiveError(
                    f"nimblejax does not support dtype {v.dtype} in '{node.name}' "
                    f"(from {node.source}). Use nimble.jit(..., backend=\"jax\").")
