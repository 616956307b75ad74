"""The subject seam: a trainer that shares no code with the reference, verified end to end, and the
loading and refusals that keep the harness honest about what a subject can feed."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from harness.checks import FAMILIES
from harness.cli import main
from harness.records import read_jsonl
from harness.subject import ENTRY_POINT_GROUP, SubjectError, load_subject, protocol
from harness.suites import SuiteError, load_suite

REPO = Path(__file__).resolve().parents[2]
TINY_DP = REPO / "examples" / "tiny-dp.toml"


def test_tiny_dp_runs_every_check_it_can_feed_and_matches_its_golden(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness("run", TINY_DP, "--ranks", 2, "--golden", "check", "--golden-dir", REPO / "golden", "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = run.summary(out)
    by_kind: dict[str, list[dict]] = {}
    for check in summary["checks"]:
        by_kind.setdefault(check["kind"], []).append(check)
    assert {"determinism", "exact", "ranks-agree", "final-weights", "golden"} <= set(by_kind)
    assert all(c["status"] == "pass" for c in summary["checks"]), summary["checks"]
    assert len(by_kind["golden"]) == 6  # 3 arms x loss, grad_norm
    assert summary["suite"] == "tiny-dp" and summary["arms"]["bucket"] == {"ranks": 2, "ep": 2, "steps_completed": 10}
    for logical_rank in (0, 1):  # one logical rank per process, each recording its own view
        assert len(read_jsonl(out / "arms" / "bucket" / f"ranks.rank{logical_rank}.jsonl")) == 10
    assert not list(out.glob("arms/*/events.rank*.jsonl"))  # no token exchange: nothing pretends there is
    arm = json.loads((out / "arms" / "bucket" / "arm.json").read_text())
    assert arm["facts"] == {} and arm["train"]["sync"] == "bucket"  # no family that needs a fact
    assert (out / "report.html").is_file() and (out / "junit.xml").is_file()


def test_tiny_dp_planted_unsynced_gradient_fails_naming_the_step_and_the_rank(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness("run", TINY_DP, "--set", "arms.per-parameter.fault=unsynced-bias", "--out", out)
    assert run.returncode == 1, run.stdout + run.stderr
    loss = run.check(out, "bucket vs per-parameter: loss")
    assert loss["status"] == "fail" and loss["first_divergent_step"] == 2
    assert loss["extra"]["first_gradient_divergence"]["step"] == 2
    ranks = run.check(out, "per-parameter: ranks-agree")
    assert ranks["status"] == "fail" and "logical rank 1" in ranks["detail"]
    assert run.check(out, "bucket: ranks-agree")["status"] == "pass"


@pytest.mark.parametrize("kind", ["token-exchange-invariants", "graph-invariants", "routing-counts", "pec-invariants"])
def test_a_check_tiny_dp_cannot_feed_is_refused_at_load_naming_the_check_and_subject(harness_main, kind: str) -> None:
    run = harness_main("run", TINY_DP, "--set", f"checks.2.kind={kind}")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip().splitlines() == [
        f'error: --set checks.2.kind: {kind} reads {_reads(kind)} records, which subject "tiny-dp" does not emit'
        " (it emits: final-weights, gradient-digests, metrics, rank-updates)"
    ]
    assert "run dir" not in run.stdout  # refused before anything was launched


def _reads(kind: str) -> str:
    return ", ".join(FAMILIES[kind].reads_of(kind))


def test_tiny_dp_throughput_is_measured_in_abba_blocks(run_harness, tmp_path: Path) -> None:
    """The subject feeds ABBA like the reference: blocks timed on every rank, tokens from its step
    records. The verdict is the gate's business (tests/test_throughput.py); here, that it judged."""
    out = tmp_path / "abba"
    run = run_harness(
        "abba", TINY_DP, "--a", "bucket", "--b", "per-parameter", "--blocks", 4, "--steps", 2, "--warmup", 1,
        "--out", out,
    )  # fmt: skip
    summary = run.summary(out)
    assert run.returncode == summary["exit_code"] and run.returncode in (0, 1, 4), run.stdout + run.stderr
    rows = read_jsonl(out / "throughput.jsonl")
    roles = [r["role"] for r in rows]
    assert len(rows) == 16 and roles.count("A") == roles.count("B") == 8
    assert {r["arm"] for r in rows} == {"bucket", "per-parameter"}
    tokens_per_step = 2 * 4 * 16  # 2 ranks x local_batch x seq_len
    assert all(r["tokens_per_s"] * r["seconds"] == pytest.approx(2 * tokens_per_step) for r in rows)
    gate = summary["throughput"]
    # 4 blocks: the fewest from which the interval is bounded
    assert 0 < gate["low"] <= gate["ratio"] <= gate["high"] and len(gate["per_block_ratios"]) == 4


def test_every_check_family_reads_only_record_families_the_protocol_defines() -> None:
    for kind, family in FAMILIES.items():
        assert family.reads_of(kind), kind
        assert set(family.reads_of(kind)) <= set(protocol.FAMILIES), kind


def test_reference_arms_declare_the_families_their_config_emits() -> None:
    suite = load_suite("parity")
    assert protocol.GRAPH in suite.arms["graph"].families
    assert protocol.GRAPH not in suite.arms["eager"].families
    assert protocol.TOKEN_EXCHANGE in suite.arms["eager"].families
    versioned = load_suite("strict-vs-stale")
    assert all(protocol.VERSIONED in arm.families for arm in versioned.arms.values() if "delay" in arm.train)


def _suite(tmp_path: Path, subject: str, body: str = "") -> Path:
    path = tmp_path / "s.toml"
    path.write_text(
        f'name = "s"\ndescription = "d"\nsubject = "{subject}"\nranks = 2\nsteps = 2\n[arms.a]\n'
        f'[[checks]]\nkind = "ranks-agree"\n{body}'
    )
    return path


@pytest.mark.parametrize(
    ("subject", "module", "expected"),
    [
        (
            "nosuch",
            None,
            'subject: subject "nosuch": not a known subject (reference, torchtitan) nor "package.module:factory"',
        ),
        ("missing_mod:subject", None, 'subject: subject "missing_mod:subject": cannot import missing_mod'),
        ("plain1:no", "x = 1\n", "subject: subject \"plain1:no\": module 'plain1' has no attribute 'no'"),
        ("plain2:x", "x = 1\n", 'subject: subject "plain2:x": 1 is not a factory'),
        ("plain3:f", "def f():\n    return object()\n", 'subject: subject "plain3:f": object lacks name, families'),
    ],
)
def test_a_subject_that_cannot_be_loaded_is_one_line_naming_it(
    tmp_path: Path, subject: str, module: str | None, expected: str
) -> None:
    if module is not None:
        (tmp_path / f"{subject.split(':')[0]}.py").write_text(module)
    with pytest.raises(SuiteError) as error:
        load_suite(str(_suite(tmp_path, subject)))
    assert expected in str(error.value)
    assert "\n" not in str(error.value)


def test_an_installed_subject_registers_under_the_entry_point_group(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "entry_point_trainer.py").write_text(
        textwrap.dedent(
            """
            import sys
            sys.path.insert(0, %r)
            from tiny_dp import TinyDP

            class Mine(TinyDP):
                name = "mine"

            def factory():
                return Mine()
            """
            % str(REPO / "examples")
        )
    )
    dist_info = tmp_path / "entry_point_trainer-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: entry-point-trainer\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nmine = entry_point_trainer:factory\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    subject = load_subject("mine")
    assert subject.name == "mine" and protocol.TOKEN_EXCHANGE not in subject.families
    suite = load_suite(str(_suite(tmp_path, "mine")))
    assert suite.subject == "mine" and suite.arms["a"].logical_ranks == 2
    with pytest.raises(SubjectError, match="not a known subject"):
        load_subject("yours")


def test_a_subject_beside_its_suite_is_the_only_module_taken_from_that_folder(tmp_path: Path) -> None:
    """Loading a subject from the suite's folder must not put the folder on sys.path, where a stray
    module named like one the harness imports later would shadow it."""
    (tmp_path / "beside_subject.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO / 'examples')!r})\nfrom tiny_dp import subject\n"
    )
    (tmp_path / "tabnanny.py").write_text("raise RuntimeError('a shadowing module ran')\n")
    suite = load_suite(str(_suite(tmp_path, "beside_subject:subject")))
    assert suite.subject == "beside_subject:subject" and str(tmp_path) not in sys.path
    sys.modules.pop("tabnanny", None)
    import tabnanny  # the standard library's, not the folder's

    assert Path(tabnanny.__file__).parent != tmp_path

    raising = tmp_path / "other"
    raising.mkdir()
    (raising / "broken_subject.py").write_text("raise ValueError('no')\n")
    with pytest.raises(SuiteError, match=r'subject "broken_subject:f": .*broken_subject.py raised ValueError: no'):
        load_suite(str(_suite(raising, "broken_subject:f")))


# --- what a suite may import: StrictModes on the suite file, the module beside it and their folders ---

_MARKS_IMPORT = "from pathlib import Path\nPath(__file__).with_name('imported').write_text('ran')\n"


def _shared(tmp_path: Path, module: str, package: bool = False) -> tuple[Path, Path]:
    """A suite naming ``module:subject`` and the module beside it (a package with a submodule when
    ``package``), which leaves a file ``imported`` when it is imported; (suite, folder)."""
    folder = tmp_path / "shared"
    folder.mkdir()
    if package:
        (folder / module).mkdir()
        (folder / module / "__init__.py").write_text("")
        (folder / module / "sub.py").write_text(_MARKS_IMPORT)
    else:
        (folder / f"{module}.py").write_text(_MARKS_IMPORT)
    target = f"{module}.sub:subject" if package else f"{module}:subject"
    return _suite(folder, target), folder


@pytest.mark.parametrize(
    ("planted", "unsafe", "why"),
    [
        ("folder-0777", "", "mode 0777 is writable by others without the sticky bit"),
        ("module-of-another-user", "{module}.py", "owned by uid 12345, expected this user's uid"),
        ("module-0666", "{module}.py", "mode 0666 is writable by others"),
        ("suite-of-another-user", "s.toml", "owned by uid 12345, expected this user's uid"),
        ("suite-0666", "s.toml", "mode 0666 is writable by others"),
        ("package-file-of-another-user", "{module}/sub.py", "owned by uid 12345, expected this user's uid"),
    ],
)
def test_a_subject_module_others_could_have_written_is_refused_before_it_is_imported(
    tmp_path: Path, planted: str, unsafe: str, why: str
) -> None:
    module = f"shared_{planted.replace('-', '_')}"
    suite, folder = _shared(tmp_path, module, package=planted.startswith("package"))
    path = folder / unsafe.format(module=module) if unsafe else folder
    if "another-user" in planted:
        os.chown(path, 12345, -1)
    else:
        path.chmod(0o777 if path.is_dir() else 0o666)
    with pytest.raises(SuiteError) as error:
        load_suite(str(suite))
    message = str(error.value)
    assert message.startswith(f'{suite}: subject: subject "{module}')
    assert f"refused: {path}: {why}" in message
    assert f'install it and name its "{ENTRY_POINT_GROUP}" entry point' in message and "\n" not in message
    assert not (folder / "imported").exists() and not (folder / module / "imported").exists()


def test_a_subject_module_in_a_shared_folder_exits_2_with_one_line_and_nothing_launched(
    harness_main, tmp_path: Path
) -> None:
    suite, folder = _shared(tmp_path, "shared_cli")
    folder.chmod(0o777)
    out = tmp_path / "run"
    run = harness_main("run", suite, "--out", out)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.splitlines() == [
        f'error: {suite}: subject: subject "shared_cli:subject": refused: {folder}: mode 0777 is writable by others'
        " without the sticky bit; a module beside a suite is imported only where nobody else can write (to run a"
        f' trainer from a shared place, install it and name its "{ENTRY_POINT_GROUP}" entry point)'
    ]
    assert not (folder / "imported").exists() and not out.exists()


# --- a subject's own code failing as it is loaded: whose fault, which exit code ---

_TINY = (
    f"import sys\nsys.path.insert(0, {str(REPO / 'examples')!r})\nimport tiny_dp\n"
    "from harness.subject import SubjectError\n"
)


@pytest.mark.parametrize(
    ("case", "code", "exit_code", "expected"),
    [
        (
            "factory-raises",
            "def subject():\n    return {}['missing']\n",
            1,
            "its factory raised: {module}:6: KeyError: 'missing'",
        ),
        (
            "factory-refuses",
            "def subject():\n    raise SubjectError('needs the foo extra: pip install foo')\n",
            2,
            'subject "{name}:subject": needs the foo extra: pip install foo',
        ),
        (
            "parse-arms-rejects",
            "class S(tiny_dp.TinyDP):\n    def parse_arms(self, tables, reader):\n"
            "        raise ValueError('lr must be a power of two')\n\ndef subject():\n    return S()\n",
            2,
            'subject "tiny-dp" rejects its config: lr must be a power of two',
        ),
        (
            "parse-arms-raises",
            "class S(tiny_dp.TinyDP):\n    source = (__import__('pathlib').Path(__file__).resolve(),)\n"
            "    def parse_arms(self, tables, reader):\n        return tables.arms['a'].nosuch\n\n"
            "def subject():\n    return S()\n",
            1,
            "subject \"tiny-dp\": parse_arms raised: {module}:8: AttributeError: 'dict' object has no attribute"
            " 'nosuch'",
        ),
    ],
)
def test_a_subject_raising_as_it_loads_is_its_bug_exit_1_unless_it_rejects_its_input_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, case: str, code: str, exit_code: int, expected: str
) -> None:
    name = f"loads_{case.replace('-', '_')}"
    module = tmp_path / f"{name}.py"
    module.write_text(_TINY + code)
    suite = _suite(tmp_path, f"{name}:subject")
    assert main(["run", str(suite), "--out", str(tmp_path / "run")]) == exit_code
    err = capsys.readouterr().err
    assert err.startswith(f"error: {suite}: ") and err.count("\n") == 1, err
    assert expected.format(module=module, name=name) in err
    assert not (tmp_path / "run").exists()


def test_a_factory_that_hangs_exits_3_at_the_timeout_naming_where_it_hangs(run_harness, tmp_path: Path) -> None:
    module = tmp_path / "hangs_forever.py"
    module.write_text("import time\n\n\ndef subject():\n    while True:\n        time.sleep(1)\n")
    suite = _suite(tmp_path, "hangs_forever:subject")
    run = run_harness("run", suite, "--timeout", 5, timeout=90)
    assert run.returncode == 3, run.stdout + run.stderr
    [line] = run.stderr.splitlines()
    assert line.startswith(f"error: suite {suite}: still loading after --timeout 5s, hangs at {module}:6 in subject")
    stack = Path(line.rsplit("(stack: ", 1)[1].rstrip(")"))
    assert f'File "{module}", line 6, in subject' in stack.read_text()
    assert run.elapsed_s < 60  # 5 s of loading after the harness's own imports, not forever


# --- records no run could have made: checked where the rank receives them, the subject's fault ---

_BAD_RECORDS = """
import dataclasses
import os
import sys

sys.path.insert(0, {examples!r})
import tiny_dp

BAD = os.environ["BAD_RECORD"]


class Arm(tiny_dp.TinyDPArm):
    def step(self, step):
        record = super().step(step)
        if BAD == "undeclared-family":
            self.recorder.exchange_event(self.rank, {{"step": step}})
        return dataclasses.replace(record, step=step + 100) if BAD == "steps-101-102" else record


class Subject(tiny_dp.TinyDP):
    def build(self, context):
        return Arm(context)


def subject():
    return Subject()
"""


# Two of the seam's rules (each rule is tests/test_seam.py's), broken by a subject in its ranks.
@pytest.mark.parametrize(
    ("bad", "record"),
    [
        ("steps-101-102", "StepRecord step 101: not a step of this run (it asked for steps 1-2)"),
        (
            "undeclared-family",
            "exchange_event: the arm does not declare the token-exchange family"
            " (it declares: final-weights, gradient-digests, metrics, rank-updates)",
        ),
    ],
)
def test_a_record_no_run_could_have_made_is_the_subjects_fault_naming_arm_rank_and_record(
    run_harness, tmp_path: Path, bad: str, record: str
) -> None:
    (tmp_path / "bad_records.py").write_text(_BAD_RECORDS.format(examples=str(REPO / "examples")))
    out = tmp_path / "run"
    run = run_harness("run", _suite(tmp_path, "bad_records:subject"), "--out", out, env={"BAD_RECORD": bad})
    assert run.returncode == 1, run.stdout + run.stderr
    [raised] = [c for c in run.summary(out)["checks"] if c["kind"] == "rank-raised"]
    rank = int(raised["name"].split()[1])  # "rank k raised": the root cause, which the line names
    expected = f"BadRecord: arm 'a', rank {rank}: {record.format(rank=rank)}"
    assert raised["status"] == "fail" and raised["detail"].endswith(expected), raised["detail"]
    assert "the subject's fault" in raised["detail"]
    assert "step 101/2" not in run.stdout


# --- the least a subject is, and the facts a family's checks need ---


def _block(text: str, opening: str) -> str:
    """The fenced block of ``text`` that starts with ``opening``, without its fences."""
    start = text.index(opening)
    return text[text.index("\n", start) + 1 : text.index("```", start + len(opening))]


def test_a_subject_that_records_only_metrics_is_parse_arms_build_and_step_end_to_end(
    run_harness, tmp_path: Path
) -> None:
    """The front page's subject, as written there (and in docs/extending.md): SubjectBase and ArmBase
    hold the rest, and no method of a family it does not declare is called (ArmBase's would raise)."""
    readme = (REPO / "README.md").read_text()
    code = _block(readme, "```python\n# my_trainer.py")
    assert code in (REPO / "docs" / "extending.md").read_text()
    assert len(code.splitlines()) <= 30
    (tmp_path / "my_trainer.py").write_text(code)
    suite = tmp_path / "my-suite.toml"
    suite.write_text(_block(readme, '```toml\nname = "mine"'))
    out = tmp_path / "run"
    run = run_harness("run", suite, "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    checks = {c["name"]: c["status"] for c in run.summary(out)["checks"] if c["kind"] == "determinism"}
    assert checks == {"a vs b: loss": "pass", "a vs b: grad_norm": "pass", "a vs b: tokens": "pass"}, checks
    arm = json.loads((out / "arms" / "a" / "arm.json").read_text())
    assert arm["facts"] == {} and arm["train"] == {"lr": 0.1, "seed": 0}
    assert not list(out.glob("arms/*/weights.rank*.json")) and not list(out.glob("arms/*/ranks.rank*.jsonl"))


_EXCHANGING = """
import sys

sys.path.insert(0, {examples!r})
import tiny_dp
from harness.subject import protocol
from harness.subject.config import dataclass_arms


class Arm(tiny_dp.TinyDPArm):
    def step(self, step):
        record = super().step(step)
        event = {{"step": step, "phase": "fwd", "layer": 0, "chunk": 0, "kind": "dispatch", "op": "launch"}}
        self.recorder.exchange_event(self.rank, {{**event, "name": "a2a", "buffer_set": 0, "seq": step, "rows": 1}})
        return record


class Exchanging(tiny_dp.TinyDP):
    name = "exchanging"
    families = tiny_dp.TinyDP.families | {{protocol.TOKEN_EXCHANGE}}

    def parse_arms(self, tables, reader):
        return dataclass_arms(tables, reader, tiny_dp.TinyConfig, self.families, facts=lambda config: {facts})

    def build(self, context):
        return Arm(context)


def subject():
    return Exchanging()
"""


@pytest.mark.parametrize(
    ("kind", "facts", "missing"),
    [
        ("token-exchange-invariants", "protocol.ArmFacts()", "moe_layers, chunks, num_buffer_sets"),
        ("overlap", "protocol.ArmFacts(moe_layers=(0,))", "chunks, num_buffer_sets"),
        (
            "routing-counts",
            "protocol.ArmFacts(moe_layers=(0,), chunks=1, num_buffer_sets=1, forced_balanced=True)",
            "experts_per_token, tokens_per_step",
        ),
    ],
)
def test_token_exchange_events_without_the_facts_their_checks_need_are_refused_at_load_naming_family_and_fact(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str, facts: str, missing: str
) -> None:
    """A trainer emitting token-exchange events under its own config names: its checks would have crashed
    on a KeyError; now the suite is refused before anything launches, exit 2, in one line."""
    module = f"exchanging_{kind.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(_EXCHANGING.format(examples=str(REPO / "examples"), facts=facts))
    suite = _suite(tmp_path, f"{module}:subject", f'[[checks]]\nkind = "{kind}"\n')
    assert main(["run", str(suite), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {suite}: checks.1.kind: {kind} reads token-exchange records, whose checks need the facts {missing},"
        f' which arm "a" of subject "exchanging" does not declare (ArmSpec.facts)\n'
    )
    assert not (tmp_path / "run").exists()


def test_the_same_events_with_their_facts_declared_load(tmp_path: Path) -> None:
    facts = "protocol.ArmFacts(moe_layers=(0,), chunks=1, num_buffer_sets=1)"
    (tmp_path / "exchanging_ok.py").write_text(_EXCHANGING.format(examples=str(REPO / "examples"), facts=facts))
    suite = load_suite(str(_suite(tmp_path, "exchanging_ok:subject", '[[checks]]\nkind = "routing-counts"\n')))
    assert suite.arms["a"].facts.moe_layers == (0,) and suite.checks[1].arms == ("a",)


def test_a_resumed_arm_of_a_subject_that_cannot_checkpoint_is_refused_at_load(tmp_path: Path) -> None:
    (tmp_path / "no_checkpoint.py").write_text(
        f"import dataclasses, sys\nsys.path.insert(0, {str(REPO / 'examples')!r})\nimport tiny_dp\n\n\n"
        "class S(tiny_dp.TinyDP):\n    def parse_arms(self, tables, reader):\n"
        "        return {n: dataclasses.replace(a, resume_at=1) for n, a in super().parse_arms(tables, reader).items()}"
        "\n\n\ndef subject():\n    return S()\n"
    )
    with pytest.raises(SuiteError) as error:
        load_suite(str(_suite(tmp_path, "no_checkpoint:subject")))
    assert str(error.value).endswith(
        'arms.a.resume_at: subject "tiny-dp" does not declare the checkpoint capability: no arm of it resumes'
    )


def test_a_declared_part_without_its_method_is_refused_where_it_is_declared() -> None:
    """No default raises at run time: the seam's bases leave out what a declaration calls for, and
    whoever declares it without the method is refused (a subject at load, exit 2; an arm in its rank)."""
    from harness.seam import ReceivedRecords
    from harness.subject.protocol import (
        ARM_METHODS,
        FINAL_WEIGHTS,
        GRAPH,
        RECORD_OPS,
        SUBJECT_METHODS,
        ArmBase,
        BadRecord,
        SubjectBase,
        undeclared_methods,
    )

    class StepOnly(ArmBase):
        def step(self, step: int) -> None:
            return None

    with pytest.raises(TypeError, match="abstract method step"):
        type("NoStep", (ArmBase,), {})()
    assert undeclared_methods(StepOnly(), {FINAL_WEIGHTS, GRAPH}, ARM_METHODS) == ["graph_export", "final_weights"]
    received = ReceivedRecords("a", 0, range(0, 1), 2, families={protocol.METRICS, FINAL_WEIGHTS})
    with pytest.raises(BadRecord, match="arm 'a', rank 0: StepOnly declares what calls for final_weights without it"):
        received.built(StepOnly(), ())
    ReceivedRecords("a", 0, range(0, 1), 2, families={protocol.METRICS}).built(StepOnly(), ())

    class ClaimsOps(SubjectBase):
        capabilities = frozenset({RECORD_OPS})

        def parse_arms(self, tables, reader):
            return {}

        def build(self, context):
            return StepOnly()

    assert undeclared_methods(ClaimsOps(), ClaimsOps.capabilities, SUBJECT_METHODS) == ["record_ops"]
