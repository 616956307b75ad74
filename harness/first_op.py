"""The first op where two arms part, found by re-running them in the run's own processes.

When a bit-level comparison of two arms (``exact``, ``ulp``, ``determinism``) fails at step s, the
metrics and the gradient digests say when the arms part, not in which op. :func:`locate_first_op`
re-runs both arms for steps 1..s through the run's own launcher and names the first op whose
outputs differ (harness/op_divergence/), in the check's ``extra.first_op_divergence`` and in one
console line:

1. **Which check**: of the failed bit-level checks of two arms, the one whose arms part first.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from harness.cancel import Cancelled
from harness.judge import Judgement
from harness.launchers import GroupLauncher, LaunchContext, LaunchResult
from harness.op_divergence import Comparison, compare_ops, describe, measured
from harness.op_divergence.files import read_captured, read_ops
from harness.op_divergence.record import OpRecord
from harness.phases import read_rank_phases
from harness.plan import LaunchGroup, plan_launches
from harness.prepare import PreparedRun
from harness.records import RecordError, RunRecords, read_jsonl
from harness.results import CheckResult
from harness.rundir import FIRST_OP_DIR, RunDirError, arm_files, fresh_dir
from harness.specs import DebugSpec, SuiteSpec
from harness.subject.protocol import RECORD_OPS

MODES = ("auto", "on", "off")
MODE_ENV = "HARNESS_FIRST_OP"  # the default of --first-op
BIT_LEVEL = ("exact", "ulp", "determinism")
# A step recorded op by op takes this many plain steps (DebugMode, a blake2b hash of every output),
# measured on cpu-tiny (8-25); the budget check (auto) uses it.
RECORDING_SLOWDOWN = 20.0
log = logging.getLogger("harness")


class NotLocated(Exception):
    """Why no op is named: ``status`` is refused, skipped or failed; the message is one line."""

    def __init__(self, status: str, why: str) -> None:
        super().__init__(why)
        self.status = status


def locate_first_op(
    run: PreparedRun, records: RunRecords, judgement: Judgement, launch: GroupLauncher, out: TextIO
) -> Judgement:
    """The judgement with the first op where the arms of its first failed bit-level check part, as
    that check's ``extra.first_op_divergence``, where ``run.options.first_op`` asks for it; the
    verdict and exit code stay as they are."""
    mode = run.options.first_op
    if mode == "off" or judgement.verdict != "fail":
        return judgement
    failed = [
        (c.first_divergent_step, i)
        for i, c in enumerate(judgement.checks)
        if c.kind in BIT_LEVEL and c.status == "fail" and len(c.arms) == 2 and c.first_divergent_step is not None
    ]
    if not failed:
        if mode == "on":
            _say("first op: nothing to locate: no exact, ulp or determinism check of two arms failed", out)
        return judgement
    index = min(failed)[1]
    check = judgement.checks[index]
    started = time.time()
    result = _locate(run, records, check, mode, launch, out)  # never raises
    run.phases.add("first-op", started, time.time())
    _say(result["line"], out)
    checks = [*judgement.checks]
    checks[index] = dataclasses.replace(check, extra={**check.extra, "first_op_divergence": result})
    return dataclasses.replace(judgement, checks=checks)


def _say(line: str, out: TextIO) -> None:
    print(line, file=out)
    log.info(line)


def _locate(
    run: PreparedRun, records: RunRecords, check: CheckResult, mode: str, launch: GroupLauncher, out: TextIO
) -> dict[str, Any]:
    """``extra.first_op_divergence``: what the re-run found, or why it found nothing; never raises."""
    a, b = check.arms
    steps = check.first_divergent_step
    base = {"arms": {"a": a, "b": b}, "steps": steps}
    budget = run.options.first_op_budget_s
    try:
        _refuse_before_launching(run, a, b)
        estimate = estimate_s(run, (a, b), steps) if mode == "auto" else None
        if estimate is not None and estimate > budget:
            raise NotLocated(
                "skipped",
                f"re-running steps 1-{steps} op by op should take about {estimate:.0f} s, over the budget of"
                f" {budget:g} s (--first-op-budget; --first-op on runs it regardless)",
            )
        _say(f"first op: re-running steps 1-{steps} of {a} and {b} with every op recorded (budget {budget:g} s)", out)
        rerun = _Rerun(run, (a, b), launch, time.monotonic() + budget, budget)
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


def estimate_s(run: PreparedRun, arms: tuple[str, str], steps: int) -> float | None:
    """Seconds the re-run's two passes should take, from what the run's own launches took (process
    rank 0's phases): each pass starts the processes, builds both arms, and runs ``steps`` steps of
    each op by op. None where the run recorded no phase of an arm."""
    pass_s, seen = 0.0, set()
    for group in run.groups:
        if not set(arms) & set(group.arms):
            continue
        for phase in read_rank_phases(run.run_dir, group.name).get(0, []):
            seconds, arm = phase["end"] - phase["start"], phase.get("arm")
            if phase["phase"] in ("imports", "rendezvous"):
                pass_s += seconds
            elif arm in arms and phase["phase"] == "build":
                pass_s += seconds
            elif arm in arms and phase["phase"] == "steps" and (done := (phase.get("detail") or {}).get("steps")):
                pass_s += seconds * RECORDING_SLOWDOWN * steps / done
                seen.add(arm)
    return 2 * pass_s if seen == set(arms) else None


@dataclass(frozen=True)
class _Rerun:
    """The re-run of two arms of a run, op by op, under one deadline."""

    run: PreparedRun
    arms: tuple[str, str]
    launch: GroupLauncher
    deadline: float  # monotonic seconds
    budget_s: float

    def locate(self, steps: int, records: RunRecords) -> dict[str, Any]:
        a, b = self.arms
        root = self._launch("record", steps)
        ops = {arm: self._ops(root, arm) for arm in self.arms}
        compared = [compare_ops(ops[a][rank], ops[b][rank]) for rank in range(len(ops[a]))]
        parted = [(c.anchor(*c.first()), rank) for rank, c in enumerate(compared) if c.first() is not None]
        rank = min(parted)[1] if parted else 0
        result = {
            "status": "located" if parted else "no divergence",
            "rank": rank,
            "ranks": [{"rank": r, "summary": describe(c)["summary"]} for r, c in enumerate(compared)],
            "reran_as_run": all(_same_metrics(records, root, arm, steps) for arm in self.arms),
            **describe(compared[rank]),
        }
        if compared[rank].pair is not None:
            result["first_difference"].update(self._measure(compared[rank], rank))
        result["line"] = _line(result, a, b, steps)
        return result

    def _launch(self, name: str, steps: int, capture: tuple[tuple[str, int, int], ...] = ()) -> Path:
        """Launches both arms for steps 1..``steps`` with every op recorded, in ``first-op/<name>/``."""
        try:
            root = fresh_dir(self.run.run_dir / FIRST_OP_DIR / name, "re-run directory")
        except RunDirError as e:
            raise NotLocated("failed", str(e)) from None
        suite = _rerun_suite(self.run.suite, self.arms, steps)
        groups = [dataclasses.replace(g, record_ops=True, capture_ops=capture) for g in plan_launches(suite)]
        dataclasses.replace(self.run.manifest, suite=suite.to_dict(), launches=groups).write(root)
        run = self.run
        context = LaunchContext(root, self.deadline, self.budget_s, run.env, subject_source=run.subject.source)
        for group in groups:
            self._launched(self.launch(group, context), group, name, root)
        return root

    def _launched(self, result: LaunchResult, group: LaunchGroup, name: str, root: Path) -> None:
        if result.timed_out:
            raise NotLocated("failed", f"the {name} pass ran past the {self.budget_s:g} s budget (--first-op-budget)")
        if not result.ok:
            raise NotLocated("failed", f"the {name} pass failed: {result.headline} (logs: {root / group.log_dir})")

    def _ops(self, root: Path, arm: str) -> list[list[OpRecord]]:
        """Each process rank's ops of ``arm``; NotLocated where a rank refused or wrote none."""
        per_rank = []
        for rank in range(self.run.suite.arms[arm].ranks):
            try:
                recorded = read_ops(arm_files(root, arm).ops(rank))
            except RecordError as e:
                raise NotLocated("failed", str(e)) from None
            if recorded.refused:
                raise NotLocated("refused", f"arm {arm!r}: {recorded.refused}")
            per_rank.append(recorded.records)
        return per_rank

    def _measure(self, c: Comparison, rank: int) -> dict[str, Any]:
        """The first differing pair's outputs, kept by a capture pass up to their step, and their differences."""
        (a, b), (i, j) = self.arms, c.pair
        root = self._launch("capture", max(c.a[i].step, c.b[j].step), capture=((a, rank, i), (b, rank, j)))
        try:
            out_a, out_b = (read_captured(arm_files(root, arm).captured(rank)) for arm in self.arms)
        except RecordError as e:
            raise NotLocated("failed", str(e)) from None
        return measured(c.a[i], out_a, c.b[j], out_b)


def _rerun_suite(suite: SuiteSpec, arms: tuple[str, str], steps: int) -> SuiteSpec:
    """What the re-run launches: the two arms alone, straight through steps 1..``steps`` (a resumed
    arm without its stop), with no check and no planted rank failure."""
    chosen = {arm: dataclasses.replace(suite.arms[arm], resume_at=None, resume_ranks=None) for arm in arms}
    return dataclasses.replace(suite, steps=steps, arms=chosen, checks=(), debug=DebugSpec(), throughput=None)


def _same_metrics(records: RunRecords, root: Path, arm: str, steps: int) -> bool:
    """Whether the re-run's loss and grad norm of steps 1..``steps`` are the run's, bit for bit (by repr)."""

    def metrics(lines: list[dict]) -> list[str]:
        return [repr((u["step"], u["loss"], u["grad_norm"])) for u in lines if u["step"] <= steps]

    path = arm_files(root, arm).metrics
    return path.is_file() and metrics(read_jsonl(path)) == metrics(records[arm].updates)


def _line(result: dict[str, Any], a: str, b: str, steps: int) -> str:
    """The console's line: where the arms part (rank, step, direction, op, module, output shapes)
    and how much the first differing outputs differ."""
    again = "" if result["reran_as_run"] else " (the re-run's metrics are not the run's: it trained otherwise)"
    first = result["first_op"]
    if first is None:
        return f"first op: not located: re-run op by op, {a} and {b} did not part in steps 1-{steps}{again}"
    op = first["a"] or first["b"]
    direction = "backward" if op["backward"] else "forward"
    where = (
        f"rank {result['rank']}, step {op['step']}, {direction} {op['op']} in {op['module'] or '(no module)'}"
        f" -> {', '.join(op['outputs'])}"
    )
    pair = result["first_difference"]
    if first["kind"] == "outputs differ":
        return f"first op: {a} and {b} part at {where}: {_difference(pair)}{again}"
    only = a if first["kind"] == "only in a" else b
    then = f"; then {pair['a']['op']} in {pair['a']['module'] or '(no module)'}: {_difference(pair)}" if pair else ""
    return f"first op: {a} and {b} part at {where}, whose output only {only} makes{then}{again}"


def _difference(pair: dict[str, Any]) -> str:
    """The largest absolute and relative difference over the pair's outputs, as measured."""
    if not pair.get("reproduced"):
        return "outputs differ (not measured: the capture pass did not reproduce them)"
    max_abs = max(float(o["max_abs"]) for o in pair["outputs"])
    max_rel = max(float(o["max_rel"]) for o in pair["outputs"])
    return f"max abs diff {max_abs:.3g}, max rel diff {max_rel:.3g}"
