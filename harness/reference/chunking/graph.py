"""Graph chunking of token-exchange regions in one traced train step, and the passes after it.

The passes know nothing about a particular expert-parallel backend. What they need of it is an
:class:`ExchangeMarkers`: how to recognise a launch and a wait in the graph and which receive pool
each uses. In order:

1. :func:`chunk_regions` finds the chunk roots through the launches whose module fqn matches a
   root pattern, and clones every region, forward and backward, into C chunks (below).
2. :func:`assign_buffer_sets` sets every ``buffer_set`` argument (found through the op schema)
   from the node's chunk id. It is separate so that backend storage stays out of the cloning.
3. :func:`schedule_regions` orders each region's chunks with the shared :class:`EPScheduler`.
4. The static checks in :mod:`~harness.reference.chunking.checks` verify the result.

**Cloning.** A region is one (root, direction): the nodes owned by the root module (backward nodes
through their forward's metadata) that depend on the chunk symbol, plus any node on a path that
leaves them and comes back. Parameters and everything computed from them alone do not depend on
the symbol, so they stay shared. For chunk c every body node is copied with its inputs rewired:
body values to chunk c's copies, the forward body's values (from a backward region) to the
forward's chunk c, values from outside carrying the chunk symbol in a dim to chunk c's split along
that dim, and sizes that mention the symbol to the same expression of the chunk's size ``s // C``.
Nothing is re-traced and no shape is patched: every size the body computes is derived from its
inputs at run time. Values used outside the region are rebuilt: tensors along the chunk dim with
``cat``, static-shaped ones (parameter gradients) with ``add``, summed from the last chunk down as
autograd accumulates eager chunks, sizes from the full symbol. Bodies that mutate in place are
rejected: their chunks would have to be chained, which this pass does not do.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Callable

import sympy
import torch
from torch import fx
from torch.utils._sympy.functions import FloorDiv

from harness.reference.chunking.schedule import EPScheduler, Owner
from harness.reference.chunking.trace import is_backward, node_fqn

NodePredicate = Callable[[fx.Node], bool]
aten = torch.ops.aten


class ChunkingError(RuntimeError):
    """The graph cannot be chunked as asked: no region matched, or a value cannot be split or joined."""


@dataclass(frozen=True)
class ExchangeMarkers:
    """How a token-exchange backend shows in a graph: the only backend knowledge the passes get."""

    is_launch: NodePredicate
    is_wait: NodePredicate
    pool: Callable[[fx.Node], str]  # the receive pool a launch writes (dispatch, combine, ...)


@dataclass
class Region:
    """One direction of one chunk root: its body (erased from the graph once cloned) and its copies per chunk."""

    root: str
    backward: bool
    body: list[fx.Node]
    chunks: list[list[fx.Node]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.root} {'bwd' if self.backward else 'fwd'}"


def match_root(fqn: str, pattern: str) -> str | None:
    """The prefix of ``fqn`` that matches ``pattern`` component by component (``*`` = one name)."""
    parts, want = fqn.split("."), pattern.split(".")
    if len(parts) < len(want) or not all(fnmatchcase(p, w) for p, w in zip(parts, want)):
        return None
    return ".".join(parts[: len(want)])


def custom_meta(node: fx.Node) -> dict:
    """The annotations a node carries (``fx.traceback.annotate``), where chunk ownership lives."""
    return node.meta.get("custom") or {}


def owner_of(node: fx.Node) -> Owner | None:
    """The chunk a node belongs to, read from the metadata both chunking paths write."""
    custom = custom_meta(node)
    if custom.get("role") != "body":
        return None
    return Owner(custom["region"], is_backward(node), custom["chunk_id"])


# ---------------------------------------------------------------------------------------------
# 1. The chunk pass


def find_regions(gm: fx.GraphModule, symbol: sympy.Symbol, root_pattern: str, is_launch: NodePredicate) -> list[Region]:
    """The regions of the roots that own a token-exchange launch, forward ones first."""
    launches = [n for n in gm.graph.nodes if is_launch(n)]
    keys = {(root, is_backward(n)) for n in launches if (root := match_root(node_fqn(n), root_pattern))}
    if not keys:
        seen = sorted({node_fqn(n) for n in launches})
        raise ChunkingError(f"no token-exchange regions matched root pattern {root_pattern!r} (launches at {seen})")
    carries = _carries_symbol(gm, symbol)
    bodies: dict[tuple[str, bool], list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node not in carries:
            continue
        key = (match_root(node_fqn(node), root_pattern), is_backward(node))
        if key in keys:
            bodies[key].append(node)
    for key, body in bodies.items():
        bodies[key] = _close_over_paths(gm.graph, set(body))
    mutating = [n.name for body in bodies.values() for n in body if _mutates(n)]
    if mutating:
        raise ChunkingError(
            f"region bodies mutate in place ({mutating[:3]}): their chunks would need chaining, not cloning"
        )
    return [Region(root, bwd, bodies[(root, bwd)]) for root, bwd in sorted(keys, key=lambda k: (k[1], k[0]))]


def _close_over_paths(graph: fx.Graph, body: set[fx.Node]) -> list[fx.Node]:
    """``body`` plus every node on a path that leaves it and comes back, in graph order.

    Such a node (a gradient sum with one term from outside the root, like a residual's) is part of
    the region's data flow: left outside, it would need every chunk before any chunk could go on.
    """
    nodes = list(graph.nodes)
    below: set[fx.Node] = set()
    for node in nodes:
        if node in body or any(a in below for a in node.all_input_nodes):
            below.add(node)
    above: set[fx.Node] = set()
    for node in reversed(nodes):
        if node in body or any(u in above for u in node.users):
            above.add(node)
    return [n for n in nodes if n in body or (n in below and n in above)]


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def chunk_regions(
    gm: fx.GraphModule,
    *,
    symbol: sympy.Symbol,
    chunks: int,
    root_pattern: str,
    is_launch: NodePredicate,
    backward: bool = True,
) -> list[Region]:
    """Clone every matched region into ``chunks`` chunks in place; ``backward=False`` leaves backward whole."""
    regions = [r for r in find_regions(gm, symbol, root_pattern, is_launch) if backward or not r.backward]
    cloner = _Cloner(gm.graph, symbol, chunks)
    later = {n for r in regions for n in r.body}
    for region in regions:  # forward first, so that backward copies can use the forward's
        later -= set(region.body)
        cloner.clone(region, later)
    cloner.erase_originals(regions)
    gm.graph.lint()
    gm.recompile()
    return regions


def _carries_symbol(gm: fx.GraphModule, symbol: sympy.Symbol) -> set[fx.Node]:
    """Nodes whose value mentions the symbol or is computed from one that does."""
    carries: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if _mentions(node.meta.get("val"), symbol) or any(a in carries for a in node.all_input_nodes):
            carries.add(node)
    return carries


def _mentions(value: Any, symbol: sympy.Symbol) -> bool:
    if isinstance(value, torch.Tensor):
        return any(_mentions(s, symbol) for s in (*value.shape, *value.stride()))
    if isinstance(value, torch.SymInt):
        return symbol in value.node.expr.free_symbols
    if isinstance(value, (list, tuple)):
        return any(_mentions(v, symbol) for v in value)
    return False


def _size_expr(size: int | torch.SymInt) -> sympy.Expr:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


class _Cloner:
    """Copies region bodies per chunk and rebuilds what crosses a region's boundary."""

    def __init__(self, graph: fx.Graph, symbol: sympy.Symbol, chunks: int) -> None:
        self.graph, self.symbol, self.chunks = graph, symbol, chunks
        self.copies: dict[fx.Node, list[fx.Node]] = {}  # every cloned body node -> its chunk copies
        self._full_size: fx.Node | None = None
        self._chunk_size: fx.Node | None = None

    def clone(self, region: Region, later: set[fx.Node]) -> None:
        """Copy ``region``'s body per chunk; ``later`` are bodies still to be copied (they keep using originals)."""
        body = set(region.body)
        split: dict[fx.Node, list[Any]] = {}

        def rewire(arg: fx.Node, chunk: int) -> Any:
            if arg in self.copies:
                return self.copies[arg][chunk]
            if arg not in split:
                split[arg] = self._split(arg, region)
            return split[arg][chunk]

        region.chunks = [[] for _ in range(self.chunks)]
        for node in region.body:
            with self.graph.inserting_before(node):
                copies = []
                for chunk in range(self.chunks):
                    copy = self.graph.node_copy(node, lambda arg, c=chunk: rewire(arg, c))
                    _tag(copy, node, chunk, region.root, "body")
                    copies.append(copy)
                    region.chunks[chunk].append(copy)
            self.copies[node] = copies
        for node in region.body:
            outside = [u for u in node.users if u not in body and u not in later]
            if outside:
                with self.graph.inserting_before(node):
                    joined = self._join(node, region)
                node.replace_all_uses_with(joined, delete_user_cb=lambda user: user in outside)

    def erase_originals(self, regions: list[Region]) -> None:
        for node in reversed([n for r in regions for n in r.body]):
            if node.users:
                raise ChunkingError(f"{node.name} is still used by {list(node.users)} after chunking")
            self.graph.erase_node(node)

    def _split(self, arg: fx.Node, region: Region) -> list[Any]:
        """Chunk c's version of a value from outside the region (the value itself when shared)."""
        value = arg.meta.get("val")
        if isinstance(value, torch.SymInt) and _mentions(value, self.symbol):
            size = self._emit(value.node.expr, self.chunk_size())
            return [size] * self.chunks
        if not (isinstance(value, torch.Tensor) and _mentions(value, self.symbol)):
            return [arg] * self.chunks
        dim = self._chunk_dim(arg, value)
        length = self.graph.call_function(aten.sym_size.int, (arg, dim))
        parts = self.graph.call_function(
            aten.split.Tensor, (arg, self.graph.call_function(operator.floordiv, (length, self.chunks)), dim)
        )
        pieces = [self.graph.call_function(operator.getitem, (parts, c)) for c in range(self.chunks)]
        if dim != 0 and value.is_contiguous():
            # The body was traced on a contiguous value and may view it as such; so must a chunk.
            pieces = [
                self.graph.call_function(aten.clone.default, (p,), {"memory_format": torch.contiguous_format})
                for p in pieces
            ]
        for c, piece in enumerate(pieces):
            _tag(piece, arg, c, region.root, "split")
        return pieces

    def _join(self, node: fx.Node, region: Region) -> fx.Node:
        """The full value of ``node`` rebuilt from its chunk copies, for users outside the region."""
        value = node.meta.get("val")
        copies = self.copies[node]
        if isinstance(value, torch.SymInt):
            joined = self._emit(value.node.expr, self.full_size())
            if not isinstance(joined, fx.Node):
                raise ChunkingError(f"{node.name}: size {value} used outside {region.name} is a constant")
        elif isinstance(value, torch.Tensor) and _mentions(tuple(value.shape), self.symbol):
            joined = self.graph.call_function(aten.cat.default, (copies, self._chunk_dim(node, value)))
        elif isinstance(value, torch.Tensor):
            joined = copies[-1]  # autograd accumulates eager chunks from the last one down
            for copy in reversed(copies[:-1]):
                joined = self.graph.call_function(aten.add.Tensor, (joined, copy))
        else:
            raise ChunkingError(
                f"{node.name} ({node.target}) of {region.name} is used outside it and cannot be re-joined"
            )
        joined.meta.update(val=value, custom={"region": region.root, "role": "join", "producer": "graph"})
        return joined

    def _chunk_dim(self, node: fx.Node, value: torch.Tensor) -> int:
        """The dim of ``value`` that carries the chunk: exactly the symbol, or k*symbol as the leading dim."""
        dims = [d for d, size in enumerate(value.shape) if self.symbol in _size_expr(size).free_symbols]
        if len(dims) == 1:
            dim, expr = dims[0], _size_expr(value.shape[dims[0]])
            if expr == self.symbol or (dim == 0 and self._leading and (expr / self.symbol).is_Integer):
                return dim
        raise ChunkingError(
            f"{node.name}: cannot split or join shape {tuple(value.shape)} along the chunk symbol {self.symbol}"
        )

    @property
    def _leading(self) -> bool:
        """Whether the symbol is the leading dim of the traced inputs, so flattened dims stay chunk-major."""
        return self.full_size().args[1] == 0

    def full_size(self) -> fx.Node:
        """A node holding the full size of the chunk dim, read off the first input that has it."""
        if self._full_size is None:
            placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
            for node in placeholders:
                value = node.meta.get("val")
                if isinstance(value, torch.Tensor):
                    dims = [d for d, s in enumerate(value.shape) if _size_expr(s) == self.symbol]
                    if dims:
                        with self.graph.inserting_after(placeholders[-1]):
                            self._full_size = self.graph.call_function(aten.sym_size.int, (node, dims[0]))
                        break
            else:
                raise ChunkingError(f"no graph input has the chunk symbol {self.symbol} as a dim")
        return self._full_size

    def chunk_size(self) -> fx.Node:
        """A node holding one chunk's size of the chunk dim: the symbol's value inside a chunk."""
        if self._chunk_size is None:
            full = self.full_size()
            with self.graph.inserting_after(full):
                self._chunk_size = self.graph.call_function(operator.floordiv, (full, self.chunks))
        return self._chunk_size

    def _emit(self, expr: sympy.Expr, size: fx.Node) -> Any:
        """Nodes computing the integer ``expr`` with the chunk symbol bound to ``size``."""
        if expr == self.symbol:
            return size
        if expr.is_Integer:
            return int(expr)
        if isinstance(expr, (sympy.Mul, sympy.Add)):
            op = operator.mul if isinstance(expr, sympy.Mul) else operator.add
            terms = [self._emit(a, size) for a in expr.args]
            result = terms[0]
            for term in terms[1:]:
                result = self.graph.call_function(op, (result, term))
            return result
        if isinstance(expr, FloorDiv):
            return self.graph.call_function(operator.floordiv, tuple(self._emit(a, size) for a in expr.args))
        raise ChunkingError(f"cannot rebuild size expression {expr} for a chunk")


def _tag(node: fx.Node, source: fx.Node, chunk: int, root: str, role: str) -> None:
    """Chunk metadata on a node the pass made; copies drop the unchunked value's fake ``val``."""
    node.meta = {k: v for k, v in source.meta.items() if k not in ("val", "tensor_meta")}
    node.meta["custom"] = {**custom_meta(source), "chunk_id": chunk, "region": root, "role": role, "producer": "graph"}


# ---------------------------------------------------------------------------------------------
# 2. The buffer-set post-pass


def assign_buffer_sets(gm: fx.GraphModule, num_buffer_sets: int) -> int:
    """Set every op argument named ``buffer_set`` to ``chunk_id % num_buffer_sets``; returns how many.

    Raises if such an op sits outside a chunk body: it would share a buffer set with whatever else
    is in flight. Nothing is changed unless every such op is valid.
    """
    targets = [(n, i) for n in gm.graph.nodes if (i := _buffer_set_index(n)) is not None]
    strays = [n.name for n, _ in targets if custom_meta(n).get("role") != "body"]
    if strays:
        raise ChunkingError(f"buffer-set pass: {strays} take a buffer_set but are not chunk body nodes")
    for node, index in targets:
        value = custom_meta(node)["chunk_id"] % num_buffer_sets
        if index < len(node.args):
            node.update_arg(index, value)
        else:
            node.update_kwarg("buffer_set", value)
    gm.recompile()
    return len(targets)


def _buffer_set_index(node: fx.Node) -> int | None:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return None
    names = [a.name for a in schema.arguments]
    return names.index("buffer_set") if "buffer_set" in names else None


def buffer_set_of(node: fx.Node) -> int | None:
    """The buffer set an exchange op node uses (its schema default when not passed)."""
    index = _buffer_set_index(node)
    if index is None:
        return None
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get("buffer_set", node.target._schema.arguments[index].default_value)


# ---------------------------------------------------------------------------------------------
# 3. Scheduling


def schedule_regions(gm: fx.GraphModule, scheduler: EPScheduler, markers: ExchangeMarkers) -> None:
    """Reorder each region's chunk bodies with the shared scheduler, in place.

    Each region and direction is placed where its first body node was, in the scheduler's order;
    a stable topological sort then pulls forward anything outside a body that a node needs. Raises
    if that would change the scheduled order: the buffer-reuse guarantee rests on it.
    """
    groups: dict[tuple[str, bool], list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if (owner := owner_of(node)) is not None:
            groups[(owner.root, owner.backward)].append(node)
    desired: list[fx.Node] = []
    scheduled: dict[tuple[str, bool], list[fx.Node]] = {}
    for node in gm.graph.nodes:
        owner = owner_of(node)
        if owner is None:
            desired.append(node)
        elif (key := (owner.root, owner.backward)) not in scheduled:
            nodes = groups[key]
            items = [(owner_of(n), _kind(n, markers)) for n in nodes]
            scheduled[key] = [nodes[i] for i in scheduler.order_owned(items)]
            desired.extend(scheduled[key])
    _stable_topological_sort(gm.graph, desired)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    for (root, backward), order in scheduled.items():
        if sorted(order, key=position.__getitem__) != order:
            raise ChunkingError(
                f"{root} {'bwd' if backward else 'fwd'}: dependencies outside its chunks contradict the schedule"
            )
    gm.graph.lint()
    gm.recompile()


def _kind(node: fx.Node, markers: ExchangeMarkers) -> str:
    return "launch" if markers.is_launch(node) else "wait" if markers.is_wait(node) else "compute"


def _stable_topological_sort(graph: fx.Graph, desired: list[fx.Node]) -> None:
    """Put nodes in ``desired`` order, moving a node's missing inputs just before it."""
    emitted: set[fx.Node] = set()
    order: list[fx.Node] = []
    for start in desired:
        stack = [start]
        while stack:
            node = stack[-1]
            if node in emitted:
                stack.pop()
                continue
            missing = [a for a in node.all_input_nodes if a not in emitted]
            if missing:
                stack.extend(reversed(missing))
                continue
            emitted.add(node)
            order.append(node)
            stack.pop()
    for previous, node in zip(order, order[1:]):
        if previous.next is not node:
            previous.append(node)
