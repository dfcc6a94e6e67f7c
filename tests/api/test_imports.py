"""The package's import structure: no module imports another that imports it back
(directly or through others, at the top, inside a function, or under
`if TYPE_CHECKING:`, since a circle of type-only imports is still a circle a reader
must untangle), and every module imports on its own, first, in an interpreter that has
loaded no nimblejax module."""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nimblejax"


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(body: list[ast.stmt]):
    """Every import statement, at any depth (functions, methods, try blocks, and
    `if TYPE_CHECKING:` blocks: type-only imports count)."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(stmt, field, None)
            if isinstance(inner, list):
                yield from _imports(inner)


def import_graph() -> nx.DiGraph:
    """module → the nimblejax modules it imports. `from a.b import c` is an edge to
    a.b.c where that is a module, else to a.b. The implicit import of a module's parent
    packages is not an edge (it is not a dependency of the module on its package)."""
    mods = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(mods)
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for stmt in _imports(ast.parse(path.read_text()).body):
            if isinstance(stmt, ast.Import):
                targets = [a.name for a in stmt.names]
            else:
                base = stmt.module or ""
                if stmt.level:
                    up = package[:len(package) - (stmt.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in stmt.names]
            graph.add_edges_from((name, t) for t in targets if t in mods and t != name)
    return graph


def test_the_import_graph_has_no_cycles():
    graph = import_graph()
    # The graph is the real one: the tracer's, the pipeline's and the loader's edges.
    assert graph.has_edge("nimblejax.compiler.trace", "nimblejax.compiler.control")
    assert graph.has_edge("nimblejax.compiler.pipeline", "nimblejax.compiler.fusion")
    assert graph.has_edge("nimblejax.runtime.libs.loader", "nimblejax.options")
    cycles = sorted(nx.simple_cycles(graph))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles)


def test_the_cycle_check_sees_imports_inside_functions_and_type_only_ones(tmp_path, monkeypatch):
    pkg = tmp_path / "nimblejax"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from nimblejax.sub import b\n")
    (pkg / "sub" / "b.py").write_text(textwrap.dedent("""\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from nimblejax.sub import c
        def f():
            from . import a
        """))
    (pkg / "sub" / "c.py").write_text("import nimblejax.sub.b\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    graph = import_graph()
    assert sorted(graph.edges) == [("nimblejax.sub.a", "nimblejax.sub.b"),
                                   ("nimblejax.sub.b", "nimblejax.sub.a"),
                                   ("nimblejax.sub.b", "nimblejax.sub.c"),
                                   ("nimblejax.sub.c", "nimblejax.sub.b")]


# One interpreter loads the third-party libraries once, then forks one child per
# module: each starts in the state a fresh interpreter would be in just before that
# module's own code runs (a fresh `python -c "import <module>"` each would cost the jax
# import 70 times). Which other modules the package loads (jax's submodules, fractions,
# statistics, ...) a first child finds out, importing every module; the parent loads
# them too, so that each child's time goes to nimblejax's own modules.
# Importing `nimblejax.a.b` runs nimblejax/__init__.py to its end first: a module that
# `import nimblejax` loads is imported by its child exactly as `import nimblejax` is
# (89 of 146 modules), so the one child of "nimblejax", started with no nimblejax module
# loaded, stands for them. Every other module's child starts from the parent after its
# own `import nimblejax`, the state `import nimblejax.a.b` reaches before nimblejax.a
# runs, and checks that it holds exactly the modules `import nimblejax` loads (58
# children each importing nimblejax again: 21 s of the test on 2 busy cores).
_IMPORT_EACH = textwrap.dedent("""\
    import importlib, os, sys, traceback
    import jax, jax.numpy, networkx, numpy  # third-party: shared by every child
    running = {}  # pid -> (module, file for its traceback)
    logs = sys.argv[1]  # the test's tmp_path: pytest removes it

    def ours():
        return {m for m in sys.modules if m.split(".")[0] == "nimblejax"}

    read, write = os.pipe()
    if os.fork() == 0:
        os.close(read)
        try:
            import nimblejax
            by_package = ours()
        except BaseException:
            by_package = set()
        for name in sys.argv[2:]:
            try:
                importlib.import_module(name)
            except BaseException:
                pass  # reported by that module's own child below
        others = [m for m in sys.modules if m.split(".")[0] != "nimblejax"]
        with os.fdopen(write, "w") as out:
            out.write(" ".join(others) + "\\n" + " ".join(by_package))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as found:
        others, by_package = found.read().split("\\n")
    others, by_package = others.split(), set(by_package.split())
    os.wait()
    for name in others:
        try:
            importlib.import_module(name)
        except BaseException:
            pass

    def reap():
        pid, status = os.wait()
        name, log = running.pop(pid)
        if status:
            print(f"--- import {name} failed:\\n{open(log).read()}", flush=True)

    def child(name, loaded):
        if len(running) >= (os.cpu_count() or 1):
            reap()
        log = os.path.join(logs, name)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                assert ours() == loaded, sorted(ours() ^ loaded)
                importlib.import_module(name)
            except BaseException:
                with open(log, "w") as f:
                    f.write(traceback.format_exc()[-3000:])
                code = 1
            os._exit(code)
        running[pid] = (name, log)

    child("nimblejax", set())  # from nothing: it stands for every module in by_package
    if by_package:  # else the child above reports why `import nimblejax` failed
        import nimblejax
        for name in [n for n in sys.argv[2:] if n not in by_package]:
            child(name, by_package)
    while running:
        reap()
    """)


@pytest.mark.long
def test_every_module_imports_on_its_own(tmp_path):
    names = list(modules())
    assert "nimblejax" in names and "nimblejax.compiler.control" in names and "nimblejax.runtime.libs.loader" in names
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, str(tmp_path), *names], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "", done.stdout[-6000:]


def test_public_error_type_is_one_class():
    import nimblejax
    from nimblejax.compiler import errors
    from nimblejax.compiler.lowering import registry

    assert nimblejax.UnsupportedPrimitiveError is errors.UnsupportedPrimitiveError
    assert registry.UnsupportedPrimitiveError is errors.UnsupportedPrimitiveError
