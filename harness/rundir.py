"""The run directory's layout: every path a run writes and the harness reads, named once.

The ranks write, the harness judges from what they wrote, and reports, ``harness collect`` and
dashboards read it back later: all of them must agree on where each record lives, so the names are
here and nowhere else (the README's "Run directory" lists what each file holds)::

    manifest.json  summary.json  report.html  junit.xml  throughput.jsonl
    arms/<arm>/    metrics.jsonl digests.jsonl arm.json graph.json fidelity.jsonl
                   events.rank<k>.jsonl ranks.rank<k>.jsonl pec.rank<k>.jsonl weights.rank<k>.json
    phases/<group>.rank<k>.jsonl
    logs/          harness.log, and each launch group's rank logs
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


def arm_files(run_dir: Path, arm: str) -> ArmFiles:
    return ArmFiles(Path(run_dir) / ARMS_DIR / arm)


def phases_file(run_dir: Path, group: str, rank: int) -> Path:
    """Process rank ``rank``'s phases in launch group ``group``."""
    return Path(run_dir) / PHASES_DIR / f"{group}.rank{rank}.jsonl"
