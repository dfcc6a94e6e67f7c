"""Sorting kernels: sort (multi-operand, num_keys, stable) and top_k.

Both order the elements of each row (the elements along one axis) by a tuple of
integer keys and then by the element's index in the row, so every order is total and
every sort is stable (which is also a valid unstable sort). Keys:

- sort follows JAX's comparator (`_sort_lt_comparator`): floats compare by their total
  order after -0.0 → +0.0 and every NaN → +NaN, so -inf < … < 0 < … < inf < NaN, zeros
  tie and NaNs tie; integers and bools by value.
- top_k follows XLA (checked against jax.jit on the CPU): descending in the total
  order of the raw bits, so NaN > inf, -NaN < -inf and +0.0 > -0.0; ties go to the
  lower index.

A float's total-order key is its bit pattern with the magnitude bits flipped when the
sign bit is set, read as a signed integer. Half types use their own 16 bits (exact for
NaN payloads), sort keys their value widened to float (exact after canonicalization).

Two kernels:
- rows that fit in shared memory (keys and index of a row padded to a power of two):
  one block per row, a bitonic sort in shared memory, then every output element is
  copied from its source element (payload operands never enter shared memory);
- longer rows: the rank of every element is counted. A block owns one tile of a row
  (its queries, in registers) and walks the row's tiles: each is loaded into shared
  memory, sorted, and each query adds its lower bound in it to its rank; the rank is the
  element's position in the output. top_k stops a block once all its queries rank ≥ k.
  It costs (n / TILE)² tile sorts per row: slow for rows of millions, exact always.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from nimblejax.compiler import dtypes
from nimblejax.compiler.ir import Node, Var
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import MAX_BLOCKS, KernelBuilder
from nimblejax.compiler.lowering.registry import register
from nimblejax.compiler.lowering.task import Kernel

SHARED_BYTES = 48 * 1024  # static shared memory a block may declare
MAX_THREADS = 1024
MAX_TILE = 4096           # elements of a tile in the long-row kernel


def _key_type(var: Var) -> str:
    return "unsigned int" if dtypes.is_unsigned_int(var.dtype) else "int"


def _key(b: KernelBuilder, var: Var, at: str, target: str, raw_total_order: bool) -> None:
    """Emit `target = key(var[at])` (target declared by the caller)."""
    ptr = b.input(var)
    n = dtypes.name(var.dtype)
    if dtypes.is_float(var.dtype) and raw_total_order:
        if n == "float32":
            bits, mask = f"__float_as_int({ptr}[{at}])", "0x7fffffff"
        else:  # the 16 bits, sign-extended
            bits, mask = f"(int)((const short*){ptr})[{at}]", "0x7fff"
        b.emit(f"{{ const int u = {bits}; {target} = u ^ ((u >> 31) & {mask}); }}")
    elif dtypes.is_float(var.dtype):
        b.emit(f"{{ const float f = {dtypes.load(var.dtype, f'{ptr}[{at}]')}; "
               f"const int u = __float_as_int(f); "
               f"{target} = (f != f) ? 0x7fc00000 : (f == 0.0f ? 0 : (u ^ ((u >> 31) & 0x7fffffff))); }}")
    else:
        b.emit(f"{target} = ({_key_type(var)}){ptr}[{at}];")


def _before(num_keys: int, n: int, descending: bool, key: Callable[[int, str], str],
            idx: Callable[[str], str]) -> str:
    """C condition: element a comes before element b. An index ≥ n marks padding,
    which comes after every element (and padding by index)."""
    op = ">" if descending else "<"
    expr = f"{idx('a')} < {idx('b')}"
    for j in reversed(range(num_keys)):
        ka, kb = key(j, "a"), key(j, "b")
        expr = f"({ka} {op} {kb} || ({ka} == {kb} && ({expr})))"
    return f"(({idx('a')} >= {n} || {idx('b')} >= {n}) ? ({idx('a')} < {idx('b')}) : {expr})"


class _Rows:
    """Rows along `axis` of `shape`: row r's element p is at base(r) + p * inner."""

    def __init__(self, shape: tuple[int, ...], axis: int) -> None:
        self.n = shape[axis]
        self.inner = max(1, math.prod(shape[axis + 1:]))
        self.count = math.prod(shape[:axis]) * math.prod(shape[axis + 1:])

    def base(self, row: str, length: int) -> str:
        """Offset of a row's first element in an array of this layout whose axis has
        `length` elements (top_k's outputs have k)."""
        if self.inner == 1:
            return f"{row} * {length}LL"
        return f"({row} / {self.inner}) * {length * self.inner}LL + {row} % {self.inner}"

    def at(self, base: str, pos: str) -> str:
        return f"{base} + (long long)({pos}) * {self.inner}" if self.inner != 1 else f"{base} + {pos}"


def _declare_tile(b: KernelBuilder, keys: list[Var], size: int) -> None:
    for j, k in enumerate(keys):
        b.emit(f"__shared__ {_key_type(k)} sk{j}[{size}];")
    b.emit(f"__shared__ int si[{size}];")


def _load_tile(b: KernelBuilder, keys: list[Var], rows: _Rows, size: int, threads: int,
               first: str, raw: bool) -> None:
    """si[s] = first + s and the keys of that element (padding past the row's end)."""
    b.open(f"for (int s = threadIdx.x; s < {size}; s += {threads})")
    b.emit(f"const int g = {first} + s;")
    b.emit("si[s] = g;")
    b.open(f"if (g < {rows.n})")
    for j, k in enumerate(keys):
        _key(b, k, rows.at("base", "g"), f"sk{j}[s]", raw)
    b.close()
    b.close()
    b.emit("__syncthreads();")


def _bitonic(b: KernelBuilder, num_keys: int, key_types: list[str], n: int, size: int,
             threads: int, descending: bool) -> None:
    """Sort the shared tile (si, sk*) of `size` (a power of two) elements in place."""
    slot = {"a": "y", "b": "x"}  # the condition below: is y before x?
    before = _before(num_keys, n, descending, lambda j, s: f"sk{j}[{slot[s]}]",
                     lambda s: f"si[{slot[s]}]")
    b.open(f"for (int k = 2; k <= {size}; k <<= 1)")
    b.open("for (int j = k >> 1; j > 0; j >>= 1)")
    b.open(f"for (int c = threadIdx.x; c < {size // 2}; c += {threads})")
    b.emit("const int x = 2 * c - (c & (j - 1)), y = x + j;  // pair c: x < y, j apart")
    b.emit("const bool up = (x & k) == 0;")
    b.open(f"if ({before} == up)")
    b.emit("{ const int tmp = si[x]; si[x] = si[y]; si[y] = tmp; }")
    for j in range(num_keys):
        b.emit(f"{{ const {key_types[j]} tmp = sk{j}[x]; sk{j}[x] = sk{j}[y]; sk{j}[y] = tmp; }}")
    b.close()
    b.close()
    b.emit("__syncthreads();")
    b.close()
    b.close()


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fits_shared(n: int, num_keys: int) -> bool:
    return _pow2(n) * 4 * (num_keys + 1) <= SHARED_BYTES


def _copy_out(b: KernelBuilder, pairs, rows: _Rows, pos: str, src: str, out_len: int) -> None:
    """out[row, pos] = in[row, src] for every (output, input) pair."""
    for out, x in pairs:
        dst = rows.at(rows.base("row", out_len), pos)
        b.emit(f"{b.output(out)}[{dst}] = {b.input(x)}[{rows.at('base', src)}];")


def _builder(node: Node) -> KernelBuilder:
    """A kernel over all of the node's outputs and inputs, parameters in that order."""
    b = KernelBuilder()
    b.ops = [node.name]
    for out in node.outputs:
        b.output(out)
    for x in node.inputs:
        b.input(x)
    return b


def _shared_kernel(node: Node, keys: list[Var], rows: _Rows, descending: bool, raw: bool,
                   write) -> Kernel:
    """One block per row: the row sorted in shared memory; `write(b)` stores the
    element of source index `si[p]` at position `p`."""
    size = _pow2(rows.n)
    threads = min(MAX_THREADS, max(32, size // 2))
    b = _builder(node)
    _declare_tile(b, keys, size)
    b.open(f"for (long long row = blockIdx.x; row < {rows.count}; row += gridDim.x)")
    b.emit(f"const long long base = {rows.base('row', rows.n)};")
    _load_tile(b, keys, rows, size, threads, "0", raw)
    _bitonic(b, len(keys), [_key_type(k) for k in keys], rows.n, size, threads, descending)
    write(b, threads)
    b.emit("__syncthreads();  // the next row overwrites the tile")
    b.close()
    return _bounded(b.finish("sort", node.outputs[0], max(1, min(rows.count, MAX_BLOCKS)), threads))


def _rank_kernel(node: Node, keys: list[Var], rows: _Rows, descending: bool, raw: bool,
                 limit: int, write) -> Kernel:
    """Long rows: each element's output position is the number of elements before it.
    A block owns one tile of a row; `write(b, e)` stores query e at position rank[e]
    (only ranks below `limit` are written)."""
    num_keys = len(keys)
    tile = MAX_TILE
    while tile * 4 * (num_keys + 1) > SHARED_BYTES:
        tile //= 2
    threads = min(MAX_THREADS, tile)
    per_thread = tile // threads
    tiles = -(-rows.n // tile)
    key_types = [_key_type(k) for k in keys]
    b = _builder(node)
    _declare_tile(b, keys, tile)
    b.open(f"for (long long w = blockIdx.x; w < {rows.count * tiles}LL; w += gridDim.x)")
    b.emit(f"const long long row = w / {tiles};")
    b.emit(f"const int q = (int)(w % {tiles});")
    b.emit(f"const long long base = {rows.base('row', rows.n)};")
    for j, kt in enumerate(key_types):
        b.emit(f"{kt} qk{j}[{per_thread}];")
    b.emit(f"int qi[{per_thread}], rank[{per_thread}];")
    b.emit("#pragma unroll")
    b.open(f"for (int e = 0; e < {per_thread}; ++e)")
    b.emit(f"qi[e] = q * {tile} + e * {threads} + threadIdx.x;")
    b.emit("rank[e] = 0;")
    b.open(f"if (qi[e] < {rows.n})")
    for j, k in enumerate(keys):
        _key(b, k, rows.at("base", "qi[e]"), f"qk{j}[e]", raw)
    b.close()
    b.close()
    b.open(f"for (int t = 0; t < {tiles}; ++t)")
    if limit < rows.n:  # top_k: stop once every query of this block ranks ≥ k
        b.emit("bool live = false;")
        b.emit("#pragma unroll")
        b.emit(f"for (int e = 0; e < {per_thread}; ++e) live |= qi[e] < {rows.n} && rank[e] < {limit};")
        b.emit("if (!__syncthreads_or(live)) break;")
    _load_tile(b, keys, rows, tile, threads, f"t * {tile}", raw)
    _bitonic(b, num_keys, key_types, rows.n, tile, threads, descending)
    # rank[e] += the lower bound of query e in the sorted tile.
    before = _before(num_keys, rows.n, descending,
                     lambda j, s: f"sk{j}[mid]" if s == "a" else f"qk{j}[e]",
                     lambda s: "si[mid]" if s == "a" else "qi[e]")
    b.emit("#pragma unroll")
    b.open(f"for (int e = 0; e < {per_thread}; ++e)")
    b.open(f"if (qi[e] < {rows.n})")
    b.emit(f"int lo = 0, hi = {tile};")
    b.open("while (lo < hi)")
    b.emit("const int mid = (lo + hi) >> 1;")
    b.emit(f"if ({before}) lo = mid + 1; else hi = mid;")
    b.close()
    b.emit("rank[e] += lo;")
    b.close()
    b.close()
    b.emit("__syncthreads();  // the next tile overwrites this one")
    b.close()
    b.emit("#pragma unroll")
    b.open(f"for (int e = 0; e < {per_thread}; ++e)")
    b.open(f"if (qi[e] < {rows.n} && rank[e] < {limit})")
    write(b)
    b.close()
    b.close()
    b.close()
    grid = max(1, min(rows.count * tiles, MAX_BLOCKS))
    return _bounded(b.finish("sortrank", node.outputs[0], grid, threads))


def _bounded(kernel: Kernel) -> Kernel:
    """Declare the block size, so that the compiler keeps each thread's registers
    within what a block of up to 1024 threads may use (else the launch fails)."""
    threads = kernel.block[0]
    source = kernel.source.replace("__global__ void", f"__global__ void __launch_bounds__({threads})", 1)
    return dataclasses.replace(kernel, source=source)


@register("sort", kind=RuleKind.KERNEL)
def sort(node: Node) -> Kernel:
    """lax.sort: every operand permuted by the lexicographic order of the first
    `num_keys` operands (stable: ties keep their order)."""
    num_keys = int(node.params.get("num_keys", 1))
    x = node.inputs[0]
    axis = int(node.params["dimension"]) % max(1, x.ndim)
    keys = list(node.inputs[:num_keys])
    rows = _Rows(x.shape, axis)
    pairs = list(zip(node.outputs, node.inputs))
    if _fits_shared(rows.n, num_keys):
        def write(b: KernelBuilder, threads: int) -> None:
            b.open(f"for (int p = threadIdx.x; p < {rows.n}; p += {threads})")
            b.emit("const int src = si[p];")
            _copy_out(b, pairs, rows, "p", "src", rows.n)
            b.close()
        return _shared_kernel(node, keys, rows, False, False, write)
    return _rank_kernel(node, keys, rows, False, False, rows.n,
                        lambda b: _copy_out(b, pairs, rows, "rank[e]", "qi[e]", rows.n))


@register("top_k", kind=RuleKind.KERNEL)
def top_k(node: Node) -> Kernel:
    """lax.top_k: the k largest elements of each row (descending, ties to the lower
    index) and their int32 indices."""
    (x,) = node.inputs
    values, indices = node.outputs
    k = int(node.params["k"])
    axis = int(node.params.get("axis", x.ndim - 1)) % x.ndim
    rows = _Rows(x.shape, axis)

    def store(b: KernelBuilder, pos: str, src: str) -> None:
        _copy_out(b, [(values, x)], rows, pos, src, k)
        b.emit(f"{b.output(indices)}[{rows.at(rows.base('row', k), pos)}] = {src};")

    if _fits_shared(rows.n, 1):
        def write(b: KernelBuilder, threads: int) -> None:
            b.open(f"for (int p = threadIdx.x; p < {k}; p += {threads})")
            b.emit("const int src = si[p];")
            store(b, "p", "src")
            b.close()
        return _shared_kernel(node, [x], rows, True, True, write)
    return _rank_kernel(node, [x], rows, True, True, k, lambda b: store(b, "rank[e]", "qi[e]"))
