"""A direct convolution or a pooling and the elementwise kernel after it as one kernel:
the generated convolution kernel (lowering/conv.py, depthwise convolutions) and pooling
kernel (lowering/rules_window.py: an average pool's division by the window's count,
Inception-v3's ten at batch 32 were 342 µs of kernels of their own) compute the
elementwise group that alone reads their result, at the same element, from their
accumulator, as the tensor-core GEMM does (fusion_gemm_post.py: the same rules for the reader, the same
merge). Together with the convolution's fused input producers (its rule's `fuses`), a
MobileNetV2 block's expansion batch norm and relu6, depthwise convolution and second
batch norm and relu6 are one kernel reading the expansion GEMM's product and writing
what the projection GEMM reads: two kernels that each read and wrote an expanded
activation are gone (at batch 32, 17 of each).

A direct-convolution or pooling group (TAKE_POSTS' kernel rules, not updating an operand
in place, writing nothing else) takes its reader when fusion_gemm_post's rules
for the reader hold: the only reader of the convolution's result, which is no graph
output; elementwise, one output of the result's shape (or a reshape of such a value, the
2-D layout the next GEMM reads), reading the result only at the element it writes. Its
dtype may be float32, bfloat16 or float16: the kernel hands the post group its value
rounded to the result's dtype, as it would have been stored and read back
(codegen.post_value), so the merged kernel computes what the two kernels did (in
bfloat16, EfficientNet-B0 at batch 32 had 16 such batch norm and swish kernels of its
own after its depthwise convolutions).
"""
from __future__ import annotations

from nimblejax.compiler.fusion import Group
from nimblejax.compiler.fusion_gemm_post import merge_posts
from nimblejax.compiler.ir import Graph
from nimblejax.compiler.kinds import GroupKind


POST_DTYPES = frozenset({"float32", "bfloat16", "float16"})


def fuse_conv_posts(groups: list[Group], graph: Graph) -> list[Group]:
    """`groups` with each (direct convolution or pooling group, elementwise reader) pair as
    one group."""
    return merge_posts(groups, graph, takes_post, reshaped=True, dtypes_ok=POST_DTYPES)


# Kernel rules whose loop computes one output element per step and can hand it to a
# post group (lowering/conv.py, lowering/rules_window.py).
TAKE_POSTS = frozenset({"conv_general_dilated", "reduce_window_sum", "reduce_window_max",
                        "reduce_window_min"})


def takes_post(g: Group) -> bool:
    return (g.kind is GroupKind.KERNEL and g.root.name in TAKE_POSTS and not g.in_place
            and not g.extra_outputs and g.post is None)
