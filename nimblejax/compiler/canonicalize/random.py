"""Random-number primitives → the threefry2x32 arithmetic JAX defines for them."""
from __future__ import annotations

from nimblejax.compiler.ir import Node

RANDOM_PRIMITIVES: frozenset[str] = frozenset()


def expand_random(node: Node) -> list[Node]:
    return [node]
