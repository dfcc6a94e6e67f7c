"""The run without a GPU: nimble's plan of each model from abstract arguments (nothing
is materialized, nothing runs), one row per model and batch with what the plan decided."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Optional

import jax
import numpy as np

from nimblejax.bench.progress import Progress, prior_s
from nimblejax.bench.results import draw_timeline, failure, run_meta, timeline_path
from nimblejax.compiler.kinds import TaskKind


def abstract_model(spec, batch: int, dtype, tiny: bool) -> tuple:
    """(fn, args as jax.ShapeDtypeStruct) without materializing weights."""
    if spec.abstract is not None:
        return spec.abstract(batch, dtype, tiny=tiny)
    fn, args = spec.build(batch, dtype, np.random.default_rng(0), tiny=tiny)
    return fn, jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)


def plan_row(spec, batch: int, dtype, tiny: bool, max_streams: Optional[int] = None,
             keep_plan: Optional[list] = None) -> dict:
    import nimblejax as nimble

    row: dict[str, Any] = {"model": spec.name, "batch": batch, "config": "plan", "status": "ok"}
    t0 = time.perf_counter()
    try:
        fn, args = abstract_model(spec, batch, dtype, tiny)
        row["params"] = int(sum(np.prod(a.shape, dtype=np.int64)
                                for a in jax.tree_util.tree_leaves(args[0]))) if len(args) > 1 else None
        f = nimble.jit(fn, backend="interpret", max_streams=max_streams)
        plan = f.plan(*args)
        row.update(plan_stats(plan))
        row["note"] = plan_notes(plan, f.options, batch)
        if keep_plan is not None:
            keep_plan.append(plan)
    except Exception as e:  # noqa: BLE001 - a row per model, whatever happens
        row["status"], row["error"] = failure(e)
    row["plan_s"] = time.perf_counter() - t0
    return row


def plan_stats(plan) -> dict:
    from nimblejax.bench.timeline import predict

    predicted = predict(plan)  # the cost model: a GPU run prints it beside the measured time
    kinds = [t.kind for t in plan.tasks]
    counts = {k: kinds.count(k) for k in sorted(set(kinds))}
    return {"tasks": len(kinds), "kernels": kinds.count("kernel"), "gemms": kinds.count("gemm"),
            "task_kinds": counts,
            "streams": int(plan.schedule.num_streams), "events": int(plan.num_events),
            "arena_bytes": int(plan.memory.arena_bytes),
            "arena_input_bytes": int(sum(v.nbytes for v in plan.graph.inputs if v in plan.memory.offsets)),
            "memory": plan.memory.describe(),
            "predicted_us": predicted.us, "predicted_gain": predicted.gain}


# Said of every batch ≥ 8 row of a CNN on a machine without cuDNN: the plan-only table
# marks it with a star and says it once below (report.plan_legend).
NO_CUDNN = " (no cuDNN found here: with it, the im2col ones go to cuDNN at this batch)"


def plan_notes(plan, options, batch: Optional[int] = None) -> str:
    """The plan's notable decisions in a few words: how parallel it is, the path of its
    convolutions, and the control flow it flattened. `options`: the plan's (its
    convolutions' path is canonicalize/conv_path.py's `use_cudnn`, at `batch` when known)."""
    from nimblejax.bench.profile import task_family
    from nimblejax.compiler.canonicalize.conv_path import use_cudnn

    tasks = len(plan.tasks)
    cp = plan.critical_path
    parts = [f"critical path {cp} of {tasks} tasks" if cp < tasks else
             f"a chain: each of the {tasks} tasks needs the one before"]
    families = [task_family(t).split("_")[0] for t in plan.tasks]
    im2col = families.count("im2col")
    convs = [(im2col, "im2col+GEMM"), (families.count("conv"), "direct"),
             (sum(t.kind is TaskKind.CUDNN for t in plan.tasks), "cuDNN")]
    conv_text = ", ".join(f"{n} {path}" for n, path in convs if n)
    if conv_text:
        # Not found here, and the one decision would take cuDNN at this batch if it were.
        if (im2col and batch is not None and options.conv == "auto" and not options.cudnn
                and use_cudnn(options.replace(cudnn=True), batch)):
            conv_text += NO_CUDNN
        parts.append(f"convs: {conv_text}")
    if plan.control:
        parts.append(f"{len(plan.control)} loops/conds flattened")
    return "; ".join(parts)


def run_plans(opts: argparse.Namespace, out=None) -> dict:
    from nimblejax.bench import report
    from nimblejax.bench.models import MODELS

    out = out if out is not None else sys.stdout
    units = [(m, b) for m in opts.model_names for b in opts.batches]
    progress = Progress(units, lambda u: prior_s(u[0], u[1], opts, "plan"))
    printer = report.RowPrinter(report.PLAN_COLUMNS, out, before=progress.clear)
    rows = []
    for name, batch in units:
        progress.step(f"planning {name} batch {batch}")
        plans: list = []
        row = plan_row(MODELS[name], batch, opts.dtype, opts.tiny, keep_plan=plans)
        rows.append(row)
        printer.row(dict(row, note=row.get("note", "").replace(NO_CUDNN, " *")))
        if opts.timeline and plans:
            path = timeline_path(opts.timeline, name, batch, opts)
            printer.say(draw_timeline(plans[0], path, f"{name} batch {batch}"))
        progress.finish((name, batch))
    progress.close()
    for line in report.plan_legend(rows, NO_CUDNN, timeline=bool(opts.timeline)):
        printer.say(line)
    return {"meta": run_meta(opts, "plan", None), "rows": rows}

