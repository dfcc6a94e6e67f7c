"""Indexing kernels: gather and the scatter family (scatter, scatter-add/-mul/-min/-max).

Semantics are XLA's (jax/_src/lax/slicing.py):
- gather clamps every start index into [0, operand_dim - slice_size] (modes CLIP and
  PROMISE_IN_BOUNDS); FILL_OR_DROP gives `fill_value` for a whole slice whose start
  vector is out of that range (`_gather_fill`).
- scatter with mode CLIP clamps start indices the same way (`_clamp_scatter_indices`);
  FILL_OR_DROP and PROMISE_IN_BOUNDS drop a whole update window whose start vector is
  out of range (XLA's native scatter).
`indices_are_sorted` and `unique_indices` are hints and change nothing here.

Gather is fusible ("elementwise"): its output at an index is the operand at an index
computed from the start indices, so an embedding lookup or `x[idx]` runs at copy speed
and fuses with its consumers. A scatter is two launches of one task with the same
parameters: the operand into the output, then one thread per update element combining
it in (atomics for the combining ops; a float scatter-add therefore sums in an order
that differs from XLA's, equal within float rounding). Elementwise producers of the
operand, the indices and the updates are fused into it (fusion.py, `fuses`): the first
launch computes the operand where it would copy it (`zeros((vocab, dim)).at[ids].add(g)`,
an embedding's gradient, writes the table once: a 16-byte fill, no zero buffer, no
copy), the second reads the indices and updates through their producers. On Hopper a
scatter-add along the operand's rows takes 2 or 4 neighbouring elements per thread and
one vector atomic (float2/float4, half2, bfloat162). A scatter that is the only reader of
an operand buffer the plan writes itself (a GEMM's output, another scatter's) updates
it in place: the second launch alone (fusion.py `_in_place`, `Task.aliases`).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from nimblejax.compiler.ir import Literal, Node, Var
from nimblejax.compiler import dtypes
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import (BLOCK, UNROLL, UNROLL_MIN, Index,
                                                 KernelBuilder, blocks_for, kernel_name, linear,
                                                 loop_body, with_prelude)
from nimblejax.compiler.lowering.elementwise import _FMAX, _FMIN
from nimblejax.compiler.lowering.registry import register
from nimblejax.compiler.lowering.task import Kernel


def _mode(node: Node) -> str:
    """'clip', 'fill' or 'promise' from the GatherScatterMode param (any JAX version)."""
    name = str(node.params.get("mode")).upper()
    if "FILL" in name:
        return "fill"
    return "clip" if "CLIP" in name else "promise"


def _start(b: KernelBuilder, indices: Var, batch: Index, k: int) -> str:
    """Start index k of the index vector at `batch` (indices' last axis is the vector)."""
    v = b.value(indices, tuple(batch) + (str(k),))
    return b.tmp("long long", f"(long long){v}")


# ---- gather ----------------------------------------------------------------------------
@register("gather", kind=RuleKind.ELEMENTWISE)
def gather(b: KernelBuilder, node: Node, idx: Index) -> str:
    operand, indices = node.inputs
    out = node.outputs[0]
    dn = node.params["dimension_numbers"]
    sizes = tuple(int(s) for s in node.params["slice_sizes"])
    offset_dims = tuple(dn.offset_dims)
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
    batch = [idx[d] for d in range(out.ndim) if d not in offset_dims]
    offsets = iter(idx[d] for d in offset_dims)
    mode = _mode(node)
    starts, conds = {}, []
    for k, d in enumerate(dn.start_index_map):
        v, upper = _start(b, indices, batch, k), operand.shape[d] - sizes[d]
        if mode == "fill":
            conds.append(f"{v} >= 0 && {v} <= {upper}")
        # Clamped in every mode: a masked-off lane still loads in bounds.
        starts[d] = b.tmp("int", f"(int)min(max({v}, 0LL), {upper}LL)")
    src = []
    for d in range(operand.ndim):
        if d in batching:
            src.append(batch[idx_batching[batching.index(d)]])
            continue
        off = "0" if d in dn.collapsed_slice_dims else next(offsets)
        start = starts.get(d)
        src.append(off if start is None else (start if off == "0" else f"({start} + {off})"))
    value = b.value(operand, tuple(src))
    if not conds:
        return value
    fill = _fill_value(node.params.get("fill_value"), out.dtype)
    return b.tmp(dtypes.compute_type(out.dtype), f"(({' && '.join(conds)}) ? {value} : {fill})")


def _fill_value(value, dtype) -> str:
    """gather's FILL_OR_DROP default: NaN, the lowest signed or highest unsigned int, True."""
    if value is None:
        if dtypes.is_float(dtype):
            value = np.nan
        elif dtypes.name(dtype) == "bool":
            value = True
        elif dtypes.is_unsigned_int(dtype):
            value = np.iinfo(dtype).max
        else:
            value = np.iinfo(dtype).min
    return dtypes.literal(value, dtype)


# ---- scatter ---------------------------------------------------------------------------
SCATTERS = ("scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max")
# Hopper adds vector atomics (float2/float4 adds; half2/bfloat162 adds are native there):
# a scatter-add whose windows run along the operand's rows combines this many
# neighbouring elements per atomic. Older GPUs take the one-element loop.
_VECTOR_ARCH = 900
_VECTOR = {"float32": (4, 2), "float16": (2,), "bfloat16": (2,)}


@register(*SCATTERS, kind=RuleKind.KERNEL, fuses=(0, 1, 2), in_place=0)
def scatter(node: Node, inlined: Mapping[Var, Node] = {}, in_place: bool = False) -> Kernel:
    """Two launches of one task, with the same parameters: the operand computed (its
    elementwise producers `inlined`: `zeros(...)` is a fill, never a buffer) or copied
    into the output, then one thread per update element (or per few neighbouring
    ones) combining it in. The indices' and updates' producers are computed where they
    are read. `in_place` (the scatter is the last reader of its operand's buffer, which
    the output then shares: fusion.py): the second launch alone."""
    out = node.outputs[0]
    params = _materialized(node, inlined, in_place)
    combine, grid, helper = _combine_kernel(node, inlined, params)
    if in_place:
        name = kernel_name("scatter", combine.ops, out.dtype, "in place\n" + combine.text(helper))
        return Kernel(name, with_prelude(combine.text(helper).replace("NAME", name, 1)), (grid, 1, 1),
                      (BLOCK, 1, 1), combine.params())
    init, init_grid = _init_kernel(node, inlined, params)
    main_text, init_text = combine.text(helper), init.text()
    # Both texts in the hash: two scatters may share a combine and differ in their init.
    name = kernel_name("scatter", combine.ops, out.dtype, main_text + init_text)
    first = Kernel(name + "_init", with_prelude(init_text.replace("NAME", name + "_init", 1)),
                   (init_grid, 1, 1), (BLOCK, 1, 1), init.params())
    return Kernel(name, with_prelude(main_text.replace("NAME", name, 1)), (grid, 1, 1),
                  (BLOCK, 1, 1), combine.params(), pre=(first,))


def _materialized(node: Node, inlined: Mapping[Var, Node], in_place: bool) -> tuple[Var, ...]:
    """The buffers the scatter reads, its fused producers' inputs in their place, in
    the order operand (not read when in place), indices, updates (the parameters of
    both launches)."""
    found: list[Var] = []
    seen: set = set()

    def visit(a) -> None:
        if not isinstance(a, Var) or a in seen:
            return
        seen.add(a)
        producer = inlined.get(a)
        if producer is None:
            found.append(a)
            return
        for x in producer.inputs:
            visit(x)

    for a in node.inputs[1:] if in_place else node.inputs:
        visit(a)
    return tuple(found)


def _builder(node: Node, inlined: Mapping[Var, Node], params: tuple[Var, ...]) -> KernelBuilder:
    """Both kernels of a scatter take the same parameters, in the same order."""
    b = KernelBuilder(inlined)
    b.ops = [node.name.replace("-", "_")]  # kernel names are C identifiers
    b.output(node.outputs[0])
    for v in params:
        b.input(v)
    return b


def _grid_stride(b: KernelBuilder, n: int) -> None:
    """Open `for (i ...)`: a grid-stride loop over [0, n)."""
    itype = "long long" if n >= 2 ** 30 else "int"
    b.open(f"for ({itype} i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < {n}; "
           f"i += (long long)gridDim.x * blockDim.x)")


def _init_kernel(node: Node, inlined: Mapping[Var, Node], params) -> tuple[KernelBuilder, int]:
    """The first launch: the output set to the operand (one write of the output). A
    materialized operand is copied 16 bytes a thread; a uniform one (a broadcast scalar:
    zeros, full) is stored 16 bytes a thread; any other fused operand is computed by the
    elementwise loop."""
    operand, out = node.inputs[0], node.outputs[0]
    b = _builder(node, inlined, params)
    vec = out.nbytes % 16 == 0  # arena offsets are 256-byte aligned
    if isinstance(operand, Var) and operand not in inlined:
        o, x = b.outputs[out], b.inputs[operand]
        n = out.nbytes // 16 if vec else out.size
        if vec:
            o, x = f"((uint4*){o})", f"((const uint4*){x})"
        _grid_stride(b, n)
        b.emit(f"{o}[i] = {x}[i];")
        b.close()
        return b, blocks_for(n)
    scalar = _uniform(operand, inlined)
    if scalar is not None and vec:
        n = out.nbytes // 16
        word = _replicated_word(b, out.dtype, b.value(scalar, ("0",) * getattr(scalar, "ndim", 0)))
        b.emit("uint4 q;")
        b.emit(f"q.x = {word}; q.y = {word}; q.z = {word}; q.w = {word};")
        _grid_stride(b, n)
        b.emit(f"((uint4*){b.outputs[out]})[i] = q;")
        b.close()
        return b, blocks_for(n)
    unroll = UNROLL if out.size >= UNROLL_MIN else 1
    return b, loop_body(b, out, lambda b, idx: b.value(operand, idx), unroll)


def _uniform(operand, inlined: Mapping[Var, Node]):
    """The scalar a uniform operand is a broadcast of (a literal or a one-element
    value), or None."""
    if isinstance(operand, Literal):
        return operand
    producer = inlined.get(operand)
    if producer is None or producer.name != "broadcast_in_dim":
        return None
    src = producer.inputs[0]
    return src if isinstance(src, Literal) or src.size == 1 else None


def _replicated_word(b: KernelBuilder, dtype, value: str) -> str:
    """A 32-bit word holding the storage bits of `value` once per element it spans."""
    st = dtypes.storage_type(dtype)
    s = b.tmp(f"const {st}", dtypes.store(dtype, value))
    size = np.dtype(dtype).itemsize
    if size == 4:
        return b.tmp("const unsigned int", f"(unsigned int){_BITS[st][0].format(x=s)}")
    if size == 2:
        return b.tmp("const unsigned int", f"(unsigned int){_BITS[st][0].format(x=s)} * 0x10001u")
    return b.tmp("const unsigned int", f"(unsigned int)(unsigned char)({s}) * 0x1010101u")


def _vector_width(node: Node) -> int:
    """How many neighbouring elements of one window row a thread combines with one
    vector atomic (1: none). The rows must run along the operand's last axis, start at
    column 0 (that axis is not scattered along) and split evenly."""
    operand, _, updates = node.inputs
    out = node.outputs[0]
    widths = _VECTOR.get(dtypes.name(out.dtype), ())
    if node.name != "scatter-add" or not widths or operand.ndim == 0:
        return 1
    dn = node.params["dimension_numbers"]
    last = operand.ndim - 1
    if (last in dn.inserted_window_dims or last in getattr(dn, "operand_batching_dims", ())
            or last in dn.scatter_dims_to_operand_dims):
        return 1
    window = tuple(dn.update_window_dims)
    if not window or window[-1] != updates.ndim - 1:
        return 1
    for w in widths:
        if updates.shape[-1] % w == 0 and operand.shape[last] % w == 0:
            return w
    return 1


def _combine_kernel(node: Node, inlined: Mapping[Var, Node], params) -> tuple[KernelBuilder, int, str]:
    """The second launch. One thread per update element: consecutive threads take
    consecutive elements of a window row, so their loads and atomics are coalesced.
    Where `_vector_width` allows, Hopper's build takes that many neighbouring elements
    per thread and one vector atomic (the other branch of an `#if __CUDA_ARCH__`)."""
    out, updates = node.outputs[0], node.inputs[2]
    b = _builder(node, inlined, params)
    width = _vector_width(node)
    if width > 1:
        b.lines.append(f"#if __CUDA_ARCH__ >= {_VECTOR_ARCH}")
        _combine_loop(b, node, width)
        b.forget()
        b.lines.append("#else")
    _combine_loop(b, node, 1)
    if width > 1:
        b.lines.append("#endif")
    helper = _atomic_helper(node.name, out.dtype)
    return b, blocks_for(updates.size // width), helper


def _combine_loop(b: KernelBuilder, node: Node, width: int) -> None:
    operand, indices, updates = node.inputs
    out = node.outputs[0]
    dn = node.params["dimension_numbers"]
    window_dims = tuple(dn.update_window_dims)
    inserted = tuple(dn.inserted_window_dims)
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    n = updates.size // width
    _grid_stride(b, n)
    wide = "long long" if updates.size >= 2 ** 31 else "int"
    first = "i" if width == 1 else b.tmp(wide, f"({wide})i * {width}")
    u = b.index_vars(first, updates.shape)
    batch = [u[d] for d in range(updates.ndim) if d not in window_dims]
    window = iter(u[d] for d in window_dims)
    # The update window's extent along each operand dimension.
    extent, pos = [], 0
    for d in range(operand.ndim):
        if d in inserted or d in batching:
            extent.append(1)
        else:
            extent.append(updates.shape[window_dims[pos]])
            pos += 1
    clip = _mode(node) == "clip"
    starts, conds = {}, []
    for k, d in enumerate(dn.scatter_dims_to_operand_dims):
        v, upper = _start(b, indices, batch, k), operand.shape[d] - extent[d]
        if clip:
            v = b.tmp("long long", f"min(max({v}, 0LL), {upper}LL)")
        else:
            conds.append(f"{v} < 0 || {v} > {upper}")
        starts[d] = v
    if conds:
        b.emit(f"if ({' || '.join(conds)}) continue;  // the whole window is dropped")
    dst = []
    for d in range(operand.ndim):
        if d in batching:
            dst.append(batch[idx_batching[batching.index(d)]])
            continue
        off = "0" if d in inserted else next(window)
        start = starts.get(d)
        dst.append(off if start is None else (start if off == "0" else f"({start} + {off})"))
    at = b.tmp("long long", linear(tuple(dst), operand.shape))
    ptr = f"{b.outputs[out]} + {at}"
    if width == 1:
        b.emit(_combine(node.name, out.dtype, ptr, b.value(updates, u)))
    elif isinstance(updates, Var) and updates not in b.inlined:
        # A buffer: the thread's neighbouring updates are one aligned vector load.
        vt = _vector_type(out.dtype, width)
        b.emit(f"atomicAdd(({vt}*)({ptr}), ((const {vt}*){b.inputs[updates]})[i]);")
    else:
        values = []
        for k in range(width):
            idx = u if k == 0 else u[:-1] + (f"({u[-1]} + {k})",)
            if k:  # the row's next element: the next update element too
                b.flat[(idx, tuple(updates.shape))] = f"({first} + {k})"
            values.append(b.value(updates, idx))
        b.emit(_vector_add(out.dtype, ptr, values))
    b.close()


_VECTOR_TYPES = {("float32", 4): ("float4", "make_float4"), ("float32", 2): ("float2", "make_float2"),
                 ("float16", 2): ("__half2", "__floats2half2_rn"),
                 ("bfloat16", 2): ("__nv_bfloat162", "__floats2bfloat162_rn")}


def _vector_type(dtype, width: int) -> str:
    return _VECTOR_TYPES[dtypes.name(dtype), width][0]


def _vector_add(dtype, ptr: str, values: list[str]) -> str:
    """One vector atomic add of compute-type `values` at `ptr` (aligned to their size);
    each lane rounds to the dtype and adds as the one-element atomic does."""
    vt, make = _VECTOR_TYPES[dtypes.name(dtype), len(values)]
    return f"atomicAdd(({vt}*)({ptr}), {make}({', '.join(values)}));"


# ---- combining one value into the output ------------------------------------------------
def _op_expr(prim: str, dtype) -> str:
    """The combine of old value {a} with update {b}, in the compute type."""
    kind = prim.removeprefix("scatter-")
    if dtypes.name(dtype) == "bool":
        return {"min": "({a} && {b})", "max": "({a} || {b})"}[kind]
    if dtypes.is_float(dtype):
        return {"add": "({a} + {b})", "mul": "({a} * {b})", "min": _FMIN, "max": _FMAX}[kind]
    ctype = dtypes.compute_type(dtype)
    return {"add": f"({ctype})((unsigned int){{a}} + (unsigned int){{b}})",
            "mul": f"({ctype})((unsigned int){{a}} * (unsigned int){{b}})",
            "min": "min({a}, {b})", "max": "max({a}, {b})"}[kind]


# Native atomics that give exactly the combine (rounded per operation to the dtype).
_NATIVE = {("scatter-add", "float32"), ("scatter-add", "float16"), ("scatter-add", "bfloat16"),
           ("scatter-add", "int32"), ("scatter-add", "uint32"),
           ("scatter-min", "int32"), ("scatter-min", "uint32"),
           ("scatter-max", "int32"), ("scatter-max", "uint32")}
_NATIVE_CALL = {"scatter-add": "atomicAdd", "scatter-min": "atomicMin", "scatter-max": "atomicMax"}


def _combine(prim: str, dtype, ptr: str, value: str) -> str:
    if prim == "scatter":  # overwrite: with duplicate indices any one update wins, as XLA
        return f"*({ptr}) = {dtypes.store(dtype, value)};"
    if (prim, dtypes.name(dtype)) in _NATIVE:
        return f"{_NATIVE_CALL[prim]}({ptr}, {dtypes.store(dtype, value)});"
    return f"{_helper_name(prim, dtype)}({ptr}, {value});"


def _helper_name(prim: str, dtype) -> str:
    return f"nimble_atomic_{prim.removeprefix('scatter-')}_{dtypes.name(dtype)}"


# (storage type → its bits, bits → storage type) for 32- and 16-bit compare-and-swap.
_BITS = {"float": ("__float_as_uint({x})", "__uint_as_float({x})"),
         "int": ("(unsigned int)({x})", "(int)({x})"),
         "unsigned int": ("({x})", "({x})"),
         "__half": ("__half_as_ushort({x})", "__ushort_as_half({x})"),
         "__nv_bfloat16": ("__bfloat16_as_ushort({x})", "__ushort_as_bfloat16({x})"),
         "short": ("(unsigned short)({x})", "(short)({x})"),
         "unsigned short": ("({x})", "({x})")}


def _atomic_helper(prim: str, dtype) -> str:
    """`nimble_atomic_<op>_<dtype>(T* p, compute v)`: *p = combine(*p, v), atomically, by a
    compare-and-swap loop on the element (32 or 16 bits) or on its aligned 32-bit word
    (8-bit types)."""
    if prim == "scatter" or (prim, dtypes.name(dtype)) in _NATIVE:
        return ""
    st, ct = dtypes.storage_type(dtype), dtypes.compute_type(dtype)
    # The old value in the compute type (an explicit cast: min(unsigned char, unsigned
    # int) would be an ambiguous overload).
    old = f"({ct}){dtypes.load(dtype, 'cur')}"
    new = dtypes.store(dtype, _op_expr(prim, dtype).format(a=old, b="v"))
    name = _helper_name(prim, dtype)
    # Guarded, so that many kernels' sources can share one translation unit (tests).
    head = (f"#ifndef {name.upper()}\n#define {name.upper()}\n"
            f"__device__ __forceinline__ void {name}({st}* p, {ct} v) {{\n")
    if np.dtype(dtype).itemsize == 1:
        return head + (
            "  unsigned int* w = (unsigned int*)((size_t)p & ~(size_t)3);\n"
            "  const unsigned int shift = ((size_t)p & 3) * 8;\n"
            "  unsigned int old = *w, assumed;\n"
            "  do {\n"
            "    assumed = old;\n"
            f"    {st} cur = ({st})((assumed >> shift) & 0xffu);\n"
            f"    {st} nv = {new};\n"
            "    unsigned int bits = (assumed & ~(0xffu << shift)) | "
            "((unsigned int)(unsigned char)nv << shift);\n"
            "    old = atomicCAS(w, assumed, bits);\n"
            "  } while (assumed != old);\n}\n#endif\n")
    word = "unsigned int" if np.dtype(dtype).itemsize == 4 else "unsigned short"
    to_bits, from_bits = _BITS[st]
    return head + (
        f"  {word}* w = ({word}*)p;\n"
        f"  {word} old = *w, assumed;\n"
        "  do {\n"
        "    assumed = old;\n"
        f"    {st} cur = {from_bits.format(x='assumed')};\n"
        f"    {st} nv = {new};\n"
        f"    old = atomicCAS(w, assumed, ({word}){to_bits.format(x='nv')});\n"
        "  } while (assumed != old);\n}\n#endif\n")
