"""Lowering: fusion groups → Tasks (generated CUDA C kernels, cuBLAS GEMMs, views)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from nimblejax.compiler.lowering import (conv, gemm, rules_elementwise, rules_indexing,  # noqa: F401
                                         rules_kernels, rules_linalg, rules_reduce, rules_sort,
                                         rules_special, rules_window)  # (registration)
from nimblejax.compiler.lowering.codegen import elementwise_kernel, reduction_kernel
from nimblejax.compiler.kinds import CONTROL_PRIMITIVES, GroupKind, TaskKind
from nimblejax.compiler.lowering.gemm_gates import gate_code
from nimblejax.compiler.lowering.gemm_post import post_code
from nimblejax.compiler.lowering.gemm_tc import choose_tile, takes_tc, tc_matmul
from nimblejax.compiler.lowering.registry import RULES, rule_for
from nimblejax.compiler.lowering.horizontal import horizontal_kernel
from nimblejax.compiler.lowering.rows import row_kernel
from nimblejax.compiler.lowering.task import ConvCall, GemmCall, Kernel, Task
from nimblejax.compiler.lowering.transpose import transpose_kernel

if TYPE_CHECKING:  # fusion imports lowering rules; avoid the cycle at import time
    from nimblejax.compiler.fusion import Group

__all__ = ["lower_group", "lower", "RULES", "Task", "Kernel", "GemmCall", "ConvCall"]


def lower_group(group: Group, small_gemm: bool = True, tc_gemm: bool = True) -> Task:
    """`small_gemm`: whether small-M float GEMMs become the generated kernel
    (Options.small_gemm; lowering/gemm_small.py). `tc_gemm`: whether library GEMMs that
    the TF32 tensor-core kernel was measured faster on become that kernel
    (Options.tc_gemm; lowering/gemm_tc.py)."""
    root = group.root
    inlined = {n.outputs[0]: n for n in group.nodes if n is not root and n not in group.siblings}
    if root.name in CONTROL_PRIMITIVES:  # a loop or branch kept as one (compiler/loops.py)
        kind = CONTROL_PRIMITIVES[root.name]
        name = f"{kind}_{root.outputs[0].id}" if root.outputs else str(kind)
        return Task(name, kind, group.inputs, group.outputs, group.nodes, control=root.params["call"])
    if group.kind is GroupKind.VIEW:
        return Task(f"view_{root.name}", TaskKind.VIEW, group.inputs, group.outputs, group.nodes)
    if group.kind is GroupKind.FUSED:
        fused = {**inlined, group.output: root}
        # A group that permutes its input's innermost axis: a tiled kernel, coalesced.
        kernel = (elementwise_kernel(group.output, fused, group.extra_outputs) if group.extra_outputs
                  else transpose_kernel(group.output, fused) or elementwise_kernel(group.output, fused))
    elif group.kind is GroupKind.HORIZONTAL:
        kernel = horizontal_kernel(group.members)
    elif group.kind is GroupKind.REDUCTION:
        reducer = rule_for(root).fn(root.inputs[0].dtype)
        kernel = reduction_kernel(root, inlined, reducer.combine, reducer.init, reducer.acc_type,
                                  siblings=group.siblings)
    elif group.kind is GroupKind.ROW:
        kernel = row_kernel(root, group.nodes, group.extra_outputs)
    elif group.kind is GroupKind.CUDNN:
        call = rule_for(root).fn(root)
        if group.epilogue is not None:  # bias, residual and relu: compiler/epilogue.py
            call = group.epilogue.apply_conv(call)
        kind = {"filter_grad": "conv_wgrad", "data_grad": "conv_dgrad"}.get(call.mode, "conv")
        name = f"cudnn_{kind}_{call.x.shape[1]}x{call.x.shape[2]}x{call.x.shape[3]}_k{call.w.shape[1]}"
        name += f"[{call.label}]" if call.label else ""
        return Task(name, TaskKind.CUDNN, group.inputs, group.outputs, group.nodes, conv=call)
    elif group.kind is GroupKind.GEMM:
        made = gemm_of(group, small_gemm)
        if isinstance(made, GemmCall):
            # The call's problem, epilogue and all, as a kernel; with its post group
            # (fusion_gemm_post.py, fusion_gemm_gates.py, which found takes_tc true)
            # computed there too.
            if group.post is not None or (tc_gemm and takes_tc(made)):
                kernel = tc_matmul(made, post=_post_code(group, made))
                return Task(kernel.name, TaskKind.KERNEL, group.inputs, group.outputs, group.nodes,
                            kernel=kernel, gemm=made)
            name = f"gemm_{made.dtype}_{made.batch}x{made.m}x{made.n}x{made.k}"
            name += f"[{made.label}]" if made.label else ""
            return Task(name, TaskKind.GEMM, group.inputs, group.outputs, group.nodes, gemm=made)
        assert group.epilogue is None, "an epilogue on a GEMM lowered to a kernel"
        kernel = made
    else:
        rule = rule_for(root)
        # A kernel rule that fuses some operands' producers computes them itself; a
        # direct convolution also its elementwise reader (fusion_conv_post.py).
        extra = {"in_place": True} if group.in_place else {}
        if group.post is not None:
            extra["post"] = group.post
        kernel = rule.fn(root, inlined, **extra) if rule.fuses else rule.fn(root, **extra)
        if group.in_place:  # the operand is read where the output is written
            operand = root.inputs[rule.in_place]
            inputs = (operand,) + tuple(v for v in kernel.params if v not in group.outputs)
            return Task(kernel.name, TaskKind.KERNEL, inputs, group.outputs, group.nodes,
                        kernel=kernel, aliases=((group.output, operand),))
    return Task(kernel.name, TaskKind.KERNEL, tuple(v for v in kernel.params if v not in group.outputs),
                group.outputs, group.nodes, kernel=kernel)


def _post_code(group: Group, call: GemmCall):
    """The code of a GEMM group's post group, if it has one, in tc_matmul's kernel."""
    if group.post is None:
        return None
    if group.gates:
        return gate_code(group.post, call.c, group.gates, choose_tile(call), call.m)
    return post_code(group.post, call.c)


def gemm_of(group: Group, small_gemm: bool = True) -> GemmCall | Kernel:
    """What a GEMM group's rule makes: the library call with the group's epilogue (fusion
    made one only for library GEMMs), or a generated kernel (integers, gemm_small.py: with
    the group's gate-sliced post group, fusion_gemm_gates.py, where it has one)."""
    made = rule_for(group.root).fn(group.root, small_gemm=small_gemm, post=group.post, gates=group.gates)
    if isinstance(made, GemmCall) and group.epilogue is not None:
        made = group.epilogue.apply(made)
    return made


def lower(groups: list[Group], small_gemm: bool = True, tc_gemm: bool = True) -> list[Task]:
    return [lower_group(g, small_gemm, tc_gemm) for g in groups]
