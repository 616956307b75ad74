"""bf16 mixed precision (``precision = "bf16-mixed"``), as H200s train: fp32 master weights and
AdamW state, the forward under bf16 autocast with the router in fp32. ``parity-bf16`` owes the
same bits as fp32 parity does; ``fidelity-bf16`` owes Hugging Face nothing bitwise and is judged
against a float64 run; the router's fp32 upcast, dropped, fails it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from harness.checks.fidelity import FP64_TIERS, fp64_ratios, judge_fp64
from harness.checks.grad_sum import judge as judge_sum
from harness.records import RankLine
from harness.reference.model import TopkRouter, get_config
from harness.reference.pec import PECConfig
from harness.reference.pipeline import PipelineConfig
from harness.reference.train import TrainConfig, Trainer

REPO = Path(__file__).resolve().parents[2]


def test_mixed_precision_keeps_fp32_weights_state_and_gradients_and_computes_in_bf16() -> None:
    losses = {}
    for precision in ("pure", "bf16-mixed"):
        trainer = Trainer(TrainConfig(ep=2, precision=precision))  # two logical ranks on pool threads
        try:
            records = [trainer.step(step) for step in (1, 2)]
        finally:
            trainer.close()
        losses[precision] = [r["loss"] for r in records]
        replica = trainer.replicas[0]
        assert {p.dtype for p in replica.params} == {torch.float32}
        states = [t for state in replica.optimizer.state.values() for t in state.values() if t.dim()]
        assert states and {t.dtype for t in states} == {torch.float32}
        pools = {pool.dtype for pool in replica.exchange.pools.values()}
        assert pools == {torch.bfloat16 if precision == "bf16-mixed" else torch.float32}
    # The same seed and batches: bf16 compute moves the loss a little, and only a little.
    assert losses["bf16-mixed"] != losses["pure"]
    assert all(math.isclose(a, b, rel_tol=1e-2) for a, b in zip(losses["bf16-mixed"], losses["pure"]))


def test_the_router_scores_in_fp32_under_bf16_autocast_unless_its_upcast_is_dropped() -> None:
    cfg = get_config("cpu-tiny-learned")
    x = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    dtypes = {}
    for upcast in (True, False):
        router = TopkRouter(cfg, forced_balanced=False, fault="none" if upcast else "router-upcast-dropped")
        torch.nn.init.normal_(router.weight, std=0.02, generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, weights = router(x)
        dtypes[upcast] = weights.dtype
    assert dtypes == {True: torch.float32, False: torch.bfloat16}


@pytest.mark.parametrize(
    "config,fields,refusal",
    [
        (TrainConfig, {"precision": "bf16-mixed", "dtype": "bfloat16"}, "keeps fp32 master weights"),
        (TrainConfig, {"fault": "router-upcast-dropped"}, "shows in bf16 compute only"),
        (PipelineConfig, {"precision": "bf16-mixed"}, "runs on the plain trainer"),
        (PECConfig, {"precision": "bf16-mixed"}, "runs on the plain trainer"),
    ],
    ids=["bf16-weights", "fault-in-fp32", "pipeline", "pec"],
)
def test_what_bf16_mixed_cannot_be_is_refused(config: type, fields: dict, refusal: str) -> None:
    config()  # the defaults stand
    with pytest.raises(ValueError, match=refusal):
        config(**fields)


def test_a_suite_asking_bf16_mixed_of_a_delayed_pipeline_exits_2_naming_the_field(harness_main) -> None:
    run = harness_main("run", "strict-vs-stale", "--set", "train.precision=bf16-mixed")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "train.precision" in run.stderr and "runs on the plain trainer" in run.stderr


def test_parity_bf16_is_bit_for_bit_and_is_really_bf16(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness(
        "run", "parity-bf16", "--ranks", 2, "--steps", 6, "--golden", "check", "--golden-dir", REPO / "golden",
        "--out", out,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    checks = {c["name"]: c for c in run.summary(out)["checks"]}
    for name in ("eager vs graph: loss", "eager-traced vs graph: grad_norm", "logical-ranks: loss"):
        assert checks[name]["status"] == "pass" and "bitwise" in checks[name]["detail"], checks[name]
    assert checks["eager vs eager-again: loss"]["status"] == checks["eager vs eager-again: events"]["status"] == "pass"
    for arm in ("eager", "eager-traced", "graph", "eager-again", "inproc"):
        assert checks[f"{arm}: fp32-gradient-sum"]["status"] == "pass", checks[f"{arm}: fp32-gradient-sum"]
    golden = [c for name, c in checks.items() if name.startswith("golden:")]
    assert golden and all(c["status"] == "pass" for c in golden)
    fp32 = json.loads(next((REPO / "golden" / "parity").glob("*float32*.json")).read_text())
    bf16 = [json.loads(line)["loss"] for line in (out / "arms" / "eager" / "metrics.jsonl").read_text().splitlines()]
    assert len(bf16) == 6 and bf16 != [fp32["arms"]["eager"]["loss"]["values"][str(step)] for step in range(1, 7)]


def test_fidelity_bf16_passes_by_the_float64_rule_and_fails_on_the_dropped_router_upcast(
    run_harness, tmp_path: Path
) -> None:
    run = run_harness("run", "fidelity-bf16", "--out", tmp_path / "ok", "--golden", "off")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.check(tmp_path / "ok", "q-lora: fidelity-fp64")["status"] == "pass"
    bad = tmp_path / "fault"
    run = run_harness(
        "run", "fidelity-bf16", "--set", "train.fault=router-upcast-dropped", "--golden", "off", "--out", bad
    )
    assert run.returncode == 1, run.stdout + run.stderr
    for arm in ("q-lora", "no-q-lora"):
        check = run.check(bad, f"{arm}: fidelity-fp64")
        assert check["status"] == "fail" and "median" in check["detail"], check
        assert ".mlp.gate.weight" in check["detail"] or ".mlp.experts." in check["detail"], check["detail"]


PARAMS = ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.down_proj")


def line(step: int, ours: float, theirs: float = 1e-5, scale: float = 1e-3) -> dict:
    """A bf16-mixed fidelity record: every gradient's RMSE against float64 ``ours`` and
    Hugging Face's ``theirs`` (so the two gradients differ by at least the difference of those);
    the loss and grad norm as far from float64 as Hugging Face's."""
    errors = {"grad_fp64_rmse": ours, "grad_oracle_fp64_rmse": theirs, "grad_fp64_rms": scale}
    diffs = {"grad_abs_diff": abs(ours - theirs)} | dict.fromkeys(
        ("weight_abs_diff", "adam_m_abs_diff", "adam_v_abs_diff"), 0.0
    )
    maxima = dict.fromkeys(("grad_oracle_max", "weight_oracle_max", "adam_m_oracle_max", "adam_v_oracle_max"), 1.0)
    return {
        "step": step,
        **{"loss": 5.001, "oracle_loss": 5.001, "fp64_loss": 5.0},
        **{"grad_norm": 1.0, "oracle_grad_norm": 1.0, "fp64_grad_norm": 1.0},
        "params": {name: {**errors, **diffs, **maxima} for name in PARAMS},
    }


def test_errors_within_the_multiple_of_hugging_faces_pass() -> None:
    result = judge_fp64("a", [line(step, ours=2e-5) for step in range(1, 6)], 5, FP64_TIERS)
    assert result.status == "pass", result.detail
    assert "2 parameters" in result.detail and "0 excesses" in result.detail


def test_a_flip_at_one_step_passes_where_a_per_step_rule_would_fail() -> None:
    lines = [line(step, ours=1e-3 if step == 2 else 2e-5) for step in range(1, 6)]
    assert max(fp64_ratios(lines[1], list(PARAMS), FP64_TIERS).values()) > 30  # every step's rule: a fail
    result = judge_fp64("a", lines, 5, FP64_TIERS)
    assert result.status == "pass", result.detail
    assert "2 excesses at single steps" in result.detail


def test_an_oracle_whose_side_is_bitwise_the_references_fails_as_comparing_nothing() -> None:
    result = judge_fp64("a", [line(step, ours=1e-5, theirs=1e-5) for step in range(1, 6)], 5, FP64_TIERS)
    assert result.status == "fail"
    assert result.detail == (
        "the oracle compared nothing: its side is bitwise the reference's on every tensor of every step (50 compared)"
    )


def test_an_error_at_most_steps_fails_naming_the_tensors_and_steps() -> None:
    lines = [line(step, ours=4e-5 if step > 2 else 2e-5) for step in range(1, 6)]
    result = judge_fp64("a", lines, 5, FP64_TIERS)
    assert result.status == "fail" and result.first_divergent_step == 3
    assert f"{PARAMS[0]} grad: median 1.3 x its bound, over it at steps 3, 4, 5" in result.detail


def test_a_record_without_its_float64_run_fails() -> None:
    record = line(1, ours=1e-6)
    del record["fp64_loss"]
    result = judge_fp64("a", [record], 1, FP64_TIERS)
    assert result.status == "fail"
    assert "no number 'fp64_loss' (fidelity-fp64 judges an arm in precision bf16-mixed)" in result.detail
    fewer = replace_params(line(1, ours=1e-6), "grad_fp64_rms")
    assert "expected numbers grad_fp64_rmse" in judge_fp64("a", [fewer], 1, FP64_TIERS).detail


def replace_params(record: dict, dropped: str) -> dict:
    params = {name: {k: v for k, v in p.items() if k != dropped} for name, p in record["params"].items()}
    return {**record, "params": params}


def test_tiers_out_of_range_are_refused_naming_the_field(harness_main, tmp_path: Path) -> None:
    suite = (REPO / "suites" / "fidelity-bf16.toml").read_text().replace("multiple = 3.0", "multiple = 0.5")
    path = tmp_path / "fidelity-bf16.toml"
    path.write_text(suite)
    run = harness_main("run", path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "checks.0.multiple: expected a multiple >= 1, got 0.5" in run.stderr


def test_a_nan_error_counts_as_over_its_bound() -> None:
    result = judge_fp64("a", [line(step, ours=math.nan if step > 2 else 2e-5) for step in range(1, 6)], 5, FP64_TIERS)
    assert result.status == "fail" and "over it at steps 3, 4, 5" in result.detail


def rank_lines(steps: int, summed: dict[int, str] | None = None) -> list[RankLine]:
    """A logical rank's lines whose fp32 re-sum hashes "aa..."; the sum's hash too, unless ``summed`` says."""
    return [
        RankLine(step, 5.0, 1.0, None, (summed or {}).get(step, "aa" * 16), "aa" * 16) for step in range(1, steps + 1)
    ]


def test_a_sum_bitwise_its_fp32_re_sum_on_every_rank_and_step_passes() -> None:
    result = judge_sum("a: fp32-gradient-sum", {0: rank_lines(3), 1: rank_lines(3)})
    assert result.status == "pass", result.detail
    assert result.detail.startswith("3 steps on 2 logical ranks: the replicated gradients as summed are bitwise")


@pytest.mark.parametrize(
    ("ranks", "detail"),
    [
        ({0: rank_lines(3), 1: rank_lines(3, {2: "bb" * 16})},
         "step 2: logical rank 1's replicated gradients as summed are not bitwise the fp32 sum of the logical"
         " ranks' own: summed in another precision or order"),
        ({0: rank_lines(2) + [RankLine(3, 5.0, 1.0)], 1: rank_lines(3)},
         "step 3: logical rank 0 recorded no gradient sum and fp32 re-sum"),
        ({0: [], 1: []}, "no per-rank records (ranks.rank<k>.jsonl): nothing compared"),
    ],
    ids=["differing", "unrecorded", "empty"],
)  # fmt: skip
def test_a_sum_not_shown_to_be_fp32_fails_naming_the_step_and_rank(ranks: dict, detail: str) -> None:
    result = judge_sum("a: fp32-gradient-sum", ranks)
    assert (result.status, result.detail) == ("fail", detail)


def test_recording_the_gradient_sum_changes_no_bit_of_training() -> None:
    """Goldens were recorded without the re-sum: gathering and hashing must leave training as it was."""
    config = TrainConfig(ep=2, precision="bf16-mixed")
    recorded: list[tuple[int, int, bool]] = []
    runs = {}
    for sink in (None, lambda rank, step, summed, resum: recorded.append((rank, step, torch.equal(summed, resum)))):
        trainer = Trainer(config, sum_sink=sink)
        try:
            runs[sink is None] = [trainer.step(step) for step in (1, 2)]
        finally:
            trainer.close()
    assert [(r["loss"], r["grad_norm"]) for r in runs[True]] == [(r["loss"], r["grad_norm"]) for r in runs[False]]
    assert sorted(recorded) == [(0, 1, True), (0, 2, True), (1, 1, True), (1, 2, True)]


SUM_SUITE = """
name = "sum"
description = "a bf16-mixed arm's gradient sum"
ranks = 2
steps = 2
[train]
precision = "bf16-mixed"
[arms.mixed]
[[checks]]
kind = "fp32-gradient-sum"
[[checks]]
kind = "ranks-agree"
"""

# The bug the check exists for: the replicated gradients summed over logical ranks in bf16 (and
# cast back to fp32), the same way on every rank and in every arm.
SUM_IN_BF16 = """
import harness.reference.train as train


def sum_in_bf16(self, rank, replica):
    total = self.group.sum(rank, self._dense_grads(replica).bfloat16()).float()
    for p, g in zip(replica.dense_params, total.split([p.numel() for p in replica.dense_params])):
        p.grad.copy_(g.view_as(p))


train.Trainer._sum_dense_grads = sum_in_bf16
"""


def test_gradients_summed_in_bf16_fail_the_fp32_sum_check_and_pass_every_rank_check(
    run_harness, plant, tmp_path: Path
) -> None:
    path = tmp_path / "sum.toml"
    path.write_text(SUM_SUITE)
    run = run_harness("run", path, "--golden", "off", "--out", tmp_path / "ok")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.check(tmp_path / "ok", "mixed: fp32-gradient-sum")["detail"].startswith("2 steps on 2 logical ranks")
    bad = tmp_path / "bf16-sum"
    run = run_harness("run", path, "--golden", "off", "--out", bad, env=plant(SUM_IN_BF16))
    assert run.returncode == 1, run.stdout + run.stderr
    check = run.check(bad, "mixed: fp32-gradient-sum")
    assert check["status"] == "fail" and check["first_divergent_step"] == 1, check
    assert check["detail"].startswith("step 1: logical rank 0's replicated gradients as summed are not bitwise"), check
    assert run.check(bad, "mixed: ranks-agree")["status"] == "pass"
