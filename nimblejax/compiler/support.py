"""Which JAX primitives nimblejax handles, and how: the one table that the audit test
(tests/compiler/test_primitive_audit.py), the README's "not supported" list and the
unsupported-primitive error read.

Every primitive of JAX is in exactly one group:

- lowered: a rule in the lowering registry (compiler/lowering/registry.py);
- rewritten: replaced by other primitives before lowering: canonicalization
  (compiler/canonicalize/), loops and conds flattened (compiler/control.py), random
  numbers expanded into threefry arithmetic (compiler/prng.py), `platform_index`
  resolved to CUDA's branch (compiler/trace.py);
- inlined: call-like primitives whose body is copied into the graph, and identities
  (compiler/trace.py); primitives of other libraries whose `impl` is JAX (equinox's)
  are inlined too (trace.library_impl), but are not JAX's and not in this table;
- not supported: NOT_SUPPORTED (compiler/unsupported.py, re-exported here), each with
  a one-line reason.

NOT_SUPPORTED lists primitives of JAX 0.10.2 (the installed version when it was
written) and those that jax-ml/jax main at cec06d1 (2026-08-08, version 0.11.1.dev)
adds: the audit runs on newer versions too. `python -m nimblejax.compiler.support`
prints the counts of each group for the installed JAX (and any primitive in none);
`--markdown` prints the README's table.
"""
from __future__ import annotations

import importlib
import sys
from collections import Counter

# The table of reasons lives in a module with no imports: the lowering registry reads it
# for its error, and importing this module (which reads every stage) would be a cycle.
from nimblejax.compiler.unsupported import NOT_SUPPORTED, reason  # noqa: F401 (re-exported)

LOWERED, REWRITTEN, INLINED, NOT_SUPPORTED_GROUP = "lowered", "rewritten", "inlined", "not supported"
GROUPS = (LOWERED, REWRITTEN, INLINED, NOT_SUPPORTED_GROUP)


# ---- classification --------------------------------------------------------------
def handled() -> dict[str, frozenset[str]]:
    """The names each group other than "not supported" holds, from the compiler's own
    tables (so a new rule or rewrite moves a primitive without an edit here)."""
    from nimblejax.compiler import control, prng, trace
    from nimblejax.compiler.canonicalize import REWRITTEN as CANONICALIZED
    from nimblejax.compiler.lowering import RULES

    return {
        LOWERED: frozenset(RULES),
        REWRITTEN: frozenset(CANONICALIZED | control.PRIMITIVES | prng.RANDOM_PRIMITIVES
                             | trace.RESOLVED | trace.PLACEHOLDERS),
        INLINED: frozenset(set(trace.INLINED) | trace.IDENTITY | trace.SOLVES),
        NOT_SUPPORTED_GROUP: frozenset(NOT_SUPPORTED),
    }


def groups_of(name: str) -> list[str]:
    """Every group holding `name` (the audit wants exactly one)."""
    return [g for g, names in handled().items() if name in names]


def classify(name: str) -> str | None:
    """The group of `name`, or None when no group holds it."""
    found = groups_of(name)
    return found[0] if found else None


# ---- the primitives of the installed JAX ------------------------------------------
# Imported before the walk: every public module a function may draw primitives from.
# Missing ones (moved or removed in some JAX version) are skipped and reported.
AUDITED_MODULES = (
    "jax", "jax.numpy", "jax.numpy.fft", "jax.numpy.linalg", "jax.scipy.special",
    "jax.scipy.linalg", "jax.scipy.signal", "jax.scipy.stats", "jax.scipy.fft",
    "jax.scipy.ndimage", "jax.scipy.sparse.linalg", "jax.scipy.optimize",
    "jax.scipy.integrate", "jax.scipy.interpolate", "jax.scipy.spatial.transform",
    "jax.random", "jax.nn", "jax.nn.initializers", "jax.lax", "jax.lax.linalg", "jax.image",
    "jax.ops", "jax.ad_checkpoint", "jax.custom_derivatives", "jax.custom_batching",
    "jax.debug", "jax.ffi", "jax.extend", "jax.export", "jax.sharding",
    "jax.experimental", "jax.experimental.checkify", "jax.experimental.sparse",
    "jax.experimental.custom_partitioning", "jax.experimental.compute_on",
    "jax.experimental.multihost_utils", "jax.experimental.shard_map", "jax.experimental.ode",
    "jax.experimental.jet", "jax.experimental.key_reuse", "jax.experimental.layout",
    "jax.experimental.buffer_callback", "jax.experimental.rnn", "jax.experimental.shard_alike",
    "jax.experimental.xla_metadata", "jax.experimental.fused",
)


def installed_primitives() -> tuple[dict[str, list[str]], list[str]]:
    """({primitive name: modules holding it}, modules that failed to import): every
    `Primitive` that is an attribute of a `jax` module loaded after importing
    AUDITED_MODULES (jax._src's modules included). What is loaded depends on what the
    process imported before, so the audit test calls this in a fresh interpreter."""
    from jax._src import core

    skipped = []
    for module in AUDITED_MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:  # moved or removed in this JAX version
            skipped.append(f"{module} ({type(e).__name__})")
    found: dict[str, set[str]] = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "jax" or module_name.startswith("jax.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, core.Primitive):
                found.setdefault(value.name, set()).add(module_name)
    return {k: sorted(v) for k, v in sorted(found.items())}, skipped


def counts(names) -> Counter:
    """How many of `names` each group holds ("unclassified": none)."""
    return Counter(classify(n) or "unclassified" for n in names)


# ---- README ------------------------------------------------------------------------
def markdown_table() -> str:
    """The README's table of unsupported primitives, one row per reason (README.md must
    contain it verbatim: tests/compiler/test_primitive_audit.py)."""
    by_reason: dict[str, list[str]] = {}
    for name, why in NOT_SUPPORTED.items():
        by_reason.setdefault(why, []).append(name)
    rows = ["| why | primitives |", "|---|---|"]
    for why, names in by_reason.items():
        rows.append(f"| {why} | {', '.join(f'`{n}`' for n in sorted(names))} |")
    return "\n".join(rows) + "\n"


def summary(names) -> str:
    """One line of counts for the installed JAX, as the README cites it."""
    import jax

    c = counts(names)
    parts = [f"{c[g]} {g}" for g in GROUPS]
    if c["unclassified"]:
        parts.append(f"{c['unclassified']} unclassified")
    return f"jax {jax.__version__}: {len(names)} primitives: " + ", ".join(parts)


def main(argv: list[str]) -> int:
    import json

    if "--markdown" in argv:  # README's table
        print(markdown_table(), end="")
        return 0
    names, skipped = installed_primitives()
    if "--json" in argv:  # for tests/compiler/test_primitive_audit.py
        print(json.dumps({"primitives": names, "skipped": skipped}))
        return 0
    print(summary(names))
    for name in sorted(n for n in names if classify(n) is None):
        print(f"  unclassified: {name} ({', '.join(names[name][:2])})")
    if skipped:
        print("modules not importable here: " + ", ".join(skipped))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
