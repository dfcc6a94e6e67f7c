"""nimblejax: ahead-of-time scheduled, multi-stream CUDA graphs for JAX functions."""
from nimblejax.api import NimbleFunction, jit
from nimblejax.explain import explain
from nimblejax.compiler.errors import UnsupportedPrimitiveError
from nimblejax.options import Options
from nimblejax.runtime import preload as _preload

__all__ = ["jit", "explain", "NimbleFunction", "Options", "UnsupportedPrimitiveError"]
__version__ = "0.1.0"

_preload.start()  # CuPy imported in the background where a CUDA driver is installed (runtime/preload.py)
