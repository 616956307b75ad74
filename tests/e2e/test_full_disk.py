"""A run directory on a full disk, for real: a small tmpfs that the run fills. The first line of the
error output names the cause (ENOSPC and the file), never the empty error file it left behind."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

DISK_BYTES = 2 * 1024 * 1024
LEFT_FREE_BYTES = 512 * 1024  # room for the manifest and the first steps, not for the whole run
EMPTY_ERROR_FILE_ON_RANK_0 = """
import os

_error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
if _error_file.endswith("rank0.error.json"):
    open(_error_file, "w").close()  # as torch's own handler leaves it on a full disk
    os._exit(1)
"""


@pytest.fixture
def small_disk(tmp_path: Path) -> Path:
    """A 2 MB tmpfs, filled but for LEFT_FREE_BYTES; unmounted at teardown."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        why = f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(f"no small disk for the full-disk test in CI: {why}")  # CI runs as root
        pytest.skip(why)
    try:
        stat = os.statvfs(disk)
        (disk / "filler").write_bytes(bytes(stat.f_bavail * stat.f_frsize - LEFT_FREE_BYTES))
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_is_the_first_line_naming_the_file(run_harness, small_disk: Path) -> None:
    out = small_disk / "run"
    run = run_harness("run", "parity", "--ranks", 2, "--golden", "off", "--out", out)
    assert run.returncode == 3, run.stdout + run.stderr
    first = run.stderr.splitlines()[0]
    assert "No space left on device" in first, f"first line: expected the full disk, got {first!r}"
    under_run_dir = rf"'{re.escape(str(out))}/[^']+'"
    assert re.search(under_run_dir, first), f"first line: expected a file under {out}, got {first!r}"
    assert "full disk error" in first  # infrastructure, not a regression: the traceback passes the reference
    assert "JSONDecodeError" not in run.stderr
    assert not list(out.rglob(".*.room")), "the space claimed for error files: expected it given back"
    assert "ERROR (exit 3)" in run.stdout  # the verdict reaches the console whatever could be written
    outputs = [line for line in run.stderr.splitlines() if "writing the outputs failed" in line]
    assert (out / "summary.json").is_file() or outputs, "summary.json: expected it written, or the console to say not"
    for line in outputs:  # each output that could not be written is named
        assert re.search(f"No space left on device: {under_run_dir}", line), f"console: expected a file, got {line!r}"


def test_an_empty_error_file_is_named_not_parsed(run_harness, plant, tmp_path: Path) -> None:
    """torch's elastic agent fails parsing an empty error file; that rank and file are the headline."""
    out = tmp_path / "run"
    run = run_harness("run", "parity", "--ranks", 2, "--steps", 2, "--out", out, env=plant(EMPTY_ERROR_FILE_ON_RANK_0))
    assert run.returncode == 3, run.stdout + run.stderr
    first = run.stderr.splitlines()[0]
    expected = "rank 0 of group 'eager+eager-traced+graph' failed, and its error file logs/rank0.error.json is empty"
    assert expected in first, f"first line: expected {expected!r}, got {first!r}"
    assert "JSONDecodeError" not in run.stderr
    assert run.summary(out)["launches"][0]["root_cause"]["kind"] == "infrastructure"
