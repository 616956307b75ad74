"""The run directory (harness/rundir.py): made private, whatever the umask, since a resumed arm's
checkpoint lives in it and a rank loads one only where every folder above it is the user's alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.rundir import INDUCTOR_ENV, RunDirError, fresh_dir, inductor_cache, make_run_dir
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


def test_a_run_that_unpickles_from_its_directory_is_refused_under_a_folder_others_may_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(RunDirError) as refused:
        make_run_dir("resume", shared / "run", unpickled="the checkpoints")
    assert str(refused.value) == (
        f"{shared}: mode 0777 is writable by others without the sticky bit: another user could swap"
        " the checkpoints; choose a private --out DIR"
    )
    assert make_run_dir("parity", shared / "plain") == shared / "plain"  # JSON records only: allowed
    shared.chmod(0o1777)  # sticky, as /tmp: nobody renames what is not theirs
    assert make_run_dir("resume", shared / "sticky", unpickled="the checkpoints") == shared / "sticky"


def test_the_resume_suite_is_refused_before_launching_under_a_shared_folder(harness_main, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    run = harness_main("run", "resume", "--out", shared / "run")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: {shared}: mode 0777 is writable by others without the sticky bit: another user could swap the"
        " checkpoints its resumed arms unpickle; choose a private --out DIR"
    ]
    assert not (shared / "run" / "arms").exists()


@pytest.mark.parametrize("cache_home", ["private", "shared"])
def test_ranks_keep_their_inductor_cache_where_only_the_user_can_write(
    cache_home: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor unpickles its cache entries: the folder must be the user's alone, or a fresh one in the run."""
    home = tmp_path / cache_home
    home.mkdir(mode=0o777 if cache_home == "shared" else 0o700)
    home.chmod(0o777 if cache_home == "shared" else 0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.delenv(INDUCTOR_ENV, raising=False)
    run_dir = make_run_dir("parity-inductor", tmp_path / "run")
    folder = Path(inductor_cache(run_dir, "avx2")[INDUCTOR_ENV])
    expected = home / "harness" / "inductor" / "avx2" if cache_home == "private" else run_dir / "inductor"
    assert folder == expected
    if cache_home == "private":
        assert mode_of(folder.stat()) == "0700"
        # One folder per ISA: a native AVX-512 run that shared the AVX2 pin's folder died of heap corruption.
        assert Path(inductor_cache(run_dir, "avx512")[INDUCTOR_ENV]) == home / "harness" / "inductor" / "avx512"
    monkeypatch.setenv(INDUCTOR_ENV, str(tmp_path / "mine"))
    assert inductor_cache(run_dir, "avx2") == {}  # the user's own choice
