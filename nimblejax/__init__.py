"""nimblejax: ahead-of-time scheduled, multi-stream CUDA graphs for JAX functions."""
from nimblejax.api import NimbleFunction, jit
from nimblejax.explain import explain
from nimblejax.lowering.registry import UnsupportedPrimitiveError

__all__ = ["jit", "explain", "NimbleFunction", "UnsupportedPrimitiveError"]
__version__ = "0.1.0"
