"""``harness bisect SUITE --good REV --bad REV``: the first commit at which a suite's verdict (or one
check's, ``--check NAME``) goes from pass to fail.

Why it exists: a change check (harness/change.py) says *whether* head differs from a base; when many
commits landed between a revision that passed and one that fails, this names the one that made the
difference, with the same runs a person would make by hand, and without touching their checkout.

**Probes.** Each probe of a commit X is one change run of the suite: head X, base ``--good``
(``ChangeRequest(base=good, head=X)``), so a numerics change since good fails its ``change`` checks.
X is bad when that run exits 1 (with ``--check NAME``: when a check named NAME, or ``NAME: ...``,
failed in its summary.json; a NAME that no check of the run bears is exit 2), good when it exits 0.
A probe that exits 3 (infrastructure, or a commit whose package does not compile:
:class:`~harness.revisions.RevisionBuildError`) or 4 (inconclusive) is skipped, as ``git bisect run``
skips exit 125: the next probe is the untried candidate nearest the midpoint, the later one on a tie
(a commit that does not build is most often mended by the next). Any other exit 2 ends the bisect.

**Candidates and cost.** The commits of ``git rev-list --ancestry-path good..bad``, oldest first;
``--good`` must be an ancestor of ``--bad``. The search is binary over N candidates and N + 1
outcomes (each candidate, or none fails): at most ceil(log2(N + 1)) probe runs, about log2(N) (15
candidates: 4), one more per skipped probe, then one more run to locate the first op.

**What is assumed.** ``--good`` is not probed: the base of its own change is itself, which passes by
construction. ``--bad`` is *not* assumed to fail: the search treats "none fails" as an outcome, so
``--bad`` is probed exactly when every earlier candidate it tried passed, the one case where the
search would otherwise name it without evidence; if it passes, the answer is exit 1, none fails.
History is assumed monotonic (good, then bad), as ``git bisect`` assumes it.

**The culprit.** Its sha and subject line; the checks that fail at it and pass at its parent (the last
good probe, or ``--good`` itself, whose checks all pass: then every check that failed at the
culprit); and one more run, ``--base <parent> --head <culprit>`` with the first-op re-run on
(harness/first_op.py), whose summary's ``change.line`` names the first op where the two part.

**Never the user's checkout.** Revisions are read from git objects only (``git archive``,
harness/revisions.py); no ``git checkout``, no ``git bisect``: the working tree, index and HEAD stay
as they are.

Exit codes: 0 a culprit was found, 1 no candidate fails, 2 bad input, 3 every remaining candidate was
skipped (the culprit is one of them), 128 + N cancelled by signal N. The bisect directory (``--out``,
default ./reports/bisect/<UTC timestamp>)::

    bisect.json              the log: each probe's sha, subject line, exit code, verdict, run directory
    bisect.html              the same as a page, linking each probe's report.html
    probe-<k>-<sha7>/        probe k's run directory, as ``harness run --out`` leaves it
    culprit-<sha7>/          the run of the culprit against its parent, first-op re-run on
    logs/harness.log         the bisect's log, with every run's own lines
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from harness.cancel import Cancellation, Cancelled
from harness.change import ChangeRequest, prepare_change
from harness.files import write_json_atomic, write_text_atomic
from harness.golden import GoldenError
from harness.prepare import RunOptions, UsageError
from harness.report.html import write_bisect_page
from harness.revisions import RevisionBuildError, RevisionError, Source, find_source, subject_package
from harness.run import run_suite
from harness.rundir import LOGS_DIR, REPORT, SUMMARY, RunDirError, fresh_dir, harness_log, make_run_dir
from harness.specs import SuiteSpec
from harness.subject import load_subject
from harness.verdict import EXIT_FAIL, EXIT_INCONCLUSIVE, EXIT_INFRA, EXIT_PASS, EXIT_USAGE

log = logging.getLogger("harness.bisect")  # into the bisect's logs/harness.log, beside every run's own lines

PASS, FAIL, SKIP = "pass", "fail", "skip"
SKIPPED_CODES = (EXIT_INFRA, EXIT_INCONCLUSIVE)


@dataclass(frozen=True)
class BisectRequest:
    """``--good REV --bad REV [--source PATH] [--check NAME]``."""

    good: str
    bad: str
    source: Path | None = None  # None: the checkout the subject's package is imported from
    check: str | None = None  # None: the run's verdict decides
    cache: Path | None = None  # the revision cache (default: revisions.default_cache_dir())


@dataclass(frozen=True)
class Commit:
    sha: str
    title: str

    def shown(self) -> str:
        return f'{self.sha[:7]} "{self.title}"'


@dataclass
class Probe:
    """One run of the suite at one candidate: head ``sha``, base ``--good``."""

    number: int  # 1, 2, ... in the order they ran
    sha: str
    title: str
    exit_code: int
    verdict: str  # pass, fail or skip: what the search made of it
    run_dir: str | None  # relative to the bisect directory; None when the run was refused before it existed
    duration_s: float
    report: str | None = None  # its report.html, relative to the bisect directory
    error: str | None = None
    failed: list[str] = field(default_factory=list)  # the checks that failed

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "duration_s": round(self.duration_s, 3)}


def max_probes(candidates: int) -> int:
    """Probe runs of a search with no skips, at most: N candidates, N + 1 outcomes."""
    return math.ceil(math.log2(candidates + 1))


def pick(lo: int, hi: int, skipped: set[int]) -> int | None:
    """The next candidate to probe between the last good ``lo`` and the first bad ``hi`` (exclusive;
    -1 and N when none is known yet): the midpoint, or past skipped ones the nearest untried, the later
    on a tie; None when none is left."""
    mid = (lo + hi) // 2
    left = [i for i in range(lo + 1, hi) if i not in skipped]
    return min(left, key=lambda i: (abs(i - mid), -i), default=None)


def run_bisect(
    suite: SuiteSpec, options: RunOptions, request: BisectRequest, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Bisects ``--good..--bad`` with the suite and returns the exit code (module docstring); raises
    RevisionError or UsageError (exit 2) before running anything when the input is bad. ``out`` and
    ``err``: the console (default: sys.stdout and sys.stderr as they are now, not at import)."""
    out, err = out or sys.stdout, err or sys.stderr
    subject = load_subject(suite.subject, suite.path.resolve())
    source = find_source(subject_package(subject, suite.subject), suite.subject, request.source)
    good = Commit(*source.resolve(request.good, "--good"))
    bad = Commit(*source.resolve(request.bad, "--bad"))
    candidates = _candidates(source, request, good, bad)
    folder = fresh_dir(options.out, "bisect directory") if options.out else make_run_dir("bisect", None)
    bisect = _Bisect(suite, options, request, good, bad, candidates, folder, out, err)
    return bisect.run()


def _candidates(source: Source, request: BisectRequest, good: Commit, bad: Commit) -> list[Commit]:
    """The commits of ``good..bad`` on the ancestry path, oldest first; UsageError unless good is an
    ancestor of bad."""
    if good.sha == bad.sha:
        raise UsageError(f"--good {request.good} and --bad {request.bad} are the same commit ({good.sha[:7]})")
    listed = source.git(
        "log", "--ancestry-path", "--reverse", "--format=%H %s", f"{good.sha}..{bad.sha}", "--", what="--bad"
    )
    commits = [Commit(*(line.split(" ", 1) + [""])[:2]) for line in listed.splitlines() if line]
    if not commits:
        raise UsageError(
            f"--good {request.good} ({good.sha[:7]}) is not an ancestor of --bad {request.bad} ({bad.sha[:7]})"
        )
    return commits


class _Bisect:
    """One bisect: the search, its probes, and the files that record them."""

    def __init__(
        self,
        suite: SuiteSpec,
        options: RunOptions,
        request: BisectRequest,
        good: Commit,
        bad: Commit,
        candidates: list[Commit],
        folder: Path,
        out: TextIO,
        err: TextIO,
    ) -> None:
        self.suite, self.options, self.request = suite, options, request
        self.good, self.bad, self.candidates, self.folder = good, bad, candidates, folder
        self.out, self.err = out, err
        self.probes: list[Probe] = []
        self.by_index: dict[int, Probe] = {}
        self.record: dict[str, Any] = {
            "command": list(options.command),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "suite": suite.name,
            "good": {"spec": request.good, **dataclasses.asdict(good)},
            "bad": {"spec": request.bad, **dataclasses.asdict(bad)},
            "check": request.check,
            "candidates": [dataclasses.asdict(c) for c in candidates],
            "max_probes": max_probes(len(candidates)),
            "verdict": "running",
            "exit_code": None,
            "culprit": None,
            "first_op": None,
            "remaining": [],
        }

    def say(self, line: str) -> None:
        print(f"bisect: {line}", file=self.out, flush=True)
        log.info(line)

    def run(self) -> int:
        n = len(self.candidates)
        self.say(
            f"{_plural(n, 'candidate')} between --good {self.good.shown()} and --bad {self.bad.shown()},"
            f" at most ~{_plural(max_probes(n), 'run')} (log2 of {n + 1} outcomes), one more per skipped commit,"
            " and one to locate the first op"
        )
        with harness_log(self.folder), Cancellation() as cancellation:
            self.write()
            try:
                code = self.search(cancellation)
            except Cancelled as c:
                self.say(f"{c}: the bisect stops")
                self.record["cancelled"] = str(c)
                code = c.exit_code
            except BaseException as e:
                self.record["error"] = f"{type(e).__name__}: {e}"
                refused = isinstance(e, (UsageError, RevisionError, GoldenError, RunDirError))
                self.finish("error", EXIT_USAGE if refused else EXIT_INFRA)
                raise
            self.finish(_VERDICTS.get(code, "cancelled"), code)
        self.say(f"log: {self.folder / 'bisect.json'}, page: {self.folder / 'bisect.html'}")
        return code

    def search(self, cancellation: Cancellation) -> int:
        """The binary search; the exit code."""
        n = len(self.candidates)
        lo, hi, skipped = -1, n, set()
        while (index := pick(lo, hi, skipped)) is not None:
            probe = self.probe(index)
            if probe.exit_code >= 128:
                cancellation.signum = probe.exit_code - 128  # a second signal now aborts at once
                raise Cancelled(probe.exit_code - 128)
            if probe.verdict == SKIP:
                skipped.add(index)
            elif probe.verdict == FAIL:
                hi = index
            else:
                lo = index
        left = sorted(i for i in skipped if lo < i < hi)
        if left or hi == n:
            self.say(self.runs_line(located=False))
        if left:
            maybe = [self.candidates[i] for i in left] + ([self.candidates[hi]] if hi < n else [])
            self.record["remaining"] = [dataclasses.asdict(c) for c in maybe]
            which = "the first bad commit" if hi < n else "the first bad commit, if any,"
            self.say(f"every remaining candidate was skipped: {which} is one of {', '.join(c.shown() for c in maybe)}")
            return EXIT_INFRA
        if hi == n:
            self.say(f"no candidate fails: {self.bad.shown()} (--bad) passes against --good {self.good.shown()}")
            return EXIT_FAIL
        self.culprit(hi, lo)
        return EXIT_PASS

    def probe(self, index: int) -> Probe:
        """One run at candidate ``index`` against --good, judged, logged and said."""
        commit, number = self.candidates[index], len(self.probes) + 1
        relative = f"probe-{number}-{commit.sha[:7]}"
        probe = Probe(number, commit.sha, commit.title, EXIT_INFRA, SKIP, None, 0.0)
        self.probes.append(probe)
        self.by_index[index] = probe
        start = time.monotonic()
        try:
            try:
                changed, revisions = prepare_change(
                    self.suite, ChangeRequest(self.good.sha, commit.sha, self.request.source, self.request.cache)
                )
            except RevisionBuildError as e:
                probe.error = str(e)
            else:
                options = dataclasses.replace(
                    self.options, out=self.folder / relative, revisions=revisions, first_op="off"
                )
                probe.exit_code, summary = self.one_run(changed, options, f"probe {number}")
                self.judge(probe, summary, relative)
        finally:
            probe.duration_s = time.monotonic() - start
            self.write()
        why = f": {probe.error}" if probe.verdict == SKIP and probe.error else ""
        if self.request.check is not None and probe.verdict != SKIP:
            why = f"; --check {self.request.check} {'failed' if probe.verdict == FAIL else 'did not fail'}"
        self.say(f"probe {number}: {commit.shown()}: {probe.verdict} (exit {probe.exit_code}{why})")
        return probe

    def one_run(self, suite: SuiteSpec, options: RunOptions, what: str) -> tuple[int, dict[str, Any]]:
        """A run into ``options.out`` and its summary ({} when it wrote none). Its console output goes to
        its logs/console.log, or, with --verbose, to the console; an error escaping it is exit 3."""
        run_dir = Path(options.out)
        with self.console(run_dir) as (out, err):
            try:
                code = run_suite(suite, options, out, err)
            except (UsageError, GoldenError, RunDirError):
                raise  # the command's fault, the same at every candidate: exit 2
            except Exception as e:  # one candidate's run: skipped, as a flake would be
                log.exception("%s: internal error", what)
                print(f"error: internal error: {type(e).__name__}: {e}", file=err)
                return EXIT_INFRA, {"error": f"internal error: {type(e).__name__}: {e} (see logs/harness.log)"}
        try:
            return code, json.loads((run_dir / SUMMARY).read_text())
        except (OSError, ValueError):
            return code, {}

    @contextmanager
    def console(self, run_dir: Path) -> Iterator[tuple[TextIO, TextIO]]:
        if self.options.verbose:
            yield self.out, self.err
            return
        captured = io.StringIO()
        try:
            yield captured, captured
        finally:
            target = run_dir / LOGS_DIR if run_dir.is_dir() else self.folder / LOGS_DIR
            name = "console.log" if run_dir.is_dir() else f"{run_dir.name}.console.log"
            try:
                write_text_atomic(target / name, captured.getvalue())
            except OSError as e:
                log.info("%s: console output not kept: %s", run_dir.name, e)

    def judge(self, probe: Probe, summary: dict[str, Any], relative: str) -> None:
        """The probe's verdict from its exit code, or with --check from its summary's checks; UsageError
        (exit 2) for a run refused as the command's fault, or a --check that names no check of it."""
        checks = summary.get("checks", [])
        probe.failed = [c["name"] for c in checks if c.get("status") == FAIL]
        probe.run_dir = relative if (self.folder / relative).is_dir() else None
        probe.report = f"{relative}/{REPORT}" if (self.folder / relative / REPORT).is_file() else None
        probe.error = summary.get("error")
        if probe.exit_code in SKIPPED_CODES:
            probe.verdict = SKIP
            probe.error = probe.error or ("inconclusive" if probe.exit_code == EXIT_INCONCLUSIVE else "infrastructure")
        elif probe.exit_code == EXIT_USAGE:
            raise UsageError(f"probe {probe.number} ({probe.sha[:7]}): {probe.error or 'refused (exit 2)'}")
        elif probe.exit_code not in (EXIT_PASS, EXIT_FAIL):
            probe.verdict = SKIP  # a signal: the search stops on it
        elif self.request.check is None:
            probe.verdict = FAIL if probe.exit_code == EXIT_FAIL else PASS
        else:
            named = [c for c in checks if _named(c["name"], self.request.check)]
            if not named:
                shown = ", ".join(sorted({c["name"] for c in checks})) or "none"
                raise UsageError(f"--check {self.request.check}: no check of the run is named so (its checks: {shown})")
            probe.verdict = FAIL if any(c.get("status") == FAIL for c in named) else PASS

    def culprit(self, index: int, lo: int) -> None:
        """The culprit ``index`` (its parent: candidate ``lo``, the last good probe, or --good when -1): its
        lines and record, and the run that locates the first op against its parent."""
        commit, parent = self.candidates[index], self.candidates[lo] if lo >= 0 else None
        base = parent or self.good
        at_culprit = self.statuses(self.by_index[index])
        at_parent = self.statuses(self.by_index[lo]) if parent is not None else None  # --good: all pass
        failed = [name for name, s in at_culprit.items() if s == FAIL]
        newly = [name for name in failed if at_parent is None or at_parent.get(name) == PASS]
        self.say(f"first bad commit: {commit.sha} {commit.title}")
        self.say(f"its parent: {base.shown()} ({'the last good probe' if parent else '--good'})")
        self.say(f"failing at {commit.sha[:7]}, passing at {base.sha[:7]}: {', '.join(newly) or 'none'}")
        self.record["culprit"] = {
            **dataclasses.asdict(commit),
            "parent": {**dataclasses.asdict(base), "from": "probe" if parent else "good"},
            "checks": newly,
        }
        self.write()
        self.locate(commit, base)

    def statuses(self, probe: Probe) -> dict[str, str]:
        """Each check's status in a probe's summary.json."""
        try:
            summary = json.loads((self.folder / str(probe.run_dir) / SUMMARY).read_text())
        except (OSError, ValueError):
            return {}
        return {c["name"]: c.get("status", "?") for c in summary.get("checks", [])}

    def locate(self, commit: Commit, parent: Commit) -> None:
        """One more run, ``--base parent --head culprit``, the first-op re-run on; quotes its change line."""
        relative = f"culprit-{commit.sha[:7]}"
        self.say(f"locating the first op: {relative}: head {commit.sha[:7]} vs base {parent.sha[:7]}, --first-op on")
        start = time.monotonic()
        try:
            changed, revisions = prepare_change(
                self.suite, ChangeRequest(parent.sha, commit.sha, self.request.source, self.request.cache)
            )
        except RevisionBuildError as e:  # both built as probes (or --good): should one not, say so
            code, summary = EXIT_INFRA, {"error": str(e)}
        else:
            options = dataclasses.replace(self.options, out=self.folder / relative, revisions=revisions, first_op="on")
            code, summary = self.one_run(changed, options, "first-op run")
        line = summary.get("change", {}).get("line") or summary.get("error") or f"no change line (exit {code})"
        self.record["first_op"] = {
            "run_dir": relative if (self.folder / relative).is_dir() else None,
            "report": f"{relative}/{REPORT}" if (self.folder / relative / REPORT).is_file() else None,
            "exit_code": code,
            "line": line,
            "duration_s": round(time.monotonic() - start, 3),
        }
        if code >= 128:
            raise Cancelled(code - 128)
        self.say(self.runs_line(located=True))
        self.say(f"first op: {line}")

    def runs_line(self, located: bool) -> str:
        skipped = sum(p.verdict == SKIP for p in self.probes)
        also = ", and 1 locating the first op" if located else ""
        probes = _plural(len(self.probes), "probe")
        return f"{_plural(len(self.probes) + located, 'run')}: {probes}, {skipped} skipped{also}"

    def finish(self, verdict: str, code: int) -> None:
        self.record["verdict"], self.record["exit_code"] = verdict, code
        self.write()

    def write(self) -> None:
        """bisect.json, then bisect.html: rewritten after every probe, so a bisect that is killed leaves its log."""
        skipped = sum(p.verdict == SKIP for p in self.probes)
        self.record["probes"] = [p.to_dict() for p in self.probes]
        self.record["skipped"] = skipped
        self.record["runs"] = len(self.probes) + (1 if self.record["first_op"] else 0)
        write_json_atomic(self.folder / "bisect.json", self.record)
        write_bisect_page(self.folder / "bisect.html", self.record)


_VERDICTS = {EXIT_PASS: "found", EXIT_FAIL: "none fails", EXIT_INFRA: "all skipped", EXIT_USAGE: "error"}


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"


def _named(check: str, name: str) -> bool:
    """``--check NAME`` names a check called NAME, or ``NAME: ...`` (an arm's checks, a pair's metrics)."""
    return check == name or check.startswith(f"{name}:")
