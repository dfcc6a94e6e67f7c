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
from typing import Any, Callable, Iterable, Optional

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


def _ms(us: Optional[float]) -> Optional[float]:
    return None if us is None else us / 1e3


def _speedup(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _note(row: dict) -> str:
    status = row.get("status", "ok")
    if status == "ok":
        return row.get("note") or ""
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


# ---- rows as they come: plain text, one line each, flushed ----------------------------------

def say(line: str, out=None) -> None:
    """One line on stdout (or `out`), flushed: logs and pipes see it at once."""
    import sys

    out = out if out is not None else sys.stdout
    out.write(line + "\n")
    out.flush()


def _cell(fmt: str) -> Callable[[dict, str], str]:
    return lambda r, field: _num(r.get(field), fmt)


# (title, JSON field, width, formatter)
_MODEL = [("model", "model", 15, lambda r, f: str(r.get(f))),
          ("batch", "batch", 5, lambda r, f: str(r.get(f)))]
_PLAN_STATS = [("tasks (kern+gemm)", "tasks", 17, lambda r, f: _tasks(r)),
               ("streams", "streams", 7, _cell("d")), ("events", "events", 6, _cell("d")),
               ("arena MB (inputs)", "arena_bytes", 17, lambda r, f: _arena(r))]
PLAN_COLUMNS = _MODEL + [
    ("params M", "params", 8, lambda r, f: "-" if r.get(f) is None else f"{r[f] / 1e6:.2f}"),
    ("tasks", "tasks", 5, _cell("d")), ("kernels", "kernels", 7, _cell("d")),
    ("gemms", "gemms", 5, _cell("d")), ("streams", "streams", 7, _cell("d")),
    ("events", "events", 6, _cell("d")),
    ("arena MB (inputs)", "arena_bytes", 17, lambda r, f: _arena(r)),
    ("predicted ms", "predicted_us", 12, lambda r, f: _num(_ms(r.get(f)), ".3f")),
    ("streams gain", "predicted_gain", 12, lambda r, f: _speedup(r.get(f))),
    ("plan s", "plan_s", 6, _cell(".2f")), ("note", "note", 0, lambda r, f: _note(r))]


# What the plan-only table's columns mean, said once under it (the header is terse).
_PLAN_LEGEND = [
    ("params M", "the model's parameters, in millions"),
    ("tasks", "launches in one call: generated CUDA kernels + GEMMs (cuBLASLt) + other "
              "library calls (cuDNN)"),
    ("streams, events", "the CUDA streams the tasks are spread over, and the events that "
                        "order tasks across streams"),
    ("arena MB (inputs)", "the plan's one device allocation; in brackets, the part that "
                          "holds the arguments (parameters included)"),
    ("predicted ms", "the GPU time of one call the plan's streams should give, from a cost "
                     "model (bench/timeline.py: bytes at 2 TB/s, GEMM flops, 2 µs a launch); "
                     "a GPU run prints it beside the measured time"),
    ("streams gain", "that prediction for the tasks on one stream, over the prediction on the "
                     "plan's streams"),
    ("plan s", "seconds to trace and plan the model here; on a GPU the first call also "
               "compiles the kernels and captures the graph"),
    ("note", "critical path: the longest chain of tasks that wait for each other; the "
             "shorter against all tasks, the more of them can run side by side"),
]


def plan_legend(rows: list[dict], no_cudnn: str = "", timeline: bool = False) -> list[str]:
    """Lines under the plan-only table: the columns, then what to try next."""
    legend = list(_PLAN_LEGEND)
    if no_cudnn and any(no_cudnn in (r.get("note") or "") for r in rows):
        legend.append(("*", no_cudnn.strip(" ()")))
    width = max(len(name) for name, _ in legend)
    lines = ["", "Columns (plans only, nothing ran):"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in legend]
    lines += ["", "Next:",
              "  nimble.explain(f, *args)   the same for your own function, task by task",
              "  python examples/basics.py  (in the repository) a plan run on the CPU with "
              "backend='interpret', checked against jax.jit"]
    if not timeline:
        lines.append("  python -m nimblejax.bench --models nasnet_mobile --batch 1 --timeline "
                     "plan.png   a plan's streams over time, estimated without a GPU (needs "
                     "matplotlib)")
    lines.append("  on a machine with an NVIDIA GPU, this command times nimble against jax.jit "
                 "(BENCHMARKS_HOWTO.md)")
    return lines


def gpu_columns(full: bool) -> list:
    """The timing table's columns: looped time first."""
    speed = lambda r, f: _speedup(r.get(f))  # noqa: E731
    cols = _MODEL + [("config", "config", 19, lambda r, f: str(r.get(f))),
                     ("looped ms", "looped_ms", 9, _cell(".3f"))]
    if full:
        cols.append(("e2e ms", "e2e_ms", 8, _cell(".3f")))
    cols += [("GPU ms", "gpu_ms", 8, _cell(".3f")),
             ("predicted ms", "predicted_us", 12, lambda r, f: _num(_ms(r.get(f)), ".3f")),
             ("speedup looped", "speedup_looped", 14, speed)]
    if full:
        cols.append(("speedup e2e", "speedup_e2e", 11, speed))
    cols.append(("speedup GPU", "speedup_gpu", 11, speed))
    cols += _PLAN_STATS + [("XLA temp MB", "xla_temp_bytes", 11, lambda r, f: _mb(r.get(f)))]
    if full:
        cols += [("compile cold s", "compile_cold_s", 14, _cell(".2f")),
                 ("compile warm s", "compile_warm_s", 14, _cell(".2f"))]
    else:
        cols.append(("first call s", "first_call_s", 12, _cell(".2f")))
    cols += [("max rel err", "max_rel_err", 11, _cell(".1e")),
             ("note", "note", 0, lambda r, f: _note(r))]
    return cols


class RowPrinter:
    """A table printed one row at a time (fixed-width columns), each line flushed as soon
    as it is written, so a log or `| tee` shows every row when it is measured."""

    LEFT = ("model", "config", "note")

    def __init__(self, columns: list, out=None, before: Callable[[], None] = lambda: None) -> None:
        import sys

        self.columns = columns
        self.out = out if out is not None else sys.stdout
        self.before = before  # e.g. take a progress line off the terminal first
        self._header = False

    def _line(self, cells: list[str]) -> str:
        parts = []
        for (title, _, width, _), text in zip(self.columns, cells):
            parts.append(text.ljust(width) if title in self.LEFT else text.rjust(width))
        return "  ".join(parts).rstrip()

    def say(self, line: str) -> None:
        self.before()
        say(line, self.out)

    def title(self, text: str) -> None:
        self.say(text)

    def header(self) -> None:
        titles = [c[0] for c in self.columns]
        self.say(self._line(titles))
        self.say(self._line(["-" * max(len(t), c[2]) for t, c in zip(titles, self.columns)]))
        self._header = True

    def row(self, r: dict) -> None:
        if not self._header:
            self.header()
        self.say(self._line([fmt(r, field) for _, field, _, fmt in self.columns]))


def geomean_lines(summary: list[dict]) -> list[str]:
    """'geomean speedup of <config> over the best jax.jit, batch B: looped …, GPU …'."""
    lines = []
    for g in summary:
        parts = [f"{name} {g[key]:.2f}x ({g[key + '_models']} models)"
                 for key, name in (("looped", "looped"), ("e2e", "e2e"), ("gpu", "GPU time"))
                 if key in g]
        lines.append(f"geomean speedup of {g['config']} over jax.jit, batch {g['batch']}: "
                     + ", ".join(parts))
    return lines


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


def speedup_series(rows: Iterable[dict], field: str = "speedup_looped"
                   ) -> tuple[list[str], dict[str, list[Optional[float]]]]:
    """(group labels "model b<batch>", config → speedups in group order) for the chart."""
    groups: list[tuple] = []
    values: dict[str, dict[tuple, float]] = {}
    for r in rows:
        s = r.get(field)
        if s is None or r.get("status", "ok") != "ok":
            continue
        key = (r["model"], r["batch"])
        if key not in groups:
            groups.append(key)
        values.setdefault(r["config"], {})[key] = float(s)
    labels = [f"{m} b{b}" for m, b in groups]
    series = {c: [v.get(g) for g in groups] for c, v in values.items()}
    jax_configs = [c for c in series if c.startswith("jax.jit")]
    if len(jax_configs) == 1 and len(series) > 1:  # the one jax.jit is the 1.0 line itself
        del series[jax_configs[0]]
    return labels, series


PLOTTED = (("speedup_looped", "looped (a fresh input each call, one block at the end)"),
           ("speedup_gpu", "GPU time"))


def plot_speedups(results: dict, path: str) -> Optional[str]:
    """Bar charts of the looped and the GPU-time speedups over the best jax.jit
    configuration, per model and batch, one panel each. Returns None when written, else
    one line saying why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    rows = results.get("rows", [])
    panels = [(field, title, *speedup_series(rows, field)) for field, title in PLOTTED]
    panels = [p for p in panels if p[2]]
    if not panels:
        return "no timings to plot (nothing ran on a GPU)"
    width_groups = max(len(p[2]) for p in panels)
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(max(7.0, 1.2 * width_groups + 4), 4.0 * len(panels)))
    for ax, (field, title, labels, series) in zip(axes[:, 0], panels):
        n = len(series)
        width = 0.8 / max(n, 1)
        for i, (config, vals) in enumerate(series.items()):
            xs = [g + (i - (n - 1) / 2) * width for g in range(len(labels))]
            ax.bar(xs, [v if v is not None else 0.0 for v in vals], width, label=config)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right")
        ax.set_ylabel("speedup over jax.jit")
        ax.set_title(title, fontsize="medium")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    gpu = results.get("meta", {}).get("gpu")
    fig.suptitle(f"nimble.jit vs jax.jit{' on ' + gpu if gpu else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
