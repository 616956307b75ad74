"""The first op where two arms part, found by re-running them in the run's own processes.

When a bit-level comparison of two arms (``exact``, ``ulp``, ``determinism``) fails at step s, the
metrics and the gradient digests say when the arms part, not in which op. :func:`locate_first_op`
re-runs both arms for steps 1..s through the run's own launcher (harness/op_rerun.py) and names the
first op whose outputs differ (harness/op_divergence/), in the check's ``extra.first_op_divergence``
and in one console line:

1. **Which check** (here): of the failed bit-level checks of two arms, the one whose arms part first.
2. **Record** (``first-op/record/``, a run directory of its own): both arms for steps 1..s in the
   run's process layout, each rank recording every op of its steps on its main thread, readied by
   the subject's ``record_ops`` hook (``ops.rank<k>.jsonl``). The arms record nothing else but their
   metrics, which must equal the run's (``reran_as_run``): a re-run that trained otherwise says so.
3. **Compare** rank by rank (:func:`~harness.op_divergence.compare_ops`); the rank shown is the one
   whose arms part soonest (the fewest ops matched before its first divergence).
4. **Measure** (``first-op/capture/``): both arms again up to the step of the first differing
   outputs, that rank keeping them (``captured.rank<k>.npz``), whose largest absolute and relative
   difference is taken here, if the second pass hashed them as the first did (``reproduced``).

It never changes the run's verdict or exit code. It refuses, in one line and before launching where
that can be told: a subject without the hook, an arm with several logical ranks in one process (the
recorder, a thread-local dispatch mode, cannot see their pool threads), arms on different process
counts; in the ranks, an arm the subject cannot record (the reference's: regional Inductor kernels,
an oracle beside it). A re-run that fails, runs past its budget or is cancelled is one line too.

**When**: ``harness run --first-op on`` locates whenever such a check failed; ``auto`` (the default,
or ``$HARNESS_FIRST_OP``) only when the re-run should fit the budget (``--first-op-budget``, the
re-run's time limit), judged from the run's own phase times; ``off`` never.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, TextIO

from harness.cancel import Cancelled
from harness.judge import Judgement
from harness.launchers import GroupLauncher
from harness.launching import Launched
from harness.op_rerun import NotLocated, OpRerun
from harness.prepare import PreparedRun
from harness.records import RunRecords
from harness.results import FAILED_AS_EXPECTED, CheckResult
from harness.subject.protocol import RECORD_OPS

MODES = ("auto", "on", "off")
MODE_ENV = "HARNESS_FIRST_OP"  # the default of --first-op
BIT_LEVEL = ("exact", "ulp", "determinism", "change")  # change: a change check, head against base
# A step recorded op by op takes this many plain steps (DebugMode, a blake2b hash of every output),
# measured on cpu-tiny (8-25); the budget check (auto) uses it.
RECORDING_SLOWDOWN = 20.0
log = logging.getLogger("harness")


def locate_first_op(
    run: PreparedRun, launched: Launched, records: RunRecords, judgement: Judgement, launch: GroupLauncher, out: TextIO
) -> Judgement:
    """The judgement with the first op where the arms of its first failed bit-level check part, as
    that check's ``extra.first_op_divergence``, where ``run.options.first_op`` asks for it; the
    verdict and exit code stay as they are. ``on`` locates a negative suite's expected failures too
    (where the system under test is known to part, the op is what its authors need)."""
    mode = run.options.first_op
    if mode == "off" or judgement.verdict not in ("fail", FAILED_AS_EXPECTED):
        return judgement
    statuses = ("fail", "xfail") if mode == "on" else ("fail",)
    failed = [
        (c.first_divergent_step, i)
        for i, c in enumerate(judgement.checks)
        if c.kind in BIT_LEVEL and c.status in statuses and len(c.arms) == 2 and c.first_divergent_step is not None
    ]
    if not failed:
        if mode == "on":
            _say("first op: nothing to locate: no exact, ulp or determinism check of two arms failed", out)
        return judgement
    index = min(failed)[1]
    check = judgement.checks[index]
    started = time.time()
    result = _locate(run, launched, records, check, mode, launch, out)  # never raises
    run.phases.add("first-op", started, time.time())
    print(result["line"], file=out)
    log.info(result["line"])
    checks = [*judgement.checks]
    checks[index] = dataclasses.replace(check, extra={**check.extra, "first_op_divergence": result})
    return dataclasses.replace(judgement, checks=checks)


def _say(line: str, out: TextIO) -> None:
    print(line, file=out)
    log.info(line)


def _locate(
    run: PreparedRun,
    launched: Launched,
    records: RunRecords,
    check: CheckResult,
    mode: str,
    launch: GroupLauncher,
    out: TextIO,
) -> dict[str, Any]:
    """``extra.first_op_divergence``: what the re-run found, or why it found nothing; never raises."""
    a, b = check.arms
    steps = check.first_divergent_step
    base = {"arms": {"a": a, "b": b}, "steps": steps}
    budget = run.options.first_op_budget_s
    try:
        _refuse_before_launching(run, a, b)
        estimate = estimate_s(run, launched, (a, b), steps) if mode == "auto" else None
        if estimate is not None and estimate > budget:
            raise NotLocated(
                "skipped",
                f"re-running steps 1-{steps} op by op should take about {estimate:.0f} s, over the budget of"
                f" {budget:g} s (--first-op-budget; --first-op on runs it regardless)",
            )
        _say(f"first op: re-running steps 1-{steps} of {a} and {b} with every op recorded (budget {budget:g} s)", out)
        rerun = OpRerun(run, (a, b), launch, time.monotonic() + budget, budget)
        return {**base, **rerun.locate(steps, records)}
    except NotLocated as e:
        return {**base, "status": e.status, "line": f"first op: not located: {e}"}
    except Cancelled as c:  # the run's own outputs are still written, with its verdict
        return {**base, "status": "failed", "line": f"first op: not located: the re-run was {c}"}
    except Exception as e:
        log.exception("internal error while locating the first op")
        why = f"internal error: {type(e).__name__}: {e} (traceback in logs/harness.log)"
        return {**base, "status": "failed", "line": f"first op: not located: {why}"}


def _refuse_before_launching(run: PreparedRun, a: str, b: str) -> None:
    """What can be refused from the suite alone, before any process starts."""
    if RECORD_OPS not in run.subject.capabilities:
        raise NotLocated(
            "refused",
            f"subject {run.subject.name!r} does not declare {RECORD_OPS}: its ops cannot be recorded",
        )
    arms = run.suite.arms
    for arm in (a, b):
        spec = arms[arm]
        if spec.logical_ranks != spec.ranks:
            raise NotLocated(
                "refused",
                f"arm {arm!r} runs {spec.logical_ranks} logical ranks in {spec.ranks} process(es); recording ops"
                " needs one logical rank per process (a thread-local recorder cannot see their pool threads)",
            )
    if arms[a].ranks != arms[b].ranks:
        raise NotLocated(
            "refused", f"arms {a!r} and {b!r} run on {arms[a].ranks} and {arms[b].ranks} processes: no rank matches"
        )


def estimate_s(run: PreparedRun, launched: Launched, arms: tuple[str, str], steps: int) -> float | None:
    """Seconds the re-run's two passes should take, from what the run's own launches took (process
    rank 0's phases): each pass starts the processes, builds both arms, and runs ``steps`` steps of
    each op by op. None where the run recorded no phase of an arm."""
    pass_s, seen = 0.0, set()
    for group in run.groups:
        if not set(arms) & set(group.arms):
            continue
        for phase in launched.rank_phases.get(group.name, {}).get(0, []):
            seconds, arm = phase["end"] - phase["start"], phase.get("arm")
            if phase["phase"] in ("imports", "rendezvous"):
                pass_s += seconds
            elif arm in arms and phase["phase"] == "build":
                pass_s += seconds
            elif arm in arms and phase["phase"] == "steps" and (done := (phase.get("detail") or {}).get("steps")):
                pass_s += seconds * RECORDING_SLOWDOWN * steps / done
                seen.add(arm)
    return 2 * pass_s if seen == set(arms) else None
