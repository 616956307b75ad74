"""One rank of a launch group: ``python -m harness.worker RUN_DIR GROUP``, started by a launcher (harness/launchers/).

Runs each arm of the group in turn, built by the suite's subject (harness/subject/) from a fresh
seed, and writes what it records (``harness/rundir.py`` names every file): ``metrics.jsonl`` (one
:class:`~harness.subject.protocol.StepRecord` a line) and ``digests.jsonl`` (process rank 0, for
logical rank 0), ``arm.json`` (the arm's config, its facts as declared and as the built arm adds them, the
CPU kernel ISA) and ``graph.json`` (a traced arm's exchange ops; process rank 0), and per logical rank
``events.rank<k>.jsonl``, ``ranks.rank<k>.jsonl`` and ``pec.rank<k>.jsonl`` (the process hosting
it). Every line is flushed, so a crash leaves every finished step on disk. After the arm's last
update each process writes its logical ranks' ``weights.rank<k>.json``: a hash of each parameter
(:func:`harness.digests.final_weights`), so final weights compare bit for bit.

An op-recording re-run's group (``LaunchGroup.record_ops``, harness/first_op.py) runs its arms
with every op of their steps recorded on the rank's main thread, which sees them all with one
logical rank per process, and writes ``ops.rank<k>.jsonl`` (and a capture pass's
``captured.rank<k>.npz``) per arm instead of the Recorder's files.

A throughput run's group lists block positions instead (:mod:`harness.throughput`): the rank
builds each copy of an arm once, records nothing of the training, and times the positions in
order into ``throughput.jsonl`` (:func:`measure_throughput`).

A rank that raises writes its traceback to its error file (TORCHELASTIC_ERROR_FILE) in room it
claimed when it started (:class:`ErrorFileInRoom`), so a full disk, which fails the rank, still
gets the rank's own error (ENOSPC, naming the file it was writing) reported.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import dataclasses
import errno
import faulthandler
import functools
import gc
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

# Before any process group exists, for every subject: imported later (torch.use_deterministic_algorithms
# does, through torch._inductor.config), it would pin the default group (docs/known-issues.md).
import torch.distributed.nn.functional  # noqa: F401
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

import harness
from harness.digests import HASH_EVERY, digest_all, final_weights, parameters_hash
from harness.files import write_json_atomic
from harness.manifest import Manifest
from harness.phases import PhaseLog
from harness.plan import LaunchGroup, Measurement
from harness.records import DigestLine, JsonlWriter, RankLine, read_jsonl
from harness.rundir import THROUGHPUT, ArmFiles, arm_files, phases_file
from harness.seam import ReceivedRecords
from harness.specs import ArmSpec, DebugSpec, SuiteSpec
from harness.subject import Subject, subject_of
from harness.subject.protocol import (
    CHECKPOINT,
    FINAL_WEIGHTS,
    GRAPH,
    Arm,
    ArmContext,
    OpsNotRecordable,
    RankUpdate,
    StepRecord,
)
from harness.throughput import stop_reason
from harness.trust import make_private_folders

if TYPE_CHECKING:
    from harness.op_divergence import OpRecorder

_PR_SET_PDEATHSIG = 1
# The harness process (the elastic agent) exports its pid, so a rank can tell it was orphaned.
AGENT_PID_ENV = "HARNESS_AGENT_PID"
# Exit code of an injected `fail_mode = "exit"`, recognisable in the parent's message.
INJECTED_EXIT_CODE = 13
# Disk space a rank claims at start-up for its error file: a traceback is a few kilobytes.
ERROR_ROOM_BYTES = 64 * 1024


def error_room(error_file: Path) -> Path:
    """The file holding the space claimed for a rank's error file, renamed into it once written."""
    return error_file.with_name(f".{error_file.name}.room")


def release_error_room(error_file: Path) -> None:
    """Frees the space a rank claimed for its error file and did not use: it ended well, or was killed."""
    error_room(error_file).unlink(missing_ok=True)


class ErrorFileInRoom(ErrorHandler):
    """torch's error handler (``@record``), writing the same error file into space claimed when the rank
    starts, then renaming it into place. A full disk is a common way for a rank to fail, and torch's
    own handler then leaves the file empty: the elastic agent fails to parse it, and the cause,
    the rank's ENOSPC, is lost. This one leaves a whole error file or none."""

    def initialize(self) -> None:
        super().initialize()
        path = self._get_error_file_path()
        if path:
            with contextlib.suppress(OSError):  # no space to claim: the file is written without it
                _claim(error_room(Path(path)), ERROR_ROOM_BYTES)

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        extra_info = {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}
        report = json.dumps({"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": extra_info}})
        try:
            _write_into(error_room(Path(path)), Path(path), report.encode())
        except OSError as error:
            with contextlib.suppress(OSError):  # stderr is the rank log, on the same disk
                print(f"{path}: cannot write the error file: {error}", flush=True)


def _claim(room: Path, size: int) -> None:
    fd = os.open(room, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def _write_into(room: Path, path: Path, data: bytes) -> None:
    """Writes ``data`` as ``path``, atomically, over the space claimed in ``room`` (it needs no new
    blocks when it fits); on failure neither file is left."""
    try:
        fd = os.open(room, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if os.pwrite(fd, data, 0) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(room))
            os.ftruncate(fd, len(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(room, path)
    except OSError:
        room.unlink(missing_ok=True)
        raise


def _die_with_parent() -> None:
    """Ask the kernel to kill this rank if the harness dies, even by SIGKILL: no orphans."""
    if sys.platform == "linux":
        ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ[AGENT_PID_ENV]):  # the harness died before we asked
        os._exit(1)


def cuda_device_index(local_rank: int, visible: int) -> int:
    """The GPU a rank drives: its local rank among the GPUs it sees, or the only one it sees where the
    cluster gives each task its own (Slurm's per-task CUDA_VISIBLE_DEVICES). Anything else is one
    line naming the rank's LOCAL_RANK and what it sees."""
    if visible < 1:
        raise RuntimeError(f"LOCAL_RANK {local_rank}: no GPU visible (CUDA_VISIBLE_DEVICES)")
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise RuntimeError(f"LOCAL_RANK {local_rank}: only {visible} GPUs visible (CUDA_VISIBLE_DEVICES)")
    return local_rank


def _init_process_group(device: str, backend: str) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        # Deterministic cuBLAS and kernels: exact comparisons are the point of the harness.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        index = cuda_device_index(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count())
        torch.cuda.set_device(index)  # the subject builds on torch.cuda.current_device()
        dist.init_process_group(backend, device_id=torch.device("cuda", index))
    else:
        dist.init_process_group(backend)


def _inject_fault(debug: DebugSpec, arm: str, step: int, rank: int) -> bool:
    """The [debug] table: make this rank raise, exit, hang or die by SIGKILL, or every rank stop
    the arm early without an error (as a trainer whose loop ends early), to prove the failure
    paths. Returns whether the arm goes on."""
    mode = debug.fail_mode
    if (debug.fail_step, debug.fail_arm) != (step, arm) or (mode != "stop" and debug.fail_rank != rank):
        return True
    print(f"[debug] injecting fail_mode={mode} on rank {rank}, arm {arm}, step {step}", flush=True)
    if mode == "stop":
        return False
    if mode == "raise":
        raise RuntimeError(f"injected failure (debug.fail_mode = 'raise') on rank {rank}, arm {arm}, step {step}")
    if mode == "exit":
        os._exit(INJECTED_EXIT_CODE)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # "hang": sleep in Python so the stack dump shows where
        time.sleep(1)


def _damage_checkpoint(folder: Path, how: str, rank: int) -> None:
    """The [debug] table's ``checkpoint_damage``, done by process rank 0 before a resumed arm's load,
    then a barrier: a shard (torch.distributed.checkpoint's ``*.distcp``, the last by name) removed
    or cut to half its size, the index (``.metadata``) overwritten with bytes that are no pickle, or
    the manifest (the reference's ``harness.json``) made to record another seed, as a checkpoint of
    another config would."""
    if rank == 0:
        print(f"[debug] damaging the checkpoint under {folder}: {how}", flush=True)
        shard = sorted(folder.rglob("*.distcp"))[-1]
        if how == "missing-shard":
            shard.unlink()
        elif how == "truncated-shard":
            os.truncate(shard, shard.stat().st_size // 2)
        elif how == "garbage-index":
            next(folder.rglob(".metadata")).write_bytes(b"garbage, not a pickle\n" * 8)
        else:
            manifest = next(folder.rglob("harness.json"))
            saved = json.loads(manifest.read_text())
            saved["config"]["seed"] += 1
            manifest.write_text(json.dumps(saved))
    dist.barrier()


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


class _ArmWriters:
    """The streamed record files of one arm, each opened on its first line. Logical ranks call from
    their own threads; each file is written by one thread only (its logical rank's)."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._writers: dict[Path, JsonlWriter] = {}
        self._opening = threading.Lock()

    def write(self, path: Path, record: Mapping[str, Any]) -> None:
        if path not in self._writers:
            with self._opening:
                self._writers[path] = self._stack.enter_context(JsonlWriter(path))
        self._writers[path].write(dict(record))


class FileRecorder:
    """The :class:`~harness.subject.protocol.Recorder` of a rank: every record family to its file, each
    record checked first (harness/seam.py). Every logical rank's loss, grad norm and replicated parameter
    hash; logical rank 0's gradient and parameter digests (see harness.digests); token-exchange and PEC
    events; an oracle's lines."""

    def __init__(self, files: ArmFiles, writers: _ArmWriters, steps: int, received: ReceivedRecords) -> None:
        self._files, self._writers, self._steps, self._received = files, writers, steps, received
        self._grad_digests: dict[int, dict[str, list]] = {}  # logical rank 0's, until its update
        self._grad_sums: dict[tuple[int, int], tuple[str, str]] = {}  # (logical rank, step) -> hashes, until then

    def gradients(self, logical_rank: int, step: int, grads: Mapping[str, torch.Tensor]) -> None:
        self._received.gradients(logical_rank, step, grads)
        if logical_rank == 0:
            self._grad_digests[step] = digest_all(dict(grads))

    def gradient_sum(self, logical_rank: int, step: int, summed: torch.Tensor, fp32_resum: torch.Tensor) -> None:
        self._grad_sums[logical_rank, step] = (parameters_hash([summed]), parameters_hash([fp32_resum]))

    def rank_update(self, logical_rank: int, step: int, update: RankUpdate) -> None:
        self._received.rank_update(logical_rank, step, update)
        hashed = step % HASH_EVERY == 0 or step == self._steps
        replicated = parameters_hash(update.replicated.values()) if hashed else None
        line = RankLine(step, update.loss, update.grad_norm, replicated, *self._grad_sums.pop((logical_rank, step), ()))
        self._writers.write(self._files.ranks(logical_rank), line.to_json())
        if logical_rank == 0:
            params = digest_all({**update.replicated, **update.sharded})
            digests = DigestLine(step, self._grad_digests.pop(step, {}), params)
            self._writers.write(self._files.digests, digests.to_json())

    def exchange_event(self, logical_rank: int, event: Mapping[str, Any]) -> None:
        self._received.event("exchange_event", logical_rank, event)
        self._writers.write(self._files.events(logical_rank), event)

    def pec_event(self, logical_rank: int, event: Mapping[str, Any]) -> None:
        self._received.event("pec_event", logical_rank, event)
        self._writers.write(self._files.pec(logical_rank), event)

    def fidelity(self, record: Mapping[str, Any]) -> None:
        self._received.fidelity(record)
        self._writers.write(self._files.fidelity, record)


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


def _received(spec: ArmSpec, steps: int, first: int = 1) -> ReceivedRecords:
    """The checks of what the arm hands this rank (harness/seam.py): process p of P hosts logical
    ranks [p*L/P, (p+1)*L/P) of L; ``first``: the step its next StepRecord must carry."""
    rank, per = dist.get_rank(), spec.logical_ranks // dist.get_world_size()
    return ReceivedRecords(spec.name, rank, range(rank * per, (rank + 1) * per), steps, first, spec.families)


def _next_update(files: ArmFiles, segment: Segment) -> int:
    """The step the arm's first StepRecord of this launch must carry: 1, or in a resumed launch the
    one after the last its first launch wrote (a pipeline's updates trail its steps)."""
    written = read_jsonl(files.metrics) if segment.first_step > 1 and files.metrics.is_file() else []
    return written[-1]["step"] + 1 if written else 1


def _seeded(spec: ArmSpec) -> None:
    """Every arm starts from the same RNG state, whatever ran before it in this process."""
    random.seed(spec.seed)
    torch.manual_seed(spec.seed)


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
    _seeded(spec)
    received = _received(spec, steps, _next_update(files, segment))
    with contextlib.ExitStack() as stack:
        writers = _ArmWriters(stack)
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
                    _damage_checkpoint(files.checkpoint, debug.checkpoint_damage, rank)
                arm.load_checkpoint(files.checkpoint, segment.first_step - 1)
        if rank == 0:
            isa = torch.backends.cpu.get_cpu_capability().lower()
            facts = spec.facts.updated(received.info(arm.info()))
            write_json_atomic(files.arm, {"train": spec.train, "cpu_capability": isa, "facts": facts.to_json()})
            if spec.emits(GRAPH):
                write_json_atomic(files.graph, received.graph(arm.graph_export()))
        updates_done, last_update = 0, segment.first_step - 1
        recording = _recording_ops(subject, arm, files, spec.name, steps, ops.capture) if ops is not None else None
        with phases.phase("steps", arm=spec.name) as detail, recording or contextlib.nullcontext() as op_recorder:
            if recording is not None and op_recorder is None:  # refused: the op file says why
                return
            planned = range(segment.first_step, last + 1)

            def before(step: int) -> bool:
                if op_recorder is not None:
                    op_recorder.step = step
                return _inject_fault(debug, spec.name, step, rank)

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
            # The last update's own step: a pipeline's updates trail its batches, so a resumed
            # launch of one makes more updates than it has steps.
            weights = received.final_weights(arm.final_weights()) if spec.emits(FINAL_WEIGHTS) else {}
            for logical_rank, parameters in weights.items():
                write_json_atomic(files.weights(logical_rank), final_weights(parameters, last_update))


def _peak_memory_reset(device: str) -> None:
    """Start a fresh peak: CUDA's allocator counter, or the kernel's RSS high-water mark (VmHWM)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _peak_memory_bytes(device: str) -> int:
    """Bytes at the peak since the reset: CUDA max allocated, or this process's peak RSS."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class _TimedArm:
    """One built copy of an arm in a throughput run: it keeps training its own model, step after
    step, across every block it is timed in, recording nothing. ``slow_fraction`` plants a
    slowdown (DebugSpec)."""

    def __init__(
        self, subject: Subject, spec: ArmSpec, device: str, total_steps: int, slow_fraction: float, cache: Path | None
    ) -> None:
        _seeded(spec)
        self.received = _received(spec, total_steps)
        self.arm = subject.build(ArmContext(spec, device, total_steps, None, cache))
        self.received.built(self.arm, ())
        self.slow_fraction = slow_fraction
        self.next_step = 1

    def run(self, steps: int) -> int:
        """Trains ``steps`` steps; returns the tokens of the updates they made."""
        tokens = 0
        for _ in range(steps):
            start = time.perf_counter()
            record = self.arm.step(self.next_step)
            tokens += self.received.step_record(record).tokens if record is not None else 0
            self.next_step += 1
            if self.slow_fraction:
                time.sleep(self.slow_fraction * (time.perf_counter() - start))
        return tokens


def _timed(copy: _TimedArm, steps: int, device: str) -> tuple[float, int, int]:
    """(seconds, peak bytes, tokens) of ``steps`` steps on this rank, between barriers: the block
    starts when every rank is ready, and its time includes the wait for the slowest."""
    _peak_memory_reset(device)
    dist.barrier()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        tokens = copy.run(steps)
        dist.barrier()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000, _peak_memory_bytes(device), tokens
    began = time.perf_counter()
    tokens = copy.run(steps)
    dist.barrier()
    return time.perf_counter() - began, _peak_memory_bytes(device), tokens


def measure_throughput(
    run_dir: Path,
    subject: Subject,
    suite: SuiteSpec,
    measurements: Sequence[Measurement],
    device: str,
    phases: PhaseLog,
    cache_dir: Path | None = None,
) -> None:
    """Times the group's block positions in order (harness/throughput.py plans them): builds each
        copy of an arm once and warms it up, then records per position the slowest rank's seconds and
        the largest peak memory of any rank to ``throughput.jsonl`` (process rank 0). Tokens per second
    count the tokens of the updates the block made (a filling pipeline makes fewer)."""
    spec, debug = suite.throughput, suite.debug
    positions = collections.Counter(m.copy for m in measurements)
    arms = {m.copy: m.arm for m in measurements}
    with contextlib.ExitStack() as stack:
        copies = {}
        for copy, count in positions.items():
            arm = arms[copy]
            slow = debug.slow_fraction if debug.slow_arm == arm else 0.0
            steps = spec.warmup + count * spec.steps
            with phases.phase("build", arm=copy):
                copies[copy] = _TimedArm(subject, suite.arms[arm], device, steps, slow, cache_dir)
            stack.callback(copies[copy].arm.close)
        with phases.phase("warmup"):
            for copy in copies.values():
                copy.run(spec.warmup)
        writer = stack.enter_context(JsonlWriter(run_dir / THROUGHPUT)) if dist.get_rank() == 0 else None
        rows: list[dict] = []
        with phases.phase("blocks"):
            for m in measurements:
                timed = copies[m.copy]
                first_step = timed.next_step
                seconds, peak, tokens = _timed(timed, spec.steps, device)
                worst = torch.tensor([seconds, float(peak), time.time()], dtype=torch.float64, device=device)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                seconds, peak, end_time = worst.tolist()
                print(f"[{m.series} block {m.block} {m.role}: {m.arm}] {seconds:.4f} s", flush=True)
                rows.append(
                    {
                        **dataclasses.asdict(m),
                        "steps": spec.steps,
                        "first_step": first_step,
                        "seconds": seconds,
                        "step_time_s": seconds / spec.steps,
                        "tokens_per_s": tokens / seconds,
                        "peak_memory_bytes": int(peak),
                        "timing": "cuda-events" if device == "cuda" else "wall",
                        "end_time": end_time,
                    }
                )
                if writer is not None:
                    writer.write(rows[-1])
                # Every rank holds the same reduced rows, so every rank reaches the same answer.
                reason = stop_reason(spec, rows)
                if reason:
                    print(f"[throughput] stopped: {reason}", flush=True)
                    break


def _op_recording(group: LaunchGroup, arm: str) -> OpRecording:
    """What an op-recording re-run's group asks of ``arm`` in this rank (``LaunchGroup.capture_ops``)."""
    rank = dist.get_rank()
    return OpRecording(next((i for name, r, i in group.capture_ops if (name, r) == (arm, rank)), None))


@functools.partial(record, error_handler=ErrorFileInRoom())
def main(argv: list[str]) -> None:
    run_dir, group_name = Path(argv[0]), argv[1]
    manifest = Manifest.read(run_dir)
    suite = manifest.spec()
    # The subject's modules are imports too, loaded before any process group exists.
    subject = subject_of(suite)
    entered = time.time()  # the imports (phases.py) end here
    # The imports made a few hundred thousand objects that live as long as the rank; frozen, they
    # are no longer walked by every full collection while the arms trace and train.
    gc.freeze()
    os.dup2(1, 2)  # stderr joins stdout in logs/rank<k>.log, in order
    sys.stdout.reconfigure(line_buffering=True)
    _die_with_parent()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the watchdog's stack dump
    group = manifest.launch(group_name)
    cache_dir = Path(manifest.trace_cache) if manifest.trace_cache else None
    device = manifest.device
    with JsonlWriter(phases_file(run_dir, group_name, int(os.environ["RANK"]))) as phase_file:
        phases = PhaseLog(phase_file.write)
        phases.add("imports", harness.IMPORTED_AT, entered)
        with phases.phase("rendezvous"):
            _init_process_group(device, manifest.backend)
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
