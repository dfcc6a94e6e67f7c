"""nimblejax/options.py: defaults < environment < `base` record < keyword overrides,
validation naming the environment variable, and the cuDNN probe."""
from __future__ import annotations

import pytest

import nimblejax as nimble
from nimblejax import options as options_mod
from nimblejax.options import Options, from_env

VARS = tuple(options_mod._ENV.values())


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_without_environment(clean_env):
    assert from_env() == Options()


def test_deferred_builds_are_on_unless_turned_off(clean_env):
    assert from_env().defer_build is True
    clean_env.setenv("NIMBLE_DEFER_BUILD", "0")
    assert from_env().defer_build is False and nimble.jit(lambda x: x).options.defer_build is False
    with pytest.raises(ValueError, match="NIMBLE_DEFER_BUILD"):
        Options(defer_build="yes")


def test_environment_then_base_then_keywords(clean_env):
    clean_env.setenv("NIMBLE_MAX_STREAMS", "3")
    clean_env.setenv("NIMBLE_GEMM", "cublas")
    clean_env.setenv("NIMBLE_EAGER", "1")
    clean_env.setenv("NIMBLE_DEBUG", "2")
    got = from_env()
    assert (got.max_streams, got.gemm, got.eager, got.debug) == (3, "cublas", True, 2)
    base = Options(max_streams=2)  # its non-default fields beat the environment
    assert from_env(base).max_streams == 2 and from_env(base).gemm == "cublas"
    assert from_env(base, max_streams=5).max_streams == 5  # keywords beat both
    assert from_env(base, max_streams=None).max_streams == 2  # None: not given
    clean_env.setenv("NIMBLE_EAGER", "0")
    assert from_env().eager is False


@pytest.mark.parametrize("var,value,match", [
    ("NIMBLE_CONV", "bogus", "NIMBLE_CONV"),
    ("NIMBLE_GEMM", "mkl", "NIMBLE_GEMM"),
    ("NIMBLE_CALL_PATH", "grpc", "NIMBLE_CALL_PATH"),
    ("NIMBLE_MAX_STREAMS", "many", "NIMBLE_MAX_STREAMS"),
    ("NIMBLE_DEBUG", "yes", "NIMBLE_DEBUG"),
    ("NIMBLE_MAX_STREAMS", "0", "max_streams"),
])
def test_bad_values_name_their_variable(clean_env, var, value, match):
    clean_env.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        from_env()


@pytest.mark.parametrize("field,var", [("small_gemm", "NIMBLE_SMALL_GEMM"),
                                       ("tc_gemm", "NIMBLE_TC_GEMM"),
                                       ("horizontal", "NIMBLE_HORIZONTAL")])
def test_kernel_switches_come_from_the_environment_and_must_be_booleans(monkeypatch, field, var):
    monkeypatch.setenv(var, "0")
    assert getattr(nimble.jit(abs).options, field) is False
    monkeypatch.setenv(var, "1")
    assert getattr(nimble.jit(abs).options, field) is True
    with pytest.raises(ValueError, match=field):
        Options(**{field: "yes"})


def test_unknown_option_is_a_type_error(clean_env):
    with pytest.raises(TypeError, match="unknown nimblejax option"):
        from_env(streams=2)


def test_cudnn_is_whether_the_probe_found_it_whatever_the_conv_setting(clean_env):
    calls = []

    def probe(found):
        return lambda: calls.append(found) or found

    assert from_env(probe_cudnn=probe(True)).cudnn is True
    assert from_env(probe_cudnn=probe(False)).cudnn is False
    assert from_env().cudnn is False  # no probe: not found
    clean_env.setenv("NIMBLE_CONV", "im2col")  # conv decides the path, not the record
    assert from_env(probe_cudnn=probe(True)).cudnn is True
    assert from_env(probe_cudnn=probe(True), cudnn=False).cudnn is False  # given: no probe
    assert calls == [True, False, True]


def test_nimble_jit_records_the_loader_search(clean_env):
    from nimblejax.runtime.libs import loader

    f = nimble.jit(lambda x: x + 1, backend="interpret")
    assert f.options.cudnn is loader.found("cudnn")


def test_records_are_values_usable_as_cache_keys():
    a, b = Options(max_streams=2), Options(max_streams=2)
    assert a == b and hash(a) == hash(b) and a != Options(max_streams=3)
    assert a.replace(debug=1) == Options(max_streams=2, debug=1)
    with pytest.raises(Exception):
        a.debug = 1  # frozen
    assert {a: 1}[b] == 1


@pytest.mark.parametrize("debug,verify,prints", [(0, False, False), (1, True, False),
                                                 (2, True, True)])
def test_debug_levels(debug, verify, prints):
    o = Options(debug=debug)
    assert o.verify is verify and o.print_passes is prints


def test_library_locations_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("NIMBLEJAX_LIBCUDNN", "/opt/x/libcudnn.so.9")
    monkeypatch.delenv("NIMBLEJAX_LIBCUBLAS", raising=False)
    assert options_mod.library_override("cudnn") == "/opt/x/libcudnn.so.9"
    assert options_mod.library_override("cublas") is None
    monkeypatch.setenv("CUDA_HOME", "/opt/cuda-x")
    assert "/opt/cuda-x" in options_mod.cuda_roots() and options_mod.cuda_roots()[-1] == "/usr/local/cuda"
    monkeypatch.setenv("NIMBLEJAX_CACHE_DIR", "/tmp/nimble-cache-x")
    assert options_mod.cache_dir() == "/tmp/nimble-cache-x"
