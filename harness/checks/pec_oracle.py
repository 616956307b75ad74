"""``pec-oracle``: a PEC arm's table against torchrec's own PEC, row by row, after every batch.

An arm with ``oracle = "torchrec"`` trains torchrec's ``PECAll2AllSeqWait``, ``PECGradientApply`` and
FBGEMM's fused row-wise optimizer beside the reference's table (:mod:`harness.oracles.torchrec`) and
records one line per batch in ``fidelity.jsonl``: per table, the worst row of the whole table (its
global id), that row's largest absolute difference and its relative error (over the row's largest
reference magnitude). Both tables are fp32 and see the same gradients; they differ only in the order
fp32 sums run (torchrec sums every position's row on the owner at once, the reference per id, then
per source rank), about 1e-7. So every row of every batch must be within ``max_rel_err`` (default
1e-6): an optimizer or gradient-sum bug moves rows by far more at the first batch it touches.

A failure names the first batch that differs, the table and its worst row:
``batch 2: model.embed_tokens row 417 rel err 3.1e-01 > 1e-06 (abs diff 6.2e-03)``. No records, a
batch not recorded or recorded twice, or a line without its tables fails: nothing passes unchecked.
"""

from __future__ import annotations

import math
from typing import Any

from harness.checks.registry import CheckFamily, register
from harness.records import RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import FIDELITY, SuiteReader

KIND = "pec-oracle"
ORACLE = "torchrec"
DEFAULT_MAX_REL_ERR = 1e-6
FIELDS = ("rows", "max_rel_err", "worst_row", "abs_diff")
NO_RECORDS = "no torchrec records (fidelity.jsonl missing or empty): no row compared"


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    """``arms`` (default: every arm with ``oracle = "torchrec"``) and ``max_rel_err``."""
    v.table(raw, dotted, ("kind", "name", "arms", "max_rel_err"))
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else kind
    if "arms" in raw:
        chosen = v.str_list(raw["arms"], f"{dotted}.arms", list(arms))
        for i, arm in enumerate(chosen):
            if arms[arm].oracle != ORACLE:
                raise v.error(f"{dotted}.arms.{i}", f'arm "{arm}" trains against no torchrec (set oracle = "torchrec")')
    else:
        chosen = tuple(arm for arm, spec in arms.items() if spec.oracle == ORACLE)
        if not chosen:
            raise v.error(dotted, 'needs an arm with oracle = "torchrec"; the suite has none')
    tolerance = v.typed(raw.get("max_rel_err", DEFAULT_MAX_REL_ERR), f"{dotted}.max_rel_err", float, True)
    return CheckSpec(kind, name, chosen, options={"max_rel_err": float(tolerance)})


def _malformed(line: Any) -> str | None:
    """What a recorded line lacks, or None."""
    tables = line.get("tables") if isinstance(line, dict) else None
    if not isinstance(tables, dict) or not tables:
        return "no tables"
    for table, found in tables.items():
        if not isinstance(found, dict) or not all(_number(found.get(f)) for f in FIELDS):
            return f"{table}: expected numbers {', '.join(FIELDS)}"
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def judge(name: str, lines: list[dict], batches: int, max_rel_err: float) -> CheckResult:
    """Pass when batches 1..``batches`` are each recorded once and every table's worst row is within
    ``max_rel_err``; fail on the first batch where one is not (NaN fails), naming the table and row."""
    if not lines:
        return CheckResult(name, KIND, "fail", NO_RECORDS)
    recorded = [line.get("step") for line in lines]
    if recorded != list(range(1, batches + 1)):
        shown = recorded if len(recorded) <= 10 else [*recorded[:10], "..."]
        return CheckResult(
            name, KIND, "fail", f"recorded batches {shown}, expected 1-{batches}: the batches missing were not compared"
        )
    worst: tuple[float, int, str, int] = (-1.0, 0, "", 0)  # (rel err, batch, table, row)
    for line in lines:
        if problem := _malformed(line):
            return CheckResult(name, KIND, "error", f"batch {line['step']}: malformed record: {problem}")
        for table, found in sorted(line["tables"].items()):
            rel = found["max_rel_err"]
            if not rel <= max_rel_err:  # NaN too
                return CheckResult(
                    name,
                    KIND,
                    "fail",
                    f"batch {line['step']}: {table} row {found['worst_row']} rel err {rel:.1e} > {max_rel_err:g}"
                    f" (abs diff {found['abs_diff']:.1e}, worst of {found['rows']} rows)",
                    first_divergent_step=line["step"],
                    max_abs_diff=found["abs_diff"],
                    max_rel_diff=rel if math.isfinite(rel) else None,
                )
            if rel > worst[0]:
                worst = (rel, line["step"], table, found["worst_row"])
    rel, batch, table, row = worst
    tables = sorted(lines[0]["tables"])
    return CheckResult(
        name,
        KIND,
        "pass",
        f"batches 1-{batches}: every row of {', '.join(tables)} within {max_rel_err:g} of torchrec's;"
        f" worst {rel:.1e} ({table} row {row}, batch {batch})",
        max_rel_diff=rel,
    )


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    tolerance = check.options["max_rel_err"]
    return [judge(f"{arm}: {check.name}", records[arm].fidelity, suite.steps, tolerance) for arm in check.arms]


register(CheckFamily((KIND,), parse, run, reads=(FIDELITY,)))
