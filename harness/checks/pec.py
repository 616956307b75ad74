"""``pec-invariants``: the gradient all-to-all of a PEC embedding, judged on the events its ranks record.

PEC (torchrec's pipelined embedding collection, PR #4498) shards an embedding row-wise over the
ranks and splits each batch's embedding gradient in two: OL, the rows batch N+1 looks up again, and
NOL, the rest (on the last batch everything is OL). Each part travels to the rows' owners by an
all-to-all that only the train pipeline starts, never autograd. Batch N's pipeline call runs: OL
lookups of N; start NOL N-1; forward N; apply NOL N-1; backward N; start OL N; dense optimizer step
(overlapping that all-to-all); apply OL N; hand NOL N to call N+1, or drain it in place on the last
batch. A sequential trainer starts and applies both parts of N right after backward N.

Each logical rank k records ``pec.rank<k>.jsonl``, one event per line, in the order it ran::

    {"seq": int, "call": int, "op": "lookup" | "start" | "apply" | "backward_done" | "optimizer_step",
     "batch": int, "part": "OL" | "NOL" | null, "module": str | null, "rows": int, "ids": [int, ...],
     "in_autograd": bool}

``call`` is the pipeline progress call (1-based, the batch it progresses), ``batch`` the batch the
event concerns (for start and apply, the gradient's batch), ``ids`` the distinct row ids (sorted; a
start lists the rows this rank sends, an apply those its shard receives and updates).

One result per invariant per arm, each message naming batch, part and call:

* ``pec:no-autograd-start``: no gradient all-to-all starts inside autograd (the pre-#4498 order
  fired OL from the embedding's backward);
* ``pec:one-ol-one-nol``: per module, exactly one OL and one NOL start per batch (2B for B
  batches) on every rank, each applied once after it, and the rows applied (on the owners) are the
  rows started;
* ``pec:starts-per-call``: a pipelined call starts 1 all-to-all first (OL 1), 2 in steady state (NOL
  N-1, OL N) and 3 last (with the drained NOL B); a sequential call starts 2;
* ``pec:ol-window``: OL(N) starts after backward N is done and before optimizer step N;
* ``pec:nol-handoff``: every part starts and is applied in the call its trainer schedules it: OL N
  in call N; NOL N in call N+1 when pipelined (the last batch's drained in its own call), in call N
  when sequential;
* ``pec:fresh-lookups``: every row looked up for batch M has received every update of an earlier
  batch: all applies of batches < M holding that id come before the lookup.

**A common order for the last one.** An id's update is applied on its owner's shard and recorded
in the owner's file, while the lookup is recorded by the rank whose batch holds the id; their seqs
are per rank and not comparable. But every logical rank runs the same pipeline: the same ops, for
the same calls, batches, parts and modules, in the same order (each all-to-all is a collective
every rank starts and waits, and a lookup of a row is served by its owner). So the i-th event of
every rank is the same step of the pipeline, and i is a clock common to all ranks: an apply at
position i on its owner precedes a lookup at position j on any rank exactly when i < j. The check
first verifies this lockstep (every rank's sequence of (call, op, batch, part, module) identical)
and fails, naming the first position where two ranks differ, when it does not hold.

No events, a rank without events, or no start or lookup at all fails; a malformed event is an error.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable

from harness.checks.registry import CheckFamily, Problem, problems_result, qualifying_arms, register
from harness.records import RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import PEC, SuiteReader

KIND = "pec-invariants"
NO_AUTOGRAD = "pec:no-autograd-start"
ONE_EACH = "pec:one-ol-one-nol"
PER_CALL = "pec:starts-per-call"
OL_WINDOW = "pec:ol-window"
NOL_HANDOFF = "pec:nol-handoff"
FRESH = "pec:fresh-lookups"
INVARIANTS = (NO_AUTOGRAD, ONE_EACH, PER_CALL, OL_WINDOW, NOL_HANDOFF, FRESH)

PIPELINED, SEQUENTIAL, LEGACY = "pipelined", "sequential", "legacy"
OPS = ("lookup", "start", "apply", "backward_done", "optimizer_step")
PARTS = ("OL", "NOL")
_GRADIENT_OPS = ("start", "apply")
_ROW_OPS = ("lookup", "start", "apply")

Event = dict
RankEvents = dict[int, list[Event]]  # logical rank -> its events in seq order


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _event_problem(e: object) -> str | None:
    """Why one event does not have the recorded format, or None."""
    if not isinstance(e, dict):
        return "not an object"
    for key in ("seq", "call", "batch", "rows"):
        if not _is_int(e.get(key)):
            return f"'{key}' must be an integer, got {e.get(key)!r}"
    if e["call"] < 1 or e["batch"] < 1:
        return f"call and batch count from 1, got call {e['call']}, batch {e['batch']}"
    if e.get("op") not in OPS:
        return f"'op' must be one of {OPS}, got {e.get('op')!r}"
    parts = PARTS if e["op"] in _GRADIENT_OPS else (*PARTS, None) if e["op"] == "lookup" else (None,)
    if e.get("part") not in parts:
        return f"'part' of a {e['op']} must be one of {parts}, got {e.get('part')!r}"
    module = e.get("module")
    if not isinstance(module, str) and (e["op"] in _GRADIENT_OPS or module is not None):
        return f"'module' of a {e['op']} must be a {'name' if e['op'] in _GRADIENT_OPS else 'name or null'}"
    ids = e.get("ids")
    if not isinstance(ids, list) or not all(_is_int(i) for i in ids) or ids != sorted(set(ids)):
        return f"'ids' must be distinct integers in ascending order, got {ids!r}"
    if e["rows"] != len(ids) or (e["op"] not in _ROW_OPS and ids):
        return f"'rows' {e['rows']} must count the {len(ids)} ids (none for a {e['op']})"
    if not isinstance(e.get("in_autograd"), bool):
        return f"'in_autograd' must be true or false, got {e.get('in_autograd')!r}"
    return None


def malformed_pec_events(events: RankEvents) -> str | None:
    """Why the events cannot be judged (a field missing or of the wrong type, seq not increasing), or None."""
    for rank, rank_events in sorted(events.items()):
        for i, e in enumerate(rank_events):
            if problem := _event_problem(e):
                return f"logical rank {rank} event {i}: {problem}"
            if i and e["seq"] <= rank_events[i - 1]["seq"]:
                previous = rank_events[i - 1]["seq"]
                return f"logical rank {rank} event {i}: seq {e['seq']} does not increase (previous {previous})"
    return None


def _what(e: Event) -> str:
    """``NOL start of batch 3 (call 4)``: the op, and the part and batch it concerns."""
    part = f"{e['part']} " if e["part"] else ""
    module = f" {e['module']}" if e["op"] in _GRADIENT_OPS and e["module"] != "model.embed_tokens" else ""
    return f"{part}{e['op']}{module} of batch {e['batch']} (call {e['call']})"


def _gradient_events(events: list[Event], op: str) -> dict[tuple[str, int, str], list[Event]]:
    """(module, batch, part) -> this rank's starts or applies of that gradient, in order."""
    found: dict[tuple[str, int, str], list[Event]] = defaultdict(list)
    for e in events:
        if e["op"] == op:
            found[e["module"], e["batch"], e["part"]].append(e)
    return found


def _modules(events: RankEvents) -> list[str]:
    return sorted({e["module"] for evs in events.values() for e in evs if e["op"] in _GRADIENT_OPS})


def expected_nol_call(trainer: str, batch: int, batches: int) -> int:
    """The call that starts and applies NOL ``batch``: the next when pipelined, except the last batch's
    (drained in its own call); its own call when sequential."""
    return batch + 1 if trainer != SEQUENTIAL and batch < batches else batch


def expected_starts(trainer: str, call: int, batches: int) -> int:
    """All-to-all starts per module in ``call``: OL of its batch, NOL of the batch before (pipelined,
    from call 2), and the drained NOL of the last batch; sequential starts both parts of its batch."""
    if trainer == SEQUENTIAL:
        return 2
    return 1 + (call > 1) + (call == batches)


def check_no_autograd_start(events: RankEvents, trainer: str, batches: int) -> CheckResult:
    """No gradient all-to-all starts inside autograd: backward only hands its gradient parts on."""
    problems: list[Problem] = []
    starts = 0
    for rank, rank_events in sorted(events.items()):
        for e in rank_events:
            if e["op"] == "start":
                starts += 1
                if e["in_autograd"]:
                    problems.append((e["batch"], f"logical rank {rank}: {_what(e)} started inside autograd"))
    if not starts:
        return CheckResult(NO_AUTOGRAD, KIND, "fail", "no gradient all-to-all start recorded: nothing to check")
    passed = f"{starts} all-to-all starts on {len(events)} logical ranks, none inside autograd"
    return problems_result(NO_AUTOGRAD, KIND, problems, passed)


def _once_on_rank(rank: int, events: list[Event], modules: list[str], batches: int) -> list[Problem]:
    starts, applies = _gradient_events(events, "start"), _gradient_events(events, "apply")
    problems: list[Problem] = []
    expected = {(m, b, p) for m in modules for b in range(1, batches + 1) for p in PARTS}
    for module, batch, part in sorted(starts.keys() | applies.keys() | expected):
        ours, applied = starts.get((module, batch, part), []), applies.get((module, batch, part), [])
        where = f"logical rank {rank}: {part} of batch {batch}" + ("" if len(modules) == 1 else f" of {module}")
        calls = ", ".join(str(e["call"]) for e in ours + applied)
        if (module, batch, part) not in expected:
            problems.append((batch, f"{where} (call {calls}) is not a batch of this {batches}-batch run"))
        elif len(ours) != 1 or len(applied) != 1:
            problems.append(
                (
                    batch,
                    f"{where}: started {len(ours)} and applied {len(applied)} times (calls {calls or '-'}),"
                    " expected once each",
                )
            )
        elif applied[0]["seq"] < ours[0]["seq"]:
            problems.append(
                (batch, f"{where}: applied (call {applied[0]['call']}) before it started (call {ours[0]['call']})")
            )
    return problems


def _row_conservation(events: RankEvents) -> list[Problem]:
    """Over all ranks, the ids applied for a (module, batch, part) are the ids started for it."""
    sent: dict[tuple, set[int]] = defaultdict(set)
    received: dict[tuple, set[int]] = defaultdict(set)
    for rank_events in events.values():
        for e in rank_events:
            if e["op"] in _GRADIENT_OPS:
                (sent if e["op"] == "start" else received)[e["module"], e["batch"], e["part"]].update(e["ids"])
    problems: list[Problem] = []
    for module, batch, part in sorted(sent.keys() | received.keys()):
        lost = sorted(sent[module, batch, part] - received[module, batch, part])
        extra = sorted(received[module, batch, part] - sent[module, batch, part])
        if lost or extra:
            what = [f"rows {lost[:5]} started, never applied"] if lost else []
            what += [f"rows {extra[:5]} applied, never started"] if extra else []
            problems.append((batch, f"{part} of batch {batch}: {'; '.join(what)}"))
    return problems


def check_one_ol_one_nol(events: RankEvents, trainer: str, batches: int) -> CheckResult:
    """Exactly one OL and one NOL all-to-all per batch and module on every rank, each applied once,
    after its start; across ranks the rows applied are the rows started (none lost, none invented)."""
    modules = _modules(events)
    if not modules:
        return CheckResult(ONE_EACH, KIND, "fail", "no gradient all-to-all recorded: nothing to count")
    problems = [p for rank in sorted(events) for p in _once_on_rank(rank, events[rank], modules, batches)]
    problems += _row_conservation(events)
    passed = (
        f"{2 * batches} starts (OL + NOL x {batches} batches) per module and logical rank, each applied once"
        f" after it; rows applied = rows started ({', '.join(modules)})"
    )
    return problems_result(ONE_EACH, KIND, problems, passed)


def check_starts_per_call(events: RankEvents, trainer: str, batches: int) -> CheckResult:
    """Starts per progress call and module: 1, then 2, then 3 (pipelined); 2 each (sequential)."""
    modules = _modules(events)
    if not modules:
        return CheckResult(PER_CALL, KIND, "fail", "no gradient all-to-all recorded: nothing to count")
    problems: list[Problem] = []
    for rank, rank_events in sorted(events.items()):
        counted = Counter((e["module"], e["call"]) for e in rank_events if e["op"] == "start")
        for module, call in sorted(counted.keys() | {(m, c) for m in modules for c in range(1, batches + 1)}):
            want = expected_starts(trainer, call, batches) if 1 <= call <= batches else 0
            if counted[module, call] != want:
                started = ", ".join(_what(e) for e in rank_events if e["op"] == "start" and e["call"] == call)
                problems.append(
                    (
                        call,
                        f"logical rank {rank}: call {call} started {counted[module, call]}, expected {want}"
                        f" ({started or 'none'})",
                    )
                )
    shape = _runs([expected_starts(trainer, call, batches) for call in range(1, batches + 1)])
    return problems_result(
        PER_CALL, KIND, problems, f"{trainer}: starts per call {shape}, on {len(events)} logical ranks"
    )


def _runs(counts: list[int]) -> str:
    """[1, 2, 2, 2, 3] -> "1, 2 x 3, 3": a per-call count sequence, repeats folded."""
    folded: list[list[int]] = []
    for count in counts:
        if folded and folded[-1][0] == count:
            folded[-1][1] += 1
        else:
            folded.append([count, 1])
    return ", ".join(f"{count}" if times == 1 else f"{count} x {times}" for count, times in folded)


def _single(events: list[Event], op: str, batch: int) -> Event | None:
    found = [e for e in events if e["op"] == op and e["batch"] == batch]
    return found[0] if len(found) == 1 else None


def check_ol_window(events: RankEvents, trainer: str, batches: int) -> CheckResult:
    """OL(N) starts after backward N is done (its gradient complete) and before optimizer step N
    (which it overlaps): once backward N has produced the gradient, and before the dense step that
    would otherwise leave nothing to hide the all-to-all behind."""
    problems: list[Problem] = []
    for rank, rank_events in sorted(events.items()):
        for batch in range(1, batches + 1):
            backward, step = _single(rank_events, "backward_done", batch), _single(rank_events, "optimizer_step", batch)
            if backward is None or step is None:
                problems.append(
                    (batch, f"logical rank {rank}: batch {batch} has no single backward_done and optimizer_step")
                )
                continue
            ol_starts = [e for e in rank_events if e["op"] == "start" and e["part"] == "OL" and e["batch"] == batch]
            if not ol_starts:
                problems.append((batch, f"logical rank {rank}: OL of batch {batch} never started"))
            for e in ol_starts:
                if e["seq"] < backward["seq"]:
                    problems.append(
                        (batch, f"logical rank {rank}: {_what(e)} started before backward of batch {batch} was done")
                    )
                elif e["seq"] > step["seq"]:
                    problems.append((batch, f"logical rank {rank}: {_what(e)} started after optimizer step {batch}"))
    passed = f"OL of batches 1-{batches} started between backward and optimizer step on {len(events)} logical ranks"
    return problems_result(OL_WINDOW, KIND, problems, passed)


def check_nol_handoff(events: RankEvents, trainer: str, batches: int) -> CheckResult:
    """Each part starts and is applied in the call its trainer schedules: OL N in call N; NOL N in
    call N+1 when pipelined (the last batch's drained in call N), call N when sequential."""
    problems: list[Problem] = []
    gradients = 0
    for rank, rank_events in sorted(events.items()):
        for e in rank_events:
            if e["op"] not in _GRADIENT_OPS:
                continue
            gradients += 1
            want = e["batch"] if e["part"] == "OL" else expected_nol_call(trainer, e["batch"], batches)
            if e["call"] != want:
                late = "late" if e["call"] > want else "early"
                problems.append((e["batch"], f"logical rank {rank}: {_what(e)}, expected in call {want} ({late})"))
    if not gradients:
        return CheckResult(NOL_HANDOFF, KIND, "fail", "no gradient all-to-all recorded: no hand-off to check")
    when = "call N+1, the last batch's drained in its own call" if trainer != SEQUENTIAL else "call N"
    return problems_result(NOL_HANDOFF, KIND, problems, f"{trainer}: OL N in call N, NOL N in {when}")


def _rows(rows: list[int]) -> str:
    """``row 7`` or ``3 rows (2, 7, 9)``, at most five listed."""
    if len(rows) == 1:
        return f"row {rows[0]}"
    return f"{len(rows)} rows ({', '.join(map(str, rows[:5]))}{', ...' if len(rows) > 5 else ''})"


def _signature(e: Event) -> tuple:
    return e["call"], e["op"], e["batch"], e["part"], e["module"]


def _lockstep_problem(events: RankEvents) -> str | None:
    """Where two ranks' pipelines part (the position clock is then meaningless), or None."""
    first = min(events)
    base = [_signature(e) for e in events[first]]
    for rank, rank_events in sorted(events.items()):
        mine = [_signature(e) for e in rank_events]
        i = next((i for i, (a, b) in enumerate(zip(base, mine)) if a != b), min(len(base), len(mine)))
        if i < max(len(base), len(mine)):
            theirs = _what(events[first][i]) if i < len(base) else "nothing"
            ours = _what(rank_events[i]) if i < len(mine) else "nothing"
            return (
                f"logical ranks {first} and {rank} are not in lockstep at event {i}: {theirs} vs {ours};"
                " lookups cannot be ordered against other ranks' applies"
            )
    return None


def check_fresh_lookups(events: RankEvents, trainer: str, batches: int) -> CheckResult:
    """Every row looked up for batch M has had every update of an earlier batch applied: each apply
    of a batch < M holding the id sits before the lookup in the common position order (module doc)."""
    if problem := _lockstep_problem(events):
        return CheckResult(FRESH, KIND, "fail", problem)
    applied: dict[int, list[tuple[int, int, Event]]] = defaultdict(list)  # id -> (position, owner, apply)
    lookups: list[tuple[int, int, Event]] = []
    for rank, rank_events in events.items():
        for position, e in enumerate(rank_events):
            if e["op"] == "apply":
                for row in e["ids"]:
                    applied[row].append((position, rank, e))
            elif e["op"] == "lookup":
                lookups.append((position, rank, e))
    if not lookups:
        return CheckResult(FRESH, KIND, "fail", "no lookups recorded: no row to check")
    stale: dict[tuple[int, int, int, int], list[int]] = defaultdict(list)  # (lookup pos, rank, apply pos, owner) -> ids
    for position, rank, lookup in lookups:
        for row in lookup["ids"]:
            for at, owner, e in applied.get(row, []):
                if e["batch"] < lookup["batch"] and at > position:
                    stale[position, rank, at, owner].append(row)
    problems: list[Problem] = []
    for (position, rank, at, owner), rows in sorted(stale.items()):
        lookup, update = events[rank][position], events[owner][at]
        problems.append(
            (
                lookup["batch"],
                f"logical rank {rank}: lookup of batch {lookup['batch']} (call {lookup['call']}) reads {_rows(rows)}"
                f" before the {update['part']} update of batch {update['batch']} is applied"
                f" (call {update['call']}, logical rank {owner})",
            )
        )
    rows_read = sum(e["rows"] for _, _, e in lookups)
    passed = f"{len(lookups)} lookups ({rows_read} rows) each after every earlier batch's update of its rows"
    return problems_result(FRESH, KIND, problems, passed)


_CHECKS: tuple[Callable[[RankEvents, str, int], CheckResult], ...] = (
    check_no_autograd_start,
    check_one_ol_one_nol,
    check_starts_per_call,
    check_ol_window,
    check_nol_handoff,
    check_fresh_lookups,
)


def check_pec(events: RankEvents, trainer: str, batches: int) -> list[CheckResult]:
    """Every invariant on one arm's events (logical rank -> events), one result each, in INVARIANTS order.

    No ranks or a rank without events fails them all, a malformed event makes them all errors."""
    silent = sorted(rank for rank, rank_events in events.items() if not rank_events)
    if not events or silent:
        who = f"logical rank {', '.join(map(str, silent))} recorded" if events else "no logical rank recorded"
        return [CheckResult(name, KIND, "fail", f"{who} no PEC events (pec.rank<k>.jsonl)") for name in INVARIANTS]
    if reason := malformed_pec_events(events):
        return [CheckResult(name, KIND, "error", f"malformed events: {reason}") for name in INVARIANTS]
    return [check(events, trainer, batches) for check in _CHECKS]


def _pec_trainer(spec: ArmSpec) -> str | None:
    """The trainer driving the arm's PEC table, or None for an arm without one."""
    return spec.facts.pec if spec.emits(PEC) else None


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    v.table(raw, dotted, ("kind", "name", "arms"))
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else KIND

    def problem(spec: ArmSpec) -> str | None:
        return None if _pec_trainer(spec) else "has no PEC table (it records no PEC events: it sets no pec field)"

    return CheckSpec(kind, name, qualifying_arms(v, raw, dotted, arms, problem, "an arm with a PEC table"))


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    """Batches are numbered like steps: a run of N steps makes N pipeline calls over batches 1..N."""
    results = []
    for arm in check.arms:
        prefix = f"{arm}: " if check.name == KIND else f"{arm}: {check.name}: "
        for result in check_pec(records[arm].pec, _pec_trainer(suite.arms[arm]), suite.steps):
            results.append(dataclasses.replace(result, name=prefix + result.name))
    return results


register(CheckFamily((KIND,), parse, run, reads=(PEC,)))
