"""On-disk records: JSON-lines streams that survive a crash, read back typed.

Ranks stream metrics and events one JSON object per line and flush every line, so a rank that
dies leaves every finished line readable. Floats go through json's float repr, which round-trips
a double bit-for-bit; exact comparisons depend on that. NaN and Infinity use json's tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from harness.families import ArmFacts
from harness.files import naming_file
from harness.rundir import arm_files

if TYPE_CHECKING:
    import pandas as pd

METRIC_COLUMNS = ("loss", "grad_norm", "tokens", "step_time_s")


class RecordError(Exception):
    """A record file that cannot be read; the message names the file and, if known, the line."""

    def __init__(self, path: Path | str, line_no: int | None, msg: str) -> None:
        self.path, self.line_no, self.msg = Path(path), line_no, msg
        where = f"{self.path}:{line_no}" if line_no is not None else f"{self.path}"
        super().__init__(f"{where}: {msg}")


class JsonlWriter:
    """Appends one JSON object per line and flushes each, so a crash loses at most the line being written."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        # One write call per line: a crash can only truncate the final line, never interleave.
        with naming_file(self.path):
            self._file.write(json.dumps(record, allow_nan=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        with naming_file(self.path):
            self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_jsonl(path: Path) -> list[dict]:
    """Reads a JSON-lines file written by JsonlWriter.

    A final line without its newline that does not parse is the trace of a crash mid-write and is
    dropped; a bad line anywhere else means the file is corrupt and raises RecordError.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(path, None, f"cannot read: {e}") from e
    lines = text.split("\n")
    records = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if line_no == len(lines):  # last piece has no trailing newline: truncated by a crash
                break
            raise RecordError(path, line_no, f"invalid JSON: {e.msg} (column {e.colno})") from e
        if not isinstance(record, dict):
            raise RecordError(path, line_no, f"expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def read_metrics(path: Path) -> pd.DataFrame:
    """Reads an arm's metrics.jsonl into a DataFrame indexed by integer step, one row per step."""
    return read_metrics_records(read_jsonl(path), path)


def read_metrics_records(records: list[dict], path: Path | str) -> pd.DataFrame:
    """read_metrics on records already read; ``path`` names them in errors."""
    import pandas as pd  # here, not at the top: rank processes write records and never pay for pandas

    for number, record in enumerate(records, start=1):
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise RecordError(path, None, f"record {number} has no integer 'step' (got {step!r})")
    frame = pd.DataFrame.from_records(records) if records else pd.DataFrame({"step": []}, dtype="int64")
    frame = frame.set_index("step").sort_index()
    duplicated = frame.index[frame.index.duplicated()].unique().tolist()
    if duplicated:
        raise RecordError(path, None, f"step(s) {duplicated} recorded more than once")
    known = [c for c in METRIC_COLUMNS if c in frame.columns]
    return frame[known + [c for c in frame.columns if c not in METRIC_COLUMNS]]


@dataclass(frozen=True)
class RankLine:
    """One logical rank's own view of one update, a line of ``ranks.rank<k>.jsonl``: the step's
    global loss and grad norm as that rank has them, and, every few steps and at the last, a hash of
    its replicated parameters (harness.digests). An arm that records its gradient sum (a bf16-mixed
    one) adds, every step, a hash of its replicated gradients as summed and of their fp32 re-sum."""

    step: int
    loss: float
    grad_norm: float
    replicated_hash: str | None = None
    grad_sum_hash: str | None = None
    grad_fp32_resum_hash: str | None = None

    def to_json(self) -> dict[str, Any]:
        line: dict[str, Any] = {"step": self.step, "loss": self.loss, "grad_norm": self.grad_norm}
        return line | {key: getattr(self, key) for key in HASHES if getattr(self, key) is not None}

    @classmethod
    def from_json(cls, raw: dict, path: Path, number: int) -> RankLine:
        _require(raw, {"step": int, "loss": (int, float), "grad_norm": (int, float)}, path, number)
        for key in HASHES:
            hashed = raw.get(key)
            if hashed is not None and not isinstance(hashed, str):
                raise RecordError(path, None, f"record {number}: {key} is {hashed!r}, not a string")
        return cls(raw["step"], float(raw["loss"]), float(raw["grad_norm"]), *(raw.get(key) for key in HASHES))


# RankLine's optional hashes, in field order.
HASHES = ("replicated_hash", "grad_sum_hash", "grad_fp32_resum_hash")


@dataclass(frozen=True)
class DigestLine:
    """Logical rank 0's digests of one update, a line of ``digests.jsonl``: each gradient (reduced,
    before clipping) and each parameter after the update, ``{name: [hash, max abs, L2]}`` in
    registration order (harness.digests)."""

    step: int
    grads: dict[str, list]
    params: dict[str, list]

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "grads": self.grads, "params": self.params}

    @classmethod
    def from_json(cls, raw: dict, path: Path, number: int) -> DigestLine:
        _require(raw, {"step": int, "grads": dict, "params": dict}, path, number)
        return cls(raw["step"], raw["grads"], raw["params"])


def _require(raw: dict, fields: dict[str, type | tuple[type, ...]], path: Path, number: int) -> None:
    """Each field present with its type (a bool is no int), or RecordError naming the record."""
    for name, kind in fields.items():
        value = raw.get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, kind):
            raise RecordError(path, None, f"record {number}: {name} is {value!r}")


def _typed_lines(path: Path, line: type[RankLine] | type[DigestLine]) -> list:
    return [line.from_json(raw, path, n) for n, raw in enumerate(_read_if_there(path), start=1)]


@dataclass
class ArmRecords:
    """What one arm left in the run directory, read back for the checks; partial when it crashed."""

    metrics: pd.DataFrame = field(default_factory=lambda: read_metrics_records([], "<none>"))
    updates: list[dict] = field(default_factory=list)  # metrics.jsonl as written: null and NaN kept apart
    events: dict[int, list[dict]] = field(default_factory=dict)  # logical rank -> token-exchange events
    ranks: dict[int, list[RankLine]] = field(default_factory=dict)  # logical rank -> its loss, grad norm, hashes
    digests: list[DigestLine] = field(default_factory=list)  # logical rank 0's gradient and parameter digests
    facts: ArmFacts | None = None  # arm.json's facts (ArmFacts: declared, and the built arm's); None: no arm.json
    graph: dict | None = None  # graph.json of a traced arm: its scheduled exchange ops; None if absent
    cpu_capability: str | None = None  # the ISA ATen dispatched to in the arm's ranks
    final_weights: dict[int, dict] = field(default_factory=dict)  # logical rank -> digests after the last update
    fidelity: list[dict] = field(default_factory=list)  # an oracle arm's fidelity.jsonl, one line per step
    pec: dict[int, list[dict]] = field(default_factory=dict)  # logical rank -> a PEC arm's gradient all-to-all events
    error: str | None = None  # unreadable records

    def steps_done(self) -> int:
        return len(self.metrics)


def _read_if_there(path: Path) -> list[dict]:
    return read_jsonl(path) if path.is_file() else []


def read_arm(run_dir: Path, arm: str, logical_ranks: int) -> ArmRecords:
    """Reads ``arms/<arm>/``; a missing file reads as empty, an unreadable one sets ``error``."""
    files = arm_files(run_dir, arm)
    records = ArmRecords()
    try:
        if files.metrics.is_file():
            records.updates = read_jsonl(files.metrics)
            records.metrics = read_metrics_records(records.updates, files.metrics)
        if files.arm.is_file():
            arm_info = json.loads(files.arm.read_text())
            records.facts = ArmFacts.from_json(arm_info.get("facts", {}))
            records.cpu_capability = arm_info.get("cpu_capability")
        if files.graph.is_file():
            records.graph = json.loads(files.graph.read_text())
        if files.fidelity.is_file():
            records.fidelity = read_jsonl(files.fidelity)
        for logical_rank in range(logical_ranks):
            records.events[logical_rank] = _read_if_there(files.events(logical_rank))
            records.ranks[logical_rank] = _typed_lines(files.ranks(logical_rank), RankLine)
            records.pec[logical_rank] = _read_if_there(files.pec(logical_rank))
            weights = files.weights(logical_rank)
            if weights.is_file():
                records.final_weights[logical_rank] = json.loads(weights.read_text())
        records.digests = _typed_lines(files.digests, DigestLine)
    except (RecordError, OSError, ValueError) as e:
        records.error = f"unreadable records of arm '{arm}': {e}"
    return records


@dataclass
class RunRecords(Mapping[str, ArmRecords]):
    """What a run left for its judge: each arm's records, by name (this is a mapping of them), and
    the run's own: a throughput run's block rows (``throughput.jsonl``) or why they cannot be read."""

    arms: dict[str, ArmRecords] = field(default_factory=dict)
    throughput: list[dict] = field(default_factory=list)
    throughput_error: str | None = None

    def __getitem__(self, arm: str) -> ArmRecords:
        return self.arms[arm]

    def __iter__(self) -> Iterator[str]:
        return iter(self.arms)

    def __len__(self) -> int:
        return len(self.arms)
