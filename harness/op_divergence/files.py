"""A rank's op records on disk: what an op-recording re-run writes (harness/rank/train.py) and the
harness reads back (harness/first_op.py).

``ops.rank<k>.jsonl`` is written whole once the rank's recording ends, atomically, so a rank
killed before then leaves no file, never a short one: a header line ``{"arm", "rank", "steps",
"ops", "refused"}``, then one :meth:`OpRecord.describe` per op in execution order. ``refused`` is
the one line of a rank whose arm cannot be recorded, and then no op follows.

``captured.rank<k>.npz`` holds the outputs of the one op a capture pass kept, in order, bit for
bit: as numpy arrays, and a dtype numpy lacks (bf16) as the integers of its bits, with each
output's torch dtype beside it. It is read back with ``allow_pickle=False``: nothing read here is
ever unpickled or executed.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from harness.files import write_bytes_atomic, write_text_atomic
from harness.op_divergence.record import OpRecord
from harness.records import RecordError, read_jsonl

_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class OpFile:
    """One rank's recording of one arm: its ops, or why it could not record them."""

    arm: str
    rank: int
    refused: str | None
    records: list[OpRecord]


def write_ops(path: Path, arm: str, rank: int, steps: int, records: list[OpRecord], refused: str | None = None) -> None:
    header = {"arm": arm, "rank": rank, "steps": steps, "ops": len(records), "refused": refused}
    lines = [json.dumps(header), *(json.dumps(r.describe(), allow_nan=False) for r in records)]
    write_text_atomic(path, "\n".join(lines) + "\n")


def read_ops(path: Path) -> OpFile:
    """A rank's op file; RecordError naming the file when it is missing, short or not one."""
    if not path.is_file():
        raise RecordError(path, None, "missing: the rank wrote no op records")
    header, *lines = read_jsonl(path) or [{}]
    if not {"arm", "rank", "ops", "refused"} <= header.keys():
        raise RecordError(path, 1, "expected a header line with arm, rank, ops and refused")
    if len(lines) != header["ops"]:
        raise RecordError(path, None, f"expected {header['ops']} ops, found {len(lines)}")
    try:
        records = [OpRecord.from_json(line) for line in lines]
    except (KeyError, TypeError, ValueError) as e:
        raise RecordError(path, None, f"not an op record: {type(e).__name__}: {e}") from None
    return OpFile(header["arm"], header["rank"], header["refused"], records)


def write_captured(path: Path, outputs: list[torch.Tensor]) -> None:
    arrays = {f"out{i}": _bits(t.detach().cpu().contiguous()) for i, t in enumerate(outputs)}
    buffer = io.BytesIO()
    np.savez(buffer, dtypes=np.array([str(t.dtype) for t in outputs], dtype=str), **arrays)
    write_bytes_atomic(path, buffer.getvalue())


def _bits(tensor: torch.Tensor) -> np.ndarray:
    try:
        return tensor.numpy()
    except TypeError:  # bf16, fp8: numpy has no such dtype, so their bits travel as integers of their size
        return tensor.view(_SAME_SIZE_INT[tensor.element_size()]).numpy()


def read_captured(path: Path) -> list[torch.Tensor]:
    """The outputs a capture pass kept, as the tensors they were; RecordError naming the file when
    it cannot be read, or names what is no torch dtype."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            names = [str(name) for name in arrays["dtypes"]]
            outputs = [torch.from_numpy(arrays[f"out{i}"]) for i in range(len(names))]
    except (OSError, KeyError, ValueError) as e:
        raise RecordError(path, None, f"cannot read the captured outputs: {e}") from None
    dtypes = [getattr(torch, name.removeprefix("torch."), None) for name in names]
    if not all(isinstance(dtype, torch.dtype) for dtype in dtypes):
        raise RecordError(path, None, f"expected torch dtypes, got {names}")
    return [t if t.dtype == dtype else t.view(dtype) for t, dtype in zip(outputs, dtypes)]
