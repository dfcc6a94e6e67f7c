from __future__ import annotations

import os

import pytest

# Every plan a test builds is checked for races (compiler/pipeline.py: verify_plan). Off by
# default for users: it adds 10-16% to planning (NASNet-A: 44 ms on 465 ms, measured).
os.environ.setdefault("NIMBLE_DEBUG", "1")

def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_matplotlib(monkeypatch):
    """Imports of matplotlib fail, as on a machine without the `bench` extra."""
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
