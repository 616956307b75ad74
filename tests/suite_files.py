"""Suites written out for a test and loaded as the CLI would load them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from harness.specs import SuiteSpec
from harness.suites import SuiteError, load_suite


def suite_from(tmp_path: Path, text: str) -> SuiteSpec:
    """The suite a file holding ``text`` loads as (written to ``tmp_path/suite.toml``)."""
    path = tmp_path / "suite.toml"
    path.write_text(text)
    return load_suite(str(path))


def suite_error(tmp_path: Path, text: str) -> str:
    """The one-line error a file holding ``text`` is refused with, its path shown as FILE."""
    path = tmp_path / "suite.toml"
    path.write_text(text)
    with pytest.raises(SuiteError) as info:
        load_suite(str(path))
    return str(info.value).replace(str(path), "FILE")


def refused_without(run_harness: Callable, tmp_path: Path, module: str, suite: str) -> str:
    """``harness run SUITE`` where ``module`` cannot be imported (a None entry in sys.modules, set
    at start-up): it must be refused with exit 2 before a run directory is made. Its stderr."""
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(f"import sys\n\nsys.modules[{module!r}] = None\n")
    out = tmp_path / "run"
    run = run_harness("run", suite, "--out", out, env={"PYTHONPATH": tmp_path / "hide"})
    assert run.returncode == 2, run.stdout + run.stderr
    assert not out.exists()
    return run.stderr
