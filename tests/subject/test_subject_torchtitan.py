"""torchtitan as the system under test (`subject = "torchtitan"`): its suites pass on 2 gloo ranks
with its own trainer and expert parallelism, their checks fail on bugs planted in it, in either
mode (torchtitan's Trainer, or its model in the harness's loop), and what it cannot run is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from suite_files import refused_without, suite_error

from harness.records import read_jsonl


def _checks(run, out: Path) -> dict[str, dict]:
    return {c["name"]: c for c in run.summary(out)["checks"]}


def test_determinism_passes_with_torchtitans_expert_parallelism(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "torchtitan-determinism", "--ranks", 2, "--out", out, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    checks = _checks(run, out)
    assert all(c["status"] == "pass" for name, c in checks.items() if name != "golden"), checks
    assert checks["run vs run-again: events"]["detail"].startswith("40 events identical")
    # A forward dispatch and combine per MoE layer (2) and step (5), on each rank, with real counts.
    for rank in (0, 1):
        launches = read_jsonl(out / "arms" / "run" / f"events.rank{rank}.jsonl")
        assert [(e["step"], e["layer"], e["name"]) for e in launches] == [
            (step, layer, name) for step in range(1, 6) for layer in (1, 2) for name in ("dispatch", "combine")
        ]
        assert all(sum(e["send_counts"]) == 4 * 32 * 3 for e in launches if e["name"] == "dispatch")
    metrics = read_jsonl(out / "arms" / "run" / "metrics.jsonl")
    assert [m["tokens"] for m in metrics] == [2 * 4 * 32] * 5
    assert metrics[0]["loss"] != metrics[-1]["loss"]  # it trains


# A bug in the change under test: the fp32 experts add the up projection instead of gating by it.
EXPERTS_UNGATED = """
import torch
import torch.nn.functional as F

import harness.oracles.torchtitan as titan


def experts(self, x, counts):
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)

    def mm(a, w):
        w = w.to_local() if hasattr(w, "to_local") else w
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)

    return mm(F.silu(mm(x, self.w1_EFD)) + mm(x, self.w3_EFD), self.w2_EDF)


titan._fp32_experts = experts
"""


def test_the_pair_passes_and_fails_on_a_bug_in_the_change(run_harness, plant, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "torchtitan-pair", "--ranks", 2, "--steps", 4, "--out", out, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    out = tmp_path / "with-the-bug"
    planted = ("--ranks", 2, "--steps", 2, "--out", out)
    run = run_harness("run", "torchtitan-pair", *planted, env=plant(EXPERTS_UNGATED), timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr
    loss = _checks(run, out)["shipped vs fp32-experts: loss"]
    assert loss["status"] == "fail" and loss["first_divergent_step"] == 1, loss


# The model mode: rank 1 leaves one dense gradient unsummed: its replica drifts from rank 0's.
UNSUMMED_ON_RANK_1 = """
import types

import torch.distributed as dist

import harness.subject.torchtitan as subject

calls = []


def all_reduce(tensor, *args, **kwargs):
    calls.append(1)
    if dist.get_rank() == 1 and len(calls) % 40 == 5:
        return dist.all_reduce(tensor.clone(), *args, **kwargs)  # the collective still runs
    return dist.all_reduce(tensor, *args, **kwargs)


subject.dist = types.SimpleNamespace(all_reduce=all_reduce, get_rank=dist.get_rank, get_world_size=dist.get_world_size)
"""


# torchtitan's trainer: rank 1's MoE load-balancing hook leaves its expert counts unsummed over the
# ranks, so its expert biases, which every rank must hold alike, part from rank 0's.
UNBALANCED_ON_RANK_1 = """
import types

import torch
import torch.distributed as dist
import torchtitan.components.optimizer.optimizer as optimizer


def all_reduce(tensor, *args, **kwargs):
    if dist.get_rank() == 1:
        return dist.all_reduce(tensor.clone(), *args, **kwargs)  # the collective still runs
    return dist.all_reduce(tensor, *args, **kwargs)


distributed = types.SimpleNamespace(**{**vars(dist), "all_reduce": all_reduce})
optimizer.torch = types.SimpleNamespace(**{**vars(torch), "distributed": distributed})
"""


@pytest.mark.parametrize(
    ("mode", "bug"), [("torchtitan", UNBALANCED_ON_RANK_1), ("model", UNSUMMED_ON_RANK_1)], ids=["trainer", "model"]
)
def test_ranks_agree_fails_when_one_rank_skips_a_sum(run_harness, plant, tmp_path: Path, mode: str, bug: str) -> None:
    out = tmp_path / "run"
    args = ("--ranks", 2, "--steps", 2, "--set", f"trainer={mode}", "--out", out)
    run = run_harness("run", "torchtitan-determinism", *args, env=plant(bug), timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr
    agree = _checks(run, out)["run: ranks-agree"]
    assert agree["status"] == "fail" and "logical rank 1" in agree["detail"], agree


SUITE = """
name = "mini"
description = "a torchtitan subject"
subject = "torchtitan"
ranks = 2
steps = 2
[train]
model = "cpu-tiny"
[arms.a]
"""


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "[arms.a]",
            '[arms.a]\nexperts = "fp16"',
            "FILE: arms.a.experts: experts must be one of ('bf16', 'fp32'), got",
        ),
        ('model = "cpu-tiny"', 'model = "cpu-huge"', "FILE: train.model: model must be one of ['cpu-tiny',"),
        ("[arms.a]", "[arms.a]\nchunks = 2", "FILE: arms.a.chunks: unknown key (allowed: ranks, trainer, model,"),
        ("[arms.a]", "[arms.a]\nep = 3", "FILE: arms.a.ep: 3 does not divide the arm's 2 ranks"),
        (
            "[arms.a]",
            '[arms.a]\nmoe_comm_backend = "deepep"',
            "FILE: arms.a.moe_comm_backend: deepep runs on CUDA only; on cpu, standard",
        ),
        (
            "[arms.a]",
            '[arms.a]\nmoe_comm_backend = "nvshmem"',
            "FILE: arms.a.moe_comm_backend: moe_comm_backend must be one of ('standard', 'deepep',",
        ),
        (
            "[arms.a]",
            '[arms.a]\nep = 1\n[[checks]]\nkind = "routing-counts"',
            'FILE: checks.0: routing-counts reads token-exchange records, which arm "a" of subject "torchtitan" does'
            " not emit",
        ),
        ("[arms.a]", '[arms.a]\ntrainer = "model"\nep = 2', "FILE: arms.a.ep: ep is torchtitan's trainer's"),
    ],
    ids=[
        "experts",
        "model",
        "unknown-field",
        "ep",
        "backend-on-cpu",
        "backend",
        "no-exchanges-at-ep-1",
        "ep-in-model-mode",
    ],
)
def test_bad_arms_are_refused_naming_the_field(tmp_path: Path, old: str, new: str, expected: str) -> None:
    message = suite_error(tmp_path, SUITE.replace(old, new))
    assert message.startswith(expected), message


def test_without_torchtitan_the_subject_is_refused_with_the_install_line(harness_main, tmp_path: Path) -> None:
    assert refused_without(harness_main, tmp_path, "torchtitan", "torchtitan-determinism") == (
        "error: suites/torchtitan-determinism.toml: subject: needs torchtitan, which is not installed:"
        " pip install -c constraints.txt 'harness[torchtitan]'\n"
    )
