"""Comparison tiers for per-step metric trajectories, judged as a CheckResult (results.py).

Pairwise comparison from a shared seed is the durable check (torchtitan's loss_compare); the tier
says how strict it is. Exact, Ulp and Close judge every step on its own. Band judges the whole
trajectory, after Megatron's approximate tier: a per-step relative bound with a small budget of
failing steps, a bound on the final value, and a minimum correlation.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import numpy as np
import pandas as pd

from harness.results import CheckResult

# Keys a suite's check table may carry besides the tier's own fields.
NON_TIER_KEYS = frozenset({"kind", "metrics", "arms", "name"})


@dataclass(frozen=True)
class _Judgement:
    failed: bool
    first: int | None  # position (not step) of the first divergence
    reason: str  # why it failed, or the tier's own pass statistics
    extra: dict


class _Tier(ABC):
    kind: ClassVar[str]
    _fields: ClassVar[dict[str, str]] = {}  # spec key -> attribute

    def spec(self) -> dict:
        """The suite/golden form of this tier; tier_from_spec(t.spec()) == t."""
        values = {key: getattr(self, attr) for key, attr in self._fields.items()}
        return {"kind": self.kind, **{k: v for k, v in values.items() if v is not None}}

    @abstractmethod
    def describe(self) -> str:
        """The pass condition in words, e.g. "within 4 ulp"."""

    @abstractmethod
    def step_ok(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Per-step verdict on two aligned, finite float64 arrays."""

    def judge(self, a: np.ndarray, b: np.ndarray) -> _Judgement:
        bad = np.flatnonzero(~self.step_ok(a, b))
        reason = f"{bad.size} of {a.size} steps not {self.describe()}" if bad.size else ""
        return _Judgement(bool(bad.size), int(bad[0]) if bad.size else None, reason, {})


@dataclass(frozen=True)
class Exact(_Tier):
    """Identical bits at every step: what a numerics-preserving refactor must deliver."""

    kind: ClassVar[str] = "exact"

    def describe(self) -> str:
        return "bitwise identical"

    def step_ok(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # Bits, not ==: -0.0 vs 0.0 is a different computation and is reported as a divergence.
        return a.view(np.int64) == b.view(np.int64)


@dataclass(frozen=True)
class Ulp(_Tier):
    """At most n representable doubles apart: reordering noise allowed, real drift not."""

    n: int
    kind: ClassVar[str] = "ulp"
    _fields: ClassVar[dict[str, str]] = {"ulps": "n"}

    def __post_init__(self) -> None:
        _require_count("ulp", "ulps", self.n)

    def describe(self) -> str:
        return f"within {self.n} ulp"

    def step_ok(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return ulp_distance(a, b) <= self.n


@dataclass(frozen=True)
class Close(_Tier):
    """|a - b| <= atol + rtol * |b| at every step, b being the reference arm."""

    rtol: float
    atol: float
    kind: ClassVar[str] = "close"
    _fields: ClassVar[dict[str, str]] = {"rtol": "rtol", "atol": "atol"}

    def __post_init__(self) -> None:
        _require_real("close", "rtol", self.rtol, 0.0, math.inf)
        _require_real("close", "atol", self.atol, 0.0, math.inf)

    def describe(self) -> str:
        return f"within rtol={self.rtol:g} atol={self.atol:g}"

    def step_ok(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.abs(a - b) <= self.atol + self.rtol * np.abs(b)


@dataclass(frozen=True)
class Band(_Tier):
    """Trajectory-level tolerance (Megatron's approximate tier) for runs that may not match bitwise."""

    max_rel: float
    final_rel: float
    min_corr: float
    max_failing_steps: int | None = None  # None: Megatron's budget, min(max(N // 100, 1), 50)
    kind: ClassVar[str] = "band"
    _fields: ClassVar[dict[str, str]] = {
        "max_rel": "max_rel",
        "final_rel": "final_rel",
        "min_corr": "min_corr",
        "max_failing_steps": "max_failing_steps",
    }

    def __post_init__(self) -> None:
        _require_real("band", "max_rel", self.max_rel, 0.0, math.inf)
        _require_real("band", "final_rel", self.final_rel, 0.0, math.inf)
        _require_real("band", "min_corr", self.min_corr, -1.0, 1.0)
        if self.max_failing_steps is not None:
            _require_count("band", "max_failing_steps", self.max_failing_steps)

    def budget(self, n_steps: int) -> int:
        if self.max_failing_steps is not None:
            return self.max_failing_steps
        return min(max(n_steps // 100, 1), 50)

    def describe(self) -> str:
        return f"within band max_rel={self.max_rel:g} final_rel={self.final_rel:g} min_corr={self.min_corr:g}"

    # Below this many steps a correlation says nothing (3 points of a flat loss can give -0.85),
    # so it is reported but not judged; the per-step and final bounds still are.
    MIN_STEPS_FOR_CORR: ClassVar[int] = 10

    def step_ok(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return rel_diff(a, b) <= self.max_rel

    def judge(self, a: np.ndarray, b: np.ndarray) -> _Judgement:
        over = np.flatnonzero(~self.step_ok(a, b))
        budget = self.budget(a.size)
        final_rel = float(rel_diff(a[-1:], b[-1:])[0])
        corr = _pearson(a, b)
        problems = []
        if over.size > budget:
            problems.append(f"{over.size} steps over max_rel {self.max_rel:g} (budget {budget})")
        if final_rel > self.final_rel:
            problems.append(f"final rel {final_rel:.3g} > {self.final_rel:g}")
        if a.size >= self.MIN_STEPS_FOR_CORR and not corr >= self.min_corr:
            shown = "undefined (a constant trajectory)" if math.isnan(corr) else f"{corr:.6f}"
            problems.append(f"correlation {shown} < {self.min_corr:g}")
        first = None
        if over.size > budget:
            first = int(over[0])
        elif final_rel > self.final_rel:
            first = a.size - 1
        extra = {"steps_over_max_rel": int(over.size), "budget": budget, "final_rel": final_rel, "corr": corr}
        if problems:
            return _Judgement(True, first, "; ".join(problems), extra)
        judged = "" if a.size >= self.MIN_STEPS_FOR_CORR else f" (not judged under {self.MIN_STEPS_FOR_CORR} steps)"
        stats = f"{over.size} steps over max_rel (budget {budget}), final rel {final_rel:.3g}, corr {corr:.6f}{judged}"
        return _Judgement(False, None, stats, extra)


Tier = Union[Exact, Ulp, Close, Band]
_TIERS: dict[str, type[_Tier]] = {t.kind: t for t in (Exact, Ulp, Close, Band)}


def _require_count(kind: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{kind} check: '{key}' must be a non-negative integer, got {value!r}")


def _require_real(kind: str, key: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi or math.isinf(value):
        bounds = f">= {lo:g}" if math.isinf(hi) else f"in [{lo:g}, {hi:g}]"
        raise ValueError(f"{kind} check: '{key}' must be a finite number {bounds}, got {value!r}")


def tier_from_spec(spec: dict) -> Tier:
    """Parses a check table such as {"kind": "close", "rtol": 1e-4, "atol": 1e-5} into a tier."""
    kind = spec.get("kind")
    if kind not in _TIERS:
        raise ValueError(f"check 'kind': expected one of {sorted(_TIERS)}, got {kind!r}")
    cls = _TIERS[kind]
    unknown = sorted(set(spec) - set(cls._fields) - NON_TIER_KEYS)
    if unknown:
        raise ValueError(f"{kind} check: unknown field '{unknown[0]}' (allowed: {sorted(cls._fields)})")
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, attr in cls._fields.items():
        if key in spec:
            kwargs[attr] = spec[key]
        elif defaults[attr] is dataclasses.MISSING:
            raise ValueError(f"{kind} check: missing field '{key}'")
    return cls(**kwargs)


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Number of float64 values between a and b (0 for -0.0 vs 0.0), elementwise, as uint64."""
    ia = np.ascontiguousarray(a, dtype=np.float64).view(np.int64)
    ib = np.ascontiguousarray(b, dtype=np.float64).view(np.int64)
    # Map the sign-magnitude bit patterns onto a monotonic integer line; -0.0 lands on 0.
    oa = np.where(ia < 0, np.iinfo(np.int64).min - ia, ia)
    ob = np.where(ib < 0, np.iinfo(np.int64).min - ib, ib)
    ua, ub = oa.view(np.uint64), ob.view(np.uint64)
    return np.where(oa >= ob, ua - ub, ub - ua)  # wrapping uint64 subtraction is exact here


def rel_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| / |b| with b the reference; 0 where equal, inf where b is 0 and a is not."""
    diff = np.abs(a - b)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = diff / np.abs(b)
    return np.where(diff == 0, 0.0, rel)


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    if a.size < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return 1.0 if np.array_equal(a, b) else math.nan
    return float(np.corrcoef(a, b)[0, 1])


def format_steps(steps: list[int], limit: int = 6) -> str:
    """Compresses sorted steps into ranges: [1, 2, 3, 7] -> "1-3, 7"."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    parts = [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in runs]
    return ", ".join(parts[:limit]) + (f", ... ({len(steps)} steps)" if len(parts) > limit else "")


def _step_mismatch(a: pd.Series, b: pd.Series, label_a: str, label_b: str) -> tuple[str, int | None] | None:
    """Explains differing step sets (an arm cut short, or with gaps); None when they match."""
    steps_a, steps_b = set(a.index.tolist()), set(b.index.tolist())
    if steps_a == steps_b:
        return None if steps_a else (f"no steps recorded in arm '{label_a}' or arm '{label_b}'", None)
    parts = []
    for label, mine, theirs in ((label_a, steps_a, steps_b), (label_b, steps_b, steps_a)):
        missing = sorted(theirs - mine)
        if not missing:
            continue
        if not mine:
            parts.append(f"arm '{label}' has no values ({len(theirs)} steps in the other arm)")
        elif min(missing) > max(mine):
            parts.append(f"arm '{label}' stops at step {max(mine)} of {len(theirs)} (missing {format_steps(missing)})")
        else:
            parts.append(f"arm '{label}' is missing steps {format_steps(missing)}")
    return "; ".join(parts), min(steps_a ^ steps_b)


def _fmt(x: float) -> str:
    return f"{x:.2g}"


def _pair(values: dict[str, float]) -> str:
    return " ".join(f"{label}={v!r}" for label, v in values.items())


def compare_series(
    name: str, a: pd.Series, b: pd.Series, tier: Tier, *, label_a: str = "a", label_b: str = "b"
) -> CheckResult:
    """Compares two step-indexed trajectories under a tier; b is the reference for relative diffs.

    Non-finite values and differing step sets fail before the tier is consulted: a metric that
    went NaN or an arm that stopped early must never pass as "close enough".
    """
    if label_a == label_b:
        raise ValueError(f"compare_series({name!r}): both arms are labelled {label_a!r}")
    a = pd.to_numeric(a, errors="coerce").astype("float64").sort_index()
    b = pd.to_numeric(b, errors="coerce").astype("float64").sort_index()
    mismatch = _step_mismatch(a, b, label_a, label_b)
    if mismatch is not None:
        detail, first = mismatch
        return CheckResult(name, tier.kind, "fail", detail, first_divergent_step=first)
    steps = a.index.to_numpy()
    x, y = a.to_numpy(), b.reindex(a.index).to_numpy()
    nonfinite = ~(np.isfinite(x) & np.isfinite(y))
    if nonfinite.any():
        i = int(np.argmax(nonfinite))
        values = {label_a: float(x[i]), label_b: float(y[i])}
        arms = " and ".join(f"'{label}'" for label, v in values.items() if not math.isfinite(v))
        detail = (
            f"non-finite value in arm {arms} at step {steps[i]}: {_pair(values)}"
            f" ({int(nonfinite.sum())} of {x.size} steps non-finite)"
        )
        return CheckResult(name, tier.kind, "fail", detail, int(steps[i]), values)

    max_abs = float(np.abs(x - y).max())
    max_rel = float(rel_diff(x, y).max())
    max_ulps = int(ulp_distance(x, y).max())
    judgement = tier.judge(x, y)
    diffs = f"max abs {_fmt(max_abs)}, max rel {_fmt(max_rel)}"
    if isinstance(tier, (Exact, Ulp)):  # ulps only mean something at bit-level strictness
        diffs += f", max {max_ulps} ulp"
    extra = {"steps": int(x.size), "max_ulps": max_ulps, **judgement.extra}
    if not judgement.failed:
        detail = f"{x.size} steps {tier.describe()}" + ("" if max_ulps == 0 else f" ({diffs})")
        if judgement.reason:
            detail += f": {judgement.reason}"
        return CheckResult(name, tier.kind, "pass", detail, None, None, max_abs, max_rel, extra)
    if judgement.first is None:
        detail = f"{judgement.reason} ({diffs})"
        return CheckResult(name, tier.kind, "fail", detail, None, None, max_abs, max_rel, extra)
    i = judgement.first
    values = {label_a: float(x[i]), label_b: float(y[i])}
    detail = f"first divergence at step {steps[i]}: {_pair(values)} ({diffs}; {judgement.reason})"
    return CheckResult(name, tier.kind, "fail", detail, int(steps[i]), values, max_abs, max_rel, extra)


def compare_arms(
    name: str,
    metrics_a: pd.DataFrame,
    metrics_b: pd.DataFrame,
    metric: str,
    tier: Tier,
    label_a: str = "a",
    label_b: str = "b",
) -> CheckResult:
    """compare_series on one metric column of two arms; a missing column fails naming the arm."""
    missing = [label for label, frame in ((label_a, metrics_a), (label_b, metrics_b)) if metric not in frame.columns]
    if missing:
        arms = " and ".join(f"'{label}'" for label in missing)
        return CheckResult(name, tier.kind, "fail", f"metric '{metric}' missing from arm {arms}")
    return compare_series(name, metrics_a[metric], metrics_b[metric], tier, label_a=label_a, label_b=label_b)
