"""``harness golden calibrate SUITE``: the tier at which a suite's goldens hold another environment's
run, measured rather than guessed.

A golden recorded on one machine cannot hold another vendor's or ISA's run bit for bit, and a fixed
loose tier is a guess: rtol 1e-4 is some thousand times what a float32 suite's loss moves between AMD
and Intel (1.2e-7), wide enough to pass real router bugs that moved loss by 3e-6. So, as Megatron-LM's
``--recommend-tolerances`` derives tolerances from repeated runs, the noise is measured: the suite runs
once at every CPU kernel ISA this machine has (the pinned AVX2 and the native one), and every golden of
the suite recorded in a comparable environment (another vendor, another torch) is one more source. Per
metric, the largest relative difference between any two sources, times a margin (10), is the tier; it
is written into the provenance of each of those goldens (golden.Calibration), where a reviewer sees
it, and where a run compared loosely, or a failed check judged for drift, reads it.

What one machine cannot vary (the vendor) comes from goldens recorded on the other; a suite calibrated
from its ISA runs alone says so in ``measured``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

import numpy as np
import pandas as pd

from harness.compare import rel_diff
from harness.environment import comparable_env_keys, cpu_pin, run_env_key
from harness.golden import Calibration, Golden, load_golden_for, write_golden
from harness.golden_plan import golden_config
from harness.prepare import RunOptions, UsageError
from harness.records import read_metrics
from harness.run import run_suite
from harness.specs import SuiteSpec
from harness.verdict import EXIT_PASS

MARGIN = 10.0

# What one environment recorded: arm -> metric -> trajectory (a float64 Series indexed by step).
Trajectories = Mapping[str, Mapping[str, pd.Series]]


def relative_noise(a: pd.Series, b: pd.Series) -> float:
    """The largest |a - b| relative to either side, over the steps both recorded: symmetric, so the
    noise does not depend on which environment is the golden. Steps where both are NaN agree."""
    x, y = a.align(b, join="inner")
    x, y = x.to_numpy(dtype="float64"), y.to_numpy(dtype="float64")
    both_nan = np.isnan(x) & np.isnan(y)
    x, y = x[~both_nan], y[~both_nan]
    if x.size == 0:
        return 0.0
    worst = np.maximum(rel_diff(x, y), rel_diff(y, x))
    return math.inf if np.isnan(worst).any() else float(worst.max())


def measure_noise(sources: Mapping[str, Trajectories], metrics: tuple[str, ...]) -> tuple[dict[str, float], list[str]]:
    """Per metric, the largest relative difference between any two ``sources`` (label -> what it
    recorded) over the arms and steps both have; and each pair compared, as "<a> vs <b>"."""
    noise = dict.fromkeys(metrics, 0.0)
    pairs = []
    for (label_a, a), (label_b, b) in itertools.combinations(sources.items(), 2):
        pairs.append(f"{label_a} vs {label_b}")
        for arm in a.keys() & b.keys():
            for metric in metrics:
                if metric in a[arm] and metric in b[arm]:
                    noise[metric] = max(noise[metric], relative_noise(a[arm][metric], b[arm][metric]))
    return noise, pairs


def noise_for_tiers(measured: dict[str, float]) -> dict[str, float]:
    """The noise each metric's tier is a multiple of: as measured, except that a metric that did not
    move at all between these environments takes the largest of the suite's metrics. It may still move
    on another vendor's machine (pec-legacy's loss is bitwise across one machine's ISAs, not across
    vendors); the tier stays within the margin times the largest noise measured."""
    largest = max(measured.values(), default=0.0)
    return {metric: value or largest for metric, value in measured.items()}


def calibrate_suite(suite: SuiteSpec, options: RunOptions, margin: float, out: TextIO, err: TextIO) -> int:
    """Runs ``suite`` at each CPU ISA of this machine, measures the noise between those runs and the
    suite's comparable goldens, and writes the calibration into those goldens. Returns the exit code:
    that of a run that did not pass (its numbers are no measure of noise), else 0."""
    if not 1 <= margin < math.inf:
        raise UsageError(f"--margin: expected a finite number >= 1, got {margin:g}")
    runs, code = _isa_runs(suite, options, out, err)
    if code != EXIT_PASS:
        return code
    goldens = _comparable_goldens(suite, options)
    sources = {**runs, **{f"golden {key}": golden.arms for key, (_, golden) in goldens.items()}}
    if len(sources) < 2:
        raise UsageError(
            f"golden calibrate {suite.name}: one environment only ({', '.join(sources)}): this machine has one"
            f" CPU ISA and no golden of another environment is recorded in {options.golden_dir / suite.name}"
        )
    noise, pairs = measure_noise(sources, suite.golden_metrics)
    unbounded = [metric for metric, value in noise.items() if not math.isfinite(value)]
    if unbounded:
        err.write(f"error: golden calibrate {suite.name}: {', '.join(unbounded)}: NaN in one environment only\n")
        return 1
    tiers = noise_for_tiers(noise)
    for metric, value in tiers.items():
        borrowed = " (none measured: the suite's largest)" if value != noise[metric] else ""
        out.write(f"{metric}: noise {value:.3g}{borrowed}, tier rtol={margin * value:.3g} ({margin:g}x)\n")
    if not any(tiers.values()):
        out.write(
            "warning: nothing moved between these environments: the tier is exact, which another vendor may not\n"
        )
    calibration = Calibration(tiers, margin, tuple(pairs))
    out.write(f"measured: {'; '.join(pairs)}\n")
    for path, golden in goldens.values():
        provenance = {**golden.provenance, "calibration": calibration.to_json()}
        write_golden(path, dataclasses.replace(golden, provenance=provenance))
        out.write(f"wrote the calibration into {path}\n")
    if not goldens:
        out.write(f"no golden of {suite.name} to write it into: record one with harness golden update\n")
    return EXIT_PASS


def _isa_runs(suite: SuiteSpec, options: RunOptions, out: TextIO, err: TextIO) -> tuple[dict[str, Trajectories], int]:
    """One plain run of the suite per CPU ISA this machine dispatches to (none on CUDA: its variation
    comes from goldens of other GPUs), each in its own run directory under ``--out``."""
    if options.device != "cpu":
        return {}, EXIT_PASS
    isas = {cpu_pin(isa).capability: isa for isa in ("native", "avx2")}  # avx2 last: kept where both are one
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    root = options.out or Path("reports") / suite.name / f"calibrate-{stamp}"
    runs = {}
    for capability, isa in sorted(isas.items()):
        run_dir = root / capability
        run = dataclasses.replace(options, golden="off", cpu_isa=isa, out=run_dir, first_op="off")
        code = run_suite(suite, run, out, err)
        if code != EXIT_PASS:
            err.write(f"error: golden calibrate {suite.name}: the {capability} run exited {code} ({run_dir})\n")
            return runs, code
        runs[f"cpu-isa {capability}"] = {
            arm: {m: read_metrics(run_dir / "arms" / arm / "metrics.jsonl")[m] for m in suite.golden_metrics}
            for arm, spec in suite.arms.items()
            if spec.expect_raise is None  # it raised, as the suite says: no metrics to measure
        }
    return runs, EXIT_PASS


def _comparable_goldens(suite: SuiteSpec, options: RunOptions) -> dict[str, tuple[Path, Golden]]:
    """The suite's goldens (env key -> path, golden) of this run's family (device, backend, dtype) and
    configuration: those a run of this machine may compare with, and its own."""
    folder = options.golden_dir / suite.name
    recorded = sorted(p.stem for p in folder.glob("*.json"))
    mine = run_env_key(options.device, suite.dtype, cpu_pin(options.cpu_isa) if options.device == "cpu" else None)
    config = {**golden_config(suite), "steps": None}
    found = {}
    for other in [mine, *comparable_env_keys(mine, recorded)]:
        path = folder / f"{other}.json"
        if path.is_file():
            golden = load_golden_for(path, suite.name)
            if {**golden.config, "steps": None} == config:
                found[other] = (path, golden)
    return found
