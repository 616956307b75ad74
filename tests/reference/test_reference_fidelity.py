"""The reference DeepSeek-V3 against Hugging Face's independent implementation, in fp32.

Logits and the gradient of every parameter under the LM loss agree to 1e-5 relative (the
largest deviation seen is ~1e-6, from different but equivalent summation orders), in one
process and with the routed experts split over 2 real gloo processes with learned routing;
and in one process for each config a real checkpoint may set: YaRN RoPE, tied embeddings, a
pad token, the activation, rms_norm_eps away from the latent norms' fixed 1e-6.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from distributed import cpu_exchange

from harness.reference.ep.exchange import bind
from harness.reference.ep.group import LogicalGroup
from harness.reference.hf_config import HF_BASE, hf_config_fields
from harness.reference.model import (
    ACTIVATIONS,
    CONFIG_FIELDS,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    causal_lm_loss,
    get_config,
)

transformers = pytest.importorskip("transformers")
from harness.oracles.hf import hf_config  # noqa: E402  (needs transformers)

RTOL = 1e-5
CFG = get_config("cpu-tiny", n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5)
BATCH, SEQ = 4, 16
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "deepseek-v3-tiny" / "config.json"
# YaRN as DeepSeek-V3 ships it (mscale = mscale_all_dim: cos/sin unscaled, the softmax scaled by
# mscale^2), with the two mscales apart (cos/sin scaled too), and without them and truncation.
YARN = {
    "deepseek-v3": dict(
        rope_factor=40.0, rope_original_max_position_embeddings=4096, rope_mscale=1.0, rope_mscale_all_dim=1.0
    ),
    "mscales-apart": dict(
        rope_factor=4.0, rope_original_max_position_embeddings=512, rope_mscale=1.0, rope_mscale_all_dim=0.5
    ),
    "factor-only": dict(
        rope_factor=8.0, rope_original_max_position_embeddings=4096, rope_beta_fast=16.0, rope_truncate=False
    ),
}


def hf_model(config: transformers.DeepseekV3Config | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config or hf_config(CFG)).float()
    with torch.no_grad():  # a non-zero correction bias exercises the group-limited choice
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape) * 0.1)
    return model


def batch(cfg: DeepseekV3Config = CFG) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_logits_and_grads(
    cfg: DeepseekV3Config = CFG, config: transformers.DeepseekV3Config | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Hugging Face's logits, gradients and state dict, for ``config`` or else the one ``cfg`` describes."""
    model = hf_model(config or hf_config(cfg))
    inputs, labels = batch(cfg)
    logits = model(input_ids=inputs).logits
    causal_lm_loss(logits, labels).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return logits.detach(), grads, {k: v.clone() for k, v in model.state_dict().items()}


def reference_on_rank(
    rank: int, ep: int, state: dict, cfg: DeepseekV3Config = CFG
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits of this rank's batch slice and gradients of the global mean loss, learned routing."""
    group = LogicalGroup(ep)
    model = DeepseekV3ForCausalLM(cfg, ep_rank=rank, ep_size=ep, forced_balanced=False)
    model.load_hf_state_dict(state)
    inputs, labels = batch(cfg)
    rows = slice(rank * BATCH // ep, (rank + 1) * BATCH // ep)
    with bind(cpu_exchange(group, rank, cfg, BATCH * SEQ)):
        logits = model(inputs[rows])
        (causal_lm_loss(logits, labels[rows]) / ep).backward()
    experts = {id(p) for p in model.expert_parameters()}
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = p.grad if id(p) in experts else torch.stack(group.all_gather(rank, p.grad)).sum(0)
    return logits.detach(), grads


def assert_matches_hf(
    logits: torch.Tensor,
    grads: dict,
    hf_logits: torch.Tensor,
    hf_grads: dict,
    rank: int,
    ep: int,
    cfg: DeepseekV3Config = CFG,
) -> None:
    rows = slice(rank * BATCH // ep, (rank + 1) * BATCH // ep)
    assert rel_err(logits, hf_logits[rows]) < RTOL, f"logits: rel err {rel_err(logits, hf_logits[rows]):.2e}"
    assert grads.keys() == hf_grads.keys()
    n_local = cfg.n_routed_experts // ep
    for name, g in grads.items():
        expected = hf_grads[name]
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            expected = expected[rank * n_local : (rank + 1) * n_local]
        assert expected.abs().max() > 0, f"{name}: no gradient, the comparison would be vacuous"
        assert rel_err(g, expected) < RTOL, f"{name}: rel err {rel_err(g, expected):.2e}"


def assert_one_process_matches_hf(
    cfg: DeepseekV3Config, config: transformers.DeepseekV3Config | None = None
) -> dict[str, torch.Tensor]:
    """Compares logits and gradients with Hugging Face's; returns the reference's gradients."""
    hf_logits, hf_grads, state = hf_logits_and_grads(cfg, config)
    logits, grads = reference_on_rank(0, 1, state, cfg)
    assert_matches_hf(logits, grads, hf_logits, hf_grads, rank=0, ep=1, cfg=cfg)
    return grads


def test_matches_transformers_in_one_process() -> None:
    assert_one_process_matches_hf(CFG)


def _ep2_worker(state: dict) -> tuple[torch.Tensor, dict]:
    import torch.distributed as dist

    return reference_on_rank(dist.get_rank(), 2, state)


def test_matches_transformers_with_experts_on_two_gloo_processes(run_on_ranks) -> None:
    hf_logits, hf_grads, state = hf_logits_and_grads()
    for rank, (logits, grads) in enumerate(run_on_ranks(2, _ep2_worker, state)):
        assert_matches_hf(logits, grads, hf_logits, hf_grads, rank=rank, ep=2)


@pytest.mark.parametrize("variant", list(YARN))
def test_yarn_rope_scaling_matches_transformers(variant: str) -> None:
    assert_one_process_matches_hf(replace(CFG, rope_type="yarn", **YARN[variant]))


def test_tied_word_embeddings_match_transformers_and_share_one_tensor() -> None:
    cfg = replace(CFG, tie_word_embeddings=True)
    grads = assert_one_process_matches_hf(cfg)
    assert "lm_head.weight" not in grads  # one parameter, under its embedding name, as in Hugging Face
    model = DeepseekV3ForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_pad_token_row_gets_no_gradient_as_in_transformers() -> None:
    inputs, _ = batch()
    pad = int(inputs[0, 0])  # a token the batch uses, so the row would otherwise get a gradient
    cfg = replace(CFG, pad_token_id=pad)
    grads = assert_one_process_matches_hf(cfg)
    embedding = grads["model.embed_tokens.weight"]
    assert embedding[pad].abs().max() == 0 and embedding[int(inputs[0, 1])].abs().max() > 0
    model = DeepseekV3ForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    assert model.model.embed_tokens.weight[pad].abs().max() == 0  # initialised as Hugging Face does


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_hidden_act_matches_transformers(act: str) -> None:
    assert_one_process_matches_hf(replace(CFG, hidden_act=act))


def test_unknown_hidden_act_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"hidden_act must be one of \('silu', .*got 'tanhshrink'"):
        replace(CFG, hidden_act="tanhshrink")


def test_latent_norms_keep_eps_1e_6_whatever_rms_norm_eps_says() -> None:
    """Hugging Face builds q_a_layernorm and kv_a_layernorm with eps 1e-6; the other norms take rms_norm_eps."""
    assert_one_process_matches_hf(replace(CFG, rms_norm_eps=1e-5))


def test_a_checkpoint_config_json_builds_the_model_transformers_builds_from_it() -> None:
    """The real file's keys (YaRN in the older rope_scaling form, fp8 quantization_config, MTP
    layers, ...) map onto the model transformers reads from the same file."""
    hf = json.loads(FIXTURE.read_text())
    cfg = get_config(HF_BASE, **{field: value for field, (_, value) in hf_config_fields(hf).items()})
    assert (cfg.rope_type, cfg.rope_factor, cfg.num_hidden_layers) == ("yarn", 40, 4)
    assert_one_process_matches_hf(cfg, transformers.DeepseekV3Config.from_dict(hf, attn_implementation="eager"))


def test_the_deepseek_v3_config_is_hugging_faces_defaults() -> None:
    """What the keys a config.json leaves out mean."""
    theirs, ours = transformers.DeepseekV3Config(), get_config(HF_BASE)
    shared = [name for name in CONFIG_FIELDS if hasattr(theirs, name)]
    assert len(shared) > 25
    assert {name: getattr(ours, name) for name in shared} == {name: getattr(theirs, name) for name in shared}
    assert theirs.rope_parameters == {"rope_type": ours.rope_type, "rope_theta": ours.rope_theta}


def test_state_dict_names_are_hugging_face_names() -> None:
    ours = DeepseekV3ForCausalLM(CFG).state_dict()
    theirs = hf_model().state_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[k].shape == theirs[k].shape for k in ours)
