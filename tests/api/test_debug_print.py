"""NIMBLE_DEBUG=2 (or debug=2): the program after every compiler pass, on stderr, each
pass once and in order, the same text every time the same function is planned."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

import nimblejax as nimble
from nimblejax.compiler import pipeline, printing
from tests.helpers import on_host

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""\
    import jax, jax.numpy as jnp, numpy as np
    import nimblejax as nimble

    def branches(w1, w2, x):
        a = jnp.tanh(x @ w1)
        b = jax.nn.relu(x @ w2)
        return jax.nn.softmax(jnp.concatenate([a, b], axis=1).reshape(4, -1), axis=-1)

    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype(np.float32) for s in [(16, 32), (16, 32), (8, 16)]]
    f = nimble.jit(branches, backend="interpret")
    np.testing.assert_allclose(f(*args), jax.jit(branches)(*args), rtol=1e-5, atol=1e-6)
    """)


def run_script(path: pathlib.Path, debug: str) -> str:
    env = dict(os.environ, NIMBLE_DEBUG=debug,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def sections(text: str) -> dict[str, str]:
    """pass name → its text, checking that every header appears once, in order."""
    headers = [printing.header(p) for p in pipeline.STAGES]
    assert [text.count(h) for h in headers] == [1] * len(headers), text[:2000]
    at = [text.index(h) for h in headers]
    assert at == sorted(at), "passes out of order"
    ends = at[1:] + [len(text)]
    return {p: text[a + len(h):e] for p, h, a, e in zip(pipeline.STAGES, headers, at, ends)}


def test_debug_2_prints_every_pass_once_in_order_the_same_twice(tmp_path):
    script = tmp_path / "debug_two.py"
    script.write_text(SCRIPT)
    first = run_script(script, "2")
    assert first == run_script(script, "2")  # a fresh process: the same text
    s = sections(first)
    assert "= dot_general" in s["trace"] and f"{script}:5" in s["trace"]  # the user's line
    assert "= concatenate" in s["canonicalize"]
    # The softmax is one row group (fusion_rows.py): its reductions and their readers.
    assert " gemm " in s["fuse"] and " row " in s["fuse"] and "[concatenate]" in s["fuse"]
    assert "GemmCall(" in s["lower"] and "grid[" in s["lower"] and "nimble_concat" in s["lower"]
    assert "2 streams" in s["streams"] and " record e0" in s["streams"] and " wait e0" in s["streams"]
    assert s["memory"].lstrip().startswith("arena ") and "@" in s["memory"]
    assert " kB" not in first and " KB" not in first  # one byte unit: KiB


def test_debug_1_and_0_print_nothing(capsys):
    x = np.arange(6, dtype=np.float32)
    for level in (0, 1):
        nimble.jit(lambda v: jnp.sin(v) * 2.0, backend="interpret", debug=level).plan(x)
        assert printing.header("trace") not in capsys.readouterr().err
    nimble.jit(lambda v: jnp.sin(v) * 2.0, backend="interpret", debug=2).plan(x)
    assert printing.header("trace") in capsys.readouterr().err


def test_debug_option_prints_the_same_plan_twice_in_one_process(capsys):
    def f(x, y):
        return jnp.sum(jnp.exp(x) * y, axis=0), jnp.cumsum(y, axis=1)

    rng = np.random.default_rng(1)
    args = [rng.standard_normal((6, 5)).astype(np.float32) for _ in range(2)]
    texts = []
    for _ in range(2):
        g = nimble.jit(f, backend="interpret", debug=2)
        got = g(*args)
        for a, b in zip(got, jax.jit(f)(*args)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        texts.append(capsys.readouterr().err)
    assert texts[0] == texts[1]
    s = sections(texts[0])
    plan = g.plan(*args)
    for task in plan.tasks:  # every kernel's name, stream and offsets are printed
        assert task.name in s["lower"] and task.name in s["streams"]
        assert printing.task_line(plan, task, printing.event_numbers(plan.schedule)) in s["memory"]


def test_debug_2_marks_a_scatter_that_updates_its_operand_in_place(capsys):
    def f(a, w, i, u):
        return jnp.tanh((a @ w).at[i].add(u))  # the GEMM's output, read by the scatter alone

    rng = np.random.default_rng(2)
    args = (rng.standard_normal((12, 8)).astype(np.float32),
            rng.standard_normal((8, 4)).astype(np.float32),
            rng.integers(0, 12, (5,)).astype(np.int32), rng.standard_normal((5, 4)).astype(np.float32))
    plan = nimble.jit(f, backend="interpret", debug=2).plan(*args)
    s = sections(capsys.readouterr().err)
    (task,) = [t for t in plan.tasks if "scatter" in t.name]
    (out, operand), = task.aliases
    fused = [line for line in s["fuse"].splitlines() if "scatter-add" in line]
    assert len(fused) == 1 and fused[0].endswith("  in place")
    assert f"({out!r} in {operand!r}'s bytes)" in s["lower"]


def test_format_bytes_is_binary():
    assert [printing.format_bytes(n) for n in (0, 1023, 1024, 1536, 3 << 20, 5 << 30, 1 << 42)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "3.0 MiB", "5.0 GiB", "4096.0 GiB"]


def test_debug_3_logs_one_line_per_call(capsys):
    """NIMBLE_DEBUG=3: each call's path, plan cache and where its leaves came from."""
    def layer(p, x):
        return jnp.tanh(x @ p["w"] + p["b"])

    r = np.random.default_rng(0)
    p = {"w": on_host(r.normal(size=(8, 8)), jnp.float32), "b": on_host(r.normal(size=8), jnp.float32)}
    f = nimble.jit(layer, backend="interpret", debug=3)
    for _ in range(3):
        f(p, on_host(r.normal(size=(2, 8)), jnp.float32))
    lines = [s for s in capsys.readouterr().err.splitlines() if s.startswith("nimblejax: layer call")]
    assert len(lines) == 3
    assert "path=xla" in lines[0] and "plan cache miss" in lines[0] and "3 passed" in lines[0]
    assert "new record: 2 held, 0 fed back, 1 passed" in lines[1]
    assert "steady: 2 held, 0 fed back, 1 passed" in lines[2] and "plan cache hit" in lines[2]
