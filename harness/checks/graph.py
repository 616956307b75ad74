"""Static checks of a traced arm's scheduled graph, judged from the ``graph.json`` the arm exported.

A traced arm (chunking ``eager-traced`` or ``graph``) writes its token-exchange launch and wait
nodes as plain data (the reference's ``export_exchange_graph`` writes it): per node its
position in the scheduled graph, op, role, receive pool, ``buffer_set`` argument, chunk, region
(chunk root) and phase, and who reads it. The reference checks its graph too, but a buggy system
under test could certify itself; these checks read only the exported graph, and derive what it must
contain from the facts in the arm's ``arm.json``:

* ``graph:exchange-counts``: each root exchanges once per direction and chunk, no more, no less
  (a region cloned only partly, a wait dropped);
* ``graph:launch-wait-pairs``: every launch read by exactly one wait, placed after it, and every
  wait reading a launch (a lost wait reads a buffer nobody filled);
* ``graph:buffer-sets``: chunk c exchanges on buffer set ``c % num_buffer_sets``, consecutive chunks
  alternate, and no launch reuses a (pool, buffer set) another exchange still has in flight;
* ``graph:chunk-order``: forward chunks start in order 0..C-1, backward chunks C-1..0.

Each check also fails when the regions it judged, one per (chunk root, direction), are not the ones
the arm's config implies (its MoE layers' roots, forward and backward): a graph whose backward flag
was lost merges both directions into half the regions, and every per-region check then passes on
the wrong regions. No graph.json, or one without exchange ops, fails: nothing passes on absent data.
What the graph must contain comes from the arm's facts (``ArmFacts``: ``chunk_roots``, ``chunks``,
``num_buffer_sets``), never from its config.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from harness.checks.registry import CheckFamily, problems_result, qualifying_arms, register
from harness.records import ArmRecords, RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import GRAPH, ArmFacts, SuiteReader

KIND = "graph-invariants"
COUNTS = "graph:exchange-counts"
PAIRS = "graph:launch-wait-pairs"
BUFFER_SETS = "graph:buffer-sets"
CHUNK_ORDER = "graph:chunk-order"
# What one MoE layer exchanges per chunk and direction: backward reverses each forward exchange.
EXPECTED_PER_ROOT = {
    "fwd": {"dispatch": 1, "wait_dispatch": 1, "combine": 1, "wait_combine": 1},
    "bwd": {"dispatch_data": 1, "wait_dispatch_data": 1, "combine_data": 1, "wait_combine_data": 1},
}
ROLES = ("launch", "wait")
PHASES = ("fwd", "bwd")


class GraphFormatError(ValueError):
    """A graph.json that cannot be judged: a node without a field the checks read, or a bad value."""


@dataclass(frozen=True)
class GraphNode:
    """One exported launch or wait node of a scheduled graph."""

    order: int  # position among all nodes of the graph
    name: str
    op: str
    role: str  # launch | wait
    pool: str
    buffer_set: int
    chunk: int | None  # None: outside every chunk body
    region: str | None  # the chunk root owning it
    phase: str  # fwd | bwd
    users: tuple[str, ...]
    consumes: str | None = None  # a wait: the node whose placeholder it reads

    @property
    def region_phase(self) -> str:
        return f"{self.region} {self.phase}"


def read_graph(graph: Any) -> list[GraphNode]:
    """The nodes of a graph.json, in graph order; raises GraphFormatError naming the node and field."""
    raw_nodes = graph.get("nodes") if isinstance(graph, dict) else None
    if not isinstance(raw_nodes, list):
        raise GraphFormatError("expected an object with a list 'nodes'")
    nodes = [_node(raw, i) for i, raw in enumerate(raw_nodes)]
    names = Counter(node.name for node in nodes)
    if repeated := sorted(name for name, n in names.items() if n > 1):
        raise GraphFormatError(f"node names {repeated} repeat")
    return sorted(nodes, key=lambda node: node.order)


def _node(raw: Any, index: int) -> GraphNode:
    where = f"node {index}"
    if not isinstance(raw, dict):
        raise GraphFormatError(f"{where}: expected an object, got {raw!r}")

    def field_(key: str, type_: type, optional: bool = False) -> Any:
        value = raw.get(key)
        if (value is None and optional) or (isinstance(value, type_) and not isinstance(value, bool)):
            return value
        raise GraphFormatError(f"{where}: '{key}' must be {type_.__name__}, got {value!r}")

    role, phase = field_("role", str), field_("phase", str)
    for key, value, allowed in (("role", role, ROLES), ("phase", phase, PHASES)):
        if value not in allowed:
            raise GraphFormatError(f"{where}: '{key}' must be one of {allowed}, got {value!r}")
    users = field_("users", list)
    if not all(isinstance(user, str) for user in users):
        raise GraphFormatError(f"{where}: 'users' must list node names, got {users!r}")
    return GraphNode(
        order=field_("order", int),
        name=field_("name", str),
        op=field_("op", str),
        role=role,
        pool=field_("pool", str),
        buffer_set=field_("buffer_set", int),
        chunk=field_("chunk", int, optional=True),
        region=field_("region", str, optional=True),
        phase=phase,
        users=tuple(users),
        consumes=field_("consumes", str, optional=True),
    )


def expected_regions(chunk_roots: list[str] | None) -> set[str] | None:
    """The regions (``GraphNode.region_phase``) a traced arm implies: each MoE layer's chunk root (the
    module names its ``arm.json`` records), forward and backward; None when it recorded none."""
    if not chunk_roots:
        return None
    return {f"{root} {phase}" for root in chunk_roots for phase in PHASES}


def region_problems(judged: Iterable[str], expected: set[str] | None) -> list[str]:
    """Why the regions a check judged are not those the config implies (none when they are)."""
    if expected is None:
        return ["no MoE layers recorded (arm.json): the regions to judge are unknown"]
    judged = set(judged)
    if judged == expected:
        return []
    missing, unexpected = sorted(expected - judged), sorted(judged - expected)
    return [
        f"judged {len(judged)} regions where the config implies {len(expected)}"
        + (f"; missing {missing}" if missing else "")
        + (f"; unexpected {unexpected}" if unexpected else "")
    ]


def _result(name: str, problems: list[str], passed: str) -> CheckResult:
    """A graph has no steps: every problem is placed at none."""
    return problems_result(name, KIND, [(None, problem) for problem in problems], passed)


def check_exchange_counts(nodes: list[GraphNode], *, roots: list[str], chunks: int) -> CheckResult:
    """Each root has exactly EXPECTED_PER_ROOT[phase] launches and waits per chunk, nothing elsewhere."""
    actual = Counter((node.region, node.phase, node.chunk, node.op) for node in nodes)
    want = Counter(
        {
            (root, phase, chunk, op): n
            for root in roots
            for phase, ops in EXPECTED_PER_ROOT.items()
            for chunk in range(chunks)
            for op, n in ops.items()
        }
    )
    problems = []
    for key in sorted(want.keys() | actual.keys(), key=str):
        if want[key] != actual[key]:
            root, phase, chunk, op = key
            where = f"{root} {phase}" + ("" if chunk is None else f" chunk {chunk}")
            problems.append(f"{where}: {actual[key]} {op} (expected {want[key]})")
    return _result(COUNTS, problems, f"{sum(want.values())} launches and waits as expected ({chunks} chunks)")


def check_launch_wait_pairs(nodes: list[GraphNode]) -> CheckResult:
    """Every launch is read by exactly one wait, placed after it, and every wait reads a launch."""
    by_name = {node.name: node for node in nodes}
    launches = [node for node in nodes if node.role == "launch"]
    problems = []
    for launch in launches:
        waits = [by_name[user] for user in launch.users if user in by_name and by_name[user].role == "wait"]
        if len(waits) != 1 or len(launch.users) != 1:
            problems.append(f"launch {launch.name} has {len(waits)} waits among its users {list(launch.users)}")
        elif waits[0].order < launch.order:
            problems.append(f"wait {waits[0].name} comes before its launch {launch.name}")
    for wait in (node for node in nodes if node.role == "wait"):
        source = by_name.get(wait.consumes) if wait.consumes is not None else None
        if source is None or source.role != "launch":
            problems.append(f"wait {wait.name} does not consume a launch")
    return _result(PAIRS, problems, f"{len(launches)} launches, each with one wait after it")


def check_buffer_sets(nodes: list[GraphNode], num_buffer_sets: int, regions: set[str] | None) -> CheckResult:
    """Chunk c exchanges on set ``c % num_buffer_sets``, so consecutive chunks alternate; no set is
    launched into while an exchange on it is in flight (it would overwrite rows not yet read); the
    chunked regions are ``regions`` (:func:`expected_regions`)."""
    problems = region_problems({node.region_phase for node in nodes if node.chunk is not None}, regions)
    used: dict[str, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    in_flight: dict[tuple[str, int], GraphNode] = {}
    for node in nodes:
        if node.chunk is None:
            problems.append(f"{node.name} is not in a chunk body (buffer set {node.buffer_set})")
            continue
        used[node.region_phase][node.chunk].add(node.buffer_set)
        if node.buffer_set != node.chunk % num_buffer_sets:
            problems.append(
                f"{node.name} of chunk {node.chunk} uses buffer set {node.buffer_set},"
                f" expected {node.chunk % num_buffer_sets}"
            )
        slot = (node.pool, node.buffer_set)
        if node.role == "launch":
            if slot in in_flight:
                problems.append(
                    f"{node.name} launches into {node.pool} buffer set {node.buffer_set}"
                    f" while {in_flight[slot].name} is in flight"
                )
            in_flight[slot] = node
        elif slot in in_flight and in_flight[slot].name == node.consumes:
            del in_flight[slot]
    for region, sets in used.items():
        chunks = sorted(sets)
        for a, b in zip(chunks, chunks[1:]):
            if num_buffer_sets > 1 and sets[a] == sets[b]:
                problems.append(f"{region}: chunks {a} and {b} both use buffer sets {sorted(sets[a])}")
    passed = f"{len(used)} regions alternate {num_buffer_sets} buffer sets, none reused in flight"
    return _result(BUFFER_SETS, problems, passed)


def check_chunk_order(nodes: list[GraphNode], regions: set[str] | None) -> CheckResult:
    """Forward chunks start their exchanges in order 0..C-1, backward chunks in order C-1..0, in
    each of ``regions`` (:func:`expected_regions`) and nowhere else."""
    first_launch: dict[tuple[str | None, str], list[int]] = defaultdict(list)
    for node in nodes:
        if node.role == "launch" and node.chunk is not None:
            chunks = first_launch[(node.region, node.phase)]
            if node.chunk not in chunks:
                chunks.append(node.chunk)
    problems = region_problems((f"{region} {phase}" for region, phase in first_launch), regions)
    for (region, phase), chunks in first_launch.items():
        expected = sorted(chunks, reverse=phase == "bwd")
        if chunks != expected:
            problems.append(f"{region} {phase}: chunks launch in order {chunks}, expected {expected}")
    return _result(CHUNK_ORDER, problems, f"{len(first_launch)} regions: forward chunks ascending, backward descending")


def graph_nodes(name: str, kind: str, arm: str, records: ArmRecords) -> list[GraphNode] | CheckResult:
    """The arm's exported graph nodes, or the result ``name`` that says why there are none to judge."""
    if records.graph is None:
        return CheckResult(name, kind, "fail", f"arm '{arm}' exported no graph.json: no graph to check")
    try:
        nodes = read_graph(records.graph)
    except GraphFormatError as e:
        return CheckResult(name, kind, "error", f"malformed graph.json of arm '{arm}': {e}")
    if not nodes:
        return CheckResult(name, kind, "fail", f"graph.json of arm '{arm}' lists no launch or wait")
    return nodes


def graph_results(arm: str, spec: ArmSpec, records: ArmRecords) -> list[CheckResult]:
    """The four static checks of one traced arm's exported graph, named ``<arm>: graph:<check>``."""
    nodes = graph_nodes(f"{arm}: {KIND}", KIND, arm, records)
    if isinstance(nodes, CheckResult):
        return [nodes]
    facts = records.facts or ArmFacts()
    roots = list(facts.chunk_roots) if facts.chunk_roots is not None else None
    if roots and facts.chunks:
        counts = check_exchange_counts(nodes, roots=roots, chunks=facts.chunks)
    else:
        what = "records no chunk roots" if roots == [] else "has no arm.json with its chunk roots and chunks"
        counts = CheckResult(COUNTS, KIND, "fail", f"arm '{arm}' {what}: no exchange counts to expect")
    regions = expected_regions(roots)
    if facts.num_buffer_sets:
        buffer_sets = check_buffer_sets(nodes, facts.num_buffer_sets, regions)
    else:
        why = f"arm '{arm}' has no arm.json with its num_buffer_sets: no buffer sets to expect"
        buffer_sets = CheckResult(BUFFER_SETS, KIND, "fail", why)
    results = [counts, check_launch_wait_pairs(nodes), buffer_sets, check_chunk_order(nodes, regions)]
    return [dataclasses.replace(r, name=f"{arm}: {r.name}") for r in results]


def _no_graph(spec: ArmSpec) -> str | None:
    return None if spec.emits(GRAPH) else "exports no graph (only a traced arm does: chunking eager-traced or graph)"


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    v.table(raw, dotted, ("kind", "name", "arms"))
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else kind
    wanted = "a traced arm (one that exports its graph: chunking eager-traced or graph)"
    return CheckSpec(kind, name, qualifying_arms(v, raw, dotted, arms, _no_graph, wanted))


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    return [result for arm in check.arms for result in graph_results(arm, suite.arms[arm], records[arm])]


register(CheckFamily((KIND,), parse, run, reads=(GRAPH,)))
