"""Training with a pipeline delay: each update applies a gradient computed ``delay`` updates ago.

Tick ``t`` runs the forward of batch ``t`` at the current version, then the backward of the
oldest pending forward once ``delay + 1`` are pending (the forward of tick ``t - delay``), then
the commit and the optimizer step. :meth:`VersionedTrainer.drain` runs the remaining backwards
without new forwards. Every batch's gradient is applied exactly once, in batch order.

Ages: batch ``b`` is forwarded at revision ``max(0, b - delay)`` (no update happens while the
pipeline fills) and applied at revision ``b``, so its age is ``min(b, delay)``. It equals the
delay for every batch but the first ``delay``, whose forwards ran while the pipeline filled; the
batches applied by the drain have the full age.

Between two ticks the pending forwards are the pipeline's whole state beyond the weights and AdamW:
:meth:`VersionedTrainer.in_flight_state` hands them to a checkpoint, ``load_in_flight`` takes them
back, and the pipeline goes on as if it had not stopped.

The trainer reuses :class:`~harness.reference.train.Trainer` for everything that is not about
versions: logical EP ranks in threads or processes, the canonical (logical-rank order) dense
gradient sum, global-norm clipping and AdamW. Every reduction added here is also an all-gather
summed in logical-rank order, so results are bitwise independent of the process layout.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from harness.reference.ep.exchange import EventSink, bind
from harness.reference.train import GradSink, TrainConfig, Trainer, UpdateSink, synthetic_batch
from harness.reference.versioned import (
    CORRECTIONS,
    RETENTIONS,
    ForwardRecord,
    VersionedModel,
    group_vote,
)

PIPELINE_CHUNKINGS = ("none", "eager")
# "versioned" is this module's VersionedTrainer; "delayed-oracle" is the same training written the
# obvious way (harness.reference.delayed_oracle), which the versioned pipeline must equal bit for bit.
TRAINERS = ("versioned", "delayed-oracle")


@dataclass(frozen=True)
class PipelineConfig(TrainConfig):
    """A :class:`TrainConfig` plus the pipeline delay and the version protocol's settings."""

    delay: int = 0
    max_gradient_staleness: int = 2
    retention: str = "retain"
    correction: str = "off"
    correction_clip: float = 5.0  # importance weights are clamped to [0, correction_clip]
    # Which trainer runs the arm (TRAINERS). The oracle keeps no forward state: retention does not apply to it.
    trainer: str = "versioned"
    # A planted bug for the harness's negative test: this batch's gradient is applied twice.
    apply_twice_batch: int | None = None

    def checkpoint_faults(self) -> tuple[str, ...]:
        """The AdamW state left out, or the oldest forward still pending (VersionedTrainer.in_flight_state)."""
        return ("optimizer-not-saved", "oldest-version-dropped")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunking not in PIPELINE_CHUNKINGS:
            raise ValueError(f"versioned training supports chunking {PIPELINE_CHUNKINGS}, got {self.chunking!r}")
        if self.delay < 0 or self.max_gradient_staleness < 0:
            raise ValueError("delay and max_gradient_staleness must be >= 0")
        if self.retention not in RETENTIONS:
            raise ValueError(f"retention must be one of {RETENTIONS}, got {self.retention!r}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction must be one of {CORRECTIONS}, got {self.correction!r}")
        if not 0 < self.correction_clip < math.inf:
            raise ValueError(f"correction_clip must be a finite number > 0, got {self.correction_clip!r}")
        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {TRAINERS}, got {self.trainer!r}")
        if self.trainer != "versioned" and self.apply_twice_batch is not None:
            raise ValueError(f"apply_twice_batch plants a bug in the versioned trainer, not in {self.trainer!r}")
        # delay > max_gradient_staleness is accepted on purpose: the version protocol refuses the
        # first over-age backward at run time, which is what the negative suite demonstrates.


class VersionedTrainer(Trainer):
    """Drives this process's logical EP ranks through a delayed, versioned training pipeline.

    ``step(batch)`` is one tick and returns the record of the update it made, or ``None`` while
    the pipeline fills; ``drain()`` finishes the pending backwards; ``run(steps)`` does both and
    yields exactly one record per batch. A record has Trainer.step's fields, where ``loss`` is the
    applied batches' global loss measured at their forward, plus:

    * ``tick``, ``revision`` (the version the update was applied to), ``ages``, ``batches_applied``;
    * ``correction_mean`` and ``correction_clipped_frac`` over the corrected tokens (``None`` when
      the correction is off or no applied batch had current logprobs);
    * ``forwards`` and ``recomputes``: model forwards (training and correction) and replayed
      forwards of each logical rank since the previous record; ``step_time_s`` likewise.
    """

    def __init__(
        self,
        config: PipelineConfig,
        event_sink: EventSink | None = None,
        grad_sink: GradSink | None = None,
        update_sink: UpdateSink | None = None,
    ) -> None:
        super().__init__(config, event_sink, grad_sink, update_sink)
        self.config: PipelineConfig = config
        self.engines = {
            r: VersionedModel(
                replica.model,
                replica.optimizer,
                max_gradient_staleness=config.max_gradient_staleness,
                retention=config.retention,
                correction=config.correction,
                correction_clip=config.correction_clip,
                grad_divisor=config.ep,
            )
            for r, replica in self.replicas.items()
        }
        self._votes = {r: group_vote(self.group, r, self.device) for r in self.logical_ranks}
        self._pending: dict[int, deque[ForwardRecord]] = {r: deque() for r in self.logical_ranks}
        self._ticks = 0
        self._updates = 0
        self._seconds = 0.0  # since the previous record
        self._counted = (0, 0)  # forwards and recomputes of the first logical rank at the previous record

    def step(self, step: int) -> dict | None:
        """One tick: forward batch ``step``, then the update of the batch ``delay`` ticks older."""
        return self._tick(step)

    def drain(self) -> list[dict]:
        """Apply every pending forward's gradient, one update per tick, without new forwards."""
        records = []
        while self._pending[self.logical_ranks[0]]:
            records.append(self._tick(None))
        return records

    def run(self, steps: int) -> Iterator[dict]:
        """Train on batches ``0..steps-1`` and drain: one record per update, ``steps`` in all."""
        for batch in range(steps):
            record = self.step(batch)
            if record is not None:
                yield record
        yield from self.drain()

    def in_flight_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per logical rank, between two ticks: its version protocol with the forwards still pending
        (VersionedModel.state), and the tick, update and record counters. The planted fault
        ``oldest-version-dropped`` leaves the oldest pending forward out."""
        counters = torch.tensor([self._ticks, self._updates, *self._counted])
        state = {}
        for rank, pending in self._pending.items():
            records = list(pending)[1:] if self.config.checkpoint_fault == "oldest-version-dropped" else list(pending)
            state[rank] = {"trainer": counters, **self.engines[rank].state(records)}
        return state

    def load_in_flight(self, state: dict[int, dict[str, torch.Tensor]]) -> None:
        """Restores what :meth:`in_flight_state` saved: the pipeline goes on with the forwards it holds,
        whose backwards replay them (VersionedModel.load_state)."""
        for rank, tensors in state.items():
            self._pending[rank] = deque(self.engines[rank].load_state(tensors, self.device))
        ticks, updates, *counted = state[self.logical_ranks[0]]["trainer"].tolist()
        self._ticks, self._updates, self._counted = ticks, updates, tuple(counted)

    def _tick(self, batch: int | None) -> dict | None:
        start = time.perf_counter()
        results = self._on_every_rank(lambda rank: self._rank_tick(rank, self._ticks, batch))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._ticks += 1
        self._seconds += time.perf_counter() - start
        update = results[self.logical_ranks[0]]
        if update is None:
            return None
        engine = self.engines[self.logical_ranks[0]]
        counted = (engine.forwards, engine.recomputes)
        record = {
            "step": self._updates,
            "tick": self._ticks - 1,
            **update,
            "tokens": len(update["batches_applied"]) * self.config.ep * self.config.local_batch * self.config.seq_len,
            "step_time_s": self._seconds,
            "forwards": counted[0] - self._counted[0],
            "recomputes": counted[1] - self._counted[1],
        }
        self._updates += 1
        self._seconds = 0.0
        self._counted = counted
        return record

    def _rank_tick(self, rank: int, tick: int, batch: int | None) -> dict | None:
        replica, engine, pending = self.replicas[rank], self.engines[rank], self._pending[rank]
        replica.exchange.step = tick
        with bind(replica.exchange):
            if batch is not None:
                inputs, labels = synthetic_batch(self.config, self.cfg.vocab_size, batch, rank)
                pending.append(engine.forward(batch, inputs.to(self.device), labels.to(self.device)))
                if len(pending) <= self.config.delay:
                    return None
            elif not pending:
                return None
            revision = engine.version.revision
            applied = engine.backward([pending[0]], self._votes[rank], apply_twice_batch=self.config.apply_twice_batch)
        self._sum_dense_grads(rank, replica)
        if self.grad_sink is not None:
            self.grad_sink(rank, self._updates, {n: p.grad for n, p in replica.model.named_parameters()})
        grad_norm = self._clip_by_global_norm(rank, replica)
        engine.optimizer_step(self._votes[rank])
        pending.popleft()
        losses = []
        for loss in applied.losses:
            per_rank = self.group.all_gather(rank, loss.float().reshape(()))
            losses.append(float(torch.stack(per_rank).sum() / self.config.ep))
        mean_loss = math.fsum(losses) / len(losses)
        self._report_update(rank, self._updates, mean_loss, float(grad_norm))
        return {
            "loss": mean_loss,
            "grad_norm": float(grad_norm),
            "revision": revision,
            "ages": applied.ages,
            "batches_applied": applied.batches,
            **self._correction_stats(rank, applied.weight_sum, applied.clipped, applied.corrected_tokens),
        }

    def _correction_stats(self, rank: int, weight_sum: float, clipped: int, tokens: int) -> dict:
        if self.config.correction == "off":
            return {"correction_mean": None, "correction_clipped_frac": None}
        local = torch.tensor([weight_sum, clipped, tokens], dtype=torch.float64, device=self.device)
        per_rank = [t.tolist() for t in self.group.all_gather(rank, local)]
        total_weight, total_clipped, total_tokens = (sum(values[i] for values in per_rank) for i in range(3))
        if total_tokens == 0:
            return {"correction_mean": None, "correction_clipped_frac": None}
        return {"correction_mean": total_weight / total_tokens, "correction_clipped_frac": total_clipped / total_tokens}
