"""nimble plans inside jax.shard_map and under jit with sharded inputs: 2 host devices
on the CPU (interpret backend), the machine's GPUs under `-m gpu`."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = os.path.join(ROOT, "tests", "helpers", "shard_map_check.py")


def run_check(backend: str, env: dict, timeout: float = 300) -> str:
    """Run the check in its own process. The timeout turns a hang into a failure; the
    check's own watchdog, a little earlier, prints every thread's stack first."""
    env = {**os.environ, **env, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        done = subprocess.run([sys.executable, CHECK, backend, str(timeout - 30)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # its output comes as bytes
        out, err = (b.decode(errors="replace") if isinstance(b, bytes) else b or ""
                    for b in (e.stdout, e.stderr))
        pytest.fail(f"shard_map_check.py {backend} did not finish in {timeout} s:\n{out}\n{err[-4000:]}")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.mark.long
def test_two_host_devices_interpret():
    """Includes the data-parallel step at realistic sizes (MLP 256→512→512→10, 64 rows
    per device), which once hung: the host callbacks of both devices waited for JAX's
    CPU worker threads that the devices held."""
    out = run_check("interpret", {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                                  "JAX_PLATFORMS": "cpu"})
    assert "2 device(s)" in out and "ALL OK" in out
    assert "data-parallel step 3 on 2 device(s), MLP 12→16→5, 8 rows per device" in out
    assert "data-parallel step 3 on 2 device(s), MLP 256→512→512→10, 64 rows per device" in out
    assert "refused at trace time" in out
    assert "shard_map of a co-executed function" in out


@pytest.mark.gpu
def test_gpus_cuda():
    out = run_check("cuda", {}, timeout=600)
    assert "ALL OK" in out and "64 rows per device, 3 segments" in out
