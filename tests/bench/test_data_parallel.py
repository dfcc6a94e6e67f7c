"""bench.data_parallel on the CPU (one host device, nimble's interpreter): the table's
columns, and the JSON's step, no-pmean and collective times and agreeing updates."""
from __future__ import annotations

import json

import pytest

from nimblejax.bench import data_parallel


@pytest.mark.long
def test_rows_time_both_steps_with_and_without_pmean(tmp_path, capsys):
    out = tmp_path / "dp.json"
    assert data_parallel.main(["--models", "mlp", "--per-device-batch", "2", "--devices", "1",
                               "--calls", "1", "--rounds", "2", "--backend", "interpret",
                               "--json", str(out), "--floor", "--segments", "2"]) == 0
    printed = capsys.readouterr().out
    assert "jax.jit scaling" in printed and "nimble step µs (of which pmean)" in printed
    (row,) = json.loads(out.read_text())["rows"]
    for name in ("jax", "nimble"):
        assert row[f"{name}_step_us"] > 0 and row[f"{name}_local_us"] > 0
        assert row[f"{name}_collective_us"] == row[f"{name}_step_us"] - row[f"{name}_local_us"]
        assert row[f"{name}_scaling"] == 1.0
        assert len(row["rounds_us"][f"{name}_step_us"]) == 2
    assert row["max_rel_err"] < 1e-3  # the same step: jax.jit's gradients reduced once
    assert row["floor_us"] > 0 and "dispatch floor" in printed
    assert row["segmented_step_us"] > 0 and "in up to 2 segments" in printed


@pytest.mark.long
def test_processes_measure_a_row_of_two_devices_together(tmp_path, capsys):
    """--processes: each row of n devices comes from n processes of one host device each,
    joined by jax.distributed (gloo on the CPU), and their step is the one-device step."""
    out = tmp_path / "dp.json"
    assert data_parallel.main(["--models", "mlp", "--per-device-batch", "2", "--devices", "1,2",
                               "--calls", "1", "--rounds", "1", "--backend", "interpret",
                               "--json", str(out), "--processes"]) == 0
    printed = capsys.readouterr().out
    assert "| mlp | 1 (1 process) |" in printed and "| mlp | 2 (2 processes) |" in printed
    one, two = json.loads(out.read_text())["rows"]
    assert one["processes"] == 1 and two["processes"] == 2 and two["devices"] == 2
    for name in ("jax", "nimble"):
        assert two[f"{name}_step_us"] > 0 and two[f"{name}_scaling"] > 0
    assert two["max_rel_err"] < 1e-3
