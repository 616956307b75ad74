"""A throughput run's blocks, timed in a rank: its launch group lists block positions
(:class:`~harness.plan.Measurement`, planned by harness/throughput.py) instead of arms to verify.

The rank builds each copy of an arm once, records nothing of the training, and times the positions
in order into ``throughput.jsonl`` (:func:`measure_throughput`), every copy training on across the
blocks it is timed in.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from harness.phases import PhaseLog
from harness.plan import Measurement
from harness.rank.train import received_records, seeded
from harness.records import JsonlWriter, read_jsonl
from harness.rundir import THROUGHPUT
from harness.specs import ArmSpec, SuiteSpec
from harness.subject import Subject
from harness.subject.protocol import ArmContext
from harness.throughput import stop_reason


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
    count the tokens of the updates the block made (a filling pipeline makes fewer). The stop rule
    sees the rows of earlier launches too (a run of separate launches), read before this one wrote any."""
    spec, debug = suite.throughput, suite.debug
    earlier = read_jsonl(run_dir / THROUGHPUT) if (run_dir / THROUGHPUT).is_file() else []
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
                reason = stop_reason(spec, [*earlier, *rows])
                if reason:
                    print(f"[throughput] stopped: {reason}", flush=True)
                    break


class _TimedArm:
    """One built copy of an arm in a throughput run: it keeps training its own model, step after
    step, across every block it is timed in, recording nothing. ``slow_fraction`` plants a
    slowdown (DebugSpec)."""

    def __init__(
        self, subject: Subject, spec: ArmSpec, device: str, total_steps: int, slow_fraction: float, cache: Path | None
    ) -> None:
        seeded(spec)
        self.received = received_records(spec, total_steps)
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
