"""The reference against torchtitan's own DeepSeek-V3 (0.3.0, installed by the `test` extra), in one
process: the same weights and batch, logits and every gradient. torchtitan is the code the
reference's MoE mirrors; the semantic differences lined up are in harness/oracles/torchtitan.py,
and the last test shows that each would fail the comparison."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import cpu_exchange

from harness.oracles.torchtitan import Names, build, titan_config
from harness.reference.ep.exchange import bind
from harness.reference.ep.group import LogicalGroup
from harness.reference.model import DeepseekV3Config, DeepseekV3ForCausalLM, causal_lm_loss, get_config

RTOL = 2e-6  # fp32, two implementations: ~5e-7 measured
BATCH, SEQ = 4, 16
LEARNED = get_config("cpu-tiny", n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5)


def _batch(cfg: DeepseekV3Config) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _reference(cfg: DeepseekV3Config, forced_balanced: bool) -> tuple[DeepseekV3ForCausalLM, torch.Tensor]:
    model = DeepseekV3ForCausalLM(cfg, forced_balanced=forced_balanced)
    model.init_weights(torch.Generator().manual_seed(42))
    inputs, labels = _batch(cfg)
    with bind(cpu_exchange(LogicalGroup(1), 0, cfg, BATCH * SEQ)):
        logits = model(inputs)
        causal_lm_loss(logits, labels).backward()
    return model, logits.detach()


def _torchtitan(
    cfg: DeepseekV3Config,
    reference: DeepseekV3ForCausalLM,
    forced_balanced: bool,
    eps: float | None = None,
    fp32_experts: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """torchtitan's logits and gradients, under the reference's names, from the reference's weights."""
    config = titan_config(cfg, forced_balanced=forced_balanced, eps=eps)
    names = Names(config)
    model = build(config, fp32=fp32_experts)
    missing, unexpected = model.load_state_dict(names.to_titan(reference.state_dict()), strict=False)
    assert not unexpected and all(name.endswith("tokens_per_expert_E") for name in missing), (missing, unexpected)
    inputs, labels = _batch(cfg)
    logits = model(inputs)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return logits.detach(), names.from_titan(grads)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("forced_balanced", [False, True], ids=["learned", "forced-balanced"])
def test_the_reference_matches_torchtitans_deepseek_v3(forced_balanced: bool) -> None:
    reference, logits = _reference(LEARNED, forced_balanced)
    titan_logits, titan_grads = _torchtitan(LEARNED, reference, forced_balanced)
    assert _rel(logits, titan_logits) < RTOL, f"logits: rel err {_rel(logits, titan_logits):.1e}"
    for name, p in reference.named_parameters():
        assert titan_grads[name].abs().max() > 0, f"{name}: no gradient, the comparison would be vacuous"
        assert _rel(p.grad, titan_grads[name]) < RTOL, f"{name}: rel err {_rel(p.grad, titan_grads[name]):.1e}"


@pytest.mark.parametrize(
    "difference", [{"fp32_experts": False}, {"eps": 1e-5}], ids=["torchtitans-bf16-experts", "torchtitans-eps"]
)
def test_each_difference_lined_up_would_fail_the_comparison(difference: dict) -> None:
    reference, logits = _reference(LEARNED, forced_balanced=False)
    titan_logits, _ = _torchtitan(LEARNED, reference, forced_balanced=False, **difference)
    assert _rel(logits, titan_logits) > 10 * RTOL


def test_yarn_is_refused_naming_what_torchtitan_lacks() -> None:
    with pytest.raises(ValueError, match="torchtitan does not scale cos/sin for YaRN"):
        titan_config(get_config("cpu-tiny", rope_type="yarn", rope_factor=4.0))
