"""Versioned backward: the version protocol, transactional commit, retention, correction, pipeline."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from harness.reference.model import causal_lm_loss
from harness.reference.pipeline import PipelineConfig, VersionedTrainer
from harness.reference.train import TrainConfig, Trainer
from harness.reference.versioned import (
    CommitRefused,
    Cotangent,
    Version,
    VersionedModel,
    correction_weight,
    lm_loss,
    solo_vote,
)

VOCAB = 16


def tiny_lm(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, VOCAB))


def engine(retention: str = "retain", max_staleness: int = 2, correction: str = "off", seed: int = 0) -> VersionedModel:
    model = tiny_lm(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return VersionedModel(
        model, optimizer, max_gradient_staleness=max_staleness, retention=retention, correction=correction
    )


def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(VOCAB, (2, 9), generator=torch.Generator().manual_seed(b))
    return tokens[:, :-1], tokens[:, 1:]


def update(e: VersionedModel, b: int) -> None:
    """Forward, backward and step one fresh batch (age 0)."""
    e.backward([e.forward(b, *batch(b))], solo_vote)
    e.optimizer_step()


def state(e: VersionedModel) -> tuple[dict, dict]:
    params = {n: p.detach().clone() for n, p in e.params.items()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in e.params.items()}
    return params, grads


def assert_same_state(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    for name in a[0]:
        assert torch.equal(a[0][name], b[0][name]), f"weight {name} changed"
        ga, gb = a[1][name], b[1][name]
        assert (ga is None and gb is None) or torch.equal(ga, gb), f".grad of {name} changed"


# -- version protocol ---------------------------------------------------------------------------


def test_age_3_is_refused_at_max_2_and_nothing_is_mutated() -> None:
    e = engine(max_staleness=2)
    stale = e.forward(0, *batch(0))
    for b in (1, 2, 3):
        update(e, b)
    before = state(e)
    with pytest.raises(CommitRefused, match="batch 0: gradient staleness 3 exceeds max_gradient_staleness 2"):
        e.backward([stale], solo_vote)
    assert_same_state(before, state(e))
    assert e.version == Version(0, 3)
    assert stale.graph is not None  # the refused record was not even touched


def test_max_staleness_0_refuses_a_backward_after_an_update() -> None:
    e = engine(max_staleness=0)
    stale = e.forward(0, *batch(0))
    update(e, 1)
    before = state(e)
    with pytest.raises(CommitRefused, match="gradient staleness 1 exceeds max_gradient_staleness 0"):
        e.backward([stale], solo_vote)
    assert_same_state(before, state(e))


def test_generation_replacement_is_refused_at_backward_and_at_optimizer_step() -> None:
    e = engine()
    pending = e.forward(0, *batch(0))
    published = e.forward(1, *batch(1))
    e.backward([published], solo_vote)
    e.replace_weights(tiny_lm(seed=1).state_dict())
    assert e.version == Version(1, 0)
    before = state(e)
    with pytest.raises(CommitRefused, match=r"replaced after forward \(generation 0 -> 1\)"):
        e.backward([pending], solo_vote)
    # The gradient published before the replacement is re-validated by the optimizer step.
    with pytest.raises(CommitRefused, match="optimizer step: parameters were replaced after forward"):
        e.optimizer_step()
    assert_same_state(before, state(e))


def test_optimizer_step_refuses_gradients_of_unknown_origin() -> None:
    e = engine()
    inputs, labels = batch(0)
    causal_lm_loss(e.model(inputs), labels).backward()  # straight into .grad, around the protocol
    before = state(e)
    with pytest.raises(CommitRefused, match="no versioned backward published"):
        e.optimizer_step()
    assert_same_state(before, state(e))
    assert e.version == Version(0, 0)


def test_a_failure_in_one_backward_of_a_batch_leaves_grad_untouched() -> None:
    e = engine()
    e.backward([e.forward(9, *batch(9))], solo_vote)  # .grad already holds an accumulated gradient
    records = [e.forward(b, *batch(b)) for b in range(3)]

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected failure in the second backward")

    records[1].graph.loss.register_hook(fail)
    before = state(e)
    with pytest.raises(RuntimeError, match="injected failure"):
        e.backward(records, solo_vote)
    assert records[0].graph is None  # the first backward did run
    assert_same_state(before, state(e))


@pytest.mark.parametrize("retention", ["retain", "offload", "replay"])
def test_a_stale_gradient_is_the_gradient_at_the_forwards_weights(retention: str) -> None:
    e = engine(retention)
    reference = tiny_lm()
    loss, _ = lm_loss(reference(batch(0)[0]), batch(0)[1])
    expected = torch.autograd.grad(loss, list(reference.parameters()))
    stale = e.forward(0, *batch(0))
    update(e, 1)
    update(e, 2)  # in-place AdamW updates of the live weights since the forward
    applied = e.backward([stale], solo_vote)
    assert applied.ages == [2]
    for (name, param), grad in zip(e.params.items(), expected):
        assert torch.equal(param.grad, grad), name


# -- loss and correction --------------------------------------------------------------------------


def test_selected_logprob_loss_is_causal_lm_loss_bitwise() -> None:
    logits = torch.randn(4, 32, 256, requires_grad=True)
    labels = torch.randint(256, (4, 32))
    ours, selected = lm_loss(logits, labels)
    plain = causal_lm_loss(logits, labels)
    assert torch.equal(ours, plain)
    assert torch.equal(torch.autograd.grad(ours / 2, logits)[0], torch.autograd.grad(plain / 2, logits)[0])
    assert torch.equal(selected, torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).flatten())


def test_correction_weight_formula_and_clip_bounds_in_a_hand_computed_case() -> None:
    lp_then = torch.tensor([-2.0, -1.0, -3.0, -0.5], requires_grad=True)
    lp_now = torch.tensor([-2.0, -1.0 + math.log(2.0), 0.0, float("-inf")], dtype=torch.bfloat16)
    weight, clipped = correction_weight(lp_now, lp_then, clip=5.0)
    # exp(0) = 1; exp(ln 2) = 2 (to bf16 rounding of the input); exp(3) = 20.1 clipped to 5; exp(-inf) = 0.
    expected = torch.tensor([1.0, math.exp(float(lp_now[1].float()) + 1.0), 5.0, 0.0])
    assert weight.dtype == torch.float32 and not weight.requires_grad
    assert torch.equal(weight, expected)
    assert clipped.tolist() == [False, False, True, False]


def test_correction_scales_only_the_selected_token_cotangent() -> None:
    logits = torch.randn(2, 3, 5, requires_grad=True)
    labels = torch.randint(5, (2, 3))
    weight = torch.tensor([0.5, 1.0, 2.0, 5.0, 0.0, 1.5])
    cotangent = Cotangent()
    loss, _ = lm_loss(logits, labels, cotangent)
    cotangent.weight = weight
    scaled = torch.autograd.grad(loss, logits)[0]
    selected = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).flatten()
    expected = torch.autograd.grad(-(weight * selected).mean(), logits)[0]
    torch.testing.assert_close(scaled, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(loss.detach(), causal_lm_loss(logits, labels).detach())  # the reported loss is not weighted


# -- the pipeline -------------------------------------------------------------------------------

EP = {"ep": 2, "chunking": "eager", "chunks": 2}


def pipeline_run(config: PipelineConfig, steps: int) -> dict:
    """Every record (minus timing) and every gradient of the logical ranks hosted here."""
    grads: dict = {}
    trainer = VersionedTrainer(
        config, grad_sink=lambda r, s, g: grads.__setitem__((r, s), {n: t.clone() for n, t in g.items()})
    )
    try:
        records = [{k: v for k, v in r.items() if k != "step_time_s"} for r in trainer.run(steps)]
    finally:
        trainer.close()
    return {"records": records, "grads": grads}


def assert_runs_equal(a: dict, b: dict, ignore: tuple[str, ...] = ()) -> None:
    def kept(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in ignore} for r in records]

    assert kept(a["records"]) == kept(b["records"])
    assert a["grads"].keys() == b["grads"].keys()
    for key, grads in a["grads"].items():
        for name, g in grads.items():
            assert torch.equal(g, b["grads"][key][name]), f"gradient {name} at {key} differs"


def test_delay_0_is_plain_training_bitwise() -> None:
    plain_grads: dict = {}
    trainer = Trainer(
        TrainConfig(**EP),
        grad_sink=lambda r, s, g: plain_grads.__setitem__((r, s), {n: t.clone() for n, t in g.items()}),
    )
    plain = [trainer.step(s) for s in range(4)]
    trainer.close()
    versioned = pipeline_run(PipelineConfig(**EP, delay=0), 4)
    assert [(r["loss"], r["grad_norm"]) for r in plain] == [(r["loss"], r["grad_norm"]) for r in versioned["records"]]
    assert_runs_equal({"records": [], "grads": plain_grads}, {"records": [], "grads": versioned["grads"]})
    assert [r["ages"] for r in versioned["records"]] == [[0]] * 4


@pytest.mark.parametrize("correction", ["off", "always"])
def test_retain_offload_and_replay_are_bitwise_identical_at_delay_2(correction: str) -> None:
    runs = {
        ret: pipeline_run(PipelineConfig(**EP, delay=2, retention=ret, correction=correction), 5)
        for ret in ("retain", "offload", "replay")
    }
    assert [r["recomputes"] for r in runs["retain"]["records"]] == [0] * 5
    assert [r["recomputes"] for r in runs["replay"]["records"]] == [1] * 5
    for ret in ("offload", "replay"):
        assert_runs_equal(runs["retain"], runs[ret], ignore=("recomputes",))
    records = runs["retain"]["records"]
    assert [r["batches_applied"] for r in records] == [[b] for b in range(5)]
    assert [r["ages"] for r in records] == [[0], [1], [2], [2], [2]]
    assert len({r["loss"] for r in records}) == 5


def test_when_available_adds_no_forward_and_always_adds_exactly_one() -> None:
    runs = {
        c: pipeline_run(PipelineConfig(**EP, delay=2, correction=c), 5)["records"]
        for c in ("off", "when_available", "always")
    }
    off = [r["forwards"] for r in runs["off"]]
    assert off == [3, 1, 1, 0, 0]  # the fill's forwards are counted in the first update
    assert [r["forwards"] for r in runs["when_available"]] == off
    assert [r["forwards"] for r in runs["always"]] == [f + (r["ages"][0] > 0) for f, r in zip(off, runs["always"])]
    # Current logprobs exist under when_available only at age 0 (weight exactly 1); always has them for all.
    assert [r["correction_mean"] for r in runs["when_available"]] == [1.0, None, None, None, None]
    stats = [(r["correction_mean"], r["correction_clipped_frac"]) for r in runs["always"]]
    assert stats[0] == (1.0, 0.0) and all(m > 0 and 0 <= c <= 1 for m, c in stats)
    assert all(r["correction_mean"] is None for r in runs["off"])


def test_delay_3_with_max_staleness_2_fails_with_a_clear_error() -> None:
    trainer = VersionedTrainer(PipelineConfig(**EP, delay=3, max_gradient_staleness=2))
    applied = []
    with pytest.raises(CommitRefused, match="batch 3: gradient staleness 3 exceeds max_gradient_staleness 2"):
        for record in trainer.run(8):
            applied.append(record["batches_applied"])
    trainer.close()
    assert applied == [[0], [1], [2]]


def test_planted_double_application_is_visible_to_an_exactly_once_check() -> None:
    clean = pipeline_run(PipelineConfig(**EP, delay=2), 4)["records"]
    planted = pipeline_run(PipelineConfig(**EP, delay=2, apply_twice_batch=1), 4)["records"]
    applied = [b for r in planted for b in r["batches_applied"]]
    assert sorted(applied) == [0, 1, 1, 2, 3]  # an exactly-once check sees batch 1 twice
    assert [b for r in clean for b in r["batches_applied"]] == [0, 1, 2, 3]
    assert planted[0] == clean[0] and planted[1]["grad_norm"] != clean[1]["grad_norm"]


def _preflight_fails_on_rank_1() -> dict:
    """Process p hosts logical rank p; process 1 reloads its weights between forward and backward."""
    trainer = VersionedTrainer(PipelineConfig(ep=2, delay=1))
    rank = trainer.logical_ranks[0]
    engine = trainer.engines[rank]
    trainer.step(0)
    trainer.step(1)
    if rank == 1:
        engine.replace_weights(trainer.replicas[rank].model.state_dict())
    before = state(engine)
    version = engine.version
    try:
        trainer.step(2)
        error = ""
    except CommitRefused as exc:
        error = str(exc)
    after = state(engine)
    trainer.close()
    unchanged = all(torch.equal(before[0][n], after[0][n]) for n in before[0]) and all(
        g is None for g in after[1].values()
    )
    return {"error": error, "unchanged": unchanged, "versions": (tuple(version), tuple(engine.version))}


def test_a_failed_preflight_on_rank_1_leaves_rank_0_untouched(run_on_ranks) -> None:
    results = run_on_ranks(2, _preflight_fails_on_rank_1)
    for rank, result in enumerate(results):
        assert "logical rank 1: batch 1: parameters were replaced after forward" in result["error"], rank
        assert "logical rank 0" not in result["error"]
        assert result["unchanged"], f"rank {rank} mutated its weights or .grad"
        assert result["versions"][0] == result["versions"][1]


def test_ep2_on_one_and_two_processes_is_bitwise_identical_at_delay_2(run_on_ranks) -> None:
    config = PipelineConfig(**EP, delay=2, correction="always")
    one = pipeline_run(config, 4)
    two = run_on_ranks(2, pipeline_run, config, 4)
    assert two[0]["records"] == two[1]["records"]
    assert_runs_equal(one, {"records": two[0]["records"], "grads": {**two[0]["grads"], **two[1]["grads"]}})
    assert len(one["grads"]) == 2 * 4
