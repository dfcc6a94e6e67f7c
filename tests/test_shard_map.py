"""nimble plans inside jax.shard_map and under jit with sharded inputs: 2 host devices
on the CPU (interpret backend), the machine's GPUs under `-m gpu`."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHECK = os.path.join(os.path.dirname(__file__), "shard_map_check.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_check(backend: str, env: dict) -> str:
    env = {**os.environ, **env, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, CHECK, backend], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    return done.stdout


def test_two_host_devices_interpret():
    out = run_check("interpret", {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                                  "JAX_PLATFORMS": "cpu"})
    assert "2 device(s)" in out and "data-parallel step 3 on 2 device(s)" in out and "ALL OK" in out


@pytest.mark.gpu
def test_gpus_cuda():
    out = run_check("cuda", {})
    assert "ALL OK" in out
