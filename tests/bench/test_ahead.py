"""jax.jit's programs compiled ahead (nimblejax/bench/ahead.py): no compile while a row
is timed, a failed compile left to the first call, and, in a fresh process, the bench's
first jax.jit call of each model loading the program compiled ahead from JAX's
persistent cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from nimblejax.bench.ahead import AheadCompiler

REPO = Path(__file__).resolve().parents[2]


def test_no_compile_runs_while_quiet():
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()
    started = threading.Event()

    def compile_(unit) -> None:
        t0 = time.monotonic()
        started.set()
        time.sleep(0.05)
        with lock:
            spans.append((t0, time.monotonic()))

    units = [("m", b) for b in range(8)]
    ahead = AheadCompiler(units, compile_, n=2)
    quiet_spans = []
    try:
        for _ in range(3):
            started.wait(5)  # a compile is running as quiet() is asked for
            with ahead.quiet():
                t0 = time.monotonic()
                time.sleep(0.08)
                quiet_spans.append((t0, time.monotonic()))
            started.clear()
        assert all(isinstance(ahead.wait(u), float) for u in units)
    finally:
        ahead.close()
    assert len(spans) == len(units)
    for q0, q1 in quiet_spans:
        overlapping = [(a, b) for a, b in spans if a < q1 and b > q0]
        assert not overlapping, (q0, q1, overlapping)


def test_a_failed_compile_is_left_to_the_first_call():
    def compile_(unit) -> None:
        if unit[1] == 2:
            raise RuntimeError("XLA ran out of memory")

    ahead = AheadCompiler([("m", 1), ("m", 2)], compile_, n=1)
    try:
        assert ahead.wait(("m", 1)) is not None
        assert ahead.wait(("m", 2)) is None
        assert ahead.wait(("other", 1)) is None  # never asked for
    finally:
        ahead.close()


# A fresh process: JAX's persistent cache is set up once per process, at its first
# compile. The bench's timing path on the CPU (nimble's interpreter for the GPU), with
# the cache in a temporary folder as the default GPU run has it.
_RUN = textwrap.dedent("""\
    import json, logging, sys
    import jax
    from nimblejax import api
    from nimblejax.bench import cli, measure

    cache, out = sys.argv[1], sys.argv[2]
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    api.gpu_available = lambda: True
    measure.jax_compile_cache = lambda opts: (cache, False)
    hits = []

    class Hits(logging.Handler):  # JAX logs each program loaded from the cache at DEBUG
        def emit(self, record):
            if record.msg.startswith("Persistent compilation cache hit for"):
                hits.append(record.args[0])

    log = logging.getLogger("jax._src.compiler")
    log.setLevel(logging.DEBUG)
    log.addHandler(Hits())
    cli.main(["--tiny", "--models", "mlp,lstm", "--batch", "1,2", "--budget", "0.02",
              "--nimble-backend", "interpret", "--compile-ahead", "2", "--json", out])
    print("HITS", json.dumps(hits))
    """)


def test_the_first_call_loads_the_program_compiled_ahead(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path / "cache"), str(out)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "compile ahead, " in r.stderr, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    jax_rows = [row for row in rows if row["config"] == "jax.jit"]
    assert len(jax_rows) == 4 and all(row["status"] == "ok" for row in rows), rows
    for row in jax_rows:
        assert row["xla_compiled_ahead_s"] > 0, row
    # The first call of each model at each batch loaded its program: only a compile
    # ahead writes it before that call (later lookups find it in memory).
    hits = json.loads(r.stdout.split("HITS ")[1].splitlines()[0])
    assert sorted(hits) == ["jit_lstm_forward"] * 2 + ["jit_mlp_forward"] * 2, hits


def test_the_default_run_compiles_nothing_ahead():
    """Off unless asked for (`--compile-ahead N`): measured slower on a fresh H100."""
    from nimblejax.bench import cli, measure

    units = [("mlp", 1), ("mlp", 32)]
    default = cli.parse_args(["--models", "mlp"])
    assert default.compile_ahead == 0
    assert measure.start_ahead(default, units, "/unused", lambda s: None) is None
    asked = cli.parse_args(["--models", "mlp", "--compile-ahead", "1", "--tiny"])
    ahead = measure.start_ahead(asked, [], "/unused", lambda s: None)  # one unit or none: no pool
    assert ahead is None and asked.compile_ahead == 1
