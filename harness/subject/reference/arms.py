"""The reference's arms as a suite writes them: ``[model]``, ``[train]`` and ``[arms.NAME]``.

Process count and EP degree: ``ranks`` (suite level, ``--ranks``) is the default process count of
every arm, and ``ep`` defaults to the suite's ``ranks``. So an arm that sets only ``ranks = 1``
hosts the whole EP group in one process (logical ranks), whatever ``--ranks``.

Trainers: an arm that sets any field of the delayed pipeline (``delay``, ``max_gradient_staleness``,
``retention``, ``correction``, ``correction_clip``, ``trainer``, ``apply_twice_batch``), in its own
table or in ``[train]``, is a *versioned* arm: it resolves to a ``PipelineConfig`` and runs on
``VersionedTrainer``, or on ``DelayedOracleTrainer`` with ``trainer = "delayed-oracle"``. An arm that
sets a PEC field (``pec``, ``pec_optimizer``, ...) resolves to a ``PECConfig``. Every other arm is a
plain ``TrainConfig`` on ``Trainer``. An arm may also name its own ``model`` (default: ``[model]
config``) and an ``oracle``: ``"hf"`` trains it in lockstep with Hugging Face transformers (see
:mod:`harness.oracles`), which must be installed.

``[model] config`` is a named config or a Hugging Face ``config.json``; any DeepseekV3Config field
in ``[model]`` replaces its value. Every mistake is one line naming the file and the dotted field.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import oracles
from harness.reference.hf_config import HF_BASE, HFConfigError, hf_config_fields
from harness.reference.model import CONFIGS, DeepseekV3Config, get_config
from harness.reference.pec import PECConfig
from harness.reference.pipeline import PipelineConfig
from harness.reference.train import TRACED, TrainConfig
from harness.specs import ArmSpec
from harness.subject import protocol
from harness.subject.config import display_path, field_types, show

# Setting any of these makes an arm versioned; any of the PEC ones makes its embedding a PEC table.
PIPELINE_FIELDS = tuple(
    f.name for f in dataclasses.fields(PipelineConfig) if f.name not in TrainConfig.__dataclass_fields__
)
PEC_FIELDS = tuple(f.name for f in dataclasses.fields(PECConfig) if f.name not in TrainConfig.__dataclass_fields__)
# TrainConfig fields, the pipeline's and PEC's, that a suite may set in [train] or [arms.X]; the model
# comes from [model] and the device from --device, so that one suite file runs anywhere.
TRAIN_FIELDS: dict[str, type] = {
    name: kind
    for name, kind in (field_types(PipelineConfig) | field_types(PECConfig)).items()
    if name not in ("model", "model_overrides", "device")
}
# Sizes and rates that must be positive; other numbers need only be non-negative ints or finite
# floats, and the reference's TrainConfig validates its own domains after this.
POSITIVE = {"ep", "local_batch", "seq_len", "chunks", "num_buffer_sets", "lr", "max_norm"}
# DeepseekV3Config fields a suite may set in [model] (or --set model.FIELD), and those a
# config.json may set to null (TOML has no null: in a suite they are set or left out).
_MODEL_HINTS = typing.get_type_hints(DeepseekV3Config)
MODEL_FIELDS = field_types(DeepseekV3Config)
_MODEL_NULLABLE = {name for name, hint in _MODEL_HINTS.items() if type(None) in typing.get_args(hint)}
# Every model int is a size >= 1 but these; floats need only be finite but the positive ones.
_MODEL_MAY_BE_ZERO = {"first_k_dense_replace", "n_shared_experts", "pad_token_id"}
_MODEL_POSITIVE = {name for name, kind in MODEL_FIELDS.items() if kind is int and name not in _MODEL_MAY_BE_ZERO} | {
    "rms_norm_eps",
    "rope_theta",
    "initializer_range",
    "rope_factor",
    "rope_beta_fast",
    "rope_beta_slow",
}
# What every reference arm records; traced, versioned, PEC and oracle arms add their own.
BASE_FAMILIES = (
    protocol.METRICS,
    protocol.RANK_UPDATES,
    protocol.GRADIENT_DIGESTS,
    protocol.FINAL_WEIGHTS,
    protocol.TOKEN_EXCHANGE,
)
# The module a chunk root names, by MoE layer (Hugging Face module names); see TrainConfig.chunk_roots.
CHUNK_ROOTS = {"moe": "model.layers.{layer}.mlp", "block": "model.layers.{layer}"}
# Fields that change how an arm trains, not what it computes: a resumed arm may differ from its straight one in them.
HOW_ONLY = ("retention", "checkpoint_fault")


def is_versioned(train: dict[str, Any]) -> bool:
    """An arm that sets any pipeline field runs on a delayed trainer (PipelineConfig.trainer)."""
    return any(key in train for key in PIPELINE_FIELDS)


def is_pec(train: dict[str, Any]) -> bool:
    """An arm that sets any PEC field runs on PECTrainer."""
    return any(key in train for key in PEC_FIELDS)


def train_config(train: dict[str, Any]) -> TrainConfig:
    """An arm's fields as the reference's config: a PipelineConfig for a versioned arm, a PECConfig for a PEC arm."""
    if is_versioned(train) and is_pec(train):
        raise ValueError(f"a PEC arm ({', '.join(PEC_FIELDS)}) has no delayed pipeline ({', '.join(PIPELINE_FIELDS)})")
    if is_versioned(train):
        return PipelineConfig(**train)
    return PECConfig(**train) if is_pec(train) else TrainConfig(**train)


def golden_config(config: TrainConfig) -> dict[str, Any]:
    """The fields an arm sets away from the defaults of its config class (what a golden's config
    records), and a versioned arm's ``trainer`` or a PEC arm's ``pec``, so that a field added later
    with a default that keeps the old behaviour leaves older goldens valid."""
    train = dataclasses.asdict(config)
    defaults = dataclasses.asdict(type(config)())
    differing = {k: v for k, v in train.items() if k not in defaults or defaults[k] != v}
    if isinstance(config, PipelineConfig):
        return {"trainer": config.trainer, **differing}
    return {"pec": config.pec, **differing} if isinstance(config, PECConfig) else differing


# An arm's stop and resume (ArmSpec.resume_at, resume_ranks): fields of the arm, not of its training.
RESUME_FIELDS = ("resume_at", "resume_ranks")


def families(config: TrainConfig, oracle: str | None) -> tuple[str, ...]:
    """The record families an arm of this config emits."""
    found = list(BASE_FAMILIES)
    if config.chunking in TRACED:
        found.append(protocol.GRAPH)
    if isinstance(config, PipelineConfig):
        found.append(protocol.VERSIONED)
    if isinstance(config, PECConfig):
        found.append(protocol.PEC)
    if config.mixed:
        found.append(protocol.GRADIENT_SUM)
    if oracle == "torchrec":  # the reference's own PEC trainer, with torchrec's table beside it
        found.append(protocol.FIDELITY)
    elif oracle:  # the lockstep wrapper keeps the reference's weights to itself
        found = [f for f in found if f != protocol.FINAL_WEIGHTS] + [protocol.FIDELITY]
    return tuple(found)


def arm_facts(config: TrainConfig) -> protocol.ArmFacts:
    """What the checks know of an arm of this config: its MoE layers and their chunk roots, how its
    tokens are exchanged and routed, and a delayed pipeline's or a PEC table's trainer."""
    model = config.model_config()
    layers = tuple(layer for layer in range(model.num_hidden_layers) if model.is_moe_layer(layer))
    pipeline = config if isinstance(config, PipelineConfig) else None
    return protocol.ArmFacts(
        moe_layers=layers,
        chunks=config.chunks if config.chunking != "none" else 1,
        num_buffer_sets=config.num_buffer_sets,
        chunk_roots=tuple(CHUNK_ROOTS[config.chunk_roots].format(layer=layer) for layer in layers),
        forced_balanced=config.routing == "forced-balanced",
        experts_per_token=model.num_experts_per_tok,
        tokens_per_step=config.local_batch * config.seq_len,
        pipeline=pipeline.trainer if pipeline else None,
        delay=pipeline.delay if pipeline else None,
        correction=pipeline.correction if pipeline else None,
        correction_clip=pipeline.correction_clip if pipeline else None,
        recomputes=pipeline is not None and pipeline.retention == "replay",
        pec=config.pec if isinstance(config, PECConfig) else None,
        how_only=HOW_ONLY,
    )


@dataclass(frozen=True)
class _Model:
    """[model] resolved: the reference's config name and the fields set away from it (what the
    ranks build, in TrainConfig.model and model_overrides), and the config as the suite named it."""

    name: str
    overrides: dict[str, Any]
    shown: str
    n_routed_experts: int


def parse_arms(tables: protocol.SuiteTables, v: protocol.SuiteReader) -> dict[str, ArmSpec]:
    """Every [arms.NAME] table over [train] and [model], as the reference's configs."""
    model = _model(tables.model, tables.suite_file, v)
    base = _train_table(tables.train, "train", tuple(TRAIN_FIELDS), v)
    return {v.name(arm, f"arms.{arm}"): _arm(arm, table, base, model, tables, v) for arm, table in tables.arms.items()}


def _train_table(raw: Any, dotted: str, allowed: tuple[str, ...], v: protocol.SuiteReader) -> dict[str, Any]:
    table = v.table(raw, dotted, allowed)
    return {
        k: v.typed(value, f"{dotted}.{k}", TRAIN_FIELDS[k], k in POSITIVE)
        for k, value in table.items()
        if k in TRAIN_FIELDS
    }


def _model_value(value: Any, dotted: str, key: str, v: protocol.SuiteReader) -> Any:
    """One DeepseekV3Config field, typed by its annotation; null only where it allows None."""
    if value is None and key in _MODEL_NULLABLE:
        return None
    return v.typed(value, dotted, MODEL_FIELDS[key], key in _MODEL_POSITIVE)


def _model(raw: Any, suite_file: Path, v: protocol.SuiteReader) -> _Model:
    """[model]: ``config``, a named config or a Hugging Face config.json, then any DeepseekV3Config
    fields replacing its values. A field that makes the model invalid is named where it was set."""
    if not isinstance(raw, dict):
        raise v.error("model", f"expected a table, got {show(raw)}")
    for key in raw:
        if key != "config" and key not in MODEL_FIELDS:
            near = difflib.get_close_matches(key, MODEL_FIELDS, n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise v.error(f"model.{key}", f"unknown key ({hint}allowed: config and the DeepseekV3Config fields)")
    shown = v.str_(raw.get("config", TrainConfig.model), "model.config")
    where: dict[str, tuple[protocol.SuiteReader, str]] = {}  # field -> the reader of its file, its dotted key
    if shown in CONFIGS:
        name, values = shown, {}
    elif shown.endswith(".json") or "/" in shown:
        name, values = HF_BASE, _hf_config(shown, suite_file, where, v)
    else:
        choices = ", ".join(CONFIGS)
        raise v.error(
            "model.config", f"expected one of {choices} or a path to a Hugging Face config.json, got {show(shown)}"
        )
    for key, value in raw.items():
        if key != "config":
            values[key] = _model_value(value, f"model.{key}", key, v)
            where[key] = (v, f"model.{key}")
    try:
        resolved = get_config(name, **values)
    except ValueError as e:
        # DeepseekV3Config's messages start with the field they reject.
        reader, dotted = where.get(str(e).split()[0], (v, "model.config"))
        raise reader.error(dotted, str(e)) from None
    overrides = {k: value for k, value in values.items() if getattr(CONFIGS[name], k) != value}
    return _Model(name, overrides, shown, resolved.n_routed_experts)


def _hf_config(
    shown: str, suite_file: Path, where: dict[str, tuple[protocol.SuiteReader, str]], v: protocol.SuiteReader
) -> dict[str, Any]:
    """The fields a Hugging Face config.json sets, typed; errors name the JSON file and key.
    A relative path is relative to the suite file, or to the working directory from --set."""
    path = Path(shown)
    if not path.is_absolute() and not v.overridden("model.config"):
        path = suite_file.parent / path
    if not path.is_file():
        raise v.error("model.config", f"no such file {show(str(path))}")
    hf_file = v.for_file(display_path(path))
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise hf_file.error("", f"invalid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise hf_file.error("", f"expected a JSON object, got {show(hf)}")
    try:
        found = hf_config_fields(hf)
    except HFConfigError as e:
        raise hf_file.error(e.key, e.reason) from None
    values = {}
    for field, (key, value) in found.items():
        values[field] = _model_value(value, key, field, hf_file)
        where[field] = (hf_file, key)
    return values


def _arm(
    name: str, raw: Any, base: dict[str, Any], model: _Model, tables: protocol.SuiteTables, v: protocol.SuiteReader
) -> ArmSpec:
    """One [arms.NAME] table over [train]; its ``model``, a named config, replaces [model]'s
    ``config`` and keeps [model]'s field overrides."""
    dotted = f"arms.{name}"
    own = _train_table(raw, dotted, ("ranks", "model", "oracle", *RESUME_FIELDS, *TRAIN_FIELDS), v)
    ranks = v.int_(raw["ranks"], f"{dotted}.ranks", 1, v.max_ranks) if "ranks" in raw else tables.ranks
    if "model" in raw:
        named = v.str_(raw["model"], f"{dotted}.model", tuple(CONFIGS))
        model = _model({**tables.model, "config": named}, tables.suite_file, v)
    ranks_field = f"{dotted}.ranks" if "ranks" in raw else "ranks"
    merged = {
        "ep": tables.ranks,
        **base,
        **own,
        "model": model.name,
        "model_overrides": model.overrides,
        "device": tables.device,
    }

    def source(key: str) -> str:
        """The field a merged value came from; ep falls back to the suite's ranks."""
        if key in own:
            return f"{dotted}.{key}"
        if key in base:
            return f"train.{key}"
        return "ranks" if key == "ep" else dotted

    if model.n_routed_experts % merged["ep"]:
        raise v.error(
            source("ep"),
            f"EP degree {merged['ep']} does not divide the {model.n_routed_experts} routed experts"
            f" of model {show(model.shown)}",
        )
    if merged["ep"] % ranks:
        raise v.error(ranks_field, f"{ranks} processes do not divide EP degree {merged['ep']} of arm {show(name)}")
    try:
        config = train_config(merged)
    except (TypeError, ValueError) as e:
        # The reference's own validation; its messages start with the field they reject.
        first_word = str(e).split()[0] if str(e) else ""
        raise v.error(source(first_word) if first_word in TRAIN_FIELDS else dotted, str(e)) from None
    if isinstance(config, PipelineConfig):
        _pipeline(config, source, tables.steps, v)
    oracle = _oracle(raw["oracle"], f"{dotted}.oracle", config, v) if "oracle" in raw else None
    if oracle == "torchrec" and config.ep != ranks:
        raise v.error(
            f"{dotted}.oracle",
            f"torchrec's PEC runs one logical rank per process: needs ep ({config.ep}) equal to the arm's"
            f" process count ({ranks}; {ranks_field})",
        )
    resume_at, resume_ranks = _resume(raw, dotted, config, oracle, tables.steps, v)
    return ArmSpec(
        name,
        ranks,
        dataclasses.asdict(config),
        logical_ranks=config.ep,
        families=families(config, oracle),
        seed=config.seed,
        golden_config=golden_config(config),
        dtype=config.precision if config.mixed else config.dtype,  # what its goldens are keyed by
        oracle=oracle,
        resume_at=resume_at,
        resume_ranks=resume_ranks,
        facts=arm_facts(config),
    )


def _resume(
    raw: dict, dotted: str, config: TrainConfig, oracle: str | None, steps: int, v: protocol.SuiteReader
) -> tuple[int | None, int | None]:
    """``resume_at`` (a step in 1..steps-1: the save) and ``resume_ranks`` (the processes that load,
    dividing the EP degree), for an arm whose whole state a checkpoint holds: a plain, versioned or
    PEC one, not the delayed oracle's pending batches nor an oracle's model beside the reference."""
    if "resume_at" not in raw:
        if "resume_ranks" in raw:
            raise v.error(f"{dotted}.resume_ranks", "needs resume_at: only a resumed arm launches twice")
        return None, None
    at = v.int_(raw["resume_at"], f"{dotted}.resume_at", 1, steps - 1) if steps > 1 else None
    if at is None:
        raise v.error(f"{dotted}.resume_at", f"a run of {steps} step has no step to resume after")
    if oracle is not None:
        raise v.error(f"{dotted}.resume_at", f"needs an arm without an oracle: the checkpoint does not hold {oracle}'s")
    if isinstance(config, PipelineConfig) and config.trainer != "versioned":
        raise v.error(
            f"{dotted}.resume_at",
            f'needs trainer = "versioned": the checkpoint does not hold the pending batches of {config.trainer}',
        )
    ranks = v.int_(raw["resume_ranks"], f"{dotted}.resume_ranks", 1, v.max_ranks) if "resume_ranks" in raw else None
    if ranks is not None and config.ep % ranks:
        raise v.error(f"{dotted}.resume_ranks", f"{ranks} processes do not divide EP degree {config.ep}")
    return at, ranks


def _oracle(value: Any, dotted: str, config: TrainConfig, v: protocol.SuiteReader) -> str:
    """An oracle the arm's configuration has a counterpart in, and whose package is installed."""
    oracle = v.str_(value, dotted, tuple(oracles.ORACLES))
    problem = UNSUPPORTED_BY[oracle](config) or oracles.missing_dependency(oracle)
    if problem:
        raise v.error(dotted, problem)
    return oracle


def unsupported_by_hf(config: TrainConfig) -> str | None:
    """Why an arm's configuration has no Hugging Face counterpart, or None.

    transformers routes by sigmoid scores and group-limited top-k, and trains one dense model:
    no delayed pipeline, no row-wise sharded embedding.
    """
    if type(config) is not TrainConfig:
        return "needs a plain arm: Hugging Face has no delayed pipeline or PEC embedding (unset their fields)"
    if config.routing != "learned":
        return f'needs routing = "learned": Hugging Face has no {config.routing} routing'
    scoring = config.model_config().scoring_func
    if scoring != "sigmoid":
        return f"needs a model with sigmoid scoring: Hugging Face has no {scoring}"
    return None


def unsupported_by_torchtitan(config: TrainConfig) -> str | None:
    """Why an arm's configuration has no torchtitan counterpart, or None.

    torchtitan's DeepSeek-V3 routes as the reference does (learned, or round-robin forced balance),
    but it trains one dense model, casts its experts to bf16 (the oracle keeps them in fp32, so it
    owes fp32 bits) and does not scale cos/sin for YaRN.
    """
    if type(config) is not TrainConfig:
        return "needs a plain arm: torchtitan's model has no delayed pipeline or PEC embedding (unset their fields)"
    if config.mixed or config.dtype != "float32":
        return 'needs precision = "pure" in dtype float32: the torchtitan oracle is held to fp32 bits'
    rope = config.model_config().rope_type
    if rope != "default":
        return f"needs a model with rope_type 'default': torchtitan does not scale cos/sin for {rope}"
    return None


def unsupported_by_torchrec(config: TrainConfig) -> str | None:
    """Why an arm's configuration has no torchrec counterpart, or None.

    torchrec's PEC is an embedding table, not a model: the arm needs one (a PEC field), trained in
    the order of torchrec's TrainPipelinePEC (pipelined), and its table is held to fp32 bits.
    """
    if not isinstance(config, PECConfig):
        return 'needs a PEC arm: torchrec\'s PEC is its embedding table (set pec = "pipelined")'
    if config.pec != "pipelined":
        return f'needs pec = "pipelined", the order of torchrec\'s TrainPipelinePEC, got {config.pec!r}'
    if config.mixed or config.dtype != "float32":
        return 'needs precision = "pure" in dtype float32: the torchrec oracle is held to fp32 bits'
    return None


UNSUPPORTED_BY = {"hf": unsupported_by_hf, "torchtitan": unsupported_by_torchtitan, "torchrec": unsupported_by_torchrec}


def _pipeline(config: PipelineConfig, source: Callable[[str], str], steps: int, v: protocol.SuiteReader) -> None:
    """What the reference accepts but can never run: it would only fail inside the ranks."""
    if config.delay > config.max_gradient_staleness:
        # The backward of every batch after the fill would be refused (CommitRefused): reject it here, exit 2.
        raise v.error(
            source("delay"), f"delay {config.delay} exceeds max_gradient_staleness {config.max_gradient_staleness}"
        )
    if config.apply_twice_batch is not None and not 1 <= config.apply_twice_batch <= steps:
        # Batches are numbered like steps; a batch that never runs would plant no bug at all.
        raise v.error(source("apply_twice_batch"), f"expected a batch id in 1-{steps}, got {config.apply_twice_batch}")
