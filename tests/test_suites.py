"""Suite loading: shipped suites resolve as documented, and every mistake is one line naming file and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.golden import config_differences
from harness.golden_plan import golden_config
from harness.plan import plan_launches
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
    assert (procs.ranks, procs.logical_ranks) == (ranks, ranks)
    assert (inproc.ranks, inproc.logical_ranks) == (1, ranks)
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
            "FILE: checks.0.kind: expected one of token-exchange-invariants, same-event-sequence, exact, ulp,",
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
            "FILE: model.config: expected one of cpu-tiny, cpu-tiny-learned, cpu-tiny-learned-no-q-lora,"
            ' cpu-tiny-64e, debugmodel, deepseek-v3 or a path to a Hugging Face config.json, got "huge"',
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
        (
            ("--set", "model.routed_scaling_factor=fast"),
            '--set model.routed_scaling_factor: expected a finite number, got "fast"',
        ),
        (
            ("--set", "model.routed_scaling=2"),
            "--set model.routed_scaling: unknown key (did you mean routed_scaling_factor? allowed: config and",
        ),
        (("--set", "model.n_group=3"), "--set model.n_group: n_group 3 does not divide the 8 routed experts"),
        (("--set", "model.hidden_act=tanh"), "--set model.hidden_act: hidden_act must be one of ('silu', 'swish'"),
        (("--set", "model.num_hidden_layers=0"), "--set model.num_hidden_layers: expected int >= 1, got 0"),
        (("--set", "model.tie_word_embeddings=1"), "--set model.tie_word_embeddings: expected true or false, got 1"),
        (("--set", "model.config=missing.json"), '--set model.config: no such file "missing.json"'),
    ],
    ids=lambda value: value if isinstance(value, str) else value[1],
)
def test_override_errors_name_the_override(tmp_path: Path, override: tuple[str, str], expected: str) -> None:
    assert _error(tmp_path, overrides=[override]).startswith(expected)


def test_model_fields_override_the_named_config_and_reach_every_arm_and_the_golden_config(tmp_path: Path) -> None:
    text = GOOD.replace("[train]", '[model]\nconfig = "cpu-tiny"\nrouted_scaling_factor = 2\n[train]')
    suite = load_suite(str(_write(tmp_path, text)), [("--set", "model.rms_norm_eps=1e-5")])
    for arm in suite.arms.values():
        assert arm.train["model"] == "cpu-tiny"
        assert arm.train["model_overrides"] == {"routed_scaling_factor": 2.0, "rms_norm_eps": 1e-5}
    differences = config_differences(golden_config(load_suite(str(_write(tmp_path, GOOD)))), golden_config(suite))
    for arm in suite.arms:
        assert f"arms.{arm}.config.model_overrides.routed_scaling_factor: golden unset, this run 2.0" in differences
        assert f"arms.{arm}.config.model_overrides.rms_norm_eps: golden unset, this run 1e-05" in differences


def test_a_model_field_set_to_the_named_configs_value_is_no_override(tmp_path: Path) -> None:
    """cpu-tiny's rms_norm_eps is 1e-6: the same model, so the same golden configuration."""
    suite = load_suite(str(_write(tmp_path, GOOD)), [("--set", "model.rms_norm_eps=1e-6")])
    assert suite.arms["eager"].golden_config == {"chunking": "eager"}


@pytest.mark.parametrize(
    "table,expected",
    [
        ("routed_scaling_factor = true", "FILE: model.routed_scaling_factor: expected a finite number, got true"),
        ("n_groups = 2", "FILE: model.n_groups: unknown key (did you mean n_group?"),
        ("topk_group = 3", "FILE: model.topk_group: topk_group must be in 1-2 (n_group), got 3"),
        ("rms_norm_eps = 0.0", "FILE: model.rms_norm_eps: expected a number > 0, got 0.0"),
        ('rope_type = "linear"', "FILE: model.rope_type: rope_type must be one of ('default', 'yarn')"),
        (
            "n_routed_experts = 5\nn_group = 1",
            'FILE: ranks: EP degree 2 does not divide the 5 routed experts of model "cpu-tiny"',
        ),
    ],
    ids=lambda value: value if value.startswith("FILE") else "",
)
def test_model_field_errors_name_file_and_field(tmp_path: Path, table: str, expected: str) -> None:
    assert _error(tmp_path, GOOD.replace("[train]", f"[model]\n{table}\n[train]")).startswith(expected)


FIXTURE = Path(__file__).parent / "fixtures" / "deepseek-v3-tiny"


def test_a_hugging_face_config_json_resolves_on_its_defaults_shrunk_by_the_suite() -> None:
    suite = load_suite(str(FIXTURE / "suite.toml"))
    train = suite.arms["procs"].train
    assert train["model"] == "deepseek-v3"  # Hugging Face's defaults, for the keys a file leaves out
    overrides = train["model_overrides"]
    assert overrides["num_hidden_layers"] == 2  # the suite's, over the file's 4
    assert (overrides["hidden_size"], overrides["n_routed_experts"], overrides["n_group"]) == (64, 8, 4)
    assert (overrides["rope_type"], overrides["rope_factor"], overrides["rope_mscale_all_dim"]) == ("yarn", 40.0, 1.0)
    assert "routed_scaling_factor" not in overrides  # 2.5, as Hugging Face's default: no override
    json.dumps(suite.to_dict())


def _hf_error(tmp_path: Path, edit: dict, drop: tuple[str, ...] = ()) -> str:
    """The one-line error of the fixture suite with its config.json edited; the file shows as CONFIG."""
    hf = {k: v for k, v in json.loads((FIXTURE / "config.json").read_text()).items() if k not in drop}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf | edit))
    suite = tmp_path / "suite.toml"
    suite.write_text((FIXTURE / "suite.toml").read_text())
    with pytest.raises(SuiteError) as info:
        load_suite(str(suite))
    message = str(info.value)
    assert "\n" not in message
    return message.replace(str(config), "CONFIG").replace(str(suite), "FILE")


@pytest.mark.parametrize(
    "edit,expected",
    [
        ({"sliding_window": 4096}, "CONFIG: sliding_window: unknown key: it may change the numerics"),
        ({"topk_method": "greedy"}, "CONFIG: topk_method: the reference implements only 'noaux_tc', got 'greedy'"),
        ({"attention_dropout": 0.1}, "CONFIG: attention_dropout: the reference implements only 0.0, got 0.1"),
        ({"moe_layer_freq": 2}, "CONFIG: moe_layer_freq: the reference implements only 1, got 2"),
        ({"num_key_value_heads": 1}, "CONFIG: num_key_value_heads: MLA has one key per head"),
        ({"rope_scaling": {"type": "longrope", "factor": 4}}, "CONFIG: rope_scaling.type: rope_type must be one of"),
        (
            {"rope_scaling": {"type": "yarn", "factor": 4, "low_freq_factor": 1}},
            "CONFIG: rope_scaling.low_freq_factor: unknown RoPE parameter",
        ),
        ({"rope_scaling": {"type": "yarn"}}, "CONFIG: rope_scaling.factor: missing: YaRN needs the factor"),
        (
            {"rope_scaling": {"type": "yarn", "factor": "40"}},
            'CONFIG: rope_scaling.factor: expected a number > 0, got "40"',
        ),
        (
            {"rope_parameters": {"rope_type": "default"}},
            "CONFIG: rope_scaling: set rope_parameters or rope_scaling, not both",
        ),
        ({"n_group": None}, "CONFIG: n_group: expected int >= 1, got null"),
        ({"hidden_act": "gelu_10"}, "CONFIG: hidden_act: hidden_act must be one of"),
        ({"model_type": "deepseek_v2"}, "CONFIG: model_type: the reference implements only 'deepseek_v3'"),
    ],
    ids=lambda value: value if isinstance(value, str) and value.startswith("CONFIG") else "",
)
def test_config_json_errors_name_the_json_file_and_key(tmp_path: Path, edit: dict, expected: str) -> None:
    assert _hf_error(tmp_path, edit).startswith(expected)


def test_config_json_without_original_max_position_embeddings_takes_max_position_embeddings(tmp_path: Path) -> None:
    rope = {"type": "yarn", "factor": 4, "beta_fast": None}
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "deepseek_v3", "max_position_embeddings": 2048, "rope_scaling": rope}))
    suite = _write(tmp_path, GOOD.replace("[train]", f'[model]\nconfig = "{config}"\nn_routed_experts = 8\n[train]'))
    overrides = load_suite(str(suite)).arms["eager"].train["model_overrides"]
    assert overrides == {
        "rope_type": "yarn",
        "rope_factor": 4.0,
        "rope_original_max_position_embeddings": 2048,
        "n_routed_experts": 8,
    }


def test_a_relative_config_path_from_set_is_relative_to_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(FIXTURE.parent)
    suite = load_suite(str(FIXTURE / "suite.toml"), [("--set", "model.config=deepseek-v3-tiny/config.json")])
    assert suite.arms["procs"].train["model"] == "deepseek-v3"
    with pytest.raises(SuiteError, match='^--set model.config: no such file "config.json"$'):
        load_suite(str(FIXTURE / "suite.toml"), [("--set", "model.config=config.json")])


def test_a_config_json_suite_runs_and_a_model_override_reaches_the_ranks(run_harness, tmp_path: Path) -> None:
    """The fixture's shrunk DeepSeek-V3 trains with learned routing on 2 processes and in one,
    bitwise alike; routed_scaling_factor set from the command line changes the loss."""
    base = run_harness("run", FIXTURE / "suite.toml", "--steps", 2, "--out", tmp_path / "base")
    assert base.returncode == 0, base.stdout + base.stderr
    scaled = run_harness(
        "run",
        FIXTURE / "suite.toml",
        "--steps",
        2,
        "--set",
        "model.routed_scaling_factor=1.0",
        "--out",
        tmp_path / "scaled",
    )
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    arm = json.loads((tmp_path / "scaled" / "arms" / "procs" / "arm.json").read_text())
    assert arm["train"]["model_overrides"]["routed_scaling_factor"] == 1.0
    losses = [
        [
            json.loads(line)["loss"]
            for line in (tmp_path / run / "arms" / "procs" / "metrics.jsonl").read_text().splitlines()
        ]
        for run in ("base", "scaled")
    ]
    assert losses[0][0] != losses[1][0]


def test_a_bad_model_override_exits_2_with_one_line_naming_it(harness_main, tmp_path: Path) -> None:
    run = harness_main("run", FIXTURE / "suite.toml", "--set", "model.n_group=3", "--out", tmp_path / "run")
    assert run.returncode == 2
    assert run.stderr == "error: --set model.n_group: n_group 3 does not divide the 8 routed experts\n"
    assert not (tmp_path / "run").exists()


def test_missing_suite_names_the_path() -> None:
    with pytest.raises(SuiteError, match=r"no-such-suite\.toml: no such suite file \(suites: .*logical-ranks"):
        load_suite("no-such-suite")
