"""Attention as one kernel: a GEMM whose result only a row kernel reads (the scores, for
its softmax), and a GEMM that only reads that row kernel's result (the probabilities,
times the values), become one generated kernel after lowering.

Why: at batch 1 and short sequences the three launches cost more than their work, and
nothing in between needs to reach memory. Measured on an H100
(`examples/gpu/probe_attention.py`, causal `jax.nn.dot_product_attention`, GPU µs of
the plan): 1x16x2x8 4.3 against 7.5 for the three kernels, 1x64x4x32 6.4 against 10.1,
1x64x12x64 8.4 against 10.7; but from 128 keys on the fused kernel loses (1x128x8x64,
GPT at batch 1: 15.4 against 11.4; 1x256x8x64: 31.5 against 15.0): one warp walks its
row's keys and values in float32 FMAs, where the GEMMs use tensor cores. Hence MAX_ROW.

The kernel runs the row kernel's passes (rows.py: one warp per row, each row a query of
one head; a block's eight rows are queries of one batch entry) between two loops it adds.
Before them the block copies the keys into shared memory, CHUNK at a time and coalesced,
and each lane computes one score, alpha * q . k_c, into the row's slice of shared memory;
the passes read the scores there instead of from a buffer and leave the probabilities
there instead of writing them; after them the values come through shared memory the same
way, and each lane sums p_j * v_j for its columns of the output and writes them where the
second GEMM would have. Every product and sum is a float32 FMA (at least as accurate as
the TF32 the library GEMMs use where JAX allows it), the sums in a fixed order.

What qualifies (`_attention_triple`), each condition with its reason:
- float32 throughout; neither GEMM has an epilogue beyond its scale (alpha), nor beta;
- the scores are read by the row task alone and the probabilities by the second GEMM
  alone, and neither is a result of the function (they never reach memory);
- the row task writes the probabilities and nothing else, and reads the scores (and what
  it computes from them: a mask, a scale, the softmax's reductions) only within each row,
  so a row's scores are all it needs;
- the probabilities are the second GEMM's first operand read row by row, or its second
  read transposed: either way a row of probabilities makes one row or one column of the
  result; both GEMMs have the same batch, and the row length is the second's contraction;
- rows of at most MAX_ROW keys and at most MAX_MACS multiply-adds in all (beyond, the
  GEMMs' tensor cores win), a head size of at most MAX_HEAD and values at most
  MAX_WIDTH wide (a chunk of either fits shared memory); a block's rows are queries of
  one batch entry (ROWS_PER_BLOCK divides the queries).
"""
from __future__ import annotations

from typing import Optional, Sequence

from nimblejax.compiler.fusion_rows import keeps_rows
from nimblejax.compiler.ir import Var
from nimblejax.compiler.kinds import GroupKind, RuleKind, TaskKind
from nimblejax.compiler.lowering import attention_tc
from nimblejax.compiler.lowering.gemm_tc_ptx import PTX_HELPERS
from nimblejax.compiler.lowering.registry import rule_for
from nimblejax.compiler.lowering.rows import (RowBuilder, extra_passes, name_ops, prologue_ops, reduce_row,
                                              write_row)
from nimblejax.compiler.lowering.task import Epilogue, GemmCall, Kernel, Task

MAX_ROW = 64  # keys per query: longer rows lose to the three kernels (module docstring)
MAX_HEAD = 128  # with MAX_WIDTH: a chunk of keys or values, 16.5 KB, and the queries, 4 KB
CHUNK = 32  # keys (values) in shared memory at a time: one per lane
ROWS_PER_BLOCK = 8  # one warp each
# Independent partial sums per lane (_scores, _values): a row per warp leaves few warps
# per SM (GPT at batch 1: 8), so each keeps several multiply-adds in flight.
UNROLL = 4
MAX_WIDTH = 128  # the values' width (the second GEMM's columns): registers per lane
# At most this many multiply-adds (rows x row length x (head size + value width)): the
# largest measured win was 6.3 M (module docstring); beyond, the GEMMs' tensor cores.
MAX_MACS = 1 << 23


def fuse_attention(groups: Sequence, tasks: Sequence[Task], outputs: Sequence) -> list[Task]:
    """`tasks` (lowered from `groups`, one each, in order) with every qualifying scores
    GEMM, row task and values GEMM replaced by one attention kernel task."""
    readers: dict[Var, list[Task]] = {}
    for t in tasks:
        for v in set(t.inputs):
            readers.setdefault(v, []).append(t)
    made = {v: (t, g) for t, g in zip(tasks, groups) for v in t.outputs}
    results = {v for v in outputs if isinstance(v, Var)}
    replaced: dict[Task, Optional[Task]] = {}
    for t3 in tasks:
        # (The scores and the probabilities each have one reader: no task joins two triples.)
        found = _attention_triple(t3, made, readers, results)
        if found is None:
            continue
        t1, t2, row, tc = found
        kernel = attention_kernel(t1.gemm, row, t3.gemm, tc)
        if kernel is None:
            continue
        fused = Task(kernel.name, TaskKind.KERNEL,
                     tuple(v for v in kernel.params if v not in t3.outputs), t3.outputs,
                     t1.eqns + t2.eqns + t3.eqns, kernel=kernel)
        replaced.update({t1: None, t2: None, t3: fused})
    return [replaced.get(t, t) for t in tasks if replaced.get(t, t) is not None]


def _attention_triple(t3: Task, made, readers, results):
    """(scores GEMM task, row task, its group, the tensor-core kernel's shape or None for
    the FMA kernel) of the triple ending at t3, or None."""
    g2 = t3.gemm
    if not _plain_f32(g2) or t3.outputs != (g2.c,):  # a GEMM (gemm_tc.py: with no post group)
        return None
    probs = g2.a if not g2.trans_a and _contiguous(g2, "a") else None
    if probs is None or probs not in made:
        probs = g2.b if g2.trans_b and _contiguous(g2, "b") else None
    if probs is None or probs not in made or probs in results or readers.get(probs) != [t3]:
        return None
    t2, row = made[probs]
    if row.kind is not GroupKind.ROW or t2.outputs != (probs,) or row.extra_outputs:
        return None
    queries, width = (g2.m, g2.n) if probs is g2.a else (g2.n, g2.m)
    for scores in t2.inputs:
        if scores not in made or scores in results or readers.get(scores) != [t2]:
            continue
        t1, _ = made[scores]
        g1 = t1.gemm
        if not _plain_f32(g1, mask_ok=True) or g1.c is not scores:
            continue
        same_problem = (_contiguous(g1, "c") and g1.batch == g2.batch and g1.n == g2.k
                        and g1.m == queries)
        if not same_problem or not _read_in_own_row(scores, row, g1.batch * g1.m):
            continue
        small = (_plain_f32(g1) and g1.n <= MAX_ROW and g1.k <= MAX_HEAD and width <= MAX_WIDTH
                 and g1.batch * g1.m * g1.n * (g1.k + width) <= MAX_MACS)
        tc = None if small else attention_tc.shape_for(g1, g2, width)
        if small or tc:
            return t1, t2, row, tc
    return None


def _plain_f32(g: Optional[GemmCall], mask_ok: bool = False) -> bool:
    """A float32 GEMM with no epilogue (`mask_ok`: or one adding a residual, the additive
    mask attention_tc.py reads with its scores)."""
    if g is None or g.dtype != "float32" or g.out_dtype not in (None, "float32"):
        return False
    return ((g.epilogue == Epilogue() and g.beta == 0.0)
            or (mask_ok and g.epilogue == Epilogue(residual=True) and g.beta == 1.0))


def _contiguous(g: GemmCall, which: str) -> bool:
    rows, cols = g.stored(which)
    return g.layout(which) == (cols, rows * cols)


def _read_in_own_row(scores: Var, row, n_rows: int) -> bool:
    """Whether the row group reads `scores`, and the values it computes from them, only
    within each row (fusion_rows.keeps_rows): a row's scores, all in shared memory, are
    then all its passes read."""
    derived = {scores}
    for node in row.nodes:  # topological order
        read = [a for a in node.inputs if isinstance(a, Var) and a in derived]
        if not read:
            continue
        if not all(keeps_rows(node, a, n_rows) for a in read):
            return False
        if rule_for(node).kind is not RuleKind.REDUCTION:  # (a row's reduction: one value)
            derived.add(node.outputs[0])
    return True


class _AttentionBuilder(RowBuilder):
    """A row kernel whose scores come from, and whose probabilities go to, the row's
    slice of shared memory `sc` (`rowbase`: the row's first flat offset)."""

    def __init__(self, inlined, scores: Var, probs: Var) -> None:
        super().__init__(inlined)
        self.scores, self.probs = scores, probs

    def load(self, var: Var, idx) -> str:
        if var is self.scores:
            return f"sc[{self.linear(idx, var.shape)} - rowbase]"
        return super().load(var, idx)

    def store(self, var: Var, offset: str, value: str) -> None:
        if var is self.probs:
            self.emit(f"sc[{offset} - rowbase] = {value};")
        else:
            super().store(var, offset, value)


def attention_kernel(g1: GemmCall, row, g2: GemmCall,
                     tc: Optional[attention_tc.Shape] = None) -> Optional[Kernel]:
    """The fused kernel (module docstring), on tensor cores cut as `tc` where that is
    given (attention_tc.py); None where the row group's shape does not give one row per
    (batch, query)."""
    root, nodes = row.root, row.nodes
    reductions = [n for n in nodes if rule_for(n).kind is RuleKind.REDUCTION]
    n_rows, length = g1.batch * g1.m, g1.n
    if (not reductions or reductions[0].outputs[0].size != n_rows or root.outputs[0].size != n_rows * length
            or any(r.inputs[0].size != n_rows * length for r in reductions)
            or g1.m % (attention_tc.ROWS if tc else ROWS_PER_BLOCK)):
        return None
    b = _AttentionBuilder({n.outputs[0]: n for n in nodes if n not in reductions}, g1.c, root.outputs[0])
    if tc:
        return _tensor_core_kernel(b, g1, row, g2, tc, reductions)
    b.emit(f"// {n_rows} rows (batch {g1.batch} x {g1.m} queries) of {length} scores, one warp each: "
           f"scores = {g1.alpha!r} * q . k (head size {g1.k}), the row kernel's passes, then p . v")
    b.emit("const int lane = threadIdx.x % 32;")
    b.emit(f"const long long o = (long long)blockIdx.x * {ROWS_PER_BLOCK} + threadIdx.x / 32;")
    width = g2.n if root.outputs[0] is g2.a else g2.m
    b.emit(f"__shared__ float sc_rows[{ROWS_PER_BLOCK * _padded(length)}];")
    b.emit(f"__shared__ float qs[{ROWS_PER_BLOCK * g1.k}];")
    b.emit(f"__shared__ float tile[{CHUNK * max(g1.k | 1, width | 1)}];")
    b.emit(f"float* sc = sc_rows + (threadIdx.x / 32) * {_padded(length)};")
    b.emit(f"const long long rowbase = o * {length};")
    b.emit(f"const long long bq = o / {g1.m}, iq = o % {g1.m};")
    b.declarations = len(b.lines)
    _scores(b, g1)
    b.emit("__syncwarp();")
    passes = extra_passes(nodes, reductions, (), n_rows, length)
    for k, reduction in enumerate(reductions):
        b.known[reduction.outputs[0]] = reduce_row(b, reduction, k, 32, passes.get(k, ()))
    write_row(b, root, length, 32)
    b.emit("__syncwarp();")
    _values(b, g2, root.outputs[0], length)
    b.ops = name_ops(reductions, b.ops, False, prologue_ops(root, nodes, reductions))
    return b.finish("attention", g2.c, n_rows // ROWS_PER_BLOCK, 32 * ROWS_PER_BLOCK)


def _tensor_core_kernel(b: _AttentionBuilder, g1: GemmCall, row, g2: GemmCall,
                        tc: attention_tc.Shape, reductions) -> Kernel:
    """attention_tc.py's kernel: its scores, the row passes in its loop over the block's
    rows, its values."""
    n_rows, length = g1.batch * g1.m, g1.n
    probs_first = row.root.outputs[0] is g2.a
    attention_tc.declare(b, g1, tc, g2.n if probs_first else g2.m)
    attention_tc.scores(b, g1, tc, _offset)
    attention_tc.prefetch_values(b, g2, probs_first, tc, length, _offset)
    attention_tc.open_rows(b, g1, tc)
    b.declarations = len(b.lines)
    passes = extra_passes(row.nodes, reductions, (), n_rows, length)
    for k, reduction in enumerate(reductions):
        b.known[reduction.outputs[0]] = reduce_row(b, reduction, k, 32, passes.get(k, ()))
    write_row(b, row.root, length, 32)
    b.close()
    b.forget()
    attention_tc.values(b, g2, probs_first, tc, length, _offset)
    b.ops = name_ops(reductions, b.ops, False, prologue_ops(row.root, row.nodes, reductions))
    return b.finish("attention_tc", g2.c, n_rows // attention_tc.ROWS, tc.threads, PTX_HELPERS)


def _offset(g: GemmCall, which: str, row: str, col: str) -> str:
    """C offset of op(A)[row][col] ('a') or op(B)[row][col] ('b') in batch entry bq."""
    ld, stride = g.layout(which)
    trans = g.trans_a if which == "a" else g.trans_b
    first, second = (col, row) if trans else (row, col)
    return f"bq * {stride}LL + (long long)({first}) * {ld} + ({second})"


def _load_tile(b: _AttentionBuilder, src: str, offset, rows: str, count: int, width: int,
               along_width: bool) -> None:
    """All threads copy rows [rows, rows + CHUNK) of the source (`offset(r, e)`: element e
    of row r; zeros from row `count` on) into `tile`, row r at r * (width | 1): an odd
    stride, so lanes reading one column of consecutive rows hit distinct banks. Where
    `along_width` (the source is contiguous along a row) consecutive threads read
    consecutive elements of a row, else of a column."""
    stride = width | 1
    b.emit("__syncthreads();  // the last chunk's readers are done")
    b.open(f"for (int i = threadIdx.x; i < {CHUNK * width}; i += {32 * ROWS_PER_BLOCK})")
    attention_tc.tile_coordinates(b, CHUNK, width, along_width)
    b.emit(f"tile[r * {stride} + e] = {rows} + r < {count} ? {src}[{offset(f'{rows} + r', 'e')}] : 0.0f;")
    b.close()
    b.emit("__syncthreads();")


def _scores(b: _AttentionBuilder, g1: GemmCall) -> None:
    """sc[c] = alpha * sum_k op(A)[iq][k] * op(B)[k][c] for every c of row o (0 past the
    row's end, up to a whole chunk). The keys come through shared memory, CHUNK at a time
    (copied by the whole block, coalesced: the block's rows are queries of one batch
    entry), and each lane sums one key over k against the query row, also in shared
    memory (the same address for every lane: a broadcast)."""
    qa, qb, head = b.input(g1.a), b.input(g1.b), g1.k
    stride = head | 1  # odd: lane l's key starts l banks apart
    b.emit(f"float* qw = qs + (threadIdx.x / 32) * {head};")
    b.emit(f"for (int k = lane; k < {head}; k += 32) qw[k] = {qa}[{_offset(g1, 'a', 'iq', 'k')}];")
    b.open(f"for (int c0 = 0; c0 < {_padded(g1.n)}; c0 += {CHUNK})")
    _load_tile(b, qb, lambda r, e: _offset(g1, "b", e, r), "c0", g1.n, head, g1.trans_b)
    b.emit(f"const float* kt = tile + lane * {stride};")
    b.emit(f"float acc[{UNROLL}] = {{}};")
    b.emit("#pragma unroll")
    b.open(f"for (int k = 0; k < {head - head % UNROLL}; k += {UNROLL})")
    b.emit("#pragma unroll")
    b.emit(f"for (int u = 0; u < {UNROLL}; ++u) acc[u] = fmaf(qw[k + u], kt[k + u], acc[u]);")
    b.close()
    for k in range(head - head % UNROLL, head):
        b.emit(f"acc[0] = fmaf(qw[{k}], kt[{k}], acc[0]);")
    b.emit("float sum = acc[0];")
    b.emit(f"for (int u = 1; u < {UNROLL}; ++u) sum += acc[u];")
    b.emit(f"sc[c0 + lane] = c0 + lane < {g1.n} ? {_scaled(g1.alpha, 'sum')} : 0.0f;")
    b.close()


def _values(b: _AttentionBuilder, g2: GemmCall, probs: Var, length: int) -> None:
    """Row o's part of the second GEMM: out = sum_j p_j * x_j for each of its columns d,
    x the other operand (its rows through shared memory, CHUNK at a time), written where
    the GEMM writes it."""
    out = b.output(g2.c)
    ldc, stride_c = g2.layout("c")
    if probs is g2.a:  # result row iq of batch bq: columns d of op(B)
        width, x, along = g2.n, b.input(g2.b), not g2.trans_b
        offset = lambda r, e: _offset(g2, "b", r, e)  # noqa: E731
        target = f"bq * {stride_c}LL + iq * {ldc}LL + d"
    else:  # probabilities are op(B)^T: result column iq, rows d of op(A)
        width, x, along = g2.m, b.input(g2.a), g2.trans_a
        offset = lambda r, e: _offset(g2, "a", e, r)  # noqa: E731
        target = f"bq * {stride_c}LL + (long long)d * {ldc} + iq"
    cols = -(-width // 32)  # columns per lane
    b.emit(f"float acc[{cols}][{UNROLL}] = {{}};")
    b.open(f"for (int j0 = 0; j0 < {_padded(length)}; j0 += {CHUNK})")
    _load_tile(b, x, offset, "j0", length, width, along)
    b.emit("#pragma unroll")
    b.open(f"for (int jj = 0; jj < {CHUNK}; jj += {UNROLL})")
    b.emit("#pragma unroll")
    b.open(f"for (int u = 0; u < {UNROLL}; ++u)")
    b.emit("const float p = sc[j0 + jj + u];")
    b.emit("#pragma unroll")
    b.emit(f"for (int e = 0; e < {cols}; ++e) "
           f"if (lane + e * 32 < {width}) acc[e][u] = fmaf(p, tile[(jj + u) * {width | 1} + lane + e * 32], acc[e][u]);")
    b.close()
    b.close()
    b.close()
    b.emit("#pragma unroll")
    b.open(f"for (int e = 0; e < {cols}; ++e)")
    b.emit("const int d = lane + e * 32;")
    b.emit("float sum = acc[e][0];")
    b.emit(f"for (int u = 1; u < {UNROLL}; ++u) sum += acc[e][u];")
    b.emit(f"if (d < {width}) {out}[{target}] = {_scaled(g2.alpha, 'sum')};")
    b.close()


def _padded(n: int) -> int:
    return -(-n // CHUNK) * CHUNK


def _scaled(alpha: float, acc: str) -> str:
    return acc if alpha == 1.0 else f"{float(alpha)!r}f * {acc}"
