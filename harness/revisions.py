"""Revisions of a subject's code, materialised from git for the ranks of a change check
(``harness run SUITE --base REV [--head REV] [--source PATH]``).

A change check runs every arm of a suite twice: at the base revision and at the head. Only the
subject's own package differs between the two (``Subject.package``: ``harness.reference`` for the
bundled reference, ``torchtitan``, a ``module:factory``'s top-level module); the worker, the
recorder and the record formats are the current harness's, so the checks read both sides alike.

Each revision's package is taken from git, never from a folder another process might be editing:
``git archive`` of the commit (or, for a head that is the working tree, the checkout's files as
they are, its tracked and untracked ones) into the user's cache (``$XDG_CACHE_HOME/harness/revisions``),
one folder per commit sha, made private. The bytes of every ``.py`` file are hashed as git hands
them over; the hashes go into ``manifest.json``, and a rank imports a module only from bytes that
match (harness/rank/revision.py). A cache entry that no longer matches is made again; a cache
folder another user can write is refused (StrictModes, harness/trust.py).

Bad input is a :class:`RevisionError` (exit 2, one line): a revision that does not resolve, a
source that is not a git checkout or does not hold the package, a subject with no source package.
A revision whose package does not compile is a :class:`RevisionBuildError` (exit 3: it cannot be
judged, as ``git bisect run`` skips a commit that does not build).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.trust import TrustError, check_path, make_private_folders

BASE, HEAD = "base", "head"
WORKING_TREE = "the working tree"
_GIT_TIMEOUT_S = 60


class RevisionError(Exception):
    """A revision, source or subject that cannot be judged as a change: one line, exit 2."""


class RevisionBuildError(Exception):
    """A revision whose package does not compile (``file:line: why``): exit 3, skipped by bisect."""


@dataclass(frozen=True)
class Revision:
    """One side of a change, materialised: ``label`` (base or head) as the arms carry it, ``spec`` as
    the user named it, the commit ``sha`` and its subject line, ``dirty`` (the hash of the working
    tree's changes to the package, a head with uncommitted changes; else None), the ``package`` it
    swaps and where it now lives (``root``: the package's folder or the module's file), and
    ``files``: the sha256 of every Python file under it, relative to ``root``'s folder."""

    label: str
    spec: str
    sha: str
    title: str
    dirty: str | None
    package: str
    repo_path: str  # the package's path inside the repository
    root: str
    files: dict[str, str] = field(default_factory=dict)

    @property
    def short(self) -> str:
        """``abc1234`` or ``abc1234, +dirty``: how the console names it."""
        return self.sha[:7] + (", +dirty" if self.dirty else "")

    def describe(self) -> str:
        """``main (def5678)``: the name the user gave and the commit, or the commit alone."""
        named = self.spec not in (self.sha, WORKING_TREE) and not self.sha.startswith(self.spec)
        return f"{self.spec} ({self.short})" if named else f"({self.short})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Revision:
        return cls(**raw)


@dataclass(frozen=True)
class Source:
    """The git checkout that holds a subject's package: its top folder and the package's path in it."""

    repo: Path
    package: str

    def git(self, *args: str, text: bool = True, what: str = "git") -> Any:
        """``git -C repo ARGS``' output; RevisionError naming ``what`` with git's own line when it fails."""
        try:
            done = subprocess.run(
                ["git", "-C", str(self.repo), *args],
                capture_output=True,
                text=text,
                timeout=_GIT_TIMEOUT_S,
                env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RevisionError(f"{what}: git failed: {e}") from None
        if done.returncode != 0:
            stderr = done.stderr if text else done.stderr.decode(errors="replace")
            last = (stderr.strip().splitlines() or ["no message"])[-1]
            raise RevisionError(f"{what}: {last}")
        return done.stdout

    def resolve(self, rev: str, flag: str) -> tuple[str, str]:
        """(sha, subject line) of the commit ``rev`` names."""
        if rev.startswith("-"):
            raise RevisionError(f"{flag} {rev}: not a revision")
        unresolved = RevisionError(f"{flag} {rev}: does not resolve to a commit in {self.repo}")
        try:  # --quiet: a name that does not resolve is exit 1 with nothing on stderr
            out = self.git(
                "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}", what=f"{flag} {rev}"
            )
        except RevisionError:
            raise unresolved from None
        sha = out.strip()
        if not sha:
            raise unresolved
        title = self.git("log", "-1", "--format=%s", sha, "--", what=f"{flag} {rev}").strip()
        return sha, title

    def package_path(self, sha: str, flag: str) -> str:
        """Where the package is in commit ``sha``: where it is installed from, if that is in this
        checkout, else ``a/b/`` or ``src/a/b/`` (a package), ``a.py`` or ``src/a.py`` (a module)."""
        dotted = self.package.replace(".", "/")
        candidates = [f"{dotted}/__init__.py", f"src/{dotted}/__init__.py", f"{dotted}.py", f"src/{dotted}.py"]
        installed = _installed_at(self.package)
        if installed is not None and installed.is_relative_to(self.repo):
            relative = installed.relative_to(self.repo).as_posix()
            candidates.insert(0, f"{relative}/__init__.py" if installed.is_dir() else relative)
        listed = set(self.git("ls-tree", "-r", "--name-only", sha, "--", *candidates, what=flag).split("\n"))
        found = next((c for c in candidates if c in listed), None)
        if found is None:
            raise RevisionError(
                f"{flag}: {self.repo} at {sha[:7]} does not hold the subject's package {self.package}"
                f" (looked for {', '.join(candidates)})"
            )
        return found.removesuffix("/__init__.py")


def subject_package(subject: object, subject_name: str) -> str | None:
    """The package a revision swaps: the subject's ``package``, else a ``module:factory``'s top-level
    module; None for a subject installed with no package of its own named."""
    declared = getattr(subject, "package", None)
    if declared:
        return declared
    return subject_name.split(":")[0].split(".")[0] if ":" in subject_name else None


def find_source(package: str | None, subject_name: str, source: Path | None) -> Source:
    """The checkout of ``--source PATH``, or, by default, the one the package is imported from."""
    if package is None:
        raise RevisionError(
            f"--base: subject {subject_name!r} names no source package (an installed wheel): it has no revisions"
        )
    if source is None:
        installed = _installed_at(package)
        if installed is None:
            raise RevisionError(f"--base: subject {subject_name!r}: package {package} is not importable")
        folder = installed if installed.is_dir() else installed.parent
        top = _toplevel(folder, f"--base: package {package} at {installed} (name its checkout with --source)")
        return Source(top, package)
    if not source.is_dir():
        raise RevisionError(f"--source {source}: no such directory")
    return Source(_toplevel(source, f"--source {source}"), package)


def _toplevel(folder: Path, what: str) -> Path:
    done = subprocess.run(
        ["git", "-C", str(folder), "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise RevisionError(f"{what}: not in a git repository")
    return Path(done.stdout.strip()).resolve()


def _installed_at(package: str) -> Path | None:
    """The folder (a package) or file (a module) ``package`` is imported from, without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    origin = Path(spec.origin).resolve()
    return origin.parent if spec.submodule_search_locations is not None else origin


def default_cache_dir() -> Path:
    """Where materialised revisions live: ``$XDG_CACHE_HOME/harness/revisions``, else ``~/.cache/...``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harness" / "revisions"


def materialise(source: Source, label: str, rev: str | None, flag: str, cache: Path) -> Revision:
    """Revision ``rev`` of the source's package (None: the working tree as it is) in ``cache``."""
    sha, title = source.resolve(rev or "HEAD", flag)
    repo_path = source.package_path(sha, flag)
    if rev is None:
        files, dirty = _working_tree(source, repo_path)
    else:
        files, dirty = _archived(source, sha, repo_path, flag), None
    _compile_all(files, rev or WORKING_TREE, sha)
    key = sha + (f"-{dirty[:16]}" if dirty else "")
    package = _cached(cache, key, files) / "package"
    root = package / Path(repo_path).name if repo_path.endswith(".py") else package
    digests = {path: hashlib.sha256(data).hexdigest() for path, data in files.items() if path.endswith(".py")}
    return Revision(label, rev or WORKING_TREE, sha, title, dirty, source.package, repo_path, str(root), digests)


def _archived(source: Source, sha: str, repo_path: str, flag: str) -> dict[str, bytes]:
    """Every regular file of the package at ``sha``, as ``git archive`` hands it over, by path below
    the package's folder (a module: its own name)."""
    tar = source.git("archive", "--format=tar", sha, "--", repo_path, text=False, what=flag)
    files = {}
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        for member in archive.getmembers():
            if member.isfile():
                files[_below(member.name, repo_path)] = archive.extractfile(member).read()
    return files


def _working_tree(source: Source, repo_path: str) -> tuple[dict[str, bytes], str | None]:
    """The package's files as they are in the checkout (tracked and untracked, not ignored), and the
    hash of its changes against HEAD, None if it has none. Files another user could have written are
    refused: their bytes would be run."""
    listed = source.git("ls-files", "-z", "-c", "-o", "--exclude-standard", "--", repo_path, what="--head")
    files = {}
    for name in filter(None, listed.split("\0")):
        path = source.repo / name
        if not path.is_file() or path.is_symlink() or "__pycache__" in Path(name).parts:
            continue  # deleted in the working tree, a link (git archive would not follow it), or bytecode
        try:
            check_path(path)
        except TrustError as e:
            raise RevisionError(f"--head: the working tree's {e}") from None
        files[_below(name, repo_path)] = path.read_bytes()
    changes = source.git("status", "--porcelain", "--untracked-files=all", "--", repo_path, what="--head")
    dirty = None
    if any("__pycache__" not in line for line in changes.splitlines()):
        listing = json.dumps({p: hashlib.sha256(d).hexdigest() for p, d in sorted(files.items())})
        dirty = hashlib.sha256(listing.encode()).hexdigest()
    return files, dirty


def _below(name: str, repo_path: str) -> str:
    """A file's path below the package's folder: ``chunking/pass.py``; a module is its own name."""
    if name == repo_path:
        return Path(name).name
    return name[len(repo_path) + 1 :]


def _compile_all(files: dict[str, bytes], rev: str, sha: str) -> None:
    """Every Python file compiles, or the revision cannot be run: RevisionBuildError at its first error."""
    for path, data in sorted(files.items()):
        if not path.endswith(".py"):
            continue
        try:
            compile(data, path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as e:
            line = getattr(e, "lineno", None)
            where = f"{path}:{line}" if line else path
            raise RevisionBuildError(f"revision {rev} ({sha[:7]}) does not build: {where}: {e}") from None


def _cached(cache: Path, key: str, files: dict[str, bytes]) -> Path:
    """``cache/<key>``, holding exactly ``files`` (laid out as the repository does, under the package's
    path); made anew when it is missing or differs. The cache must be the user's own (StrictModes)."""
    make_private_folders(cache)
    try:
        check_path(cache)
    except TrustError as e:
        raise RevisionError(f"revision cache {e}: not used (name another with $XDG_CACHE_HOME)") from None
    folder = cache / key
    if folder.is_dir() and _holds(folder, files):
        return folder
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=f".{key}."))  # 0700
    for path, data in files.items():
        target = staging / "package" / path
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        target.write_bytes(data)
    shutil.rmtree(folder, ignore_errors=True)
    try:
        os.rename(staging, folder)
    except OSError:  # made meanwhile by another run: it holds the same bytes, which the ranks verify
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _holds(folder: Path, files: dict[str, bytes]) -> bool:
    package = folder / "package"
    on_disk = {p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file()}
    return on_disk == set(files) and all((package / p).read_bytes() == d for p, d in files.items())
