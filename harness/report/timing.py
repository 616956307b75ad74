"""The report's "Time to verdict" section: the run's timeline (harness/phases.py) as a table."""

from __future__ import annotations


def timing_view(timing: dict | None) -> dict | None:
    """Rows of (where, seconds, share of the total, detail), largest share flagged; None for a run
    recorded before phases were (an old summary.json re-rendered)."""
    if not timing or not timing.get("timeline"):
        return None
    total = timing["total_s"]
    largest = max(timing["timeline"], key=lambda s: s["seconds"])
    rows = [
        {
            "where": " / ".join(part for part in (s["group"], s["arm"]) if part),
            "segment": s["segment"],
            "seconds": f"{s['seconds']:.2f}",
            "share": f"{100 * s['seconds'] / total:.0f}%" if total else "",
            "detail": s["detail"],
            "largest": s is largest,
        }
        for s in timing["timeline"]
    ]
    reported = any(s["segment"] == "report" for s in timing["timeline"])
    scope = "" if reported else " up to this report"
    return {"rows": rows, "headline": f"{total:.2f} s from the harness's start{scope}; largest: {largest['segment']}"}
