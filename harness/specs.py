"""The validated form of a suite: what ``harness/suites.py`` makes of a TOML file, what
``manifest.json`` records, and what every rank and every check reads.

Kept apart from the parser so that check families (``harness/checks/``) and the workers can use
the specs without importing the validator, which itself dispatches to the check families.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.reference.pec import PECConfig
from harness.reference.pipeline import PipelineConfig
from harness.reference.train import TrainConfig


def _own_fields(config: type[TrainConfig]) -> tuple[str, ...]:
    """The fields a TrainConfig subclass adds."""
    return tuple(
        f.name for f in dataclasses.fields(config) if f.name not in {g.name for g in dataclasses.fields(TrainConfig)}
    )


# Setting any of these makes an arm versioned.
PIPELINE_FIELDS = _own_fields(PipelineConfig)
# Setting any of these makes the arm's token embedding a PEC table (harness.reference.pec).
PEC_FIELDS = _own_fields(PECConfig)


def is_versioned(train: dict[str, Any]) -> bool:
    """An arm that sets any pipeline field runs on a delayed trainer (PipelineConfig.trainer); the rest on Trainer."""
    return any(key in train for key in PIPELINE_FIELDS)


def is_pec(train: dict[str, Any]) -> bool:
    """An arm that sets any PEC field runs on PECTrainer."""
    return any(key in train for key in PEC_FIELDS)


def train_config(train: dict[str, Any]) -> TrainConfig:
    """An arm's fields as the reference's config: a PipelineConfig for a versioned arm, a PECConfig for a PEC arm."""
    if is_versioned(train) and is_pec(train):
        raise ValueError(f"a PEC arm ({', '.join(PEC_FIELDS)}) has no delayed pipeline ({', '.join(PIPELINE_FIELDS)})")
    if is_versioned(train):
        return PipelineConfig(**train)
    return PECConfig(**train) if is_pec(train) else TrainConfig(**train)


@dataclass(frozen=True)
class ArmSpec:
    """One arm: the full TrainConfig keyword set and how many processes host its EP group."""

    name: str
    ranks: int
    train: dict[str, Any]
    oracle: str | None = None  # an implementation trained in lockstep with it (harness.oracles)

    @property
    def ep(self) -> int:
        return self.train["ep"]

    @property
    def versioned(self) -> bool:
        return is_versioned(self.train)

    def non_defaults(self) -> dict[str, Any]:
        """The fields this arm sets away from the defaults of its config class (what a golden's
        config records), and a versioned arm's ``trainer`` or a PEC arm's ``pec``, so that a field
        added later with a default that keeps the old behaviour leaves older goldens valid."""
        config_class = type(train_config(self.train))
        defaults = dataclasses.asdict(config_class())
        differing = {k: v for k, v in self.train.items() if k not in defaults or defaults[k] != v}
        if self.versioned:
            return {"trainer": self.train["trainer"], **differing}
        return {"pec": self.train["pec"], **differing} if is_pec(self.train) else differing


@dataclass(frozen=True)
class CheckSpec:
    """One [[checks]] entry; ``tier`` is the comparison tier's spec for metric comparisons and
    ``options`` holds the fields only the check's family reads (see harness/checks/)."""

    kind: str
    name: str
    arms: tuple[str, ...]
    metrics: tuple[str, ...] = ()
    tier: dict[str, Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DebugSpec:
    """Fault injection for the harness's own tests. ``fail_*``: a rank fails (off unless
    ``fail_step`` is set). ``slow_*``: in a throughput measurement every step of ``slow_arm``
    sleeps ``slow_fraction`` of its own duration after it (a planted slowdown of that fraction)."""

    fail_step: int | None = None
    fail_rank: int = 0
    fail_mode: str = "raise"
    fail_arm: str | None = None
    slow_arm: str | None = None
    slow_fraction: float = 0.0


@dataclass(frozen=True)
class ThroughputSpec:
    """A vs B step time in ABBA blocks (harness/throughput.py): the suite's [throughput] table, or
    ``harness abba``'s flags. B may be A itself: it is then a second, separately built copy."""

    a: str
    b: str
    blocks: int = 4
    steps: int = 5  # timed steps per block position
    warmup: int = 2  # untimed steps per arm copy, after its build
    max_slowdown: float = 0.05  # the gate: B/A step time must stay at or under 1 + this
    control: bool = False  # also measure A against a second copy of A: the noise floor


@dataclass(frozen=True)
class SuiteSpec:
    """A validated suite: its arms, its checks and how goldens are checked; what manifest.json records."""

    name: str
    description: str
    path: Path
    ranks: int
    steps: int
    arms: dict[str, ArmSpec]
    checks: tuple[CheckSpec, ...]
    golden_tier: dict[str, Any]
    golden_metrics: tuple[str, ...]
    golden_cross_env: dict[str, Any]
    debug: DebugSpec
    throughput: ThroughputSpec | None = None  # set: a throughput run, judged by its ABBA gate
    expect: str = "pass"  # "fail": a negative suite, which passes when exactly ``expected_failures`` fail
    expected_failures: tuple[str, ...] = ()  # the check results (by name) a negative suite must fail

    def to_dict(self) -> dict[str, Any]:
        """The resolved suite as manifest.json records it (and the workers read it)."""
        return {
            "name": self.name,
            "description": self.description,
            "path": str(self.path),
            "ranks": self.ranks,
            "steps": self.steps,
            "arms": {a.name: {"ranks": a.ranks, "train": a.train, "oracle": a.oracle} for a in self.arms.values()},
            "checks": [dataclasses.asdict(c) for c in self.checks],
            "golden": {
                "tier": self.golden_tier,
                "metrics": list(self.golden_metrics),
                "cross_env": self.golden_cross_env,
            },
            "debug": dataclasses.asdict(self.debug),
            "throughput": dataclasses.asdict(self.throughput) if self.throughput else None,
            "expect": self.expect,
            "expected_failures": list(self.expected_failures),
        }
