"""The seam between the harness and a system under test: the only things the harness knows of one.

A *subject* is a trainer the harness can verify: the bundled reference (``reference``), or any
trainer a user brings (``"package.module:factory"``, or an entry point of the group
``harness.subjects``). It does three things, in the spirit of torchtitan's ``TrainSpec``:

1. **Parse its arms.** A suite's ``[model]``, ``[train]`` and ``[arms.NAME]`` tables are the
   subject's own fields: :meth:`Subject.parse_arms` validates them with the suite's typed readers
   (so a mistake names the file and the dotted field like any other) and returns one
   :class:`~harness.specs.ArmSpec` per arm: its process count, its config as plain JSON (what the
   ranks build from), the record families it emits, its seed and its :class:`ArmFacts`.
2. **Build an arm** inside each rank process, once ``torch.distributed`` is initialised
   (:meth:`Subject.build`, given an :class:`ArmContext`), and train it: :meth:`Arm.step` returns a
   :class:`StepRecord` per optimizer update; :meth:`Arm.drain` returns those still in flight at
   the end (a delayed pipeline's).
3. **Record** what it can through the :class:`Recorder` it was built with: each method is one
   record family below. The harness writes the files (``harness/rundir.py`` names them) and judges
   them; a subject never judges itself.

A subject that records only metrics is :class:`SubjectBase` with ``parse_arms`` and ``build``, and
an :class:`ArmBase` with ``step``: the bases hold every default.

Record families. Every check family declares the families it reads
(:class:`~harness.checks.registry.CheckFamily`), and a suite whose check reads a family its arm
cannot emit is refused at load (exit 2), naming the check and the subject. The checks know an arm
through its typed :class:`ArmFacts` alone, never through its config: a family's checks need some
(:data:`FAMILY_FACTS`), and a check reading a family of an arm that lacks one is refused at load
too, naming the family and the fact. Optional parts are declared, never probed for: the families
of an arm (``ArmSpec.families``) decide which of its record methods the rank calls, and a
subject's ``capabilities`` (:data:`CAPABILITIES`) which of its optional parts the harness uses.

Every record a rank receives is checked there before it is written (:mod:`harness.seam`): a record
no run could have made (a step the run did not ask for, one missing, repeated or out of order,
negative or NaN tokens or seconds, a logical rank the process does not host, a family the arm does
not declare) is :class:`BadRecord`, the subject's fault.

Whose fault, and its exit code, when the subject's own code fails in the harness process (loading):

* its module cannot be found or raises on import, its factory is no callable, returns something
  that is no subject, or raises :class:`SubjectError` (it refuses to load: a missing extra):
  bad input, exit 2, one line naming the subject and why;
* its factory raises anything else: the subject's bug, :class:`SubjectFault`, exit 1, one line
  naming the file:line of its traceback's last frame in the subject's code and the exception line
  (the factory takes no input, so it cannot be refusing any);
* ``parse_arms`` raises through ``reader.error``, or raises :class:`SubjectError` or ``ValueError``:
  it rejects the suite's config, bad input, exit 2, naming the suite file; anything else it raises
  is the subject's bug, exit 1, as for the factory;
* loading (the import, the factory, ``parse_arms``) that is still running at the run's ``--timeout``
  is reported as a rank's hang is: exit 3, one line naming the file:line where it hangs, the whole
  stack in a file the line names (:mod:`harness.loading`).
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

# The record families and the facts their checks need live in harness/families.py (so that specs.py, which
# types an arm's facts, need not import the seam); a subject names them here, where the seam is defined.
from harness.families import (  # noqa: F401
    FAMILIES,
    FAMILY_FACTS,
    FIDELITY,
    FINAL_WEIGHTS,
    GRADIENT_DIGESTS,
    GRADIENT_SUM,
    GRAPH,
    METRICS,
    PEC,
    RANK_UPDATES,
    TOKEN_EXCHANGE,
    VERSIONED,
    ArmFacts,
)

if TYPE_CHECKING:
    import torch

    from harness.op_divergence import OpRecorder
    from harness.specs import ArmSpec

# Capabilities: the optional parts of a subject, declared in ``Subject.capabilities`` (never probed for).
CHECKPOINT = "checkpoint"  # Arm.save_checkpoint and load_checkpoint: a suite's resume_at
RECORD_OPS = "record-ops"  # Subject.record_ops: harness run --first-op
TRACE_CACHE = "trace-cache"  # Subject.cache_problem: its arms reuse what they keep in ArmContext.cache_dir
CAPABILITIES = (CHECKPOINT, RECORD_OPS, TRACE_CACHE)
# The methods a declared record family or capability calls for, of an arm (ArmSpec.families, and its
# subject's CHECKPOINT where it resumes) and of a subject (Subject.capabilities): whoever declares one
# without them is refused.
ARM_METHODS: dict[str, tuple[str, ...]] = {
    GRAPH: ("graph_export",),
    FINAL_WEIGHTS: ("final_weights",),
    CHECKPOINT: ("save_checkpoint", "load_checkpoint"),
}
SUBJECT_METHODS: dict[str, tuple[str, ...]] = {RECORD_OPS: ("record_ops",), TRACE_CACHE: ("cache_problem",)}


def undeclared_methods(obj: object, declared: Iterable[str], methods: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The ``methods`` that ``obj`` lacks of those its ``declared`` parts call for, in ``methods``' order."""
    declared = set(declared)
    wanted = (method for part, calls in methods.items() if part in declared for method in calls)
    return [method for method in wanted if not callable(getattr(obj, method, None))]


class SubjectError(Exception):
    """A subject that cannot be found or loaded; the message is one line naming it and why."""


class SubjectFault(Exception):
    """The subject's own code raised while the harness loaded it (its factory, or ``parse_arms`` other than
    rejecting its config): its bug, exit 1; one line naming the subject, where in its code, and the exception."""


class BadRecord(Exception):
    """A record a subject handed a rank that no run could have made: the subject's fault, exit 1 (triage.py);
    the message is one line naming the arm, the rank and the record."""


class CheckpointRefused(Exception):
    """A checkpoint an arm must not load (partial, damaged, of another config, not provably the user's)
    or cannot sign; the message is one line naming the file and what is wrong. Bad input, not a
    regression: a rank that raises it ends the run with exit 2 (triage.py)."""


class OpsNotRecordable(Exception):
    """An arm whose ops cannot be recorded op by op (``Subject.record_ops``); the message is one line
    naming why. A rank that meets it records nothing and trains nothing; the harness says why."""


@dataclass(frozen=True)
class StepRecord:
    """One optimizer update, as ``metrics.jsonl`` records it (one line).

    ``step`` counts updates from 1; ``loss`` and ``grad_norm`` are the global values, identical on
    every process, in fp32 or wider; ``tokens`` are the step's global tokens. ``extra`` holds the
    typed columns of further record families (a versioned pipeline's ``tick``, ``revision``, ages
    and correction statistics): numbers, strings, lists or None.
    """

    step: int
    loss: float
    grad_norm: float
    tokens: int
    step_time_s: float
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "tokens": self.tokens,
            "step_time_s": self.step_time_s,
            **self.extra,
        }


@dataclass(frozen=True)
class RankUpdate:
    """One logical rank right after its optimizer step: its own view of the step's global loss and
    grad norm, and its live parameters by name. The ``replicated`` ones must be equal on every
    logical rank (data parallelism); ``sharded`` are this rank's own (its experts), if any."""

    loss: float
    grad_norm: float
    replicated: Mapping[str, torch.Tensor]
    sharded: Mapping[str, torch.Tensor] = field(default_factory=dict)


class Recorder(Protocol):
    """Where an arm records; one method per record family. Logical ranks may call from their own
    threads, each for its own logical rank. A recorder that does not record a family (a throughput
    run records none) takes the calls and drops them."""

    def rank_update(self, logical_rank: int, step: int, update: RankUpdate) -> None:
        """RANK_UPDATES and GRADIENT_DIGESTS: after the rank's optimizer step for update ``step``."""

    def gradients(self, logical_rank: int, step: int, grads: Mapping[str, torch.Tensor]) -> None:
        """GRADIENT_DIGESTS: the rank's final gradients of update ``step`` (reduced, before clipping),
        in registration order."""

    def gradient_sum(self, logical_rank: int, step: int, summed: torch.Tensor, fp32_resum: torch.Tensor) -> None:
        """GRADIENT_SUM: the rank's replicated gradients of update ``step`` as summed over logical ranks,
        and every logical rank's own gradients summed again in fp32 in logical-rank order; both flat,
        in the same order. Equal bits show the sum was taken in fp32 (before ``rank_update``)."""

    def exchange_event(self, logical_rank: int, event: Mapping[str, Any]) -> None:
        """TOKEN_EXCHANGE: one launch or wait. docs/schema/ has no schema of an event: its fields (step, phase,
        layer, chunk, kind, op, name, buffer_set, seq, rows; a launch's send_counts and recv_counts) are those
        harness/checks/exchange.py reads, listed in docs/run-directory.md (events.rank<k>.jsonl)."""

    def pec_event(self, logical_rank: int, event: Mapping[str, Any]) -> None:
        """PEC: one lookup, gradient all-to-all start or apply of a PEC table."""

    def fidelity(self, record: Mapping[str, Any]) -> None:
        """FIDELITY: an oracle's comparison of one step (process rank 0)."""


@dataclass(frozen=True)
class ArmContext:
    """What a rank hands a subject to build one arm.

    The default process group is initialised (``torch.distributed``, gloo or nccl); ``arm.ranks``
    processes host ``arm.logical_ranks`` logical ranks, process ``p`` the logical ranks
    ``[p*L/P, (p+1)*L/P)``. Python's and torch's RNGs were seeded with ``arm.seed`` just before.
    ``steps`` is the number of updates the arm will be asked for (a pipeline drains after them);
    ``cache_dir`` is where a subject may keep what it can reuse across runs (the reference's traced
    graphs), None when caching is off. ``recorder`` is None where nothing is recorded (a throughput
    run): the arm then skips the work of recording.
    """

    arm: ArmSpec
    device: str
    steps: int
    recorder: Recorder | None
    cache_dir: Path | None = None


class Arm(Protocol):
    """One built arm in one rank process. The rank calls ``step``, ``drain``, ``info`` and ``close`` of
    every arm, and the rest only of an arm that declares what they record: ``final_weights`` for the
    FINAL_WEIGHTS family, ``graph_build`` and ``graph_export`` for GRAPH (``ArmSpec.families``), the
    checkpoint methods for a subject with the CHECKPOINT capability (``Subject.capabilities``).
    :class:`ArmBase` has every method but ``step``."""

    def step(self, step: int) -> StepRecord | None:
        """Trains update ``step`` (1, 2, ...); None while a pipeline is still filling."""

    def drain(self) -> Iterable[StepRecord]:
        """The updates still in flight after the last ``step`` (none for most trainers)."""

    def info(self) -> ArmFacts:
        """Facts only the built arm knows (the checkpoint a launch resumed from), over those its
        ``ArmSpec.facts`` declared; ``arm.json`` records the two."""

    def graph_build(self) -> Mapping[str, Any]:
        """GRAPH: where the traced graph came from and what building it cost (the run's timeline)."""

    def graph_export(self) -> Mapping[str, Any]:
        """GRAPH: the traced step's exchange ops as plain data (``graph.json``), asked for after the
        arm's steps (a subject may trace at its first step)."""

    def final_weights(self) -> Mapping[int, Mapping[str, torch.Tensor]]:
        """FINAL_WEIGHTS: logical rank -> its parameters by name, for the logical ranks of this process."""

    def save_checkpoint(self, folder: Path, step: int) -> None:
        """CHECKPOINT: saves the whole training state after update ``step`` under ``folder``; every
        process calls it. A suite's ``resume_at``: the arm's first launch saves after update k, and a
        fresh launch, perhaps of another process count, loads before update k+1."""

    def load_checkpoint(self, folder: Path, step: int) -> None:
        """CHECKPOINT: restores the state saved after update ``step`` under ``folder``; raises
        :class:`CheckpointRefused`, naming the file and what is missing, when it must not."""

    def close(self) -> None:
        """Releases threads and memory; called once, also after a failure."""


class ArmBase(ABC):
    """An :class:`Arm` with the defaults: a subclass writes ``step``, and the methods its declared
    families and capabilities call for (``graph_export`` for GRAPH, ``final_weights`` for FINAL_WEIGHTS,
    ``save_checkpoint`` and ``load_checkpoint`` for CHECKPOINT): a rank refuses an arm that declares one
    without its method (:data:`ARM_METHODS`). Nothing to drain, no facts beyond those declared,
    nothing to close."""

    @abstractmethod
    def step(self, step: int) -> StepRecord | None: ...

    def drain(self) -> Iterable[StepRecord]:
        return ()

    def info(self) -> ArmFacts:
        return ArmFacts()

    def graph_build(self) -> Mapping[str, Any]:
        return {}

    def close(self) -> None:
        pass


class Subject(Protocol):
    """A system under test. ``name`` labels it in messages; ``families`` is every record family any
    of its arms may emit; ``capabilities`` its optional parts (CAPABILITIES), which the harness uses
    only where declared; ``source`` is its code: a rank that raises with a frame in there is a
    regression (exit 1), anywhere else infrastructure (exit 3). ``train_fields`` names the fields a
    bare ``--set FIELD=VALUE`` may set on ``[train]`` and every arm setting it. :class:`SubjectBase`
    has every attribute and method but ``parse_arms`` and ``build``.

    Optional: ``package``, the importable package (or module) that is the subject's own code, which a
    change check (``harness run --base REV``, harness/change.py) takes from each revision; without
    it, a ``module:factory`` subject's top-level module, and an installed one has no revisions."""

    name: str
    families: frozenset[str]
    capabilities: frozenset[str]
    source: tuple[Path, ...]
    train_fields: Mapping[str, type]

    def parse_arms(self, tables: SuiteTables, reader: SuiteReader) -> dict[str, ArmSpec]:
        """The suite's arms, validated; raise through ``reader.error`` naming the field."""

    def build(self, context: ArmContext) -> Arm:
        """One arm, in a rank process."""

    def cache_problem(self, cache_dir: Path) -> str | None:
        """TRACE_CACHE: why ``cache_dir`` must not be used (an unsafe folder), or None; checked before
        launching. A subject without the capability is handed the folder unchecked, and keeps nothing there."""

    def record_ops(self, arm: Arm, recorder: OpRecorder) -> None:
        """RECORD_OPS: readies a built ``arm`` to have the ops of its steps recorded by ``recorder``
        (harness/op_divergence/), a dispatch mode that sees this thread only. It adds the ops whose
        outputs hold no data yet to ``recorder.placeholders`` (an exchange launch's receive slot) and
        routes a traced step through ``recorder.interpret``, so that each op gets its node's module.
        Raises :class:`OpsNotRecordable` where the arm's ops do not all run on this thread as ops
        (compiled kernels, a model of an oracle beside it). A subject without the capability is refused
        before any re-run is launched (``harness run --first-op``)."""


class SubjectBase(ABC):
    """A :class:`Subject` with the defaults: a subclass writes ``parse_arms`` and ``build``. Its name is
    its class's, its arms record metrics only, it has no optional part, its code is its class's file
    (its package: that file's top-level module), and no field may be set by a bare ``--set``."""

    families: frozenset[str] = frozenset({METRICS})
    capabilities: frozenset[str] = frozenset()
    train_fields: Mapping[str, type] = {}

    @functools.cached_property
    def name(self) -> str:
        return type(self).__name__

    @functools.cached_property
    def source(self) -> tuple[Path, ...]:
        return (Path(inspect.getfile(type(self))).resolve(),)

    @functools.cached_property
    def package(self) -> str:
        return type(self).__module__.split(".")[0]

    @abstractmethod
    def parse_arms(self, tables: SuiteTables, reader: SuiteReader) -> dict[str, ArmSpec]: ...

    @abstractmethod
    def build(self, context: ArmContext) -> Arm: ...


@dataclass(frozen=True)
class SuiteTables:
    """The raw tables of a suite that belong to its subject, and the suite facts they resolve
    against: ``ranks`` (the default process count, ``--ranks``), ``steps``, the suite file (for
    relative paths in it) and ``device`` (``--device``)."""

    model: dict[str, Any]
    train: dict[str, Any]
    arms: dict[str, Any]
    ranks: int
    steps: int
    suite_file: Path
    device: str


class SuiteReader(Protocol):
    """The suite validator's typed readers, which a subject's ``parse_arms`` and a check family's
    parser use: each raises :class:`~harness.suites.SuiteError` naming the file (or ``--set``) and the
    dotted field."""

    def error(self, dotted: str, msg: str) -> Exception: ...
    def table(self, raw: Any, dotted: str, allowed: Sequence[str]) -> dict: ...
    def str_(self, value: Any, dotted: str, choices: tuple[str, ...] | None = None) -> str: ...
    def int_(self, value: Any, dotted: str, lo: int = 1, hi: int | None = None) -> int: ...
    def typed(self, value: Any, dotted: str, expected: type, positive: bool) -> Any: ...
    def str_list(self, value: Any, dotted: str, choices: Sequence[str]) -> tuple[str, ...]: ...
    def arm_pair(self, raw: dict, dotted: str, arms: dict[str, ArmSpec]) -> tuple[str, str]: ...
    def metric_list(self, raw: dict, dotted: str, default: tuple[str, ...]) -> tuple[str, ...]: ...
    def tier(self, raw: dict, dotted: str) -> dict[str, Any]: ...
    def check_name(self, value: Any, dotted: str) -> str: ...
    def name(self, value: Any, dotted: str) -> str: ...
    def overridden(self, dotted: str) -> bool: ...
    def for_file(self, shown: str) -> SuiteReader: ...

    max_ranks: int
