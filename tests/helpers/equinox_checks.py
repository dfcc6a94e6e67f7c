"""equinox's runtime checks without host callbacks, for the library tests
(tests/end_to_end/test_lib_diffrax.py, test_lib_optimistix.py)."""
from __future__ import annotations

import jax
import pytest


@pytest.fixture
def no_host_callbacks(monkeypatch):
    """equinox's checks as EQX_ON_ERROR=nan makes them: a failed check gives NaN, with no
    host callback (eqx.error_if's pure_callback), so nimble can plan a solve whole.
    equinox reads the variable at import; a check reads its module global. JAX's traces
    of equinox's jitted helpers made with callbacks are dropped before and after."""
    errors = pytest.importorskip("equinox._errors")
    jax.clear_caches()
    monkeypatch.setattr(errors, "EQX_ON_ERROR", "nan")
    yield
    monkeypatch.undo()
    jax.clear_caches()
