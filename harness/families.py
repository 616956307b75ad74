"""The record families an arm can record, and the facts (:class:`ArmFacts`) that their checks need
of an arm beyond its records: the vocabulary the seam (harness/subject/protocol.py, which names
them all for a subject), the specs (harness/specs.py, which hold an arm's facts), the records and
the checks share. It imports nothing of the harness, so each of them can."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

# Record families: what an arm can record, each through one Recorder method or Arm property.
METRICS = "metrics"  # StepRecord per update, from Arm.step: every subject emits it
RANK_UPDATES = "rank-updates"  # Recorder.rank_update: each logical rank's loss, grad norm, replica hash
GRADIENT_DIGESTS = "gradient-digests"  # Recorder.gradients + rank_update: logical rank 0's digests per step
FINAL_WEIGHTS = "final-weights"  # Arm.final_weights: every logical rank's parameters after the last update
TOKEN_EXCHANGE = "token-exchange"  # Recorder.exchange_event: expert-parallel launches and waits
GRAPH = "graph"  # Arm.graph_export: a traced step's scheduled exchange ops
VERSIONED = "versioned-updates"  # StepRecord.extra: a delayed pipeline's ages, revisions, corrections
PEC = "pec-events"  # Recorder.pec_event: a PEC table's lookups, gradient all-to-all starts and applies
FIDELITY = "fidelity"  # Recorder.fidelity: an oracle's lockstep comparison, per step
GRADIENT_SUM = "gradient-sum"  # Recorder.gradient_sum + rank_update: each logical rank's sum and its fp32 re-sum
FAMILIES = (
    METRICS,
    RANK_UPDATES,
    GRADIENT_DIGESTS,
    FINAL_WEIGHTS,
    TOKEN_EXCHANGE,
    GRAPH,
    VERSIONED,
    PEC,
    FIDELITY,
    GRADIENT_SUM,
)
# The facts (ArmFacts fields) an arm must declare for the checks that read each record family; see ArmFacts.needs.
FAMILY_FACTS: dict[str, tuple[str, ...]] = {
    TOKEN_EXCHANGE: ("moe_layers", "chunks", "num_buffer_sets"),
    GRAPH: ("chunk_roots", "chunks", "num_buffer_sets"),
    VERSIONED: ("pipeline", "delay", "correction", "correction_clip"),
    PEC: ("pec",),
}


@dataclass(frozen=True)
class ArmFacts:
    """What the checks know of an arm beyond its records, typed: the checks read these, never an arm's
    config (``ArmSpec.train``, the subject's own). ``parse_arms`` declares them with each arm
    (``ArmSpec.facts``); the built arm may add what only it knows (``Arm.info``: the checkpoint a
    launch resumed from), and ``arm.json`` records the two. None: not known.

    A record family's checks need some of them (:data:`FAMILY_FACTS`, and :meth:`needs`): a suite
    whose check reads a family from an arm that lacks one is refused at load (exit 2), naming the
    family and the fact."""

    # token-exchange and graph: the expert-parallel layers and how their tokens are exchanged
    moe_layers: tuple[int, ...] | None = None  # the layers that exchange tokens (Hugging Face layer indices)
    chunks: int | None = None  # chunks each MoE layer exchanges per pass (1: unchunked)
    num_buffer_sets: int | None = None  # receive buffer sets the chunks rotate through
    chunk_roots: tuple[str, ...] | None = None  # graph: each MoE layer's chunk root (module name), in layer order
    forced_balanced: bool = False  # routing sends every expert as many rows (counts known in advance)
    experts_per_token: int | None = None  # the top-k; needed with forced_balanced
    tokens_per_step: int | None = None  # tokens a logical rank routes per step; needed with forced_balanced
    # versioned-updates: a delayed pipeline
    pipeline: str | None = None  # whose exchange order it follows: "versioned" or "delayed-oracle"
    delay: int | None = None  # batches between a batch's forward and its update
    correction: str | None = None  # "off", "when_available" or "always"
    correction_clip: float | None = None  # importance weights are clamped to [0, correction_clip]
    recomputes: bool = False  # its backward replays the forward (token-exchange phase "recompute")
    # pec-events: the trainer driving a PEC table's gradient all-to-alls
    pec: str | None = None  # "pipelined", "sequential" or "legacy"
    # comparisons: config fields that change how the arm trains, not what (a resumed arm may differ in them)
    how_only: tuple[str, ...] = ()
    # what a launch observed (Arm.info)
    resumed_from: int | None = None  # the update whose checkpoint a fresh launch loaded

    def needs(self, family: str, emits: Iterable[str] = ()) -> tuple[str, ...]:
        """The facts the checks reading ``family`` need of an arm that emits ``emits``: the family's own
        (FAMILY_FACTS), the top-k and tokens of forced-balanced routing, and a pipeline's order and delay
        for the exchanges a delayed pipeline makes."""
        needed = FAMILY_FACTS.get(family, ())
        if family == TOKEN_EXCHANGE and self.forced_balanced:
            needed += ("experts_per_token", "tokens_per_step")
        if family == TOKEN_EXCHANGE and VERSIONED in emits:
            needed += ("pipeline", "delay", "correction")
        return needed

    def missing(self, family: str, emits: Iterable[str] = ()) -> tuple[str, ...]:
        """The facts :meth:`needs` lists that are not known."""
        return tuple(fact for fact in self.needs(family, tuple(emits)) if getattr(self, fact) is None)

    def updated(self, built: ArmFacts) -> ArmFacts:
        """These facts with those the built arm set (fields away from their defaults) in their place."""
        return replace(self, **built.set_fields())

    def set_fields(self) -> dict[str, Any]:
        """The facts away from their defaults (None, False, none): those known."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    def to_json(self) -> dict[str, Any]:
        """The known facts, as ``arm.json`` and ``manifest.json`` record them."""
        return {name: list(v) if isinstance(v, tuple) else v for name, v in self.set_fields().items()}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ArmFacts:
        """Facts as :meth:`to_json` wrote them; keys it does not know are not facts, and are left out."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in known})
