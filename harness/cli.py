"""The ``harness`` command: list, run, golden update, report, doctor.

Exit codes (run and golden update): 0 pass, 1 a check failed, 2 bad usage, suite or input,
3 infrastructure (a rank crashed or hung, a timeout, a launch failure).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.run import (
    EXIT_PASS,
    EXIT_USAGE,
    GOLDEN_DIR,
    GOLDEN_MODES,
    RunOptions,
    UsageError,
    describe_environment,
    rerender,
    run_suite,
)
from harness.suites import SuiteError, list_suites, load_suite


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", metavar="SUITE", help="a suite name under suites/, or a path to a suite file")
    # --ranks and --steps go through the suite validator (as "--set ranks=N"), so their errors read alike.
    parser.add_argument("--ranks", metavar="N", help="processes of the suite's multi-process arms, and the EP degree (1-8)")
    parser.add_argument("--steps", metavar="N", help="training steps per arm")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: nccl, one GPU per rank")
    parser.add_argument("--out", type=Path, metavar="DIR", help="run directory (default reports/<suite>/<UTC timestamp>)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S", help="wall-clock limit for all launches (default 600)")
    parser.add_argument("--golden-dir", type=Path, default=GOLDEN_DIR, metavar="DIR", help="golden root (default: the repository's golden/)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a suite field, e.g. steps=5, arms.eager.lr=0.01, train.seed=1, chunks=4 (all arms)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="harness", description="Verify distributed LLM training changes with paired runs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("list", help="list the suites")
    run = commands.add_parser("run", help="run a suite and compare its arms")
    _add_run_arguments(run)
    run.add_argument("--golden", choices=GOLDEN_MODES, default="auto", help="auto (default): check when a golden exists for this environment")
    golden = commands.add_parser("golden", help="manage golden trajectories")
    golden_commands = golden.add_subparsers(dest="golden_command", required=True, metavar="ACTION")
    _add_run_arguments(golden_commands.add_parser("update", help="run a suite and record its golden for this environment"))
    report = commands.add_parser("report", help="re-render report.html and junit.xml of a run directory")
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    commands.add_parser("doctor", help="print versions, devices and distributed backends")
    return parser


def _overrides(args: argparse.Namespace) -> list[tuple[str, str]]:
    flags = [(f"--{name}", f"{name}={getattr(args, name)}") for name in ("ranks", "steps") if getattr(args, name) is not None]
    return flags + [("--set", item) for item in args.overrides]


def _run(args: argparse.Namespace, argv: list[str], golden: str) -> int:
    suite = load_suite(args.suite, _overrides(args), device=args.device)
    if not args.timeout > 0:  # also rejects nan
        raise UsageError(f"--timeout: expected seconds > 0, got {args.timeout:g}")
    options = RunOptions(
        device=args.device,
        out=args.out,
        timeout_s=args.timeout,
        golden=golden,
        golden_dir=args.golden_dir,
        command=("harness", *argv),
    )
    return run_suite(suite, options)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        if args.command == "list":
            suites = list_suites()
            width = max((len(name) for name, _ in suites), default=0)
            for name, description in suites:
                print(f"{name:<{width}}  {description}")
            return EXIT_PASS
        if args.command == "run":
            return _run(args, argv, args.golden)
        if args.command == "golden":
            return _run(args, argv, "update")
        if args.command == "report":
            return rerender(args.run_dir)
        for key, value in describe_environment().items():
            print(f"{key:<14} {value}")
        return EXIT_PASS
    except (SuiteError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
