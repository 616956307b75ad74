import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.compare import Exact, compare_arms
from harness.report import format_verdict_table, write_html, write_junit

REPO = Path(__file__).resolve().parents[2]


def metrics(steps=12, perturb_at=None):
    loss = 2.3 * np.exp(-np.arange(steps) / 8)

    def frame(values):
        return pd.DataFrame(
            {"loss": values, "grad_norm": values / 2, "tokens": 256, "step_time_s": 0.01},
            index=pd.RangeIndex(steps, name="step"),
        )

    graph = loss.copy()
    if perturb_at is not None:
        graph[perturb_at:] += 1e-7 * np.arange(1, steps - perturb_at + 1)
    return {"eager": frame(loss), "graph": frame(graph)}


def summary(checks, verdict="fail", exit_code=1):
    return {
        "suite": "parity",
        "verdict": verdict,
        "exit_code": exit_code,
        "ranks": 2,
        "steps": 12,
        "arms": ["eager", "graph"],
        "duration_s": 4.25,
        "run_dir": "reports/parity/20260101-000000",
        "checks": checks,
    }


def checks_for(m):
    return [
        compare_arms(f"exact:{metric}", m["eager"], m["graph"], metric, Exact(), "eager", "graph").to_dict()
        for metric in ("loss", "grad_norm")
    ] + [
        {
            "name": "token-exchange:buffer-reuse",
            "kind": "token-exchange-invariants",
            "status": "error",
            "detail": "malformed events: event 3",
        },
        {"name": "golden:eager", "kind": "exact", "status": "skip", "detail": "no golden for arm 'eager'"},
    ]


def test_junit_counts_and_failure_detail(tmp_path):
    m = metrics(perturb_at=5)
    path = tmp_path / "junit.xml"
    write_junit(path, summary(checks_for(m)))
    root = ET.parse(path).getroot()
    suite = root.find("testsuite")
    assert suite.get("name") == "parity"
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == (
        "4",
        "2",
        "1",
        "1",
    )
    assert suite.get("time") == "4.250"
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert all(c.get("classname") == "parity" for c in cases.values())
    failure = cases["exact:loss"].find("failure")
    assert failure.get("message").startswith("first divergence at step 5: eager=")
    assert "first divergent step: 5" in failure.text and "graph: " in failure.text
    assert cases["token-exchange:buffer-reuse"].find("error") is not None
    assert cases["golden:eager"].find("skipped") is not None


def test_junit_error_run_without_checks_is_not_green(tmp_path):
    path = tmp_path / "junit.xml"
    write_junit(path, summary([], verdict="error", exit_code=3) | {"error": "rank 1 timed out after 300 s"})
    suite = ET.parse(path).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("errors")) == ("1", "1")
    assert suite.find("testcase/error").get("message") == "rank 1 timed out after 300 s"


def test_junit_survives_control_characters(tmp_path):
    path = tmp_path / "junit.xml"
    write_junit(path, summary([{"name": "x", "kind": "exact", "status": "fail", "detail": "bad\x00byte\x1b[31m"}]))
    assert "byte" in ET.parse(path).getroot().find("testsuite/testcase/failure").get("message")


def test_html_is_self_contained_and_shows_checks(tmp_path):
    m = metrics(perturb_at=5)
    s = summary(checks_for(m))
    s["checks"][0]["detail"] += " <script>alert(1)</script>"
    golden = {"eager": m["eager"][["loss", "grad_norm"]]}
    path = tmp_path / "report.html"
    write_html(path, s, m, golden=golden, manifest={"command": "harness run parity", "seed": 42})
    html = path.read_text()
    assert "parity: FAIL (exit code 1)" in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert not re.search(r"(src|href)=\"(https?:)?//", html)
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 2  # loss, grad_norm; step_time_s and tokens are constant here
    assert "constant in every arm: step_time_s = 0.01, tokens = 256" in html
    assert html.count('<tr class="fail">') == 2 and '<tr class="divergent">' in html
    assert repr(float(m["graph"].loc[7, "loss"])) in html  # exact per-step values
    assert "golden eager" in html and "&#34;seed&#34;: 42" in html


def test_the_cli_loads_matplotlib_and_scipy_only_when_a_report_draws_or_a_throughput_is_judged():
    """Every command imports harness.cli; one that draws nothing or judges no throughput (list, a parity
    run until its report) must not pay ~0.3 s for matplotlib nor ~0.4 s for scipy.stats."""
    code = "import sys, harness.cli; print(*(m for m in ('matplotlib', 'scipy') if m in sys.modules))"
    imported = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert imported.stdout.split() == []


@pytest.mark.parametrize("perturb_at", [None, 0])
def test_html_plots_handle_all_zero_and_all_nonzero_differences(tmp_path, perturb_at):
    m = metrics(perturb_at=perturb_at)
    path = tmp_path / "report.html"
    write_html(path, summary(checks_for(m), verdict="pass", exit_code=0), m)
    assert "parity: PASS" in path.read_text()


def test_html_with_a_cut_short_arm_and_no_checks(tmp_path):
    m = metrics()
    m["graph"] = m["graph"].iloc[:4]
    path = tmp_path / "report.html"
    write_html(path, summary([], verdict="error", exit_code=3), m)
    html = path.read_text()
    assert "No checks ran." in html and "parity: ERROR" in html


def test_verdict_table_puts_failures_first_and_aligns():
    m = metrics(perturb_at=5)
    text = format_verdict_table(summary(checks_for(m)))
    lines = text.splitlines()
    assert lines[0] == "parity: FAIL (exit 1) - 4 checks, 2 ranks, 12 steps, 4.2 s"
    assert [line.split()[0] for line in lines[1:-1]] == ["ERROR", "FAIL", "FAIL", "SKIP"]
    assert lines[-1] == "0 passed, 2 failed, 1 errors, 1 skipped"
    detail_columns = {
        line.index(check["detail"][:20]) for line, check in zip(lines[1:], [checks_for(m)[i] for i in (2, 0, 1, 3)])
    }
    assert len(detail_columns) == 1


def test_html_plots_take_mathtext_characters_literally(tmp_path):
    """A "$" in a label once started matplotlib mathtext and broke the report of a passing run."""
    metrics = {"$a^$": pd.DataFrame({"loss": [1.0, 0.5]}, index=pd.Index([1, 2], name="step")),
               "b": pd.DataFrame({"loss": [1.0, 0.25]}, index=pd.Index([1, 2], name="step"))}  # fmt: skip
    write_html(tmp_path / "report.html", {"suite": "s", "verdict": "pass", "checks": []}, metrics)
    assert "$a^$" in (tmp_path / "report.html").read_text()


def test_html_shows_where_the_gradients_first_differ_beside_the_curve(tmp_path):
    m = metrics(perturb_at=5)
    s = summary(checks_for(m))
    where = "step 5: first gradient to differ is model.layers.1.mlp.experts.down_proj (max abs 1e-05, max rel 0.002)"
    s["checks"][0]["name"] = "eager vs graph: loss"  # as the pair checks name a metric's comparison
    s["checks"][0]["extra"]["first_gradient_divergence"] = {"summary": where, "step": 5}
    path = tmp_path / "report.html"
    write_html(path, s, m)
    html = path.read_text()
    figures = re.findall(r"<figure>.*?</figure>", html, re.S)
    assert where in figures[0] and "eager vs graph: loss" in figures[0]  # the loss curve
    assert all(where not in f for f in figures[1:])


def test_drift_reads_apart_from_a_regression_on_the_console_in_junit_and_in_the_report(tmp_path):
    m = metrics(perturb_at=5)
    loss, grad_norm = checks_for(m)[:2]
    line = "regression: 1 failed check: exact:grad_norm (1 more failed as drift: see their rows)"
    s = summary([loss | {"label": "drift"}, grad_norm | {"label": "regression"}]) | {
        "label": "regression",
        "label_line": line,
    }
    lines = format_verdict_table(s).splitlines()
    assert lines[0].startswith("parity: FAIL [regression] (exit 1) - 2 checks")
    assert [row.split()[:2] for row in lines[1:3]] == [["DRIFT", "exact:loss"], ["FAIL", "exact:grad_norm"]]
    assert format_verdict_table(s | {"label": "drift"}).startswith("parity: FAIL [drift: re-bless] (exit 1)")

    write_junit(tmp_path / "junit.xml", s)
    testsuite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert testsuite.find("properties/property[@name='label']").get("value") == "regression"
    messages = [case.find("failure").get("message") for case in testsuite.findall("testcase")]
    assert messages[0].startswith("drift: first divergence at step 5: eager=")
    assert messages[1].startswith("regression: first divergence at step 5: eager=")

    write_html(tmp_path / "report.html", s, m)
    html = (tmp_path / "report.html").read_text()
    assert "parity: FAIL [regression] (exit code 1)" in html and line in html
    assert '<span class="label drift">(drift)</span>' in html and '<span class="label regression">' in html


def test_a_figure_drawn_while_matplotlib_imports_in_the_background_waits_for_that_import() -> None:
    """In a fresh interpreter: the background import, cancelled before it began or awaited once it
    has, never runs beside the import of the first figure (two threads importing matplotlib at once
    can leave it half made, and every later figure of the process failing)."""
    code = (
        "import time\n"
        "from harness.report import figures\n"
        "for wait in (0.0, figures._IMPORT_DELAY_S + 0.05):\n"
        "    figures.import_in_background()\n"
        "    started = list(figures._background)\n"
        "    time.sleep(wait)\n"
        "    figures.new_figure(1, 1)\n"
        "    print(len(started), [t.is_alive() for t in started], len(figures._background))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    # The first pass starts a thread and waits for none; the second finds matplotlib imported.
    assert done.stdout.splitlines() == ["1 [False] 0", "0 [] 0"]
