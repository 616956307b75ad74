"""The reference DeepSeek-V3 against Hugging Face's independent implementation, in fp32.

Logits and the gradient of every parameter under the LM loss agree to 1e-5 relative (the
largest deviation seen is ~1e-6, from different but equivalent summation orders), in one
process and with the routed experts split over 2 real gloo processes with learned routing.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks

from harness.reference.ep.exchange import TokenExchange, bind
from harness.reference.ep.group import LogicalGroup
from harness.reference.model import DeepseekV3ForCausalLM, causal_lm_loss, get_config

transformers = pytest.importorskip("transformers")
from harness.oracles.hf import hf_config  # noqa: E402  (needs transformers)

RTOL = 1e-5
CFG = get_config("cpu-tiny", n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5)
BATCH, SEQ = 4, 16


def hf_model() -> torch.nn.Module:
    config = hf_config(CFG)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).float()
    with torch.no_grad():  # a non-zero correction bias exercises the group-limited choice
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape) * 0.1)
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(CFG.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_logits_and_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = hf_model()
    inputs, labels = batch()
    logits = model(input_ids=inputs).logits
    causal_lm_loss(logits, labels).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return logits.detach(), grads, {k: v.clone() for k, v in model.state_dict().items()}


def reference_on_rank(rank: int, ep: int, state: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits of this rank's batch slice and gradients of the global mean loss, learned routing."""
    group = LogicalGroup(ep)
    model = DeepseekV3ForCausalLM(CFG, ep_rank=rank, ep_size=ep)
    model.load_hf_state_dict(state)
    model.set_forced_balanced(False)
    exchange = TokenExchange(
        group,
        rank,
        hidden=CFG.hidden_size,
        capacity=BATCH * SEQ * CFG.num_experts_per_tok,
        num_buffer_sets=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    inputs, labels = batch()
    rows = slice(rank * BATCH // ep, (rank + 1) * BATCH // ep)
    with bind(exchange):
        logits = model(inputs[rows])
        (causal_lm_loss(logits, labels[rows]) / ep).backward()
    experts = {id(p) for p in model.expert_parameters()}
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = p.grad if id(p) in experts else torch.stack(group.all_gather(rank, p.grad)).sum(0)
    return logits.detach(), grads


def assert_matches_hf(
    logits: torch.Tensor, grads: dict, hf_logits: torch.Tensor, hf_grads: dict, rank: int, ep: int
) -> None:
    rows = slice(rank * BATCH // ep, (rank + 1) * BATCH // ep)
    assert rel_err(logits, hf_logits[rows]) < RTOL
    assert grads.keys() == hf_grads.keys()
    n_local = CFG.n_routed_experts // ep
    for name, g in grads.items():
        expected = hf_grads[name]
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            expected = expected[rank * n_local : (rank + 1) * n_local]
        assert expected.abs().max() > 0, f"{name}: no gradient, the comparison would be vacuous"
        assert rel_err(g, expected) < RTOL, f"{name}: rel err {rel_err(g, expected):.2e}"


def test_matches_transformers_in_one_process() -> None:
    hf_logits, hf_grads, state = hf_logits_and_grads()
    logits, grads = reference_on_rank(0, 1, state)
    assert_matches_hf(logits, grads, hf_logits, hf_grads, rank=0, ep=1)


def _ep2_worker(state: dict) -> tuple[torch.Tensor, dict]:
    import torch.distributed as dist

    return reference_on_rank(dist.get_rank(), 2, state)


def test_matches_transformers_with_experts_on_two_gloo_processes() -> None:
    hf_logits, hf_grads, state = hf_logits_and_grads()
    for rank, (logits, grads) in enumerate(run_on_ranks(2, _ep2_worker, state)):
        assert_matches_hf(logits, grads, hf_logits, hf_grads, rank=rank, ep=2)


def test_state_dict_names_are_hugging_face_names() -> None:
    ours = DeepseekV3ForCausalLM(CFG).state_dict()
    theirs = hf_model().state_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[k].shape == theirs[k].shape for k in ours)
