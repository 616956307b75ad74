"""`harness ci`: several suites as one gate on real gloo ranks, retries of infrastructure failures
only, one index.html and one merged junit.xml, the worst exit code; `harness doctor --device cuda`;
and the GitHub workflows that run them."""

from __future__ import annotations

import json
import re
import shlex
import signal
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from harness.ci import worst_exit_code
from harness.cli import build_parser, main
from harness.suites import list_suites

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO / ".github" / "workflows"
GATE_SUITES = ["parity", "logical-ranks", "strict-vs-stale", "pec"]


def _variant(tmp_path: Path, name: str, replace: tuple[str, str] = ("", ""), append: str = "") -> Path:
    """suites/logical-ranks.toml under another name, with one edit: a suite file of its own for a gate."""
    text = (REPO / "suites" / "logical-ranks.toml").read_text()
    assert replace[0] in text
    text = text.replace('name = "logical-ranks"', f'name = "{name}"').replace(*replace) + append
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def _testsuites(gate: Path) -> dict[str, list[ET.Element]]:
    root = ET.parse(gate / "junit.xml").getroot()
    assert root.tag == "testsuites"
    return {suite.get("name"): suite.findall("testcase") for suite in root.findall("testsuite")}


def _attempts(gate: Path, suite: str) -> list[dict]:
    record = json.loads((gate / "ci.json").read_text())
    return next(s for s in record["suites"] if s["suite"] == suite)["attempts"]


def test_gate_of_two_passing_suites_exits_0_with_one_index_and_their_junit_merged(run_harness, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    run = run_harness("ci", "parity", "logical-ranks", "--ranks", 2, "--steps", 3, "--golden", "off", "--out", gate)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in gate.glob("**/index.html")) == ["index.html"]
    index = (gate / "index.html").read_text()
    for suite in ("parity", "logical-ranks"):
        report = f"{suite}/attempt-1/report.html"
        assert f'href="{report}"' in index and (gate / report).is_file()
        [attempt] = _attempts(gate, suite)
        assert (attempt["attempt"], attempt["exit_code"], attempt["verdict"]) == (1, 0, "pass")
        assert attempt["run_dir"] == f"{suite}/attempt-1"
    record = json.loads((gate / "ci.json").read_text())
    assert (record["verdict"], record["exit_code"]) == ("pass", 0)
    # The merged file holds each run's own testsuite, testcase for testcase.
    merged = _testsuites(gate)
    assert list(merged) == ["parity", "logical-ranks"]
    for suite, cases in merged.items():
        own = ET.parse(gate / suite / "attempt-1" / "junit.xml").getroot().find("testsuite").findall("testcase")
        assert [c.get("name") for c in cases] == [c.get("name") for c in own] and len(cases) > 5
    assert "procs vs inproc: loss" in [c.get("name") for c in merged["logical-ranks"]]
    assert "ci: PASS (exit 0) - 2 suites" in run.stdout and f"index: {gate / 'index.html'}" in run.stdout


def test_regression_is_not_retried_infrastructure_is_retried_and_the_gate_exits_1(run_harness, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    regression = _variant(tmp_path, "diverges", ("[arms.inproc]\nranks = 1\n", "[arms.inproc]\nranks = 1\nlr = 0.01\n"))
    flake = _variant(tmp_path, "killed", append='\n[debug]\nfail_mode = "kill"\nfail_step = 1\nfail_rank = 1\n')
    run = run_harness("ci", regression, flake, "--steps", 2, "--golden", "off", "--retries", 1, "--out", gate)
    assert run.returncode == 1, run.stdout + run.stderr  # a regression outranks an infrastructure failure
    [failed] = _attempts(gate, "diverges")
    assert (failed["exit_code"], failed["verdict"], failed["run_dir"]) == (1, "fail", "diverges/attempt-1")
    killed = _attempts(gate, "killed")
    assert [(a["attempt"], a["exit_code"], a["verdict"]) for a in killed] == [(1, 3, "error"), (2, 3, "error")]
    assert all("killed by SIGKILL" in a["error"] for a in killed)
    assert not (gate / "diverges" / "attempt-2").exists() and (gate / "killed" / "attempt-2" / "report.html").is_file()
    record = json.loads((gate / "ci.json").read_text())
    assert (record["verdict"], record["exit_code"]) == ("fail", 1)
    assert [(s["suite"], s["exit_code"]) for s in record["suites"]] == [("diverges", 1), ("killed", 3)]
    # A failed suite carries its run's label, so the gate's table tells a regression from drift.
    assert [s["label"] for s in record["suites"]] == ["regression", None]
    assert re.search(r"^  FAIL \[regression\]\s+diverges\s+exit 1", run.stdout, re.MULTILINE), run.stdout
    merged = _testsuites(gate)  # the final attempt of each
    killed_cases = ET.parse(gate / "killed" / "attempt-2" / "junit.xml").getroot().find("testsuite")
    errors = [case.find("error").get("type") for case in killed_cases if case.find("error") is not None]
    assert errors[0] == "launch" and set(errors[1:]) == {"not-evaluated"}, errors  # no arm ran after the kill
    assert killed_cases.get("errors") == str(len(errors))
    assert any(c.find("failure") is not None for c in merged["diverges"])
    assert any(c.find("error") is not None for c in merged["killed"])
    index = (gate / "index.html").read_text()
    assert "FAIL [regression]</td>" in index
    assert 'href="killed/attempt-1/report.html"' in index and 'href="killed/attempt-2/report.html"' in index
    assert "ci: killed: exit 3 (infrastructure), retrying" in run.stdout


def test_sigint_stops_the_whole_gate_with_130(start_harness, processes_mentioning, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    proc = start_harness("ci", "logical-ranks", "parity", "--steps", 50, "--golden", "off", "--out", gate)
    metrics = gate / "logical-ranks" / "attempt-1" / "arms" / "procs" / "metrics.jsonl"
    give_up = time.monotonic() + 120
    while not (metrics.is_file() and metrics.stat().st_size):
        assert proc.poll() is None and time.monotonic() < give_up, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 130, stdout + stderr
    assert not (gate / "parity").exists()  # the next suite never started
    [attempt] = _attempts(gate, "logical-ranks")
    assert (attempt["exit_code"], attempt["verdict"]) == (130, "cancelled")
    record = json.loads((gate / "ci.json").read_text())
    assert (record["verdict"], record["exit_code"], record["cancelled"]) == ("cancelled", 130, "cancelled by SIGINT")
    assert record["suites"][1] == {
        "suite": "parity",
        "verdict": "not run",
        "exit_code": None,
        "label": None,
        "report": None,
        "attempts": [],
    }
    assert [c.find("skipped").get("message") for c in _testsuites(gate)["parity"]] == [
        "not run: the gate stopped (cancelled by SIGINT) before this suite"
    ]
    assert (gate / "index.html").is_file() and not processes_mentioning(str(gate))


# The cases below stop before any rank starts, so they run the CLI in this process (capsys): a
# subprocess would only add the start-up of torch to each.


def test_bad_suite_name_among_several_exits_2_before_anything_runs(capsys, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    assert main(["ci", "logical-ranks", "no-such-suite", "--out", str(gate)]) == 2
    assert "no-such-suite.toml: no such suite file" in capsys.readouterr().err
    assert not gate.exists()
    assert main(["ci", "logical-ranks", "logical-ranks", "--out", str(gate)]) == 2
    assert "logical-ranks named more than once" in capsys.readouterr().err and not gate.exists()
    assert main(["ci", "logical-ranks", "--retries", "-1", "--out", str(gate)]) == 2 and not gate.exists()


def test_suite_refused_in_the_gate_is_exit_2_without_a_retry_and_in_the_junit(capsys, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    empty = tmp_path / "empty"
    assert main(["ci", "logical-ranks", "--golden", "check", "--golden-dir", str(empty), "--out", str(gate)]) == 2
    [attempt] = _attempts(gate, "logical-ranks")
    assert (attempt["exit_code"], attempt["verdict"], attempt["run_dir"]) == (2, "usage", None)
    [case] = _testsuites(gate)["logical-ranks"]
    assert case.get("name") == "run" and case.find("error").get("message") == attempt["error"]
    assert "golden" in attempt["error"]


@pytest.mark.parametrize(
    ("codes", "worst"),
    [
        ([], 0),
        ([0, 0], 0),
        ([0, 4], 4),
        ([4, 3], 3),
        ([3, 2], 2),
        ([2, 1, 3, 4, 0], 1),
        ([1, 130], 130),
        ([143, 3, 1], 143),
    ],
)
def test_worst_exit_code_orders_signal_regression_usage_infrastructure_inconclusive_pass(
    codes: list[int], worst: int
) -> None:
    assert worst_exit_code(codes) == worst


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the preflight has nothing to miss here")
def test_doctor_cuda_names_each_missing_item_on_its_own_line_and_exits_2(capsys, monkeypatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert main(["doctor", "--device", "cuda", "--ranks", "2"]) == 2
    out, err = capsys.readouterr()
    cuda = f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None else "sees no GPU"
    nccl = [] if dist.is_nccl_available() else ["missing: nccl: torch.distributed has no NCCL backend in this build"]
    missing = err.splitlines()
    assert missing[0].startswith("missing: cuda: ") and cuda in missing[0]
    assert missing[1:] == ["missing: gpus: 0 visible, --ranks 2 needs 2 (one per rank)", *nccl]
    assert "ok: CUBLAS_WORKSPACE_CONFIG: unset: the ranks set :4096:8" in out.splitlines()
    assert "ok: deterministic algorithms: torch.use_deterministic_algorithms(True) accepted" in out.splitlines()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    assert main(["doctor", "--device", "cuda", "--ranks", "2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        *missing,
        "missing: CUBLAS_WORKSPACE_CONFIG: ':0:0' in the environment; deterministic cuBLAS needs :4096:8 or :16:8",
    ]
    assert main(["doctor"]) == 0  # plain doctor: no preflight
    out, err = capsys.readouterr()
    assert not err and not any(line.startswith(("ok:", "missing:")) for line in out.splitlines())


def _workflow(name: str) -> dict:
    workflow = yaml.safe_load((WORKFLOWS / name).read_text())
    workflow["on"] = workflow.pop(True)  # YAML 1.1 reads the key `on` as true
    return workflow


def _commands(job: dict) -> list[list[str]]:
    return [shlex.split(line) for step in job["steps"] if "run" in step for line in step["run"].splitlines() if line]


def test_gpu_gate_workflow_runs_harness_ci_on_the_self_hosted_h200_runner() -> None:
    workflow = _workflow("gpu-gate.yml")
    assert set(workflow["on"]) >= {"push", "pull_request"}
    job = workflow["jobs"]["gate"]
    assert job["runs-on"] == ["self-hosted", "linux", "h200"]
    commands = _commands(job)
    parser = build_parser()
    [doctor] = [parser.parse_args(c[1:]) for c in commands if c[0].endswith("harness") and c[1] == "doctor"]
    assert (doctor.device, doctor.ranks) == ("cuda", 2)
    [gate] = [parser.parse_args(c[1:]) for c in commands if c[0].endswith("harness") and c[1] == "ci"]
    assert (gate.suite, gate.ranks, gate.device) == (GATE_SUITES, "2", "cuda")
    assert set(GATE_SUITES) <= {suite for suite, _ in list_suites()}
    # The harness retries; the workflow does not, and it publishes and uploads whatever the gate left.
    assert not any("retry" in step.get("uses", "") or step.get("continue-on-error") for step in job["steps"])
    by_action = {step["uses"].split("@")[0]: step for step in job["steps"] if "uses" in step}
    junit = by_action["mikepenz/action-junit-report"]
    upload = by_action["actions/upload-artifact"]
    assert junit["with"]["report_paths"] == str(gate.out / "junit.xml")
    assert upload["with"]["path"].rstrip("/") == str(gate.out)
    assert junit["if"] == upload["if"] == "always()"


def test_gpu_gate_workflow_judges_a_pull_request_as_a_change_against_its_base() -> None:
    job = _workflow("gpu-gate.yml")["jobs"]["change"]
    assert job["runs-on"] == ["self-hosted", "linux", "h200"] and "pull_request" in job["if"]
    assert "head.repo.full_name == github.repository" in job["if"]  # never code from a fork
    checkout = next(step for step in job["steps"] if step.get("uses", "").startswith("actions/checkout"))
    assert checkout["with"]["fetch-depth"] == 0  # the base commit must be in the clone
    [gate] = [build_parser().parse_args(c[1:]) for c in _commands(job) if c[0].endswith("harness") and c[1] == "ci"]
    assert gate.base == "${{ github.event.pull_request.base.sha }}" and gate.head is None  # the checkout itself
    assert set(gate.suite) <= set(GATE_SUITES) and gate.device == "cuda"


def test_cpu_workflow_runs_the_readme_test_command_on_a_hosted_runner() -> None:
    workflow = _workflow("cpu.yml")
    [job] = workflow["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest"
    assert _commands(job) == [[".ci/run"]]
    readme_command = "pip install -c constraints.txt -e '.[test]' && tools/install-torchrec && python -m pytest -n 2 -q"
    assert readme_command in (REPO / "README.md").read_text() and readme_command in (REPO / ".ci" / "run").read_text()
