"""A run's launch plan: which launch groups run its arms, in which order (:func:`plan_launches`).

A suite's arms are grouped by process count (:func:`plan_launches`); a resumed arm's two launches,
saving then loading, are groups of their own. A throughput run instead times its two arms in ABBA
blocks (harness/throughput.py says how it stops, harness/abba.py why that order), each block
position a :class:`Measurement` (:func:`plan_throughput_launches`). The plan is made before
anything launches, written into manifest.json as data, and read back typed by every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from harness.abba import BLOCK
from harness.rundir import LOGS_DIR
from harness.specs import ArmSpec, SuiteSpec, ThroughputSpec

SERIES = ("main", "control")


@dataclass(frozen=True)
class Measurement:
    """One block position: ``copy`` names the trainer it times (``A``, ``B``, or ``A2``, the
    control's second copy of A), ``role`` its place in the block's A B B A."""

    series: str
    block: int
    position: int
    role: str
    copy: str
    arm: str


@dataclass(frozen=True)
class LaunchGroup:
    """Arms sharing a process count: they run in one launch, one after another. A throughput
    run's group instead times the block positions in ``measurements``.
    A resumed arm's two launches are groups apart from the straight arms' (shared with resumed arms
    that stop and resume alike): ``first_step`` to ``last_step`` (None: the suite's last), the
    first ending with a save (``checkpoint = "save"``), the second starting with a load (``"load"``).
    An op-recording re-run's groups (harness/first_op.py) set ``record_ops``: every rank records its
    ops, and keeps the outputs of the op ``capture_ops`` names for it, as (arm, process rank, op index).
    ``revision``: the side of a change its arms run (harness/change.py), whose package its ranks import."""

    name: str
    ranks: int
    arms: tuple[str, ...]
    log_dir: str  # relative to the run directory
    measurements: tuple[Measurement, ...] = ()
    first_step: int = 1
    last_step: int | None = None
    checkpoint: str | None = None
    record_ops: bool = False
    capture_ops: tuple[tuple[str, int, int], ...] = ()
    revision: str | None = None

    def log(self, rank: int) -> str:
        return f"{self.log_dir}/rank{rank}.log"

    def error_file(self, rank: int) -> str:
        """Where the rank writes its traceback (TORCHELASTIC_ERROR_FILE), relative to the run directory."""
        return f"{self.log_dir}/rank{rank}.error.json"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LaunchGroup:
        """A group as manifest.json holds it (``dataclasses.asdict``), typed again; TypeError for a
        field it does not know."""
        return cls(
            **{
                **raw,
                "arms": tuple(raw["arms"]),
                "measurements": tuple(Measurement(**m) for m in raw.get("measurements", ())),
                "capture_ops": tuple(tuple(op) for op in raw.get("capture_ops", ())),
            }
        )


def plan_launches(suite: SuiteSpec) -> list[LaunchGroup]:
    """Groups arms by process count, keeping the suite's arm order; then the resumed arms' saving
    launches, then their loading ones. Resumed arms that save on the same process count after the
    same step share their saving launch, and so for loading: their arms run in turn in it, as in
    any group, and a launch's start-up (seconds) is paid once. Arms of a change's two revisions
    never share a launch: a process imports one revision of the subject. An arm expected to raise
    (``ArmSpec.expect_raise``) has a launch of its own: its raise must take no other arm down."""
    by_ranks: dict[tuple[str | None, int, str | None], list[str]] = {}
    saving: dict[tuple[str | None, int, int], list[str]] = {}
    loading: dict[tuple[str | None, int, int], list[str]] = {}
    for arm in suite.arms.values():
        if arm.resume_at is None:
            alone = arm.name if arm.expect_raise else None
            by_ranks.setdefault((arm.revision, arm.ranks, alone), []).append(arm.name)
        else:
            saving.setdefault((arm.revision, arm.ranks, arm.resume_at), []).append(arm.name)
            loading.setdefault((arm.revision, arm.resume_ranks or arm.ranks, arm.resume_at), []).append(arm.name)
    single = len(by_ranks) == 1 and not saving
    groups = [
        LaunchGroup(
            joined(arms), ranks, tuple(arms), LOGS_DIR if single else f"{LOGS_DIR}/{joined(arms)}", revision=rev
        )
        for (rev, ranks, _), arms in by_ranks.items()
    ]
    for (rev, ranks, at), arms in saving.items():
        name = f"{joined(arms)}@1-{at}"
        groups.append(
            LaunchGroup(name, ranks, tuple(arms), f"{LOGS_DIR}/{name}", last_step=at, checkpoint="save", revision=rev)
        )
    for (rev, ranks, at), arms in loading.items():
        name = f"{joined(arms)}@{at + 1}-"
        groups.append(
            LaunchGroup(
                name, ranks, tuple(arms), f"{LOGS_DIR}/{name}", first_step=at + 1, checkpoint="load", revision=rev
            )
        )
    return groups


def joined(arms: list[str]) -> str:
    """A launch group's name, its folder's under logs/: its arms joined by "+", or where that would not
    fit a folder's name (255 bytes, a suffix such as "@1-4" beside it) the first and how many more; an
    arm is in one group of a kind, so the name is still the group's own."""
    name = "+".join(arms)
    return name if len(name.encode()) <= 200 else f"{arms[0]}+{len(arms) - 1}-more"


def expected_raise(group: LaunchGroup, arms: Mapping[str, ArmSpec]) -> str | None:
    """The text an arm expected to raise must raise with, when ``group`` is that arm's launch."""
    return arms[group.arms[0]].expect_raise if len(group.arms) == 1 else None


def plan_measurements(spec: ThroughputSpec) -> list[Measurement]:
    """Every block position in the order it runs: block k of the main series, then (with
    ``control``) block k of A against its copy, so both series see the same drift."""
    copies = {"main": {"A": ("A", spec.a), "B": ("B", spec.b)}, "control": {"A": ("A", spec.a), "B": ("A2", spec.a)}}
    plan = []
    for block in range(1, spec.planned_blocks + 1):
        for series in SERIES if spec.control else ("main",):
            for position, role in enumerate(BLOCK):
                copy, arm = copies[series][role]
                plan.append(Measurement(series, block, position, role, copy, arm))
    return plan


def plan_throughput_launches(suite: SuiteSpec) -> list[LaunchGroup]:
    """One launch holding every measurement when A and B have one process count and one revision;
    else a launch per run of consecutive positions of one arm: A | B B | A A | B B | ... A, the
    block's two B positions in one launch, and its last A with the next block's first. Each arm is
    so timed as often first as second in its launch, and a launch's start-up (seconds) is paid about
    twice a block rather than four times."""
    spec = suite.throughput
    plan = plan_measurements(spec)
    a, b = suite.arms[spec.a], suite.arms[spec.b]
    ranks = {a.ranks, b.ranks}
    if len(ranks) == 1 and a.revision == b.revision:
        arms = tuple(dict.fromkeys((spec.a, spec.b)))
        return [LaunchGroup("+".join(arms), ranks.pop(), arms, LOGS_DIR, tuple(plan), revision=a.revision)]
    runs: list[list[Measurement]] = []
    for m in plan:
        if runs and runs[-1][-1].arm == m.arm:
            runs[-1].append(m)
        else:
            runs.append([m])
    groups = []
    for run in runs:
        first, arm = run[0], suite.arms[run[0].arm]
        name = f"{first.series}-b{first.block}p{first.position}-{first.arm}"
        groups.append(
            LaunchGroup(name, arm.ranks, (first.arm,), f"{LOGS_DIR}/{name}", tuple(run), revision=arm.revision)
        )
    return groups
