"""Files that are safe to run or unpickle: the user's own, in folders nobody else can change, and
signed with the user's key.

Unpickling runs code, and importing a module runs code. A run directory, a trace cache, a
checkpoint or a suite's subject module may sit where other users reach it (a shared CI runner, a
cluster's scratch), so the harness and the reference's ranks use nothing from there that is not
proven the user's own. Two rules, each closing a hole the other leaves:

* **StrictModes** (as OpenSSH checks ``authorized_keys``): every folder from ``/`` down to the file
  is owned by the user or root and, unless sticky, writable by nobody else; the file itself is
  the user's (or root's, where :func:`check_path` allows it) and writable by nobody else. A folder
  another user may write lets them rename a file or a whole subtree away and put theirs in its
  place, whatever the file's own mode says.
* **Verify bytes, then use those bytes.** A check by path is a check of the path at that moment:
  the path can be swapped between the check and the read (``renameat2(RENAME_EXCHANGE)``, timed by
  inotify). So what is unpickled is first read once, through a file descriptor opened without
  following links, and its HMAC-SHA256 tag under the user's secret key (:func:`user_key`) is
  checked on those very bytes (:func:`verified_payload`); the bytes handed on are the ones checked.

This module imports only the standard library: the reference (the system under test, which imports
nothing else of the harness) signs its checkpoints and trace-cache entries with it too.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

KEY_HEX_DIGITS = 64  # the secret key: 256 random bits, written as hex
TAG_BYTES = hashlib.sha256().digest_size


class TrustError(Exception):
    """A file, folder or key that is not safe to use (``path``, and ``why``)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why


def default_key_file() -> Path:
    """The user's secret key: in their own config folder, never in a folder that others may share."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "harness" / "trace-cache.key"


def check_folder(folder: Path) -> None:
    """StrictModes for one folder: another user's, or writable by others without the sticky bit (which
    keeps them from replacing what they do not own), raises TrustError. A missing folder passes."""
    try:
        info = folder.stat()
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as error:
        raise TrustError(folder, f"cannot be examined ({error.strerror})") from None
    if owner := foreign_owner(info):
        raise TrustError(folder, owner)
    _refuse_writable_by_others(folder, info)


def check_path(path: Path, *, root_may_own: bool = False) -> None:
    """StrictModes along the whole path: ``path`` (a file or a folder) is the user's own (or root's, when
    ``root_may_own``: an installed file) and writable by nobody else, and every folder above it, up to
    ``/``, is the user's or root's and writable by nobody else unless sticky. Symbolic links on the way
    are judged where they stand and where they lead. Raises TrustError naming the first unsafe place."""
    lexical = Path(os.path.abspath(path))
    real = Path(os.path.realpath(path))
    for place in dict.fromkeys([*lexical.parents, *real.parents]):
        info = _stat(place, os.stat)
        if info.st_uid not in (os.geteuid(), 0):
            raise TrustError(place, f"a folder above it is {foreign_owner(info)} or root's")
        _refuse_writable_by_others(place, info)
    for place in dict.fromkeys([lexical, real]):
        info = _stat(place, os.lstat)
        if stat.S_ISLNK(info.st_mode):
            if info.st_uid not in (os.geteuid(), 0):
                raise TrustError(place, f"a symbolic link {foreign_owner(info)}")
            continue
        if (why := foreign_owner(info)) and not (root_may_own and info.st_uid == 0):
            raise TrustError(place, why)
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise TrustError(place, f"mode {mode_of(info)} is writable by others")


def open_own_file(path: Path) -> BinaryIO:
    """``path`` opened to read if it is a regular file of the user's, never through a symbolic link;
    else TrustError. OSError if it cannot be opened (FileNotFoundError: there is none)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # NONBLOCK: a FIFO must not hang a rank
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise TrustError(path, "a symbolic link, expected a regular file") from None
        raise
    file = os.fdopen(fd, "rb")
    info = os.fstat(fd)
    why = foreign_owner(info) if stat.S_ISREG(info.st_mode) else "not a regular file"
    if why:
        file.close()
        raise TrustError(path, why)
    return file


def user_key(path: Path | None = None) -> bytes:
    """The user's secret key at ``path`` (default :func:`default_key_file`), made if there is none (0600,
    in folders made 0700). Processes that start at once agree on one key: each links a key of its own
    into place, and a process that loses the race reads the winner's. Raises TrustError if the key is
    not the user's own secret."""
    path = default_key_file() if path is None else path
    try:
        try:
            return _read_key(path)
        except FileNotFoundError:
            _make_key(path)
        return _read_key(path)
    except OSError as error:
        raise TrustError(path, f"cannot read or make the key ({error.strerror})") from None


def tag(key: bytes, name: str, payload: bytes) -> bytes:
    """HMAC-SHA256 over a name and a payload: signed bytes copied under another name are refused too."""
    mac = hmac.new(key, name.encode() + b"\0", hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def tag_matches(key: bytes, name: str, payload: bytes, expected: bytes) -> bool:
    """Whether ``expected`` is ``payload``'s tag under ``key`` and ``name``, compared in constant time."""
    return hmac.compare_digest(expected, tag(key, name, payload))


def verified_payload(path: Path, key: bytes, name: str, expected: bytes) -> bytes:
    """The bytes of the user's own regular file at ``path``, read once through one descriptor, once their
    tag under ``key`` and ``name`` is ``expected``; else TrustError. Use these bytes, never the path again."""
    with open_own_file(path) as file:
        payload = file.read()
    if not tag_matches(key, name, payload, expected):
        why = "its tag does not match the user's key: altered, replaced, cut short or signed with another key"
        raise TrustError(path, why)
    return payload


def make_private_folders(folder: Path) -> None:
    """``folder`` and its missing parents, each made 0700 whatever the umask."""
    for missing in reversed([f for f in (folder, *folder.parents) if not f.exists()]):
        try:
            missing.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by another process
            continue
        missing.chmod(0o700)  # mkdir's mode passes through the umask


def foreign_owner(info: os.stat_result) -> str | None:
    """Why a file or folder is not the user's own, or None if it is."""
    if info.st_uid == os.geteuid():
        return None
    return f"owned by uid {info.st_uid}, expected this user's uid {os.geteuid()}"


def mode_of(info: os.stat_result) -> str:
    return f"{stat.S_IMODE(info.st_mode):04o}"


def _refuse_writable_by_others(folder: Path, info: os.stat_result) -> None:
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise TrustError(folder, f"mode {mode_of(info)} is writable by others without the sticky bit")


def _stat(place: Path, how: object) -> os.stat_result:
    try:
        return how(place)  # type: ignore[operator]
    except OSError as error:
        raise TrustError(place, f"cannot be examined ({error.strerror})") from None


def _make_key(path: Path) -> None:
    make_private_folders(path.parent)
    fd, candidate = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # 0600
    try:
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(KEY_HEX_DIGITS // 2))
            file.flush()
            os.fsync(file.fileno())  # a key cut short by a crash would refuse everything until deleted
        with contextlib.suppress(FileExistsError):  # another process made it first: its key is the key
            os.link(candidate, path)
    finally:
        os.unlink(candidate)


def _read_key(path: Path) -> bytes:
    """The key at ``path``: FileNotFoundError if there is none, TrustError if others may open it or it is
    not a key."""
    with open_own_file(path) as file:
        info = os.fstat(file.fileno())
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise TrustError(path, f"expected mode 0600 (no access for others), got {mode_of(info)}")
        text = file.read(KEY_HEX_DIGITS + 2)
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except ValueError:  # not ASCII, or not hex
        key = b""
    if len(key) * 2 != KEY_HEX_DIGITS:
        raise TrustError(path, f"expected {KEY_HEX_DIGITS} hex digits, got something else")
    return key
