"""A rank of a revision's launch group imports the subject's package from that revision
(harness/revisions.py materialised it), ahead of the installed one.

A finder at the front of ``sys.meta_path`` answers for the package and its submodules from the
revision's folder; everything else, the harness included, is imported as usual. A module is run
from the bytes read once through one descriptor and only if their sha256 is the one the harness
took from git (``Revision.files``): a file changed in the cache after the harness checked it is
refused (ImportError), never run.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from harness.revisions import Revision
from harness.trust import open_own_file


class RevisionFinder(importlib.abc.MetaPathFinder):
    """Finds ``package`` and its submodules in the revision's folder (``Revision.root``)."""

    def __init__(self, revision: Revision) -> None:
        self.revision = revision
        self.root = Path(revision.root)
        self.is_module = revision.repo_path.endswith(".py")

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec:
        package = self.revision.package
        if fullname != package and not fullname.startswith(package + "."):
            return None
        if self.is_module:
            return self._spec(fullname, self.root, self.root.name, None) if fullname == package else None
        below = fullname[len(package) :].lstrip(".").replace(".", "/")
        folder = self.root / below if below else self.root
        if (folder / "__init__.py").is_file():
            name = f"{below}/__init__.py" if below else "__init__.py"
            return self._spec(fullname, folder / "__init__.py", name, [str(folder)])
        module = folder.with_name(folder.name + ".py")
        if below and module.is_file():
            return self._spec(fullname, module, f"{below}.py", None)
        return None

    def _spec(
        self, fullname: str, file: Path, name: str, locations: list[str] | None
    ) -> importlib.machinery.ModuleSpec:
        loader = VerifiedLoader(file, self.revision.files.get(name), self.revision)
        return importlib.util.spec_from_file_location(
            fullname, file, loader=loader, submodule_search_locations=locations
        )


class VerifiedLoader(importlib.abc.Loader):
    """Runs one file's bytes if their sha256 is ``expected``."""

    def __init__(self, file: Path, expected: str | None, revision: Revision) -> None:
        self.file, self.expected, self.revision = file, expected, revision

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        with open_own_file(self.file) as f:
            data = f.read()
        if self.expected is None or hashlib.sha256(data).hexdigest() != self.expected:
            raise ImportError(
                f"{self.file}: not the bytes of revision {self.revision.spec} ({self.revision.sha[:7]}): changed in the"
                " revision cache after the harness checked it; refused"
            )
        exec(compile(data, str(self.file), "exec", dont_inherit=True), module.__dict__)


def use_revision(revision: Revision) -> None:
    """Imports the subject's package from ``revision`` from now on, and imports it now: a module the
    harness loads by path (a ``module:factory`` beside its suite) finds it loaded already."""
    if revision.package in sys.modules:
        raise RuntimeError(f"{revision.package} was imported before its revision {revision.spec} could be put first")
    sys.meta_path.insert(0, RevisionFinder(revision))
    importlib.import_module(revision.package)
