"""torchtitan's own DeepSeek-V3 as the system under test: ``subject = "torchtitan"``.

Where an oracle arm holds torchtitan to the reference, this subject trains torchtitan itself
(0.3.0, the ``torchtitan`` extra), so that a change to torchtitan, or a choice between two of its
configs, is verified the way the reference's are: determinism, a pair of configs, the ranks'
agreement, routing counts, goldens, the first divergence, ABBA throughput.

An arm (titan_config.TitanConfig) trains in one of two modes. ``trainer = "torchtitan"``, the
default, runs torchtitan's own Trainer: its parallelize, loss, clipping, optimizer with its MoE
load-balancing hook, and LR schedule (titan_trainer.py). ``trainer = "model"`` trains torchtitan's
model in the loop below, :class:`TitanArm`: each process one expert-parallel and data-parallel rank
(torchtitan's ``dp_shard = ep``), forward and loss on its own synthetic batch, backward of the mean
loss over ranks, the dense gradients summed over the processes, global-norm clipping and AdamW.
There the model has the shape of a reference model config (built by
:func:`harness.oracles.torchtitan.titan_config`) and torchtitan's own initialisation; with 2 or more
processes torchtitan shards its experts and exchanges tokens through its ``AllToAllTokenDispatcher``
(:func:`~harness.oracles.torchtitan.expert_parallel`). ``experts = "fp32"`` replaces torchtitan's
bf16 grouped experts with the oracle's fp32 ones.

Recorded in both modes: metrics; each rank's loss, grad norm and parameters; its gradients
(digests); final weights; and a launch event around every forward dispatch and combine all-to-all
(titan_config.ExchangeEvents), for ``routing-counts``. The backward all-to-alls run inside torch's
autograd and are not recorded.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from harness import oracles
from harness.subject import protocol
from harness.subject.config import dataclass_arms
from harness.subject.titan_config import (
    IN_FLIGHT_OPS,
    ExchangeEvents,
    TitanConfig,
    grad_or_zeros,
    synthetic_batch,
)
from harness.subject.titan_trainer import TitanTrainerArm

if TYPE_CHECKING:
    from harness.op_divergence import OpRecorder
    from harness.specs import ArmSpec


class TitanArm(protocol.ArmBase):
    """This process's rank of an arm: torchtitan's model, its AdamW, its exchange events."""

    def __init__(self, context: protocol.ArmContext) -> None:
        from harness.oracles import torchtitan as titan
        from harness.reference.model import get_config

        self.config = TitanConfig(**context.arm.train)
        self.recorder = context.recorder
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cuda = context.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.cfg = get_config(self.config.model)
        spec = titan.titan_config(self.cfg, forced_balanced=self.config.routing == "forced-balanced")
        if self.world > 1:
            titan.shard_experts(spec)
        self.names = titan.Names(spec)
        # The same initialisation on every process (the harness seeded it): experts shard it after.
        self.model = titan.build(spec, fp32=self.config.experts == "fp32")
        self.model.init_states(buffer_device=self.device)
        self.model.to(self.device)
        if self.world > 1:
            titan.expert_parallel(self.model, self.world, self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.lr, foreach=False)
        self.moe_layers = [layer for layer in range(self.cfg.num_hidden_layers) if self.cfg.is_moe_layer(layer)]
        self.exchanges = ExchangeEvents(self.model, self.moe_layers, self.recorder, self.rank)
        if self.recorder is not None and context.arm.emits(protocol.TOKEN_EXCHANGE):
            self.exchanges.record()

    def step(self, step: int) -> protocol.StepRecord:
        from harness.oracles.lockstep import clip_grad_norm

        start = time.perf_counter()
        self.exchanges.step = step
        inputs, labels = (t.to(self.device) for t in synthetic_batch(self.config, self.cfg.vocab_size, step, self.rank))
        loss = F.cross_entropy(self.model(inputs).flatten(0, 1).float(), labels.flatten()) / self.world
        loss.backward()
        loss = loss.detach()
        dense = [p.grad for p in self.model.parameters() if p.grad is not None and not isinstance(p, DTensor)]
        for tensor in [loss, *dense]:  # the expert shards' gradients came back through the all-to-all
            dist.all_reduce(tensor)
        if self.recorder is not None:
            self.recorder.gradients(self.rank, step, self._named(grad_or_zeros))
        grad_norm = float(clip_grad_norm(self.model, self.config.max_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.recorder is not None:
            params = self._named(lambda p: p)
            replicated = {n: t for n, t in params.items() if ".mlp.experts." not in n}
            sharded = {n: t for n, t in params.items() if ".mlp.experts." in n}
            self.recorder.rank_update(self.rank, step, protocol.RankUpdate(float(loss), grad_norm, replicated, sharded))
        tokens = self.world * self.config.local_batch * self.config.seq_len
        return protocol.StepRecord(step, float(loss), grad_norm, tokens, time.perf_counter() - start)

    def _named(self, of: Any) -> dict[str, torch.Tensor]:
        """``of(parameter)`` for every parameter, this process's part of an expert shard, under the
        reference's (Hugging Face's) names, so that records read alike across subjects."""
        local = {n: of(p) for n, p in self.model.named_parameters()}
        local = {n: t.to_local() if isinstance(t, DTensor) else t for n, t in local.items()}
        return self.names.from_titan({n: t.detach() for n, t in local.items()})

    def record_ops(self, recorder: OpRecorder) -> None:
        """Readies the steps for ``recorder``: one rank per process, every op on this thread."""
        recorder.placeholders |= IN_FLIGHT_OPS

    def info(self) -> protocol.ArmFacts:
        """The MoE layers of the built model."""
        return protocol.ArmFacts(moe_layers=tuple(self.moe_layers))

    def final_weights(self) -> Mapping[int, Mapping[str, torch.Tensor]]:
        return {self.rank: self._named(lambda p: p)}


def arm_facts(config: TitanConfig) -> protocol.ArmFacts:
    """What the checks know of an arm: the MoE layers of its model, each exchanging its tokens whole
    or, chunked, in torchtitan's two chunks (one buffer set: torchtitan allocates each exchange's
    output), and the counts forced-balanced routing gives."""
    from harness.reference.model import get_config

    model = get_config(config.model)
    moe_layers = tuple(layer for layer in range(model.num_hidden_layers) if model.is_moe_layer(layer))
    return protocol.ArmFacts(
        moe_layers=moe_layers,
        chunks=1 if config.chunking == "none" else 2,
        num_buffer_sets=1,
        # torchtitan's chunk regions (its chunked_region_fqn): one per MoE layer, where the arm chunks
        chunk_roots=tuple(
            config.chunk_root.replace("*", str(layer)) for layer in moe_layers if config.chunking != "none"
        ),
        forced_balanced=config.routing == "forced-balanced",
        experts_per_token=model.num_experts_per_tok,
        tokens_per_step=config.local_batch * config.seq_len,
    )


class Torchtitan(protocol.SubjectBase):
    """The subject: its arms are :class:`TitanConfig` tables, one logical rank per process."""

    name = "torchtitan"
    families = frozenset(
        {
            protocol.METRICS,
            protocol.RANK_UPDATES,
            protocol.GRADIENT_DIGESTS,
            protocol.FINAL_WEIGHTS,
            protocol.TOKEN_EXCHANGE,
            protocol.GRAPH,
        }
    )
    capabilities = frozenset({protocol.RECORD_OPS})
    train_fields = {f: type(v) for f, v in TitanConfig().__dict__.items()}
    package = "torchtitan"  # what a change check (--base) takes from each revision

    def __init__(self) -> None:
        # A rank that raises in here, in the model builder, or in torchtitan itself is the subject's.
        found = importlib.util.find_spec("torchtitan")
        titan = (Path(found.origin).parent,) if found is not None and found.origin else ()
        here = Path(__file__).resolve()
        oracle = Path(oracles.__file__).resolve().parent / "torchtitan.py"
        self.source = (here, here.parent / "titan_trainer.py", oracle, *titan)

    def parse_arms(self, tables: protocol.SuiteTables, reader: protocol.SuiteReader) -> dict[str, ArmSpec]:
        if problem := oracles.missing_dependency("torchtitan"):
            raise reader.error("subject", problem)
        positive = ("local_batch", "seq_len", "lr", "max_norm")
        arms = dataclass_arms(
            tables, reader, TitanConfig, self.families, positive, subject=f'subject "{self.name}"', facts=arm_facts
        )
        for name, arm in list(arms.items()):
            config = TitanConfig(**arm.train)
            if config.ep and arm.ranks % config.ep:
                raise reader.error(f"arms.{name}.ep", f"{config.ep} does not divide the arm's {arm.ranks} ranks")
            backend = config.moe_comm_backend
            if backend != "standard" and tables.device != "cuda":
                why = f"{backend} runs on CUDA only; on {tables.device}, standard (its all-to-all, local at EP 1)"
                raise reader.error(f"arms.{name}.moe_comm_backend", why)
            # Exchanges are taken from the standard all-to-all's: none at EP 1 (local dispatch), nor of
            # another, nor of a traced step, whose dispatcher's Python ran once, at the trace.
            if (config.ep or arm.ranks) == 1 or backend != "standard" or config.traced:
                arms[name] = arm = dataclasses.replace(arm, families=_without(arm, protocol.TOKEN_EXCHANGE))
            # Only a traced step has a graph: its collectives, from torchtitan's traced step.
            if not config.traced:
                arms[name] = dataclasses.replace(arm, families=_without(arm, protocol.GRAPH))
        return arms

    def record_ops(self, arm: protocol.Arm, recorder: OpRecorder) -> None:
        arm.record_ops(recorder)

    def build(self, context: protocol.ArmContext) -> protocol.Arm:
        if TitanConfig(**context.arm.train).trainer == "model":
            return TitanArm(context)
        return TitanTrainerArm(context)


def _without(arm: ArmSpec, family: str) -> tuple[str, ...]:
    return tuple(f for f in arm.families if f != family)


def subject() -> Torchtitan:
    return Torchtitan()
