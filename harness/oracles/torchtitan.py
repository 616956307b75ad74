"""torchtitan's own DeepSeek-V3 (0.3.0, the ``torchtitan`` extra), the ``"torchtitan"`` oracle's model:
built to compute what a reference model config computes, with the reference's weights. It is the
code the reference's MoE mirrors. Three semantic differences are lined up, each of which moves
numbers by 1e-4 or more:

- the routed experts in fp32: torchtitan's ``GroupedExperts.forward`` casts inputs and weights to
  bf16 unconditionally, so its grouped matmuls are replaced, on each built model, with fp32 ones
  (the same op, ``torch._grouped_mm``);
- every RMSNorm's eps from the config (torchtitan's default is 1e-5, DeepSeek-V3's 1e-6);
- attention through SDPA (``ScaledDotProductAttention``, causal): FlexAttention, torchtitan's
  default, has no CPU backward.

YaRN is refused: torchtitan does not scale cos/sin for it. Weights travel by name (torchtitan's
state-dict adapter for the dense tensors; the fused ``gate_up_proj`` split into ``w1`` and ``w3``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.distributed import parallel_dims
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models import deepseek_v3 as titan
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.moe import GroupedExperts, TokenChoiceTopKRouter
from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

from harness.reference.ep.group import LogicalGroup
from harness.reference.model import DeepseekV3Config
from harness.reference.train import TrainConfig

SPMD_BACKEND = "partial_dtensor"  # DTensors on the model-parallel axes only; see expert_parallel
_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_TITAN_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.routed_experts\.inner_experts\.(w1_EFD|w2_EDF|w3_EFD)$")


def titan_config(
    cfg: DeepseekV3Config, forced_balanced: bool = False, eps: float | None = None, comm_backend: str = "standard"
) -> titan.DeepSeekV3Model.Config:
    """The torchtitan model config of a reference config (default RoPE only); ``eps`` replaces the
    config's RMSNorm eps (to show that it matters); ``comm_backend`` is torchtitan's token dispatcher."""
    if cfg.rope_type != "default":
        raise ValueError(f"rope_type {cfg.rope_type!r}: torchtitan does not scale cos/sin for YaRN")
    layers = titan.build_mla_moe_layers(
        n_layers=cfg.num_hidden_layers,
        n_dense_layers=cfg.first_k_dense_replace,
        dim=cfg.hidden_size,
        n_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank or 0,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        mscale=1.0,
        dense_hidden_dim=cfg.intermediate_size,
        moe_hidden_dim=cfg.moe_intermediate_size,
        num_experts=cfg.n_routed_experts,
        num_shared_experts=cfg.n_shared_experts,
        router_top_k=cfg.num_experts_per_tok,
        router_score_func=cfg.scoring_func,
        router_num_expert_groups=cfg.n_group,
        router_num_limited_groups=cfg.topk_group,
        router_route_scale=cfg.routed_scaling_factor,
        router_route_norm=cfg.norm_topk_prob,
        attn_backend="flex",  # replaced below: no CPU backward
        moe_comm_backend=comm_backend,
        non_blocking_capacity_factor=None,
        linear_init=titan._LINEAR_INIT,
        norm_init=titan._NORM_INIT,
        depth_init=titan._depth_init,
        depth_experts_init=titan._depth_experts_init,
        rope=ComplexRoPE.Config(dim=cfg.qk_rope_head_dim, max_seq_len=4096, theta=cfg.rope_theta),
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = titan.DeepSeekV3Model.Config(
        vocab_size=cfg.vocab_size,
        dim=cfg.hidden_size,
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=cfg.hidden_size),
        norm=RMSNorm.Config(normalized_shape=cfg.hidden_size),
        lm_head=Linear.Config(in_features=cfg.hidden_size, out_features=cfg.vocab_size),
        layers=layers,
        mtp_layers=[],
    )
    _each(config, RMSNorm.Config, lambda norm: setattr(norm, "eps", cfg.rms_norm_eps if eps is None else eps))
    # torchtitan's round-robin forced load balance, as the reference's forced-balanced routing
    force = forced_balanced
    _each(config, TokenChoiceTopKRouter.Config, lambda router: setattr(router, "_debug_force_load_balance", force))
    return config


def _each(obj: Any, kind: type, visit: Any, seen: set[int] | None = None) -> None:
    """``visit`` every config of ``kind`` in a config tree."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, kind):
        visit(obj)
    children = [getattr(obj, f.name) for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else obj
    if isinstance(children, (list, tuple)):
        for child in children:
            _each(child, kind, visit, seen)


def _fp32_experts(self: GroupedExperts, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """``GroupedExperts.forward`` without its bf16 casts; under EP, on this rank's expert shard."""
    offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)

    def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w = w.to_local() if isinstance(w, DTensor) else w
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)

    return mm(F.silu(mm(x_RD, self.w1_EFD)) * mm(x_RD, self.w3_EFD), self.w2_EDF)


def build(config: titan.DeepSeekV3Model.Config, fp32: bool = True) -> torch.nn.Module:
    """torchtitan's model of ``config``, its routed experts in fp32 unless ``fp32`` is False."""
    model = config.build()
    if fp32:
        fp32_experts(model)
    return model


def fp32_experts(model: torch.nn.Module) -> None:
    """Run ``model``'s routed experts in fp32: torchtitan's grouped matmuls without their bf16 casts."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.forward = _fp32_experts.__get__(module)


def shard_experts(config: titan.DeepSeekV3Model.Config) -> None:
    """Set torchtitan's DeepSeek-V3 sharding config with EP on ``config`` (before building)."""
    set_deepseek_v3_sharding_config(config, enable_sp=False, enable_ep=True)


def expert_parallel(model: torch.nn.Module, processes: int, device: torch.device) -> None:
    """Expert parallelism over the default process group, torchtitan's own: ``Module.parallelize``
    with EP = ``processes`` shards each routed-expert weight (Shard(0): process p holds the p-th
    block of experts, as the reference's logical rank p) and wires its ``AllToAllTokenDispatcher``.
    The model's config must have had :func:`shard_experts`. Two adjustments, through what torchtitan
    exposes: the device mesh is built on ``device``'s type (``parallel_dims.device_type``, which
    torchtitan sets to "cuda" wherever no accelerator is found), and the SPMD backend is
    ``partial_dtensor`` (DTensors on the model-parallel axes only): the default ``spmd_types``
    backend fails on gloo."""
    parallel_dims.device_type = device.type
    set_spmd_backend(SPMD_BACKEND)
    dims = parallel_dims.ParallelDims(
        dp_replicate=1,
        dp_shard=processes,
        cp=1,
        tp=1,
        pp=1,
        ep=processes,
        world_size=processes,
        spmd_backend=SPMD_BACKEND,
    )
    dims.build_mesh()
    model.parallelize(dims)


class Names:
    """The reference's (Hugging Face's) tensor names and torchtitan's, both ways."""

    def __init__(self, config: titan.DeepSeekV3Model.Config) -> None:
        self.titan_of = DeepSeekV3StateDictAdapter(config, None).from_hf_map
        self.reference_of = {titan_name: name for name, titan_name in self.titan_of.items()}

    def to_titan(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The reference's tensors under torchtitan's names, ``gate_up_proj`` split (views)."""
        out = {}
        for name, tensor in state.items():
            if match := _EXPERTS.match(name):
                base = f"layers.{match[1]}.moe.routed_experts.inner_experts."
                if match[2] == "gate_up_proj":
                    out[base + "w1_EFD"], out[base + "w3_EFD"] = tensor.chunk(2, dim=1)
                else:
                    out[base + "w2_EDF"] = tensor
            else:
                out[_rename(name, self.titan_of)] = tensor
        return out

    def from_titan(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """torchtitan's tensors under the reference's names, ``w1`` and ``w3`` fused into ``gate_up_proj``."""
        out = {}
        for name, tensor in tensors.items():
            if match := _TITAN_EXPERTS.match(name):
                experts = f"model.layers.{match[1]}.mlp.experts."
                if match[2] == "w1_EFD":
                    w3 = tensors[name.removesuffix("w1_EFD") + "w3_EFD"]
                    out[experts + "gate_up_proj"] = torch.cat([tensor, w3], dim=1)
                elif match[2] == "w2_EDF":
                    out[experts + "down_proj"] = tensor
            else:
                out[_rename(name, self.reference_of)] = tensor
        return out


def _rename(name: str, mapping: dict[str, str]) -> str:
    """``name`` through an adapter map whose keys hold the layer index as ``{}``."""
    layer = re.search(r"\.(\d+)\.", name)
    key = re.sub(r"\.(\d+)\.", ".{}.", name, count=1)
    return mapping[key].format(layer[1]) if layer else mapping[key]


class Torchtitan:
    """The ``"torchtitan"`` oracle's :class:`~harness.oracles.lockstep.Counterpart`: forced-balanced
    routing is torchtitan's own round-robin (``_debug_force_load_balance``).

    With one logical rank per process (EP = processes > 1) it is expert parallel
    (:func:`expert_parallel`): every process builds the model and holds its logical rank's experts.
    """

    label = "torchtitan"

    def __init__(self, config: TrainConfig, group: LogicalGroup) -> None:
        self.titan = titan_config(config.model_config(), forced_balanced=config.routing == "forced-balanced")
        self.processes = group.processes
        self.expert_parallel = 1 < group.processes == config.ep
        if self.expert_parallel:
            shard_experts(self.titan)
        self.names = Names(self.titan)

    def build(self, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        """In float32, the only dtype an arm against torchtitan may have: ``Module.to(dtype)``
        would also cast the complex RoPE cache, dropping its imaginary part."""
        assert dtype == torch.float32, dtype
        model = build(self.titan).to(device)
        if self.expert_parallel:
            expert_parallel(model, self.processes, device)
        return model.train()

    def load(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        """Every parameter and correction bias (an expert shard into its DTensor's local part);
        only torchtitan's token counters are not the reference's."""
        state = model.state_dict()
        incoming = self.names.to_titan(weights)
        missing = [n for n in state if n not in incoming and not n.endswith("tokens_per_expert_E")]
        unexpected = [n for n in incoming if n not in state]
        if missing or unexpected:
            raise RuntimeError(f"torchtitan's model lacks {unexpected} and the reference's {missing}")
        with torch.no_grad():
            for name, tensor in incoming.items():
                target = state[name]
                (target.to_local() if isinstance(target, DTensor) else target).copy_(tensor)

    def logits(self, model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return model(inputs)

    def as_reference(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.names.from_titan(tensors)
