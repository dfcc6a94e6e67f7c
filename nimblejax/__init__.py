"""nimblejax: ahead-of-time scheduled, multi-stream CUDA graphs for JAX functions."""
from nimblejax.api import NimbleFunction, jit
from nimblejax.explain import explain
from nimblejax.compiler.errors import UnsupportedPrimitiveError
from nimblejax.options import Options

__all__ = ["jit", "explain", "NimbleFunction", "Options", "UnsupportedPrimitiveError"]
__version__ = "0.1.0"


def _import_cupy() -> None:
    """CuPy, nimble's binding of the CUDA runtime, is imported with nimblejax (0.1 to 0.4 s),
    as jax imports jaxlib: a first call then costs its own work, not CuPy's import (0.15 to
    0.18 s of a cold first call on an H200, 0554a39's tree). Where CuPy is missing or does
    not import, nothing changes here: the cuda backend says so when it is asked for."""
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001 (reported at first use: api.gpu_available)
        pass


_import_cupy()
