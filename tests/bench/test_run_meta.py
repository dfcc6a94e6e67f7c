"""What a bench run records besides its rows (bench/results.py run_meta): the source's
commit and the options the environment changed, so that a JSON file names what ran."""
from __future__ import annotations

import argparse
import subprocess

import numpy as np

from nimblejax import options
from nimblejax.bench import results


def namespace() -> argparse.Namespace:
    return argparse.Namespace(model_names=["mlp"], batches=[1], dtype=np.float32, tiny=True)


def test_a_run_records_the_options_its_environment_changed(monkeypatch):
    for name in ("NIMBLE_SPLIT_K", "NIMBLE_PDL", "NIMBLE_MAX_STREAMS"):
        monkeypatch.delenv(name, raising=False)
    before = results.run_meta(namespace(), "plan", None)["options"]  # (the suite sets NIMBLE_DEBUG)
    assert before == options.changed(options.from_env(None))
    monkeypatch.setenv("NIMBLE_SPLIT_K", "0")
    monkeypatch.setenv("NIMBLE_PDL", "0")
    monkeypatch.setenv("NIMBLE_MAX_STREAMS", "4")
    assert results.run_meta(namespace(), "plan", None)["options"] == {
        **before, "split_k": False, "pdl": False, "max_streams": 4}


def test_changed_lists_only_fields_off_their_defaults():
    assert options.changed(options.Options()) == {}
    assert options.changed(options.Options(gemm="cublas", segments=2)) == {"gemm": "cublas", "segments": 2}


def test_the_commit_is_the_checkouts_head_or_none():
    commit = results.source_commit()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=results.__file__.rsplit("/nimblejax/", 1)[0])
    if head.returncode != 0:  # not a git checkout (an installed copy)
        assert commit is None
    else:
        assert commit is not None and commit.rstrip("+") == head.stdout.strip()
