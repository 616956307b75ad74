"""Suite files: TOML in, validated and typed specs out.

A suite names its system under test, its arms and the checks to run on them. Every mistake, in
the file or in a ``--set`` override, is reported as one line naming where it came from and the
dotted field, before anything is launched:
``suites/parity.toml: arms.graph.chunks: expected int >= 1, got "two"``.

The suite's system under test is its ``subject`` (``"reference"`` by default; see
:mod:`harness.subject`). Its ``[model]``, ``[train]`` and ``[arms.NAME]`` tables are the subject's
own fields, which it parses with the typed readers here; everything else (checks, golden, debug,
throughput, expectations) is the harness's. A check that reads a record family its arm cannot emit
(:mod:`harness.subject.protocol`), or whose arm lacks the facts that family's checks need
(``ArmFacts``), is refused, naming the check, the family and the subject; so is a resumed arm of
a subject that does not declare the ``checkpoint`` capability.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from pathlib import Path
from typing import Any

from harness.checks import CHECK_KINDS, FAMILIES
from harness.checks.pairs import DEFAULT_METRICS
from harness.compare import tier_from_spec
from harness.records import METRIC_COLUMNS
from harness.shipped import shipped_dir
from harness.specs import ArmSpec, CheckSpec, DebugSpec, SuiteSpec, ThroughputSpec
from harness.subject import DEFAULT, Subject, SubjectError, SubjectFault, load_subject, raised_in
from harness.subject.config import display_path, show
from harness.subject.protocol import CHECKPOINT, SuiteTables

# The shipped suites; --suites-dir names a folder of the user's own instead.
SUITES_DIR = shipped_dir("suites")
MAX_RANKS = 8
FAIL_MODES = ("raise", "hang", "exit", "kill", "stop")
CHECKPOINT_DAMAGE = ("missing-shard", "truncated-shard", "garbage-index", "other-config")
# Names that become paths (suites, arms) or labels (checks) must be safe as both.
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]*")
CHECK_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _.,:()+-]*")
# The tier a golden of another environment is checked with: it must absorb the kernel-ISA noise
# between CPUs (measured at most 2e-6 relative over the shipped suites' 20 steps, AVX-512 vs AVX2)
# and still catch a real change (a 1% learning-rate change moves the loss by 1e-3 at step 2).
CROSS_ENV_TIER = {"kind": "close", "rtol": 1e-4, "atol": 0.0}


_TOP_KEYS = (
    "name", "description", "ranks", "steps", "model", "train", "arms", "checks", "golden", "debug", "throughput",
    "expect", "expected_failures", "subject", "change",
)  # fmt: skip
_TABLES = ("model", "train", "golden", "debug", "throughput", "change")


class SuiteError(Exception):
    """A bad suite or override; the message is one line naming the file (or --set) and field."""


def suite_path(name_or_path: str, suites_dir: Path = SUITES_DIR) -> Path:
    """SUITE on the command line: a path to a TOML file, or the name of one in ``suites_dir``."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.is_file():
        return path
    return suites_dir / f"{name_or_path}.toml"


def list_suites(suites_dir: Path = SUITES_DIR) -> list[tuple[str, str]]:
    """(name, description) of every suite in ``suites_dir``, read without validation."""
    found = []
    for path in sorted(suites_dir.glob("*.toml")):
        try:
            description = str(tomllib.loads(path.read_text()).get("description", ""))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            description = f"(invalid TOML: {e})"
        found.append((path.stem, description))
    return found


def load_suite(
    name_or_path: str, overrides: list[tuple[str, str]] = (), device: str = "cpu", suites_dir: Path = SUITES_DIR
) -> SuiteSpec:
    """Reads, overrides and validates a suite.

    ``overrides`` are (origin, "key=value") pairs, origin being how the user wrote it
    ("--set" or a dedicated flag such as "--ranks"), so errors can point back at it.
    """
    path = suite_path(name_or_path, suites_dir)
    shown = display_path(path)
    if not path.is_file():
        known = ", ".join(name for name, _ in list_suites(suites_dir))
        raise SuiteError(f"{shown}: no such suite file (suites: {known})")
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SuiteError(f"{shown}: invalid TOML: {e}") from None
    v = _Validator(shown, device, _subject(raw, path, shown))
    for origin, item in overrides:
        v.apply_override(raw, origin, item)
    return v.suite(raw, path)


def _subject(raw: dict, path: Path, shown: str) -> Subject:
    """The suite's ``subject``, loaded (a ``module:factory`` from beside the suite file first)."""
    name = raw.get("subject", DEFAULT)
    if not isinstance(name, str) or not name:
        raise SuiteError(f"{shown}: subject: expected a non-empty string, got {show(name)}")
    try:
        return load_subject(name, path.resolve())
    except SubjectError as e:
        raise SuiteError(f"{shown}: subject: {e}") from None
    except SubjectFault as e:
        raise SubjectFault(f"{shown}: subject: {e}") from None


def field_reader(shown: str) -> _Validator:
    """The suite validator's typed readers for another TOML file (a Slurm profile), so that its
    errors read as a suite's do: ``<file>: <dotted field>: expected ..., got ...``."""
    return _Validator(shown, "cpu", None)


def _parse_value(text: str) -> Any:
    """A --set value is a TOML value (5, 0.01, true, "x", [1, 2]); anything else is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


class _Validator:
    """Walks the raw TOML tree; remembers which fields came from overrides to name them in errors."""

    max_ranks = MAX_RANKS

    def __init__(self, shown: str, device: str, subject: Subject | None) -> None:
        self.shown = shown
        self.device = device
        self.subject = subject
        self.origins: dict[str, str] = {}  # dotted field -> "--set key" / "--ranks"

    def overridden(self, dotted: str) -> bool:
        """Whether ``dotted`` was set by an override (a relative path in it is then the working directory's)."""
        return dotted in self.origins

    def for_file(self, shown: str) -> _Validator:
        """Readers for another file the suite names (a config.json): errors name that file."""
        return _Validator(shown, self.device, self.subject)

    def error(self, dotted: str, msg: str) -> SuiteError:
        for field, origin in self.origins.items():
            if dotted == field or dotted.startswith(field + ".") or field.startswith(dotted + "."):
                return SuiteError(f"{origin}: {msg}")
        return SuiteError(f"{self.shown}: {dotted}: {msg}" if dotted else f"{self.shown}: {msg}")

    def parse_arms(self, tables: SuiteTables) -> dict[str, ArmSpec]:
        """The subject's arms: what it raises rejecting its config is bad input (SuiteError, exit 2), anything
        else its bug (SubjectFault, exit 1), named by where in its code (harness/subject/protocol.py)."""
        subject = f"subject {show(self.subject.name)}"
        try:
            arms = self.subject.parse_arms(tables, self)
        except SuiteError:
            raise
        except (SubjectError, ValueError) as e:
            raise self.error("", f"{subject} rejects its config: {e}") from None
        except Exception as e:
            where = raised_in(e, self.subject.source)
            raise SubjectFault(f"{self.shown}: {subject}: parse_arms raised: {where}") from None
        for name, arm in arms.items():
            if arm.resume_at is not None and CHECKPOINT not in self.subject.capabilities:
                why = f"{subject} does not declare the {CHECKPOINT} capability: no arm of it resumes"
                raise self.error(f"arms.{name}.resume_at", why)
        return arms

    # --- overrides -------------------------------------------------------------------------

    def apply_override(self, raw: dict, origin: str, item: str) -> None:
        key, sep, text = item.partition("=")
        key = key.strip()
        label = origin if origin != "--set" else f"--set {key}"
        if not sep or not key:
            raise SuiteError(f"{origin} {item}: expected key=value")
        value = _parse_value(text.strip())
        if key == "subject":
            raise SuiteError(f"{label}: the subject is the suite file's; it cannot be overridden")
        if "." not in key and key not in _TOP_KEYS and key in self.subject.train_fields:
            # Shorthand: a bare train field applies to the suite and to every arm setting it.
            arms = raw.get("arms") if isinstance(raw.get("arms"), dict) else {}
            targets = ["train." + key] + [
                f"arms.{arm}.{key}" for arm, table in arms.items() if isinstance(table, dict) and key in table
            ]
        else:
            targets = [key]
        for dotted in targets:
            self.origins[dotted] = label
            self._set(raw, dotted, value, label)

    def _set(self, raw: dict, dotted: str, value: Any, label: str) -> None:
        parts = dotted.split(".")
        node: Any = raw
        for depth, part in enumerate(parts[:-1]):
            here = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                node = node[self._index(node, part, here, label)]
                continue
            if not isinstance(node, dict):
                raise SuiteError(f"{label}: {'.'.join(parts[:depth])} is not a table")
            if part not in node:
                if depth == 0 and part in _TABLES:
                    node[part] = {}
                elif depth == 1 and parts[0] == "arms":
                    known = ", ".join(raw.get("arms", {}))
                    raise SuiteError(f"{label}: no arm named {show(part)} (arms: {known})")
                else:
                    raise SuiteError(f"{label}: unknown key {show(here)}")
            node = node[part]
        last = parts[-1]
        if isinstance(node, list):
            node[self._index(node, last, dotted, label)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise SuiteError(f"{label}: {'.'.join(parts[:-1])} is not a table")

    @staticmethod
    def _index(node: list, part: str, here: str, label: str) -> int:
        if not part.isdigit() or int(part) >= len(node):
            raise SuiteError(f"{label}: {here}: expected an index below {len(node)}")
        return int(part)

    # --- typed readers ---------------------------------------------------------------------

    def table(self, raw: Any, dotted: str, allowed: tuple[str, ...] | dict) -> dict:
        if not isinstance(raw, dict):
            raise self.error(dotted, f"expected a table, got {show(raw)}")
        for key in raw:
            if key not in allowed:
                where = f"{dotted}.{key}" if dotted else key
                raise self.error(where, f"unknown key (allowed: {', '.join(allowed)})")
        return raw

    def int_(self, value: Any, dotted: str, lo: int = 1, hi: int | None = None) -> int:
        bounds = f">= {lo}" if hi is None else f"in {lo}-{hi}"
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            raise self.error(dotted, f"expected int {bounds}, got {show(value)}")
        return value

    def str_(self, value: Any, dotted: str, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(dotted, f"expected a non-empty string, got {show(value)}")
        if choices is not None and value not in choices:
            raise self.error(dotted, f"expected one of {', '.join(choices)}, got {show(value)}")
        return value

    def str_list(self, value: Any, dotted: str, choices: tuple[str, ...] | list[str]) -> tuple[str, ...]:
        if not isinstance(value, list) or not value:
            raise self.error(dotted, f"expected a non-empty list of strings, got {show(value)}")
        for i, item in enumerate(value):
            self.str_(item, f"{dotted}.{i}", tuple(choices))
        return tuple(value)

    def typed(self, value: Any, dotted: str, expected: type, positive: bool) -> Any:
        """``value`` as a bool, int (>= 1 if ``positive``, else >= 0), finite float (> 0 if ``positive``) or string."""
        if expected is bool:
            if not isinstance(value, bool):
                raise self.error(dotted, f"expected true or false, got {show(value)}")
            return value
        if expected is int:
            return self.int_(value, dotted, lo=1 if positive else 0)
        if expected is float:
            number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            if not number or (positive and value <= 0):
                raise self.error(
                    dotted, f"expected a {'number > 0' if positive else 'finite number'}, got {show(value)}"
                )
            return float(value)
        if expected is str:
            return self.str_(value, dotted)
        return value

    # --- the suite -------------------------------------------------------------------------

    def suite(self, raw: dict, path: Path) -> SuiteSpec:
        self.table(raw, "", _TOP_KEYS)
        for key in ("name", "description", "ranks", "steps", "arms"):
            if key not in raw:
                raise self.error(key, "missing")
        name = self.name(raw["name"], "name")
        description = self.str_(raw["description"], "description")
        ranks = self.int_(raw["ranks"], "ranks", 1, MAX_RANKS)
        steps = self.int_(raw["steps"], "steps")
        arms_raw = raw["arms"]
        if not isinstance(arms_raw, dict) or not arms_raw:
            raise self.error("arms", f"expected at least one [arms.NAME] table, got {show(arms_raw)}")
        raises = self.expected_raises(arms_raw)
        arms_raw = {
            name: {k: v for k, v in table.items() if k != "expect_raise"} if isinstance(table, dict) else table
            for name, table in arms_raw.items()
        }
        tables = SuiteTables(raw.get("model", {}), raw.get("train", {}), arms_raw, ranks, steps, path, self.device)
        arms = self.parse_arms(tables)
        for arm, text in raises.items():
            if arms[arm].resume_at is not None:
                raise self.error(f"arms.{arm}.expect_raise", "an arm expected to raise does not resume")
            arms[arm] = dataclasses.replace(arms[arm], expect_raise=text)
        throughput = self.throughput(raw["throughput"], arms) if "throughput" in raw else None
        checks_raw = raw.get("checks", [])
        if not isinstance(checks_raw, list) or (not checks_raw and throughput is None):
            # A suite that checks nothing would pass whatever its arms did; a throughput run has its gate.
            raise self.error("checks", f"expected at least one [[checks]] table, got {show(checks_raw)}")
        checks = tuple(self.check(c, f"checks.{i}", arms) for i, c in enumerate(checks_raw))
        names = [c.name for c in checks]
        for i, c in enumerate(checks):
            if names.count(c.name) > 1:
                raise self.error(f"checks.{i}.name", f"duplicate check name {show(c.name)}")
        golden_tier, golden_metrics, cross_env = self.golden(raw.get("golden", {}))
        debug = self.debug(raw.get("debug", {}), arms, steps)
        expect, expected_failures = self.expectation(raw, throughput)
        change_tier = self.change(raw.get("change", {}))
        return SuiteSpec(
            name,
            description,
            path,
            ranks,
            steps,
            arms,
            checks,
            golden_tier,
            golden_metrics,
            cross_env,
            debug,
            throughput,
            expect,
            expected_failures,
            raw.get("subject", DEFAULT),
            change_tier,
        )

    def expected_raises(self, arms_raw: dict) -> dict[str, str]:
        """Each arm's ``expect_raise``, a key of the harness in any subject's arm table: the text the
        line of the exception the system under test is known to raise in that arm must contain."""
        raises = {}
        for name, table in arms_raw.items():
            if isinstance(table, dict) and "expect_raise" in table:
                text = self.str_(table["expect_raise"], f"arms.{name}.expect_raise")
                if not text.strip():
                    raise self.error(f"arms.{name}.expect_raise", "empty: name the text of the exception's line")
                raises[name] = text
        return raises

    def change(self, raw: Any) -> dict[str, Any]:
        """[change]: the tier at which each arm at a change's head must match itself at its base
        (``harness run --base``): exact unless it names ulp, close or band with their bounds."""
        if not isinstance(raw, dict):
            raise self.error("change", f"expected a table, got {show(raw)}")
        for key in ("arms", "name", "metrics"):
            if key in raw:
                raise self.error(f"change.{key}", "unknown key (allowed: kind and the tier's fields)")
        return self.tier({"kind": "exact", **raw}, "change")

    def expectation(self, raw: dict, throughput: ThroughputSpec | None) -> tuple[str, tuple[str, ...]]:
        """``expect`` ("pass" or "fail") and, for a negative suite, ``expected_failures``: the names of
        the check results that must fail, as the console and summary.json name them ("<arm>: <check>",
        "<a> vs <b>: loss"); a name no check produces fails the run. Without the list, "fail" would
        accept any failure."""
        expect = self.str_(raw.get("expect", "pass"), "expect", ("pass", "fail"))
        if expect == "pass":
            if "expected_failures" in raw:
                raise self.error("expected_failures", 'only a suite with expect = "fail" lists expected failures')
            return expect, ()
        if throughput is not None:
            raise self.error("expect", "a throughput run is judged by its gate alone: it cannot expect to fail")
        if "expected_failures" not in raw:
            raise self.error("expected_failures", 'missing: expect = "fail" needs the checks that must fail')
        names = raw["expected_failures"]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise self.error("expected_failures", f"expected a non-empty list of check names, got {show(names)}")
        return expect, tuple(names)

    def throughput(self, raw: Any, arms: dict[str, ArmSpec]) -> ThroughputSpec:
        """[throughput]: arms ``a`` and ``b`` (the same arm measures it against a copy of itself),
        ABBA ``blocks`` ("auto", the default, or a number >= 2: an interval needs two) with
        ``max_blocks`` and ``budget_s`` bounding "auto", timed ``steps`` per block position,
        ``warmup`` steps, ``max_slowdown`` (the gate) and ``control`` (an A/A null control)."""
        fields = {f.name: f for f in dataclasses.fields(ThroughputSpec)}
        table = self.table(raw, "throughput", tuple(fields))
        for key in ("a", "b"):
            if key not in table:
                raise self.error(f"throughput.{key}", f"missing (an arm: {', '.join(arms)})")
        values: dict[str, Any] = {key: self.str_(table[key], f"throughput.{key}", tuple(arms)) for key in ("a", "b")}
        for key in ("a", "b"):
            if arms[values[key]].oracle:
                raise self.error(
                    f"throughput.{key}", f"arm {show(values[key])} trains in lockstep with an oracle: not timed"
                )
        if "blocks" in table:
            blocks = values["blocks"] = table["blocks"]
            if blocks != "auto" and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 2):
                raise self.error("throughput.blocks", f'expected "auto" or an int >= 2, got {show(blocks)}')
        for key, lo in (("max_blocks", 2), ("steps", 1), ("warmup", 0)):
            if key in table:
                values[key] = self.int_(table[key], f"throughput.{key}", lo)
        if "budget_s" in table:
            values["budget_s"] = self.typed(table["budget_s"], "throughput.budget_s", float, True)
        if "max_slowdown" in table:
            values["max_slowdown"] = self.typed(table["max_slowdown"], "throughput.max_slowdown", float, False)
        if "control" in table:
            values["control"] = self.typed(table["control"], "throughput.control", bool, False)
        spec = ThroughputSpec(**values)
        if spec.max_slowdown < 0:
            raise self.error("throughput.max_slowdown", f"expected a number >= 0, got {show(spec.max_slowdown)}")
        return spec

    def name(self, value: Any, dotted: str) -> str:
        """Suite and arm names become directories: lowercase letters, digits, '-' and '_' only."""
        if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
            raise self.error(dotted, f"expected a name of lowercase letters, digits, '-' or '_', got {show(value)}")
        return value

    def arm_pair(self, raw: dict, dotted: str, arms: dict[str, ArmSpec]) -> tuple[str, str]:
        if "arms" not in raw:
            if len(arms) < 2:
                raise self.error(dotted, "needs two arms to compare, the suite has one")
            first, second = list(arms)[:2]
            return first, second
        pair = self.str_list(raw["arms"], f"{dotted}.arms", list(arms))
        if len(pair) != 2 or pair[0] == pair[1]:
            raise self.error(f"{dotted}.arms", f"expected two different arm names, got {show(list(pair))}")
        return pair[0], pair[1]

    def check(self, raw: Any, dotted: str, arms: dict[str, ArmSpec]) -> CheckSpec:
        """A [[checks]] table, parsed by the family that owns its kind (harness/checks/)."""
        if not isinstance(raw, dict):
            raise self.error(dotted, f"expected a table, got {show(raw)}")
        if "kind" not in raw:
            raise self.error(f"{dotted}.kind", f"missing (one of {', '.join(CHECK_KINDS)})")
        kind = self.str_(raw["kind"], f"{dotted}.kind", CHECK_KINDS)
        family = FAMILIES[kind]
        unfed = sorted(set(family.reads_of(kind)) - self.subject.families)
        if unfed:
            raise self.error(
                f"{dotted}.kind",
                f"{kind} reads {', '.join(unfed)} records, which subject {show(self.subject.name)} does not emit"
                f" (it emits: {', '.join(sorted(self.subject.families))})",
            )
        self.refuse_missing_facts(kind, raw, dotted, arms)
        check = family.parse(kind, raw, dotted, self, arms)
        for arm in check.arms:
            missing = sorted(set(family.reads_of(kind)) - set(arms[arm].families))
            if missing:
                raise self.error(
                    f"{dotted}.arms" if "arms" in raw else dotted,
                    f'{kind} reads {", ".join(missing)} records, which arm "{arm}" of subject'
                    f" {show(self.subject.name)} does not emit",
                )
        return check

    def refuse_missing_facts(self, kind: str, raw: dict, dotted: str, arms: dict[str, ArmSpec]) -> None:
        """Refuses a check that reads a record family of an arm (one it lists, or any) whose facts lack
        what that family's checks need (ArmFacts.needs): they could judge nothing, or would crash."""
        listed = raw.get("arms") if isinstance(raw.get("arms"), list) else list(arms)
        for arm, spec in arms.items():
            for family in FAMILIES[kind].reads_of(kind) if arm in listed else ():
                if spec.emits(family) and (missing := spec.facts.missing(family, spec.families)):
                    raise self.error(
                        f"{dotted}.kind",
                        f"{kind} reads {family} records, whose checks need the facts {', '.join(missing)}, which arm"
                        f' "{arm}" of subject {show(self.subject.name)} does not declare (ArmSpec.facts)',
                    )

    def check_name(self, value: Any, dotted: str) -> str:
        """Check names label reports and plots: no markup, path or shell characters."""
        if not isinstance(value, str) or not CHECK_NAME_PATTERN.fullmatch(value):
            allowed = "letters, digits, spaces and _ . , : ( ) + -"
            raise self.error(
                dotted, f"expected a name of {allowed}, starting with a letter or digit, got {show(value)}"
            )
        return value

    def metric_list(self, raw: dict, dotted: str, default: tuple[str, ...]) -> tuple[str, ...]:
        return self.str_list(raw["metrics"], f"{dotted}.metrics", METRIC_COLUMNS) if "metrics" in raw else default

    def tier(self, raw: dict, dotted: str) -> dict[str, Any]:
        try:
            return tier_from_spec(raw).spec()
        except ValueError as e:
            raise self.error(dotted, str(e)) from None

    def golden(self, raw: Any) -> tuple[dict[str, Any], tuple[str, ...], dict[str, Any]]:
        """(tier, metrics, cross-environment tier) of the [golden] table."""
        # The tier parser rejects fields the tier lacks; "arms" and "name" mean nothing here.
        if not isinstance(raw, dict):
            raise self.error("golden", f"expected a table, got {show(raw)}")
        for key in ("arms", "name"):
            if key in raw:
                raise self.error(
                    f"golden.{key}", "unknown key (allowed: kind, metrics, cross_env and the tier's fields)"
                )
        own = {k: v for k, v in raw.items() if k != "cross_env"}
        cross_env = raw.get("cross_env", CROSS_ENV_TIER)
        if not isinstance(cross_env, dict) or cross_env.get("kind") == "exact":
            raise self.error("golden.cross_env", f"expected a tier table that is not exact, got {show(cross_env)}")
        metrics = self.metric_list(own, "golden", DEFAULT_METRICS)
        cross_tier = self.tier(cross_env, "golden.cross_env")
        for key in ("metrics", "arms", "name"):
            if key in cross_env:
                raise self.error(f"golden.cross_env.{key}", "unknown key (allowed: kind and the tier's fields)")
        return self.tier({"kind": "exact", **own}, "golden"), metrics, cross_tier

    def debug(self, raw: Any, arms: dict[str, ArmSpec], steps: int) -> DebugSpec:
        table = self.table(raw, "debug", tuple(f.name for f in dataclasses.fields(DebugSpec)))
        arm = self.str_(table["fail_arm"], "debug.fail_arm", tuple(arms)) if "fail_arm" in table else next(iter(arms))
        slow_fraction = self.typed(table.get("slow_fraction", 0.0), "debug.slow_fraction", float, False)
        if slow_fraction < 0:
            raise self.error("debug.slow_fraction", f"expected a number >= 0, got {show(slow_fraction)}")
        if slow_fraction and "slow_arm" not in table:
            raise self.error("debug.slow_arm", f"missing (the arm to slow down: {', '.join(arms)})")
        return DebugSpec(
            fail_step=self.int_(table["fail_step"], "debug.fail_step", 1, steps) if "fail_step" in table else None,
            fail_rank=self.int_(table.get("fail_rank", 0), "debug.fail_rank", 0, arms[arm].ranks - 1),
            fail_mode=self.str_(table.get("fail_mode", "raise"), "debug.fail_mode", FAIL_MODES),
            fail_arm=arm,
            slow_arm=self.str_(table["slow_arm"], "debug.slow_arm", tuple(arms)) if "slow_arm" in table else None,
            slow_fraction=slow_fraction,
            checkpoint_damage=(
                self.str_(table["checkpoint_damage"], "debug.checkpoint_damage", CHECKPOINT_DAMAGE)
                if "checkpoint_damage" in table
                else None
            ),
        )
