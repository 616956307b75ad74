"""Regression or flake: one case of each rule in harness/triage.py."""

from __future__ import annotations

import signal

import pytest

from harness.results import BAD_INPUT, REGRESSION
from harness.subject import load_subject
from harness.triage import INFRASTRUCTURE, REFUSED, Verdict, classify, exception_line

# The harness's own frames in a rank: the arm's steps, and a [debug] table's planted failure.
RANK = "/work/harness/harness/rank/train.py"
FAULTS = "/work/harness/harness/rank/faults.py"
SOURCE = load_subject("reference").source
SUBJECT_DIR = SOURCE[0]


def _traceback(*files: str, last: str) -> str:
    frames = "".join(f'  File "{f}", line 10, in fn\n    code()\n' for f in files)
    return f"Traceback (most recent call last):\n{frames}{last}\n"


def test_a_signal_is_infrastructure_and_an_oom_kill_is_named() -> None:
    assert classify(-signal.SIGSEGV, None).reason == "killed by SIGSEGV"
    assert classify(-signal.SIGKILL, None) == classify(-signal.SIGKILL, None, oom_kills_during=0)
    oom = classify(-signal.SIGKILL, None, oom_kills_during=1)
    assert oom.kind == INFRASTRUCTURE and "an OOM kill" in oom.reason


def test_a_shape_error_raised_through_the_reference_is_a_regression() -> None:
    text = _traceback(RANK, str(SUBJECT_DIR / "model.py"), "/site-packages/torch/nn/functional.py",
                      last="RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)")  # fmt: skip
    verdict = classify(1, text, subject_source=SOURCE)
    assert verdict.kind == REGRESSION and verdict.reason == "raised in the system under test (model.py)"


def test_an_internal_consistency_assertion_of_the_reference_is_a_regression() -> None:
    text = _traceback(
        RANK, str(SUBJECT_DIR / "versioned.py"), last="RuntimeError: replay of batch 2 diverged: loss 1 != 2"
    )
    assert classify(1, text, subject_source=SOURCE).kind == REGRESSION


@pytest.mark.parametrize(
    "last",
    [
        "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer",
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "OSError: [Errno 28] No space left on device: '/runs/parity/arms/eager/digests.jsonl'",
    ],
    ids=["peer-reset", "nccl", "oom", "full-disk"],
)
def test_flake_patterns_win_even_inside_the_reference(last: str) -> None:
    text = _traceback(RANK, str(SUBJECT_DIR / "ep" / "group.py"), "/torch/distributed/distributed_c10d.py", last=last)
    assert classify(1, text, subject_source=SOURCE).kind == INFRASTRUCTURE


def test_a_raise_outside_the_system_under_test_is_infrastructure() -> None:
    text = _traceback(RANK, FAULTS, last="RuntimeError: injected failure")
    assert classify(1, text, subject_source=SOURCE).reason == "raised outside the system under test"
    assert classify(13, None).reason == "exit code 13 without a traceback"


def test_exception_line_is_the_last_unindented_line() -> None:
    text = _traceback(RANK, last="ValueError: bad\n  note: indented")
    assert exception_line(text) == "ValueError: bad"


def test_the_system_under_test_is_the_code_its_subject_names() -> None:
    """The same traceback through the reference is a regression of the reference and infrastructure
    of another subject: a user's trainer is judged by its own code."""
    text = _traceback(RANK, str(SUBJECT_DIR / "model.py"), last="RuntimeError: shapes cannot be multiplied")
    assert classify(1, text, subject_source=SOURCE).kind == REGRESSION
    assert classify(1, text, subject_source=("/work/examples/tiny_dp.py",)).kind == INFRASTRUCTURE


def test_a_refused_checkpoint_is_bad_input_its_line_the_reason() -> None:
    """Even with "timed out" in its line, which would otherwise be a flake."""
    line = "/runs/r/arms/a/checkpoint/step-3/__1_0.distcp: missing: the index reads 9 bytes (timed out)"
    text = _traceback(RANK, str(SUBJECT_DIR.parent / "subject" / "reference" / "arm.py"), last=REFUSED + line)
    assert classify(1, text, subject_source=SOURCE) == Verdict(BAD_INPUT, line)
