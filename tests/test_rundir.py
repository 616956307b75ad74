"""The run directory (harness/rundir.py): made private, whatever the umask, since a resumed arm's
checkpoint lives in it and a rank loads one only where every folder above it is the user's alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.rundir import fresh_dir, make_run_dir
from harness.trust import mode_of


def test_a_run_directory_and_the_folders_made_above_it_are_private_whatever_the_umask(
    umask_000: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    run_dir = make_run_dir("resume", None)
    assert run_dir.parent == tmp_path / "reports" / "resume"
    made = [tmp_path / "reports", run_dir.parent, run_dir, run_dir / "logs"]
    assert [mode_of(p.stat()) for p in made] == ["0700"] * 4


def test_an_empty_out_dir_that_others_could_write_is_made_private(umask_000: None, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir(mode=0o777)
    assert fresh_dir(out, "run directory") == out
    assert (mode_of(out.stat()), mode_of((out / "logs").stat())) == ("0700", "0700")
