"""A failed rank: regression, bad input or flake? The classification behind exit codes 1, 2 and 3.

CI retries a flake (exit 3) and blocks on a regression (exit 1), so a crash must be told apart
from infrastructure trouble; a checkpoint that must not be loaded is neither, but bad input (exit
2), which no retry and no change to the code under test cures. Only the root cause is judged: the
rank that died first (the launchers order deaths as they happen). Its peers' errors ("Connection
reset by peer") are consequences. The rules, in order:

1. It died by a signal (SIGKILL, SIGSEGV, SIGABRT, ...): infrastructure. A SIGKILL while the
   cgroup's OOM-kill counter rose is named an OOM kill.
2. It raised :class:`~harness.subject.protocol.CheckpointRefused` (a partial checkpoint, a
   damaged one, one of another config): bad input, its one line the reason.
3. It raised :class:`~harness.subject.protocol.BadRecord` (a record no run could have made,
   harness/seam.py): the subject's fault, a regression, its one line naming the arm and the record.
4. It raised, and its exception matches a flake pattern below: infrastructure.
5. It raised, and the traceback passes through the system under test (its ``Subject.source``):
   a regression, reported as the failed check "rank k raised" with the traceback. A shape error
   or an internal consistency assertion ("replay of batch 2 diverged") a change introduced fails
   the same way on every retry.
6. Anything else (the harness's own code, an exit without a traceback): infrastructure.

The patterns are matched against the exception's last line only: every traceback through a
collective has ``distributed_c10d.py`` among its frames, and that alone says nothing.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.results import BAD_INPUT, REGRESSION
from harness.subject.protocol import BadRecord, CheckpointRefused

INFRASTRUCTURE = "infrastructure"
# How a traceback's last line starts when the rank refused a checkpoint.
REFUSED = f"{CheckpointRefused.__module__}.{CheckpointRefused.__qualname__}: "
BAD_RECORD = f"{BadRecord.__module__}.{BadRecord.__qualname__}: "
MEMORY_EVENTS = Path("/sys/fs/cgroup/memory.events")

# (what it is, pattern on the exception line): failures that retrying may cure.
FLAKE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "process group or network",
        re.compile(
            r"Connection (reset|closed|refused)|Broken pipe|DistNetworkError|DistBackendError|DistStoreError"
            r"|Gloo|NCCL|nccl|Socket Timeout|timed out|Timed out|TimeoutError|ECONNRESET"
        ),
    ),
    ("out of memory", re.compile(r"out of memory|OutOfMemoryError|Cannot allocate memory|bad_alloc")),
    ("device", re.compile(r"CUDA error|CUDA driver|cudaError|ECC error|device-side assert")),
    ("full disk", re.compile(r"No space left on device|Disk quota exceeded|ENOSPC|EDQUOT")),
)

_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+, in ', re.MULTILINE)


@dataclass(frozen=True)
class Verdict:
    """How one rank failure counts: REGRESSION (exit 1), BAD_INPUT (exit 2) or INFRASTRUCTURE (exit 3),
    and why (for bad input, the refusal's own line)."""

    kind: str
    reason: str


def exception_line(traceback: str) -> str:
    """ "RuntimeError: shapes cannot be multiplied": the last unindented line of a traceback."""
    lines = [line for line in traceback.strip().splitlines() if line.strip() and not line[0].isspace()]
    return lines[-1].strip() if lines else ""


def raised_exception(traceback: str) -> str:
    """The exception a traceback ends with, all its lines (a message may span many: an FX graph's
    printout): what follows the innermost frame and its source line."""
    lines = traceback.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    after = lines[frames[-1] + 1 :] if frames else lines
    while after and after[0].startswith(" "):
        after = after[1:]
    return "\n".join(after).strip()


def oom_kills() -> int | None:
    """The cgroup's OOM-kill counter (cgroup v2), or None where it cannot be read."""
    try:
        text = MEMORY_EVENTS.read_text()
    except OSError:
        return None
    match = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
    return int(match[1]) if match else None


def classify(
    exitcode: int, traceback: str | None, oom_kills_during: int = 0, subject_source: Sequence[Path] = ()
) -> Verdict:
    """Applies the rules above to the root-cause rank: its exit code (negative: killed by that
    signal), the traceback it left, if any, and the folders of the subject's code."""
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        if oom_kills_during > 0 and -exitcode == signal.SIGKILL:
            return Verdict(INFRASTRUCTURE, f"killed by {name}: an OOM kill (oom_kill rose by {oom_kills_during})")
        return Verdict(INFRASTRUCTURE, f"killed by {name}")
    if not traceback:
        return Verdict(INFRASTRUCTURE, f"exit code {exitcode} without a traceback")
    line = exception_line(traceback)
    if line.startswith(REFUSED):
        return Verdict(BAD_INPUT, line.removeprefix(REFUSED))
    if line.startswith(BAD_RECORD):
        return Verdict(REGRESSION, "a record no run could have made: the subject's fault")
    for what, pattern in FLAKE_PATTERNS:
        if pattern.search(line):
            return Verdict(INFRASTRUCTURE, f"{what} error")
    frames = [Path(f).resolve() for f in _FRAME.findall(traceback)]
    subject = [f for f in frames if any(f.is_relative_to(folder) for folder in subject_source)]
    if subject:
        return Verdict(REGRESSION, f"raised in the system under test ({Path(subject[-1]).name})")
    return Verdict(INFRASTRUCTURE, "raised outside the system under test")
