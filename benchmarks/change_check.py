"""The cost of a change check: ``harness run SUITE --base REV`` against a plain ``harness run SUITE``.

A change check runs every arm twice, at the base and at the head; a base judged once is not run
again (harness/base_cache.py), so the next check against it runs the head alone. Three kinds of
run, side by side, on a git repository made here from the installed reference (a base commit and a
comment-only head, as a refactor is):

* **plain**: ``harness run SUITE`` as it is;
* **cold**: ``harness run SUITE --base HEAD~1 --source REPO`` with an empty revision and base cache;
* **warm**: the same, with the base's records kept by an earlier (untimed) run.

All runs share one warm trace cache (filled by untimed runs first), so tracing is not what is
compared. Each round runs plain, cold, warm, warm, cold, plain: per series the plain run is A and the
change check B, in A B B A order, so a drift of the machine cancels; the ratios are paired within
rounds (Student-t interval over the rounds' log ratios, harness.abba.paired_ratio). The goals: at
most 2.1x cold, 1.1x warm.

    python benchmarks/change_check.py [--rounds 3] [--suite parity] [--steps 5] [--ranks 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
from harness.abba import paired_ratio

GOALS = {"cold": 2.1, "warm": 1.1}


def git(repo: Path, *args: str) -> None:
    identity = ("-c", "user.name=benchmark", "-c", "user.email=benchmark@harness.invalid")
    subprocess.run(["git", *identity, "-C", str(repo), *args], check=True, capture_output=True)


def make_repo(root: Path) -> Path:
    """A repository of the installed reference: its files as shipped, then a comment added."""
    repo = root / "repo"
    reference = Path(harness.__file__).resolve().parent / "reference"
    shutil.copytree(reference, repo / "harness" / "reference", ignore=shutil.ignore_patterns("__pycache__"))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "reference as shipped")
    model = repo / "harness" / "reference" / "model.py"
    model.write_text(model.read_text() + "\n# a comment, and nothing else\n")
    git(repo, "commit", "-q", "-am", "a comment")
    return repo


def timed(cmd: list[str], env: dict[str, str]) -> float:
    """Wall seconds of one command, which must pass."""
    began = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.monotonic() - began
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--suite", default="parity")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="change-check-"))
    repo = make_repo(tmp)
    env = {**os.environ, "HARNESS_TRACE_CACHE": str(tmp / "traces"), "HARNESS_FIRST_OP": "off"}
    runs = iter(range(10**6))
    run = [sys.executable, "-m", "harness", "run", args.suite, "--steps", str(args.steps), "--ranks", str(args.ranks)]
    change = ["--base", "HEAD~1", "--source", str(repo)]

    def one(kind: str) -> float:
        out = ["--out", str(tmp / f"run-{next(runs)}")]
        if kind == "plain":
            return timed([*run, *out], env)
        cache = tmp / "warm-cache" if kind == "warm" else tmp / f"cold-cache-{next(runs)}"
        return timed([*run, *change, *out], {**env, "XDG_CACHE_HOME": str(cache)})

    one("plain")  # fills the trace cache for head and base alike (one source), not timed
    one("warm")  # keeps the base's records in the warm cache, not timed
    order: dict[str, list[str]] = {"cold": [], "warm": []}
    values: dict[str, list[float]] = {"cold": [], "warm": []}
    seconds: dict[str, list[float]] = {"plain": [], "cold": [], "warm": []}
    for _ in range(args.rounds):
        for kind in ("plain", "cold", "warm", "warm", "cold", "plain"):
            took = one(kind)
            seconds[kind].append(took)
            for series in ("cold", "warm"):
                if kind in ("plain", series):
                    order[series].append("A" if kind == "plain" else "B")
                    values[series].append(took)
    print(f"change check vs plain run: harness run {args.suite} --steps {args.steps} --ranks {args.ranks},")
    print(f"{args.rounds} rounds of plain, cold, warm, warm, cold, plain; wall seconds, median per kind:")
    for kind, taken in seconds.items():
        print(f"  {kind:<6} {sorted(taken)[len(taken) // 2]:6.1f} s")
    for series in ("cold", "warm"):
        ratio = paired_ratio(order[series], values[series], anytime=False)
        met = "meets" if ratio.high <= GOALS[series] else "misses"
        print(
            f"  {series} / plain: {ratio.ratio:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}] 95% CI over"
            f" {ratio.blocks} rounds ({met} the goal of {GOALS[series]}x)"
        )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
