"""Finding the system under test a suite names: ``subject = "reference"`` (the default), an
installed subject registered under the entry-point group ``harness.subjects``, or
``"package.module:factory"``. The protocol itself is :mod:`harness.subject.protocol`.

A ``module:factory`` is imported from the suite file's folder first (a module or package there:
only that one, with sys.path untouched), then from the installed packages: a trainer of one's own
runs from a suite beside it (``examples/tiny-dp.toml`` names ``tiny_dp:subject``). The factory
is called with no arguments and returns the subject. Nothing else is imported: only what the
suite, which the user runs, names.

Importing runs code, so a ``module:factory`` is imported only where nobody else could have put it
(StrictModes, :func:`harness.trust.check_path`): the suite file, the module or package beside it
(every file of the package, and a module's cached bytecode) and every folder above them must be the
user's own or root's and writable by nobody else; else the suite is refused, exit 2, naming the path
and why, before anything is imported, in the harness and again in each rank. A trainer that must
run from a shared place is installed and named by its entry point, which is never looked up beside
the suite.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from harness.subject.protocol import (
    CAPABILITIES,
    SUBJECT_METHODS,
    TRACE_CACHE,
    Subject,
    SubjectError,
    SubjectFault,
    undeclared_methods,
)
from harness.trust import TrustError, check_path

if TYPE_CHECKING:
    from harness.specs import SuiteSpec

DEFAULT = "reference"
ENTRY_POINT_GROUP = "harness.subjects"
BUILTIN = {DEFAULT: "harness.subject.reference:subject", "torchtitan": "harness.subject.torchtitan:subject"}
# What a subject must have (harness/subject/protocol.py); its optional parts are in ``capabilities``.
_DECLARED = ("name", "families", "capabilities", "source", "train_fields", "parse_arms", "build")
_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")

__all__ = [
    "DEFAULT",
    "ENTRY_POINT_GROUP",
    "Subject",
    "SubjectError",
    "SubjectFault",
    "load_subject",
    "raised_in",
    "subject_of",
    "usable_trace_cache",
]


def subject_of(suite: SuiteSpec) -> Subject:
    """The system under test a validated suite names."""
    return load_subject(suite.subject, suite.path.resolve())


def usable_trace_cache(path: Path | None, subject: Subject) -> tuple[Path | None, str | None]:
    """The trace cache the ranks may use (None: off), and the line saying why not when the subject
    finds its folder unsafe (the reference: reference/chunking/trace_cache.py): the run then traces,
    and is judged on its merits."""
    vetted = path is not None and TRACE_CACHE in subject.capabilities
    why = subject.cache_problem(path) if vetted else None
    return (None, why) if why else (path, None)


@functools.cache
def load_subject(name: str, suite_file: Path | None = None) -> Subject:
    """The subject ``name`` names; a ``module:factory`` is looked up first beside ``suite_file``, which,
    with what would be imported from there, must be safe to import (see above). Raises SubjectError
    (exit 2) naming the subject and what went wrong, or SubjectFault (exit 1) when its factory raised."""
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
    search_dir = None
    if suite_file is not None and name not in BUILTIN:
        _refuse_unsafe(name, suite_file, module_name.split(".")[0])
        search_dir = suite_file.parent
    return _made(name, lambda: getattr(_import(name, module_name, search_dir), attr))


def _refuse_unsafe(name: str, suite_file: Path, top: str) -> None:
    """StrictModes on the suite file and on what would be imported as ``top`` from beside it: a
    SubjectError naming the first unsafe path and why, and the safe way to run a shared trainer."""
    for place in (suite_file, *_beside(suite_file.parent, top)):
        try:
            check_path(place, root_may_own=True)
        except TrustError as e:
            raise SubjectError(
                f'subject "{name}": refused: {e}; a module beside a suite is imported only where nobody else can'
                f' write (to run a trainer from a shared place, install it and name its "{ENTRY_POINT_GROUP}"'
                " entry point)"
            ) from None


def _beside(folder: Path, top: str) -> list[Path]:
    """What importing ``top`` from ``folder`` would read (as :func:`_load_beside` looks): a package's
    folder and everything under it, or a module and its cached bytecode."""
    package = folder / top
    if (package / "__init__.py").is_file():
        return [package, *sorted(package.rglob("*"))]
    module, cache = folder / f"{top}.py", folder / "__pycache__"
    if not module.is_file():
        return []
    return [module, *([cache, *sorted(cache.glob(f"{top}.*.pyc"))] if cache.is_dir() else [])]


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


def _made(name: str, find_factory: Callable[[], object]) -> Subject:
    try:
        factory = find_factory()
    except AttributeError as e:
        raise SubjectError(f'subject "{name}": {e}') from None
    if not callable(factory):
        raise SubjectError(f'subject "{name}": {factory!r} is not a factory (a callable returning the subject)')
    try:
        subject = factory()
    except SubjectError as e:  # it refuses to load, saying why (a missing extra): bad input
        raise SubjectError(f'subject "{name}": {e}') from None
    except Exception as e:  # it takes no input: whatever else it raises is its bug
        raise SubjectFault(f'subject "{name}": its factory raised: {raised_in(e, _code_of(factory))}') from None
    missing = [a for a in _DECLARED if not hasattr(subject, a)]
    if missing:
        raise SubjectError(
            f'subject "{name}": {type(subject).__name__} lacks {", ".join(missing)}'
            " (see harness.subject.protocol; SubjectBase has all but parse_arms and build)"
        )
    unknown = sorted(set(subject.capabilities) - set(CAPABILITIES))
    if unknown:
        raise SubjectError(
            f'subject "{name}": capabilities {", ".join(unknown)} are not known ({", ".join(CAPABILITIES)})'
        )
    if lacking := undeclared_methods(subject, subject.capabilities, SUBJECT_METHODS):
        raise SubjectError(f'subject "{name}": {type(subject).__name__} declares {lacking[0]}\'s capability without it')
    return subject


def raised_in(error: BaseException, code: Iterable[Path]) -> str:
    """``file:line: Type: message``: where ``error`` was raised, as the last frame of its traceback in
    the subject's ``code`` (files or folders), else its last frame; the line a user needs to fix it."""
    roots = [Path(c).resolve() for c in code]
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if any(Path(f.filename).resolve().is_relative_to(root) for root in roots)]
    line = traceback.format_exception_only(type(error), error)[-1].strip()
    where = (ours or frames)[-1] if frames else None
    return f"{where.filename}:{where.lineno}: {line}" if where else line


def _code_of(factory: object) -> tuple[Path, ...]:
    """The subject's code, as far as its factory tells: the file of its top-level module, or that
    package's folder."""
    module = inspect.getmodule(factory)
    top = sys.modules.get(module.__name__.split(".")[0]) if module else None
    file = getattr(top, "__file__", None)
    if not file:
        return ()
    return (Path(file).parent if Path(file).name == "__init__.py" else Path(file),)
