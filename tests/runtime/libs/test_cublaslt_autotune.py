"""cuBLASLt's algorithm timing on filled operands (runtime/libs/cublaslt.py: LtGemm._filled):
candidates run on fresh buffers of pseudo-random values of the operands' dtypes, never
on the plan's (possibly uninitialized) buffers, which are neither read nor written.
CPU tests check the values and which buffers are filled; `gpu` tests run it."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import pytest

from nimblejax.compiler.lowering.task import Epilogue, GemmCall
from nimblejax.runtime.libs import cublaslt, fill

WORKSPACE_BYTES = 4 << 20


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_random_values_fill_every_element_in_range(dtype):
    x = fill.random_values(np, 4099, dtype)  # numpy has CuPy's array API used here
    if dtype == "bfloat16":
        assert x.dtype == np.uint16
        x = (x.astype(np.uint32) << 16).view(np.float32)
    values = x.astype(np.float64)
    assert values.shape == (4099,) and np.all(np.isfinite(values))
    assert values.min() >= -1.0 and values.max() < 1.0
    # Spread over the range, not a constant or a short cycle.
    assert abs(values.mean()) < 0.05 and 0.5 < values.std() < 0.65
    assert len(np.unique(values)) > (2000 if dtype == "float32" else 200)
    with pytest.raises(ValueError, match="int8"):
        fill.random_values(np, 4, "int8")


@dataclass
class _Fake:
    """A device array as _filled sees it: its pointer, and what was asked for."""

    elements: int
    dtype: str
    ptr: int

    @property
    def data(self):
        return self

    @property
    def nbytes(self) -> int:
        return self.elements * (2 if self.dtype in ("bfloat16", "float16") else 4)


class _FakeCupy:
    """The two CuPy calls _filled makes besides fill_values: empty and memcpyAsync."""

    def __init__(self, made: list, copies: list) -> None:
        self.made = made
        runtime = type("runtime", (), {"memcpyDeviceToDevice": 3,
                                       "memcpyAsync": staticmethod(lambda *a: copies.append(a))})
        self.cuda = type("cuda", (), {"runtime": runtime})

    def empty(self, elements: int, dtype: str) -> _Fake:
        self.made.append(_Fake(elements, dtype, 0x1000 * (len(self.made) + 1)))
        return self.made[-1]


def test_filled_reads_the_fill_arrays_and_writes_a_copy(monkeypatch):
    made: list[_Fake] = []
    copies: list[tuple] = []
    pools: dict[str, _Fake] = {}

    def fake_fill(cupy, elements, dtype):  # one array per dtype, grown when too short
        if dtype not in pools or pools[dtype].elements < elements:
            pools[dtype] = _Fake(elements, dtype, 0x1000 * (len(made) + 1))
            made.append(pools[dtype])
        return pools[dtype]

    monkeypatch.setattr(cublaslt, "fill_values", fake_fill)
    # Strided A (BERT's heads at batch 1), a bias and a residual, bf16 in, f32 out.
    call = GemmCall(12, 128, 64, 128, False, False, "bfloat16", "f32_from_half",
                    out_dtype="float32", beta=1.0, lda=768, stride_a=64,
                    epilogue=Epilogue(bias=True, residual=True))
    gemm = object.__new__(cublaslt.LtGemm)  # no library: _filled reads only these
    gemm.call, gemm.has_bias, gemm.has_residual = call, True, True
    buf = cublaslt.GemmBuffers(1, 2, 3, 0x77, stream=0x88, bias=4, residual=5)
    held: list = []
    stream = type("stream", (), {"ptr": 0x99, "__enter__": lambda s: s,
                                 "__exit__": lambda s, *e: None})()
    filled = gemm._filled(_FakeCupy(made, copies), buf, stream, held)
    assert all(m in held for m in made)  # alive until the timing stream is done
    want = {"a": (11 * 64 + 127 * 768 + 128, "bfloat16"), "b": (12 * 128 * 64, "bfloat16"),
            "c": (12 * 128 * 64, "float32"), "bias": (64, "float32"),
            "residual": (12 * 128 * 64, "float32")}
    for name, (elements, dtype) in want.items():
        array = next(m for m in made if m.ptr == getattr(filled, name))
        assert array.dtype == dtype and array.elements >= elements, name
    # C, which the GEMM writes, is a buffer of its own, copied from the fill array.
    c = next(m for m in made if m.ptr == filled.c)
    assert c not in pools.values() and c.elements == want["c"][0]
    assert copies == [(filled.c, pools["float32"].ptr, c.nbytes, 3, 0x99)]
    assert (filled.workspace, filled.stream) == (0x77, 0x88)  # the plan's workspace
    assert not {1, 2, 3, 4, 5} & {filled.a, filled.b, filled.c, filled.bias, filled.residual}


class _HostArray:
    """A numpy array as CuPy's: `.data.ptr` its address (host memory stands in)."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = np.ascontiguousarray(values)
        self.data = type("data", (), {"ptr": self.values.ctypes.data})()
        self.dtype, self.itemsize, self.size = self.values.dtype, self.values.itemsize, self.values.size


class _HostCupy:
    """asarray, empty, the current stream and memcpyAsync (as a memmove) over host memory."""

    def __init__(self) -> None:
        self.copies = 0

        def memcpy(dst, src, n, kind, stream):
            assert kind == 3 and stream == 0
            self.copies += 1
            ctypes.memmove(dst, src, n)

        runtime = type("runtime", (), {"memcpyDeviceToDevice": 3, "memcpyAsync": staticmethod(memcpy)})
        stream = type("stream", (), {"ptr": 0})()
        self.cuda = type("cuda", (), {"runtime": runtime,
                                      "get_current_stream": staticmethod(lambda: stream)})

    def asarray(self, values: np.ndarray) -> _HostArray:
        return _HostArray(values)

    def empty(self, elements: int, dtype) -> _HostArray:
        return _HostArray(np.empty(elements, dtype))


def test_fill_values_repeat_one_block_grow_and_are_released(monkeypatch):
    monkeypatch.setattr(fill, "_FILL", {})
    monkeypatch.setattr(fill, "_BLOCKS", {})
    monkeypatch.setattr(fill, "FILL_BLOCK", 4)
    cupy = _HostCupy()
    small = fill.fill_values(cupy, 10, "float32")
    block = fill.random_values(np, 4, "float32")
    assert np.array_equal(small.values, np.concatenate([block, block, block[:2]]))
    assert cupy.copies == 3  # the block, then 4 and 2 values of what is filled
    assert fill.fill_values(cupy, 8, "float32") is small  # long enough: reused
    grown = fill.fill_values(cupy, 15, "float32")
    assert grown.size == 20 and np.array_equal(grown.values[:10], small.values)  # doubled
    assert np.array_equal(grown.values, np.resize(block, 20))
    assert fill.fill_values(cupy, 3, "bfloat16").dtype == np.uint16  # one per dtype
    fill.release_fill()
    assert fill._FILL == {} and fill._BLOCKS == {}


def test_cold_copies_cover_twice_the_l2_and_stop_where_the_operands_do():
    l2 = 50 << 20
    # BERT at batch 1: A 128x768, B the 768x768 weight: 2.75 MB a slot, 39 slots.
    assert fill.cold_copies(128 * 768 * 4, 768 * 768 * 4, l2) == 39
    assert fill.cold_copies(1, 1, l2) == fill.MAX_COLD_COPIES
    assert fill.cold_copies(40 << 20, 80 << 20, l2) == 1  # larger than two L2s already


def test_cold_operand_pairs_are_distinct_aligned_slots_of_random_values(monkeypatch):
    monkeypatch.setattr(fill, "_FILL", {})
    monkeypatch.setattr(fill, "_BLOCKS", {})
    cupy, held = _HostCupy(), []
    a_bytes, b_bytes, l2 = 1000, 3000, 64 << 10
    pairs = fill.cold_operand_pairs(cupy, a_bytes, b_bytes, "float32", l2, held)
    n = fill.cold_copies(a_bytes, b_bytes, l2)
    assert len(pairs) == n == 32 and len(held) == 1
    values = held[0]
    lo, hi = values.data.ptr, values.data.ptr + values.size * 4
    spans = sorted(span for a, b in pairs for span in ((a, a + a_bytes), (b, b + b_bytes)))
    assert all(x % 256 == 0 for a, b in pairs for x in (a, b))
    assert lo <= spans[0][0] and spans[-1][1] <= hi  # inside the array
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # disjoint
    assert sum(e - s for s, e in spans) >= fill.COLD_L2_FACTOR * l2 // 2  # A and B: most of it
    fill.release_fill()


def test_cold_operand_pairs_stop_at_the_timed_launches(monkeypatch):
    """After an L2 flush each timed launch needs operands of its own, no more: at most
    `most` copies (BERT at batch 1: 10 of the 39 that cycling through two L2s took)."""
    monkeypatch.setattr(fill, "_FILL", {})
    monkeypatch.setattr(fill, "_BLOCKS", {})
    held: list = []
    l2 = 50 << 20
    pairs = fill.cold_operand_pairs(_HostCupy(), 128 * 768 * 4, 768 * 768 * 4, "float32", l2, held,
                                    most=cublaslt.TIMED_LAUNCHES)
    assert len(pairs) == cublaslt.TIMED_LAUNCHES and len(set(pairs)) == len(pairs)
    big = fill.cold_operand_pairs(_HostCupy(), 40 << 20, 40 << 20, "float32", l2, held, most=10)
    assert len(big) == 2  # two copies already span two L2s: launches alternate them
    fill.release_fill()


def test_the_l2_flusher_writes_twice_the_l2_on_the_stream_it_is_given():
    writes: list = []
    runtime = type("runtime", (), {"memsetAsync": staticmethod(lambda *a: writes.append(a))})

    class Buffer:
        def __init__(self, nbytes: int) -> None:
            self.nbytes, self.data = nbytes, type("data", (), {"ptr": 4096})

    cupy = type("cupy", (), {"uint8": np.uint8, "empty": staticmethod(lambda n, dtype: Buffer(n)),
                             "cuda": type("cuda", (), {"runtime": runtime})})
    held: list = []
    flush = fill.l2_flusher(cupy, 50 << 20, held)
    assert writes == [] and len(held) == 1
    flush(77)
    assert writes == [(4096, 0, fill.COLD_L2_FACTOR * (50 << 20), 77)]


def test_only_plans_larger_than_the_l2_time_on_cold_operands(monkeypatch):
    device = type("device", (), {"attributes": {"L2CacheSize": 50 << 20}})
    cupy = type("cupy", (), {"cuda": type("cuda", (), {"Device": staticmethod(lambda: device)})})
    assert fill.cold_l2_bytes(cupy, 300 << 20) == 50 << 20  # BERT's arena
    assert fill.cold_l2_bytes(cupy, 12 << 20) == 0  # the MLP's: its weights stay in L2
    monkeypatch.setattr(fill, "COLD", False)
    assert fill.cold_l2_bytes(cupy, 300 << 20) == 0


# ---- GPU ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu():
    cupy = pytest.importorskip("cupy")
    handle = cublaslt.LtHandle()
    yield cupy, handle, cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
    handle.destroy()


@pytest.mark.gpu
def test_timing_leaves_the_plans_buffers_untouched(gpu, monkeypatch):
    cupy, handle, workspace = gpu
    monkeypatch.setattr(cublaslt, "_ALGO_CACHE", {})
    call = GemmCall(2, 64, 48, 32, False, True, "float32", "tf32", alpha=0.5, beta=1.0)
    rng = np.random.default_rng(0)
    a, b, c = (cupy.asarray(rng.standard_normal(n).astype(np.float32))
               for n in (2 * 64 * 32, 2 * 48 * 32, 2 * 64 * 48))
    before = [cupy.asnumpy(x) for x in (a, b, c)]
    cupy.cuda.Device().synchronize()
    buffers = cublaslt.GemmBuffers(a.data.ptr, b.data.ptr, c.data.ptr, workspace.data.ptr)
    gemm = cublaslt.LtGemm(handle, call, WORKSPACE_BYTES, buffers=buffers)
    try:
        assert gemm.timings_us is not None and any(t is not None for t in gemm.timings_us)
        cupy.cuda.Device().synchronize()
        for x, old in zip((a, b, c), before):  # beta = 1 reads C: it was not the timed C
            np.testing.assert_array_equal(cupy.asnumpy(x), old)
    finally:
        gemm.close()


@pytest.mark.gpu
def test_strided_heads_gemm_after_timing_matches_numpy(gpu, monkeypatch):
    # q·kᵀ over 4 heads of a (1, 16, 4, 8) q and k, read in place (ld 32, stride 8).
    cupy, handle, workspace = gpu
    monkeypatch.setattr(cublaslt, "_ALGO_CACHE", {})
    call = GemmCall(4, 16, 16, 8, False, True, "float32", "f32", lda=32, stride_a=8,
                    ldb=32, stride_b=8)
    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal((16, 4, 8)).astype(np.float32) for _ in range(2))
    q_dev, k_dev = cupy.asarray(q), cupy.asarray(k)
    c_dev = cupy.full(4 * 16 * 16, np.nan, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    buffers = cublaslt.GemmBuffers(q_dev.data.ptr, k_dev.data.ptr, c_dev.data.ptr,
                                   workspace.data.ptr)
    gemm = cublaslt.LtGemm(handle, call, WORKSPACE_BYTES, buffers=buffers)
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        gemm.run(handle, q_dev.data.ptr, k_dev.data.ptr, c_dev.data.ptr, workspace.data.ptr,
                 WORKSPACE_BYTES, stream.ptr)
        stream.synchronize()
    finally:
        gemm.close()
    want = np.einsum("qhd,khd->hqk", q.astype(np.float64), k.astype(np.float64))
    np.testing.assert_allclose(cupy.asnumpy(c_dev).reshape(4, 16, 16), want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_cold_timing_picks_a_working_algorithm_and_caches_apart(gpu, monkeypatch):
    """A GEMM of a plan larger than the L2 is timed after an L2 flush on copies of A and B: it
    still picks a candidate that runs, computes the product, and its choice is cached
    apart from the same GEMM timed on one A and B."""
    cupy, handle, workspace = gpu
    monkeypatch.setattr(cublaslt, "_ALGO_CACHE", {})
    call = GemmCall(1, 128, 768, 768, False, False, "float32", "f32")
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((128, 768)).astype(np.float32), rng.standard_normal((768, 768)).astype(np.float32)
    a_dev, b_dev = cupy.asarray(a), cupy.asarray(b)
    c_dev = cupy.full(128 * 768, np.nan, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    l2 = int(cupy.cuda.Device().attributes["L2CacheSize"])
    gemms = []
    try:
        for l2_bytes in (0, l2):
            buffers = cublaslt.GemmBuffers(a_dev.data.ptr, b_dev.data.ptr, c_dev.data.ptr,
                                           workspace.data.ptr, l2_bytes=l2_bytes)
            gemms.append(cublaslt.LtGemm(handle, call, WORKSPACE_BYTES, buffers=buffers))
        assert len(cublaslt._ALGO_CACHE) == 2
        for g in gemms:
            assert any(t is not None for t in g.timings_us)
            c_dev.fill(np.nan)
            g.run(handle, a_dev.data.ptr, b_dev.data.ptr, c_dev.data.ptr, workspace.data.ptr,
                  WORKSPACE_BYTES, cupy.cuda.get_current_stream().ptr)
            np.testing.assert_allclose(cupy.asnumpy(c_dev).reshape(128, 768), a @ b, rtol=1e-4, atol=1e-3)
    finally:
        for g in gemms:
            g.close()
        fill.release_fill()
