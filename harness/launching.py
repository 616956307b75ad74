"""Launching a prepared run: its launch groups one after another under one deadline, with live
progress, until the first failure, a signal or the end (:func:`launch_run`).

The launcher of one group is given: the elastic agent here (launchers/local.py) or a Slurm job
(launchers/slurm/watch.py). Whatever happens, what was launched is returned, never raised: a
signal becomes ``Launched.cancelled``, an error of the harness itself ``Launched.internal_error``,
and the ranks' records stay on disk for the judge.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TextIO

from harness.cancel import Cancelled
from harness.launchers import GroupLauncher, LaunchContext, LaunchResult
from harness.phases import cache_notes, read_rank_phases
from harness.prepare import PreparedRun
from harness.progress import BlockProgress, Progress
from harness.subject import subject_of

log = logging.getLogger("harness")


@dataclass
class Launched:
    """What launching a run came to: each group's result in launch order, and how it ended early,
    if it did (a signal, or an error inside the harness, which leaves the outcome unknown)."""

    results: list[LaunchResult] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    cancelled: Cancelled | None = None
    internal_error: str | None = None

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


def launch_run(run: PreparedRun, launch: GroupLauncher, out: TextIO, err: TextIO) -> Launched:
    """Runs the groups of ``run`` with ``launch``; prints each group's error, then what the trace cache did."""
    launched = Launched()
    try:
        for result in _launch_groups(run, launch, out):
            launched.results.append(result)
            if result.error:
                print(f"error: {result.error}", file=err)
    except Cancelled as c:
        launched.cancelled = c
    except Exception as e:
        log.exception("internal error while launching the suite")
        launched.internal_error = f"internal error: {type(e).__name__}: {e}"
    for line in cache_notes({group.name: read_rank_phases(run.run_dir, group.name) for group in run.groups}):
        print(line, file=out)
        log.info(line)
    return launched


def _launch_groups(run: PreparedRun, launch: GroupLauncher, out: TextIO) -> Iterator[LaunchResult]:
    """Each group's result as it ends; the first failure ends the run."""
    suite, options = run.suite, run.options
    spec = suite.throughput
    if spec:
        roles = {"A": spec.a, "B": spec.b, **({"control": spec.a} if spec.control else {})}
        progress: Progress | BlockProgress = BlockProgress(run.run_dir, roles, spec.blocks, out, options.verbose)
    else:
        arms = [arm for group in run.groups for arm in group.arms]
        progress = Progress(run.run_dir, arms, suite.steps, out, options.verbose)
    deadline = time.monotonic() + options.timeout_s
    env = run.pin.env if run.pin else {}
    source = subject_of(suite).source
    context = LaunchContext(run.run_dir, deadline, options.timeout_s, env, progress.tick, source)
    try:
        for group in run.groups:
            with run.phases.phase("launch", group=group.name):
                result = launch(group, context)
            log.info("group %s: %s", group.name, result.headline or "ok")
            if not result.ok:
                progress.close()  # its last state stays above the error the caller prints
            yield result
            if not result.ok:
                return
    finally:
        progress.close()
