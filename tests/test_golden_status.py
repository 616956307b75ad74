"""Which suite has which environment's golden: ``harness golden status`` and the README's table,
generated from golden/ and checked against it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from harness.environment import EnvKey, run_env_key, split_env_key
from harness.golden import GoldenError, load_golden, write_golden
from harness.golden_status import (
    TABLE_BEGIN,
    TABLE_END,
    golden_inventory,
    golden_table,
    readme_table,
    write_readme_table,
)
from harness.shipped import SOURCE_ROOT
from harness.suites import SUITES_DIR

GOLDENS, README = SOURCE_ROOT / "golden", SOURCE_ROOT / "docs" / "goldens.md"
AMD, INTEL = "cpu-pinned-avx2-amd-gloo-float32-torch2.13", "cpu-pinned-avx2-intel-gloo-float32-torch2.13"


def _table_in(readme: Path) -> str:
    text = readme.read_text(encoding="utf-8")
    start, end = readme_table(text, str(readme))
    return text[start:end]


def _copy_golden(source: Path, golden_dir: Path, suite: str, key: str) -> Path:
    """A real golden filed under another suite and env key, as if recorded there."""
    golden = dataclasses.replace(load_golden(source), suite=suite, env_key=key)
    path = golden_dir / suite / f"{key}.json"
    write_golden(path, golden)
    return path


@pytest.mark.parametrize(
    "key, parts",
    [
        ("cpu-pinned-avx2-amd-gloo-bf16-mixed-torch2.13", ("cpu-pinned-avx2-amd", "gloo", "bf16-mixed", "torch2.13")),
        ("cuda-h200-nccl-bfloat16-torch2.14", ("cuda-h200", "nccl", "bfloat16", "torch2.14")),
        ("cpu-gloo-float32-torch2.13", ("cpu", "gloo", "float32", "torch2.13")),
    ],
)
def test_an_env_key_splits_at_its_backend_so_dashed_dtypes_stay_whole(key: str, parts: tuple[str, ...]) -> None:
    assert split_env_key(key) == EnvKey(*parts)
    assert split_env_key(key).environment == f"{parts[0]}-{parts[1]}-{parts[3]}"


def test_a_string_that_is_no_env_key_does_not_split() -> None:
    with pytest.raises(ValueError, match="is not <device class>-<gloo|nccl|mpi>-<dtype>-torch<major.minor>"):
        split_env_key("cpu-pinned-avx2-amd-float32-torch2.13")  # no backend


def test_the_readme_table_is_the_one_generated_from_the_shipped_goldens() -> None:
    generated = golden_table(golden_inventory(GOLDENS, SUITES_DIR))
    assert _table_in(README) == generated, (
        "docs/goldens.md's golden table is stale: run harness golden table --write docs/goldens.md"
    )


def test_a_golden_added_to_golden_dir_makes_the_readme_table_disagree_until_it_is_written(tmp_path: Path) -> None:
    goldens = tmp_path / "golden"
    shutil.copytree(GOLDENS, goldens)
    _copy_golden(GOLDENS / "resume" / f"{AMD}.json", goldens, "resume", INTEL)
    table = golden_table(golden_inventory(goldens, SUITES_DIR))
    assert table != _table_in(README)
    assert "| `resume` | float32 | float32 |" in table.splitlines()
    readme = tmp_path / "goldens.md"
    shutil.copy(README, readme)
    assert write_readme_table(readme, table) and _table_in(readme) == table
    assert not write_readme_table(readme, table)  # written once, unchanged after
    before, after = README.read_text().split(TABLE_BEGIN), readme.read_text().split(TABLE_BEGIN)
    assert before[0] == after[0] and before[1].split(TABLE_END)[1] == after[1].split(TABLE_END)[1]


def test_the_table_has_a_column_per_environment_and_marks_each_missing_golden(tmp_path: Path) -> None:
    suites = tmp_path / "suites"
    suites.mkdir()
    for name in ("determinism", "parity-bf16", "throughput-pec"):
        shutil.copy(SUITES_DIR / f"{name}.toml", suites)
    _copy_golden(GOLDENS / "determinism" / f"{AMD}.json", tmp_path / "golden", "determinism", AMD)
    _copy_golden(GOLDENS / "determinism" / f"{INTEL}.json", tmp_path / "golden", "example", INTEL)
    assert golden_table(golden_inventory(tmp_path / "golden", suites)).splitlines() == [
        f"| suite | `{split_env_key(AMD).environment}` | `{split_env_key(INTEL).environment}` |",
        "| --- | --- | --- |",
        "| `determinism` | float32 | **missing** float32 |",
        "| `example` | **missing** float32 | float32 |",  # no suite file: the dtype its golden has
        "| `parity-bf16` | **missing** bf16-mixed | **missing** bf16-mixed |",  # expected, recorded nowhere
    ]  # throughput-pec: an ABBA gate has no golden


def test_status_says_ok_or_missing_and_what_a_run_compares_with_instead(harness_main, tmp_path: Path) -> None:
    suites, goldens = tmp_path / "suites", tmp_path / "golden"
    suites.mkdir()
    for name in ("determinism", "parity", "parity-bf16", "throughput-pec"):
        shutil.copy(SUITES_DIR / f"{name}.toml", suites)
    mine = run_env_key("cpu", "float32")
    other = INTEL if mine != INTEL else AMD
    own = _copy_golden(GOLDENS / "determinism" / f"{AMD}.json", goldens, "determinism", mine)
    loose = _copy_golden(GOLDENS / "parity" / f"{AMD}.json", goldens, "parity", other)
    status = harness_main("golden", "status", "--golden-dir", goldens, "--suites-dir", suites)
    assert status.returncode == 0, status.stdout + status.stderr
    bf16 = run_env_key("cpu", "bf16-mixed")
    parity = (
        f"missing  parity       this environment's golden ({mine}) is missing;"
        f" a run compares loosely with {other} at the cross-environment tier"
    )
    assert status.stdout.splitlines() == [
        f"ok       determinism  {own.relative_to(goldens)}",
        f"{parity} (calibrated)",
        f"missing  parity-bf16  this environment's golden ({bf16}) is missing, and none is comparable:"
        " a run compares with none",
    ]
    # Without a calibration the loose comparison is at the suite's fixed tier, and the line says how to measure one.
    uncalibrated = json.loads(loose.read_text())
    del uncalibrated["provenance"]["calibration"]
    loose.write_text(json.dumps(uncalibrated))
    status = harness_main("golden", "status", "--golden-dir", goldens, "--suites-dir", suites)
    assert f"{parity} (not calibrated: harness golden calibrate parity)" in status.stdout.splitlines()


def test_status_refuses_a_golden_dir_that_is_not_there(harness_main, tmp_path: Path) -> None:
    status = harness_main("golden", "status", "--golden-dir", tmp_path / "absent")
    assert (status.returncode, status.stdout) == (2, "")
    assert status.stderr == f"error: {tmp_path / 'absent'}: no such golden directory\n"


@pytest.mark.parametrize(
    "folder, key, field",
    [
        ("parity", "cpu-pinned-avx2-amd-float32-torch2.13", "env_key"),  # names no backend
        ("pec", AMD, "suite"),  # a parity golden filed under pec
    ],
)
def test_a_bad_golden_is_refused_by_file_and_field(tmp_path: Path, folder: str, key: str, field: str) -> None:
    path = tmp_path / folder / f"{key}.json"
    path.parent.mkdir()
    shutil.copy(GOLDENS / "parity" / f"{AMD}.json", path)
    text = path.read_text().replace(f'"env_key": "{AMD}"', f'"env_key": "{key}"')
    path.write_text(text)
    with pytest.raises(GoldenError) as refused:
        golden_inventory(tmp_path, SUITES_DIR)
    assert (refused.value.path, refused.value.field) == (path, field)


def test_writing_the_table_needs_each_marker_once(tmp_path: Path) -> None:
    readme = tmp_path / "goldens.md"
    readme.write_text(f"# x\n{TABLE_BEGIN}\n{TABLE_BEGIN}\n{TABLE_END}\n")
    with pytest.raises(GoldenError, match=f"goldens.md: {TABLE_BEGIN}: expected once, found 2 times"):
        write_readme_table(readme, "| a |\n")
    readme.write_text(f"# x\n{TABLE_END}\n{TABLE_BEGIN}\n")
    with pytest.raises(GoldenError, match=f"{TABLE_END}: comes before {TABLE_BEGIN}"):
        write_readme_table(readme, "| a |\n")


def test_a_golden_of_another_configuration_is_stale_in_the_table_and_the_status(harness_main, tmp_path: Path) -> None:
    """A golden recorded before an arm was added is present, and no run compares with it (strict-vs-stale's
    AMD golden lacked its clipped arm for days, while the table said float32): the table and the status
    say stale, and how its configuration differs."""
    suites, goldens = tmp_path / "suites", tmp_path / "golden"
    suites.mkdir()
    shutil.copy(SUITES_DIR / "strict-vs-stale.toml", suites)
    mine = run_env_key("cpu", "float32")
    path = _copy_golden(GOLDENS / "strict-vs-stale" / f"{AMD}.json", goldens, "strict-vs-stale", mine)
    assert "**stale**" not in golden_table(golden_inventory(goldens, suites))
    older = json.loads(path.read_text())
    del older["config"]["arms"]["clipped"], older["arms"]["clipped"]
    path.write_text(json.dumps(older))
    environment = split_env_key(mine).environment
    assert golden_table(golden_inventory(goldens, suites)).splitlines() == [
        f"| suite | `{environment}` |",
        "| --- | --- |",
        "| `strict-vs-stale` | **stale** float32 |",
    ]
    status = harness_main("golden", "status", "--golden-dir", goldens, "--suites-dir", suites)
    assert status.returncode == 0, status.stdout + status.stderr
    differences = 'arms.clipped.config.chunking: golden unset, this run "eager"; '
    differences += 'arms.clipped.config.correction: golden unset, this run "always"; '
    differences += "arms.clipped.config.correction_clip: golden unset, this run 1.01; "
    differences += "arms.clipped.config.delay: golden unset, this run 2; "
    differences += 'arms.clipped.config.trainer: golden unset, this run "versioned"; '
    differences += "arms.clipped.ranks: golden unset, this run 2"
    assert status.stdout.splitlines() == [
        f"stale    strict-vs-stale  {path.relative_to(goldens)}: recorded for another configuration ({differences}):"
        " record it again with harness golden update strict-vs-stale"
    ]
