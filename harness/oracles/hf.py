"""Hugging Face ``DeepseekV3ForCausalLM`` trained in lockstep with the reference: the fidelity oracle.

The reference is the system under test; transformers is an implementation written independently
of it, with the same parameter names. Every step of an oracle arm:

1. the Hugging Face model (one, holding every expert, in process rank 0) takes the reference's
   current weights and correction biases: dense tensors from logical rank 0, the expert shards of
   all logical ranks gathered over the process group;
2. both compute the loss and its gradients on the same global batch, the synthetic batches of all
   logical ranks; the global loss is the mean over logical ranks of each rank's mean NLL, as the
   reference's;
3. both step: the reference its own way, Hugging Face with nothing but torch's
   ``clip_grad_norm_`` and ``AdamW`` (the reference's learning rate, max norm and AdamW defaults);
4. process rank 0 records one line: both losses and grad norms, and per parameter the largest
   absolute difference of the gradients (before clipping) and of the updated weights, beside the
   largest magnitude of the Hugging Face tensor. The harness judges the line; nothing here does.

The weights are synced at every step, so a divergence shows at the step that caused it instead of
compounding; the optimizer state of each side stays its own.

Under ``precision = "bf16-mixed"`` neither side owes the other its bits, so both are held to a third
run, torch's accuracy checker's way: Hugging Face's model in float64 takes the same weights and
batch each step, and the record adds, per gradient, the RMSE of each side against it (and the
loss's and grad norm's float64 values). Hugging Face then trains under the same bf16 autocast as
the reference, with one adjustment: its router casts to float32 to route in float32, which autocast
would undo, so the router runs with autocast off, as the reference's does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from harness.reference.model import DeepseekV3Config
from harness.reference.train import DTYPES, GradSink, TrainConfig, Trainer, UpdateSink, synthetic_batch

Tensors = dict[str, torch.Tensor]


def rope_parameters(cfg: DeepseekV3Config) -> dict:
    """Hugging Face's rope_parameters for the reference's flattened ``rope_*`` fields."""
    params = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "yarn":
        params |= {
            "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position_embeddings,
            "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow,
            "mscale": cfg.rope_mscale,
            "mscale_all_dim": cfg.rope_mscale_all_dim,
            "truncate": cfg.rope_truncate,
        }
        if cfg.rope_attention_factor is not None:
            params["attention_factor"] = cfg.rope_attention_factor
    return params


def hf_config(cfg: DeepseekV3Config) -> transformers.DeepseekV3Config:
    """The transformers config of a reference model config: same fields, eager attention and experts."""
    return transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=cfg.n_shared_experts,
        n_routed_experts=cfg.n_routed_experts,
        routed_scaling_factor=cfg.routed_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        num_experts_per_tok=cfg.num_experts_per_tok,
        first_k_dense_replace=cfg.first_k_dense_replace,
        norm_topk_prob=cfg.norm_topk_prob,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope_parameters(cfg),
        max_position_embeddings=cfg.rope_original_max_position_embeddings * int(cfg.rope_factor),
        rope_interleave=cfg.rope_interleave,
        attention_bias=cfg.attention_bias,
        hidden_act=cfg.hidden_act,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=cfg.pad_token_id,
        use_cache=False,
        attn_implementation="eager",
        experts_implementation="eager",  # the plain per-expert loop, not a fused kernel
    )


def differences(ours: Tensors, theirs: Tensors, what: str) -> dict[str, dict[str, float]]:
    """Per tensor of ``theirs``: the largest |ours - theirs| (in float64, so the subtraction adds
    no rounding of its own) and the largest |theirs|, keyed ``<what>_abs_diff``, ``<what>_hf_max``."""
    return {
        name: {
            f"{what}_abs_diff": (ours[name].double() - t.double()).abs().max().item(),
            f"{what}_hf_max": t.abs().max().item(),
        }
        for name, t in theirs.items()
    }


def fp64_errors(ours: Tensors, theirs: Tensors, fp64: Tensors) -> dict[str, dict[str, float]]:
    """Per tensor of ``fp64``: the RMSE of ours and of theirs against it, and its own RMS (the scale
    of the check's floor), keyed ``grad_fp64_rmse``, ``grad_hf_fp64_rmse``, ``grad_fp64_rms``."""

    def rmse(t: torch.Tensor, exact: torch.Tensor) -> float:
        return (t.double() - exact).square().mean().sqrt().item()

    return {
        name: {
            "grad_fp64_rmse": rmse(ours[name], exact),
            "grad_hf_fp64_rmse": rmse(theirs[name], exact),
            "grad_fp64_rms": exact.square().mean().sqrt().item(),
        }
        for name, exact in fp64.items()
    }


def _autocast_off(forward: Callable, device_type: str) -> Callable:
    """``forward`` run with autocast off."""

    def run(*args: object, **kwargs: object) -> object:
        with torch.autocast(device_type, enabled=False):
            return forward(*args, **kwargs)

    return run


# AdamW's moments, compared beside the weights: linear (exp_avg) and quadratic (exp_avg_sq) in the
# clipped gradient, they show a clipping or moment bug at the gradient's own tier, where the
# updated weights (divided by sqrt(exp_avg_sq) + eps) can only be held to a looser one.
ADAM_MOMENTS = {"exp_avg": "adam_m", "exp_avg_sq": "adam_v"}


class HFLockstep:
    """A reference :class:`Trainer` and a Hugging Face model stepped together; the arm's trainer.

    ``step`` returns the reference's metrics record, as ``Trainer.step`` does, and on process
    rank 0 hands the fidelity record to ``fidelity_sink``.
    """

    def __init__(
        self,
        config: TrainConfig,
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
        self.hf: transformers.DeepseekV3ForCausalLM | None = None
        self.hf64: transformers.DeepseekV3ForCausalLM | None = None  # bf16-mixed: the float64 run
        if self.group.process_rank == 0:
            self.hf = self._hf_model(DTYPES[config.dtype])
            self.optimizer = torch.optim.AdamW(self.hf.parameters(), lr=config.lr)
            if config.mixed:
                self.hf64 = self._hf_model(torch.float64)
                for module in self.hf.modules():  # its float32 routing, which autocast would undo
                    if isinstance(module, DeepseekV3TopkRouter):
                        module.forward = _autocast_off(module.forward, self.trainer.device.type)

    def _hf_model(self, dtype: torch.dtype) -> transformers.DeepseekV3ForCausalLM:
        """Its random initialisation is overwritten at the first sync; forking keeps the global
        generator where it was, so the reference side runs exactly as a plain arm would."""
        with torch.random.fork_rng(devices=[]):
            model = transformers.DeepseekV3ForCausalLM(hf_config(self.trainer.cfg))
        return model.to(device=self.trainer.device, dtype=dtype).train()

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
        if self.hf is not None:
            self.hf.load_state_dict(weights)
            hf_loss = self._loss_and_grads(self.hf, step, self.config.compute(self.trainer.device))
            if self.hf64 is not None:
                self.hf64.load_state_dict(weights)  # copied into its float64 parameters
                exact["fp64_loss"] = self._loss_and_grads(self.hf64, step, contextlib.nullcontext())
        result = self.trainer.step(step)
        grads, self._grads = self._gather(self._grads), {}
        if self.hf is not None:
            hf_grads = _grads_of(self.hf)
            grad_diffs = differences(grads, hf_grads, "grad")
            if self.hf64 is not None:
                fp64_grads = _grads_of(self.hf64)
                exact["fp64_grad_norm"] = torch.linalg.vector_norm(
                    torch.stack([*map(torch.linalg.vector_norm, fp64_grads.values())])
                ).item()
                for name, errors in fp64_errors(grads, hf_grads, fp64_grads).items():
                    grad_diffs[name] |= errors
                self.hf64.zero_grad(set_to_none=True)
            hf_grad_norm = torch.nn.utils.clip_grad_norm_(self.hf.parameters(), self.config.max_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        updated = self._gather(
            {r: dict(replica.model.named_parameters()) for r, replica in self.trainer.replicas.items()}
        )
        moments = {key: self._gather(self._adam_state(key)) for key in ADAM_MOMENTS}
        if self.hf is not None and self.fidelity_sink is not None:
            weight_diffs = differences(updated, dict(self.hf.named_parameters()), "weight")
            hf_state = {n: self.optimizer.state[p] for n, p in self.hf.named_parameters()}
            for key, label in ADAM_MOMENTS.items():
                theirs = {n: state[key] for n, state in hf_state.items()}
                for name, diff in differences(moments[key], theirs, label).items():
                    weight_diffs[name] |= diff
            self.fidelity_sink(
                {
                    "step": step,
                    "loss": result["loss"],
                    "hf_loss": hf_loss,
                    "grad_norm": result["grad_norm"],
                    "hf_grad_norm": hf_grad_norm.item(),
                    **exact,
                    "params": {name: {**grad_diffs[name], **weight_diffs[name]} for name in grad_diffs},
                }
            )
        return result

    def _adam_state(self, key: str) -> dict[int, Tensors]:
        """Each local logical rank's AdamW moment ``key`` per parameter, after this step."""
        return {
            r: {n: replica.optimizer.state[p][key] for n, p in replica.model.named_parameters()}
            for r, replica in self.trainer.replicas.items()
        }

    def _loss_and_grads(
        self, model: transformers.DeepseekV3ForCausalLM, step: int, compute: contextlib.AbstractContextManager
    ) -> float:
        """Forward (under ``compute``) and backward of the global batch; the loss is the mean of the
        ranks' mean NLLs, in float32 at least."""
        vocab, device = self.trainer.cfg.vocab_size, self.trainer.device
        batches = [synthetic_batch(self.config, vocab, step, rank) for rank in range(self.config.ep)]
        inputs = torch.cat([inputs for inputs, _ in batches]).to(device)
        with compute:
            logits = model(input_ids=inputs).logits.split(self.config.local_batch)
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
            parts = [torch.empty_like(flat) for _ in range(self.group.processes)] if self.hf is not None else None
            dist.gather(flat, parts, dst=0)
            if parts is None:
                return {}
            flat = torch.cat(parts)
        pieces = flat.split([shapes[name].numel() for _ in range(self.config.ep) for name in self.expert_names])
        full = {name: t.detach() for name, t in local[ranks[0]].items()}
        for i, name in enumerate(self.expert_names):
            full[name] = torch.cat([piece.view(shapes[name]) for piece in pieces[i :: len(self.expert_names)]])
        return full


def _grads_of(model: torch.nn.Module) -> Tensors:
    """Every parameter's gradient; zeros for one the loss did not reach."""
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
