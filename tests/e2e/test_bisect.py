"""``harness bisect``: the first commit of a real git history at which a suite fails, found by probing
a few commits with change runs, skipping one that does not build, and leaving the checkout as it was.
Its refusals of bad input are in-process and fast; ``pick`` is the search's next probe."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from git_repos import ONE_ARM_SUITE, ONE_PROCESS, ROUTED_SCALING_TWICE, GitRepo, append_to, copy_reference

from harness.bisect import max_probes, pick

BROKEN = "harness/reference/broken.py"


def _history(repo: GitRepo, commits: int) -> None:
    """A repository holding the reference package: commit 1 copies it, each later one appends a comment,
    but commit 7 adds a module that does not compile, commit 8 removes it, commit 9 plants a numerics
    change (the routing weights scaled twice)."""
    repo.commit("copy the reference", copy_reference)
    for k in range(2, commits + 1):
        if k == 7:
            repo.commit(
                "add broken.py, which does not compile", lambda root: (root / BROKEN).write_text("def broken(:\n")
            )
        elif k == 8:
            repo.commit("remove broken.py", lambda root: (root / BROKEN).unlink())
        elif k == 9:
            repo.commit("scale the routing weights twice", ROUTED_SCALING_TWICE)
        else:
            module = "model.py" if k % 2 else "train.py"
            repo.commit(f"comment {k}", append_to(f"harness/reference/{module}", f"# comment {k}"))


def _state(repo: Path) -> tuple[str, str, str]:
    """git status, HEAD, and a hash of every file of the working tree and of the index."""
    status = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=all", "--ignored"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    digest = hashlib.sha256()
    for path in sorted(p for p in repo.rglob("*") if p.is_file() and ".git" not in p.relative_to(repo).parts):
        digest.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update((repo / ".git" / "index").read_bytes())
    digest.update((repo / ".git" / "HEAD").read_bytes())
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    return status, head.stdout, digest.hexdigest()


def test_bisect_names_the_commit_that_changed_the_numerics_skipping_one_that_does_not_build(
    run_harness, tmp_path: Path
) -> None:
    repo, out, suite = GitRepo(tmp_path / "repo"), tmp_path / "bisect", tmp_path / "change-one.toml"
    _history(repo, 16)
    suite.write_text(ONE_ARM_SUITE)
    shas = repo.git("rev-list", "--reverse", "HEAD").split()
    culprit, broken = shas[8], shas[6]  # commits 9 and 7
    before = _state(repo.root)

    result = run_harness(
        "bisect", suite, "--good", shas[0], "--bad", "HEAD", "--source", repo.root, "--steps", 2, *ONE_PROCESS,
        "--golden", "off", "--out", out,
        env={"XDG_CACHE_HOME": tmp_path / "cache"}, timeout=600,
    )  # fmt: skip

    assert result.returncode == 0, result.stdout + result.stderr
    assert _state(repo.root) == before
    assert f"first bad commit: {culprit} scale the routing weights twice" in result.stdout
    assert "bisect: 15 candidates" in result.stdout
    log = json.loads((out / "bisect.json").read_text())
    assert log["verdict"] == "found" and log["culprit"]["sha"] == culprit
    assert log["runs"] <= 6 and log["runs"] == len(log["probes"]) + 1
    skipped = [p for p in log["probes"] if p["verdict"] == "skip"]
    assert [p["sha"] for p in skipped] == [broken] and log["skipped"] == 1
    assert skipped[0]["exit_code"] == 3 and "broken.py:1" in skipped[0]["error"]
    assert f"probe {skipped[0]['number']}: {broken[:7]} " in result.stdout
    for probe in log["probes"]:
        if probe["verdict"] != "skip":
            assert (out / probe["report"]).is_file()
            assert probe["run_dir"] == f"probe-{probe['number']}-{probe['sha'][:7]}"
    parent = log["culprit"]["parent"]
    assert parent["sha"] == shas[7] and parent["from"] == "probe"
    assert "eager: head vs base: loss" in log["culprit"]["checks"]
    assert "eager: ranks-agree" not in log["culprit"]["checks"]
    # the run of the culprit against its parent names the first op where they part
    first_op = log["first_op"]
    assert first_op["exit_code"] == 1 and "first op:" in first_op["line"] and "mlp.gate" in first_op["line"]
    assert f"bisect: first op: {first_op['line']}" in result.stdout
    page = (out / "bisect.html").read_text()
    assert all(p["report"] in page for p in log["probes"] if p["report"])


def test_good_not_an_ancestor_of_bad_is_one_line_exit_2(harness_main, tmp_path: Path) -> None:
    repo, suite = GitRepo(tmp_path / "repo"), tmp_path / "change-one.toml"
    _history(repo, 3)
    suite.write_text(ONE_ARM_SUITE)
    result = harness_main(
        "bisect", suite, "--good", "HEAD", "--bad", "HEAD~2", "--source", repo.root, "--out", tmp_path / "b"
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "is not an ancestor of --bad HEAD~2" in result.stderr
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("flag", ["--good", "--bad"])
def test_a_revision_that_does_not_resolve_is_exit_2(harness_main, tmp_path: Path, flag: str) -> None:
    repo, suite = GitRepo(tmp_path / "repo"), tmp_path / "change-one.toml"
    _history(repo, 2)
    suite.write_text(ONE_ARM_SUITE)
    revisions = {"--good": "HEAD~1", "--bad": "HEAD", flag: "no-such-rev"}
    result = harness_main("bisect", suite, *[x for item in revisions.items() for x in item], "--source", repo.root)
    assert result.returncode == 2
    assert result.stderr == f"error: {flag} no-such-rev: does not resolve to a commit in {repo.root.resolve()}\n"


def test_the_next_probe_is_the_midpoint_or_past_skipped_ones_the_nearest_later_first() -> None:
    assert pick(-1, 15, set()) == 7 and max_probes(15) == 4
    assert pick(3, 7, {5}) == 6 and pick(3, 7, {4, 5, 6}) is None
    assert pick(6, 7, set()) is None and pick(-1, 0, set()) is None
