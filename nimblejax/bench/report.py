"""Tables, JSON and the speedup chart of `python -m nimblejax.bench`.

Everything here works on the plain results dict the CLI builds:

    {"meta": {"mode": "gpu" | "plan", "gpu": str | None, ...},
     "rows": [{"model", "batch", "config", "status", ...}, ...]}

`status` is "ok", "unsupported" (nimble has no lowering for a primitive yet), "error"
(the row's `error` says what failed) or "skipped". See BENCHMARKS_HOWTO.md for the fields.
"""
from __future__ import annotations

import json
import math
from typing import Any, Iterable, Optional

MB = 1024 * 1024


def _num(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt)


def _mb(v: Optional[int]) -> str:
    return "-" if v is None else f"{v / MB:.1f}"


def _arena(row: dict) -> str:
    """Arena MB, with the part that holds the inputs (parameters included) in brackets."""
    if row.get("arena_bytes") is None:
        return "-"
    if row.get("arena_input_bytes") is None:
        return _mb(row["arena_bytes"])
    return f"{_mb(row['arena_bytes'])} ({_mb(row['arena_input_bytes'])})"


def _speedup(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _note(row: dict) -> str:
    status = row.get("status", "ok")
    if status == "ok":
        return ""
    msg = (row.get("error") or "").strip().splitlines()
    return f"{status}: {msg[0]}" if msg else status


def _tasks(row: dict) -> str:
    if row.get("tasks") is None:
        return "-"
    if row.get("kernels") is None or row.get("gemms") is None:
        return str(row["tasks"])
    parts = f"{row['kernels']}+{row['gemms']}"
    for kind, n in sorted((row.get("task_kinds") or {}).items()):
        if kind not in ("kernel", "gemm") and n:
            parts += f"+{n} {kind}"
    return f"{row['tasks']} ({parts})"


_NO_WRAP = ("model", "config", "tasks (kern+gemm)", "arena MB (inputs)")


def _console(console=None):
    from rich.console import Console

    if console is not None:
        return console
    console = Console()
    if not console.is_terminal:  # logs and pipes: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, 200))
    return console


def gpu_table(rows: Iterable[dict], title: Optional[str] = None):
    """The timing table (one row per model × batch × configuration)."""
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for col, justify in (("model", "left"), ("batch", "right"), ("config", "left"),
                         ("looped ms", "right"), ("e2e ms", "right"), ("GPU ms", "right"),
                         ("speedup looped", "right"), ("speedup e2e", "right"),
                         ("speedup GPU", "right"), ("tasks (kern+gemm)", "right"),
                         ("streams", "right"), ("events", "right"), ("arena MB (inputs)", "right"),
                         ("XLA temp MB", "right"), ("compile cold s", "right"),
                         ("compile warm s", "right"), ("max rel err", "right"), ("note", "left")):
        t.add_column(col, justify=justify, overflow="fold", no_wrap=col in _NO_WRAP)
    last = None
    for r in rows:
        key = (r.get("model"), r.get("batch"))
        if last is not None and key != last:
            t.add_section()
        last = key
        t.add_row(str(r.get("model")), str(r.get("batch")), str(r.get("config")),
                  _num(r.get("looped_ms"), ".3f"), _num(r.get("e2e_ms"), ".3f"),
                  _num(r.get("gpu_ms"), ".3f"), _speedup(r.get("speedup_looped")),
                  _speedup(r.get("speedup_e2e")), _speedup(r.get("speedup_gpu")),
                  _tasks(r), _num(r.get("streams"), "d"), _num(r.get("events"), "d"),
                  _arena(r), _mb(r.get("xla_temp_bytes")),
                  _num(r.get("compile_cold_s"), ".2f"), _num(r.get("compile_warm_s"), ".2f"),
                  _num(r.get("max_rel_err"), ".1e"), _note(r))
    return t


def plan_table(rows: Iterable[dict], title: Optional[str] = None):
    """The plan-only table (no GPU): what nimble would launch."""
    from rich.table import Table

    t = Table(title=title)
    for col, justify in (("model", "left"), ("batch", "right"), ("params M", "right"),
                         ("tasks", "right"), ("kernels", "right"), ("gemms", "right"),
                         ("streams", "right"), ("events", "right"), ("arena MB (inputs)", "right"),
                         ("plan s", "right"), ("note", "left")):
        t.add_column(col, justify=justify, overflow="fold", no_wrap=col in _NO_WRAP)
    for r in rows:
        params = r.get("params")
        t.add_row(str(r.get("model")), str(r.get("batch")),
                  "-" if params is None else f"{params / 1e6:.2f}",
                  _num(r.get("tasks"), "d"), _num(r.get("kernels"), "d"), _num(r.get("gemms"), "d"),
                  _num(r.get("streams"), "d"), _num(r.get("events"), "d"),
                  _arena(r), _num(r.get("plan_s"), ".2f"), _note(r))
    return t


def print_results(results: dict, console=None) -> None:
    console = _console(console)
    meta = results.get("meta", {})
    rows = results.get("rows", [])
    if meta.get("mode") == "plan":
        console.print(plan_table(rows, title="nimblejax plans (no GPU: nothing ran)"))
    else:
        title = f"nimble.jit vs jax.jit on {meta.get('gpu') or 'GPU'}"
        console.print(gpu_table(rows, title=title))


def write_json(results: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1, default=_jsonable)
        fh.write("\n")


def _jsonable(v: Any) -> Any:
    try:
        import numpy as np

        if isinstance(v, np.generic):
            return v.item()
    except ImportError:  # pragma: no cover
        pass
    return str(v)


def speedup_series(rows: Iterable[dict]) -> tuple[list[str], dict[str, list[Optional[float]]]]:
    """(group labels "model b<batch>", config → speedups in group order) for the chart."""
    groups: list[tuple] = []
    values: dict[str, dict[tuple, float]] = {}
    for r in rows:
        s = r.get("speedup_e2e")
        if s is None or r.get("status", "ok") != "ok":
            continue
        key = (r["model"], r["batch"])
        if key not in groups:
            groups.append(key)
        values.setdefault(r["config"], {})[key] = float(s)
    labels = [f"{m} b{b}" for m, b in groups]
    return labels, {c: [v.get(g) for g in groups] for c, v in values.items()}


def plot_speedups(results: dict, path: str) -> Optional[str]:
    """Bar chart of end-to-end speedups over the best jax.jit configuration, per model
    and batch. Returns None when written, else one line saying why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    labels, series = speedup_series(results.get("rows", []))
    if not labels:
        return "no timings to plot (nothing ran on a GPU)"
    n = len(series)
    width = 0.8 / max(n, 1)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(labels) + 4), 4.5))
    for i, (config, vals) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(labels))]
        ax.bar(xs, [v if v is not None else 0.0 for v in vals], width, label=config)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("speedup over best jax.jit (end-to-end)")
    gpu = results.get("meta", {}).get("gpu")
    ax.set_title(f"nimble.jit vs jax.jit{' on ' + gpu if gpu else ''}")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
