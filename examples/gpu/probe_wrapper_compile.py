"""XLA's compile of nimble's call on a cold first call, under candidate compiler options.

On the XLA call path a first call lowers the plan as one custom call inside a jax.jit and
XLA compiles that program while the graph is built beside it (runtime/placement.py). On
an H200 (f0ac4f5) that compile took 0.13 to 0.18 s of the MLP's 0.29 s first call at
batch 1, the longest part. The program is the custom call and little else, so XLA's
optimizing passes have nothing to do in it: this times the first call with
`xla_path.WRAPPER_COMPILER_OPTIONS` set to each candidate, each run in a fresh process
with empty kernel caches (as bench/first_call.py), in alternating rounds:

    PYTHONPATH=. python3 examples/gpu/probe_wrapper_compile.py [--models mlp:1,lstm:1]
        [--rounds 2] [--json out.json]

Printed per variant and model: the first call (s), XLA's compile seconds inside it (the
sum over `jax._src.compiler`'s compile entry points), the steady call afterwards (µs,
looped over fresh inputs) and the largest difference from jax.jit's result. A variant
whose options XLA refuses shows its error.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

from nimblejax.bench.needs_gpu import require_gpu

VARIANTS = {
    "default": None,
    "O0": {"xla_backend_optimization_level": 0},
    "llvm-cheap": {"xla_llvm_disable_expensive_passes": True},
    "autotune-0": {"xla_gpu_autotune_level": 0},
    "no-command-buffer": {"xla_gpu_enable_command_buffer": ""},
    "all": {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
            "xla_gpu_autotune_level": 0, "xla_gpu_enable_command_buffer": ""},
}


def child(variant: str, model: str, batch: int) -> dict:
    """In a fresh process: the first call under the variant's options, then the steady call."""
    import jax
    import jax._src.compiler as jax_compiler
    import jax.numpy as jnp
    import numpy as np

    import nimblejax as nimble
    from nimblejax import xla_path
    from nimblejax.bench.models import MODELS

    xla_path.WRAPPER_COMPILER_OPTIONS = VARIANTS[variant]
    compile_s = [0.0]
    for name in ("backend_compile", "backend_compile_and_load"):
        real = getattr(jax_compiler, name, None)
        if real is not None:
            def timed(*args, _real=real, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    compile_s[0] += time.perf_counter() - t0
            setattr(jax_compiler, name, timed)
    fn, (params, x) = MODELS[model].build(batch, jnp.float32, np.random.default_rng(0))
    jax.block_until_ready((params, x))
    t0 = time.perf_counter()
    f = nimble.jit(fn)
    out = jax.block_until_ready(f(params, x))
    first = time.perf_counter() - t0
    xla_s = compile_s[0]
    inputs = [x + 0.001 * i for i in range(8)]
    jax.block_until_ready(inputs)
    for i in range(20):
        f(params, inputs[i % 8])
    jax.block_until_ready(f(params, x))
    t0 = time.perf_counter()
    for i in range(200):
        last = f(params, inputs[i % 8])
    jax.block_until_ready(last)
    looped_us = (time.perf_counter() - t0) / 200 * 1e6
    want = np.asarray(jax.jit(fn)(params, x), np.float32)
    error = float(np.max(np.abs(np.asarray(out, np.float32) - want)))
    return dict(variant=variant, model=model, batch=batch, first_call_s=round(first, 3),
                xla_compile_s=round(xla_s, 3), looped_us=round(looped_us, 1), max_abs_error=error)


def run(variant: str, model: str, batch: int, root: str) -> dict:
    """One child in a fresh process with empty kernel caches, as bench/first_call.py's."""
    from nimblejax.bench.first_call import fresh_env

    done = subprocess.run([sys.executable, __file__, "--child", variant, model, str(batch)],
                          env=fresh_env(root, cold_handler=False), capture_output=True, text=True, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-2:]
        return dict(variant=variant, model=model, batch=batch, error=" | ".join(tail))
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp:1,lstm:1", help="model:batch, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child:
        variant, model, batch = opts.child
        print(json.dumps(child(variant, model, int(batch))), flush=True)
        return
    require_gpu(__file__)
    cases = [(m, int(b)) for m, b in (c.split(":") for c in opts.models.split(","))]
    variants = opts.variants.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for r in range(opts.rounds):
            for variant in variants if r % 2 == 0 else variants[::-1]:
                for model, batch in cases:
                    rows.append(run(variant, model, batch, root))
                    print(json.dumps(rows[-1]), flush=True)
    print("| variant | model | batch | first call s | XLA compile s | steady µs | max abs error |")
    print("|---|---|---|---|---|---|---|")
    for variant in variants:
        for model, batch in cases:
            mine = [r for r in rows if (r["variant"], r["model"], r["batch"]) == (variant, model, batch)]
            ok = [r for r in mine if "error" not in r]
            if not ok:
                print(f"| {variant} | {model} | {batch} | {mine[0]['error'] if mine else '—'} | | | |")
                continue
            med = {k: statistics.median(r[k] for r in ok) for k in ("first_call_s", "xla_compile_s", "looped_us")}
            print(f"| {variant} | {model} | {batch} | {med['first_call_s']:.3f} | {med['xla_compile_s']:.3f} "
                  f"| {med['looped_us']:.1f} | {max(r['max_abs_error'] for r in ok):.3g} |")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
