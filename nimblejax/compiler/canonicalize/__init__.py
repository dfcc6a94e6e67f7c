"""Canonicalization: the stage between tracing and fusion. It rewrites nodes into the
forms lowering expects, each rewrite registered for its primitives beside it
(registry.py: one table, primitive → rewrite):

- convolutions → im2col + GEMM, a cuDNN call, or kept for the direct kernel (conv_path.py:
  the one place a convolution's path is decided);
- reductions over axes of size 1 → a reshape; long reductions with few outputs → two
  reductions (reductions.py, split.py);
- split → one slice per output (slices.py);
- a transpose that moves only axes of size 1 → a reshape (transposes.py);
- scatter-sub → a negation and a scatter-add (scatter_sub.py);
- the max-pool gradient (select_and_scatter_add) → each window's selection, then a
  gather of the source values (pool_grad.py);
- stack, unstack, tile → reshapes, slices, broadcasts and a concatenate (stacking.py);
- independent dots sharing an operand → one dot and free slices of its result
  (merge_dots.py: a pass over the whole graph, not a rewrite of one node), once the
  rewrites above have made their dots and slices;
- a per-channel scale after a cuBLASLt GEMM (a batch norm after a convolution) →
  the GEMM's weights scaled, so that its epilogue takes the rest (channel_scales.py),
  last, once every dot has its final layout;
- dot_general → operands transposed into a GEMM-ready layout or read in place with
  strides (dot.py), in a second sweep after merge_dots, so that merged dots get their
  layout too and merge_dots sees the dots as the user wrote them; before it, explicit
  transposes feeding a dot are folded into it where the GEMM can read their input in
  place (dot.fold_operand_transposes); then vector products of at most a thousand
  multiply-adds become a multiply and a sum (small_dots.py: a library call costs more);
  a GEMM with few output tiles and a long K whose readers are adds or multiplies
  (through a reshape: a convolution's) becomes partial products over slices of K,
  summed in the kernel that reads it (split_k.py).

(Random-number primitives and PRNG key arrays are expanded earlier, while tracing:
compiler/prng.py.)

Every rewrite emits ordinary JAX primitives (or ours with JAX reference semantics), so
the CPU interpreter runs a canonicalized graph like any other. Values a rewrite makes
that nothing reads (the unused outputs of an unstack or a split) are dropped at the end.
"""
from __future__ import annotations

# Each rewrite module registers its rewrites on import.
from nimblejax.compiler.canonicalize import (conv_path, dot, pool_grad, reductions,  # noqa: F401
                                             scatter_sub, slices, stacking, transposes)
from nimblejax.compiler.canonicalize.channel_scales import fold_channel_scales
from nimblejax.compiler.canonicalize.merge_dots import merge_dots
from nimblejax.compiler.canonicalize.registry import REWRITES, sweep
from nimblejax.compiler.canonicalize.small_dots import strength_reduce_small_dots
from nimblejax.compiler.canonicalize.split_k import split_k_dots
from nimblejax.compiler.ir import Graph
from nimblejax.options import Options

# Primitives this stage replaces entirely (they need no lowering rule).
REWRITTEN = frozenset(name for name, rule in REWRITES.items() if rule.replaces)


def canonicalize(graph: Graph, options: Options) -> Graph:
    """The rewrites in two sweeps around merge_dots, then common subexpressions merged
    (a convolution's two gradients each transpose or reshape the same value), then the
    channel scales folded into their GEMMs."""
    first = sweep(graph.nodes, options, after_merge=False)
    merged = merge_dots(Graph(graph.inputs, graph.outputs, tuple(first), graph.consts))
    merged = dot.fold_operand_transposes(merged)
    merged = strength_reduce_small_dots(merged)
    if options.split_k:
        merged = split_k_dots(merged)
    last = sweep(merged.nodes, options, after_merge=True)
    from nimblejax.compiler.trace import common_subexpressions, drop_dead_code

    last = Graph(graph.inputs, graph.outputs, tuple(last), merged.consts)
    return drop_dead_code(fold_channel_scales(drop_dead_code(common_subexpressions(last)), options))
