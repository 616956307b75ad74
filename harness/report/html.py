"""Self-contained HTML report: verdict, checks, metric overlays and differences, per-step values, manifest.

Everything is inline (plots as base64 PNG, CSS in the template), so the file opens offline and can
be attached to a CI run or a pull request as it is.
"""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path

import jinja2
import numpy as np
import pandas as pd
from matplotlib.figure import Figure  # no pyplot: no global backend or figure state
from matplotlib.ticker import MaxNLocator

_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=True,
)
_FIRST_METRICS = ("loss", "grad_norm")
_MARKERS_UP_TO = 100  # steps; beyond this markers only clutter the lines


def problems_first(checks: list[dict]) -> list[dict]:
    """Errors, then failures, then the rest, each in run order: what a reviewer needs comes first."""
    return sorted(checks, key=lambda c: {"error": 0, "fail": 1}.get(c.get("status"), 2))


def _metric_names(metrics: dict[str, pd.DataFrame]) -> list[str]:
    """Numeric columns of any arm, loss and grad_norm first."""
    names = {c for frame in metrics.values() for c in frame.columns if pd.api.types.is_numeric_dtype(frame[c])}
    return [m for m in _FIRST_METRICS if m in names] + sorted(names - set(_FIRST_METRICS))


def _differences(
    metric: str, metrics: dict[str, pd.DataFrame], golden: dict[str, pd.DataFrame]
) -> list[tuple[str, pd.Series]]:
    """|arm - first arm| for every other arm, and |arm - golden| where a golden exists, on common steps."""
    arms = [a for a, frame in metrics.items() if metric in frame.columns]
    pairs = [(f"|{arm} - {arms[0]}|", metrics[arm][metric], metrics[arms[0]][metric]) for arm in arms[1:]]
    pairs += [
        (f"|{arm} - golden|", metrics[arm][metric], golden[arm][metric])
        for arm in arms
        if arm in golden and metric in golden[arm].columns
    ]
    out = []
    for label, a, b in pairs:
        a, b = a.astype("float64").align(b.astype("float64"), join="inner")
        out.append((label, (a - b).abs()))
    return out


def _label(text: str) -> str:
    """A legend label as matplotlib shows it literally: "$" would start mathtext."""
    return text.replace("$", r"\$")


def _plot(metric: str, metrics: dict[str, pd.DataFrame], golden: dict[str, pd.DataFrame]) -> str:
    """One PNG (base64) per metric: all arms overlaid, and their absolute differences on a log scale."""
    fig = Figure(figsize=(11, 3.4), dpi=100, layout="constrained")
    ax_values, ax_diff = fig.subplots(1, 2)
    for ax in (ax_values, ax_diff):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    marker = "." if max(len(f) for f in metrics.values()) <= _MARKERS_UP_TO else None
    for arm, frame in metrics.items():
        if metric in frame.columns:
            ax_values.plot(frame.index, frame[metric], marker=marker, label=_label(arm))
    for arm, frame in golden.items():
        if metric in frame.columns:
            ax_values.plot(
                frame.index, frame[metric], linestyle="--", color="black", alpha=0.6, label=_label(f"golden {arm}")
            )
    ax_values.set(title=_label(metric), xlabel="step")
    ax_values.legend(fontsize="small")

    diffs = _differences(metric, metrics, golden)
    ax_diff.set(title=_label(f"{metric}: absolute difference"), xlabel="step")
    positive = [d[d > 0] for _, d in diffs]
    if not any(len(p) for p in positive):
        message = "all differences are exactly 0" if diffs else "nothing to compare"
        ax_diff.text(0.5, 0.5, message, ha="center", va="center", transform=ax_diff.transAxes)
        ax_diff.set(xticks=[], yticks=[], xlabel="")
    else:
        # Log scale cannot show 0: exact matches sit on a floor line below the smallest difference.
        floor = min(float(p.min()) for p in positive if len(p)) / 10
        ax_diff.set_yscale("log")
        for label, diff in diffs:
            (line,) = ax_diff.plot(diff.index, diff.where(diff > 0), marker=marker, label=_label(label))
            zeros = diff.index[diff == 0]
            if len(zeros):
                ax_diff.scatter(
                    zeros,
                    np.full(len(zeros), floor),
                    marker="v",
                    s=12,
                    color=line.get_color(),
                    label=_label(f"{label} = 0"),
                )
        ax_diff.axhline(floor, color="grey", linewidth=0.5)
        ax_diff.legend(fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _localisations(metric: str, checks: list[dict]) -> list[tuple[str, str]]:
    """(check name, where its arms' gradients first differ) for each failed comparison of this metric."""
    return [
        (c["name"], c["extra"]["first_gradient_divergence"]["summary"])
        for c in checks
        if c.get("status") == "fail"
        and c.get("name", "").endswith(f": {metric}")
        and "first_gradient_divergence" in (c.get("extra") or {})
    ]


def _cell(value: object) -> str:
    """Exact text for floats (repr round-trips), so a reviewer sees the same digits the check saw."""
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)
    return str(value)


def _step_table(
    names: list[str], metrics: dict[str, pd.DataFrame], golden: dict[str, pd.DataFrame]
) -> tuple[list[tuple[str, list[str]]], pd.DataFrame]:
    """Wide table step x (metric, arm); golden columns follow the arms."""
    columns = {}
    for name in names:
        for arm, frame in metrics.items():
            if name in frame.columns:
                columns[(name, arm)] = frame[name]
        for arm, frame in golden.items():
            if name in frame.columns:
                columns[(name, f"golden {arm}")] = frame[name]
    table = pd.DataFrame(columns).sort_index()
    headers = [(name, [label for (m, label) in columns if m == name]) for name in names]
    return headers, table


def write_html(
    path: Path,
    summary: dict,
    metrics: dict[str, pd.DataFrame],
    golden: dict[str, pd.DataFrame] | None = None,
    manifest: dict | None = None,
) -> None:
    """Renders report.html for one run. metrics and golden map arm -> step-indexed DataFrame."""
    golden = golden or {}
    names = _metric_names(metrics)
    headers, table = _step_table(names, metrics, golden)
    checks = problems_first(summary.get("checks", []))
    divergent = {
        c["first_divergent_step"]
        for c in checks
        if c.get("status") == "fail" and c.get("first_divergent_step") is not None
    }
    rows = [
        {"step": step, "divergent": step in divergent, "cells": [_cell(v) for v in row]}
        for step, row in zip(table.index, table.astype(object).itertuples(index=False))
    ]
    counts = {s: sum(c.get("status") == s for c in checks) for s in ("pass", "fail", "error", "skip")}
    html = _TEMPLATES.get_template("report.html").render(
        summary=summary,
        checks=checks,
        counts=counts,
        plots=[(name, _plot(name, metrics, golden), _localisations(name, checks)) for name in names],
        headers=headers,
        rows=rows,
        manifest=json.dumps(manifest, indent=2, default=str) if manifest is not None else None,
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(html, encoding="utf-8")
