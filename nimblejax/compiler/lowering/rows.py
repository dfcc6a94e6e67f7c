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

A value of the row's prologue that is read outside the group too (fusion_rows.py:
pre-LN's residual sum) is written in the first pass over rows of its length that comes
after the reductions it reads (the pass computes it anyway), else in a pass of its own.
The kernel's name shows the prologue's operations before the pattern:
nimble_row_add_layernorm_f32 for LN(x + y).
"""
from __future__ import annotations

import math
from typing import Mapping

from nimblejax.compiler import dtypes
from nimblejax.compiler.ir import Atom, Node, Var
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import BLOCK, INDEX_ONLY, Index, KernelBuilder
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
        self.reused: frozenset[Var] = frozenset()  # computed values kept for later passes
        self.declarations = 0  # where the register arrays are declared: lines[top:]

    def value(self, atom: Atom, idx: Index) -> str:
        if isinstance(atom, Var) and atom in self.known:
            return self.known[atom]
        if not (isinstance(atom, Var) and atom in self.reused and self._at_element(atom, idx)):
            return super().value(atom, idx)
        if atom in self.cached:
            return f"{self.cached[atom]}[j]"
        value = super().value(atom, idx)
        if atom not in self.uncached and self._declare(atom):
            self.emit(f"{self.cached[atom]}[j] = {value};")
        return value

    def load(self, var: Var, idx: Index) -> str:
        if var in self.uncached or not self._at_element(var, idx):
            return super().load(var, idx)
        if var in self.cached:
            return f"{self.cached[var]}[j]"
        if not self._declare(var):
            return super().load(var, idx)
        return f"({self.cached[var]}[j] = {super().load(var, idx)})"

    def _at_element(self, var: Var, idx: Index) -> bool:
        """Whether `idx` is the pass's own element, in a loop over this thread's slots."""
        return bool(self.slots) and self.element == (tuple(idx), tuple(var.shape), self.depth)

    def _declare(self, var: Var) -> bool:
        """A register array for var's elements of row o, if the budget has room."""
        if (len(self.cached) + 1) * self.slots > CACHED_REGISTERS:
            self.uncached.add(var)
            return False
        name = self.cached[var] = f"row{len(self.cached)}"
        self.lines.insert(self.declarations, f"  {dtypes.compute_type(var.dtype)} {name}[{self.slots}];"
                          f"  // {var!r}: this thread's elements of row o")
        self.declarations += 1
        return True

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


def row_kernel(root: Node, nodes: tuple[Node, ...], extra: tuple[Var, ...] = ()) -> Kernel:
    """One kernel for a row group: `nodes` in topological order, `root` last; `extra`:
    values of the group it writes besides the root's."""
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
    b.reused = reused_values(nodes, reductions, root, extra)
    passes = extra_passes(nodes, reductions, extra, n_rows, per_out)
    for k, reduction in enumerate(reductions):
        b.known[reduction.outputs[0]] = reduce_row(b, reduction, k, per_row,
                                                    passes.get(k, ()), n_rows if ragged else 0)
        hoist_row_values(b, nodes, reductions, n_rows)
    if ragged:
        b.open(f"if (row < {n_rows})")
    for v in passes.get(None, ()):  # a length no pass has: a pass of its own
        _write_pass(b, v, v.size // n_rows, per_row)
    write_row(b, root, per_out, per_row, passes.get(len(reductions), ()))
    while b.depth > 1:
        b.close()
    b.ops = name_ops(reductions, b.ops, per_out < longest, prologue_ops(root, nodes, reductions))
    return b.finish("row", out, -(-n_rows // rows_per_block), block)


def hoist_row_values(b: RowBuilder, nodes: tuple[Node, ...], reductions: list[Node], n_rows: int) -> None:
    """Compute once per row, between passes, each value of the group that has one element
    per row and is computed from the reductions known so far (LayerNorm's mean, variance
    and rsqrt; softmax's sum in its dtype), so the passes read a register instead of
    recomputing it at every element: in bfloat16 each of those steps is a conversion,
    which an H100 runs at a quarter of the float rate. Only values that read a reduction
    are taken: fusion_rows.py made sure those are read at their own row, whose row-major
    offset is `o`. Same operations, same order: the same bits as computing them in the
    pass."""
    known = {r.outputs[0] for r in reductions if r.outputs[0] in b.known}
    pending = {r.outputs[0] for r in reductions} - known
    made = {v: n for n in nodes for v in n.outputs}
    rows: dict[tuple[int, ...], Index] = {}  # shape → its index of row o
    for node in nodes:
        v = node.outputs[0]
        if node in reductions or v in b.known or v.size != n_rows:
            continue
        upstream = _reads(v, made, known | pending)
        if upstream and not upstream & pending:
            shape = tuple(v.shape)
            if shape not in rows:
                rows[shape] = b.index_vars("o", shape)
            b.known[v] = b.value(v, rows[shape])


def reused_values(nodes: tuple[Node, ...], reductions: list[Node], root: Node,
                  extra: tuple[Var, ...]) -> frozenset[Var]:
    """The values a later pass would recompute at its element from a reduction: computed
    from one and read by two passes (softmax's exp(x - max), read by the sum's pass and
    the last; LayerNorm's x - mean, by the variance's and the last), less those read only
    to compute another such value. The first pass that computes one keeps it in
    registers, where the budget allows (RowBuilder), and later passes read it there."""
    made = {v: n for n in nodes for v in n.outputs}
    stop = {r.outputs[0] for r in reductions}
    targets = [r.inputs[0] for r in reductions] + [root.outputs[0], *extra]
    counts: dict[Var, int] = {}
    for t in targets:
        for v in _computed(t, made, stop):
            counts[v] = counts.get(v, 0) + 1
    shared = {v for v, k in counts.items() if k >= 2 and _reads(v, made, stop)}
    readers: dict[Var, set[Var]] = {}
    for n in nodes:
        for a in n.inputs:
            if isinstance(a, Var):
                readers.setdefault(a, set()).update(n.outputs)
    return frozenset(v for v in shared if not readers.get(v, set()) <= shared)


def extra_passes(nodes: tuple[Node, ...], reductions: list[Node], extra: tuple[Var, ...],
                  n_rows: int, per_out: int) -> dict[int | None, list[Var]]:
    """Where each extra output is written: pass k (k < len(reductions): reduction k's; k =
    len(reductions): the last, the root's), the first of the value's length per row after
    every reduction it reads, or None: a pass of its own."""
    made = {v: n for n in nodes for v in n.outputs}
    position = {r.outputs[0]: k for k, r in enumerate(reductions)}
    lengths = [r.inputs[0].size // n_rows for r in reductions] + [per_out]
    passes: dict[int | None, list[Var]] = {}
    for v in extra:  # (a reduction's own value: after its pass)
        after = 1 + max((position[u] for u in _reads(v, made, position) | ({v} & position.keys())),
                        default=-1)
        k = next((k for k in range(after, len(lengths)) if lengths[k] == v.size // n_rows), None)
        passes.setdefault(k, []).append(v)
    return passes


def _reads(v: Var, made: Mapping[Var, Node], stop) -> set[Var]:
    """The values in `stop` that v is computed from within the group (not through them)."""
    found, seen, todo = set(), {v}, [v]
    while todo:
        n = made.get(todo.pop())
        for a in n.inputs if n is not None else ():
            if isinstance(a, Var) and a not in seen:
                seen.add(a)
                (found.add if a in stop else todo.append)(a)
    return found


def _store_extra(b: RowBuilder, extra: list[Var], idx: Index, shape: tuple[int, ...], flat: str,
                 guard: str = "") -> None:
    """Store each value of `extra` at row-major offset `flat` (idx in `shape` where the
    value has that shape), computed before `guard` (the pass's own element index: its
    registers)."""
    values = [(v, b.value(v, idx if tuple(v.shape) == shape else b.index_vars(flat, v.shape)))
              for v in extra]
    if guard:
        b.open(f"if ({guard})")
    for v, value in values:
        b.store(v, flat, value)
    if guard:
        b.close()


def _write_pass(b: RowBuilder, v: Var, length: int, per_row: int) -> None:
    """A pass that only writes v, a value of `length` per row no other pass has."""
    slots, b.slots = b.slots, 0  # (its loop is not the other passes' j loop)
    scopes = b.open_pass(length, per_row)
    flat = b.tmp(f"const {_itype(v)}", f"({_itype(v)})o * {length} + c")
    _store_extra(b, [v], b.index_vars(flat, v.shape), tuple(v.shape), flat)
    b.close_pass(scopes)
    b.slots = slots


def _itype(v: Var) -> str:
    return "long long" if v.size >= 2 ** 31 else "int"


def reduce_row(b: RowBuilder, reduction: Node, k: int, per_row: int, extra=(),
                ragged_rows: int = 0) -> str:
    """One pass over row `o` reducing `reduction`'s operand, also writing the `extra`
    values of its length (for rows < `ragged_rows` where that is not 0: a thread past
    the last row redoes it); the result's C name, which every thread of the row holds."""
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
    if extra:
        flat = b.tmp(f"const {_itype(x)}", f"({_itype(x)})o * {length} + c")
        _store_extra(b, list(extra), idx, tuple(x.shape), flat,
                     f"row < {ragged_rows}" if ragged_rows else "")
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


def write_row(b: RowBuilder, root: Node, per_out: int, per_row: int, extra=()) -> None:
    """The last pass: row `o`'s `per_out` elements of the root, at offsets o * per_out + c,
    and of the `extra` values of that length."""
    out = root.outputs[0]
    if per_out == 1:
        b.open("if (lane == 0)")
        b.store(out, "o", b.value(out, b.index_vars("o", out.shape)))
        for v in extra:
            b.store(v, "o", b.value(v, b.index_vars("o", v.shape)))
        b.close()
        return
    itype = _itype(out)
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
    if extra:
        _store_extra(b, list(extra), idx, tuple(out.shape), flat)
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


def name_ops(reductions: list[Node], ops: list[str], reduces_rows: bool,
              prologue: list[str] = ()) -> list[str]:
    """What the kernel's name shows: the `prologue`'s operations and the pattern where it
    is a known one (softmax, log_softmax, logsumexp, layer_norm, rms_norm), else its
    reductions and operations."""
    pattern = _pattern([s.name.removeprefix("reduce_") for s in reductions], set(ops), reduces_rows)
    return [*prologue, pattern] if pattern else [s.name.removeprefix("reduce_") for s in reductions] + ops


def _pattern(reduced: list[str], seen: set[str], reduces_rows: bool) -> str | None:
    if reduced == ["max", "sum"] and "exp" in seen:
        if reduces_rows:  # one output per row
            return "logsumexp"
        return "softmax" if "div" in seen else "logsoftmax" if "log" in seen else None
    if set(reduced) == {"sum"} and ("rsqrt" in seen or "sqrt" in seen) and not reduces_rows:
        return "layernorm" if len(reduced) == 2 else "rmsnorm" if len(reduced) == 1 else None
    return None


def prologue_ops(root: Node, nodes: tuple[Node, ...], reductions: list[Node]) -> list[str]:
    """The operations every pass over the row computes before its reductions come in: the
    row input's producers (the residual add of LN(x + y)), in graph order, less moves."""
    made = {v: n for n in nodes for v in n.outputs}
    stop = {r.outputs[0] for r in reductions}
    tops = [r.inputs[0] for r in reductions]
    if root.outputs[0].size > reductions[0].outputs[0].size:  # the last pass reads the row
        tops.append(root.outputs[0])
    common = None
    for top in tops:
        computed = {made[v] for v in _computed(top, made, stop)}
        common = computed if common is None else common & computed
    return [n.name for n in nodes if n in (common or ()) and n.name not in INDEX_ONLY]


def _computed(v: Var, made: Mapping[Var, Node], stop) -> set[Var]:
    """The group's values that computing v computes (v included), not through `stop`."""
    seen, todo = set(), [v]
    while todo:
        a = todo.pop()
        if a in seen or a in stop or a not in made:
            continue
        seen.add(a)
        todo.extend(x for x in made[a].inputs if isinstance(x, Var))
    return seen
