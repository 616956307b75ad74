"""harness/seam.py: each rule a rank holds a subject's records to, broken once, is a BadRecord naming
the arm, the rank and the record; records a run could have made pass. The whole path (a rank raising
it, the verdict blaming the subject) is subject/test_subject.py's, end to end."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from harness.seam import ReceivedRecords
from harness.subject import protocol
from harness.subject.protocol import BadRecord, RankUpdate, StepRecord


def _received(families: set[str] | None = None) -> ReceivedRecords:
    """Arm 'a' on rank 1, hosting logical rank 1 of a 2-step run."""
    return ReceivedRecords("a", 1, range(1, 2), steps=2, families=families or protocol.FAMILIES)


def _step(step: int = 1, **changes: object) -> StepRecord:
    record = StepRecord(step=step, loss=2.5, grad_norm=0.5, tokens=128, step_time_s=0.01)
    return StepRecord(**{**record.__dict__, **changes})


def _steps(*records: StepRecord) -> Callable[[ReceivedRecords], None]:
    def receive(received: ReceivedRecords) -> None:
        for record in records:
            received.step_record(record)

    return receive


WEIGHTS = {"w": torch.zeros(2)}


@pytest.mark.parametrize(
    ("receive", "why"),
    [
        (_steps(_step(101)), "StepRecord step 101: not a step of this run (it asked for steps 1-2)"),
        (_steps(_step(1), _step(1)), "StepRecord step 1: expected step 2 next (repeated or out of order)"),
        (_steps(_step(2)), "StepRecord step 2: expected step 1 next (step 1 missing)"),
        (_steps(_step(True)), "StepRecord step True: step is bool, expected an int"),
        (_steps(_step(tokens=math.nan)), "StepRecord step 1: tokens is nan, expected an int >= 0"),
        (_steps(_step(step_time_s=-1.0)), "StepRecord step 1: step_time_s is -1.0, expected a finite number >= 0"),
        (_steps(_step(grad_norm=-1.0)), "StepRecord step 1: grad_norm is -1.0, expected a number >= 0 (or NaN, inf)"),
        (_steps(_step(loss="2.5")), "StepRecord step 1: loss is '2.5', expected a number"),
        (_steps(_step(extra={"loss": 1.0})), "StepRecord step 1: extra sets loss, a field of the record itself"),
        (_steps(_step(extra={"tick": object()})), "StepRecord step 1: extra: not JSON (Object of type object"),
        (lambda r: r.step_record({"step": 1}), "the arm returned dict for a step, expected a StepRecord or None"),
        (
            lambda r: r.rank_update(5, 1, RankUpdate(1.0, 1.0, {})),
            "rank_update of logical rank 5: this process hosts logical ranks 1-1",
        ),
        (
            lambda r: [r.rank_update(1, 2, RankUpdate(1.0, 1.0, {})), r.rank_update(1, 1, RankUpdate(1.0, 1.0, {}))],
            "rank_update of logical rank 1, step 1: after step 2 (repeated or out of order)",
        ),
        (
            lambda r: r.gradients(1, 1, {"w": [0.0]}),
            "gradients of logical rank 1, step 1: 'w' -> list, expected name -> tensor",
        ),
        (
            lambda r: r.final_weights({1: {"w": 1.0}}),
            "final_weights of logical rank 1: 'w' -> float, expected name -> tensor",
        ),
        (
            lambda r: r.final_weights({0: WEIGHTS}),
            "final_weights of logical rank 0: this process hosts logical ranks 1-1",
        ),
        (
            lambda r: r.event("exchange_event", 1, {1: "a"}),
            "exchange_event of logical rank 1: keys ['1'], expected strings",
        ),
        (lambda r: r.info({"moe_layers": 2}), "Arm.info() returned dict, expected ArmFacts"),
    ],
    ids=lambda value: value.split(":")[0] if isinstance(value, str) else None,
)
def test_a_record_no_run_could_have_made_names_arm_rank_and_record(receive: Callable, why: str) -> None:
    with pytest.raises(BadRecord) as raised:
        receive(_received())
    assert str(raised.value).startswith(f"arm 'a', rank 1: {why}"), str(raised.value)


def test_a_record_of_a_family_the_arm_does_not_declare_is_no_record() -> None:
    received = _received({protocol.METRICS, protocol.FINAL_WEIGHTS})
    with pytest.raises(BadRecord) as raised:
        received.event("exchange_event", 1, {"step": 1})
    assert str(raised.value) == (
        "arm 'a', rank 1: exchange_event: the arm does not declare the token-exchange family"
        " (it declares: final-weights, metrics)"
    )


def test_records_a_run_could_have_made_pass() -> None:
    """Every rule's good side, so that none of the refusals above is a refusal of everything; a NaN
    loss is a finding the checks judge, not a bad record."""
    received = _received()
    received.step_record(_step(1, loss=math.nan, extra={"tick": 3}))
    received.step_record(_step(2, grad_norm=math.inf))
    received.rank_update(1, 1, RankUpdate(2.5, 0.5, WEIGHTS))
    received.rank_update(1, 2, RankUpdate(2.5, 0.5, WEIGHTS, {"expert": torch.ones(1)}))
    received.gradients(1, 1, WEIGHTS)
    received.event("pec_event", 1, {"step": 1, "kind": "start"})
    assert received.final_weights({1: WEIGHTS}) == {1: WEIGHTS}
    assert received.info(protocol.ArmFacts()) == protocol.ArmFacts()
