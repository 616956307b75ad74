"""The trace cache in one process: a hit builds the same graph as a trace and trains bit for bit the
same, a changed reference source file misses, a cached faulty graph still fails its static checks,
and an entry that cannot be read or written costs a trace, never the run. A folder, key or entry
that another user could have written is never trusted: nothing in it runs, and the run says so
(end to end, on the command line, too)."""

from __future__ import annotations

import os
import pickle
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from harness.prepare import usable_trace_cache
from harness.reference.chunking.graph_step import ScheduledGraph
from harness.reference.chunking.trace_cache import (
    REFERENCE_ROOT,
    CacheSlot,
    GraphCache,
    open_cache,
)
from harness.reference.train import TrainConfig, Trainer
from harness.subject import load_subject
from harness.trust import TAG_BYTES, TrustError, default_key_file

CONFIG = TrainConfig(ep=1, chunking="eager-traced")
TAG_MISMATCH = "refused (its tag does not match the user's key: altered, cut short or signed with another key)"
ANOTHER_UID = 12345


class WritesAFile:
    """Pickled, it creates ``marker`` as it is loaded: what a user who can write a cache entry could plant."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return Path.touch, (self.marker,)


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    """A copy of the reference's sources: the key hashes these, so a test may edit them."""
    return Path(shutil.copytree(REFERENCE_ROOT, tmp_path / "reference"))


def build(config: TrainConfig, cache: GraphCache) -> Trainer:
    trainer = Trainer(config, trace_cache=cache)
    trainer.close()
    return trainer


@dataclass
class Traced:
    trainer: Trainer  # CONFIG built into an empty cache folder: traced (a miss), then stored
    entry: Path  # the entry it stored


@pytest.fixture(scope="module")
def traced_once(tmp_path_factory: pytest.TempPathFactory, session_dir: Path) -> Traced:
    """CONFIG traced once for the module, its entry signed with the session's key (conftest.py), which
    every test here signs with. A test whose cache must hold that entry first copies it
    (:func:`cache_holding`) rather than tracing again; only test_a_hit_builds_and_trains_exactly_as_a_trace
    trains the trainer."""
    folder = tmp_path_factory.mktemp("traced") / "cache"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XDG_CONFIG_HOME", str(session_dir / "config"))
        trainer = build(CONFIG, GraphCache(folder))  # the sources' digest is their copies' (relative paths)
    return Traced(trainer, only_entry(folder))


def cache_holding(entry: Path, folder: Path) -> Path:
    """``folder``, made private as the cache makes it, holding a copy of ``entry`` (its 0600 mode
    too): what building CONFIG into an empty ``folder`` leaves. The copy's path."""
    folder.mkdir(mode=0o700, parents=True)
    return Path(shutil.copy2(entry, folder))


def train(trainer: Trainer, steps: int = 3) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in (trainer.step(step) for step in range(1, steps + 1))]


def only_entry(folder: Path) -> Path:
    (entry,) = folder.glob("*.graph")
    return entry


def mode(path: Path) -> int:
    return path.lstat().st_mode & 0o7777


def test_a_hit_builds_and_trains_exactly_as_a_trace(traced_once: Traced, tmp_path: Path, sources: Path) -> None:
    entry, traced = traced_once.entry, traced_once.trainer
    assert traced.graph_build["origin"] == "trace" and traced.graph_build["cache"] == "miss"
    assert list(entry.parent.glob("*.graph")) == [entry]
    cache_holding(entry, tmp_path / "cache")

    cached = build(CONFIG, GraphCache(tmp_path / "cache", sources))
    assert cached.graph_build["origin"] == "cache" and cached.graph_build["cache"] == "hit"
    assert "trace" not in cached.graph_build["seconds"]
    assert cached.graph_step.gm.code == traced.graph_step.gm.code
    assert cached.graph_export == traced.graph_export
    assert [(c.name, c.status) for c in cached.graph_step.checks] == [
        (c.name, c.status) for c in traced.graph_step.checks
    ]

    assert train(cached) == train(traced)
    for (name, a), (_, b) in zip(
        traced.replicas[0].model.named_parameters(), cached.replicas[0].model.named_parameters()
    ):
        assert torch.equal(a, b), name


def test_a_changed_reference_source_misses(traced_once: Traced, tmp_path: Path, sources: Path) -> None:
    cache_holding(traced_once.entry, tmp_path / "cache")
    assert build(CONFIG, GraphCache(tmp_path / "cache", sources)).graph_build["cache"] == "hit"

    pass_file = sources / "chunking" / "graph.py"
    pass_file.write_text(pass_file.read_text() + "\n# a changed pass\n")
    changed = build(CONFIG, GraphCache(tmp_path / "cache", sources))
    assert changed.graph_build["origin"] == "trace" and changed.graph_build["cache"] == "miss"
    assert len(list((tmp_path / "cache").glob("*.graph"))) == 2


def test_another_config_misses(traced_once: Traced, tmp_path: Path, sources: Path) -> None:
    cache_holding(traced_once.entry, tmp_path / "cache")
    other = TrainConfig(ep=1, chunking="eager-traced", chunks=4)
    assert build(other, GraphCache(tmp_path / "cache", sources)).graph_build["cache"] == "miss"


def test_a_cached_faulty_graph_fails_the_same_static_checks(tmp_path: Path, sources: Path) -> None:
    faulty = TrainConfig(ep=1, chunking="graph", fault="forward-order-backward")  # baked into the cached graph
    traced = build(faulty, GraphCache(tmp_path / "cache", sources))
    cached = build(faulty, GraphCache(tmp_path / "cache", sources))
    assert cached.graph_build["cache"] == "hit"

    def failed(trainer: Trainer) -> set[str]:
        return {c.name for c in trainer.graph_step.checks if c.status == "fail"}

    assert failed(cached) == failed(traced) == {"graph:chunk-order"}


def test_an_unreadable_entry_is_traced_again_and_replaced(traced_once: Traced, tmp_path: Path, sources: Path) -> None:
    entry = cache_holding(traced_once.entry, tmp_path / "cache")
    entry.write_bytes(entry.read_bytes()[:1000])  # cut short, as by a full disk

    retraced = build(CONFIG, GraphCache(tmp_path / "cache", sources))
    assert retraced.graph_build["origin"] == "trace"
    assert retraced.graph_build["cache"] == TAG_MISMATCH
    assert build(CONFIG, GraphCache(tmp_path / "cache", sources)).graph_build["cache"] == "hit"


def test_an_unwritable_cache_costs_only_the_trace(tmp_path: Path, sources: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    trainer = build(CONFIG, GraphCache(blocker / "cache", sources))
    assert trainer.graph_build["origin"] == "trace"
    assert trainer.graph_build["cache"].startswith("unwritable (")
    assert train(trainer, 1)[0][0] > 0


def test_an_entry_replaced_by_code_is_refused_unrun_and_replaced(
    traced_once: Traced, tmp_path: Path, sources: Path
) -> None:
    entry, marker = cache_holding(traced_once.entry, tmp_path / "cache"), tmp_path / "ran"
    entry.write_bytes(pickle.dumps(WritesAFile(marker)))

    retraced = build(CONFIG, GraphCache(tmp_path / "cache", sources))
    assert not marker.exists()
    assert (retraced.graph_build["origin"], retraced.graph_build["cache"]) == ("trace", TAG_MISMATCH)
    assert retraced.graph_build["entry"] == str(entry)
    assert build(CONFIG, GraphCache(tmp_path / "cache", sources)).graph_build["cache"] == "hit"


def test_code_ahead_of_the_real_graph_signed_with_another_key_never_runs(
    traced_once: Traced, tmp_path: Path, sources: Path
) -> None:
    entry, marker = cache_holding(traced_once.entry, tmp_path / "cache"), tmp_path / "ran"
    graph = CacheSlot(entry, open_cache(tmp_path / "cache")).load(ScheduledGraph)
    assert isinstance(graph, ScheduledGraph)
    CacheSlot(entry, b"another user's key").store((WritesAFile(marker), graph))

    retraced = build(CONFIG, GraphCache(tmp_path / "cache", sources))
    assert not marker.exists()
    assert (retraced.graph_build["origin"], retraced.graph_build["cache"]) == ("trace", TAG_MISMATCH)


def test_a_signed_entry_of_another_type_is_a_miss_and_replaced(
    traced_once: Traced, tmp_path: Path, sources: Path
) -> None:
    entry = cache_holding(traced_once.entry, tmp_path / "cache")
    CacheSlot(entry, open_cache(tmp_path / "cache")).store(42)

    retraced = build(CONFIG, GraphCache(tmp_path / "cache", sources))
    assert retraced.graph_build["origin"] == "trace"
    assert retraced.graph_build["cache"] == "unreadable (expected a ScheduledGraph, got int)"
    assert build(CONFIG, GraphCache(tmp_path / "cache", sources)).graph_build["cache"] == "hit"


@pytest.mark.parametrize(
    "foreign,why",
    [
        (lambda entry: os.chown(entry, ANOTHER_UID, ANOTHER_UID), f"owned by uid {ANOTHER_UID}, expected this"),
        (lambda entry: entry.symlink_to(entry.rename(entry.with_suffix(".elsewhere"))), "a symbolic link"),
    ],
    ids=["another-users", "symlink"],
)
def test_an_entry_that_is_not_the_users_own_file_is_refused_and_replaced(
    traced_once: Traced, tmp_path: Path, sources: Path, foreign, why: str
) -> None:
    """Not even opened: the symbolic link points to a valid entry of the user's."""
    entry = cache_holding(traced_once.entry, tmp_path / "cache")
    foreign(entry)

    retraced = build(CONFIG, GraphCache(tmp_path / "cache", sources))
    assert retraced.graph_build["origin"] == "trace"
    assert retraced.graph_build["cache"].startswith(f"refused ({why}")
    assert entry.is_file() and not entry.is_symlink() and entry.stat().st_uid == os.geteuid()
    assert build(CONFIG, GraphCache(tmp_path / "cache", sources)).graph_build["cache"] == "hit"


@pytest.mark.parametrize(
    "unsafe,why",
    [
        (lambda folder: folder.chmod(0o777), "mode 0777 is writable by others without the sticky bit"),
        (lambda folder: folder.chmod(0o770), "mode 0770 is writable by others without the sticky bit"),
        (lambda folder: os.chown(folder, ANOTHER_UID, ANOTHER_UID), f"owned by uid {ANOTHER_UID}, expected this"),
    ],
    ids=["world-writable", "group-writable", "another-users"],
)
def test_a_folder_others_could_write_is_neither_read_nor_written(
    traced_once: Traced, tmp_path: Path, sources: Path, unsafe, why: str
) -> None:
    folder = tmp_path / "cache"
    entry = cache_holding(traced_once.entry, folder)
    written = entry.read_bytes()
    unsafe(folder)

    retraced = build(CONFIG, GraphCache(folder, sources))
    assert retraced.graph_build["origin"] == "trace"
    assert retraced.graph_build["cache"].startswith(f"off ({folder}: {why}")
    assert [entry] == list(folder.iterdir()) and entry.read_bytes() == written
    with pytest.raises(TrustError, match=why):
        open_cache(folder)


def test_a_sticky_folder_of_the_users_is_used(tmp_path: Path, sources: Path) -> None:
    """Like /tmp: others may add entries, but not replace the user's (and theirs are refused)."""
    folder = tmp_path / "cache"
    folder.mkdir()
    folder.chmod(0o1777)
    assert build(CONFIG, GraphCache(folder, sources)).graph_build["cache"] == "miss"
    assert build(CONFIG, GraphCache(folder, sources)).graph_build["cache"] == "hit"


def test_what_the_cache_makes_only_its_user_may_open(
    tmp_path: Path, sources: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    umask = os.umask(0o002)  # a user's umask that shares with the group
    try:
        build(CONFIG, GraphCache(tmp_path / "made" / "cache", sources))
    finally:
        os.umask(umask)
    key = tmp_path / "config" / "harness" / "trace-cache.key"
    assert default_key_file() == key
    made = [tmp_path / "made", tmp_path / "made" / "cache", tmp_path / "config", key.parent]
    assert [mode(folder) for folder in made] == [0o700] * 4
    assert (mode(only_entry(tmp_path / "made" / "cache")), mode(key)) == (0o600, 0o600)


def test_a_key_others_may_read_turns_the_cache_off(tmp_path: Path, sources: Path) -> None:
    key = tmp_path / "trace-cache.key"
    open_cache(tmp_path / "cache", key)
    key.chmod(0o640)

    trainer = build(CONFIG, GraphCache(tmp_path / "cache", sources, key_file=key))
    assert trainer.graph_build["origin"] == "trace"
    assert trainer.graph_build["cache"] == f"off ({key}: expected mode 0600 (no access for others), got 0640)"
    assert not (tmp_path / "cache").exists()


def test_the_harness_turns_an_unsafe_cache_off_before_launching_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    folder = tmp_path / "cache"
    reference = load_subject("reference")
    assert usable_trace_cache(folder, reference) == (folder, None)
    default_key_file().chmod(0o644)
    why = "expected mode 0600 (no access for others), got 0644"
    line = f"trace cache {default_key_file()}: not used: {why}; tracing instead"
    assert usable_trace_cache(folder, reference) == (None, line)
    assert usable_trace_cache(None, reference) == (None, None)


def test_processes_making_the_key_at_once_agree_on_one(tmp_path: Path) -> None:
    key, racers = tmp_path / "config" / "trace-cache.key", 8
    start = threading.Barrier(racers)

    def make() -> bytes:
        start.wait()
        return open_cache(tmp_path / "cache", key)

    with ThreadPoolExecutor(racers) as pool:
        keys = set(pool.map(lambda _: make(), range(racers)))
    assert len(keys) == 1 and [p.name for p in key.parent.iterdir()] == [key.name]


# The graph arm of parity alone, for one step: what the cache holds, at the least cost.
ONE_TRACED_ARM = """
name = "traced"
description = "parity's graph arm alone"
ranks = 2
steps = 1
model = { config = "cpu-tiny" }
train = { seed = 42, routing = "forced-balanced", local_batch = 4, seq_len = 32, chunking = "graph", chunks = 2 }
arms = { graph = {} }
checks = [{ kind = "token-exchange-invariants" }]
"""


def test_a_cache_folder_others_could_write_never_runs_their_code_and_the_run_says_so_once(
    run_harness, tmp_path: Path
) -> None:
    """End to end, 2 ranks of a traced arm: entries replaced by code are refused and traced again (one
    line for both), and in a folder anyone may write, another user's entries holding code ahead of
    the real graph are not read at all (one line): both runs pass, and the code never runs."""
    cache, marker = tmp_path / "cache", tmp_path / "ran"
    suite = tmp_path / "traced.toml"
    suite.write_text(ONE_TRACED_ARM)

    def run(name: str) -> tuple[list[str], dict]:
        out = tmp_path / name
        done = run_harness("run", suite, "--golden", "off", "--trace-cache", cache, "--out", out)
        assert done.returncode == 0, done.stdout + done.stderr
        builds = {s["arm"]: s["detail"] for s in done.summary(out)["timing"]["timeline"] if s["segment"] == "build"}
        return [line for line in done.stdout.splitlines() if line.startswith("trace cache")], builds

    run("first")
    entries = sorted(cache.glob("*.graph"))
    assert len(entries) == 2
    for entry in entries:
        entry.write_bytes(pickle.dumps(WritesAFile(marker)))
    notes, builds = run("replaced")
    assert not marker.exists()
    assert notes == [f"trace cache entries {', '.join(map(str, entries))}: {TAG_MISMATCH}; traced instead"]
    assert builds["graph"] == f"trace, cache {TAG_MISMATCH} on 2 ranks"
    key = open_cache(cache)
    assert all(isinstance(CacheSlot(entry, key).load(ScheduledGraph), ScheduledGraph) for entry in entries)

    for entry in entries:
        entry.write_bytes(pickle.dumps(WritesAFile(marker)) + entry.read_bytes()[TAG_BYTES:])
        os.chown(entry, ANOTHER_UID, ANOTHER_UID)
    cache.chmod(0o777)
    notes, builds = run("shared")
    assert not marker.exists()
    assert notes == [
        f"trace cache {cache}: not used: mode 0777 is writable by others without the sticky bit; tracing instead"
    ]
    assert builds["graph"] == "trace, cache off on 2 ranks"
