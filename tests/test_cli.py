"""The command line's own errors: a bad flag value is one line naming the flag and the value, exit 2,
on every subcommand, as every other error is; argparse's usage block is not printed."""

from __future__ import annotations

import pytest

from harness.cli import main


@pytest.mark.parametrize(
    ("argv", "flag", "value"),
    [
        (["run", "logical-ranks", "--timeout", "abc"], "--timeout", "abc"),
        (["run", "logical-ranks", "--first-op-budget", "abc"], "--first-op-budget", "abc"),
        (["run", "logical-ranks", "--device", "tpu"], "--device", "tpu"),
        (["run", "logical-ranks", "--first-op", "maybe"], "--first-op", "maybe"),
        (["abba", "logical-ranks", "--timeout", "1e"], "--timeout", "1e"),
        (["abba", "logical-ranks", "--cpu-isa", "sse"], "--cpu-isa", "sse"),
        (["ci", "logical-ranks", "--retries", "x"], "--retries", "x"),
        (["ci", "logical-ranks", "--timeout", "abc"], "--timeout", "abc"),
        (["submit", "logical-ranks", "--nodes", "two"], "--nodes", "two"),
        (["submit", "logical-ranks", "--golden", "yes"], "--golden", "yes"),
        (["golden", "update", "logical-ranks", "--timeout", "soon"], "--timeout", "soon"),
        (["collect", "some-run", "--timeout", "abc"], "--timeout", "abc"),
        (["doctor", "--ranks", "z"], "--ranks", "z"),
        (["doctor", "--device", "tpu"], "--device", "tpu"),
    ],
)
def test_a_bad_flag_value_is_one_line_naming_the_flag_and_the_value(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str, value: str
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert flag in lines[0] and repr(value) in lines[0] and lines[0].startswith("error: harness ")
    assert captured.out == ""


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "logical-ranks", "--bogus"], "error: harness: unrecognized arguments: --bogus"),
        (["run"], "error: harness run: the following arguments are required: SUITE"),
        (["golden"], "error: harness golden: the following arguments are required: ACTION"),
    ],
)
def test_an_unknown_flag_or_a_missing_argument_is_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err == expected + "\n"
