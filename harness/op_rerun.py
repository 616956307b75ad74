"""The re-run that finds where two arms part, op by op (harness/first_op.py decides whether to run it).

Two passes, each a run directory of its own under ``first-op/`` and launched through the run's own
launcher under one deadline: ``record`` trains both arms for steps 1..s with every op of their steps
recorded and compares them rank by rank (harness/op_divergence/); ``capture`` trains them again up to
the step of the first differing outputs, keeping those outputs, whose differences are then measured.
Whatever stops it is a :class:`NotLocated`, one line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.launchers import GroupLauncher, LaunchContext, LaunchResult
from harness.op_divergence import Comparison, compare_ops, describe, measured
from harness.op_divergence.files import read_captured, read_ops
from harness.op_divergence.record import OpRecord
from harness.plan import LaunchGroup, plan_launches
from harness.prepare import PreparedRun
from harness.records import RecordError, RunRecords, read_jsonl
from harness.rundir import FIRST_OP_DIR, RunDirError, arm_files, fresh_dir
from harness.specs import DebugSpec, SuiteSpec


class NotLocated(Exception):
    """Why no op is named: ``status`` is refused, skipped or failed; the message is one line."""

    def __init__(self, status: str, why: str) -> None:
        super().__init__(why)
        self.status = status


@dataclass(frozen=True)
class OpRerun:
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
        context = LaunchContext(root, self.deadline, self.budget_s, run.env, subject_source=run.subject_source)
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
