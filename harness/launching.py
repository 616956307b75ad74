"""Launching a prepared run: its launch groups one after another under one deadline, with live
progress, until the first failure, a signal or the end (:func:`launch_run`).

The launcher of one group is given: the elastic agent here (launchers/local.py) or a Slurm job
(launchers/slurm/watch.py). Whatever happens, what was launched is returned, never raised: a
signal becomes ``Launched.cancelled``, an error of the harness itself ``Launched.internal_error``,
and the ranks' records stay on disk for the judge.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TextIO

from harness.base_cache import keep_base
from harness.cancel import Cancelled
from harness.launchers import GroupLauncher, LaunchContext, LaunchResult
from harness.phases import cache_notes, read_rank_phases
from harness.plan import expected_raise
from harness.prepare import PreparedRun
from harness.results import REGRESSION

log = logging.getLogger("harness")


@dataclass
class Launched:
    """What launching a run came to: each group's result in launch order, and how it ended early,
    if it did (a signal, or an error inside the harness, which leaves the outcome unknown)."""

    results: list[LaunchResult] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    cancelled: Cancelled | None = None
    internal_error: str | None = None
    rank_phases: dict[str, dict[int, list[dict]]] = field(default_factory=dict)  # group -> rank -> its phases

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def ended_well(self) -> bool:
        """Neither a signal nor an error of the harness cut it short."""
        return self.cancelled is None and self.internal_error is None


def launch_run(run: PreparedRun, launch: GroupLauncher, out: TextIO, err: TextIO) -> Launched:
    """Runs the groups of ``run`` with ``launch`` until the first failure; prints its error once the
    live progress is closed, then what the trace cache did where it went wrong."""
    launched, options, kind = Launched(), run.options, run.kind
    raising = {group.name for group in run.groups if expected_raise(group, run.suite.arms) is not None}
    raised: set[str] = set()  # groups whose arm raised from the system under test, as expected: their check says so
    try:
        with contextlib.closing(kind.progress(run.run_dir, run.groups, out, options.verbose)) as progress:
            deadline = time.monotonic() + options.timeout_s
            context = LaunchContext(
                run.run_dir, deadline, options.timeout_s, run.env, progress.tick, run.subject_source
            )
            for group in run.groups:
                with run.phases.phase("launch", group=group.name):
                    result = launch(group, context)
                log.info("group %s: %s", group.name, result.headline or "ok")
                launched.results.append(result)
                # An arm expected to raise that did, from the system under test: its check says so, the others go on.
                raised_as_expected = group.name in raising and result.verdict and result.verdict.kind == REGRESSION
                if raised_as_expected:
                    raised.add(group.name)
                if (not result.ok and not raised_as_expected) or kind.measured_enough(run.run_dir, group):
                    break
    except Cancelled as c:
        launched.cancelled = c
    except Exception as e:
        log.exception("internal error while launching the suite")
        launched.internal_error = f"internal error: {type(e).__name__}: {e}"
    for result in launched.results:
        if result.error and result.group.name not in raised:
            print(f"error: {result.error}", file=err)
    launched.rank_phases = {group.name: read_rank_phases(run.run_dir, group.name) for group in run.groups}
    ran_all = len(launched.results) == len(run.groups) and all(r.ok for r in launched.results)
    kept = keep_base(run.base, run.run_dir, ran_all and launched.ended_well) if run.base else None
    for line in [*cache_notes(launched.rank_phases), *filter(None, [kept])]:
        print(line, file=out)
        log.info(line)
    return launched
