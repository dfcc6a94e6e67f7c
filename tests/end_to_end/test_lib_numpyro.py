"""Programs written the way numpyro's documentation shows them (issue 33), through
nimble.jit on the CPU interpreter against jax.jit on random inputs: a hierarchical
model's log density and its gradient, the log densities of common distributions, and
samples drawn from Gamma, Beta and Dirichlet (random_gamma's rejection loop planned whole:
the same draws as jax.jit's, to a few ulps)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.libraries import assert_kernels_compile, close, left_to_xla, report_kernels

numpyro = pytest.importorskip("numpyro")
dist = pytest.importorskip("numpyro.distributions")
infer_util = pytest.importorskip("numpyro.infer.util")
pytestmark = pytest.mark.filterwarnings("ignore:nimblejax. .* nimble region")


# ---- a hierarchical model: numpyro's eight schools -------------------------------------
def eight_schools(sigma, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("J", sigma.shape[0]):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def potential(params, sigma, y):
    """The negative log joint at unconstrained parameters (tau through exp), as HMC reads it."""
    return infer_util.potential_energy(eight_schools, (sigma,), {"y": y}, params)


def log_joint(params, sigma, y):
    return infer_util.log_density(eight_schools, (sigma,), {"y": y}, params)[0]


def schools(seed: int, j: int = 8):
    r = np.random.default_rng(seed)
    params = {"mu": np.float32(r.standard_normal()), "tau": np.float32(r.standard_normal()),
              "theta": r.standard_normal(j).astype(np.float32)}
    sigma = (5.0 + 10.0 * r.random(j)).astype(np.float32)
    return params, sigma, (10.0 * r.standard_normal(j)).astype(np.float32)


@pytest.mark.parametrize("density", [potential, log_joint])
def test_hierarchical_model_density_and_gradient(density):
    params, sigma, y = schools(0)
    if density is log_joint:
        params["tau"] = np.abs(params["tau"]) + 0.5  # log_density reads constrained values
    f = nimble.jit(density, backend="interpret", fallback="error")
    close(f(params, sigma, y), jax.jit(density)(params, sigma, y))
    grad = jax.grad(density)
    close(nimble.jit(grad, backend="interpret", fallback="error")(params, sigma, y),
          jax.jit(grad)(params, sigma, y), tol=1e-4)


# ---- log densities -----------------------------------------------------------------------
def log_probs(x, u, p, s, cov_factor):
    """x: reals, u: in (0, 1), p: positive, s: a point on the simplex (last axis)."""
    scale = cov_factor @ cov_factor.T + jnp.eye(cov_factor.shape[0])
    return {
        "normal": dist.Normal(0.5, 2.0).log_prob(x),
        "beta": dist.Beta(p[:4] + 0.5, p[4:] + 0.5).log_prob(u),
        "gamma": dist.Gamma(p + 0.5, 2.0).log_prob(p),
        "student_t": dist.StudentT(p + 1.0, 0.3, 1.5).log_prob(x),
        "dirichlet": dist.Dirichlet(p[:3] + 0.5).log_prob(s),
        "mvn": dist.MultivariateNormal(x[:4], covariance_matrix=scale).log_prob(x[4:]),
    }


def log_prob_args(seed: int):
    r = np.random.default_rng(seed)
    s = r.random((4, 3)) + 0.1
    return (r.standard_normal(8).astype(np.float32), r.uniform(0.05, 0.95, 4).astype(np.float32),
            r.uniform(0.2, 3.0, 8).astype(np.float32), (s / s.sum(-1, keepdims=True)).astype(np.float32),
            r.standard_normal((4, 4)).astype(np.float32))


def test_log_prob_of_common_distributions():
    args = log_prob_args(1)
    f = nimble.jit(log_probs, backend="interpret")
    close(f(*args), jax.jit(log_probs)(*args), tol=1e-5)
    # MultivariateNormal's Cholesky factor and triangular solve: nimble's kernels.
    assert left_to_xla(nimble.explain(f, *args)) == set()


# ---- samplers ------------------------------------------------------------------------------
def samples(key, conc, a, b):
    kg, kb, kd = jax.random.split(key, 3)
    return (dist.Gamma(conc, 2.0).sample(kg, (6,)), dist.Beta(a, b).sample(kb, (5,)),
            dist.Dirichlet(conc[:3]).sample(kd, (4,)))


def sampler_args(seed: int):
    r = np.random.default_rng(seed)
    conc, a, b = (r.uniform(0.3, 4.0, n).astype(np.float32) for n in (5, 3, 3))
    return conc, a, b


@pytest.mark.parametrize("typed", [False, True], ids=["raw_key", "typed_key"])
def test_gamma_beta_dirichlet_samples_match_jax_jit(typed):
    seed = 2 + typed
    key = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)
    args = sampler_args(seed)
    f = nimble.jit(samples, backend="interpret", fallback="error")
    got, want = f(key, *args), jax.jit(samples)(key, *args)
    # The same draws, a few ulps apart: jax.jit and JAX's op-by-op evaluation differ by as
    # much (up to 5.5e-7 relative here), XLA fusing the rejection test's log and exp.
    close(got, want, tol=2e-6)
    assert all(np.all(np.asarray(g) > 0) for g in jax.tree_util.tree_leaves(got))


def test_generated_kernels_compile():
    """lgamma, digamma and the rejection sampler's loop among them."""
    params, sigma, y = schools(0)
    reports = [nimble.explain(nimble.jit(jax.grad(potential), backend="interpret"), params, sigma, y),
               nimble.explain(nimble.jit(log_probs, backend="interpret"), *log_prob_args(1)),
               nimble.explain(nimble.jit(samples, backend="interpret"), jax.random.PRNGKey(0),
                              *sampler_args(0))]
    assert_kernels_compile({k: v for r in reports for k, v in report_kernels(r).items()}, "numpyro")


# ---- GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_programs_match_jax_jit():
    params, sigma, y = schools(4)
    for fn in (potential, jax.grad(potential)):
        close(nimble.jit(fn)(params, sigma, y), jax.jit(fn)(params, sigma, y), tol=1e-4)
    args = log_prob_args(5)
    close(nimble.jit(log_probs)(*args), jax.jit(log_probs)(*args), tol=1e-4)
    key, args = jax.random.PRNGKey(6), sampler_args(6)
    close(nimble.jit(samples)(key, *args), jax.jit(samples)(key, *args), tol=1e-4)
