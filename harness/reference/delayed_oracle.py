"""Delayed-gradient training written the obvious way: the oracle the versioned pipeline must equal.

:class:`~harness.reference.pipeline.VersionedTrainer` gets delayed gradients through snapshots,
forward records kept until their backward, retention modes, voted transactional commits and a
cotangent hook. This trainer computes the same updates from the definition, with none of that
machinery and no code of ``versioned.py`` or ``pipeline.py`` (only the arm's ``PipelineConfig``):

* Update ``u`` (counted from 0, at revision ``u``) applies the ``u``-th batch received. Its loss
  and gradient are taken at the weights of revision ``max(0, u - delay)``: ``delay`` updates back,
  or revision 0 for the first ``delay`` batches, which arrive while the pipeline fills and nothing
  has been updated yet. Its age is the difference of the two revisions.
* Ticks match the pipeline's: ``step(batch)`` receives one batch and applies the oldest one waiting
  once ``delay`` newer ones wait behind it; ``drain()`` applies the rest, one per tick.
* The importance correction weighs each selected token by
  ``w = min(exp(lp_now - lp_then), correction_clip)``, where ``lp_then`` are the selected-token
  log-probs under the forward's (old) weights and ``lp_now`` under the current ones, and the
  gradient is that of ``-mean(w * lp_then)`` (the reported loss stays the plain mean NLL).
  ``lp_now`` exists when a forward already ran at the current weights: for a batch of age 0 the
  forward itself (``w`` is then exactly 1). ``always`` runs a no-grad forward at the current weights
  for a stale batch; ``when_available`` leaves a stale batch uncorrected.

Each update, on every logical rank: keep a deep copy of the weights of every revision an update may
still need (the current one and the ``delay`` before it); for a stale batch under ``always``, the
current log-probs; copy the old weights into the model, forward, backward of the (weighted)
objective, copy the current weights back; then Trainer's dense-gradient sum, global-norm clipping
and AdamW step, and a copy of the new weights.
"""

from __future__ import annotations

import time
from collections import deque

import torch
from torch import nn

from harness.reference.ep.exchange import EventSink, bind
from harness.reference.model import causal_lm_loss
from harness.reference.pipeline import PipelineConfig
from harness.reference.train import GradSink, Trainer, UpdateSink, synthetic_batch

Weights = dict[str, torch.Tensor]


def copy_weights(model: nn.Module) -> Weights:
    """A deep copy of the model's parameters, by name."""
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def load_weights(model: nn.Module, weights: Weights) -> None:
    """Overwrite the model's parameters in place (the optimizer keeps its state per parameter)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])


def selected_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under ``logits``, in fp32, one per token: ``[batch * seq]``."""
    logprobs = torch.log_softmax(logits.flatten(0, 1).float(), dim=-1)
    return logprobs.gather(1, labels.flatten().unsqueeze(1)).squeeze(1)


class DelayedOracleTrainer(Trainer):
    """Drives this process's logical EP ranks through delayed-gradient training, from the definition.

    Same seam and records as ``VersionedTrainer``: ``step(batch)`` per tick (``None`` while the
    pipeline fills), ``drain()``, and records with ``tick``, ``revision``, ``ages``,
    ``batches_applied``, ``correction_mean``, ``correction_clipped_frac``, ``forwards`` and
    ``recomputes`` (always 0: nothing is replayed) besides Trainer.step's fields.
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
        # Per logical rank: revision -> a copy of the weights at that revision, for the revisions still needed.
        self._weights = {r: {0: copy_weights(replica.model)} for r, replica in self.replicas.items()}
        self._waiting: deque[int] = deque()  # batches received and not yet applied, oldest first
        self._ticks = 0
        self._updates = 0
        self._seconds = 0.0  # since the previous record

    def step(self, step: int) -> dict | None:
        """One tick: receive batch ``step``; apply the oldest waiting batch if ``delay`` wait behind it."""
        self._waiting.append(step)
        return self._tick(self._waiting.popleft() if len(self._waiting) > self.config.delay else None)

    def drain(self) -> list[dict]:
        """Apply every waiting batch, one update per tick, receiving none."""
        records = []
        while self._waiting:
            records.append(self._tick(self._waiting.popleft()))
        return records

    def _tick(self, batch: int | None) -> dict | None:
        start = time.perf_counter()
        tick, revision = self._ticks, self._updates
        self._ticks += 1
        if batch is None:
            self._seconds += time.perf_counter() - start
            return None
        origin = max(0, revision - self.config.delay)
        results = self._on_every_rank(lambda rank: self._rank_update(rank, tick, batch, origin, revision))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._seconds += time.perf_counter() - start
        record = {
            "step": revision,
            "tick": tick,
            **results[self.logical_ranks[0]],
            "revision": revision,
            "ages": [revision - origin],
            "batches_applied": [batch],
            "tokens": self.config.ep * self.config.local_batch * self.config.seq_len,
            "step_time_s": self._seconds,
            "recomputes": 0,
        }
        self._updates += 1
        self._seconds = 0.0
        return record

    def _rank_update(self, rank: int, tick: int, batch: int, origin: int, revision: int) -> dict:
        """Apply ``batch``'s gradient at the weights of ``origin`` to the weights of ``revision``."""
        replica, weights, config = self.replicas[rank], self._weights[rank], self.config
        model = replica.model
        replica.exchange.step = tick
        inputs, labels = (t.to(self.device) for t in synthetic_batch(config, self.cfg.vocab_size, batch, rank))
        stale = origin < revision
        corrected = config.correction != "off"
        lp_now = None
        forwards = 1
        with bind(replica.exchange):
            if stale and config.correction == "always":
                with torch.no_grad():
                    lp_now = selected_logprobs(model(inputs), labels)
                forwards += 1
            load_weights(model, weights[origin])
            logits = model(inputs)
            loss = causal_lm_loss(logits, labels)
            lp_then = selected_logprobs(logits, labels) if corrected else None
            if corrected and not stale:
                lp_now = lp_then.detach()  # the forward ran at the current weights
            weight = clipped = None
            if lp_now is not None:
                ratio = torch.exp(lp_now - lp_then.detach())
                weight, clipped = ratio.clamp(max=config.correction_clip), ratio > config.correction_clip
            objective = loss if weight is None else -(weight * lp_then).mean()
            (objective / config.ep).backward()
            load_weights(model, weights[revision])
        self._sum_dense_grads(rank, replica)
        if self.grad_sink is not None:
            self.grad_sink(rank, revision, {n: p.grad for n, p in model.named_parameters()})
        grad_norm = self._clip_by_global_norm(rank, replica)
        replica.optimizer.step()
        replica.optimizer.zero_grad(set_to_none=True)
        weights[revision + 1] = copy_weights(model)
        for old in [r for r in weights if r < revision + 1 - config.delay]:
            del weights[old]
        losses = self.group.all_gather(rank, loss.detach().float().reshape(()))
        global_loss = float(torch.stack(losses).sum() / config.ep)
        self._report_update(rank, revision, global_loss, float(grad_norm))
        return {
            "loss": global_loss,
            "grad_norm": float(grad_norm),
            "forwards": forwards,
            **self._correction_stats(rank, weight, clipped),
        }

    def _correction_stats(self, rank: int, weight: torch.Tensor | None, clipped: torch.Tensor | None) -> dict:
        """Mean weight and clipped fraction over every logical rank's tokens; None where uncorrected."""
        if weight is None:  # the same on every rank: they all apply a batch of the same age
            return {"correction_mean": None, "correction_clipped_frac": None}
        gathered = self.group.all_gather(rank, torch.stack([weight, clipped.to(weight.dtype)]))
        every = torch.cat(gathered, dim=1).double()
        return {
            "correction_mean": float(every[0].sum()) / every.shape[1],
            "correction_clipped_frac": float(every[1].sum()) / every.shape[1],
        }
