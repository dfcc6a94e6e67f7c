"""Per-leaf error of one train step, nimble against jax.jit (GPU diagnostic)."""

import jax
import numpy as np

import nimblejax as nimble
from nimblejax.bench.needs_gpu import require_gpu
from tests.helpers.train_models import TRAIN_MODELS, batch, make_train_step

require_gpu(__file__)

for name, (init, apply) in TRAIN_MODELS.items():
    step = make_train_step(apply)
    rng = np.random.default_rng(0)
    params = init(rng)
    vel = jax.tree_util.tree_map(lambda p: p * 0.0, params)
    x, labels = batch(rng, 32)
    for prec in ("default", "highest"):
        with jax.default_matmul_precision(prec):
            want = jax.jit(step)(params, vel, x, labels)
            got = nimble.jit(step, backend="cuda")(params, vel, x, labels)
        paths = jax.tree_util.tree_flatten_with_path(want)[0]
        worst = sorted(((float(np.max(np.abs(np.asarray(g) - np.asarray(w))) / (np.max(np.abs(np.asarray(w))) + 1e-30)),
                        jax.tree_util.keystr(p)) for (p, w), g in zip(paths, jax.tree_util.tree_leaves(got))))[-4:]
        print(name, prec, worst)
