"""Where a train step's host time goes under nimble.jit (GPU machine)."""
import cProfile
import os
import pstats
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import nimblejax as nimble  # noqa: E402
from train_models import TRAIN_MODELS, batch, make_train_step  # noqa: E402

init, apply = TRAIN_MODELS["resnet"]
step = make_train_step(apply)
rng = np.random.default_rng(0)
params = init(rng)
vel = jax.tree_util.tree_map(lambda p: p * 0.0, params)
x, labels = batch(rng, 32)
f = nimble.jit(step, backend="cuda")
state = (params, vel)
for _ in range(5):
    p, v, loss = f(*state, x, labels)
    state = (p, v)
jax.block_until_ready(state)
(exe,) = f.executables()
s0 = exe.streams[0]


def med(fn, n=50):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def loop():
    global state
    p, v, loss = f(*state, x, labels)
    state = (p, v)
    jax.block_until_ready(loss)


print("train step e2e (fed back)", med(loop))
print("graph.launch + sync", med(lambda: (exe.graph.launch(s0), s0.synchronize())))
leaves = jax.tree_util.tree_leaves((state, x, labels))
print("unpacker call + block", med(lambda: jax.block_until_ready(exe.unpacker(leaves))))
print("flatten", med(lambda: f._flatten((*state, x, labels), {})))
prof = cProfile.Profile()
prof.enable()
for _ in range(50):
    loop()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(16)
