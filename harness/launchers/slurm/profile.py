"""Slurm cluster profiles, ``slurm/<name>.toml``: where a run's jobs go and what each task gets.

A profile is validated as suite fields are (exit 2 naming the file, or the flag, and the field),
before anything is submitted. Every value that reaches the job script is quoted: submitit quotes
the ``#SBATCH`` values, and ``env`` becomes ``export NAME=<quoted value>``; the ``setup`` lines are
the one exception, shell commands written as the user wants them run.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.plan import LaunchGroup
from harness.shipped import shipped_dir
from harness.suites import SuiteError, display_path, field_reader

PROFILES_DIR = shipped_dir("slurm")
PROFILE_KEYS = (
    "description",
    "partition",
    "account",
    "qos",
    "constraint",
    "gpus_per_node",
    "cpus_per_task",
    "mem_gb",
    "time",
    "setup",
    "env",
)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class SlurmProfile:
    """A cluster profile, ``slurm/<name>.toml``: where the jobs run and what each task gets."""

    name: str
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: float | None = None
    time_min: int = 60  # Slurm's own limit per job; its granularity is a minute
    setup: tuple[str, ...] = ()  # shell lines before the tasks start: module loads, venv activation
    env: dict[str, str] = field(default_factory=dict)  # exported to the tasks (NCCL settings)

    def script_setup(self) -> list[str]:
        """The job script's setup: the profile's lines as written, then its environment, quoted."""
        return [*self.setup, *(f"export {name}={shlex.quote(value)}" for name, value in self.env.items())]


def profile_path(name_or_path: str) -> Path:
    """``--profile``: a path to a TOML file, or the name of one under slurm/."""
    path = Path(name_or_path)
    return path if path.suffix == ".toml" or path.is_file() else PROFILES_DIR / f"{name_or_path}.toml"


def load_profile(name_or_path: str | None, flags: dict[str, tuple[str, Any]] | None = None) -> SlurmProfile:
    """Reads and validates a profile (None: none, Slurm's defaults); ``flags`` maps a profile key to
    (the flag that sets it, value), e.g. ``{"time": ("--time", 5)}``, validated as the file's
    fields are and named in errors."""
    raw: dict[str, Any] = {}
    path, shown = Path("default"), "--profile"
    if name_or_path is not None:
        path = profile_path(name_or_path)
        shown = display_path(path)
        if not path.is_file():
            known = ", ".join(p.stem for p in sorted(PROFILES_DIR.glob("*.toml")))
            raise SuiteError(f"{shown}: no such Slurm profile (profiles: {known})")
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise SuiteError(f"{shown}: invalid TOML: {e}") from None
    v = field_reader(shown)
    for key, (flag, value) in (flags or {}).items():
        raw[key] = value
        v.origins[key] = flag
    v.table(raw, "", PROFILE_KEYS)
    strings = {key: v.str_(raw[key], key) for key in ("partition", "account", "qos", "constraint") if key in raw}
    setup = raw.get("setup", [])
    if not isinstance(setup, list):
        raise v.error("setup", f"expected a list of shell lines, got {json.dumps(setup)}")
    for i, line in enumerate(setup):
        if "\n" in v.str_(line, f"setup.{i}"):
            raise v.error(f"setup.{i}", "expected one line, got a string with a newline")
    env = raw.get("env", {})
    if not isinstance(env, dict):
        raise v.error("env", f'expected a table of NAME = "value", got {json.dumps(env)}')
    for name, value in env.items():
        if not _ENV_NAME.match(name):
            raise v.error(f"env.{name}", "expected an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        v.typed(value, f"env.{name}", str, False)
    return SlurmProfile(
        name=path.stem,
        **strings,
        gpus_per_node=v.int_(raw.get("gpus_per_node", 0), "gpus_per_node", lo=0),
        cpus_per_task=v.int_(raw.get("cpus_per_task", 1), "cpus_per_task"),
        mem_gb=v.typed(raw["mem_gb"], "mem_gb", float, True) if "mem_gb" in raw else None,
        time_min=v.int_(raw.get("time", 60), "time"),
        setup=tuple(setup),
        env=dict(env),
    )


def job_shape(group: LaunchGroup, nodes: int) -> int:
    """Tasks per node of a group's job: its ranks spread evenly over ``nodes``."""
    if nodes < 1 or group.ranks % nodes:
        raise SuiteError(f"--nodes {nodes}: group '{group.name}' has {group.ranks} ranks, not a multiple of {nodes}")
    return group.ranks // nodes


def check_gpus(profile: SlurmProfile, device: str, tasks_per_node: int) -> None:
    """``--device cuda`` runs one rank per GPU: the profile must give each node enough."""
    if device == "cuda" and profile.gpus_per_node < tasks_per_node:
        raise SuiteError(
            f"--device cuda: {tasks_per_node} ranks per node need gpus_per_node >= {tasks_per_node}"
            f" (profile {profile.name}: {profile.gpus_per_node}; or --gpus-per-node)"
        )


def executor_parameters(
    profile: SlurmProfile, name: str, nodes: int, tasks_per_node: int, after: str | None
) -> dict[str, Any]:
    """submitit's parameters for one group's job; ``after``: the job it waits for (afterany)."""
    optional = {
        "slurm_partition": profile.partition,
        "slurm_account": profile.account,
        "slurm_qos": profile.qos,
        "slurm_constraint": profile.constraint,
        "gpus_per_node": profile.gpus_per_node or None,
        "mem_gb": profile.mem_gb,
    }
    # submitit asks Slurm for SIGUSR2 90 s before the time limit, for checkpointing the harness does not
    # use; a job shorter than that gets it at once, before any handler, and dies of it. SIGURG is ignored.
    additional = {"signal": "URG@90", **({"dependency": f"afterany:{after}"} if after else {})}
    return {
        "name": name,
        "nodes": nodes,
        "tasks_per_node": tasks_per_node,
        "cpus_per_task": profile.cpus_per_task,
        "timeout_min": profile.time_min,
        "slurm_setup": profile.script_setup(),
        "slurm_additional_parameters": additional,
        **{key: value for key, value in optional.items() if value is not None},
    }
