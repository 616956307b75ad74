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
  user's secret key, which lives outside any cache folder (:func:`harness.trust.default_key_file`:
  ``$XDG_CONFIG_HOME/harness/trace-cache.key``, else ``~/.config/harness/trace-cache.key``). The key
  is made on first use, 0600 in a 0700 folder, by ranks racing to make it as well: each links its
  own into place and a loser reads the winner's. A key that is not a regular file of the user's, or
  that others may open, turns the cache off;
* as OpenSSH's StrictModes, a cache folder owned by another user, or that others may write without
  the sticky bit, is neither read nor written (the cache is off), and an entry that is not a
  regular file of the user's (a symbolic link, another user's file) is never opened.

:func:`open_cache` checks a folder and the key before a run; what it refuses is a
:class:`~harness.trust.TrustError` naming the path and why (the checks are :mod:`harness.trust`'s).
Folders the cache makes are 0700 and entries 0600, whatever the umask.

**Misses.** An entry that is refused (not the user's file, a tag that does not match), that cannot
be read (truncated, written by an incompatible build) or that holds an object of another type is a
miss, its slot's ``status`` says why, and the fresh graph replaces it. Entries are written to a
temporary file and renamed, so processes that share the directory never read half an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch

from harness import trust
from harness.trust import TAG_BYTES, TrustError

REFERENCE_ROOT = Path(__file__).resolve().parents[1]  # harness/reference
# The node metadata a scheduled graph still needs: what the finishing passes and checks read.
KEPT_METADATA = frozenset({"custom", "nn_module_stack", "autograd_backward"})
T = TypeVar("T")


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


def open_cache(root: Path, key_file: Path | None = None) -> bytes:
    """The key that signs and checks ``root``'s entries, once ``root`` (if it exists yet) and the key
    (made if missing; default :func:`~harness.trust.default_key_file`) are found safe. Raises TrustError."""
    trust.check_folder(root)
    return trust.user_key(key_file)


class GraphCache:
    """A directory of cached graphs, keyed for the reference sources under ``sources``, signed with the
    key in ``key_file`` (default :func:`harness.trust.default_key_file`)."""

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
        except TrustError as error:
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
        except TrustError as error:
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
            trust.make_private_folders(self.path.parent)
            with tempfile.NamedTemporaryFile(dir=self.path.parent, suffix=".tmp", delete=False) as file:  # 0600
                tmp = Path(file.name)
                file.write(trust.tag(self.key, self.path.name, payload) + payload)
            os.replace(tmp, self.path)
        except OSError as error:
            unwritable = f"unwritable ({error})"
            self.status = unwritable if self.status == "miss" else f"{self.status}, then {unwritable}"
            if tmp is not None:
                tmp.unlink(missing_ok=True)


def _authenticated_payload(path: Path, key: bytes) -> bytes:
    """The pickled bytes of the entry at ``path``, once it is found the user's own file and its tag checks."""
    with trust.open_own_file(path) as file:
        data = file.read()
    tag, payload = data[:TAG_BYTES], data[TAG_BYTES:]
    if not trust.tag_matches(key, path.name, payload, tag):
        why = "its tag does not match the user's key: altered, cut short or signed with another key"
        raise TrustError(path, why)
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
