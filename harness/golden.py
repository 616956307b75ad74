"""Golden files: reference metrics per suite and environment, validated on load, replaced atomically.

Pairwise parity catches a change that breaks the arms' equivalence; a golden catches both arms
drifting together (a model change, a toolchain upgrade). Numerics depend on hardware and
toolchain, so goldens are keyed by environment, as Megatron keys them by GPU and container, and an
update shows a reviewer what moved (diff_summary) before it lands. This module is the file: its
format, reading, writing and diffing one, and which goldens of other environments a run may compare
with; what a run does with its golden is harness/golden_plan.py.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.compare import Exact, compare_series, format_steps, tier_from_spec
from harness.environment import FINGERPRINT_KEYS
from harness.files import remove_stale_temps, write_json_atomic
from harness.shipped import SOURCE_ROOT, in_checkout

# 2: the configuration a golden was recorded for (steps, arms) is part of the file, so a run of
# another configuration is refused or reported by name, never silently compared.
SCHEMA = 2
PROVENANCE_KEYS = ("torch", "device", "backend", "dtype", "harness", "git_sha", "date")
# Null when an installed harness recorded the golden: it runs from no checkout, so has no commit to name.
NULLABLE_PROVENANCE = ("git_sha",)
# The rest of the environment's fingerprint (environment.py), recorded since goldens tell drift from
# a regression: a string, or null where it does not apply. Optional, so that a golden recorded before
# loads as it is; a field it lacks is unknown (fingerprint_changes).
FINGERPRINT_PROVENANCE = tuple(key for key in FINGERPRINT_KEYS if key not in PROVENANCE_KEYS)
_TOP_KEYS = {"schema", "suite", "env_key", "provenance", "config", "tier", "arms"}
_TRAJECTORY_KEYS = {"start_step", "end_step", "values"}


class GoldenError(Exception):
    """A golden that cannot be used; the one-line message names the file and the bad field."""

    def __init__(self, path: Path | str, field: str | None, msg: str) -> None:
        self.path, self.field = path, field
        super().__init__(f"{path}: {field}: {msg}" if field else f"{path}: {msg}")


@dataclass(frozen=True)
class Calibration:
    """The tier at which a run of another environment is held to a golden, measured rather than guessed
    (harness/calibration.py): per metric, the largest relative difference seen between environments
    (``noise``), times ``margin``. Kept in the golden's provenance, so it is reviewed with the golden."""

    # metric -> the largest relative difference measured between environments; a metric that did not
    # move at all takes the suite's largest (calibration.py)
    noise: dict[str, float]
    margin: float
    measured: tuple[str, ...]  # what was compared, one phrase each ("cpu-isa avx2 vs native")

    def tier(self, metric: str) -> dict:
        return {"kind": "close", "rtol": self.margin * self.noise[metric], "atol": 0.0}

    def describe(self) -> str:
        """ "calibrated: loss within rtol=1.2e-06, grad_norm within rtol=3e-06 (10x the noise measured)"."""
        tiers = ", ".join(f"{m} within rtol={self.margin * n:.2g}" for m, n in self.noise.items())
        return f"calibrated: {tiers} ({self.margin:g}x the noise measured)"

    def to_json(self) -> dict:
        return {"noise": dict(self.noise), "margin": self.margin, "measured": list(self.measured)}

    @classmethod
    def from_json(cls, raw: Any, source: Any) -> Calibration:
        field = "provenance.calibration"
        if not isinstance(raw, dict) or set(raw) != {"noise", "margin", "measured"}:
            raise GoldenError(source, field, "expected an object with noise, margin and measured")
        noise, margin, measured = raw["noise"], raw["margin"], raw["measured"]
        if not isinstance(noise, dict) or not noise:
            raise GoldenError(source, f"{field}.noise", "expected a non-empty mapping of metric -> relative noise")
        for metric, value in noise.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise GoldenError(source, f"{field}.noise.{metric}", f"expected a finite number >= 0, got {value!r}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 1 <= margin < math.inf:
            raise GoldenError(source, f"{field}.margin", f"expected a finite number >= 1, got {margin!r}")
        if not isinstance(measured, list) or not measured or not all(isinstance(m, str) for m in measured):
            raise GoldenError(source, f"{field}.measured", "expected a non-empty list of strings")
        return cls({m: float(v) for m, v in noise.items()}, float(margin), tuple(measured))


@dataclass(eq=False)
class Golden:
    """A parsed golden file; trajectories are float64 Series indexed by step."""

    suite: str
    env_key: str
    provenance: dict[str, Any]  # strings or null; a calibration (Calibration.to_json) where measured
    config: dict  # {"steps": N, "arms": {arm: {"ranks": P, "config": non-default fields}}}
    tier: dict
    arms: dict[str, dict[str, pd.Series]]

    @property
    def steps(self) -> int:
        return self.config["steps"]

    @property
    def calibration(self) -> Calibration | None:
        """The measured cross-environment tier, where ``harness golden calibrate`` wrote one."""
        raw = self.provenance.get("calibration")
        return None if raw is None else Calibration.from_json(raw, self.env_key)

    def cross_env_tiers(self, fixed: dict) -> dict[str, dict]:
        """metric -> the tier at which a run of another environment is held to this golden, or at
        which a failed check is judged again to tell drift from a regression: the calibrated one,
        else the suite's ``fixed`` cross-environment tier."""
        calibration = self.calibration
        metrics = {m for trajectories in self.arms.values() for m in trajectories}
        if calibration is None:
            return dict.fromkeys(sorted(metrics), fixed)
        return {m: calibration.tier(m) if m in calibration.noise else fixed for m in sorted(metrics)}

    def to_dict(self) -> dict:
        arms = {arm: {m: _trajectory(s) for m, s in metrics.items()} for arm, metrics in self.arms.items()}
        return {
            "schema": SCHEMA,
            "suite": self.suite,
            "env_key": self.env_key,
            "provenance": dict(self.provenance),
            "config": self.config,
            "tier": dict(self.tier),
            "arms": arms,
        }


def _trajectory(series: pd.Series) -> dict:
    """The file form of one metric; a missing value is "nan", as in Megatron's goldens."""
    series = series.astype("float64").sort_index()
    values = {str(int(step)): float(v) if math.isfinite(v) else "nan" for step, v in series.items()}
    return {"start_step": int(series.index.min()), "end_step": int(series.index.max()), "values": values}


def _parse_trajectory(source: Any, field: str, obj: Any) -> pd.Series:
    if not isinstance(obj, dict):
        raise GoldenError(source, field, "expected an object with start_step, end_step, values")
    unknown = sorted(set(obj) - _TRAJECTORY_KEYS)
    if unknown:
        raise GoldenError(source, f"{field}.{unknown[0]}", "unknown field")
    for key in ("start_step", "end_step"):
        if isinstance(obj.get(key), bool) or not isinstance(obj.get(key), int):
            raise GoldenError(source, f"{field}.{key}", f"expected an integer, got {obj.get(key)!r}")
    values = obj.get("values")
    if not isinstance(values, dict) or not values:
        raise GoldenError(source, f"{field}.values", "expected a mapping of step -> float")
    parsed = {}
    for key, value in values.items():
        if not re.fullmatch(r"0|-?[1-9][0-9]*", key):
            raise GoldenError(source, f"{field}.values", f"step {key!r} is not an integer")
        finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not finite and value != "nan":
            raise GoldenError(source, f"{field}.values.{key}", f'expected a finite number or "nan", got {value!r}')
        parsed[int(key)] = math.nan if value == "nan" else float(value)
    if (obj["start_step"], obj["end_step"]) != (min(parsed), max(parsed)):
        raise GoldenError(
            source,
            field,
            f"start_step/end_step {obj['start_step']}/{obj['end_step']}"
            f" do not match the steps {min(parsed)}..{max(parsed)}",
        )
    series = pd.Series(parsed, dtype="float64").sort_index()
    series.index.name = "step"
    return series


def _parse(obj: Any, source: Any) -> Golden:
    """Validates the file form of a golden; every error names the field."""
    if not isinstance(obj, dict):
        raise GoldenError(source, None, "expected a JSON object")
    unknown = sorted(set(obj) - _TOP_KEYS)
    if unknown:
        raise GoldenError(source, unknown[0], "unknown field")
    if obj.get("schema") != SCHEMA:
        hint = " (recorded by an older harness: record it again with harness golden update)"
        raise GoldenError(source, "schema", f"expected {SCHEMA}, got {obj.get('schema')!r}{hint}")
    for key in ("suite", "env_key"):
        if not isinstance(obj.get(key), str) or not obj[key]:
            raise GoldenError(source, key, f"expected a non-empty string, got {obj.get(key)!r}")
    provenance = obj.get("provenance")
    if not isinstance(provenance, dict):
        raise GoldenError(source, "provenance", "expected an object")
    for key in PROVENANCE_KEYS:
        value = provenance.get(key)
        if key in NULLABLE_PROVENANCE and key in provenance and value is None:
            continue
        if not isinstance(value, str):
            expected = "a string or null" if key in NULLABLE_PROVENANCE else "a string"
            raise GoldenError(source, f"provenance.{key}", f"expected {expected}, got {value!r}")
    for key in FINGERPRINT_PROVENANCE:
        if not isinstance(provenance.get(key), (str, type(None))):
            raise GoldenError(source, f"provenance.{key}", f"expected a string or null, got {provenance[key]!r}")
    if "calibration" in provenance:
        Calibration.from_json(provenance["calibration"], source)
    config = obj.get("config")
    if not isinstance(config, dict) or set(config) != {"steps", "arms"} or not isinstance(config["arms"], dict):
        raise GoldenError(source, "config", "expected an object with steps and arms")
    if isinstance(config["steps"], bool) or not isinstance(config["steps"], int) or config["steps"] < 1:
        raise GoldenError(source, "config.steps", f"expected an integer >= 1, got {config['steps']!r}")
    if not isinstance(obj.get("tier"), dict):
        raise GoldenError(source, "tier", 'expected an object such as {"kind": "exact"}')
    try:
        tier = tier_from_spec(obj["tier"]).spec()
    except ValueError as e:
        raise GoldenError(source, "tier", str(e)) from e
    arms = obj.get("arms")
    if not isinstance(arms, dict) or not arms:
        raise GoldenError(source, "arms", "expected a non-empty mapping of arm -> metric -> trajectory")
    parsed: dict[str, dict[str, pd.Series]] = {}
    for arm, metrics in arms.items():
        if not isinstance(metrics, dict) or not metrics:
            raise GoldenError(source, f"arms.{arm}", "expected a non-empty mapping of metric -> trajectory")
        parsed[arm] = {m: _parse_trajectory(source, f"arms.{arm}.{m}", t) for m, t in metrics.items()}
    return Golden(obj["suite"], obj["env_key"], dict(provenance), json.loads(json.dumps(config)), tier, parsed)


def load_golden(path: Path) -> Golden:
    """Reads and validates a golden file; its env_key must match the file name."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise GoldenError(path, None, f"cannot read: {e.strerror}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GoldenError(path, None, f"invalid JSON: {e}") from e
    golden = _parse(obj, path)
    if golden.env_key != path.stem:
        raise GoldenError(path, "env_key", f"{golden.env_key!r} does not match the file name {path.name!r}")
    return golden


def load_golden_for(path: Path, suite: str) -> Golden:
    """load_golden, refusing a golden of another suite: one filed in the wrong folder."""
    golden = load_golden(path)
    if golden.suite != suite:
        raise GoldenError(path, "suite", f"golden is for suite {golden.suite!r}, not {suite!r}")
    return golden


def golden_from_metrics(
    suite: str,
    env_key: str,
    provenance: dict[str, str | None],
    config: dict,
    tier_spec: dict,
    metrics: dict[str, pd.DataFrame],
    metrics_names: tuple[str, ...] = ("loss", "grad_norm"),
) -> Golden:
    """Builds a golden from a run's per-arm metrics; refuses missing or non-finite values.
    ``tier_spec`` is a validated tier in its normal form (``SuiteSpec.golden_tier``)."""
    arms = {}
    for arm, frame in metrics.items():
        for name in metrics_names:
            if name not in frame.columns:
                raise ValueError(f"cannot record golden: arm '{arm}' has no '{name}' metric")
            bad = frame.index[~np.isfinite(frame[name].astype("float64"))].tolist()
            if bad:
                raise ValueError(f"cannot record golden: arm '{arm}' {name} is non-finite at steps {format_steps(bad)}")
        arms[arm] = {name: frame[name].astype("float64").rename_axis("step").sort_index() for name in metrics_names}
    return Golden(suite, env_key, dict(provenance), json.loads(json.dumps(config)), dict(tier_spec), arms)


def write_golden(path: Path, golden: Golden) -> None:
    """Writes atomically, so a crash mid-update leaves the previous golden intact; the temp file
    such a crash left behind is removed by the next update (once it is stale, remove_stale_temps)."""
    path = Path(path)
    if path.stem != golden.env_key:
        raise ValueError(f"{path}: file name must be {golden.env_key}.json to match the golden's env_key")
    remove_stale_temps(path)
    write_json_atomic(path, golden.to_dict())


def _identical(a: pd.Series, b: pd.Series) -> bool:
    return a.index.equals(b.index) and np.array_equal(a.to_numpy().view(np.int64), b.to_numpy().view(np.int64))


def diff_summary(old: Golden | None, new: Golden) -> str:
    """What an update changes, per arm and metric, for a reviewer: "unchanged", "new", "removed" or where it moved."""
    lines = [f"golden {new.suite}/{new.env_key}: {'new file' if old is None else 'update'}"]
    old_arms = old.arms if old is not None else {}
    if old is not None:
        lines += [f"  config: {change}" for change in config_differences(old.config, new.config)]
        for key in sorted(old.provenance.keys() | new.provenance.keys()):
            before, after = _shown(old.provenance, key), _shown(new.provenance, key)
            if before != after:
                lines.append(f"  provenance.{key}: {before} -> {after}")
        if old.tier != new.tier:
            lines.append(f"  tier: {old.tier} -> {new.tier}")
    for arm, metrics in new.arms.items():
        for metric, after in metrics.items():
            label = f"{arm}/{metric}"
            before = old_arms.get(arm, {}).get(metric)
            if before is None:
                lines.append(f"  {label}: new ({after.size} steps, {after.index.min()}..{after.index.max()})")
            elif _identical(before, after):
                lines.append(f"  {label}: unchanged ({after.size} steps)")
            else:
                result = compare_series(label, after, before, Exact(), label_a="new", label_b="old")
                lines.append(f"  {label}: changed: {result.detail}")
    for arm, metrics in old_arms.items():
        for metric in metrics:
            if metric not in new.arms.get(arm, {}):
                lines.append(f"  {arm}/{metric}: removed")
    return "\n".join(lines)


def _shown(provenance: dict[str, str | None], key: str) -> str:
    """A provenance field as the diffs name it: its value, "null" where it does not apply, "unknown"
    where the golden predates the field."""
    if key not in provenance:
        return "unknown"
    return "null" if provenance[key] is None else str(provenance[key])


def fingerprint_changes(provenance: dict[str, str | None], run: dict[str, str | None]) -> tuple[list[str], list[str]]:
    """How this run's environment (environment.fingerprint) differs from the one a golden recorded:
    (changed: "torch 2.13.0 -> 2.13.1", one per field both know and differ in; unrecorded:
    "mkl unknown -> 2024.2 build 20240605", one per field the golden predates).

    An unknown field is named but is no change: a golden too old to say what it ran on must not
    let a change of the code pass as drift. A field this run lacks (a manifest of an older harness,
    read by ``harness collect``) counts as unknown too.
    """
    changed, unrecorded = [], []
    for key in FINGERPRINT_KEYS:
        before, after = _shown(provenance, key), _shown(run, key)
        if before == after:
            continue
        (unrecorded if "unknown" in (before, after) else changed).append(f"{key} {before} -> {after}")
    return changed, unrecorded


_MISSING = object()


def config_differences(golden: dict, run: dict) -> list[str]:
    """Every field where two golden configs differ, dotted: "arms.graph.config.chunks: golden 2, this run 4"."""

    def flat(obj: Any, prefix: str) -> dict[str, Any]:
        if isinstance(obj, dict) and obj:
            return {
                k: v for key, value in obj.items() for k, v in flat(value, f"{prefix}.{key}" if prefix else key).items()
            }
        return {prefix: obj}

    def show(value: Any) -> str:
        return "unset" if value is _MISSING else json.dumps(value)

    # Through JSON, so that a tuple in the run and a list in the file compare equal.
    mine, theirs = flat(json.loads(json.dumps(golden)), ""), flat(json.loads(json.dumps(run)), "")
    return [
        f"{key}: golden {show(mine.get(key, _MISSING))}, this run {show(theirs.get(key, _MISSING))}"
        for key in sorted(mine.keys() | theirs.keys())
        if mine.get(key, _MISSING) != theirs.get(key, _MISSING)
    ]


def shown_path(path: Path, root: Path) -> str:
    """A golden's path as the console, summary.json and the report show it: relative to the checkout
    or the working directory when under either, else to the golden root ``root``; never a home
    directory or a temporary folder that means nothing to a reader of a CI log."""
    path = Path(path).absolute()
    for base in ([SOURCE_ROOT] if in_checkout() else []) + [Path.cwd(), Path(root).absolute()]:
        if path.is_relative_to(base):
            return path.relative_to(base).as_posix() or "."
    return str(path)


def loose_lead(key: str, other: str, verb: str) -> str:
    """How the golden lines (the plan, the outcome, ``harness golden status``) start when the
    golden of this environment ``key`` is missing and ``other``'s is compared instead, so that a
    reader sees the check was loose before reading its counts: "this environment's golden (<key>)
    is missing; <verb> loosely with <other> at the cross-environment tier"."""
    return f"this environment's golden ({key}) is missing; {verb} loosely with {other} at the cross-environment tier"
