"""A rank's entry, ``python -m harness.rank RUN_DIR GROUP``: reads the run's manifest, loads the
suite's subject (a change's group: from its revision, revision.py), joins the group's process
group, runs the group's arms (train.py) or times its blocks (throughput.py), and leaves.

It leaves fast either way. A rank that is done exits without the interpreter's teardown of torch,
which would cost most of a second on every rank before the launcher sees the group end; a rank that
raises writes its error file (errors.py) and exits at once, so that it is the first of its group to
die and is named the root cause.

It starts fast too. What a rank imports (torch, its subject: some 300k objects) lives until it exits,
so no garbage collection runs while it loads, and what it loaded is frozen before it trains
(``gc.freeze``): no later collection walks it again. The imports take a sixth less time, and the
first optimizer's import of torch._dynamo a second less.
"""

# ruff: noqa: E402 (the collector is switched off before the imports)
from __future__ import annotations

import gc

gc.disable()

import contextlib
import functools
import os
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

# Before any process group exists, for every subject: imported later (torch.use_deterministic_algorithms
# does, through torch._inductor.config), it would pin the default group (docs/known-issues.md).
import torch.distributed.nn.functional  # noqa: F401
from torch.distributed.elastic.multiprocessing.errors import record

import harness
from harness.manifest import Manifest
from harness.phases import PhaseLog
from harness.plan import LaunchGroup
from harness.rank.errors import ErrorFileInRoom
from harness.rank.process import init_process_group, set_up_process
from harness.rank.revision import use_revision
from harness.rank.throughput import measure_throughput
from harness.rank.train import OpRecording, Segment, run_arm
from harness.records import JsonlWriter
from harness.rundir import phases_file
from harness.subject import subject_of


@functools.partial(record, error_handler=ErrorFileInRoom())
def main(argv: list[str]) -> None:
    """Runs launch group ``argv[1]`` of the run directory ``argv[0]`` as this rank (the launcher's
    RANK), then exits the process: it never returns."""
    run_dir, group_name = Path(argv[0]), argv[1]
    manifest = Manifest.read(run_dir)
    suite = manifest.spec()
    group = manifest.launch(group_name)
    if group.revision is not None:  # a side of a change: its subject package, not the installed one
        use_revision(manifest.revisions[group.revision])
    # The subject's modules are imports too, loaded before any process group exists.
    subject = subject_of(suite)
    gc.freeze()
    gc.enable()
    entered = time.time()  # the imports (phases.py) end here
    set_up_process()
    cache_dir = Path(manifest.trace_cache) if manifest.trace_cache else None
    device = manifest.device
    with JsonlWriter(phases_file(run_dir, group_name, int(os.environ["RANK"]))) as phase_file:
        phases = PhaseLog(phase_file.write)
        phases.add("imports", harness.IMPORTED_AT, entered)
        with phases.phase("rendezvous"):
            init_process_group(device, manifest.backend)
        print(f"rank {dist.get_rank()}/{dist.get_world_size()} of group {group_name}: pid {os.getpid()}", flush=True)
        if group.measurements:
            measure_throughput(run_dir, subject, suite, group.measurements, device, phases, cache_dir)
        else:
            segment = Segment(group.first_step, group.last_step, group.checkpoint)
            for arm in group.arms:
                spec = suite.arms[arm]
                ops = _op_recording(group, arm) if group.record_ops else None
                run_arm(run_dir, subject, spec, suite.steps, suite.debug, device, phases, cache_dir, segment, ops)
        with phases.phase("shutdown"):
            dist.destroy_process_group()
    # Every record is closed and the group is gone. A normal interpreter exit would now spend most
    # of a second tearing down torch and torch._dynamo module by module, on every rank, before the
    # launcher sees the group end: leave without it.
    sys.stdout.flush()
    os._exit(0)


def _op_recording(group: LaunchGroup, arm: str) -> OpRecording:
    """What an op-recording re-run's group asks of ``arm`` in this rank (``LaunchGroup.capture_ops``)."""
    rank = dist.get_rank()
    return OpRecording(next((i for name, r, i in group.capture_ops if (name, r) == (arm, rank)), None))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Exception:
        # @record has written the error file. Die now, not after most of a second of interpreter
        # teardown: the rank that raised must be the first to go, or a peer that loses its
        # connection meanwhile dies first and is blamed as the root cause. Even if the log, on a
        # full disk, cannot take the traceback.
        with contextlib.suppress(OSError):
            traceback.print_exc()
            sys.stderr.flush()
        os._exit(1)
