"""The console while ranks run: live per-arm lines on a terminal, plain lines in logs and with --verbose."""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import pytest

from harness.progress import BlockProgress, Progress

_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_CLOCK = r"\d+:\d\d:\d\d"
# Variables by which rich (or a user) turns the live display off or forces it on (as conftest's TERMINAL_OVERRIDES).
_TERMINAL_OVERRIDES = ("TTY_INTERACTIVE", "TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR", "COLUMNS")


class _Terminal(io.StringIO):
    """A stream that says it is a terminal, and keeps what was drawn on it."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> _Terminal:
    """A terminal stream, in an environment that lets rich draw on it, 120 columns wide."""
    for name in _TERMINAL_OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "120")
    return _Terminal()


def _frame(drawn: str) -> list[str]:
    """The last frame of a live display, without colours and cursor moves: rich starts each redraw
    with a carriage return."""
    plain = _ESCAPES.sub("", drawn)
    return [line.rstrip() for line in plain.rsplit("\r", 1)[-1].splitlines() if line.strip()]


def _lines(drawn: str) -> list[str]:
    """Every line drawn, frame after frame, without colours: a cursor move or erase starts a line."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-ln-z]", "\n", drawn)
    text = re.sub(r"\x1b\[[0-9;]*m", "", text).replace("\r", "\n")
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def _append(path: Path, *records: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _metrics(run_dir: Path, *arms: str) -> dict[str, Path]:
    return {arm: run_dir / "arms" / arm / "metrics.jsonl" for arm in arms}


def _step(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "grad_norm": 0.5}


def test_plain_lines_follow_metrics_as_they_are_written(tmp_path: Path) -> None:
    stream = io.StringIO()
    progress = Progress(_metrics(tmp_path, "a"), steps=2, stream=stream)
    metrics = tmp_path / "arms" / "a" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    progress.tick()  # nothing written yet
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 1, "loss": 1.5, "grad_norm": 0.5}) + "\n" + '{"step": 2, "lo')
    progress.tick()  # the half-written line waits
    with metrics.open("a") as f:
        f.write('ss": 1.25, "grad_norm": 0.25}\n')
    progress.tick()
    progress.close()
    assert stream.getvalue().splitlines() == [
        "[arm a] step 1/2 loss=1.5 grad_norm=0.5",
        "[arm a] step 2/2 loss=1.25 grad_norm=0.25",
    ]


def test_verbose_prints_plain_step_lines_on_a_terminal_too(tmp_path: Path, terminal: _Terminal) -> None:
    progress = Progress(_metrics(tmp_path, "eager", "graph"), steps=2, stream=terminal, verbose=True)
    _append(tmp_path / "arms" / "eager" / "metrics.jsonl", _step(1, 2.5), _step(2, 2.25))
    progress.tick()
    _append(tmp_path / "arms" / "graph" / "metrics.jsonl", _step(1, 2.5))
    progress.tick()
    progress.close()
    assert terminal.getvalue().splitlines() == [
        "[arm eager] step 1/2 loss=2.5 grad_norm=0.5",
        "[arm eager] step 2/2 loss=2.25 grad_norm=0.5",
        "[arm graph] step 1/2 loss=2.5 grad_norm=0.5",
    ]


def test_terminal_shows_one_live_line_per_arm_from_start_up_to_the_end(tmp_path: Path, terminal: _Terminal) -> None:
    arms = ["eager", "graph", "stale"]
    progress = Progress(_metrics(tmp_path, *arms), steps=4, stream=terminal)
    first = _frame(terminal.getvalue())
    assert re.fullmatch(rf"eager +━+ step 0/4 +{_CLOCK} starting ranks", first[0]), first
    assert [line.split()[-1] for line in first[1:]] == ["waiting", "waiting"]

    eager = tmp_path / "arms" / "eager" / "metrics.jsonl"
    _append(eager)  # rank 0 opened the file: the arm builds its trainer
    progress.tick()
    assert _frame(terminal.getvalue())[0].endswith("building")
    for step in range(1, 5):
        _append(eager, _step(step, 2.5 - step / 10))
        time.sleep(0.05)
        progress.tick()
    assert _frame(terminal.getvalue())[1].endswith("starting ranks")  # the next arm, while none runs
    graph = tmp_path / "arms" / "graph" / "metrics.jsonl"
    for step in (1, 2):
        _append(graph, _step(step, 2.5 - step / 10))
        time.sleep(0.1)
        progress.tick()
    running = _frame(terminal.getvalue())
    assert re.fullmatch(rf"graph +━+╺?━* step 2/4 loss=2.3000 {_CLOCK} eta {_CLOCK}", running[1]), running
    assert running[2].endswith("waiting")

    progress.close()  # graph stopped short, stale never began: so the last frame says
    last = _frame(terminal.getvalue())
    assert len(last) == 3, last
    assert re.fullmatch(rf"eager +━+ step 4/4 loss=2.1000 {_CLOCK} done", last[0]), last
    assert re.fullmatch(rf"graph +━+╺?━* step 2/4 loss=2.3000 {_CLOCK} stopped", last[1]), last
    assert re.fullmatch(r"stale +━+ step 0/4 +not run", last[2]), last
    assert "[arm" not in terminal.getvalue()  # no per-step lines beside the display


def _measurement(series: str, block: int, position: int, role: str, arm: str, step_time_s: float) -> dict:
    return {
        "series": series, "block": block, "position": position, "role": role, "arm": arm, "steps": 5,
        "first_step": 3, "seconds": 5 * step_time_s, "step_time_s": step_time_s, "tokens_per_s": 1000.0,
        "peak_memory_bytes": 1 << 20,
    }  # fmt: skip


def _abba_block(series: str, block: int, a: str, b: str, a_s: float, b_s: float) -> list[dict]:
    roles = [("A", a, a_s), ("B", b, b_s), ("B", b, b_s), ("A", a, a_s)]
    return [_measurement(series, block, pos, role, arm, s) for pos, (role, arm, s) in enumerate(roles)]


def test_block_progress_shows_each_arm_block_step_times_and_eta(tmp_path: Path, terminal: _Terminal) -> None:
    arms = {"A": "eager", "B": "graph", "control": "eager"}
    progress = BlockProgress(tmp_path / "throughput.jsonl", arms, blocks=2, stream=terminal)
    first = _frame(terminal.getvalue())
    assert [line.split()[:2] for line in first] == [["A", "eager"], ["B", "graph"], ["control", "eager"]]
    assert all(re.search(rf"block 0/2 +{_CLOCK} starting ranks$", line) for line in first), first

    throughput = tmp_path / "throughput.jsonl"
    for measurement in _abba_block("main", 1, "eager", "graph", 0.08, 0.1):
        _append(throughput, measurement)
        time.sleep(0.05)
        progress.tick()
    running = _frame(terminal.getvalue())
    assert re.search(rf"block 1/2 last 0.0800s median 0.0800s per step {_CLOCK} eta {_CLOCK}$", running[0]), running
    assert re.search(rf"block 1/2 last 0.1000s median 0.1000s per step {_CLOCK} eta {_CLOCK}$", running[1]), running

    _append(
        throughput,
        *_abba_block("main", 2, "eager", "graph", 0.1, 0.1),
        *_abba_block("control", 1, "eager", "eager", 0.09, 0.07),
    )
    progress.tick()
    progress.close()
    last = _frame(terminal.getvalue())
    assert re.fullmatch(rf"A eager +━+ block 2/2 last 0.1000s median 0.0900s per step {_CLOCK} done", last[0]), last
    assert re.fullmatch(rf"B graph +━+ block 2/2 last 0.1000s median 0.1000s per step {_CLOCK} done", last[1]), last
    assert re.fullmatch(
        rf"control eager +━+╺?━* block 1/2 last 0.0900s median 0.0800s per step {_CLOCK} stopped", last[2]
    ), last


def test_block_progress_prints_one_plain_line_per_measurement_off_a_terminal(tmp_path: Path) -> None:
    stream = io.StringIO()
    progress = BlockProgress(tmp_path / "throughput.jsonl", {"A": "eager", "B": "graph"}, blocks=3, stream=stream)
    _append(tmp_path / "throughput.jsonl", *_abba_block("main", 1, "eager", "graph", 0.08, 0.1)[:2])
    progress.tick()
    progress.close()
    assert stream.getvalue().splitlines() == [
        "[main A eager] block 1/3 position 0 step_time_s=0.08 tokens_per_s=1000.0",
        "[main B graph] block 1/3 position 1 step_time_s=0.1 tokens_per_s=1000.0",
    ]


@pytest.mark.parametrize("verbose", [False, True], ids=["live", "verbose"])
def test_run_on_a_terminal_draws_live_lines_unless_verbose(run_in_terminal, tmp_path: Path, verbose: bool) -> None:
    """logical-ranks has two launch groups (2 processes, then 1): the second arm waits, then starts."""
    args = ["run", "logical-ranks", "--steps", "2", "--golden", "off", "--out", str(tmp_path / "run")]
    code, drawn = run_in_terminal(args + (["--verbose"] if verbose else []))
    text = "\n".join(_lines(drawn))
    assert code == 0, text
    plain = [line for line in text.splitlines() if line.startswith("[arm ")]
    if verbose:
        assert [re.sub(r" loss=.*", "", line) for line in plain] == [
            "[arm procs] step 1/2",
            "[arm procs] step 2/2",
            "[arm inproc] step 1/2",
            "[arm inproc] step 2/2",
        ]
        assert "starting ranks" not in text
    else:
        assert plain == []
        for arm in ("procs", "inproc"):
            assert re.search(rf"^{arm} +━+ step 0/2 +{_CLOCK} starting ranks$", text, re.MULTILINE), text
            assert re.search(rf"^{arm} +━+ step 2/2 loss=\d+\.\d{{4}} {_CLOCK} done$", text, re.MULTILINE), text
        assert re.search(r"^inproc +━+ step 0/2 +waiting$", text, re.MULTILINE), text
    assert "logical-ranks: PASS (exit 0)" in text
