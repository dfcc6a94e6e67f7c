"""Every primitive of the installed JAX is lowered, rewritten, inlined or listed as not
supported with a reason (nimblejax/compiler/support.py), and exactly one of these: a
JAX upgrade that brings a new primitive fails here, naming it, instead of at a user's
call. docs/reference.md's table of unsupported primitives is the table's own output."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import nimblejax
from nimblejax.compiler import support
from tests.helpers import on_host

ROOT = Path(nimblejax.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed() -> dict[str, list[str]]:
    """{name: modules} of the installed JAX's primitives, walked in a fresh interpreter
    (what this test process imported before would change what is loaded)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    run = subprocess.run([sys.executable, "-m", "nimblejax.compiler.support", "--json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(found["primitives"]) > 200, found  # the walk found JAX's primitives
    return found["primitives"]


@pytest.mark.parametrize("job", ["ci", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_every_primitive_of_the_installed_jax_is_classified(installed, job):
    """Also a `gpu` test: `pytest -m gpu` on the GPU machine audits its own jax line."""
    missing = {n: mods for n, mods in installed.items() if support.classify(n) is None}
    assert not missing, (
        f"jax {jax.__version__} has primitives nimblejax neither lowers, rewrites nor inlines, "
        f"and NOT_SUPPORTED (nimblejax/compiler/unsupported.py) does not list: "
        + "; ".join(f"{n} (from {', '.join(m[:2])})" for n, m in sorted(missing.items())))


def test_each_primitive_is_in_exactly_one_group(installed):
    names = set(installed).union(*support.handled().values())
    doubled = {n: support.groups_of(n) for n in names if len(support.groups_of(n)) > 1}
    assert not doubled, f"primitives in more than one group: {doubled}"


def test_not_supported_table_has_no_stale_entries():
    """A primitive that gained a rule, a rewrite or an inlining leaves the table."""
    stale = {n: support.groups_of(n) for n in support.NOT_SUPPORTED
             if support.groups_of(n) != [support.NOT_SUPPORTED_GROUP]}
    assert not stale, f"NOT_SUPPORTED lists primitives that are now handled: {stale}"


def test_reasons_are_one_line_table_cells():
    bad = {n: why for n, why in support.NOT_SUPPORTED.items()
           if not why.strip() or "\n" in why or "|" in why}
    assert not bad, bad


def test_unsupported_primitive_error_gives_the_reason():
    import jax.numpy as jnp
    import numpy as np

    import nimblejax as nimble

    x = on_host(np.random.default_rng(0).standard_normal((3, 3)), jnp.float32)
    with pytest.raises(NotImplementedError) as info:
        nimble.jit(lambda a: jnp.fft.fft(a).real, backend="interpret", fallback="error")(x)
    assert "'fft'" in str(info.value) and support.NOT_SUPPORTED["fft"] in str(info.value)


REFERENCE = "docs/reference.md"  # the README links there for the full lists


def test_reference_lists_the_not_supported_table():
    reference = (ROOT / REFERENCE).read_text()
    assert support.markdown_table() in reference, (
        f"{REFERENCE}'s table of unsupported primitives is out of date: replace it with the "
        "output of `python -m nimblejax.compiler.support --markdown`")


def test_reference_counts_are_those_of_the_version_it_names(installed):
    """The reference cites the counts for one JAX version; on that version they must hold."""
    reference = (ROOT / REFERENCE).read_text()
    cited = re.search(r"`(jax (\S+): \d+ primitives: [^`]*)`", reference)
    assert cited, f"{REFERENCE} cites no primitive counts (python -m nimblejax.compiler.support)"
    if cited.group(2) != jax.__version__:
        pytest.skip(f"README cites jax {cited.group(2)}; this is {jax.__version__}")
    assert cited.group(1) == support.summary(installed)
