"""Suite files: TOML in, validated and typed specs out.

A suite names its arms (each a TrainConfig of the reference plus a process count) and the
checks to run on them. Every mistake, in the file or in a ``--set`` override, is reported as
one line naming where it came from and the dotted field, before anything is launched:
``suites/parity.toml: arms.graph.chunks: expected int >= 1, got "two"``.

Process count and EP degree: ``ranks`` (suite level, ``--ranks``) is the default process
count of every arm, and ``ep`` defaults to the suite's ``ranks``. So an arm that sets only
``ranks = 1`` hosts the whole EP group in one process (logical ranks), whatever ``--ranks``.

Trainers: an arm that sets any field of the delayed pipeline (``delay``,
``max_gradient_staleness``, ``retention``, ``correction``, ``correction_clip``, ``trainer``,
``apply_twice_batch``), in its own table or in ``[train]``, is a *versioned* arm: it resolves to a
``PipelineConfig`` and runs on ``VersionedTrainer``, or on ``DelayedOracleTrainer`` with
``trainer = "delayed-oracle"``; every other arm is a plain ``TrainConfig`` on ``Trainer``. An arm may also
name its own ``model`` (default: ``[model] config``) and an ``oracle``: ``"hf"`` trains it in
lockstep with Hugging Face transformers (see :mod:`harness.oracles`), which must be installed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import oracles
from harness.checks import FAMILIES
from harness.checks.pairs import DEFAULT_METRICS
from harness.compare import tier_from_spec
from harness.records import METRIC_COLUMNS
from harness.reference.hf_config import HF_BASE, HFConfigError, hf_config_fields
from harness.reference.model import CONFIGS, DeepseekV3Config, get_config
from harness.reference.pec import PECConfig
from harness.reference.pipeline import PipelineConfig
from harness.reference.train import TrainConfig
from harness.shipped import shipped_dir
from harness.specs import ArmSpec, CheckSpec, DebugSpec, SuiteSpec, ThroughputSpec, train_config

# The shipped suites; --suites-dir names a folder of the user's own instead.
SUITES_DIR = shipped_dir("suites")
MAX_RANKS = 8
FAIL_MODES = ("raise", "hang", "exit", "kill", "stop")
# Names that become paths (suites, arms) or labels (checks) must be safe as both.
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]*")
CHECK_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _.,:()+-]*")
# The tier a golden of another environment is checked with: it must absorb the kernel-ISA noise
# between CPUs (measured at most 2e-6 relative over the shipped suites' 20 steps, AVX-512 vs AVX2)
# and still catch a real change (a 1% learning-rate change moves the loss by 1e-3 at step 2).
CROSS_ENV_TIER = {"kind": "close", "rtol": 1e-4, "atol": 0.0}


def _value_type(hint: Any) -> type:
    """``int | None`` -> int: TOML has no null, so an optional field is either set or left out."""
    return next((arg for arg in typing.get_args(hint) if arg is not type(None)), hint)


# TrainConfig fields, the pipeline's and PEC's, that a suite may set in [train] or [arms.X]; the model
# comes from [model] and the device from --device, so that one suite file runs anywhere.
_TRAIN_FIELDS: dict[str, type] = {
    name: _value_type(hint)
    for name, hint in (typing.get_type_hints(PipelineConfig) | typing.get_type_hints(PECConfig)).items()
    if name not in ("model", "model_overrides", "device")
}
# Sizes and rates that must be positive; other numbers need only be non-negative ints or finite
# floats, and the reference's TrainConfig validates its own domains after this.
_POSITIVE = {"ep", "local_batch", "seq_len", "chunks", "num_buffer_sets", "lr", "max_norm"}
# DeepseekV3Config fields a suite may set in [model] (or --set model.FIELD), and those a
# config.json may set to null (TOML has no null: in a suite they are set or left out).
_MODEL_HINTS = typing.get_type_hints(DeepseekV3Config)
_MODEL_FIELDS: dict[str, type] = {name: _value_type(hint) for name, hint in _MODEL_HINTS.items()}
_MODEL_NULLABLE = {name for name, hint in _MODEL_HINTS.items() if type(None) in typing.get_args(hint)}
# Every model int is a size >= 1 but these; floats need only be finite but the positive ones.
_MODEL_MAY_BE_ZERO = {"first_k_dense_replace", "n_shared_experts", "pad_token_id"}
_MODEL_POSITIVE = {name for name, kind in _MODEL_FIELDS.items() if kind is int and name not in _MODEL_MAY_BE_ZERO} | {
    "rms_norm_eps",
    "rope_theta",
    "initializer_range",
    "rope_factor",
    "rope_beta_fast",
    "rope_beta_slow",
}
_TOP_KEYS = (
    "name", "description", "ranks", "steps", "model", "train", "arms", "checks", "golden", "debug", "throughput",
    "expect", "expected_failures",
)  # fmt: skip
_TABLES = ("model", "train", "golden", "debug", "throughput")


class SuiteError(Exception):
    """A bad suite or override; the message is one line naming the file (or --set) and field."""


@dataclass(frozen=True)
class _Model:
    """[model] resolved: the reference's config name and the fields set away from it (what the
    ranks build, in TrainConfig.model and model_overrides), and the config as the suite named it."""

    name: str
    overrides: dict[str, Any]
    shown: str
    n_routed_experts: int


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
    v = _Validator(shown, device)
    for origin, item in overrides:
        v.apply_override(raw, origin, item)
    return v.suite(raw, path)


def field_reader(shown: str) -> _Validator:
    """The suite validator's typed readers for another TOML file (a Slurm profile), so that its
    errors read as a suite's do: ``<file>: <dotted field>: expected ..., got ...``."""
    return _Validator(shown, "cpu")


def display_path(path: Path) -> str:
    """A path as errors show it: relative to the working directory where it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _parse_value(text: str) -> Any:
    """A --set value is a TOML value (5, 0.01, true, "x", [1, 2]); anything else is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


class _Validator:
    """Walks the raw TOML tree; remembers which fields came from overrides to name them in errors."""

    def __init__(self, shown: str, device: str) -> None:
        self.shown = shown
        self.device = device
        self.origins: dict[str, str] = {}  # dotted field -> "--set key" / "--ranks"

    def error(self, dotted: str, msg: str) -> SuiteError:
        for field, origin in self.origins.items():
            if dotted == field or dotted.startswith(field + ".") or field.startswith(dotted + "."):
                return SuiteError(f"{origin}: {msg}")
        return SuiteError(f"{self.shown}: {dotted}: {msg}" if dotted else f"{self.shown}: {msg}")

    # --- overrides -------------------------------------------------------------------------

    def apply_override(self, raw: dict, origin: str, item: str) -> None:
        key, sep, text = item.partition("=")
        key = key.strip()
        label = origin if origin != "--set" else f"--set {key}"
        if not sep or not key:
            raise SuiteError(f"{origin} {item}: expected key=value")
        value = _parse_value(text.strip())
        if "." not in key and key not in _TOP_KEYS and key in _TRAIN_FIELDS:
            # Shorthand: a bare TrainConfig field applies to the suite and to every arm setting it.
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
                    raise SuiteError(f"{label}: no arm named {_show(part)} (arms: {known})")
                else:
                    raise SuiteError(f"{label}: unknown key {_show(here)}")
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
            raise self.error(dotted, f"expected a table, got {_show(raw)}")
        for key in raw:
            if key not in allowed:
                where = f"{dotted}.{key}" if dotted else key
                raise self.error(where, f"unknown key (allowed: {', '.join(allowed)})")
        return raw

    def int_(self, value: Any, dotted: str, lo: int = 1, hi: int | None = None) -> int:
        bounds = f">= {lo}" if hi is None else f"in {lo}-{hi}"
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            raise self.error(dotted, f"expected int {bounds}, got {_show(value)}")
        return value

    def str_(self, value: Any, dotted: str, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(dotted, f"expected a non-empty string, got {_show(value)}")
        if choices is not None and value not in choices:
            raise self.error(dotted, f"expected one of {', '.join(choices)}, got {_show(value)}")
        return value

    def str_list(self, value: Any, dotted: str, choices: tuple[str, ...] | list[str]) -> tuple[str, ...]:
        if not isinstance(value, list) or not value:
            raise self.error(dotted, f"expected a non-empty list of strings, got {_show(value)}")
        for i, item in enumerate(value):
            self.str_(item, f"{dotted}.{i}", tuple(choices))
        return tuple(value)

    def train_value(self, value: Any, dotted: str, key: str) -> Any:
        """Type-checks one TrainConfig field against its annotation."""
        return self.typed(value, dotted, _TRAIN_FIELDS[key], key in _POSITIVE)

    def model_value(self, value: Any, dotted: str, key: str) -> Any:
        """Type-checks one DeepseekV3Config field against its annotation; null only where it allows None."""
        if value is None and key in _MODEL_NULLABLE:
            return None
        return self.typed(value, dotted, _MODEL_FIELDS[key], key in _MODEL_POSITIVE)

    def typed(self, value: Any, dotted: str, expected: type, positive: bool) -> Any:
        """``value`` as a bool, int (>= 1 if ``positive``, else >= 0), finite float (> 0 if ``positive``) or string."""
        if expected is bool:
            if not isinstance(value, bool):
                raise self.error(dotted, f"expected true or false, got {_show(value)}")
            return value
        if expected is int:
            return self.int_(value, dotted, lo=1 if positive else 0)
        if expected is float:
            number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            if not number or (positive and value <= 0):
                raise self.error(
                    dotted, f"expected a {'number > 0' if positive else 'finite number'}, got {_show(value)}"
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
        model = self.model(raw.get("model", {}), path)
        base = self.train_table(raw.get("train", {}), "train", allowed=tuple(_TRAIN_FIELDS))
        arms_raw = raw["arms"]
        if not isinstance(arms_raw, dict) or not arms_raw:
            raise self.error("arms", f"expected at least one [arms.NAME] table, got {_show(arms_raw)}")
        arms = {
            self.name(arm, f"arms.{arm}"): self.arm(arm, table, base, model, ranks, steps, raw.get("model", {}), path)
            for arm, table in arms_raw.items()
        }
        throughput = self.throughput(raw["throughput"], arms) if "throughput" in raw else None
        checks_raw = raw.get("checks", [])
        if not isinstance(checks_raw, list) or (not checks_raw and throughput is None):
            # A suite that checks nothing would pass whatever its arms did; a throughput run has its gate.
            raise self.error("checks", f"expected at least one [[checks]] table, got {_show(checks_raw)}")
        checks = tuple(self.check(c, f"checks.{i}", arms) for i, c in enumerate(checks_raw))
        names = [c.name for c in checks]
        for i, c in enumerate(checks):
            if names.count(c.name) > 1:
                raise self.error(f"checks.{i}.name", f"duplicate check name {_show(c.name)}")
        golden_tier, golden_metrics, cross_env = self.golden(raw.get("golden", {}))
        debug = self.debug(raw.get("debug", {}), arms, steps)
        expect, expected_failures = self.expectation(raw, throughput)
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
        )

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
            raise self.error("expected_failures", f"expected a non-empty list of check names, got {_show(names)}")
        return expect, tuple(names)

    def throughput(self, raw: Any, arms: dict[str, ArmSpec]) -> ThroughputSpec:
        """[throughput]: arms ``a`` and ``b`` (the same arm measures it against a copy of itself),
        ABBA ``blocks`` (>= 2: an interval needs two), timed ``steps`` per block position,
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
                    f"throughput.{key}", f"arm {_show(values[key])} trains in lockstep with an oracle: not timed"
                )
        for key, lo in (("blocks", 2), ("steps", 1), ("warmup", 0)):
            if key in table:
                values[key] = self.int_(table[key], f"throughput.{key}", lo)
        if "max_slowdown" in table:
            values["max_slowdown"] = self.typed(table["max_slowdown"], "throughput.max_slowdown", float, False)
        if "control" in table:
            values["control"] = self.typed(table["control"], "throughput.control", bool, False)
        spec = ThroughputSpec(**values)
        if spec.max_slowdown < 0:
            raise self.error("throughput.max_slowdown", f"expected a number >= 0, got {_show(spec.max_slowdown)}")
        return spec

    def name(self, value: Any, dotted: str) -> str:
        """Suite and arm names become directories: lowercase letters, digits, '-' and '_' only."""
        if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
            raise self.error(dotted, f"expected a name of lowercase letters, digits, '-' or '_', got {_show(value)}")
        return value

    def model(self, raw: Any, suite_file: Path) -> _Model:
        """[model]: ``config``, a named config or a Hugging Face config.json, then any DeepseekV3Config
        fields replacing its values. A field that makes the model invalid is named where it was set."""
        if not isinstance(raw, dict):
            raise self.error("model", f"expected a table, got {_show(raw)}")
        for key in raw:
            if key != "config" and key not in _MODEL_FIELDS:
                near = difflib.get_close_matches(key, _MODEL_FIELDS, n=1)
                hint = f"did you mean {near[0]}? " if near else ""
                raise self.error(f"model.{key}", f"unknown key ({hint}allowed: config and the DeepseekV3Config fields)")
        shown = self.str_(raw.get("config", TrainConfig.model), "model.config")
        where: dict[str, tuple[_Validator, str]] = {}  # field -> the validator of its file, its dotted key
        if shown in CONFIGS:
            name, values = shown, {}
        elif shown.endswith(".json") or "/" in shown:
            name, values = HF_BASE, self.hf_config(shown, suite_file, where)
        else:
            choices = ", ".join(CONFIGS)
            raise self.error(
                "model.config", f"expected one of {choices} or a path to a Hugging Face config.json, got {_show(shown)}"
            )
        for key, value in raw.items():
            if key != "config":
                values[key] = self.model_value(value, f"model.{key}", key)
                where[key] = (self, f"model.{key}")
        try:
            resolved = get_config(name, **values)
        except ValueError as e:
            # DeepseekV3Config's messages start with the field they reject.
            validator, dotted = where.get(str(e).split()[0], (self, "model.config"))
            raise validator.error(dotted, str(e)) from None
        overrides = {k: v for k, v in values.items() if getattr(CONFIGS[name], k) != v}
        return _Model(name, overrides, shown, resolved.n_routed_experts)

    def hf_config(self, shown: str, suite_file: Path, where: dict[str, tuple[_Validator, str]]) -> dict[str, Any]:
        """The fields a Hugging Face config.json sets, typed; errors name the JSON file and key.
        A relative path is relative to the suite file, or to the working directory from --set."""
        path = Path(shown)
        if not path.is_absolute() and "model.config" not in self.origins:
            path = suite_file.parent / path
        if not path.is_file():
            raise self.error("model.config", f"no such file {_show(str(path))}")
        hf_file = _Validator(display_path(path), self.device)
        try:
            hf = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise hf_file.error("", f"invalid JSON: {e}") from None
        if not isinstance(hf, dict):
            raise hf_file.error("", f"expected a JSON object, got {_show(hf)}")
        try:
            found = hf_config_fields(hf)
        except HFConfigError as e:
            raise hf_file.error(e.key, e.reason) from None
        values = {}
        for field, (key, value) in found.items():
            values[field] = hf_file.model_value(value, key, field)
            where[field] = (hf_file, key)
        return values

    def train_table(self, raw: Any, dotted: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        table = self.table(raw, dotted, allowed)
        return {k: self.train_value(v, f"{dotted}.{k}", k) for k, v in table.items() if k in _TRAIN_FIELDS}

    def arm(
        self,
        name: str,
        raw: Any,
        base: dict[str, Any],
        model: _Model,
        suite_ranks: int,
        steps: int,
        model_raw: dict,
        suite_file: Path,
    ) -> ArmSpec:
        """One [arms.NAME] table over [train]; its ``model``, a named config, replaces [model]'s
        ``config`` and keeps [model]'s field overrides."""
        dotted = f"arms.{name}"
        own = self.train_table(raw, dotted, allowed=("ranks", "model", "oracle", *_TRAIN_FIELDS))
        ranks = self.int_(raw["ranks"], f"{dotted}.ranks", 1, MAX_RANKS) if "ranks" in raw else suite_ranks
        if "model" in raw:
            named = self.str_(raw["model"], f"{dotted}.model", tuple(CONFIGS))
            model = self.model({**model_raw, "config": named}, suite_file)
        ranks_field = f"{dotted}.ranks" if "ranks" in raw else "ranks"
        merged = {
            "ep": suite_ranks,
            **base,
            **own,
            "model": model.name,
            "model_overrides": model.overrides,
            "device": self.device,
        }

        def source(key: str) -> str:
            """The field a merged value came from; ep falls back to the suite's ranks."""
            return (
                f"{dotted}.{key}"
                if key in own
                else f"train.{key}"
                if key in base
                else "ranks"
                if key == "ep"
                else dotted
            )

        if model.n_routed_experts % merged["ep"]:
            raise self.error(
                source("ep"),
                f"EP degree {merged['ep']} does not divide the {model.n_routed_experts} routed experts"
                f" of model {_show(model.shown)}",
            )
        if merged["ep"] % ranks:
            raise self.error(
                ranks_field, f"{ranks} processes do not divide EP degree {merged['ep']} of arm {_show(name)}"
            )
        try:
            config = train_config(merged)
        except (TypeError, ValueError) as e:
            # The reference's own validation; its messages start with the field they reject.
            first_word = str(e).split()[0] if str(e) else ""
            raise self.error(source(first_word) if first_word in _TRAIN_FIELDS else dotted, str(e)) from None
        if isinstance(config, PipelineConfig):
            self.pipeline(config, source, steps)
        oracle = self.oracle(raw["oracle"], f"{dotted}.oracle", config) if "oracle" in raw else None
        return ArmSpec(name, ranks, dataclasses.asdict(config), oracle)

    def oracle(self, value: Any, dotted: str, config: TrainConfig) -> str:
        """An oracle the arm's configuration has a counterpart in, and whose package is installed."""
        oracle = self.str_(value, dotted, oracles.ORACLES)
        problem = oracles.unsupported(config) or oracles.missing_dependency()
        if problem:
            raise self.error(dotted, problem)
        return oracle

    def pipeline(self, config: PipelineConfig, source: Callable[[str], str], steps: int) -> None:
        """What the reference accepts but can never run: it would only fail inside the ranks."""
        if config.delay > config.max_gradient_staleness:
            # The backward of every batch after the fill would be refused (CommitRefused): reject it here, exit 2.
            raise self.error(
                source("delay"), f"delay {config.delay} exceeds max_gradient_staleness {config.max_gradient_staleness}"
            )
        if config.apply_twice_batch is not None and not 1 <= config.apply_twice_batch <= steps:
            # Batches are numbered like steps; a batch that never runs would plant no bug at all.
            raise self.error(
                source("apply_twice_batch"), f"expected a batch id in 1-{steps}, got {config.apply_twice_batch}"
            )

    def arm_pair(self, raw: dict, dotted: str, arms: dict[str, ArmSpec]) -> tuple[str, str]:
        if "arms" not in raw:
            if len(arms) < 2:
                raise self.error(dotted, "needs two arms to compare, the suite has one")
            first, second = list(arms)[:2]
            return first, second
        pair = self.str_list(raw["arms"], f"{dotted}.arms", list(arms))
        if len(pair) != 2 or pair[0] == pair[1]:
            raise self.error(f"{dotted}.arms", f"expected two different arm names, got {_show(list(pair))}")
        return pair[0], pair[1]

    def check(self, raw: Any, dotted: str, arms: dict[str, ArmSpec]) -> CheckSpec:
        """A [[checks]] table, parsed by the family that owns its kind (harness/checks/)."""
        if not isinstance(raw, dict):
            raise self.error(dotted, f"expected a table, got {_show(raw)}")
        if "kind" not in raw:
            raise self.error(f"{dotted}.kind", f"missing (one of {', '.join(FAMILIES)})")
        kind = self.str_(raw["kind"], f"{dotted}.kind", tuple(FAMILIES))
        return FAMILIES[kind].parse(kind, raw, dotted, self, arms)

    def check_name(self, value: Any, dotted: str) -> str:
        """Check names label reports and plots: no markup, path or shell characters."""
        if not isinstance(value, str) or not CHECK_NAME_PATTERN.fullmatch(value):
            allowed = "letters, digits, spaces and _ . , : ( ) + -"
            raise self.error(
                dotted, f"expected a name of {allowed}, starting with a letter or digit, got {_show(value)}"
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
            raise self.error("golden", f"expected a table, got {_show(raw)}")
        for key in ("arms", "name"):
            if key in raw:
                raise self.error(
                    f"golden.{key}", "unknown key (allowed: kind, metrics, cross_env and the tier's fields)"
                )
        own = {k: v for k, v in raw.items() if k != "cross_env"}
        cross_env = raw.get("cross_env", CROSS_ENV_TIER)
        if not isinstance(cross_env, dict) or cross_env.get("kind") == "exact":
            raise self.error("golden.cross_env", f"expected a tier table that is not exact, got {_show(cross_env)}")
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
            raise self.error("debug.slow_fraction", f"expected a number >= 0, got {_show(slow_fraction)}")
        if slow_fraction and "slow_arm" not in table:
            raise self.error("debug.slow_arm", f"missing (the arm to slow down: {', '.join(arms)})")
        return DebugSpec(
            fail_step=self.int_(table["fail_step"], "debug.fail_step", 1, steps) if "fail_step" in table else None,
            fail_rank=self.int_(table.get("fail_rank", 0), "debug.fail_rank", 0, arms[arm].ranks - 1),
            fail_mode=self.str_(table.get("fail_mode", "raise"), "debug.fail_mode", FAIL_MODES),
            fail_arm=arm,
            slow_arm=self.str_(table["slow_arm"], "debug.slow_arm", tuple(arms)) if "slow_arm" in table else None,
            slow_fraction=slow_fraction,
        )
