"""Micro-benchmark: ways to hand a CuPy buffer to JAX, timed with block_until_ready
on the fresh array (what a caller pays). Run on the GPU machine."""
import weakref

import cupy
import jax
import jax.numpy as jnp
import numpy as np
from jax._src import xla_bridge
from jax._src.lib import _jax

from nimblejax.bench.timing import median_us
from nimblejax.bench.needs_gpu import require_gpu




require_gpu(__file__)
backend = xla_bridge.get_backend("gpu")
s = cupy.cuda.Stream(non_blocking=True)


def fresh():
    return cupy.empty(1024, dtype=np.float32)


def cai(arr, stream=None):
    d = {"shape": arr.shape, "typestr": "<f4", "data": (arr.data.ptr, False), "version": 3,
         "strides": None}
    if stream is not None:
        d["stream"] = stream
    out = _jax.cuda_array_interface_to_buffer(cai=d, gpu_backend=backend, device_id=0)
    weakref.finalize(out, lambda a: None, arr)
    return out


ways = {
    "cai direct": lambda: cai(fresh()),
    "jnp.asarray(cupy)": lambda: jnp.asarray(fresh()),
    "jax.dlpack.from_dlpack(cupy)": lambda: jax.dlpack.from_dlpack(fresh()),
    "device_put(numpy) (reference)": lambda: jax.device_put(np.ones(1024, np.float32)),
}
for name, make in ways.items():
    print(f"{name:32s} import {median_us(make):7.1f} µs   import+block {median_us(lambda: make().block_until_ready()):7.1f} µs")
