"""Checkpoint and resume: the reference's checkpoints (harness/reference/checkpoint.py) and the
`resume` suite, in which a run stopped after step k and resumed by a fresh launch must equal the
run that never stopped, bit for bit."""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed.checkpoint as dcp
from suite_files import suite_error, suite_from

from harness.checks.resume import run as judge_resume
from harness.plan import plan_launches
from harness.records import ArmRecords, read_jsonl
from harness.reference import checkpoint
from harness.reference.pec import PECConfig, PECTrainer
from harness.reference.pipeline import PipelineConfig, VersionedTrainer
from harness.reference.train import TrainConfig, Trainer
from harness.results import CheckResult
from harness.specs import CheckSpec
from harness.subject.protocol import ArmFacts
from harness.suites import load_suite
from harness.trust import mode_of, tag, user_key

CONFIG = TrainConfig(ep=2, chunking="eager", chunks=2)  # EP=2 as logical ranks of this process
PIPELINE = PipelineConfig(ep=2, chunking="eager", chunks=2, delay=2, correction="always")
# What a versioned trainer's record says of its update; its time and replay count aside.
UPDATE_FIELDS = ("step", "loss", "grad_norm", "revision", "ages", "batches_applied", "forwards", "correction_mean")


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


def _updates(trainer: VersionedTrainer, batches: range, drain: bool = False) -> list[dict]:
    records = [r for r in map(trainer.step, batches) if r is not None] + (trainer.drain() if drain else [])
    return [{k: r[k] for k in UPDATE_FIELDS} for r in records]


def _versions_held(checkpoint_dir: Path) -> tuple[int, set[str]]:
    """Logical rank 0's pending forwards and the versions of the snapshots the checkpoint holds."""
    keys = dcp.FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata
    forwards = {k.split(".")[3] for k in keys if k.startswith("rank0.in_flight.forward.")}
    versions = {".".join(k.split(".")[3:5]) for k in keys if k.startswith("rank0.in_flight.snapshot.")}
    return len(forwards), versions


def test_a_loaded_versioned_pipeline_trains_on_bit_for_bit(tmp_path: Path) -> None:
    """Delay 2, correction always, retain: saved while the pipeline fills (after tick 2: batches 1 and
    2 in flight at one version, their own logprobs the correction's state), loaded, saved again in
    steady state (after tick 4: batches 3 and 4 at two versions), loaded again. Each restored forward
    has no graph and replays, though the arm retains: the replays are counted."""
    expected = _updates(VersionedTrainer(PIPELINE), range(1, 6), drain=True)
    first = VersionedTrainer(PIPELINE)
    got = _updates(first, range(1, 3))
    checkpoint.save(first, 2, tmp_path)
    assert _versions_held(tmp_path / "step-2") == (2, {"0.0"})  # one snapshot for two forwards
    second = VersionedTrainer(PIPELINE)
    checkpoint.load(second, tmp_path, 2)
    got += _updates(second, range(3, 5))
    checkpoint.save(second, 4, tmp_path)
    assert _versions_held(tmp_path / "step-4") == (2, {"0.0", "0.1"})
    third = VersionedTrainer(PIPELINE)
    checkpoint.load(third, tmp_path, 4)
    got += _updates(third, range(5, 6), drain=True)
    assert got == expected
    assert [u["step"] for u in got] == [0, 1, 2, 3, 4]
    assert third.engines[0].recomputes == 4  # batches 1 and 2 replayed after the first load, 3 and 4 after the second


def test_a_loaded_pec_table_trains_on_bit_for_bit_with_its_pending_nol_part(tmp_path: Path) -> None:
    config = PECConfig(ep=2)
    straight = PECTrainer(config, batches=4)
    expected = _losses(straight, range(1, 5))
    first = PECTrainer(config, batches=4)
    got = _losses(first, range(1, 3))
    pending = {rank: table.gradients[(2, "NOL")] for rank, table in first.tables.items()}
    assert {rank: sorted(table.gradients) for rank, table in first.tables.items()} == {0: [(2, "NOL")], 1: [(2, "NOL")]}
    checkpoint.save(first, 2, tmp_path)
    second = PECTrainer(config, batches=4)
    checkpoint.load(second, tmp_path, 2)
    for rank, table in second.tables.items():
        restored = table.gradients[(2, "NOL")]
        assert torch.equal(restored.ids, pending[rank].ids) and torch.equal(restored.grads, pending[rank].grads)
    got += _losses(second, range(3, 5))
    assert got == expected
    for rank, table in second.tables.items():
        assert torch.equal(table.weight, straight.tables[rank].weight)
        assert torch.equal(table.optimizer.state, straight.tables[rank].optimizer.state)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A checkpoint after step 2 under tmp_path/ckpt."""
    trainer = _trainer()
    _losses(trainer, range(1, 3))
    checkpoint.save(trainer, 2, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _overwrite(path: Path) -> None:
    """Garbage of the same size: what no size check catches."""
    path.write_bytes(b"x" * path.stat().st_size)


def _edit_manifest(checkpoint_dir: Path, edit: Callable[[dict], None]) -> None:
    manifest = checkpoint_dir / checkpoint.MANIFEST
    saved = json.loads(manifest.read_text())
    edit(saved)
    manifest.write_text(json.dumps(saved))


NO_MATCH = "its tag does not match the user's key: altered, replaced, cut short or signed with another key: not loaded"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda c: (c / "step-2" / "__0_0.distcp").unlink(),
            r"step-2/__0_0\.distcp: missing: the index reads \d+ bytes of tensors from it",
        ),
        (
            lambda c: _truncate(c / "step-2" / "__0_0.distcp"),
            r"step-2/__0_0\.distcp: truncated: (\d+) bytes, the index reads (\d+)$",
        ),
        (lambda c: (c / "step-2" / ".metadata").unlink(), r"step-2/\.metadata: missing: not a complete checkpoint"),
        (lambda c: _overwrite(c / "step-2" / ".metadata"), r"step-2/\.metadata: " + re.escape(NO_MATCH)),
        (lambda c: _overwrite(c / "step-2" / "__0_0.distcp"), r"step-2/__0_0\.distcp: " + re.escape(NO_MATCH)),
        (
            lambda c: _edit_manifest(c / "step-2", lambda m: m.update(format=1)),
            r"step-2/harness\.json: format: 1, this harness reads 2",
        ),
        (
            lambda c: _edit_manifest(c / "step-2", lambda m: m.pop("tags")),
            r"step-2/harness\.json: tags: expected each file's tag, 64 hex digits, got None",
        ),
        (lambda c: (c / "step-2" / "harness.json").unlink(), r"step-2/harness\.json: missing: the save did not finish"),
        (
            lambda c: (c / "step-2").rename(c / "step-2.partial"),
            r"step-2: no such checkpoint \(found: step-2\.partial\)",
        ),
    ],
    ids=[
        "missing-shard",
        "truncated-shard",
        "no-index",
        "garbage-index",
        "overwritten-shard",
        "other-format",
        "no-tags",
        "no-manifest",
        "unfinished",
    ],
)
def test_a_partial_or_damaged_checkpoint_never_loads_and_names_the_file(saved: Path, damage, message: str) -> None:
    damage(saved)
    with pytest.raises(checkpoint.CheckpointError, match=message) as info:
        checkpoint.load(_trainer(), saved, 2)
    assert str(saved) in str(info.value) and "\n" not in str(info.value)
    assert "weights_only" not in str(info.value)  # torch's advice to load it unchecked


def test_a_signed_shard_torch_cannot_read_is_refused_in_our_words(saved: Path) -> None:
    """A shard whose tag matches yet whose bytes are no tensors (a build that writes another format):
    refused naming the shard, never with torch's advice to load it with ``weights_only=False``."""
    shard = saved / "step-2" / "__0_0.distcp"
    _overwrite(shard)
    signed = tag(user_key(), "step-2/__0_0.distcp", shard.read_bytes()).hex()
    _edit_manifest(saved / "step-2", lambda m: m["tags"].update({"__0_0.distcp": signed}))
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(_trainer(), saved, 2)
    assert str(info.value) == f"{shard}: signed, yet not tensors this build reads (UnpicklingError)"


def test_a_file_signed_for_another_step_is_refused(saved: Path) -> None:
    """A tag covers the file's place too: step 2's index renamed into a step-3 checkpoint does not load."""
    (saved / "step-2").rename(saved / "step-3")
    _edit_manifest(saved / "step-3", lambda m: m.update(step=3))
    with pytest.raises(checkpoint.CheckpointError, match=r"step-3/\.metadata: " + re.escape(NO_MATCH)):
        checkpoint.load(_trainer(), saved, 3)


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
from harness.suites import load_suite

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


RESUMED = {  # the suite's resumed arms and their straight arms
    "resumed": "straight",
    "resharded": "straight",
    "unsharded": "straight",  # the reverse: saved by one process, loaded by 2
    **{f"versioned-{arm}": "versioned" for arm in ("retain", "offload", "replay", "resharded")},
    "pec-resumed": "pec",
    "pec-resharded": "pec",
}


def _in_flight(out: Path, arm: str, rank: int) -> set[str]:
    """Logical rank ``rank``'s in-flight keys in an arm's checkpoint of the suite's run."""
    saved = out / "arms" / arm / "checkpoint" / "step-4"
    prefix = f"rank{rank}.in_flight."
    keys = dcp.FileSystemReader(saved).read_metadata().state_dict_metadata
    return {k.removeprefix(prefix) for k in keys if k.startswith(prefix)}


def _modes(root: Path) -> dict[str, str]:
    """Every folder's and file's mode under ``root`` (itself included), by path relative to it."""
    places = [root, *root.rglob("*")]
    return {p.relative_to(root).as_posix(): mode_of(p.stat()) for p in places}


def test_the_suite_passes_every_case(run_harness, umask_000: None, tmp_path: Path) -> None:
    """One run of the shipped suite, read for every case (a run costs a minute on 2 cores). It runs
    under umask 000, where every folder would be 0777 and every file 0666: the run directory and the
    checkpoints must be private all the same, or the loading ranks would refuse them."""
    out = tmp_path / "run"
    run = run_harness("run", "resume", "--ranks", 2, "--out", out, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert _modes(out)["."] == "0700"
    for arm in RESUMED:
        arm_dir = out / "arms" / arm
        assert {_modes(out)[f"arms/{arm}"], _modes(out)["arms"]} == {"0700"}
        modes = _modes(arm_dir / "checkpoint")
        assert set(modes) > {".", "step-4", "step-4/.metadata", "step-4/harness.json"}, modes
        assert {m for p, m in modes.items() if (arm_dir / "checkpoint" / p).is_dir()} == {"0700"}, modes
        assert {m for p, m in modes.items() if (arm_dir / "checkpoint" / p).is_file()} == {"0600"}, modes
    checks = {c["name"]: c for c in run.summary(out)["checks"]}
    for arm, straight in RESUMED.items():
        pair = f"{straight} vs {arm}"
        assert checks[f"{pair}: resumed"]["detail"] == f"{arm} loaded its checkpoint of step 4 in a fresh launch"
        assert checks[f"{pair}: loss"]["detail"] == "6 steps bitwise identical"
        assert checks[f"{pair}, final weights"]["status"] == "pass"
        assert [m["step"] for m in read_jsonl(out / "arms" / arm / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    # The resumed arms share a saving launch (unsharded's is one process), then load on 2 processes
    # or, resharded, on one.
    logs = {p.name for p in (out / "logs").iterdir() if p.is_dir()}
    saving = "+".join(arm for arm in RESUMED if arm != "unsharded") + "@1-4"
    resharded = "+".join(arm for arm in RESUMED if arm.endswith("resharded")) + "@5-"
    loading = "+".join(arm for arm in RESUMED if not arm.endswith("resharded")) + "@5-"
    assert logs == {"straight+versioned+pec", saving, "unsharded@1-4", loading, resharded}, logs
    for one_process in (resharded, "unsharded@1-4"):
        assert sorted(p.name for p in (out / "logs" / one_process).glob("rank*.log")) == ["rank0.log"]
    for rank in (0, 1):
        # After tick 4 at delay 2, batches 3 and 4 wait for their backward, forwarded at revisions 0 and 1.
        held = _in_flight(out, "versioned-retain", rank)
        assert {k.split(".")[1] for k in held if k.startswith("forward.") and k.endswith(".batch")} == {"2", "3"}
        assert {".".join(k.split(".")[1:3]) for k in held if k.startswith("snapshot.")} == {"0.0", "0.1"}
        # Between batches 4 and 5 of a pipelined PEC table, batch 4's NOL part is pending.
        pec = {"trainer", "events", "rowwise_state", "gradient.4.NOL.ids", "gradient.4.NOL.grads"}
        assert _in_flight(out, "pec-resumed", rank) == pec


def test_resumed_arms_that_stop_alike_share_their_launches() -> None:
    groups = plan_launches(load_suite("resume", [("--ranks", "ranks=2")]))
    assert [(g.ranks, g.first_step, g.last_step, g.checkpoint, len(g.arms)) for g in groups] == [
        (2, 1, None, None, 3),
        (2, 1, 4, "save", 8),
        (1, 1, 4, "save", 1),  # unsharded: EP=2 hosted in one process
        (2, 5, None, "load", 6),
        (1, 5, None, "load", 3),
    ]


HEAD = """
name = "{name}"
description = "{description}"
ranks = 2
steps = 4
[model]
config = "cpu-tiny"
[train]
routing = "forced-balanced"
chunking = "eager"
chunks = 2
"""
MINI = (
    HEAD.format(name="mini-resume", description="straight against resumed")
    + """
[arms.straight]
[arms.resumed]
resume_at = 2
[[checks]]
kind = "resume"
arms = ["straight", "resumed"]
"""
)


FAULTS = HEAD.format(name="resume-faults", description="each planted checkpoint bug against the arm that never stopped")
STRAIGHT = {"straight": "", "versioned": 'delay = 2\ncorrection = "always"\n', "pec": 'pec = "pipelined"\n'}
# Each fault's arm (resumed after step 2): its straight arm, and where the resume check must find it.
PLANTED = {
    # The update of step 3 used fresh AdamW moments: its gradients equal, its weights do not.
    "optimizer-not-saved": ("straight", 4, "step 3: gradients identical; first parameter to differ after the"),
    "data-position-lost": ("straight", 3, "step 3: first gradient to differ is"),
    # Saved while the pipeline fills (batches 1 and 2 in flight): the resumed pipeline applies batch 2 first.
    "oldest-version-dropped": ("versioned", 1, "step 1: first gradient to differ is"),
    # Batch 2's NOL rows are never updated; batch 3 reads none of them (NOL), batch 4 does.
    "pending-nol-dropped": ("pec", 4, "step 4: first gradient to differ is"),
}


def test_each_planted_checkpoint_bug_fails_naming_the_step_and_parameter(run_harness, tmp_path: Path) -> None:
    """Every fault's arm in one run, beside the straight arms (one test: a run costs half a minute)."""
    arms = [f"[arms.{arm}]\n{table}" for arm, table in STRAIGHT.items()]
    for fault, (straight, _, _) in PLANTED.items():
        arms.append(f'[arms.{fault}]\n{STRAIGHT[straight]}resume_at = 2\ncheckpoint_fault = "{fault}"\n')
        arms.append(f'[[checks]]\nkind = "resume"\narms = ["{straight}", "{fault}"]\n')
    (tmp_path / "faults.toml").write_text(FAULTS + "".join(arms))
    run = run_harness("run", tmp_path / "faults.toml", "--out", tmp_path / "run", timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr
    checks = {c["name"]: c for c in run.summary(tmp_path / "run")["checks"]}
    seen, details = {}, {}
    for fault, (straight, _, where) in PLANTED.items():
        loaded, loss = checks[f"{straight} vs {fault}: resumed"], checks[f"{straight} vs {fault}: loss"]
        seen[fault] = (loaded["status"], loss["status"], loss["first_divergent_step"], where in loss["detail"])
        details[fault] = loss["detail"]
    # Each loaded its checkpoint, and went wrong at its step, naming where.
    assert seen == {fault: ("pass", "fail", step, True) for fault, (_, step, _) in PLANTED.items()}, details


DAMAGED = """
name = "resume-damaged"
description = "a resumed arm whose checkpoint is damaged between its two launches"
ranks = 1
steps = 2
[model]
config = "cpu-tiny"
[train]
local_batch = 1
seq_len = 8
[arms.resumed]
resume_at = 1
[[checks]]
kind = "ranks-agree"
"""


@pytest.mark.parametrize(
    ("damage", "line"),
    [
        ("missing-shard", r"step-1/__0_0\.distcp: missing: the index reads \d+ bytes of tensors from it"),
        ("truncated-shard", r"step-1/__0_0\.distcp: truncated: \d+ bytes, the index reads \d+"),
        ("garbage-index", r"step-1/\.metadata: " + re.escape(NO_MATCH)),
        ("other-config", r"step-1/harness\.json: config\.seed: saved 43, this arm has 42"),
    ],
    ids=["missing-shard", "truncated-shard", "garbage-index", "other-config"],
)
def test_a_damaged_checkpoint_is_bad_input_naming_the_file(run_harness, tmp_path: Path, damage: str, line: str) -> None:
    (tmp_path / "damaged.toml").write_text(DAMAGED)
    out = tmp_path / "run"
    run = run_harness("run", tmp_path / "damaged.toml", "--set", f"debug.checkpoint_damage={damage}", "--out", out)
    assert run.returncode == 2, run.stdout + run.stderr
    summary = run.summary(out)
    assert summary["verdict"] == "bad-input" and summary["launches"][-1]["root_cause"]["kind"] == "bad-input"
    refused = next(c for c in summary["checks"] if c["kind"] == "bad-input")
    where = re.escape(str(out / "arms" / "resumed" / "checkpoint")) + "/"
    assert re.fullmatch(where + line, refused["detail"]), refused["detail"]
    error = next(text for text in run.stderr.splitlines() if text.startswith("error: "))
    assert error.endswith(refused["detail"]) and "refused its input" in error


RENAME_EXCHANGE = 2  # renameat2's flag: swap the two names in one step (linux/fs.h)
AT_FDCWD = -100  # names relative to the working directory (linux/fcntl.h)


def _exchange(first: Path, second: Path) -> None:
    """Swaps two folders in one step, as an attacker would: renameat2 with RENAME_EXCHANGE. Where libc
    has no renameat2, by three renames through a third name, with a warning (a wider window)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        warnings.warn("libc has no renameat2: the folders are swapped by three renames", stacklevel=2)
        aside = first.with_name(f"{first.name}.aside")
        first.rename(aside)
        second.rename(first)
        aside.rename(second)
        return
    if renameat2(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), RENAME_EXCHANGE) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error), str(first))


class _PlantedIndex:
    """An index that, when unpickled, leaves ``marker`` (code of the planter's, run in the rank) and
    returns ``index`` unpickled: the real index, so that the load goes on as if nothing happened."""

    def __init__(self, marker: Path, index: bytes) -> None:
        self.marker, self.index = marker, index

    def __reduce__(self) -> tuple:
        return eval, (f"(open({str(self.marker)!r}, 'w').close(), __import__('pickle').loads({self.index!r}))[1]",)


def test_a_run_folder_swapped_between_the_check_and_the_read_is_refused_unread(start_harness, tmp_path: Path) -> None:
    """The race of a run directory whose parent others may write: the loading rank checks the path,
    then, before it reads, the run folder is swapped (renameat2 RENAME_EXCHANGE) for a copy whose
    index is a pickle that runs code. The rank waits between the two (checkpoint.RACE_ENV) while this
    process swaps. The index read is the planted one, but it is checked before it is unpickled:
    nothing runs, and the load is refused as bad input, naming the file."""
    (tmp_path / "damaged.toml").write_text(DAMAGED)
    out, race, marker = tmp_path / "run", tmp_path / "race", tmp_path / "planted-code-ran"
    race.mkdir()
    harness = start_harness("run", tmp_path / "damaged.toml", "--out", out, env={checkpoint.RACE_ENV: race})
    deadline = time.monotonic() + 300
    while not (race / "checked").exists():
        assert harness.poll() is None and time.monotonic() < deadline, harness.communicate()
        time.sleep(0.05)
    planted = tmp_path / "planted"
    shutil.copytree(out, planted)
    index = planted / "arms" / "resumed" / "checkpoint" / "step-1" / ".metadata"
    index.write_bytes(pickle.dumps(_PlantedIndex(marker, index.read_bytes())))
    _exchange(out, planted)
    (race / "go").touch()
    stdout, stderr = harness.communicate(timeout=300)
    assert not marker.exists()
    assert harness.returncode == 2, stdout + stderr
    error = next(text for text in stderr.splitlines() if text.startswith("error: "))
    assert error.endswith(f"{out}/arms/resumed/checkpoint/step-1/.metadata: {NO_MATCH}"), error


@pytest.mark.parametrize(
    ("resume", "expected"),
    [
        ("resume_at = 4", "FILE: arms.resumed.resume_at: expected int in 1-3, got 4"),
        ("resume_ranks = 1", "FILE: arms.resumed.resume_ranks: needs resume_at: only a resumed arm launches twice"),
        (
            'resume_at = 2\ndelay = 1\ntrainer = "delayed-oracle"',
            'FILE: arms.resumed.resume_at: needs trainer = "versioned": the checkpoint does not hold the pending',
        ),
        (
            'resume_at = 2\ndelay = 1\ncheckpoint_fault = "pending-nol-dropped"',
            "FILE: arms.resumed.checkpoint_fault: checkpoint_fault must be one of ('none', 'optimizer-not-saved',"
            " 'oldest-version-dropped') for this arm's trainer, got 'pending-nol-dropped'",
        ),
        ("resume_at = 2\nresume_ranks = 3", "FILE: arms.resumed.resume_ranks: 3 processes do not divide EP degree 2"),
    ],
    ids=["beyond-the-run", "ranks-alone", "delayed-oracle", "fault-of-another-trainer", "ranks-not-dividing"],
)
def test_a_bad_resume_is_refused_naming_the_field(tmp_path: Path, resume: str, expected: str) -> None:
    message = suite_error(tmp_path, MINI.replace("resume_at = 2", resume))
    assert message.startswith(expected), message


def test_the_resume_check_needs_the_straight_arm_first(tmp_path: Path) -> None:
    text = MINI.replace('arms = ["straight", "resumed"]', 'arms = ["resumed", "straight"]')
    assert suite_error(tmp_path, text) == (
        'FILE: checks.0.arms.0: arm "resumed" resumes (resume_at): the first arm trains straight'
    )


def test_a_checkpoint_under_a_folder_others_could_write_is_not_read(saved: Path) -> None:
    """A folder above the checkpoint that others may write lets them swap the checkpoint for theirs:
    refused, naming that folder. With the sticky bit they cannot rename what is not theirs: loaded."""
    saved.chmod(0o777)
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(_trainer(), saved, 2)
    assert str(info.value) == (
        f"{saved}: mode 0777 is writable by others without the sticky bit: another user could swap in a"
        " checkpoint of theirs: not loaded"
    )
    saved.chmod(0o1777)
    assert checkpoint.load(_trainer(), saved, 2) == 2


def test_a_key_that_is_not_the_users_secret_signs_and_checks_no_checkpoint(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the user's own key nothing can be signed or verified: refused, naming the key file."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    key = tmp_path / "config" / "harness" / "trace-cache.key"
    key.parent.mkdir(parents=True)
    key.write_text("0" * 64)
    key.chmod(0o644)
    why = f"{key}: expected mode 0600 (no access for others), got 0644: no checkpoint can be"
    trainer = _trainer()
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.save(trainer, 3, tmp_path / "other")
    assert str(info.value) == f"{why} signed with it"
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(trainer, saved, 2)
    assert str(info.value) == f"{why} checked with it"


def _results(resumed_info: dict, straight_losses: list[float], resumed_losses: list[float]) -> dict[str, CheckResult]:
    """The resume check on synthetic records of MINI's two arms: name -> result."""

    def metrics(losses: list[float]) -> pd.DataFrame:
        steps = pd.Index(range(1, len(losses) + 1), name="step")
        return pd.DataFrame({"loss": losses, "grad_norm": [1.0] * len(losses)}, index=steps)

    with tempfile.TemporaryDirectory() as tmp:
        suite = suite_from(Path(tmp), MINI)
    records = {
        "straight": ArmRecords(metrics=metrics(straight_losses)),
        "resumed": ArmRecords(metrics=metrics(resumed_losses), facts=ArmFacts(**resumed_info)),
    }
    check = CheckSpec("resume", "straight vs resumed", ("straight", "resumed"), ("loss", "grad_norm"))
    return {r.name: r for r in judge_resume(check, suite, records)}


def _judged(resumed_info: dict, straight_losses: list[float], resumed_losses: list[float]) -> dict[str, str]:
    """The resume check on synthetic records of MINI's two arms: name -> status."""
    return {name: r.status for name, r in _results(resumed_info, straight_losses, resumed_losses).items()}


def test_the_resume_check_fails_an_arm_that_never_loaded_even_with_equal_numbers() -> None:
    """A resume that silently started over from the same seed would match bit for bit: not a pass."""
    assert _judged({"resumed_from": None}, [5.0] * 4, [5.0] * 4) == {"straight vs resumed: resumed": "fail"}
    assert _judged({}, [5.0] * 4, [5.0] * 4) == {"straight vs resumed: resumed": "fail"}


def test_the_resume_check_fails_on_no_steps_and_on_a_differing_step() -> None:
    assert _judged({"resumed_from": 2}, [5.0] * 4, [5.0] * 4)["straight vs resumed: loss"] == "pass"
    assert _judged({"resumed_from": 2}, [5.0] * 4, [5.0, 5.0, 5.1, 5.0])["straight vs resumed: loss"] == "fail"
    assert _judged({"resumed_from": 2}, [], [])["straight vs resumed: loss"] == "fail"


def test_the_resume_check_names_a_differing_value_before_the_steps_a_short_arm_lacks() -> None:
    """A pipeline whose checkpoint lost a pending forward makes one update fewer: it ends short, but
    the news is its first update that differs."""
    loss = _results({"resumed_from": 2}, [5.0] * 4, [5.0, 5.1, 5.0])["straight vs resumed: loss"]
    assert loss.status == "fail" and loss.first_divergent_step == 2, loss
    assert loss.detail.startswith("first divergence at step 2: ") and "stops at step 3 of 4" in loss.detail
    short = _results({"resumed_from": 2}, [5.0] * 4, [5.0] * 3)["straight vs resumed: loss"]
    assert short.status == "fail" and short.first_divergent_step == 4, short
