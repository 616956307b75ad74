"""A disk cache of scheduled train-step graphs: an unchanged arm loads its graph instead of tracing it.

Tracing forward, loss and backward with ``make_fx`` (fake tensors, a symbolic chunk dim) costs
seconds per rank; loading the graph the passes made of it costs a tenth of one. An entry is one
pickled object (a scheduled graph and the results of the passes that made it), written with
torch's own :class:`~torch.fx._graph_pickler.GraphPickler`, which pickles nodes, ops and the node
metadata the later passes and checks read (chunk ownership, module stack, backward flag). Fake
values are left out: the passes that need them have run.

**Name.** An entry is found by a hash of everything the graph depends on: what the caller names
(the trainer, its whole config, the rank that traced, the device), the torch and Python versions,
and the contents of every source file of the reference. Any edit to the reference, a pass as much
as the model, misses; so does a new torch. Loading never skips what comes after it: the caller
runs the same finishing passes and static checks on a loaded graph as on a fresh one.

**Trust.** Unpickling runs code, and a cache folder may be one that other users reach (a shared CI
runner, a cluster), so nothing is unpickled that is not proven the user's own:

* every entry begins with an HMAC-SHA256, over its file name and its pickled bytes, under the
  user's secret key, which lives outside any cache folder (:func:`default_key_file`:
  ``$XDG_CONFIG_HOME/harness/trace-cache.key``, else ``~/.config/harness/trace-cache.key``). The key
  is made on first use, 0600 in a 0700 folder, by ranks racing to make it as well: each links its
  own into place and a loser reads the winner's. A key that is not a regular file of the user's, or
  that others may open, turns the cache off;
* as OpenSSH's StrictModes, a cache folder owned by another user, or that others may write without
  the sticky bit, is neither read nor written (the cache is off), and an entry that is not a
  regular file of the user's (a symbolic link, another user's file) is never opened.

:func:`open_cache` checks a folder and the key before a run; what it refuses is a
:class:`TraceCacheError` naming the path and why. Folders the cache makes are 0700 and entries
0600, whatever the umask.

**Misses.** An entry that is refused (not the user's file, a tag that does not match), that cannot
be read (truncated, written by an incompatible build) or that holds an object of another type is a
miss, its slot's ``status`` says why, and the fresh graph replaces it. Entries are written to a
temporary file and renamed, so processes that share the directory never read half an entry.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
import sys
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO, TypeVar

import torch

REFERENCE_ROOT = Path(__file__).resolve().parents[1]  # harness/reference
# The node metadata a scheduled graph still needs: what the finishing passes and checks read.
KEPT_METADATA = frozenset({"custom", "nn_module_stack", "autograd_backward"})
KEY_HEX_DIGITS = 64  # the secret key: 256 random bits, written as hex
TAG_BYTES = hashlib.sha256().digest_size  # an entry's HMAC-SHA256, ahead of its pickled bytes
T = TypeVar("T")


class TraceCacheError(Exception):
    """A cache folder, key or entry that is not safe to use (``path``, and ``why``): the cache does without it."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why


def _graph_pickler() -> ModuleType:
    """torch.fx._graph_pickler, imported on first use: it imports torch._dynamo and FX's symbolic
    shapes (about a second), which only a process that builds a traced arm needs."""
    import torch.fx._graph_pickler

    return torch.fx._graph_pickler


def source_digest(root: Path) -> str:
    """sha256 over the relative path and bytes of every ``.py`` file under ``root``, in path order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def default_key_file() -> Path:
    """The user's secret key: in their own config folder, never in a cache folder that others may share."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "harness" / "trace-cache.key"


def open_cache(root: Path, key_file: Path | None = None) -> bytes:
    """The key that signs and checks ``root``'s entries, once ``root`` (if it exists yet) and the key
    (made if missing; default :func:`default_key_file`) are found safe. Raises TraceCacheError."""
    _check_folder(root)
    return _read_or_create_key(default_key_file() if key_file is None else key_file)


def _check_folder(folder: Path) -> None:
    """OpenSSH's StrictModes: a folder of another user's, or one that others may write without the
    sticky bit (which keeps them from replacing what they do not own), is refused with TraceCacheError.
    A missing folder passes: the first store makes it, 0700."""
    try:
        info = folder.stat()
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as error:
        raise TraceCacheError(folder, f"cannot be examined ({error.strerror})") from None
    if owner := _foreign_owner(info):
        raise TraceCacheError(folder, owner)
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise TraceCacheError(folder, f"mode {_mode(info)} is writable by others without the sticky bit")


def _read_or_create_key(path: Path) -> bytes:
    """The user's secret key at ``path``, made if there is none (0600, in folders made 0700). Processes
    that start at once agree on one key: each links a key of its own into place, and a process that
    loses the race reads the winner's. Raises TraceCacheError if the key is not the user's own secret."""
    try:
        try:
            return _read_key(path)
        except FileNotFoundError:
            _make_key(path)
        return _read_key(path)
    except OSError as error:
        raise TraceCacheError(path, f"cannot read or make the key ({error.strerror})") from None


def _make_key(path: Path) -> None:
    _make_private_folders(path.parent)
    fd, candidate = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # 0600
    try:
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(KEY_HEX_DIGITS // 2))
            file.flush()
            os.fsync(file.fileno())  # a key cut short by a crash would keep the cache off until deleted
        with contextlib.suppress(FileExistsError):  # another process made it first: its key is the key
            os.link(candidate, path)
    finally:
        os.unlink(candidate)


def _read_key(path: Path) -> bytes:
    """The key at ``path``: FileNotFoundError if there is none, TraceCacheError if others may open it
    or it is not a key."""
    with _open_own_file(path) as file:
        info = os.fstat(file.fileno())
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise TraceCacheError(path, f"expected mode 0600 (no access for others), got {_mode(info)}")
        text = file.read(KEY_HEX_DIGITS + 2)
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except ValueError:  # not ASCII, or not hex
        key = b""
    if len(key) * 2 != KEY_HEX_DIGITS:
        raise TraceCacheError(path, f"expected {KEY_HEX_DIGITS} hex digits, got something else")
    return key


def _open_own_file(path: Path) -> BinaryIO:
    """``path`` opened to read if it is a regular file of the user's, never through a symbolic link;
    else TraceCacheError. OSError if it cannot be opened (FileNotFoundError: there is none)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # NONBLOCK: a FIFO must not hang a rank
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise TraceCacheError(path, "a symbolic link, expected a regular file") from None
        raise
    file = os.fdopen(fd, "rb")
    info = os.fstat(fd)
    why = _foreign_owner(info) if stat.S_ISREG(info.st_mode) else "not a regular file"
    if why:
        file.close()
        raise TraceCacheError(path, why)
    return file


def _foreign_owner(info: os.stat_result) -> str | None:
    """Why a file or folder is not the user's own, or None if it is."""
    if info.st_uid == os.geteuid():
        return None
    return f"owned by uid {info.st_uid}, expected this user's uid {os.geteuid()}"


def _mode(info: os.stat_result) -> str:
    return f"{stat.S_IMODE(info.st_mode):04o}"


def _make_private_folders(folder: Path) -> None:
    """``folder`` and its missing parents, each made 0700 whatever the umask."""
    for missing in reversed([f for f in (folder, *folder.parents) if not f.exists()]):
        try:
            missing.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by another process
            continue
        missing.chmod(0o700)  # mkdir's mode passes through the umask


class GraphCache:
    """A directory of cached graphs, keyed for the reference sources under ``sources``, signed with the
    key in ``key_file`` (default :func:`default_key_file`)."""

    def __init__(self, root: Path, sources: Path = REFERENCE_ROOT, key_file: Path | None = None) -> None:
        self.root = Path(root)
        self.sources = source_digest(sources)
        self.key_file = key_file

    def slot(self, **identity: Any) -> CacheSlot:
        """Where the graph of ``identity`` (JSON-able: trainer, config, rank, device) lives; a slot that
        is ``off``, saying why, if the folder or the key is not safe to use."""
        lookup = {
            **identity,
            "torch": torch.__version__,
            "python": list(sys.version_info[:2]),
            "sources": self.sources,
        }
        name = hashlib.sha256(json.dumps(lookup, sort_keys=True, default=str).encode()).hexdigest()[:32]
        path = self.root / f"{name}.graph"
        try:
            return CacheSlot(path, open_cache(self.root, self.key_file))
        except TraceCacheError as error:
            return CacheSlot(path, None, f"off ({error})")


class CacheSlot:
    """One entry's file, signed with ``key`` (None: the cache is off). ``status`` says what happened to it:
    hit, miss, off, refused, unreadable or unwritable (why)."""

    def __init__(self, path: Path, key: bytes | None, status: str = "miss") -> None:
        self.path = path
        self.key = key
        self.status = status

    def load(self, expected: type[T]) -> T | None:
        """The cached ``expected``, or None (a miss, or an entry that is refused or cannot be read).
        Nothing is unpickled unless its tag proves it was written with the user's key."""
        if self.key is None:
            return None
        try:
            payload = _authenticated_payload(self.path, self.key)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except TraceCacheError as error:
            self.status = f"refused ({error.why})"
            return None
        except OSError as error:
            self.status = f"unreadable ({error})"
            return None
        try:
            loaded = _unpickle(payload)
        except Exception as error:  # any unreadable entry is a miss; the fresh graph replaces it
            self.status = f"unreadable ({type(error).__name__}: {error})"
            return None
        if not isinstance(loaded, expected):
            self.status = f"unreadable (expected a {expected.__name__}, got {type(loaded).__name__})"
            return None
        self.status = "hit"
        return loaded

    def store(self, value: Any) -> None:
        """Writes ``value`` signed, atomically; a cache that cannot be written costs the next run a trace, no more."""
        if self.key is None:
            return
        payload = _pickle(value)
        tmp: Path | None = None
        try:
            _make_private_folders(self.path.parent)
            with tempfile.NamedTemporaryFile(dir=self.path.parent, suffix=".tmp", delete=False) as file:  # 0600
                tmp = Path(file.name)
                file.write(_tag(self.key, self.path.name, payload) + payload)
            os.replace(tmp, self.path)
        except OSError as error:
            unwritable = f"unwritable ({error})"
            self.status = unwritable if self.status == "miss" else f"{self.status}, then {unwritable}"
            if tmp is not None:
                tmp.unlink(missing_ok=True)


def _tag(key: bytes, name: str, payload: bytes) -> bytes:
    """HMAC-SHA256 over an entry's file name and payload: a valid entry copied to another name is refused too."""
    mac = hmac.new(key, name.encode() + b"\0", hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def _authenticated_payload(path: Path, key: bytes) -> bytes:
    """The pickled bytes of the entry at ``path``, once it is found the user's own file and its tag checks."""
    with _open_own_file(path) as file:
        data = file.read()
    tag, payload = data[:TAG_BYTES], data[TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(key, path.name, payload)):
        why = "its tag does not match the user's key: altered, cut short or signed with another key"
        raise TraceCacheError(path, why)
    return payload


def _pickle(value: Any) -> bytes:
    pickler = _graph_pickler()
    options = pickler.Options(ops_filter=None, node_metadata_key_filter=KEPT_METADATA.__contains__)
    return pickler.GraphPickler.dumps(value, options)


def _unpickle(payload: bytes) -> Any:
    pickler = _graph_pickler()
    from torch._subclasses.fake_tensor import FakeTensorMode  # loaded with the pickler: see above
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with warnings.catch_warnings():  # torch's own unpickling of pytree specs warns of a deprecation
        warnings.simplefilter("ignore", FutureWarning)
        return pickler.GraphPickler.loads(payload, FakeTensorMode(shape_env=ShapeEnv()))
