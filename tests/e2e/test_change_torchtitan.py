"""Change checks on torchtitan (`harness run torchtitan-determinism --base REV --source REPO`): a git
repository made from the installed torchtitan package's own files, where each commit is a change to
torchtitan that the `torchtitan-determinism` suite (2 ranks, torchtitan's expert parallelism, learned
routing over expert groups, cpu-tiny-learned) judges head against base.

The bug reintroduced is one torchtitan fixed: its DeepSeek-V3 router weighted a token's top-k experts
by their raw sigmoid scores, where DeepSeek-V3 and Hugging Face first normalise them to sum to 1
(pytorch/torchtitan#1418, "deepseek_v3 and llama4 moe router scores are not normlized"; fixed by
pytorch/torchtitan#1419, "[DSV3] Add normalization for topk router scores", since generalised into
the router's ``route_norm``). The test removes that normalisation from the copied router. The suite's
config normalises (cpu-tiny-learned: ``norm_topk_prob``, 3 experts a token, scaled by 2.5 after), so
the bug changes every MoE layer's output, and the loss, from step 1 on.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.environment import cpu_pin

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed: pip install -c constraints.txt 'harness[torchtitan]'",
)

ROUTER = Path("torchtitan/models/common/moe.py")
# The top-k router's normalisation: the ``if self.route_norm:`` block, its body with it.
NORMALISATION = re.compile(r"\n( +)if self\.route_norm:\n(?:\1 +\S.*\n)+")
STEPS = ("--steps", 2, "--golden", "off", "--first-op", "off")  # the first op: docs/subjects.md
CHECKS = ("loss", "grad_norm", "final weights")  # each arm's change checks
GOLDENS = Path(__file__).resolve().parents[2] / "golden"  # the shipped goldens


def _git(repo: Path, *args: str) -> str:
    """git in ``repo``, with a fixed identity and none of the user's configuration (hooks, signing)."""
    identity = {"GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@example.com"}
    identity |= {"GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@example.com"}
    env = {**os.environ, **identity, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


def _commit(repo: Path, title: str) -> None:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", title)


@pytest.fixture(scope="module")
def titan_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A git repository of the installed torchtitan: the package as installed; a comment added to its
    MoE module (HEAD~1); the router's top-k normalisation removed (HEAD)."""
    installed = Path(importlib.util.find_spec("torchtitan").submodule_search_locations[0])
    repo = tmp_path_factory.mktemp("torchtitan-repo")
    shutil.copytree(installed, repo / "torchtitan", ignore=shutil.ignore_patterns("__pycache__"))
    _git(repo, "init", "-q")
    _commit(repo, "torchtitan as installed")
    router = repo / ROUTER
    router.write_text(router.read_text() + "# A comment: the same code.\n")
    _commit(repo, "A comment in the MoE module")
    text = router.read_text()
    assert len(NORMALISATION.findall(text)) == 1, "torchtitan's router no longer normalises as 0.3.0 does"
    router.write_text(NORMALISATION.sub("\n", text, count=1))
    _commit(repo, "Router: top-k scores scaled unnormalised (torchtitan#1418, before #1419)")
    return repo


@pytest.fixture(scope="module")
def revision_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The revisions' cache ($XDG_CACHE_HOME) of this module's runs, never the user's: the base of
    one run is the head of the other, materialised once."""
    return tmp_path_factory.mktemp("xdg-cache")


def test_the_reintroduced_router_bug_fails_the_change_naming_the_step_and_gradient(
    run_harness, titan_repo: Path, revision_cache: Path, tmp_path: Path
) -> None:
    """The head (the working tree, HEAD) against HEAD~1. The forward changes, so the first gradient
    to differ in backward order is the output head's; the head is still deterministic, and its ranks
    agree: only the change checks fail."""
    out = tmp_path / "run"
    args = ("--base", "HEAD~1", "--source", titan_repo, *STEPS, "--out", out)
    run = run_harness("run", "torchtitan-determinism", *args, env={"XDG_CACHE_HOME": revision_cache}, timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr
    summary = run.summary(out)
    assert summary["label"] == "change", summary["label_line"]
    named = "step 1: first gradient to differ is lm_head.weight"
    assert named in summary["change"]["line"], summary["change"]["line"]
    assert named in run.stdout
    revisions = summary["change"]["revisions"]
    assert revisions["base"]["title"] == "A comment in the MoE module"
    assert revisions["head"]["spec"] == "the working tree" and revisions["head"]["dirty"] is None
    assert revisions["head"]["title"].startswith("Router: top-k scores scaled unnormalised")
    changes = {c["name"]: c for c in summary["checks"] if c["kind"] == "change"}
    assert set(changes) == {f"{arm}: head vs base: {what}" for arm in ("run", "run-again") for what in CHECKS}
    for name, check in changes.items():
        assert check["status"] == "fail" and check["label"] == "change", check
        if name.endswith(("loss", "grad_norm")):
            assert check["first_divergent_step"] == 1, check
            assert named in check["detail"], check["detail"]
            assert check["extra"]["first_gradient_divergence"]["parameter"] == "lm_head.weight", check
    others = [c for c in summary["checks"] if c["kind"] not in ("change", "golden")]
    assert others and all(c["status"] == "pass" for c in others), others


def test_a_comment_only_change_passes_bitwise(
    run_harness, titan_repo: Path, revision_cache: Path, tmp_path: Path
) -> None:
    """HEAD~1 (a comment added) against HEAD~2 (torchtitan as installed): two commits whose files
    differ, the same code, so every change check is bitwise."""
    out = tmp_path / "run"
    args = ("--base", "HEAD~2", "--head", "HEAD~1", "--source", titan_repo, *STEPS, "--out", out)
    run = run_harness("run", "torchtitan-determinism", *args, env={"XDG_CACHE_HOME": revision_cache}, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = run.summary(out)
    revisions = summary["change"]["revisions"]
    assert revisions["base"]["files"] != revisions["head"]["files"]  # the comment: another file
    assert summary["change"]["line"].endswith(": 2 steps bitwise identical on 2 arms"), summary["change"]["line"]
    changes = [c for c in summary["checks"] if c["kind"] == "change"]
    assert len(changes) == 6
    for check in changes:
        assert check["status"] == "pass", check
        assert check["detail"] in (
            "2 steps bitwise identical",
            "45 parameters bitwise identical on all 2 logical ranks after 2 updates",
        ), check


def test_the_reintroduced_router_bug_fails_the_golden_bitwise_here_and_at_the_calibrated_tier_elsewhere(
    run_harness, titan_repo: Path, tmp_path: Path
) -> None:
    """The same bug against the shipped golden, as a plain run of ``torchtitan-determinism``: the ranks
    import torchtitan from the repository's working tree (the bug) ahead of the installed package.
    Pinned to AVX2, this machine's own golden holds it bit for bit. At the native ISA there is no
    golden of its own, as on a machine of another vendor: the pinned one holds it at the tier
    calibrated from the noise between those environments, ten times that noise, and the bug, which
    moves the loss past that by step 2, fails there too (at rtol 1e-4, the fixed tier, it passed)."""
    for isa in ("avx2", "native"):
        out = tmp_path / isa
        args = ("--steps", 2, "--cpu-isa", isa, "--golden", "check", "--golden-dir", GOLDENS, "--out", out)
        run = run_harness("run", "torchtitan-determinism", *args, env={"PYTHONPATH": titan_repo}, timeout=600)
        assert run.returncode == 1, run.stdout + run.stderr
        summary = run.summary(out)
        failed = {c["name"]: c for c in summary["checks"] if c["status"] == "fail"}
        assert {"golden:run:loss", "golden:run-again:loss"} <= set(failed), sorted(failed)
        assert all(c["kind"] == "golden" for c in failed.values()), sorted(failed)
        # Bit for bit from step 1; at ten times the noise, once the bug has moved the loss that far: step 2.
        assert failed["golden:run:loss"]["first_divergent_step"] == (1 if isa == "avx2" else 2), failed[
            "golden:run:loss"
        ]
        golden = summary["golden"]
        assert golden["missing_for_this_environment"] == (isa == "native"), golden
        if isa == "native" and cpu_pin("native").capability != "avx2":
            assert "calibrated: loss within rtol=" in golden["plan"], golden["plan"]
