"""benchmarks/gpu_smoke.sh, the script a session with a GPU runs: everything in it that runs on CPU,
run here on CPU, and its FAIL lines and exit code when the runs fail."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "benchmarks" / "gpu_smoke.sh"  # run by the run_gpu_smoke fixture of conftest.py


def test_the_smoke_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SMOKE)], capture_output=True).returncode == 0


def test_every_item_of_the_smoke_that_runs_on_cpu_passes_there(run_gpu_smoke, tmp_path: Path) -> None:
    run = run_gpu_smoke(tmp_path / "smoke", STEPS="2")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert [line for line in lines if line.startswith("PASS ")] == [
        "PASS doctor (preflight and one training step)",
        "PASS parity-cold",
        "PASS parity-cold traced its graphs (trace cache miss)",
        "PASS parity-warm",
        "PASS parity-warm loaded its graphs (trace cache hit)",
        "PASS determinism",
        "PASS retention",
        "PASS pec",
        "PASS fidelity",
        "PASS parity-bf16",
        "PASS fidelity-bf16",
        "PASS abba eager vs graph, timed by wall",
    ]
    assert "SKIP gpu-gate.yml gate (needs 2 GPUs, 0 visible)" in lines
    assert not any(line.startswith("FAIL") for line in lines)


def test_a_run_that_fails_is_a_fail_line_naming_its_exit_and_the_smoke_exits_1(run_gpu_smoke, tmp_path: Path) -> None:
    run = run_gpu_smoke(tmp_path / "smoke", STEPS="1", SET="debug.fail_step=1", ONLY="doctor determinism")
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert f"FAIL determinism (exit 3; {tmp_path / 'smoke' / 'determinism'})" in lines
    assert "PASS doctor (preflight and one training step)" in lines  # the doctor plants nothing
    assert {"SKIP parity (not in ONLY)", "SKIP parity-bf16 (not in ONLY)", "SKIP abba (not in ONLY)"} <= set(lines)
    assert not [line for line in lines if line.startswith("PASS parity")]
