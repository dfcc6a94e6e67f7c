"""The benchmark suite without a GPU: published output shapes and parameter counts,
tiny models against jax.jit under the interpreter, and the CLI's plan-only mode."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import nimblejax as nimble
from tests.helpers.models import assert_tree_close
from nimblejax.bench import cli
from nimblejax.bench.models import MODELS

PUBLISHED = {  # parameters, ±15% (the classifier included; BERT: the encoder stack)
    "resnet50": 25.6e6, "mobilenet_v2": 3.5e6, "efficientnet_b0": 5.3e6,
    "inception_v3": 23.8e6, "nasnet_mobile": 5.3e6, "bert": 85e6, "lstm": 2.1e6,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_count(name):
    count = MODELS[name].param_count()
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.15, count


@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2", "efficientnet_b0", "inception_v3",
                                  "nasnet_mobile"])
def test_classifiers_output_1000_logits(name):
    assert MODELS[name].output_shape(batch=2) == (2, 1000)


@pytest.mark.parametrize("name", ["mlp", "lstm", "bert"])
def test_tiny_model_matches_jax_under_the_interpreter(name):
    fn, args = MODELS[name].build(2, tiny=True)
    assert_tree_close(nimble.jit(fn, backend="interpret")(*args), jax.jit(fn)(*args))


def test_cli_without_gpu_prints_plans_and_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    out = tmp_path / "plans.json"
    assert cli.main(["--tiny", "--models", "mlp,lstm", "--batch", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "No CUDA GPU is visible" in printed
    rows = json.loads(out.read_text())["rows"]
    assert {r["model"] for r in rows} == {"mlp", "lstm"}
    assert all(r["tasks"] > 0 and r["streams"] >= 1 for r in rows)
    assert np.isfinite([r["arena_bytes"] for r in rows]).all()
