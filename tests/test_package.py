"""The installed package: a wheel built from the source tree, installed into a fresh venv and run
from a directory outside the tree, finds its suites and goldens as package data and writes its
reports under ./reports of the working directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.cli import main
from harness.shipped import PACKAGE_DIR

REPO = Path(__file__).resolve().parent.parent
# A user's own suite: one process, two identical arms, one step; quick to run.
USER_SUITE = """\
name = "mine"
description = "A user's own suite"
ranks = 1
steps = 1

[model]
config = "cpu-tiny"

[train]
routing = "forced-balanced"
local_batch = 2
seq_len = 8

[arms.a]

[arms.b]

[[checks]]
kind = "exact"
arms = ["a", "b"]
"""


@dataclass(frozen=True)
class Installed:
    """A venv holding only the wheel (torch and the other dependencies are the test interpreter's,
    wherever it keeps them), and an empty working directory outside the source tree to run it from."""

    venv: Path
    wheel: Path
    workdir: Path

    def run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        # No PYTHONPATH and no golden root from the test session: the package finds its own.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HARNESS_GOLDEN_DIR")}
        return subprocess.run(
            [str(self.venv / "bin" / args[0]), *args[1:]],
            cwd=self.workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _package_dirs() -> list[str]:
    """The site directories the running interpreter imports its packages from: a venv's, the system's
    or the user's, whichever it has. Listed in a .pth file they give a new venv the same dependencies
    but not the checkout's editable harness, whose finder is a .pth file there, never processed."""
    return [path for path in sys.path if Path(path).name in ("site-packages", "dist-packages")]


def _source_files() -> list[str]:
    """What a fresh clone of this tree holds: tracked files and new ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return [name for name in listed.stdout.splitlines() if (REPO / name).is_file()]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """``pip install`` of a wheel built from a copy of the tree (a build writes build/ and egg-info)."""
    if not (REPO / ".git").exists():
        pytest.skip("the wheel is built from the files git tracks; this tree is not a git checkout")
    root = tmp_path_factory.mktemp("package")
    clone = root / "clone"
    for name in _source_files():
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, clone / name)
    wheels = root / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(clone)]
    subprocess.run(build, check=True, capture_output=True, timeout=120)
    (wheel,) = wheels.glob("harness-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    install = [*pip, "--python", python, "install", "--no-index", "--no-deps", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=120)
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    ).stdout.strip()
    (Path(purelib) / "test-dependencies.pth").write_text("\n".join(_package_dirs()) + "\n")
    workdir = root / "work"
    workdir.mkdir()
    return Installed(venv, wheel, workdir)


def test_wheel_ships_every_suite_and_golden(installed: Installed) -> None:
    shipped = [name for name in _source_files() if name.startswith(("suites/", "golden/"))]
    assert any(name.startswith("golden/") and name.count("/") == 2 for name in shipped)  # golden/<suite>/<key>.json
    in_wheel = set(zipfile.ZipFile(installed.wheel).namelist())
    assert {f"harness/_{name}" for name in shipped} <= in_wheel


def test_installed_harness_lists_and_runs_from_any_directory(installed: Installed) -> None:
    probe = "import harness, harness.shipped as s; print(harness.__file__, *map(s.shipped_dir, ['golden', 'suites']))"
    where = installed.run("python", "-c", probe)
    assert where.returncode == 0, where.stderr
    module, golden_dir, suites_dir = map(Path, where.stdout.split())
    for path in (module, golden_dir, suites_dir):
        assert path.is_relative_to(installed.venv), f"{path}: not in the venv (a path into the source tree?)"
    assert sorted(p.relative_to(golden_dir) for p in golden_dir.glob("*/*.json")) == sorted(
        Path(name).relative_to("golden") for name in _source_files() if name.startswith("golden/")
    )

    listed = installed.run("harness", "list")
    assert listed.returncode == 0, listed.stderr
    names = {line.split()[0] for line in listed.stdout.splitlines()}
    assert {"parity", "determinism", "logical-ranks"} <= names

    run = installed.run("harness", "run", "parity", "--ranks", "2", "--steps", "3", "--golden", "off")
    assert run.returncode == 0, run.stdout + run.stderr
    (run_dir,) = (installed.workdir / "reports" / "parity").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["verdict"] == "pass" and summary["steps"] == 3
    assert f"run dir: {run_dir}" in run.stdout
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["versions"]["git_sha"] is None  # an installed package names no commit
    assert not list(installed.venv.rglob("reports")), "reports written into the venv"


def test_installed_harness_runs_a_users_own_suite_from_suites_dir(installed: Installed) -> None:
    (installed.workdir / "my-suites").mkdir()
    (installed.workdir / "my-suites" / "mine.toml").write_text(USER_SUITE)
    out = installed.workdir / "mine-run"
    run = installed.run("harness", "run", "mine", "--suites-dir", "my-suites", "--golden", "off", "--out", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads((out / "summary.json").read_text())["verdict"] == "pass"


def test_list_names_the_suites_of_suites_dir_only(tmp_path: Path, capsys) -> None:
    (tmp_path / "mine.toml").write_text(USER_SUITE)
    assert main(["list", "--suites-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "mine  A user's own suite\n"


@pytest.mark.parametrize(
    "command", [("list",), ("run", "parity"), ("abba", "throughput-pec"), ("golden", "update", "parity")], ids=" ".join
)
def test_every_command_refuses_a_missing_suites_dir_in_one_line(command, tmp_path: Path, capsys) -> None:
    missing = tmp_path / "no-such-dir"
    assert main([*command, "--suites-dir", str(missing)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: --suites-dir {missing}: no such directory"]


def test_a_suite_missing_from_the_suites_dir_names_those_there(tmp_path: Path, capsys) -> None:
    (tmp_path / "mine.toml").write_text(USER_SUITE)
    assert main(["run", "parity", "--suites-dir", str(tmp_path)]) == 2
    assert "parity.toml: no such suite file (suites: mine)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command", [("golden", "update", "parity"), ("run", "parity", "--golden", "update")], ids=" ".join
)
def test_goldens_are_never_recorded_into_the_installed_package(command, capsys) -> None:
    packaged = PACKAGE_DIR / "_golden"  # where a wheel install keeps the shipped goldens
    assert main([*command, "--golden-dir", str(packaged)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"error: --golden-dir {packaged}: the shipped goldens of the installed package are read-only"
    )
    assert not packaged.exists()
