"""Why a JAX primitive is not supported: NOT_SUPPORTED, one line of reason per primitive
nimblejax neither lowers, rewrites nor inlines.

The table of compiler/support.py (which re-exports it and checks it against the
compiler's own tables and the installed JAX: tests/compiler/test_primitive_audit.py), in a
module of its own with no imports so that the lowering registry can name the reason in
its unsupported-primitive error without importing the stages support.py reads.

It lists primitives of JAX 0.10.2 (the installed version when it was written), those
that jax-ml/jax main at cec06d1 (2026-08-08, version 0.11.1.dev) adds, and those the audit
found on jax 0.11.2 on the GPU machine: the audit runs on every version we test.
"""
from __future__ import annotations

NOT_SUPPORTED: dict[str, str] = {}


def _reason(reason: str, *names: str) -> None:
    for name in names:
        assert name not in NOT_SUPPORTED, name
        NOT_SUPPORTED[name] = reason


_reason("linear algebra beyond Cholesky, LU and triangular solves of small float32 matrices "
        "(lowering/rules_linalg.py): eigen, QR, SVD and Schur decompositions need cuSOLVER "
        "calls not written yet",
        "cholesky_update", "eig", "eigh", "geqp3", "geqrf", "hessenberg",
        "householder_product", "ormqr", "qr", "schur", "svd",
        "symmetric_product", "tridiagonal", "tridiagonal_solve")
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
_reason("sharding, placement and XLA annotations: a plan runs on one device, without XLA "
        "(a sharding_constraint to one device is the identity)",
        "compute_on", "custom_partitioning", "device_put", "global_array_to_host_local_array",
        "host_local_array_to_global_array", "inspect_sharding", "layout_constraint", "reshard",
        "shard_alike", "shard_map", "sharding_constraint", "xla_metadata_call",
        "xla_metadata_value",
        # jax 0.11.2 (found by this audit on the GPU machine, 2026-11-24):
        "program_order", "relayout")
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
_reason("call-like primitives whose bodies are not inlined yet (custom_vmap, linear_call, "
        "lax.composite)",
        "composite", "custom_jvp_call_jaxpr", "custom_vmap_call",
        "linear_call", "remat_opt")
_reason("random bits from generators other than threefry2x32 (XLA's RngBitGenerator, "
        "rng_uniform, Philox, threefry4x32)",
        "philox2x32", "philox4x32", "rng_bit_generator", "rng_uniform", "threefry4x32")
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
_reason("not lowered yet (no rule written)",
        "approx_top_k")
_reason("JAX-internal bookkeeping (dead-code sinks, staging, uninitialized placeholders, "
        "autodiff zeros): not lowered",
        "dce_sink", "empty", "stage", "tie", "unreachable", "zeros_like")


def reason(name: str) -> str | None:
    """Why `name` is not supported, or None when the table does not list it."""
    return NOT_SUPPORTED.get(name)
