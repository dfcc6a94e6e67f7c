"""Standalone kernels: primitives whose output element needs a branch or a loop over
other elements (concatenate, pad, dynamic slices, scans, argmax). Their inputs are
always materialized buffers."""
from __future__ import annotations


from nimblejax.compiler.ir import Node
from nimblejax.compiler import dtypes
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import BLOCK, Index, KernelBuilder, blocks_for, loop_kernel
from nimblejax.compiler.lowering.registry import register
from nimblejax.compiler.lowering.task import Kernel
from nimblejax.compiler.lowering import xla_reduce_order
from nimblejax.compiler.lowering.elementwise import _FMAX, _FMIN


@register("concatenate", kind=RuleKind.KERNEL)
def concatenate(node: Node) -> Kernel:
    dim = int(node.params["dimension"])
    out = node.outputs[0]

    def body(b: KernelBuilder, idx: Index) -> str:
        b.emit(f"{dtypes.compute_type(out.dtype)} val;")
        start = 0
        for k, x in enumerate(node.inputs):
            src = list(idx)
            src[dim] = f"({idx[dim]} - {start})" if start else idx[dim]
            load = f"val = {b.load(x, tuple(src))};"
            if k == len(node.inputs) - 1:
                b.emit(f"else {{ {load} }}" if k else load)
            else:
                b.emit(f"{'else ' if k else ''}if ({idx[dim]} < {start + x.shape[dim]}) {{ {load} }}")
            start += x.shape[dim]
        return "val"

    return loop_kernel("concat", out, ["concatenate"], body)


@register("pad", kind=RuleKind.KERNEL)
def pad(node: Node) -> Kernel:
    x, pad_value = node.inputs
    out = node.outputs[0]

    def body(b: KernelBuilder, idx: Index) -> str:
        pv = b.value(pad_value, ())
        conds, src = [], []
        for d, ((lo, _hi, interior), i) in enumerate(zip(node.params["padding_config"], idx)):
            t = b.tmp("int", f"{i} - ({int(lo)})")
            step = int(interior) + 1
            conds.append(f"{t} >= 0")
            if step > 1:
                conds.append(f"{t} % {step} == 0")
                t = f"({t} / {step})"
            conds.append(f"{t} < {x.shape[d]}")
            src.append(t)
        inside = " && ".join(conds) or "true"
        # The ternary evaluates the load only when the index is inside the operand.
        return b.tmp(dtypes.compute_type(out.dtype), f"({inside}) ? {b.load(x, tuple(src))} : {pv}")

    return loop_kernel("pad", out, ["pad"], body)


def _clamped_starts(b: KernelBuilder, starts, limits) -> list[str]:
    # XLA clamps dynamic start indices so the slice stays inside the operand.
    out = []
    for s, limit in zip(starts, limits):
        v = b.value(s, ())
        out.append(b.tmp("int", f"min(max((int){v}, 0), {int(limit)})"))
    return out


@register("dynamic_slice", kind=RuleKind.KERNEL)
def dynamic_slice(node: Node) -> Kernel:
    x, *starts = node.inputs
    out = node.outputs[0]
    sizes = node.params["slice_sizes"]

    def body(b: KernelBuilder, idx: Index) -> str:
        s = _clamped_starts(b, starts, [x.shape[d] - sizes[d] for d in range(x.ndim)])
        return b.load(x, tuple(f"({a} + {i})" for a, i in zip(s, idx)))

    return loop_kernel("dynslice", out, ["dynamic_slice"], body)


@register("dynamic_update_slice", kind=RuleKind.KERNEL)
def dynamic_update_slice(node: Node) -> Kernel:
    x, upd, *starts = node.inputs
    out = node.outputs[0]

    def body(b: KernelBuilder, idx: Index) -> str:
        s = _clamped_starts(b, starts, [x.shape[d] - upd.shape[d] for d in range(x.ndim)])
        t = [b.tmp("int", f"{i} - {a}") for a, i in zip(s, idx)]
        inside = " && ".join(f"{ti} >= 0 && {ti} < {n}" for ti, n in zip(t, upd.shape)) or "true"
        return b.tmp(dtypes.compute_type(out.dtype),
                     f"({inside}) ? {b.load(upd, tuple(t))} : {b.load(x, idx)}")

    return loop_kernel("dynupdate", out, ["dynamic_update_slice"], body)


# jnp.logaddexp: max + log1p(exp(-|a - b|)); where a - b is NaN (equal infinities, or a
# NaN operand) it is a + b, so inf stays inf and -inf stays -inf.
_LOGADDEXP = ("(({a} - {b}) != ({a} - {b}) ? ({a} + {b}) : "
              "fmaxf({a}, {b}) + log1pf(expf(-fabsf({a} - {b}))))")
SCANS = {"cumsum": ("({a} + {b})", lambda d: dtypes.literal(0, d)),
         "cumprod": ("({a} * {b})", lambda d: dtypes.literal(1, d)),
         "cummax": (_FMAX, dtypes.lowest), "cummin": (_FMIN, dtypes.highest),
         "cumlogsumexp": (_LOGADDEXP, dtypes.lowest)}


@register(*SCANS, kind=RuleKind.KERNEL)
def cumulative(node: Node) -> Kernel:
    """One thread per line along `axis`, a serial scan (in the compute type)."""
    x, out = node.inputs[0], node.outputs[0]
    axis, reverse = int(node.params["axis"]), bool(node.params["reverse"])
    combine, init = SCANS[node.name]
    if not dtypes.is_float(out.dtype) and node.name in ("cummax", "cummin"):
        combine = "max({a}, {b})" if node.name == "cummax" else "min({a}, {b})"
    n = x.shape[axis]
    inner = 1
    for d in x.shape[axis + 1:]:
        inner *= d
    lines = max(1, x.size // max(n, 1))
    ctype = dtypes.compute_type(out.dtype)
    b = KernelBuilder()
    b.ops = [node.name]
    b.input(x)
    b.output(out)
    b.open(f"for (long long line = blockIdx.x * (long long)blockDim.x + threadIdx.x; "
           f"line < {lines}; line += (long long)gridDim.x * blockDim.x)")
    b.emit(f"const long long base = (line / {inner}) * {n * inner} + line % {inner};")
    b.emit(f"{ctype} acc = {init(out.dtype)};")
    b.open(f"for (int k = 0; k < {n}; ++k)")
    b.emit(f"const long long at = base + (long long)({f'{n - 1} - k' if reverse else 'k'}) * {inner};")
    b.emit(f"{ctype} v = {dtypes.load(x.dtype, f'{b.input(x)}[at]')};")
    # Halves accumulate in float and round only what they store, as XLA's fused scan
    # does (rounding the running sum each step drifts: 9600 bf16 values summed to -34
    # where jax.jit gives -24.25).
    b.emit(f"acc = {combine.format(a='acc', b='v')};")
    b.store(out, "at", "acc")
    b.close()
    b.close()
    return b.finish("scan", out, blocks_for(lines), BLOCK)


@register("argmax", "argmin", kind=RuleKind.KERNEL)
def argminmax(node: Node) -> Kernel:
    """One warp per output; the lowest index of the best value, or, where the reduced
    row holds a NaN, the NaN that XLA's GPU reduction returns.

    JAX's reducer lets a NaN win and, between two NaNs, its first operand; which NaN
    comes out depends on how XLA's fusion combines the row (xla_reduce_order.py). That
    is the NaN of lowest `nan_rank`, so each lane keeps two things that combine in any
    order: the best non-NaN value with its lowest index, and the NaN of lowest rank."""
    x, out = node.inputs[0], node.outputs[0]
    (axis,) = node.params["axes"]
    cmp = ">" if node.name == "argmax" else "<"
    kept = [d for d in range(x.ndim) if d != axis]
    n_out, n_red = out.size, x.shape[axis]
    # Warp shuffles do not take bool, so booleans compare as int.
    ctype = "int" if dtypes.name(x.dtype) == "bool" else dtypes.compute_type(x.dtype)
    is_float = dtypes.is_float(x.dtype)
    warps = BLOCK // 32
    none = "2147483647"
    b = KernelBuilder()
    b.ops = [node.name]
    b.emit("const int lane = threadIdx.x % 32;")
    b.open(f"for (long long o = (long long)blockIdx.x * {warps} + threadIdx.x / 32; o < {n_out}; "
           f"o += (long long)gridDim.x * {warps})")
    out_idx = b.index_vars("o", [x.shape[d] for d in kept])
    b.emit(f"{ctype} av = 0; int ai = {none};")
    if is_float:
        order = xla_reduce_order.arrangement_for(x.shape, axis, x.dtype)
        b.emit("long long nr = 9223372036854775807LL; int ni = 0;")
    b.open(f"for (int r = lane; r < {n_red}; r += 32)")
    full = list(out_idx)
    full.insert(axis, "r")
    b.emit(f"const {ctype} bv = {b.load(x, tuple(full))};")
    if is_float:
        b.open("if (bv != bv)")
        rank = xla_reduce_order.emit_nan_rank(b.tmp, order, n_red, "r")
        b.emit(f"if ({rank} < nr) {{ nr = {rank}; ni = r; }}")
        b.close()
        b.emit(f"else if (ai == {none} || bv {cmp} av) {{ av = bv; ai = r; }}")
    else:
        b.emit(f"if (ai == {none} || bv {cmp} av) {{ av = bv; ai = r; }}")
    b.close()
    b.open("for (int off = 16; off > 0; off >>= 1)")
    b.emit(f"const {ctype} bv = __shfl_down_sync(0xffffffffu, av, off);")
    b.emit("const int bi = __shfl_down_sync(0xffffffffu, ai, off);")
    b.emit(f"if (bi != {none} && (ai == {none} || bv {cmp} av || (bv == av && bi < ai))) "
           "{ av = bv; ai = bi; }")
    if is_float:
        b.emit("const long long br = __shfl_down_sync(0xffffffffu, nr, off);")
        b.emit("const int bn = __shfl_down_sync(0xffffffffu, ni, off);")
        b.emit("if (br < nr) { nr = br; ni = bn; }")
    b.close()
    b.open("if (lane == 0)")
    result = "(nr != 9223372036854775807LL ? ni : ai)" if is_float else "ai"
    b.store(out, "o", f"({dtypes.compute_type(out.dtype)}){result}")
    b.close()
    b.close()
    return b.finish("arg", out, blocks_for(n_out * 32), BLOCK)
