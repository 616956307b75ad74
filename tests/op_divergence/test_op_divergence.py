"""The first op where two arms part (harness.op_divergence), on planted bugs of the reference.

Each test records two in-process arms op by op, on cpu-tiny with one logical rank and one step:
a correct arm and one with a planted bug. The first divergence must name the op the bug is in.
Two runs of one arm must not diverge, and neither must an eager and a graph-chunked arm that
agree bitwise, although their op sequences differ.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from harness.op_divergence import ArmRun, OpRecord, OpRecorder, compare_ops, describe, first_op_divergence, record_arm
from harness.op_divergence.record import content_digest
from harness.reference.chunking import graph_step
from harness.reference.chunking.graph import _Cloner, _mentions
from harness.reference.model import TokenDispatcher
from harness.reference.train import TrainConfig
from harness.subject.reference.op_trace import PLACEHOLDER_OPS, trainer_run

# Graph arms chunk deep copies of one trace; copying its fake tensors warns about a torch-internal deprecation.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

STEPS = 1
EAGER = TrainConfig(ep=1)
FACTOR = 2.5
SCALED = replace(EAGER, model_overrides={"routed_scaling_factor": FACTOR})  # cpu-tiny's factor is 1: twice is once
EAGER_CHUNKED = replace(EAGER, chunking="eager", chunks=2)
GRAPH = replace(EAGER_CHUNKED, chunking="graph")


def divergence(run_a: ArmRun, run_b: ArmRun, **kwargs) -> dict:
    result = first_op_divergence(run_a, run_b, placeholders=PLACEHOLDER_OPS, **kwargs)
    json.dumps(result, allow_nan=False)  # it goes into summary.json as is
    return result


def planted(run: ArmRun, owner: object, name: str, value: object) -> ArmRun:
    """``run`` with ``owner.name`` replaced while it builds and trains: the other arm keeps the original."""

    def run_planted(recorder: OpRecorder) -> None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(owner, name, value)
            run(recorder)

    return run_planted


@pytest.fixture(scope="module")
def one_trace() -> Iterator[None]:
    """Every graph arm here is built from one trace of the train step, each from a deep copy (the
    passes rewrite it in place): tracing is most of a graph arm's cost, and the planted bug is in
    a pass after it."""
    traced = {}

    def trace_once(model, batch, loss_fn, **kwargs):
        key = (tuple(t.shape for t in batch), tuple(sorted(kwargs.items())))
        if key not in traced:
            traced[key] = TRACE(model, batch, loss_fn, **kwargs)
        return copy.deepcopy(traced[key])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graph_step, "trace_train_step", trace_once)
        yield


TRACE = graph_step.trace_train_step


def first_row(result: dict) -> dict:
    [row] = [r for r in result["window"] if r.get("first")]
    return row


def test_records_attribute_ops_to_modules_both_ways_and_two_runs_of_an_arm_agree() -> None:
    run = trainer_run(EAGER, STEPS)
    records = record_arm(run, placeholders=PLACEHOLDER_OPS).records
    gate = {(r.op, r.backward) for r in records if r.module == "model.layers.1.mlp.gate"}
    assert ("aten.mul.Tensor", False) in gate and any(backward for _, backward in gate)
    launches = [r for r in records if r.op in PLACEHOLDER_OPS]
    assert launches and all(r.hashes == (None,) * len(r.outputs) for r in launches)
    assert [r.index for r in records] == list(range(len(records)))

    result = describe(compare_ops(records, record_arm(run, placeholders=PLACEHOLDER_OPS).records))
    assert not result["diverged"] and result["first_op"] is None and result["window"] == []
    matching = result["matching"]
    assert matching["aligned"] == matching["ops"]["a"] == matching["ops"]["b"] == len(records)
    assert matching["ambiguous"] == {"a": 0, "b": 0} and matching["spans"] == 0


def sums(partial: str, total: str) -> list[OpRecord]:
    """Three inputs, then two adds with these output hashes: a partial sum, then the total, which
    persists (as a parameter's update does)."""
    inputs = [
        OpRecord(i, 0, "aten.clone.default", "", False, ("f32[4]",), (h,), (1.0,), (), False)
        for i, h in enumerate("xyz")
    ]
    add = dict(step=0, op="aten.add.Tensor", module="m", backward=True, outputs=("f32[4]",), absmax=(1.0,))
    return [
        *inputs,
        OpRecord(index=3, hashes=(partial,), inputs=(0, 1), persists=False, **add),
        OpRecord(index=4, hashes=(total,), inputs=(3, 2), persists=True, **add),
    ]


def test_partial_sums_in_another_order_heal_unless_the_total_differs() -> None:
    reordered = describe(compare_ops(sums("x+y", "x+y+z"), sums("x+z", "x+y+z")))
    assert not reordered["diverged"] and reordered["matching"]["unaligned"]["a"] == {"healed": 1}
    wrong = describe(compare_ops(sums("x+y", "x+y+z"), sums("x+z", "x+z+z")))
    pair = wrong["first_difference"]
    assert wrong["diverged"] and pair["a"]["index"] == pair["b"]["index"] == 3  # the partial sum, where they part


def test_a_difference_sent_through_a_collective_does_not_heal() -> None:
    """A forward difference that reaches the update only through a collective's placeholder (FSDP's
    reduce-scatter of a gradient: no content when recorded) is where the arms part, not healed."""

    def run(activation: str, update: str) -> list[OpRecord]:
        op = dict(step=0, module="m", backward=False, outputs=("f32[4]",), absmax=(1.0,))
        return [
            OpRecord(index=0, op="aten.mul.Tensor", hashes=(activation,), inputs=(), persists=False, **op),
            OpRecord(
                index=1,
                op="_c10d_functional.reduce_scatter_tensor.default",
                hashes=(None,),
                inputs=(0,),
                persists=False,
                **{**op, "absmax": (None,)},
            ),
            OpRecord(
                index=2, op="_c10d_functional.wait_tensor.default", hashes=(update,), inputs=(1,), persists=True, **op
            ),
        ]

    result = describe(compare_ops(run("good", "u1"), run("bad", "u2")))
    assert result["diverged"] and result["first_difference"]["a"]["index"] == 0  # the mul, not the wait


def test_routed_scaling_applied_twice_is_named_at_the_routers_mul() -> None:
    result = divergence(trainer_run(SCALED, STEPS), trainer_run(replace(SCALED, fault="routed-scaling-twice"), STEPS))
    assert result["diverged"] and result["first_op"]["kind"] == "outputs differ"
    assert result["only_in_a"] == result["only_in_b"] == []
    first = result["first_difference"]
    for side in (first["a"], first["b"]):
        assert (side["op"], side["module"], side["backward"], side["step"]) == (
            "aten.mul.Tensor",
            "model.layers.1.mlp.gate",
            False,
            0,
        )
    assert first["reproduced"]
    [out] = first["outputs"]
    # The planted arm's weights are the correct ones times the factor once more.
    assert out["max_abs"] == pytest.approx(first["a"]["absmax"][0] * (FACTOR - 1), rel=1e-6)
    assert out["max_rel"] == pytest.approx((FACTOR - 1) / FACTOR, rel=1e-6)
    row = first_row(result)
    assert row["a"]["status"] == row["b"]["status"] == "differs"


def unpermute_by_order(self, combined_AD: torch.Tensor, plan, weights_TK: torch.Tensor) -> torch.Tensor:
    rows_AD = combined_AD.index_select(0, plan.order_A)  # the bug: the order itself, not its inverse
    return (rows_AD.view(-1, self.top_k, rows_AD.shape[-1]).float() * weights_TK.unsqueeze(-1).float()).sum(1)


def test_unpermute_by_the_order_instead_of_its_inverse_is_named_at_index_select() -> None:
    result = divergence(
        trainer_run(EAGER, STEPS), planted(trainer_run(EAGER, STEPS), TokenDispatcher, "unpermute", unpermute_by_order)
    )
    first = result["first_difference"]
    for side in (first["a"], first["b"]):
        assert (side["op"], side["module"], side["backward"]) == (
            "aten.index_select.default",
            "model.layers.1.mlp",
            False,
        )
    # The correct arm inverts the order first, just before: an argsort (a sort's indices) the planted arm lacks.
    assert [r["op"] for r in result["only_in_a"]] == ["aten.sort.default"] and result["only_in_b"] == []
    assert result["first_op"]["a"] == result["only_in_a"][0]
    # The same rows in another order: the same largest magnitude, other bits.
    assert first["a"]["absmax"] == first["b"]["absmax"] and first["a"]["hashes"] != first["b"]["hashes"]
    [out] = first["outputs"]
    assert first["reproduced"] and out["max_abs"] > 0 and 0 < out["elements_differing"] <= out["elements"]


def test_eager_and_graph_chunking_agree_op_for_op_though_their_sequences_differ(one_trace: None) -> None:
    result = divergence(trainer_run(EAGER_CHUNKED, STEPS), trainer_run(GRAPH, STEPS), arms=("eager", "graph"))
    assert not result["diverged"], result["summary"]
    matching = result["matching"]
    assert "divergent" not in matching["unaligned"]["a"] and "divergent" not in matching["unaligned"]["b"]
    # The traced arm runs other ops in another order: the matching says how much it had to skip, and where.
    assert matching["spans"] > 0 and matching["ambiguous"]["a"] + matching["ambiguous"]["b"] > 0
    assert len(matching["where"]) == min(matching["spans"], 10) and "unaligned spans" in matching["note"]


JOIN = _Cloner._join


def join_keeping_the_last_chunk(self: _Cloner, node, region):
    """The planted join: a parameter's gradient is its last chunk's alone, with no ``add`` of the others."""
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) and not _mentions(tuple(value.shape), self.symbol):
        return self.copies[node][-1]
    return JOIN(self, node, region)


def test_graph_join_keeping_only_the_last_chunk_is_named_at_the_add_the_graph_lacks(one_trace: None) -> None:
    graph = planted(trainer_run(GRAPH, STEPS), _Cloner, "_join", join_keeping_the_last_chunk)
    result = divergence(trainer_run(EAGER_CHUNKED, STEPS), graph, arms=("eager", "graph"))
    first = result["first_op"]
    assert first["kind"] == "only in a" and first["b"] is None
    assert first["a"]["op"] in ("aten.add.Tensor", "aten.add_.Tensor") and first["a"]["backward"]
    assert first["a"]["module"].startswith("model.layers.2.mlp")  # backward reaches the last MoE layer first
    assert result["only_in_a"][0] == first["a"] and result["only_in_b"] == []
    row = first_row(result)
    assert row["a"]["index"] == first["a"]["index"] and row["b"] is None
    # Eager and traced sequences differ: the result states how ambiguous the matching was up to there.
    assert result["matching"]["ambiguous"]["a"] + result["matching"]["ambiguous"]["b"] > 0


def test_an_arm_that_recorded_no_op_is_refused_not_called_equal() -> None:
    """Two empty recordings agree trivially: the comparison must say nothing was compared."""
    with pytest.raises(ValueError, match="arm a recorded no op"):
        compare_ops([], [])


def test_a_collectives_outputs_are_recorded_without_hashes_the_op_reading_them_hashes_what_landed(tmp_path) -> None:
    """gloo's in-place collectives return before their work lands the data (a rank's all_gather hashed
    uninitialised memory, the same on both arms, while the cat reading it differed): a hash taken then
    is noise."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        parts = [torch.empty(4)]
        with OpRecorder() as recorder:
            dist.all_gather(parts, torch.arange(4.0))
            torch.cat(parts)
    finally:
        dist.destroy_process_group()
    gather, cat = recorder.records[-2:]
    assert gather.op == "c10d.allgather_.default" and gather.hashes == (None,) * len(gather.outputs)
    assert cat.op == "aten.cat.default" and cat.hashes[0] is not None and cat.absmax == (3.0,)


def test_a_conjugate_view_is_hashed_by_its_values() -> None:
    # RoPE's complex frequencies reach backward as conjugate views, whose bytes cannot be viewed as another dtype.
    z = torch.tensor([1 + 2j, 3 - 4j])
    assert content_digest(z.conj()) == content_digest(z.conj().resolve_conj())
    assert content_digest(z.conj()) != content_digest(z)


def test_hashing_leaves_the_storage_resizable() -> None:
    # FSDP frees an unsharded parameter by resizing its storage to 0: an op's output hashed while in use must allow it.
    t = torch.arange(8, dtype=torch.float32)
    digest = content_digest(t)
    t.untyped_storage().resize_(0)
    assert digest == content_digest(torch.arange(8, dtype=torch.float32))
