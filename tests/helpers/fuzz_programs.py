"""Random small JAX programs for the differential fuzzer (tests/end_to_end/test_fuzz.py).

A program is drawn with hypothesis as a small op graph: a pool of values (inputs made on
demand, then one value per op), each op reading one or two values of the pool. It is
kept as Python source text (`Program.source`), so the minimal program hypothesis finds
prints as code that a regression test can paste.

Only primitives nimblejax lowers today are drawn (compiler.lowering.RULES); gather,
scatter, sort, random and special functions are left out for now.

Floats that went through inexact arithmetic are never fed to a discontinuous op
(comparison, floor, sign, argmax, float→int convert): one ulp of difference between
two correct implementations would flip the result. Each value carries `exact`: True for
inputs and for values made from exact values by ops that round identically everywhere
(views, max/min, neg/abs, selects, conversions, integer arithmetic).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from tests.helpers.fuzz_values import (DIMS, DTYPES, FLOATS, INTS, MAX_SIZE, SMALL, Builder, Program,
                                       Skip)


# ---- ops: each reads the pool through the builder and emits a line, or raises Skip ------
UNARY_FLOAT = ["jnp.tanh({x})", "jnp.sin({x})", "jax.nn.sigmoid({x})", "-{x}", "jnp.abs({x})",
               "jnp.exp(jnp.tanh({x}))", "jnp.sqrt(jnp.abs({x}))", "jnp.log1p(jnp.abs({x}))",
               "{x} * {x}", "{x} ** 3", "lax.rsqrt(jnp.abs({x}) + 1)", "jnp.cos({x})",
               "jnp.clip({x}, -0.75, 0.5)"]
EXACT_UNARY_FLOAT = {"-{x}", "jnp.abs({x})", "jnp.clip({x}, -0.75, 0.5)"}
DISCONTINUOUS_FLOAT = ["jnp.floor({x} * 4)", "jnp.sign({x})", "jnp.round({x} * 4)", "jnp.ceil({x})"]
UNARY_INT = ["-{x}", "jnp.abs({x})", "~{x}", "lax.population_count({x})", "{x} * {x}",
             "lax.clz({x})"]


def op_unary(b: Builder) -> None:
    x = b.pick()
    if x.dtype in FLOATS:
        table = UNARY_FLOAT + (DISCONTINUOUS_FLOAT if x.exact else [])
        t = b.draw(st.sampled_from(table))
        exact = x.exact and t in EXACT_UNARY_FLOAT
        b.emit(t.format(x=x.name), x.shape, x.dtype, exact)
    elif x.dtype in INTS:
        t = b.draw(st.sampled_from(UNARY_INT if x.dtype == "int32" else UNARY_INT[2:]))
        b.emit(t.format(x=x.name), x.shape, x.dtype, True)
    else:
        b.emit(f"~{x.name}", x.shape, "bool", True)


# Shifts by 32 or more are defined in XLA (sign fill; on unsigned types too).
SHIFT_BY_40 = "lax.shift_right_arithmetic({x}, jnp.broadcast_to({y} & 40, {x}.shape))"


def op_binary(b: Builder) -> None:
    x = b.pick()
    if x.dtype in FLOATS:
        y = b.other(x, FLOATS if b.draw(st.booleans()) else (x.dtype,))
        t = b.draw(st.sampled_from(["{x} + {y}", "{x} - {y}", "{x} * {y}", "jnp.maximum({x}, {y})",
                                    "jnp.minimum({x}, {y})", "{x} / (jnp.abs({y}) + 1)"]))
        exact = "maximum" in t or "minimum" in t
    elif x.dtype == "int32":
        y = b.other(x)
        t = b.draw(st.sampled_from(["{x} + {y}", "{x} - {y}", "{x} * {y}", "jnp.maximum({x}, {y})",
                                    "{x} & {y}", "{x} | {y}", "{x} ^ {y}", "{x} // ({y} | 1)",
                                    "{x} % ({y} | 1)", "jnp.right_shift({x}, {y} & 31)",
                                    "jnp.left_shift({x}, {y} & 7)", SHIFT_BY_40]))
        exact = True
    elif x.dtype == "uint32":
        y = b.other(x)
        t = b.draw(st.sampled_from(["{x} + {y}", "{x} - {y}", "{x} * {y}", "jnp.minimum({x}, {y})",
                                    "{x} ^ {y}", "jnp.right_shift({x}, {y} & 31)",
                                    "{x} // ({y} | 1)", SHIFT_BY_40]))
        exact = True
    else:
        y = b.other(x)
        t = b.draw(st.sampled_from(["{x} & {y}", "{x} | {y}", "{x} ^ {y}", "{x} == {y}"]))
        exact = True
    expr = t.format(x=x.name, y=y)
    shape, dtype = _result(b, expr)
    b.emit(expr, shape, dtype, exact and x.exact and _exact(b, y))


def _exact(b: Builder, name: str) -> bool:
    return all(v.exact for v in b.pool if v.name == name)


def _result(b: Builder, expr: str) -> tuple[tuple[int, ...], str]:
    """Shape and dtype of `expr` over the pool (jnp promotion and broadcasting)."""
    scope = {"jnp": jnp, "lax": jax.lax, "jax": jax, "np": np}
    scope.update({v.name: jax.ShapeDtypeStruct(v.shape, v.dtype) for v in b.pool})
    names = [v.name for v in b.pool]
    try:
        out = jax.eval_shape(eval(f"lambda {', '.join(names)}: {expr}", scope),
                             *[scope[n] for n in names])
    except (TypeError, ValueError):  # shapes that do not broadcast, say
        raise Skip
    if out.size > MAX_SIZE:
        raise Skip
    return tuple(out.shape), np.dtype(out.dtype).name


def op_compare(b: Builder) -> None:
    x = b.pick()
    if not x.exact or x.dtype == "bool":
        raise Skip
    y = b.other(x)
    if not _exact(b, y):
        raise Skip
    op = b.draw(st.sampled_from(["<", "<=", "==", "!=", ">"]))
    expr = f"{x.name} {op} {y}"
    b.emit(expr, *_result(b, expr), True)


def op_select(b: Builder) -> None:
    x = b.pick()
    conds = [v for v in b.pool if v.dtype == "bool" and v.shape == x.shape]
    cond = b.draw(st.sampled_from(conds)).name if conds else b.new_input(x.shape, "bool").name
    y = b.other(x)
    expr = f"jnp.where({cond}, {x.name}, {y})"
    b.emit(expr, *_result(b, expr), x.exact and _exact(b, y))


def op_convert(b: Builder) -> None:
    x = b.pick()
    to = b.draw(st.sampled_from(DTYPES))
    if x.dtype in FLOATS and to not in FLOATS and not x.exact:
        raise Skip
    if x.dtype in FLOATS and to == "uint32":
        # Negative floats to unsigned: XLA leaves the result implementation-defined.
        b.emit(f"jnp.abs({x.name}).astype(jnp.uint32)", x.shape, to, True)
        return
    # A half result may not be rounded by XLA (excess precision): not exact.
    exact = x.exact and (to not in FLOATS[1:] or to == x.dtype)
    b.emit(f"{x.name}.astype(jnp.{to})", x.shape, to, exact)


def op_reduce(b: Builder) -> None:
    x = b.pick()
    axes = b.axes(x)
    keep = b.draw(st.booleans())
    if x.dtype == "bool":
        fn = b.draw(st.sampled_from(["jnp.any", "jnp.all"]))
    elif x.dtype in FLOATS:
        fn = b.draw(st.sampled_from(["jnp.sum", "jnp.max", "jnp.min", "jnp.mean", "jnp.var",
                                     "jnp.prod"]))
    else:
        fn = b.draw(st.sampled_from(["jnp.sum", "jnp.max", "jnp.min", "jnp.prod"]))
    if fn == "jnp.prod" and math.prod(x.shape[a] for a in axes) > 64:
        raise Skip
    expr = f"{fn}({x.name}, axis={axes}, keepdims={keep})"
    exact = x.exact and (fn in ("jnp.max", "jnp.min", "jnp.any", "jnp.all") or x.dtype in INTS)
    b.emit(expr, *_result(b, expr), exact)


def op_normalize(b: Builder) -> None:
    """Softmax / layer-norm shapes: a reduction broadcast back onto its operand."""
    x = b.pick()
    if x.dtype not in FLOATS or not x.ndim:
        raise Skip
    a = b.draw(st.integers(-x.ndim, x.ndim - 1))
    t = b.draw(st.sampled_from([
        "jax.nn.softmax({x}, axis={a})",
        "jax.nn.log_softmax({x}, axis={a})",
        "({x} - {x}.mean({a}, keepdims=True)) * lax.rsqrt({x}.var({a}, keepdims=True) + 1e-2)",
        "{x} - jnp.max({x}, axis={a}, keepdims=True)",
        "{x} * jnp.sum({x}, axis={a}, keepdims=True)",
        "jnp.exp({x} - jnp.max({x}, axis={a}, keepdims=True)) / "
        "jnp.sum(jnp.exp({x} - jnp.max({x}, axis={a}, keepdims=True)), axis={a}, keepdims=True)",
    ]))
    b.emit(t.format(x=x.name, a=a), x.shape, x.dtype, False)


def op_reshape(b: Builder) -> None:
    x = b.pick()
    factors = _prime_factors(x.size)
    rank = b.draw(st.integers(0 if x.size == 1 else 1, 4))
    dims = [1] * max(rank, 1)
    for f in factors:
        dims[b.draw(st.integers(0, len(dims) - 1))] *= f
    dims = dims[:rank] if rank else []
    if rank and math.prod(dims) != x.size:
        raise Skip
    b.emit(f"{x.name}.reshape({tuple(dims)})", dims, x.dtype, x.exact)


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def op_view(b: Builder) -> None:
    x = b.pick()
    kind = b.draw(st.sampled_from(["squeeze", "expand", "transpose", "slice", "rev",
                                   "broadcast", "broadcast_in_dim"]))
    if kind == "squeeze":
        ones = [d for d in range(x.ndim) if x.shape[d] == 1]
        if not ones:
            raise Skip
        axes = tuple(sorted(b.draw(st.sets(st.sampled_from(ones), min_size=1))))
        shape = [s for d, s in enumerate(x.shape) if d not in axes]
        b.emit(f"jnp.squeeze({x.name}, axis={axes})", shape, x.dtype, x.exact)
    elif kind == "expand":
        a = b.draw(st.integers(0, x.ndim))
        b.emit(f"jnp.expand_dims({x.name}, {a})", x.shape[:a] + (1,) + x.shape[a:], x.dtype, x.exact)
    elif kind == "transpose":
        perm = tuple(b.draw(st.permutations(range(x.ndim))))
        b.emit(f"jnp.transpose({x.name}, {perm})", [x.shape[p] for p in perm], x.dtype, x.exact)
    elif kind == "slice":
        starts, limits, strides = [], [], []
        for d in x.shape:
            s = b.draw(st.integers(0, d - 1))
            limits.append(b.draw(st.integers(s + 1, d)))
            starts.append(s)
            strides.append(b.draw(st.sampled_from([1, 1, 2, 3])))
        shape = [-(-(lim - s) // st_) for s, lim, st_ in zip(starts, limits, strides)]
        b.emit(f"lax.slice({x.name}, {tuple(starts)}, {tuple(limits)}, {tuple(strides)})",
               shape, x.dtype, x.exact)
    elif kind == "rev":
        dims = b.axes(x)
        b.emit(f"lax.rev({x.name}, {dims})", x.shape, x.dtype, x.exact)
    elif kind == "broadcast":  # jnp.broadcast_to: new leading axes, unit axes stretched
        lead = tuple(b.draw(st.sampled_from(DIMS)) for _ in range(b.draw(st.integers(0, 2))))
        shape = lead + tuple(b.draw(st.sampled_from(DIMS)) if d == 1 else d for d in x.shape)
        if math.prod(shape) > SMALL and math.prod(shape) > x.size:
            raise Skip
        b.emit(f"jnp.broadcast_to({x.name}, {shape})", shape, x.dtype, x.exact)
    else:  # new axes anywhere
        rank = x.ndim + b.draw(st.integers(0, 2))
        dims = tuple(sorted(b.draw(st.sets(st.integers(0, rank - 1), min_size=x.ndim,
                                           max_size=x.ndim)))) if x.ndim else ()
        shape = [b.draw(st.sampled_from(DIMS)) for _ in range(rank)]
        for j, d in enumerate(dims):
            shape[d] = x.shape[j] if x.shape[j] != 1 else shape[d]
        if math.prod(shape) > SMALL and math.prod(shape) > x.size:
            raise Skip
        b.emit(f"lax.broadcast_in_dim({x.name}, {tuple(shape)}, {dims})", shape, x.dtype, x.exact)


def op_pad(b: Builder) -> None:
    x = b.pick()
    if not x.ndim:
        raise Skip
    config, shape = [], []
    for d in x.shape:
        interior = b.draw(st.integers(0, 1))
        full = d + (d - 1) * interior
        lo = b.draw(st.integers(-min(1, full - 1), 2))
        hi = b.draw(st.integers(-min(1, full + lo - 1), 2))
        config.append((lo, hi, interior))
        shape.append(full + lo + hi)
    value = {"bool": "False", "uint32": "7", "int32": "-3"}.get(x.dtype, "0.5")
    b.emit(f"lax.pad({x.name}, jnp.{x.dtype}({value}), {tuple(config)})", shape, x.dtype, x.exact)


def op_concat(b: Builder) -> None:
    x = b.pick()
    if not x.ndim:
        raise Skip
    a = b.draw(st.integers(0, x.ndim - 1))
    parts = [x.name]
    shape = list(x.shape)
    for _ in range(b.draw(st.integers(1, 2))):
        ys = [v for v in b.pool if v.dtype == x.dtype and v.ndim == x.ndim
              and all(v.shape[d] == x.shape[d] for d in range(x.ndim) if d != a)]
        if b.draw(st.booleans()):
            y = b.draw(st.sampled_from(ys))  # x itself is among them
        else:
            s = list(x.shape)
            s[a] = b.draw(st.sampled_from(DIMS))
            y = b.new_input(s, x.dtype)
        parts.append(y.name)
        shape[a] += y.shape[a]
    exact = all(_exact(b, p) for p in parts)
    b.emit(f"jnp.concatenate([{', '.join(parts)}], axis={a})", shape, x.dtype, exact)


def op_dot(b: Builder) -> None:
    x = b.pick()
    if x.dtype not in FLOATS + ("int32",) or not x.ndim:
        raise Skip
    c = b.draw(st.integers(0, x.ndim - 1))
    batch = [d for d in range(x.ndim) if d != c]
    lb = (b.draw(st.sampled_from(batch)),) if batch and b.draw(st.booleans()) else ()
    n = b.draw(st.sampled_from((None, 1, 3, 8, 17)))
    rhs_axes = [("b", x.shape[d]) for d in lb] + [("k", x.shape[c])] + ([("n", n)] if n else [])
    order = b.draw(st.permutations(range(len(rhs_axes))))
    rshape = tuple(rhs_axes[i][1] for i in order)
    pos = {rhs_axes[i][0]: j for j, i in enumerate(order)}
    rb = (pos["b"],) if lb else ()
    y = b.new_input(rshape, x.dtype)
    free = [x.shape[d] for d in range(x.ndim) if d != c and d not in lb]
    shape = [x.shape[d] for d in lb] + free + ([n] if n else [])
    if math.prod(shape) * x.shape[c] > 1 << 18:
        raise Skip
    prec = ""
    if x.dtype == "float32":
        highest = b.draw(st.booleans())
        prec = ", precision=lax.Precision.HIGHEST" if highest else ""
        b.p.tf32 |= not highest
    dn = f"((({c},), ({pos['k']},)), ({lb}, {rb}))"
    b.emit(f"lax.dot_general({x.name}, {y.name}, {dn}{prec})", shape, x.dtype,
           x.dtype == "int32")


def op_window(b: Builder) -> None:
    x = b.pick()
    if not x.ndim or x.dtype == "bool":
        raise Skip
    kind = b.draw(st.sampled_from(["max", "min", "sum"]))
    init = {"max": "-jnp.inf", "min": "jnp.inf", "sum": "0."}[kind]
    if x.dtype in INTS:
        info = np.iinfo(x.dtype)
        init = {"max": str(int(info.min)), "min": str(int(info.max)), "sum": "0"}[kind]
    k = b.draw(st.integers(1, min(2, x.ndim)))  # window over the last k axes
    dims = (1,) * (x.ndim - k) + tuple(b.draw(st.integers(1, 3)) for _ in range(k))
    strides = (1,) * (x.ndim - k) + tuple(b.draw(st.integers(1, 2)) for _ in range(k))
    dil = (1,) * (x.ndim - k) + tuple(b.draw(st.sampled_from([1, 1, 2])) for _ in range(k))
    padding = b.draw(st.sampled_from(["'SAME'", "'VALID'", "explicit"]))
    if padding == "explicit":
        padding = str(tuple((b.draw(st.integers(0, 1)), b.draw(st.integers(0, 2))) for _ in x.shape))
    expr = (f"lax.reduce_window({x.name}, np.array({init}, jnp.dtype({x.dtype!r})), lax.{'add' if kind == 'sum' else kind}, "
            f"{dims}, {strides}, {padding}, window_dilation={dil})")
    shape, dtype = _result(b, expr)
    if 0 in shape:
        raise Skip
    b.emit(expr, shape, dtype, x.exact and (kind != "sum" or x.dtype in INTS))


def op_scan(b: Builder) -> None:
    x = b.pick()
    if not x.ndim or x.dtype == "bool":
        raise Skip
    a = b.draw(st.integers(0, x.ndim - 1))
    rev = b.draw(st.booleans())
    fn = b.draw(st.sampled_from(["cumsum", "cummax", "cummin"] +
                                (["cumprod"] if x.shape[a] <= 16 else [])))
    exact = x.exact and (fn in ("cummax", "cummin") or x.dtype in INTS)
    b.emit(f"lax.{fn}({x.name}, axis={a}, reverse={rev})", x.shape, x.dtype, exact)


def op_argmax(b: Builder) -> None:
    x = b.pick()
    if not x.ndim or not x.exact:
        raise Skip
    a = b.draw(st.integers(0, x.ndim - 1))
    fn = b.draw(st.sampled_from(["jnp.argmax", "jnp.argmin"]))
    expr = f"{fn}({x.name}, axis={a})"
    b.emit(expr, *_result(b, expr), True)


def op_iota(b: Builder) -> None:
    x = b.pick()
    if not x.ndim or x.dtype == "bool":
        raise Skip
    d = b.draw(st.integers(0, x.ndim - 1))
    b.emit(f"{x.name} + lax.broadcasted_iota(jnp.{x.dtype}, {x.shape}, {d})", x.shape, x.dtype,
           x.exact and x.dtype in INTS)


def op_dynamic(b: Builder) -> None:
    """dynamic_slice / dynamic_update_slice at 0-d int32 inputs in [-20, 20): XLA clamps
    the starts so the window stays inside the operand."""
    x = b.pick()
    if not x.ndim:
        raise Skip
    sizes = tuple(b.draw(st.integers(1, d)) for d in x.shape)
    starts = ", ".join(b.new_input((), "int32").name for _ in x.shape)
    if b.draw(st.booleans()):
        b.emit(f"lax.dynamic_slice({x.name}, ({starts},), {sizes})", sizes, x.dtype, x.exact)
    else:
        upd = b.new_input(sizes, x.dtype)
        b.emit(f"lax.dynamic_update_slice({x.name}, {upd.name}, ({starts},))", x.shape, x.dtype,
               x.exact)


OPS = {"unary": op_unary, "binary": op_binary, "compare": op_compare, "select": op_select,
       "convert": op_convert, "reduce": op_reduce, "normalize": op_normalize,
       "reshape": op_reshape, "view": op_view, "pad": op_pad, "concat": op_concat,
       "dot": op_dot, "window": op_window, "scan": op_scan, "argmax": op_argmax,
       "iota": op_iota, "dynamic": op_dynamic}
WEIGHTS = ["unary"] * 3 + ["binary"] * 3 + ["view"] * 2 + ["reduce"] * 2 + sorted(OPS)


@st.composite
def programs(draw, max_ops: int = 8, big_odds: int = 10) -> Program:
    b = Builder(draw, big_odds)
    b.new_input(b.shape(), draw(st.sampled_from(DTYPES)))
    n_ops = draw(st.integers(1, max_ops))
    tries = 0
    while len(b.p.lines) < n_ops and tries < 4 * max_ops:
        tries += 1
        inputs, lines, pool = len(b.p.inputs), len(b.p.lines), len(b.pool)
        try:
            OPS[draw(st.sampled_from(WEIGHTS))](b)
        except Skip:  # undo inputs a failed op made
            del b.p.inputs[inputs:], b.p.lines[lines:], b.pool[pool:]
    outs = [b.pool[-1].name]
    extra = draw(st.lists(st.sampled_from([v.name for v in b.pool]), max_size=3))
    outs += extra  # may repeat a value, or name an input: both are outputs nimble must handle
    if draw(st.integers(0, 5)) == 0:
        outs.append(draw(st.sampled_from(["2.5", "jnp.int32(4)", "jnp.ones((2,), jnp.float32)"])))
    b.p.outputs = outs
    b.p.seed = draw(st.integers(0, 2 ** 16))
    b.p.max_streams = draw(st.sampled_from([None, 1, 2, 3]))
    return b.p
