"""sort, top_k and split: plans against jax.jit under the interpreter, the kernels'
shapes, the generated sort kernels run on the CPU (tests/helpers/kernel_emulator.py: each
block's threads as OS threads, compared bit for bit with JAX), and the same programs on the GPU."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tests.helpers import on_host
from tests.helpers import kernel_emulator
import nimblejax as nimble
from tests.helpers.models import assert_tree_close
from tests.helpers.primitive_table import RECORDS, Record
from tests.helpers.xla_argminmax_sim import xla_gpu_argminmax
from nimblejax.compiler.ir import Literal
from nimblejax.compiler.lowering import xla_reduce_order as xo

SORT_RECORDS = [r for r in RECORDS if r.primitive in ("sort", "top_k")]


# ---- programs ----------------------------------------------------------------------
def top_k_sample(logits, noise, temperature=0.7, k=8):
    """Top-k sampling with the Gumbel trick: the k best logits, their softmax
    probabilities, and one token per row drawn with the given uniform noise."""
    values, idx = lax.top_k(logits, k)
    probs = jax.nn.softmax(values / temperature, axis=-1)
    gumbel = -jnp.log(-jnp.log(noise))
    choice = jnp.argmax(values / temperature + gumbel, axis=-1)
    token = jnp.sum(jnp.where(jnp.arange(k) == choice[:, None], idx, 0), axis=-1)
    return token, probs, idx


def sample_args(rng, batch=4, vocab=1000):
    logits = on_host(rng.normal(size=(batch, vocab)) * 3, jnp.float32)
    noise = on_host(rng.uniform(0.01, 0.99, size=(batch, 8)), jnp.float32)
    return logits, noise


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def inception_loss(params, x, y):
    """Inception-style block: three branches concatenated on channels, a head."""
    a = jax.nn.relu(_conv(x, params["b1"]))
    b = jax.nn.relu(_conv(jax.nn.relu(_conv(x, params["b3a"])), params["b3b"]))
    pool = lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
    c = jax.nn.relu(_conv(pool, params["bp"]))
    h = jnp.concatenate([a, b, c], axis=-1)
    logits = jnp.mean(h, axis=(1, 2)) @ params["head"]
    return jnp.mean((logits - y) ** 2)


def inception_step(params, x, y):
    loss, grads = jax.value_and_grad(inception_loss)(params, x, y)
    return loss, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def inception_args(rng):
    w = lambda *s: on_host(rng.normal(size=s) * 0.3, jnp.float32)  # noqa: E731
    params = {"b1": w(1, 1, 4, 3), "b3a": w(1, 1, 4, 2), "b3b": w(3, 3, 2, 5),
              "bp": w(1, 1, 4, 2), "head": w(10, 6)}
    return params, w(1, 6, 6, 4), w(1, 6)


def _names(plan) -> list[str]:
    return [n.name for t in plan.tasks for n in t.eqns]


# ---- interpreter ---------------------------------------------------------------------
def test_top_k_sampling_matches_jax():
    args = sample_args(np.random.default_rng(0))
    f = nimble.jit(top_k_sample, backend="interpret")
    got, want = f(*args), jax.jit(top_k_sample)(*args)
    assert_tree_close(got, want)
    np.testing.assert_array_equal(got[0], want[0])


def test_inception_training_step_splits_into_slices():
    args = inception_args(np.random.default_rng(0))
    f = nimble.jit(inception_step, backend="interpret")
    assert "split" in str(jax.make_jaxpr(inception_step)(*args))
    assert_tree_close(f(*args), jax.jit(inception_step)(*args))
    names = _names(f.plan(*args))
    assert "split" not in names and "slice" in names and "concatenate" in names


def test_split_rewrite_keeps_the_source_line_and_shapes():
    from nimblejax.compiler.canonicalize.slices import rewrite_split
    from nimblejax.options import Options
    from nimblejax.compiler.trace import make_graph

    graph, _ = make_graph(lambda x: lax.split(x, (2, 0, 3), axis=1),
                          [jax.ShapeDtypeStruct((4, 5), jnp.float32)])
    (node,) = [n for n in graph.nodes if n.name == "split"]
    assert "test_sort.py" in node.source
    parts = rewrite_split(node, Options())
    assert [p.name for p in parts] == ["slice"] * 3
    assert [p.outputs[0] for p in parts] == list(node.outputs)
    assert all(p.source == node.source and p.inputs == node.inputs for p in parts)
    assert [p.params["start_indices"] for p in parts] == [(0, 0), (0, 2), (0, 2)]
    assert [p.params["limit_indices"] for p in parts] == [(4, 2), (4, 2), (4, 5)]


@pytest.mark.parametrize("n,kernel", [(37, "nimble_sort_"), (4096, "nimble_sort_"),
                                      (4097, "nimble_sortrank_"), (70000, "nimble_sortrank_")])
def test_long_rows_take_the_rank_kernel(n, kernel):
    x = jax.ShapeDtypeStruct((2, n), jnp.float32)
    (task,) = [t for t in nimble.jit(jnp.argsort, backend="interpret").plan(x).tasks
               if t.kernel and "sort" in t.kernel.name]
    assert task.kernel.name.startswith(kernel)
    assert task.kernel.block[0] <= 1024


def test_sort_of_many_operands_and_keys_matches_jax():
    rng = np.random.default_rng(3)
    keys = [on_host(rng.integers(0, 3, (3, 300)), jnp.int32) for _ in range(3)]
    pay = [on_host(rng.normal(size=(3, 300)), jnp.float32), jnp.asarray(rng.random((3, 300)) > .5)]
    fn = lambda *ops: lax.sort(ops, dimension=1, num_keys=3, is_stable=True)  # noqa: E731
    got = nimble.jit(fn, backend="interpret")(*keys, *pay)
    for g, w in zip(got, jax.jit(fn)(*keys, *pay)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# ---- the generated kernels, run on the CPU --------------------------------------------
EMULATED = ["sort", "sort-rows-of-1", "sort-row-5000-rank", "sort-nan-inf-zeros", "sort-bf16",
            "sort-u32", "sort-bool", "sort-payloads-stable", "sort-num-keys-2",
            "sort-num-keys-2-rank", "sort-argsort-axis0", "top_k-nan-inf-zeros", "top_k-f16",
            "top_k-u8", "top_k-long-k", "top_k-axis0"]
# A long row with a small k: blocks stop early once their queries rank below k.
EARLY_EXIT = Record("top_k", lambda x: lax.top_k(x, 3), lambda r: (
    on_host(r.normal(size=(1, 13000)), jnp.float32),), label="early-exit")


SCAN_AND_ARG = ("argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "pad",
                "concatenate")


CPU_RECORDS = ([r for r in SORT_RECORDS if r.id in EMULATED] + [EARLY_EXIT] +
               [r for r in RECORDS if r.primitive in SCAN_AND_ARG])


def _plan_and_tasks(record):
    args = record.args(np.random.default_rng(1))
    plan = nimble.jit(record.fn, backend="interpret").plan(*args)
    return args, plan, [t for t in plan.tasks if t.kernel and t.eqns[-1].name == record.primitive]


@pytest.fixture(scope="module")
def cpu_library():
    """Every record's kernels in one library (one compiler run)."""
    if kernel_emulator.compiler() is None:
        pytest.skip("no C++ compiler")
    return kernel_emulator.build([k for r in CPU_RECORDS for t in _plan_and_tasks(r)[2]
                                  for k in t.kernel.launches])


@pytest.mark.parametrize("record", CPU_RECORDS, ids=lambda r: r.id)
def test_generated_kernel_on_cpu_matches_jax(record, cpu_library):
    """Bit for bit, except the float scans: a serial scan rounds where XLA's does not."""
    args, plan, tasks = _plan_and_tasks(record)
    values = dict(zip(plan.graph.inputs, (np.asarray(a) for a in jax.tree_util.tree_leaves(args))))
    values.update(plan.graph.consts)
    value = lambda a: a.value if isinstance(a, Literal) else values[a]  # noqa: E731
    for n in plan.graph.nodes:  # every value, by JAX
        outs = n.primitive.bind(*map(value, n.inputs), **n.params)
        values.update(zip(n.outputs, outs if n.primitive.multiple_results else [outs]))
    assert tasks
    for task in tasks:
        outputs = task.eqns[-1].outputs
        garbage = lambda v: np.frombuffer(b"\xab" * v.nbytes, v.dtype).reshape(v.shape)  # noqa: E731
        buffers = [garbage(v).copy() if v in outputs else np.array(values[v], v.dtype, order="C")
                   for v in task.kernel.params]
        kernel_emulator.launch(task.kernel, buffers, cpu_library)  # threads as OS threads
        got = dict(zip(task.kernel.params, buffers))
        for v in outputs:
            want = np.asarray(values[v])
            if record.primitive in ("argmax", "argmin"):  # XLA's GPU order of NaNs, not its CPU's
                want = xla_gpu_reference(task.eqns[-1], values[task.eqns[-1].inputs[0]])
            if record.primitive.startswith("cum") and jnp.issubdtype(v.dtype, jnp.inexact):
                assert_tree_close(got[v], want)
            else:
                assert got[v].tobytes() == want.tobytes(), (record.id, got[v], want)


def xla_gpu_reference(node, x):
    """What jax.jit's argmax/argmin returns on the GPU: tests/xla_argminmax_sim.py."""
    (axis,) = node.params["axes"]
    x = np.asarray(x)
    is_max = node.name == "argmax"
    if x.dtype.kind == "f" or x.dtype.name == "bfloat16":
        x = x.astype(np.float32)
    order = xo.arrangement_for(x.shape, axis, node.inputs[0].dtype)
    init = -np.inf if is_max else np.inf
    return xla_gpu_argminmax(x, axis, is_max, order, init).astype(node.outputs[0].dtype)


# ---- GPU -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("record", SORT_RECORDS, ids=lambda r: r.id)
def test_gpu_sort_records_bitwise(record):
    """A sort or top_k moves elements, so results equal JAX's bit for bit. The reference
    is jax.jit on the CPU: XLA's GPU top_k may order NaNs differently."""
    args = record.args(np.random.default_rng(1))
    got = nimble.jit(record.fn, backend="cuda")(*args)
    with jax.default_device(jax.devices("cpu")[0]):
        want = jax.jit(record.fn)(*jax.device_put(args, jax.devices("cpu")[0]))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), record.id


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 1), (5, 1023), (2, 4096), (2, 4097), (3, 20000), (1, 200000)])
def test_gpu_argsort_and_sort_random_rows(shape):
    x = on_host(np.random.default_rng(5).integers(-1000, 1000, shape), jnp.float32)
    fn = lambda x: (jnp.sort(x), jnp.argsort(x, stable=True))  # noqa: E731
    got, want = nimble.jit(fn, backend="cuda")(x), jax.jit(fn)(x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [1000, 50257])
def test_gpu_top_k_sampling(vocab):
    args = sample_args(np.random.default_rng(7), batch=8, vocab=vocab)
    f = nimble.jit(top_k_sample, backend="cuda")
    want = jax.jit(top_k_sample)(*args)
    for _ in range(2):
        got = f(*args)
        assert_tree_close(got, want)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


@pytest.mark.gpu
def test_gpu_inception_training_step():
    args = inception_args(np.random.default_rng(0))
    f = nimble.jit(inception_step, backend="cuda")
    want = jax.jit(inception_step)(*args)
    assert_tree_close(f(*args), want)
    assert_tree_close(f(*args), want)


@pytest.mark.gpu
def test_gpu_cumlogsumexp_and_argmax_dtypes():
    rng = np.random.default_rng(2)
    x = on_host(rng.normal(size=(5, 300)), jnp.float32)
    for fn in (lambda x: lax.cumlogsumexp(x, axis=1), lambda x: lax.cumlogsumexp(x, axis=0, reverse=True)):
        assert_tree_close(nimble.jit(fn, backend="cuda")(x), jax.jit(fn)(x))
    for dtype in (jnp.float16, jnp.bfloat16, jnp.int8, jnp.uint8, jnp.int16, jnp.uint32, jnp.bool_):
        y = on_host(rng.integers(0, 5, (6, 77)), dtype)
        for fn in (lambda y: jnp.argmax(y, axis=1), lambda y: jnp.argmin(y, axis=0)):
            np.testing.assert_array_equal(nimble.jit(fn, backend="cuda")(y), jax.jit(fn)(y))
