"""Reductions. Each returns (combine template, identity, accumulator C type) for a dtype;
codegen.reduction_kernel fuses the operand's elementwise producers into the loop."""
from __future__ import annotations

from dataclasses import dataclass

from nimblejax.compiler import dtypes
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.elementwise import _FMAX, _FMIN
from nimblejax.compiler.lowering.registry import register


@dataclass(frozen=True)
class Reducer:
    combine: str
    init: str
    acc_type: str


def _acc_type(dtype) -> str:
    # Halves accumulate in float (as XLA does); bool accumulates in int because warp
    # shuffles do not take bool.
    return "int" if dtypes.name(dtype) == "bool" else dtypes.compute_type(dtype)


@register("reduce_sum", kind=RuleKind.REDUCTION)
def reduce_sum(dtype) -> Reducer:
    return Reducer("({a} + {b})", dtypes.literal(0, dtype), _acc_type(dtype))


@register("reduce_prod", kind=RuleKind.REDUCTION)
def reduce_prod(dtype) -> Reducer:
    return Reducer("({a} * {b})", dtypes.literal(1, dtype), _acc_type(dtype))


def _extremum(dtype, largest: bool) -> Reducer:
    if dtypes.is_float(dtype):  # NaN-propagating, as XLA's max/min
        return Reducer(_FMAX if largest else _FMIN, (dtypes.lowest if largest else dtypes.highest)(dtype),
                       "float")
    if dtypes.name(dtype) == "bool":
        return Reducer("({a} || {b})", "0", "int") if largest else Reducer("({a} && {b})", "1", "int")
    return Reducer("max({a}, {b})" if largest else "min({a}, {b})",
                   (dtypes.lowest if largest else dtypes.highest)(dtype), _acc_type(dtype))


@register("reduce_max", kind=RuleKind.REDUCTION)
def reduce_max(dtype) -> Reducer:
    return _extremum(dtype, largest=True)


@register("reduce_min", kind=RuleKind.REDUCTION)
def reduce_min(dtype) -> Reducer:
    return _extremum(dtype, largest=False)


@register("reduce_or", kind=RuleKind.REDUCTION)
def reduce_or(dtype) -> Reducer:
    if dtypes.name(dtype) == "bool":
        return Reducer("({a} || {b})", "0", "int")
    return Reducer("({a} | {b})", "0", _acc_type(dtype))


@register("reduce_and", kind=RuleKind.REDUCTION)
def reduce_and(dtype) -> Reducer:
    if dtypes.name(dtype) == "bool":
        return Reducer("({a} && {b})", "1", "int")
    return Reducer("({a} & {b})", "(~0)", _acc_type(dtype))


@register("reduce_xor", kind=RuleKind.REDUCTION)
def reduce_xor(dtype) -> Reducer:
    # Bool accumulates 0/1 in an int, where ^ is the parity; sign-extended 8- and 16-bit
    # integers stay sign-extended under ^.
    return Reducer("({a} ^ {b})", "0", _acc_type(dtype))
