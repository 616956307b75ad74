"""DeepSeek-V3 for training tests: MLA attention, dense SwiGLU FFN, DeepSeekMoE with expert parallelism.

Parameter names follow Hugging Face ``DeepseekV3ForCausalLM`` so that state dicts move between the
two unchanged (experts are stored fused, ``gate_up_proj`` [E, 2I, D] and ``down_proj`` [E, D, I]).
Under expert parallelism a model instance holds only its logical rank's slice of the routed
experts; :meth:`DeepseekV3ForCausalLM.load_hf_state_dict` takes the full tensors and slices them.

The MoE layer's forward calls the router, the token dispatcher and the experts in order.
:meth:`MoE.stages` offers the same steps as stages (compute, launch, wait) on a per-chunk record,
so that the chunking code can interleave the stages of several chunks through the EP scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from harness.reference.ep import ops as ep_ops
from harness.reference.ep.exchange import region


def _gelu_tanh_python(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# ``hidden_act`` names as Hugging Face's ACT2FN spells them, each computed the way ACT2FN computes it.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh_python,
    "gelu_fast": _gelu_fast,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
}
ROPE_TYPES = ("default", "yarn")
SCORING_FUNCS = ("sigmoid", "softmax")


@dataclass(frozen=True)
class DeepseekV3Config:
    """Field names match ``transformers.DeepseekV3Config``; ``scoring_func`` adds softmax scoring, and
    ``correction_bias_init`` draws the initial ``e_score_correction_bias`` uniformly from [0, it)
    (0: all zero, as a fresh model has), so that the group-limited choice depends on the bias.

    Hugging Face's ``rope_parameters`` dict is flattened: its key ``k`` is the field ``rope_k``
    (``rope_type``, ``rope_factor``, ``rope_mscale_all_dim``, ...); the ``rope_*`` fields other than
    ``rope_theta`` and ``rope_type`` only matter for ``rope_type = "yarn"``.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    n_shared_experts: int = 1
    n_routed_experts: int = 8
    routed_scaling_factor: float = 1.0
    kv_lora_rank: int = 32
    q_lora_rank: int | None = 32
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    qk_nope_head_dim: int = 16
    n_group: int = 2
    topk_group: int = 1
    num_experts_per_tok: int = 2
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    attention_bias: bool = False
    correction_bias_init: float = 0.0
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_position_embeddings: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0  # 0 means unset, as Hugging Face reads it
    rope_mscale_all_dim: float = 0.0
    rope_attention_factor: float | None = None  # None: derived from rope_factor and the mscales
    rope_truncate: bool = True

    def __post_init__(self) -> None:
        """Rejects what would fail obscurely inside a forward; messages start with the field."""
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {tuple(ACTIVATIONS)}, got {self.hidden_act!r}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.n_group < 1 or self.n_routed_experts % self.n_group:
            raise ValueError(f"n_group {self.n_group} does not divide the {self.n_routed_experts} routed experts")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in 1-{self.n_group} (n_group), got {self.topk_group}")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1-{self.n_routed_experts} (n_routed_experts), "
                f"got {self.num_experts_per_tok}"
            )
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"pad_token_id must be a token id below vocab_size {self.vocab_size}, got {self.pad_token_id}"
            )
        if self.rope_factor < 1.0:
            raise ValueError(f"rope_factor must be >= 1, got {self.rope_factor}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


_CPU_TINY_LEARNED = DeepseekV3Config(
    n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5, correction_bias_init=0.1
)
CONFIGS: dict[str, DeepseekV3Config] = {
    # 20 steps of two arms on 2 CPU ranks take seconds.
    "cpu-tiny": DeepseekV3Config(),
    # cpu-tiny with what forced-balanced routing never exercises: learned routing over 4 expert
    # groups (2 chosen), 3 experts per token, a routed scaling factor and a non-zero correction bias.
    "cpu-tiny-learned": _CPU_TINY_LEARNED,
    "cpu-tiny-learned-no-q-lora": replace(_CPU_TINY_LEARNED, q_lora_rank=None),
    # cpu-tiny with 64 routed experts, for EP 16, 32 and 64 simulated by logical ranks in a few processes.
    "cpu-tiny-64e": DeepseekV3Config(n_routed_experts=64),
    # torchtitan's deepseek_v3 debugmodel shape, for GPUs.
    "debugmodel": DeepseekV3Config(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=16,
        n_shared_experts=2,
        n_routed_experts=8,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        routed_scaling_factor=1.0,
    ),
    # Hugging Face's DeepseekV3Config defaults, the 671B checkpoint's shape (61 layers, 256 experts):
    # what the keys a config.json leaves out mean. Shrink it with overrides before building it.
    "deepseek-v3": DeepseekV3Config(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        n_shared_experts=1,
        n_routed_experts=256,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        n_group=8,
        topk_group=4,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
    ),
}
CONFIG_FIELDS = tuple(f.name for f in fields(DeepseekV3Config))


def get_config(name: str, **overrides: Any) -> DeepseekV3Config:
    """A named config with some fields replaced; an unknown name or field is a ValueError naming it."""
    if name not in CONFIGS:
        raise ValueError(f"model: unknown model config {name!r}; known: {sorted(CONFIGS)}")
    unknown = sorted(set(overrides) - set(CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"model_overrides: {unknown[0]!r} is no DeepseekV3Config field")
    return replace(CONFIGS[name], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(cfg: DeepseekV3Config, pos_freqs: torch.Tensor) -> torch.Tensor:
    """YaRN: interpolate the low frequencies by ``rope_factor``, keep the high ones, ramp between
    the dims that turn ``rope_beta_fast`` and ``rope_beta_slow`` times over the original context.
    Hugging Face's ``_compute_yarn_parameters``, step for step."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(cfg.rope_original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(pos_freqs.device)
    extrapolation = 1 - ramp
    interpolated = 1.0 / (cfg.rope_factor * pos_freqs)
    return interpolated * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_attention_factor(cfg: DeepseekV3Config) -> float:
    """The scale YaRN puts on cos and sin (Hugging Face's ``attention_factor``)."""
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return float(
            yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
        )
    return yarn_mscale(cfg.rope_factor)


def rope_cos_sin(cfg: DeepseekV3Config, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pos_freqs = cfg.rope_theta ** (
        torch.arange(0, cfg.qk_rope_head_dim, 2, device=device).float() / cfg.qk_rope_head_dim
    )
    inv_freq = 1.0 / pos_freqs if cfg.rope_type == "default" else _yarn_inv_freq(cfg, pos_freqs)
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    if cfg.rope_type == "default":
        return freqs.cos(), freqs.sin()
    scale = _yarn_attention_factor(cfg)
    return freqs.cos() * scale, freqs.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate ``x`` [B, H, L, R]; DeepSeek checkpoints store rotary dims as interleaved pairs."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# Hugging Face builds q_a_layernorm and kv_a_layernorm with this eps, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Multi-head latent attention: queries (optionally low-rank) and a compressed shared KV latent."""

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.cfg = cfg
        heads, bias = cfg.num_attention_heads, cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, heads * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, cfg.hidden_size, bias=bias)
        self.scaling = cfg.qk_head_dim**-0.5
        if cfg.rope_type != "default" and cfg.rope_mscale_all_dim:
            # DeepSeek-V3 scales the softmax by YaRN's mscale squared (Hugging Face's yarn_apply_mscale).
            mscale = yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
            self.scaling = self.scaling * mscale * mscale

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cfg = self.cfg
        bsz, seq, _ = x.shape
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(bsz, seq, cfg.num_attention_heads, cfg.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)

        kv_latent, k_rot = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent))
        kv = kv.view(bsz, seq, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)

        cos, sin = rope
        q_rot = apply_rope(q_rot, cos, sin, cfg.rope_interleave)
        k_rot = apply_rope(k_rot.view(bsz, 1, seq, cfg.qk_rope_head_dim), cos, sin, cfg.rope_interleave)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, cfg.num_attention_heads, -1, -1)], dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward, used for the dense layers and the shared experts."""

    def __init__(self, hidden: int, inner: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


# Shape suffixes of the MoE below: B batch, S sequence, D hidden size, T tokens (B * S), K experts per
# token, E routed experts, EP expert-parallel ranks, L experts per rank (E / EP), A token copies sent
# (T * K, in expert order, so grouped by destination rank), R rows received for this rank's experts.


ROUTER_FAULTS = ("router-upcast-dropped", "routed-scaling-twice")


class TopkRouter(nn.Module):
    """DeepSeek-V3 router: sigmoid/softmax scores, score-correction bias, group-limited top-k; or,
    ``forced_balanced``, torchtitan's forced load balance, which ignores the scores for the choice.

    The scores are computed in fp32 whatever autocast would do: they choose the experts and weight
    their outputs. ``fault`` plants a bug (:data:`ROUTER_FAULTS`): ``router-upcast-dropped`` leaves
    the logits, and the sigmoid or softmax over them, in bf16 under bf16 autocast;
    ``routed-scaling-twice`` multiplies the weights by ``routed_scaling_factor`` twice.
    """

    def __init__(self, cfg: DeepseekV3Config, forced_balanced: bool, fault: str = "none") -> None:
        super().__init__()
        if fault not in ("none", *ROUTER_FAULTS):
            raise ValueError(f"router fault must be one of {ROUTER_FAULTS}, got {fault!r}")
        self.cfg, self.forced_balanced = cfg, forced_balanced
        self.upcast = fault != "router-upcast-dropped"
        self.scale = cfg.routed_scaling_factor ** (2 if fault == "routed-scaling-twice" else 1)
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (expert ids, weights), both [T, K]; weights carry the gradient to the router."""
        cfg = self.cfg
        if self.upcast:
            with torch.autocast(x.device.type, enabled=False):
                logits = F.linear(x.float(), self.weight.float())
        else:
            logits = F.linear(x, self.weight)
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        if self.forced_balanced:
            # torchtitan's moe_force_load_balance: the choice ignores the scores, so every expert
            # gets exactly T*K/E assignments; scores are still gathered so the router learns.
            ids = torch.arange(x.shape[0] * cfg.num_experts_per_tok, device=x.device)
            ids = (ids % cfg.n_routed_experts).view(x.shape[0], cfg.num_experts_per_tok)
        else:
            ids = self._group_limited_topk(scores.detach())
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scale

    def _group_limited_topk(self, scores: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        choice = scores + self.e_score_correction_bias
        grouped = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        top_groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, cfg.n_routed_experts)
        return choice.masked_fill(~expert_mask, float("-inf")).topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]


class GroupedExperts(nn.Module):
    """This logical rank's slice of the routed experts, fused as in Hugging Face."""

    def __init__(self, cfg: DeepseekV3Config, num_local: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * cfg.moe_intermediate_size, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_local, cfg.hidden_size, cfg.moe_intermediate_size))
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        """``x`` is sorted by local expert; one matmul pair per expert, so no atomics anywhere."""
        outs = []
        for e, part in enumerate(x.split(rows_per_expert)):
            gate, up = F.linear(part, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act(gate) * up, self.down_proj[e]))
        return torch.cat(outs)


@dataclass(frozen=True, eq=False)
class DispatchPlan:
    """Where one chunk's token copies go and come from, fixed by routing before anything moves.

    The dispatch reads it and the combine reads it reversed, so neither may see it change. The row
    counts are sizes, not tensors: under forced-balanced routing they are static, so the exchange traces.
    """

    order_A: torch.Tensor  # token-expert assignments (T * K, flattened) sorted stably by expert
    send_counts_EP: torch.Tensor  # rows sent to each rank
    recv_counts_EP: torch.Tensor  # rows received from each rank
    recv_per_expert_EPL: torch.Tensor  # rows received, by source rank and local expert
    send_rows: int
    recv_rows: int


class TokenDispatcher:
    """Carries token copies to the ranks of their experts and back, as launch/wait pairs.

    It has no parameters, so it is no ``nn.Module``. Launches and waits are separate methods so
    that compute can run while an exchange is in flight; ``buffer_set`` names the receive pool.
    """

    def __init__(self, cfg: DeepseekV3Config, ep_size: int, forced_balanced: bool) -> None:
        self.num_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.ep_size, self.num_local = ep_size, cfg.n_routed_experts // ep_size
        self.forced_balanced = forced_balanced

    def permute(self, tokens_TD: torch.Tensor, expert_ids_TK: torch.Tensor) -> tuple[torch.Tensor, DispatchPlan]:
        """The token copies in expert order, and the plan that sends them (counts exchanged, blocking)."""
        expert_ids_A = expert_ids_TK.flatten()
        order_A = torch.argsort(expert_ids_A, stable=True)
        per_expert_EPL = F.one_hot(expert_ids_A, self.num_experts).sum(0).view(self.ep_size, self.num_local)
        recv_per_expert_EPL = ep_ops.exchange_counts(per_expert_EPL)
        send_counts_EP, recv_counts_EP = per_expert_EPL.sum(1), recv_per_expert_EPL.sum(1)
        send_AD = tokens_TD.index_select(0, order_A // self.top_k)
        if torch.is_autocast_enabled(send_AD.device.type):  # the experts' compute dtype: half the bytes
            send_AD = send_AD.to(torch.get_autocast_dtype(send_AD.device.type))
        # Forced-balanced routing receives exactly what it sends: static shapes, so it traces.
        recv_rows = send_AD.shape[0] if self.forced_balanced else int(recv_counts_EP.sum())
        plan = DispatchPlan(order_A, send_counts_EP, recv_counts_EP, recv_per_expert_EPL, send_AD.shape[0], recv_rows)
        return send_AD, plan

    def launch_dispatch(self, send_AD: torch.Tensor, plan: DispatchPlan, buffer_set: int) -> torch.Tensor:
        """Start sending; returns the placeholder [R, D] that :meth:`wait_dispatch` turns into rows."""
        return ep_ops.dispatch(send_AD, plan.send_counts_EP, plan.recv_counts_EP, plan.recv_rows, buffer_set)

    def wait_dispatch(self, pending_RD: torch.Tensor, buffer_set: int) -> torch.Tensor:
        """The received rows [R, D], ordered by (source rank, local expert)."""
        return ep_ops.wait_dispatch(pending_RD, buffer_set)

    def launch_combine(self, expert_out_RD: torch.Tensor, plan: DispatchPlan, buffer_set: int) -> torch.Tensor:
        """Start sending the expert outputs back where their tokens came from: the dispatch reversed."""
        return ep_ops.combine(expert_out_RD, plan.recv_counts_EP, plan.send_counts_EP, plan.send_rows, buffer_set)

    def wait_combine(self, pending_AD: torch.Tensor, buffer_set: int) -> torch.Tensor:
        """The expert outputs [A, D] of this rank's token copies, still in expert order."""
        return ep_ops.wait_combine(pending_AD, buffer_set)

    def unpermute(self, combined_AD: torch.Tensor, plan: DispatchPlan, weights_TK: torch.Tensor) -> torch.Tensor:
        """Each token's expert outputs back in token order, summed with the router's weights: [T, D]."""
        per_assignment_AD = combined_AD.index_select(0, torch.argsort(plan.order_A))
        # Weighted in the router's fp32, as torchtitan does; a no-op in an fp32 model.
        return (
            per_assignment_AD.view(-1, self.top_k, per_assignment_AD.shape[-1]).float()
            * weights_TK.unsqueeze(-1).float()
        ).sum(1)


def _set_by_a_stage() -> Any:
    """A chunk field a stage fills in; reading it before then is an AttributeError."""
    return field(init=False, repr=False)


@dataclass(slots=True, eq=False)
class MoEChunk:
    """One chunk's values between the MoE stages. Slots make a misspelt field fail at once."""

    x_BSD: torch.Tensor
    buffer_set: int
    tokens_TD: torch.Tensor = _set_by_a_stage()  # what the router and the shared experts read
    weights_TK: torch.Tensor = _set_by_a_stage()
    send_AD: torch.Tensor = _set_by_a_stage()
    plan: DispatchPlan = _set_by_a_stage()
    pending: torch.Tensor = _set_by_a_stage()  # the placeholder of the exchange in flight
    shared_TD: torch.Tensor = _set_by_a_stage()
    received_RD: torch.Tensor = _set_by_a_stage()
    expert_out_RD: torch.Tensor = _set_by_a_stage()
    combined_AD: torch.Tensor = _set_by_a_stage()
    out_BSD: torch.Tensor = _set_by_a_stage()


ChunkT = TypeVar("ChunkT")


@dataclass(frozen=True)
class Stage(Generic[ChunkT]):
    """One step of a region body. The EP scheduler reorders stages of different chunks by ``kind``."""

    kind: str  # "compute" | "launch" | "wait"
    name: str
    run: Callable[[ChunkT], None]


class MoE(nn.Module):
    """DeepSeekMoE: shared experts plus top-k routed experts reached through the token exchange.

    ``layer_id`` names the layer in exchange events; ``forced_balanced`` routes every expert the
    same number of tokens whatever the scores (torchtitan's ``force_load_balance``).
    """

    def __init__(
        self, cfg: DeepseekV3Config, layer_id: int, ep_size: int, forced_balanced: bool, router_fault: str = "none"
    ) -> None:
        super().__init__()
        if cfg.n_routed_experts % ep_size:
            raise ValueError(f"EP degree {ep_size} does not divide n_routed_experts {cfg.n_routed_experts}")
        self.layer_id, self.forced_balanced = layer_id, forced_balanced
        self.num_local = cfg.n_routed_experts // ep_size
        self.gate = TopkRouter(cfg, forced_balanced, router_fault)
        self.experts = GroupedExperts(cfg, self.num_local)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.hidden_act)
        self.dispatcher = TokenDispatcher(cfg, ep_size, forced_balanced)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        buffer_set = 0  # one chunk: the first receive pool
        with region(layer=self.layer_id, chunk=0):
            tokens_TD, weights_TK, send_AD, plan = self.route(x_BSD)
            pending_RD = self.dispatcher.launch_dispatch(send_AD, plan, buffer_set)
            shared_TD = self.shared_experts(tokens_TD)  # runs while the tokens travel
            received_RD = self.dispatcher.wait_dispatch(pending_RD, buffer_set)
            expert_out_RD = self.run_experts(received_RD, plan)
            pending_AD = self.dispatcher.launch_combine(expert_out_RD, plan, buffer_set)
            combined_AD = self.dispatcher.wait_combine(pending_AD, buffer_set)
            routed_TD = self.dispatcher.unpermute(combined_AD, plan, weights_TK)
            return (routed_TD + shared_TD).to(x_BSD.dtype).view(x_BSD.shape)

    def route(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchPlan]:
        """Choose experts: (tokens [T, D], weights [T, K], token copies to send [A, D], their plan)."""
        tokens_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        # One fan-out point for the router and the shared experts keeps the gradient sum into
        # ``tokens_TD`` two-way (commutative), so its bits do not depend on autograd's visit order.
        local_TD = tokens_TD.view_as(tokens_TD)
        expert_ids_TK, weights_TK = self.gate(local_TD)
        send_AD, plan = self.dispatcher.permute(tokens_TD, expert_ids_TK)
        return local_TD, weights_TK, send_AD, plan

    def run_experts(self, received_RD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """This rank's experts on the received rows, which come ordered (source rank, local expert):
        regrouped by local expert for the experts, and back in arrival order for the combine."""
        counts_EPL = plan.recv_per_expert_EPL
        rows = received_RD.shape[0]
        block_R = torch.searchsorted(
            counts_EPL.flatten().cumsum(0), torch.arange(rows, device=counts_EPL.device), right=True
        )
        by_expert_R = torch.argsort(block_R % self.num_local, stable=True).to(received_RD.device)
        if self.forced_balanced:
            rows_per_expert = [rows // self.num_local] * self.num_local
        else:
            rows_per_expert = counts_EPL.sum(0).tolist()
        out_RD = self.experts(received_RD.index_select(0, by_expert_R), rows_per_expert)
        return out_RD.index_select(0, torch.argsort(by_expert_R))

    def stages(self) -> list[Stage[MoEChunk]]:
        """The forward's steps as stages on a :class:`MoEChunk`: launch-wait pairs, compute between."""
        return [
            Stage("compute", "route", self._route),
            Stage("launch", "dispatch", self._launch_dispatch),
            Stage("compute", "shared_experts", self._shared_experts),
            Stage("wait", "dispatch", self._wait_dispatch),
            Stage("compute", "experts", self._run_experts),
            Stage("launch", "combine", self._launch_combine),
            Stage("wait", "combine", self._wait_combine),
            Stage("compute", "unpermute", self._unpermute),
        ]

    def _route(self, c: MoEChunk) -> None:
        c.tokens_TD, c.weights_TK, c.send_AD, c.plan = self.route(c.x_BSD)

    def _launch_dispatch(self, c: MoEChunk) -> None:
        c.pending = self.dispatcher.launch_dispatch(c.send_AD, c.plan, c.buffer_set)

    def _shared_experts(self, c: MoEChunk) -> None:
        c.shared_TD = self.shared_experts(c.tokens_TD)

    def _wait_dispatch(self, c: MoEChunk) -> None:
        c.received_RD = self.dispatcher.wait_dispatch(c.pending, c.buffer_set)

    def _run_experts(self, c: MoEChunk) -> None:
        c.expert_out_RD = self.run_experts(c.received_RD, c.plan)

    def _launch_combine(self, c: MoEChunk) -> None:
        c.pending = self.dispatcher.launch_combine(c.expert_out_RD, c.plan, c.buffer_set)

    def _wait_combine(self, c: MoEChunk) -> None:
        c.combined_AD = self.dispatcher.wait_combine(c.pending, c.buffer_set)

    def _unpermute(self, c: MoEChunk) -> None:
        routed_TD = self.dispatcher.unpermute(c.combined_AD, c.plan, c.weights_TK)
        c.out_BSD = (routed_TD + c.shared_TD).to(c.x_BSD.dtype).view(c.x_BSD.shape)


RopeCosSin = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True, eq=False)
class BlockChunk:
    """One chunk's values between the stages of a whole block: attention, then the MoE's stages."""

    x_BSD: torch.Tensor
    buffer_set: int
    h_BSD: torch.Tensor = _set_by_a_stage()  # the block input plus attention: the MoE output adds to it
    moe: MoEChunk = _set_by_a_stage()
    out_BSD: torch.Tensor = _set_by_a_stage()


def _on_moe_chunk(stage: Stage[MoEChunk]) -> Stage[BlockChunk]:
    """An MoE stage, run on the MoE's record inside a block chunk."""
    return Stage(stage.kind, stage.name, lambda c: stage.run(c.moe))


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: DeepseekV3Config, layer_id: int, ep_size: int, forced_balanced: bool, router_fault: str = "none"
    ) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg)
        self.mlp = (
            MoE(cfg, layer_id, ep_size, forced_balanced, router_fault)
            if cfg.is_moe_layer(layer_id)
            else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, rope: RopeCosSin) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope)
        return h + self.mlp(self.post_attention_layernorm(h))

    def stages(self, rope: RopeCosSin) -> list[Stage[BlockChunk]]:
        """A whole block as a chunkable region: attention folds into the MoE's first compute stage."""
        route, *exchange, unpermute = self.mlp.stages()

        def attention_and_route(c: BlockChunk) -> None:
            c.h_BSD = c.x_BSD + self.self_attn(self.input_layernorm(c.x_BSD), rope)
            c.moe = MoEChunk(self.post_attention_layernorm(c.h_BSD), c.buffer_set)
            route.run(c.moe)

        def unpermute_and_residual(c: BlockChunk) -> None:
            unpermute.run(c.moe)
            c.out_BSD = c.h_BSD + c.moe.out_BSD

        return [
            Stage("compute", "attention+route", attention_and_route),
            *map(_on_moe_chunk, exchange),
            Stage("compute", "unpermute+residual", unpermute_and_residual),
        ]


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, ep_size: int, forced_balanced: bool, router_fault: str = "none") -> None:
        super().__init__()
        self.cfg = cfg
        # The pad token's row gets no gradient from the lookup.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, ep_size, forced_balanced, router_fault) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        rope = tuple(t.to(h.dtype) for t in rope_cos_sin(self.cfg, input_ids.shape[1], input_ids.device))
        for layer in self.layers:
            h = layer(h, rope)
        return self.norm(h)


class DeepseekV3ForCausalLM(nn.Module):
    """The model of one logical EP rank: all dense weights, ``n_routed_experts / ep_size`` experts.

    ``forced_balanced`` is the routing mode of every MoE layer (see :class:`MoE`); ``router_fault``
    plants one of the bugs :class:`TopkRouter` describes.
    """

    def __init__(
        self,
        cfg: DeepseekV3Config,
        ep_rank: int = 0,
        ep_size: int = 1,
        *,
        forced_balanced: bool = True,
        router_fault: str = "none",
    ) -> None:
        super().__init__()
        self.cfg, self.ep_rank, self.ep_size = cfg, ep_rank, ep_size
        self.model = DeepseekV3Model(cfg, ep_size, forced_balanced, router_fault)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.cfg.num_hidden_layers) if self.cfg.is_moe_layer(i)]

    def expert_parameters(self) -> list[nn.Parameter]:
        """Parameters sharded over EP ranks (everything else is replicated)."""
        return [p for m in self.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]

    def init_weights(self, generator: torch.Generator) -> None:
        """Seeded initialisation of the *full* model's tensors, sliced to this rank's experts.

        Every logical rank draws the same full tensors, so any process layout starts identically.
        As Hugging Face initialises, a tied ``lm_head`` is the embedding and the pad token's row is zero.
        """
        full = {}
        for name, shape in self.full_shapes().items():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                full[name] = torch.ones(shape)
            elif name.endswith("e_score_correction_bias"):
                # Drawn only when asked, so that every other config's weights stay as they were.
                bias = self.cfg.correction_bias_init
                full[name] = torch.rand(shape, generator=generator) * bias if bias else torch.zeros(shape)
            elif name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                full[name] = full["model.embed_tokens.weight"]
            else:
                full[name] = torch.randn(shape, generator=generator) * self.cfg.initializer_range
        if self.cfg.pad_token_id is not None:
            full["model.embed_tokens.weight"][self.cfg.pad_token_id] = 0.0
        self.load_hf_state_dict(full)

    def full_shapes(self) -> dict[str, torch.Size]:
        """Shapes of the Hugging Face state dict of the whole (unsharded) model, in a fixed order."""
        shapes = {}
        for name, tensor in self.state_dict().items():
            shape = tensor.shape
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                shape = torch.Size([self.cfg.n_routed_experts, *shape[1:]])
            shapes[name] = shape
        return shapes

    def load_hf_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Load a full Hugging Face ``DeepseekV3ForCausalLM`` state dict, keeping this rank's experts."""
        own = self.state_dict()
        missing = sorted(set(own) - set(full))
        if missing:
            raise KeyError(f"state dict lacks {missing[:3]}{'...' if len(missing) > 3 else ''}")
        n_local = self.cfg.n_routed_experts // self.ep_size
        sliced = {}
        for name in own:
            tensor = full[name]
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensor = tensor[self.ep_rank * n_local : (self.ep_rank + 1) * n_local]
            sliced[name] = tensor
        self.load_state_dict(sliced)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


__all__ = [
    "ROUTER_FAULTS",
    "ACTIVATIONS",
    "CONFIG_FIELDS",
    "CONFIGS",
    "BlockChunk",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "DispatchPlan",
    "MoE",
    "MoEChunk",
    "Stage",
    "TokenDispatcher",
    "causal_lm_loss",
    "get_config",
]
