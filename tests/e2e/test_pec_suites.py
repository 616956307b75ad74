"""The PEC suites through the real CLI on 2-rank gloo runs: pipelined equals sequential bit for bit,
EP=2 in one process equals EP=2 on two, each planted fault of the reference fails the checks that
catch it (exit 1; a wrong hand-off also parts pipelined from sequential), and the pre-#4498 order
fails the autograd invariant, as its negative suite expects."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from suite_files import run_suite_text

from harness.checks.pec import INVARIANTS
from harness.records import read_jsonl

ARMS = ("sequential", "pipelined", "chunked-sequential", "chunked-pipelined")


def _statuses(run, out: Path) -> dict[str, str]:
    """Every check's status but the golden's (off in these runs)."""
    return {c["name"]: c["status"] for c in run.summary(out)["checks"] if c["name"] != "golden"}


def _failing(run, out: Path) -> set[str]:
    return {name for name, status in _statuses(run, out).items() if status == "fail"}


def _curves(out: Path, arm: str) -> list[tuple]:
    """(step, loss, grad_norm) as recorded: floats read back bit for bit."""
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_jsonl(out / "arms" / arm / "metrics.jsonl")]


def test_pec_passes_over_20_steps_and_ep2_in_one_process_gives_the_same_bits(run_harness, tmp_path: Path) -> None:
    two = tmp_path / "two"
    run = run_harness("run", "pec", "--ranks", 2, "--golden", "off", "--out", two, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    statuses = _statuses(run, two)
    assert set(statuses.values()) == {"pass"}, statuses
    for arm in ARMS:
        assert {f"{arm}: {name}" for name in INVARIANTS} <= statuses.keys()
    for compared in ("sequential vs pipelined", "chunked-sequential vs chunked-pipelined"):
        assert {f"{compared}: loss", f"{compared}: grad_norm"} <= statuses.keys()
    assert "sequential vs pipelined, final weights" in statuses
    assert len(_curves(two, "pipelined")) == 20

    one = tmp_path / "one"
    run = run_harness("run", "pec", "--ranks", 1, "--set", "ep=2", "--golden", "off", "--out", one, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    for arm in ARMS:
        assert _curves(one, arm) == _curves(two, arm), arm
    assert sorted(p.name for p in (one / "arms" / "pipelined").glob("pec.rank*.jsonl")) == [
        "pec.rank0.jsonl",
        "pec.rank1.jsonl",
    ]


# Each planted PEC fault in a pipelined arm of its own, and exactly the checks that catch it there
# ({arm}: that arm).
PEC_FAULTS = {
    # NOL applied two batches late: a wrong hand-off, rows read stale, and the numbers part
    "nol-two-late": {
        "{arm}: pec:nol-handoff",
        "{arm}: pec:fresh-lookups",
        "{arm}: pec:starts-per-call",
        "sequential vs {arm}: loss",
        "sequential vs {arm}: grad_norm",
        "sequential vs {arm}, final weights",
    },
    "ol-before-backward": {"{arm}: pec:ol-window"},
    # the last batch's NOL is empty (everything is OL), so only the events can tell
    "no-drain": {"{arm}: pec:one-ol-one-nol", "{arm}: pec:starts-per-call"},
    "ol-as-nol": {
        "{arm}: pec:fresh-lookups",
        "sequential vs {arm}: loss",
        "sequential vs {arm}: grad_norm",
        "sequential vs {arm}, final weights",
    },
}


def _pec_with_faulty_pipelined_arms() -> str:
    """The pec suite (5 steps) with its pipelined arm once per planted fault, each compared with the
    sequential arm as pec compares its pipelined arm; the chunked pair as in pec."""
    text = (Path(__file__).resolve().parents[2] / "suites" / "pec.toml").read_text()
    head = "".join(
        line for line in text[: text.index("[arms.sequential]")].splitlines(True) if not line.startswith("#")
    )
    head = head.replace('name = "pec"', 'name = "pec-faults"').replace("steps = 20", "steps = 5")
    head = re.sub(r'description = ".*"', 'description = "pec, its pipelined arm once per planted fault"', head)
    arms = '[arms.sequential]\npec = "sequential"\n\n'
    arms += "".join(f'[arms.pipelined-{fault}]\npec = "pipelined"\npec_fault = "{fault}"\n\n' for fault in PEC_FAULTS)
    arms += '[arms.chunked-sequential]\npec = "sequential"\nchunking = "eager"\nchunks = 2\n\n'
    arms += '[arms.chunked-pipelined]\npec = "pipelined"\nchunking = "eager"\nchunks = 2\n\n'
    checks = ""
    for pair in [
        *(("sequential", f"pipelined-{fault}") for fault in PEC_FAULTS),
        ("chunked-sequential", "chunked-pipelined"),
    ]:
        arms_list = f'arms = ["{pair[0]}", "{pair[1]}"]\n'
        checks += f'[[checks]]\nkind = "exact"\n{arms_list}metrics = ["loss", "grad_norm"]\n\n'
        checks += f'[[checks]]\nkind = "final-weights"\n{arms_list}\n'
    every = ["pec-invariants", "token-exchange-invariants", "ranks-agree", "routing-counts"]
    return head + arms + checks + "".join(f'[[checks]]\nkind = "{kind}"\n\n' for kind in every)


def _of_arm(arm: str, names: set[str]) -> set[str]:
    """The checks among ``names`` that judge ``arm``: its own, and its comparisons with another arm."""
    return {
        n for n in names if n.startswith(f"{arm}: ") or f" vs {arm}: " in n or n.endswith(f" vs {arm}, final weights")
    }


@pytest.fixture(scope="module")
def pec_faults(module_run_harness, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """One 2-rank run of every planted PEC fault, each in its own arm; the run and its directory."""
    folder = tmp_path_factory.mktemp("pec-faults")
    return run_suite_text(module_run_harness, folder, "pec-faults", _pec_with_faulty_pipelined_arms())


@pytest.mark.parametrize("fault", list(PEC_FAULTS))
def test_each_planted_pec_fault_exits_1_naming_the_checks_that_catch_it(pec_faults: tuple, fault: str) -> None:
    run, out = pec_faults
    assert run.returncode == 1, run.stdout + run.stderr
    failing = _failing(run, out)
    caught_by = {name.format(arm=f"pipelined-{fault}") for name in PEC_FAULTS[fault]}
    assert _of_arm(f"pipelined-{fault}", failing) == caught_by
    assert all(f"FAIL  {name}" in run.stdout for name in caught_by), run.stdout
    # Nothing else fails: not the clean arms, run in the same processes, nor any check of two arms.
    assert failing == set().union(*(_of_arm(f"pipelined-{other}", failing) for other in PEC_FAULTS))


def test_legacy_order_fails_as_expected_on_the_autograd_invariant_only(run_harness, tmp_path: Path) -> None:
    """The documented negative suite: exactly its two expected failures, on the legacy arm's events
    only, make it pass (exit 0), reported as failed as expected."""
    out = tmp_path / "legacy"
    run = run_harness("run", "pec-legacy", "--ranks", 2, "--steps", 5, "--golden", "off", "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    statuses = _statuses(run, out)
    assert {name for name, status in statuses.items() if status == "xfail"} == {
        "legacy: pec:no-autograd-start",
        "legacy: pec:ol-window",
    }
    assert set(statuses.values()) == {"pass", "xfail"}, statuses
    autograd = run.check(out, "legacy: pec:no-autograd-start")
    assert autograd["detail"].startswith(
        "failed as expected: logical rank 0: OL start of batch 1 (call 1) started inside autograd"
    )
    assert run.summary(out)["verdict"] == "failed-as-expected"
    assert "pec-legacy: FAILED AS EXPECTED (exit 0)" in run.stdout
    assert 'type="xfail"' in (out / "junit.xml").read_text()
    assert "FAILED AS EXPECTED" in (out / "report.html").read_text()


def test_a_negative_suite_whose_bug_is_gone_fails(run_harness, tmp_path: Path) -> None:
    """The legacy arm given the pipelined order: the checks it exists to trip now pass, so the
    negative suite fails (exit 1), naming each expected failure that did not happen."""
    out = tmp_path / "fixed"
    args = ("--steps", 2, "--golden", "off", "--set", "arms.legacy.pec=pipelined", "--out", out)
    run = run_harness("run", "pec-legacy", "--ranks", 2, *args)
    assert run.returncode == 1, run.stdout + run.stderr
    assert _failing(run, out) == {"legacy: pec:no-autograd-start", "legacy: pec:ol-window"}
    assert run.check(out, "legacy: pec:ol-window")["detail"].startswith("expected to fail, but passed: ")


def test_both_rowwise_optimizers_pipelined_equal_sequential(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "optimizers"
    run = run_harness("run", "pec-optimizers", "--ranks", 2, "--steps", 5, "--golden", "off", "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    statuses = _statuses(run, out)
    assert set(statuses.values()) == {"pass"}, statuses
    assert _curves(out, "sgd-pipelined") != _curves(out, "adagrad-pipelined")  # the optimizer is really chosen
