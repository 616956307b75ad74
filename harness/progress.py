"""Per-arm "step k/N" on the console while the ranks run, read from the metrics they stream."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO


class Progress:
    """Per-arm "step k/N", read from the metrics.jsonl the ranks stream.

    On a terminal one line per arm is redrawn in place; otherwise each step is a plain line.
    """

    def __init__(self, run_dir: Path, arms: list[str], steps: int, stream: TextIO = sys.stdout) -> None:
        self.run_dir, self.arms, self.steps, self.stream = run_dir, arms, steps, stream
        self.tty = stream.isatty()
        self._offsets = dict.fromkeys(arms, 0)
        self._done: dict[str, int] = dict.fromkeys(arms, 0)
        self._open_line = False

    def tick(self) -> None:
        for arm in self.arms:
            for record in self._new_records(arm):
                self._done[arm] = int(record.get("step", self._done[arm] + 1))
                self._show(arm, record)

    def _new_records(self, arm: str) -> list[dict]:
        path = self.run_dir / "arms" / arm / "metrics.jsonl"
        try:
            with path.open("rb") as f:
                f.seek(self._offsets[arm])
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next tick
        self._offsets[arm] += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def _show(self, arm: str, record: dict) -> None:
        step = f"[arm {arm}] step {self._done[arm]}/{self.steps}"
        line = f"{step} loss={record.get('loss')} grad_norm={record.get('grad_norm')}"
        if not self.tty:
            print(line, file=self.stream, flush=True)
            return
        finished = self._done[arm] >= self.steps
        self.stream.write("\r\033[K" + line + ("\n" if finished else ""))
        self.stream.flush()
        self._open_line = not finished

    def close(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False
