"""A small plain-PyTorch data-parallel trainer as a subject of the harness: ``subject = "tiny_dp:subject"``.

It shares no code with the bundled reference: no MoE, no expert parallelism, no token exchange, no
graph. Each process is one data-parallel rank with a full replica of a tiny residual MLP language
model; a step computes the loss on its own synthetic batch, sums the gradients over the process
group (one flat bucket, or one all-reduce per parameter: ``sync``), clips by the global norm with
torch's ``clip_grad_norm_`` and steps AdamW. It records what a data-parallel trainer can: metrics,
each rank's loss, grad norm and replica hash, gradient digests and final weights. So the harness
can judge determinism, a pair of configs, the ranks' agreement, goldens, the first divergence and
throughput, and refuses the checks it cannot feed (token exchange, graph).

``fault = "unsynced-bias"`` plants a bug for the harness to find: rank 1 skips the gradient sum of
the last block's bias, so its replica drifts from rank 0's.

Everything the harness needs is in :func:`subject`: the seam is :mod:`harness.subject.protocol`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from harness.subject import protocol
from harness.subject.config import dataclass_arms

if TYPE_CHECKING:
    from harness.specs import ArmSpec

SYNCS = ("bucket", "per-parameter")
FAULTS = ("none", "unsynced-bias")


@dataclass(frozen=True)
class TinyConfig:
    """One arm: the model's sizes, the data, the optimizer, how gradients are summed."""

    vocab: int = 64
    hidden: int = 32
    layers: int = 2
    local_batch: int = 4
    seq_len: int = 16
    lr: float = 1e-2
    max_norm: float = 1.0
    seed: int = 0
    sync: str = "bucket"
    fault: str = "none"

    def __post_init__(self) -> None:
        if self.sync not in SYNCS:
            raise ValueError(f"sync must be one of {SYNCS}, got {self.sync!r}")
        if self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {self.fault!r}")


class TinyLM(nn.Module):
    """Embedding, residual GELU blocks, a final norm and the output head."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.blocks = nn.ModuleList(nn.Linear(config.hidden, config.hidden) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + F.gelu(block(x))
        return self.head(self.norm(x))


def synthetic_batch(config: TinyConfig, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that count up by their own stride, seeded by (seed, step, rank): learnable, reproducible."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 8_191 + rank)
    start = torch.randint(config.vocab, (config.local_batch, 1), generator=gen)
    stride = torch.randint(1, 8, (config.local_batch, 1), generator=gen)
    tokens = (start + stride * torch.arange(config.seq_len + 1)) % config.vocab
    return tokens[:, :-1], tokens[:, 1:]


class TinyDPArm(protocol.ArmBase):
    """One data-parallel rank of an arm (this process's)."""

    def __init__(self, context: protocol.ArmContext) -> None:
        self.config = TinyConfig(**context.arm.train)
        self.recorder = context.recorder
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.use_deterministic_algorithms(True)
        local = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device("cuda", local) if context.device == "cuda" else torch.device("cpu")
        self.model = TinyLM(self.config).to(self.device)  # the same init on every rank: seeded by the harness
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.lr, foreach=False)

    def step(self, step: int) -> protocol.StepRecord:
        start = time.perf_counter()
        inputs, labels = (t.to(self.device) for t in synthetic_batch(self.config, step, self.rank))
        loss = F.cross_entropy(self.model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        self._sum_gradients()
        named = dict(self.model.named_parameters())
        if self.recorder is not None:
            self.recorder.gradients(self.rank, step, {n: p.grad for n, p in named.items()})
        grad_norm = float(nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        global_loss = float(total / self.world)
        if self.recorder is not None:
            self.recorder.rank_update(self.rank, step, protocol.RankUpdate(global_loss, grad_norm, named))
        tokens = self.world * self.config.local_batch * self.config.seq_len
        return protocol.StepRecord(step, global_loss, grad_norm, tokens, time.perf_counter() - start)

    def _sum_gradients(self) -> None:
        """The data-parallel mean of every gradient: one flat all-reduce, or one per parameter."""
        grads = [p.grad for p in self.model.parameters()]
        skipped = self.model.blocks[-1].bias.grad if self.config.fault == "unsynced-bias" and self.rank == 1 else None
        if self.config.sync == "bucket":
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat)
            for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
                if g is not skipped:
                    g.copy_(summed.view_as(g))
        else:
            for g in grads:
                if g is not skipped:
                    dist.all_reduce(g)
                else:
                    dist.all_reduce(g.clone())  # the collective still runs on every rank
        for g in grads:
            g.div_(self.world)

    def final_weights(self) -> Mapping[int, Mapping[str, torch.Tensor]]:
        return {self.rank: dict(self.model.named_parameters())}


class TinyDP(protocol.SubjectBase):
    """The subject: its arms are :class:`TinyConfig` tables, one logical rank per process."""

    name = "tiny-dp"
    families = frozenset({protocol.METRICS, protocol.RANK_UPDATES, protocol.GRADIENT_DIGESTS, protocol.FINAL_WEIGHTS})
    train_fields = {f: type(v) for f, v in TinyConfig().__dict__.items()}

    def parse_arms(self, tables: protocol.SuiteTables, reader: protocol.SuiteReader) -> dict[str, ArmSpec]:
        positive = ("vocab", "hidden", "layers", "local_batch", "seq_len", "lr", "max_norm")
        return dataclass_arms(tables, reader, TinyConfig, self.families, positive, subject=f'subject "{self.name}"')

    def build(self, context: protocol.ArmContext) -> TinyDPArm:
        return TinyDPArm(context)


def subject() -> TinyDP:
    return TinyDP()
