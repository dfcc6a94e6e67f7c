"""Which JAX primitives nimblejax handles, and how: the one table that the audit test
(tests/test_primitive_audit.py), the README's "not supported" list and the
unsupported-primitive error read.

Every primitive of JAX is in exactly one group:

- lowered: a rule in the lowering registry (compiler/lowering/registry.py);
- rewritten: replaced by other primitives before lowering: canonicalization
  (compiler/canonicalize/), loops and conds flattened (compiler/control.py), random
  numbers expanded into threefry arithmetic (compiler/prng.py);
- inlined: call-like primitives whose body is copied into the graph, and identities
  (compiler/trace.py);
- not supported: NOT_SUPPORTED below, each with a one-line reason.

NOT_SUPPORTED lists primitives of JAX 0.10.2 (the installed version when it was
written) and those that jax-ml/jax main at cec06d1 (2026-08-08, version 0.11.1.dev)
adds: the audit runs on newer versions too. `python -m nimblejax.compiler.support`
prints the counts of each group for the installed JAX (and any primitive in none);
`--markdown` prints the README's table.
"""
from __future__ import annotations

import importlib
import sys
from collections import Counter

LOWERED, REWRITTEN, INLINED, NOT_SUPPORTED_GROUP = "lowered", "rewritten", "inlined", "not supported"
GROUPS = (LOWERED, REWRITTEN, INLINED, NOT_SUPPORTED_GROUP)

NOT_SUPPORTED: dict[str, str] = {}


def _reason(reason: str, *names: str) -> None:
    for name in names:
        assert name not in NOT_SUPPORTED, name
        NOT_SUPPORTED[name] = reason


_reason("linear algebra: factorizations and solves need cuSOLVER/cuBLAS calls not written yet",
        "cholesky", "cholesky_update", "eig", "eigh", "geqp3", "geqrf", "hessenberg",
        "householder_product", "lu", "lu_pivots_to_permutation", "ormqr", "qr", "schur", "svd",
        "symmetric_product", "triangular_solve", "tridiagonal", "tridiagonal_solve")
_reason("FFT: no cuFFT call yet", "fft")
_reason("complex numbers: complex64/complex128 are not supported dtypes",
        "complex", "conj", "real", "imag")
_reason("collectives and named axes: a plan is one device's program (use the nimble function "
        "as shard_map's per-device body, with the collectives outside it)",
        "all_gather", "all_gather_done", "all_gather_invariant", "all_gather_reduced",
        "all_gather_reduced_start", "all_gather_start", "all_to_all", "all_to_all_done",
        "all_to_all_start", "axis_index", "pbroadcast", "pbroadcast_done", "pbroadcast_start",
        "pmax", "pmin", "ppermute", "ppermute_done", "ppermute_start", "precv", "preduced",
        "psend", "psum", "psum_done", "psum_invariant", "psum_invariant_start", "psum_start",
        "pvary", "ragged_all_to_all", "reduce_scatter", "reduce_scatter_done",
        "reduce_scatter_start", "reduced_vary_cast_p", "unreduced_psum", "unreduced_psum_start",
        "unreduced_reduce_scatter", "unreduced_reduce_scatter_start", "vary_unreduced_cast_p",
        # jax 0.11 (main at cec06d1):
        "unreduced_pmax", "unreduced_pmin")
_reason("sharding, placement and XLA annotations: a plan runs on one device, without XLA",
        "compute_on", "custom_partitioning", "device_put", "global_array_to_host_local_array",
        "host_local_array_to_global_array", "inspect_sharding", "layout_constraint", "reshard",
        "shard_alike", "shard_map", "sharding_constraint", "xla_metadata_call",
        "xla_metadata_value")
_reason("host callbacks, tokens and checkify checks: a captured CUDA graph makes no host "
        "round trips", "after_all", "buffer_callback", "check", "create_token", "debug_callback",
        "debug_print", "io_callback", "pure_callback")
_reason("calls into other compilers and libraries (XLA FFI, cuDNN fused attention and RNN, "
        "Pallas, exported StableHLO): not lowered",
        "call_exported", "core_map", "cudnn_fusion", "dot_product_attention_bwd",
        "dot_product_attention_bwd_wrapper", "dot_product_attention_fp8_bwd",
        "dot_product_attention_fp8_bwd_wrapper", "dot_product_attention_fp8_fwd",
        "dot_product_attention_fp8_fwd_wrapper", "dot_product_attention_fwd",
        "dot_product_attention_fwd_wrapper", "ffi_call", "fused_call", "pallas_call", "rnn_bwd",
        "rnn_fwd", "scaled_matmul", "scaled_matmul_wrapper", "with_memory_space_constraint")
_reason("call-like primitives whose bodies are not inlined yet (custom_linear_solve, "
        "custom_vmap, linear_call, lax.composite, platform_dependent)",
        "composite", "custom_jvp_call_jaxpr", "custom_linear_solve", "custom_vmap_call",
        "linear_call", "platform_index", "remat_opt")
_reason("random bits from generators other than threefry2x32 (XLA's RngBitGenerator, "
        "rng_uniform, Philox, threefry4x32)",
        "philox2x32", "philox4x32", "rng_bit_generator", "rng_uniform", "threefry4x32")
_reason("jax.random.gamma, beta and dirichlet: random_gamma's rejection loop has no static "
        "trip count", "random_gamma")
_reason("mutable state (jax Refs, run_state, hijax boxes and logs): not traced",
        "accum_grad_in_ref", "addupdate", "box_get", "box_set", "broadcast_to",
        "call_hi_primitive", "call_hi_primitive_linearized", "create_linear", "empty_ref",
        "free_ref", "freeze", "get", "log_extend", "log_read", "new_box", "new_log", "new_ref",
        "pin", "run_state", "swap", "unpin")
_reason("symbolic shapes (jax.export shape polymorphism): plans have static shapes",
        "dim_as_value", "dimension_size", "shape_assertion")
_reason("reductions and windows with a user-written body (lax.reduce, lax.reduce_window with a "
        "function, select_and_scatter): only the named reducers are lowered",
        "reduce", "reduce_window", "select_and_gather_add", "select_and_scatter")
_reason("sparse arrays (jax.experimental.sparse): not lowered",
        "bcoo_dot_general", "bcoo_dot_general_sampled", "bcoo_extract", "bcoo_fromdense",
        "bcoo_sort_indices", "bcoo_spdot_general", "bcoo_sum_duplicates", "bcoo_todense",
        "bcoo_transpose", "bcsr_dot_general", "bcsr_extract", "bcsr_fromdense", "bcsr_todense",
        "coo_fromdense", "coo_matmat", "coo_matvec", "coo_spmm", "coo_spmv", "coo_todense",
        "csr_fromdense", "csr_matmat", "csr_matvec", "csr_spmm", "csr_spmv", "csr_todense",
        "spsolve", "todense")
_reason("extended dtypes other than PRNG keys: not supported", "from_edtype", "to_edtype")
_reason("block-scaled and ragged matrix products (fp8/mx scales, grouped GEMMs): not lowered yet",
        "ragged_dot_general", "scaled_dot")
_reason("comparisons in JAX's total order (jnp.searchsorted, sort comparators): not lowered yet",
        "eq_to", "le_to", "lt_to")
_reason("not lowered yet (no rule written)",
        "approx_top_k", "polygamma", "reduce_xor", "scatter-sub", "zeta")
_reason("JAX-internal bookkeeping (dead-code sinks, staging, uninitialized placeholders, "
        "autodiff zeros): not lowered",
        "dce_sink", "empty", "empty2", "stage", "tie", "unreachable", "zeros_like")


# ---- classification --------------------------------------------------------------
def handled() -> dict[str, frozenset[str]]:
    """The names each group other than "not supported" holds, from the compiler's own
    tables (so a new rule or rewrite moves a primitive without an edit here)."""
    from nimblejax.compiler import control, prng, trace
    from nimblejax.compiler.canonicalize import REWRITTEN as CANONICALIZED
    from nimblejax.compiler.lowering import RULES

    return {
        LOWERED: frozenset(RULES),
        REWRITTEN: frozenset(CANONICALIZED | control.PRIMITIVES | prng.RANDOM_PRIMITIVES),
        INLINED: frozenset(set(trace.INLINED) | trace.IDENTITY),
        NOT_SUPPORTED_GROUP: frozenset(NOT_SUPPORTED),
    }


def groups_of(name: str) -> list[str]:
    """Every group holding `name` (the audit wants exactly one)."""
    return [g for g, names in handled().items() if name in names]


def classify(name: str) -> str | None:
    """The group of `name`, or None when no group holds it."""
    found = groups_of(name)
    return found[0] if found else None


def reason(name: str) -> str | None:
    return NOT_SUPPORTED.get(name)


# ---- the primitives of the installed JAX ------------------------------------------
# Imported before the walk: every public module a function may draw primitives from.
# Missing ones (moved or removed in some JAX version) are skipped and reported.
AUDITED_MODULES = (
    "jax", "jax.numpy", "jax.numpy.fft", "jax.numpy.linalg", "jax.scipy.special",
    "jax.scipy.linalg", "jax.scipy.signal", "jax.scipy.stats", "jax.scipy.fft",
    "jax.scipy.ndimage", "jax.scipy.sparse.linalg", "jax.scipy.optimize",
    "jax.scipy.integrate", "jax.scipy.interpolate", "jax.scipy.spatial.transform",
    "jax.random", "jax.nn", "jax.nn.initializers", "jax.lax", "jax.lax.linalg", "jax.image",
    "jax.ops", "jax.ad_checkpoint", "jax.custom_derivatives", "jax.custom_batching",
    "jax.debug", "jax.ffi", "jax.extend", "jax.export", "jax.sharding",
    "jax.experimental", "jax.experimental.checkify", "jax.experimental.sparse",
    "jax.experimental.custom_partitioning", "jax.experimental.compute_on",
    "jax.experimental.multihost_utils", "jax.experimental.shard_map", "jax.experimental.ode",
    "jax.experimental.jet", "jax.experimental.key_reuse", "jax.experimental.layout",
    "jax.experimental.buffer_callback", "jax.experimental.rnn", "jax.experimental.shard_alike",
    "jax.experimental.xla_metadata", "jax.experimental.fused",
)


def installed_primitives() -> tuple[dict[str, list[str]], list[str]]:
    """({primitive name: modules holding it}, modules that failed to import): every
    `Primitive` that is an attribute of a `jax` module loaded after importing
    AUDITED_MODULES (jax._src's modules included). What is loaded depends on what the
    process imported before, so the audit test calls this in a fresh interpreter."""
    from jax._src import core

    skipped = []
    for module in AUDITED_MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:  # moved or removed in this JAX version
            skipped.append(f"{module} ({type(e).__name__})")
    found: dict[str, set[str]] = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "jax" or module_name.startswith("jax.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, core.Primitive):
                found.setdefault(value.name, set()).add(module_name)
    return {k: sorted(v) for k, v in sorted(found.items())}, skipped


def counts(names) -> Counter:
    """How many of `names` each group holds ("unclassified": none)."""
    return Counter(classify(n) or "unclassified" for n in names)


# ---- README ------------------------------------------------------------------------
def markdown_table() -> str:
    """The README's table of unsupported primitives, one row per reason (README.md must
    contain it verbatim: tests/test_primitive_audit.py)."""
    by_reason: dict[str, list[str]] = {}
    for name, why in NOT_SUPPORTED.items():
        by_reason.setdefault(why, []).append(name)
    rows = ["| why | primitives |", "|---|---|"]
    for why, names in by_reason.items():
        rows.append(f"| {why} | {', '.join(f'`{n}`' for n in sorted(names))} |")
    return "\n".join(rows) + "\n"


def summary(names) -> str:
    """One line of counts for the installed JAX, as the README cites it."""
    import jax

    c = counts(names)
    parts = [f"{c[g]} {g}" for g in GROUPS]
    if c["unclassified"]:
        parts.append(f"{c['unclassified']} unclassified")
    return f"jax {jax.__version__}: {len(names)} primitives: " + ", ".join(parts)


def main(argv: list[str]) -> int:
    import json

    if "--markdown" in argv:  # README's table
        print(markdown_table(), end="")
        return 0
    names, skipped = installed_primitives()
    if "--json" in argv:  # for tests/test_primitive_audit.py
        print(json.dumps({"primitives": names, "skipped": skipped}))
        return 0
    print(summary(names))
    for name in sorted(n for n in names if classify(n) is None):
        print(f"  unclassified: {name} ({', '.join(names[name][:2])})")
    if skipped:
        print("modules not importable here: " + ", ".join(skipped))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
