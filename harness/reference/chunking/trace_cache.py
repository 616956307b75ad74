"""A disk cache of scheduled train-step graphs: an unchanged arm loads its graph instead of tracing it.

Tracing forward, loss and backward with ``make_fx`` (fake tensors, a symbolic chunk dim) costs
seconds per rank; loading the graph the passes made of it costs a tenth of one. An entry is one
pickled object (a scheduled graph and the results of the passes that made it), written with
torch's own :class:`~torch.fx._graph_pickler.GraphPickler`, which pickles nodes, ops and the node
metadata the later passes and checks read (chunk ownership, module stack, backward flag). Fake
values are left out: the passes that need them have run.

**Key.** An entry is found by a hash of everything the graph depends on: what the caller names
(the trainer, its whole config, the rank that traced, the device), the torch and Python versions,
and the contents of every source file of the reference. Any edit to the reference, a pass as much
as the model, misses; so does a new torch. Loading never skips what comes after it: the caller
runs the same finishing passes and static checks on a loaded graph as on a fresh one.

An entry that cannot be read (truncated, written by an incompatible build) is a miss, and the
fresh graph replaces it. Entries are written to a temporary file and renamed, so processes that
share the directory never read half an entry.
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
from typing import Any

import torch

REFERENCE_ROOT = Path(__file__).resolve().parents[1]  # harness/reference
# The node metadata a scheduled graph still needs: what the finishing passes and checks read.
KEPT_METADATA = frozenset({"custom", "nn_module_stack", "autograd_backward"})


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


class GraphCache:
    """A directory of cached graphs, keyed for the reference sources under ``sources``."""

    def __init__(self, root: Path, sources: Path = REFERENCE_ROOT) -> None:
        self.root = Path(root)
        self.sources = source_digest(sources)

    def slot(self, **identity: Any) -> CacheSlot:
        """Where the graph of ``identity`` (JSON-able: trainer, config, rank, device) lives."""
        key = {
            **identity,
            "torch": torch.__version__,
            "python": list(sys.version_info[:2]),
            "sources": self.sources,
        }
        name = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
        return CacheSlot(self.root / f"{name}.graph")


class CacheSlot:
    """One entry's file. ``status`` says what happened to it: hit, miss, unreadable or unwritable (why)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.status = "miss"

    def load(self) -> Any | None:
        """The cached object, or None (a miss, or an entry that cannot be read)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            self.status = f"unreadable ({error})"
            return None
        pickler = _graph_pickler()
        from torch._subclasses.fake_tensor import FakeTensorMode  # loaded with the pickler: see above
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        try:
            with warnings.catch_warnings():  # torch's own unpickling of pytree specs warns of a deprecation
                warnings.simplefilter("ignore", FutureWarning)
                loaded = pickler.GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
        except Exception as error:  # any unreadable entry is a miss; the fresh graph replaces it
            self.status = f"unreadable ({type(error).__name__}: {error})"
            return None
        self.status = "hit"
        return loaded

    def store(self, value: Any) -> None:
        """Writes ``value`` atomically; a cache that cannot be written costs the next run a trace, nothing more."""
        pickler = _graph_pickler()
        options = pickler.Options(ops_filter=None, node_metadata_key_filter=KEPT_METADATA.__contains__)
        data = pickler.GraphPickler.dumps(value, options)
        tmp: Path | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.path.parent, suffix=".tmp", delete=False) as file:
                tmp = Path(file.name)
                file.write(data)
            os.replace(tmp, self.path)
        except OSError as error:
            self.status = f"unwritable ({error})"
            if tmp is not None:
                tmp.unlink(missing_ok=True)
