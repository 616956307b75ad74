"""Where the time to a verdict goes: each process's phases, and the run's timeline built from them.

Every rank process records its phases (imports, rendezvous, and per arm build, steps and finish,
then shutdown) to ``phases/<group>.rank<k>.jsonl``, one line per finished phase with wall-clock
``start`` and ``end``, so a crash keeps the phases before it. The harness process keeps its own
(imports, prepare, one launch per group, judge, first-op where a re-run located an op, report) in
``summary.json``.

:func:`timeline` cuts the run's wall time into consecutive segments. Ranks run their phases in
step (they meet at every collective), so a rank phase's segment ends when the *last* rank ends
it: the segments are the run's critical path, and they add up to its wall time exactly.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from harness.rundir import PHASES_DIR

USUAL_CACHE_STATUSES = frozenset({"hit", "miss", "off"})  # a trace cache entry's status that needs no word


class PhaseLog:
    """A process's phases, in order; each is handed to ``sink`` (a rank's JSONL writer) as it ends."""

    def __init__(self, sink: Callable[[dict], None] | None = None) -> None:
        self.phases: list[dict] = []
        self._sink = sink

    def add(self, phase: str, start: float, end: float, **labels: object) -> None:
        """A phase that has ended; ``labels`` (group, arm, detail) travel with it."""
        record = {"phase": phase, **labels, "start": start, "end": end}
        self.phases.append(record)
        if self._sink is not None:
            self._sink(record)

    @contextlib.contextmanager
    def phase(self, phase: str, **labels: object) -> Iterator[dict]:
        """Times the block; the caller may fill the yielded dict (it becomes ``detail``). A block
        that raises is still recorded, with ``"failed": True``."""
        detail: dict = {}
        start = time.time()
        try:
            yield detail
        except BaseException:
            detail["failed"] = True
            raise
        finally:
            self.add(phase, start, time.time(), **labels, **({"detail": detail} if detail else {}))


def read_rank_phases(run_dir: Path, group: str) -> dict[int, list[dict]]:
    """Every rank's recorded phases of one launch group; a line cut short by a crash is dropped."""
    phases = {}
    for path in sorted((Path(run_dir) / PHASES_DIR).glob(f"{group}.rank*.jsonl")):  # rundir.phases_file
        rank = int(path.stem.rsplit(".rank", 1)[1])
        lines = []
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                lines.append(json.loads(line))
        phases[rank] = lines
    return phases


def timeline(harness: list[dict], ranks: dict[str, dict[int, list[dict]]]) -> list[dict]:
    """Consecutive segments from the harness's first phase to its last, each ``{segment, group, arm,
    seconds, detail}``. Inside a launch: ``start processes`` (the launcher, until the last rank
    is running), then each rank phase until the last rank ends it, then ``exit`` (until the launch
    returns)."""
    segments: list[dict] = []
    if not harness:
        return segments
    cursor = harness[0]["start"]

    def cut(segment: str, end: float, group: str | None = None, arm: str | None = None, detail: str = "") -> None:
        nonlocal cursor
        seconds = max(0.0, end - cursor)
        segments.append({"segment": segment, "group": group, "arm": arm, "seconds": seconds, "detail": detail})
        cursor = max(cursor, end)

    for phase in harness:
        if phase["phase"] != "launch":
            cut(phase["phase"], phase["end"])
            continue
        group = phase["group"]
        per_rank = ranks.get(group, {})
        if any(per_rank.values()):  # ranks on a full disk may have recorded nothing
            cut("start processes", max(p[0]["start"] for p in per_rank.values() if p), group)
        for (name, arm), recorded in _aligned(per_rank):
            cut(name, max(r["end"] for r in recorded), group, arm, _graph_detail(recorded))
        cut("exit", phase["end"], group)
    return segments


def _aligned(per_rank: dict[int, list[dict]]) -> list[tuple[tuple[str, str | None], list[dict]]]:
    """Each (phase, arm) in the order the ranks ran them, with every rank's record of it."""
    order: dict[tuple[str, str | None], list[dict]] = {}
    for records in per_rank.values():
        for record in records:
            order.setdefault((record["phase"], record.get("arm")), []).append(record)
    return sorted(order.items(), key=lambda item: min(r["start"] for r in item[1]))


def _graph_detail(recorded: list[dict]) -> str:
    """How a traced arm's graph was built across the ranks: "cache hit on 2 ranks", "trace, cache miss on 2 ranks"."""
    builds = Counter(
        f"{g['origin']}, cache {g['cache']}" if g["origin"] == "trace" else f"cache {g['cache']}"
        for g in _graph_builds(recorded)
    )
    return "; ".join(f"{how} on {n} rank{'s' * (n > 1)}" for how, n in builds.items())


def cache_notes(ranks: dict[str, dict[int, list[dict]]]) -> list[str]:
    """One line for each way the ranks' trace cache entries went wrong (refused, unreadable, unwritable:
    the status says why), naming the entries: a run that passes all the same must not keep it quiet."""
    entries: dict[str, set[str]] = {}
    for per_rank in ranks.values():
        for recorded in per_rank.values():
            for build in _graph_builds(recorded):
                if build["cache"] not in USUAL_CACHE_STATUSES:
                    entries.setdefault(build["cache"], set()).add(build["entry"])
    return [
        f"trace cache {'entry' if len(paths) == 1 else 'entries'} {', '.join(sorted(paths))}: {status}; traced instead"
        for status, paths in entries.items()
    ]


def _graph_builds(recorded: list[dict]) -> Iterator[dict]:
    """The graph builds (GraphStep.build) among phase records: a traced arm's build phase carries one."""
    return (g for r in recorded if (g := (r.get("detail") or {}).get("graph")))
