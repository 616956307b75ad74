"""The subject seam: a trainer that shares no code with the reference, verified end to end, and the
loading and refusals that keep the harness honest about what a subject can feed."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from harness.checks import FAMILIES
from harness.records import read_jsonl
from harness.subject import ENTRY_POINT_GROUP, SubjectError, load_subject, protocol
from harness.suites import SuiteError, load_suite

REPO = Path(__file__).resolve().parent.parent
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
    assert arm["info"]["parameters"] > 0 and arm["train"]["sync"] == "bucket"
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
def test_a_check_tiny_dp_cannot_feed_is_refused_at_load_naming_the_check_and_subject(run_harness, kind: str) -> None:
    run = run_harness("run", TINY_DP, "--set", f"checks.2.kind={kind}")
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
    (tmp_path / "my_trainer.py").write_text(
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
    dist_info = tmp_path / "my_trainer-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-trainer\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nmine = my_trainer:factory\n")
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
