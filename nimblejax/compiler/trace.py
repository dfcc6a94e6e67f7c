"""jaxpr → graph IR: inline nested calls, bind constants and literals, drop dead code.

Works across JAX's jaxpr renames (INLINED lists both names): nested jit is `pjit`
(≤0.6) or `jit` (≥0.7); custom_vjp is `custom_vjp_call_jaxpr` (≤0.6) or
`custom_vjp_call` (≥0.7); 0.11 merged ClosedJaxpr into Jaxpr (jaxprs.open_jaxpr reads
both); after 0.11.0 `closed_call` and `call` are one `eval_jaxpr` primitive
(`call_jaxpr` param; custom_vjp's forward emits it). Loops and conds are flattened by
control.py, PRNG keys and random primitives expanded by prng.py (docs/design.md, "Data
flow").
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from nimblejax.compiler import control
from nimblejax.compiler import prng
from nimblejax.compiler.errors import UnsupportedPrimitiveError
from nimblejax.compiler.ir import Atom, Graph, Literal, Node, Var
from nimblejax.compiler.jaxprs import open_jaxpr

# Call-like primitives whose body is inlined, and the params that may hold the body.
INLINED = {
    "pjit": ("jaxpr",),
    "jit": ("jaxpr",),
    "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",),
    "call": ("call_jaxpr",),
    "eval_jaxpr": ("call_jaxpr", "jaxpr"),
    "custom_jvp_call": ("call_jaxpr", "jaxpr"),
    "custom_vjp_call": ("call_jaxpr", "fun_jaxpr", "jaxpr"),
    "custom_vjp_call_jaxpr": ("fun_jaxpr", "call_jaxpr"),
    "remat": ("jaxpr",),
    "remat2": ("jaxpr",),
    "checkpoint": ("jaxpr",),
    "custom_lin": (),  # only appears under linearize; never in a plain jaxpr
}
# Primitives that are the identity on values (`name`: jax.ad_checkpoint.checkpoint_name,
# a tag for remat policies).
IDENTITY = frozenset({"stop_gradient", "optimization_barrier", "name"})
# `sharding_constraint` to a sharding of one device (jax.lax.with_sharding_constraint in a
# program that runs on one GPU) is the identity too: a plan runs on one device. Over
# several devices it is not supported (unsupported.py): it stays with XLA.
ONE_DEVICE_IDENTITY = frozenset({"sharding_constraint"})
# `custom_linear_solve` (lax.custom_linear_solve: jax.scipy.sparse.linalg's solvers,
# lineax) computes its value with its `solve` jaxpr: that body is inlined with its
# constants and the right-hand side (the other jaxprs are for its derivatives).
SOLVES = frozenset({"custom_linear_solve"})
# `platform_index` (lax.platform_dependent; jnp.diagonal's Mosaic branch, which numpyro's
# MultivariateNormal reaches) is known when nimble plans: a plan runs on CUDA. It becomes
# the index of CUDA's branch, a literal, and the `cond` it feeds keeps that branch alone.
PLATFORM = "cuda"
RESOLVED = frozenset({"platform_index"})
# `empty2` (an uninitialized scalar: the unused residual of a `cond` branch under
# autodiff, jnp.diagonal's) is the zero JAX's own lowering writes: a literal.
PLACEHOLDERS = frozenset({"empty2"})


def make_graph(fun: Callable, specs: Sequence[jax.ShapeDtypeStruct]) -> tuple[Graph, Any]:
    """Trace `fun` (flat arguments, flat outputs) and return (graph, output shapes)."""
    closed, out_shapes = jax.make_jaxpr(fun, return_shape=True)(*specs)
    return jaxpr_to_graph(closed), out_shapes


def jaxpr_to_graph(closed: Any) -> Graph:
    jaxpr, consts = open_jaxpr(closed)
    builder = GraphBuilder()
    inputs = tuple(builder.new_var(v.aval) for v in jaxpr.invars)
    const_vars = [builder.const(c) for c in consts]
    outs = builder.inline(jaxpr, list(const_vars) + list(inputs))
    graph = Graph(inputs=inputs, outputs=tuple(outs), nodes=tuple(builder.nodes),
                  consts=builder.consts)
    graph = drop_dead_code(common_subexpressions(graph))
    return dataclasses.replace(graph, control=tuple(dict.fromkeys(builder.control)))


class GraphBuilder:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.consts: dict[Var, np.ndarray] = {}
        self.control: list[control.ControlDecision] = []  # what became of each loop/cond

    def new_var(self, aval: Any) -> Var:
        shape, dtype = prng.physical(aval)  # PRNG key arrays hold their key data
        return Var(shape, dtype, bool(getattr(aval, "weak_type", False)))

    def const(self, value: Any) -> Atom:
        arr = np.asarray(prng.key_data(value))
        if arr.ndim == 0:
            return Literal(arr)
        var = Var(arr.shape, arr.dtype)
        self.consts[var] = arr
        return var

    def inline(self, jaxpr: Any, args: list[Atom], outer: str = "<unknown>") -> list[Atom]:
        """Copy `jaxpr`'s equations into the graph. `outer` is the user line of the call
        being inlined: bodies traced once and cached (jnp.fft, jax.nn.relu) carry no
        user frame of their own, so they report their call site."""
        env: dict[Any, Atom] = dict(zip(list(jaxpr.constvars) + list(jaxpr.invars), args))

        def read(v: Any) -> Atom:
            if _is_literal(v):
                return Literal(np.asarray(v.val, dtype=v.aval.dtype))
            return env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            src = source_line(eqn)
            src = outer if src == "<unknown>" else src
            if name in INLINED and _body(eqn) is not None:
                body, consts = open_jaxpr(_body(eqn))
                outs = self.inline(body, [self.const(c) for c in consts] + ins, src)
            elif name in IDENTITY or (name in ONE_DEVICE_IDENTITY and one_device(eqn)):
                outs = ins[: len(eqn.outvars)]
            elif name in RESOLVED:
                outs = [platform_index(eqn.params["platforms"], src)]
            elif name in PLACEHOLDERS:
                outs = [Literal(np.zeros((), eqn.outvars[0].aval.dtype))]
            elif name in SOLVES:
                body, consts = open_jaxpr(eqn.params["jaxprs"].solve)
                outs = self.inline(body, [self.const(c) for c in consts] + _solve_operands(eqn, ins), src)
            elif name in control.PRIMITIVES:  # unrolled loop or select (compiler/control.py)
                outs = control.inline_control(self, eqn, ins, src)
            elif name in prng.RANDOM_PRIMITIVES or prng.touches_keys(eqn):
                outs = prng.expand(self, eqn, ins, src)
            elif (impl := library_impl(eqn)) is not None:  # equinox's primitives, say
                self.control.append(control.ControlDecision(
                    name, src, "inlined", "a library primitive with no rule, traced "
                    "through its implementation in JAX"))
                body, consts = open_jaxpr(impl)
                start = len(self.nodes)
                outs = self.inline(body, [self.const(c) for c in consts] + ins, src)
                # Traced here, its equations would name this file: they carry the call's line.
                self.nodes[start:] = [dataclasses.replace(n, source=src) for n in self.nodes[start:]]
            else:
                outs = [self.new_var(v.aval) for v in eqn.outvars]
                self.nodes.append(Node(eqn.primitive, tuple(ins), tuple(outs),
                                       dict(eqn.params), src,
                                       effectful=bool(getattr(eqn, "effects", None))))
            for v, a in zip(eqn.outvars, outs):
                if not _is_dropvar(v):
                    env[v] = a
        return [read(v) for v in jaxpr.outvars]


def platform_index(platforms: Sequence[Any], src: str) -> Literal:
    """The branch of lax.platform_dependent a CUDA plan takes: the first that names CUDA
    or is the default (None), as JAX's lowering picks it. The CPU interpreter runs the
    same plan, so it takes CUDA's branch too (jax.jit on the CPU takes the CPU's)."""
    for i, names in enumerate(platforms):
        if names is None or PLATFORM in names:
            return Literal(np.asarray(i, np.int32))
    raise UnsupportedPrimitiveError(
        f"nimblejax cannot plan primitive 'platform_index' (from {src}): "
        f"lax.platform_dependent has no branch for {PLATFORM!r} and no default "
        f"(its branches: {platforms}). Use nimble.jit(..., backend=\"jax\") to run this "
        f"function with plain jax.jit.")


def library_impl(eqn: Any) -> Any:
    """The jaxpr of `eqn`'s implementation, for a primitive defined outside JAX whose
    `impl` is written in JAX (equinox's unvmap_any, select_if_vmap, nonbatchable,
    maybe_set...): inlined, it needs no rule of its own. None for any other primitive:
    JAX's own (their impl, defined in jax, dispatches the primitive itself) and those
    with effects, and any primitive nimble has a lowering rule for (a rule wins over the
    implementation: a stand-in of a newer JAX's primitive, say)."""
    from nimblejax.compiler.lowering.registry import RULES
    from nimblejax.compiler.unsupported import NOT_SUPPORTED

    impl = getattr(eqn.primitive, "impl", None)
    module = getattr(getattr(impl, "func", impl), "__module__", None) or "jax"
    if (impl is None or module.split(".")[0] in ("jax", "jaxlib", "nimblejax")
            or eqn.primitive.name in NOT_SUPPORTED or eqn.primitive.name in RULES
            or getattr(eqn, "effects", None)):
        return None
    specs = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
                  for v in eqn.invars)
    key = (eqn.primitive, specs, tuple(sorted(eqn.params.items())))
    try:
        return _IMPLS[key]
    except KeyError:
        pass
    except TypeError:  # a param that cannot be a key (a list, a dict): traced each time
        key = None
    try:
        closed = jax.make_jaxpr(lambda *xs: impl(*xs, **eqn.params))(*specs)
    except Exception:  # an impl that is not traceable JAX (a host call, a C function)
        closed = None
    if closed is not None and eqn.primitive.name in _primitive_names(open_jaxpr(closed)[0]):
        closed = None
    if key is not None:
        if len(_IMPLS) >= _MAX_IMPLS:
            _IMPLS.clear()
        _IMPLS[key] = closed
    return closed


# library_impl's jaxprs by (primitive, operand types, params): the gradient of a diffrax
# solve meets equinox's few primitives about 2,000 times (its test, one process:
# 31 s -> 27 s with the cache).
_IMPLS: dict = {}
_MAX_IMPLS = 4096


def _primitive_names(jaxpr: Any) -> set[str]:
    names: set[str] = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for inner in control._sub_jaxprs(eqn.params):
            names |= _primitive_names(open_jaxpr(inner)[0])
    return names


def _solve_operands(eqn: Any, ins: list) -> list:
    """A custom_linear_solve's operands for its `solve` jaxpr: that jaxpr's constants
    (the third of the four constant groups), then the right-hand side."""
    lengths = eqn.params["const_lengths"]
    start = lengths.matvec + lengths.vecmat
    return ins[start:start + lengths.solve] + ins[sum(lengths):]


def one_device(eqn: Any) -> bool:
    """Whether `eqn`'s `sharding` param places its value on a single device."""
    sharding = eqn.params.get("sharding")
    try:
        return len(sharding.device_set) == 1
    except Exception:  # an abstract mesh's sharding names no devices
        return getattr(sharding, "num_devices", None) == 1


def _body(eqn: Any) -> Any:
    for key in INLINED[eqn.primitive.name]:
        if eqn.params.get(key) is not None:
            return eqn.params[key]
    return None


def _is_literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


def _is_dropvar(v: Any) -> bool:
    return type(v).__name__ == "DropVar"


def _exclude_nimble_frames() -> None:
    """Equations traced through nimble's own call path (runtime/xla_op.py, api.py) name
    the user's line, not ours: JAX skips excluded paths when it picks the user frame."""
    import os

    from jax._src import source_info_util as siu

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nimblejax/
    for path in (os.path.join(package, "runtime") + os.sep, os.path.join(package, "api.py")):
        try:
            siu.register_exclusion(path)
        except Exception:  # private JAX API: without it the line may name nimble's frame
            return


_exclude_nimble_frames()


def source_line(eqn: Any) -> str:
    """file:line of the user's code that emitted `eqn` (JAX's internal frames skipped).
    When that line is in an installed library (optax, flax), the first line of the
    user's own code that led there follows: "optax/...:400, called from train.py:31"."""
    from jax._src import source_info_util as siu

    info = eqn.source_info
    for get in (lambda: siu.user_frame(info.traceback), lambda: siu.user_frame(info)):
        try:
            frame = get()
        except Exception:  # the helper's signature moved across JAX versions
            continue
        if frame is not None and frame.file_name:
            return f"{frame.file_name}:{frame.start_line}" + _called_from(siu, info, frame)
    try:
        return siu.summarize(info) or "<unknown>"
    except Exception:
        return "<unknown>"


_LIBRARY_DIRS = ("site-packages", "dist-packages")


def _called_from(siu: Any, info: Any, frame: Any) -> str:
    if not any(d in frame.file_name for d in _LIBRARY_DIRS):
        return ""
    try:
        for f in siu.user_frames(info.traceback):
            if not any(d in f.file_name for d in _LIBRARY_DIRS):
                return f", called from {f.file_name}:{f.start_line}"
    except Exception:  # private JAX API
        pass
    return ""


def common_subexpressions(graph: Graph) -> Graph:
    """Merge nodes that apply the same primitive with the same params to the same
    inputs (jnp.mean inside jnp.var recomputes the mean, for example)."""
    rename: dict[Var, Atom] = {}
    seen: dict[Any, Node] = {}
    nodes: list[Node] = []
    for node in graph.nodes:
        ins = tuple(rename.get(a, a) if isinstance(a, Var) else a for a in node.inputs)
        if ins != node.inputs:
            node = Node(node.primitive, ins, node.outputs, node.params, node.source, node.effectful)
        key = _cse_key(node)
        prev = seen.get(key) if key is not None else None
        if prev is not None:
            rename.update(zip(node.outputs, prev.outputs))
            continue
        if key is not None:
            seen[key] = node
        nodes.append(node)
    outputs = tuple(rename.get(a, a) if isinstance(a, Var) else a for a in graph.outputs)
    return Graph(graph.inputs, outputs, tuple(nodes), graph.consts)


def _cse_key(node: Node) -> Any:
    if node.effectful:
        return None
    ins = tuple(a if isinstance(a, Var) else ("lit", a.value.dtype.str, a.value.tobytes())
                for a in node.inputs)
    try:
        key = (node.primitive, ins, tuple(sorted(node.params.items())))
        hash(key)
    except TypeError:  # params holding arrays or jaxprs: do not merge
        return None
    return key


def drop_dead_code(graph: Graph) -> Graph:
    live = {a for a in graph.outputs if isinstance(a, Var)}
    kept: list[Node] = []
    for node in reversed(graph.nodes):
        if any(o in live for o in node.outputs) or _has_effect(node):
            kept.append(node)
            live.update(a for a in node.inputs if isinstance(a, Var))
    consts = {v: c for v, c in graph.consts.items() if v in live}
    return Graph(graph.inputs, graph.outputs, tuple(reversed(kept)), consts)


def _has_effect(node: Node) -> bool:
    # Effectful nodes (debug callbacks, io) are kept so that lowering can reject them
    # by name instead of dropping them silently.
    return node.effectful
