"""What nimble.jit accepts as an argument, and the part of an argument a plan depends on.

Shared by the call paths in api.py and the residency check (runtime/residency.py),
which compares a leaf's signature with the previous call's.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


# Frames of these packages are not the user's: a warning names the first frame outside them.
_INTERNAL_PREFIXES = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                           for m in (sys.modules[__name__.rpartition(".")[0]], jax))


def warn_at_user_line(message: str, category: type = UserWarning) -> None:
    """warnings.warn pointing at the user's line: the first frame outside nimblejax and
    jax (a nimble function may be called from inside jax.jit, vmap or grad)."""
    frame, level = sys._getframe(0), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL_PREFIXES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def as_tuple(x) -> tuple:
    if x is None:
        return ()
    return (x,) if isinstance(x, (int, str)) else tuple(x)


def is_array_like(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float)) or \
        hasattr(x, "__cuda_array_interface__")


def check_leaf(name: str, leaf: Any, fun: Callable) -> Any:
    """`leaf`, or a TypeError naming it by its path (`params[0]['w']`, as jax.jit does)."""
    if is_array_like(leaf):
        return leaf
    raise TypeError(
        f"argument {name} of {getattr(fun, '__name__', 'the function')} is a "
        f"{type(leaf).__name__}, not an array: pass a jax/numpy/cupy array or a Python "
        f"scalar, or mark the argument static with static_argnums/static_argnames")


def named_leaves(fun: Callable, args: tuple, kwargs: dict, static_argnums: tuple):
    """(name, leaf) for every leaf of the dynamic arguments (statics taken out), named as
    jax.jit names them: the parameter's name, then the path inside it (`x`,
    `params[0][1]`, `rest[2]` for *rest, `kw['a']` for **kw)."""
    names = _positional_names(fun, len(args), static_argnums)
    for name, arg in zip(names, args):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            yield name + jax.tree_util.keystr(path), leaf
    keywords, var_keyword = _keyword_names(fun)
    for key in sorted(kwargs):
        name = key if key in keywords or var_keyword is None else f"{var_keyword}[{key!r}]"
        for path, leaf in jax.tree_util.tree_flatten_with_path(kwargs[key])[0]:
            yield name + jax.tree_util.keystr(path), leaf


def _positional_names(fun: Callable, count: int, static_argnums: tuple) -> list[str]:
    """Names of the first `count` positional arguments that are not static."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        params = []
    named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
    names, position = [], 0
    while len(names) < count:
        if position not in static_argnums:
            if position < len(named):
                names.append(named[position])
            else:  # past the named ones: *args, or the position where there is no name
                names.append(f"{var or 'args'}[{position - len(named)}]")
        position += 1
    return names


def _keyword_names(fun: Callable) -> tuple[set, str | None]:
    """The names a keyword argument can bind to, and the **kwargs parameter's name."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return set(), None
    var = next((p.name for p in params if p.kind == p.VAR_KEYWORD), None)
    return {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}, var


def check_hashable(statics: tuple, fun: Callable) -> None:
    for _, v in statics:
        try:
            hash(v)
        except TypeError:
            raise TypeError(f"static argument {v!r} of {fun.__name__} must be "
                            f"hashable (it is part of the cache key)") from None


def signature(x: Any) -> tuple:
    """(shape, dtype, weak_type): the part of an argument a plan depends on."""
    if isinstance(x, (bool, int, float)) and not isinstance(x, np.generic):
        return (), _scalar_dtype(x), True  # Python scalars are weakly typed, as in jax.jit
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # kept: the plan unwraps it
        return tuple(x.shape), x.dtype if key else np.dtype(x.dtype), bool(getattr(x, "weak_type", False))
    dtype = np.dtype(x.dtype)
    if dtype == np.float64 and not jax.config.jax_enable_x64:
        dtype = np.dtype(np.float32)
    elif dtype == np.int64 and not jax.config.jax_enable_x64:
        dtype = np.dtype(np.int32)
    return tuple(x.shape), dtype, False


def spec(x: Any) -> jax.ShapeDtypeStruct:
    """The abstract value a plan is traced at for argument `x`."""
    shape, dtype, weak = signature(x)
    return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)


def _scalar_dtype(x: bool | int | float) -> np.dtype:
    """jnp.asarray(x).dtype without making an array (that takes 20 µs, on every call
    that passes a Python scalar): it depends only on the kind of scalar and x64."""
    kind = bool if isinstance(x, bool) else int if isinstance(x, int) else float
    dtype, low, high = _kind_dtype(kind, bool(jax.config.jax_enable_x64))
    if kind is int and not low <= x <= high:
        dtype = jnp.asarray(x).dtype  # out of range: raises OverflowError, as jax.jit does
    return dtype


@functools.cache
def _kind_dtype(kind: type, x64: bool) -> tuple[np.dtype, int, int]:
    """(dtype, and for an int its range) of a Python scalar of `kind` (x64 keys the cache)."""
    dtype = np.dtype(jnp.asarray(kind(0)).dtype)
    info = np.iinfo(dtype) if kind is int else None
    return dtype, info.min if info else 0, info.max if info else 0


def split_statics(static_argnums: tuple, static_argnames: tuple, args: tuple, kwargs: dict) -> tuple:
    """(statics, dynamic args, dynamic kwargs); statics are (position or name, value)."""
    if not (static_argnums or static_argnames):
        return (), args, kwargs
    statics = tuple((i, args[i]) for i in static_argnums if i < len(args))
    statics += tuple(sorted((k, v) for k, v in kwargs.items() if k in static_argnames))
    args = tuple(a for i, a in enumerate(args) if i not in static_argnums)
    kwargs = {k: v for k, v in kwargs.items() if k not in static_argnames}
    return statics, args, kwargs


def static_positions(fun: Callable, nums: tuple, names: tuple) -> tuple[tuple, tuple]:
    """Complete static_argnums from static_argnames and back, as jax.jit does; refuse
    positions and names the function does not have (ValueError, as jax.jit)."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return tuple(nums), tuple(names)
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    has_varkw = any(p.kind == p.VAR_KEYWORD for p in params)
    bad_nums = [i for i in nums if not has_varargs and not -len(positional) <= i < len(positional)]
    if bad_nums:
        raise ValueError(f"static_argnums {bad_nums} out of range: "
                         f"{getattr(fun, '__name__', 'the function')} takes {len(positional)} "
                         f"positional argument(s)")
    known = {p.name for p in params if p.kind != p.VAR_POSITIONAL}
    bad_names = sorted(n for n in names if n not in known) if not has_varkw else []
    if bad_names:
        raise ValueError(f"static_argnames {bad_names} are not parameters of "
                         f"{getattr(fun, '__name__', 'the function')} (it takes {sorted(known)})")
    nums = set(i if i >= 0 else len(positional) + i for i in nums)
    names = set(names)
    for i in list(nums):
        if i < len(positional):
            names.add(positional[i])
    for n in list(names):
        if n in positional:
            nums.add(positional.index(n))
    return tuple(sorted(nums)), tuple(sorted(names))


def name_like(flat_fun: Callable, fun: Callable, num_leaves: int, args: list, kwargs: dict,
              static_argnums: tuple, static_argnames: tuple) -> None:
    """Make JAX's tracing errors about `flat_fun` name `fun` and its arguments, as jax.jit
    does ("while tracing the function f at file:line ... the argument x"): JAX's debug
    info for `fun` at these arguments (flat leaves in flat_fun's order), on flat_fun."""
    try:
        from jax._src import api_util

        dbg = api_util.debug_info("jit", fun, args, kwargs, static_argnums=static_argnums,
                                  static_argnames=static_argnames)
        if len(dbg.arg_names or ()) != num_leaves:
            return  # names and flat_fun's arguments disagree: keep JAX's generic names
        save = getattr(api_util, "save_wrapped_fun_debug_info", None)
        if save is not None:
            save(flat_fun, dbg)
        else:
            flat_fun.__fun_debug_info__ = dbg
    except Exception:  # noqa: BLE001 - only a nicer message is lost (a JAX without this API)
        pass


def donated_leaves(in_tree, donate_argnums: tuple, static_argnums: tuple) -> frozenset[int]:
    """Flat indices of the leaves of `in_tree` ((args, kwargs) of the dynamic arguments)
    that belong to donated positional arguments."""
    if not donate_argnums:
        return frozenset()
    args_tree = in_tree.children()[0]
    n_args = len(args_tree.children()) + len(static_argnums)
    dyn_positions = [i for i in range(n_args) if i not in static_argnums]
    donated, start = set(), 0
    for pos, child in zip(dyn_positions, args_tree.children()):
        if pos in donate_argnums:
            donated.update(range(start, start + child.num_leaves))
        start += child.num_leaves
    return frozenset(donated)
