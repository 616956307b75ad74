"""Hugging Face ``DeepseekV3ForCausalLM``, the ``"hf"`` oracle's model (see :mod:`harness.oracles.lockstep`).

transformers is written independently of the reference, with the same parameter names: the weights
travel as they are. Under ``precision = "bf16-mixed"`` Hugging Face trains under the same bf16
autocast as the reference, with one adjustment: its router casts to float32 to route in float32,
which autocast would undo, so the router runs with autocast off, as the reference's does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from harness.reference.ep.group import LogicalGroup
from harness.reference.model import DeepseekV3Config
from harness.reference.train import TrainConfig


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


def _autocast_off(forward: Callable, device_type: str) -> Callable:
    """``forward`` run with autocast off."""

    def run(*args: object, **kwargs: object) -> object:
        with torch.autocast(device_type, enabled=False):
            return forward(*args, **kwargs)

    return run


class HuggingFace:
    """The ``"hf"`` oracle's :class:`~harness.oracles.lockstep.Counterpart`."""

    label = "Hugging Face"
    expert_parallel = False  # transformers has no expert parallelism

    def __init__(self, config: TrainConfig, group: LogicalGroup) -> None:
        self.config = config

    def build(self, dtype: torch.dtype, device: torch.device) -> nn.Module:
        model = transformers.DeepseekV3ForCausalLM(hf_config(self.config.model_config()))
        if self.config.mixed:  # its float32 routing, which autocast would undo
            for module in model.modules():
                if isinstance(module, DeepseekV3TopkRouter):
                    module.forward = _autocast_off(module.forward, device.type)
        return model.to(device=device, dtype=dtype).train()

    def load(self, model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        model.load_state_dict(weights)

    def logits(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return model(input_ids=inputs).logits

    def as_reference(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors
