"""The version protocol of a delayed (versioned) pipeline, checked on its update records.

One metrics.jsonl line per optimizer update: every batch applied exactly once (``exactly-once``),
the gradient ages the pipeline's delay implies (``staleness-ages``), and sane importance-correction
statistics (``correction-stats``). Each check reads one versioned arm at a time.

A correction whose clip never binds cannot show that the clip works: a clip of 50 where the arm
asks for 5 passes on weights that never reach 5. ``min_clipped_frac`` makes ``correction-stats``
prove the clip acted: every stale update must have clipped at least that fraction of its tokens
(an arm with a binding clip, say ``correction_clip = 1.01``).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable

from harness.checks.registry import CheckFamily, Problem, problems_result, qualifying_arms, register
from harness.compare import format_steps
from harness.records import RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import VERSIONED, SuiteReader

EXACTLY_ONCE = "exactly-once"
STALENESS_AGES = "staleness-ages"
CORRECTION_STATS = "correction-stats"
# The reference clamps importance weights to [0, clip]: clamp(exp(lp_now - lp_then), 0, clip); an arm
# sets clip as correction_clip, and this is its default.
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
    return problems_result(EXACTLY_ONCE, EXACTLY_ONCE, problems, passed)


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
    return problems_result(STALENESS_AGES, STALENESS_AGES, problems, passed, extra={"ages_seen": seen})


def _stat_problem(value: object, lo: float, hi: float) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {value!r}, not a number"
    if not math.isfinite(value):
        return f"is non-finite ({value!r})"
    if not lo <= value <= hi:
        return f"{value!r} is outside [{lo:g}, {hi:g}]"
    return None


def check_correction_stats(
    updates: list[Update],
    correction: str,
    delay: int,
    clip: float = CORRECTION_CLIP,
    min_clipped_frac: float | None = None,
) -> CheckResult:
    """Reports the importance correction's mean weight and clipped fraction per step.

    Fails on values no correct weighting can produce (non-finite, a mean weight outside
    [0, clip], a clipped fraction outside [0, 1]) and on a correction that did nothing:
    ``always`` must report statistics at every step and, with a delay, weights that differ from 1
    on the stale updates (a weight stuck at exactly 1 is a correction never applied);
    ``when_available`` must report them at least once. A step without statistics under
    ``when_available`` (no applied batch had current logprobs) is reported, not failed. With
    ``min_clipped_frac``, every stale update must have clipped at least that fraction of its tokens.
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
    stale = [row for row, u in zip(per_step, ordered) if any(age > 0 for age in u.get("ages") or [])]
    if min_clipped_frac is not None and not problems:
        problems += _unclipped(stale, clip, min_clipped_frac)
    if correction == "always" and delay > 0 and not problems:
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
        return problems_result(CORRECTION_STATS, CORRECTION_STATS, problems, "", extra={"per_step": per_step})
    absent = [row["step"] for row in per_step if row["mean"] is None]
    means = [row["mean"] for row in reported]
    parts = [
        f"{correction}: mean weight {min(means):.4f} to {max(means):.4f} (average {math.fsum(means) / len(means):.4f}),"
        f" clipped fraction at most {max(row['clipped_frac'] for row in reported):.3g},"
        f" at steps {format_steps([row['step'] for row in reported])}"
    ]
    if min_clipped_frac is not None:
        least = min(row["clipped_frac"] for row in stale)
        parts.append(f"clipped at least {least:.3g} at every stale step (min_clipped_frac {min_clipped_frac:g})")
    if absent:
        parts.append(f"no corrected tokens at steps {format_steps(absent)}")
    return CheckResult(CORRECTION_STATS, CORRECTION_STATS, "pass", "; ".join(parts), extra={"per_step": per_step})


def _unclipped(stale: list[dict], clip: float, min_clipped_frac: float) -> list[Problem]:
    """The stale steps whose clipped fraction is under ``min_clipped_frac``: the clip did not act there."""
    if not stale:
        return [(None, f"no stale update: no clip to see acting (min_clipped_frac {min_clipped_frac:g})")]
    return [
        (
            row["step"],
            f"step {row['step']}: clipped fraction {row['clipped_frac']!r} under min_clipped_frac"
            f" {min_clipped_frac:g}: the clip at {clip:g} did not act",
        )
        for row in stale
        if row["clipped_frac"] is None or row["clipped_frac"] < min_clipped_frac
    ]


def _versioned_arms(
    raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec], corrected: bool
) -> tuple[str, ...]:
    """The arms a version-protocol check reads: those listed, or every versioned arm (with a
    correction, when ``corrected``: statistics of a correction that is off check nothing)."""

    def problem(spec: ArmSpec) -> str | None:
        if not spec.emits(VERSIONED):
            return "is not versioned (it records no versioned updates: it sets no pipeline field)"
        if corrected and spec.facts.correction == "off":
            return 'has correction = "off": no statistics to check'
        return None

    wanted = "a versioned arm with a correction" if corrected else "a versioned arm (one that sets a pipeline field)"
    return qualifying_arms(v, raw, dotted, arms, problem, wanted)


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    """``min_clipped_frac`` (correction-stats only): a fraction in (0, 1] every stale update must clip."""
    v.table(raw, dotted, ("kind", "name", "arms", *(["min_clipped_frac"] if kind == CORRECTION_STATS else [])))
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else kind
    options = {}
    if "min_clipped_frac" in raw:
        fraction = v.typed(raw["min_clipped_frac"], f"{dotted}.min_clipped_frac", float, True)
        if fraction > 1:
            raise v.error(f"{dotted}.min_clipped_frac", f"expected a fraction in (0, 1], got {fraction:g}")
        options["min_clipped_frac"] = fraction
    return CheckSpec(kind, name, _versioned_arms(raw, dotted, v, arms, kind == CORRECTION_STATS), options=options)


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    """Batches are numbered like steps (see harness.rank.train.updates): a run of N steps applies batches 1..N."""
    results = []
    for arm in check.arms:
        updates, facts = records[arm].updates, records[arm].facts
        if facts is None:
            result = CheckResult(
                check.kind, check.kind, "fail", "no arm.json with the arm's facts: no pipeline to judge"
            )
        elif check.kind == EXACTLY_ONCE:
            result = check_exactly_once(updates, range(1, suite.steps + 1))
        elif check.kind == STALENESS_AGES:
            result = check_staleness_ages(updates, facts.delay)
        else:
            clip, least = facts.correction_clip, check.options.get("min_clipped_frac")
            result = check_correction_stats(updates, facts.correction, facts.delay, clip, least)
        results.append(dataclasses.replace(result, name=f"{arm}: {check.name}"))
    return results


register(CheckFamily((EXACTLY_ONCE, STALENESS_AGES, CORRECTION_STATS), parse, run, reads=(VERSIONED,)))
