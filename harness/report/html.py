"""Self-contained HTML report: verdict, throughput, checks grouped by kind, the first op where two
arms part, metric overlays and differences, per-step values, manifest.

Everything is inline (plots as base64 PNG, CSS in the template), so the file opens offline and can
be attached to a CI run or a pull request as it is.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jinja2
import numpy as np
import pandas as pd

from harness.files import write_text_atomic
from harness.report.checks import group_by_kind, problems_first, status_counts, tally, verdict_label
from harness.report.figures import integer_ticks, literal, new_figure, png_base64
from harness.report.first_op import first_op_view
from harness.report.throughput import throughput_view
from harness.report.timing import timing_view

_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=True,
)
_TEMPLATES.filters["verdict_label"] = verdict_label
_FIRST_METRICS = ("loss", "grad_norm")
_MARKERS_UP_TO = 100  # steps; beyond this markers only clutter the lines


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


def _plot(metric: str, metrics: dict[str, pd.DataFrame], golden: dict[str, pd.DataFrame]) -> str:
    """One PNG (base64) per metric: all arms overlaid, and their absolute differences on a log scale."""
    fig = new_figure(11, 3.4)
    ax_values, ax_diff = fig.subplots(1, 2)
    for ax in (ax_values, ax_diff):
        integer_ticks(ax)
    marker = "." if max(len(f) for f in metrics.values()) <= _MARKERS_UP_TO else None
    for arm, frame in metrics.items():
        if metric in frame.columns:
            ax_values.plot(frame.index, frame[metric], marker=marker, label=literal(arm))
    for arm, frame in golden.items():
        if metric in frame.columns:
            ax_values.plot(
                frame.index, frame[metric], linestyle="--", color="black", alpha=0.6, label=literal(f"golden {arm}")
            )
    ax_values.set(title=literal(metric), xlabel="step")
    ax_values.legend(fontsize="small")

    diffs = _differences(metric, metrics, golden)
    ax_diff.set(title=literal(f"{metric}: absolute difference"), xlabel="step")
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
            (line,) = ax_diff.plot(diff.index, diff.where(diff > 0), marker=marker, label=literal(label))
            zeros = diff.index[diff == 0]
            if len(zeros):
                ax_diff.scatter(
                    zeros,
                    np.full(len(zeros), floor),
                    marker="v",
                    s=12,
                    color=line.get_color(),
                    label=literal(f"{label} = 0"),
                )
        ax_diff.axhline(floor, color="grey", linewidth=0.5)
        ax_diff.legend(fontsize="small")
    return png_base64(fig)


def _constant_metrics(
    names: list[str], metrics: dict[str, pd.DataFrame], golden: dict[str, pd.DataFrame]
) -> dict[str, object]:
    """Metrics holding one value in every arm, step and golden (tokens per step, say), with that value:
    their plot would be a flat line and a blank difference, so the per-step table alone shows them."""
    constant = {}
    for name in names:
        values = pd.concat([f[name] for f in (*metrics.values(), *golden.values()) if name in f.columns]).unique()
        if len(values) == 1:
            value = values[0]
            constant[name] = value.item() if isinstance(value, np.generic) else value
    return constant


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


def _value_lines(check: dict) -> list[str]:
    """A check's values at its first divergent step, one "label = value" each, exact as the check saw them."""
    return [f"{label} = {_cell(value)}" for label, value in (check.get("values") or {}).items()]


def write_html(
    path: Path,
    summary: dict,
    metrics: dict[str, pd.DataFrame],
    golden: dict[str, pd.DataFrame] | None = None,
    manifest: dict | None = None,
    throughput: pd.DataFrame | None = None,
) -> None:
    """Renders report.html for one run. metrics and golden map arm -> step-indexed DataFrame;
    throughput holds the rows of throughput.jsonl (see :func:`harness.report.read_throughput`)
    and is read only when summary["throughput"] is set."""
    golden = golden or {}
    names = _metric_names(metrics)
    constant = _constant_metrics(names, metrics, golden)
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
    html = _TEMPLATES.get_template("report.html").render(
        summary=summary,
        verdict=verdict_label(summary.get("verdict"), summary.get("label")),
        tally=tally(status_counts(checks)),
        groups=group_by_kind(checks),
        first_op=first_op_view(checks),
        value_lines=_value_lines,
        throughput=throughput_view(summary["throughput"], throughput) if summary.get("throughput") else None,
        plots=[
            (name, _plot(name, metrics, golden), _localisations(name, checks)) for name in names if name not in constant
        ],
        constant=[(name, _cell(value) or "nan") for name, value in constant.items()],
        show_metrics=bool(names) or not summary.get("throughput"),
        headers=headers,
        rows=rows,
        manifest=json.dumps(manifest, indent=2, default=str) if manifest is not None else None,
        timing=timing_view(summary.get("timing")),
    )
    write_text_atomic(path, html)


def write_ci_index(path: Path, gate: dict) -> None:
    """Renders a ``harness ci`` gate's index.html from its ci.json record: the gate's verdict, and each
    suite's verdict and attempts, linking every attempt's report.html (paths relative to the gate)."""
    html = _TEMPLATES.get_template("ci.html").render(gate=gate)
    write_text_atomic(path, html)


def write_bisect_page(path: Path, bisect: dict) -> None:
    """Renders ``harness bisect``'s bisect.html from its bisect.json record: each probe, linking its
    report.html, and the culprit with the run that locates the first op (paths relative to the page)."""
    write_text_atomic(path, _TEMPLATES.get_template("bisect.html").render(bisect=bisect))
