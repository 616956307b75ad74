"""Cancelling `harness run` with SIGINT or SIGTERM: exit 128 + N, verdict `cancelled`, every
output written, no rank left behind; a second signal aborts at once."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    give_up = time.monotonic() + timeout_s
    while not (path.is_file() and path.stat().st_size):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < give_up, f"{path} never appeared"
        time.sleep(0.05)


# A run cancelled after a step or two renders its report in a blink (one value per metric: nothing
# to plot), which can leave no time for a second signal to land before the harness exits. Held for
# a few seconds, as a long run's plots hold it, the report gives the second signal its window.
SLOW_REPORT = """
import time
import harness.report

_write_html = harness.report.write_html


def _slow_write_html(*args, **kwargs):
    time.sleep(5)
    return _write_html(*args, **kwargs)


harness.report.write_html = _slow_write_html
"""


def _training(start_harness, out: Path, env: dict[str, object] | None = None) -> subprocess.Popen:
    """A long run, returned once its ranks have recorded a step."""
    proc = start_harness("run", "logical-ranks", "--steps", 50, "--out", out, env=env)
    _wait_for(out / "arms" / "procs" / "metrics.jsonl", proc)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_cancels_with_128_plus_n_and_writes_every_output(
    start_harness, processes_mentioning, tmp_path: Path, sig: signal.Signals
) -> None:
    out = tmp_path / "run"
    proc = _training(start_harness, out)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stdout + stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "cancelled" and summary["exit_code"] == 128 + sig
    cancelled = next(c for c in summary["checks"] if c["name"] == "cancelled")
    assert cancelled["detail"].startswith(f"cancelled by {sig.name}")
    assert 1 <= summary["arms"]["procs"]["steps_completed"] < 50  # what the ranks recorded is kept
    assert "<error" in (out / "junit.xml").read_text()
    assert (out / "report.html").stat().st_size > 0
    assert "Traceback" not in stderr
    assert not processes_mentioning(str(out))


def test_second_sigint_while_the_outputs_are_written_aborts_with_130(
    start_harness, processes_mentioning, plant, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    proc = _training(start_harness, out, plant(SLOW_REPORT))
    proc.send_signal(signal.SIGINT)
    # summary.json, then junit.xml, go before the (slowed) report: the second signal lands after both
    _wait_for(out / "junit.xml", proc, timeout_s=60)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stdout + stderr
    assert json.loads((out / "summary.json").read_text())["verdict"] == "cancelled"
    assert "<error" in (out / "junit.xml").read_text()
    assert not (out / "report.html").exists()  # the second signal cut the report short
    assert not processes_mentioning(str(out))


def test_second_sigint_during_the_launch_aborts_at_once(
    start_harness, processes_mentioning, plant, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    proc = _training(start_harness, out, plant(SLOW_REPORT))
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)  # two signals at once would reach Python as one; this one lands while the ranks stop
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stdout + stderr
    assert "SIGINT again: aborting at once" in stderr
    assert not (out / "report.html").exists()  # it never got that far
    time.sleep(1)  # PR_SET_PDEATHSIG: the ranks follow the harness
    assert not processes_mentioning(str(out))
