"""Real overlap of chunked token exchanges (kind ``overlap``): the next chunk's exchange is in flight
while a chunk waits for its own.

Chunking promises overlap wherever an arm's facts (``ArmFacts``) have ``chunks >= 2`` and
``num_buffer_sets >= 2``: the EP
scheduler holds a chunk's k-th wait until the next chunk has issued its k-th launch, so the next
chunk's tokens travel while this chunk computes. A scheduler that waits for chunk 0's exchange
before launching chunk 1's computes the same numbers and issues the same exchanges on the same
buffer sets; only the order of launches and waits shows it. This check reads that order: the
graph order in ``graph.json`` for traced arms, the emission order of the token-exchange events for
eager arms.

A region is one (chunk root, direction) of a graph, or one (step, phase, MoE layer) of one
logical rank's events. Its chunks are taken in the order they first launch (whether that order
is right is ``graph:chunk-order``'s business), and each consecutive pair must overlap. The
detail reports the fraction of regions that do; a region that does not fails the check.

Eager arms schedule their forward (and its replay, ``recompute``) only: their backward is
autograd's, which runs each reverse exchange's launch and wait inside one autograd node, so it
promises no overlap and is not judged. Traced arms schedule both directions.

The regions judged must be those the arm's config implies, or the check fails whatever their
overlap: a graph's two regions per MoE layer (``graph.expected_regions``); in every (logical rank,
step, phase) of an eager arm's events, one region per MoE layer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from harness.checks.exchange import Event, malformed_events
from harness.checks.graph import GraphNode, expected_regions, graph_nodes, region_problems
from harness.checks.registry import CheckFamily, problems_result, qualifying_arms, register
from harness.records import ArmRecords, RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import GRAPH, TOKEN_EXCHANGE, SuiteReader

KIND = "overlap"
# The phases an eager arm's scheduler orders; its backward is autograd's.
EAGER_SCHEDULED_PHASES = ("fwd", "recompute")
Sequence = list[tuple[int | None, str]]  # (chunk, "launch" | "wait") of one region, in order


def overlap_problem(sequence: Sequence) -> str | None:
    """Why a region's exchanges do not overlap, or None: for chunks a, b in first-launch order,
    a's k-th wait must come after b's k-th launch, for every k both have."""
    launches: dict[int | None, list[int]] = defaultdict(list)
    waits: dict[int | None, list[int]] = defaultdict(list)
    for position, (chunk, role) in enumerate(sequence):
        (launches if role == "launch" else waits)[chunk].append(position)
    order = list(launches)
    if len(order) < 2:
        return f"only chunks {order} launch: nothing to overlap"
    for a, b in zip(order, order[1:]):
        for k, (wait_at, launch_at) in enumerate(zip(waits[a], launches[b])):
            if wait_at < launch_at:
                return f"chunk {a} waits for its exchange {k} before chunk {b} launches its exchange {k}"
    return None


def graph_regions(nodes: list[GraphNode]) -> dict[str, Sequence]:
    """The launch/wait sequence of each (root, direction) of a graph, in graph order."""
    regions: dict[str, Sequence] = defaultdict(list)
    for node in nodes:
        regions[node.region_phase].append((node.chunk, node.role))
    return dict(regions)


def event_regions(events: list[Event], phases: tuple[str, ...]) -> dict[tuple[int, str, int], Sequence]:
    """The launch/wait sequence of each (step, phase, layer) in ``phases`` of one logical rank's events."""
    regions: dict[tuple[int, str, int], Sequence] = defaultdict(list)
    for e in events:
        if e["phase"] in phases:
            regions[(e["step"], e["phase"], e["layer"])].append((e["chunk"], e["op"]))
    return dict(regions)


def layer_problems(rank: int, regions: Iterable[tuple[int, str, int]], moe_layers: list[int]) -> list[str]:
    """Why one logical rank's event regions are not one per MoE layer in each (step, phase) they cover."""
    layers: dict[tuple[int, str], set[int]] = defaultdict(set)
    for step, phase, layer in regions:
        layers[(step, phase)].add(layer)
    return [
        f"logical rank {rank} step {step} {phase}: regions of layers {sorted(seen)}, the MoE layers are {moe_layers}"
        for (step, phase), seen in layers.items()
        if seen != set(moe_layers)
    ]


def overlap_result(name: str, regions: dict[str, Sequence], scope: str, wrong_regions: list[str]) -> CheckResult:
    """Passes when the regions are the expected ones (``wrong_regions`` says why not) and every one
    overlaps; the detail gives the fraction that does, over ``scope``."""
    if not regions:
        return CheckResult(name, KIND, "fail", f"no {scope} recorded: no overlap to check")
    problems = [(None, problem) for problem in wrong_regions]
    problems += [(None, f"{label}: {problem}") for label, seq in regions.items() if (problem := overlap_problem(seq))]
    overlapping = len(regions) - len(problems) + len(wrong_regions)
    fraction = overlapping / len(regions)
    extra = {"regions": len(regions), "overlapping": overlapping, "fraction": fraction}
    summary = f"{overlapping} of {len(regions)} {scope} overlap ({fraction:.0%})"
    if problems:
        problems[0] = (None, f"{summary}; {problems[0][1]}")
    return problems_result(name, KIND, problems, f"{summary}: each chunk waits after the next chunk launches", extra)


def arm_overlap(name: str, arm: str, spec: ArmSpec, records: ArmRecords) -> CheckResult:
    """One arm's overlap: from its graph when traced, else from every logical rank's events."""
    if spec.emits(GRAPH):
        nodes = graph_nodes(name, KIND, arm, records)
        if isinstance(nodes, CheckResult):
            return nodes
        regions = graph_regions(nodes)
        roots = records.facts.chunk_roots if records.facts is not None else None
        expected = expected_regions(list(roots) if roots is not None else None)
        return overlap_result(name, regions, "graph regions", region_problems(regions, expected))
    empty = [rank for rank, events in sorted(records.events.items()) if not events]
    if not records.events or empty:
        return CheckResult(name, KIND, "fail", f"logical ranks {empty or 'all'} recorded no token-exchange events")
    regions: dict[str, Sequence] = {}
    moe_layers = list(records.facts.moe_layers or []) if records.facts is not None else []
    wrong = region_problems((), None) if not moe_layers else []
    for rank, events in sorted(records.events.items()):
        if reason := malformed_events(events):
            return CheckResult(name, KIND, "error", f"malformed events of logical rank {rank}: {reason}")
        own = event_regions(events, EAGER_SCHEDULED_PHASES)
        wrong += layer_problems(rank, own, moe_layers)
        regions |= {f"logical rank {rank} step {s} {p} layer {layer}": seq for (s, p, layer), seq in own.items()}
    return overlap_result(name, regions, "forward regions", wrong)


def _no_overlap_promised(spec: ArmSpec) -> str | None:
    """Why an arm's facts promise no overlap, or None."""
    chunks, buffer_sets = spec.facts.chunks, spec.facts.num_buffer_sets
    if chunks == 1:
        return "is not chunked (its facts: chunks = 1): nothing to overlap"
    if chunks is None or buffer_sets is None or chunks < 2 or buffer_sets < 2:
        return f"promises no overlap: chunks = {chunks}, num_buffer_sets = {buffer_sets}"
    return None


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    v.table(raw, dotted, ("kind", "name", "arms"))
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else kind
    wanted = "a chunked arm with chunks >= 2 and num_buffer_sets >= 2"
    return CheckSpec(kind, name, qualifying_arms(v, raw, dotted, arms, _no_overlap_promised, wanted))


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    return [arm_overlap(f"{arm}: {check.name}", arm, suite.arms[arm], records[arm]) for arm in check.arms]


register(CheckFamily((KIND,), parse, run, reads=(TOKEN_EXCHANGE,)))
