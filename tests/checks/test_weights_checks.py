"""The final-weights check family on hand-made records: identical digests pass, anything else fails.
Every shipped suite judges the last update of every arm pair whose metrics it compares, and a bug in
that update alone fails final-weights where every metric comparison passes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.checks import FAMILIES
from harness.checks.pairs import DETERMINISM, PAIR_KINDS
from harness.checks.resume import KIND as RESUME
from harness.records import ArmRecords
from harness.suites import SUITES_DIR, list_suites, load_suite

SUITE = """
name = "weights"
description = "two arms whose final weights must match"
ranks = 2
steps = 3
[arms.a]
[arms.b]
[[checks]]
kind = "final-weights"
"""


def _weights(updates: int = 3, **changed: str) -> dict:
    return {"updates": updates, "parameters": {"embed": "e" * 64, "head": "h" * 64, **changed}}


@pytest.mark.parametrize(
    "b_weights,status,detail",
    [
        (
            {0: _weights(), 1: _weights()},
            "pass",
            "2 parameters bitwise identical on all 2 logical ranks after 3 updates",
        ),
        ({0: _weights()}, "fail", "logical rank 1: no final weights recorded by arm b"),
        (
            {0: _weights(), 1: _weights(head="0" * 64)},
            "fail",
            "logical rank 1: 1 of 2 parameters differ after 3 updates: head",
        ),
        ({0: _weights(2), 1: _weights()}, "fail", "logical rank 0: a recorded weights after 3 updates, b after 2"),
        ({0: {"updates": 3}, 1: _weights()}, "fail", "logical rank 0: malformed final weights of arm b"),
    ],
    ids=["identical", "missing", "differing", "fewer-updates", "malformed"],
)
def test_final_weights_pass_only_on_identical_digests_of_every_logical_rank(
    tmp_path: Path, b_weights: dict, status: str, detail: str
) -> None:
    path = tmp_path / "suite.toml"
    path.write_text(SUITE)
    suite = load_suite(str(path))
    check = suite.checks[0]
    records = {"a": ArmRecords(final_weights={0: _weights(), 1: _weights()}), "b": ArmRecords(final_weights=b_weights)}
    [result] = FAMILIES[check.kind].run(check, suite, records)
    assert (result.name, result.status, result.detail) == ("a vs b, final weights", status, detail)


def test_no_final_weights_at_all_fails(tmp_path: Path) -> None:
    path = tmp_path / "suite.toml"
    path.write_text(SUITE)
    suite = load_suite(str(path))
    [result] = FAMILIES["final-weights"].run(suite.checks[0], suite, {"a": ArmRecords(), "b": ArmRecords()})
    assert result.status == "fail" and result.detail == (
        "logical rank 0: no final weights recorded by arm a and b (and 1 more)"
    )


# The checks that compare two arms' metrics, whose last step's loss and grad norm are computed
# before that step's update: its weights are in no curve.
METRIC_PAIR_KINDS = (*PAIR_KINDS, DETERMINISM, RESUME)
# How a check table says why its pair's final weights are not compared.
EXEMPTION = re.compile(r"#\s*no final-weights:\s*\S")


def unjudged_last_updates(path: Path) -> list[str]:
    """The metric checks of the suite file ``path`` whose arm pair has no final-weights check and
    whose [[checks]] table does not say why (a ``# no final-weights: <reason>`` comment)."""
    suite = load_suite(str(path))
    tables = path.read_text().split("[[checks]]")[1:]
    weighed = {frozenset(check.arms) for check in suite.checks if check.kind == "final-weights"}
    return [
        f"{path.stem}: {check.name}"
        for check, table in zip(suite.checks, tables, strict=True)
        if check.kind in METRIC_PAIR_KINDS and frozenset(check.arms) not in weighed and not EXEMPTION.search(table)
    ]


def test_a_metric_pair_without_final_weights_is_found_unless_its_table_says_why(tmp_path: Path) -> None:
    path = tmp_path / "pair.toml"
    exact = '[[checks]]\nkind = "exact"\n'
    path.write_text(SUITE.replace('[[checks]]\nkind = "final-weights"\n', exact))
    assert unjudged_last_updates(path) == ["pair: a vs b"]
    path.write_text(SUITE.replace('[[checks]]\nkind = "final-weights"\n', exact + "# no final-weights:\n"))
    assert unjudged_last_updates(path) == ["pair: a vs b"]  # a reason is owed
    path.write_text(SUITE.replace('[[checks]]\nkind = "final-weights"\n', exact + "# no final-weights: why\n"))
    assert unjudged_last_updates(path) == []
    path.write_text(SUITE + exact + 'arms = ["b", "a"]\n')
    assert unjudged_last_updates(path) == []


def test_every_shipped_suite_compares_the_final_weights_of_the_arms_it_pairs() -> None:
    unjudged = [found for name, _ in list_suites() for found in unjudged_last_updates(SUITES_DIR / f"{name}.toml")]
    assert unjudged == []


# A bug in the last update only: where one process hosts the whole EP group, the last step's
# gradients are clipped and dropped, not applied. Its loss and grad norm are those of a correct step.
LAST_UPDATE_DROPPED = """
import harness.reference.train as train

LAST = 3
_step = train.Trainer.step
_optimizer_step = train.Trainer._optimizer_step


def step(self, step):
    self.dropping = step == LAST and self.group.processes == 1
    return _step(self, step)


def optimizer_step(self, rank):
    if not self.dropping:
        return _optimizer_step(self, rank)
    replica = self.replicas[rank]
    norm = self._clip_by_global_norm(rank, replica)
    replica.optimizer.zero_grad(set_to_none=True)
    return norm


train.Trainer.step = step
train.Trainer._optimizer_step = optimizer_step
"""


def test_a_bug_in_the_last_update_passes_the_metrics_and_fails_final_weights(
    run_harness, plant, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "logical-ranks", "--steps", 3, "--out", out, env=plant(LAST_UPDATE_DROPPED))
    assert run.returncode == 1, run.stdout + run.stderr
    checks = {c["name"]: c for c in run.summary(out)["checks"]}
    assert checks["procs vs inproc: loss"]["status"] == "pass"
    assert checks["procs vs inproc: grad_norm"]["status"] == "pass"
    weights = checks["procs vs inproc, final weights"]
    assert weights["status"] == "fail"
    assert re.match(r"logical rank 0: \d+ of \d+ parameters differ after 3 updates", weights["detail"]), weights
    assert [name for name, c in checks.items() if c["status"] == "fail"] == ["procs vs inproc, final weights"]
