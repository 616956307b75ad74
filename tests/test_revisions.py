"""harness/revisions.py and harness/rank/revision.py: a revision of a package taken from a real git
repository, and imported only from the bytes git handed over."""

from __future__ import annotations

import hashlib
import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from git_repos import GitRepo

from harness.rank.revision import use_revision
from harness.revisions import (
    WORKING_TREE,
    RevisionBuildError,
    RevisionError,
    Source,
    find_source,
    materialise,
)

PACKAGE = "revtestpkg"  # a package no other test imports


def _package(version: str) -> callable:
    def edit(root: Path) -> None:
        (root / PACKAGE).mkdir(exist_ok=True)
        (root / PACKAGE / "__init__.py").write_text("from revtestpkg.core import VERSION\n")
        (root / PACKAGE / "core.py").write_text(f"VERSION = {version!r}\n")

    return edit


@pytest.fixture
def repo(tmp_path: Path) -> GitRepo:
    repo = GitRepo(tmp_path / "repo")
    repo.commit("one", _package("one"))
    repo.commit("two", _package("two"))
    return repo


@pytest.fixture
def clean_import() -> Iterator[None]:
    """The test's finder and modules are gone afterwards."""
    finders = list(sys.meta_path)
    yield
    sys.meta_path[:] = finders
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def test_a_commit_is_materialised_from_git_with_the_sha256_of_each_file(repo: GitRepo, tmp_path: Path) -> None:
    source = Source(repo.root, PACKAGE)
    first = materialise(source, "base", "HEAD~1", "--base", tmp_path / "cache")
    assert first.sha == repo.git("rev-parse", "HEAD~1") and first.title == "one" and first.dirty is None
    core = Path(first.root) / "core.py"
    assert core.read_text() == "VERSION = 'one'\n"
    assert first.files["core.py"] == hashlib.sha256(core.read_bytes()).hexdigest()
    assert first.describe() == f"HEAD~1 ({first.sha[:7]})"
    # The working tree is the head by default: clean, it is HEAD's commit (bytecode aside); changed, it says so.
    (repo.root / PACKAGE / "__pycache__").mkdir()
    (repo.root / PACKAGE / "__pycache__" / "core.cpython-311.pyc").write_bytes(b"not source")
    clean = materialise(source, "head", None, "--head", tmp_path / "cache")
    assert clean.dirty is None and "__pycache__/core.cpython-311.pyc" not in clean.files
    (repo.root / PACKAGE / "core.py").write_text("VERSION = 'three'\n")
    head = materialise(source, "head", None, "--head", tmp_path / "cache")
    assert head.spec == WORKING_TREE and head.dirty and head.short == f"{head.sha[:7]}, +dirty"
    assert (Path(head.root) / "core.py").read_text() == "VERSION = 'three'\n"


def test_a_cache_entry_changed_on_disk_is_made_again(repo: GitRepo, tmp_path: Path) -> None:
    source, cache = Source(repo.root, PACKAGE), tmp_path / "cache"
    revision = materialise(source, "base", "HEAD", "--base", cache)
    core = Path(revision.root) / "core.py"
    core.write_text("VERSION = 'planted'\n")
    again = materialise(source, "base", "HEAD", "--base", cache)
    assert (Path(again.root) / "core.py").read_text() == "VERSION = 'two'\n"


def test_the_rank_imports_the_revisions_bytes_and_refuses_bytes_changed_after_the_check(
    repo: GitRepo, tmp_path: Path, clean_import: None
) -> None:
    revision = materialise(Source(repo.root, PACKAGE), "base", "HEAD~1", "--base", tmp_path / "cache")
    (Path(revision.root) / "core.py").write_text("VERSION = 'swapped'\n")  # after the harness checked it
    with pytest.raises(ImportError, match="not the bytes of revision HEAD~1"):
        use_revision(revision)


def test_the_rank_imports_the_package_from_its_revision(repo: GitRepo, tmp_path: Path, clean_import: None) -> None:
    revision = materialise(Source(repo.root, PACKAGE), "base", "HEAD~1", "--base", tmp_path / "cache")
    use_revision(revision)
    module = importlib.import_module(PACKAGE)
    assert module.VERSION == "one" and Path(module.__file__).parent == Path(revision.root)
    with pytest.raises(RuntimeError, match="imported before"):
        use_revision(revision)


@pytest.mark.parametrize(
    ("rev", "message"),
    [
        ("no-such-branch", "--base no-such-branch: "),
        ("--upload-pack=x", "--base --upload-pack=x: not a revision"),
    ],
)
def test_a_revision_that_does_not_resolve_is_one_line(repo: GitRepo, tmp_path: Path, rev: str, message: str) -> None:
    with pytest.raises(RevisionError, match=message):
        materialise(Source(repo.root, PACKAGE), "base", rev, "--base", tmp_path / "cache")


def test_a_source_that_does_not_hold_the_package_is_refused(repo: GitRepo, tmp_path: Path) -> None:
    with pytest.raises(RevisionError, match="does not hold the subject's package otherpkg"):
        materialise(Source(repo.root, "otherpkg"), "base", "HEAD", "--base", tmp_path / "cache")


def test_a_source_that_is_not_a_git_checkout_or_a_subject_without_a_package_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RevisionError, match=f"--source {tmp_path}: not in a git repository"):
        find_source("json", "x:subject", tmp_path)
    with pytest.raises(RevisionError, match="names no source package"):
        find_source(None, "installed", None)
    (tmp_path / "lonepkg").mkdir()
    (tmp_path / "lonepkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))  # installed, as a wheel would be: in no checkout
    with pytest.raises(RevisionError, match="package lonepkg at .* not in a git repository"):
        find_source("lonepkg", "x:subject", None)


def test_a_revision_that_does_not_compile_cannot_be_built(repo: GitRepo, tmp_path: Path) -> None:
    repo.commit("broken", lambda root: (root / PACKAGE / "broken.py").write_text("def broken(:\n"))
    with pytest.raises(RevisionBuildError, match=r"does not build: broken.py:1"):
        materialise(Source(repo.root, PACKAGE), "head", "HEAD", "--head", tmp_path / "cache")


def test_a_working_tree_file_others_may_write_is_refused(repo: GitRepo, tmp_path: Path) -> None:
    core = repo.root / PACKAGE / "core.py"
    core.chmod(0o666)
    with pytest.raises(RevisionError, match="core.py: mode 0666 is writable by others"):
        materialise(Source(repo.root, PACKAGE), "head", None, "--head", tmp_path / "cache")


def test_a_cache_folder_others_may_write_is_refused(repo: GitRepo, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o777)
    cache.chmod(0o777)
    with pytest.raises(RevisionError, match="revision cache .* writable by others"):
        materialise(Source(repo.root, PACKAGE), "base", "HEAD", "--base", cache)


def test_the_installed_package_in_a_checkout_is_found_there() -> None:
    source = find_source("harness.reference", "reference", None)
    top = subprocess.run(["git", "-C", str(source.repo), "rev-parse", "--show-toplevel"], capture_output=True)
    assert top.returncode == 0 and (source.repo / "harness" / "reference" / "__init__.py").is_file()
