"""The compiler's user-facing errors, in a module of their own (no imports), so that
every stage can raise them without importing another stage."""
from __future__ import annotations


class UnsupportedPrimitiveError(NotImplementedError):
    """A primitive, dtype or control-flow form nimblejax cannot plan; the message names
    the user's line and `backend="jax"`. Public: `nimblejax.UnsupportedPrimitiveError`."""
