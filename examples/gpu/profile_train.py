"""Where a train step's host time goes under nimble.jit (GPU machine)."""
import cProfile
import pstats

import jax
import numpy as np

import nimblejax as nimble
from nimblejax.bench.needs_gpu import require_gpu
from nimblejax.bench.timing import median_us
from tests.helpers.train_models import TRAIN_MODELS, batch, make_train_step

require_gpu(__file__)
init, apply = TRAIN_MODELS["resnet"]
step = make_train_step(apply)
rng = np.random.default_rng(0)
params = init(rng)
vel = jax.tree_util.tree_map(lambda p: p * 0.0, params)
x, labels = batch(rng, 32)
f = nimble.jit(step, backend="cuda", call_path="python")  # the direct path's pieces below
state = (params, vel)
for _ in range(5):
    p, v, loss = f(*state, x, labels)
    state = (p, v)
jax.block_until_ready(state)
(exe,) = f.runners()  # runtime/direct_runner.py's DirectRunner
s0 = exe.graph.streams[0]


def loop():
    global state
    p, v, loss = f(*state, x, labels)
    state = (p, v)
    jax.block_until_ready(loss)


print("train step e2e (fed back)", median_us(loop))
print("graph.launch + sync", median_us(lambda: (exe.graph.graph.launch(s0), s0.synchronize())))
leaves = jax.tree_util.tree_leaves((state, x, labels))
print("unpacker call + block", median_us(lambda: jax.block_until_ready(exe.unpacker(leaves))))
print("flatten", median_us(lambda: f._flatten((*state, x, labels), {})))
prof = cProfile.Profile()
prof.enable()
for _ in range(50):
    loop()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(16)
