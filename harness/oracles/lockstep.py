"""An oracle's model trained in lockstep with the reference: the fidelity oracle's run.

The reference is the system under test; the oracle (Hugging Face transformers or torchtitan) is an
implementation written independently of it. Every step of an oracle arm:

1. the oracle's model (one, holding every expert, in process rank 0) takes the reference's current
   weights and correction biases: dense tensors from logical rank 0, the expert shards of all
   logical ranks gathered over the process group; the oracle's :class:`Counterpart` renames them;
2. both compute the loss and its gradients on the same global batch, the synthetic batches of all
   logical ranks; the global loss is the mean over logical ranks of each rank's mean NLL, as the
   reference's;
3. both step: the reference its own way, the oracle with nothing but torch's ``clip_grad_norm_``
   and ``AdamW`` (the reference's learning rate, max norm and AdamW defaults);
4. process rank 0 records one line: both losses and grad norms, and per parameter (under the
   reference's names) the largest absolute difference of the gradients (before clipping), of the
   updated weights and of AdamW's moments, beside the largest magnitude of the oracle's tensor.
   The harness judges the line; nothing here does.

The weights are synced at every step, so a divergence shows at the step that caused it instead of
compounding; the optimizer state of each side stays its own.

Under ``precision = "bf16-mixed"`` neither side owes the other its bits, so both are held to a third
run, torch's accuracy checker's way: the oracle's model in float64 takes the same weights and batch
each step, and the record adds, per gradient, the RMSE of each side against it (and the loss's and
grad norm's float64 values).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness.reference.train import DTYPES, GradSink, TrainConfig, Trainer, UpdateSink, synthetic_batch

Tensors = dict[str, torch.Tensor]


class Counterpart(Protocol):
    """An oracle's model of the arm's reference config, seen under the reference's tensor names."""

    label: str  # what the records and the check's messages call the oracle

    def build(self, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The oracle's model, in ``dtype``, in training mode; its initial weights do not matter."""

    def load(self, model: nn.Module, weights: Tensors) -> None:
        """Copy the reference's ``weights`` (its state dict, every expert) into ``model``."""

    def logits(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """The model's logits of a batch of token ids."""

    def as_reference(self, tensors: dict[str, torch.Tensor]) -> Tensors:
        """Tensors keyed by the oracle's parameter names, under the reference's parameter names."""


def differences(ours: Tensors, theirs: Tensors, what: str) -> dict[str, dict[str, float]]:
    """Per tensor of ``theirs``: the largest |ours - theirs| (in float64, so the subtraction adds
    no rounding of its own) and the largest |theirs|, keyed ``<what>_abs_diff``, ``<what>_oracle_max``."""
    return {
        name: {
            f"{what}_abs_diff": (ours[name].double() - t.double()).abs().max().item(),
            f"{what}_oracle_max": t.abs().max().item(),
        }
        for name, t in theirs.items()
    }


def fp64_errors(ours: Tensors, theirs: Tensors, fp64: Tensors) -> dict[str, dict[str, float]]:
    """Per tensor of ``fp64``: the RMSE of ours and of theirs against it, and its own RMS (the scale
    of the check's floor), keyed ``grad_fp64_rmse``, ``grad_oracle_fp64_rmse``, ``grad_fp64_rms``."""

    def rmse(t: torch.Tensor, exact: torch.Tensor) -> float:
        return (t.double() - exact).square().mean().sqrt().item()

    return {
        name: {
            "grad_fp64_rmse": rmse(ours[name], exact),
            "grad_oracle_fp64_rmse": rmse(theirs[name], exact),
            "grad_fp64_rms": exact.square().mean().sqrt().item(),
        }
        for name, exact in fp64.items()
    }


# AdamW's moments, compared beside the weights: linear (exp_avg) and quadratic (exp_avg_sq) in the
# clipped gradient, they show a clipping or moment bug at the gradient's own tier, where the
# updated weights (divided by sqrt(exp_avg_sq) + eps) can only be held to a looser one.
ADAM_MOMENTS = {"exp_avg": "adam_m", "exp_avg_sq": "adam_v"}


class Lockstep:
    """A reference :class:`Trainer` and an oracle's model stepped together; the arm's trainer.

    ``step`` returns the reference's metrics record, as ``Trainer.step`` does, and on process
    rank 0 hands the fidelity record to ``fidelity_sink``.
    """

    def __init__(
        self,
        config: TrainConfig,
        counterpart: Callable[[TrainConfig], Counterpart],
        event_sink: Callable[[int, dict], None] | None,
        fidelity_sink: Callable[[dict], None] | None,
        grad_sink: GradSink | None = None,
        update_sink: UpdateSink | None = None,
    ) -> None:
        self.config = config
        self.fidelity_sink = fidelity_sink
        self.grad_sink = grad_sink
        self.trainer = Trainer(config, event_sink=event_sink, grad_sink=self._keep_grads, update_sink=update_sink)
        self.moe_layers = self.trainer.moe_layers
        self.graph_export = self.trainer.graph_export
        self.graph_build = self.trainer.graph_build
        self.group = self.trainer.group
        model = self.trainer.replicas[self.group.local_ranks[0]].model
        expert_ids = {id(p) for p in model.expert_parameters()}
        self.expert_names = [n for n, p in model.named_parameters() if id(p) in expert_ids]
        self._grads: dict[int, Tensors] = {}  # logical rank -> its gradients, before clipping
        self._grads_lock = threading.Lock()
        self.oracle: nn.Module | None = None
        self.oracle64: nn.Module | None = None  # bf16-mixed: the float64 run
        if self.group.process_rank == 0:
            self.counterpart = counterpart(config)
            self.oracle = self._build(DTYPES[config.dtype])
            self.optimizer = torch.optim.AdamW(self.oracle.parameters(), lr=config.lr)
            if config.mixed:
                self.oracle64 = self._build(torch.float64)

    def _build(self, dtype: torch.dtype) -> nn.Module:
        """Its random initialisation is overwritten at the first sync; forking keeps the global
        generator where it was, so the reference side runs exactly as a plain arm would."""
        with torch.random.fork_rng(devices=[]):
            return self.counterpart.build(dtype, self.trainer.device)

    def close(self) -> None:
        self.trainer.close()

    def _keep_grads(self, rank: int, step: int, grads: Tensors) -> None:
        """The reference's grad sink, on each logical rank's thread; the trainer clips in place next."""
        kept = {name: g.detach().clone() for name, g in grads.items()}
        with self._grads_lock:
            self._grads[rank] = kept
        if self.grad_sink is not None:
            self.grad_sink(rank, step, grads)

    def step(self, step: int) -> dict:
        """One lockstep step; every process calls it, as it calls ``Trainer.step``."""
        weights = self._gather({r: replica.model.state_dict() for r, replica in self.trainer.replicas.items()})
        exact: dict = {}
        if self.oracle is not None:
            self.counterpart.load(self.oracle, weights)
            oracle_loss = self._loss_and_grads(self.oracle, step, self.config.compute(self.trainer.device))
            if self.oracle64 is not None:
                self.counterpart.load(self.oracle64, weights)  # copied into its float64 parameters
                exact["fp64_loss"] = self._loss_and_grads(self.oracle64, step, contextlib.nullcontext())
        result = self.trainer.step(step)
        grads, self._grads = self._gather(self._grads), {}
        if self.oracle is not None:
            oracle_grads = self._grads_of(self.oracle)
            grad_diffs = differences(grads, oracle_grads, "grad")
            if self.oracle64 is not None:
                fp64_grads = self._grads_of(self.oracle64)
                exact["fp64_grad_norm"] = torch.linalg.vector_norm(
                    torch.stack([*map(torch.linalg.vector_norm, fp64_grads.values())])
                ).item()
                for name, errors in fp64_errors(grads, oracle_grads, fp64_grads).items():
                    grad_diffs[name] |= errors
                self.oracle64.zero_grad(set_to_none=True)
            oracle_grad_norm = torch.nn.utils.clip_grad_norm_(self.oracle.parameters(), self.config.max_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        updated = self._gather(
            {r: dict(replica.model.named_parameters()) for r, replica in self.trainer.replicas.items()}
        )
        moments = {key: self._gather(self._adam_state(key)) for key in ADAM_MOMENTS}
        if self.oracle is not None and self.fidelity_sink is not None:
            as_reference = self.counterpart.as_reference
            weight_diffs = differences(updated, as_reference(dict(self.oracle.named_parameters())), "weight")
            oracle_state = {n: self.optimizer.state[p] for n, p in self.oracle.named_parameters()}
            for key, label in ADAM_MOMENTS.items():
                theirs = as_reference({n: state[key] for n, state in oracle_state.items()})
                for name, diff in differences(moments[key], theirs, label).items():
                    weight_diffs[name] |= diff
            self.fidelity_sink(
                {
                    "step": step,
                    "oracle": self.counterpart.label,
                    "loss": result["loss"],
                    "oracle_loss": oracle_loss,
                    "grad_norm": result["grad_norm"],
                    "oracle_grad_norm": oracle_grad_norm.item(),
                    **exact,
                    "params": {name: {**grad_diffs[name], **weight_diffs[name]} for name in grad_diffs},
                }
            )
        return result

    def _grads_of(self, model: nn.Module) -> Tensors:
        """Every parameter's gradient, under the reference's names; zeros for one the loss did not reach."""
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
        return self.counterpart.as_reference(grads)

    def _adam_state(self, key: str) -> dict[int, Tensors]:
        """Each local logical rank's AdamW moment ``key`` per parameter, after this step."""
        return {
            r: {n: replica.optimizer.state[p][key] for n, p in replica.model.named_parameters()}
            for r, replica in self.trainer.replicas.items()
        }

    def _loss_and_grads(self, model: nn.Module, step: int, compute: contextlib.AbstractContextManager) -> float:
        """Forward (under ``compute``) and backward of the global batch; the loss is the mean of the
        ranks' mean NLLs, in float32 at least."""
        vocab, device = self.trainer.cfg.vocab_size, self.trainer.device
        batches = [synthetic_batch(self.config, vocab, step, rank) for rank in range(self.config.ep)]
        inputs = torch.cat([inputs for inputs, _ in batches]).to(device)
        with compute:
            logits = self.counterpart.logits(model, inputs).split(self.config.local_batch)
            # torch's own cross entropy, not the reference's loss: a bug there must not move both sides.
            per_rank = [
                F.cross_entropy(
                    lg.flatten(0, 1).to(torch.promote_types(lg.dtype, torch.float32)), labels.to(device).flatten()
                )
                for lg, (_, labels) in zip(logits, batches)
            ]
            loss = torch.stack(per_rank).mean()
        loss.backward()
        return loss.item()

    def _gather(self, local: dict[int, Tensors]) -> Tensors:
        """The whole model's tensors, on process rank 0, from each process's logical ranks: dense
        ones as logical rank 0 has them, expert shards concatenated in logical-rank order (process
        p hosts the p-th block of logical ranks). Every process calls it; the others get {}."""
        ranks = sorted(local)
        shapes = {name: local[ranks[0]][name].shape for name in self.expert_names}
        flat = torch.cat([local[r][name].detach().flatten() for r in ranks for name in self.expert_names])
        if self.group.processes > 1:
            parts = [torch.empty_like(flat) for _ in range(self.group.processes)] if self.oracle is not None else None
            dist.gather(flat, parts, dst=0)
            if parts is None:
                return {}
            flat = torch.cat(parts)
        pieces = flat.split([shapes[name].numel() for _ in range(self.config.ep) for name in self.expert_names])
        full = {name: t.detach() for name, t in local[ranks[0]].items()}
        for i, name in enumerate(self.expert_names):
            full[name] = torch.cat([piece.view(shapes[name]) for piece in pieces[i :: len(self.expert_names)]])
        return full
