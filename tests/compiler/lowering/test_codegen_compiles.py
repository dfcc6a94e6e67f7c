"""Every kernel the test suite generates compiles for sm_90 without a GPU (NVRTC or
nvcc), so a codegen bug is caught on CI machines."""
from __future__ import annotations

import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.models import MODELS, model_args
from tests.helpers.primitive_table import RECORDS
from nimblejax.testing.nvrtc_check import available_compiler, compile_to_ptx

pytestmark = pytest.mark.skipif(available_compiler() is None, reason="no NVRTC or nvcc")


def suite_kernels() -> dict[str, str]:
    kernels: dict[str, str] = {}
    for r in RECORDS:
        plan = nimble.jit(r.fn, backend="interpret").plan(*r.args(np.random.default_rng(1)))
        kernels.update((k.name, k.source) for t in plan.tasks if t.kernel for k in t.kernel.launches)
    for name, (fn, _, opts) in MODELS.items():
        plan = nimble.jit(fn, backend="interpret", **opts).plan(*model_args(name))
        kernels.update((k.name, k.source) for t in plan.tasks if t.kernel for k in t.kernel.launches)
    return kernels


@pytest.mark.long
def test_all_generated_kernels_compile():
    kernels = suite_kernels()
    assert len(kernels) > 100
    # One translation unit: the headers have include guards and every kernel name is
    # unique (it carries a hash of its text), so this is one compiler run, not hundreds.
    source = "\n".join(kernels.values())
    ptx = compile_to_ptx(source, "nimble_suite.cu", arch="sm_90", fast=True)
    missing = [name for name in kernels if f".entry {name}(" not in ptx]
    assert not missing, missing
