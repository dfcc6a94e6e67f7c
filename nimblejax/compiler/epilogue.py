"""GEMM epilogues: the elementwise work after a dot_general that cuBLASLt does inside
the GEMM, as XLA folds a dense layer's bias and activation into its GEMM call.

Fusion (fusion.py) asks `find_epilogues` which nodes after each library GEMM
(lowering/gemm.py: is_library_gemm) its call computes; the GEMM's group takes them, so
`relu(x @ w + b)` is one task and no kernel. The chain, every step optional, in the order
cuBLASLt applies them (C = act(alpha * A @ B + R + bias)):

    dot_general → × or ÷ a scalar literal (alpha) → + bias and / or + residual → activation
                → transpose

- bias: a vector of n values added to every row of the GEMM's row-major (batch, m, n)
  output. It is found back through the reshapes and broadcast_in_dims that give it the
  output's rank (`x @ w + b` in jax.numpy and flax.linen.Dense): the GEMM reads the
  vector itself, and those nodes (its `bias_path`) are only copied into the group's
  equations for the CPU interpreter (an LSTM's one broadcast bias serves every step).
- residual: a value of the output's shape that is written anyway (a graph input, or a
  value some library call or kernel reads) and not computed later than the dot's
  operands, read as cuBLASLt's C with beta = 1. `residual - product` (an SGD update
  `p - lr * grad` whose gradient is the product) is the same with alpha negated, where
  no bias came before.
- activation: relu (max(x, 0)) or gelu_tanh (jax.nn.gelu(approximate=True)'s
  equations). The erf GELU (approximate=False; BERT's) is not cuBLASLt's GELU: it stays
  a kernel, after a GEMM that adds the bias.
- transpose: one that permutes only the result's batch, row and column axes so that the
  GEMM can write into its buffer with a leading dimension and one batch stride
  (canonicalize/dot.py: output_layout): the GEMM writes the transposed value, and no
  transpose kernel runs (BERT at batch 1: the attention's p·v, written (S, H, D) for
  the next dense layer). Where only the rows have unit stride there, the GEMM computes
  C^T = op(B)^T op(A)^T (operands swapped), so no bias may come before it (cuBLASLt's
  bias would run along the other axis then). No residual may come before it (cuBLASLt
  reads R with the layout it writes), only views that put in or take out axes of size 1
  (jnp.matmul's squeeze and broadcast of a batch of one). Where the transposed result
  is written contiguous (a swapped 2-D product), a scale, a residual and an activation
  may follow it, but no bias: the weight gradient of `x @ w` is `(dᵀ x)ᵀ` in JAX's
  backward pass, and its SGD update `w - lr * grad` is then one GEMM.
Convolutions (cuDNN's forward call, float32, one group) take a shorter chain:
cudnnConvolutionBiasActivationForward computes relu(conv + residual + bias), with the
bias a vector along the NHWC output's channels, and needs both the bias and relu (its
identity activation works with one algorithm only). So a convolution's chain is a bias,
a residual and relu, in any order up to relu, and it is taken only if it holds a bias and
relu: a batch norm's shift and relu after a convolution whose per-channel scale was
folded into its weights (canonicalize/channel_scales.py). Measured on an H100 at batch
32 (ResNet-50's 3×3 convolutions): conv + a batch-norm-and-relu kernel 78 / 46 / 37 /
42 µs at 56² / 28² / 14² / 7², the fused call 46 / 30 / 28 / 37 µs (53 / 34 / 31 / 38 with
a residual).
Reshapes of the output (views) may sit between the other steps. A value inside the chain
must have its next step as its only use and not be a graph output: it is never written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Optional

import numpy as np

from nimblejax.compiler.canonicalize.dot import MatrixLayout, output_layout
from nimblejax.compiler.epilogue_gelu import gelu_tanh
from nimblejax.compiler.ir import Atom, Graph, Literal, Node, Var
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.gemm import gemm_sizes, is_library_gemm, with_layout
from nimblejax.compiler.lowering.registry import rule_for
from nimblejax.compiler.lowering.task import ConvCall, Epilogue, GemmCall

VIEWS = frozenset({"reshape", "squeeze"})
# Consumers that read a value from its buffer: a residual they read is written anyway.
_READ_FROM_MEMORY = frozenset({RuleKind.GEMM, RuleKind.CUDNN, RuleKind.KERNEL})


@dataclass(frozen=True, eq=False)
class EpilogueMatch:
    """A GEMM's epilogue: the nodes after `dot` its call computes (graph order), the
    nodes that only lay its bias vector out as the add reads it, and the value it writes."""

    dot: Node
    chain: tuple[Node, ...]
    bias_path: tuple[Node, ...]  # nearest the bias add first
    output: Var
    alpha: float = 1.0
    bias: Optional[Var] = None
    residual: Optional[Var] = None
    activation: str = "none"
    bias_add: Optional[Node] = None
    out_layout: Optional[MatrixLayout] = None  # written through a transpose

    @property
    def path_edges(self) -> list[tuple[Var, Node]]:
        """(value, user) from the bias path's first node to the bias add: uses that only
        the group's equations make (the GEMM reads `bias`, the path's input)."""
        users = (self.bias_add, *self.bias_path[:-1])
        return [(p.outputs[0], u) for p, u in zip(self.bias_path, users)]

    @property
    def epilogue(self) -> Epilogue:
        return Epilogue(bias=self.bias is not None, activation=self.activation,
                        residual=self.residual is not None)

    @property
    def label(self) -> str:
        return "+".join(filter(None, (self.epilogue.label(self.alpha),
                                      "transposed" * (self.out_layout is not None))))

    def apply_conv(self, call: ConvCall) -> ConvCall:
        """The convolution's ConvCall with this epilogue, writing the chain's last value."""
        return replace(call, epilogue=self.epilogue, y=self.output, bias=self.bias,
                       residual=self.residual)

    def apply(self, call: GemmCall) -> GemmCall:
        """The dot's GemmCall with this epilogue, writing the chain's last value."""
        call = replace(call, alpha=self.alpha, beta=1.0 if self.residual is not None else 0.0,
                       epilogue=self.epilogue, c=self.output, bias=self.bias,
                       residual=self.residual)
        layout = self.out_layout
        if layout is None:
            return call
        if layout.trans:  # C^T = op(B)^T op(A)^T: the operands swapped, C^T row-major
            call = replace(call, m=call.n, n=call.m, a=call.b, b=call.a,
                           trans_a=not call.trans_b, trans_b=not call.trans_a,
                           lda=call.ldb, ldb=call.lda, stride_a=call.stride_b,
                           stride_b=call.stride_a)
        return with_layout(call, "c", replace(layout, trans=False))


@dataclass
class _Context:
    consumers: Mapping[Var, list[Node]]
    producer: Mapping[Var, Node]
    outputs: frozenset
    depth: Mapping[Node, int]  # longest chain of nodes from the graph's inputs
    claimed: set  # nodes already in an epilogue

    def only_use(self, v: Atom, user: Node) -> bool:
        """v is read by `user` alone, once, and is no graph output."""
        return (isinstance(v, Var) and v not in self.outputs
                and self.consumers.get(v) == [user] and sum(a is v for a in user.inputs) == 1)

    def free(self, node: Optional[Node]) -> bool:
        return node is not None and node not in self.claimed


def find_epilogues(graph: Graph, consumers: Mapping[Var, list[Node]],
                   outputs, small_gemm: bool = True) -> dict[Node, EpilogueMatch]:
    """dot_general or cuDNN convolution node → its epilogue, for the library GEMMs and
    convolutions that have one. With `small_gemm`, small-M dots are generated kernels
    (lowering/gemm_small.py), not library GEMMs: they take no epilogue."""
    producer = {v: n for n in graph.nodes for v in n.outputs}
    depth: dict[Node, int] = {}
    for node in graph.nodes:
        depth[node] = 1 + max((depth[producer[a]] for a in node.inputs if a in producer), default=0)
    ctx = _Context(consumers, producer, frozenset(outputs), depth, set())
    found: dict[Node, EpilogueMatch] = {}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node in ctx.claimed:
            continue
        match = None
        if node.name == "dot_general" and is_library_gemm(node, small_gemm):
            match = _Chain(node, ctx).match()
        elif takes_conv_epilogue(node):
            match = _Chain(node, ctx).match()
            if match is not None and (match.bias is None or match.activation != "relu"):
                match = None  # cuDNN's fused call: a bias and relu, or nothing
        if match is not None:
            match = replace(match, chain=tuple(sorted(match.chain, key=order.__getitem__)))
            ctx.claimed.update(match.chain)
            found[node] = match
    return found


def takes_conv_epilogue(node: Node) -> bool:
    """A float32 forward cuDNN convolution of one group, which
    cudnnConvolutionBiasActivationForward computes with a bias, a residual and relu
    (module docstring: convolutions)."""
    return (node.name == "nimble_cudnn_conv" and node.params["groups"] == 1
            and all(np.dtype(v.dtype) == np.float32 for v in (*node.inputs, *node.outputs)))


class _Chain:
    """The steps after one dot, taken while they match (module docstring's order)."""

    def __init__(self, dot: Node, ctx: _Context) -> None:
        # a convolution's chain: per-channel bias (NHWC: its last axis), residual, relu only
        self.conv = dot.name != "dot_general"
        self.dot, self.ctx = dot, ctx
        self.n = dot.outputs[0].shape[-1] if self.conv else gemm_sizes(dot)[2]
        self.taken: list[Node] = []
        self.alpha, self.activation = 1.0, "none"
        self.bias: Optional[Var] = None
        self.residual: Optional[Var] = None
        self.bias_path: tuple[Node, ...] = ()
        self.bias_add: Optional[Node] = None
        self.out_layout: Optional[MatrixLayout] = None

    def match(self) -> Optional[EpilogueMatch]:
        cur = written = self.dot.outputs[0]  # cur may be a view of `written`, not taken yet
        views: list[Node] = []  # reshapes since the last step: taken only if a step follows
        while True:
            users = self.ctx.consumers.get(cur, [])
            if cur in self.ctx.outputs or not users:
                break
            if len(users) == 1 and users[0].name in VIEWS and users[0].params.get("dimensions") is None \
                    and self.ctx.free(users[0]) and self.ctx.only_use(cur, users[0]):
                views.append(users[0])
                cur = users[0].outputs[0]
                continue
            step = self._step(cur, users, views)
            if step is None:
                break
            self.taken += views + list(step)
            views = []
            cur = written = step[-1].outputs[0]  # a step's last node (dependence order) makes it
        if not self.taken:
            return None
        return EpilogueMatch(self.dot, tuple(self.taken), self.bias_path, written, self.alpha,
                             self.bias, self.residual, self.activation, self.bias_add,
                             self.out_layout)

    def _step(self, cur: Var, users: list[Node], views: list[Node]) -> Optional[tuple[Node, ...]]:
        """The nodes of the next step after cur, recorded, or None. `views`: the
        reshapes between the last step and cur."""
        if self.out_layout is not None and not self._written_contiguous():
            return None
        gemm = not self.conv  # a convolution's chain: no transpose, GELU, scale or subtraction
        transpose = self._transpose_step(cur, views) if gemm and self.out_layout is None else None
        if transpose is not None:
            return transpose
        if len(users) > 1:  # only an activation reads its input several times
            gelu = gelu_tanh(cur, self.ctx) if gemm and self.activation == "none" else None
            if gelu is not None:
                self.activation = "gelu_tanh"
            return gelu
        user, ctx = users[0], self.ctx
        if not (ctx.free(user) and ctx.only_use(cur, user)):
            return None
        if self.activation != "none":  # only the transpose follows the activation
            return None
        other = _other_operand(user, cur)
        scale = _scale(user, cur) if gemm and self.bias is None and self.residual is None else None
        if scale is not None:
            self.alpha *= scale
        elif user.name == "add" and self.bias is None and self.out_layout is None \
                and (found := _bias(other, cur, self.n, ctx)):
            self.bias, self.bias_path = found
            self.bias_add = user
        elif user.name == "add" and self.residual is None and _residual(other, cur, self.dot, ctx):
            self.residual = other
        elif gemm and _subtracted_from(user, cur) and self.bias is None and self.residual is None \
                and _residual(other, cur, self.dot, ctx):
            # r - alpha·A@B: an SGD update `p - lr * grad` of a weight whose gradient is
            # the product. Negating alpha negates only the product (no bias before it).
            self.residual, self.alpha = other, -self.alpha
        elif _is_relu(user, cur):
            self.activation = "relu"
        else:
            return None
        return (user,)

    def _written_contiguous(self) -> bool:
        """The transposed result is written as one contiguous batch of contiguous
        matrices (a swapped 2-D product): a residual, contiguous too, then lines up with
        it (GemmCall reads a residual with C's contiguous layout only)."""
        batch, m, n, _ = gemm_sizes(self.dot)
        rows, cols = (n, m) if self.out_layout.trans else (m, n)
        return self.out_layout.ld == cols and (batch == 1 or self.out_layout.stride == rows * cols)

    def _transpose_step(self, cur: Var, views: list[Node]) -> Optional[tuple[Node, ...]]:
        """A transpose the GEMM writes through (module docstring), reached from cur
        through views that only put in or take out axes of size 1, recorded: those views
        and the transpose; or None."""
        ctx, nodes, v = self.ctx, [], cur
        while True:
            users = ctx.consumers.get(v, [])
            if len(users) != 1 or not (ctx.free(users[0]) and ctx.only_use(v, users[0])):
                return None
            if users[0].name == "transpose":
                break
            if not _unit_view(users[0]):
                return None
            nodes.append(users[0])
            v = users[0].outputs[0]
        transpose = users[0]
        if self.residual is not None or not all(_unit_view(n) for n in views):
            return None
        perm = tuple(int(p) for p in transpose.params["permutation"])
        layout = output_layout(self.dot, perm, v.shape)  # checks the views keep every axis
        if layout is None or (layout.trans and self.bias is not None):
            return None
        self.out_layout = layout
        return (*nodes, transpose)


def _unit_view(node: Node) -> bool:
    """A reshape, squeeze or broadcast_in_dim that only puts in or takes out axes of
    size 1: the same values in the same order."""
    if node.name not in ("reshape", "squeeze", "broadcast_in_dim", "expand_dims") or \
            len(node.inputs) != 1 or not isinstance(node.inputs[0], Var):
        return False
    if node.name == "reshape" and node.params.get("dimensions") is not None:
        return False
    x, y = node.inputs[0], node.outputs[0]
    if node.name == "broadcast_in_dim" and x.size != y.size:
        return False
    return [d for d in x.shape if d != 1] == [d for d in y.shape if d != 1]


def _other_operand(node: Node, cur: Var) -> Optional[Atom]:
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    return b if a is cur else a


def _subtracted_from(node: Node, cur: Var) -> bool:
    """node is r - cur (cur only as the subtrahend)."""
    return node.name == "sub" and len(node.inputs) == 2 and node.inputs[1] is cur \
        and node.inputs[0] is not cur


# ---- alpha ------------------------------------------------------------------------------
def _scale(node: Node, cur: Var) -> Optional[float]:
    """c for cur * c, c * cur or cur / c with c a finite scalar literal."""
    other = _other_operand(node, cur)
    if not isinstance(other, Literal):
        return None
    c = float(other.value)
    if not math.isfinite(c):
        return None
    if node.name == "mul":
        return c
    if node.name == "div" and node.inputs[0] is cur and c != 0.0:
        return 1.0 / c
    return None


# ---- bias and residual --------------------------------------------------------------------
def _bias(e: Optional[Atom], cur: Var, n: int, ctx: _Context) -> Optional[tuple[Var, tuple[Node, ...]]]:
    """(the n-vector, the nodes between it and the add, nearest the add first) when `e`
    adds the same n values to every row of cur (row-major: element t gets vector[t % n]).
    Those nodes may have other uses: they stay where they are and are copied."""
    if not isinstance(e, Var):
        return None
    path: list[Node] = []
    if _row_vector_shape(e.shape, cur.shape, n):
        src = e
    else:
        p = ctx.producer.get(e)
        if (e.shape != cur.shape or not ctx.free(p) or p.name != "broadcast_in_dim"
                or not _broadcast_along_rows(p, cur.shape, n)):
            return None
        src, path = p.inputs[0], [p]
    # Back through rank changes (jnp's (n,) → (1, n)): the same n values in the same order.
    while True:
        p = ctx.producer.get(src)
        if not (ctx.free(p) and _same_values(p)):
            return src, tuple(path)
        path.append(p)
        src = p.inputs[0]


def row_vector(e: Optional[Atom], cur: Var, n: int, producer: Mapping[Var, Node]) -> Optional[Var]:
    """The n values `e` combines with every row of cur (element t with vector[t % n]),
    by the bias add's rule (_bias), or None: canonicalize/channel_scales.py's scale."""
    found = _bias(e, cur, n, _Context({}, producer, frozenset(), {}, set()))
    return found[0] if found else None


def _splits(shape: tuple[int, ...], n: int) -> list[int]:
    """Every k with prod(shape[k:]) == n: the trailing axes that hold a row of n."""
    return [k for k in range(len(shape) + 1) if math.prod(shape[k:]) == n]


def _row_vector_shape(s: tuple[int, ...], shape: tuple[int, ...], n: int) -> bool:
    """An operand of shape s, broadcast to `shape` (rank-preserving, as jaxprs add
    (m, n) + (1, n)), holds one row of n values."""
    return len(s) == len(shape) and any(all(d == 1 for d in s[:k]) and s[k:] == shape[k:]
                                        for k in _splits(shape, n))


def _broadcast_along_rows(node: Node, shape: tuple[int, ...], n: int) -> bool:
    """broadcast_in_dim of n values onto the trailing axes that hold a row."""
    o, dims = node.inputs[0], tuple(node.params["broadcast_dimensions"])
    if len(node.inputs) != 1 or not isinstance(o, Var) or o.size != n:
        return False
    if any(b <= a for a, b in zip(dims, dims[1:])):
        return False
    return any(all(d >= k for d, size in zip(dims, o.shape) if size != 1)
               for k in _splits(shape, n))


def _same_values(node: Node) -> bool:
    """A node whose output holds its input's values in the same row-major order."""
    if len(node.inputs) != 1 or not isinstance(node.inputs[0], Var):
        return False
    if node.name in VIEWS:
        return node.params.get("dimensions") is None
    return node.name == "broadcast_in_dim" and node.inputs[0].size == node.outputs[0].size


def _residual(r: Optional[Atom], cur: Var, dot: Node, ctx: _Context) -> bool:
    """r of cur's shape, in a buffer anyway (reading it in the GEMM costs no extra write)
    and ready about when the dot's operands are: the GEMM waits for it. So of the two
    products in an LSTM step's `x @ w_ih + h @ w_hh`, the recurrent one, on the critical
    path, adds the other (computed off it) rather than waiting for it."""
    if not isinstance(r, Var) or r.shape != cur.shape or r.dtype != cur.dtype:
        return False
    p = ctx.producer.get(r)
    if p is not None and ctx.depth[p] > ctx.depth[dot]:
        return False
    if p is None or r in ctx.outputs or rule_for(p).kind is not RuleKind.ELEMENTWISE:
        return True
    return _read_from_memory(r, ctx)


def _read_from_memory(v: Var, ctx: _Context) -> bool:
    """Some library call or kernel reads v's buffer (through views: a reshape feeding a
    GEMM), so v is written whatever else reads it."""
    for u in ctx.consumers.get(v, []):
        if rule_for(u).kind in _READ_FROM_MEMORY:
            return True
        if u.name in VIEWS and u.params.get("dimensions") is None and _read_from_memory(u.outputs[0], ctx):
            return True
    return False


# ---- activations ----------------------------------------------------------------------------
def _is_relu(node: Node, cur: Var) -> bool:
    other = _other_operand(node, cur)
    return node.name == "max" and isinstance(other, Literal) and float(other.value) == 0.0
