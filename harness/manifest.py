"""``manifest.json``: what a run was asked to do, written once before any rank starts.

The ranks build their arms from it, ``harness collect`` judges a Slurm run from it, and the report
shows it; so it is one typed value, written and read here and nowhere else, with a schema version
(``docs/schema/manifest.schema.json``). The suite inside is :meth:`SuiteSpec.to_dict`, read back with
:meth:`SuiteSpec.from_dict`: the same types on both sides of the process boundary.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from harness.files import write_json_atomic
from harness.plan import LaunchGroup
from harness.revisions import Revision
from harness.rundir import MANIFEST
from harness.specs import SuiteSpec

SCHEMA_VERSION = 1


class ManifestError(Exception):
    """A manifest.json that cannot be read; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Manifest:
    """One run's request: the command, the resolved suite, the environment it runs in, its launch
    groups (harness/plan.py), the golden plan with absolute paths, the time limit, the trace cache
    the ranks may use, and, for a change check, its revisions by label (harness/revisions.py)."""

    command: list[str]
    created: str
    suite: dict[str, Any]
    versions: dict[str, Any]
    device: str
    device_class: str
    cpu_isa: dict[str, Any] | None
    backend: str
    ranks: int
    seed: list[int]
    env_key: str
    golden_config: dict[str, Any]
    launches: list[LaunchGroup]
    golden: dict[str, Any]
    timeout_s: float
    trace_cache: str | None
    schema_version: int = SCHEMA_VERSION
    revisions: dict[str, Revision] = field(default_factory=dict)

    def spec(self) -> SuiteSpec:
        """The suite, typed again."""
        return SuiteSpec.from_dict(self.suite)

    def launch(self, group: str) -> LaunchGroup:
        """The launch group named ``group``."""
        return next(g for g in self.launches if g.name == group)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write(self, run_dir: Path) -> None:
        write_json_atomic(Path(run_dir) / MANIFEST, self.to_json())

    @classmethod
    def read(cls, run_dir: Path) -> Manifest:
        """The run directory's manifest; ManifestError naming the file and the field when it is not one."""
        path = Path(run_dir) / MANIFEST
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"{path}: not readable: {e}") from None
        if not isinstance(raw, dict):
            raise ManifestError(f"{path}: expected a JSON object")
        version = raw.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ManifestError(f"{path}: schema_version {version!r}, this harness reads {SCHEMA_VERSION}")
        fields = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing, unknown = sorted(required - raw.keys()), sorted(raw.keys() - fields)
        if missing:
            raise ManifestError(f"{path}: missing {', '.join(missing)}")
        if unknown:
            raise ManifestError(f"{path}: unknown {', '.join(unknown)}")
        try:
            launches = [LaunchGroup.from_dict(g) for g in raw["launches"]]
        except (TypeError, KeyError, AttributeError) as e:
            raise ManifestError(f"{path}: launches: not a list of launch groups: {e}") from None
        try:
            revisions = {label: Revision.from_dict(r) for label, r in raw.get("revisions", {}).items()}
        except (TypeError, AttributeError) as e:
            raise ManifestError(f"{path}: revisions: not revisions by label: {e}") from None
        return cls(**{**raw, "launches": launches, "revisions": revisions})
