"""The `fidelity` suite: the reference trained in lockstep with Hugging Face transformers.

End to end, on real gloo ranks: the shipped suite passes, and numerics bugs planted in the
reference's shared code, which forced-balanced suites cannot see, fail it naming the parameter.
The check itself is exercised on records written here: absent, short, malformed or diverging
records never pass.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
from suite_files import refused_without, suite_error

from harness.checks.fidelity import judge
from harness.records import read_jsonl
from harness.suites import load_suite

# Suites with an oracle arm load only where transformers is installed (the `fidelity` extra).
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers")

TIERS = {"max_rel_err": 1e-5, "weight_max_rel_err": 1e-3}
PARAMS = ("model.embed_tokens.weight", "model.layers.1.mlp.experts.down_proj")


def line(step: int, **errors: float) -> dict:
    """A fidelity record whose relative errors are ``errors`` (``<param index>_<grad|weight>``, loss, grad_norm)."""
    params = {
        name: {
            "grad_abs_diff": errors.get(f"p{i}_grad", 0.0),
            "grad_oracle_max": 1.0,
            "weight_abs_diff": errors.get(f"p{i}_weight", 0.0),
            "weight_oracle_max": 1.0,
            "adam_m_abs_diff": errors.get(f"p{i}_adam_m", 0.0),
            "adam_m_oracle_max": 1.0,
            "adam_v_abs_diff": 0.0,
            "adam_v_oracle_max": 1.0,
        }
        for i, name in enumerate(PARAMS)
    }
    return {
        "step": step,
        "oracle": "Hugging Face",
        "loss": 5.0 * (1 + errors.get("loss", 0.0)),
        "oracle_loss": 5.0,
        "grad_norm": 1.0,
        "oracle_grad_norm": 1.0,
        "params": params,
    }


def test_records_within_the_tiers_pass_and_name_the_largest_errors() -> None:
    result = judge("a: fidelity", [line(1, p1_grad=2e-6), line(2, p0_weight=4e-4)], 2, TIERS)
    assert result.status == "pass", result.detail
    assert "2 parameters" in result.detail and f"{PARAMS[1]} grad 2.0e-06" in result.detail
    assert f"{PARAMS[0]} weight 4.0e-04" in result.detail


def test_a_diverging_gradient_fails_naming_the_first_step_and_the_parameter() -> None:
    lines = [line(1), line(2, p1_grad=3e-2, p0_grad=2e-5), line(3, loss=1.0)]
    result = judge("a: fidelity", lines, 3, TIERS)
    assert result.status == "fail" and result.first_divergent_step == 2
    assert result.detail == (
        f"step 2: {PARAMS[1]} grad rel err 3.0e-02 > 1e-05; {PARAMS[0]} grad rel err 2.0e-05 > 1e-05"
        " (against Hugging Face)"
    )


def test_an_oracle_whose_side_is_bitwise_the_references_fails_as_comparing_nothing() -> None:
    result = judge("a: fidelity", [line(1), line(2)], 2, TIERS)
    assert result.status == "fail"
    assert result.detail == (
        "the oracle compared nothing: its side is bitwise the reference's on every tensor of every step (20 compared)"
    )
    assert result.extra["bitwise"] == {"differing": 0, "compared": 20}


def test_one_quantity_apart_in_one_bit_is_an_oracle_and_is_counted() -> None:
    result = judge("a: fidelity", [line(1), line(2, p1_adam_m=1e-12)], 2, TIERS)
    assert result.status == "pass", result.detail
    assert result.extra["bitwise"] == {"differing": 1, "compared": 20}
    assert "1 of 20 quantities not bitwise the oracle's" in result.detail


def test_weights_are_judged_at_their_own_tier() -> None:
    assert judge("a", [line(1, p0_weight=5e-4)], 1, TIERS).status == "pass"
    result = judge("a", [line(1, p0_weight=2e-3)], 1, TIERS)
    assert result.detail == f"step 1: {PARAMS[0]} weight rel err 2.0e-03 > 0.001 (against Hugging Face)"


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ([], "no fidelity records (fidelity.jsonl missing or empty): nothing compared"),
        ([line(1)], "recorded steps [1], expected 1-2: the steps missing were not compared"),
        ([line(1), line(1)], "recorded steps [1, 1], expected 1-2: the steps missing were not compared"),
        ([line(1), {**line(2), "params": {PARAMS[0]: line(2)["params"][PARAMS[0]]}}], f"no record of {PARAMS[1]}"),
        ([line(1), {**line(2), "oracle_loss": None}], "step 2: record has no number 'oracle_loss'"),
        ([{**line(1), "params": {}}, line(2)], "step 1: record has no parameters"),
    ],
)
def test_absent_short_or_malformed_records_fail(lines: list[dict], expected: str) -> None:
    result = judge("a: fidelity", lines, 2, TIERS)
    assert result.status == "fail" and expected in result.detail, result.detail


def test_nan_and_a_difference_against_an_all_zero_tensor_fail() -> None:
    assert judge("a", [line(1, p0_grad=math.nan)], 1, TIERS).detail.startswith(f"step 1: {PARAMS[0]} grad rel err nan")
    zero = line(1, p1_grad=1e-9)
    zero["params"][PARAMS[1]]["grad_oracle_max"] = 0.0
    assert judge("a", [zero], 1, TIERS).detail == f"step 1: {PARAMS[1]} grad rel err inf > 1e-05 (against Hugging Face)"


SUITE = """
name = "mini"
description = "oracle arms"
ranks = 2
steps = 2
[model]
config = "cpu-tiny-learned"
[train]
routing = "learned"
[arms.hf]
oracle = "hf"
[arms.plain]
"""


@needs_transformers
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ('[[checks]]\nkind = "fidelity"\narms = ["plain"]',
         'checks.0.arms.0: arm "plain" trains against no model in lockstep'),
        ('[[checks]]\nkind = "fidelity"\nmax_rel_err = 0', "checks.0.max_rel_err: expected a relative error > 0"),
        ('[[checks]]\nkind = "fidelity"\n[arms.hf2]\noracle = "hf"\nrouting = "forced-balanced"',
         'arms.hf2.oracle: needs routing = "learned": Hugging Face has no forced-balanced routing'),
        ('[[checks]]\nkind = "fidelity"\n[arms.hf2]\noracle = "hf"\ndelay = 1',
         "arms.hf2.oracle: needs a plain arm: Hugging Face has no delayed pipeline or PEC embedding"),
        ('[[checks]]\nkind = "fidelity"\n[arms.hf2]\noracle = "hf"\npec = "pipelined"',
         "arms.hf2.oracle: needs a plain arm: Hugging Face has no delayed pipeline or PEC embedding"),
        ('[[checks]]\nkind = "fidelity"\n[arms.hf2]\noracle = "jax"',
         "arms.hf2.oracle: expected one of hf, torchtitan"),
        ('[[checks]]\nkind = "fidelity"\n[arms.hf2]\nmodel = "cpu-huge"', "arms.hf2.model: expected one of"),
    ],
)  # fmt: skip
def test_fidelity_suite_mistakes_are_one_line_naming_the_field(tmp_path: Path, extra: str, expected: str) -> None:
    message = suite_error(tmp_path, SUITE + extra)
    assert expected in message and "\n" not in message, message


@needs_transformers
@needs_transformers
def test_an_oracle_arm_is_refused_where_a_model_override_leaves_hugging_face(tmp_path: Path) -> None:
    text = SUITE.replace('config = "cpu-tiny-learned"', 'config = "cpu-tiny-learned"\nscoring_func = "softmax"')
    message = suite_error(tmp_path, text + '[[checks]]\nkind = "fidelity"')
    assert message == "FILE: arms.hf.oracle: needs a model with sigmoid scoring: Hugging Face has no softmax"


def test_without_an_oracle_arm_the_check_is_refused(tmp_path: Path) -> None:
    text = SUITE.replace('oracle = "hf"\n', "") + '[[checks]]\nkind = "fidelity"'
    expected = 'FILE: checks.0: needs an arm with an oracle (oracle = "hf" or "torchtitan"); the suite has none'
    assert suite_error(tmp_path, text) == expected


@needs_transformers
def test_shipped_suite_covers_q_lora_on_and_off_with_learned_routing_and_both_ep_layouts() -> None:
    suite = load_suite("fidelity", [("--ranks", "ranks=2")])
    arms = suite.arms
    assert {arm.oracle for arm in arms.values()} == {"hf"}
    assert {(arm.ranks, arm.logical_ranks) for arm in arms.values()} == {(2, 2), (1, 2)}
    assert {arm.train["model"] for arm in arms.values()} == {"cpu-tiny-learned", "cpu-tiny-learned-no-q-lora"}
    assert all(arm.train["routing"] == "learned" and arm.train["chunking"] == "eager" for arm in arms.values())


def _fidelity(run, out: Path) -> dict[str, dict]:
    return {c["name"]: c for c in run.summary(out)["checks"] if c["kind"] == "fidelity"}


@needs_transformers
def test_the_suite_passes_against_transformers(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "fidelity", "--ranks", 2, "--out", out, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    checks = _fidelity(run, out)
    assert set(checks) == {"q-lora: fidelity", "no-q-lora: fidelity"}
    assert all(c["status"] == "pass" for c in checks.values()), checks
    # Two fp32 implementations part in some bits: the oracle compared something.
    assert all(c["extra"]["bitwise"]["differing"] > 0 for c in checks.values()), checks
    for arm, params in (("q-lora", 45), ("no-q-lora", 39)):
        lines = read_jsonl(out / "arms" / arm / "fidelity.jsonl")
        assert [r["step"] for r in lines] == [1, 2, 3, 4, 5]
        assert all(len(r["params"]) == params for r in lines)
        # The recorded losses are the reference arm's own metrics, untouched by the oracle.
        metrics = read_jsonl(out / "arms" / arm / "metrics.jsonl")
        assert [r["loss"] for r in lines] == [m["loss"] for m in metrics]


UNSCALED_ROUTING = """
import harness.reference.model as model

_route = model.TopkRouter.forward


def route_without_scaling(self, x):
    ids, weights = _route(self, x)
    return ids, weights / self.cfg.routed_scaling_factor


model.TopkRouter.forward = route_without_scaling
"""

CHOICE_WITHOUT_BIAS = """
import harness.reference.model as model

_choose = model.TopkRouter._group_limited_topk


def choose_ignoring_the_bias(self, scores):
    return _choose(self, scores - self.e_score_correction_bias)


model.TopkRouter._group_limited_topk = choose_ignoring_the_bias
"""

# Global-norm clipping that leaves the expert gradients unscaled: the grad norm is still right.
EXPERTS_NOT_CLIPPED = """
import torch

import harness.reference.train as train

_clip = train.Trainer._clip_by_global_norm


def clip_dense_only(self, rank, replica):
    experts = [p.grad.clone() for p in replica.expert_params]
    norm = _clip(self, rank, replica)
    with torch.no_grad():
        for p, g in zip(replica.expert_params, experts):
            p.grad.copy_(g)
    return norm


train.Trainer._clip_by_global_norm = clip_dense_only
"""


@needs_transformers
@pytest.mark.parametrize(
    ("bug", "parameter", "options"),
    [
        (UNSCALED_ROUTING, r"\.mlp\.experts\.\S+ (grad|adam_[mv])", ()),
        (CHOICE_WITHOUT_BIAS, r"\.mlp\.experts\.\S+ (grad|adam_[mv])", ()),
        # max_norm 0.5 makes the first step clip (its grad norm is 0.91).
        (EXPERTS_NOT_CLIPPED, r"\.mlp\.experts\.\S+ adam_[mv]", ("--set", "train.max_norm=0.5")),
    ],
    ids=["routed-scaling-factor-not-applied", "expert-choice-ignores-correction-bias", "experts-not-clipped"],
)
def test_bugs_planted_in_the_reference_fail_naming_the_parameter(
    run_harness, plant, tmp_path: Path, bug: str, parameter: str, options: tuple[str, ...]
) -> None:
    out = tmp_path / "run"
    run = run_harness(
        "run",
        "fidelity",
        "--ranks",
        2,
        "--steps",
        2,
        *options,
        "--out",
        out,
        env=plant(bug),
        timeout=600,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    for name, check in _fidelity(run, out).items():
        assert check["status"] == "fail" and check["first_divergent_step"] == 1, check
        pattern = r"step 1: (loss|model\.\S+ (grad|weight|adam_m|adam_v)) rel err \S+ > 1e-05"
        assert re.match(pattern, check["detail"]), check
        assert re.search(parameter, check["detail"]), check["detail"]
        assert f"FAIL  {name}" in run.stdout


# The lockstep's bug this check exists for: the oracle's side taken from the reference's, so every
# recorded difference is 0 and every tier holds whatever the reference computes.
ORACLE_MIRRORS_THE_REFERENCE = """
import harness.oracles.lockstep as lockstep

_differences = lockstep.differences
_init = lockstep.Lockstep.__init__


def differences(ours, theirs, what):
    return _differences(ours, {name: ours[name] for name in theirs}, what)


def mirrored(record):
    return {**record, "oracle_loss": record["loss"], "oracle_grad_norm": record["grad_norm"]}


def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if self.fidelity_sink is not None:
        sink = self.fidelity_sink
        self.fidelity_sink = lambda record: sink(mirrored(record))


lockstep.differences = differences
lockstep.Lockstep.__init__ = init
"""


@needs_transformers
def test_an_oracle_whose_values_are_the_references_fails_the_suite(run_harness, plant, tmp_path: Path) -> None:
    out = tmp_path / "run"
    planted = plant(ORACLE_MIRRORS_THE_REFERENCE)
    run = run_harness("run", "fidelity", "--ranks", 2, "--steps", 2, "--out", out, env=planted, timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr
    checks = _fidelity(run, out)
    assert set(checks) == {"q-lora: fidelity", "no-q-lora: fidelity"}
    for check in checks.values():
        assert check["status"] == "fail", check
        assert check["detail"].startswith("the oracle compared nothing: its side is bitwise the reference's"), check
        assert check["extra"]["bitwise"]["differing"] == 0


def test_without_transformers_the_suite_is_refused_with_the_install_hint(harness_main, tmp_path: Path) -> None:
    assert refused_without(harness_main, tmp_path, "transformers", "fidelity") == (
        "error: suites/fidelity.toml: arms.q-lora.oracle: needs transformers, which is not installed:"
        " pip install -c constraints.txt 'harness[fidelity]'\n"
    )
