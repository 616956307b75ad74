"""Finding the system under test a suite names: ``subject = "reference"`` (the default), an
installed subject registered under the entry-point group ``harness.subjects``, or
``"package.module:factory"``. The protocol itself is :mod:`harness.subject.protocol`.

A ``module:factory`` is imported from the suite file's folder first (a module or package there:
only that one, with sys.path untouched), then from the installed packages: a trainer of one's own
runs from a suite beside it (``examples/tiny-dp.toml`` names ``tiny_dp:subject``). The factory
is called with no arguments and returns the subject. Nothing else is imported: only what the
suite, which the user runs, names.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from harness.subject.protocol import Subject, SubjectError

if TYPE_CHECKING:
    from harness.specs import SuiteSpec

DEFAULT = "reference"
ENTRY_POINT_GROUP = "harness.subjects"
BUILTIN = {DEFAULT: "harness.subject.reference:subject", "torchtitan": "harness.subject.torchtitan:subject"}
_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")

__all__ = [
    "DEFAULT",
    "ENTRY_POINT_GROUP",
    "Subject",
    "SubjectError",
    "load_subject",
    "subject_of",
    "usable_trace_cache",
]


def subject_of(suite: SuiteSpec) -> Subject:
    """The system under test a validated suite names."""
    return load_subject(suite.subject, suite.subject_dir)


def usable_trace_cache(path: Path | None, subject: Subject) -> tuple[Path | None, str | None]:
    """The trace cache the ranks may use (None: off), and the line saying why not when the subject
    finds its folder unsafe (the reference: reference/chunking/trace_cache.py): the run then traces,
    and is judged on its merits."""
    problem = getattr(subject, "cache_problem", None)
    why = problem(path) if path is not None and problem is not None else None
    return (None, why) if why else (path, None)


@functools.cache
def load_subject(name: str, search_dir: Path | None = None) -> Subject:
    """The subject ``name`` names; ``search_dir`` (the suite file's folder) is searched first for a
    ``module:factory``. Raises SubjectError naming the subject and what went wrong."""
    target = BUILTIN.get(name)
    if target is None and ":" not in name:
        installed = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
        if name not in installed:
            known = ", ".join(sorted({*BUILTIN, *installed}))
            raise SubjectError(f'subject "{name}": not a known subject ({known}) nor "package.module:factory"')
        return _made(name, installed[name].load)
    target = target or name
    if not _TARGET.fullmatch(target):
        raise SubjectError(f'subject "{name}": expected "package.module:factory"')
    module_name, attr = target.split(":")
    return _made(name, lambda: getattr(_import(name, module_name, search_dir), attr))


def _import(name: str, module_name: str, search_dir: Path | None) -> object:
    """``module_name``, its top-level module or package taken from ``search_dir`` where it is there.
    Only that one is loaded from the folder; sys.path is left alone, so nothing else in the folder
    (a stray ``json.py``) can shadow a module the harness imports later."""
    top = module_name.split(".")[0]
    if search_dir is not None and top not in sys.modules:
        _load_beside(name, top, search_dir)
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise SubjectError(f'subject "{name}": cannot import {module_name}: {e}') from None


def _load_beside(name: str, top: str, folder: Path) -> None:
    for path, package in ((folder / top / "__init__.py", True), (folder / f"{top}.py", False)):
        if not path.is_file():
            continue
        locations = [str(path.parent)] if package else None
        spec = importlib.util.spec_from_file_location(top, path, submodule_search_locations=locations)
        module = importlib.util.module_from_spec(spec)
        sys.modules[top] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[top]
            raise SubjectError(f'subject "{name}": {path} raised {type(e).__name__}: {e}') from None
        return


def _made(name: str, find_factory: object) -> Subject:
    try:
        factory = find_factory()
    except AttributeError as e:
        raise SubjectError(f'subject "{name}": {e}') from None
    if not callable(factory):
        raise SubjectError(f'subject "{name}": {factory!r} is not a factory (a callable returning the subject)')
    subject = factory()
    missing = [
        a for a in ("name", "families", "source", "train_fields", "parse_arms", "build") if not hasattr(subject, a)
    ]
    if missing:
        raise SubjectError(
            f'subject "{name}": {type(subject).__name__} lacks {", ".join(missing)} (see harness.subject.protocol)'
        )
    return subject
