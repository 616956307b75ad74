"""Real git repositories for the tests of change checks: a repository the test makes, commits to,
and reads back (no mock of git)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import harness

REFERENCE = Path(harness.__file__).resolve().parent / "reference"
_IDENTITY = ("-c", "user.name=harness tests", "-c", "user.email=tests@harness.invalid")
# Commits of the same tree, parents and message get the same sha in every test process: what one xdist
# worker materialised or kept for a revision, another finds.
_DATES = {"GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}


class GitRepo:
    """A git repository at ``root``: ``commit`` applies an edit and commits it, returning its sha."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.git("init", "-q", "-b", "main")

    def git(self, *args: str) -> str:
        command = ["git", *_IDENTITY, "-C", str(self.root), *args]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **_DATES})
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def commit(self, message: str, edit: Callable[[Path], None]) -> str:
        edit(self.root)
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)
        return self.git("rev-parse", "HEAD")


def copy_reference(root: Path) -> None:
    """The bundled reference's package, as the harness ships it, at ``harness/reference/`` under ``root``."""
    shutil.copytree(REFERENCE, root / "harness" / "reference", ignore=shutil.ignore_patterns("__pycache__"))


def replace_in(path: str, old: str, new: str) -> Callable[[Path], None]:
    """An edit that replaces the one occurrence of ``old`` in the file at ``path`` (relative to the repository)."""

    def edit(root: Path) -> None:
        file = root / path
        text = file.read_text()
        assert text.count(old) == 1, f"{path}: {old!r} occurs {text.count(old)} times"
        file.write_text(text.replace(old, new))

    return edit


def append_to(path: str, line: str) -> Callable[[Path], None]:
    """An edit that appends ``line`` to the file at ``path`` (relative to the repository)."""

    def edit(root: Path) -> None:
        with (root / path).open("a") as file:
            file.write(line + "\n")

    return edit


# The reference's routed scaling factor applied twice: the router's weights scaled by its square.
ROUTED_SCALING_TWICE = replace_in(
    "harness/reference/model.py",
    "return ids, weights * self.scale\n",
    "return ids, weights * self.scale * self.scale\n",
)
# A comment, and nothing else.
COMMENT_ONLY = replace_in(
    "harness/reference/model.py", "return ids, weights * self.scale\n", "return ids, weights * self.scale  # scaled\n"
)

# One eager arm of the reference whose router scales its weights (cpu-tiny's own factor is 1.0, which scaling
# twice would leave as it is): the suite of the change and bisect tests.
# ONE_ARM_SUITE on one process (EP 1): each launch starts one rank process, not two, and ops can be recorded.
ONE_PROCESS = ("--ranks", 1)
ONE_ARM_SUITE = """
name = "change-one"
description = "one eager arm of the reference"
ranks = 2
steps = 3
[model]
config = "cpu-tiny"
routed_scaling_factor = 2.5
[train]
seed = 42
routing = "forced-balanced"
local_batch = 4
seq_len = 32
chunks = 2
chunk_roots = "moe"
chunk_dim = "batch"
[arms.eager]
chunking = "eager"
[[checks]]
kind = "ranks-agree"
"""
