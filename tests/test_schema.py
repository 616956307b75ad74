"""The published JSON Schemas (docs/schema/) hold what the harness writes, and refuse what it must
not: every CLI test validates the summaries it reads (conftest.valid_summary); these pin the schema
itself against drift in both directions."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from conftest import ARM_SCHEMA, MANIFEST_SCHEMA, METRICS_LINE_SCHEMA, SUMMARY_SCHEMA, valid_summary


def test_a_real_run_validates_and_an_undocumented_field_does_not(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "determinism", "--ranks", 1, "--steps", 2, "--golden", "off", "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = valid_summary(out)
    with pytest.raises(jsonschema.ValidationError, match="Additional properties"):
        SUMMARY_SCHEMA.validate({**summary, "undocumented": 1})
    with pytest.raises(jsonschema.ValidationError, match="'maybe' is not one of"):
        SUMMARY_SCHEMA.validate({**summary, "verdict": "maybe"})
    assert summary["label"] is None  # a passing run is neither drift nor a regression
    with pytest.raises(jsonschema.ValidationError, match="'flaky' is not one of"):
        SUMMARY_SCHEMA.validate({**summary, "label": "flaky"})
    bad_check = {**summary["checks"][0], "status": "passed"}
    with pytest.raises(jsonschema.ValidationError):
        SUMMARY_SCHEMA.validate({**summary, "checks": [bad_check]})
    line = json.loads((out / "arms" / "first" / "metrics.jsonl").read_text().splitlines()[0])
    METRICS_LINE_SCHEMA.validate(line)
    with pytest.raises(jsonschema.ValidationError, match="'step' is a required property"):
        METRICS_LINE_SCHEMA.validate({k: v for k, v in line.items() if k != "step"})
    manifest = json.loads((out / "manifest.json").read_text())
    with pytest.raises(jsonschema.ValidationError, match="1 was expected"):
        MANIFEST_SCHEMA.validate({**manifest, "schema_version": 2})
    with pytest.raises(jsonschema.ValidationError, match="'subject' is a required property"):
        SUMMARY_SCHEMA.validate({k: v for k, v in summary.items() if k != "subject"})
    arm = json.loads((out / "arms" / "first" / "arm.json").read_text())
    assert arm["facts"]["moe_layers"] and len(arm["facts"]["chunk_roots"]) == len(arm["facts"]["moe_layers"])
    with pytest.raises(jsonschema.ValidationError, match="Additional properties"):
        ARM_SCHEMA.validate({**arm, "moe_layers": arm["facts"]["moe_layers"]})
    with pytest.raises(jsonschema.ValidationError, match="Additional properties"):
        ARM_SCHEMA.validate({**arm, "facts": {**arm["facts"], "parameters": 1}})
