"""bench/first_call.py: each side's first call in a fresh process, the table of ratios,
and a child that fails reported as a row that says why (not a crash of the whole run)."""
from __future__ import annotations

import argparse
import json
import types

import pytest

from nimblejax.bench import first_call


def test_table_gives_nimble_over_jax_per_model_and_batch():
    rows = [{"model": "m", "batch": 1, "side": "jax", "first_call_s": 4.0},
            {"model": "m", "batch": 1, "side": "nimble", "first_call_s": 1.0},
            {"model": "m", "batch": 32, "side": "jax", "first_call_s": 2.0},
            {"model": "m", "batch": 32, "side": "nimble", "error": "boom"}]
    lines = first_call._table(rows).splitlines()
    assert lines[2] == "| m | 1 | 4.0 | 1.0 | 0.25 |"
    assert lines[3] == "| m | 32 | 2.0 | — | boom |"


def test_variants_get_their_columns_and_rounds_their_medians():
    rows = [{"model": "m", "batch": 1, "side": "jax", "first_call_s": t} for t in (4.0, 2.0, 3.0)]
    rows += [{"model": "m", "batch": 1, "side": "nimble", "first_call_s": t} for t in (1.0, 1.5, 0.5)]
    rows += [{"model": "m", "batch": 1, "side": "nimble", "variant": "defer", "first_call_s": t}
             for t in (0.3, 0.6)]
    lines = first_call._table(rows).splitlines()
    assert lines[0] == "| model | batch | jax.jit s | nimble s | nimble / jax.jit | defer s | defer / jax.jit |"
    assert lines[2] == "| m | 1 | 3.0 | 1.0 | 0.33 | 0.45 | 0.15 |"


def test_a_variant_is_a_label_and_the_variables_it_sets():
    assert first_call.parse_variant("defer:NIMBLE_DEFER_BUILD=1,NIMBLE_PDL=0") == (
        "defer", {"NIMBLE_DEFER_BUILD": "1", "NIMBLE_PDL": "0"})
    for bad in ("defer", "defer:", ":A=1", "defer:A"):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL:VAR=VALUE"):
            first_call.parse_variant(bad)


def test_a_nimble_variant_runs_under_its_environment(tmp_path, monkeypatch):
    seen: list = []

    def fake_run(cmd, env, capture_output, text):
        seen.append(env.get("NIMBLE_DEFER_BUILD"))
        return types.SimpleNamespace(returncode=0, stderr="", stdout=json.dumps(
            {"model": "m", "batch": 1, "side": cmd[-1], "first_call_s": 1.0}))

    monkeypatch.setattr(first_call.subprocess, "run", fake_run)
    monkeypatch.delenv("NIMBLE_DEFER_BUILD", raising=False)
    row = first_call.run_one("m", 1, "nimble", str(tmp_path), False, variant=("defer", {"NIMBLE_DEFER_BUILD": "1"}))
    assert row["variant"] == "defer" and seen == ["1"]
    assert "variant" not in first_call.run_one("m", 1, "jax", str(tmp_path), False) and seen[-1] is None


def test_a_failing_child_is_a_row_naming_the_error(tmp_path):
    row = first_call.run_one("no_such_model", 1, "jax", str(tmp_path), cold_handler=False)
    assert row["model"] == "no_such_model" and "first_call_s" not in row
    assert "no_such_model" in row["error"]  # the child's KeyError, its last lines


def test_fresh_env_empties_the_kernel_caches_and_turns_jaxs_cache_off(tmp_path):
    env = first_call.fresh_env(str(tmp_path), cold_handler=True)
    assert env["CUPY_CACHE_DIR"].startswith(str(tmp_path))
    assert env["NIMBLEJAX_CACHE_DIR"].startswith(str(tmp_path))
    assert env["JAX_ENABLE_COMPILATION_CACHE"] == "false"
    json.dumps(env)  # a plain environment for subprocess


def test_phases_are_read_from_the_profile_by_file_and_function():
    """Each phase sums the cumulative time of its function in its file; a phase never
    called is 0.0."""
    import pstats

    stats = pstats.Stats.__new__(pstats.Stats)
    stats.stats = {  # (file, line, function): (calls, primitive calls, tottime, cumtime, callers)
        ("/x/nimblejax/compiler/pipeline.py", 1, "compile_function"): (1, 1, 0.01, 0.30, {}),
        ("/x/site-packages/cupy/__init__.py", 1, "<module>"): (1, 1, 0.02, 0.14, {}),
        ("/x/nimblejax/runtime/launch.py", 9, "_lt_gemms"): (2, 2, 0.0, 0.05, {}),
        ("/x/jax/_src/compiler.py", 3, "backend_compile_and_load"): (1, 1, 0.0, 0.07, {}),
        ("/x/numpy/__init__.py", 1, "<module>"): (1, 1, 0.0, 9.0, {}),  # not a phase
    }
    got = first_call.phase_seconds(stats)
    assert got["trace and plan"] == 0.3 and got["import cupy"] == 0.14
    assert got["  cuBLASLt's algorithms"] == 0.05 and got["XLA compiles"] == 0.07
    assert got["  cuDNN's algorithms"] == 0.0 and set(got) == {p[0] for p in first_call.PHASES}
    rows = [{"model": "m", "batch": 1, "side": "nimble", "first_call_s": 1.2, "phases_s": got},
            {"model": "m", "batch": 1, "side": "jax", "error": "boom"}]
    table = first_call._phase_table(rows).splitlines()
    assert table[0] == "| phase | m 1 nimble |" and table[2] == "| first call (profiled) | 1.2 |"
    assert "| trace and plan | 0.3 |" in table
    top = first_call.profile_top(stats, total_s=1.0)  # numpy's 9 s holds the whole call: left out
    assert [r[0] for r in top[:2]] == ["nimblejax/compiler/pipeline.py:1(compile_function)",
                                       "cupy/__init__.py:1(<module>)"]
    assert top[0][1:] == [0.3, 1] and len(top) == 4


def test_a_child_profiles_its_first_call_when_asked(monkeypatch, capsys):
    """--child ... --phases: the child's row carries the phases (jax.jit's side on the CPU)."""
    first_call.main(["--child", "mlp", "1", "jax", "--phases"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["side"] == "jax" and row["first_call_s"] > 0
    assert set(row["phases_s"]) == {p[0] for p in first_call.PHASES}
    assert row["phases_s"]["XLA compiles"] > 0
    assert row["profile_top"] and all(0 <= r[1] < 0.9 * row["first_call_s"] for r in row["profile_top"])
