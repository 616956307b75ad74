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
from torch.distributed.tensor import DTensor

from harness.reference.ep.group import LogicalGroup
from harness.reference.train import DTYPES, GradSink, SumSink, TrainConfig, Trainer, UpdateSink, synthetic_batch

Tensors = dict[str, torch.Tensor]


class Counterpart(Protocol):
    """An oracle's model of the arm's reference config, seen under the reference's tensor names."""

    label: str  # what the records and the check's messages call the oracle
    # Whether every process holds the oracle's model, with its own logical rank's expert shard
    # (expert parallelism through the oracle's own all-to-all), or process rank 0 all of it.
    expert_parallel: bool

    def build(self, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The oracle's model, in ``dtype``, in training mode; its initial weights do not matter."""

    def load(self, model: nn.Module, weights: Tensors) -> None:
        """Copy the reference's ``weights`` (its state dict: every expert, or under expert
        parallelism this process's logical rank's) into ``model``."""

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


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """torch's global-norm clipping over a whole model whose expert shards may be DTensors (under
    expert parallelism; torch reduces their norm over their processes) beside plain dense
    parameters (the same on every process): each kind's norm apart, then one total, as
    torchtitan's own clipping with EP does. Returns the total norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    kinds = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    norms = []
    for kind in kinds:
        norm = torch.nn.utils.get_total_norm([p.grad for p in kind])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for kind in kinds:
        torch.nn.utils.clip_grads_with_norm_(kind, max_norm, total)
    return total


def sum_over_processes(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """Under expert parallelism: the loss and the replicated (non-DTensor) gradients summed over the
    processes (an expert shard's gradient came back through the all-to-all). Returns the loss."""
    loss = loss.detach()
    dense = [p.grad for p in model.parameters() if p.grad is not None and not isinstance(p, DTensor)]
    for tensor in [loss, *dense]:
        dist.all_reduce(tensor)
    return loss


class Lockstep:
    """A reference :class:`Trainer` and an oracle's model stepped together; the arm's trainer.

    ``step`` returns the reference's metrics record, as ``Trainer.step`` does, and on process
    rank 0 hands the fidelity record to ``fidelity_sink``. The oracle's model lives in process
    rank 0 and takes the global batch, unless its counterpart is ``expert_parallel``: then every
    process holds one, with this process's logical rank's expert shard, and takes that rank's batch.
    """

    def __init__(
        self,
        config: TrainConfig,
        counterpart: Callable[[TrainConfig, LogicalGroup], Counterpart],
        event_sink: Callable[[int, dict], None] | None,
        fidelity_sink: Callable[[dict], None] | None,
        grad_sink: GradSink | None = None,
        update_sink: UpdateSink | None = None,
        sum_sink: SumSink | None = None,
    ) -> None:
        self.config = config
        self.fidelity_sink = fidelity_sink
        self.grad_sink = grad_sink
        self.trainer = Trainer(
            config, event_sink=event_sink, grad_sink=self._keep_grads, update_sink=update_sink, sum_sink=sum_sink
        )
        self.moe_layers = self.trainer.moe_layers
        self.graph_export = self.trainer.graph_export
        self.graph_build = self.trainer.graph_build
        self.group = self.trainer.group
        model = self.trainer.replicas[self.group.local_ranks[0]].model
        expert_ids = {id(p) for p in model.expert_parameters()}
        self.expert_names = [n for n, p in model.named_parameters() if id(p) in expert_ids]
        self._grads: dict[int, Tensors] = {}  # logical rank -> its gradients, before clipping
        self._grads_lock = threading.Lock()
        self.counterpart = counterpart(config, self.group)
        self.recording = self.group.process_rank == 0
        self.oracle: nn.Module | None = None
        self.oracle64: nn.Module | None = None  # bf16-mixed: the float64 run
        if self.recording or self.counterpart.expert_parallel:
            self.oracle = self._build(DTYPES[config.dtype])
            self.optimizer = torch.optim.AdamW(self.oracle.parameters(), lr=config.lr, foreach=False)
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
        states = {r: replica.model.state_dict() for r, replica in self.trainer.replicas.items()}
        weights = states[self.group.local_ranks[0]] if self.counterpart.expert_parallel else self._gather(states)
        exact: dict = {}
        theirs: dict[str, Tensors] = {}  # the oracle's tensors under the reference's names
        if self.oracle is not None:
            self.counterpart.load(self.oracle, weights)
            oracle_loss = self._loss_and_grads(self.oracle, step, self.config.compute(self.trainer.device))
            if self.oracle64 is not None:
                self.counterpart.load(self.oracle64, weights)  # copied into its float64 parameters
                exact["fp64_loss"] = self._loss_and_grads(self.oracle64, step, contextlib.nullcontext())
        result = self.trainer.step(step)
        grads, self._grads = self._gather(self._grads), {}
        if self.oracle is not None:
            theirs["grad"] = self._grads_of(self.oracle)
            if self.oracle64 is not None:
                exact |= self._fp64_run(grads, theirs["grad"])
            oracle_grad_norm = clip_grad_norm(self.oracle, self.config.max_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            named = dict(self.oracle.named_parameters())
            theirs["weight"] = self._as_reference(named)
            for key, label in ADAM_MOMENTS.items():
                theirs[label] = self._as_reference({n: self.optimizer.state[p][key] for n, p in named.items()})
        ours = {
            "grad": grads,
            "weight": self._gather(
                {r: dict(replica.model.named_parameters()) for r, replica in self.trainer.replicas.items()}
            ),
            **{label: self._gather(self._adam_state(key)) for key, label in ADAM_MOMENTS.items()},
        }
        if self.recording and self.fidelity_sink is not None:
            params: dict[str, dict] = {name: {} for name in theirs["grad"]}
            for what, tensors in theirs.items():
                for name, diff in differences(ours[what], tensors, what).items():
                    params[name] |= diff
            for name, errors in exact.pop("grad_errors", {}).items():
                params[name] |= errors
            self.fidelity_sink(
                {
                    "step": step,
                    "oracle": self.counterpart.label,
                    # how many processes the oracle's model spans (its own expert parallelism)
                    "oracle_processes": self.group.processes if self.counterpart.expert_parallel else 1,
                    "loss": result["loss"],
                    "oracle_loss": oracle_loss,
                    "grad_norm": result["grad_norm"],
                    "oracle_grad_norm": oracle_grad_norm.item(),
                    **exact,
                    "params": params,
                }
            )
        return result

    def _fp64_run(self, grads: Tensors, oracle_grads: Tensors) -> dict:
        """The float64 run's grad norm and, per gradient, each side's error against it."""
        fp64_grads = self._grads_of(self.oracle64)
        norm = torch.linalg.vector_norm(torch.stack([*map(torch.linalg.vector_norm, fp64_grads.values())]))
        self.oracle64.zero_grad(set_to_none=True)
        return {"fp64_grad_norm": norm.item(), "grad_errors": fp64_errors(grads, oracle_grads, fp64_grads)}

    def _as_reference(self, tensors: dict[str, torch.Tensor]) -> Tensors:
        """The oracle's tensors, whole (an expert shard gathered from every process: collective
        under expert parallelism), under the reference's names."""
        whole = {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in tensors.items()}
        return self.counterpart.as_reference(whole)

    def _grads_of(self, model: nn.Module) -> Tensors:
        """Every parameter's gradient as it is now (a copy: clipping scales them in place), under
        the reference's names; zeros for one the loss did not reach."""
        return self._as_reference(
            {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
        )

    def _adam_state(self, key: str) -> dict[int, Tensors]:
        """Each local logical rank's AdamW moment ``key`` per parameter, after this step."""
        return {
            r: {n: replica.optimizer.state[p][key] for n, p in replica.model.named_parameters()}
            for r, replica in self.trainer.replicas.items()
        }

    def _loss_and_grads(self, model: nn.Module, step: int, compute: contextlib.AbstractContextManager) -> float:
        """Forward (under ``compute``) and backward of the global batch; the loss is the mean of the
        logical ranks' mean NLLs, in float32 at least. Under expert parallelism each process takes
        its own logical rank's batch, and the dense gradients and the loss are summed over the
        processes (the expert shards' gradients come back through the oracle's all-to-all)."""
        vocab, device = self.trainer.cfg.vocab_size, self.trainer.device
        ranks = self.group.local_ranks if self.counterpart.expert_parallel else range(self.config.ep)
        batches = [synthetic_batch(self.config, vocab, step, rank) for rank in ranks]
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
            loss = torch.stack(per_rank).sum() / self.config.ep
        loss.backward()
        if self.counterpart.expert_parallel:
            loss = sum_over_processes(model, loss)
        return loss.item()

    def _gather(self, local: dict[int, Tensors]) -> Tensors:
        """The whole model's tensors, on process rank 0, from each process's logical ranks: dense
        ones as logical rank 0 has them, expert shards concatenated in logical-rank order (process
        p hosts the p-th block of logical ranks). Every process calls it; the others get {}."""
        ranks = sorted(local)
        shapes = {name: local[ranks[0]][name].shape for name in self.expert_names}
        flat = torch.cat([local[r][name].detach().flatten() for r in ranks for name in self.expert_names])
        if self.group.processes > 1:
            parts = [torch.empty_like(flat) for _ in range(self.group.processes)] if self.recording else None
            dist.gather(flat, parts, dst=0)
            if parts is None:
                return {}
            flat = torch.cat(parts)
        pieces = flat.split([shapes[name].numel() for _ in range(self.config.ep) for name in self.expert_names])
        full = {name: t.detach() for name, t in local[ranks[0]].items()}
        for i, name in enumerate(self.expert_names):
            full[name] = torch.cat([piece.view(shapes[name]) for piece in pieces[i :: len(self.expert_names)]])
        return full
