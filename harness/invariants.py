"""Token-exchange invariants, checked on the launch/wait events each rank records (ARCHITECTURE §5).

Each check targets a bug that chunked asynchronous expert parallelism invites: a wait with no
launch or a launch never waited (a hang, or a read of a buffer nobody filled), a buffer set reused
while an exchange on it is in flight (silent corruption), a missing or extra exchange, chunks of
one layer exchanging differently, and eager and graph chunking issuing different exchanges.

The version-protocol invariants of a delayed (versioned) pipeline are checked on its update
records (one metrics.jsonl line per optimizer update): every batch applied exactly once, the
gradient ages the pipeline's delay implies, and sane importance-correction statistics.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

from harness.compare import CheckResult, format_steps

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
_MAX_LISTED = 20

Event = dict
Problem = tuple[int | None, str]  # (step, message), in the order found
Plan = dict[tuple[int, str], int]  # (step, phase) -> exchanges per MoE layer and chunk


def _where(e: Event) -> str:
    return f"step {e['step']} {e['phase']} layer {e['layer']} chunk {e['chunk']}"


def _describe(e: Event) -> str:
    return f"{_where(e)} {e['kind']} {e['op']} on buffer set {e['buffer_set']} ({e['rows']} rows)"


def _exchange(e: Event) -> tuple:
    """Identifies one exchange: its launch and its wait share this key."""
    return e["step"], e["phase"], e["layer"], e["chunk"], e["kind"], e["buffer_set"]


def _malformed(events: list[Event]) -> str | None:
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


def _result(
    name: str, problems: list[Problem], passed: str, kind: str = KIND, extra: dict | None = None
) -> CheckResult:
    if not problems:
        return CheckResult(name, kind, "pass", passed, extra=extra or {})
    step, message = problems[0]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    listed = {"problems": [m for _, m in problems[:_MAX_LISTED]], "problem_count": len(problems)}
    return CheckResult(name, kind, "fail", message + more, first_divergent_step=step, extra={**(extra or {}), **listed})


def _error(name: str, reason: str) -> CheckResult:
    return CheckResult(name, KIND, "error", f"malformed events: {reason}")


def check_launch_wait_pairing(events: list[Event]) -> CheckResult:
    """Every launch is waited exactly once, after it, on the same exchange and buffer set."""
    if reason := _malformed(events):
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
    return _result(PAIRING, [(step, msg) for _, step, msg in sorted(found)], passed)


def check_buffer_reuse(events: list[Event]) -> CheckResult:
    """No launch on a (kind, buffer set) while an earlier exchange on it is still unwaited."""
    if reason := _malformed(events):
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
    return _result(BUFFER_REUSE, problems, passed)


def training_plan(steps: int | Iterable[int], recompute: bool = False) -> Plan:
    """Plain training: one forward and one backward exchange (and one recompute) per step.

    steps is a count (steps 0..steps-1) or the step numbers themselves.
    """
    step_list = range(steps) if isinstance(steps, int) else sorted(steps)
    phases = ("fwd", "recompute", "bwd") if recompute else ("fwd", "bwd")
    return {(s, p): 1 for s in step_list for p in phases}


def pipeline_plan(batches: int, delay: int, *, replay: bool, always_correct: bool) -> Plan:
    """The delayed pipeline of ``harness.reference.pipeline``; its events' step is the tick.

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
    """The delayed oracle of ``harness.reference.delayed_oracle``; its events' step is the tick.

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
    if reason := _malformed(events):
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
    return _result(COUNTS, problems, passed)


def check_chunk_signatures(events: list[Event]) -> CheckResult:
    """Within each (step, phase, layer) every chunk issues the same (kind, op, rows) sequence."""
    if reason := _malformed(events):
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
    return _result(
        CHUNK_SIGNATURES, problems, f"{len(groups)} (step, phase, layer) groups, chunks exchange identically"
    )


def check_same_event_sequence(
    events_a: list[Event], events_b: list[Event], *, label_a: str, label_b: str
) -> CheckResult:
    """Two arms (eager vs graph chunking) issue identical exchanges in identical order; seq may be offset."""
    for label, events in ((label_a, events_a), (label_b, events_b)):
        if reason := _malformed(events):
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


# --- the version protocol of a delayed pipeline, on its update records ----------------------

EXACTLY_ONCE = "exactly-once"
STALENESS_AGES = "staleness-ages"
CORRECTION_STATS = "correction-stats"
# The reference clamps importance weights to [0, 5]: clamp(exp(lp_now - lp_then), 0, 5).
CORRECTION_CLIP = 5.0

Update = dict  # one metrics.jsonl record of a versioned arm: step, batches_applied, ages, correction_*


def _int_lists(updates: list[Update], field: str) -> str | None:
    """Why ``field`` is not a list of ints in every update, or None."""
    for u in updates:
        values = u.get(field)
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return f"step {u.get('step')}: '{field}' must be a list of integers, got {values!r}"
    return None


def check_exactly_once(updates: list[Update], batches: Iterable[int]) -> CheckResult:
    """Every batch's gradient is applied exactly once: none twice (a gradient staged or committed
    again), none lost (a forward never backwarded, a pipeline not drained), none from nowhere."""
    if reason := _int_lists(updates, "batches_applied"):
        return CheckResult(EXACTLY_ONCE, EXACTLY_ONCE, "error", f"malformed records: {reason}")
    applied_at: dict[int, list[int]] = defaultdict(list)
    for u in updates:
        for batch in u["batches_applied"]:
            applied_at[batch].append(u["step"])
    expected = sorted(batches)
    problems: list[Problem] = []
    for batch in sorted(applied_at.keys() | set(expected)):
        steps = applied_at.get(batch, [])
        if batch not in expected:
            problems.append(
                (steps[0], f"batch {batch} applied at step {format_steps(steps)} but is not a batch of this run")
            )
        elif not steps:
            problems.append((None, f"batch {batch} never applied"))
        elif len(steps) > 1:
            problems.append(
                (steps[1], f"batch {batch} applied {len(steps)} times, at steps {', '.join(map(str, steps))}")
            )
    passed = f"{len(expected)} batches ({format_steps(expected)}) each applied exactly once over {len(updates)} updates"
    return _result(EXACTLY_ONCE, problems, passed, kind=EXACTLY_ONCE)


def _ages_seen(updates: list[Update]) -> dict[int, list[int]]:
    seen: dict[int, list[int]] = defaultdict(list)
    for u in updates:
        for age in sorted(set(u["ages"])):
            seen[age].append(u["step"])
    return dict(sorted(seen.items()))


def check_staleness_ages(updates: list[Update], delay: int) -> CheckResult:
    """The i-th update (from 0) applies gradients of age min(i, delay), and only those.

    The first ``delay`` forwards ran while the pipeline filled, before any update, so they are
    younger; every later gradient is exactly ``delay`` updates old, the drained ones included.
    """
    if reason := _int_lists(updates, "ages"):
        return CheckResult(STALENESS_AGES, STALENESS_AGES, "error", f"malformed records: {reason}")
    ordered = sorted(updates, key=lambda u: u["step"])
    problems: list[Problem] = []
    for i, u in enumerate(ordered):
        want = min(i, delay)
        if not u["ages"] or any(age != want for age in u["ages"]):
            fill = f" (update {i + 1} of the pipeline fill)" if i < delay else ""
            problems.append((u["step"], f"step {u['step']}: ages {u['ages']}, expected {want}{fill} at delay {delay}"))
    seen = _ages_seen(ordered)
    shown = ", ".join(
        f"{age} at step{'s' if len(steps) > 1 else ''} {format_steps(steps)}" for age, steps in seen.items()
    )
    fill = f"; steps {format_steps([u['step'] for u in ordered[:delay]])} fill the pipeline" if delay else ""
    passed = f"ages seen: {shown} (delay {delay}{fill})"
    return _result(STALENESS_AGES, problems, passed, kind=STALENESS_AGES, extra={"ages_seen": seen})


def _stat_problem(value: object, lo: float, hi: float) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {value!r}, not a number"
    if not math.isfinite(value):
        return f"is non-finite ({value!r})"
    if not lo <= value <= hi:
        return f"{value!r} is outside [{lo:g}, {hi:g}]"
    return None


def check_correction_stats(
    updates: list[Update], correction: str, delay: int, clip: float = CORRECTION_CLIP
) -> CheckResult:
    """Reports the importance correction's mean weight and clipped fraction per step.

    Fails on values no correct weighting can produce (non-finite, a mean weight outside
    [0, clip], a clipped fraction outside [0, 1]) and on a correction that did nothing:
    ``always`` must report statistics at every step and, with a delay, weights that differ from 1
    on the stale updates (a weight stuck at exactly 1 is a correction never applied);
    ``when_available`` must report them at least once. A step without statistics under
    ``when_available`` (no applied batch had current logprobs) is reported, not failed.
    """
    if correction == "off":
        raise ValueError("check_correction_stats: correction is off, there is nothing to check")
    ordered = sorted(updates, key=lambda u: u["step"])
    per_step = [
        {"step": u["step"], "mean": u.get("correction_mean"), "clipped_frac": u.get("correction_clipped_frac")}
        for u in ordered
    ]
    problems: list[Problem] = []
    for row in per_step:
        if row["mean"] is None and row["clipped_frac"] is None:
            if correction == "always":
                problems.append(
                    (row["step"], f'step {row["step"]}: no correction statistics under correction = "always"')
                )
            continue
        for key, hi in (("mean", clip), ("clipped_frac", 1.0)):
            if problem := _stat_problem(row[key], 0.0, hi):
                problems.append((row["step"], f"step {row['step']}: correction {key.replace('_', ' ')} {problem}"))
    reported = [row for row in per_step if row["mean"] is not None]
    if not reported and not problems:
        problems.append((None, f"no step of {len(per_step)} reported correction statistics under {correction}"))
    if correction == "always" and delay > 0 and not problems:
        stale = [row for row, u in zip(per_step, ordered) if any(age > 0 for age in u.get("ages") or [])]
        if not stale:
            problems.append((None, f"no stale update among {len(per_step)} at delay {delay}: nothing was corrected"))
        elif all(row["mean"] == 1.0 for row in stale):
            steps = format_steps([row["step"] for row in stale])
            problems.append(
                (
                    stale[0]["step"],
                    f"mean weight exactly 1 at every stale step ({steps}): the correction was not applied",
                )
            )
    if problems:
        return _result(CORRECTION_STATS, problems, "", kind=CORRECTION_STATS, extra={"per_step": per_step})
    absent = [row["step"] for row in per_step if row["mean"] is None]
    means = [row["mean"] for row in reported]
    parts = [
        f"{correction}: mean weight {min(means):.4f} to {max(means):.4f} (average {math.fsum(means) / len(means):.4f}),"
        f" clipped fraction at most {max(row['clipped_frac'] for row in reported):.3g},"
        f" at steps {format_steps([row['step'] for row in reported])}"
    ]
    if absent:
        parts.append(f"no corrected tokens at steps {format_steps(absent)}")
    return CheckResult(CORRECTION_STATS, CORRECTION_STATS, "pass", "; ".join(parts), extra={"per_step": per_step})
