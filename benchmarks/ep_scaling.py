"""Time to verdict and peak memory as the EP degree grows: EP 2, 4, ..., 64 by logical ranks.

Each EP degree is one ``harness run logical-ranks`` of the 64-expert model (``cpu-tiny-64e``): the
EP group on 2 processes, then the same group in one process, for ``--steps`` steps, no golden.
Per EP degree, in one table: the wall time from spawn to exit; the largest arm's steps (the
training itself), the judging and the report, from the run's own timeline (summary.json
``timing``); the peak RSS of any process of the run (the ranks: one dense replica per logical
rank); and the size of its records. The last column pair gives each one's growth per doubling of
EP (this row over the previous one): 2.0 is linear in EP, above it worse than linear.

    python benchmarks/ep_scaling.py [--steps 3] [--eps 2 4 8 16 32 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WRAPPER = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:], capture_output=True).returncode
print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def measure(ep: int, steps: int, out: Path) -> dict:
    """One run at EP ``ep``: its wall time, timeline segments, peak RSS and record size."""
    cmd = [
        sys.executable, "-m", "harness", "run", "logical-ranks", "--steps", str(steps), "--golden", "off",
        "--set", "model.config=cpu-tiny-64e", "--set", f"train.ep={ep}", "--out", str(out), "--trace-cache", "off",
    ]  # fmt: skip
    began = time.perf_counter()
    wrapped = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - began
    code, peak_kb = map(int, wrapped.stdout.split())
    summary = json.loads((out / "summary.json").read_text())
    if code != 0:
        raise SystemExit(f"EP {ep}: harness run exited {code} ({summary['verdict']}); see {out}")
    seconds: dict[str, float] = {}
    for segment in summary["timing"]["timeline"]:
        name = segment["segment"]
        seconds[name] = (
            max(seconds.get(name, 0.0), segment["seconds"])
            if name == "steps"
            else (seconds.get(name, 0.0) + segment["seconds"])
        )
    records = sum(f.stat().st_size for f in (out / "arms").rglob("*") if f.is_file())
    return {
        "ep": ep,
        "wall_s": wall,
        "steps_s": seconds.get("steps", 0.0),
        "judge_s": seconds.get("judge", 0.0),
        "report_s": seconds.get("report", 0.0),
        "peak_rss_mb": peak_kb / 1024,
        "records_mb": records / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--eps", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ep in args.eps:
            rows.append(measure(ep, args.steps, Path(tmp) / f"ep{ep}"))
            print(f"EP {ep}: done", file=sys.stderr, flush=True)
    columns = ("wall_s", "steps_s", "judge_s", "report_s", "peak_rss_mb", "records_mb")
    print(f"harness run logical-ranks, cpu-tiny-64e, {args.steps} steps, 2 processes + 1, {os.cpu_count()} CPUs")
    print(f"{'EP':>4} " + " ".join(f"{c:>11}" for c in columns) + "   growth per doubling (wall, judge, rss, records)")
    for previous, row in zip([None, *rows], rows):
        cells = " ".join(f"{row[c]:>11.2f}" for c in columns)
        growth = ""
        if previous is not None and row["ep"] == 2 * previous["ep"]:
            ratios = [
                row[c] / previous[c] if previous[c] else float("nan")
                for c in ("wall_s", "judge_s", "peak_rss_mb", "records_mb")
            ]
            growth = "   " + " ".join(f"{r:.2f}x" for r in ratios)
        print(f"{row['ep']:>4} {cells}{growth}")


if __name__ == "__main__":
    main()
