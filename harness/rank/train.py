"""One arm in a rank: built by the suite's subject from a fresh seed, trained, and recorded.

Process rank 0 writes ``metrics.jsonl`` (one :class:`~harness.subject.protocol.StepRecord` a line),
``arm.json`` (the arm's config, its facts as declared and as the built arm adds them, the CPU kernel
ISA) and ``graph.json`` (a traced arm's exchange ops); the rest of its records go through the rank's
Recorder (recorder.py). After the arm's last update each process writes its logical ranks'
``weights.rank<k>.json``: a hash of each parameter (:func:`harness.digests.final_weights`), so final
weights compare bit for bit.

A resumed arm runs in two launches (:class:`Segment`): the first ends with a checkpoint, the second
loads it and appends to the records of the first. An op-recording re-run's group
(``LaunchGroup.record_ops``, harness/first_op.py) runs its arms with every op of their steps recorded
on the rank's main thread, which sees them all with one logical rank per process, and writes
``ops.rank<k>.jsonl`` (and a capture pass's ``captured.rank<k>.npz``) per arm instead of the
Recorder's files.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from harness.digests import final_weights
from harness.files import write_json_atomic
from harness.phases import PhaseLog
from harness.rank.faults import damage_checkpoint, inject_fault
from harness.rank.recorder import ArmWriters, FileRecorder
from harness.records import JsonlWriter, read_jsonl
from harness.rundir import ArmFiles, arm_files
from harness.seam import ReceivedRecords
from harness.specs import ArmSpec, DebugSpec
from harness.subject import Subject
from harness.subject.protocol import (
    CHECKPOINT,
    FINAL_WEIGHTS,
    GRAPH,
    Arm,
    ArmContext,
    OpsNotRecordable,
    StepRecord,
)
from harness.trust import make_private_folders

if TYPE_CHECKING:
    from harness.op_divergence import OpRecorder


@dataclass(frozen=True)
class Segment:
    """The steps one launch of an arm runs (its launch group's ``first_step``..``last_step``; None:
    the suite's last) and its checkpoint: ``"save"`` after them, ``"load"`` before."""

    first_step: int = 1
    last_step: int | None = None
    checkpoint: str | None = None


@dataclass(frozen=True)
class OpRecording:
    """An op-recording re-run's request to one arm in this rank (``LaunchGroup.record_ops``): every
    op of its steps recorded, and the outputs of the op with index ``capture`` kept, if set."""

    capture: int | None = None


def updates(arm: Arm, steps: range, before_step: Callable[[int], bool], drain: bool = True) -> Iterator[StepRecord]:
    """The arm's updates of ``steps``, then (``drain``) those a pipeline still had in flight; ends
    early, and undrained, where ``before_step`` returns False."""
    for step in steps:
        if not before_step(step):
            return
        record = arm.step(step)  # None while a pipeline fills
        if record is not None:
            yield record
    if drain:
        yield from arm.drain()


def seeded(spec: ArmSpec) -> None:
    """Every arm starts from the same RNG state, whatever ran before it in this process."""
    random.seed(spec.seed)
    torch.manual_seed(spec.seed)


def received_records(spec: ArmSpec, steps: int, first: int = 1) -> ReceivedRecords:
    """The checks of what the arm hands this rank (harness/seam.py): process p of P hosts logical
    ranks [p*L/P, (p+1)*L/P) of L; ``first``: the step its next StepRecord must carry."""
    rank, per = dist.get_rank(), spec.logical_ranks // dist.get_world_size()
    return ReceivedRecords(spec.name, rank, range(rank * per, (rank + 1) * per), steps, first, spec.families)


def run_arm(
    run_dir: Path,
    subject: Subject,
    spec: ArmSpec,
    steps: int,
    debug: DebugSpec,
    device: str,
    phases: PhaseLog,
    cache_dir: Path | None = None,
    segment: Segment | None = None,
    ops: OpRecording | None = None,
) -> None:
    """Builds the arm from a fresh seed and runs its steps, streaming records; its build, steps and
    finish are three phases. A ``segment`` runs part of the steps: the first of a resumed arm ends
    with a save, the second starts with a load and appends to the records of the first. With
    ``ops`` every op of the steps is recorded, and the arm records nothing through a Recorder but
    its metrics: the harness's own digests must not run among its ops."""
    rank = dist.get_rank()
    files = arm_files(run_dir, spec.name)
    make_private_folders(files.dir)  # every rank, before any writes: a checkpoint goes in it (rundir.py)
    segment = segment or Segment()
    last = segment.last_step or steps
    seeded(spec)
    received = received_records(spec, steps, _next_update(files, segment))
    with contextlib.ExitStack() as stack:
        writers = ArmWriters(stack)
        recorder = FileRecorder(files, writers, steps, received)
        metrics = stack.enter_context(JsonlWriter(files.metrics)) if rank == 0 else None
        with phases.phase("build", arm=spec.name) as build:
            arm = subject.build(ArmContext(spec, device, steps, None if ops is not None else recorder, cache_dir))
            stack.callback(arm.close)
            received.built(arm, _uses(subject, spec))
            if spec.emits(GRAPH):
                build["graph"] = received.graph_build(arm.graph_build())
        if segment.checkpoint == "load":  # a subject that cannot checkpoint was refused at load
            with phases.phase("load", arm=spec.name):
                if debug.checkpoint_damage:
                    damage_checkpoint(files.checkpoint, debug.checkpoint_damage, rank)
                arm.load_checkpoint(files.checkpoint, segment.first_step - 1)
        if rank == 0:
            isa = torch.backends.cpu.get_cpu_capability().lower()
            facts = spec.facts.updated(received.info(arm.info()))
            write_json_atomic(files.arm, {"train": spec.train, "cpu_capability": isa, "facts": facts.to_json()})
        updates_done, last_update = 0, segment.first_step - 1
        recording = _recording_ops(subject, arm, files, spec.name, steps, ops.capture) if ops is not None else None
        with phases.phase("steps", arm=spec.name) as detail, recording or contextlib.nullcontext() as op_recorder:
            if recording is not None and op_recorder is None:  # refused: the op file says why
                return
            planned = range(segment.first_step, last + 1)

            def before(step: int) -> bool:
                if op_recorder is not None:
                    op_recorder.step = step
                return inject_fault(debug, spec.name, step, rank)

            for record in map(received.step_record, updates(arm, planned, before, drain=last == steps)):
                updates_done, last_update = updates_done + 1, record.step
                detail["steps"] = updates_done
                if metrics is not None:
                    metrics.write(record.to_json())
                print(
                    f"[arm {spec.name}] step {record.step}/{steps} loss={record.loss!r} grad_norm={record.grad_norm!r}",
                    flush=True,
                )
        if segment.checkpoint == "save":
            with phases.phase("save", arm=spec.name):
                arm.save_checkpoint(files.checkpoint, last)
            return
        with phases.phase("finish", arm=spec.name):
            if rank == 0 and spec.emits(GRAPH):  # after the steps: a subject may trace at its first
                write_json_atomic(files.graph, received.graph(arm.graph_export()))
            # The last update's own step: a pipeline's updates trail its batches, so a resumed
            # launch of one makes more updates than it has steps.
            weights = received.final_weights(arm.final_weights()) if spec.emits(FINAL_WEIGHTS) else {}
            for logical_rank, parameters in weights.items():
                write_json_atomic(files.weights(logical_rank), final_weights(parameters, last_update))


@contextlib.contextmanager
def _recording_ops(
    subject: Subject, arm: Arm, files: ArmFiles, name: str, steps: int, capture: int | None
) -> Iterator[OpRecorder | None]:
    """The arm's steps under an OpRecorder readied by the subject's ``record_ops`` hook, then this
    rank's op file and, with ``capture``, that op's outputs (harness/op_divergence/files.py). Yields
    None where the arm cannot be recorded: the op file then holds the refusal, and no step runs."""
    # Imported here: only an op-recording re-run needs DebugMode.
    from harness.op_divergence import OpRecorder
    from harness.op_divergence.files import write_captured, write_ops

    rank = dist.get_rank()
    recorder = OpRecorder(capture=capture)
    try:
        subject.record_ops(arm, recorder)
    except OpsNotRecordable as refused:
        write_ops(files.ops(rank), name, rank, steps, [], refused=str(refused))
        yield None
        return
    with recorder:
        yield recorder
    write_ops(files.ops(rank), name, rank, steps, recorder.records)
    if capture is not None:
        write_captured(files.captured(rank), recorder.captured or [])


def _uses(subject: Subject, spec: ArmSpec) -> tuple[str, ...]:
    """The capabilities of its subject that an arm uses: checkpointing, when it resumes."""
    return (CHECKPOINT,) if spec.resume_at and CHECKPOINT in subject.capabilities else ()


def _next_update(files: ArmFiles, segment: Segment) -> int:
    """The step the arm's first StepRecord of this launch must carry: 1, or in a resumed launch the
    one after the last its first launch wrote (a pipeline's updates trail its steps)."""
    written = read_jsonl(files.metrics) if segment.first_step > 1 and files.metrics.is_file() else []
    return written[-1]["step"] + 1 if written else 1
