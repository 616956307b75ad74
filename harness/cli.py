"""The ``harness`` command: list, run, abba, golden update/calibrate/status/table, ci, submit, collect, report, doctor.

Exit codes (run, abba and golden update): 0 pass, 1 a check failed (a regression), 2 bad usage,
suite or input, 3 infrastructure (a rank killed or hung, a timeout, a launch failure, an internal
error), 4 inconclusive (a throughput gate that needs more blocks), 128 + N cancelled by signal N.
``harness ci`` exits with its suites' worst code (harness/ci.py); ``harness doctor --device cuda``
exits 2 when the machine lacks something a GPU run needs.
Every error is one line on the console; a traceback goes to the run's logs/harness.log, or to a
file the line names when no run directory exists yet.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NoReturn

import harness
from harness.bisect import BisectRequest, run_bisect
from harness.calibration import MARGIN, calibrate_suite
from harness.cancel import Cancelled
from harness.change import ChangeRequest, prepare_change
from harness.ci import run_gate
from harness.environment import CPU_ISAS, cpu_pin, cuda_preflight, describe_environment
from harness.first_op import MODE_ENV as FIRST_OP_ENV
from harness.first_op import MODES as FIRST_OP_MODES
from harness.golden import GoldenError
from harness.golden_plan import GOLDEN_MODES
from harness.golden_status import golden_inventory, golden_table, status_lines, write_readme_table
from harness.launchers.slurm.profile import load_profile
from harness.loading import LoadTimeout, load_within
from harness.outputs import rerender
from harness.prepare import RunOptions, UsageError, default_golden_dir, trace_cache_dir
from harness.revisions import RevisionBuildError, RevisionError
from harness.run import run_suite
from harness.rundir import RunDirError
from harness.shipped import inside_package
from harness.slurm_run import collect_run, submit_suite
from harness.specs import SuiteSpec
from harness.subject import SubjectFault
from harness.suites import SUITES_DIR, SuiteError, list_suites, load_suite
from harness.verdict import EXIT_FAIL, EXIT_INFRA, EXIT_PASS, EXIT_USAGE


def _add_run_arguments(
    parser: argparse.ArgumentParser, steps_help: str = "training steps per arm", gate: bool = False
) -> None:
    """The options of one run; ``gate``: of each run of a ``harness ci`` gate, which takes several suites
    and whose --out is the gate's directory."""
    parser.add_argument(
        "suite",
        metavar="SUITE",
        nargs="+" if gate else None,
        help="a suite name (see harness list), or a path to a suite file",
    )
    # --ranks and --steps go through the suite validator (as "--set ranks=N"), so their errors read alike.
    parser.add_argument(
        "--ranks", metavar="N", help="processes of the suite's multi-process arms, and the EP degree (1-8)"
    )
    parser.add_argument("--steps", metavar="N", help=steps_help)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: nccl, one GPU per rank"
    )
    out_help = (
        "gate directory, a run directory OUT/<suite>/attempt-<k>/ per run (default ./reports/ci/<UTC timestamp>)"
        if gate
        else "run directory (default ./reports/<suite>/<UTC timestamp>)"
    )
    parser.add_argument("--out", type=Path, metavar="DIR", help=out_help)
    parser.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="wall-clock limit for all launches (default 600)"
    )
    _add_golden_dir_argument(parser)
    _add_suites_dir_argument(parser)
    _add_cpu_isa_argument(parser)
    parser.add_argument(
        "--trace-cache",
        metavar="DIR|off",
        help="where traced arms keep their scheduled graphs between runs; off: trace every time"
        " (default $HARNESS_TRACE_CACHE, else $XDG_CACHE_HOME/harness/traces, else ~/.cache/harness/traces)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a suite field, e.g. steps=5, arms.eager.lr=0.01, train.seed=1, chunks=4 (all arms)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print every step as a plain line, also on a terminal (no live display)"
    )


def _add_change_arguments(parser: argparse.ArgumentParser) -> None:
    """A change check's revisions (harness/change.py)."""
    parser.add_argument(
        "--base",
        metavar="REV",
        help="judge a change: run every arm at this git revision of the subject's code too, and compare",
    )
    parser.add_argument(
        "--head", metavar="REV", help="with --base: the revision under test (default: the working tree as it is)"
    )
    parser.add_argument(
        "--source",
        type=Path,
        metavar="PATH",
        help="with --base: the git checkout holding the subject's package (default: the one it is imported from)",
    )


def _add_golden_dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--golden-dir",
        type=Path,
        default=default_golden_dir(),
        metavar="DIR",
        help="golden root (default: the shipped goldens, or $HARNESS_GOLDEN_DIR)",
    )


def _add_cpu_isa_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cpu-isa", choices=CPU_ISAS, default="avx2",
        help="CPU kernels: avx2 (default) pins them, so goldens check bitwise on any x86-64 with AVX2;"
        " native: full speed",
    )  # fmt: skip


def _add_suites_dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--suites-dir", type=Path, metavar="DIR", help="where SUITE names are looked up (default: the shipped suites)"
    )


def _suites_dir(args: argparse.Namespace) -> Path:
    """``--suites-dir DIR``, which must exist (a typo is an error, not an empty list), or the shipped suites."""
    if args.suites_dir is None:
        return SUITES_DIR
    if not args.suites_dir.is_dir():
        raise UsageError(f"--suites-dir {args.suites_dir}: no such directory")
    return args.suites_dir


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its errors one line like every other error of the harness: its usage block
    (eight lines and more) would bury the flag and the value that were wrong. Subcommands' parsers are
    of this class too (argparse makes them of their parent's)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="harness", description="Verify distributed LLM training changes with paired runs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_suites_dir_argument(commands.add_parser("list", help="list the suites"))
    run = commands.add_parser("run", help="run a suite and compare its arms")
    _add_run_arguments(run)
    _add_change_arguments(run)
    run.add_argument(
        "--golden",
        choices=GOLDEN_MODES,
        default="auto",
        help="auto (default): check when a golden exists for this environment",
    )
    run.add_argument(
        "--first-op",
        choices=FIRST_OP_MODES,
        help="when an exact, ulp or determinism check of two arms fails, re-run them op by op and name the first"
        f" op where they part: on, off, or auto (default, or ${FIRST_OP_ENV}): if it fits --first-op-budget",
    )
    run.add_argument(
        "--first-op-budget",
        type=float,
        default=RunOptions.first_op_budget_s,
        metavar="S",
        help=f"time limit of that re-run (default {RunOptions.first_op_budget_s:g})",
    )
    golden = commands.add_parser("golden", help="manage golden trajectories")
    golden_commands = golden.add_subparsers(dest="golden_command", required=True, metavar="ACTION")
    _add_run_arguments(
        golden_commands.add_parser("update", help="run a suite and record its golden for this environment")
    )
    calibrate = golden_commands.add_parser(
        "calibrate",
        help="measure the suite's noise between environments (this machine's CPU ISAs, goldens of others) and"
        " write the tier at which a golden holds another environment's run into its goldens",
    )
    _add_run_arguments(calibrate)
    calibrate.add_argument(
        "--margin", type=float, default=MARGIN, metavar="X", help=f"tier = X times the noise (default {MARGIN:g})"
    )
    status = golden_commands.add_parser(
        "status",
        help="one line per suite: ok, or missing (this machine's CPU env key has no golden) and what a run"
        " compares with instead",
    )
    table = golden_commands.add_parser(
        "table", help="print the Markdown table of which suite has which environment's golden"
    )
    table.add_argument(
        "--write", type=Path, metavar="FILE", help="put the table between FILE's golden-table markers (docs/goldens.md)"
    )
    for reader in (status, table):
        _add_golden_dir_argument(reader)
        _add_suites_dir_argument(reader)
    _add_cpu_isa_argument(status)
    abba = commands.add_parser(
        "abba",
        help="time arm B against arm A in ABBA blocks and gate on the slowdown",
        description="Step time of arm B over arm A, in A B B A blocks in the same rank processes, with a"
        " an interval that holds after any number of blocks, so that it may stop as soon as it clears the"
        " threshold. Exit 0: B is not slower beyond --max-slowdown; 1: it is, with confidence;"
        " 4: inconclusive (the interval still straddles the threshold when the blocks or the budget ran out).",
    )
    _add_run_arguments(abba, steps_help="timed steps per block position (default 5)")
    _add_change_arguments(abba)
    abba.add_argument("--arm", metavar="ARM", help="with --base: the arm timed at base against itself at head")
    abba.add_argument("--a", metavar="ARM", help="the baseline arm (default: the suite's [throughput] a)")
    abba.add_argument("--b", metavar="ARM", help="the arm under test; may be A itself (a second copy)")
    abba.add_argument(
        "--blocks",
        metavar="K|auto",
        help="ABBA blocks: auto (default) stops once the interval clears the threshold; K (>= 2) runs exactly K",
    )
    abba.add_argument("--max-blocks", metavar="N", help="with --blocks auto: stop after N blocks (default 100)")
    abba.add_argument(
        "--budget-s", metavar="S", help="with --blocks auto: stop after S seconds of measuring (default 300)"
    )
    abba.add_argument("--warmup", metavar="W", help="untimed steps per arm after its build (default 2)")
    abba.add_argument(
        "--max-slowdown", metavar="F", help="the gate: B/A step time at most 1 + F, with confidence (default 0.05)"
    )
    abba.add_argument("--control", action="store_true", help="also time A against a copy of A: the noise floor")
    ci = commands.add_parser(
        "ci",
        help="a CI gate: run several suites, retry infrastructure failures, one index.html and junit.xml",
        description="Runs the suites one after another, each as `harness run` would, into OUT/<suite>/attempt-<k>/;"
        " retries a suite only on exit 3 (infrastructure), writes OUT/ci.json, OUT/index.html and a merged"
        " OUT/junit.xml, and exits with the worst code: a signal (128+N) > 1 > 2 > 3 > 4 > 0.",
    )
    _add_run_arguments(ci, gate=True)
    _add_change_arguments(ci)
    ci.add_argument("--golden", choices=GOLDEN_MODES, default="auto", help="as for harness run (default auto)")
    ci.add_argument(
        "--retries", type=int, default=1, metavar="N", help="more attempts of a suite that exits 3 (default 1)"
    )
    bisect = commands.add_parser(
        "bisect",
        help="find the first commit between --good and --bad at which the suite (or --check NAME) fails",
        description="Binary search over git rev-list --ancestry-path GOOD..BAD (about log2(N) runs): each probe runs"
        " the suite with --head at the commit and --base at GOOD; exit 3 and 4 are skipped. Reads git objects"
        " only: the checkout's working tree, index and HEAD are left as they are. Exit 0: a culprit found;"
        " 1: no candidate fails; 3: every remaining candidate was skipped (harness/bisect.py).",
    )
    _add_run_arguments(bisect)
    next(a for a in bisect._actions if a.dest == "out").help = "bisect directory (default ./reports/bisect/<UTC time>)"
    bisect.add_argument("--good", metavar="REV", required=True, help="a revision that passes (an ancestor of --bad)")
    bisect.add_argument("--bad", metavar="REV", required=True, help="a revision that fails")
    bisect.add_argument(
        "--source", type=Path, metavar="PATH", help="the git checkout of the subject's package (default: the imported)"
    )
    bisect.add_argument("--check", metavar="NAME", help="bad: a check NAME or NAME: ... failed (default: exit 1)")
    bisect.add_argument("--golden", choices=("auto", "check", "off"), default="auto", help="as for harness run")
    _add_slurm_commands(commands)
    report = commands.add_parser("report", help="re-render report.html and junit.xml of a run directory")
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    doctor = commands.add_parser(
        "doctor", help="print versions, devices, backends, the env key runs use and its goldens"
    )
    _add_golden_dir_argument(doctor)
    doctor.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: also check what a GPU runner needs (exit 2, one line per missing item)",
    )
    doctor.add_argument("--ranks", type=int, default=2, metavar="N", help="processes (GPUs) a run uses (default 2)")
    doctor.add_argument(
        "--step",
        action="store_true",
        help="also train one step twice through the harness on --ranks processes (always with --device cuda)",
    )
    return parser


def _add_slurm_commands(commands: argparse._SubParsersAction) -> None:
    """``harness submit`` (a run as Slurm jobs, through submitit) and ``harness collect`` (judge one later)."""
    submit = commands.add_parser(
        "submit",
        help="run a suite as Slurm jobs (submitit) and judge it as harness run does",
        description="Each launch group becomes one Slurm job of --nodes x (ranks / nodes) tasks; the harness"
        " waits, watching squeue and the job files, then checks the records as harness run does.",
    )
    _add_run_arguments(submit)
    submit.add_argument("--golden", choices=GOLDEN_MODES, default="auto", help="as for harness run")
    submit.add_argument("--nodes", type=int, default=1, metavar="K", help="nodes per job; ranks must divide by K")
    submit.add_argument("--profile", metavar="NAME|PATH", help="a cluster profile under slurm/ (e.g. local), or a file")
    for flag, meaning in SLURM_FLAGS.items():
        submit.add_argument(
            f"--{flag.replace('_', '-')}", metavar=flag.upper(), help=f"{meaning} (overrides the profile)"
        )
    submit.add_argument(
        "--no-wait", action="store_true", help="print the job ids and the run dir, and exit; judge later with collect"
    )
    collect = commands.add_parser(
        "collect", help="wait for a run's Slurm jobs (harness submit --no-wait) and judge it as harness run does"
    )
    collect.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    collect.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="limit on the jobs' running time (default 600)"
    )
    collect.add_argument("--verbose", action="store_true", help="print every step as a plain line")


# The profile fields harness submit sets by flag: --partition P, --account A, --time MIN, --gpus-per-node G.
SLURM_FLAGS = {
    "partition": "Slurm partition",
    "account": "Slurm account",
    "time": "Slurm time limit per job, in minutes",
    "gpus_per_node": "GPUs per node",
}


# harness abba's flags that set [throughput] fields of the same name (--steps sets throughput.steps).
_ABBA_FIELDS = ("a", "b", "blocks", "max_blocks", "budget_s", "warmup", "max_slowdown")


def _overrides(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The flags that set suite fields, as (flag, "key=value") overrides the suite validator checks."""
    abba = args.command == "abba"
    fields = {"ranks": "ranks", "steps": "throughput.steps" if abba else "steps"}
    if abba:
        fields.update({name: f"throughput.{name}" for name in _ABBA_FIELDS})
    flags = [
        (f"--{name.replace('_', '-')}", f"{key}={_toml(name, getattr(args, name))}")
        for name, key in fields.items()
        if getattr(args, name) is not None
    ]
    if abba and args.control:
        flags.append(("--control", "throughput.control=true"))
    if abba and args.arm is not None:  # with --base: the arm timed at base against itself at head
        flags += [("--arm", f'throughput.{role}="{args.arm}"') for role in ("a", "b")]
    return flags + [("--set", item) for item in args.overrides]


def _toml(flag: str, value: str) -> str:
    """Arm names and ``--blocks auto`` are TOML strings; numbers stay as typed, so the validator
    reports "two" as not an int."""
    return f'"{value}"' if flag in ("a", "b") or (flag == "blocks" and value == "auto") else value


def _run(args: argparse.Namespace, argv: list[str], golden: str) -> int:
    suite = _load(args, args.suite)
    if args.command == "abba" and suite.throughput is None:
        names = "--arm with --base" if getattr(args, "base", None) else "--a and --b"
        raise UsageError(f"harness abba: suite {suite.name} has no [throughput] table; name the arms with {names}")
    options = _run_options(args, argv, golden)
    suite, options = _with_change(args, suite, options)
    spec = suite.throughput
    if spec is not None and spec.adaptive and spec.budget_s >= options.timeout_s:
        raise UsageError(
            f"throughput.budget_s {spec.budget_s:g} is not under --timeout {options.timeout_s:g}: the launch would"
            " be stopped before the budget; lower --budget-s or raise --timeout"
        )
    if args.command == "submit":
        flags = {
            key: (f"--{key.replace('_', '-')}", _flag_value(getattr(args, key)))
            for key in SLURM_FLAGS
            if getattr(args, key) is not None
        }
        profile = load_profile(args.profile, flags)
        source = {"suite": str(suite.path.resolve()), "overrides": _overrides(args)}
        return submit_suite(suite, options, profile, args.nodes, source, not args.no_wait, sys.stdout, sys.stderr)
    return run_suite(suite, options, sys.stdout, sys.stderr)  # the streams as they are now, not at import


def _with_change(args: argparse.Namespace, suite: SuiteSpec, options: RunOptions) -> tuple[SuiteSpec, RunOptions]:
    """The suite and options of a change check (``--base``; harness/change.py), else as they are."""
    base = getattr(args, "base", None)
    if base is None:
        for flag in ("head", "source", "arm"):
            if getattr(args, flag, None) is not None:
                raise UsageError(f"--{flag}: only with --base REV (a change check)")
        return suite, options
    if options.golden == "update":
        raise UsageError("--base: a change check records no golden; update it with a plain run at head")
    changed, revisions = prepare_change(suite, ChangeRequest(base, args.head, args.source))
    return changed, dataclasses.replace(options, revisions=revisions)


def _flag_value(text: str) -> int | str:
    """A number as typed, so the profile validator reports "five" as not an int."""
    return int(text) if text.lstrip("-").isdigit() else text


def _load(args: argparse.Namespace, name: str) -> SuiteSpec:
    """The suite ``name``, loaded under the run's --timeout: loading runs the subject's code (harness/loading.py)."""
    suites_dir = _suites_dir(args)
    return load_within(
        _timeout(args), f"suite {name}", lambda: load_suite(name, _overrides(args), args.device, suites_dir)
    )


def _timeout(args: argparse.Namespace) -> float:
    """--timeout, which must be a finite number of seconds > 0."""
    if not (args.timeout > 0 and math.isfinite(args.timeout)):  # also rejects nan
        raise UsageError(f"--timeout: expected a finite number of seconds > 0, got {args.timeout:g}")
    return args.timeout


def _run_options(args: argparse.Namespace, argv: list[str], golden: str) -> RunOptions:
    if golden == "update" and inside_package(args.golden_dir):
        raise UsageError(
            f"--golden-dir {args.golden_dir}: the shipped goldens of the installed package are read-only;"
            " record goldens in a folder of your own with --golden-dir DIR"
        )
    first_op, budget = _first_op(args)
    return RunOptions(
        device=args.device,
        out=args.out,
        timeout_s=_timeout(args),
        golden=golden,
        golden_dir=args.golden_dir,
        cpu_isa=args.cpu_isa,
        command=("harness", *argv),
        verbose=args.verbose,
        trace_cache=trace_cache_dir(args.trace_cache),
        first_op=first_op,
        first_op_budget_s=budget,
        started_at=args.started_at,
    )


def _first_op(args: argparse.Namespace) -> tuple[str, float]:
    """``harness run``'s --first-op (else $HARNESS_FIRST_OP, else auto) and --first-op-budget; other
    commands never re-run (harness/first_op.py)."""
    if args.command != "run":
        return "off", RunOptions.first_op_budget_s
    mode = args.first_op or os.environ.get(FIRST_OP_ENV) or "auto"
    if mode not in FIRST_OP_MODES:
        raise UsageError(f"${FIRST_OP_ENV}: expected one of {', '.join(FIRST_OP_MODES)}, got {mode!r}")
    if not (args.first_op_budget > 0 and math.isfinite(args.first_op_budget)):
        raise UsageError(f"--first-op-budget: expected a finite number of seconds > 0, got {args.first_op_budget:g}")
    return mode, args.first_op_budget


def _crash_log() -> Path:
    """Where a traceback goes when no run directory exists to hold it."""
    with tempfile.NamedTemporaryFile("w", prefix="harness-", suffix=".log", delete=False) as f:
        traceback.print_exc(file=f)
    return Path(f.name)


def main(argv: list[str] | None = None) -> int:
    """The ``harness`` command on ``argv``, its timeline starting now; None: the program itself (console
    script, ``python -m harness``), its timeline starting with its imports, which leaves through
    ``os._exit`` once its output is flushed."""
    if argv is not None:
        return _main(argv, time.time())
    # The imports made ~300k objects (torch alone ~170k) that live until exit. Frozen, they are no longer
    # walked by each full collection (~0.2 s apiece while judging); ``python -m harness`` made them
    # with the collector off.
    gc.freeze()
    gc.enable()
    code = _main(sys.argv[1:], harness.IMPORTED_AT)
    # Every file is written and closed by now; tearing torch and the rest down module by module would
    # cost a third of a second more before the shell (or CI) sees the exit code.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str], started_at: float) -> int:
    try:
        args = build_parser().parse_args(argv)
        args.started_at = started_at
        return _command(args, argv)
    except (SuiteError, UsageError, GoldenError, RunDirError, RevisionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SubjectFault as e:  # the subject's own code raised as it was loaded: its bug
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAIL
    except (LoadTimeout, RevisionBuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INFRA
    except Cancelled as e:
        print(f"harness: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("harness: cancelled by SIGINT", file=sys.stderr)
        return 128 + signal.SIGINT
    except Exception as e:
        print(f"error: internal error: {type(e).__name__}: {e} (traceback: {_crash_log()})", file=sys.stderr)
        return EXIT_INFRA


def _command(args: argparse.Namespace, argv: list[str]) -> int:
    if args.command == "list":
        suites = list_suites(_suites_dir(args))
        width = max((len(name) for name, _ in suites), default=0)
        for name, description in suites:
            print(f"{name:<{width}}  {description}")
        return EXIT_PASS
    if args.command in ("run", "submit"):
        return _run(args, argv, args.golden)
    if args.command == "collect":
        options = RunOptions(timeout_s=_timeout(args), verbose=args.verbose, started_at=args.started_at)
        return collect_run(args.run_dir, options, sys.stdout, sys.stderr)
    if args.command == "golden":
        return _golden(args, argv)
    if args.command == "abba":
        return _run(args, argv, "off")
    if args.command == "ci":
        options = _run_options(args, argv, args.golden)
        changes = [_with_change(args, _load(args, name), options) for name in args.suite]
        revisions = {suite.name: changed.revisions for suite, changed in changes}
        suites = [suite for suite, _ in changes]
        return run_gate(suites, options, args.retries, sys.stdout, sys.stderr, revisions)
    if args.command == "bisect":
        request = BisectRequest(args.good, args.bad, args.source, args.check)
        return run_bisect(_load(args, args.suite), _run_options(args, argv, args.golden), request)
    if args.command == "report":
        return rerender(args.run_dir, sys.stdout)
    for key, value in describe_environment(args.golden_dir).items():
        print(f"{key:<14} {value}")
    if args.device == "cuda" or args.step:
        return _preflight(args.device, args.ranks)
    return EXIT_PASS


def _golden(args: argparse.Namespace, argv: list[str]) -> int:
    """``harness golden update`` runs the suite; ``status`` and ``table`` read the goldens only."""
    if args.golden_command == "update":
        return _run(args, argv, "update")
    if args.golden_command == "calibrate":
        options = _run_options(args, argv, "update")  # it writes goldens: never the installed package's
        return calibrate_suite(_load(args, args.suite), options, args.margin, sys.stdout, sys.stderr)
    inventory = golden_inventory(args.golden_dir, _suites_dir(args))
    if args.golden_command == "status":
        print("\n".join(status_lines(inventory, cpu_pin(args.cpu_isa))))
    elif args.write:
        changed = write_readme_table(args.write, golden_table(inventory))
        print(f"{'wrote' if changed else 'unchanged:'} the golden table in {args.write}")
    else:
        print(golden_table(inventory), end="")
    return EXIT_PASS


def _preflight(device: str, ranks: int) -> int:
    """``harness doctor --device cuda`` (or ``--step``): each item a runner needs, "ok" on stdout or
    "missing" on stderr, one line each, then one real training step if nothing is missing; exit 2
    when any item is missing or the step fails, as the run it predicts would be refused or fail."""
    if ranks < 1:
        raise UsageError(f"--ranks: expected an int >= 1, got {ranks}")
    items = cuda_preflight(ranks) if device == "cuda" else []
    if all(item.ok for item in items):
        from harness.doctor import step_preflight  # the whole harness: only when a step is run

        items.append(step_preflight(device, ranks))
    for item in items:
        print(
            f"{'ok' if item.ok else 'missing'}: {item.item}: {item.detail}", file=sys.stdout if item.ok else sys.stderr
        )
    return EXIT_PASS if all(item.ok for item in items) else EXIT_USAGE
