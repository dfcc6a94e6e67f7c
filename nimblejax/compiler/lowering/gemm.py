"""dot_general → a cuBLAS GEMM record (float types), the small-M kernel (an RNN's
recurrent GEMM: gemm_small.py says when and why) or a generated kernel (ints).

Operands were put in a GEMM-ready layout before fusion (compiler/canonicalize/dot.py):
contiguous for the generated kernels, read in place with a leading dimension and batch
stride (GemmCall's lda, stride_a, ...) for library GEMMs.
`small_gemm` is Options.small_gemm (NIMBLE_SMALL_GEMM=0 turns the small-M kernel off).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Union

from nimblejax.compiler.canonicalize.dot import (MatrixLayout, compute_mode, dot_sizes,
                                                gemm_layout, is_float_gemm, operand_layouts)
from nimblejax.compiler.ir import Node
from nimblejax.compiler import dtypes
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import BLOCK, KernelBuilder, blocks_for
from nimblejax.compiler.lowering.gemm_gates import gate_code
from nimblejax.compiler.lowering.gemm_small import small_m_matmul, small_tile, takes_small_m
from nimblejax.compiler.lowering.registry import register
from nimblejax.compiler.lowering.task import GemmCall, Kernel

def gemm_sizes(node: Node) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a dot_general."""
    return dot_sizes(node)


def is_small_m_gemm(node: Node) -> bool:
    """Whether a float GEMM fits the small-M kernel's rule (gemm_small.takes_small_m)."""
    layout = gemm_layout(node)
    return (layout is not None and is_float_gemm(node)
            and takes_small_m(*gemm_sizes(node), layout[1], dtypes.name(node.inputs[0].dtype)))


def is_library_gemm(node: Node, small_gemm: bool = True) -> bool:
    """Whether a canonicalized dot_general becomes a GemmCall (else a generated kernel)."""
    return is_float_gemm(node) and not (small_gemm and is_small_m_gemm(node))


@register("dot_general", kind=RuleKind.GEMM)
def dot_general(node: Node, small_gemm: bool = True, post=None, gates: int = 0) -> Union[GemmCall, Kernel]:
    """The GEMM's library call or kernel; the small-M kernel with a gate-sliced `post`
    group of `gates` gates computed in it (fusion_gemm_gates.py), where one is given. A
    library call's post group is lowering's (the tensor-core kernel's: gemm_tc.py)."""
    if is_library_gemm(node, small_gemm):
        return library_gemm(node)
    layout = gemm_layout(node)
    if layout is None:
        raise AssertionError("dot_general must be canonicalized before lowering")
    lhs, rhs = node.inputs
    batch, m, n, k = gemm_sizes(node)
    ta, tb = layout
    if small_gemm and is_small_m_gemm(node):
        code = gate_code(post, node.outputs[0], gates, small_tile(m, n), m) if post is not None else None
        return small_m_matmul(node.outputs[0], lhs, rhs, m, n, k, ta, gates=code)
    assert post is None, "a post group on a GEMM that is neither the small-M nor the tensor-core kernel"
    return naive_matmul(node, batch, m, n, k, ta, tb)


def library_gemm(node: Node) -> GemmCall:
    """A GemmCall reading both operands in place: contiguous where canonicalize_dot left
    them in a GEMM-ready order, else with their strides (MatrixLayout)."""
    lhs, rhs = node.inputs
    out = node.outputs[0]
    batch, m, n, k = gemm_sizes(node)
    dtype, out_dtype = dtypes.name(lhs.dtype), dtypes.name(out.dtype)
    compute = compute_mode(node) if dtype == "float32" else "f32_from_half"
    call = GemmCall(batch, m, n, k, False, False, dtype, compute,
                    out_dtype=out_dtype if out_dtype != dtype else None, a=lhs, b=rhs, c=out)
    contiguous = gemm_layout(node)
    if contiguous is not None:
        return replace(call, trans_a=contiguous[0], trans_b=contiguous[1])
    la, lb = operand_layouts(node)
    if la is None or lb is None:
        raise AssertionError("dot_general must be canonicalized before lowering")
    call = replace(call, trans_a=la.trans, trans_b=lb.trans)
    return with_layout(with_layout(call, "a", la), "b", lb)


def with_layout(call: GemmCall, which: str, layout: MatrixLayout) -> GemmCall:
    """`call` reading (writing) operand `which` with the layout's leading dimension and
    batch stride, each left None where it is the contiguous one (so a contiguous call
    is the same record as before: names and the algorithm cache do not change)."""
    rows, cols = call.stored(which)
    ld = None if layout.ld == cols else layout.ld
    stride = None if call.batch == 1 or layout.stride == rows * cols else layout.stride
    return replace(call, **{f"ld{which}": ld, f"stride_{which}": stride})


def naive_matmul(node: Node, batch: int, m: int, n: int, k: int, ta: bool, tb: bool) -> Kernel:
    """Integer (and mixed) dots: one thread per output, a serial dot product."""
    lhs, rhs = node.inputs
    out = node.outputs[0]
    acc = dtypes.compute_type(out.dtype)
    b = KernelBuilder()
    b.ops = ["dot"]
    b.output(out)
    a_ix = (f"(bb * {m * k} + kk * {m} + i)" if ta else f"(bb * {m * k} + i * {k} + kk)")
    b_ix = (f"(bb * {n * k} + j * {k} + kk)" if tb else f"(bb * {n * k} + kk * {n} + j)")
    b.open(f"for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < {batch * m * n}; "
           f"t += (long long)gridDim.x * blockDim.x)")
    b.emit(f"const long long bb = t / {m * n}; const long long i = (t / {n}) % {m}; "
           f"const long long j = t % {n};")
    b.emit(f"{acc} acc = 0;")
    la = dtypes.load(lhs.dtype, f"{b.input(lhs)}[{a_ix}]")
    lb_ = dtypes.load(rhs.dtype, f"{b.input(rhs)}[{b_ix}]")
    b.emit(f"for (long long kk = 0; kk < {k}; ++kk) acc += ({acc}){la} * ({acc}){lb_};")
    b.store(out, "t", "acc")
    b.close()
    return b.finish("dot", out, blocks_for(batch * m * n), BLOCK)


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p
