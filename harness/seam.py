"""Every record a subject hands a rank, checked where the rank receives it, before it is written.

The checks judge what an arm recorded; a record that no run could have made would be judged as if
it were true (a 2-step run whose steps are 101 and 102 passed). So each record family the seam
defines (harness/subject/protocol.py) is held to what the run asked for, here and only here:

* ``StepRecord`` (``Arm.step``, ``Arm.drain``): a StepRecord; ``step`` an int, a step of the run
  (1..steps), each the one after the last (none missing, repeated or out of order; a resumed
  launch goes on from the last one its first launch wrote); an arm that ends short of the run's last
  step made no false record, and the checks say where it stopped; ``loss`` a number and
  ``grad_norm`` a number not below 0 (NaN and infinity are findings, which the checks judge);
  ``tokens`` an int >= 0; ``step_time_s`` a finite number >= 0; ``extra`` JSON columns with string
  keys, none of them a field above.
* ``Recorder`` calls: ``logical_rank`` one this process hosts; ``step`` a step of the run, each
  logical rank's in increasing order per family; a ``RankUpdate`` of numbers and name -> tensor
  mappings; gradients name -> tensor; events and fidelity lines JSON objects with string keys.
* ``Arm.final_weights``: logical ranks this process hosts, each name -> tensor; ``Arm.info``: an
  ``ArmFacts``; ``Arm.graph_export`` and ``graph_build``: JSON objects.
* A record of a family the arm does not declare (``ArmSpec.families``): the checks would never read it,
  so it is no record at all (a ``Recorder.exchange_event`` from an arm without ``token-exchange``).

A record that breaks a rule raises :class:`~harness.subject.protocol.BadRecord` in the rank, one
line naming the arm, the rank and the record; triage.py counts it as the subject's fault (exit 1).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import torch

from harness.subject.protocol import (
    ARM_METHODS,
    FAMILIES,
    FIDELITY,
    GRADIENT_DIGESTS,
    PEC,
    RANK_UPDATES,
    TOKEN_EXCHANGE,
    ArmFacts,
    BadRecord,
    RankUpdate,
    StepRecord,
    undeclared_methods,
)

_STEP_FIELDS = ("step", "loss", "grad_norm", "tokens", "step_time_s")


class ReceivedRecords:
    """The rules above for one arm in one rank. ``hosted``: the logical ranks this process hosts;
    ``steps``: the run's; ``first``: the step the arm's next StepRecord must carry; ``families``: those
    the arm declares."""

    def __init__(
        self, arm: str, rank: int, hosted: range, steps: int, first: int = 1, families: Iterable[str] = FAMILIES
    ) -> None:
        self.where = f"arm '{arm}', rank {rank}"
        self.hosted, self.steps, self.next = hosted, steps, first
        self.families = frozenset(families)
        self._last: dict[tuple[str, int], int] = {}  # (family, logical rank) -> its last step

    def built(self, arm: object, declared: Iterable[str]) -> None:
        """A built arm has the methods its declared families (and ``declared``, its subject's capabilities
        it uses) call for: else the subject's fault, before any step."""
        if lacking := undeclared_methods(arm, self.families | set(declared), ARM_METHODS):
            self._bad(f"{type(arm).__name__} declares what calls for {lacking[0]} without it")

    def step_record(self, record: object) -> StepRecord:
        """``record`` (what ``Arm.step`` or ``drain`` returned, not None), checked, and the next step expected."""
        if not isinstance(record, StepRecord):
            self._bad(f"the arm returned {type(record).__name__} for a step, expected a StepRecord or None")
        what = f"StepRecord step {record.step!r}"
        step = self._step(record.step, what)
        if step != self.next:
            gap = f"step {self.next} missing" if step > self.next else "repeated or out of order"
            self._bad(f"{what}: expected step {self.next} next ({gap})")
        self._number(record.loss, f"{what}: loss")
        self._number(record.grad_norm, f"{what}: grad_norm", at_least=0.0)
        if isinstance(record.tokens, bool) or not isinstance(record.tokens, int) or record.tokens < 0:
            self._bad(f"{what}: tokens is {record.tokens!r}, expected an int >= 0")
        self._number(record.step_time_s, f"{what}: step_time_s", at_least=0.0, finite=True)
        if not isinstance(record.extra, Mapping):
            self._bad(f"{what}: extra is {type(record.extra).__name__}, expected a mapping")
        if shadowed := sorted(set(record.extra) & set(_STEP_FIELDS)):
            self._bad(f"{what}: extra sets {', '.join(shadowed)}, a field of the record itself")
        self._json(record.extra, f"{what}: extra")
        self.next += 1
        return record

    def rank_update(self, logical_rank: int, step: int, update: object) -> None:
        self._declared(RANK_UPDATES, "rank_update")
        what = self._recorded("rank_update", logical_rank, step)
        if not isinstance(update, RankUpdate):
            self._bad(f"{what}: got {type(update).__name__}, expected a RankUpdate")
        self._number(update.loss, f"{what}: loss")
        self._number(update.grad_norm, f"{what}: grad_norm", at_least=0.0)
        self._tensors(update.replicated, f"{what}: replicated")
        self._tensors(update.sharded, f"{what}: sharded")

    def gradients(self, logical_rank: int, step: int, grads: object) -> None:
        self._declared(GRADIENT_DIGESTS, "gradients")
        self._tensors(grads, self._recorded("gradients", logical_rank, step))

    def event(self, family: str, logical_rank: int, event: object) -> None:
        """An ``exchange_event`` or ``pec_event`` (``family``) of ``logical_rank``."""
        self._declared(TOKEN_EXCHANGE if family == "exchange_event" else PEC, family)
        self._json(event, f"{family} of logical rank {self._hosted(logical_rank, family)}", mapping=True)

    def fidelity(self, record: object) -> None:
        self._declared(FIDELITY, "fidelity")
        self._json(record, "fidelity record", mapping=True)

    def final_weights(self, weights: object) -> Mapping[int, Mapping[str, torch.Tensor]]:
        if not isinstance(weights, Mapping):
            self._bad(f"final_weights: got {type(weights).__name__}, expected logical rank -> parameters")
        for logical_rank, parameters in weights.items():
            self._tensors(parameters, f"final_weights of logical rank {self._hosted(logical_rank, 'final_weights')}")
        return weights

    def info(self, facts: object) -> ArmFacts:
        if not isinstance(facts, ArmFacts):
            self._bad(f"Arm.info() returned {type(facts).__name__}, expected ArmFacts")
        self._json(facts.to_json(), "Arm.info()", mapping=True)
        return facts

    def graph(self, graph: object) -> Mapping[str, Any]:
        self._json(graph, "Arm.graph_export()", mapping=True)
        return graph  # type: ignore[return-value]

    def graph_build(self, build: object) -> Mapping[str, Any]:
        self._json(build, "Arm.graph_build()", mapping=True)
        return build  # type: ignore[return-value]

    def _declared(self, family: str, call: str) -> None:
        if family not in self.families:
            declared = ", ".join(sorted(self.families))
            self._bad(f"{call}: the arm does not declare the {family} family (it declares: {declared})")

    def _recorded(self, family: str, logical_rank: int, step: object) -> str:
        """The name of a Recorder call's record, once its logical rank and step are checked."""
        what = f"{family} of logical rank {self._hosted(logical_rank, family)}, step {step!r}"
        checked = self._step(step, what)
        last = self._last.get((family, logical_rank), 0)
        if checked <= last:
            self._bad(f"{what}: after step {last} (repeated or out of order)")
        self._last[(family, logical_rank)] = checked
        return what

    def _hosted(self, logical_rank: object, family: str) -> int:
        if isinstance(logical_rank, bool) or logical_rank not in self.hosted:
            hosted = f"{self.hosted.start}-{self.hosted.stop - 1}"
            self._bad(f"{family} of logical rank {logical_rank!r}: this process hosts logical ranks {hosted}")
        return logical_rank  # type: ignore[return-value]

    def _step(self, step: object, what: str) -> int:
        if isinstance(step, bool) or not isinstance(step, int):
            self._bad(f"{what}: step is {type(step).__name__}, expected an int")
        if not 1 <= step <= self.steps:
            self._bad(f"{what}: not a step of this run (it asked for steps 1-{self.steps})")
        return step

    def _number(self, value: object, what: str, at_least: float | None = None, finite: bool = False) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self._bad(f"{what} is {value!r}, expected a number")
        if (finite and not math.isfinite(value)) or (at_least is not None and value < at_least):
            bound = f"a finite number >= {at_least:g}" if finite else f"a number >= {at_least:g} (or NaN, inf)"
            self._bad(f"{what} is {value!r}, expected {bound}")

    def _tensors(self, named: object, what: str) -> None:
        if not isinstance(named, Mapping):
            self._bad(f"{what}: got {type(named).__name__}, expected name -> tensor")
        for name, tensor in named.items():
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                self._bad(f"{what}: {name!r} -> {type(tensor).__name__}, expected name -> tensor")

    def _json(self, value: object, what: str, mapping: bool = False) -> None:
        if mapping and not isinstance(value, Mapping):
            self._bad(f"{what}: got {type(value).__name__}, expected a JSON object")
        if isinstance(value, Mapping) and not all(isinstance(key, str) for key in value):
            self._bad(f"{what}: keys {sorted(map(repr, value))}, expected strings")
        try:
            json.dumps(dict(value) if isinstance(value, Mapping) else value, allow_nan=True)
        except (TypeError, ValueError) as e:
            self._bad(f"{what}: not JSON ({e})")

    def _bad(self, why: str) -> NoReturn:
        raise BadRecord(f"{self.where}: {why}")
