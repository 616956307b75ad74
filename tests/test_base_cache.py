"""harness/base_cache.py: a change check's base records kept between runs, signed, JSON only, and
used only under the key of everything they depend on."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from suite_files import suite_from

from harness.base_cache import base_key, keep, keep_base, restore, reuse_base
from harness.change import change_suite
from harness.rundir import ARMS_DIR

SUITE = """
name = "cached"
description = "one arm"
ranks = 2
steps = 3
[model]
config = "cpu-tiny"
[arms.eager]
chunking = "eager"
[[checks]]
kind = "ranks-agree"
"""


@pytest.fixture
def suite(tmp_path: Path):
    return change_suite(suite_from(tmp_path, SUITE))


def _records(run_dir: Path, arm: str = "eager@base") -> Path:
    folder = run_dir / ARMS_DIR / arm
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    (folder / "arm.json").write_text('{"facts": {}}')
    return folder


def test_the_key_moves_with_the_base_the_steps_the_config_and_the_environment(suite) -> None:
    key = base_key(suite, "a" * 40, "cpu-env", "harness.reference")
    assert key == base_key(suite, "a" * 40, "cpu-env", "harness.reference")
    fewer = dataclasses.replace(suite, steps=2)
    seed = dataclasses.replace(suite, arms={n: dataclasses.replace(a, seed=a.seed + 1) for n, a in suite.arms.items()})
    others = [
        base_key(suite, "b" * 40, "cpu-env", "harness.reference"),
        base_key(suite, "a" * 40, "cuda-env", "harness.reference"),
        base_key(fewer, "a" * 40, "cpu-env", "harness.reference"),
        base_key(seed, "a" * 40, "cpu-env", "harness.reference"),
    ]
    assert key not in others and len(set(others)) == len(others)


def test_records_kept_are_restored_into_another_run(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _records(tmp_path / "run1")
    assert "kept" in keep(cache, "k" * 64, tmp_path / "run1", ["eager@base"])
    line = restore(cache, "k" * 64, tmp_path / "run2", ["eager@base"])
    assert line.startswith("base: records of 1 arm reused")
    restored = tmp_path / "run2" / ARMS_DIR / "eager@base"
    assert (restored / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.5}\n'
    assert oct((cache / f"{'k' * 64}.json").stat().st_mode & 0o777) == "0o600"


def test_an_altered_entry_is_a_miss_and_the_base_runs(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _records(tmp_path / "run1")
    keep(cache, "k" * 64, tmp_path / "run1", ["eager@base"])
    entry = cache / f"{'k' * 64}.json"
    entry.write_bytes(entry.read_bytes().replace(b"5.5", b"4.4"))
    with pytest.raises(LookupError, match="not used .*tag does not match"):
        restore(cache, "k" * 64, tmp_path / "run2", ["eager@base"])
    assert not (tmp_path / "run2" / ARMS_DIR).exists()


def test_a_base_arm_that_left_other_files_than_json_records_is_not_kept(tmp_path: Path) -> None:
    folder = _records(tmp_path / "run1")
    (folder / "checkpoint.pt").write_bytes(b"\x80\x04pickle")
    assert keep(tmp_path / "cache", "k" * 64, tmp_path / "run1", ["eager@base"]) is None
    assert not (tmp_path / "cache" / f"{'k' * 64}.json").exists()


def test_a_run_restores_what_an_earlier_run_of_the_same_base_kept(
    suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    first = reuse_base(suite, "a" * 40, "harness.reference", "cpu-env", tmp_path / "run1")
    assert not first.restored and "not cached yet" in first.line
    _records(tmp_path / "run1")
    assert keep_base(first, tmp_path / "run1", complete=False) is None  # a run cut short keeps nothing
    assert "kept" in keep_base(first, tmp_path / "run1", complete=True)
    second = reuse_base(suite, "a" * 40, "harness.reference", "cpu-env", tmp_path / "run2")
    assert second.restored and (tmp_path / "run2" / ARMS_DIR / "eager@base" / "metrics.jsonl").is_file()
    other = reuse_base(suite, "c" * 40, "harness.reference", "cpu-env", tmp_path / "run3")
    assert not other.restored
