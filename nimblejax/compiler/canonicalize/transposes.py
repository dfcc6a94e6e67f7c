"""Transposes before fusion: one that moves only axes of size 1 keeps every element
where it was, so it is a reshape (a view, no kernel), as XLA's simplifier treats it as a
bitcast. `jax.nn.dot_product_attention` emits one after its second einsum at batch 1
((1, 2, 3, 0, 4) on (1, 1, 128, 8, 64)): a copy kernel in every attention layer (GPT
at batch 1: 4 launches of 1.3 µs).
"""
from __future__ import annotations

from nimblejax.compiler.canonicalize.registry import rewrites
from nimblejax.compiler.canonicalize.replace import replace_with
from nimblejax.compiler.ir import Node
from nimblejax.options import Options


def keeps_memory_order(shape: tuple[int, ...], permutation: tuple[int, ...]) -> bool:
    """Whether transposing `shape` by `permutation` leaves the row-major element order
    unchanged: the axes longer than 1 stay in their order."""
    moved = [axis for axis in permutation if shape[axis] != 1]
    return moved == sorted(moved)


@rewrites("transpose")
def canonical_transpose(node: Node, options: Options) -> list[Node]:
    x, out = node.inputs[0], node.outputs[0]
    if keeps_memory_order(tuple(x.shape), tuple(node.params["permutation"])):
        return replace_with(node, lambda a: a.reshape(out.shape))
    return [node]
