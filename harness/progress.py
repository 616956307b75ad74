"""The console while ranks run: progress read from the records they stream.

``Progress`` follows each arm's ``metrics.jsonl`` (one line per step), ``BlockProgress`` the
run's ``throughput.jsonl`` (one line per ABBA block position); the caller names the files. Both
are driven by ``tick()`` from the launcher's watchdog thread and ended by ``close()``.

On an interactive terminal they draw one live line per arm with rich: a bar, the step (or
block) counter, the latest loss (or step times), the elapsed time and the ETA. An arm that has
not begun shows as waiting; the arm about to begin shows "starting ranks" while nothing else
runs (ranks import and build for long stretches), then "building" until its first step lands.
The final state stays on screen. Elsewhere (CI logs) and with ``verbose`` every record is one
plain line, so a log reads step by step.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    ProgressBar,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.text import Text

# A line's state, and how it reads where no ETA shows. "running" shows the ETA instead.
_STATE_LABELS = {
    "waiting": ("waiting", "dim"),
    "starting": ("starting ranks", "yellow"),
    "building": ("building", "yellow"),
    "done": ("done", "green"),
    "stopped": ("stopped", "red"),
    "not run": ("not run", "dim"),
}
_BUSY_WITHOUT_PROGRESS = ("starting", "building")  # the bar pulses: work goes on, nothing counted yet


class _JsonlTail:
    """The complete lines another process has appended to a JSONL file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def exists(self) -> bool:
        return self.path.exists()

    def read_new(self) -> list[dict]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next tick
        self._offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


class _StateOrEta(ProgressColumn):
    """The ETA of a running line, else the word for its state."""

    def __init__(self) -> None:
        super().__init__()
        self._eta = TimeRemainingColumn()

    def render(self, task: Task) -> Text:
        state = task.fields["state"]
        if state == "running":
            return Text("eta ", style="progress.remaining") + self._eta.render(task)
        label, style = _STATE_LABELS[state]
        return Text(label, style=style)


class _Elapsed(TimeElapsedColumn):
    """Elapsed time, blank for a line that has not begun."""

    def render(self, task: Task) -> Text:
        return super().render(task) if task.started else Text("")


class _Bar(BarColumn):
    """A bar that pulses while its line is busy but has nothing counted yet, and stays still while waiting."""

    def render(self, task: Task) -> ProgressBar:
        return ProgressBar(
            total=task.total,
            completed=task.completed,
            width=self.bar_width,
            pulse=task.fields["state"] in _BUSY_WITHOUT_PROGRESS,
            animation_time=task.get_time(),
            style=self.style,
            complete_style=self.complete_style,
            finished_style=self.finished_style,
            pulse_style=self.pulse_style,
        )


def _live_console(stream: TextIO, verbose: bool) -> Console | None:
    """A rich console on ``stream`` when it is an interactive terminal and plain lines were not asked
    for; rich's own checks (TERM=dumb, TTY_INTERACTIVE=0) can still turn the live display off."""
    if verbose or not stream.isatty():
        return None
    console = Console(file=stream)
    return console if console.is_interactive else None


class _LiveLines:
    """One rich line per name, drawn on ``refresh()``; ``close()`` leaves the last frame on screen."""

    def __init__(self, console: Console, names: list[str], total: int) -> None:
        # prints to the process's stdout and stderr land above the display instead of through it
        redirect = console.file in (sys.stdout, sys.__stdout__)
        self._progress = RichProgress(
            TextColumn("[bold]{task.description}"),
            _Bar(bar_width=24),
            TextColumn("{task.fields[counter]}"),
            TextColumn("{task.fields[detail]}"),
            _Elapsed(),
            _StateOrEta(),
            console=console,
            auto_refresh=False,
            redirect_stdout=redirect,
            redirect_stderr=redirect,
        )
        self._tasks = {
            name: self._progress.add_task(name, total=total, start=False, state="waiting", counter="", detail="")
            for name in names
        }

    def state(self, name: str) -> str:
        return self._progress.tasks[self._tasks[name]].fields["state"]

    def update(self, name: str, state: str, **fields: object) -> None:
        """Sets a line's state and fields (completed, counter, detail); its clock starts when it leaves
        "waiting" and stops when it is stopped."""
        task = self._tasks[name]
        if state not in ("waiting", "not run") and not self._progress.tasks[task].started:
            self._progress.start_task(task)
        if state == "stopped":
            self._progress.stop_task(task)
        self._progress.update(task, state=state, **fields)

    def refresh(self) -> None:
        """Draws the lines; the first call starts the display, so its first frame already shows each state."""
        if self._progress.live.is_started:
            self._progress.refresh()
        else:
            self._progress.start()

    def close(self) -> None:
        self._progress.stop()


class Progress:
    """Per-arm "step k/N" and loss, read from the metrics.jsonl the ranks stream.

    ``metrics`` maps each arm to its metrics.jsonl, in the order the arms run (launch group by
    launch group), so the next to run is known.
    """

    def __init__(
        self, metrics: dict[str, Path], steps: int, stream: TextIO = sys.stdout, verbose: bool = False
    ) -> None:
        arms = list(metrics)
        self.arms, self.steps, self.stream = arms, steps, stream
        self._metrics = {arm: _JsonlTail(path) for arm, path in metrics.items()}
        self._done = dict.fromkeys(arms, 0)
        self._latest: dict[str, dict] = {}  # each arm's last metrics record
        console = _live_console(stream, verbose)
        self._live = _LiveLines(console, arms, steps) if console else None
        self._closed = False
        if self._live:
            self._update_states()
            self._live.refresh()

    def tick(self) -> None:
        if self._closed:
            return
        for arm in self.arms:
            for record in self._metrics[arm].read_new():
                self._done[arm] = int(record.get("step", self._done[arm] + 1))
                self._latest[arm] = record
                if not self._live:
                    print(_step_line(arm, self._done[arm], self.steps, record), file=self.stream, flush=True)
        if self._live:
            self._update_states()
            self._live.refresh()

    def _update_states(self) -> None:
        busy = False
        for arm in self.arms:
            done = self._done[arm]
            if done >= self.steps:
                state = "done"
            elif done > 0:
                state = "running"
            elif self._metrics[arm].exists():  # rank 0 opened it: the arm is building its trainer
                state = "building"
            else:  # the first arm with no file, while no other arm runs, is the one the ranks start up for
                state = "waiting" if busy else "starting"
            busy = busy or state != "done"
            detail = _loss(self._latest.get(arm, {}))
            self._live.update(arm, state, completed=done, counter=f"step {done}/{self.steps}", detail=detail)

    def close(self) -> None:
        """Leaves the last state on screen: an arm cut short reads "stopped", one never begun "not run"."""
        if self._closed:
            return
        self._closed = True
        if not self._live:
            return
        for arm in self.arms:
            state = self._live.state(arm)
            if state in ("waiting", "starting"):
                self._live.update(arm, "not run")
            elif state != "done":
                self._live.update(arm, "stopped")
        self._live.close()


def _step_line(arm: str, step: int, steps: int, record: dict) -> str:
    return f"[arm {arm}] step {step}/{steps} loss={record.get('loss')} grad_norm={record.get('grad_norm')}"


def _loss(record: dict) -> str:
    loss = record.get("loss")
    return f"loss={loss:.4f}" if isinstance(loss, (int, float)) else ""


class BlockProgress:
    """Per-arm "block k/K" of an ABBA measurement, with the last and median step time, read from
    the throughput.jsonl that process rank 0 streams (one line per block position).

    ``arms`` maps a role to its arm: "A" and "B" (the main series), and "control" when the A/A
    control runs (its lines are series "control", both of its roles on the one line);
    ``throughput`` is the run's throughput.jsonl; ``blocks`` the most it may measure, and with
    ``adaptive`` ("auto") it may stop before: the counter reads "block k/≤K".
    """

    def __init__(
        self,
        throughput: Path,
        arms: dict[str, str],
        blocks: int,
        stream: TextIO = sys.stdout,
        verbose: bool = False,
        adaptive: bool = False,
    ) -> None:
        self.arms, self.blocks, self.stream = arms, blocks, stream
        self._of = f"≤{blocks}" if adaptive else str(blocks)
        self._throughput = _JsonlTail(throughput)
        self._step_times: dict[str, list[float]] = {role: [] for role in arms}
        self._last_block = dict.fromkeys(arms, 0)
        console = _live_console(stream, verbose)
        self._live = _LiveLines(console, [self._label(role) for role in arms], blocks) if console else None
        self._closed = False
        if self._live:
            for role in arms:  # every arm's ranks start together, and measure in turn
                self._live.update(self._label(role), "starting", total=self._total(role), counter=f"block 0/{self._of}")
            self._live.refresh()

    def _label(self, role: str) -> str:
        return f"{role} {self.arms[role]}"

    def _total(self, role: str) -> int:
        """Measurements of one line: each block holds A twice and B twice (A B B A), the control both."""
        return self.blocks * (4 if role == "control" else 2)

    def tick(self) -> None:
        if self._closed:
            return
        for record in self._throughput.read_new():
            role = "control" if record.get("series") == "control" else record.get("role")
            if role not in self.arms:
                continue
            self._step_times[role].append(record["step_time_s"])
            self._last_block[role] = int(record.get("block", self._last_block[role]))
            if self._live:
                self._show(role)
            else:
                print(_measurement_line(record, self._of), file=self.stream, flush=True)
        if self._live:
            self._live.refresh()

    def _show(self, role: str) -> None:
        times = self._step_times[role]
        self._live.update(
            self._label(role),
            "done" if len(times) >= self._total(role) else "running",
            completed=len(times),
            counter=f"block {self._last_block[role]}/{self._of}",
            detail=f"last {times[-1]:.4f}s median {statistics.median(times):.4f}s per step",
        )

    def close(self) -> None:
        """Leaves the last state on screen; a line short of its blocks reads "stopped"."""
        if self._closed:
            return
        self._closed = True
        if not self._live:
            return
        for role in self.arms:
            if len(self._step_times[role]) < self._total(role):
                self._live.update(self._label(role), "stopped")
        self._live.close()


def _measurement_line(record: dict, blocks: str) -> str:
    where = f"[{record.get('series')} {record.get('role')} {record.get('arm')}]"
    block = f"block {record.get('block')}/{blocks} position {record.get('position')}"
    times = f"step_time_s={record.get('step_time_s')} tokens_per_s={record.get('tokens_per_s')}"
    return f"{where} {block} {times}"
