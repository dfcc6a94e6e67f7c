"""Tasks: the unit of GPU work a plan is made of."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from nimblejax.compiler.ir import Node, Var
from nimblejax.compiler.kinds import TaskKind


@dataclass(frozen=True)
class Kernel:
    """A generated CUDA C kernel. Its pointer arguments are `params`, in order, then its
    `scalars` as `long long` arguments (KernelBuilder.hoist: an unrolled loop's step reads
    its slice at an offset passed in, so every step is one source, compiled once).

    `pre`: kernels launched before this one on the same stream, with the same `params`
    (a scatter first computes or copies its operand into its output: a grid-wide step)."""

    name: str
    source: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    params: tuple[Var, ...]
    pre: tuple["Kernel", ...] = ()
    scalars: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert all(k.params == self.params and k.scalars == self.scalars for k in self.pre), self.name

    @property
    def n_args(self) -> int:
        """Its 8-byte launch arguments: the pointers, then the scalars."""
        return len(self.params) + len(self.scalars)

    @property
    def launches(self) -> tuple["Kernel", ...]:
        """Every kernel this one stands for, in launch order."""
        return (*self.pre, self)


# Library calls: one record per call kind. Each carries the plan-time decision (the
# problem the library solves, with its dtypes and math mode) and the operands it runs on.
# Equality and hashing ignore the operands, so a record is also the key under which the
# runtime caches the algorithm it measured for that problem.
GEMM_DTYPES = ("float32", "float16", "bfloat16")
GEMM_COMPUTE = {"float32": ("f32", "tf32"), "float16": ("f32_from_half",),
                "bfloat16": ("f32_from_half",)}
_INT32_MAX = 2**31 - 1
_LAYOUT_FIELDS = ("lda", "ldb", "ldc", "stride_a", "stride_b", "stride_c")
# Activations cuBLASLt applies in a GEMM's epilogue. Its GELU is the tanh approximation
# (jax.nn.gelu(approximate=True)); the erf form is not among them.
GEMM_ACTIVATIONS = ("none", "relu", "gelu_tanh")


@dataclass(frozen=True)
class Epilogue:
    """What a GEMM computes on its product before writing C (compiler/epilogue.py):
    C = activation(alpha * op(A) @ op(B) + beta * R + bias), where `residual` says an
    operand R of C's shape is added (beta = 1) and `bias` a vector of length n added to
    every row of C."""

    bias: bool = False
    activation: str = "none"
    residual: bool = False

    def __post_init__(self) -> None:
        if self.activation not in GEMM_ACTIVATIONS:
            raise ValueError(f"Epilogue.activation={self.activation!r}; "
                             f"expected one of {list(GEMM_ACTIVATIONS)}")

    @property
    def parts(self) -> tuple[str, ...]:
        """The steps in the order cuBLASLt applies them, activation last."""
        steps = ("residual",) * self.residual + ("bias",) * self.bias
        return steps + ((self.activation,) if self.activation != "none" else ())

    def __bool__(self) -> bool:
        return bool(self.parts)

    def label(self, alpha: float = 1.0) -> str:
        """For reports: 'scale+bias+gelu_tanh' ('' for none), alpha a scale of the product."""
        return "+".join(("scale",) * (alpha != 1.0) + self.parts)


@dataclass(frozen=True)
class GemmCall:
    """Row-major batched GEMM: C[b] (m x n) = op(A[b]) @ op(B[b]).

    A[b] is stored row-major as (m, k), or (k, m) when trans_a; B[b] as (k, n), or
    (n, k) when trans_b; C[b] as (m, n). Each is read (written) with a leading dimension
    (elements from one stored row to the next) and a batch stride (elements from one
    batch entry to the next): `lda`/`stride_a` and so on, None for a contiguous batch
    of contiguous matrices. Strides let a GEMM read an operand, or write its result,
    through a transpose that only permutes batch, row and column axes (BERT's attention
    heads at batch 1: compiler/canonicalize/dot.py, compiler/epilogue.py).
    compute: 'f32' (full float32) or 'tf32' (XLA's default for float32 dots) for
    float32, 'f32_from_half' for float16/bfloat16. out_dtype: C's dtype when it
    differs from the inputs' (bf16 x bf16 -> f32). epilogue: what is added and applied
    before C is written (cuBLASLt only); `bias` (n values of C's dtype) and `residual`
    (C's shape and dtype, read with beta = 1) are its operands. Without a residual, a
    beta != 0 reads C itself.
    """

    batch: int
    m: int
    n: int
    k: int
    trans_a: bool
    trans_b: bool
    dtype: str
    compute: str
    alpha: float = 1.0
    beta: float = 0.0
    out_dtype: Optional[str] = None
    epilogue: Epilogue = Epilogue()
    a: Optional[Var] = field(default=None, compare=False, repr=False)
    b: Optional[Var] = field(default=None, compare=False, repr=False)
    c: Optional[Var] = field(default=None, compare=False, repr=False)
    bias: Optional[Var] = field(default=None, compare=False, repr=False)
    residual: Optional[Var] = field(default=None, compare=False, repr=False)
    lda: Optional[int] = None
    ldb: Optional[int] = None
    ldc: Optional[int] = None
    stride_a: Optional[int] = None
    stride_b: Optional[int] = None
    stride_c: Optional[int] = None

    def __post_init__(self) -> None:
        self._check_problem()
        self._check_layouts()

    def _check_layouts(self) -> None:
        for which in "abc":
            rows, cols = self.stored(which)
            ld, stride = getattr(self, f"ld{which}"), getattr(self, f"stride_{which}")
            if ld is not None and not cols <= ld <= _INT32_MAX:
                raise ValueError(f"GemmCall.ld{which}={ld} must be at least the stored row "
                                 f"length {cols}")
            if stride is not None and not 0 <= stride < 2**62:
                raise ValueError(f"GemmCall.stride_{which}={stride} must be >= 0")
        if self.residual is not None and (self.ldc is not None or self.stride_c is not None):
            raise ValueError("GemmCall: a residual is read with C's contiguous layout only")

    def _check_problem(self) -> None:
        for name in ("batch", "m", "n", "k"):
            if not 1 <= getattr(self, name) <= _INT32_MAX:
                raise ValueError(f"GemmCall.{name}={getattr(self, name)} must be in [1, 2**31)")
        if self.dtype not in GEMM_DTYPES:
            raise ValueError(f"GemmCall.dtype={self.dtype!r}; expected one of {list(GEMM_DTYPES)}")
        if self.out_dtype is not None and self.out_dtype not in GEMM_DTYPES:
            raise ValueError(f"GemmCall.out_dtype={self.out_dtype!r}; expected one of {list(GEMM_DTYPES)}")
        if self.compute not in GEMM_COMPUTE[self.dtype]:
            raise ValueError(f"GemmCall.compute={self.compute!r} invalid for dtype {self.dtype!r}; "
                             f"expected one of {list(GEMM_COMPUTE[self.dtype])}")
        if self.epilogue.residual and self.beta != 1.0:
            raise ValueError(f"GemmCall with a residual epilogue needs beta=1.0, got {self.beta}")
        if self.c is not None:  # operands given: the epilogue's are there exactly when used
            for name in ("bias", "residual"):
                if getattr(self.epilogue, name) != (getattr(self, name) is not None):
                    raise ValueError(f"GemmCall.{name} operand must be given exactly when "
                                     f"the epilogue has one ({self.epilogue})")

    @property
    def label(self) -> str:
        """The epilogue for reports: 'scale+bias+gelu_tanh', '' for a plain GEMM;
        '+strided' where an operand or the result is read or written with strides."""
        return "+".join(filter(None, (self.epilogue.label(self.alpha),
                                      "strided" * self.strided)))

    def __repr__(self) -> str:
        """As the dataclass's, without the layout fields left contiguous (None)."""
        shown = (f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr
                 and not (f.name in _LAYOUT_FIELDS and getattr(self, f.name) is None))
        return f"GemmCall({', '.join(shown)})"

    @property
    def strided(self) -> bool:
        return any(getattr(self, f) is not None for f in _LAYOUT_FIELDS)

    def stored(self, which: str) -> tuple[int, int]:
        """(rows, cols) of operand 'a', 'b' or 'c' as stored row-major."""
        return {"a": (self.k, self.m) if self.trans_a else (self.m, self.k),
                "b": (self.n, self.k) if self.trans_b else (self.k, self.n),
                "c": (self.m, self.n)}[which]

    def layout(self, which: str) -> tuple[int, int]:
        """(leading dimension, batch stride) of operand 'a', 'b' or 'c', in elements."""
        rows, cols = self.stored(which)
        ld, stride = getattr(self, f"ld{which}"), getattr(self, f"stride_{which}")
        return (cols if ld is None else ld), (rows * cols if stride is None else stride)

    def extent(self, which: str) -> int:
        """Elements from the first to one past the last that operand `which` touches."""
        rows, cols = self.stored(which)
        ld, stride = self.layout(which)
        return (self.batch - 1) * stride + (rows - 1) * ld + cols

    @property
    def a_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.k, self.m) if self.trans_a else (self.batch, self.m, self.k)

    @property
    def b_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.n, self.k) if self.trans_b else (self.batch, self.k, self.n)

    @property
    def c_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.m, self.n)

    @property
    def operands(self) -> tuple[Optional[Var], ...]:
        """a, b, c, bias, residual (None where the epilogue has none)."""
        return self.a, self.b, self.c, self.bias, self.residual


@dataclass(frozen=True)
class ConvCall:
    """y (N,OH,OW,K) NHWC = conv(x (N,H,W,C) NHWC, w (K,R,S,C/G) KRSC), symmetric
    padding: a cuDNN forward convolution (mode 'forward': reads x and w, writes y), its
    filter gradient (mode 'filter_grad': reads x and y, the output gradient, writes w) or
    its input gradient (mode 'data_grad': reads w and y, writes x). math: 'tf32' | 'f32'
    | 'half'."""

    x_shape: tuple[int, int, int, int]
    w_shape: tuple[int, int, int, int]
    y_shape: tuple[int, int, int, int]
    padding: tuple[int, int]
    strides: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    dtype: str
    out_dtype: str
    math: str
    mode: str = "forward"
    # A forward convolution's epilogue (compiler/epilogue.py): y = relu(conv + residual +
    # bias), bias a vector of K values, as cudnnConvolutionBiasActivationForward computes
    # it (bias and relu always together: cuDNN's identity activation binds the algorithm).
    epilogue: Epilogue = Epilogue()
    x: Optional[Var] = field(default=None, compare=False, repr=False)
    w: Optional[Var] = field(default=None, compare=False, repr=False)
    y: Optional[Var] = field(default=None, compare=False, repr=False)
    bias: Optional[Var] = field(default=None, compare=False, repr=False)
    residual: Optional[Var] = field(default=None, compare=False, repr=False)

    @property
    def operands(self) -> tuple[Optional[Var], ...]:
        """x, w, y, bias, residual (None where the epilogue has none)."""
        return self.x, self.w, self.y, self.bias, self.residual

    @property
    def label(self) -> str:
        return self.epilogue.label()


@dataclass(frozen=True, eq=False)
class Task:
    """What a unit of work reads and writes, how it launches, and the equations it
    stands for (so the CPU plan interpreter can run it with JAX)."""

    name: str
    kind: TaskKind
    inputs: tuple[Var, ...]
    outputs: tuple[Var, ...]
    eqns: tuple[Node, ...]
    kernel: Optional[Kernel] = None
    # The GEMM a GEMM task calls the library for; on a KERNEL task, the GEMM its generated
    # kernel computes (lowering/gemm_tc.py), for passes that look for GEMMs (attention.py).
    gemm: Optional[GemmCall] = None
    conv: Optional[ConvCall] = None
    # (output, input) pairs: the output is computed in the input's bytes (a scatter that
    # is the last reader of its operand updates it in place); the plan gives them one
    # buffer.
    aliases: tuple[tuple[Var, Var], ...] = ()
    # A WHILE or SWITCH task's sub-plans: a LoopCall or SwitchCall (compiler/loops.py).
    control: Optional[Any] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", TaskKind(self.kind))  # a string is checked

    @property
    def source(self) -> str:
        return self.eqns[-1].source if self.eqns else "<unknown>"

    def __repr__(self) -> str:
        return f"Task({self.name})"
