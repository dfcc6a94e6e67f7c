"""The CPU plan interpreter (`backend="interpret"`).

Runs a plan's tasks in an order the streams and events allow, over a NumPy arena laid
out exactly as the memory plan says, evaluating each task's equations with JAX on the
CPU. A missing event or an unsafe memory reuse shows up as a wrong answer under some
interleaving: the arena starts filled with NaN bytes, and interleavings are random.

The equations run on a CPU client of the interpreter's own (`device()`), never on JAX's
devices: the interpreter runs inside a host callback of a computation that may occupy
every worker thread of JAX's CPU client (one per device of a shard_map over host
devices), and work queued there (an asynchronous execution, or the asynchronous copy of
an operand of more than about 128 KiB) would wait for a thread that never comes free.
"""
from __future__ import annotations

import random
import threading
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from nimblejax.compiler import loops
from nimblejax.compiler.fusion_rows import SAME_INDEX
from nimblejax.compiler.ir import Literal, Var
from nimblejax.compiler.lowering.task import Task
from nimblejax.compiler.pipeline import Plan
from nimblejax.compiler.streams import Schedule
from nimblejax.runtime import interpret_exact, interpret_layout
from nimblejax.runtime.runner import assemble

NAN_BYTE = 0xFF  # 0xFFFFFFFF is a NaN in float32 and -1 in int32


def interleaving(schedule: Schedule, rng: Optional[random.Random]) -> list:
    """A random order of tasks in which each stream runs in order and waits on its events."""
    queues = {s: [t for t in schedule.order if schedule.stream[t] == s]
              for s in range(schedule.num_streams)}
    heads = {s: 0 for s in queues}
    done: set = set()
    order = []
    while len(order) < len(schedule.order):
        ready = [s for s, q in queues.items() if heads[s] < len(q)
                 and all(u in done for u in schedule.waits(q[heads[s]]))]
        if not ready:
            raise RuntimeError("the schedule deadlocks: a stream waits on an event never recorded")
        s = rng.choice(ready) if rng else ready[0]
        task = queues[s][heads[s]]
        heads[s] += 1
        done.add(task)
        order.append(task)
    return order


class Arena:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.bytes = np.full(plan.memory.arena_bytes, NAN_BYTE, dtype=np.uint8)

    def read(self, var: Var) -> np.ndarray:
        off = self.plan.offset(var)
        raw = self.bytes[off: off + var.nbytes]
        return raw.view(var.dtype).reshape(var.shape).copy()

    def write(self, var: Var, value) -> None:
        arr = np.ascontiguousarray(np.asarray(value, dtype=var.dtype).reshape(var.shape))
        off = self.plan.offset(var)
        self.bytes[off: off + var.nbytes] = arr.reshape(-1).view(np.uint8)


_device: Optional[tuple] = None  # (the interpreter's CPU device, whether its client is its own)
_device_lock = threading.Lock()


def device():
    """The CPU device the interpreter evaluates equations on: the one device of a
    synchronous CPU client of its own, made on first use (its executions run on the
    calling thread, its copies on its own threads). JAX's first CPU device if this
    jaxlib cannot make one (`own_device()` is then False)."""
    global _device
    if _device is None:
        with _device_lock:
            if _device is None:
                try:
                    from jax._src.lib import xla_client

                    client = xla_client.make_cpu_client(asynchronous=False, num_devices=1)
                    _device = (client.devices()[0], True)  # the device keeps its client
                except Exception:  # noqa: BLE001 - a jaxlib without it: share JAX's device
                    _device = (jax.devices("cpu")[0], False)
    return _device[0]


def own_device() -> bool:
    """Whether `device()` belongs to a CPU client of the interpreter's own."""
    device()
    return _device[1]


def run(plan: Plan, args: Sequence, seed: Optional[int] = 0) -> list[np.ndarray]:
    """Execute `plan` on flat `args`; `seed=None` runs in launch order."""
    arena = loaded(plan, args)
    rng = random.Random(seed) if seed is not None else None
    with jax.default_device(device()):
        run_tasks(plan, arena, rng)
    return outputs(plan, arena, args)


def loaded(plan: Plan, args: Sequence) -> Arena:
    """A fresh arena (NaN bytes) holding the plan's inputs and constants."""
    arena = Arena(plan)
    for var, arg in zip(plan.graph.inputs, args):
        if var in plan.memory.offsets:
            arena.write(var, np.asarray(arg))
    for var, value in plan.graph.consts.items():
        if var in plan.memory.offsets:
            arena.write(var, value)
    return arena


def run_tasks(plan: Plan, arena: Arena, rng: Optional[random.Random]) -> None:
    """Every task of `plan` once, in an interleaving its streams and events allow."""
    for task in interleaving(plan.schedule, rng):
        execute(task, arena, rng)


def execute(task: Task, arena: Arena, rng: Optional[random.Random] = None) -> None:
    if task.control is not None:  # a WHILE or SWITCH task: its sub-plans (loops.py)
        run_control(task, arena, rng)
        return
    env: dict[Var, object] = {v: arena.read(v) for v in task.inputs}
    for eqn in task.eqns:
        vals = [a.value if isinstance(a, Literal) else env[a] for a in eqn.inputs]
        outs = evaluate(eqn, vals)
        outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outputs, outs))
    for v in task.outputs:
        arena.write(v, np.asarray(env[v]))


# An elementwise equation runs on its operands flattened and padded to a power of two of
# at least this many elements, so that one XLA program serves every shape of a size
# class: JAX compiles each primitive once per shape, and compiling was most of the
# interpreter's time (a train step of Inception-v3: 1254 programs, 42 s of 80 s).
MIN_BUCKET = 256


def evaluate(eqn, vals: list):
    """`eqn`'s results on `vals`: a move of data or an exactly rounded arithmetic
    operation by NumPy (interpret_layout.py, interpret_exact.py), else evaluated with
    JAX on the CPU; an elementwise equation whose operands have its
    output's shape, or are scalars, on flat, padded copies of the former (each element's
    value is computed from the same operands, wherever it sits)."""
    out = eqn.outputs[0] if len(eqn.outputs) == 1 else None
    if out is None:
        return eqn.primitive.bind(*vals, **eqn.params)
    shape = tuple(out.shape)
    moved = interpret_layout.evaluate(eqn.primitive.name, vals, eqn.params)
    if moved is not None and moved.shape == shape and moved.dtype == out.dtype:
        return moved
    exact = interpret_exact.evaluate(eqn.primitive.name, vals, eqn.params, out)
    if exact is not None:
        return exact
    if (eqn.primitive.name not in SAME_INDEX or out.size < 2
            or any(np.shape(v) not in (shape, ()) for v in vals)
            or not any(np.shape(v) == shape for v in vals)):
        return eqn.primitive.bind(*vals, **eqn.params)
    n = out.size
    size = max(MIN_BUCKET, 1 << (n - 1).bit_length())
    flat = [np.pad(np.asarray(v).reshape(-1), (0, size - n)) if np.shape(v) == shape else v for v in vals]
    return np.asarray(eqn.primitive.bind(*flat, **eqn.params))[:n].reshape(shape)


# ---- WHILE and SWITCH tasks (compiler/loops.py) --------------------------------------
def run_control(task: Task, arena: Arena, rng: Optional[random.Random]) -> None:
    """A WHILE task runs its step plan until the step's condition fails, a SWITCH task
    the branch plan its index picks, each in an arena of its own and its own
    interleavings; the results are written where the enclosing plan reads them."""
    node = task.eqns[0]
    operands = loops.node_operands(node, arena.read)
    if isinstance(task.control, loops.LoopCall):
        outs = run_loop(task.control, bool(operands[0]), operands[1:], rng)
    else:
        branches = task.control.branches
        plan = branches[loops.branch_index(operands[0], len(branches))]
        sub = loaded(plan, operands[1:])
        run_tasks(plan, sub, rng)
        outs = outputs(plan, sub, operands[1:])
    for var, value in zip(node.outputs, outs):
        arena.write(var, value)


def run_loop(call: "loops.LoopCall", pred: bool, operands: Sequence,
             rng: Optional[random.Random]) -> list[np.ndarray]:
    """The loop as the GPU runs it: the carry in the step plan's own input slots, each
    next carry copied into its slot, one carry after another, after each step."""
    step = call.step
    arena = loaded(step, operands)
    slots = step.graph.inputs[call.nconsts:]
    while pred:
        run_tasks(step, arena, rng)
        nxt, flag = step.graph.outputs[:-1], step.graph.outputs[-1]
        pred = bool(arena.read(flag))
        for slot, out, passed in zip(slots, nxt, call.passed):
            if not passed:
                arena.write(slot, arena.read(out))
    return [arena.read(slot) for slot in slots]


def outputs(plan: Plan, arena: Arena, args) -> list[np.ndarray]:
    """The plan's flat outputs once its tasks ran on `arena` (`args`: its inputs)."""
    made = [arena.read(a) for a in plan.output_buffers]
    return assemble(plan, made, lambda k: np.asarray(args[k]), np.asarray)
