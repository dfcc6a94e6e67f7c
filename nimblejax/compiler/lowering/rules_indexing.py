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
and fuses with its consumers. A scatter is two launches of one task: a copy of the
operand into the output, then one thread per update element combining it in (atomics
for the combining ops; a float scatter-add therefore sums in an order that differs
from XLA's, equal within float rounding).
"""
from __future__ import annotations

import numpy as np

from nimblejax.compiler.ir import Node, Var
from nimblejax.compiler import dtypes
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import BLOCK, PRELUDE, Index, KernelBuilder, blocks_for, linear
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


@register(*SCATTERS, kind=RuleKind.KERNEL)
def scatter(node: Node) -> Kernel:
    """A copy of the operand into the output, then the updates combined in."""
    main = _combine_kernel(node)
    return Kernel(main.name, main.source, main.grid, main.block, main.params,
                  pre=(_copy_kernel(node, main.name),))


def _builder(node: Node) -> KernelBuilder:
    """Both kernels of a scatter take the same parameters, in the same order."""
    operand, indices, updates = node.inputs
    b = KernelBuilder()
    b.ops = [node.name.replace("-", "_")]  # kernel names are C identifiers
    b.output(node.outputs[0])
    for v in (operand, indices, updates):
        b.input(v)
    return b


def _copy_kernel(node: Node, main_name: str) -> Kernel:
    out = node.outputs[0]
    b = _builder(node)
    o, x = b.outputs[out], b.inputs[node.inputs[0]]
    vec = out.nbytes % 16 == 0  # arena offsets are 256-byte aligned
    n = out.nbytes // 16 if vec else out.size
    if vec:
        o, x = f"((uint4*){o})", f"((const uint4*){x})"
    itype = "long long" if n >= 2 ** 30 else "int"
    b.open(f"for ({itype} i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < {n}; "
           f"i += (long long)gridDim.x * blockDim.x)")
    b.emit(f"{o}[i] = {x}[i];")
    b.close()
    text = f"{b.signature('NAME')} {{\n" + "\n".join(b.lines) + "\n}\n"
    name = main_name + "_init"
    return Kernel(name, PRELUDE + text.replace("NAME", name, 1), (blocks_for(n), 1, 1),
                  (BLOCK, 1, 1), b.params())


def _combine_kernel(node: Node) -> Kernel:
    operand, indices, updates = node.inputs
    out = node.outputs[0]
    dn = node.params["dimension_numbers"]
    window_dims = tuple(dn.update_window_dims)
    inserted = tuple(dn.inserted_window_dims)
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    b = _builder(node)
    n = updates.size
    itype = "long long" if n >= 2 ** 30 else "int"
    b.open(f"for ({itype} i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < {n}; "
           f"i += (long long)gridDim.x * blockDim.x)")
    u = b.index_vars("i", updates.shape)
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
    value = b.value(updates, u)
    b.emit(_combine(node.name, out.dtype, f"{b.outputs[out]} + {at}", value))
    b.close()
    return b.finish("scatter", out, blocks_for(n), BLOCK, prelude=_atomic_helper(node.name, out.dtype))


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
