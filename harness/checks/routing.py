"""``routing-counts``: what one logical rank sends another is what that rank receives from it.

Every token-exchange launch records the rows its logical rank sends to each destination rank and
receives from each source rank (``send_counts``, ``recv_counts`` in ``events.rank<k>.jsonl``).
Both sides come from the routing: the sender's from its own top-k, the receiver's from the
per-expert count exchange. A count exchange that lands in the wrong slot, a stale count reused
across chunks or layers, or a permutation that drops tokens makes them disagree, and then rows go
to the wrong expert or are read from a buffer nobody filled. With forced-balanced routing the
counts are known in advance: every rank sends every rank tokens x top-k / EP rows per exchange.
"""

from __future__ import annotations

from collections import Counter

from harness.checks.registry import CheckFamily, arm_list, problems_result, register
from harness.records import ArmRecords, RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import TOKEN_EXCHANGE, ArmFacts, SuiteReader

KIND = "routing-counts"

Exchange = tuple  # (step, phase, layer, chunk, name, occurrence): one collective, on every rank


def _launches(events: list[dict]) -> dict[Exchange, dict]:
    """A rank's launch events keyed so that the same collective has the same key on every rank."""
    seen: Counter = Counter()
    keyed = {}
    for e in events:
        if e.get("op") != "launch":
            continue
        where = (e["step"], e["phase"], e["layer"], e["chunk"], e["name"])
        keyed[(*where, seen[where])] = e
        seen[where] += 1
    return keyed


def _where(key: Exchange) -> str:
    step, phase, layer, chunk, name, occurrence = key
    again = f" (#{occurrence + 1})" if occurrence else ""
    return f"step {step} {phase} layer {layer} chunk {chunk} {name}{again}"


def _exchange_problems(key: Exchange, launches: dict[int, dict], expected: int | None) -> list[str]:
    ranks = sorted(launches)
    problems = []
    for r, e in launches.items():
        for field in ("send_counts", "recv_counts"):
            counts = e.get(field)
            if not isinstance(counts, list) or len(counts) != len(ranks):
                problems.append(f"{_where(key)}: logical rank {r} recorded {field} {counts!r}, not {len(ranks)} counts")
            elif expected is not None and any(c != expected for c in counts):
                problems.append(
                    f"{_where(key)}: logical rank {r} {field} {counts}, forced-balanced routing gives {expected} each"
                )
    if problems:
        return problems
    for i in ranks:
        for j in ranks:
            sent, received = launches[i]["send_counts"][j], launches[j]["recv_counts"][i]
            if sent != received:
                problems.append(
                    f"{_where(key)}: logical rank {i} sends {sent} rows to logical rank {j},"
                    f" which receives {received} from it"
                )
    return problems


def check_routing_counts(name: str, events: dict[int, list[dict]], expected: int | None = None) -> CheckResult:
    """For every exchange, rank i's send count to j equals j's receive count from i (and, with
    forced-balanced routing, ``expected``); an exchange missing on a rank fails, and so do no launches."""
    try:
        keyed = {r: _launches(evs) for r, evs in sorted(events.items())}
    except (KeyError, AttributeError) as e:
        return CheckResult(name, KIND, "error", f"malformed events: {e!r}")
    # In the order they ran: by step, then as the lowest rank that has them launched them.
    exchanges = sorted(dict.fromkeys(key for launches in keyed.values() for key in launches), key=lambda k: k[0])
    if not exchanges:
        return CheckResult(name, KIND, "fail", "no token-exchange launches recorded: no routing counts to check")
    problems: list[tuple[int, str]] = []
    for key in exchanges:
        absent = [r for r in sorted(keyed) if key not in keyed[r]]
        if absent:
            problems.append((key[0], f"{_where(key)}: no such launch on logical rank {', '.join(map(str, absent))}"))
            continue
        problems += [(key[0], p) for p in _exchange_problems(key, {r: keyed[r][key] for r in keyed}, expected)]
    balanced = f", each {expected} rows as forced-balanced routing gives" if expected is not None else ""
    passed = f"{len(exchanges)} exchanges on {len(keyed)} logical ranks: every send count matches its receive{balanced}"
    return problems_result(name, KIND, problems, passed)


def balanced_count(facts: ArmFacts, ep: int) -> int | None:
    """Rows each of ``ep`` logical ranks sends each other per exchange under forced-balanced routing
    (every expert gets tokens x top-k / experts of a chunk), from the arm's facts; None when routing
    is learned."""
    if not facts.forced_balanced:
        return None
    rows = facts.tokens_per_step // facts.chunks * facts.experts_per_token
    return rows // ep


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    v.table(raw, dotted, ("kind", "name", "arms"))
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else KIND
    return CheckSpec(kind, name, arm_list(v, raw, dotted, arms))


def arm_routing(name: str, spec: ArmSpec, records: ArmRecords) -> CheckResult:
    facts = records.facts
    if facts is None:
        return CheckResult(name, KIND, "fail", "the arm has no arm.json with its facts: no routing to expect")
    if facts.forced_balanced and None in (facts.experts_per_token, facts.tokens_per_step, facts.chunks):
        why = "arm.json records no experts_per_token, tokens_per_step or chunks: no balanced count to expect"
        return CheckResult(name, KIND, "fail", why)
    return check_routing_counts(name, records.events, balanced_count(facts, spec.logical_ranks))


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    return [arm_routing(f"{arm}: {check.name}", suite.arms[arm], records[arm]) for arm in check.arms]


register(CheckFamily((KIND,), parse, run, reads=(TOKEN_EXCHANGE,)))
