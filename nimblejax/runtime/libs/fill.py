"""Operands for timing GEMM algorithms: pseudo-random values of a GEMM's dtypes, in
[-1, 1) as XLA's autotuner fills its buffers (cublaslt.LtGemm._filled reads them).

One device array per dtype serves every GEMM of a plan, grown to the largest operand and
freed (`release_fill`) once the plan's GEMMs are timed. Its values are made without a
CuPy kernel: a block hashed on the host, tiled on the device by copies. The GEMMs of a
plan larger than the L2 cache are timed on cold operands (`cold_operand_pairs`).
"""
from __future__ import annotations

import numpy as np

from .cublas import itemsize


def random_values(xp, elements: int, dtype: str):
    """`elements` pseudo-random values in [-1, 1) of a GEMM dtype (a uint16 array
    holding the bits where the dtype is bfloat16, which CuPy lacks): a hash of each
    element's index, computed with the array module `xp` (numpy: see fill_values)."""
    h = xp.arange(max(int(elements), 1), dtype=xp.uint32)
    for mul in (0x9E3779B1, 0x45D9F3B):  # an integer hash (multiply, xor-shift)
        h = h * xp.uint32(mul)
        h ^= h >> xp.uint32(16)
    x = (h >> xp.uint32(8)).astype(xp.float32) * xp.float32(2.0 ** -23) - xp.float32(1.0)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(xp.float16)
    if dtype == "bfloat16":  # the upper half of a float32 is a bfloat16 (truncated)
        return (x.view(xp.uint32) >> xp.uint32(16)).astype(xp.uint16)
    raise ValueError(f"no random fill for GEMM dtype {dtype!r}")


# dtype -> a device array of random_values, as long as the largest operand asked for so
# far; the timing of every GEMM of a plan reads its operands from it (cublaslt.LtGemm._filled).
_FILL: dict[str, object] = {}
FILL_BLOCK = 1 << 20  # values hashed on the host per dtype; longer fills repeat them
_BLOCKS: dict[str, object] = {}  # dtype -> FILL_BLOCK values on the device


def fill_values(cupy, elements: int, dtype: str):
    """A device array of at least `elements` random values of `dtype`, made on the host
    and copied on the current stream: no CuPy kernel to compile (CuPy's elementwise
    kernels took 1.5 s of ResNet-50's cold first call), and made once for all of a
    plan's GEMMs. FILL_BLOCK values are hashed once and repeated: ResNet-50's largest
    operand at batch 32 holds 26 M. Read-only: a GEMM's output gets a copy of its own."""
    have = _FILL.get(dtype)
    if have is None or have.size < elements:
        grown = max(int(elements), 2 * have.size if have is not None else 0)
        if dtype not in _BLOCKS:
            _BLOCKS[dtype] = cupy.asarray(random_values(np, FILL_BLOCK, dtype))
        have = _FILL[dtype] = _tiled(cupy, _BLOCKS[dtype], grown)
    return have


def _tiled(cupy, block, elements: int):
    """`elements` values: `block` repeated, by device-to-device copies on the current
    stream, each copying all that is filled so far (log2(elements / block) copies)."""
    out = cupy.empty(elements, dtype=block.dtype)
    rt, stream = cupy.cuda.runtime, cupy.cuda.get_current_stream().ptr
    item = block.itemsize
    filled = min(elements, block.size)
    rt.memcpyAsync(out.data.ptr, block.data.ptr, filled * item, rt.memcpyDeviceToDevice, stream)
    while filled < elements:
        n = min(filled, elements - filled)
        rt.memcpyAsync(out.data.ptr + filled * item, out.data.ptr, n * item,
                       rt.memcpyDeviceToDevice, stream)
        filled += n
    return out


def release_fill() -> None:
    """Frees the fill arrays (once a plan's GEMMs are timed)."""
    _FILL.clear()
    _BLOCKS.clear()


# Cold operands: where a plan's arena is larger than the GPU's L2 cache, each of its
# GEMMs reads its weights from device memory (a call streams the whole arena through L2
# before the next call returns to a GEMM), so its candidates are timed on operands not
# in L2. Timed on one A and B repeated, a GEMM at batch 1 reads its weights from L2,
# where an algorithm with few blocks looks as fast as one that spreads the weights over
# every SM. The timed launches follow a write of COLD_L2_FACTOR L2 sizes (`l2_flusher`),
# and launch i reads A and B copy i % n: n distinct copies (at most the launches), or
# fewer where n copies together reach COLD_L2_FACTOR L2 sizes, so no launch finds its
# operands in L2. (Without the flush, every launch had to cycle through 2 L2 sizes of
# copies, up to MAX_COLD_COPIES launches a candidate: ResNet-50's cold first call at
# batch 1 spent 1.1 to 1.3 s choosing cuBLASLt's algorithms, against 0.26 s timed warm.)
COLD = True  # False: every GEMM timed on one A and B (examples/gpu/probe_variants.py)
COLD_L2_FACTOR = 2
MAX_COLD_COPIES = 64
ALIGN = 256  # cuBLASLt's pointer alignment (cublaslt.POINTER_ALIGNMENT)


def cold_l2_bytes(cupy, arena_bytes: int) -> int:
    """The current GPU's L2 size where a plan's arena of `arena_bytes` is larger (its
    GEMMs are timed on cold operands), else 0."""
    if not COLD:
        return 0
    l2 = int(cupy.cuda.Device().attributes["L2CacheSize"])
    return l2 if arena_bytes > l2 else 0


def _aligned(nbytes: int) -> int:
    return -(-int(nbytes) // ALIGN) * ALIGN


def cold_copies(a_bytes: int, b_bytes: int, l2_bytes: int) -> int:
    """How many copies of A and B the timing rotates through (1: they are already
    larger than COLD_L2_FACTOR L2 caches together)."""
    slot = _aligned(a_bytes) + _aligned(b_bytes)
    return max(1, min(MAX_COLD_COPIES, -(-COLD_L2_FACTOR * int(l2_bytes) // slot)))


def cold_operand_pairs(cupy, a_bytes: int, b_bytes: int, dtype: str, l2_bytes: int,
                       held: list, most: int = MAX_COLD_COPIES) -> list[tuple[int, int]]:
    """(A, B) device pointers of `cold_copies` distinct slots of random values of
    `dtype` (at most `most`), each 256-byte aligned; the array holding them is appended
    to `held`."""
    n = min(int(most), cold_copies(a_bytes, b_bytes, l2_bytes))
    slot = _aligned(a_bytes) + _aligned(b_bytes)
    values = fill_values(cupy, -(-(n * slot + ALIGN) // itemsize(dtype)), dtype)
    held.append(values)
    base = _aligned(values.data.ptr)
    return [(base + i * slot, base + i * slot + _aligned(a_bytes)) for i in range(n)]


def l2_flusher(cupy, l2_bytes: int, held: list):
    """A function of a stream pointer that evicts what the L2 holds: a memset of
    COLD_L2_FACTOR L2 sizes on that stream (no kernel to compile). The buffer it writes
    is appended to `held`."""
    buf = cupy.empty(COLD_L2_FACTOR * int(l2_bytes), dtype=cupy.uint8)
    held.append(buf)
    rt = cupy.cuda.runtime
    return lambda stream: rt.memsetAsync(buf.data.ptr, 0, buf.nbytes, stream)
