"""PEC: the token embedding sharded row-wise, its gradient all-to-all driven by the training pipeline.

After torchrec's ``PECAll2AllSeqWait``, ``PECGradientApply`` and the train pipeline's ``grad_dist``
as of PR #4498. ``model.embed_tokens`` becomes a :class:`ShardedEmbedding`: logical EP rank ``r``
of ``E`` owns the contiguous rows ``[r*V/E, (r+1)*V/E)`` of the ``V``-row table. A lookup sends the
batch's distinct ids to their owners and gets the rows back (two all-to-alls). The table trains
outside autograd and AdamW, by a fused row-wise optimizer on the owner (:class:`RowwiseOptimizer`).

**OL and NOL.** The OL ids of batch N are those of the EP group's batch N (any logical rank) that
also occur in its batch N+1; NOL ids are the rest; on the last batch every id is OL. A NOL row is
not read by batch N+1, so its update may wait until then; an OL row must be updated before the
lookups of batch N+1.

**Autograd does no communication.** :class:`PECAll2AllSeqWait`'s backward sums the output gradient
per distinct id (in position order), splits it into an OL and a NOL :class:`PECGradientApply`, and
returns no gradient. ``dist()`` starts the asynchronous all-to-all of the gradient rows to their
owners and is idempotent; ``apply()`` waits, sums the rows of one id over source ranks in
logical-rank order, and steps the row-wise optimizer. Only the legacy trainer starts OL inside
backward (torchrec before #4498).

**Trainers** (:data:`PEC_TRAINERS`), for batch N:

* ``pipelined``: 1 lookups of N; 2 start NOL N-1; 3 forward N; 4 apply NOL N-1; 5 backward N;
  6 start OL N; 7 dense optimizer step (clip and AdamW), overlapping that all-to-all; 8 apply OL N;
  9 NOL N waits for batch N+1; 10 on the last batch, drain NOL in place.
* ``sequential``: after backward N, start and apply OL N, then NOL N; then the optimizer step.
* ``legacy``: pipelined, but backward N starts OL N itself (the pipeline's start is then a no-op).

Every lookup sees the rows every earlier batch updated, so the three train bit for bit alike.
Backward N means autograd's backward and the data-parallel sum of the replicated gradients (DDP
runs that inside backward). The grad norm (reported and clipped) covers the dense and expert
parameters only: the table's rows are neither counted nor clipped, as torchrec's fused optimizers
are not, so it does not depend on when the rows travel.

**Events** (``pec_sink(logical_rank, event)``), one per lookup, start, apply, end of backward and
dense optimizer step, in order, with the fields of :meth:`PECEvents.emit`. ``start`` lists the
gradient ids this rank sends, ``apply`` the owned ids it updates. Every logical rank emits the
same sequence of lookups, starts and applies (the collectives are in lockstep), with its own ids.

**Faults** (:data:`PEC_FAULTS`). Of the pipeline (pipelined only): ``nol-two-late`` starts and
applies NOL N during batch N+2 (the drain applies what is left); ``ol-before-backward`` starts OL N
after autograd but before the gradient sum ends backward; ``no-drain`` leaves NOL of the last batch
unstarted; ``ol-as-nol`` classifies each batch's smallest OL id as NOL. Of the table (any trainer:
every trainer shares this code, so only an independent implementation sees them):
``adagrad-overwrite`` sets row-wise Adagrad's state to the step's mean squared gradient instead of
adding it; ``sum-one-source`` keeps, per id, one source rank's gradient row instead of the sum over
source ranks.

**Checkpoint** (:meth:`PECTrainer.in_flight_state`): between batches, the row-wise optimizer's
state and every gradient part not yet applied (pipelined: the last batch's NOL part, not yet
started). A loaded trainer starts and applies only what it holds: the pipeline's filling rule skips
the batches before the oldest of them.

**Batches** (:class:`PECBatches`): batch N draws each logical rank's tokens uniformly from a pool of
ids common to the EP group. Pool N+1 keeps ``round(pec_overlap * size)`` ids of pool N and draws
the rest from the ids outside it, so ``pec_overlap`` is the fraction of batch N+1's candidate ids
drawn from batch N's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from harness.reference.ep.exchange import EventSink, bind
from harness.reference.ep.group import LogicalGroup, PendingExchange
from harness.reference.model import DeepseekV3ForCausalLM, causal_lm_loss
from harness.reference.train import GradSink, TrainConfig, Trainer, UpdateSink

PEC_TRAINERS = ("pipelined", "sequential", "legacy")
PEC_OPTIMIZERS = ("rowwise-sgd", "rowwise-adagrad")
PIPELINE_FAULTS = ("nol-two-late", "ol-before-backward", "no-drain", "ol-as-nol")
TABLE_FAULTS = ("adagrad-overwrite", "sum-one-source")
PEC_FAULTS = ("none", *PIPELINE_FAULTS, *TABLE_FAULTS)
PEC_CHUNKINGS = ("none", "eager")
MODULE = "model.embed_tokens"
ADAGRAD_EPS = 1e-8  # fbgemm's default for row-wise Adagrad

# Called with (logical rank, event) for every PEC event of that rank, on its thread.
PECSink = Callable[[int, dict], None]


@dataclass(frozen=True)
class PECConfig(TrainConfig):
    """A :class:`TrainConfig` whose token embedding is a PEC table (see the module docstring)."""

    pec: str = "pipelined"  # which trainer drives the table's gradient all-to-alls (PEC_TRAINERS)
    pec_optimizer: str = "rowwise-adagrad"  # the table's fused row-wise optimizer, at learning rate lr
    pec_overlap: float = 0.5  # the fraction of batch N+1's candidate ids drawn from batch N's
    pec_fault: str = "none"  # a planted pipeline bug (PEC_FAULTS), for the harness's negative tests

    def checkpoint_faults(self) -> tuple[str, ...]:
        """The AdamW state left out, or the pending NOL gradient part (PECTrainer.in_flight_state)."""
        return ("optimizer-not-saved", "pending-nol-dropped")

    def __post_init__(self) -> None:
        super().__post_init__()
        cfg = self.model_config()
        if self.pec not in PEC_TRAINERS:
            raise ValueError(f"pec must be one of {PEC_TRAINERS}, got {self.pec!r}")
        if self.pec_optimizer not in PEC_OPTIMIZERS:
            raise ValueError(f"pec_optimizer must be one of {PEC_OPTIMIZERS}, got {self.pec_optimizer!r}")
        if not 0.0 <= self.pec_overlap <= 1.0:
            raise ValueError(f"pec_overlap must be a fraction in [0, 1], got {self.pec_overlap!r}")
        if self.pec_fault not in PEC_FAULTS:
            raise ValueError(f"pec_fault must be one of {PEC_FAULTS}, got {self.pec_fault!r}")
        if self.pec_fault in PIPELINE_FAULTS and self.pec != "pipelined":
            raise ValueError(f"pec_fault {self.pec_fault!r} breaks the pipelined trainer: it needs pec = 'pipelined'")
        if self.chunking not in PEC_CHUNKINGS:
            raise ValueError(f"chunking must be one of {PEC_CHUNKINGS} with a PEC table, got {self.chunking!r}")
        if cfg.vocab_size % self.ep:
            raise ValueError(f"ep {self.ep} does not divide the vocabulary ({cfg.vocab_size} rows) of {self.model}")
        if cfg.tie_word_embeddings or cfg.pad_token_id is not None:
            raise ValueError(f"model {self.model}: a PEC table needs untied embeddings and no pad_token_id")


class PECBatches:
    """One logical rank's synthetic batches 1, 2, ...; every rank derives the same pools."""

    def __init__(self, config: PECConfig, vocab: int, rank: int) -> None:
        self._config, self._vocab, self._rank = config, vocab, rank
        tokens = config.ep * config.local_batch * (config.seq_len + 1)
        self.pool_size = max(1, min(vocab // 2, tokens // 4))  # most of a pool occurs in its batch
        self._pools: list[torch.Tensor] = []

    def pool(self, batch: int) -> torch.Tensor:
        """The ids batch ``batch`` draws from; pool N+1 keeps ``round(pec_overlap * size)`` of pool N."""
        while len(self._pools) < batch:
            gen = torch.Generator().manual_seed(self._config.seed * 1_000_003 + (len(self._pools) + 1) * 8_191)
            if not self._pools:
                self._pools.append(torch.randperm(self._vocab, generator=gen)[: self.pool_size])
                continue
            previous = self._pools[-1]
            kept = previous[
                torch.randperm(self.pool_size, generator=gen)[: round(self._config.pec_overlap * self.pool_size)]
            ]
            outside = torch.ones(self._vocab, dtype=torch.bool)
            outside[previous] = False
            fresh = outside.nonzero().flatten()
            fresh = fresh[torch.randperm(fresh.numel(), generator=gen)[: self.pool_size - kept.numel()]]
            self._pools.append(torch.cat([kept, fresh]))
        return self._pools[batch - 1]

    def batch(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)`` of this rank, seeded by (seed, batch, rank) like ``synthetic_batch``."""
        config = self._config
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + batch * 8_191 + self._rank)
        pool = self.pool(batch)
        tokens = pool[torch.randint(pool.numel(), (config.local_batch, config.seq_len + 1), generator=gen)]
        return tokens[:, :-1], tokens[:, 1:]


def split_overlap(ids: torch.Tensor, next_ids: torch.Tensor | None) -> torch.Tensor:
    """Which of batch N's distinct ``ids`` are OL: those in batch N+1's ``next_ids`` (all, on the last batch)."""
    if next_ids is None:
        return torch.ones_like(ids, dtype=torch.bool)
    return torch.isin(ids, next_ids)


class PECEvents:
    """One logical rank's PEC event stream: numbers its events and hands them to the sink."""

    def __init__(self, rank: int, sink: PECSink | None) -> None:
        self.rank, self._sink = rank, sink
        self.seq = 0  # the next event's number (a checkpoint keeps it, so a resumed stream goes on)
        self.call = 0  # the pipeline progress call (batch number) running on this rank

    def emit(
        self, op: str, batch: int, part: str | None = None, ids: torch.Tensor | None = None, module: str = MODULE
    ) -> None:
        """``{seq, call, op, batch, part, module, rows, ids, in_autograd}``; ``ids`` distinct and sorted.
        ``module`` names the table of a start or apply: an oracle's own table shares this stream."""
        listed = [] if ids is None else ids.tolist()
        event = {
            "seq": self.seq,
            "call": self.call,
            "op": op,
            "batch": batch,
            "part": part,
            "module": module if part is not None else None,
            "rows": len(listed),
            "ids": listed,
            "in_autograd": torch._C._current_graph_task_id() != -1,
        }
        self.seq += 1
        if self._sink is not None:
            self._sink(self.rank, event)


class RowwiseOptimizer:
    """A fused row-wise optimizer on one shard, torchrec style: one state value per row (Adagrad)."""

    def __init__(self, kind: str, weight: torch.Tensor, lr: float, overwrite: bool = False) -> None:
        self.kind, self.weight, self.lr = kind, weight, lr
        self.overwrite = overwrite  # the planted fault adagrad-overwrite
        self.state = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)

    @torch.no_grad()
    def step(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Update the shard's ``rows`` (distinct local indices) by their summed gradients."""
        grads = grads.float()
        if self.kind == "rowwise-adagrad":
            if self.overwrite:
                self.state[rows] = grads.pow(2).mean(1)
            else:
                self.state[rows] += grads.pow(2).mean(1)
            grads = grads / (self.state[rows].sqrt() + ADAGRAD_EPS).unsqueeze(1)
        self.weight[rows] = (self.weight[rows].float() - self.lr * grads).to(self.weight.dtype)


class ShardedEmbedding(nn.Module):
    """``model.embed_tokens`` as logical rank ``rank``'s row shard of the table; lookups ask the owners."""

    def __init__(
        self, table: torch.Tensor, group: LogicalGroup, rank: int, config: PECConfig, events: PECEvents
    ) -> None:
        super().__init__()
        self.group, self.rank, self.events = group, rank, events
        self.rows_per_rank = table.shape[0] // group.ep
        self.first_row = rank * self.rows_per_rank
        own = table[self.first_row : self.first_row + self.rows_per_rank].detach().clone()
        self.weight = nn.Parameter(own, requires_grad=False)  # trained by self.optimizer, not autograd
        self.optimizer = RowwiseOptimizer(
            config.pec_optimizer, self.weight, config.lr, overwrite=config.pec_fault == "adagrad-overwrite"
        )
        self.one_source = config.pec_fault == "sum-one-source"
        self.legacy = config.pec == "legacy"
        self.ol_as_nol = config.pec_fault == "ol-as-nol"
        self.gradients: dict[tuple[int, str], PECGradientApply] = {}  # (batch, part), until applied
        self.looked_up: Lookup | None = None  # the batch looked up for the next forward

    def exchange(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int], PendingExchange]:
        """Start sending ``send_counts[d]`` rows of ``send`` to logical rank ``d``; the receive counts
        are exchanged first unless given. Returns the receive buffer, its counts and the exchange."""
        if recv_counts is None:
            sizes = torch.tensor(send_counts, dtype=torch.int64, device=send.device)  # nccl gathers on the GPU
            counts = self.group.all_gather(self.rank, sizes)
            recv_counts = [int(c[self.rank]) for c in counts]
        out = send.new_empty((sum(recv_counts), *send.shape[1:]))
        return out, recv_counts, self.group.all_to_all(self.rank, send, send_counts, recv_counts, out)

    def owner_counts(self, ids: torch.Tensor) -> list[int]:
        """Rows of the sorted ``ids`` per owning logical rank (contiguous: owners own contiguous ranges)."""
        return torch.bincount(ids // self.rows_per_rank, minlength=self.group.ep).tolist()

    def lookup(self, batch: int, inputs: torch.Tensor, seen: torch.Tensor, upcoming: torch.Tensor | None) -> None:
        """Fetch the rows of ``inputs`` from their owners for the next forward; ``seen`` are the EP group's
        ids of batch N-1 (lookup part OL: they waited for OL N-1), ``upcoming`` those of batch N+1."""
        ids, inverse = torch.unique(inputs, sorted=True, return_inverse=True)
        counts = self.owner_counts(ids)
        wanted, recv_counts, pending = self.exchange(ids, counts)
        pending.wait()
        rows, _, pending = self.exchange(self.weight.detach()[wanted - self.first_row], recv_counts, counts)
        pending.wait()
        after_ol = torch.isin(ids, seen)
        self.events.emit("lookup", batch, "OL", ids[after_ol])
        self.events.emit("lookup", batch, "NOL", ids[~after_ol])
        overlapped = split_overlap(ids, upcoming)
        if self.ol_as_nol and overlapped.any():
            overlapped[overlapped.nonzero()[0]] = False
        self.looked_up = Lookup(batch, inputs, ids, inverse, rows.requires_grad_(True), overlapped)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        lookup = self.looked_up
        if lookup is None or not torch.equal(lookup.inputs, input_ids):
            raise RuntimeError(f"logical rank {self.rank}: forward of ids that were not looked up (call lookup first)")
        self.looked_up = None
        return PECAll2AllSeqWait.apply(lookup.rows, self, lookup)

    def take(self, batch: int, part: str) -> PECGradientApply:
        """The gradient of ``part`` of ``batch`` that backward handed over and nobody applied yet."""
        try:
            return self.gradients[(batch, part)]
        except KeyError:
            raise RuntimeError(
                f"logical rank {self.rank}: no pending {part} gradient of batch {batch}"
                f" (pending: {sorted(self.gradients)})"
            ) from None


@dataclass
class Lookup:
    """A batch's looked-up rows, until its forward; ``overlapped`` marks the OL ids among ``ids``."""

    batch: int
    inputs: torch.Tensor
    ids: torch.Tensor
    inverse: torch.Tensor
    rows: torch.Tensor
    overlapped: torch.Tensor


class PECAll2AllSeqWait(torch.autograd.Function):
    """Embedding output from the looked-up rows; backward only splits its gradient into OL and NOL."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, table: ShardedEmbedding, lookup: Lookup) -> torch.Tensor:
        ctx.table, ctx.lookup = table, lookup
        return rows[lookup.inverse]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        table, lookup = ctx.table, ctx.lookup
        per_id = grad.new_zeros((lookup.ids.numel(), grad.shape[-1]))
        per_id.index_add_(0, lookup.inverse.flatten(), grad.flatten(0, -2))  # in position order
        for part, mask in (("OL", lookup.overlapped), ("NOL", ~lookup.overlapped)):
            table.gradients[(lookup.batch, part)] = PECGradientApply(
                table, lookup.batch, part, lookup.ids[mask], per_id[mask]
            )
        if table.legacy:  # torchrec before #4498: backward fires the OL all-to-all itself
            table.gradients[(lookup.batch, "OL")].dist()
        return None, None, None


class PECGradientApply:
    """One part (OL or NOL) of one batch's table gradient on one logical rank: ``dist()`` starts its
    all-to-all to the owners, once; ``apply()`` waits and steps the owners' row-wise optimizer."""

    def __init__(self, table: ShardedEmbedding, batch: int, part: str, ids: torch.Tensor, grads: torch.Tensor) -> None:
        self.table, self.batch, self.part, self.ids, self.grads = table, batch, part, ids, grads
        self._in_flight: tuple[torch.Tensor, list[int], torch.Tensor, list[PendingExchange]] | None = None

    @property
    def started(self) -> bool:
        """Whether :meth:`dist` started its all-to-all (and its rows are on their way)."""
        return self._in_flight is not None

    def dist(self) -> None:
        """Start the asynchronous all-to-all of the gradient rows to their owners; idempotent."""
        if self._in_flight is not None:
            return
        table = self.table
        table.events.emit("start", self.batch, self.part, self.ids)
        counts = table.owner_counts(self.ids)
        recv_ids, recv_counts, ids_sent = table.exchange(self.ids, counts)
        recv_grads, _, grads_sent = table.exchange(self.grads, counts, recv_counts)
        self._in_flight = (recv_ids, recv_counts, recv_grads, [ids_sent, grads_sent])

    def apply(self) -> None:
        """Wait for the rows, sum each id's rows over source ranks in logical-rank order, step the optimizer."""
        if self._in_flight is None:
            raise RuntimeError(f"apply of the {self.part} gradient of batch {self.batch} before its dist()")
        table = self.table
        if table.gradients.pop((self.batch, self.part), None) is not self:
            raise RuntimeError(f"the {self.part} gradient of batch {self.batch} is applied twice")
        recv_ids, recv_counts, recv_grads, pending = self._in_flight
        for exchange in pending:
            exchange.wait()
        ids, position = torch.unique(recv_ids, sorted=True, return_inverse=True)
        if table.one_source:  # the planted fault: one source rank's row per id overwrites the others'
            summed = recv_grads.new_zeros((ids.numel(), recv_grads.shape[-1]))
            summed[position] = recv_grads
        else:
            source = torch.repeat_interleave(torch.arange(len(recv_counts)), torch.tensor(recv_counts))
            per_source = recv_grads.new_zeros((len(recv_counts), ids.numel(), recv_grads.shape[-1]))
            per_source[source.to(recv_ids.device), position] = recv_grads
            summed = per_source.sum(0)
        table.optimizer.step(ids - table.first_row, summed)
        table.events.emit("apply", self.batch, self.part, ids)


# Each trainer's gradient all-to-alls, as (op, part, lag) per point of the step: the action concerns
# the batch ``lag`` batches before the running one. Points run in this order.
POINTS = ("before_forward", "before_backward", "after_autograd", "after_backward", "after_optimizer")
Action = tuple[str, str, int]
_PIPELINED: dict[str, list[Action]] = {
    "before_forward": [("start", "NOL", 1)],
    "before_backward": [("apply", "NOL", 1)],
    "after_backward": [("start", "OL", 0)],
    "after_optimizer": [("apply", "OL", 0)],
}
SCHEDULES: dict[str, dict[str, list[Action]]] = {
    "pipelined": _PIPELINED,
    "legacy": _PIPELINED,  # backward starts OL first; the pipeline's start finds it started
    "sequential": {
        "after_backward": [("start", "OL", 0), ("apply", "OL", 0), ("start", "NOL", 0), ("apply", "NOL", 0)]
    },
}


def schedule(config: PECConfig) -> dict[str, list[Action]]:
    """The trainer's actions per point, with its planted fault (if any) edited in."""
    actions = {point: list(SCHEDULES[config.pec].get(point, [])) for point in POINTS}
    if config.pec_fault == "nol-two-late":
        actions["before_forward"] = [("start", "NOL", 2)]
        actions["before_backward"] = [("apply", "NOL", 2)]
    elif config.pec_fault == "ol-before-backward":
        actions["after_backward"].remove(("start", "OL", 0))
        actions["after_autograd"].append(("start", "OL", 0))
    return actions


class PECTrainer(Trainer):
    """Trains with ``model.embed_tokens`` as a PEC table over the logical EP ranks, for ``batches``
    batches numbered 1..batches (the last one drains); the seam is Trainer's plus ``pec_sink``."""

    def __init__(
        self,
        config: PECConfig,
        event_sink: EventSink | None = None,
        grad_sink: GradSink | None = None,
        update_sink: UpdateSink | None = None,
        *,
        pec_sink: PECSink | None = None,
        batches: int,
    ) -> None:
        if batches < 1:
            raise ValueError(f"batches must be >= 1, got {batches}")
        self.tables: dict[int, ShardedEmbedding] = {}
        self._pec_sink = pec_sink
        super().__init__(config, event_sink, grad_sink, update_sink)  # builds the tables (_prepare_model)
        self.config: PECConfig = config
        self.batches = batches
        self.actions = schedule(config)
        self.drains = config.pec != "sequential" and config.pec_fault != "no-drain"
        self.data = {r: PECBatches(config, self.cfg.vocab_size, r) for r in self.logical_ranks}
        self._done = 0  # batches trained
        self._first_batch = 1  # the oldest batch whose table gradient this trainer holds or will hold
        self._known_ids: dict[int, dict[int, torch.Tensor]] = {r: {} for r in self.logical_ranks}

    def _prepare_model(self, rank: int, model: DeepseekV3ForCausalLM) -> None:
        table = model.model.embed_tokens.weight.detach()
        events = PECEvents(rank, self._pec_sink)
        self.tables[rank] = ShardedEmbedding(table, self.group, rank, self.config, events)
        model.model.embed_tokens = self.tables[rank]

    def step(self, step: int) -> dict:
        """Train batch ``step``; batches run in order, 1..batches."""
        if step != self._done + 1 or step > self.batches:
            raise ValueError(f"PEC batches run in order 1..{self.batches}: expected {self._done + 1}, got {step}")
        record = super().step(step)
        self._done = step
        return record

    def _rank_step(self, rank: int, step: int) -> tuple[float, float]:
        replica, table = self.replicas[rank], self.tables[rank]
        replica.exchange.step = table.events.call = step
        inputs, labels = (t.to(self.device) for t in self.data[rank].batch(step))
        last = step == self.batches
        seen = self._group_ids(rank, step - 1)
        upcoming = None if last else self._group_ids(rank, step + 1)
        table.lookup(step, inputs, seen, upcoming)
        self._act(rank, step, "before_forward")
        with bind(replica.exchange):
            loss = causal_lm_loss(replica.model(inputs), labels)
            self._act(rank, step, "before_backward")
            (loss / self.config.ep).backward()
        self._act(rank, step, "after_autograd")
        self._reduce_gradients(rank, step)
        table.events.emit("backward_done", step)
        self._act(rank, step, "after_backward")
        grad_norm = self._optimizer_step(rank)
        table.events.emit("optimizer_step", step)
        self._act(rank, step, "after_optimizer")
        if last and self.drains:
            for batch, part in sorted(table.gradients):
                gradient = table.gradients[(batch, part)]
                gradient.dist()
                gradient.apply()
        return self._finish_step(rank, step, loss, grad_norm)

    def _act(self, rank: int, step: int, point: str) -> None:
        table = self.tables[rank]
        for op, part, lag in self.actions[point]:
            if step - lag < self._first_batch:
                continue  # no such batch yet (the pipeline is filling), or none that a loaded checkpoint held
            gradient = table.take(step - lag, part)
            if op == "start":
                gradient.dist()
            else:
                gradient.apply()

    def in_flight_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per logical rank, between two batches: the row-wise optimizer's state (the table's rows are
        a model parameter), each gradient part that backward handed over and nobody applied yet
        (pipelined: the last batch's NOL part, not yet started), the event and batch counters. The
        planted fault ``pending-nol-dropped`` leaves the pending NOL parts out."""
        state = {}
        for rank, table in self.tables.items():
            tensors = {
                "trainer": torch.tensor(self._done),
                "events": torch.tensor(table.events.seq),
                "rowwise_state": table.optimizer.state,
            }
            for (batch, part), gradient in table.gradients.items():
                if gradient.started:
                    raise RuntimeError(f"the {part} gradient of batch {batch} is in flight: no checkpoint mid-exchange")
                if part == "NOL" and self.config.checkpoint_fault == "pending-nol-dropped":
                    continue
                tensors[f"gradient.{batch}.{part}.ids"] = gradient.ids
                tensors[f"gradient.{batch}.{part}.grads"] = gradient.grads
            state[rank] = tensors
        return state

    def load_in_flight(self, state: dict[int, dict[str, torch.Tensor]]) -> None:
        """Restores what :meth:`in_flight_state` saved. The pipeline goes on with exactly the gradients
        the checkpoint holds: a batch before the oldest of them has nothing left to start or apply
        (the filling rule of :meth:`_act`), so a gradient the save left out is silently lost, as a
        real checkpoint bug would lose it, and only the numbers show it."""
        for rank, tensors in state.items():
            table = self.tables[rank]
            table.optimizer.state.copy_(tensors["rowwise_state"])
            table.events.seq = int(tensors["events"])
            table.gradients = {}
            for key in sorted(k for k in tensors if k.startswith("gradient.") and k.endswith(".ids")):
                _, batch, part, _ = key.split(".")
                ids, grads = (tensors[f"gradient.{batch}.{part}.{t}"].to(self.device) for t in ("ids", "grads"))
                table.gradients[(int(batch), part)] = PECGradientApply(table, int(batch), part, ids, grads)
        self._done = int(state[self.logical_ranks[0]]["trainer"])
        held = [batch for table in self.tables.values() for batch, _ in table.gradients]
        self._first_batch = min(held, default=self._done + 1)

    def _group_ids(self, rank: int, batch: int) -> torch.Tensor:
        """The distinct ids of the EP group's batch ``batch`` (none before batch 1), gathered once from
        every logical rank's own batch: a collective that every logical rank runs alike."""
        known = self._known_ids[rank]
        if batch not in known:
            present = torch.zeros(self.cfg.vocab_size, dtype=torch.uint8)
            if batch >= 1:
                present[self.data[rank].batch(batch)[0].flatten()] = 1
            everywhere = torch.stack(self.group.all_gather(rank, present.to(self.device))).amax(0)
            known[batch] = everywhere.nonzero().flatten().to(self.device)
        for old in [b for b in known if b < batch - 2]:
            del known[old]
        return known[batch]
