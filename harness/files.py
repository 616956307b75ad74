"""Writing a file so that a crash, a full disk or a second signal never leaves a torn one, and
naming the file in the error when a write fails.

Rank records stream line by line (records.py); everything the harness writes whole (a summary, a
manifest, a golden, a report, a rank's op records) goes through :func:`write_text_atomic` or
:func:`write_bytes_atomic`: readers see the old file or the new one.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

# A write_json_atomic temp file older than this is a killed write's leftover, not a writer's work in progress.
STALE_TEMP_S = 60.0


@contextmanager
def naming_file(path: Path | str) -> Iterator[None]:
    """Adds ``path`` to an OSError raised while writing it: a failed write or flush (ENOSPC on a full
    disk) names no file, and the file is what the user must look at."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """Writes JSON so that readers see the old file or the new one, never a torn one."""
    write_text_atomic(path, json.dumps(obj, indent=2, allow_nan=True) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Writes ``text`` so that readers see the old file or the new one, never a torn one (a report
    cut short by a full disk or a second signal would open as a broken page)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Writes ``data`` as :func:`write_text_atomic` writes text.

    The temp file lives in the target directory so os.replace stays a same-filesystem rename.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with naming_file(path), os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def remove_stale_temps(path: Path, older_than_s: float = STALE_TEMP_S) -> None:
    """Deletes the temp files that writes of ``path`` killed mid-write left (write_json_atomic's
    ``.<name>.<random>.tmp``), which nothing else would ever remove. Only those older than
    ``older_than_s``: a younger one may be a concurrent writer's, still being written."""
    path = Path(path)
    cutoff = time.time() - older_than_s
    for temp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        with suppress(FileNotFoundError):  # its writer renamed it into place meanwhile
            if temp.stat().st_mtime < cutoff:
                temp.unlink()
