"""The run directory's layout: every path a run writes and the harness reads, named once.

The ranks write, the harness judges from what they wrote, and reports, ``harness collect`` and
dashboards read it back later: all of them must agree on where each record lives, so the names are
here and nowhere else (docs/run-directory.md lists what each file holds)::

    manifest.json  summary.json  report.html  junit.xml  throughput.jsonl
    arms/<arm>/    metrics.jsonl digests.jsonl arm.json graph.json fidelity.jsonl
                   events.rank<k>.jsonl ranks.rank<k>.jsonl pec.rank<k>.jsonl weights.rank<k>.json
    phases/<group>.rank<k>.jsonl
    logs/          harness.log, and each launch group's rank logs
    first-op/record/  first-op/capture/  (harness/first_op.py) each a run directory of its own, whose
                   arms/<arm>/ add ops.rank<k>.jsonl (and, in capture/, captured.rank<k>.npz)

A run directory is made here too (:func:`make_run_dir`), never reused, with the harness's own log
(:func:`harness_log`). It is private (0700, the folders it makes above it too) whatever the umask: a
resumed arm's checkpoint lives in it, and a rank loads one only where every folder above it is the
user's alone (harness/reference/checkpoint.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from harness.trust import TrustError, check_path, make_private_folders

MANIFEST = "manifest.json"
SUMMARY = "summary.json"
REPORT = "report.html"
JUNIT = "junit.xml"
THROUGHPUT = "throughput.jsonl"  # one line per ABBA block position (throughput runs)
ARMS_DIR = "arms"
PHASES_DIR = "phases"
LOGS_DIR = "logs"
HARNESS_LOG = f"{LOGS_DIR}/harness.log"
LAUNCHER_LOG = f"{LOGS_DIR}/launcher.log"  # the elastic agent's own messages
FIRST_OP_DIR = "first-op"  # the re-runs that record every op (harness/first_op.py), one run directory each
# Run directories go under ./reports of the working directory: never into an installed package.
REPORTS_DIR = Path("reports")
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
log = logging.getLogger("harness")


class RunDirError(Exception):
    """A run directory that cannot be made where asked; one line naming it, exit code 2."""


@dataclass(frozen=True)
class ArmFiles:
    """The record files of one arm, ``arms/<arm>/``."""

    dir: Path

    @property
    def metrics(self) -> Path:
        """One line per optimizer update (process rank 0)."""
        return self.dir / "metrics.jsonl"

    @property
    def digests(self) -> Path:
        """Logical rank 0's gradient and parameter digests, per step."""
        return self.dir / "digests.jsonl"

    @property
    def arm(self) -> Path:
        """The arm's train config, MoE layers and CPU kernel ISA."""
        return self.dir / "arm.json"

    @property
    def graph(self) -> Path:
        """A traced arm's scheduled exchange ops."""
        return self.dir / "graph.json"

    @property
    def fidelity(self) -> Path:
        """An oracle arm's per-step comparison."""
        return self.dir / "fidelity.jsonl"

    @property
    def checkpoint(self) -> Path:
        """A resumed arm's checkpoints, saved by its first launch for its second (``step-<k>/``)."""
        return self.dir / "checkpoint"

    def events(self, logical_rank: int) -> Path:
        """Token-exchange launches and waits of one logical rank."""
        return self.dir / f"events.rank{logical_rank}.jsonl"

    def ranks(self, logical_rank: int) -> Path:
        """One logical rank's loss, grad norm and replicated-parameter hash, per step."""
        return self.dir / f"ranks.rank{logical_rank}.jsonl"

    def pec(self, logical_rank: int) -> Path:
        """One logical rank's PEC table events."""
        return self.dir / f"pec.rank{logical_rank}.jsonl"

    def weights(self, logical_rank: int) -> Path:
        """One logical rank's parameter hashes after the arm's last update."""
        return self.dir / f"weights.rank{logical_rank}.json"

    def ops(self, rank: int) -> Path:
        """An op-recording re-run's (harness/first_op.py): process rank ``rank``'s ops, in order."""
        return self.dir / f"ops.rank{rank}.jsonl"

    def captured(self, rank: int) -> Path:
        """A capture pass's: the outputs of the one op process rank ``rank`` was asked to keep."""
        return self.dir / f"captured.rank{rank}.npz"


def arm_files(run_dir: Path, arm: str) -> ArmFiles:
    return ArmFiles(Path(run_dir) / ARMS_DIR / arm)


def phases_file(run_dir: Path, group: str, rank: int) -> Path:
    """Process rank ``rank``'s phases in launch group ``group``."""
    return Path(run_dir) / PHASES_DIR / f"{group}.rank{rank}.jsonl"


def fresh_dir(path: Path, what: str) -> Path:
    """``--out DIR``: a new or empty directory, made private (0700) with its ``logs/``; else RunDirError
    naming it."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise RunDirError(f"--out {path}: exists and is not an empty directory")
    try:
        make_private_folders(path / LOGS_DIR)
        path.chmod(0o700)  # an empty --out DIR that was there already
    except OSError as e:
        raise RunDirError(f"--out {path}: cannot create the {what}: {e.strerror}") from None
    return path


def make_run_dir(suite: str, out: Path | None, unpickled: str | None = None) -> Path:
    """``--out DIR`` (new or empty), else ./reports/<suite>/<UTC timestamp>[-n], never reused; private.
    ``unpickled``: what of the run is unpickled from it (a resumed arm's checkpoint, a Slurm job's
    submission), when something is: then a run directory under a folder another user may write, from
    where they could swap it for theirs, is refused (RunDirError) before anything runs. Records are
    JSON: a run that unpickles nothing may live in a shared project folder."""
    path = fresh_dir(out, "run directory") if out is not None else _timestamped(suite)
    if unpickled:
        try:
            check_path(path)
        except TrustError as e:
            raise RunDirError(f"{e}: another user could swap {unpickled}; choose a private --out DIR") from None
    return path


def _timestamped(suite: str) -> Path:
    """./reports/<suite>/<UTC timestamp>[-n], made private."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = REPORTS_DIR.absolute() / suite
    try:
        make_private_folders(base)
        for n in range(1, 1000):
            path = base / (stamp if n == 1 else f"{stamp}-{n}")
            try:
                path.mkdir(mode=0o700)
            except FileExistsError:
                continue
            make_private_folders(path / LOGS_DIR)
            path.chmod(0o700)  # mkdir's mode passes through the umask
            return path
    except OSError as e:
        raise RunDirError(f"{base}: cannot create a run directory ({e.strerror}); choose one with --out DIR") from None
    raise RunDirError(f"{base}: cannot create a run directory for {stamp}")


class QuietFileHandler(logging.FileHandler):
    """A log file that, when it cannot be written (a full disk), says nothing and raises nothing:
    logging's own report would print a traceback on the console, above the error that matters."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass

    def close(self) -> None:
        with suppress(OSError):  # its last flush
            super().close()


@contextmanager
def harness_log(run_dir: Path) -> Iterator[Path]:
    """The harness's own log for one run, logs/harness.log: decisions, and every traceback."""
    path = run_dir / HARNESS_LOG
    handler = QuietFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield path
    finally:
        log.removeHandler(handler)
        handler.close()


def inductor_cache(run_dir: Path, kernels: str) -> dict[str, str]:
    """Inductor unpickles its cache entries, which nobody signs, and its default folder
    (/tmp/torchinductor_<user>) is one another user can make first. So ranks keep theirs in the user's
    cache folder, made private and checked along its whole path, or else fresh in the run directory.
    A TORCHINDUCTOR_CACHE_DIR the user set is theirs to vouch for.

    One folder per kind of ``kernels`` the ranks run (the CPU ISA, "avx2" or "avx512", or "cuda"): a
    native AVX-512 run of parity-inductor that shared the AVX2-pinned run's cache died of heap
    corruption, and passes with one of its own."""
    if INDUCTOR_ENV in os.environ:
        return {}
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harness" / "inductor" / kernels
    try:
        make_private_folders(folder)
        check_path(folder)
    except (OSError, TrustError) as e:
        log.info("Inductor cache: %s: not used; one in the run directory instead", e)
        folder = run_dir / "inductor"
    return {INDUCTOR_ENV: str(folder)}
