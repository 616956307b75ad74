"""Change checks on the bundled reference (harness/change.py): every arm at two git revisions of
``harness/reference/``, taken from a real repository the test makes; a comment-only change passes
bitwise, a planted numerics change fails naming the step, the parameter and the op, and a planted
slowdown fails the ABBA gate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import pytest
from git_repos import (
    COMMENT_ONLY,
    ONE_ARM_SUITE,
    ONE_PROCESS,
    ROUTED_SCALING_TWICE,
    GitRepo,
    copy_reference,
    replace_in,
)

from harness.verdict import EXIT_FAIL, EXIT_PASS, EXIT_USAGE

# Every step sleeps 30% of its own time after it.
SLOW_STEP = replace_in(
    "harness/reference/train.py",
    "        loss, grad_norm = results[self.logical_ranks[0]]\n",
    "        loss, grad_norm = results[self.logical_ranks[0]]\n"
    "        time.sleep(0.3 * (time.perf_counter() - start))\n",
)


class History(NamedTuple):
    repo: GitRepo
    shipped: str  # the reference as the harness ships it
    comment: str  # main's HEAD: a comment added, nothing else
    scaling_twice: str  # branch "planted", from shipped
    slow: str  # branch "slow", from shipped
    suite: Path


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> History:
    root = tmp_path_factory.mktemp("change")
    repo = GitRepo(root / "repo")
    shipped = repo.commit("reference as shipped", copy_reference)
    repo.git("checkout", "-q", "-b", "planted")
    scaling_twice = repo.commit("router: apply the routed scaling factor twice", ROUTED_SCALING_TWICE)
    repo.git("checkout", "-q", "-b", "slow", shipped)
    slow = repo.commit("train: a slower step", SLOW_STEP)
    repo.git("checkout", "-q", "main")
    comment = repo.commit("model: a comment", COMMENT_ONLY)
    suite = root / "change-one.toml"
    suite.write_text(ONE_ARM_SUITE)
    return History(repo, shipped, comment, scaling_twice, slow, suite)


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_a_comment_only_commit_passes_parity_with_every_change_check_bitwise(
    run_harness, history: History, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    run = run_harness(
        "run", "parity", "--steps", 3, "--base", "HEAD~1", "--source", history.repo.root, "--out", out, timeout=400
    )
    assert run.returncode == EXIT_PASS, run.stdout + run.stderr
    summary = _summary(out)
    change = [c for c in summary["checks"] if c["kind"] == "change"]
    assert len(change) == 9 and all(c["status"] == "pass" for c in change)  # 3 arms: loss, grad norm, weights
    assert all("bitwise identical" in c["detail"] for c in change)
    line = f"head ({history.comment[:7]}) vs base HEAD~1 ({history.shipped[:7]}): 3 steps bitwise identical on 3 arms"
    assert summary["change"]["line"] == line and line in run.stdout
    assert line in (out / "report.html").read_text()
    # The suite's own checks judged the head arms alone, as a plain run does.
    own = [c for c in summary["checks"] if c["kind"] not in ("change", "golden")]
    assert own and all("@base" not in " ".join(c["arms"]) for c in own)
    manifest = json.loads((out / "manifest.json").read_text())
    assert {g["revision"] for g in manifest["launches"]} <= {"base", "head"}
    assert manifest["revisions"]["base"]["sha"] == history.shipped
    # The same change as a CI gate passes too, its base's records reused from the run above.
    gate = tmp_path / "gate"
    ci = run_harness("ci", "parity", "--steps", 3, "--base", "HEAD~1", "--source", history.repo.root, "--out", gate)
    assert ci.returncode == EXIT_PASS and "base: records of 3 arms reused" in ci.stdout, ci.stdout + ci.stderr


def test_a_planted_numerics_change_fails_naming_the_step_the_parameter_and_the_op(
    run_harness, history: History, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    change = ("--base", history.shipped, "--head", history.scaling_twice, "--source", history.repo.root, *ONE_PROCESS)
    run = run_harness("run", history.suite, *change, "--first-op", "on", "--out", out, timeout=400)
    assert run.returncode == EXIT_FAIL, run.stdout + run.stderr
    summary = _summary(out)
    assert summary["label"] == "change" and summary["label_line"].startswith("change: 3 failed checks")
    loss = next(c for c in summary["checks"] if c["name"] == "eager: head vs base: loss")
    assert loss["first_divergent_step"] == 1 and "first gradient to differ is lm_head.weight" in loss["detail"]
    op = loss["extra"]["first_op_divergence"]
    assert op["status"] == "located" and op["arms"] == {"a": "eager@base", "b": "eager"}
    # The extra multiply by the scale: an op of the router that only the head's code makes.
    assert "model.layers.1.mlp.gate" in op["line"] and "whose output only eager makes" in op["line"]
    assert summary["change"]["line"].startswith(f"head ({history.scaling_twice[:7]}) vs base ({history.shipped[:7]})")
    assert "1 of 1 arm differ" in summary["change"]["line"] and op["line"] in summary["change"]["line"]
    # The same change as a CI gate: the base was judged by the run above, so only the head runs.
    gate = tmp_path / "gate"
    ci = run_harness("ci", history.suite, *change, "--out", gate, timeout=400)
    assert ci.returncode == EXIT_FAIL, ci.stdout + ci.stderr
    assert "base: records of 1 arm reused" in ci.stdout
    attempt = json.loads((gate / "ci.json").read_text())["suites"][0]
    assert attempt["label"] == "change", attempt
    launched = json.loads((gate / "change-one" / "attempt-1" / "manifest.json").read_text())["launches"]
    assert [g["revision"] for g in launched] == ["head"]


def test_a_planted_slowdown_fails_the_abba_gate_of_head_against_base(
    run_harness, history: History, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    change = ("--base", history.shipped, "--head", history.slow, "--source", history.repo.root, "--arm", "eager")
    # "Is my branch slower at all?": any slowdown with confidence fails. Each block position is a launch of its
    # own (a process imports one revision) that costs some 5 s to start: positions of 100 steps (3 s) average
    # out a busy machine's spells, and decide in about 5 blocks where positions of 20 steps took 9.
    timing = ("--ranks", 1, "--steps", 100, "--warmup", 2, "--max-blocks", 12, "--budget-s", 300, "--max-slowdown", 0)
    run = run_harness("abba", history.suite, *change, *timing, "--out", out, timeout=500)
    assert run.returncode == EXIT_FAIL, run.stdout + run.stderr
    measured = _summary(out)["throughput"]
    assert measured["low"] > 1.0 and measured["ratio"] > 1.15, measured
    line = _summary(out)["change"]["line"]
    assert line.startswith(f"head ({history.slow[:7]}) vs base ({history.shipped[:7]}): eager/eager@base step time")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--base", "no-such-rev"), "error: --base no-such-rev: "),
        (("--base", "HEAD", "--head", "nope"), "error: --head nope: "),
        (("--head", "HEAD"), "error: --head: only with --base REV"),
        (("--base", "HEAD", "--source", "/"), "error: --source /: not in a git repository"),
        (("--base", "HEAD", "--golden", "update"), "error: --base: a change check records no golden"),
    ],
    ids=["base", "head", "head-alone", "source-not-git", "golden-update"],
)
def test_bad_change_input_is_one_line_and_exit_2(
    harness_main, history: History, tmp_path: Path, args: tuple, message: str
) -> None:
    source = () if "--source" in args else ("--source", history.repo.root)
    run = harness_main("run", history.suite, *args, *source, "--out", tmp_path / "run")
    assert run.returncode == EXIT_USAGE and run.stderr.startswith(message) and run.stderr.count("\n") == 1, run.stderr
    assert not (tmp_path / "run").exists()


def test_a_source_without_the_subjects_package_is_refused(harness_main, tmp_path: Path) -> None:
    repo = GitRepo(tmp_path / "empty")
    repo.commit("nothing", lambda root: (root / "README").write_text("no package here\n"))
    run = harness_main("run", "parity", "--base", "HEAD", "--source", repo.root)
    assert run.returncode == EXIT_USAGE
    assert "does not hold the subject's package harness.reference" in run.stderr, run.stderr


def test_a_change_table_with_an_unknown_tier_is_refused(harness_main, tmp_path: Path) -> None:
    path = tmp_path / "suite.toml"
    path.write_text(ONE_ARM_SUITE + '\n[change]\nkind = "roughly"\n')
    run = harness_main("run", path)
    assert run.returncode == EXIT_USAGE and "suite.toml: change: " in run.stderr and "roughly" in run.stderr
