"""Compile-only tests for nimblejax.testing.nvrtc_check; they need no GPU."""

from __future__ import annotations

import pytest

from nimblejax.testing.nvrtc_check import (
    KernelCompileError,
    available_compiler,
    available_compilers,
    compile_to_ptx,
    include_dirs,
)

if available_compiler() is None:
    pytest.skip("neither NVRTC nor nvcc is available", allow_module_level=True)

# Exercise every backend present, so the nvcc fallback is covered too.
compilers = pytest.mark.parametrize("compiler", available_compilers())

SAXPY = r"""
extern "C" __global__ void saxpy(const float* x, const float* y, float* out,
                                 float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = a * x[i] + y[i];
    }
}
"""

HALF_BF16 = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

extern "C" __global__ void mixed(const __half* xh, const __nv_bfloat16* xb,
                                 __half* yh, __nv_bfloat16* yb, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    __half h = hexp(xh[i]) * __float2half(0.5f) + xh[i];
    __nv_bfloat16 b = xb[i] * __float2bfloat16(2.0f) - hexp(xb[i]);
    float mixed = __half2float(h) + __bfloat162float(b);
    yh[i] = __float2half_rn(silu(mixed));
    yb[i] = __float2bfloat16(mixed);
}
"""

BROKEN = r"""extern "C" __global__ void broken(float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = undefined_symbol_xyz * 2.0f;
    }
}
"""
BROKEN_LINE = 4


def test_available_compiler_is_known() -> None:
    assert available_compiler() in ("nvrtc", "nvcc")
    assert available_compiler() == available_compilers()[0]


def test_include_dirs_hold_fp16_headers() -> None:
    assert include_dirs(), "cuda_fp16.h not found; NVRTC cannot build half kernels"


@compilers
def test_elementwise_f32(compiler: str) -> None:
    ptx = compile_to_ptx(SAXPY, "saxpy", compiler=compiler)
    assert ".entry saxpy" in ptx
    assert ".target sm_90" in ptx


@compilers
def test_half_and_bfloat16_kernel(compiler: str) -> None:
    ptx = compile_to_ptx(HALF_BF16, "mixed", compiler=compiler)
    # extern "C" keeps the name unmangled, which the loader relies on.
    assert ".entry mixed" in ptx


@compilers
def test_arch_is_respected(compiler: str) -> None:
    ptx = compile_to_ptx(SAXPY, "saxpy80", arch="sm_80", compiler=compiler)
    assert ".target sm_80" in ptx


@compilers
def test_broken_kernel_reports_offending_line(compiler: str) -> None:
    with pytest.raises(KernelCompileError) as info:
        compile_to_ptx(BROKEN, "broken", compiler=compiler)
    err = info.value
    assert err.compiler == compiler
    assert BROKEN_LINE in err.lines
    message = str(err)
    assert "undefined_symbol_xyz" in message
    # The numbered, marked source line itself is quoted.
    assert f">> {BROKEN_LINE} |         out[i] = undefined_symbol_xyz * 2.0f;" in message


@compilers
def test_undecorated_helper_is_rejected(compiler: str) -> None:
    # Without -default-device a host function cannot be called from a kernel,
    # matching how CuPy compiles the same source on the GPU machine.
    source = (
        "float twice(float v) { return 2.0f * v; }\n"
        'extern "C" __global__ void k(float* x) { x[0] = twice(x[0]); }\n'
    )
    with pytest.raises(KernelCompileError) as info:
        compile_to_ptx(source, "host_helper", compiler=compiler)
    # NVRTC flags the definition (line 1), nvcc the call site (line 2).
    assert set(info.value.lines) & {1, 2}


@compilers
def test_missing_header_is_a_compile_error(compiler: str) -> None:
    source = '#include <no_such_header_nimblejax.h>\nextern "C" __global__ void k() {}\n'
    with pytest.raises(KernelCompileError) as info:
        compile_to_ptx(source, "missing_header", compiler=compiler)
    assert "no_such_header_nimblejax.h" in str(info.value)


def test_forced_compiler_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in available_compilers():
        monkeypatch.setenv("NIMBLEJAX_KERNEL_COMPILER", name)
        assert available_compiler() == name
    monkeypatch.setenv("NIMBLEJAX_KERNEL_COMPILER", "no-such-compiler")
    assert available_compiler() is None
