"""Fixtures for tests that start real processes (the harness command with its ranks, rank processes
in a real process group, a browser), which mark them ``e2e``; the command in the test's own process,
for what it refuses before launching; the environment every test's runs see; /proc scans."""

from __future__ import annotations

import fcntl
import json
import math
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest

from harness.cli import main as cli_main
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


# A test that asks for one of these starts real processes (a fixture that asks for one marks the
# tests that use it): the harness command's rank processes, the command itself in this process or in
# a subprocess (run_harness, module_run_harness, start_harness, run_in_terminal; installed: a wheel's
# harness in a fresh venv, tests/test_package.py; run_gpu_smoke: a script that runs it), rank
# processes in a real gloo process group (run_on_ranks, and run_reference: the bundled reference's own
# CLI), or a headless browser (chromium).
E2E_FIXTURES = frozenset(
    {"run_harness", "module_run_harness", "start_harness", "run_in_terminal", "installed", "run_gpu_smoke"}
    | {"run_on_ranks", "run_reference", "chromium"}
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks every test that starts real processes ``e2e`` by the fixtures it asks for, so that nobody
    has to remember to: ``pytest -m "not e2e"`` is then the fast tier, the unit and in-process tests alone."""
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


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test session's temporary folder, the same for all its xdist workers."""
    session = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        session = session.parent  # popen-gw<k>/ sits in the session's directory
    return session


@pytest.fixture(autouse=True)
def shared_trace_cache(session_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs share one trace cache per test session (all xdist workers), never the user's own: a traced
    arm is traced once per session, and every later run checks the cached graph as it would a fresh one.
    The key that signs its entries is the session's too (XDG_CONFIG_HOME): no test touches ~/.config;
    nor ~/.cache, where change checks keep revisions and base records (XDG_CACHE_HOME)."""
    monkeypatch.setenv("HARNESS_TRACE_CACHE", str(session_dir / "trace-cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(session_dir / "config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(session_dir / "cache"))


@pytest.fixture
def umask_000() -> Iterator[None]:
    """umask 000 for the test, and so for the runs it starts: whatever is made without a mode of its
    own is 0777 (folders) or 0666 (files). Private files must be made so whatever the umask."""
    before = os.umask(0)
    yield
    os.umask(before)


def _run_cli(args: tuple, timeout: float, env: dict[str, object]) -> CliRun:
    start = time.monotonic()
    environ = {**os.environ, **{k: str(v) for k, v in env.items()}}
    proc = subprocess.run(_command(args), cwd=REPO, capture_output=True, text=True, timeout=timeout, env=environ)
    return CliRun(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


def _in_process(
    args: tuple,
    env: dict[str, object],
    capture: pytest.CaptureFixture[str],
    patch: pytest.MonkeyPatch,
    timeout: float,
    tests_tmp: Path,
) -> CliRun:
    """``harness.cli.main(args)`` in this process, from the repository, with ``env`` set for the call;
    its exit code and what it and its ranks printed (``capture`` is fd-level for runs). The modules
    it imported from the tests' temporary folders (``tests_tmp``: a subject a test wrote) are forgotten
    after it, as a fresh process would never have seen them; nothing else is (a checkout or a virtual
    environment in /tmp keeps its modules: half of matplotlib forgotten is a matplotlib whose classes
    no longer match). A run past ``timeout`` ends this process (SIGALRM), never the session."""
    with patch.context() as patched:
        patched.chdir(REPO)
        for name, value in env.items():
            patched.setenv(name, str(value))
        before, temporary = set(sys.modules), tests_tmp.resolve()
        capture.readouterr()
        start = time.monotonic()
        signal.alarm(math.ceil(timeout))
        try:
            code = cli_main([str(arg) for arg in args])
        finally:
            signal.alarm(0)
            printed = capture.readouterr()
            for name in set(sys.modules) - before:
                if temporary in Path(getattr(sys.modules[name], "__file__", None) or "/").resolve().parents:
                    del sys.modules[name]
    return CliRun(code, printed.out, printed.err, time.monotonic() - start)


@pytest.fixture
def run_harness(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, session_dir: Path
) -> Callable[..., CliRun]:
    """``run_harness("run", "determinism", "--steps", 3)``: the real CLI, waited for; its ranks are
    real processes. The command itself runs in this process (``harness.cli.main``), whose imports the
    session has paid for already: a fresh interpreter would spend some 3 s of a core on them per run.
    ``process=True`` runs it in one, for what only a process shows: a bug planted in the harness
    itself (``plant``), or how the process ends."""

    def run(*args: object, timeout: float = 240, env: dict[str, object] | None = None, process: bool = False) -> CliRun:
        if process:
            return _run_cli(args, timeout, env or {})
        return _in_process(args, env or {}, capfd, monkeypatch, timeout, session_dir)

    return run


@pytest.fixture(scope="module")
def module_run_harness(tmp_path_factory: pytest.TempPathFactory, session_dir: Path) -> Callable[..., CliRun]:
    """``run_harness`` for a module-scoped fixture: one run that several tests read, each asserting on
    it what it would assert on a run of its own. Module fixtures start before the autouse fixtures
    above, so the run gets their environment here: an empty golden root, no first-op re-runs, the
    session's trace cache and key."""
    isolated = {
        "HARNESS_GOLDEN_DIR": tmp_path_factory.mktemp("no-goldens"),
        "HARNESS_FIRST_OP": "off",
        "HARNESS_TRACE_CACHE": session_dir / "trace-cache",
        "XDG_CONFIG_HOME": session_dir / "config",
    }

    def run(*args: object, timeout: float = 240, env: dict[str, object] | None = None) -> CliRun:
        return _run_cli(args, timeout, {**isolated, **(env or {})})

    return run


@pytest.fixture
def harness_main(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, session_dir: Path
) -> Callable[..., CliRun]:
    """``harness_main("abba", "parity", "--blocks", 1)``: the harness command in this process, as
    ``run_harness`` runs it, for commands refused before anything launches, which so stay in the
    fast tier (it starts no process, so marks no test ``e2e``)."""

    def run(*args: object, env: dict[str, object] | None = None) -> CliRun:
        return _in_process(args, env or {}, capfd, monkeypatch, 240, session_dir)

    return run


@pytest.fixture
def plant(tmp_path: Path) -> Callable[[str], dict[str, object]]:
    """``plant(code)``: the environment in which every process a run starts (its ranks) runs ``code`` at
    start-up, as a sitecustomize, with the repository importable so it can patch the reference: a bug
    planted where a change would put it. The harness's own process runs it too where it is one of its
    own (``run_harness(..., process=True)``, ``start_harness``): a bug planted in the harness. The
    trace cache is off: a patch made at run time leaves the reference's files, and so the cache key,
    as they were."""

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
def run_on_ranks(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list]:
    """``run_on_ranks(world, fn, *args)``: ``fn(*args)`` on ``world`` fresh gloo rank processes
    (tests/distributed.py), the per-rank results in rank order."""
    import distributed

    monkeypatch.setattr(distributed, "FIXTURE_ASKED", True)
    return distributed.start_ranks


@pytest.fixture
def run_reference() -> Callable[..., str]:
    """``run_reference("--ep", 2, "--ranks", 2)``: the bundled reference's own CLI, ``python -m
    harness.reference`` (gloo rank processes when --ranks > 1), waited for; its stdout."""

    def run(*args: object, timeout: float = 300) -> str:
        command = [sys.executable, "-m", "harness.reference", *map(str, args)]
        return subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True, timeout=timeout).stdout

    return run


# Variables by which rich (or a user) turns the live display off or forces it on.
TERMINAL_OVERRIDES = ("TTY_INTERACTIVE", "TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR", "COLUMNS")


@pytest.fixture
def run_in_terminal() -> Callable[..., tuple[int, str]]:
    """``run_in_terminal(["run", "logical-ranks", ...])``: the real CLI with a pseudo-terminal, 120
    columns wide, as its stdout and stderr; its exit code and everything it drew."""

    def run(args: list[str], timeout_s: float = 300) -> tuple[int, str]:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        env = {k: v for k, v in os.environ.items() if k not in TERMINAL_OVERRIDES} | {"TERM": "xterm-256color"}
        proc = subprocess.Popen(_command(tuple(args)), cwd=REPO, stdin=slave, stdout=slave, stderr=slave, env=env)
        os.close(slave)
        drawn, deadline = [], time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if not select.select([master], [], [], 1.0)[0]:
                    continue
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: the harness closed the terminal (exited)
                    break
                if not data:
                    break
                drawn.append(data)
            return proc.wait(timeout=max(1.0, deadline - time.monotonic())), b"".join(drawn).decode(errors="replace")
        finally:
            os.close(master)
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    return run


@pytest.fixture
def run_gpu_smoke() -> Callable[..., subprocess.CompletedProcess]:
    """``run_gpu_smoke(out, STEPS="2")``: benchmarks/gpu_smoke.sh on CPU, with this venv's harness and
    the environment given (it runs the CLI, suite after suite), its outputs under ``out``; waited for."""

    def run(out: Path, **env: str) -> subprocess.CompletedProcess:
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # this venv's harness
        environ = {**os.environ, "PATH": path, "DEVICE": "cpu", "INSTALL": "0", "OUT": str(out), **env}
        smoke = ["bash", str(REPO / "benchmarks" / "gpu_smoke.sh")]
        return subprocess.run(smoke, cwd=REPO, env=environ, capture_output=True, text=True, timeout=600)

    return run


CHROMIUM_INSTALL = REPO / ".ci" / "install-chromium"


@pytest.fixture(scope="session")
def chromium() -> str:
    """The path of Debian's chromium, installed first if missing (.ci/install-chromium: root and
    apt-get). Where it cannot be had the test skips and says why, except in CI (``CI`` set), where
    a report never checked in a browser is a failure."""
    found = subprocess.run([str(CHROMIUM_INSTALL)], capture_output=True, text=True, timeout=900)
    if found.returncode != 0:
        why = found.stderr.strip() or f"{CHROMIUM_INSTALL} exit code {found.returncode}"
        if os.environ.get("CI"):
            pytest.fail(f"no chromium for the browser test in CI: {why}")
        pytest.skip(f"no chromium (Debian package: chromium): {why}")
    return found.stdout.strip().splitlines()[-1]


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
