"""Golden trajectories: reference metrics per suite and environment, validated on load, replaced atomically.

Pairwise parity catches a change that breaks the arms' equivalence; a golden catches both arms
drifting together (a model change, a toolchain upgrade). Numerics depend on hardware and
toolchain, so goldens are keyed by environment, as Megatron keys them by GPU and container, and an
update shows a reviewer what moved (diff_summary) before it lands.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from harness.compare import Exact, compare_series, format_steps, tier_from_spec
from harness.environment import FINGERPRINT_KEYS, split_env_key
from harness.files import remove_stale_temps, write_json_atomic
from harness.results import CheckResult
from harness.shipped import SOURCE_ROOT, in_checkout

if TYPE_CHECKING:
    from harness.manifest import Manifest
    from harness.specs import SuiteSpec

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


@dataclass(eq=False)
class Golden:
    """A parsed golden file; trajectories are float64 Series indexed by step."""

    suite: str
    env_key: str
    provenance: dict[str, str | None]
    config: dict  # {"steps": N, "arms": {arm: {"ranks": P, "config": non-default fields}}}
    tier: dict
    arms: dict[str, dict[str, pd.Series]]

    @property
    def steps(self) -> int:
        return self.config["steps"]

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


# --- which golden a run compares with --------------------------------------------------------

GOLDEN_MODES = ("auto", "check", "update", "off")
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


def comparable_goldens(suite_dir: Path, key: str) -> list[Path]:
    """Goldens of other environments a run keyed ``key`` may compare with at the cross-environment
    tier: same device family (cpu, cuda), backend and dtype. Best first: same torch, then pinned."""
    mine = split_env_key(key)
    found = []
    for path in sorted(suite_dir.glob("*.json")):
        try:
            other = split_env_key(path.stem)
        except ValueError:
            continue
        family = other.device.split("-")[0] == mine.device.split("-")[0]
        if path.stem != key and family and (other.backend, other.dtype) == (mine.backend, mine.dtype):
            found.append(path)
    return sorted(found, key=lambda p: (split_env_key(p.stem).torch != mine.torch, "-pinned-" not in p.stem, p.stem))


def shown_path(path: Path, root: Path) -> str:
    """A golden's path as the console, summary.json and the report show it: relative to the checkout
    or the working directory when under either, else to the golden root ``root``; never a home
    directory or a temporary folder that means nothing to a reader of a CI log."""
    path = Path(path).absolute()
    for base in ([SOURCE_ROOT] if in_checkout() else []) + [Path.cwd(), Path(root).absolute()]:
        if path.is_relative_to(base):
            return path.relative_to(base).as_posix() or "."
    return str(path)


@dataclass
class GoldenPlan:
    """What a run does with goldens, decided before launching so a bad golden costs no run (exit 2)."""

    mode: str  # check | update | off
    path: Path  # this environment's golden: what update writes
    golden: Golden | None = None  # what check compares with, or what update replaces
    tier: dict | None = None  # check's tier: the golden's own, or the cross-environment tier
    note: str | None = None  # one console line before the run: what will be compared and how, or why nothing is
    root: Path | None = None  # the golden root (--golden-dir) the paths are shown against
    how: str | None = None  # the tier in words ("bit for bit")
    # This run's environment (environment.fingerprint): what update records as provenance, and what a
    # failed check compares with the golden's to tell drift from a regression. None: not recorded.
    fingerprint: dict[str, str | None] | None = None
    # No golden for this run's own env key when the run was planned: a check then compares loosely with
    # another environment's golden, and the console and summary.json say so, since a bug that moves the
    # numbers by less than the cross-environment tier passes such a run.
    missing: bool = False

    @property
    def cross_env(self) -> bool:
        return self.golden is not None and self.golden.env_key != self.path.stem

    @property
    def compared(self) -> Path | None:
        """The golden file a check compares with."""
        return self.path.parent / f"{self.golden.env_key}.json" if self.golden and self.mode == "check" else None

    def shown(self, path: Path) -> str:
        return shown_path(path, self.root or path.parent.parent)

    def record(self) -> dict:
        """manifest.json's ``golden``: the plan with absolute paths, as ``harness collect`` reloads it."""
        return {
            "mode": self.mode,
            "path": str(self.path),
            "compared": str(self.compared) if self.compared else None,
            "root": str(self.root) if self.root else None,
            "tier": self.tier,
            "note": self.note,
            "fingerprint": self.fingerprint,
            "missing_for_this_environment": self.missing,
        }

    @classmethod
    def from_record(cls, record: dict) -> GoldenPlan:
        """The plan :meth:`record` wrote, with the golden it compares with loaded again; an older
        harness's record has no fingerprint, nor whether its own golden was missing (then a check
        against another environment's golden tells)."""
        compared = record["compared"]
        root = Path(record["root"]) if record["root"] else None
        golden = load_golden(Path(compared)) if compared else None
        how = tier_from_spec(record["tier"]).describe() if record["tier"] else None
        fingerprint, path = record.get("fingerprint"), Path(record["path"])
        missing = record.get("missing_for_this_environment", golden is not None and golden.env_key != path.stem)
        return cls(record["mode"], path, golden, record["tier"], record["note"], root, how, fingerprint, missing)

    def summary(self, outcome: str | None) -> dict:
        """summary.json's ``golden``: the plan announced before the run and the ``outcome`` judged
        after it, with paths relative to the checkout or the golden root."""
        return {
            "mode": self.mode,
            "path": self.shown(self.path),
            "compared": self.shown(self.compared) if self.compared else None,
            "tier": self.tier,
            "plan": self.note,
            "outcome": outcome,
            "missing_for_this_environment": self.missing,
            "compared_env_key": self.golden.env_key if self.compared else None,
        }

    def outcome(self, checks: list[CheckResult]) -> str | None:
        """The golden line after judging, None when nothing was compared: "golden: 6 of 6 checks match
        golden/parity/<key>.json" or "golden: 2 of 6 checks differ from ...". Checks not evaluated
        (an arm that never ran) are counted apart."""
        if self.compared is None:
            return None
        judged = [c for c in checks if c.kind == "golden" and c.status in ("pass", "fail")]
        differ = sum(c.status == "fail" for c in judged)
        unjudged = sum(c.kind == "golden" for c in checks) - len(judged)
        rest = f"; {unjudged} not evaluated" if unjudged else ""
        where, how = self.shown(self.compared), self.how
        loosely = loose_lead(self.path.stem, self.golden.env_key, "compared") + ": " if self.cross_env else ""
        if not judged:
            return f"golden: {loosely}{unjudged} checks against {where} not evaluated" if unjudged else None
        if differ:
            return f"golden: {loosely}{differ} of {len(judged)} checks differ from {where} ({how}){rest}"
        return f"golden: {loosely}{len(judged)} of {len(judged)} checks match {where} ({how}){rest}"


def loose_lead(key: str, other: str, verb: str) -> str:
    """How the golden lines (the plan, the outcome, ``harness golden status``) start when the
    golden of this environment ``key`` is missing and ``other``'s is compared instead, so that a
    reader sees the check was loose before reading its counts: "this environment's golden (<key>)
    is missing; <verb> loosely with <other> at the cross-environment tier"."""
    return f"this environment's golden ({key}) is missing; {verb} loosely with {other} at the cross-environment tier"


def golden_config(suite: SuiteSpec) -> dict:
    """What a golden is recorded for: steps, and each arm's processes and the fields its subject
    says it sets away from their defaults (``ArmSpec.golden_config``).

    Non-default fields only: a field the subject adds later leaves goldens comparable, while a
    changed default moves the numerics and shows up as a golden failure, as it should.
    """
    arms = {a.name: {"ranks": a.ranks, "config": a.golden_config} for a in suite.arms.values()}
    return {"steps": suite.steps, "arms": arms}


def update_golden(plan: GoldenPlan, suite: SuiteSpec, manifest: Manifest, metrics: dict[str, pd.DataFrame]) -> str:
    """Writes the run's trajectories as the golden (atomically); returns the diff for the reviewer."""
    provenance = {
        **(plan.fingerprint or {}),
        "torch": manifest.versions["torch"],
        "device": manifest.device_class,
        "backend": manifest.backend,
        "dtype": suite.dtype,
        "harness": manifest.versions["harness"],
        "git_sha": manifest.versions["git_sha"],
        "date": manifest.created,
    }
    config = golden_config(suite)
    new = golden_from_metrics(
        suite.name, manifest.env_key, provenance, config, suite.golden_tier, metrics, suite.golden_metrics
    )
    diff = diff_summary(plan.golden, new)
    write_golden(plan.path, new)
    return "\n".join(filter(None, [plan.note, diff, f"wrote {plan.shown(plan.path)}"]))


# Options a run takes that ``harness golden update`` does not (what a run does with its golden,
# where it writes, a gate's retries, Slurm's), and the options that take no value.
_RUN_ONLY = ("--out", "--golden", "--retries", "--nodes", "--profile", "--partition", "--account", "--time",
             "--gpus-per-node", "--no-wait")  # fmt: skip
_NO_VALUE = ("--verbose", "--no-wait", "--control")


def rebless_command(command: Sequence[str], suite: SuiteSpec) -> str:
    """The command that records this environment's golden of ``suite`` again, from the run's own
    command line (manifest.json's ``command``): ``harness golden update`` with the same suite and
    options (--ranks, --steps, --set, --device, --cpu-isa, --golden-dir, ...), so the new golden is
    of this run's configuration. It prints what moved (diff_summary) for review before the change
    lands. A gate's other suites, and what only a run takes, are left out."""
    kept, args = [], iter(command[2:])  # after "harness run" (or submit, ci)
    for arg in args:
        if not arg.startswith("-"):  # a suite: this one, or another of a gate's
            if arg == suite.name or Path(arg).resolve() == Path(suite.path).resolve():
                kept.insert(0, arg)
            continue
        flag = arg.split("=", 1)[0]
        value = [] if "=" in arg or flag in _NO_VALUE else [next(args, "")]
        if flag not in _RUN_ONLY:
            kept += [arg, *value]
    return shlex.join(["harness", "golden", "update", *kept])


def plan_golden(
    suite: str,
    config: dict,
    key: str,
    requested: str,
    golden_dir: Path,
    cross_env_tier: dict,
    fingerprint: dict[str, str | None] | None = None,
) -> GoldenPlan:
    """Resolves ``--golden`` for a suite whose configuration is ``config`` (see golden_config), run
    in the environment ``fingerprint`` (environment.fingerprint).

    auto and check compare with this env key's golden, else with a comparable golden of another
    environment at ``cross_env_tier``. Where none applies, check is an error and auto says so in
    its note. A golden of another configuration is an error under check and reported under auto;
    a run shorter than its golden compares its first steps, a longer one is another configuration.
    """
    path = golden_dir / suite / f"{key}.json"
    missing = not path.is_file()

    def plan(
        mode: str,
        golden: Golden | None = None,
        tier: dict | None = None,
        note: str | None = None,
        how: str | None = None,
    ) -> GoldenPlan:
        return GoldenPlan(mode, path, golden, tier, note, golden_dir, how, fingerprint, missing)

    def shown(where: Path) -> str:
        return shown_path(where, golden_dir)

    if requested == "off":
        return plan("off", note="golden: not compared (--golden off)")
    if requested == "update":
        try:
            existing = load_golden_for(path, suite) if path.is_file() else None
        except GoldenError as e:
            return plan("update", note=f"replacing an unreadable golden: {e}")
        return plan("update", existing)
    source = path if not missing else next(iter(comparable_goldens(golden_dir / suite, key)), None)
    if source is None:
        recorded = sorted(p.stem for p in (golden_dir / suite).glob("*.json"))
        found = f"recorded: {', '.join(recorded)}; none comparable" if recorded else "none recorded for this suite"
        reason = f"no golden for env key {key} in {shown(golden_dir / suite)} ({found})"
        if requested == "check":
            raise GoldenError(path, None, f"--golden check: {reason}; record one with: harness golden update {suite}")
        return plan("off", note=f"golden: not compared: {reason}")
    golden = load_golden_for(source, suite)
    differences = config_differences({**golden.config, "steps": None}, {**config, "steps": None})
    if config["steps"] > golden.steps:
        differences.append(f"steps: golden {golden.steps}, this run {config['steps']} (longer than its golden)")
    if differences:
        if requested == "check":
            raise GoldenError(source, "config", f"recorded for another configuration: {'; '.join(differences)}")
        return plan(
            "off", note=f"golden: not compared: {shown(source)} is for another configuration: {'; '.join(differences)}"
        )
    tier = golden.tier if source == path else tier_from_spec(cross_env_tier).spec()
    how = tier_from_spec(tier).describe()
    prefix = f", its first {config['steps']} of {golden.steps} steps" if config["steps"] < golden.steps else ""
    lead = "will compare with " if source == path else loose_lead(key, golden.env_key, "will compare") + ": "
    return plan("check", golden, tier, f"golden: {lead}{shown(source)}{prefix}, {how}", how)


def load_golden_for(path: Path, suite: str) -> Golden:
    """load_golden, refusing a golden of another suite: one filed in the wrong folder."""
    golden = load_golden(path)
    if golden.suite != suite:
        raise GoldenError(path, "suite", f"golden is for suite {golden.suite!r}, not {suite!r}")
    return golden
