"""The delayed oracle: the versioned pipeline equals it bit for bit (records, every gradient, final
weights) across delays, corrections and retention modes, and it catches bugs planted in the pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.checks.exchange import delayed_oracle_plan
from harness.records import read_jsonl
from harness.reference.delayed_oracle import DelayedOracleTrainer
from harness.reference.pipeline import PipelineConfig, VersionedTrainer
from harness.suites import SuiteError, load_suite

EP = {"ep": 2, "chunking": "eager", "chunks": 2}
STEPS = 5  # fill, steady state and drain at delay 2
# Record fields both trainers must agree on; forwards are counted per tick and differ by design
# (the pipeline forwards at the forward's tick, the oracle at the update's).
SHARED = ("step", "tick", "loss", "grad_norm", "revision", "ages", "batches_applied", "tokens")
STATS = ("correction_mean", "correction_clipped_frac")


def train(trainer_class: type, config: PipelineConfig, steps: int = STEPS) -> dict:
    """Records, every gradient after the dense sum, and the final weights of the logical ranks hosted here."""
    grads: dict = {}
    trainer = trainer_class(
        config, grad_sink=lambda r, s, g: grads.__setitem__((r, s), {n: t.clone() for n, t in g.items()})
    )
    try:
        records = [trainer.step(batch) for batch in range(1, steps + 1)]
        records = [r for r in records if r is not None] + trainer.drain()
        weights = {
            r: {n: p.detach().clone() for n, p in rep.model.named_parameters()} for r, rep in trainer.replicas.items()
        }
    finally:
        trainer.close()
    return {"records": records, "grads": grads, "weights": weights}


def assert_bitwise_equal(pipeline: dict, oracle: dict) -> None:
    fields = SHARED + STATS
    assert [{k: r[k] for k in fields} for r in pipeline["records"]] == [
        {k: r[k] for k in fields} for r in oracle["records"]
    ]
    assert pipeline["grads"].keys() == oracle["grads"].keys()
    for key, grads in pipeline["grads"].items():
        for name, grad in grads.items():
            assert torch.equal(grad, oracle["grads"][key][name]), f"gradient {name} at {key} differs"
    for rank, weights in pipeline["weights"].items():
        for name, weight in weights.items():
            assert torch.equal(weight, oracle["weights"][rank][name]), f"final weight {name} of rank {rank} differs"


@pytest.mark.parametrize("delay", [0, 1, 2])
@pytest.mark.parametrize("correction", ["off", "when_available", "always"])
def test_pipeline_equals_the_oracle_bitwise(delay: int, correction: str) -> None:
    config = PipelineConfig(**EP, delay=delay, correction=correction)
    pipeline, oracle = train(VersionedTrainer, config), train(DelayedOracleTrainer, config)
    assert_bitwise_equal(pipeline, oracle)
    assert [r["ages"] for r in oracle["records"]] == [[min(u, delay)] for u in range(STEPS)]
    assert [r["batches_applied"] for r in oracle["records"]] == [[b] for b in range(1, STEPS + 1)]


@pytest.mark.parametrize(
    "retention,delay,correction", [("offload", 2, "always"), ("replay", 2, "always"), ("replay", 1, "when_available")]
)
def test_every_retention_mode_equals_the_oracle_bitwise(retention: str, delay: int, correction: str) -> None:
    config = PipelineConfig(**EP, delay=delay, correction=correction, retention=retention)
    assert_bitwise_equal(train(VersionedTrainer, config), train(DelayedOracleTrainer, config))


def test_the_oracle_matches_while_the_correction_clip_is_active() -> None:
    config = PipelineConfig(**EP, delay=2, correction="always", correction_clip=1.01)
    pipeline, oracle = train(VersionedTrainer, config), train(DelayedOracleTrainer, config)
    clipped = [r["correction_clipped_frac"] for r in oracle["records"]]
    assert clipped[0] == 0.0 and all(c > 0 for c in clipped[1:]), clipped  # age 0 has weight 1, never clipped
    assert all(r["correction_mean"] <= 1.01 for r in oracle["records"])
    assert_bitwise_equal(pipeline, oracle)


def _both_trainers(config: PipelineConfig) -> tuple[dict, dict]:
    return train(VersionedTrainer, config), train(DelayedOracleTrainer, config)


def test_pipeline_equals_the_oracle_on_two_processes(run_on_ranks) -> None:
    ranks = run_on_ranks(2, _both_trainers, PipelineConfig(**EP, delay=2, correction="always", retention="replay"))
    for pipeline, oracle in ranks:
        assert_bitwise_equal(pipeline, oracle)
    shared = [[{k: r[k] for k in SHARED + STATS} for r in oracle["records"]] for _, oracle in ranks]
    assert shared[0] == shared[1]  # loss, grad norm and the correction's statistics are global


def test_oracle_plan_counts_its_exchanges_per_tick() -> None:
    """Nothing in the fill; then a forward and a backward per tick, plus the correction's forward."""
    assert delayed_oracle_plan(3, 2, always_correct=True) == {
        (2, "fwd"): 1, (2, "bwd"): 1,  # batch 0 was forwarded before any update: no correction forward
        (3, "fwd"): 2, (3, "bwd"): 1,
        (4, "fwd"): 2, (4, "bwd"): 1,
    }  # fmt: skip


ORACLE = 'trainer = "delayed-oracle"\n'
SUITE = """
name = "oracle"
description = "a versioned arm and its oracle"
ranks = 2
steps = 4
[arms.stale]
delay = 2
[arms.oracle]
delay = 2
trainer = "delayed-oracle"
[[checks]]
kind = "final-weights"
"""


@pytest.mark.parametrize(
    "fields,expected",
    [
        ('trainer = "naive"\n', "arms.oracle.trainer: trainer must be one of ('versioned', 'delayed-oracle')"),
        (
            ORACLE + "apply_twice_batch = 2\n",
            "arms.oracle.apply_twice_batch: apply_twice_batch plants a bug in the versioned",
        ),
        (
            ORACLE + "correction_clip = 0.0\n",
            "arms.oracle.correction_clip: correction_clip must be a finite number > 0",
        ),
        (
            ORACLE + "ep = 4\n",
            "checks.0.arms: final weights compare logical rank by logical rank; stale has 2 logical ranks, oracle 4",
        ),
    ],
    ids=["unknown-trainer", "planted-bug-in-oracle", "clip", "ep-mismatch"],
)
def test_oracle_fields_are_validated(tmp_path: Path, fields: str, expected: str) -> None:
    path = tmp_path / "suite.toml"
    path.write_text(SUITE.replace(ORACLE, fields))
    with pytest.raises(SuiteError) as info:
        load_suite(str(path))
    assert str(info.value).startswith(f"{path}: {expected}"), str(info.value)


# --- through the CLI: the shipped suite, and bugs planted in the pipeline ----------------------

ORACLE_CHECKS = ("stale vs oracle: loss", "stale vs oracle: grad_norm", "stale vs oracle, final weights")


def test_clip_active_run_of_strict_vs_stale_is_exact_against_the_oracle(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "strict-vs-stale", "--steps", 5, "--set", "correction_clip=1.01", "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    for name in ORACLE_CHECKS:
        assert run.check(out, name)["status"] == "pass", name
    clipped = [u["correction_clipped_frac"] for u in read_jsonl(out / "arms" / "oracle" / "metrics.jsonl")]
    assert all(c > 0 for c in clipped[1:]), clipped
    assert [u["correction_clipped_frac"] for u in read_jsonl(out / "arms" / "stale" / "metrics.jsonl")] == clipped


PRELUDE = """
import torch
import harness.reference.pipeline as pipeline
import harness.reference.versioned as versioned
"""
BUGS = {
    # Version bookkeeping: the snapshot cache forgets to compare versions, so every forward runs on
    # revision 0's weights while recording its true version (ages stay right).
    "stale-snapshot": """
def first_snapshot_forever(self):
    if self._snapshot is None:
        copies = {n: p.detach().clone().requires_grad_() for n, p in self.params.items()}
        self._snapshot = (self.version, copies)
    return self._snapshot[1]

versioned.VersionedModel._current_snapshot = first_snapshot_forever
""",
    # The correction: weights computed and reported, never applied to the cotangent.
    "unweighted-cotangent": """
versioned._ScaleCotangent.backward = staticmethod(lambda ctx, grad: (grad, None))
""",
    # Retention (offload): float host buffers pooled by shape, so a later save overwrites an earlier one.
    "pooled-offload": """
def pooled_offload_hooks(device):
    pool = {}

    def pack(tensor):
        if not tensor.is_floating_point():
            return tensor.device, tensor.clone()
        host = pool.setdefault((tensor.shape, tensor.dtype), torch.empty(tensor.shape, dtype=tensor.dtype))
        host.copy_(tensor)
        return tensor.device, host

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed[1].to(packed[0]))

versioned._offload_hooks = pooled_offload_hooks
""",
    # The commit: .grad is not cleared after a step, so gradients accumulate across updates.
    "accumulating-grads": """
step = versioned.VersionedModel.optimizer_step

def step_keeping_grads(self, vote=versioned.solo_vote):
    kept = {n: p.grad for n, p in self.params.items()}
    step(self, vote)
    for n, p in self.params.items():
        p.grad = kept[n]

versioned.VersionedModel.optimizer_step = step_keeping_grads
""",
    # The fill: backwards start once `delay` forwards are pending, not `delay + 1` (the drain is one short too).
    "short-fill": """
init = pipeline.VersionedTrainer.__init__

def init_with_short_fill(self, config, *args, **kwargs):
    init(self, config, *args, **kwargs)
    if config.delay > 0:
        self.config = pipeline.PipelineConfig(**{**vars(config), "delay": config.delay - 1})

pipeline.VersionedTrainer.__init__ = init_with_short_fill
""",
    # The drain: its last update is recorded but never stepped (only the final weights show it).
    "drain-loses-last-step": """
def drain_losing_last_step(self):
    records, pending = [], self._pending[self.logical_ranks[0]]
    while pending:
        if len(pending) == 1:
            for engine in self.engines.values():
                engine.optimizer_step = lambda vote=None: None
        records.append(self._tick(None))
    return records

pipeline.VersionedTrainer.drain = drain_losing_last_step
""",
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_bug_planted_in_the_pipeline_fails_the_oracle_check(run_harness, plant, tmp_path: Path, bug: str) -> None:
    out = tmp_path / "run"
    retention = ["--set", "arms.stale.retention=offload"] if bug == "pooled-offload" else []
    run = run_harness(
        "run", "strict-vs-stale", "--steps", 5, *retention, "--golden", "off", "--out", out,
        env=plant(PRELUDE + BUGS[bug]),
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    failed = [name for name in ORACLE_CHECKS if run.check(out, name)["status"] == "fail"]
    assert failed, [run.check(out, name) for name in ORACLE_CHECKS]
    assert f"FAIL  {failed[0]}" in run.stdout
    assert not [c for c in run.summary(out)["checks"] if c["kind"] == "rank-raised"]  # a wrong number, not a crash
