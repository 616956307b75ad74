"""The ``fidelity`` check: the reference against an oracle (Hugging Face, torchtitan) trained in lockstep.

An arm with ``oracle = "hf"`` or ``"torchtitan"`` records ``arms/<arm>/fidelity.jsonl`` (see
:mod:`harness.oracles.lockstep`): per step the oracle's name, both losses and grad norms, and per
parameter the largest absolute difference of the gradients, of the updated weights and of AdamW's
moments beside the largest magnitude of the oracle's tensor. Here each quantity's relative error,
``max|diff| / max|oracle|`` (the loss's and grad norm's: ``|diff| / |oracle|``), must stay within
its tier:

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

Nor does an oracle that is not one. Two independent fp32 implementations sum in different orders,
so some of their tensors differ in some bits at some step; a lockstep that took the oracle's side
from the reference would pass any bug that kept within the tiers. Each check therefore counts the
quantities (loss, grad norm, and per parameter its gradient, updated weight and AdamW moments, over
every step) whose recorded difference is not exactly 0, reports the count (``extra``), and fails
when it is 0: the oracle compared nothing.

``fidelity-fp64`` judges an arm in ``precision = "bf16-mixed"``, where neither side owes the other
its bits, as torch's accuracy checker does (``torch._dynamo.utils.same`` with an fp64 reference):
each side's error against the float64 run of the same step, recorded beside it (RMSE per gradient;
the loss's and grad norm's absolute error). The bound of the reference's error is ``multiple``
times the oracle's plus ``floor`` times the float64 value's magnitude (its RMS for a gradient);
each quantity passes when the median over the steps of its error over its bound is at most 1
(:func:`judge_fp64` says why the median). torch uses a multiple of 3 for bf16 and an absolute
floor; a relative floor serves tensors of any magnitude.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from harness.checks.registry import CheckFamily, register
from harness.records import RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import FIDELITY, SuiteReader

KIND = "fidelity"
FP64_KIND = "fidelity-fp64"
DEFAULT_TIERS = {"max_rel_err": 1e-5, "weight_max_rel_err": 1e-3}
FP64_TIERS = {"multiple": 3.0, "floor": 1e-3}
FP64_SCALARS = ("fp64_loss", "fp64_grad_norm")
FP64_FIELDS = ("grad_fp64_rmse", "grad_oracle_fp64_rmse", "grad_fp64_rms")
SCALARS = ("loss", "grad_norm")  # recorded beside oracle_loss and oracle_grad_norm
PARAM_FIELDS = (
    "grad_abs_diff",
    "grad_oracle_max",
    "weight_abs_diff",
    "weight_oracle_max",
    "adam_m_abs_diff",
    "adam_m_oracle_max",
    "adam_v_abs_diff",
    "adam_v_oracle_max",
)
SHOWN = 3  # differences named in a failure's detail
# The oracles whose whole model trains in lockstep; torchrec's PEC table has its own check (pec-oracle).
LOCKSTEP_ORACLES = ("hf", "torchtitan")
NO_RECORDS = "no fidelity records (fidelity.jsonl missing or empty): nothing compared"
MIRRORED = "the oracle compared nothing: its side is bitwise the reference's on every tensor of every step"


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    """``arms`` (default: every arm with an oracle), then ``max_rel_err`` and ``weight_max_rel_err``,
    or ``fidelity-fp64``'s ``multiple`` and ``floor``."""
    defaults = DEFAULT_TIERS if kind == KIND else FP64_TIERS
    v.table(raw, dotted, ("kind", "name", "arms", *defaults))
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else kind
    if "arms" in raw:
        chosen = v.str_list(raw["arms"], f"{dotted}.arms", list(arms))
        for i, arm in enumerate(chosen):
            if arms[arm].oracle not in LOCKSTEP_ORACLES:
                raise v.error(f"{dotted}.arms.{i}", f'arm "{arm}" trains against no model in lockstep (set oracle)')
    else:
        chosen = tuple(arm for arm, spec in arms.items() if spec.oracle in LOCKSTEP_ORACLES)
        if not chosen:
            raise v.error(dotted, 'needs an arm with an oracle (oracle = "hf" or "torchtitan"); the suite has none')
    tiers = {key: _tolerance(v, raw.get(key, default), f"{dotted}.{key}", key) for key, default in defaults.items()}
    return CheckSpec(kind, name, chosen, options=tiers)


def _tolerance(v: SuiteReader, value: Any, dotted: str, key: str) -> float:
    what = "a multiple >= 1" if key == "multiple" else "a relative error > 0"
    low = 1 if key == "multiple" else 0
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or value < low or (low == 0 and value == 0):
        raise v.error(dotted, f"expected {what}, got {value!r}")
    return float(value)


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    judged = judge if check.kind == KIND else judge_fp64
    return [judged(f"{arm}: {check.name}", records[arm].fidelity, suite.steps, check.options) for arm in check.arms]


def rel_err(diff: float, scale: float) -> float:
    """diff / |scale|; 0 when both are 0 (identical zeros), inf when only the scale is 0."""
    if diff == 0:
        return 0.0
    return diff / abs(scale) if scale else math.inf


def step_errors(line: dict, params: list[str]) -> dict[str, tuple[float, str]]:
    """Every relative error of one recorded step, labelled, with the tier key that bounds it."""
    errors = {
        label: (rel_err(abs(line[key] - line[f"oracle_{key}"]), line[f"oracle_{key}"]), "max_rel_err")
        for key, label in zip(SCALARS, ("loss", "grad norm"))
    }
    for name in params:
        p = line["params"][name]
        errors[f"{name} grad"] = (rel_err(p["grad_abs_diff"], p["grad_oracle_max"]), "max_rel_err")
        errors[f"{name} weight"] = (rel_err(p["weight_abs_diff"], p["weight_oracle_max"]), "weight_max_rel_err")
        for moment in ("adam_m", "adam_v"):
            errors[f"{name} {moment}"] = (rel_err(p[f"{moment}_abs_diff"], p[f"{moment}_oracle_max"]), "max_rel_err")
    return errors


def bitwise_differing(lines: list[dict], params: list[str]) -> dict[str, int]:
    """How many recorded quantities of the run differ from the oracle's at all, of how many: the
    loss, the grad norm and every ``*_abs_diff`` of ``params`` at every step. A difference is
    recorded in float64 of fp32 (or narrower) values, so it is 0 exactly when the bits agree."""
    diffs = [line[key] - line[f"oracle_{key}"] for line in lines for key in SCALARS]
    diffs += [
        value
        for line in lines
        for name in params
        for field, value in line["params"][name].items()
        if field.endswith("_abs_diff")
    ]
    return {"differing": sum(d != 0 for d in diffs), "compared": len(diffs)}


def _mirrored(name: str, kind: str, counts: dict[str, int]) -> CheckResult | None:
    """The failure of a run whose oracle's side equals the reference's everywhere, or None."""
    if counts["differing"]:
        return None
    return CheckResult(name, kind, "fail", f"{MIRRORED} ({counts['compared']} compared)", extra={"bitwise": counts})


def malformed(line: dict, params: list[str]) -> str | None:
    """What a recorded line lacks, or None; the parameters are those of the first line."""
    for key in (*SCALARS, *(f"oracle_{k}" for k in SCALARS)):
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
        return CheckResult(name, KIND, "fail", NO_RECORDS)
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
    if missing := _missing_steps(lines, steps):
        return CheckResult(name, KIND, "fail", missing)
    counts = bitwise_differing(lines, params)
    if mirrored := _mirrored(name, KIND, counts):
        return mirrored
    largest = "; ".join(f"{label} {err:.1e}" for err, label in worst.values())
    detail = (
        f"{steps} steps: loss, grad norm, the gradients and AdamW moments of {len(params)} parameters within"
        f" {tiers['max_rel_err']:g}, updated weights within {tiers['weight_max_rel_err']:g} of {oracle_of(lines)}"
        f" (largest rel err: {largest}; {_differing(counts)})"
    )
    return CheckResult(
        name, KIND, "pass", detail, max_rel_diff=max(err for err, _ in worst.values()), extra={"bitwise": counts}
    )


def _differing(counts: dict[str, int]) -> str:
    return f"{counts['differing']} of {counts['compared']} quantities not bitwise the oracle's"


def oracle_of(lines: list[dict]) -> str:
    """The oracle the records name, for the messages."""
    return str(lines[0].get("oracle", "the oracle"))


def _missing_steps(lines: list[dict], steps: int) -> str | None:
    recorded = sorted(line["step"] for line in lines)
    if recorded != list(range(1, steps + 1)):
        return f"recorded steps {recorded}, expected 1-{steps}: the steps missing were not compared"
    return None


def fp64_ratios(line: dict, params: list[str], tiers: dict[str, float]) -> dict[str, float]:
    """Every error of one recorded step against float64 over its bound, ``multiple`` times the
    oracle's error plus ``floor`` times the float64 value's magnitude (its RMS for a gradient)."""
    m, floor = tiers["multiple"], tiers["floor"]
    ratios = {}
    for key, label in zip(SCALARS, ("loss", "grad norm")):
        exact = line[f"fp64_{key}"]
        bound = m * abs(line[f"oracle_{key}"] - exact) + floor * abs(exact)
        ratios[label] = rel_err(abs(line[key] - exact), bound)
    for name in params:
        p = line["params"][name]
        bound = m * p["grad_oracle_fp64_rmse"] + floor * p["grad_fp64_rms"]
        ratios[f"{name} grad"] = rel_err(p["grad_fp64_rmse"], bound)
    return ratios


def malformed_fp64(line: dict, params: list[str]) -> str | None:
    """What a record lacks for ``fidelity-fp64``: the float64 run of a bf16-mixed arm."""
    for key in (*SCALARS, *(f"oracle_{k}" for k in SCALARS), *FP64_SCALARS):
        if not _number(line.get(key)):
            return f"no number {key!r} (fidelity-fp64 judges an arm in precision bf16-mixed)"
    recorded = line.get("params")
    if not isinstance(recorded, dict) or not recorded:
        return "no parameters"
    for name in params:
        if not isinstance(recorded.get(name), dict) or not all(_number(recorded[name].get(f)) for f in FP64_FIELDS):
            return f"{name}: expected numbers {', '.join(FP64_FIELDS)}"
    return None


def judge_fp64(name: str, lines: list[dict], steps: int, tiers: dict[str, float]) -> CheckResult:
    """One bf16-mixed oracle arm's records: per quantity, its error against float64 over its bound
    at every step, and the median of those over the steps at most 1.

    The median, not every step: routing is discontinuous, and a bf16-sized change of a router's
    input flips a near-tie token to another expert, in the reference and in the oracle alike,
    each at its own steps. Such a flip breaks any multiple at a step or two; an error in the
    arithmetic (an fp32 upcast dropped) breaks it at most steps.
    """
    if not lines:
        return CheckResult(name, FP64_KIND, "fail", NO_RECORDS)
    params = list(lines[0].get("params") or {})
    per_quantity: dict[str, list[tuple[float, int]]] = {}
    for line in sorted(lines, key=lambda line: line.get("step", 0)):
        step = line.get("step")
        if problem := malformed_fp64(line, params):
            return CheckResult(name, FP64_KIND, "fail", f"step {step}: record has {problem}", first_divergent_step=step)
        for label, ratio in fp64_ratios(line, params, tiers).items():
            per_quantity.setdefault(label, []).append((ratio, step))
    if missing := _missing_steps(lines, steps):
        return CheckResult(name, FP64_KIND, "fail", missing)
    counts = bitwise_differing(lines, params)
    if mirrored := _mirrored(name, FP64_KIND, counts):
        return mirrored
    # A NaN error counts as over its bound.
    medians = {
        label: statistics.median(math.inf if math.isnan(r) else r for r, _ in rs) for label, rs in per_quantity.items()
    }
    bound = f"{tiers['multiple']:g} x {oracle_of(lines)}'s + {tiers['floor']:g} of the float64 value"
    over = sorted((m, label) for label, m in medians.items() if not m <= 1)[::-1]
    if over:
        shown = "; ".join(
            f"{label}: median {m:.1f} x its bound, over it at steps"
            f" {', '.join(str(s) for r, s in per_quantity[label] if not r <= 1)}"
            for m, label in over[:SHOWN]
        )
        more = f" (and {len(over) - SHOWN} more)" if len(over) > SHOWN else ""
        first = min(s for _, label in over for r, s in per_quantity[label] if not r <= 1)
        detail = f"error against float64 above {bound}: {shown}{more}"
        return CheckResult(
            name,
            FP64_KIND,
            "fail",
            detail,
            first_divergent_step=first,
            max_rel_diff=over[0][0],
            extra={"bitwise": counts},
        )
    worst, label = max((m, label) for label, m in medians.items())
    flips = sum(not r <= 1 for rs in per_quantity.values() for r, _ in rs)
    detail = (
        f"{steps} steps: loss, grad norm and the gradients of {len(params)} parameters: error against float64"
        f" within {bound}, by the median over the steps (closest: {label}, {worst:.2f} of its bound;"
        f" {flips} excesses at single steps, as routing flips give; {_differing(counts)})"
    )
    return CheckResult(name, FP64_KIND, "pass", detail, max_rel_diff=worst, extra={"bitwise": counts})


def _failure(name: str, step: int, over: list[tuple[float, str, float]], line: dict) -> CheckResult:
    shown = "; ".join(f"{label} rel err {err:.1e} > {tol:g}" for err, label, tol in over[:SHOWN])
    more = f" (and {len(over) - SHOWN} more)" if len(over) > SHOWN else ""
    return CheckResult(
        name,
        KIND,
        "fail",
        f"step {step}: {shown}{more} (against {oracle_of([line])})",
        first_divergent_step=step,
        values={"reference": line["loss"], "oracle": line["oracle_loss"]},
        max_rel_diff=over[0][0],
        extra={"over_tier": {label: err for err, label, _ in over}},
    )


register(CheckFamily(kinds=(KIND, FP64_KIND), parse=parse, run=run, reads=(FIDELITY,)))
