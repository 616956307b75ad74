"""The throughput section of report.html: the A-vs-B verdict, per-block ratios, step times, memory.

It shows what the run judged and measured, and judges nothing itself: summary.json's
``"throughput"`` holds the statistics and the verdict, and throughput.jsonl holds one row per
position of each ABBA block, as process rank 0 streamed them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from harness.records import read_jsonl
from harness.report.figures import integer_ticks, literal, new_figure, png_base64
from harness.rundir import THROUGHPUT

_SERIES_ORDER = ("main", "control")
_MIB = 2**20


def read_throughput(run_dir: Path) -> pd.DataFrame | None:
    """The rows of ``run_dir/throughput.jsonl``, or None when the run measured no throughput.

    Raises :class:`~harness.records.RecordError` when the file is corrupt (a line cut short by a
    crash at the very end is dropped, as for every streamed record).
    """
    path = Path(run_dir) / THROUGHPUT
    return pd.DataFrame(read_jsonl(path)) if path.is_file() else None


@dataclass(frozen=True)
class ThroughputView:
    """What the template shows of a throughput run, formatted."""

    verdict: str
    measured: str  # "B/A step time = ratio [low, high] · threshold t (1 + max slowdown)"
    headline: str
    criterion: str  # why the verdict follows from the interval and the threshold
    facts: list[tuple[str, str]]
    improvement: str | None  # a big speed-up, which usually means that the baseline moved
    startup_note: str | None  # set when every block position was a launch of its own
    noise_note: str | None
    arms: list[dict[str, str]]
    ratio_plot: str
    distribution_plot: str | None
    blocks: list[dict]
    missing: str | None  # why there are no per-block measurements to show


def _float(value: object) -> float:
    """A JSON number as a float; null (an interval a single block cannot bound) becomes NaN."""
    return math.nan if value is None else float(value)


def _ratio_text(value: object) -> str:
    number = _float(value)
    if math.isnan(number):
        return "n/a"
    return f"{number:.3f}" if math.isfinite(number) else ("∞" if number > 0 else "-∞")


def _milliseconds(seconds: object) -> str:
    number = _float(seconds)
    return "n/a" if math.isnan(number) else f"{number * 1000:.2f} ms"


def _rate(value: object) -> str:
    number = _float(value)
    return "n/a" if math.isnan(number) else f"{number:.0f}"


def _mib(value: object) -> str:
    number = _float(value)
    return "n/a" if math.isnan(number) else f"{number / _MIB:.1f} MiB"


def _percent(fraction: object) -> str:
    """0.05 -> "5%", 0.025 -> "2.5%": a threshold as it was given, not rounded."""
    return f"{_float(fraction) * 100:g}%"


def _bounds(stats: dict) -> str:
    return f"[{_ratio_text(stats.get('low'))}, {_ratio_text(stats.get('high'))}]"


def _interval(stats: dict) -> str:
    return f"{_ratio_text(stats.get('ratio'))} {_bounds(stats)}"


def _criterion(t: dict, threshold: float) -> str:
    """Why the verdict follows from the interval and the threshold, as the gate (harness/throughput.py) decides."""
    b, slowdown = t.get("b", "B"), _percent(t.get("max_slowdown"))
    confidence = f"{_percent(t.get('confidence'))} confidence"
    low, high = _float(t.get("low")), _float(t.get("high"))
    at = _ratio_text(threshold)
    verdict = str(t.get("verdict"))
    if verdict == "pass":
        return f"upper bound {_ratio_text(high)} ≤ threshold {at}: {b} is not slower beyond {slowdown} ({confidence})"
    if verdict == "fail":
        return f"lower bound {_ratio_text(low)} > threshold {at}: {b} is slower beyond {slowdown} ({confidence})"
    if verdict == "inconclusive" and (low > threshold or high <= threshold):  # the interval decided; the control not
        return f"the A/A control lies beyond the threshold {at}: this machine is too noisy for the gate to decide"
    if verdict == "inconclusive":
        return (
            f"the interval [{_ratio_text(low)}, {_ratio_text(high)}] straddles the threshold {at}: "
            "neither a regression nor a pass; more blocks can decide it"
        )
    return f"not judged ({verdict}): see the headline"


def improvement_note(t: dict) -> str | None:
    """The warning for a big speed-up of B (summary["throughput"]["improvement"]), which usually means
    that the baseline moved. "X% faster" is the step time saved, 1 - r for step time ratio r, as the
    gate's headline says it; the tokens/s gained, 1/r - 1, is given beside it."""
    ratio = _float(t.get("ratio"))
    if not t.get("improvement") or not ratio > 0:
        return None
    return (
        f"{t.get('b')} is {1 - ratio:.1%} faster than {t.get('a')} (step time × {ratio:.3f},"
        f" {1 / ratio - 1:.1%} more tokens/s): check whether the baseline moved"
    )


def _spread(t: dict) -> str:
    """IQR/median of each role's step times, e.g. "A 4.0%, B 12.0%"."""
    return ", ".join(f"{role} {_float(v):.1%}" for role, v in (t.get("noise") or {}).items()) or "n/a"


def _noise_note(t: dict) -> str | None:
    if not t.get("noisy"):
        return None
    return f"noisy: IQR/median over 10% within an arm ({_spread(t)}); the interval is wide for that reason"


def _ratio_label(t: dict) -> str:
    return f"{t.get('b')}/{t.get('a')} step time"


def _threshold_text(t: dict, threshold: float) -> str:
    return f"{_ratio_text(threshold)} (1 + max slowdown {_percent(t.get('max_slowdown'))})"


def _facts(t: dict, threshold: float) -> list[tuple[str, str]]:
    control = t.get("control")
    control_text = (
        f"{_interval(control)}{' (noisy)' if control.get('noisy') else ''}: the noise floor of this machine"
        if control
        else "not run (--control measures A against a copy of A)"
    )
    return [
        (_ratio_label(t), _interval(t)),
        (
            "confidence",
            f"{_percent(t.get('confidence'))} confidence sequence over the per-block log ratios: it holds after"
            " every block at once, so the run may stop at the first block that decides",
        ),
        ("threshold", _threshold_text(t, threshold)),
        (
            "blocks",
            f"{t.get('blocks')} ABBA blocks of {t.get('steps')} steps, after {t.get('warmup')} warm-up steps per arm"
            f" ({t.get('block_rule', 'fixed')})",
        ),
        ("stopped", str(t.get("stopped") or "n/a")),
        ("timing", f"{t.get('timing')}, {t.get('mode')}"),
        ("noise (IQR/median)", _spread(t)),
        ("control (A vs A)", control_text),
    ]


def _ratio_plot(t: dict, threshold: float) -> str:
    """Per-block ratios with the interval as a band and the threshold; the control's beside them."""
    panels = [(f"{t.get('b')}/{t.get('a')}", t)]
    if t.get("control"):
        panels.append((f"control: {t.get('a')}/{t.get('a')} (a second copy)", t["control"]))
    fig = new_figure(5.5 * len(panels), 3.4)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (title, stats) in zip(axes, panels):
        ratios = [_float(r) for r in stats.get("per_block_ratios") or []]
        ax.plot(range(1, len(ratios) + 1), ratios, "o", color="C0", label="per-block ratio", zorder=3)
        ratio = _float(stats.get("ratio"))
        bounded = [i for i in stats.get("sequence") or [] if math.isfinite(_float(i["high"])) and _float(i["low"]) > 0]
        if bounded:
            blocks = [i["blocks"] for i in bounded]
            lows, highs = [_float(i["low"]) for i in bounded], [_float(i["high"]) for i in bounded]
            ax.fill_between(blocks, lows, highs, step="mid", color="C0", alpha=0.18, label="interval after each block")
        if math.isfinite(ratio):
            ax.axhline(ratio, color="C0", linewidth=1.2, label=f"ratio {ratio:.3f}")
        if math.isfinite(threshold):
            ax.axhline(threshold, color="C3", linestyle="--", label=f"threshold {threshold:.3f}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=literal(title), xlabel="block")
        integer_ticks(ax)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("step time ratio (> 1: slower)")
    return png_base64(fig)


def _ordered(frame: pd.DataFrame) -> pd.DataFrame:
    """Main series first, then the control; each by block and position."""
    rank = frame["series"].map(lambda s: _SERIES_ORDER.index(s) if s in _SERIES_ORDER else len(_SERIES_ORDER))
    return frame.assign(_rank=rank).sort_values(["_rank", "block", "position"], kind="stable").drop(columns="_rank")


def _copy(rows: pd.DataFrame, role: str) -> str:
    """The trainer a role's rows time: "A2" for the control's second copy of A; the role without copies."""
    return "/".join(rows["copy"].astype(str).unique()) if "copy" in rows.columns else role


def _distribution_plot(frame: pd.DataFrame) -> str:
    """Step time of every measurement per series and role (box and points), and peak memory per block."""
    # Position 0 is A and position 1 is B in every block: main A, main B, control A, control B.
    series_roles = list(_ordered(frame).groupby(["series", "role"], sort=False))
    labels = [f"{series} {_copy(rows, role)}\n{'/'.join(rows['arm'].astype(str).unique())}"
              for (series, role), rows in series_roles]  # fmt: skip
    fig = new_figure(11, 3.6)
    ax_time, ax_memory = fig.subplots(1, 2)
    times = [rows["step_time_s"].astype("float64").dropna().to_numpy() for _, rows in series_roles]
    positions = np.arange(1, len(times) + 1)
    ax_time.boxplot(times, positions=positions, widths=0.5, showfliers=False)
    for x, values in zip(positions, times):
        jitter = np.linspace(-0.12, 0.12, len(values)) if len(values) > 1 else np.zeros(len(values))
        ax_time.plot(x + jitter, values, ".", alpha=0.7)
    ax_time.set_xticks(positions, [literal(label) for label in labels])
    ax_time.set(title="step time per measurement", ylabel="seconds per step")

    has_memory = "peak_memory_bytes" in frame.columns and frame["peak_memory_bytes"].notna().any()
    if has_memory:
        for label, (_, rows) in zip(labels, series_roles):
            per_block = rows.groupby("block")["peak_memory_bytes"].max().astype("float64") / _MIB
            ax_memory.plot(per_block.index, per_block.to_numpy(), "o-", label=literal(label.replace("\n", ": ")))
        integer_ticks(ax_memory)
        ax_memory.set(title="peak memory per block", xlabel="block", ylabel="MiB")
        ax_memory.legend(fontsize="small")
    else:
        ax_memory.text(0.5, 0.5, "no peak memory recorded", ha="center", va="center", transform=ax_memory.transAxes)
        ax_memory.set(xticks=[], yticks=[])
    return png_base64(fig)


def _block_rows(frame: pd.DataFrame, t: dict) -> list[dict]:
    """One row per measurement; the block's ratio, and the interval after it, span the rows of its block."""
    ratios = {
        "main": t.get("per_block_ratios") or [],
        "control": (t.get("control") or {}).get("per_block_ratios") or [],
    }
    intervals = {
        "main": t.get("sequence") or [],
        "control": (t.get("control") or {}).get("sequence") or [],
    }
    rows = []
    for (series, block), measured in _ordered(frame).groupby(["series", "block"], sort=False):
        series_ratios = ratios.get(series, [])
        index = int(block) - 1
        ratio = _ratio_text(series_ratios[index]) if 0 <= index < len(series_ratios) else "n/a"
        after = intervals.get(series, [])
        interval = _bounds(after[index]) if 0 <= index < len(after) else "n/a"
        for i, m in enumerate(measured.to_dict("records")):
            first, steps = m.get("first_step"), m.get("steps")
            rows.append(
                {
                    "series": series,
                    "block": block,
                    "position": m.get("position"),
                    "role": m.get("role"),
                    "arm": m.get("arm"),
                    "steps": f"{steps} (from step {first})" if first is not None else str(steps),
                    "seconds": _milliseconds(m.get("seconds")),
                    "step_time": _milliseconds(m.get("step_time_s")),
                    "tokens_per_s": _rate(m.get("tokens_per_s")),
                    "peak_memory": _mib(m.get("peak_memory_bytes")),
                    "ratio": ratio if i == 0 else None,
                    "interval": interval,
                    "ratio_rows": len(measured),
                }
            )
    return rows


def throughput_view(t: dict, frame: pd.DataFrame | None) -> ThroughputView:
    """Formats summary.json's "throughput" and the rows of throughput.jsonl for the template."""
    threshold = _float(t["threshold"]) if "threshold" in t else 1 + _float(t.get("max_slowdown"))
    separate = t.get("mode") == "separate-launches"
    measured = frame is not None and not frame.empty
    return ThroughputView(
        verdict=str(t.get("verdict")),
        measured=f"{_ratio_label(t)} = {_interval(t)} · threshold {_threshold_text(t, threshold)}",
        headline=str(t.get("headline") or ""),
        criterion=_criterion(t, threshold),
        facts=_facts(t, threshold),
        improvement=improvement_note(t),
        startup_note=(
            "Each block position is its own launch (the arms need different process counts): each rebuilds"
            " its arm, warms it up and trains from step 1 again. Start-up (launch, imports, build, warm-up)"
            " is outside the step times; each launch's wall time, start-up included, is under Launches in"
            " summary.json."
            if separate
            else None
        ),
        noise_note=_noise_note(t),
        arms=[
            {
                "arm": arm,
                "role": "A" if arm == t.get("a") else "B",  # B is labelled "<arm> (copy B)" when A is B
                "step_time": _milliseconds(stats.get("step_time_s")),
                "tokens_per_s": _rate(stats.get("tokens_per_s")),
                "peak_memory": _mib(stats.get("peak_memory_bytes")),
            }
            for arm, stats in (t.get("arms") or {}).items()
        ],
        ratio_plot=_ratio_plot(t, threshold),
        distribution_plot=_distribution_plot(frame) if measured else None,
        blocks=_block_rows(frame, t) if measured else [],
        missing=None if measured else f"{THROUGHPUT} holds no measurements: no per-block values to show",
    )
