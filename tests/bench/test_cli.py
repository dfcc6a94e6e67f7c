"""`python -m nimblejax.bench` without a GPU, the timing path on the CPU (nimble's
interpreter standing in for the GPU), and the report's table and chart."""
from __future__ import annotations

import io
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nimblejax import api
from nimblejax.bench import cli, report
from nimblejax.bench import results as bench_results
from nimblejax.bench import progress as progress_mod
from nimblejax.bench.models import MODELS, SUITE, ModelSpec
from tests.helpers import on_host

NO_GPU_LINE = "No CUDA GPU is visible"


def _fake_primitive():
    from jax.extend.core import Primitive

    prim = Primitive("bench_fake_op")
    # A host implementation (not JAX): nimble cannot inline it as a library primitive.
    prim.def_impl(lambda x: np.asarray(x))
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    return prim


def _fake_spec() -> ModelSpec:
    """A model built on a primitive nimble has no lowering for."""
    prim = _fake_primitive()

    def fn(params, x):
        return prim.bind(jnp.tanh(x @ params["w"]))

    def build(batch, dtype=jnp.float32, rng=None, *, tiny=False):
        rng = rng if rng is not None else np.random.default_rng(0)
        return fn, ({"w": on_host(rng.standard_normal((8, 8)), dtype)},
                    on_host(rng.standard_normal((batch, 8)), dtype))

    return ModelSpec("fake", build, "uses an unsupported primitive")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(api, "gpu_available", lambda: False)


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(api, "gpu_available", lambda: True)


def _table_rows(out: str, model: str) -> list[str]:
    """The streamed table's lines of one model (fixed-width columns, model first)."""
    return [line for line in out.splitlines() if line.split()[:1] == [model]]


def test_no_gpu_plans_every_model(no_gpu, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    assert cli.main(["--tiny", "--models", "mlp,lstm", "--json", str(out_json)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert out.count(NO_GPU_LINE) == 1
    assert [line for line in out.splitlines() if NO_GPU_LINE in line][0].startswith(NO_GPU_LINE)
    assert len(_table_rows(out, "mlp")) == 2 and len(_table_rows(out, "lstm")) == 2
    # Said once, not on every row: nothing is timed; each row's note is what the plan decided.
    assert out.count("nothing is timed") == 1 and "not timed" not in out
    for line in _table_rows(out, "mlp") + _table_rows(out, "lstm"):
        assert "critical path" in line, line
    # Under the table: what the columns mean, then what to try next.
    tail = out[out.index("Columns (plans only"):]
    for column in ("tasks", "streams, events", "arena MB (inputs)", "plan s"):
        assert f"\n  {column}  " in tail, column
    assert "Next:" in tail and "nimble.explain" in tail and "examples/basics.py" in tail
    assert "ETA" in captured.err and "ETA" not in out  # progress goes to stderr only
    data = json.loads(out_json.read_text())
    meta = data["meta"]
    assert meta["mode"] == "plan" and meta["gpu"] is None
    # Only what was done: nothing was timed, so no timing settings.
    for key in ("repeat", "cold_caches", "configs", "budget_s", "timed", "loops"):
        assert key not in meta, key
    assert meta["plan_options"]["max_streams"] is None
    rows = data["rows"]
    assert [(r["model"], r["batch"]) for r in rows] == [("mlp", 1), ("mlp", 32), ("lstm", 1), ("lstm", 32)]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["tasks"] == sum(r["task_kinds"].values()) > 0
        assert r["kernels"] == r["task_kinds"].get("kernel", 0)
        assert r["streams"] >= 1 and r["events"] >= 0 and r["arena_bytes"] > 0
        assert r["note"].startswith(("critical path", "a chain"))
        assert not any(k.endswith("_ms") or k.startswith("compile") for k in r), r
    lstm = [r for r in rows if r["model"] == "lstm"][0]
    assert lstm["streams"] > 1  # the input projections run beside the recurrence


def test_plan_notes_name_the_decisions():
    from nimblejax.bench.plans import plan_notes

    fn, args = MODELS["resnet50"].abstract(32, tiny=True)
    import nimblejax as nimble

    f = nimble.jit(fn, backend="interpret", cudnn=False)
    plan, plan_options = f.plan(*args), f.options
    note = plan_notes(plan, plan_options, batch=32)
    assert f"critical path {plan.critical_path} of {len(plan.tasks)} tasks" in note
    assert "im2col+GEMM" in note and "no cuDNN found here" in note
    assert "no cuDNN" not in plan_notes(plan, plan_options, batch=1)  # im2col anyway at batch 1
    # im2col chosen, not for want of libcudnn: no such note.
    assert "no cuDNN" not in plan_notes(plan, plan_options.replace(conv="im2col"), batch=32)
    chain = nimble.jit(lambda x: jnp.sin(jnp.cos(x)) * 2, backend="interpret").plan(
        jax.ShapeDtypeStruct((4, 4), jnp.float32))
    if chain.critical_path == len(chain.tasks):
        assert plan_notes(chain, plan_options).startswith("a chain")


def test_plan_legend_explains_the_star_once_where_a_row_has_it():
    from nimblejax.bench.plans import NO_CUDNN
    from nimblejax.bench.report import plan_legend

    plain = [{"note": "critical path 3 of 9 tasks"}]
    starred = plain + [{"note": "critical path 3 of 9 tasks; convs: 2 im2col+GEMM" + NO_CUDNN}]
    assert not any(line.lstrip().startswith("*") for line in plan_legend(plain, NO_CUDNN))
    stars = [line for line in plan_legend(starred, NO_CUDNN) if line.lstrip().startswith("*")]
    assert len(stars) == 1 and "no cuDNN found here" in stars[0]
    assert any("--timeline" in line for line in plan_legend(plain, NO_CUDNN))
    assert not any("--timeline" in line for line in plan_legend(plain, NO_CUDNN, timeline=True))


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
    """The GPU path end to end (--full: every configuration), with nimble's interpreter
    in place of the GPU: every configuration is a row, errors are recorded and the next
    model still runs."""
    monkeypatch.setitem(MODELS, "fake", _fake_spec())
    out_json = tmp_path / "bench.json"
    plot = tmp_path / "speedups.png"
    argv = ["--full", "--tiny", "--models", "fake,mlp", "--batch", "2", "--repeat", "2", "--no-cold",
            "--nimble-backend", "interpret", "--json", str(out_json), "--plot", str(plot)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert NO_GPU_LINE not in out
    data = json.loads(out_json.read_text())
    assert data["meta"]["mode"] == "gpu" and data["meta"]["run"] == "full"
    assert data["meta"]["repeat"] == 2 and data["meta"]["cold_caches"] is False
    assert data["meta"]["timed"] == ["looped", "e2e", "gpu"]
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
        assert r["looped_ms"] > 0 and r["speedup_looped"] > 0
        assert r["compile_cold_s"] > 0 and r["compile_warm_s"] > 0
        assert r["tasks"] > 0 and r["timed_calls"] == 2
    assert mlp["nimble 1-stream"]["streams"] == 1
    assert mlp["nimble multi-stream"]["streams"] > 1
    assert data["summary"]["geomeans"], data["summary"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert plot.read_bytes()[:4] == b"\x89PNG"


def test_default_run_records_what_it_did(fake_gpu, tmp_path, capsys):
    """No flags (bar the CPU stand-ins): jax.jit against nimble multi-stream, looped and
    GPU time within a time budget, first-call times, and the geomeans at the end."""
    out_json = tmp_path / "bench.json"
    argv = ["--tiny", "--models", "mlp", "--batch", "2", "--nimble-backend", "interpret",
            "--budget", "0.05", "--json", str(out_json)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    data = json.loads(out_json.read_text())
    meta = data["meta"]
    assert meta["run"] == "default" and meta["configs"] == ["jax.jit", "nimble multi-stream"]
    assert meta["budget_s"] == 0.05 and "repeat" not in meta and meta["cold_caches"] is False
    assert meta["timed"] == ["looped", "gpu"]
    rows = {r["config"]: r for r in data["rows"]}
    assert list(rows) == ["jax.jit", "nimble multi-stream"]
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["looped_ms"] > 0 and r["first_call_s"] > 0 and r["timed_calls"] >= 2
        assert "e2e_ms" not in r and "compile_cold_s" not in r and "compile_warm_s" not in r
    assert rows["nimble multi-stream"]["gpu_ms"] is None  # the interpreter has no GPU time
    assert rows["nimble multi-stream"]["speedup_looped"] > 0
    (g,) = data["summary"]["geomeans"]
    assert g["config"] == "nimble multi-stream" and g["batch"] == 2
    assert g["looped"] == pytest.approx(rows["nimble multi-stream"]["speedup_looped"])
    out = captured.out.splitlines()
    header = [i for i, line in enumerate(out) if line.startswith("model ")]
    assert len(header) == 1
    h = out[header[0]]
    assert h.index("looped ms") < h.index("GPU ms") < h.index("speedup looped") < h.index("note")
    assert "e2e" not in h and "compile cold" not in h and "first call s" in h
    assert out[-2].startswith("geomean speedup of nimble multi-stream over jax.jit, batch 2: looped")
    assert "ETA" in captured.err and "estimated" in captured.err


class _Log:
    """A stdout that records each write and flush, in order with the fake timers' calls."""

    def __init__(self, events: list) -> None:
        self.events = events

    def write(self, text: str) -> int:
        self.events.append(("write", text))
        return len(text)

    def flush(self) -> None:
        self.events.append(("flush", None))

    def isatty(self) -> bool:
        return False


def test_rows_stream_as_they_are_measured(fake_gpu, monkeypatch, tmp_path):
    """With fake timers: each row is written and flushed right after its own
    measurements, before the next configuration is timed, when stdout is not a terminal."""
    from nimblejax.bench import timing

    events: list = []

    def fake(name, us):
        def timer(*args, **kwargs):
            events.append(("measure", name))
            return us
        return timer

    monkeypatch.setattr(timing, "looped_us", fake("looped", 1000.0))
    monkeypatch.setattr(timing, "throughput_us", fake("gpu", 800.0))
    monkeypatch.setattr(timing, "e2e_us", fake("e2e", 1200.0))
    monkeypatch.setattr(sys, "stdout", _Log(events))
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    argv = ["--tiny", "--models", "mlp,lstm", "--batch", "2", "--nimble-backend", "interpret",
            "--repeat", "3"]
    assert cli.main(argv) == 0
    writes = [(i, text) for i, (kind, text) in enumerate(events) if kind == "write"]
    rows = [(i, text) for i, text in writes if text.split()[:1] in (["mlp"], ["lstm"])]
    assert [t.split()[0] for _, t in rows] == ["mlp", "mlp", "lstm", "lstm"]
    measures = [i for i, (kind, _) in enumerate(events) if kind == "measure"]
    for (i, text), (j, _) in zip(rows, rows[1:] + [(len(events), None)]):
        assert events[i + 1] == ("flush", None), text  # flushed at once
        later = [m for m in measures if i < m < j]
        earlier = [m for m in measures if m < i]
        assert earlier, text  # printed after its own measurements ...
        # ... and before the next row's: the next row's timers all run after this line.
        if j < len(events):
            assert later, text
    jax_row = rows[0][1]
    assert "1.000" in jax_row and "0.800" in jax_row  # looped ms, then GPU ms
    err = stderr.getvalue()
    assert "[1/2] mlp batch 2: jax.jit" in err and "[2/2] lstm batch 2" in err
    assert "ETA" in err and "\r" not in err  # a log: one line per step


def test_progress_eta_from_priors_and_elapsed_time():
    now = [0.0]
    buf = io.StringIO()
    progress = progress_mod.Progress(["a", "b"], {"a": 10.0, "b": 30.0}.get, stream=buf, clock=lambda: now[0])
    assert progress.estimate_s() == 40.0
    progress.step("a")
    now[0] = 20.0  # a took twice its prior: b is expected to as well
    progress.finish("a")
    assert progress.estimate_s() == 60.0
    progress.step("b")
    assert buf.getvalue().splitlines()[-1] == "[2/2] b  (0m20s elapsed, ETA 1m00s)"

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    progress = progress_mod.Progress(["a"], lambda u: 1.0, stream=tty, clock=lambda: 0.0)
    progress.step("a")
    progress.clear()
    assert tty.getvalue() == "\r\x1b[K[1/1] a  (0m00s elapsed, ETA 0m01s)\r\x1b[K"


def test_estimate_of_the_default_run_fits_two_minutes_when_warm():
    """The priors (measured on an H100) put the default run of the whole suite under two
    minutes once the compile caches are filled, and say the first run takes longer."""
    opts = cli.parse_args([])
    units = [(m, b) for m in opts.model_names for b in opts.batches]
    warm = sum(progress_mod.prior_s(m, b, opts, "gpu", warm=True) for m, b in units)
    cold = sum(progress_mod.prior_s(m, b, opts, "gpu", warm=False) for m, b in units)
    assert warm < 120 < cold
    full = cli.parse_args(["--full"])
    assert sum(progress_mod.prior_s(m, b, full, "gpu") for m, b in units) > 4 * cold


def test_configs_and_models_options(no_gpu):
    opts = cli.parse_args(["--models", "mlp", "--configs", "jax,multi-stream,eager", "--batch", "4"])
    assert opts.config_keys == ["jax", "nimble-eager", "nimble"]  # jax.jit first, always
    assert opts.batches == [4] and opts.model_names == ["mlp"]
    default = cli.parse_args([])
    assert default.model_names == list(SUITE) and default.batches == [1, 32]
    assert default.config_keys == ["jax", "nimble"] and default.repeat is None
    assert default.budget == cli.DEFAULT_BUDGET_S and not default.full and not default.cold
    full = cli.parse_args(["--full"])
    assert full.config_keys == list(cli.CONFIGS) and full.repeat == cli.FULL_REPEAT and full.cold
    assert not cli.parse_args(["--full", "--no-cold"]).cold
    assert cli.parse_args(["--full", "--repeat", "7"]).repeat == 7
    assert cli.parse_args(["--timeline", "t.png"]).timeline == "t.png"
    with pytest.raises(SystemExit):
        cli.parse_args(["--models", "no_such_model"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--budget", "0"])


def test_timeline_paths():
    one = cli.parse_args(["--models", "mlp", "--batch", "1"])
    assert bench_results.timeline_path("t.png", "mlp", 1, one) == "t.png"
    many = cli.parse_args([])
    assert bench_results.timeline_path("out/t.png", "bert", 32, many) == "out/t_bert_b32.png"


def test_geomeans_per_config_and_batch():
    rows = [{"model": m, "batch": 1, "config": c, "status": "ok", "speedup_looped": s,
             "speedup_gpu": 2 * s}
            for m, s in (("a", 1.0), ("b", 4.0)) for c in ("jax.jit", "nimble multi-stream")]
    rows.append({"model": "c", "batch": 1, "config": "nimble multi-stream", "status": "error"})
    g = bench_results.geomeans(rows)
    assert g == [{"config": "nimble multi-stream", "batch": 1, "looped": pytest.approx(2.0),
                  "looped_models": 2, "gpu": pytest.approx(4.0), "gpu_models": 2}]
    (line,) = report.geomean_lines(g)
    assert line == ("geomean speedup of nimble multi-stream over jax.jit, batch 1: "
                    "looped 2.00x (2 models), GPU time 4.00x (2 models)")


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
                             "looped_ms": 0.9 + i / 10,
                             "tasks": 120, "kernels": 70, "gemms": 50, "streams": 4, "events": 9,
                             "arena_bytes": 300 * 2**20, "arena_input_bytes": 100 * 2**20,
                             "xla_temp_bytes": 150 * 2**20, "compile_cold_s": 12.5,
                             "compile_warm_s": 1.5, "max_rel_err": 1e-4})
    rows.append({"model": "inception_v3", "batch": 1, "config": "nimble eager", "status": "ok",
                 "e2e_ms": 2.0, "looped_ms": 1.5, "tasks": 30, "kernels": 10, "gemms": 8,
                 "task_kinds": {"kernel": 10, "gemm": 8, "cudnn": 12}})
    rows.append({"model": "nasnet_mobile", "batch": 1, "config": "nimble multi-stream",
                 "status": "error", "error": "KernelLaunchError: too many resources\nsecond line"})
    bench_results.add_speedups(rows)
    return {"meta": {"mode": "gpu", "gpu": "Fake GPU 80GB"}, "rows": rows}


def test_rows_from_fabricated_results():
    """The streamed table's cells (report.RowPrinter) of the --full columns and the
    plan-only ones."""
    results = _fabricated()
    assert results["rows"][0]["speedup_e2e"] == pytest.approx(1.0)
    assert results["rows"][2]["speedup_e2e"] == pytest.approx(1.0 / 1.2)
    buf = io.StringIO()
    printer = report.RowPrinter(report.gpu_columns(full=True), buf)
    for row in results["rows"]:
        printer.row(row)
    text = buf.getvalue()
    for s in ("resnet50", "nimble multi-stream", "120 (70+50)", "300.0 (100.0)", "150.0",
              "12.50", "1.0e-04", "0.83x", "error: ", "KernelLaunchError", "30 (10+8+12 cudnn)"):
        assert s in text, s
    assert "second line" not in text
    assert len(text.splitlines()) == 2 + len(results["rows"])  # header, rule, one line a row
    buf = io.StringIO()
    printer = report.RowPrinter(report.PLAN_COLUMNS, buf)
    for row in [{"model": "mlp", "batch": 1, "status": "ok", "params": 3158016, "tasks": 89,
                 "kernels": 41, "gemms": 48, "streams": 8, "events": 7, "arena_bytes": 2**20},
                {"model": "x", "batch": 1, "status": "unsupported", "error": "no rule for 'foo'"}]:
        printer.row(row)
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
    labels, series = report.speedup_series(_fabricated()["rows"])  # looped
    assert labels == ["resnet50 b1", "resnet50 b32", "bert b1", "bert b32", "inception_v3 b1"]
    assert set(series) == set(cli.CONFIGS.values())
    assert series["jax.jit"][0] == pytest.approx(1.0)
    gpu_labels, _ = report.speedup_series(_fabricated()["rows"], "speedup_gpu")
    assert gpu_labels == labels[:4]  # the eager inception row has no GPU time
    assert [f for f, _ in report.PLOTTED] == ["speedup_looped", "speedup_gpu"]
    path = tmp_path / "speedups.png"
    assert report.plot_speedups(_fabricated(), str(path)) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "no timings" in report.plot_speedups({"meta": {"mode": "plan"}, "rows": []},
                                                str(tmp_path / "none.png"))


def test_plot_without_matplotlib(no_matplotlib, tmp_path):
    why = report.plot_speedups(_fabricated(), str(tmp_path / "p.png"))
    assert why is not None and "matplotlib" in why and "\n" not in why
