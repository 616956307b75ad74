"""The ``fidelity`` check: the reference against Hugging Face transformers, trained in lockstep.

An arm with ``oracle = "hf"`` records ``arms/<arm>/fidelity.jsonl`` (see
:mod:`harness.oracles.hf`): per step both losses and grad norms, and per parameter the largest
absolute difference of the gradients and of the updated weights beside the largest magnitude of
the Hugging Face tensor. Here each quantity's relative error, ``max|diff| / max|hf|`` (the loss's
and grad norm's: ``|diff| / |hf|``), must stay within its tier:

- ``max_rel_err`` (default 1e-5, the fp32 tier of the reference's unit test) for the loss, the
  grad norm, every gradient and AdamW's two moments after the step (``adam_m``, ``adam_v``), which
  are linear and quadratic in the clipped gradient: equivalent fp32 summation orders differ by ~1e-6,
  and a clipping or moment bug shows here at the first step;
- ``weight_max_rel_err`` (default 1e-3) for every updated weight. Adam divides each gradient by
  its own magnitude: where an element's gradient is near AdamW's eps (1e-8), gradients equal to
  ~1e-6 of their tensor's largest move that element's update by up to ``lr * diff / eps``. At
  lr 1e-3 that is ~1e-4 of the weights' magnitude at the first step, harmless but not 1e-5.

A failure names the first step that differs and what differs there, largest error first:
``step 1: model.layers.1.mlp.experts.down_proj grad rel err 3.0e-02 > 1e-05``. No records, a step
not recorded, or a line without a parameter the first step had fails: nothing passes unchecked.
"""

from __future__ import annotations

import math
from typing import Any

from harness.checks.registry import CheckFamily, SuiteReader, register
from harness.compare import CheckResult
from harness.records import RunRecords
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import FIDELITY

KIND = "fidelity"
DEFAULT_TIERS = {"max_rel_err": 1e-5, "weight_max_rel_err": 1e-3}
SCALARS = ("loss", "grad_norm")  # recorded beside hf_loss and hf_grad_norm
PARAM_FIELDS = (
    "grad_abs_diff",
    "grad_hf_max",
    "weight_abs_diff",
    "weight_hf_max",
    "adam_m_abs_diff",
    "adam_m_hf_max",
    "adam_v_abs_diff",
    "adam_v_hf_max",
)
SHOWN = 3  # differences named in a failure's detail


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    """``arms`` (default: every arm with an oracle), ``max_rel_err``, ``weight_max_rel_err``."""
    v.table(raw, dotted, ("kind", "name", "arms", *DEFAULT_TIERS))
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else KIND
    if "arms" in raw:
        chosen = v.str_list(raw["arms"], f"{dotted}.arms", list(arms))
        for i, arm in enumerate(chosen):
            if arms[arm].oracle is None:
                raise v.error(f"{dotted}.arms.{i}", f'arm "{arm}" trains against no oracle (set oracle = "hf")')
    else:
        chosen = tuple(arm for arm, spec in arms.items() if spec.oracle is not None)
        if not chosen:
            raise v.error(dotted, 'needs an arm with an oracle (oracle = "hf"); the suite has none')
    tiers = {key: _tolerance(v, raw.get(key, default), f"{dotted}.{key}") for key, default in DEFAULT_TIERS.items()}
    return CheckSpec(kind, name, chosen, options=tiers)


def _tolerance(v: SuiteReader, value: Any, dotted: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise v.error(dotted, f"expected a relative error > 0, got {value!r}")
    return float(value)


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    return [judge(f"{arm}: {check.name}", records[arm].fidelity, suite.steps, check.options) for arm in check.arms]


def rel_err(diff: float, scale: float) -> float:
    """diff / |scale|; 0 when both are 0 (identical zeros), inf when only the scale is 0."""
    if diff == 0:
        return 0.0
    return diff / abs(scale) if scale else math.inf


def step_errors(line: dict, params: list[str]) -> dict[str, tuple[float, str]]:
    """Every relative error of one recorded step, labelled, with the tier key that bounds it."""
    errors = {
        label: (rel_err(abs(line[key] - line[f"hf_{key}"]), line[f"hf_{key}"]), "max_rel_err")
        for key, label in zip(SCALARS, ("loss", "grad norm"))
    }
    for name in params:
        p = line["params"][name]
        errors[f"{name} grad"] = (rel_err(p["grad_abs_diff"], p["grad_hf_max"]), "max_rel_err")
        errors[f"{name} weight"] = (rel_err(p["weight_abs_diff"], p["weight_hf_max"]), "weight_max_rel_err")
        for moment in ("adam_m", "adam_v"):
            errors[f"{name} {moment}"] = (rel_err(p[f"{moment}_abs_diff"], p[f"{moment}_hf_max"]), "max_rel_err")
    return errors


def malformed(line: dict, params: list[str]) -> str | None:
    """What a recorded line lacks, or None; the parameters are those of the first line."""
    for key in (*SCALARS, *(f"hf_{k}" for k in SCALARS)):
        if not _number(line.get(key)):
            return f"no number {key!r}"
    recorded = line.get("params")
    if not isinstance(recorded, dict) or not recorded:
        return "no parameters"
    missing = [name for name in params if name not in recorded]
    if missing:
        return f"no record of {', '.join(missing[:SHOWN])}{' ...' if len(missing) > SHOWN else ''}"
    for name in params:
        if not isinstance(recorded[name], dict) or not all(_number(recorded[name].get(f)) for f in PARAM_FIELDS):
            return f"{name}: expected numbers {', '.join(PARAM_FIELDS)}"
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def judge(name: str, lines: list[dict], steps: int, tiers: dict[str, float]) -> CheckResult:
    """One oracle arm's fidelity records against the tiers, step by step."""
    if not lines:
        return CheckResult(
            name, KIND, "fail", "no fidelity records (fidelity.jsonl missing or empty): nothing compared"
        )
    params = list(lines[0].get("params") or {})
    worst: dict[str, tuple[float, str]] = {}  # tier key -> (largest error, its label)
    for line in sorted(lines, key=lambda line: line.get("step", 0)):
        step = line.get("step")
        problem = malformed(line, params)
        if problem:
            return CheckResult(name, KIND, "fail", f"step {step}: record has {problem}", first_divergent_step=step)
        errors = step_errors(line, params)
        over = sorted(
            ((err, label, tiers[tier]) for label, (err, tier) in errors.items() if not err <= tiers[tier]),
            key=lambda item: -item[0] if not math.isnan(item[0]) else -math.inf,
        )
        if over:
            return _failure(name, step, over, line)
        for label, (err, tier) in errors.items():
            if err >= worst.get(tier, (-1.0, ""))[0]:
                worst[tier] = (err, label)
    recorded = sorted(line["step"] for line in lines)
    if recorded != list(range(1, steps + 1)):
        detail = f"recorded steps {recorded}, expected 1-{steps}: the steps missing were not compared"
        return CheckResult(name, KIND, "fail", detail)
    largest = "; ".join(f"{label} {err:.1e}" for err, label in worst.values())
    detail = (
        f"{steps} steps: loss, grad norm, the gradients and AdamW moments of {len(params)} parameters within"
        f" {tiers['max_rel_err']:g}, updated weights within {tiers['weight_max_rel_err']:g} of Hugging Face"
        f" (largest rel err: {largest})"
    )
    return CheckResult(name, KIND, "pass", detail, max_rel_diff=max(err for err, _ in worst.values()))


def _failure(name: str, step: int, over: list[tuple[float, str, float]], line: dict) -> CheckResult:
    shown = "; ".join(f"{label} rel err {err:.1e} > {tol:g}" for err, label, tol in over[:SHOWN])
    more = f" (and {len(over) - SHOWN} more)" if len(over) > SHOWN else ""
    return CheckResult(
        name,
        KIND,
        "fail",
        f"step {step}: {shown}{more}",
        first_divergent_step=step,
        values={"reference": line["loss"], "hf": line["hf_loss"]},
        max_rel_diff=over[0][0],
        extra={"over_tier": {label: err for err, label, _ in over}},
    )


register(CheckFamily(kinds=(KIND,), parse=parse, run=run, reads=(FIDELITY,)))
