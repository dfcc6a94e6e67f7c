"""CUDA C code generation: a builder that computes fused values at an index, and the
kernel templates (elementwise loop, reduction) every fused kernel comes from.

Shapes are compile-time constants baked into the source, so a kernel's only
arguments are buffer pointers, which makes it trivial to freeze into a CUDA graph.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable, Mapping, Optional, Sequence

from nimblejax.compiler.ir import Atom, Literal, Node, Var, short_dtype
from nimblejax.compiler import dtypes
from nimblejax.compiler.lowering.task import Kernel
from nimblejax.compiler.lowering.xla_math import helpers_for

PRELUDE = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"
BLOCK = 256
MAX_BLOCKS = 65535 * 16  # grid-stride loops cover the rest

Index = tuple[str, ...]


class KernelBuilder:
    """Collects parameters and SSA lines of one kernel body."""

    def __init__(self, inlined: Mapping[Var, Node] = {}, hoist: bool = False) -> None:
        self.inlined = dict(inlined)
        # With `hoist`, a slice that picks one index of an axis (an unrolled loop's step t)
        # reads it from a kernel argument: (slice output, axis) -> (C name, value).
        self.hoist = hoist
        self.scalars: dict[tuple, tuple[str, int]] = {}
        self.inputs: dict[Var, str] = {}
        self.outputs: dict[Var, str] = {}
        self.lines: list[str] = []
        self.memo: dict[tuple, str] = {}
        self.count = 0
        self.depth = 1
        self.ops: list[str] = []
        # (index, shape) -> the C name of its row-major linear offset, where one is
        # known: a reshape of the loop's own index then reads `in[i]`, with no divisions.
        self.flat: dict[tuple[Index, tuple[int, ...]], str] = {}

    # ---- parameters and lines ---------------------------------------------------
    def input(self, var: Var) -> str:
        if var not in self.inputs:
            self.inputs[var] = f"in{len(self.inputs)}"
        return self.inputs[var]

    def output(self, var: Var) -> str:
        if var not in self.outputs:
            self.outputs[var] = f"out{len(self.outputs)}"
        return self.outputs[var]

    def picked_index(self, node: Node, axis: int, value: int) -> str:
        """The C text of slice `node`'s start on an axis it keeps one index of: the
        literal, or with `hoist` a `long long` argument, so that kernels differing only
        in that index (the steps of an unrolled loop) share one source."""
        key = (node.outputs[0], axis)
        if not self.hoist or node.inputs[0].shape[axis] == 1:
            return str(value)
        if key not in self.scalars:
            self.scalars[key] = (f"s{len(self.scalars)}", value)
        return self.scalars[key][0]

    def scalar_values(self) -> tuple[int, ...]:
        return tuple(v for _, v in self.scalars.values())

    def scalar_params(self) -> list[str]:
        """The scalars' parameter declarations, after the inputs'."""
        return [f"const long long {n}" for n, _ in self.scalars.values()]

    def emit(self, line: str) -> None:
        self.lines.append("  " * self.depth + line)

    def tmp(self, ctype: str, expr: str) -> str:
        name = f"v{self.count}"
        self.count += 1
        self.emit(f"{ctype} {name} = {expr};")
        return name

    def open(self, header: str) -> None:
        self.emit(header + " {")
        self.depth += 1

    def close(self) -> None:
        self.depth -= 1
        self.emit("}")

    def forget(self) -> None:
        """Drop memoized values (they were defined in a scope that just closed)."""
        self.memo.clear()
        self.flat.clear()

    # ---- values -----------------------------------------------------------------
    def value(self, atom: Atom, idx: Index) -> str:
        """C name (or literal) of `atom` at multi-index `idx`, in its compute type."""
        if isinstance(atom, Literal):
            return dtypes.literal(atom.value, atom.dtype)
        idx = operand_index(atom, idx)
        key = (atom.id, idx)
        if key in self.memo:
            return self.memo[key]
        node = self.inlined.get(atom)
        if node is None:
            name = self.tmp(dtypes.compute_type(atom.dtype), self.load(atom, idx))
        else:
            from nimblejax.compiler.lowering.registry import rule_for

            name = rule_for(node).fn(self, node, idx)
            self.ops.append(node.name)  # after its operands: names read in compute order
        self.memo[key] = name
        return name

    def load(self, var: Var, idx: Index) -> str:
        return dtypes.load(var.dtype, f"{self.input(var)}[{self.linear(idx, var.shape)}]")

    def linear(self, idx: Index, shape: Sequence[int]) -> str:
        """Row-major offset of `idx` in `shape`: a known name, or the sum of strides."""
        return self.flat.get((tuple(idx), tuple(shape))) or linear(idx, shape)

    def store(self, var: Var, offset: str, value: str) -> None:
        self.emit(f"{self.output(var)}[{offset}] = {dtypes.store(var.dtype, value)};")

    def index_vars(self, linear_name: str, shape: Sequence[int]) -> Index:
        """Declare per-dimension indices of `linear_name` over row-major `shape`."""
        idx = []
        stride = 1
        strides = []
        for d in reversed(shape):
            strides.append(stride)
            stride *= d
        strides.reverse()
        for d, (size, st) in enumerate(zip(shape, strides)):
            if size == 1:
                idx.append("0")
                continue
            expr = linear_name if st == 1 else f"({linear_name} / {st})"
            if d > 0:
                expr = f"({expr} % {size})"
            idx.append(self.tmp("int", expr) if expr != linear_name else f"(int){linear_name}")
        self.flat[(tuple(idx), tuple(shape))] = linear_name
        return tuple(idx)

    # ---- kernel text ------------------------------------------------------------
    def params(self) -> tuple[Var, ...]:
        return tuple(self.outputs) + tuple(self.inputs)

    def input_params(self) -> list[str]:
        """The inputs' parameter declarations, in order."""
        return [f"const {dtypes.storage_type(v.dtype)}* __restrict__ {n}" for v, n in self.inputs.items()]

    def signature(self, name: str) -> str:
        args = [f"{dtypes.storage_type(v.dtype)}* __restrict__ {n}" for v, n in self.outputs.items()]
        return f'extern "C" __global__ void {name}({", ".join(args + self.input_params() + self.scalar_params())})'

    def text(self, prelude: str = "") -> str:
        """The kernel's text without PRELUDE, named NAME."""
        body = "\n".join(self.lines)
        return f"{prelude}{self.signature('NAME')} {{\n{body}\n}}\n"

    def finish(self, kind: str, result: Var, grid: int, block: int, prelude: str = "") -> Kernel:
        text = self.text(prelude)
        name = kernel_name(kind, self.ops, result.dtype, text)
        source = with_prelude(text.replace("NAME", name, 1))
        return Kernel(name, source, (grid, 1, 1), (block, 1, 1), self.params(), scalars=self.scalar_values())


def with_prelude(source: str) -> str:
    """A kernel's whole source: the headers, the XLA math helpers it calls, `source`."""
    return PRELUDE + helpers_for(source) + source


def kernel_name(kind: str, ops: Sequence[str], dtype, text: str) -> str:
    """Readable, unique: nimble_fused_tanh_add_f32_3a9c."""
    seen: list[str] = []
    for op in ops:
        short = op.replace("_", "")
        if short not in seen and op not in INDEX_ONLY:
            seen.append(short)
    parts = [kind] + seen[:4] + [short_dtype(dtype)]
    digest = hashlib.sha1(text.encode()).hexdigest()[:4]
    return "nimble_" + "_".join(parts) + "_" + digest


INDEX_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze",
                        "transpose", "slice", "rev", "convert_element_type"})


def operand_index(atom: Atom, idx: Index) -> Index:
    """The index an operand is read at for an output index `idx`: none for a scalar, 0
    along size-1 axes (newer JAX lets `add` take f32[16,64] and f32[1,64]: an operand
    broadcast without a broadcast_in_dim)."""
    if atom.ndim == 0:
        return ()
    if 1 in atom.shape and len(idx) == atom.ndim:
        return tuple("0" if n == 1 else i for n, i in zip(atom.shape, idx))
    return tuple(idx)


def linear(idx: Index, shape: Sequence[int]) -> str:
    """Row-major linear offset of `idx` in `shape`, dropping zero terms."""
    terms = []
    stride = 1
    for i, size in zip(reversed(idx), reversed(shape)):
        if i != "0" and size != 1:
            terms.append(i if stride == 1 else f"{i} * {stride}")
        stride *= size
    if not terms:
        return "0"
    wide = stride >= 2 ** 31
    return " + ".join(f"(long long){t}" if wide else t for t in reversed(terms))


def interleave(ndim: int, kept, kept_idx: Index, axes, red_idx: Index) -> Index:
    """The operand index of a reduction from its kept and its reduced indices."""
    full = [""] * ndim
    for d, i in zip(kept, kept_idx):
        full[d] = i
    for d, i in zip(axes, red_idx):
        full[d] = i
    return tuple(full)


def dilated_source(pos: str, dilation: int, size: int) -> tuple[str, list[str]]:
    """Index into an operand of `size` elements of position `pos` in its padded,
    `dilation`-dilated form, and the conditions for it to be a real element (not
    padding, not a hole between dilated elements)."""
    conds = [f"{pos} >= 0"]
    if dilation > 1:
        conds.append(f"{pos} % {dilation} == 0")
        pos = f"({pos} / {dilation})"
    conds.append(f"{pos} < {size}")
    return pos, conds


def blocks_for(n: int, block: int = BLOCK) -> int:
    return max(1, min((n + block - 1) // block, MAX_BLOCKS))


# ---- templates ----------------------------------------------------------------------
def loop_kernel(kind: str, out: Var, ops: Sequence[str], body: Callable[[KernelBuilder, Index], str],
                inlined: Mapping[Var, Node] = {}, unroll: int = 1,
                index_shape: Optional[Sequence[int]] = None) -> Kernel:
    """One thread per output element (a grid-stride loop); `body` returns its value.
    With `unroll` > 1 a thread computes that many elements a block apart before it
    stores any, so their loads are in flight together (one load per thread at a time
    leaves an H200 at half its memory bandwidth); a plain loop finishes the tail.
    `index_shape`: the shape body's index is over, where `out` is a reshape of it (the
    same elements in the same order); out's own by default."""
    b = KernelBuilder(inlined, hoist=True)
    b.ops = list(ops)
    return b.finish(kind, out, loop_body(b, out, body, unroll, index_shape), BLOCK)


def loop_body(b: KernelBuilder, out: Var, body: Callable[[KernelBuilder, Index], str],
              unroll: int = 1, index_shape: Optional[Sequence[int]] = None) -> int:
    """loop_kernel's loop, emitted into `b`; returns its grid size."""
    n = out.size
    shape = tuple(index_shape) if index_shape is not None else out.shape
    assert math.prod(shape) == n, (shape, out.shape)
    itype = "long long" if n >= 2 ** 30 else "int"  # i + a grid's stride stays in range
    if unroll > 1:
        step = unroll * BLOCK
        b.open(f"for ({itype} i0 = ({itype})blockIdx.x * {step} + threadIdx.x; i0 < {n}; "
               f"i0 += ({itype})gridDim.x * {step})")
        b.open(f"if (i0 + {(unroll - 1) * BLOCK} < {n})")
        values = []
        for k in range(unroll):
            name = b.tmp(f"const {itype}", f"i0 + {k * BLOCK}" if k else "i0")
            values.append((name, body(b, b.index_vars(name, shape))))
        for name, value in values:
            b.store(out, name, value)
        b.close()
        b.forget()
        b.open("else")
        b.open(f"for ({itype} i = i0; i < {n}; i += {BLOCK})")
    else:
        b.open(f"for ({itype} i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < {n}; "
               f"i += (long long)gridDim.x * blockDim.x)")
    idx = b.index_vars("i", shape)
    b.store(out, "i", body(b, idx))
    while b.depth > 1:
        b.close()
    return blocks_for(-(-n // unroll))


# ---- a loop kernel's post group (fusion_conv_post.py) --------------------------------------
def post_value(b: KernelBuilder, post, out: Var, idx: Index, value: str) -> str:
    """The C value, at `idx` of `out`'s shape, of the elementwise group `post` that reads
    `out` at its own element, with `value` (out's value there, in its compute type) in
    place of a read of `out`: rounded as it would have been stored. Before a reshape that
    ends the group (the 2-D layout a GEMM reads next), the kernel writing the reshaped
    output at the same offset (loop_kernel's index_shape)."""
    b.memo[(out.id, operand_index(out, idx))] = b.tmp(dtypes.compute_type(out.dtype),
                                                      dtypes.round_to(out.dtype, value))
    root = post.root
    before = root.inputs[0] if root.name == "reshape" and root.params.get("dimensions") is None else post.output
    return b.value(before, idx)


def loop_kernel_with_post(kind: str, out: Var, ops: Sequence[str], body: Callable[[KernelBuilder, Index], str],
                          inlined: Mapping[Var, Node] = {}, post=None, unroll: int = 1) -> Kernel:
    """loop_kernel over `out`'s elements, writing `out`, or with a post group (whose value
    `body` returns through post_value) the post group's output."""
    if post is None:
        return loop_kernel(kind, out, ops, body, inlined, unroll)
    inlined = {**inlined, **{n.outputs[0]: n for n in post.nodes}}
    return loop_kernel(kind, post.output, ops, body, inlined, unroll, index_shape=out.shape)


def unroll_for(out: Var) -> int:
    """How many elements a thread of a gather-like loop kernel over `out` computes before
    it stores any (loop_kernel's `unroll`): UNROLL from UNROLL_MIN elements on, as the
    fused elementwise kernels do."""
    return UNROLL if out.size >= UNROLL_MIN else 1


# Fused kernels (and gather-like loop kernels: unroll_for) of at least this many elements
# compute UNROLL of them per thread.
UNROLL, UNROLL_MIN = 4, 1 << 16


def elementwise_kernel(root: Var, inlined: Mapping[Var, Node], extra: Sequence[Var] = ()) -> Kernel:
    """One thread per element of `root`; every inlined producer is recomputed there.
    `extra`: inlined values of root's shape, computed at root's own index (fusion's
    _fused_output_target), that the kernel writes too, at the same offset."""
    unroll = UNROLL if root.size >= UNROLL_MIN else 1

    def body(b: KernelBuilder, idx: Index) -> str:
        value = b.value(root, idx)
        for v in extra:
            b.store(v, b.linear(idx, root.shape), b.value(v, idx))
        return value

    return loop_kernel("fused", root, [], body, inlined, unroll)


def reduction_kernel(node: Node, inlined: Mapping[Var, Node], combine: str, init: str,
                     acc_type: str, siblings: Sequence[Node] = ()) -> Kernel:
    """Row reductions (the innermost axis is reduced): one warp, or one 256-thread block
    for long rows, per output. Column reductions (the innermost axis is kept, as in
    batch-norm statistics or a global average pool over H, W): column_reduction_kernel,
    which also computes `siblings` (fusion_siblings.py) in the same loop."""
    x, out, axes = node.inputs[0], node.outputs[0], tuple(sorted(node.params["axes"]))
    if x.ndim and (x.ndim - 1) not in axes:
        return column_reduction_kernel(node, inlined, combine, init, acc_type, siblings)
    assert not siblings, "sibling reductions are column reductions"
    n_out, n_red = out.size, _reduced_size(node)
    per_out = 256 if (n_red >= 4096 and n_out < 2048) else 32
    b = KernelBuilder(inlined)
    b.emit(f"const int lane = threadIdx.x % {per_out};")
    b.emit(f"const long long o = (long long)blockIdx.x * {BLOCK // per_out} + threadIdx.x / {per_out};")
    # Whole warps (or whole blocks) leave together, so the shuffles below stay converged.
    b.emit(f"if (o >= {n_out}) return;")
    out_idx = _output_index(b, node)
    b.emit(f"{acc_type} acc = {init};")
    _accumulate(b, (node,), ("acc",), out_idx, combine, "lane", per_out)
    b.forget()
    b.emit(f"for (int off = 16; off > 0; off >>= 1) {{ {acc_type} other = "
           f"__shfl_down_sync(0xffffffffu, acc, off); acc = {combine.format(a='acc', b='other')}; }}")
    if per_out > 32:
        b.emit(f"__shared__ {acc_type} partial[{per_out // 32}];")
        b.emit("if (lane % 32 == 0) partial[lane / 32] = acc;")
        b.emit("__syncthreads();")
        b.open("if (lane == 0)")
        b.emit(f"for (int w = 1; w < {per_out // 32}; ++w) {{ {acc_type} other = partial[w]; "
               f"acc = {combine.format(a='acc', b='other')}; }}")
        b.close()
    b.open("if (lane == 0)")
    b.store(out, "o", _cast_acc(acc_type, out.dtype))
    b.close()
    b.ops.append(node.name)
    return b.finish("reduce", out, blocks_for(n_out * per_out), BLOCK)


def column_reduction_kernel(node: Node, inlined: Mapping[Var, Node], combine: str, init: str,
                            acc_type: str, siblings: Sequence[Node] = ()) -> Kernel:
    """A block per 32 neighbouring outputs (they differ in the innermost axis, so a warp
    reads 32 neighbouring elements): its 8 warps share the reduced elements, then add
    up through shared memory. split.py first cuts long columns into a first stage with
    enough outputs to fill the GPU. `siblings`: reductions of the same shape whose sums
    the same loop computes beside node's, one accumulator and output each (the values
    they read at an index are loaded once)."""
    roots = (*siblings, node)
    out = node.outputs[0]
    n_out = out.size
    tx = min(32, 1 << max(0, (n_out - 1).bit_length()))
    ty = BLOCK // tx
    b = KernelBuilder(inlined)
    b.emit(f"const int tx = threadIdx.x % {tx}, ty = threadIdx.x / {tx};")
    b.emit(f"const long long o = (long long)blockIdx.x * {tx} + tx;")
    accs = [f"acc{k}" if siblings else "acc" for k in range(len(roots))]
    for acc in accs:
        b.emit(f"{acc_type} {acc} = {init};")
    # No early return: every thread reaches the __syncthreads below.
    b.open(f"if (o < {n_out})")
    _accumulate(b, roots, accs, _output_index(b, node), combine, "ty", ty)
    b.close()
    b.forget()
    tiles = [f"partial{k}" if siblings else "partial" for k in range(len(roots))]
    for acc, tile in zip(accs, tiles):
        b.emit(f"__shared__ {acc_type} {tile}[{ty}][{tx + 1}];")
        b.emit(f"{tile}[ty][tx] = {acc};")
    b.emit("__syncthreads();")
    b.open(f"if (ty == 0 && o < {n_out})")
    for root, acc, tile in zip(roots, accs, tiles):
        b.emit(f"for (int w = 1; w < {ty}; ++w) {{ {acc_type} other = {tile}[w][tx]; "
               f"{acc} = {combine.format(a=acc, b='other')}; }}")
        b.store(root.outputs[0], "o", _cast_acc(acc_type, root.outputs[0].dtype, acc))
    b.close()
    b.ops.append(node.name)
    return b.finish("reduce", out, -(-n_out // tx), BLOCK)


def _reduced_size(node: Node) -> int:
    x = node.inputs[0]
    return max(1, _prod(x.shape[a] for a in node.params["axes"]))


def _kept_axes(node: Node) -> tuple[tuple[int, ...], list[int]]:
    x = node.inputs[0]
    axes = tuple(sorted(node.params["axes"]))
    return axes, [d for d in range(x.ndim) if d not in axes]


def _output_index(b: KernelBuilder, node: Node) -> Index:
    """The kept axes' indices of output `o` (a name the kernel has declared)."""
    x = node.inputs[0]
    return b.index_vars("o", [x.shape[d] for d in _kept_axes(node)[1]])


def _accumulate(b: KernelBuilder, nodes: Sequence[Node], accs: Sequence[str], out_idx: Index,
                combine: str, start: str, step: int) -> None:
    """`acc_k = combine(acc_k, x_k[out_idx, r])` for r = start, start + step, … over the
    reduced elements, for reductions `nodes` of one shape (their values at an index
    computed in one scope, so what they share is loaded once)."""
    x = nodes[0].inputs[0]
    axes, kept = _kept_axes(nodes[0])
    b.open(f"for (long long r = {start}; r < {_reduced_size(nodes[0])}; r += {step})")
    red_idx = b.index_vars("r", [x.shape[a] for a in axes])
    idx = interleave(x.ndim, kept, out_idx, axes, red_idx)
    for node, acc in zip(nodes, accs):
        v = b.value(node.inputs[0], idx)
        b.emit(f"{acc} = {combine.format(a=acc, b=v)};")
    b.close()


def _cast_acc(acc_type: str, dtype, acc: str = "acc") -> str:
    ctype = dtypes.compute_type(dtype)
    return acc if ctype == acc_type else f"({ctype}){acc}"


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p
