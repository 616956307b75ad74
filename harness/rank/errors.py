"""A rank's error file, whole or not at all, even when the disk is full.

A rank that raises writes its traceback to its error file (TORCHELASTIC_ERROR_FILE), which the
launchers read to report the rank's failure (harness/launchers/failures.py). A full disk is a
common way for a rank to fail, and torch's own error handler then leaves the file empty: the
launcher fails to parse it, and the cause, the rank's ENOSPC naming the file it was writing, is
lost. So a rank claims room for its error file when it starts (:class:`ErrorFileInRoom`), and the
launchers free what a rank that ended well, or was killed, left unused (:func:`release_error_room`).

The launchers import this module, so it imports nothing of a rank's training.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
import traceback
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

# Disk space a rank claims at start-up for its error file: a traceback is a few kilobytes.
ERROR_ROOM_BYTES = 64 * 1024


def error_room(error_file: Path) -> Path:
    """The file holding the space claimed for a rank's error file, renamed into it once written."""
    return error_file.with_name(f".{error_file.name}.room")


def release_error_room(error_file: Path) -> None:
    """Frees the space a rank claimed for its error file and did not use: it ended well, or was killed."""
    error_room(error_file).unlink(missing_ok=True)


class ErrorFileInRoom(ErrorHandler):
    """torch's error handler (``@record``), writing the same error file into space claimed when the rank
    starts, then renaming it into place: a whole error file or none."""

    def initialize(self) -> None:
        super().initialize()
        path = self._get_error_file_path()
        if path:
            with contextlib.suppress(OSError):  # no space to claim: the file is written without it
                _claim(error_room(Path(path)), ERROR_ROOM_BYTES)

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        extra_info = {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}
        report = json.dumps({"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": extra_info}})
        try:
            _write_into(error_room(Path(path)), Path(path), report.encode())
        except OSError as error:
            with contextlib.suppress(OSError):  # stderr is the rank log, on the same disk
                print(f"{path}: cannot write the error file: {error}", flush=True)


def _claim(room: Path, size: int) -> None:
    fd = os.open(room, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def _write_into(room: Path, path: Path, data: bytes) -> None:
    """Writes ``data`` as ``path``, atomically, over the space claimed in ``room`` (it needs no new
    blocks when it fits); on failure neither file is left."""
    try:
        fd = os.open(room, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if os.pwrite(fd, data, 0) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(room))
            os.ftruncate(fd, len(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(room, path)
    except OSError:
        room.unlink(missing_ok=True)
        raise
