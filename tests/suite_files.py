"""Suites written out for a test and loaded as the CLI would load them."""

from __future__ import annotations

import sys
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


def run_suite_text(run_harness: Callable, folder: Path, name: str, text: str) -> tuple:
    """The suite ``text`` written to ``folder/NAME.toml`` and run once on 2 ranks, golden off, for the
    tests of a module that each read the one run: the run and its directory."""
    suite, out = folder / f"{name}.toml", folder / "run"
    suite.write_text(text)
    return run_harness("run", suite, "--ranks", 2, "--golden", "off", "--out", out, timeout=400), out


def refused_without(harness_main: Callable, tmp_path: Path, module: str, suite: str) -> str:
    """``harness run SUITE`` (in this process: the ``harness_main`` fixture) where ``module`` cannot be
    imported (a None entry in sys.modules): it must be refused with exit 2 before a run directory is
    made. Its stderr."""
    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, module, None)
        run = harness_main("run", suite, "--out", out)
    assert run.returncode == 2, run.stdout + run.stderr
    assert not out.exists()
    return run.stderr
