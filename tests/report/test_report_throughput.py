"""The throughput section of report.html, built from run directories written in the contract's format."""

from __future__ import annotations

import base64
import io
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest
from throughput_runs import write_throughput_run

from harness.report import format_verdict_table, read_throughput, write_html, write_junit


def render(run_dir: Path, metrics: dict[str, pd.DataFrame] | None = None) -> str:
    """report.html of the run directory, rendered as a rerender would: summary and throughput.jsonl from disk."""
    summary = json.loads((run_dir / "summary.json").read_text())
    write_html(run_dir / "report.html", summary, metrics or {}, throughput=read_throughput(run_dir))
    return (run_dir / "report.html").read_text()


def section(html: str) -> str:
    match = re.search(r'<section id="throughput">.*?</section>', html, re.S)
    assert match, "no throughput section"
    return match.group(0)


def image_width(html: str, alt_start: str) -> int:
    """Pixel width of the inline PNG whose alt text starts with alt_start."""
    match = re.search(rf'<img alt="{re.escape(alt_start)}[^"]*" src="data:image/png;base64,([^"]+)"', html)
    assert match, f"no image {alt_start!r}"
    return matplotlib.image.imread(io.BytesIO(base64.b64decode(match.group(1))), format="png").shape[1]


def test_a_big_improvement_is_flagged_as_a_moved_baseline(tmp_path: Path) -> None:
    """A 25% speed-up passes the gate; shown only as a pass, nobody would ask whether A got slower."""
    summary = write_throughput_run(tmp_path, a_step_s=0.10, b_step_s=0.08)
    html = section(render(tmp_path))
    assert summary["throughput"]["verdict"] == "pass" and summary["throughput"]["improvement"]
    assert re.search(r'class="alert improvement">graph is 20\.\d% faster than eager \(step time × 0\.8\d\d, 2[45]\.\d% '
                     r'more tokens/s\): check whether the baseline moved</p>', html)  # fmt: skip
    assert "throughput PASS" in html
    assert "note: graph is" in format_verdict_table(summary).splitlines()[1]


def test_no_improvement_note_without_a_big_improvement(tmp_path: Path) -> None:
    summary = write_throughput_run(tmp_path, a_step_s=0.08, b_step_s=0.0805)
    html = render(tmp_path)
    assert "faster than" not in html and "baseline moved" not in format_verdict_table(summary)


def test_the_verdict_shows_the_ratio_its_interval_and_the_threshold(tmp_path: Path) -> None:
    summary = write_throughput_run(tmp_path, a_step_s=0.08, b_step_s=0.10)  # 25% slower: fail
    t = summary["throughput"]
    html = section(render(tmp_path))
    assert t["verdict"] == "fail" and "throughput FAIL" in html
    interval = f"{t['ratio']:.3f} [{t['low']:.3f}, {t['high']:.3f}]"
    assert f"graph/eager step time = {interval}" in html
    assert f"lower bound {t['low']:.3f} &gt; threshold 1.050" in html and "1.050 (1 + max slowdown 5%)" in html


def test_an_inconclusive_gate_is_shown_as_such_everywhere(tmp_path: Path) -> None:
    """Read as a pass, a straddling interval would let a slowdown through; read as a fail, CI would block on noise."""
    summary = write_throughput_run(tmp_path, a_step_s=0.08, b_step_s=0.084, verdict="inconclusive")
    html = render(tmp_path)
    assert 'class="banner inconclusive"' in html and "abba: INCONCLUSIVE (exit code 4)" in html
    assert 'class="banner small inconclusive"' in section(html) and "straddles the threshold 1.050" in html
    assert "0 passed, 0 failed, 1 inconclusive, 0 errors, 0 skipped" in html
    assert '<tr class="inconclusive">' in html
    table = format_verdict_table(summary)
    assert table.splitlines()[1].split()[0] == "INCONCLUSIVE" and table.endswith("1 inconclusive, 0 errors, 0 skipped")
    write_junit(tmp_path / "junit.xml", summary)
    testsuite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert testsuite.get("skipped") == "1" and testsuite.get("failures") == "0"
    skipped = testsuite.find("testcase/skipped")
    assert skipped is not None and skipped.get("message").startswith("inconclusive: graph/eager step time")


def test_separate_launches_say_how_each_block_was_measured(tmp_path: Path) -> None:
    write_throughput_run(tmp_path / "separate", mode="separate-launches")
    write_throughput_run(tmp_path / "shared", mode="shared-processes")
    note = "Start-up (launch, imports, build, warm-up) is outside the step times"
    assert note in section(render(tmp_path / "separate"))
    assert note not in render(tmp_path / "shared")


def test_the_control_is_plotted_and_tabled_beside_the_main_series(tmp_path: Path) -> None:
    with_control = write_throughput_run(tmp_path / "control", control=True)
    write_throughput_run(tmp_path / "alone")
    html = section(render(tmp_path / "control"))
    control = with_control["throughput"]["control"]
    assert f"{control['ratio']:.3f} [{control['low']:.3f}, {control['high']:.3f}]" in html
    alone = section(render(tmp_path / "alone"))
    assert "not run (--control measures A against a copy of A)" in alone
    ratio_plot = "per-block step time ratios"
    assert image_width(html, ratio_plot) == 2 * image_width(alone, ratio_plot)  # a second panel for the control
    assert html.count("<td>control</td>") == 16 and html.count("<td>main</td>") == 16


def test_the_blocks_table_holds_every_measurement_and_each_block_ratio(tmp_path: Path) -> None:
    summary = write_throughput_run(tmp_path, blocks=5, a_step_s=0.08, b_step_s=0.09)
    html = section(render(tmp_path))
    cells = re.findall(r'<td class="num" rowspan="4">([^<]+)</td>', html)
    measured = summary["throughput"]
    assert cells[::2] == [f"{r:.3f}" for r in measured["per_block_ratios"]]
    # Beside each block, the interval after it: unbounded until 4 blocks, then finite.
    assert cells[1::2][:3] == ["[0.000, ∞]"] * 3
    assert cells[1::2][3:] == [f"[{i['low']:.3f}, {i['high']:.3f}]" for i in measured["sequence"][3:]]
    assert html.count("<td>main</td>") == 20
    assert "150.0 MiB" in html and "120.0 MiB" in html  # peak memory per arm
    assert image_width(html, "step time per measurement") > 0


def test_a_throughput_run_without_metrics_has_no_empty_metrics_section(tmp_path: Path) -> None:
    write_throughput_run(tmp_path)
    assert "<h2>Metrics</h2>" not in render(tmp_path)
    loss = pd.DataFrame({"loss": [2.0, 1.5, 1.2]}, index=pd.Index([1, 2, 3], name="step"))
    html = render(tmp_path, {"eager": loss, "graph": loss * 1.01})
    assert "<h2>Metrics</h2>" in html and 'alt="loss: all arms' in html


def test_a_missing_or_cut_short_throughput_file(tmp_path: Path) -> None:
    assert read_throughput(tmp_path) is None
    write_throughput_run(tmp_path)
    with (tmp_path / "throughput.jsonl").open("a") as f:
        f.write('{"series": "main", "blo')  # a crash mid-line
    assert len(read_throughput(tmp_path)) == 16
    summary = json.loads((tmp_path / "summary.json").read_text())
    write_html(tmp_path / "report.html", summary, {}, throughput=None)
    html = section((tmp_path / "report.html").read_text())
    assert "throughput.jsonl holds no measurements" in html and "per-block step time ratios" in html


@pytest.mark.parametrize("high", [None, float("inf")])
def test_an_unbounded_interval_of_one_block_still_renders(tmp_path: Path, high: float | None) -> None:
    summary = write_throughput_run(tmp_path, blocks=1, verdict="inconclusive")
    summary["throughput"]["high"] = high
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    html = section(render(tmp_path))
    assert ("n/a]" if high is None else "∞]") in html


def test_a_noisy_measurement_says_why_its_interval_is_wide(tmp_path: Path) -> None:
    summary = write_throughput_run(tmp_path / "quiet")
    assert "noisy:" not in render(tmp_path / "quiet")
    summary["throughput"].update(noisy=True, noise={"A": 0.04, "B": 0.125})
    write_html(tmp_path / "report.html", summary, {}, throughput=read_throughput(tmp_path / "quiet"))
    assert "noisy: IQR/median over 10% within an arm (A 4.0%, B 12.5%)" in (tmp_path / "report.html").read_text()


def test_an_inconclusive_verdict_from_a_noisy_control_says_so(tmp_path: Path) -> None:
    """The gate overrides a decided interval when A against A lies beyond the threshold; "straddles" would be false."""
    summary = write_throughput_run(tmp_path, control=True, a_step_s=0.08, b_step_s=0.1, verdict="inconclusive")
    assert summary["throughput"]["low"] > 1.05  # the main interval alone would fail
    html = section(render(tmp_path))
    assert "the A/A control lies beyond the threshold 1.050" in html and "straddles" not in html


def test_a_gate_that_could_not_judge_shows_its_reason(tmp_path: Path) -> None:
    summary = write_throughput_run(tmp_path, blocks=1)
    throughput = summary["throughput"]
    for key in ("ratio", "low", "high", "per_block_ratios", "confidence", "noise"):
        del throughput[key]
    throughput.update(
        verdict="error", headline="not judged: 1 complete ABBA block(s) of 1 recorded; an interval needs 2"
    )
    (tmp_path / "summary.json").write_text(json.dumps(summary | {"verdict": "error", "exit_code": 3}))
    html = section(render(tmp_path))
    assert "throughput ERROR" in html and "not judged: 1 complete ABBA block(s)" in html
