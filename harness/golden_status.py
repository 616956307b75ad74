"""Which suite has which environment's golden: ``harness golden status`` and ``harness golden table``.

A run without its own environment's golden compares with another's at the loose cross-environment
tier (golden.plan_golden), where a bug that moves the numbers by less than that tier passes: real
router bugs passed so on Intel, whose goldens were missing for suites recorded on AMD only. So the
gaps are listed, not guessed: ``status`` names the suites this machine has no golden for, and
``table`` renders the whole inventory as the Markdown table docs/goldens.md carries between its
markers, regenerated from ``golden/`` (a test fails when the two disagree).

A suite expects goldens when it is shipped and not a throughput suite (an ABBA gate records no
steps to compare), or when ``golden/`` has any for it (an example's suite, such as tiny-dp);
its goldens' dtype is the suite's (SuiteSpec.dtype), else the one its recorded goldens carry.
A golden recorded for another configuration than its suite now runs (an arm added since) is
**stale**: present, and compared by no run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from harness.environment import CpuPin, backend_for, comparable_env_keys, device_class, env_key, split_env_key
from harness.golden import Golden, GoldenError, config_differences, load_golden_for, loose_lead, shown_path
from harness.golden_plan import golden_config
from harness.specs import SuiteSpec
from harness.suites import list_suites, load_suite

TABLE_BEGIN, TABLE_END = "<!-- golden-table:begin -->", "<!-- golden-table:end -->"
CALIBRATE = "harness golden calibrate"


@dataclass(frozen=True)
class Inventory:
    """The goldens under one golden root, and the ones each suite is expected to have."""

    root: Path
    dtypes: dict[str, tuple[str, ...]]  # suite -> the dtypes its goldens are keyed by, sorted
    recorded: dict[str, frozenset[str]]  # suite -> the env keys it has a golden for
    environments: tuple[str, ...]  # every env key's environment (EnvKey.environment) under the root, sorted
    # suite -> env key -> how its golden's configuration differs from the suite's: a golden no run of
    # the suite compares with (golden_plan.plan_golden), however present it looks
    stale: dict[str, dict[str, str]]
    calibrated: dict[str, frozenset[str]]  # suite -> the env keys whose golden carries a calibration


def golden_inventory(golden_dir: Path, suites_dir: Path) -> Inventory:
    """Reads every golden under ``golden_dir`` (each validated: a bad one is a GoldenError naming its
    file and field) and every suite in ``suites_dir``."""
    if not golden_dir.is_dir():
        raise GoldenError(golden_dir, None, "no such golden directory")
    suites = {name: load_suite(name, suites_dir=suites_dir) for name, _ in list_suites(suites_dir)}
    recorded: dict[str, set[str]] = {}
    stale: dict[str, dict[str, str]] = {}
    calibrated: dict[str, set[str]] = {}
    for path in sorted(golden_dir.glob("*/*.json")):
        golden = load_golden_for(path, path.parent.name)
        try:
            split_env_key(golden.env_key)
        except ValueError as e:
            raise GoldenError(path, "env_key", str(e)) from None
        recorded.setdefault(golden.suite, set()).add(golden.env_key)
        if golden.calibration is not None:
            calibrated.setdefault(golden.suite, set()).add(golden.env_key)
        if golden.suite in suites:
            differences = _configuration_differences(golden, suites[golden.suite])
            if differences:
                stale.setdefault(golden.suite, {})[golden.env_key] = differences
    dtypes = {suite: {split_env_key(key).dtype for key in keys} for suite, keys in recorded.items()}
    for name, suite in suites.items():
        if suite.throughput is None:
            dtypes.setdefault(name, set()).add(suite.dtype)
    environments = {split_env_key(key).environment for keys in recorded.values() for key in keys}
    return Inventory(
        golden_dir,
        {suite: tuple(sorted(found)) for suite, found in sorted(dtypes.items())},
        {suite: frozenset(recorded.get(suite, ())) for suite in sorted(dtypes)},
        tuple(sorted(environments)),
        stale,
        {suite: frozenset(keys) for suite, keys in calibrated.items()},
    )


def _configuration_differences(golden: Golden, suite: SuiteSpec) -> str:
    """How ``golden`` was recorded for another configuration than ``suite`` runs (plan_golden's rule: a
    golden shorter than the suite is another configuration too); empty when a run compares with it."""
    differences = config_differences({**golden.config, "steps": None}, {**golden_config(suite), "steps": None})
    if golden.steps < suite.steps:
        differences.append(f"steps: golden {golden.steps}, suite {suite.steps}")
    return "; ".join(differences)


def status_lines(inventory: Inventory, pin: CpuPin) -> list[str]:
    """``harness golden status``: one line per suite and dtype, for this machine's CPU env key under
    ``pin``: "ok" and the golden, "stale" and how its configuration differs, or "missing" and what a
    run compares with instead."""
    device = device_class("cpu", pin)
    width = max((len(suite) for suite in inventory.dtypes), default=0)
    lines = []
    for suite, dtypes in inventory.dtypes.items():
        for dtype in dtypes:
            key = env_key(device, backend_for("cpu"), dtype, torch.__version__)
            path = inventory.root / suite / f"{key}.json"
            differences = inventory.stale.get(suite, {}).get(key)
            if differences:
                why = f"recorded for another configuration ({differences}): record it again with harness golden update"
                lines.append(f"stale    {suite:<{width}}  {shown_path(path, inventory.root)}: {why} {suite}")
                continue
            if key in inventory.recorded[suite]:
                lines.append(f"ok       {suite:<{width}}  {shown_path(path, inventory.root)}")
                continue
            other = next(iter(comparable_env_keys(key, inventory.recorded[suite])), None)
            none = f"this environment's golden ({key}) is missing, and none is comparable: a run compares with none"
            tier = (
                "calibrated" if other in inventory.calibrated.get(suite, ()) else f"not calibrated: {CALIBRATE} {suite}"
            )
            instead = f"{loose_lead(key, other, 'a run compares')} ({tier})" if other else none
            lines.append(f"missing  {suite:<{width}}  {instead}")
    return lines


def golden_table(inventory: Inventory) -> str:
    """The Markdown table of which suite has a golden for which environment: a row per suite, a
    column per environment under the golden root; a cell names the dtype recorded, or "**missing**"
    and the dtype the suite's goldens are keyed by."""

    def cell(suite: str, environment: str) -> str:
        keys = {split_env_key(key).dtype: key for key in inventory.recorded[suite]
                if split_env_key(key).environment == environment}  # fmt: skip
        stale = inventory.stale.get(suite, {})
        return ", ".join(
            f"**missing** {dtype}" if dtype not in keys else f"**stale** {dtype}" if keys[dtype] in stale else dtype
            for dtype in inventory.dtypes[suite]
        )

    rows = [
        "| suite | " + " | ".join(f"`{environment}`" for environment in inventory.environments) + " |",
        "| --- |" + " --- |" * len(inventory.environments),
    ]
    for suite in inventory.dtypes:
        rows.append(f"| `{suite}` | " + " | ".join(cell(suite, env) for env in inventory.environments) + " |")
    return "\n".join(rows) + "\n"


def readme_table(text: str, source: str) -> tuple[int, int]:
    """Where the generated table sits in ``text`` (docs/goldens.md, named ``source`` in errors): the
    offsets just after the begin marker's line and at the end marker, each marker present once."""
    for marker in (TABLE_BEGIN, TABLE_END):
        if text.count(marker) != 1:
            raise GoldenError(source, marker, f"expected once, found {text.count(marker)} times")
    start, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN) + 1, text.index(TABLE_END)
    if start > end:
        raise GoldenError(source, TABLE_END, f"comes before {TABLE_BEGIN}")
    return start, end


def write_readme_table(readme: Path, table: str) -> bool:
    """Puts ``table`` between the markers of a page (docs/goldens.md); True when that changed the file."""
    text = readme.read_text(encoding="utf-8")
    start, end = readme_table(text, str(readme))
    new = text[:start] + table + text[end:]
    if new != text:
        readme.write_text(new, encoding="utf-8")
    return new != text
