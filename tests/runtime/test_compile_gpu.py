"""runtime/compile.py on the GPU: a first call compiles each of its kernels once, in the
form the graph launches (the programmatic-launch wait included), the early start of
api.py and the graph build asking for the same sources."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.runtime.test_compile import looped

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("pdl_on", [True, False])
def test_a_first_call_compiles_each_kernel_once_in_the_form_it_launches(monkeypatch, pdl_on):
    from nimblejax.runtime import compile as compile_mod
    from nimblejax.runtime import pdl
    from nimblejax.runtime.launch import plan_kernels

    built: list = []
    real = compile_mod._compile_together

    def spy(sources, arch=None):
        built.extend(sources)
        return real(sources, arch)

    monkeypatch.setattr(compile_mod, "_compile_together", spy)
    c = float(np.random.default_rng().uniform(1.5, 2.5))  # new sources: none cached in this process

    def fn(a):
        return looped(a) * c + jnp.tanh(a * c)

    f = nimble.jit(fn, loops="graph", pdl=pdl_on)
    a = jnp.asarray(np.random.default_rng(1).uniform(0.5, 40.0, 256), jnp.float32)
    np.testing.assert_allclose(np.asarray(f(a)), np.asarray(jax.jit(fn)(a)), rtol=1e-5, atol=1e-5)
    launched = {k.source for k in plan_kernels(f.plan(a), pdl.applies(pdl_on), nested=True)}
    assert built and len(built) == len(set(built)), "a kernel compiled twice"
    assert set(built) <= launched, "a source compiled that the graph does not launch"


def subnormal_mix(n: int = 4096) -> np.ndarray:
    """float32 values of both signs: subnormal ones, the smallest normal ones, ordinary ones."""
    rng = np.random.default_rng(7)
    tiny = np.finfo(np.float32).tiny
    parts = [rng.uniform(0, tiny, n // 4), rng.uniform(tiny, 4 * tiny, n // 4),
             rng.uniform(0.5, 2.0, n // 4), np.ldexp(1.0, rng.integers(-149, -126, n // 4))]
    x = np.concatenate(parts).astype(np.float32)
    return x * rng.choice(np.float32([-1, 1]), x.size)


@pytest.mark.parametrize("name, fn", [
    ("half", lambda x, y: x * 0.5),
    ("product", lambda x, y: x * y),
    ("sum", lambda x, y: x + y * 0.25),
    ("sqrt", lambda x, y: jnp.sqrt(jnp.abs(x)) * y),
    ("max", lambda x, y: jnp.maximum(x, y)),
])
def test_subnormal_operands_and_results_bit_for_bit_as_jax_jit(name, fn):
    """XLA's GPU kernels keep subnormal float32 values (no flush to zero); nimble's are
    compiled so too (runtime/compile.py's load_module), so the bits agree."""
    x = subnormal_mix()
    y = np.roll(x, 1) * np.float32(3.0)
    args = (jnp.asarray(x), jnp.asarray(y))
    got = np.asarray(nimble.jit(fn)(*args)).view(np.int32)
    want = np.asarray(jax.jit(fn)(*args)).view(np.int32)
    differ = np.flatnonzero(got != want)
    assert differ.size == 0, f"{name}: {differ.size} of {x.size} differ, e.g. x={x[differ[:3]]}"


def test_the_handlers_copy_kernel_is_built_with_the_handler(monkeypatch):
    """Compiled by NVRTC into the handler's cache folder, not through CuPy's RawKernel
    (whose compile preprocesses the source first: 0.23-0.53 s of a cold first call on
    an H200), and loaded from there by a process that finds it built."""
    import cupy

    from nimblejax.runtime import compile as compile_mod
    from nimblejax.runtime import ffi_runner

    folders: list = []
    real = compile_mod.load_module

    def spy(code, options=compile_mod.OPTIONS, folder=None, arch=None):
        folders.append(folder)
        return real(code, options, folder, arch)

    def refuse(*args, **kwargs):
        raise AssertionError("compiled through CuPy's RawKernel")

    monkeypatch.setattr(compile_mod, "load_module", spy)
    monkeypatch.setattr(compile_mod, "_runtime_modules", {})
    monkeypatch.setattr(ffi_runner, "_COPY_FUNCTIONS", {})
    monkeypatch.setattr(cupy, "RawKernel", refuse)

    def fn(a, b):
        return jnp.tanh(a) * b + jnp.sin(b)

    f = nimble.jit(fn)
    rng = np.random.default_rng(3)
    a, b = (jnp.asarray(rng.standard_normal(512), jnp.float32) for _ in range(2))
    np.testing.assert_allclose(np.asarray(f(a, b)), np.asarray(jax.jit(fn)(a, b)), rtol=1e-6, atol=1e-6)
    if getattr(f, "_library", None) is None:
        pytest.skip("the XLA FFI handler is not built on this machine")
    from nimblejax.options import cache_dir

    assert cache_dir() in folders


def test_a_cold_first_call_starts_compiling_before_cupy_is_imported(tmp_path):
    """A fresh process with CuPy's background import off (NIMBLE_PRELOAD=0: the first call
    imports it): the plan's kernels start compiling (NVRTC called directly,
    runtime/nvrtc.py) before CuPy is imported, so that CuPy's import runs beside them;
    the call's result is jax.jit's."""
    import subprocess
    import sys

    script = """
import sys
import jax, jax.numpy as jnp, numpy as np
import nimblejax as nimble
from nimblejax.runtime import compile as compile_mod
seen = []
real = compile_mod.start_compiling
def spy(kernels):
    kernels = list(kernels)
    if kernels:
        seen.append("cupy" in sys.modules)
    return real(kernels)
compile_mod.start_compiling = spy
fn = lambda x: jnp.tanh(x) * 2.0 + jnp.sin(x)
x = jnp.asarray(np.random.default_rng(0).standard_normal(4096), jnp.float32)
got = nimble.jit(fn)(x)
np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(fn)(x)), rtol=1e-6, atol=1e-6)
print("cupy imported at the first start:", seen[0], "cupy now:", "cupy" in sys.modules)
"""
    env = {**__import__("os").environ, "CUPY_CACHE_DIR": str(tmp_path / "kernels"), "NIMBLE_PRELOAD": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cupy imported at the first start: False cupy now: True" in done.stdout, done.stdout


def test_the_background_cupy_import_leaves_cuda_visible_devices_to_the_program():
    """`import nimblejax` imports CuPy on a thread (runtime/preload.py) without
    initializing the driver: a program that hides every GPU afterwards, before its first
    CUDA use, sees none, as it would after `import jax` alone."""
    import subprocess
    import sys

    script = """
import os
import nimblejax
from nimblejax.runtime import preload
thread = preload.start()
preload.join()
import sys
print("preloaded:", thread is not None and "cupy" in sys.modules)
os.environ["CUDA_VISIBLE_DEVICES"] = ""
import cupy
try:
    count = cupy.cuda.runtime.getDeviceCount()
except cupy.cuda.runtime.CUDARuntimeError:
    count = 0
print("devices:", count)
"""
    env = {**__import__("os").environ, "NIMBLE_PRELOAD": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "preloaded: True" in done.stdout and "devices: 0" in done.stdout, done.stdout
