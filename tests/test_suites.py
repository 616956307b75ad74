"""Suite loading: shipped suites resolve as documented, and every mistake is one line naming file and field."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from harness.launch import plan_launches
from harness.progress import Progress
from harness.suites import SuiteError, list_suites, load_suite

GOOD = """
name = "mini"
description = "two arms"
ranks = 2
steps = 3
[train]
lr = 0.001
[arms.eager]
chunking = "eager"
chunks = 2
[arms.plain]
[[checks]]
kind = "exact"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "suite.toml"
    path.write_text(text)
    return path


def _error(tmp_path: Path, text: str = GOOD, overrides: list[tuple[str, str]] = ()) -> str:
    path = _write(tmp_path, text)
    with pytest.raises(SuiteError) as info:
        load_suite(str(path), overrides)
    message = str(info.value)
    assert "\n" not in message
    return message.replace(str(path), "FILE")


def test_shipped_suites_are_listed_and_load() -> None:
    names = dict(list_suites())
    assert {"logical-ranks", "determinism"} <= set(names)
    for name in names:
        assert load_suite(name).description == names[name]


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_ranks_is_the_process_count_and_the_ep_degree_of_logical_ranks(ranks: int) -> None:
    suite = load_suite("logical-ranks", [("--ranks", f"ranks={ranks}")])
    procs, inproc = suite.arms["procs"], suite.arms["inproc"]
    assert (procs.ranks, procs.ep) == (ranks, ranks)
    assert (inproc.ranks, inproc.ep) == (1, ranks)
    groups = plan_launches(suite)
    if ranks == 1:  # one layout: both arms in one launch
        assert [(g.ranks, g.arms, g.log_dir) for g in groups] == [(1, ("procs", "inproc"), "logs")]
    else:
        assert [(g.ranks, g.arms, g.log_dir) for g in groups] == [
            (ranks, ("procs",), "logs/procs"),
            (1, ("inproc",), "logs/inproc"),
        ]


def test_arm_resolves_to_a_full_train_config(tmp_path: Path) -> None:
    suite = load_suite(str(_write(tmp_path, GOOD)), [("--set", "arms.eager.lr=0.01"), ("--set", "steps=5")])
    eager, plain = suite.arms["eager"].train, suite.arms["plain"].train
    assert (eager["lr"], plain["lr"], suite.steps) == (0.01, 0.001, 5)
    assert (eager["chunking"], eager["chunks"], eager["ep"], eager["model"]) == ("eager", 2, 2, "cpu-tiny")
    assert suite.checks[0].arms == ("eager", "plain") and suite.checks[0].metrics == ("loss", "grad_norm")
    json.dumps(suite.to_dict())  # the manifest form is JSON


def test_bare_train_field_override_applies_to_every_arm(tmp_path: Path) -> None:
    suite = load_suite(str(_write(tmp_path, GOOD)), [("--set", "chunks=4")])
    assert suite.arms["eager"].train["chunks"] == 4 and suite.arms["plain"].train["chunks"] == 4


@pytest.mark.parametrize(
    "text,expected",
    [
        ("bogus = 1\n" + GOOD, "FILE: bogus: unknown key"),
        (GOOD + "bogus = 1\n", "FILE: checks.0: exact check: unknown field 'bogus'"),
        (GOOD.replace("chunks = 2", 'chunks = "two"'), 'FILE: arms.eager.chunks: expected int >= 1, got "two"'),
        (GOOD.replace("ranks = 2", "ranks = 9"), "FILE: ranks: expected int in 1-8, got 9"),
        (
            GOOD.replace("ranks = 2", "ranks = 3"),
            'FILE: ranks: EP degree 3 does not divide the 8 routed experts of model "cpu-tiny"',
        ),
        (
            GOOD.replace("[arms.plain]", "[arms.plain]\nep = 6"),
            "FILE: arms.plain.ep: EP degree 6 does not divide the 8 routed experts",
        ),
        (
            GOOD.replace("[arms.plain]", "[arms.plain]\nranks = 4"),
            'FILE: arms.plain.ranks: 4 processes do not divide EP degree 2 of arm "plain"',
        ),
        (
            GOOD.replace('kind = "exact"', 'kind = "exactly"'),
            "FILE: checks.0.kind: expected one of token-exchange-invariants, same-event-sequence,"
            " graph-invariants, overlap, exact",
        ),
        (GOOD + 'arms = ["eager", "graph"]\n', 'FILE: checks.0.arms.1: expected one of eager, plain, got "graph"'),
        (
            GOOD + 'metrics = ["los"]\n',
            'FILE: checks.0.metrics.0: expected one of loss, grad_norm, tokens, step_time_s, got "los"',
        ),
        (GOOD + "rtol = 0.1\n", "FILE: checks.0: exact check: unknown field 'rtol'"),
        (GOOD.replace('kind = "exact"', 'kind = "close"'), "FILE: checks.0: close check: missing field 'rtol'"),
        (GOOD.replace("lr = 0.001", 'lr = "fast"'), 'FILE: train.lr: expected a number > 0, got "fast"'),
        (
            GOOD.replace('chunking = "eager"', 'chunking = "graphs"'),
            "FILE: arms.eager.chunking: chunking must be one of",
        ),
        (GOOD.replace("lr = 0.001", 'routing = "random"'), "FILE: train.routing: routing must be one of"),
        (
            GOOD.replace("[train]", '[model]\nconfig = "huge"\n[train]'),
            'FILE: model.config: expected one of cpu-tiny, debugmodel, got "huge"',
        ),
        (
            GOOD + '[debug]\nfail_mode = "explode"\n',
            'FILE: debug.fail_mode: expected one of raise, hang, exit, kill, stop, got "explode"',
        ),
        (
            GOOD.replace("[arms.plain]", '[arms."../../../x"]'),
            "FILE: arms.../../../x: expected a name of lowercase letters, digits",
        ),
        (
            GOOD.replace("[arms.plain]", '[arms."$x^2$"]'),
            "FILE: arms.$x^2$: expected a name of lowercase letters, digits",
        ),
        (
            GOOD + 'name = "a/b $x$"\n',
            "FILE: checks.0.name: expected a name of letters, digits, spaces and _ . , : ( ) + -",
        ),
        (GOOD.split("[[checks]]")[0], "FILE: checks: expected at least one [[checks]] table, got []"),
        (
            GOOD + '[golden]\ncross_env = { kind = "exact" }\n',
            "FILE: golden.cross_env: expected a tier table that is not exact",
        ),
        (GOOD + "[debug]\nfail_rank = 2\n", "FILE: debug.fail_rank: expected int in 0-1, got 2"),
        (GOOD.replace('name = "mini"', ""), "FILE: name: missing"),
        ("name = ", "FILE: invalid TOML"),
    ],
    ids=lambda value: value if value.startswith("FILE") else "",
)
def test_suite_errors_name_file_and_field(tmp_path: Path, text: str, expected: str) -> None:
    """ids are the expected messages: the TOML texts differ from GOOD by one line."""
    assert _error(tmp_path, text).startswith(expected)


@pytest.mark.parametrize(
    "override,expected",
    [
        (("--set", "arms.eager.chunks=two"), '--set arms.eager.chunks: expected int >= 1, got "two"'),
        (("--set", "chunks=0"), "--set chunks: expected int >= 1, got 0"),
        (("--set", "arms.graph.lr=0.1"), '--set arms.graph.lr: no arm named "graph" (arms: eager, plain)'),
        (("--set", "train.speed=2"), "--set train.speed: unknown key"),
        (("--set", "steps"), "--set steps: expected key=value"),
        (("--set", "steps.x=1"), "--set steps.x: steps is not a table"),
        (("--set", "checks.3.kind=exact"), "--set checks.3.kind: checks.3: expected an index below 1"),
        (("--ranks", "ranks=6"), '--ranks: EP degree 6 does not divide the 8 routed experts of model "cpu-tiny"'),
        (("--steps", "steps=0"), "--steps: expected int >= 1, got 0"),
    ],
    ids=lambda value: value if isinstance(value, str) else value[1],
)
def test_override_errors_name_the_override(tmp_path: Path, override: tuple[str, str], expected: str) -> None:
    assert _error(tmp_path, overrides=[override]).startswith(expected)


def test_missing_suite_names_the_path() -> None:
    with pytest.raises(SuiteError, match=r"no-such-suite\.toml: no such suite file \(suites: .*logical-ranks"):
        load_suite("no-such-suite")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [False, True])
def test_progress_follows_metrics_as_they_are_written(tmp_path: Path, tty: bool) -> None:
    stream = _Terminal() if tty else io.StringIO()
    progress = Progress(tmp_path, ["a"], steps=2, stream=stream)
    metrics = tmp_path / "arms" / "a" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    progress.tick()  # nothing written yet
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 1, "loss": 1.5, "grad_norm": 0.5}) + "\n" + '{"step": 2, "lo')
    progress.tick()  # the half-written line waits
    with metrics.open("a") as f:
        f.write('ss": 1.25, "grad_norm": 0.25}\n')
    progress.tick()
    progress.close()
    text = stream.getvalue()
    if tty:
        assert (
            text == "\r\x1b[K[arm a] step 1/2 loss=1.5 grad_norm=0.5\r\x1b[K[arm a] step 2/2 loss=1.25 grad_norm=0.25\n"
        )
    else:
        assert text.splitlines() == [
            "[arm a] step 1/2 loss=1.5 grad_norm=0.5",
            "[arm a] step 2/2 loss=1.25 grad_norm=0.25",
        ]
