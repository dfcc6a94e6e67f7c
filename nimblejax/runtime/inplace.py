"""Which operands the XLA call path reads in place, and which results it writes in place.

On the XLA call path a plan's graph was captured over its own arena. By default the
graph's first node copies every operand into its arena slot and its last node every
result out of its arena buffer (the handler sets their copy tables each call), and for
large results that is a copy of all their bytes (a 62.5 MB scatter-add result: 47 µs
on an H100).

A buffer that only generated kernels touch can instead be *re-pointed*: the handler
rewrites the pointer parameter of each kernel node that names it
(`cuGraphExecKernelNodeSetParams`), so the graph reads XLA's operand buffer or writes
XLA's result buffer directly. A call then patches only the nodes whose address changed
since the last call (0.4 µs a node on an H100) and copies nothing.

Library calls (cuBLAS/cuBLASLt GEMMs, cuDNN) cannot be re-pointed this way: their
captured nodes hold the addresses inside an undocumented parameter blob. A buffer one of
them touches keeps its copy. So does:
- a donated operand: XLA writes a result into its buffer, and the graph may write that
  result while another stream still reads the operand;
- a result that shares its buffer with another result, an operand or a constant, and
  an operand a result views;
- a buffer named by many kernel nodes and small enough that one batched copy costs less
  than patching every node each call (`MAX_PATCHED_NODES`, `ALWAYS_BELOW_BYTES`).

This module is the pure decision (no GPU); `xla_op.FfiRunner` finds the kernel nodes
and the handler does the patching.
"""
from __future__ import annotations

from dataclasses import dataclass

from nimblejax.compiler.ir import Var
from nimblejax.compiler.kinds import TaskKind
from nimblejax.compiler.lowering.task import Task
from nimblejax.compiler.plan import Plan

# Patching costs ~0.4 µs of host time per kernel node per changed address; setting the
# graph's copy node costs about as much however many buffers it moves. A buffer read by
# more kernel nodes than this is copied unless it is large.
MAX_PATCHED_NODES = 4
# From this size on the copy's GPU time (about 1 µs per 2 MB) outweighs any patching.
ALWAYS_BELOW_BYTES = 1 << 20


@dataclass(frozen=True)
class Site:
    """Pointer parameter `param` of every kernel launch of `task` names the buffer."""

    task: Task
    param: int


@dataclass(frozen=True)
class InPlace:
    """`inputs`: plan input positions read from XLA's operand buffers; `outputs`: output
    buffers (values, as in `plan.graph.outputs`) written into XLA's result buffers;
    `sites[v]`: the kernel parameters that name v's buffer."""

    inputs: frozenset[int]
    outputs: frozenset[Var]
    sites: dict

    @property
    def empty(self) -> bool:
        return not self.inputs and not self.outputs


NONE = InPlace(frozenset(), frozenset(), {})


def analyze(plan: Plan, donated: frozenset = frozenset()) -> InPlace:
    """The buffers this plan's XLA call path re-points rather than copies."""
    root = lambda v: plan.storage.get(v, v)  # noqa: E731
    sites: dict[Var, list[Site]] = {}
    by_library: set[Var] = set()
    for t in plan.tasks:
        if t.kind is TaskKind.KERNEL:
            for p, v in enumerate(t.kernel.params):
                sites.setdefault(root(v), []).append(Site(t, p))
        else:
            by_library.update(plan.reads[t])
            by_library.update(plan.writes[t])
    written = {b for t in plan.tasks for b in plan.writes[t]}

    def patchable(buf: Var) -> bool:
        if buf in by_library or buf not in sites or buf not in plan.memory.offsets or not buf.nbytes:
            return False
        nodes = sum(len(s.task.kernel.launches) for s in sites[buf])
        return nodes <= MAX_PATCHED_NODES or buf.nbytes >= ALWAYS_BELOW_BYTES

    # An operand whose buffer a result views (a reshape of it returned) is copied in: the
    # result is copied out of that arena slot.
    viewed = {root(a) for a in plan.output_buffers}
    inputs = frozenset(i for i, v in enumerate(plan.graph.inputs)
                       if i not in donated and root(v) == v and v not in written and v not in viewed
                       and patchable(v))
    shared = _shared_roots(plan, root)
    outputs = frozenset(a for a in plan.output_buffers
                        if root(a) not in shared and patchable(root(a)))
    keep = {plan.graph.inputs[i] for i in inputs} | {root(a) for a in outputs}
    return InPlace(inputs, outputs, {b: tuple(s) for b, s in sites.items() if b in keep})


def _shared_roots(plan: Plan, root) -> set:
    """Buffers that hold more than one result, or a result and an operand or constant:
    XLA gives each result a buffer of its own."""
    seen: dict[Var, int] = {}
    for a in plan.output_buffers:
        seen[root(a)] = seen.get(root(a), 0) + 1
    shared = {b for b, n in seen.items() if n > 1}
    shared |= {root(v) for v in plan.graph.inputs} | {root(c) for c in plan.graph.consts}
    return shared
