"""Checkpoint and resume: the reference's checkpoints (harness/reference/checkpoint.py) and the
`resume` suite, in which a run stopped after step k and resumed by a fresh launch must equal the
run that never stopped, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch
from suite_files import suite_error, suite_from

from harness.checks.resume import run as judge_resume
from harness.records import ArmRecords, read_jsonl
from harness.reference import checkpoint
from harness.reference.train import TrainConfig, Trainer
from harness.specs import CheckSpec

CONFIG = TrainConfig(ep=2, chunking="eager", chunks=2)  # EP=2 as logical ranks of this process


def _trainer(config: TrainConfig = CONFIG) -> Trainer:
    torch.manual_seed(0)
    return Trainer(config)


def _losses(trainer: Trainer, steps: range) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in map(trainer.step, steps)]


def test_a_loaded_checkpoint_trains_on_bit_for_bit(tmp_path: Path) -> None:
    straight = _trainer()
    expected = _losses(straight, range(1, 6))[3:]
    first = _trainer()
    _losses(first, range(1, 4))
    checkpoint.save(first, 3, tmp_path)
    torch.manual_seed(123)  # whatever the new process's RNG, the checkpoint's is restored
    second = _trainer()
    assert checkpoint.load(second, tmp_path, 3) == 3
    assert _losses(second, range(4, 6)) == expected
    manifest = json.loads((tmp_path / "step-3" / checkpoint.MANIFEST).read_text())
    assert manifest["step"] == 3 and manifest["config"]["ep"] == 2 and manifest["keys"] > 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A checkpoint after step 2 under tmp_path/ckpt."""
    trainer = _trainer()
    _losses(trainer, range(1, 3))
    checkpoint.save(trainer, 2, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda c: (c / "step-2" / "__0_0.distcp").unlink(),
            r"step-2: cannot read its tensors: FileNotFoundError: .*__0_0\.distcp",
        ),
        (lambda c: _truncate(c / "step-2" / "__0_0.distcp"), r"step-2: cannot read its tensors: \w+: "),
        (lambda c: (c / "step-2" / ".metadata").unlink(), r"step-2/\.metadata: missing: not a complete checkpoint"),
        (lambda c: (c / "step-2" / "harness.json").unlink(), r"step-2/harness\.json: missing: the save did not finish"),
        (
            lambda c: (c / "step-2").rename(c / "step-2.partial"),
            r"step-2: no such checkpoint \(found: step-2\.partial\)",
        ),
    ],
    ids=["missing-shard", "truncated-shard", "no-index", "no-manifest", "unfinished"],
)
def test_a_partial_checkpoint_never_loads_and_names_the_file(saved: Path, damage, message: str) -> None:
    damage(saved)
    with pytest.raises(checkpoint.CheckpointError, match=message) as info:
        checkpoint.load(_trainer(), saved, 2)
    assert str(saved) in str(info.value) and "\n" not in str(info.value)


def test_a_checkpoint_of_another_config_is_refused_naming_the_field(saved: Path) -> None:
    other = TrainConfig(ep=2, chunking="eager", chunks=2, lr=2e-3)
    with pytest.raises(
        checkpoint.CheckpointError, match=r"harness\.json: config\.lr: saved 0\.001, this arm has 0\.002"
    ):
        checkpoint.load(_trainer(other), saved, 2)


# A child saves after step 1, then is SIGKILLed in the middle of saving step 1 again and step 2:
# after the tensors are written, before the save is finished.
KILLED_MID_SAVE = """
import os, signal, sys
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from harness.reference import checkpoint
from harness.reference.train import TrainConfig, Trainer
from harness.specs import CheckSpec

folder, again = Path(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
trainer = Trainer(TrainConfig(ep=2, chunking="eager", chunks=2))
trainer.step(1)
checkpoint.save(trainer, 1, folder)
trainer.step(2)
dcp.FileSystemWriter.finish = lambda self, *a, **k: os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save(trainer, again, folder)
"""


@pytest.mark.parametrize("again", [1, 2], ids=["same-step", "next-step"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path: Path, again: int) -> None:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(KILLED_MID_SAVE))
    child = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), str(again)], capture_output=True)
    assert child.returncode == -9, child.stderr.decode()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-1", f"step-{again}.partial"]
    straight = _trainer()
    expected = _losses(straight, range(1, 4))[1:]
    resumed = _trainer()
    assert checkpoint.load(resumed, tmp_path / "ckpt", 1) == 1
    assert _losses(resumed, range(2, 4)) == expected


def test_the_suite_passes_resumed_and_resharded(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "resume", "--ranks", 2, "--out", out, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    checks = {c["name"]: c for c in run.summary(out)["checks"]}
    for arm in ("resumed", "resharded"):
        assert (
            checks[f"straight vs {arm}: resumed"]["detail"]
            == f"{arm} loaded its checkpoint of step 3 in a fresh launch"
        )
        assert checks[f"straight vs {arm}: loss"]["detail"] == "6 steps bitwise identical"
        assert [m["step"] for m in read_jsonl(out / "arms" / arm / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
        saved = out / "arms" / arm / "checkpoint" / "step-3"
        assert {".metadata", "harness.json"} <= {p.name for p in saved.iterdir()}
    # Two launches of each resumed arm, the resharded one's second on one process.
    logs = sorted(p.name for p in (out / "logs").iterdir() if p.is_dir())
    assert logs == ["resharded@1-3", "resharded@4-", "resumed@1-3", "resumed@4-", "straight"], logs
    assert sorted(p.name for p in (out / "logs" / "resharded@4-").glob("rank*.log")) == ["rank0.log"]


MINI = """
name = "mini-resume"
description = "straight against resumed"
ranks = 2
steps = 4
[model]
config = "cpu-tiny"
[train]
routing = "forced-balanced"
chunking = "eager"
chunks = 2
[arms.straight]
[arms.resumed]
resume_at = 2
[[checks]]
kind = "resume"
arms = ["straight", "resumed"]
"""


@pytest.mark.parametrize(
    ("fault", "step", "where"),
    [
        ("optimizer-not-saved", 4, "step 3: gradients identical; first parameter to differ after the optimizer step"),
        ("data-position-lost", 3, "step 3: first gradient to differ is"),
    ],
)
def test_each_planted_checkpoint_bug_fails_naming_the_step_and_parameter(
    run_harness, tmp_path: Path, fault: str, step: int, where: str
) -> None:
    suite = tmp_path / "mini.toml"
    suite.write_text(MINI)
    out = tmp_path / "run"
    args = ("--set", f"train.checkpoint_fault={fault}", "--out", out)
    run = run_harness("run", suite, *args, timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr
    loss = {c["name"]: c for c in run.summary(out)["checks"]}["straight vs resumed: loss"]
    assert loss["status"] == "fail" and loss["first_divergent_step"] == step, loss
    assert where in loss["detail"], loss["detail"]


@pytest.mark.parametrize(
    ("resume", "expected"),
    [
        ("resume_at = 4", "FILE: arms.resumed.resume_at: expected int in 1-3, got 4"),
        ("resume_ranks = 1", "FILE: arms.resumed.resume_ranks: needs resume_at: only a resumed arm launches twice"),
        ("resume_at = 2\ndelay = 1", "FILE: arms.resumed.resume_at: needs a plain arm: the checkpoint does not hold"),
        ("resume_at = 2\nresume_ranks = 3", "FILE: arms.resumed.resume_ranks: 3 processes do not divide EP degree 2"),
    ],
    ids=["beyond-the-run", "ranks-alone", "versioned", "ranks-not-dividing"],
)
def test_a_bad_resume_is_refused_naming_the_field(tmp_path: Path, resume: str, expected: str) -> None:
    message = suite_error(tmp_path, MINI.replace("resume_at = 2", resume))
    assert message.startswith(expected), message


def test_the_resume_check_needs_the_straight_arm_first(tmp_path: Path) -> None:
    text = MINI.replace('arms = ["straight", "resumed"]', 'arms = ["resumed", "straight"]')
    assert suite_error(tmp_path, text) == (
        'FILE: checks.0.arms.0: arm "resumed" resumes (resume_at): the first arm trains straight'
    )


def test_a_checkpoint_others_could_write_is_not_read(saved: Path) -> None:
    """torch.distributed.checkpoint unpickles its index: one another user could write is refused."""
    index = saved / "step-2" / ".metadata"
    index.chmod(0o666)
    with pytest.raises(
        checkpoint.CheckpointError, match=r"step-2/\.metadata: owned by uid \d+, mode 666: another user"
    ):
        checkpoint.load(_trainer(), saved, 2)


def _judged(resumed_info: dict, straight_losses: list[float], resumed_losses: list[float]) -> dict[str, str]:
    """The resume check on synthetic records of MINI's two arms: name -> status."""

    def metrics(losses: list[float]) -> pd.DataFrame:
        steps = pd.Index(range(1, len(losses) + 1), name="step")
        return pd.DataFrame({"loss": losses, "grad_norm": [1.0] * len(losses)}, index=steps)

    with tempfile.TemporaryDirectory() as tmp:
        suite = suite_from(Path(tmp), MINI)
    records = {
        "straight": ArmRecords(metrics=metrics(straight_losses)),
        "resumed": ArmRecords(metrics=metrics(resumed_losses), info=resumed_info),
    }
    check = CheckSpec("resume", "straight vs resumed", ("straight", "resumed"), ("loss", "grad_norm"))
    return {r.name: r.status for r in judge_resume(check, suite, records)}


def test_the_resume_check_fails_an_arm_that_never_loaded_even_with_equal_numbers() -> None:
    """A resume that silently started over from the same seed would match bit for bit: not a pass."""
    assert _judged({"resumed_from": None}, [5.0] * 4, [5.0] * 4) == {"straight vs resumed: resumed": "fail"}
    assert _judged({}, [5.0] * 4, [5.0] * 4) == {"straight vs resumed: resumed": "fail"}


def test_the_resume_check_fails_on_no_steps_and_on_a_differing_step() -> None:
    assert _judged({"resumed_from": 2}, [5.0] * 4, [5.0] * 4)["straight vs resumed: loss"] == "pass"
    assert _judged({"resumed_from": 2}, [5.0] * 4, [5.0, 5.0, 5.1, 5.0])["straight vs resumed: loss"] == "fail"
    assert _judged({"resumed_from": 2}, [], [])["straight vs resumed: loss"] == "fail"
