"""The cold first call: jax.jit against nimble, each in a fresh process with empty caches.

    python -m nimblejax.bench.first_call --models resnet50,bert --batch 1,32 --json out.json

Each (model, batch, side) runs in its own Python process with a fresh CuPy kernel cache
and JAX's persistent compilation cache off, so neither side finds anything compiled
before. The model's weights and input are made and moved to the GPU first; the timed span
is ``f = jit(fn); block(f(params, x))``: tracing, planning, compiling, building and the
first run. nimble's built handler (a one-time g++ build per install, cached under
``nimblejax.options.cache_dir()``) is kept; ``--cold-handler`` empties that cache too.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SIDES = ("jax", "nimble")


def child(model: str, batch: int, side: str) -> dict:
    """Runs in the fresh process: times the first call and checks it against jax.jit's
    answer from the same process (computed after the timing, so it warms nothing)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import nimblejax as nimble
    from nimblejax.bench.models import MODELS

    fn, (params, x) = MODELS[model].build(batch, jnp.float32, np.random.default_rng(0))
    jax.block_until_ready((params, x))
    t0 = time.perf_counter()
    f = jax.jit(fn) if side == "jax" else nimble.jit(fn)
    out = jax.block_until_ready(f(params, x))
    seconds = time.perf_counter() - t0
    row = {"model": model, "batch": batch, "side": side, "first_call_s": round(seconds, 3)}
    if side == "nimble":
        want = np.asarray(jax.jit(fn)(params, x), np.float32)
        got = np.asarray(out, np.float32)
        row["max_abs_error"] = float(np.max(np.abs(got - want)))
        row["max_abs_value"] = float(np.max(np.abs(want)))
    return row


def _fresh_env(root: str, cold_handler: bool) -> dict:
    env = dict(os.environ)
    env["CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix="cupy-", dir=root)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cold_handler:
        env["NIMBLEJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="nimblejax-", dir=root)
    return env


def run_one(model: str, batch: int, side: str, root: str, cold_handler: bool) -> dict:
    cmd = [sys.executable, "-m", "nimblejax.bench.first_call", "--child", model, str(batch), side]
    done = subprocess.run(cmd, env=_fresh_env(root, cold_handler), capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"model": model, "batch": batch, "side": side, "error": " | ".join(tail)}
    return json.loads(lines[-1])


def _table(rows: list[dict]) -> str:
    by_key = {(r["model"], r["batch"], r["side"]): r for r in rows}
    out = ["| model | batch | jax.jit s | nimble s | nimble / jax.jit |", "|---|---|---|---|---|"]
    for model, batch in dict.fromkeys((r["model"], r["batch"]) for r in rows):
        j, n = by_key.get((model, batch, "jax"), {}), by_key.get((model, batch, "nimble"), {})
        js, ns = j.get("first_call_s"), n.get("first_call_s")
        ratio = f"{ns / js:.2f}" if js and ns else n.get("error", j.get("error", "—"))
        out.append(f"| {model} | {batch} | {js or '—'} | {ns or '—'} | {ratio} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,bert,lstm,resnet50,mobilenet_v2,efficientnet_b0,"
                                         "inception_v3,nasnet_mobile")
    ap.add_argument("--batch", default="1,32", help="comma-separated batch sizes")
    ap.add_argument("--cold-handler", action="store_true",
                    help="also rebuild nimble's XLA FFI handler (its first use after install)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "BATCH", "SIDE"), help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.child:
        model, batch, side = opts.child
        print(json.dumps(child(model, int(batch), side)), flush=True)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="nimblejax-first-call-") as root:
        for model in opts.models.split(","):
            for batch in (int(b) for b in opts.batch.split(",")):
                for side in SIDES:
                    rows.append(run_one(model, batch, side, root, opts.cold_handler))
                    print(json.dumps(rows[-1]), flush=True)
    print(_table(rows))
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
