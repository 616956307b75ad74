import json
import math
import os
import struct

import numpy as np
import pytest

from harness.files import write_json_atomic
from harness.records import JsonlWriter, RecordError, read_jsonl, read_metrics


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def test_floats_round_trip_bit_for_bit(tmp_path):
    rng = np.random.default_rng(0)
    values = [float(v) for v in rng.standard_normal(200) * 10.0 ** rng.integers(-300, 300, 200)]
    values += [-0.0, 5e-324, 2.0794415416798357, 1 / 3, math.inf, -math.inf, 1.7976931348623157e308]
    path = tmp_path / "m.jsonl"
    with JsonlWriter(path) as w:
        for step, v in enumerate(values):
            w.write({"step": step, "loss": v})
        w.write({"step": len(values), "loss": math.nan})
    back = [r["loss"] for r in read_jsonl(path)]
    assert [_bits(v) for v in back[:-1]] == [_bits(v) for v in values]
    assert math.isnan(back[-1])


def test_every_written_line_is_on_disk_before_close(tmp_path):
    path = tmp_path / "m.jsonl"
    w = JsonlWriter(path)
    w.write({"step": 0, "loss": 1.5})
    w.write({"step": 1, "loss": 1.25})
    # A crash now (no close) must still leave both lines readable by another process.
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]
    w.close()


def test_truncated_final_line_is_dropped(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.9}\n{"step": 2, "lo')
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]


def test_corrupt_line_in_the_middle_raises_naming_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(RecordError) as exc:
        read_jsonl(path)
    assert exc.value.line_no == 2
    assert str(exc.value).startswith(f"{path}:2: invalid JSON")
    assert "\n" not in str(exc.value)


def test_corrupt_final_line_with_newline_is_not_a_truncation(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "lo\n')
    with pytest.raises(RecordError, match=":2: "):
        read_jsonl(path)


def test_non_object_line_raises(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(RecordError, match="expected a JSON object"):
        read_jsonl(path)


def test_read_metrics_indexes_by_step_and_orders_columns(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlWriter(path) as w:
        w.write({"step": 1, "extra": 7, "step_time_s": 0.2, "tokens": 128, "grad_norm": 0.5, "loss": 2.0})
        w.write({"step": 0, "extra": 8, "step_time_s": 0.3, "tokens": 128, "grad_norm": 0.6, "loss": 2.5})
    frame = read_metrics(path)
    assert list(frame.index) == [0, 1]
    assert frame.index.name == "step"
    assert list(frame.columns) == ["loss", "grad_norm", "tokens", "step_time_s", "extra"]
    assert frame.loc[0, "loss"] == 2.5 and frame["loss"].dtype == np.float64


def test_read_metrics_rejects_duplicate_and_missing_steps(tmp_path):
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"step": 0, "loss": 1.0}\n{"step": 0, "loss": 1.0}\n')
    with pytest.raises(RecordError, match=r"step\(s\) \[0\] recorded more than once"):
        read_metrics(dup)
    nostep = tmp_path / "nostep.jsonl"
    nostep.write_text('{"loss": 1.0}\n')
    with pytest.raises(RecordError, match="no integer 'step'"):
        read_metrics(nostep)


def test_read_metrics_of_empty_file_is_empty(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("")
    frame = read_metrics(path)
    assert frame.empty and frame.index.name == "step"


def test_write_json_atomic_replaces_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "sub" / "summary.json"
    write_json_atomic(path, {"verdict": "fail", "x": 0.1})
    write_json_atomic(path, {"verdict": "pass", "x": 2.0794415416798357})
    assert json.loads(path.read_text()) == {"verdict": "pass", "x": 2.0794415416798357}
    assert os.listdir(path.parent) == ["summary.json"]


def test_write_json_atomic_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "golden.json"
    write_json_atomic(path, {"old": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"new": object()})
    assert json.loads(path.read_text()) == {"old": 1}
    assert os.listdir(tmp_path) == ["golden.json"]
