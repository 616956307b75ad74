"""``harness doctor``'s real step: the bundled reference trains one step twice, through the whole
harness, on the processes and device a run would use (:func:`step_preflight`).

The other preflight items (harness/environment.py) look at the machine; this one uses it: a process
group on the run's backend (nccl on GPUs), the elastic launcher, one forward and backward through
the token exchange on every rank, and the two runs in bitwise agreement (the ``determinism`` suite,
one step, no golden). A green doctor then predicts a run that starts, trains and agrees with itself.
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

from harness.environment import Preflight, backend_for
from harness.prepare import RunOptions
from harness.run import run_suite
from harness.rundir import SUMMARY
from harness.suites import SUITES_DIR, load_suite

SUITE = "determinism"
TIMEOUT_S = 300.0


def step_preflight(device: str, ranks: int, overrides: tuple[str, ...] = ()) -> Preflight:
    """One step of the determinism suite on ``ranks`` processes of ``device``, twice; ``overrides``
    are ``--set`` items (a test plants a failure with them)."""
    sets = [("--steps", "steps=1"), ("--ranks", f"ranks={ranks}"), *(("--set", item) for item in overrides)]
    suite = load_suite(SUITE, sets, device=device, suites_dir=SUITES_DIR)
    what = f"one step of the reference on {ranks} {backend_for(device)} ranks ({device}), twice"
    with tempfile.TemporaryDirectory(prefix="harness-doctor-") as tmp:
        run_dir = Path(tmp) / "run"
        options = RunOptions(device=device, out=run_dir, timeout_s=TIMEOUT_S, golden="off", trace_cache=None)
        code = run_suite(suite, options, out=io.StringIO(), err=io.StringIO())
        try:
            summary = json.loads((run_dir / SUMMARY).read_text())
        except (OSError, ValueError) as e:
            return Preflight("training step", False, f"{what}: no summary.json ({e}), exit {code}")
    if code == 0:
        return Preflight("training step", True, f"{what}: bitwise equal")
    failed = next((c for c in summary["checks"] if c["status"] not in ("pass", "skip")), None)
    why = f"{failed['name']}: {failed['detail']}" if failed else summary["verdict"]
    return Preflight("training step", False, f"{what}: exit {code}, {why}")
