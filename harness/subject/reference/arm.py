"""One arm of the bundled reference in a rank process: its trainer, and the reference's sinks
turned into the harness's :class:`~harness.subject.protocol.Recorder` calls.

The trainer follows the arm's config: ``Trainer`` for a plain arm (traced or eager chunking),
``VersionedTrainer`` or ``DelayedOracleTrainer`` for a versioned one (``trainer``), ``PECTrainer`` for
a PEC table, and an oracle's model in lockstep (:mod:`harness.oracles.lockstep`; the oracle's
module imported only then) for an arm with ``oracle = "hf"`` or ``"torchtitan"``; a PEC arm with
``oracle = "torchrec"`` runs ``PECTrainer`` with torchrec's table beside it
(:mod:`harness.oracles.torchrec`). A versioned trainer counts its updates from 0 and its batches
like steps; here its update k becomes step k + 1, so that at delay 0 it trains on the data a plain
Trainer sees at the same step, and the two compare exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from harness.reference.chunking.trace_cache import GraphCache
from harness.reference.delayed_oracle import DelayedOracleTrainer
from harness.reference.pec import PECConfig, PECTrainer
from harness.reference.pipeline import PipelineConfig, VersionedTrainer
from harness.reference.train import RankUpdate as ReferenceUpdate
from harness.reference.train import Trainer
from harness.subject.protocol import (
    ArmBase,
    ArmContext,
    ArmFacts,
    CheckpointRefused,
    OpsNotRecordable,
    RankUpdate,
    StepRecord,
)
from harness.subject.reference.arms import train_config
from harness.subject.reference.op_trace import prepare_recording

if TYPE_CHECKING:
    from harness.op_divergence import OpRecorder

# PipelineConfig.trainer -> the class that runs such an arm.
PIPELINE_TRAINERS: dict[str, type[Trainer]] = {"versioned": VersionedTrainer, "delayed-oracle": DelayedOracleTrainer}
_STEP_FIELDS = ("step", "loss", "grad_norm", "tokens", "step_time_s")


class ReferenceArm(ArmBase):
    """The reference's trainer for one arm, behind the harness's Arm protocol."""

    def __init__(self, context: ArmContext) -> None:
        self.config = train_config(context.arm.train)
        self.oracle = context.arm.oracle
        self.offset = 1 if isinstance(self.config, PipelineConfig) else 0
        self.data_offset = 0  # a resumed arm's batches: its data position against the harness's step
        self.resumed_from: int | None = None
        self.trainer = self._trainer(context)

    def _trainer(self, context: ArmContext) -> Any:
        config, recorder = self.config, context.recorder
        sinks: dict[str, Callable | None] = {"event_sink": None, "grad_sink": None, "update_sink": None}
        if recorder is not None:
            sinks = {
                "event_sink": recorder.exchange_event,
                "grad_sink": lambda rank, step, grads: recorder.gradients(rank, self._update_of(step), grads),
                "update_sink": lambda rank, step, update: recorder.rank_update(
                    rank, self._update_of(step), _update(update)
                ),
            }
            if config.mixed:  # the design's fp32 sum of gradients, checked (fp32-gradient-sum)
                sinks["sum_sink"] = lambda rank, step, summed, resum: recorder.gradient_sum(
                    rank, self._update_of(step), summed, resum
                )
        if context.arm.oracle == "torchrec":
            from harness.oracles.torchrec import TorchrecLockstep

            fidelity_sink = recorder.fidelity if recorder else None
            pec_sink = recorder.pec_event if recorder else None
            return TorchrecLockstep(
                config, **sinks, pec_sink=pec_sink, fidelity_sink=fidelity_sink, batches=context.steps
            )
        if context.arm.oracle:
            from harness.oracles.lockstep import Lockstep

            counterpart = _counterpart(context.arm.oracle)
            return Lockstep(config, counterpart, **sinks, fidelity_sink=recorder.fidelity if recorder else None)
        if isinstance(config, PipelineConfig):
            return PIPELINE_TRAINERS[config.trainer](config, **sinks)
        if isinstance(config, PECConfig):
            pec_sink = recorder.pec_event if recorder else None
            return PECTrainer(config, **sinks, pec_sink=pec_sink, batches=context.steps)
        cache = GraphCache(context.cache_dir) if context.cache_dir else None
        return Trainer(config, **sinks, trace_cache=cache)

    def record_ops(self, recorder: OpRecorder) -> None:
        """Readies the trainer for ``recorder`` (the subject's ``record_ops``); an arm that trains an
        oracle's model in lockstep is refused: the oracle's ops would be recorded as the arm's."""
        if self.oracle:
            raise OpsNotRecordable(f"recording ops: the arm trains beside an oracle ({self.oracle}), whose ops mix in")
        prepare_recording(self.trainer, recorder)

    def _update_of(self, step: int) -> int:
        """The harness's update number of the trainer's ``step`` (its batch number, once resumed)."""
        return step + self.offset - self.data_offset

    def save_checkpoint(self, folder: Path, step: int) -> None:
        """The whole state after the arm's step ``step`` (harness.reference.checkpoint): a versioned
        arm's pipeline and a PEC arm's pending gradients in flight included. Imported here:
        torch.distributed.checkpoint costs every rank a second to import. A checkpoint that cannot be
        signed (the user's key is not their secret) is :class:`CheckpointRefused`, with its one line."""
        from harness.reference import checkpoint

        try:
            checkpoint.save(self.trainer, step, folder)
        except checkpoint.CheckpointError as e:
            raise CheckpointRefused(str(e)) from None

    def load_checkpoint(self, folder: Path, step: int) -> None:
        """Restores the state saved after the arm's step ``step``; training goes on from the data
        position the checkpoint records, which is ``step`` unless a planted fault lost it. A
        checkpoint the reference refuses is :class:`CheckpointRefused`, with its one line."""
        from harness.reference import checkpoint

        try:
            position = checkpoint.load(self.trainer, folder, step)
        except checkpoint.CheckpointError as e:
            raise CheckpointRefused(str(e)) from None
        self.data_offset = position - step
        self.resumed_from = step

    def _record(self, result: dict) -> StepRecord:
        extra = {k: v for k, v in result.items() if k not in _STEP_FIELDS}
        step, loss, grad_norm, tokens, seconds = (result[k] for k in _STEP_FIELDS)
        return StepRecord(step + self.offset, loss, grad_norm, tokens, seconds, extra)

    def step(self, step: int) -> StepRecord | None:
        result = self.trainer.step(step + self.data_offset)
        if result is not None and self.data_offset:
            result["step"] = step  # the harness's count of updates, whatever batch the arm took
        return None if result is None else self._record(result)

    def drain(self) -> list[StepRecord]:
        if not self.offset:
            return []
        return [self._record(result) for result in self.trainer.drain()]

    def info(self) -> ArmFacts:
        """The MoE layers of the built model, and the update a fresh launch loaded a checkpoint of."""
        return ArmFacts(moe_layers=tuple(self.trainer.moe_layers), resumed_from=self.resumed_from)

    def graph_export(self) -> dict:
        return self.trainer.graph_export

    def graph_build(self) -> dict:
        return self.trainer.graph_build

    def final_weights(self) -> Mapping[int, Mapping[str, torch.Tensor]]:
        if not isinstance(self.trainer, Trainer):  # the lockstep wrapper: its weights are synced each step
            return {}
        return {rank: dict(replica.model.named_parameters()) for rank, replica in self.trainer.replicas.items()}

    def close(self) -> None:
        self.trainer.close()


def _counterpart(oracle: str) -> Callable:
    """The oracle's model class, imported only for an arm that trains against it."""
    if oracle == "hf":
        from harness.oracles.hf import HuggingFace

        return HuggingFace
    from harness.oracles.torchtitan import Torchtitan

    return Torchtitan


def _update(update: ReferenceUpdate) -> RankUpdate:
    return RankUpdate(update.loss, update.grad_norm, update.replicated, update.experts)
