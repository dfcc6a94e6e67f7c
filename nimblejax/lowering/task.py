"""Tasks: the unit of GPU work a plan is made of."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nimblejax.ir import Node, Var


@dataclass(frozen=True)
class Kernel:
    """A generated CUDA C kernel. Its pointer arguments are `params`, in order."""

    name: str
    source: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    params: tuple[Var, ...]


@dataclass(frozen=True)
class GemmCall:
    """C[b] (m×n, row-major) = op(A[b]) @ op(B[b]); see runtime.cublas for the layout."""

    batch: int
    m: int
    n: int
    k: int
    trans_a: bool
    trans_b: bool
    in_dtype: str
    out_dtype: str
    compute: str  # 'f32' (full float32) or 'tf32' (XLA's default for float32 dots)
    a: Var
    b: Var
    c: Var


@dataclass(frozen=True)
class CudnnConv:
    """y (N,OH,OW,K) = conv(x (N,H,W,C), w (K,R,S,C/G)), NHWC/KRSC, symmetric padding."""

    padding: tuple[int, int]
    strides: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    math: str  # 'tf32' | 'f32' | 'half'
    x: Var
    w: Var
    y: Var


@dataclass(frozen=True, eq=False)
class Task:
    """What a unit of work reads and writes, how it launches, and the equations it
    stands for (so the CPU plan interpreter can run it with JAX)."""

    name: str
    kind: str  # 'kernel' | 'gemm' | 'cudnn' | 'view'
    inputs: tuple[Var, ...]
    outputs: tuple[Var, ...]
    eqns: tuple[Node, ...]
    kernel: Optional[Kernel] = None
    gemm: Optional[GemmCall] = None
    cudnn: Optional[CudnnConv] = None

    @property
    def source(self) -> str:
        return self.eqns[-1].source if self.eqns else "<unknown>"

    def __repr__(self) -> str:
        return f"Task({self.name})"
