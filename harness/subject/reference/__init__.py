"""The bundled reference (``harness/reference/``) as a subject, ``subject = "reference"``.

This package is the only code of the harness that imports the reference (the Hugging Face
oracle, which trains beside it, aside): the rest knows it through
:mod:`harness.subject.protocol` alone. :mod:`.arms` parses a suite's tables into the reference's
configs; :mod:`.arm` builds and trains one arm in a rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import harness.reference
from harness.reference.chunking.trace_cache import open_cache
from harness.subject import protocol
from harness.subject.reference.arms import TRAIN_FIELDS, parse_arms
from harness.trust import TrustError

if TYPE_CHECKING:
    from harness.op_divergence import OpRecorder
    from harness.specs import ArmSpec


class ReferenceSubject:
    """The DeepSeek-V3 MoE with MinimalAsyncEP-style exchange, graph chunking, versioned backward and PEC."""

    name = "reference"
    families = frozenset(protocol.FAMILIES)
    capabilities = frozenset(protocol.CAPABILITIES)
    source = (Path(harness.reference.__file__).resolve().parent,)
    package = "harness.reference"  # what a change check (--base) takes from each revision
    train_fields = TRAIN_FIELDS

    def parse_arms(self, tables: protocol.SuiteTables, reader: protocol.SuiteReader) -> dict[str, ArmSpec]:
        return parse_arms(tables, reader)

    def build(self, context: protocol.ArmContext) -> protocol.Arm:
        from harness.subject.reference.arm import ReferenceArm  # torch and the model: in the ranks only

        return ReferenceArm(context)

    def record_ops(self, arm: protocol.Arm, recorder: OpRecorder) -> None:
        """A plain arm with one logical rank per process, eager or traced (not by regional Inductor)."""
        arm.record_ops(recorder)

    def cache_problem(self, cache_dir: Path) -> str | None:
        """Why the trace cache folder is unsafe to load graphs from (reference/chunking/trace_cache.py)."""
        try:
            open_cache(cache_dir)
        except TrustError as error:
            return f"trace cache {error.path}: not used: {error.why}; tracing instead"
        return None


def subject() -> ReferenceSubject:
    return ReferenceSubject()
