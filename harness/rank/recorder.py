"""Where a rank's records go: the :class:`~harness.subject.protocol.Recorder` a built arm records
through, each record checked (harness/seam.py), then streamed to its file (``harness/rundir.py``
names every file).

Per logical rank, by the process hosting it: ``ranks.rank<k>.jsonl`` (loss, grad norm and replicated
parameter hash of each update), ``events.rank<k>.jsonl`` (token-exchange events) and
``pec.rank<k>.jsonl`` (PEC events); ``digests.jsonl`` (logical rank 0's gradient and parameter
digests, harness/digests.py) by process rank 0; an oracle's lines to ``fidelity.jsonl``. Every line
is flushed, so a crash leaves every finished step on disk.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from harness.digests import HASH_EVERY, digest_all, parameters_hash
from harness.records import DigestLine, JsonlWriter, RankLine
from harness.rundir import ArmFiles
from harness.seam import ReceivedRecords
from harness.subject.protocol import RankUpdate


class ArmWriters:
    """The streamed record files of one arm, each opened on its first line and closed with ``stack``.
    Logical ranks call from their own threads; each file is written by one thread only (its logical
    rank's)."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._writers: dict[Path, JsonlWriter] = {}
        self._opening = threading.Lock()

    def write(self, path: Path, record: Mapping[str, Any]) -> None:
        """Appends ``record`` as one line of ``path``, opening it first if this is its first line."""
        if path not in self._writers:
            with self._opening:
                self._writers[path] = self._stack.enter_context(JsonlWriter(path))
        self._writers[path].write(dict(record))


class FileRecorder:
    """The :class:`~harness.subject.protocol.Recorder` of a rank: every record family to its file, each
    record checked first (harness/seam.py). Every logical rank's loss, grad norm and replicated parameter
    hash; logical rank 0's gradient and parameter digests (see harness.digests); token-exchange and PEC
    events; an oracle's lines."""

    def __init__(self, files: ArmFiles, writers: ArmWriters, steps: int, received: ReceivedRecords) -> None:
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
