"""`python -m nimblejax.bench` without a GPU, the timing path on the CPU (nimble's
interpreter standing in for the GPU), and the report's table and chart."""
from __future__ import annotations

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nimblejax import api
from nimblejax.bench import cli, report
from nimblejax.bench.models import MODELS, ModelSpec

NO_GPU_LINE = "No CUDA GPU is visible"


def _fake_primitive():
    from jax.extend.core import Primitive

    prim = Primitive("bench_fake_op")
    prim.def_impl(lambda x: x)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    return prim


def _fake_spec() -> ModelSpec:
    """A model built on a primitive nimble has no lowering for."""
    prim = _fake_primitive()

    def fn(params, x):
        return prim.bind(jnp.tanh(x @ params["w"]))

    def build(batch, dtype=jnp.float32, rng=None, *, tiny=False):
        rng = rng if rng is not None else np.random.default_rng(0)
        return fn, ({"w": jnp.asarray(rng.standard_normal((8, 8)), dtype)},
                    jnp.asarray(rng.standard_normal((batch, 8)), dtype))

    return ModelSpec("fake", build, "uses an unsupported primitive")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(api, "gpu_available", lambda: False)


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(api, "gpu_available", lambda: True)


def test_no_gpu_plans_every_model(no_gpu, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    assert cli.main(["--tiny", "--models", "mlp,lstm", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert out.count(NO_GPU_LINE) == 1
    assert [line for line in out.splitlines() if NO_GPU_LINE in line][0].startswith(NO_GPU_LINE)
    table_rows = [line for line in out.splitlines() if line.startswith("│")]
    assert sum("mlp" in r for r in table_rows) == 2 and sum("lstm" in r for r in table_rows) == 2
    data = json.loads(out_json.read_text())
    assert data["meta"]["mode"] == "plan" and data["meta"]["gpu"] is None
    rows = data["rows"]
    assert [(r["model"], r["batch"]) for r in rows] == [("mlp", 1), ("mlp", 32), ("lstm", 1), ("lstm", 32)]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["tasks"] == sum(r["task_kinds"].values()) > 0
        assert r["kernels"] == r["task_kinds"].get("kernel", 0)
        assert r["streams"] >= 1 and r["events"] >= 0 and r["arena_bytes"] > 0
    lstm = [r for r in rows if r["model"] == "lstm"][0]
    assert lstm["streams"] > 1  # the input projections run beside the recurrence


def test_unsupported_model_is_a_row_not_a_crash(no_gpu, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(MODELS, "fake", _fake_spec())
    out_json = tmp_path / "bench.json"
    assert cli.main(["--tiny", "--models", "fake,mlp", "--batch", "2", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "unsupported: " in out
    rows = json.loads(out_json.read_text())["rows"]
    fake, mlp = rows
    assert fake["status"] == "unsupported" and "bench_fake_op" in fake["error"]
    assert "\n" not in fake["error"]
    assert mlp["status"] == "ok"


def test_timing_path_on_cpu(fake_gpu, monkeypatch, tmp_path, capsys):
    """The GPU path end to end, with nimble's interpreter in place of the GPU: every
    configuration is a row, errors are recorded and the next model still runs."""
    monkeypatch.setitem(MODELS, "fake", _fake_spec())
    out_json = tmp_path / "bench.json"
    plot = tmp_path / "speedups.png"
    argv = ["--tiny", "--models", "fake,mlp", "--batch", "2", "--repeat", "2", "--no-cold",
            "--nimble-backend", "interpret", "--json", str(out_json), "--plot", str(plot)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert NO_GPU_LINE not in out
    data = json.loads(out_json.read_text())
    assert data["meta"]["mode"] == "gpu"
    rows = data["rows"]
    fake = [r for r in rows if r["model"] == "fake"]
    mlp = {r["config"]: r for r in rows if r["model"] == "mlp"}
    assert len(fake) == len(mlp) == len(cli.CONFIGS)
    assert all(r["status"] == "unsupported" for r in fake if r["config"].startswith("nimble"))
    assert mlp["jax.jit"]["status"] == "ok" and mlp["jax.jit"]["max_rel_err"] == 0.0
    assert mlp["jax.jit"]["speedup_e2e"] <= 1.0 + 1e-9
    for label in ("nimble eager", "nimble 1-stream", "nimble multi-stream"):
        r = mlp[label]
        assert r["status"] == "ok", r
        assert r["max_rel_err"] < 2e-3
        assert r["e2e_ms"] > 0 and r["speedup_e2e"] > 0
        assert r["compile_cold_s"] > 0 and r["compile_warm_s"] > 0
        assert r["tasks"] > 0
    assert mlp["nimble 1-stream"]["streams"] == 1
    assert mlp["nimble multi-stream"]["streams"] > 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert plot.read_bytes()[:4] == b"\x89PNG"


def test_configs_and_models_options(no_gpu):
    opts = cli.parse_args(["--models", "mlp", "--configs", "jax,multi-stream,eager", "--batch", "4"])
    assert opts.config_keys == ["jax", "nimble", "nimble-eager"]
    assert opts.batches == [4] and opts.model_names == ["mlp"]
    assert cli.parse_args([]).model_names == list(MODELS)
    with pytest.raises(SystemExit):
        cli.parse_args(["--models", "no_such_model"])


@pytest.mark.parametrize("name, want", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                         ("float16", "float16"), ("half", "float16")])
def test_dtype_choices(name, want):
    assert cli.parse_args(["--dtype", name]).dtype == jnp.dtype(want)
    assert cli.parse_args([]).dtype == jnp.dtype("float32")


def _dtype_error(capsys, name: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--dtype", name])
    assert exit_info.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "float32, bfloat16, float16" in lines[0]
    return lines[0]


def test_unknown_dtype_is_a_one_line_usage_error(capsys):
    line = _dtype_error(capsys, "foo")
    assert "'foo'" in line and "not a dtype" in line


@pytest.mark.parametrize("name", ["float64", "double", "int64", "complex64"])
def test_64_bit_dtypes_are_refused_not_run_as_float32(capsys, name):
    assert "64-bit" in _dtype_error(capsys, name)


def test_integer_dtype_is_refused_for_the_float_models(capsys):
    assert "floating-point" in _dtype_error(capsys, "int32")


def test_float64_is_refused_before_anything_runs(no_gpu, monkeypatch, capsys):
    monkeypatch.setattr(cli, "run_plans", lambda *a: pytest.fail("planned a float64 run"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--tiny", "--models", "mlp", "--dtype", "float64"])
    assert exit_info.value.code == 2
    assert "float64" in capsys.readouterr().err


def _fabricated() -> dict:
    rows = []
    for model in ("resnet50", "bert"):
        for batch in (1, 32):
            for i, config in enumerate(cli.CONFIGS.values()):
                rows.append({"model": model, "batch": batch, "config": config, "status": "ok",
                             "e2e_ms": 1.0 + i / 10, "gpu_ms": 0.8 + i / 10,
                             "tasks": 120, "kernels": 70, "gemms": 50, "streams": 4, "events": 9,
                             "arena_bytes": 300 * 2**20, "arena_input_bytes": 100 * 2**20,
                             "xla_temp_bytes": 150 * 2**20, "compile_cold_s": 12.5,
                             "compile_warm_s": 1.5, "max_rel_err": 1e-4})
    rows.append({"model": "inception_v3", "batch": 1, "config": "nimble eager", "status": "ok",
                 "e2e_ms": 2.0, "tasks": 30, "kernels": 10, "gemms": 8,
                 "task_kinds": {"kernel": 10, "gemm": 8, "cudnn": 12}})
    rows.append({"model": "nasnet_mobile", "batch": 1, "config": "nimble multi-stream",
                 "status": "error", "error": "KernelLaunchError: too many resources\nsecond line"})
    cli.add_speedups(rows)
    return {"meta": {"mode": "gpu", "gpu": "Fake GPU 80GB"}, "rows": rows}


def test_table_from_fabricated_results():
    from rich.console import Console

    results = _fabricated()
    assert results["rows"][0]["speedup_e2e"] == pytest.approx(1.0)
    assert results["rows"][2]["speedup_e2e"] == pytest.approx(1.0 / 1.2)
    buf = io.StringIO()
    report.print_results(results, Console(file=buf, width=320))
    text = buf.getvalue()
    for s in ("Fake GPU 80GB", "resnet50", "nimble multi-stream", "120 (70+50)",
              "300.0 (100.0)", "150.0", "12.50", "1.0e-04", "0.83x", "error: ", "KernelLaunchError", "30 (10+8+12 cudnn)"):
        assert s in text, s
    assert "second line" not in text
    buf = io.StringIO()
    plan = {"meta": {"mode": "plan"},
            "rows": [{"model": "mlp", "batch": 1, "status": "ok", "params": 3158016, "tasks": 89,
                      "kernels": 41, "gemms": 48, "streams": 8, "events": 7, "arena_bytes": 2**20},
                     {"model": "x", "batch": 1, "status": "unsupported", "error": "no rule for 'foo'"}]}
    report.print_results(plan, Console(file=buf, width=250))
    text = buf.getvalue()
    assert "3.16" in text and "89" in text and "unsupported: no rule for 'foo'" in text


def test_json_roundtrip(tmp_path):
    results = _fabricated()
    results["rows"][0]["numpy_value"] = np.float32(2.5)
    path = tmp_path / "r.json"
    report.write_json(results, str(path))
    back = json.loads(path.read_text())
    assert back["rows"][0]["numpy_value"] == 2.5
    assert len(back["rows"]) == len(results["rows"])


def test_plot_from_fabricated_results(tmp_path):
    pytest.importorskip("matplotlib")
    labels, series = report.speedup_series(_fabricated()["rows"])
    assert labels == ["resnet50 b1", "resnet50 b32", "bert b1", "bert b32", "inception_v3 b1"]
    assert set(series) == set(cli.CONFIGS.values())
    path = tmp_path / "speedups.png"
    assert report.plot_speedups(_fabricated(), str(path)) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "no timings" in report.plot_speedups({"meta": {"mode": "plan"}, "rows": []},
                                                str(tmp_path / "none.png"))


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    why = report.plot_speedups(_fabricated(), str(tmp_path / "p.png"))
    assert why is not None and "matplotlib" in why and "\n" not in why
