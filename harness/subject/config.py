"""Helpers for a subject parsing its arms: the typed fields of a config dataclass, and the whole
``[train]`` / ``[arms.NAME]`` parsing of a subject whose arm is one such dataclass.

A trainer brought to the harness usually has a flat config: :func:`dataclass_arms` reads its
fields from ``[train]`` (shared) and ``[arms.NAME]`` (per arm, with ``ranks``), type-checks each by
its annotation, builds the dataclass (whose ``__post_init__`` may raise ValueError starting with
the field it rejects) and returns the arms with one logical rank per process.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from harness.specs import ArmSpec
from harness.subject.protocol import METRICS, ArmFacts, SuiteReader, SuiteTables


def show(value: Any) -> str:
    """A value as messages quote it: JSON where it can be."""
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def display_path(path: Path) -> str:
    """A path as errors show it: relative to the working directory where it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _value_type(hint: Any) -> type:
    """``int | None`` -> int: TOML has no null, so an optional field is either set or left out."""
    return next((arg for arg in typing.get_args(hint) if arg is not type(None)), hint)


def field_types(config: type) -> dict[str, type]:
    """A config dataclass's fields and the type a suite value must have for each."""
    return {name: _value_type(hint) for name, hint in typing.get_type_hints(config).items()}


def dataclass_arms(
    tables: SuiteTables,
    v: SuiteReader,
    config: type,
    families: Iterable[str] = (METRICS,),
    positive: Iterable[str] = (),
    subject: str = "this subject",
    facts: Callable[[Any], ArmFacts] | None = None,
) -> dict[str, ArmSpec]:
    """The arms of a subject whose arm config is the dataclass ``config``: ``[train]`` then each
    ``[arms.NAME]`` (which may also set ``ranks``). A ``seed`` field seeds the arm (else 0), a
    ``dtype`` field keys its goldens (else float32). Every arm emits ``families``, and has the facts
    ``facts`` gives of its built config (none: an arm of metrics, rank updates, digests and weights
    needs none)."""
    if tables.model:
        raise v.error("model", f"{subject} has no [model] table: set its fields in [train]")
    fields, positive = field_types(config), set(positive)
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}

    def typed(raw: Any, dotted: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        table = v.table(raw, dotted, allowed)
        return {k: v.typed(x, f"{dotted}.{k}", fields[k], k in positive) for k, x in table.items() if k in fields}

    base = typed(tables.train, "train", tuple(fields))
    arms = {}
    for name, raw in tables.arms.items():
        dotted = f"arms.{v.name(name, f'arms.{name}')}"
        own = typed(raw, dotted, ("ranks", *fields))
        ranks = v.int_(raw["ranks"], f"{dotted}.ranks", 1, v.max_ranks) if "ranks" in raw else tables.ranks
        try:
            built = config(**{**base, **own})
        except (TypeError, ValueError) as e:
            first_word = str(e).split()[0] if str(e) else ""
            where = (
                f"{dotted}.{first_word}"
                if first_word in own
                else f"train.{first_word}"
                if first_word in base
                else dotted
            )
            raise v.error(where, str(e)) from None
        train = dataclasses.asdict(built)
        arms[name] = ArmSpec(
            name,
            ranks,
            train,
            logical_ranks=ranks,
            families=tuple(families),
            seed=int(train.get("seed", 0)),
            golden_config={k: x for k, x in train.items() if k not in defaults or defaults[k] != x},
            dtype=str(train.get("dtype", "float32")),
            facts=facts(built) if facts is not None else ArmFacts(),
        )
    return arms
