"""What a run does with its golden: planned before launching (:func:`plan_golden`), so that a bad
golden costs no run (exit 2), and written after judging (:func:`update_golden`) for ``--golden update``
of a run that passed. The golden file itself is harness/golden.py.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from harness.compare import tier_from_spec
from harness.environment import comparable_env_keys
from harness.golden import (
    Golden,
    GoldenError,
    config_differences,
    diff_summary,
    golden_from_metrics,
    load_golden,
    load_golden_for,
    loose_lead,
    shown_path,
    write_golden,
)
from harness.results import CheckResult
from harness.revisions import BASE

if TYPE_CHECKING:
    from harness.manifest import Manifest
    from harness.specs import SuiteSpec

GOLDEN_MODES = ("auto", "check", "update", "off")


@dataclass
class GoldenPlan:
    """What a run does with goldens, decided before launching so a bad golden costs no run (exit 2)."""

    mode: str  # check | update | off
    path: Path  # this environment's golden: what update writes
    golden: Golden | None = None  # what check compares with
    # check's tier: the golden's own, or the suite's cross-environment tier (which a golden's
    # calibration replaces, metric by metric: Golden.cross_env_tiers)
    tier: dict | None = None
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

    @property
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
        fingerprint, path = record.get("fingerprint"), Path(record["path"])
        calibration = golden.calibration if golden is not None and golden.env_key != path.stem else None
        how = tier_from_spec(record["tier"]).describe() if record["tier"] else None
        how = calibration.describe() if calibration else how
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


def golden_config(suite: SuiteSpec) -> dict:
    """What a golden is recorded for: steps, and each arm's processes and the fields its subject
    says it sets away from their defaults (``ArmSpec.golden_config``).

    Non-default fields only: a field the subject adds later leaves goldens comparable, while a
    changed default moves the numerics and shows up as a golden failure, as it should.
    """
    arms = {a.name: {"ranks": a.ranks, "config": a.golden_config} for a in suite.arms.values() if a.revision != BASE}
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
    try:  # read now, not when planned: the file this write replaces, whoever wrote it meanwhile
        old, note = (load_golden_for(plan.path, suite.name) if plan.path.is_file() else None), None
    except GoldenError as e:
        old, note = None, f"replacing an unreadable golden: {e}"
    if old is not None and "calibration" in old.provenance:  # noise between environments, not this one's values
        provenance["calibration"] = old.provenance["calibration"]
    new = golden_from_metrics(
        suite.name, manifest.env_key, provenance, config, suite.golden_tier, metrics, suite.golden_metrics
    )
    diff = diff_summary(old, new)
    write_golden(plan.path, new)
    return "\n".join(filter(None, [note, diff, f"wrote {plan.shown(plan.path)}"]))


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

    none is off for a run that has no golden at all (a throughput run's step times), so says nothing.
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

    if requested in ("off", "none"):
        return plan("off", note="golden: not compared (--golden off)" if requested == "off" else None)
    if requested == "update":
        return plan("update")
    recorded = sorted(p.stem for p in (golden_dir / suite).glob("*.json"))
    comparable = [golden_dir / suite / f"{other}.json" for other in comparable_env_keys(key, recorded)]
    source = path if not missing else next(iter(comparable), None)
    if source is None:
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
    calibration = golden.calibration if source != path else None  # the cross-environment tier, measured
    tier = golden.tier if source == path else tier_from_spec(cross_env_tier).spec()
    how = calibration.describe() if calibration else tier_from_spec(tier).describe()
    prefix = f", its first {config['steps']} of {golden.steps} steps" if config["steps"] < golden.steps else ""
    lead = "will compare with " if source == path else loose_lead(key, golden.env_key, "will compare") + ": "
    return plan("check", golden, tier, f"golden: {lead}{shown(source)}{prefix}, {how}", how)
