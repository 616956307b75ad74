"""Token-exchange invariants, checked on the launch/wait events each rank records (docs/architecture.md,
"Token-exchange invariants").

Each check targets a bug that chunked asynchronous expert parallelism invites: a wait with no
launch or a launch never waited (a hang, or a read of a buffer nobody filled), a buffer set reused
while an exchange on it is in flight (silent corruption), a missing or extra exchange, chunks of
one layer exchanging differently, and eager and graph chunking issuing different exchanges.

Kinds: ``token-exchange-invariants`` (one arm at a time, against the exchanges its training
implies) and ``same-event-sequence`` (two arms issue the same exchanges in the same order).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

from harness.checks.registry import CheckFamily, Problem, arm_list, problems_result, register
from harness.records import ArmRecords, RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import TOKEN_EXCHANGE, VERSIONED, SuiteReader

KIND = "token-exchange-invariants"
PAIRING = "token-exchange:launch-wait-pairing"
BUFFER_REUSE = "token-exchange:buffer-reuse"
COUNTS = "token-exchange:expected-counts"
CHUNK_SIGNATURES = "token-exchange:chunk-signatures"
SAME_SEQUENCE = "same-event-sequence"

PHASES = ("fwd", "recompute", "bwd")
KINDS = ("dispatch", "combine")
OPS = ("launch", "wait")
_INT_FIELDS = ("step", "layer", "chunk", "buffer_set", "seq", "rows")
# What must match between two arms: everything but the seq numbering.
SEQUENCE_FIELDS = ("step", "phase", "layer", "chunk", "kind", "op", "buffer_set", "rows")

Event = dict
Plan = dict[tuple[int, str], int]  # (step, phase) -> exchanges per MoE layer and chunk


def _where(e: Event) -> str:
    return f"step {e['step']} {e['phase']} layer {e['layer']} chunk {e['chunk']}"


def _describe(e: Event) -> str:
    return f"{_where(e)} {e['kind']} {e['op']} on buffer set {e['buffer_set']} ({e['rows']} rows)"


def _exchange(e: Event) -> tuple:
    """Identifies one exchange: its launch and its wait share this key."""
    return e["step"], e["phase"], e["layer"], e["chunk"], e["kind"], e["buffer_set"]


def malformed_events(events: list[Event]) -> str | None:
    """Why the event list cannot be checked (a missing field, a bad value, out of order), or None."""
    last_seq = None
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            return f"event {i} is not an object"
        for key in _INT_FIELDS:
            if isinstance(e.get(key), bool) or not isinstance(e.get(key), int):
                return f"event {i}: '{key}' must be an integer, got {e.get(key)!r}"
        for key, allowed in (("phase", PHASES), ("kind", KINDS), ("op", OPS)):
            if e.get(key) not in allowed:
                return f"event {i}: '{key}' must be one of {allowed}, got {e.get(key)!r}"
        if last_seq is not None and e["seq"] <= last_seq:
            return f"event {i}: seq {e['seq']} does not increase (previous {last_seq}): events out of emission order"
        last_seq = e["seq"]
    return None


def _error(name: str, reason: str) -> CheckResult:
    return CheckResult(name, KIND, "error", f"malformed events: {reason}")


def check_launch_wait_pairing(events: list[Event]) -> CheckResult:
    """Every launch is waited exactly once, after it, on the same exchange and buffer set."""
    if reason := malformed_events(events):
        return _error(PAIRING, reason)
    pending: dict[tuple, list[int]] = defaultdict(list)
    found: list[tuple[int, int, str]] = []  # (event index, step, message)
    for i, e in enumerate(events):
        if e["op"] == "launch":
            pending[_exchange(e)].append(i)
        elif pending[_exchange(e)]:
            pending[_exchange(e)].pop(0)
        else:
            found.append((i, e["step"], f"event {i}: wait without a launch: {_describe(e)}"))
    for indices in pending.values():
        found += [(i, events[i]["step"], f"event {i}: launch never waited: {_describe(events[i])}") for i in indices]
    launches = sum(e["op"] == "launch" for e in events)
    passed = f"{launches} launches, each waited once on the same exchange and buffer set"
    return problems_result(PAIRING, KIND, [(step, msg) for _, step, msg in sorted(found)], passed)


def check_buffer_reuse(events: list[Event]) -> CheckResult:
    """No launch on a (kind, buffer set) while an earlier exchange on it is still unwaited."""
    if reason := malformed_events(events):
        return _error(BUFFER_REUSE, reason)
    in_flight: dict[tuple, list[int]] = defaultdict(list)  # (kind, buffer_set) -> launch indices
    problems: list[Problem] = []
    for i, e in enumerate(events):
        slot = (e["kind"], e["buffer_set"])
        if e["op"] == "launch":
            if in_flight[slot]:
                j = in_flight[slot][0]
                problems.append(
                    (
                        e["step"],
                        (
                            f"{e['kind']} buffer set {e['buffer_set']} reused at {_where(e)} (event {i})"
                            f" while {_where(events[j])} is in flight (launched at event {j}, not yet waited)"
                        ),
                    )
                )
            in_flight[slot].append(i)
        else:
            match = [j for j in in_flight[slot] if _exchange(events[j]) == _exchange(e)]
            if match:
                in_flight[slot].remove(match[0])
    used = ", ".join(f"{k} {sorted({e['buffer_set'] for e in events if e['kind'] == k})}" for k in KINDS)
    passed = f"{len(events)} events, no buffer set reused while in flight (buffer sets used: {used})"
    return problems_result(BUFFER_REUSE, KIND, problems, passed)


def training_plan(steps: int | Iterable[int], recompute: bool = False) -> Plan:
    """Plain training: one forward and one backward exchange (and one recompute) per step.

    steps is a count (steps 0..steps-1) or the step numbers themselves.
    """
    step_list = range(steps) if isinstance(steps, int) else sorted(steps)
    phases = ("fwd", "recompute", "bwd") if recompute else ("fwd", "bwd")
    return {(s, p): 1 for s in step_list for p in phases}


def pipeline_plan(batches: int, delay: int, *, replay: bool, always_correct: bool) -> Plan:
    """The delayed pipeline of the reference (its ``pipeline.py``); its events' step is the tick.

    Tick t forwards batch t while t < batches and, from tick ``delay`` on, backwards the forward of
    tick t - delay (replay re-runs that forward first, as "recompute"). The ``always`` correction
    runs one more forward, under the current weights, for each backward whose forward ran at an
    older version: every one but the first when delay > 0 (the first ran before any update).
    """
    plan: Counter = Counter()
    for tick in range(batches + delay):
        if tick < batches:
            plan[tick, "fwd"] += 1
        if tick >= delay:
            plan[tick, "bwd"] += 1
            if replay:
                plan[tick, "recompute"] += 1
            if always_correct and 0 < delay < tick:
                plan[tick, "fwd"] += 1
    return dict(plan)


def delayed_oracle_plan(batches: int, delay: int, *, always_correct: bool) -> Plan:
    """The delayed oracle of the reference (its ``delayed_oracle.py``); its events' step is the tick.

    Nothing runs while the pipeline fills. Tick ``t >= delay`` applies batch ``t - delay``: one
    forward at the old weights and its backward, after one more forward at the current weights
    under ``always`` for every batch but the first when delay > 0 (the first one's weights are current).
    """
    plan: Counter = Counter()
    for tick in range(delay, batches + delay):
        plan[tick, "fwd"] += 1 + (always_correct and 0 < delay < tick)
        plan[tick, "bwd"] += 1
    return dict(plan)


def check_planned_counts(events: list[Event], *, plan: Plan, moe_layers: list[int], chunks: int) -> CheckResult:
    """``plan[step, phase]`` dispatch and combine launches per (step, phase, MoE layer, chunk), nothing else."""
    if reason := malformed_events(events):
        return _error(COUNTS, reason)
    expected = Counter(
        {
            (s, p, layer, c, k): n
            for (s, p), n in plan.items()
            for layer in moe_layers
            for c in range(chunks)
            for k in KINDS
        }
    )
    actual = Counter((e["step"], e["phase"], e["layer"], e["chunk"], e["kind"]) for e in events if e["op"] == "launch")
    places = sorted({key[:4] for key in expected | actual}, key=lambda k: (k[0], PHASES.index(k[1]), k[2], k[3]))
    problems: list[Problem] = []
    for s, p, layer, c in places:
        got = [actual[(s, p, layer, c, k)] for k in KINDS]
        want = [expected[(s, p, layer, c, k)] for k in KINDS]
        if got != want:
            state = "missing" if not any(got) else "unexpected" if not any(want) else "wrong count"
            counts = ", ".join(f"{k} {g} (expected {w})" for k, g, w in zip(KINDS, got, want))
            problems.append((s, f"step {s} {p} layer {layer} chunk {c}: {state}: {counts} launches"))
    per_phase = ", ".join(
        f"{p} {sum(n for (_, q), n in plan.items() if q == p)}" for p in PHASES if any(q == p for _, q in plan)
    )
    passed = (
        f"{sum(actual.values())} launches = {sum(plan.values())} exchanges ({per_phase}) x"
        f" {len(moe_layers)} MoE layers x {chunks} chunks x dispatch+combine"
    )
    return problems_result(COUNTS, KIND, problems, passed)


def check_chunk_signatures(events: list[Event]) -> CheckResult:
    """Within each (step, phase, layer) every chunk issues the same (kind, op, rows) sequence."""
    if reason := malformed_events(events):
        return _error(CHUNK_SIGNATURES, reason)
    groups: dict[tuple, dict[int, list[tuple]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        groups[e["step"], e["phase"], e["layer"]][e["chunk"]].append((e["kind"], e["op"], e["rows"]))
    problems: list[Problem] = []
    for (s, p, layer), by_chunk in groups.items():
        ref_chunk = min(by_chunk)
        ref = by_chunk[ref_chunk]
        for chunk, sig in sorted(by_chunk.items()):
            if sig == ref:
                continue
            k = next((k for k, (x, y) in enumerate(zip(sig, ref)) if x != y), min(len(sig), len(ref)))
            mine = " ".join(map(str, sig[k])) if k < len(sig) else "nothing"
            theirs = " ".join(map(str, ref[k])) if k < len(ref) else "nothing"
            problems.append(
                (
                    s,
                    (
                        f"step {s} {p} layer {layer}: chunk {chunk} differs from chunk {ref_chunk} at its"
                        f" exchange event {k}: {mine} vs {theirs} (kind op rows)"
                    ),
                )
            )
    return problems_result(
        CHUNK_SIGNATURES, KIND, problems, f"{len(groups)} (step, phase, layer) groups, chunks exchange identically"
    )


def check_same_event_sequence(
    events_a: list[Event], events_b: list[Event], *, label_a: str, label_b: str
) -> CheckResult:
    """Two arms (eager vs graph chunking) issue identical exchanges in identical order; seq may be offset."""
    for label, events in ((label_a, events_a), (label_b, events_b)):
        if reason := malformed_events(events):
            return CheckResult(SAME_SEQUENCE, SAME_SEQUENCE, "error", f"malformed events in arm '{label}': {reason}")
    if not events_a and not events_b:
        return CheckResult(SAME_SEQUENCE, SAME_SEQUENCE, "fail", f"no events in arm '{label_a}' or arm '{label_b}'")
    seq_a = [{f: e[f] for f in SEQUENCE_FIELDS} for e in events_a]
    seq_b = [{f: e[f] for f in SEQUENCE_FIELDS} for e in events_b]
    i = next((i for i, (x, y) in enumerate(zip(seq_a, seq_b)) if x != y), None)
    if i is not None:
        detail = f"event {i} differs: {label_a}: {_describe(seq_a[i])}; {label_b}: {_describe(seq_b[i])}"
        values = {label_a: seq_a[i], label_b: seq_b[i]}
        return CheckResult(SAME_SEQUENCE, SAME_SEQUENCE, "fail", detail, seq_a[i]["step"], values, extra={"index": i})
    if len(seq_a) != len(seq_b):
        n = min(len(seq_a), len(seq_b))
        longer, seq = (label_a, seq_a) if len(seq_a) > n else (label_b, seq_b)
        detail = (
            f"arm '{label_a}' has {len(seq_a)} events, arm '{label_b}' has {len(seq_b)};"
            f" first extra in '{longer}' at event {n}: {_describe(seq[n])}"
        )
        return CheckResult(SAME_SEQUENCE, SAME_SEQUENCE, "fail", detail, seq[n]["step"], extra={"index": n})
    return CheckResult(
        SAME_SEQUENCE, SAME_SEQUENCE, "pass", f"{len(seq_a)} events identical in arms '{label_a}' and '{label_b}'"
    )


def _merge(name: str, per_rank: dict[int, CheckResult]) -> CheckResult:
    """One result for all ranks: the worst status, naming the first rank that has it."""
    if not per_rank:
        return CheckResult(name, KIND, "fail", "no ranks recorded any events")
    for status in ("error", "fail"):
        bad = [r for r, res in per_rank.items() if res.status == status]
        if bad:
            first = per_rank[bad[0]]
            others = f"; ranks {bad[1:]} also {status}" if len(bad) > 1 else ""
            extra = {**first.extra, "failing_ranks": bad}
            return CheckResult(
                name,
                KIND,
                status,
                f"rank {bad[0]}: {first.detail}{others}",
                first.first_divergent_step,
                first.values,
                extra=extra,
            )
    first_rank = min(per_rank)
    return CheckResult(name, KIND, "pass", f"all {len(per_rank)} ranks: {per_rank[first_rank].detail}")


def check_planned_exchanges(
    events_by_rank: dict[int, list[Event]], *, plan: Plan, moe_layers: list[int], chunks: int
) -> list[CheckResult]:
    """Runs the four single-arm invariants on every rank's events; one merged result per invariant.

    A rank with no events fails every invariant, and so do no MoE layers: an empty log must never
    pass for a run that should have exchanged tokens.
    """
    checks: list[tuple[str, Callable[[list[Event]], CheckResult]]] = [
        (PAIRING, check_launch_wait_pairing),
        (BUFFER_REUSE, check_buffer_reuse),
        (COUNTS, lambda ev: check_planned_counts(ev, plan=plan, moe_layers=moe_layers, chunks=chunks)),
        (CHUNK_SIGNATURES, check_chunk_signatures),
    ]
    results = []
    for name, check in checks:
        per_rank = {}
        for rank in sorted(events_by_rank):
            events = events_by_rank[rank]
            if not moe_layers:
                per_rank[rank] = CheckResult(name, KIND, "fail", "no MoE layers: no exchange to check")
            elif not events:
                per_rank[rank] = CheckResult(name, KIND, "fail", "no token-exchange events recorded")
            else:
                per_rank[rank] = check(events)
        results.append(_merge(name, per_rank))
    return results


def same_events(name: str, a: ArmRecords, b: ArmRecords, label_a: str, label_b: str) -> CheckResult:
    """check_same_event_sequence on every logical rank; the first rank that differs is reported."""
    results = {
        rank: check_same_event_sequence(
            a.events.get(rank, []), b.events.get(rank, []), label_a=label_a, label_b=label_b
        )
        for rank in sorted(a.events.keys() | b.events.keys())
    }
    bad = next((r for r in results.values() if r.status != "pass"), None)
    if bad is not None:
        rank = next(k for k, v in results.items() if v is bad)
        return dataclasses.replace(bad, name=name, detail=f"logical rank {rank}: {bad.detail}")
    total = sum(len(events) for events in a.events.values())
    return CheckResult(name, SAME_SEQUENCE, "pass", f"{total} events identical on all {len(results)} logical ranks")


def arm_exchanges(arm: str, spec: ArmSpec, records: ArmRecords) -> list[CheckResult]:
    """The token-exchange invariants of one arm, against the exchanges its facts imply: a plain
    step's, or those of a delayed pipeline's order (ArmFacts.pipeline)."""
    facts = records.facts
    if facts is None or not facts.moe_layers:
        what = "records no MoE layers" if facts is not None else "has no arm.json with its MoE layers"
        return [CheckResult(f"{arm}: token-exchange", KIND, "fail", f"arm '{arm}' {what}: no exchange to check")]
    steps = records.metrics.index.tolist()
    always = facts.correction == "always"
    if spec.emits(VERSIONED) and facts.pipeline == "delayed-oracle":
        plan = delayed_oracle_plan(len(steps), facts.delay, always_correct=always)
    elif spec.emits(VERSIONED):
        plan = pipeline_plan(len(steps), facts.delay, replay=facts.recomputes, always_correct=always)
    else:
        plan = training_plan(steps)
    results = check_planned_exchanges(records.events, plan=plan, moe_layers=list(facts.moe_layers), chunks=facts.chunks)
    return [dataclasses.replace(r, name=f"{arm}: {r.name}") for r in results]


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    v.table(raw, dotted, ("kind", "name", "arms"))
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else None
    if kind == KIND:
        return CheckSpec(kind, name or "token-exchange", arm_list(v, raw, dotted, arms))
    a, b = v.arm_pair(raw, dotted, arms)
    return CheckSpec(kind, name or f"{a} vs {b}: events", (a, b))


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    if check.kind == KIND:
        return [r for arm in check.arms for r in arm_exchanges(arm, suite.arms[arm], records[arm])]
    a, b = check.arms
    return [same_events(check.name, records[a], records[b], a, b)]


register(CheckFamily((KIND, SAME_SEQUENCE), parse, run, reads=(TOKEN_EXCHANGE,)))
