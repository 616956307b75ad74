"""Time to verdict: where the wall time of ``harness run parity`` goes, against a bare torchrun floor.

The floor is what any multi-process torch job pays: ``python -m torch.distributed.run --standalone``
of ranks that import torch, meet at a barrier and exit (gloo, one thread each). Against it, per
rank count, ``harness run parity --ranks N`` as a user types it, twice over:

* **cold**: an empty trace cache, so every traced arm traces on every rank;
* **warm**: a cache filled by an earlier (untimed) run, so traced arms load their graphs.

Each round runs floor, warm, cold, cold, warm, floor (so both pairs are in A B B A order and a
drift of the machine cancels), and the ratios to the floor are paired within rounds (Student-t
interval over the rounds' log ratios, harness.abba.paired_ratio).

The phase table comes from each run's own records (summary.json ``timing``, harness/phases.py):
a rank phase ends when its last rank ends it, so the rows add up to the wall time measured here
from spawn to exit. Medians over the rounds; shares of the run's total; each phase divided by
the floor's total.

    python benchmarks/time_to_verdict.py [--rounds 2] [--ranks 2 8] [--cpu-isa avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.abba import paired_ratio
from harness.environment import CPU_ISAS, cpu_pin

FLOOR_WORKER = """
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""
# Timeline segments (harness/phases.py) into the rows of the table, in order; "{arm}" rows repeat per arm.
ROWS = (
    ("harness start: interpreter, imports, suite", ("interpreter", "start", "prepare")),
    ("launch and rendezvous", ("start processes", "rendezvous")),
    ("rank imports", ("imports",)),
    ("build and trace {arm}", ("build",)),
    ("steps {arm}", ("steps", "finish")),
    ("rank shutdown and exit", ("shutdown", "exit")),
    ("judging", ("judge",)),
    ("report and harness exit", ("report", "harness exit")),
)


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(wall seconds, spawn time, exit time) of one command, which must succeed."""
    began = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    ended = time.time()
    if proc.returncode:
        sys.exit(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return ended - began, began, ended


def phase_seconds(run_dir: Path, spawned: float, exited: float) -> dict[str, float]:
    """Seconds per (row, arm) of one harness run, from its summary.json timeline, plus the interpreter's
    start before harness was imported and its exit after the last phase (measured from outside)."""
    timing = json.loads((run_dir / "summary.json").read_text())["timing"]
    segments = [
        {"segment": "interpreter", "arm": None, "seconds": timing["phases"][0]["start"] - spawned},
        *timing["timeline"],
        {"segment": "harness exit", "arm": None, "seconds": exited - timing["phases"][-1]["end"]},
    ]
    rows: dict[str, float] = {}
    for segment in segments:
        label = next(label for label, names in ROWS if segment["segment"] in names).format(arm=segment["arm"])
        rows[label] = rows.get(label, 0.0) + segment["seconds"]
    return rows


def measure(ranks: int, rounds: int, env: dict[str, str], tmp: Path) -> dict:
    floor_file = tmp / "floor.py"
    floor_file.write_text(FLOOR_WORKER)
    floor = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        str(floor_file),
    ]
    warm_cache = tmp / f"warm-{ranks}"
    runs = iter(range(10**6))

    def parity(cache: Path) -> tuple[float, dict]:
        out = tmp / f"run-{ranks}-{next(runs)}"
        cmd = [sys.executable, "-m", "harness", "run", "parity", "--ranks", str(ranks), "--trace-cache", str(cache)]
        wall, spawned, exited = timed([*cmd, "--out", str(out)], env)
        return wall, phase_seconds(out, spawned, exited)

    parity(warm_cache)  # fills the warm cache; not timed
    # Per series, the floor is A and the parity run B: floor, warm, warm, floor is one ABBA block.
    order: dict[str, list[str]] = {"warm": [], "cold": []}
    values: dict[str, list[float]] = {"warm": [], "cold": []}
    phases: dict[str, list[dict[str, float]]] = {"warm": [], "cold": []}
    floors = []
    for _ in range(rounds):
        for kind in ("floor", "warm", "cold", "cold", "warm", "floor"):
            if kind == "floor":
                seconds = timed(floor, env)[0]
                floors.append(seconds)
            else:
                seconds, rows = parity(warm_cache if kind == "warm" else tmp / f"cold-{ranks}-{next(runs)}")
                phases[kind].append(rows)
            for series in ("warm", "cold"):
                if kind in ("floor", series):
                    order[series].append("A" if kind == "floor" else "B")
                    values[series].append(seconds)
    ratios = {kind: paired_ratio(order[kind], values[kind], anytime=False) for kind in order}
    return {"floors": floors, "phases": phases, "ratios": ratios}


def print_table(ranks: int, result: dict) -> None:
    floor = statistics.median(result["floors"])
    medians = {
        kind: {key: statistics.median(run.get(key, 0.0) for run in runs) for key in runs[0]}
        for kind, runs in result["phases"].items()
    }
    totals = {kind: sum(rows.values()) for kind, rows in medians.items()}
    print(f"\nparity --ranks {ranks}: floor (bare torchrun, import torch, barrier) median {floor:.2f} s")
    print(f"{'phase':<46}{'cold s':>8}{'share':>7}{'warm s':>8}{'share':>7}{'warm/floor':>11}")
    for key in medians["cold"]:
        cold, warm = medians["cold"][key], medians["warm"].get(key, 0.0)
        print(
            f"{key:<46}{cold:8.2f}{cold / totals['cold']:7.0%}{warm:8.2f}{warm / totals['warm']:7.0%}"
            f"{warm / floor:11.2f}"
        )
    total = f"{'total (sum of medians)':<46}{totals['cold']:8.2f}{'':>7}{totals['warm']:8.2f}{'':>7}"
    print(f"{total}{totals['warm'] / floor:11.2f}")
    for kind in ("warm", "cold"):
        print(f"{kind}: {result['ratios'][kind].summary('floor', f'parity --ranks {ranks} ({kind})')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of floor, warm, cold, cold, warm, floor")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8], help="rank counts to measure")
    parser.add_argument("--cpu-isa", choices=CPU_ISAS, default="avx2", help="the kernels the floor's ranks get")
    args = parser.parse_args()
    env = {**os.environ, **cpu_pin(args.cpu_isa).env}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            print_table(ranks, measure(ranks, args.rounds, env, Path(tmp)))


if __name__ == "__main__":
    main()
