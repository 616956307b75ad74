"""The validated form of a suite: what ``harness/suites.py`` makes of a TOML file, what
``manifest.json`` records, and what every rank and every check reads.

Kept apart from the parser so that check families (``harness/checks/``) and the ranks can use
the specs without importing the validator, which itself dispatches to the check families.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.families import ArmFacts


@dataclass(frozen=True)
class ArmSpec:
    """One arm, as its subject parsed it (harness/subject/protocol.py): ``ranks`` processes host its
    ``logical_ranks`` logical ranks (the reference's EP degree); ``train`` is its config as plain
    JSON, what the ranks build it from; ``families`` the record families it emits; ``golden_config``
    what a golden is recorded for (its fields set away from their defaults); ``dtype`` goes into the
    environment key of its goldens; ``oracle`` names an implementation it trains in lockstep with.
    ``resume_at`` k: the arm trains steps 1..k, saves a checkpoint and ends its processes; a fresh
    launch of ``resume_ranks`` processes (default ``ranks``) loads it and trains k+1 onwards. ``facts``
    are what the checks know of it beyond its records (the checks read them, never ``train``).
    ``revision``: in a change check (harness/change.py), the side of the change whose code the arm
    runs, ``base`` or ``head`` (its ranks import the subject's package from there); None: the
    installed code. ``expect_raise``: the system under test is known to raise in this arm, with this
    text in the exception's line; the arm runs in a launch of its own, so that it takes no other arm
    down, and the raise is an expected failure until a release stops raising it (judge.py)."""

    name: str
    ranks: int
    train: dict[str, Any]
    logical_ranks: int
    families: tuple[str, ...]
    seed: int
    golden_config: dict[str, Any]
    dtype: str = "float32"
    oracle: str | None = None
    resume_at: int | None = None
    resume_ranks: int | None = None
    facts: ArmFacts = ArmFacts()
    revision: str | None = None
    expect_raise: str | None = None

    def emits(self, family: str) -> bool:
        return family in self.families

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"families": list(self.families), "facts": self.facts.to_json()}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ArmSpec:
        """An arm as manifest.json records it, for the ranks."""
        return cls(**{**raw, "families": tuple(raw["families"]), "facts": ArmFacts.from_json(raw.get("facts", {}))})


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
    sleeps ``slow_fraction`` of its own duration after it (a planted slowdown of that fraction).
    ``checkpoint_damage``: every resumed arm's checkpoint is damaged between its two launches
    (a shard missing or truncated, a garbage index, or a manifest of another config; harness/rank/faults.py)."""

    fail_step: int | None = None
    fail_rank: int = 0
    fail_mode: str = "raise"
    fail_arm: str | None = None
    slow_arm: str | None = None
    slow_fraction: float = 0.0
    checkpoint_damage: str | None = None


@dataclass(frozen=True)
class ThroughputSpec:
    """A vs B step time in ABBA blocks (harness/throughput.py): the suite's [throughput] table, or
    ``harness abba``'s flags. B may be A itself: it is then a second, separately built copy."""

    a: str
    b: str
    # "auto": blocks until the gate's interval clears its threshold, at most ``max_blocks`` and
    # ``budget_s`` seconds of measuring (harness/throughput.py); a number: exactly that many.
    blocks: int | str = "auto"
    max_blocks: int = 100
    budget_s: float = 300.0
    steps: int = 5  # timed steps per block position
    warmup: int = 2  # untimed steps per arm copy, after its build
    max_slowdown: float = 0.05  # the gate: B/A step time must stay at or under 1 + this
    control: bool = False  # also measure A against a second copy of A: the noise floor

    @property
    def adaptive(self) -> bool:
        return self.blocks == "auto"

    @property
    def planned_blocks(self) -> int:
        """The most blocks the run may measure."""
        return self.max_blocks if self.adaptive else int(self.blocks)


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
    subject: str = "reference"  # the system under test (harness/subject/)
    # The [change] table: the tier at which each arm at head must match itself at base (harness/change.py).
    change_tier: dict[str, Any] = field(default_factory=lambda: {"kind": "exact"})

    @property
    def dtype(self) -> str:
        """The arms' dtypes, joined: what the environment key of the suite's goldens carries."""
        return "+".join(sorted({arm.dtype for arm in self.arms.values()}))

    def to_dict(self) -> dict[str, Any]:
        """The resolved suite as manifest.json records it (and the ranks read it)."""
        return {
            "name": self.name,
            "description": self.description,
            "path": str(self.path),
            "ranks": self.ranks,
            "steps": self.steps,
            "subject": self.subject,
            "arms": {a.name: a.to_dict() for a in self.arms.values()},
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
            "change_tier": self.change_tier,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SuiteSpec:
        """The suite as :meth:`to_dict` wrote it (manifest.json), typed again: in a rank, or in
        ``harness collect``."""
        golden, throughput = raw["golden"], raw["throughput"]
        checks = tuple(
            CheckSpec(**{**c, "arms": tuple(c["arms"]), "metrics": tuple(c["metrics"])}) for c in raw["checks"]
        )
        return cls(
            name=raw["name"],
            description=raw["description"],
            path=Path(raw["path"]),
            ranks=raw["ranks"],
            steps=raw["steps"],
            arms={name: ArmSpec.from_dict(arm) for name, arm in raw["arms"].items()},
            checks=checks,
            golden_tier=golden["tier"],
            golden_metrics=tuple(golden["metrics"]),
            golden_cross_env=golden["cross_env"],
            debug=DebugSpec(**raw["debug"]),
            throughput=ThroughputSpec(**throughput) if throughput else None,
            expect=raw["expect"],
            expected_failures=tuple(raw["expected_failures"]),
            subject=raw["subject"],
            change_tier=raw["change_tier"],
        )
