"""The row kernel: a row group (compiler/fusion_rows.py) as one kernel.

A row normalization (softmax, LayerNorm, ...) is a few reductions over each row of x and
an output computed from the row and its reductions. One warp, part of a warp or block
runs one row: each reduction is a pass over the row (a block-stride loop, so rows of any
length work) that recomputes the reduction's operand from the inputs: from registers
where a thread's share of the row fits (RowBuilder: at most MAX_SLOTS elements), else
from global memory (the row was just read: L1 or L2), then a butterfly of warp
shuffles and, for a block, its
warps' partials through shared memory, so every thread of the row ends with the value in
a register; a last pass writes the outputs. Halves accumulate in float (as XLA does).
"""
from __future__ import annotations

import math
from typing import Mapping

from nimblejax.compiler import dtypes
from nimblejax.compiler.ir import Atom, Node, Var
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import BLOCK, Index, KernelBuilder
from nimblejax.compiler.lowering.registry import rule_for
from nimblejax.compiler.lowering.task import Kernel

MAX_THREADS_PER_ROW = 1024
ELEMENTS_PER_THREAD = 8  # per pass: rows get threads until each has about this many
# ... and, where that leaves the GPU short of threads (BERT's 128 LayerNorm rows), more
# of them, up to one per element, until about 8 warps per SM of an H100 (132 SMs) run.
TARGET_THREADS = 1 << 15


# A thread keeps the elements it reads of a row in registers, for the next passes, where
# it has at most this many per pass, and at most CACHED_REGISTERS of them in all.
MAX_SLOTS = 8
CACHED_REGISTERS = 32


class RowBuilder(KernelBuilder):
    """A KernelBuilder that reads the row's reductions from registers: `known` maps each
    reduced value to its C name. (fusion_rows.py made sure that every reader of a
    reduction reads it in its own row, so the index is not needed.)

    With `slots` > 0 each pass visits a thread's elements of the row as `c = lane + j *
    per_row`, j < slots (an unrolled loop), and an input read at the pass's own element
    (`element`: its index and shape, so the offset is o * length + c in every pass) is
    kept in a register array `rowN[j]` the first time a pass reads it; later passes read
    the array. Only reads at the pass's own loop depth are kept: those always happen."""

    def __init__(self, inlined: Mapping[Var, Node], slots: int = 0) -> None:
        super().__init__(inlined)
        self.known: dict[Var, str] = {}
        self.slots = slots
        self.element: tuple[Index, tuple[int, ...], int] | None = None  # idx, shape, depth
        self.cached: dict[Var, str] = {}
        self.uncached: set[Var] = set()
        self.declarations = 0  # where the register arrays are declared: lines[top:]

    def value(self, atom: Atom, idx: Index) -> str:
        if isinstance(atom, Var) and atom in self.known:
            return self.known[atom]
        return super().value(atom, idx)

    def load(self, var: Var, idx: Index) -> str:
        if (not self.slots or self.element is None or var in self.uncached
                or self.element != (tuple(idx), tuple(var.shape), self.depth)):
            return super().load(var, idx)
        if var in self.cached:
            return f"{self.cached[var]}[j]"
        if (len(self.cached) + 1) * self.slots > CACHED_REGISTERS:
            self.uncached.add(var)
            return super().load(var, idx)
        name = self.cached[var] = f"row{len(self.cached)}"
        self.lines.insert(self.declarations, f"  {dtypes.compute_type(var.dtype)} {name}[{self.slots}];"
                          f"  // {var!r}: this thread's elements of row o")
        self.declarations += 1
        return f"({name}[j] = {super().load(var, idx)})"

    def open_pass(self, length: int, per_row: int) -> int:
        """Open the loop over this thread's elements `c` of a row of `length`; returns how
        many scopes to close."""
        if not self.slots:
            self.open(f"for (int c = lane; c < {length}; c += {per_row})")
            return 1
        self.emit("#pragma unroll")
        self.open(f"for (int j = 0; j < {self.slots}; ++j)")
        self.emit(f"const int c = lane + j * {per_row};")
        if length % per_row == 0:
            return 1
        self.open(f"if (c < {length})")
        return 2

    def close_pass(self, scopes: int) -> None:
        self.element = None
        for _ in range(scopes):
            self.close()
        self.forget()


def threads_per_row(n_rows: int, longest: int) -> int:
    """A power of two, up to a block of 1024, so that each thread has a few elements, or
    fewer where there are few rows."""
    want = -(-longest // ELEMENTS_PER_THREAD)
    per_row = min(MAX_THREADS_PER_ROW, 1 << max(0, (want - 1).bit_length()))
    while (n_rows * per_row < TARGET_THREADS and 2 * per_row <= min(longest, MAX_THREADS_PER_ROW)):
        per_row *= 2
    return per_row


def row_kernel(root: Node, nodes: tuple[Node, ...]) -> Kernel:
    """One kernel for a row group: `nodes` in topological order, `root` last."""
    reductions = [n for n in nodes if rule_for(n).kind is RuleKind.REDUCTION]
    out = root.outputs[0]
    n_rows = reductions[0].outputs[0].size
    per_out = out.size // n_rows  # the outputs of one row: its length, or 1
    longest = max([per_out] + [s.inputs[0].size // n_rows for s in reductions])
    per_row = threads_per_row(n_rows, longest)
    block = max(per_row, BLOCK) if per_row <= 32 else per_row
    rows_per_block = block // per_row
    b = RowBuilder({n.outputs[0]: n for n in nodes if n not in reductions},
                   _slots(reductions, n_rows, per_out, per_row))
    b.emit(f"// {n_rows} rows, {per_row} thread(s) per row: "
           + ", ".join(f"{s.name} over {s.inputs[0].size // n_rows}" for s in reductions)
           + f", then {per_out} output(s) per row")
    b.emit(f"const int lane = threadIdx.x % {per_row};")
    b.emit(f"const long long row = (long long)blockIdx.x * {rows_per_block} + threadIdx.x / {per_row};")
    ragged = n_rows % rows_per_block != 0
    if ragged:  # (no early return: every lane of a warp must reach the shuffles)
        b.emit(f"const long long o = row < {n_rows} ? row : {n_rows - 1};  // past the end: redo the last row")
    else:
        b.emit("const long long o = row;")
    b.declarations = len(b.lines)
    for k, reduction in enumerate(reductions):
        b.known[reduction.outputs[0]] = _reduce_row(b, reduction, k, per_row)
    if ragged:
        b.open(f"if (row < {n_rows})")
    _write_row(b, root, per_out, per_row)
    while b.depth > 1:
        b.close()
    b.ops = _name_ops(reductions, b.ops, per_out < longest)
    return b.finish("row", out, -(-n_rows // rows_per_block), block)


def _reduce_row(b: RowBuilder, reduction: Node, k: int, per_row: int) -> str:
    """One pass over row `o` reducing `reduction`'s operand; the result's C name, which every
    thread of the row holds."""
    reducer = rule_for(reduction).fn(reduction.inputs[0].dtype)
    x, out = reduction.inputs[0], reduction.outputs[0]
    acc, acc_type, combine = f"acc{k}", reducer.acc_type, reducer.combine
    length = x.size // out.size
    lead = b.index_vars("o", out.shape)
    b.emit(f"// pass {k}: {reduction.name}")
    b.emit(f"{acc_type} {acc} = {reducer.init};")
    scopes = b.open_pass(length, per_row)
    idx = lead + b.index_vars("c", x.shape[out.ndim:])
    b.element = (idx, tuple(x.shape), b.depth)
    v = b.value(x, idx)
    b.emit(f"{acc} = {combine.format(a=acc, b=v)};")
    b.close_pass(scopes)
    if per_row > 1:  # butterfly: lanes exchange within their aligned group of per_row
        b.emit(f"for (int off = {min(per_row, 32) // 2}; off > 0; off >>= 1) {{ {acc_type} other = "
               f"__shfl_xor_sync(0xffffffffu, {acc}, off); {acc} = {combine.format(a=acc, b='other')}; }}")
    if per_row > 32:  # one row per block: its warps' partials through shared memory
        warps = per_row // 32
        b.emit(f"__shared__ {acc_type} part{k}[{warps}];")
        b.emit(f"if (lane % 32 == 0) part{k}[lane / 32] = {acc};")
        b.emit("__syncthreads();")
        b.emit(f"{acc} = part{k}[0];")
        b.emit(f"for (int w = 1; w < {warps}; ++w) {{ {acc_type} other = part{k}[w]; "
               f"{acc} = {combine.format(a=acc, b='other')}; }}")
    ctype = dtypes.compute_type(out.dtype)
    value = acc if ctype == acc_type else f"({ctype}){acc}"
    return b.tmp(ctype, dtypes.round_to(out.dtype, value) if dtypes.is_float(out.dtype) else value)


def _write_row(b: RowBuilder, root: Node, per_out: int, per_row: int) -> None:
    """The last pass: row `o`'s `per_out` elements of the root, at offsets o * per_out + c."""
    out = root.outputs[0]
    if per_out == 1:
        b.open("if (lane == 0)")
        b.store(out, "o", b.value(out, b.index_vars("o", out.shape)))
        b.close()
        return
    itype = "long long" if out.size >= 2 ** 31 else "int"
    scopes = b.open_pass(per_out, per_row)
    flat = b.tmp(f"const {itype}", f"({itype})o * {per_out} + c")
    q = _lead_axes(out.shape, out.size // per_out)
    if q is not None:  # the leading axes index rows: no division of the whole offset
        idx = b.index_vars("o", out.shape[:q]) + b.index_vars("c", out.shape[q:])
        b.flat[(idx, tuple(out.shape))] = flat
        b.element = (idx, tuple(out.shape), b.depth)
    else:
        idx = b.index_vars(flat, out.shape)
    b.store(out, flat, b.value(out, idx))
    b.close_pass(scopes)


def _slots(reductions: list[Node], n_rows: int, per_out: int, per_row: int) -> int:
    """Elements per thread per pass where every pass has the same length and they are
    few enough to keep in registers, else 0 (every pass reads global memory)."""
    lengths = {s.inputs[0].size // n_rows for s in reductions}
    lengths |= {per_out} if per_out > 1 else set()
    slots = -(-max(lengths) // per_row)
    return slots if len(lengths) == 1 and slots <= MAX_SLOTS else 0


def _lead_axes(shape: tuple[int, ...], n_rows: int) -> int | None:
    for q in range(len(shape) + 1):
        if math.prod(shape[:q]) == n_rows:
            return q
    return None


def _name_ops(reductions: list[Node], ops: list[str], reduces_rows: bool) -> list[str]:
    """What the kernel's name shows: the pattern where it is a known one (softmax,
    log_softmax, logsumexp, layer_norm, rms_norm), else its reductions and operations."""
    reduced = [s.name.removeprefix("reduce_") for s in reductions]
    seen = set(ops)
    if reduced == ["max", "sum"] and "exp" in seen:
        if reduces_rows:  # one output per row
            return ["logsumexp"]
        return ["softmax"] if "div" in seen else ["logsoftmax"] if "log" in seen else reduced + ops
    if set(reduced) == {"sum"} and ("rsqrt" in seen or "sqrt" in seen) and not reduces_rows:
        return ["layernorm"] if len(reduced) == 2 else ["rmsnorm"] if len(reduced) == 1 else reduced + ops
    return reduced + ops
