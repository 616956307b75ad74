"""Suites written out for a test and loaded as the CLI would load them."""

from __future__ import annotations

from pathlib import Path

from harness.specs import SuiteSpec
from harness.suites import load_suite


def suite_from(tmp_path: Path, text: str) -> SuiteSpec:
    """The suite a file holding ``text`` loads as (written to ``tmp_path/suite.toml``)."""
    path = tmp_path / "suite.toml"
    path.write_text(text)
    return load_suite(str(path))
