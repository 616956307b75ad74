"""A base judged once is not run again: the records of a change check's base arms, kept between runs.

A base revision is a commit, and a commit does not change; so the records its arms leave are
reusable by the next change check against the same base (the next push to the same pull request,
the next probe of a bisect). They are kept under a key of everything they depend on: the base's
sha, the harness's own code (its modules other than the subject package it swaps: the recorder,
the record formats, the subject's adapter), the base arms as resolved (steps, configs, seeds,
processes, fault injection), and the environment key (device, kernel ISA, dtype, versions). A run
whose key is found restores the records into its run directory and launches only the head.

An entry is one file, ``$XDG_CACHE_HOME/harness/bases/<key>.json``: the HMAC-SHA256 tag of its
payload under the user's key (harness/trust.py), then the payload, JSON text only (never a pickle),
every arm file by name. It is read once through one descriptor and used only if its tag checks; a
refused or unreadable entry is a miss, said in one line, and the base runs. A base arm whose files
are not all JSON (a checkpoint of a resumed arm) is not kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
from harness.rundir import ARMS_DIR
from harness.specs import SuiteSpec
from harness.trust import (
    TAG_BYTES,
    TrustError,
    check_path,
    make_private_folders,
    open_own_file,
    tag,
    tag_matches,
    user_key,
)

RECORD_SUFFIXES = (".json", ".jsonl")
log = logging.getLogger("harness")


@dataclass(frozen=True)
class BaseRecords:
    """Where a change check's base records are kept (``key`` in ``cache``), which arms they are, and
    whether this run restored them instead of running the base (``line`` says which, and why)."""

    cache: Path
    key: str
    arms: tuple[str, ...]
    restored: bool
    line: str


def reuse_base(suite: SuiteSpec, base_sha: str, package: str, env_key: str, run_dir: Path) -> BaseRecords:
    """The base's records restored into ``run_dir`` where they are kept, else the plan to keep them."""
    cache, key = default_base_cache(), base_key(suite, base_sha, env_key, package)
    arms = tuple(name for name, arm in suite.arms.items() if arm.revision == "base")
    try:
        return BaseRecords(cache, key, arms, True, restore(cache, key, run_dir, list(arms)))
    except LookupError as e:
        return BaseRecords(cache, key, arms, False, str(e))


def keep_base(base: BaseRecords, run_dir: Path, complete: bool) -> str | None:
    """Keeps the base's records of a run that ran it (not restored) to its last step; the line saying
    so, or None. A failure to write the cache is a line too: it never fails the run."""
    if base.restored or not complete:
        return None
    try:
        return keep(base.cache, base.key, run_dir, list(base.arms))
    except (OSError, TrustError) as e:
        return f"base: records not kept: {e}"


def default_base_cache() -> Path:
    """``$XDG_CACHE_HOME/harness/bases``, else ``~/.cache/harness/bases``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harness" / "bases"


def base_key(suite: SuiteSpec, base_sha: str, env_key: str, package: str) -> str:
    """The key of a base's records: see the module's docstring for what goes in."""
    arms = {name: dataclasses.asdict(arm) for name, arm in suite.arms.items() if arm.revision == "base"}
    described = {
        "base": base_sha,
        "harness": harness_digest(package),
        "steps": suite.steps,
        "arms": arms,
        "debug": dataclasses.asdict(suite.debug),
        "env": env_key,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


def harness_digest(package: str) -> str:
    """sha256 over the harness's own Python files but the subject's package (whose revision is the base's)."""
    root = Path(harness.__file__).resolve().parent
    swapped = root.parent / package.replace(".", "/")
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if path.is_relative_to(swapped):
            continue
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def restore(cache: Path, key: str, run_dir: Path, arms: list[str]) -> str:
    """Writes the entry's records of ``arms`` into ``run_dir/arms/``; the line saying what happened.
    Raises LookupError when there is no usable entry (its line says why, when it was refused)."""
    path = cache / f"{key}.json"
    try:
        if not cache.is_dir():
            raise FileNotFoundError(cache)
        check_path(cache)
        with open_own_file(path) as file:
            data = file.read()
        payload = data[TAG_BYTES:]
        if not tag_matches(user_key(), path.name, payload, data[:TAG_BYTES]):
            raise TrustError(
                path, "its tag does not match the user's key: altered, cut short or signed with another key"
            )
        records: dict[str, dict[str, str]] = json.loads(payload)["arms"]
    except FileNotFoundError:
        raise LookupError(f"base: not cached yet: running it (it will be kept in {cache})") from None
    except (TrustError, OSError, ValueError, KeyError, TypeError) as e:
        raise LookupError(f"base: cached records not used ({e}): running it") from None
    if sorted(records) != sorted(arms):
        raise LookupError(f"base: cached records hold arms {sorted(records)}, not {sorted(arms)}: running it")
    for arm, files in records.items():
        folder = run_dir / ARMS_DIR / arm
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            if "/" in name or name.startswith(".") or not name.endswith(RECORD_SUFFIXES):
                raise LookupError(f"base: cached records name a file {name!r} no arm writes: running it")
            (folder / name).write_text(text)
    return f"base: records of {len(arms)} arm{'s' if len(arms) != 1 else ''} reused from {path.name[:12]} (not run)"


def keep(cache: Path, key: str, run_dir: Path, arms: list[str]) -> str | None:
    """Stores the records of ``arms`` under ``key``; the line saying so, or None when an arm left a
    file that is not a JSON record (nothing is kept then)."""
    records: dict[str, dict[str, Any]] = {}
    for arm in arms:
        folder = run_dir / ARMS_DIR / arm
        files = sorted(p for p in folder.iterdir() if p.is_file())
        if not files or any(not p.name.endswith(RECORD_SUFFIXES) for p in files):
            return None
        records[arm] = {p.name: p.read_text() for p in files}
    payload = json.dumps({"arms": records}).encode()
    make_private_folders(cache)
    check_path(cache)
    path = cache / f"{key}.json"
    fd, staged = tempfile.mkstemp(dir=cache, prefix=f".{path.name}.")  # 0600
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(tag(user_key(), path.name, payload) + payload)
        os.replace(staged, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
    return f"base: records of {len(arms)} arm{'s' if len(arms) != 1 else ''} kept for the next change against it"
