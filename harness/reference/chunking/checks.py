"""Static checks of a chunked (or unchunked) traced train step, as structured results.

They read only what both chunking paths write: exchange ops found through
:class:`~harness.reference.chunking.graph.ExchangeMarkers`, chunk ownership from node metadata, and
buffer sets from the op schema. Each check targets a bug that graph chunking invites: a region
cloned only partly (exchange counts), a lost or misplaced wait, a buffer set shared by chunks in
flight, and chunks scheduled in the wrong order.

:func:`export_exchange_graph` gives the same facts as plain data (``arms/<arm>/graph.json``), so
that a judge outside the system under test can check the graph without trusting these verdicts.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from torch import fx

from harness.reference.chunking.graph import ExchangeMarkers, buffer_set_of, match_root, owner_of
from harness.reference.chunking.trace import is_backward, node_fqn


@dataclass
class GraphCheck:
    """One static check of a graph: ``status`` is "pass" or "fail"; ``problems`` lists what failed."""

    name: str
    status: str
    detail: str
    problems: list[str] = field(default_factory=list)


def _result(name: str, problems: list[str], passed: str) -> GraphCheck:
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return GraphCheck(name, "fail", problems[0] + more, problems)
    return GraphCheck(name, "pass", passed)


def exchange_inventory(gm: fx.GraphModule, markers: ExchangeMarkers, root_pattern: str) -> Counter:
    """Launch and wait counts keyed by (root, "fwd"|"bwd", chunk id or None, op name)."""
    inventory: Counter = Counter()
    for node in gm.graph.nodes:
        if markers.is_launch(node) or markers.is_wait(node):
            phase = "bwd" if is_backward(node) else "fwd"
            chunk = owner.chunk if (owner := owner_of(node)) is not None else None
            inventory[(match_root(node_fqn(node), root_pattern), phase, chunk, node.target._opname)] += 1
    return inventory


def export_exchange_graph(gm: fx.GraphModule, markers: ExchangeMarkers, root_pattern: str) -> dict:
    """The scheduled graph's launch and wait nodes, in graph order, as JSON-ready data.

    Per node: ``order`` (its position among all nodes of the graph), ``name``, ``op`` (the op's
    name), ``role`` (``"launch"`` or ``"wait"``), ``pool`` (the receive pool it uses),
    ``buffer_set``, ``chunk`` (None outside a chunk body), ``region`` (the chunk root owning it),
    ``phase`` (``"fwd"`` or ``"bwd"``), ``users`` (names of the nodes reading its value) and, for a
    wait, ``consumes`` (the name of the node whose placeholder it reads, None if not a node).
    """
    nodes = []
    for order, node in enumerate(gm.graph.nodes):
        launch, wait = markers.is_launch(node), markers.is_wait(node)
        if not (launch or wait):
            continue
        owner = owner_of(node)
        exported = {
            "order": order,
            "name": node.name,
            "op": node.target._opname,
            "role": "launch" if launch else "wait",
            "pool": markers.pool(node),
            "buffer_set": buffer_set_of(node),
            "chunk": owner.chunk if owner is not None else None,
            "region": match_root(node_fqn(node), root_pattern),
            "phase": "bwd" if is_backward(node) else "fwd",
            "users": [user.name for user in node.users],
        }
        if wait:
            pending = node.args[0] if node.args else None
            exported["consumes"] = pending.name if isinstance(pending, fx.Node) else None
        nodes.append(exported)
    return {"nodes": nodes}


def check_exchange_counts(
    gm: fx.GraphModule,
    markers: ExchangeMarkers,
    *,
    root_pattern: str,
    roots: Iterable[str],
    expected: dict[str, Counter],
    chunks: int | None,
) -> GraphCheck:
    """Each root has exactly ``expected[phase]`` launches and waits per chunk (``chunks=None``: unchunked)."""
    actual = exchange_inventory(gm, markers, root_pattern)
    chunk_ids: list[int | None] = [None] if chunks is None else list(range(chunks))
    want = Counter(
        {
            (root, phase, c, op): n
            for root in roots
            for phase, ops in expected.items()
            for c in chunk_ids
            for op, n in ops.items()
        }
    )
    problems = []
    for key in sorted(want.keys() | actual.keys(), key=str):
        if want[key] != actual[key]:
            root, phase, chunk, op = key
            where = f"{root} {phase}" + ("" if chunk is None else f" chunk {chunk}")
            problems.append(f"{where}: {actual[key]} {op} (expected {want[key]})")
    total = sum(want.values())
    scope = "unchunked" if chunks is None else f"{chunks} chunks"
    return _result("graph:exchange-counts", problems, f"{total} launches and waits as expected ({scope})")


def check_launch_wait_pairs(gm: fx.GraphModule, markers: ExchangeMarkers) -> GraphCheck:
    """Every launch is consumed by exactly one wait, placed after it, and every wait consumes a launch."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    problems = []
    launches = [n for n in gm.graph.nodes if markers.is_launch(n)]
    for launch in launches:
        waits = [u for u in launch.users if markers.is_wait(u)]
        if len(waits) != 1 or len(launch.users) != 1:
            problems.append(
                f"launch {launch.name} has {len(waits)} waits among its users {[u.name for u in launch.users]}"
            )
        elif position[waits[0]] < position[launch]:
            problems.append(f"wait {waits[0].name} comes before its launch {launch.name}")
    for wait in (n for n in gm.graph.nodes if markers.is_wait(n)):
        if not (wait.args and isinstance(wait.args[0], fx.Node) and markers.is_launch(wait.args[0])):
            problems.append(f"wait {wait.name} does not consume a launch")
    return _result("graph:launch-wait-pairs", problems, f"{len(launches)} launches, each with one wait after it")


def check_buffer_sets(gm: fx.GraphModule, markers: ExchangeMarkers, num_buffer_sets: int) -> GraphCheck:
    """Chunk c's exchanges use set ``c % num_buffer_sets``, so consecutive chunks alternate;
    no set is reused in flight."""
    problems = []
    used: dict[tuple[str, bool], dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    in_flight: dict[tuple[str, int], fx.Node] = {}
    for node in gm.graph.nodes:
        if not (markers.is_launch(node) or markers.is_wait(node)):
            continue
        owner, buffer_set = owner_of(node), buffer_set_of(node)
        if owner is None:
            problems.append(f"{node.name} is not in a chunk body (buffer set {buffer_set})")
            continue
        used[(owner.root, owner.backward)][owner.chunk].add(buffer_set)
        if buffer_set != owner.chunk % num_buffer_sets:
            problems.append(
                f"{node.name} of chunk {owner.chunk} uses buffer set {buffer_set},"
                f" expected {owner.chunk % num_buffer_sets}"
            )
        slot = (markers.pool(node), buffer_set)
        if markers.is_launch(node):
            if slot in in_flight:
                problems.append(
                    f"{node.name} launches into {slot[0]} buffer set {buffer_set}"
                    f" while {in_flight[slot].name} is in flight"
                )
            in_flight[slot] = node
        elif in_flight.get(slot) is node.args[0]:
            del in_flight[slot]
    for (root, backward), sets in used.items():
        chunks = sorted(sets)
        for a, b in zip(chunks, chunks[1:]):
            if num_buffer_sets > 1 and sets[a] == sets[b]:
                problems.append(
                    f"{root} {'bwd' if backward else 'fwd'}: chunks {a} and {b} both use buffer sets {sorted(sets[a])}"
                )
    return _result(
        "graph:buffer-sets",
        problems,
        f"{len(used)} regions alternate {num_buffer_sets} buffer sets, none reused in flight",
    )


def check_chunk_order(gm: fx.GraphModule, markers: ExchangeMarkers) -> GraphCheck:
    """Forward chunks start their exchanges in order 0..C-1, backward chunks in order C-1..0."""
    first_launch: dict[tuple[str, bool], list[int]] = defaultdict(list)
    for node in gm.graph.nodes:
        if markers.is_launch(node) and (owner := owner_of(node)) is not None:
            chunks = first_launch[(owner.root, owner.backward)]
            if owner.chunk not in chunks:
                chunks.append(owner.chunk)
    problems = []
    for (root, backward), chunks in first_launch.items():
        expected = sorted(chunks, reverse=backward)
        if chunks != expected:
            problems.append(
                f"{root} {'bwd' if backward else 'fwd'}: chunks launch in order {chunks}, expected {expected}"
            )
    return _result(
        "graph:chunk-order", problems, f"{len(first_launch)} regions: forward chunks ascending, backward descending"
    )
