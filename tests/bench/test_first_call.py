"""bench/first_call.py: each side's first call in a fresh process, the table of ratios,
and a child that fails reported as a row that says why (not a crash of the whole run)."""
from __future__ import annotations

import json

from nimblejax.bench import first_call


def test_table_gives_nimble_over_jax_per_model_and_batch():
    rows = [{"model": "m", "batch": 1, "side": "jax", "first_call_s": 4.0},
            {"model": "m", "batch": 1, "side": "nimble", "first_call_s": 1.0},
            {"model": "m", "batch": 32, "side": "jax", "first_call_s": 2.0},
            {"model": "m", "batch": 32, "side": "nimble", "error": "boom"}]
    lines = first_call._table(rows).splitlines()
    assert lines[2] == "| m | 1 | 4.0 | 1.0 | 0.25 |"
    assert lines[3] == "| m | 32 | 2.0 | — | boom |"


def test_a_failing_child_is_a_row_naming_the_error(tmp_path):
    row = first_call.run_one("no_such_model", 1, "jax", str(tmp_path), cold_handler=False)
    assert row["model"] == "no_such_model" and "first_call_s" not in row
    assert "no_such_model" in row["error"]  # the child's KeyError, its last lines


def test_fresh_env_empties_the_kernel_caches_and_turns_jaxs_cache_off(tmp_path):
    env = first_call._fresh_env(str(tmp_path), cold_handler=True)
    assert env["CUPY_CACHE_DIR"].startswith(str(tmp_path))
    assert env["NIMBLEJAX_CACHE_DIR"].startswith(str(tmp_path))
    assert env["JAX_ENABLE_COMPILATION_CACHE"] == "false"
    json.dumps(env)  # a plain environment for subprocess
