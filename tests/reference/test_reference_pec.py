"""PEC in the reference: the OL/NOL split, dist() and apply(), the drain, the row-wise optimizers,
and the trainers bit for bit (pipelined = sequential = legacy, on 1 and 2 gloo processes)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from harness.reference.ep.group import LogicalGroup
from harness.reference.pec import (
    TABLE_FAULTS,
    PECBatches,
    PECConfig,
    PECEvents,
    PECGradientApply,
    PECTrainer,
    RowwiseOptimizer,
    ShardedEmbedding,
    split_overlap,
)

STEPS = 20
BASE = PECConfig(ep=2, chunking="eager")


def train(config: PECConfig, steps: int = STEPS) -> dict:
    """Metrics, every PEC event and the final table shards of the logical ranks hosted here."""
    events: list[tuple[int, dict]] = []
    trainer = PECTrainer(config, pec_sink=lambda rank, event: events.append((rank, event)), batches=steps)
    try:
        metrics = [(m["loss"], m["grad_norm"]) for m in (trainer.step(s) for s in range(1, steps + 1))]
    finally:
        trainer.close()
    weights = {
        (r, n): p.detach().clone() for r, rep in trainer.replicas.items() for n, p in rep.model.named_parameters()
    }
    return {"metrics": metrics, "events": events, "weights": weights}


def by_rank_and_seq(event: tuple[int, dict]) -> tuple[int, int]:
    return event[0], event[1]["seq"]


def merged(per_process: list[dict]) -> dict:
    """One run from the processes' parts: metrics agree on every process; events and weights are per rank."""
    assert all(part["metrics"] == per_process[0]["metrics"] for part in per_process)
    return {
        "metrics": per_process[0]["metrics"],
        "events": sorted((e for part in per_process for e in part["events"]), key=by_rank_and_seq),
        "weights": {k: v for part in per_process for k, v in part["weights"].items()},
    }


def assert_same_training(a: dict, b: dict) -> None:
    assert a["metrics"] == b["metrics"]
    assert a["weights"].keys() == b["weights"].keys()
    differing = [k for k in a["weights"] if not torch.equal(a["weights"][k], b["weights"][k])]
    assert not differing, f"weights differ: {differing[:3]}"


def gradient_ops(run: dict, rank: int = 0) -> list[tuple[int, str, int, str]]:
    """(call, op, batch, part) of one logical rank's gradient all-to-all starts and applies."""
    return [
        (e["call"], e["op"], e["batch"], e["part"])
        for r, e in run["events"]
        if r == rank and e["op"] in ("start", "apply")
    ]


def test_split_marks_ids_of_the_next_batch_overlapped_and_everything_on_the_last_batch() -> None:
    ids = torch.tensor([3, 5, 8, 13])
    assert split_overlap(ids, torch.tensor([1, 5, 13, 21])).tolist() == [False, True, False, True]
    assert split_overlap(ids, torch.tensor([2, 4])).tolist() == [False] * 4
    assert split_overlap(ids, None).tolist() == [True] * 4


def test_backward_splits_the_gradient_by_the_next_batch_of_the_whole_group() -> None:
    # Batch N's ids that any logical rank looks up in batch N+1 are OL on every rank.
    run = train(BASE, steps=3)
    lookups = {(r, e["batch"]): set() for r, e in run["events"] if e["op"] == "lookup"}
    for r, e in run["events"]:
        if e["op"] == "lookup":
            lookups[(r, e["batch"])] |= set(e["ids"])
    for r, e in run["events"]:
        if e["op"] == "start":
            nxt = set().union(*(lookups.get((k, e["batch"] + 1), set()) for k in (0, 1)))
            overlapped = {i for i in lookups[(r, e["batch"])] if e["batch"] == 3 or i in nxt}
            expected = overlapped if e["part"] == "OL" else lookups[(r, e["batch"])] - overlapped
            assert set(e["ids"]) == expected, (r, e["batch"], e["part"])


def test_batches_draw_the_configured_fraction_of_ids_from_the_previous_batch() -> None:
    batches = PECBatches(replace(BASE, pec_overlap=0.25), vocab=256, rank=0)
    for n in range(1, 5):
        kept = set(batches.pool(n).tolist()) & set(batches.pool(n + 1).tolist())
        assert len(kept) == round(0.25 * batches.pool_size)
    assert set(batches.batch(3)[0].flatten().tolist()) <= set(batches.pool(3).tolist())


def one_rank_table(optimizer: str = "rowwise-sgd") -> tuple[ShardedEmbedding, list[dict]]:
    """The whole table on one logical rank (EP 1, no process group), recording its events."""
    events: list[dict] = []
    config = PECConfig(ep=1, pec_optimizer=optimizer, lr=0.5)
    table = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    return ShardedEmbedding(table, LogicalGroup(1), 0, config, PECEvents(0, lambda _, e: events.append(e))), events


def test_dist_is_idempotent_and_apply_needs_it_once() -> None:
    table, events = one_rank_table()
    gradient = PECGradientApply(table, 1, "OL", torch.tensor([1, 4]), torch.ones(2, 2))
    table.gradients[(1, "OL")] = gradient
    with pytest.raises(RuntimeError, match="before its dist"):
        gradient.apply()
    gradient.dist()
    gradient.dist()
    gradient.apply()
    assert [(e["op"], e["ids"]) for e in events] == [("start", [1, 4]), ("apply", [1, 4])]
    assert table.weight[1].tolist() == [1.5, 2.5] and table.weight[4].tolist() == [7.5, 8.5]
    with pytest.raises(RuntimeError, match="applied twice"):
        gradient.apply()


def test_rowwise_adagrad_keeps_one_state_value_per_row() -> None:
    weight = torch.zeros(3, 2)
    optimizer = RowwiseOptimizer("rowwise-adagrad", weight, lr=0.1)
    optimizer.step(torch.tensor([2]), torch.tensor([[3.0, 4.0]]))
    assert optimizer.state.tolist() == [0.0, 0.0, 12.5]  # mean of the squares
    expected = -0.1 * torch.tensor([3.0, 4.0]) / (torch.tensor(12.5).sqrt() + 1e-8)
    assert torch.equal(weight[2], expected) and not weight[:2].any()


def test_pipelined_issues_torchrecs_order_and_drains_nol_on_the_last_batch() -> None:
    run = train(BASE, steps=4)
    ops = gradient_ops(run)
    assert ops == [
        (1, "start", 1, "OL"),
        (1, "apply", 1, "OL"),
        (2, "start", 1, "NOL"),
        (2, "apply", 1, "NOL"),
        (2, "start", 2, "OL"),
        (2, "apply", 2, "OL"),
        (3, "start", 2, "NOL"),
        (3, "apply", 2, "NOL"),
        (3, "start", 3, "OL"),
        (3, "apply", 3, "OL"),
        (4, "start", 3, "NOL"),
        (4, "apply", 3, "NOL"),
        (4, "start", 4, "OL"),
        (4, "apply", 4, "OL"),
        (4, "start", 4, "NOL"),  # the drain: everything is OL on the last batch, so NOL 4 is empty
        (4, "apply", 4, "NOL"),
    ]
    assert Counter(call for call, op, _, _ in ops if op == "start") == {1: 1, 2: 2, 3: 2, 4: 3}
    order = [(e["op"], e["part"]) for r, e in run["events"] if r == 0 and e["call"] == 2]
    assert order.index(("backward_done", None)) < order.index(("start", "OL")) < order.index(("optimizer_step", None))
    assert not any(e["in_autograd"] for _, e in run["events"])
    last_nol = [e for _, e in run["events"] if e["op"] == "start" and (e["batch"], e["part"]) == (4, "NOL")]
    assert [e["rows"] for e in last_nol] == [0, 0]


def test_no_drain_leaves_the_last_nol_unstarted() -> None:
    ops = gradient_ops(train(replace(BASE, pec_fault="no-drain"), steps=3))
    assert (3, "start", 3, "NOL") not in ops and len([op for op in ops if op[1] == "start"]) == 5


def test_legacy_starts_ol_inside_backward_once() -> None:
    run = train(replace(BASE, pec="legacy"), steps=3)
    starts = [(e["batch"], e["part"], e["in_autograd"]) for r, e in run["events"] if r == 0 and e["op"] == "start"]
    assert starts == [(1, "OL", True), (1, "NOL", False), (2, "OL", True), (2, "NOL", False), (3, "OL", True)] + [
        (3, "NOL", False)
    ]


def test_ol_before_backward_starts_ol_before_backward_returns() -> None:
    run = train(replace(BASE, pec_fault="ol-before-backward"), steps=2)
    order = [(e["op"], e["part"]) for r, e in run["events"] if r == 0 and e["call"] == 2]
    assert order.index(("start", "OL")) < order.index(("backward_done", None))


@pytest.mark.parametrize("optimizer", ["rowwise-sgd", "rowwise-adagrad"])
def test_pipelined_and_legacy_equal_sequential_bit_for_bit(optimizer: str) -> None:
    config = replace(BASE, pec_optimizer=optimizer)
    sequential = train(replace(config, pec="sequential"))
    assert_same_training(train(config), sequential)
    assert_same_training(train(replace(config, pec="legacy")), sequential)
    first_loss = sequential["metrics"][0][0]
    assert all(loss != first_loss for loss, _ in sequential["metrics"][1:])  # it trains


def test_the_two_optimizers_train_the_table_differently() -> None:
    sgd = train(replace(BASE, pec_optimizer="rowwise-sgd"), steps=3)
    adagrad = train(replace(BASE, pec_optimizer="rowwise-adagrad"), steps=3)
    key = (0, "model.embed_tokens.weight")
    assert not torch.equal(sgd["weights"][key], adagrad["weights"][key])


@pytest.mark.parametrize("fault", ["nol-two-late", "ol-as-nol"])
def test_a_late_or_misclassified_update_makes_pipelined_differ_from_sequential(fault: str) -> None:
    sequential = train(replace(BASE, pec="sequential"), steps=6)
    faulty = train(replace(BASE, pec_fault=fault), steps=6)
    assert faulty["metrics"] != sequential["metrics"]


def test_two_gloo_processes_equal_one_process_and_pipelined_equals_sequential(run_on_ranks) -> None:
    one_process = train(BASE)
    two_processes = merged(run_on_ranks(2, train, BASE))
    assert_same_training(one_process, two_processes)
    assert sorted(one_process["events"], key=by_rank_and_seq) == two_processes["events"]
    assert_same_training(merged(run_on_ranks(2, train, replace(BASE, pec="sequential"))), two_processes)


@pytest.mark.parametrize("fault", TABLE_FAULTS)
def test_a_table_fault_is_shared_by_every_trainer_so_pipelined_still_equals_sequential(fault: str) -> None:
    """The reference's own arms cannot see it (only an independent table can: suite pec-torchrec),
    though it does change the table."""
    config = replace(BASE, pec_optimizer="rowwise-adagrad")
    faulty = train(replace(config, pec_fault=fault), steps=3)
    assert_same_training(faulty, train(replace(config, pec_fault=fault, pec="sequential"), steps=3))
    key = (0, "model.embed_tokens.weight")
    assert not torch.equal(faulty["weights"][key], train(config, steps=3)["weights"][key])
