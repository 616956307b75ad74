"""JUnit XML: one testcase per check, so any CI system shows which check failed and why."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from harness.files import write_text_atomic
from harness.report.checks import not_evaluated, status_counts

# Characters XML 1.0 cannot carry; a traceback in a detail must not make the whole file invalid.
_INVALID_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _text(value: object) -> str:
    return _INVALID_XML.sub("\ufffd", str(value))


def _failure_body(check: dict) -> str:
    lines = [check.get("detail", "")]
    if check.get("first_divergent_step") is not None:
        lines.append(f"first divergent step: {check['first_divergent_step']}")
    for label, value in (check.get("values") or {}).items():
        lines.append(f"  {label}: {value!r}")
    for key in ("max_abs_diff", "max_rel_diff"):
        if check.get(key) is not None:
            lines.append(f"{key}: {check[key]!r}")
    return "\n".join(lines)


def write_junit(path: Path, summary: dict) -> None:
    """Writes summary.json's checks as a JUnit testsuite (see :func:`junit_testsuite`)."""
    root = ET.Element("testsuites")
    root.append(junit_testsuite(summary))
    _write(path, root)


def junit_testsuite(summary: dict) -> ET.Element:
    """summary.json's checks as one JUnit <testsuite>, one testcase per check.

    A run that ended in error with no erroring check (a rank crashed before any check ran) gets a
    synthetic "run" testcase in error, so CI never reads it as an empty, green suite. An inconclusive
    check (a gate whose interval straddles its threshold) is skipped with a message that starts
    "inconclusive:", never a silent pass; the run's exit code 4 is what tells CI to measure again.
    A negative suite's expected failure is skipped too, of type "xfail", its detail "failed as expected: ...".
    A check not evaluated (its arm never ran) is an error of type "not-evaluated", apart from the
    launch's own error, which names the cause. A failure's message starts with its label, "drift: "
    or "regression: ", and a failed run's label is the testsuite's property ``label``.
    """
    suite = str(summary.get("suite", "harness"))
    checks = list(summary.get("checks", []))
    if summary.get("verdict") == "error" and not any(c.get("status") == "error" for c in checks):
        reason = summary.get("error") or f"run ended with verdict 'error' (exit code {summary.get('exit_code')})"
        checks.append({"name": "run", "kind": "run", "status": "error", "detail": reason})
    counts = status_counts(checks)
    testsuite = ET.Element(
        "testsuite",
        name=_text(suite),
        tests=str(len(checks)),
        failures=str(counts["fail"]),
        errors=str(counts["error"]),
        skipped=str(counts["skip"] + counts["inconclusive"] + counts["xfail"]),
        time=f"{float(summary.get('duration_s') or 0.0):.3f}",
    )
    if summary.get("label"):
        properties = ET.SubElement(testsuite, "properties")
        ET.SubElement(properties, "property", name="label", value=_text(summary["label"]))
    for check in checks:
        case = ET.SubElement(
            testsuite, "testcase", classname=_text(suite), name=_text(check.get("name", "?")), time="0"
        )
        status = check.get("status")
        detail = _text(check.get("detail", ""))
        if status in ("fail", "error"):
            kind = "not-evaluated" if not_evaluated(check) else check.get("kind", "")
            message = f"{check['label']}: {detail}" if check.get("label") else detail
            element = ET.SubElement(case, "failure" if status == "fail" else "error", message=message, type=_text(kind))
            element.text = _text(_failure_body(check))
        elif status == "skip":
            ET.SubElement(case, "skipped", message=detail)
        elif status in ("inconclusive", "xfail"):
            # inconclusive: not a pass and not a regression; CI shows it as not run, and exit code 4 gates.
            # xfail: a negative suite's expected failure, skipped as pytest reports an xfail.
            prefix = "inconclusive: " if status == "inconclusive" else ""
            element = ET.SubElement(case, "skipped", message=f"{prefix}{detail}", type=status)
            element.text = _text(_failure_body(check))
    return testsuite


def read_testsuites(path: Path) -> list[ET.Element]:
    """The <testsuite> elements of a JUnit file (its root, or the root's children); raises
    OSError or ET.ParseError when the file is missing or unreadable."""
    root = ET.parse(path).getroot()
    return [root] if root.tag == "testsuite" else root.findall("testsuite")


def write_merged_junit(path: Path, testsuites: list[ET.Element]) -> None:
    """One JUnit file of several runs' testsuites, taken as they are, under totals CI can show at once."""
    root = ET.Element("testsuites")
    for key in ("tests", "failures", "errors", "skipped"):
        root.set(key, str(sum(int(suite.get(key, 0)) for suite in testsuites)))
    root.set("time", f"{sum(float(suite.get('time', 0)) for suite in testsuites):.3f}")
    root.extend(testsuites)
    _write(path, root)


def _write(path: Path, root: ET.Element) -> None:
    ET.indent(root)
    write_text_atomic(path, ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n")
