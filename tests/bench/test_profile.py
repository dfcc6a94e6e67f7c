"""The per-task profiler: its grouping on a real plan (CPU), its timings on a GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from nimblejax.bench.models import MODELS
from nimblejax.bench.profile import group, summarize, task_category, task_family, task_times
from tests.helpers import on_host


def test_families_and_categories_of_a_cnn_plan():
    fn, args = MODELS["mobilenet_v2"].abstract(2, tiny=True)
    plan = nimble.jit(fn).plan(*args)
    launched = [t for t in plan.schedule.order]
    cats = {task_category(t) for t in launched}
    assert "cublas" in cats or "cudnn" in cats
    for t in launched:
        fam = task_family(t)
        assert fam and not fam.startswith("nimble_")
        if t.kind == "kernel":
            assert t.kernel.name.removeprefix("nimble_").startswith(fam)


def test_summary_adds_up_rows():
    rows = [{"task": f"t{i}", "kind": "kernel", "family": fam, "category": fam.split("_")[0],
             "us": us, "source": "f.py:1", "out_shape": [4], "kernel": f"nimble_{fam}_abcd",
             "grid": 1, "block": 256}
            for i, (fam, us) in enumerate([("fused_add_f32", 3.0), ("fused_add_f32", 5.0),
                                           ("reduce_max_f32", 10.0)])]
    assert group(rows, "family") == [("reduce_max_f32", 1, 10.0), ("fused_add_f32", 2, 8.0)]
    text = summarize(rows)
    assert "3 tasks, serial sum 18 µs" in text
    assert text.index("reduce_max_f32") < text.index("fused_add_f32")


@pytest.mark.gpu
def test_task_times_cover_every_task_and_are_positive():
    rng = np.random.default_rng(0)
    x = on_host(rng.standard_normal((64, 256)), jnp.float32)
    w = on_host(rng.standard_normal((256, 256)), jnp.float32)
    f = nimble.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=1), tc_gemm=False)  # a cuBLAS task
    jax.block_until_ready(f(x, w))
    exe = f.executables()[-1]
    rows = task_times(exe, repeats=3)
    assert [r["task"] for r in rows] == [t.name for t in exe.plan.schedule.order]
    assert all(0 < r["us"] < 10_000 for r in rows)
    assert {r["category"] for r in rows} >= {"cublas"}
