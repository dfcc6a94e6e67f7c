"""`import nimblejax` imports CuPy where it can (a first call then does not), and imports
without it."""
from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_nimblejax_imports_cupy_with_itself():
    pytest.importorskip("cupy")
    assert run("import sys, nimblejax; print('cupy' in sys.modules)") == "True"


def test_nimblejax_imports_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None\n"  # `import cupy` raises ImportError
            "import nimblejax as nimble, jax.numpy as jnp\n"
            "print(float(nimble.jit(lambda x: x * 2, backend='interpret')(jnp.ones(3)).sum()))")
    assert run(code) == "6.0"
