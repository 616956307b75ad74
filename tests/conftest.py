"""Fixtures for tests that run the harness for real: its CLI in a subprocess, and /proc scans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest

from harness.records import read_jsonl

REPO = Path(__file__).resolve().parent.parent
SCHEMAS = REPO / "docs" / "schema"


def _validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads((SCHEMAS / name).read_text()))


SUMMARY_SCHEMA, METRICS_LINE_SCHEMA = _validator("summary.schema.json"), _validator("metrics-line.schema.json")
MANIFEST_SCHEMA, ARM_SCHEMA = _validator("manifest.schema.json"), _validator("arm.schema.json")


def valid_summary(run_dir: Path) -> dict:
    """summary.json of a run, checked against its published JSON Schema, and so are its manifest.json,
    every arm.json and every line of its arms' metrics.jsonl: what a dashboard reads must be what
    the docs say."""
    summary = json.loads((run_dir / "summary.json").read_text())
    SUMMARY_SCHEMA.validate(summary)
    MANIFEST_SCHEMA.validate(json.loads((run_dir / "manifest.json").read_text()))
    for arm in sorted(run_dir.glob("arms/*/arm.json")):
        ARM_SCHEMA.validate(json.loads(arm.read_text()))
    for metrics in sorted(run_dir.glob("arms/*/metrics.jsonl")):
        for line in read_jsonl(metrics):
            METRICS_LINE_SCHEMA.validate(line)
    return summary


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str
    elapsed_s: float

    def summary(self, run_dir: Path) -> dict:
        return valid_summary(run_dir)

    def check(self, run_dir: Path, name: str) -> dict:
        return next(c for c in self.summary(run_dir)["checks"] if c["name"] == name)


def _command(args: tuple) -> list[str]:
    return [sys.executable, "-m", "harness", *map(str, args)]


# A test that asks for one of these runs the harness's CLI in a subprocess, rank processes and all
# (``installed``: a wheel's harness, in a fresh venv: tests/test_package.py).
E2E_FIXTURES = frozenset({"run_harness", "start_harness", "installed"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks every end-to-end test ``e2e`` by the fixtures it asks for, so that nobody has to remember
    to: ``pytest -m "not e2e"`` is then the fast tier, the unit and in-process tests alone."""
    for item in items:
        if E2E_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(autouse=True)
def no_shipped_goldens(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """CLI runs see an empty golden root unless a test passes --golden-dir: no test may depend on
    the goldens shipped for the machine it runs on."""
    monkeypatch.setenv("HARNESS_GOLDEN_DIR", str(tmp_path_factory.mktemp("no-goldens")))


@pytest.fixture(autouse=True)
def no_first_op_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    """CLI runs do not re-run a failed pair op by op unless a test asks (--first-op, tests/test_first_op.py):
    every planted failure would otherwise pay for two more launches, minutes over the suite."""
    monkeypatch.setenv("HARNESS_FIRST_OP", "off")


@pytest.fixture(autouse=True)
def shared_trace_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs share one trace cache per test session (all xdist workers), never the user's own: a traced
    arm is traced once per session, and every later run checks the cached graph as it would a fresh one.
    The key that signs its entries is the session's too (XDG_CONFIG_HOME): no test touches ~/.config."""
    session = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        session = session.parent  # popen-gw<k>/ sits in the session's directory
    monkeypatch.setenv("HARNESS_TRACE_CACHE", str(session / "trace-cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(session / "config"))


@pytest.fixture
def umask_000() -> Iterator[None]:
    """umask 000 for the test, and so for the runs it starts: whatever is made without a mode of its
    own is 0777 (folders) or 0666 (files). Private files must be made so whatever the umask."""
    before = os.umask(0)
    yield
    os.umask(before)


@pytest.fixture
def run_harness() -> Callable[..., CliRun]:
    """``run_harness("run", "determinism", "--steps", 3)``: the real CLI, waited for."""

    def run(*args: object, timeout: float = 240, env: dict[str, object] | None = None) -> CliRun:
        start = time.monotonic()
        environ = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
        proc = subprocess.run(_command(args), cwd=REPO, capture_output=True, text=True, timeout=timeout, env=environ)
        return CliRun(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)

    return run


@pytest.fixture
def plant(tmp_path: Path) -> Callable[[str], dict[str, object]]:
    """``plant(code)``: the environment in which every process of a run (the ranks included) runs
    ``code`` at start-up, as a sitecustomize, with the repository importable so it can patch the
    reference: a bug planted where a change would put it. The trace cache is off: a patch made at
    run time leaves the reference's files, and so the cache key, as they were."""

    def environment(code: str) -> dict[str, object]:
        site = tmp_path / "planted"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(code)
        return {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "HARNESS_TRACE_CACHE": "off"}

    return environment


@pytest.fixture
def start_harness() -> Callable[..., subprocess.Popen]:
    """The real CLI, started and not waited for; killed at teardown if still running."""
    started: list[subprocess.Popen] = []

    def start(*args: object, env: dict[str, object] | None = None) -> subprocess.Popen:
        environ = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
        proc = subprocess.Popen(
            _command(args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def processes_mentioning() -> Callable[[str], list[str]]:
    """Command lines of live processes that contain a string (a run directory): orphan detection."""

    def scan(text: str) -> list[str]:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry.name}: {cmdline}")
        return found

    return scan
