"""The trace cache in one process: a hit builds the same graph as a trace and trains bit for bit the
same, a changed reference source file misses, a cached faulty graph still fails its static checks,
and an entry that cannot be read or written costs a trace, never the run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from harness.reference.chunking.trace_cache import REFERENCE_ROOT, GraphCache
from harness.reference.train import TrainConfig, Trainer

CONFIG = TrainConfig(ep=1, chunking="eager-traced")


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    """A copy of the reference's sources: the key hashes these, so a test may edit them."""
    return Path(shutil.copytree(REFERENCE_ROOT, tmp_path / "reference"))


def build(config: TrainConfig, cache: GraphCache) -> Trainer:
    trainer = Trainer(config, trace_cache=cache)
    trainer.close()
    return trainer


def train(trainer: Trainer, steps: int = 3) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in (trainer.step(step) for step in range(1, steps + 1))]


def test_a_hit_builds_and_trains_exactly_as_a_trace(tmp_path: Path, sources: Path) -> None:
    traced = build(CONFIG, GraphCache(tmp_path / "cache", sources))
    assert traced.graph_build["origin"] == "trace" and traced.graph_build["cache"] == "miss"
    assert len(list((tmp_path / "cache").glob("*.graph"))) == 1

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


def test_a_changed_reference_source_misses(tmp_path: Path, sources: Path) -> None:
    build(CONFIG, GraphCache(tmp_path / "cache", sources))
    assert build(CONFIG, GraphCache(tmp_path / "cache", sources)).graph_build["cache"] == "hit"

    pass_file = sources / "chunking" / "graph.py"
    pass_file.write_text(pass_file.read_text() + "\n# a changed pass\n")
    changed = build(CONFIG, GraphCache(tmp_path / "cache", sources))
    assert changed.graph_build["origin"] == "trace" and changed.graph_build["cache"] == "miss"
    assert len(list((tmp_path / "cache").glob("*.graph"))) == 2


def test_another_config_misses(tmp_path: Path, sources: Path) -> None:
    build(CONFIG, GraphCache(tmp_path / "cache", sources))
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


def test_an_unreadable_entry_is_traced_again_and_replaced(tmp_path: Path, sources: Path) -> None:
    build(CONFIG, GraphCache(tmp_path / "cache", sources))
    (entry,) = (tmp_path / "cache").glob("*.graph")
    entry.write_bytes(entry.read_bytes()[:1000])  # cut short, as by a full disk

    retraced = build(CONFIG, GraphCache(tmp_path / "cache", sources))
    assert retraced.graph_build["origin"] == "trace"
    assert retraced.graph_build["cache"].startswith("unreadable (")
    assert build(CONFIG, GraphCache(tmp_path / "cache", sources)).graph_build["cache"] == "hit"


def test_an_unwritable_cache_costs_only_the_trace(tmp_path: Path, sources: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    trainer = build(CONFIG, GraphCache(blocker / "cache", sources))
    assert trainer.graph_build["origin"] == "trace"
    assert trainer.graph_build["cache"].startswith("unwritable (")
    assert train(trainer, 1)[0][0] > 0
