"""Attention as one kernel: a GEMM whose result only a row kernel reads (the scores, for
its softmax), and a GEMM that only reads that row kernel's result (the probabilities,
times the values), become one generated kernel after lowering.

Why: at batch 1 and short sequences the three launches cost more than their work. GPT
at batch 1 on an H100: per layer a 3.4 µs scores GEMM (8 heads of 128x128x64), a 2.2 µs
masked softmax and a 4.0 µs probabilities-times-values GEMM; XLA's three kernels are a
little faster, and nothing in between needs to reach memory.

The kernel runs the row kernel's passes (rows.py: one warp per row, each row a query of
one head) between two loops it adds. Before them, each lane computes its elements of the
row's scores, alpha * q . k_c, into the row's slice of shared memory; the passes read
the scores there instead of from a buffer and leave the probabilities there instead of
writing them; after them, each lane sums p_j * v_j for its columns of the output and
writes them where the second GEMM would have. Every product and sum is a float32 FMA (at
least as accurate as the TF32 the library GEMMs use where JAX allows it), the sums in a
fixed order.

What qualifies (`_attention_triple`), each condition with its reason:
- float32 throughout; neither GEMM has an epilogue beyond its scale (alpha), nor beta;
- the scores are read by the row task alone and the probabilities by the second GEMM
  alone, and neither is a result of the function (they never reach memory);
- the row task writes the probabilities and nothing else, and reads the scores only at
  its own element: through elementwise operations of the scores' size and reshapes (a
  mask, a scale, the softmax's reductions), so a row's scores are all it needs;
- the probabilities are the second GEMM's first operand read row by row, or its second
  read transposed: either way a row of probabilities makes one row or one column of the
  result; both GEMMs have the same batch, and the row length is the second's contraction;
- rows of at most MAX_ROW (their scores fit shared memory), a contraction (the head
  size) of at most MAX_HEAD.
"""
from __future__ import annotations

from typing import Optional, Sequence

from nimblejax.compiler.fusion_rows import RESHAPES, SAME_INDEX
from nimblejax.compiler.ir import Node, Var
from nimblejax.compiler.kinds import GroupKind, RuleKind, TaskKind
from nimblejax.compiler.lowering.registry import rule_for
from nimblejax.compiler.lowering.rows import RowBuilder, _extra_passes, _name_ops, _reduce_row, _write_row
from nimblejax.compiler.lowering.task import Epilogue, GemmCall, Kernel, Task

MAX_ROW = 1024  # float32 scores of ROWS_PER_BLOCK rows: 32 KB of shared memory
MAX_HEAD = 256
ROWS_PER_BLOCK = 8  # one warp each


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
        triple = _attention_triple(t3, made, readers, results)
        if triple is None or any(t in replaced for t in triple[:2]):
            continue
        t1, (t2, row), _ = triple
        kernel = attention_kernel(t1.gemm, row, t3.gemm)
        if kernel is None:
            continue
        fused = Task(kernel.name, TaskKind.KERNEL,
                     tuple(v for v in kernel.params if v not in t3.outputs), t3.outputs,
                     t1.eqns + t2.eqns + t3.eqns, kernel=kernel)
        replaced.update({t1: None, t2: None, t3: fused})
    return [replaced.get(t, t) for t in tasks if replaced.get(t, t) is not None]


def _attention_triple(t3: Task, made, readers, results):
    """(scores GEMM task, (row task, its group), values GEMM task) ending at t3, or None."""
    g2 = t3.gemm
    if t3.kind is not TaskKind.GEMM or not _plain_f32(g2):
        return None
    probs = g2.a if not g2.trans_a and _contiguous(g2, "a") else None
    if probs is None or probs not in made:
        probs = g2.b if g2.trans_b and _contiguous(g2, "b") else None
    if probs is None or probs not in made or probs in results or readers.get(probs) != [t3]:
        return None
    t2, row = made[probs]
    if row.kind is not GroupKind.ROW or t2.outputs != (probs,) or row.extra_outputs:
        return None
    for scores in t2.inputs:
        if scores not in made or scores in results or readers.get(scores) != [t2]:
            continue
        t1, _ = made[scores]
        g1 = t1.gemm
        if (t1.kind is TaskKind.GEMM and _plain_f32(g1) and g1.c is scores and _contiguous(g1, "c")
                and g1.batch == g2.batch and g1.n == g2.k and g1.m == (g2.m if probs is g2.a else g2.n)
                and g1.n <= MAX_ROW and g1.k <= MAX_HEAD and _read_at_own_element(scores, row)):
            return t1, (t2, row), t3
    return None


def _plain_f32(g: Optional[GemmCall]) -> bool:
    return (g is not None and g.dtype == "float32" and g.out_dtype in (None, "float32")
            and g.epilogue == Epilogue() and g.beta == 0.0)


def _contiguous(g: GemmCall, which: str) -> bool:
    rows, cols = g.stored(which)
    return g.layout(which) == (cols, rows * cols)


def _read_at_own_element(scores: Var, row) -> bool:
    """Whether the row group reads `scores` only where it computes: through elementwise
    operations on values of the scores' shape and through reshapes, into its reductions
    and its root (whose passes visit element c of row o at flat offset o * n + c)."""
    derived, nodes = {scores}, row.nodes
    for node in nodes:  # topological order
        read = [a for a in node.inputs if isinstance(a, Var) and a in derived]
        if not read:
            continue
        out = node.outputs[0]
        kind = rule_for(node).kind
        if kind is RuleKind.REDUCTION and node.inputs[0] in derived and len(read) == 1:
            continue
        same = node.name in SAME_INDEX and all(tuple(a.shape) == tuple(out.shape) for a in read)
        if not (same or node.name in RESHAPES) or out.size != scores.size:
            return False
        derived.add(out)
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


def attention_kernel(g1: GemmCall, row, g2: GemmCall) -> Optional[Kernel]:
    """The fused kernel (module docstring); None where the row group's shape does not
    give one row per (batch, query)."""
    root, nodes = row.root, row.nodes
    reductions = [n for n in nodes if rule_for(n).kind is RuleKind.REDUCTION]
    n_rows, length = g1.batch * g1.m, g1.n
    if (not reductions or reductions[0].outputs[0].size != n_rows or root.outputs[0].size != n_rows * length
            or any(r.inputs[0].size != n_rows * length for r in reductions) or n_rows % ROWS_PER_BLOCK):
        return None
    b = _AttentionBuilder({n.outputs[0]: n for n in nodes if n not in reductions}, g1.c, root.outputs[0])
    b.emit(f"// {n_rows} rows (batch {g1.batch} x {g1.m} queries) of {length} scores, one warp each: "
           f"scores = {g1.alpha!r} * q . k (head size {g1.k}), the row kernel's passes, then p . v")
    b.emit("const int lane = threadIdx.x % 32;")
    b.emit(f"const long long o = (long long)blockIdx.x * {ROWS_PER_BLOCK} + threadIdx.x / 32;")
    b.emit(f"__shared__ float sc_rows[{ROWS_PER_BLOCK * length}];")
    b.emit(f"float* sc = sc_rows + (threadIdx.x / 32) * {length};")
    b.emit(f"const long long rowbase = o * {length};")
    b.emit(f"const long long bq = o / {g1.m}, iq = o % {g1.m};")
    b.declarations = len(b.lines)
    _scores(b, g1)
    b.emit("__syncwarp();")
    passes = _extra_passes(nodes, reductions, (), n_rows, length)
    for k, reduction in enumerate(reductions):
        b.known[reduction.outputs[0]] = _reduce_row(b, reduction, k, 32, passes.get(k, ()))
    _write_row(b, root, length, 32)
    b.emit("__syncwarp();")
    _values(b, g2, root.outputs[0], length)
    b.ops = ["attention", *_name_ops(reductions, b.ops, False)]
    return b.finish("attention", g2.c, n_rows // ROWS_PER_BLOCK, 32 * ROWS_PER_BLOCK)


def _element(g: GemmCall, which: str, batch: str, row: str, col: str) -> tuple[str, str]:
    """(C offset of op(operand)[batch][row][0], step along the contraction) for operand
    'a' (row: an output row, walking k) or 'b' (col: an output column, walking k)."""
    ld, stride = g.layout(which)
    if which == "a":
        return (f"{batch} * {stride}LL + (long long)({row}) * {1 if g.trans_a else ld}", str(ld if g.trans_a else 1))
    return (f"{batch} * {stride}LL + (long long)({col}) * {1 if not g.trans_b else ld}", str(1 if g.trans_b else ld))


def _scores(b: _AttentionBuilder, g1: GemmCall) -> None:
    """Each lane's elements c of row o: alpha * sum_k op(A)[iq][k] * op(B)[k][c]."""
    qa, qb = b.input(g1.a), b.input(g1.b)
    a_base, a_step = _element(g1, "a", "bq", "iq", "")
    b.emit(f"const float* qrow = {qa} + {a_base};")
    b.open(f"for (int c = lane; c < {g1.n}; c += 32)")
    b_base, b_step = _element(g1, "b", "bq", "", "c")
    b.emit(f"const float* kcol = {qb} + {b_base};")
    b.emit("float acc = 0.0f;")
    b.emit(f"for (int k = 0; k < {g1.k}; ++k) acc = fmaf(qrow[k * {a_step}], kcol[k * {b_step}], acc);")
    b.emit(f"sc[c] = {_scaled(g1.alpha, 'acc')};")
    b.close()


def _values(b: _AttentionBuilder, g2: GemmCall, probs: Var, length: int) -> None:
    """Row o's part of the second GEMM: out = sum_j p_j * x_j for each of its columns d,
    x the other operand; written where the GEMM writes it."""
    out = b.output(g2.c)
    ldc, stride_c = g2.layout("c")
    if probs is g2.a:  # result row iq of batch bq: columns d of op(B)
        width, (x_base, x_step) = g2.n, _element(g2, "b", "bq", "", "d")
        target = f"bq * {stride_c}LL + iq * {ldc}LL + d"
        x = b.input(g2.b)
    else:  # probabilities are op(B)^T: result column iq, rows d of op(A)
        width, (x_base, x_step) = g2.m, _element(g2, "a", "bq", "d", "")
        target = f"bq * {stride_c}LL + (long long)d * {ldc} + iq"
        x = b.input(g2.a)
    b.open(f"for (int d = lane; d < {width}; d += 32)")
    b.emit(f"const float* xcol = {x} + {x_base};")
    b.emit("float acc = 0.0f;")
    b.emit(f"for (int j = 0; j < {length}; ++j) acc = fmaf(sc[j], xcol[j * {x_step}], acc);")
    b.emit(f"{out}[{target}] = {_scaled(g2.alpha, 'acc')};")
    b.close()


def _scaled(alpha: float, acc: str) -> str:
    return acc if alpha == 1.0 else f"{float(alpha)!r}f * {acc}"
