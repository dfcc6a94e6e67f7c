"""What a value costs to recompute, which decides where fusion (fusion.py) writes it.

An elementwise value is recomputed in every kernel that reads it, unless:
- it is large, several kernels read it, and it reads two full-size buffers or computes a
  transcendental function (`worth_writing`): a residual `relu(bn(a) + b)` feeding the
  next block's GEMM and its residual add; EfficientNet's swish after its depthwise
  convolution, read by the squeeze's sum and by the excite multiply (XLA writes both
  once too);
- it computes a transcendental function and is read through a broadcast into a large
  kernel (`read_broadcast`): EfficientNet's excite gate at batch 32, a sigmoid per image
  and channel, would be recomputed once per pixel;
- a kernel rule that reads each element of a fused operand many times (a convolution's
  window: `cheap_fuses`) would recompute more than a few arithmetic instructions
  (`costly_to_fuse`): such a rule then fuses none of that operand's producers.
A node that reads no buffer (`free`: a literal broadcast to a shape) costs nothing and is
recomputed however many kernels read it.
"""
from __future__ import annotations

from nimblejax.compiler.ir import Graph, Node, Var
from nimblejax.compiler.kinds import RuleKind
from nimblejax.compiler.lowering.codegen import INDEX_ONLY
from nimblejax.compiler.lowering.registry import only_cheap_fuses, rule_for

# Below this many elements a kernel costs its launch, not its bytes: recomputing a
# value in several kernels is free there, and one more kernel is not.
RECOMPUTE_ANY_BELOW = 1 << 20
# An elementwise chain inlined deeper than this below its kernel's root is cut (its value
# written): code generation recurses once per inlined node, and an unrolled loop of
# elementwise steps would otherwise become one kernel of thousands of nested values.
MAX_INLINE_DEPTH = 96
# Elementwise functions costing tens of instructions an element (libdevice's exp, the
# division of a sigmoid).
TRANSCENDENTAL = frozenset({"exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "sin", "cos",
                            "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh",
                            "atanh", "erf", "erfc", "erf_inv", "pow", "lgamma", "digamma", "cbrt"})
# What a `cheap_fuses` kernel rule (a convolution, reading each input element once per
# window position) may recompute on every read: a few arithmetic instructions, nothing
# transcendental (a batch norm and relu6, not swish's sigmoid).
CHEAP_PRODUCERS = frozenset({"add", "sub", "mul", "neg", "max", "min", "clamp", "abs", "select_n",
                             "convert_element_type", "broadcast_in_dim", "reshape", "squeeze",
                             "expand_dims", "copy"})
# A value read through a broadcast into at least this many times as many elements.
BROADCAST_READ = 16


def worth_writing(graph: Graph, consumers) -> tuple[set[Node], set[Node]]:
    """(the elementwise nodes cheaper to write once than to recompute in each kernel that
    reads them, the subset of those read through a broadcast, written even where one
    kernel reads them). Written: large, used more than once, and reading more than one
    distinct full-size buffer (broadcast operands are free) with their elementwise
    producers inlined, or computing a TRANSCENDENTAL function of one; or computing one
    and read through a broadcast (read_broadcast)."""
    producer = {v: n for n in graph.nodes for v in n.outputs}
    sources: dict[Node, frozenset] = {}
    costly: set[Node] = set()  # a transcendental function since the last value written
    chosen: set[Node] = set()
    broadcast: set[Node] = set()
    for node in graph.nodes:
        if rule_for(node).kind is not RuleKind.ELEMENTWISE:
            continue
        out = node.outputs[0]
        found: set = set()
        for a in node.inputs:
            if isinstance(a, Var) and a.size >= out.size:
                p = producer.get(a)
                found |= sources[p] if p in sources else {a}
        if node.name in TRANSCENDENTAL or any(producer.get(a) in costly for a in node.inputs
                                              if isinstance(a, Var) and a.size >= out.size):
            costly.add(node)
        if node in costly and read_broadcast(out, consumers):
            broadcast.add(node)
        if node in broadcast or (out.size >= RECOMPUTE_ANY_BELOW and (len(found) > 1 or node in costly)
                                 and len(consumers.get(out, ())) > 1):
            chosen.add(node)
            costly.discard(node)
            found = {out}  # read back by its consumers
        sources[node] = frozenset(found)
    return chosen, broadcast


def read_broadcast(value: Var, consumers) -> bool:
    """Whether an elementwise reader of `value` (through index-only steps) computes
    BROADCAST_READ times as many elements, and a large value (RECOMPUTE_ANY_BELOW, below
    which a kernel costs its launch more than its work)."""
    todo, seen = [value], 0
    while todo and seen < 8:
        v = todo.pop()
        for u in consumers.get(v, ()):
            seen += 1
            if rule_for(u).kind is not RuleKind.ELEMENTWISE or len(u.outputs) != 1:
                continue
            if u.outputs[0].size >= max(BROADCAST_READ * value.size, RECOMPUTE_ANY_BELOW):
                return True
            if u.name in INDEX_ONLY:
                todo.append(u.outputs[0])
    return False


def costly_to_fuse(graph: Graph) -> set[Node]:
    """The `cheap_fuses` kernel nodes (registry.py) whose fused operands have a producer
    that is not cheap among the elementwise nodes before them: they fuse none."""
    producer = {v: n for n in graph.nodes for v in n.outputs}
    costly = set()
    for node in graph.nodes:
        rule = rule_for(node)
        if not only_cheap_fuses(rule, node):
            continue
        stack = [node.inputs[k] for k in rule.fuses]
        seen: set[Node] = set()
        while stack and len(seen) <= MAX_INLINE_DEPTH:
            p = producer.get(stack.pop())
            if p is None or p in seen or rule_for(p).kind is not RuleKind.ELEMENTWISE:
                continue
            if p.name not in CHEAP_PRODUCERS:
                costly.add(node)
                break
            seen.add(p)
            stack.extend(a for a in p.inputs if isinstance(a, Var))
    return costly


def free(node: Node) -> bool:
    """A node that reads no buffer (a literal broadcast to a shape): recomputing it costs
    nothing, in however many kernels. `jax.grad` of a max (relu) selects between full
    arrays of 1.0 and 0.0, one per shape, shared by every layer of that shape: written,
    each was a kernel and a full-size read in each mask (28 kernels, 78M elements in
    ResNet-50's train step at batch 32)."""
    return not any(isinstance(a, Var) for a in node.inputs)
