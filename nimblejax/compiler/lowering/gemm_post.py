"""The C code of a GEMM's post group (compiler/fusion_gemm_post.py) inside the tensor-core
GEMM kernel's epilogue (gemm_tc.py): the group's output at element (row, col), computed
with the GEMM's value there (`v`, after its own epilogue) in place of a read of the
GEMM's result, and the group's other operands read as its fused kernel would read them
(KernelBuilder, the same code generation)."""
from __future__ import annotations

from dataclasses import dataclass

from nimblejax.compiler import dtypes
from nimblejax.compiler.ir import Var
from nimblejax.compiler.lowering.codegen import KernelBuilder


@dataclass(frozen=True)
class PostCode:
    lines: tuple[str, ...]   # statements ending with the value in `result`
    result: str              # the C name of the group's output at (row, col)
    inputs: tuple[Var, ...]  # the other buffers read, the kernel's last params
    params: tuple[str, ...]  # their declarations (KernelBuilder.input_params)
    output: Var              # what the kernel writes (instead of the GEMM's result)
    ops: tuple[str, ...]


class _Builder(KernelBuilder):
    """A KernelBuilder that reads the GEMM's result as the epilogue's `v`."""

    def __init__(self, inlined, gemm_out: Var) -> None:
        super().__init__(inlined)
        self.gemm_out = gemm_out

    def load(self, var: Var, idx) -> str:
        return "v" if var is self.gemm_out else super().load(var, idx)


def post_code(post, gemm_out: Var) -> PostCode:
    """`post` (a FUSED fusion.Group reading `gemm_out` at its own element, 2-D)."""
    inlined = {n.outputs[0]: n for n in post.nodes}
    b = _Builder(inlined, gemm_out)
    leading = ("0",) * (post.output.ndim - 2)  # axes of size 1 before the matrix
    value = b.value(post.output, (*leading, "row", "col"))
    result = b.tmp("float", dtypes.round_to(post.output.dtype, value))
    lines = tuple(line.strip() for line in b.lines)
    return PostCode(lines, result, tuple(b.inputs), tuple(b.input_params()), post.output, tuple(b.ops))
