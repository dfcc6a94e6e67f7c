"""What a run of `python -m nimblejax.bench` can be asked for: the configurations (in the
order they run), their aliases and nimble options, the dtypes, and the defaults of the
default and --full runs. Read by the argument parser (cli.py) and the runs (plans.py,
measure.py, results.py)."""
from __future__ import annotations

# Configurations, in the order they run: key → label.
CONFIGS = {
    "jax": "jax.jit",
    "jax-concurrent": "jax.jit concurrent",
    "nimble-eager": "nimble eager",
    "nimble-1-stream": "nimble 1-stream",
    "nimble": "nimble multi-stream",
}
ALIASES = {"jax.jit": "jax", "concurrent": "jax-concurrent", "jax.jit-concurrent": "jax-concurrent",
           "eager": "nimble-eager", "1-stream": "nimble-1-stream", "1stream": "nimble-1-stream",
           "nimble-1stream": "nimble-1-stream", "multi-stream": "nimble",
           "nimble-multi-stream": "nimble"}
NIMBLE_OPTIONS = {"nimble-eager": dict(eager=True), "nimble-1-stream": dict(max_streams=1),
                  "nimble": dict()}
JAX_CONFIGS = ("jax", "jax-concurrent")
# Dtypes the benchmark models run in: nimble's floating types. nimble has no 64-bit
# types, and without jax_enable_x64 JAX would quietly build float64 arrays as float32,
# so float64 is refused rather than mislabelled; the models are floating-point networks,
# so integer types (which nimble supports) are refused too.
DTYPES = ("float32", "bfloat16", "float16")


# The default run: jax.jit against nimble's multi-stream graph, looped and GPU time, the
# calls of each measurement sized to a time budget. --full is the long run.
QUICK_CONFIGS = ("jax", "nimble")
DEFAULT_BUDGET_S = 0.5  # seconds of timed calls per row (looped + GPU time) by default
FULL_REPEAT = 200
LOOPS = 5  # every measurement is the median of this many loops of `calls` calls
