"""What a run records besides its measurements, shared by the plan-only run (plans.py)
and the timed run (measure.py): the run's metadata and the GPU's name, a failure as a row's status, the
speedups over jax.jit and their geometric means, and the --timeline files."""
from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any, Optional

import jax
import numpy as np

from nimblejax.bench.configs import CONFIGS, JAX_CONFIGS, LOOPS


def run_meta(opts: argparse.Namespace, mode: str, gpu: Optional[str]) -> dict:
    """What this run did, and nothing it did not: a plan-only run records no timing
    settings."""
    import nimblejax

    from nimblejax import options as options_mod

    o = options_mod.from_env(None)
    meta = {"mode": mode, "gpu": gpu, "jax": jax.__version__, "nimblejax": nimblejax.__version__,
            "commit": source_commit(), "python": platform.python_version(), "models": opts.model_names,
            "batches": opts.batches, "dtype": str(opts.dtype), "tiny": opts.tiny,
            "options": options_mod.changed(o)}
    if mode == "gpu":
        meta.update(run="full" if opts.full else "default",
                    configs=[CONFIGS[k] for k in opts.config_keys],
                    timed=["looped", "e2e", "gpu"] if opts.full else ["looped", "gpu"],
                    loops=LOOPS, cold_caches=opts.cold)
        if opts.repeat is not None:
            meta["repeat"] = opts.repeat
        else:
            meta["budget_s"] = opts.budget
    else:
        meta["plan_options"] = {"gemm": o.gemm, "conv": o.conv, "cudnn": o.cudnn,
                                "max_streams": o.max_streams}
    meta["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return meta


def source_commit() -> Optional[str]:
    """The git commit of the nimblejax source that runs (its checkout's HEAD, with a '+'
    where tracked files differ from it), or None outside a git checkout."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def failure(e: BaseException) -> tuple[str, str]:
    """(status, message) of an exception: unsupported primitives are not crashes."""
    if isinstance(e, NotImplementedError):
        return "unsupported", first_line(e)
    return "error", f"{type(e).__name__}: {first_line(e)}"


def timeline_path(path: str, model: str, batch: int, opts: argparse.Namespace) -> str:
    """--timeline's file for one model and batch: the path itself when the run has one
    model and one batch, else <stem>_<model>_b<batch><suffix>."""
    if len(opts.model_names) == 1 and len(opts.batches) == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}_{model}_b{batch}{ext or '.png'}"


def draw_timeline(plan, path: str, title: str, task_us: Optional[list] = None) -> str:
    """Draw one timeline; the line to print (written, or why not)."""
    from nimblejax.bench import timeline

    try:
        timeline.draw_timeline(plan, path, task_us=task_us, title=title)
    except ImportError as e:
        return f"no timeline: {e}"
    return f"wrote {path}"


def add_speedups(rows: list[dict]) -> None:
    """speedup_e2e / speedup_looped / speedup_gpu: the best (lowest) time of the jax.jit configurations
    that ran, divided by the row's time."""
    jax_rows = [r for r in rows if r.get("config") in (CONFIGS[k] for k in JAX_CONFIGS)
                and r.get("status") == "ok"]
    for field, out in (("e2e_ms", "speedup_e2e"), ("looped_ms", "speedup_looped"),
                       ("gpu_ms", "speedup_gpu")):
        times = [r[field] for r in jax_rows if r.get(field)]
        best = min(times) if times else None
        for r in rows:
            t = r.get(field)
            r[out] = best / t if best and t and r.get("status") == "ok" else None



def geomeans(rows: list[dict]) -> list[dict]:
    """Per nimble configuration and batch: the geometric means of the looped, GPU-time
    (and, where measured, end-to-end) speedups over the rows that have them."""
    out = []
    configs = list(dict.fromkeys(r["config"] for r in rows
                                 if r.get("config") not in (CONFIGS[k] for k in JAX_CONFIGS)))
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    for config in configs:
        for batch in batches:
            mine = [r for r in rows if r["config"] == config and r["batch"] == batch
                    and r.get("status") == "ok"]
            entry: dict[str, Any] = {"config": config, "batch": batch}
            for field, name in (("speedup_looped", "looped"), ("speedup_gpu", "gpu"),
                                ("speedup_e2e", "e2e")):
                vals = [r[field] for r in mine if r.get(field)]
                if vals:
                    entry[name] = float(np.exp(np.mean(np.log(vals))))
                    entry[f"{name}_models"] = len(vals)
            if len(entry) > 2:
                out.append(entry)
    return out


def gpu_name() -> str:
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001
        return "GPU"
