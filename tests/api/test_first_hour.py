"""What a new user meets in the first hour, checked: the README's quickstart from the
folder holding an editable clone, every example without a GPU, the no-GPU warning's
location, and tracing errors that name the user's function and argument."""
from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import nimblejax as nimble
from nimblejax import api

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))  # run anywhere
GPU_EXAMPLES = sorted((REPO / "examples" / "gpu").glob("*.py"))  # need a GPU


def _env(**extra) -> dict:
    """A subprocess environment without this run's PYTHONPATH and with no GPU visible."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(CUDA_VISIBLE_DEVICES="", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


# ---- the no-GPU warning names the user's line ------------------------------------------

@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(api, "gpu_available", lambda: False)
    monkeypatch.setattr(api, "_warned_no_gpu", False)


def _no_gpu_warning(record) -> warnings.WarningMessage:
    (w,) = [w for w in record if "no CUDA GPU is visible" in str(w.message)]
    return w


def test_no_gpu_warning_names_the_callers_line(no_gpu):
    f = nimble.jit(lambda x: x + 1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        out = f(jnp.ones(3))
    w = _no_gpu_warning(record)
    assert (w.filename, w.lineno) == (__file__, line)
    assert float(out[0]) == 2.0


def test_no_gpu_warning_inside_jax_transforms_names_the_callers_line(no_gpu):
    f = nimble.jit(lambda x: jnp.sum(x * x))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        g = jax.jit(jax.grad(f))(jnp.ones(3))
    w = _no_gpu_warning(record)
    assert (w.filename, w.lineno) == (__file__, line)
    assert float(g[0]) == 2.0


# ---- tracing errors name the user's function and argument, as jax.jit's do ---------------

def relu_if(params, x, *, scale=1.0):
    if x > 0:  # a Python branch on a traced value: an error under any jit
        return x * params["w"] * scale
    return x


def _tracing_error(f) -> str:
    with pytest.raises(jax.errors.TracerBoolConversionError) as e:
        f({"w": jnp.ones(())}, jnp.ones(()), scale=2.0)
    return str(e.value)


def _named(message: str) -> tuple[str, str]:
    fun = re.search(r"while tracing the function (\S+ at \S+)", message)
    arg = re.search(r"depends on the value of the argument (\S+?)\.", message)
    assert fun and arg, message
    return fun.group(1), arg.group(1)


@pytest.mark.parametrize("call_path", ["auto", "python"])
def test_tracer_error_names_the_users_function_and_argument(call_path):
    want = _named(_tracing_error(jax.jit(relu_if)))
    assert want == (f"relu_if at {__file__}:{relu_if.__code__.co_firstlineno}", "x")
    got = _tracing_error(nimble.jit(relu_if, backend="interpret", call_path=call_path))
    assert _named(got) == want, got
    assert "api.py" not in got and "flat" not in got


def test_tracer_error_while_planning_names_the_users_argument():
    def pick(table, ids, flag):
        if flag:  # flag is traced: not a Python bool
            return table[ids]
        return table

    f = nimble.jit(pick, backend="interpret")
    specs = (jax.ShapeDtypeStruct((4, 2), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32),
             jax.ShapeDtypeStruct((), jnp.bool_))
    with pytest.raises(jax.errors.TracerBoolConversionError) as e:
        f.plan(*specs)
    assert _named(str(e.value)) == (f"pick at {__file__}:{pick.__code__.co_firstlineno}", "flag")


def test_static_arguments_are_left_out_of_the_names():
    def scaled(x, n):
        if x.sum() > n:
            return x
        return x * n

    with pytest.raises(jax.errors.TracerBoolConversionError) as e:
        nimble.jit(scaled, static_argnums=1, backend="interpret")(jnp.ones(3), 2)
    assert _named(str(e.value))[1] == "x"


# ---- every example without a GPU: a clear message, no traceback -------------------------

_RUN_ALL = """
import json, runpy, sys
results = {}
for path in sys.argv[1:]:
    sys.argv = [path]
    try:
        runpy.run_path(path, run_name="__main__")
        results[path] = [0, "ran to the end"]
    except SystemExit as e:
        results[path] = [1 if isinstance(e.code, str) else e.code, str(e.code)]
    except BaseException as e:
        results[path] = ["raised", f"{type(e).__name__}: {e}"]
print("RESULTS", json.dumps(results))
"""


def _run_all(paths: list[Path]) -> dict:
    """Each script's __main__ in one process (runpy: JAX is imported once), no GPU."""
    r = subprocess.run([sys.executable, "-c", _RUN_ALL, *map(str, paths)], cwd=REPO,
                       env=_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=600)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULTS ")]
    assert line, r.stdout + r.stderr
    return json.loads(line[0][len("RESULTS "):])


@pytest.mark.long
def test_every_example_runs_without_a_gpu():
    """The teaching examples run to the end on the CPU plan interpreter, each checking
    its results against jax.jit (an assert in the example)."""
    names = {p.name for p in EXAMPLES}
    assert {"basics.py", "grad.py", "train_step.py", "flax_model.py"} <= names, names
    results = _run_all(EXAMPLES)
    for path in EXAMPLES:
        assert results[str(path)] == [0, "ran to the end"], (path.name, results[str(path)])


def test_every_gpu_example_says_it_needs_a_gpu():
    """Each GPU tool, run with no GPU visible, stops with one message naming itself, why
    (no GPU is visible, not a CUDA error code) and what to do instead: benchmark_runtime.py
    as its own process (exit status 1, no traceback), every tool's __main__ in one process."""
    assert len(GPU_EXAMPLES) >= 8
    one = subprocess.run([sys.executable, "examples/gpu/benchmark_runtime.py"], cwd=REPO,
                         env=_env(PYTHONPATH=str(REPO)), capture_output=True, text=True,
                         timeout=120)
    assert one.returncode == 1, one.stdout + one.stderr
    assert one.stderr.startswith("examples/gpu/benchmark_runtime.py needs an NVIDIA GPU"), one.stderr
    assert "no GPU is visible" in one.stderr and "cudaError" not in one.stderr, one.stderr
    assert "backend='interpret'" in one.stderr and "Traceback" not in one.stderr
    results = _run_all(GPU_EXAMPLES)
    for path in GPU_EXAMPLES:
        status, message = results[str(path)]
        name = f"examples/gpu/{path.name}"
        assert status == 1, (name, message)
        assert message.startswith(f"{name} needs an NVIDIA GPU"), (name, message)


def test_examples_need_no_sys_path_lines():
    for path in EXAMPLES + GPU_EXAMPLES:
        assert "sys.path" not in path.read_text(), path


def test_examples_readme_lists_every_example():
    text = (REPO / "examples" / "README.md").read_text()
    for path in EXAMPLES + GPU_EXAMPLES:
        assert f"({path.relative_to(REPO / 'examples').as_posix()})" in text, path.name


def test_no_gpu_reasons_say_what_they_mean(monkeypatch):
    from nimblejax.bench import needs_gpu

    monkeypatch.setattr(needs_gpu, "_driver_loadable", lambda: False)
    assert needs_gpu.gpu_problem() == ("no GPU is visible: the NVIDIA driver (libcuda.so.1) "
                                       "is not installed here")
    reason = needs_gpu.runtime_reason("CUDARuntimeError: cudaErrorNoDevice: no CUDA-capable device")
    assert reason.startswith("no GPU is visible") and "CUDA_VISIBLE_DEVICES" in reason
    reason = needs_gpu.runtime_reason("CUDARuntimeError: cudaErrorInsufficientDriver: ...")
    assert "driver is too old" in reason and "cudaError" not in reason
    assert needs_gpu.runtime_reason("CUDARuntimeError: cudaErrorUnknown") == \
        "CUDARuntimeError: cudaErrorUnknown"


def test_require_gpu_passes_where_a_gpu_is_usable(monkeypatch):
    from nimblejax.bench import needs_gpu

    monkeypatch.setattr(needs_gpu, "gpu_problem", lambda: None)
    needs_gpu.require_gpu("examples/x.py")  # returns: nothing to say
    monkeypatch.setattr(needs_gpu, "gpu_problem", lambda: "CUDARuntimeError: cudaErrorLaunchFailure")
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as e:
        needs_gpu.require_gpu(str(REPO / "examples" / "gpu" / "x.py"))
    assert str(e.value).startswith("examples/gpu/x.py needs an NVIDIA GPU")  # as typed from the root
    assert "cudaErrorLaunchFailure" in str(e.value)  # an unknown failure is quoted
    monkeypatch.chdir(REPO / "tests")  # outside the folder: its last two parts
    with pytest.raises(SystemExit) as e:
        needs_gpu.require_gpu(str(REPO / "examples" / "gpu" / "x.py"))
    assert str(e.value).startswith("gpu/x.py needs an NVIDIA GPU")


# ---- the README's quickstart from the folder that holds an editable clone ---------------

def _quickstart() -> str:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block, "README.md has no python block"
    return block.group(1)


def _venv_usable() -> bool:
    try:
        import ensurepip  # noqa: F401
        import venv  # noqa: F401
    except ImportError:
        return False
    return True


def _parent_site_packages() -> list[str]:
    """This interpreter's package folders (jax, numpy, ...), not the repository itself."""
    return [p for p in sys.path if p and os.path.isdir(p) and Path(p).resolve() != REPO
            and Path(p).name in ("site-packages", "dist-packages")]


_OFFLINE = ("Could not find a version", "No matching distribution", "NewConnectionError",
            "Temporary failure in name resolution", "Network is unreachable", "ConnectTimeout",
            "ReadTimeout", "ProxyError", "Max retries exceeded")


def _pip_install_editable(py: Path, clone: Path) -> None:
    """`pip install --no-deps -e clone` into the venv of `py`: with the build tools of this
    environment where they are complete, else with pip's build isolation (which fetches
    setuptools: skipped where there is no network)."""
    have = subprocess.run([str(py), "-c", "import setuptools, sys; v = tuple(int(x) for x in "
                           "setuptools.__version__.split('.')[:2]); import importlib.util as u; "
                           "sys.exit(0 if v >= (70, 1) or (v >= (64, 0) and u.find_spec('wheel')) "
                           "else 1)"], env=_env(), capture_output=True, timeout=60)
    flags = ["--no-build-isolation"] if have.returncode == 0 else []
    cmd = [str(py), "-m", "pip", "install", "-q", "--no-deps", *flags, "-e", str(clone)]
    try:
        r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip("pip install -e timed out (no network for build isolation?)")
    if r.returncode != 0:
        if not flags and any(s in r.stdout + r.stderr for s in _OFFLINE):
            pytest.skip("pip needs the network to fetch setuptools for build isolation here")
        pytest.fail(f"pip install -e failed:\n{r.stdout}\n{r.stderr}")


@pytest.mark.long
def test_readme_quickstart_from_the_folder_holding_an_editable_clone(tmp_path):
    """git clone …/nimblejax; pip install -e nimblejax; then the quickstart from the
    clone's parent folder, where the clone (named nimblejax/, without __init__.py) must
    not shadow the installed package as an empty namespace package."""
    if not _venv_usable():
        pytest.skip("venv/ensurepip are not available in this Python")
    parent = tmp_path / "work"
    clone = parent / "nimblejax"
    clone.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, clone / name)
    shutil.copytree(REPO / "nimblejax", clone / "nimblejax",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env_dir = tmp_path / "venv"
    # Without a pip of its own (ensurepip installing one was 5.6 s of CPU, the venv
    # 0.1 s): the pip of this environment, on the venv's path below, installs into it.
    r = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                        str(env_dir)], env=_env(), capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.skip(f"cannot make a venv here: {r.stderr.strip()[-300:]}")
    py = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             env=_env(), capture_output=True, text=True, timeout=60).stdout.strip()
    # jax, numpy and the rest come from this environment (plain path entries: its own
    # .pth files, e.g. another editable nimblejax, are not run).
    Path(purelib, "zz_test_parent_env.pth").write_text("\n".join(_parent_site_packages()) + "\n")
    if subprocess.run([str(py), "-m", "pip", "--version"], env=_env(), capture_output=True,
                      timeout=60).returncode != 0:  # no pip in this environment's folders
        subprocess.run([str(py), "-m", "ensurepip", "-q"], env=_env(), capture_output=True,
                       timeout=120, check=True)
    _pip_install_editable(py, clone)
    script = parent / "quickstart.py"
    code = _quickstart()
    script.write_text(code + "\nimport nimblejax as _n\nprint('NIMBLEJAX_FILE', _n.__file__)\n")
    r = subprocess.run([str(py), script.name], cwd=parent, env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"NIMBLEJAX_FILE {clone / 'nimblejax' / '__init__.py'}" in r.stdout, r.stdout
    assert "nimblejax plan:" in r.stdout  # nimble.explain's report
    # The parallelism the project is about: independent branches on several streams.
    streams, events = map(int, re.search(r"totals: \d+ tasks, (\d+) streams, (\d+) events",
                                         r.stdout).groups())
    assert streams >= 2 and events >= 1, r.stdout
    assert f"{streams} streams, {events} events" in r.stdout  # the Report's attributes
    lines = r.stdout.splitlines()
    diff = float(lines[lines.index(next(x for x in lines if x.startswith("NIMBLEJAX_FILE"))) - 1])
    assert diff < 1e-4, lines  # the interpreted plan against jax.jit
    # No GPU here: jax.jit ran it, and the warning names the quickstart's own line.
    call = next(i for i, line in enumerate(code.splitlines(), 1) if "= fast(" in line)
    assert "no CUDA GPU is visible" in r.stderr
    assert f"quickstart.py:{call}: UserWarning" in r.stderr, r.stderr


# ---- the README's other blocks: every command and link points at something real ---------

def _bash_blocks(path: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)


@pytest.mark.parametrize("doc", ["README.md", "examples/README.md", "BENCHMARKS_HOWTO.md"])
def test_documented_commands_and_links_exist(doc):
    """`python -m X` names a module of this checkout, `python path.py` and `bash path` a
    file, and every relative link a file: the moved examples keep their documentation."""
    import importlib.util

    path = REPO / doc
    commands = "\n".join(_bash_blocks(path)) + "\n" + path.read_text()
    for module in set(re.findall(r"python3? -m ([\w.]+)", commands)):
        if module not in ("pip", "pytest", "venv"):
            assert importlib.util.find_spec(module), f"{doc}: python -m {module}"
    for script in set(re.findall(r"(?:python3?|bash) ((?:examples|\.ci)/[\w/.-]+)", commands)):
        assert (REPO / script).is_file(), f"{doc}: {script}"
    for link in set(re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text())):
        assert (path.parent / link).exists(), f"{doc}: link {link}"


@pytest.mark.long
def test_the_transformer_benchmark_runs_its_rows_on_the_cpu():
    """examples/gpu/benchmark_transformers.py on the CPU interpreter at its tiny sizes: a
    row per program, nimble's values those of jax.jit."""
    done = subprocess.run([sys.executable, "examples/gpu/benchmark_transformers.py", "--tiny",
                           "--backend", "interpret", "--batch", "1", "--only", "causal self"],
                          cwd=REPO, env=_env(PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| causal")]
    assert [r[0] for r in rows] == ["| causal self-attention block"], done.stdout
    assert float(rows[0][-1].rstrip(" |")) < 1e-4, done.stdout
