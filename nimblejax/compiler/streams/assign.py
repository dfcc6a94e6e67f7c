"""Stream assignment for a task DAG, after Nimble (NeurIPS 2020) §4.

Pipeline (all index-based; node i is the i-th node of a topological order):

1. reachability as Python-int bitsets, and the transitive reduction G';
2. a maximum matching M of the bipartite graph {(u_out, v_in) : u->v in G'}.
   Matched pairs share a stream, so the syncs are the |G'| - |M| unmatched
   edges -- the fewest any maximum-concurrency assignment can have;
3. chain merging: grow M into a matching N of the *closure* bipartite graph
   (u may precede v on a stream when u reaches v) by augmenting paths that
   never trade away a G' edge.  Chains of N are chains of the partial
   order: tasks with no path between them never share a stream, and the
   number of streams is the smallest among minimum-sync assignments.

Step 3 is a weighted matching (weight 1 on G' edges, 0 on other closure
edges; maximise weight, then size).  A König vertex cover of M is an optimal
dual, so the augmenting paths that keep the weight are exactly those over
dual-tight edges, and a plain DFS over tight edges finds them (see
``_merge_chains``).

Step 4 keeps both counts and prefers the critical path: a G' edge left to an
event trades places with its ends' matched pairs where that costs neither a
G' pair nor a chain (``_prefer_critical``), the edges on the longest paths
(the task weights given, else one per task) first; only where every chain gets
a stream of its own (packed onto fewer, other chains need other events).
Pairs on one stream are where a kernel may start while the one before it ends
(programmatic dependent launch, runtime/pdl.py); an event between streams
waits for the end.

The stream count usually equals the Dilworth width but cannot always: on
0->5, 1->4, 2->4, 2->8, 3->5, 4->6, 4->7, 5->8, 5->9 (width 4) every
4-stream assignment needs 5 events while 5 streams need only 4.  We keep
Nimble's priority (fewest events) and report ``width`` separately.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import networkx as nx

# Step 4 on (False: the matching of steps 2-3 as found; examples/gpu/probe_variants.py
# compares them on the GPU). It is left out where the chains are packed onto fewer
# streams (`_pack`): there other chains change the events the packing needs (ResNet-50's
# train step at batch 32: 344 → 382 events, the cost model's prediction the same).
PREFER_CRITICAL = True


@dataclass(frozen=True)
class StreamAssignment:
    """Result of :func:`assign_streams`.

    ``order`` is a topological launch order in which each stream's tasks
    appear in stream order; ``syncs`` are the (recorder, waiter) event edges.
    ``width`` is the largest antichain, a lower bound on ``num_streams`` for
    maximum concurrency (reached unless fewer events need another stream).
    """

    stream: dict
    syncs: list
    num_streams: int
    reduced_edges: int
    width: int
    order: tuple


@dataclass(frozen=True)
class _Poset:
    """The DAG re-indexed by topological position, with reachability bitsets."""

    nodes: tuple          # index -> node
    reduced: tuple        # index -> successors in the transitive reduction
    desc: tuple           # index -> bitset of strict descendants
    level: tuple          # index -> longest path (in tasks) ending here, 0-based


def assign_streams(dag: nx.DiGraph, max_streams: int | None = None,
                   weight: Callable[[object], float] | None = None) -> StreamAssignment:
    """Assign every task of ``dag`` to a CUDA stream and list the event syncs.

    With ``max_streams=None`` two tasks with no path between them never
    share a stream and the syncs are the minimum for that.  With
    ``max_streams=k`` the chains are packed onto k streams: the chain with
    most tasks goes to stream 0 (it usually carries the critical path), the
    others, by earliest ASAP start, go to the stream that frees earliest under
    a unit-time list-scheduling estimate.  Each stream then runs its tasks in
    one global topological order, and only syncs not implied by stream order
    and the other syncs are kept. ``weight(node)``: a task's estimated time, for
    which pairs share a stream among equally few syncs and streams (step 4).
    """
    if max_streams is not None and (not isinstance(max_streams, int) or max_streams < 1):
        raise ValueError(f"max_streams must be a positive int or None, got {max_streams!r}")
    poset = _build_poset(dag)
    n = len(poset.nodes)
    mate_l, mate_r = _min_sync_matching(poset)
    chain_count = n - sum(1 for v in mate_l if v >= 0)  # step 4 keeps it
    if PREFER_CRITICAL and (max_streams is None or chain_count <= max_streams):
        _prefer_critical(poset, mate_l, mate_r, weight)
    width = n - _closure_matching_size(poset, list(mate_l), list(mate_r))
    chains = _chains(mate_l, mate_r)
    # By ASAP level: a breadth-first launch order, topological since levels rise along edges.
    order = sorted(range(n), key=lambda i: (poset.level[i], i))
    if max_streams is None or len(chains) <= max_streams:
        stream_of = _stream_per_task(chains, range(len(chains)), n)
        # Proven minimal: a G' edge has no task in between, so nothing else implies it.
        syncs = [(u, v) for u in range(n) for v in poset.reduced[u] if stream_of[u] != stream_of[v]]
    else:
        stream_of = _stream_per_task(chains, _pack(chains, poset.level, max_streams), n)
        syncs = _necessary_syncs(order, stream_of, poset.reduced, max_streams)
    nodes = poset.nodes
    return StreamAssignment(
        stream={nodes[i]: stream_of[i] for i in range(n)},
        syncs=[(nodes[u], nodes[v]) for u, v in syncs],
        num_streams=min(len(chains), max_streams or len(chains)),
        reduced_edges=sum(len(r) for r in poset.reduced),
        width=width,
        order=tuple(nodes[i] for i in order),
    )


def _min_sync_matching(poset: _Poset) -> tuple[list[int], list[int]]:
    """Steps 2-3: (mate_l, mate_r) of the chain matching N."""
    n = len(poset.nodes)
    mate_l = _reduction_matching(poset.reduced, n)
    cover_l, cover_r = _konig_cover(poset.reduced, mate_l, n)
    mate_r = _inverse(mate_l, n)
    _merge_chains(poset, mate_l, mate_r, cover_l, cover_r)
    return mate_l, mate_r


# --- reachability and transitive reduction -------------------------------------------

def _build_poset(dag: nx.DiGraph) -> _Poset:
    if not dag.is_directed():
        raise ValueError("stream assignment needs a directed graph")
    try:
        nodes = tuple(nx.topological_sort(dag))
    except nx.NetworkXUnfeasible as err:
        raise ValueError("task graph has a cycle") from err
    index = {v: i for i, v in enumerate(nodes)}
    succ = [sorted({index[w] for w in dag.successors(v)}) for v in nodes]
    n = len(nodes)
    desc: list[int] = [0] * n
    reduced: list[list[int]] = [[]] * n
    # Reverse topological order: all successors' bitsets are final already.
    for i in range(n - 1, -1, -1):
        below = 0
        for j in succ[i]:
            below |= desc[j]
        # j is redundant iff another successor already reaches it.
        reduced[i] = [j for j in succ[i] if not (below >> j) & 1]
        for j in succ[i]:
            below |= 1 << j
        desc[i] = below
    level = [0] * n
    for i in range(n):
        for j in succ[i]:
            level[j] = max(level[j], level[i] + 1)
    return _Poset(nodes, tuple(tuple(r) for r in reduced), tuple(desc), tuple(level))


# --- step 2: maximum matching on G' (Hopcroft-Karp) ----------------------------------

def _reduction_matching(adj: Sequence[Sequence[int]], n: int) -> list[int]:
    """Hopcroft-Karp; returns mate_l (left u -> right v, or -1)."""
    mate_l, mate_r = [-1] * n, [-1] * n
    for u in range(n):  # greedy start: most vertices match here already
        for v in adj[u]:
            if mate_r[v] < 0:
                mate_l[u], mate_r[v] = v, u
                break
    while True:
        dist = _hk_layers(adj, mate_l, mate_r, n)
        if dist is None:
            return mate_l
        for u in range(n):
            if mate_l[u] < 0 and dist[u] == 0:
                _hk_augment(u, adj, mate_l, mate_r, dist)


def _hk_layers(adj, mate_l, mate_r, n) -> list[int] | None:
    """BFS layers of free-left alternating paths; None if no augmenting path."""
    dist = [-1] * n
    queue = [u for u in range(n) if mate_l[u] < 0]
    for u in queue:
        dist[u] = 0
    found = False
    for u in queue:  # the list grows while we walk it: a FIFO queue
        for v in adj[u]:
            w = mate_r[v]
            if w < 0:
                found = True
            elif dist[w] < 0:
                dist[w] = dist[u] + 1
                queue.append(w)
    return dist if found else None


def _hk_augment(root, adj, mate_l, mate_r, dist) -> bool:
    """Iterative layered DFS (recursion would overflow on long chains)."""
    stack, its, via = [root], [iter(adj[root])], []
    while stack:
        u = stack[-1]
        for v in its[-1]:
            w = mate_r[v]
            if w < 0:
                via.append(v)
                _flip(stack, via, mate_l, mate_r)
                return True
            if dist[w] == dist[u] + 1:
                via.append(v)
                stack.append(w)
                its.append(iter(adj[w]))
                break
        else:
            dist[u] = -2  # dead end for the rest of this phase
            stack.pop()
            its.pop()
            if via:
                via.pop()
    return False


def _flip(lefts: list[int], rights: list[int], mate_l: list[int], mate_r: list[int]) -> None:
    for a, b in zip(lefts, rights):
        mate_l[a], mate_r[b] = b, a


def _inverse(mate_l: list[int], n: int) -> list[int]:
    mate_r = [-1] * n
    for u, v in enumerate(mate_l):
        if v >= 0:
            mate_r[v] = u
    return mate_r


def _konig_cover(adj, mate_l, n) -> tuple[list[int], list[int]]:
    """Minimum vertex cover of G' from a maximum matching (König).

    Z = vertices on alternating paths from free lefts; cover = (L - Z) + (R & Z).
    As 0/1 duals it is tight on every matched edge and 0 on free vertices,
    which is what makes it a valid potential for the closure augmentation.
    """
    mate_r = _inverse(mate_l, n)
    seen_l, seen_r = [False] * n, [False] * n
    queue = [u for u in range(n) if mate_l[u] < 0]
    for u in queue:
        seen_l[u] = True
    for u in queue:
        for v in adj[u]:
            if not seen_r[v]:
                seen_r[v] = True
                w = mate_r[v]
                if w >= 0 and not seen_l[w]:
                    seen_l[w] = True
                    queue.append(w)
    return [0 if s else 1 for s in seen_l], [1 if s else 0 for s in seen_r]


# --- step 3: augmenting in the closure graph ------------------------------------------

class _Unseen:
    """Rights not yet visited in a phase, as one bitset, so a whole
    reachability set is filtered with a single AND instead of a loop."""

    __slots__ = ("bits",)

    def __init__(self, bits: int) -> None:
        self.bits = bits


def _bits(cand: int, unseen: _Unseen) -> Iterator[int]:
    while True:
        cand &= unseen.bits  # re-filter: deeper DFS levels visit rights meanwhile
        if not cand:
            return
        low = cand & -cand
        cand ^= low
        yield low.bit_length() - 1


Neighbours = Callable[[int, _Unseen], Iterator[int]]


def _kuhn(n: int, mate_l: list[int], mate_r: list[int], neighbours: Neighbours) -> int:
    """Augment until no path exists; each phase visits every right at most once."""
    grown = 0
    while True:
        unseen = _Unseen((1 << n) - 1)
        before = grown
        for a in range(n):
            if mate_l[a] < 0 and _kuhn_path(a, mate_l, mate_r, neighbours, unseen):
                grown += 1
        if grown == before:
            return grown


def _kuhn_path(root, mate_l, mate_r, neighbours: Neighbours, unseen: _Unseen) -> bool:
    stack, its, via = [root], [neighbours(root, unseen)], []
    while stack:
        b = next(its[-1], -1)
        if b < 0:
            stack.pop()
            its.pop()
            if via:
                via.pop()
            continue
        unseen.bits ^= 1 << b
        via.append(b)
        w = mate_r[b]
        if w < 0:
            _flip(stack, via, mate_l, mate_r)
            return True
        stack.append(w)
        its.append(neighbours(w, unseen))
    return False


def _merge_chains(poset: _Poset, mate_l, mate_r, cover_l, cover_r) -> None:
    """Grow the G' matching in the closure graph without losing a G' pair.

    Dual-tight edges for the cover y: G' edges with y_u + y_v = 1, and
    closure-only edges with y_u = y_v = 0.  Matched edges stay tight and free
    vertices keep y = 0 after each flip, so y remains optimal throughout.
    """
    n = len(poset.nodes)
    zero_r = sum(1 << v for v in range(n) if cover_r[v] == 0)
    sparse = [tuple(v for v in poset.reduced[u] if cover_l[u] + cover_r[v] == 1) for u in range(n)]
    desc = poset.desc

    def tight(a: int, unseen: _Unseen) -> Iterator[int]:
        for b in sparse[a]:
            if (unseen.bits >> b) & 1:
                yield b
        if cover_l[a] == 0:
            yield from _bits(desc[a] & zero_r, unseen)

    _kuhn(n, mate_l, mate_r, tight)


# --- step 4: the critical path's pairs on one stream ------------------------------------

def _prefer_critical(poset: _Poset, mate_l: list[int], mate_r: list[int],
                     weight: Callable[[object], float] | None) -> None:
    """For each G' edge u -> v, longest path through it first: where u and v are
    matched elsewhere (u -> v2, u2 -> v), match u -> v and u2 -> v2 instead (u2 must
    reach v2) when that keeps as many pairs and G' pairs and the G' pairs lie on
    longer paths. Chains stay chains of the partial order; the counts of streams and
    syncs do not change."""
    n = len(poset.nodes)
    w = [1.0] * n if weight is None else [float(weight(v)) for v in poset.nodes]
    depth, height = list(w), list(w)  # the longest path ending / starting at each task
    for u in range(n):
        for v in poset.reduced[u]:
            depth[v] = max(depth[v], depth[u] + w[v])
    for u in range(n - 1, -1, -1):
        for v in poset.reduced[u]:
            height[u] = max(height[u], w[u] + height[v])
    crit = {(u, v): depth[u] + height[v] for u in range(n) for v in poset.reduced[u]}

    def value(pairs: list) -> tuple[int, float]:  # (G' pairs, their path lengths)
        on = [crit[p] for p in pairs if p in crit]
        return len(on), sum(on)

    for u, v in sorted(crit, key=lambda e: (-crit[e], e)):
        v2, u2 = mate_l[u], mate_r[v]
        if v2 == v:
            continue
        before = [(a, b) for a, b in ((u, v2), (u2, v)) if a >= 0 and b >= 0]
        after = [(u, v)]
        if u2 >= 0 and v2 >= 0:
            if not (poset.desc[u2] >> v2) & 1:
                continue  # u2 cannot precede v2 on a stream: a chain would be lost
            after.append((u2, v2))
        if len(after) < len(before) or value(after) <= value(before):
            continue
        for a, b in before:
            mate_l[a], mate_r[b] = -1, -1
        for a, b in after:
            mate_l[a], mate_r[b] = b, a


def _closure_matching_size(poset: _Poset, mate_l: list[int], mate_r: list[int]) -> int:
    """Maximum matching of the full closure graph, warm-started (Dilworth: width = n - this)."""
    desc = poset.desc
    _kuhn(len(poset.nodes), mate_l, mate_r, lambda a, unseen: _bits(desc[a], unseen))
    return sum(1 for v in mate_l if v >= 0)


def _chains(mate_l: list[int], mate_r: list[int]) -> list[list[int]]:
    """Chains of the matching, longest first (ties: earliest head)."""
    chains = []
    for head in range(len(mate_l)):
        if mate_r[head] < 0:
            chain = [head]
            while mate_l[chain[-1]] >= 0:
                chain.append(mate_l[chain[-1]])
            chains.append(chain)
    chains.sort(key=lambda c: (-len(c), c[0]))
    return chains


def _stream_per_task(chains, stream_of_chain, n: int) -> list[int]:
    stream_of = [0] * n
    for chain, s in zip(chains, stream_of_chain):
        for t in chain:
            stream_of[t] = s
    return stream_of


# --- limited streams -------------------------------------------------------------------

def _pack(chains: list[list[int]], level: Sequence[int], k: int) -> list[int]:
    """Chain -> stream.  Chain 0 (longest) on stream 0; the rest by ASAP
    start onto the stream whose estimated finish (unit task time, chains on a
    stream serialised) is earliest."""
    out = [0] * len(chains)
    finish = [0] * k
    finish[0] = level[chains[0][-1]] + 1
    heap = [(finish[s], s) for s in range(k)]
    heapq.heapify(heap)
    rest = sorted(range(1, len(chains)), key=lambda c: (level[chains[c][0]], -len(chains[c]), c))
    for c in rest:
        free_at, s = heapq.heappop(heap)
        start = max(free_at, level[chains[c][0]])
        span = level[chains[c][-1]] - level[chains[c][0]] + 1
        out[c] = s
        heapq.heappush(heap, (start + span, s))
    return out


def _necessary_syncs(order, stream_of, reduced, k) -> list[tuple[int, int]]:
    """Keep a G' edge as a sync only if stream order and the syncs chosen so
    far do not already imply it.  Vector clocks (per stream, the highest
    stream sequence number known to be finished) make each test O(1).

    Predecessors are tried latest-first: an earlier one can be implied by a
    later one's clock but never the reverse, so each kept sync is necessary.
    """
    preds: list[list[int]] = [[] for _ in order]
    for u, vs in enumerate(reduced):
        for v in vs:
            preds[v].append(u)
    pos = {t: p for p, t in enumerate(order)}
    seq, done = [0] * len(order), [None] * len(order)
    last = [-1] * k
    count = [0] * k
    syncs = []
    for v in order:
        s = stream_of[v]
        clock = list(done[last[s]]) if last[s] >= 0 else [-1] * k
        for u in sorted(preds[v], key=pos.__getitem__, reverse=True):
            if clock[stream_of[u]] < seq[u]:
                syncs.append((u, v))
                clock = [max(a, b) for a, b in zip(clock, done[u])]
        seq[v], count[s] = count[s], count[s] + 1
        clock[s] = seq[v]
        done[v], last[s] = clock, v
    return syncs
