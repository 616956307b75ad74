"""The torchtitan subject trains with torchtitan's own Trainer (harness/subject/titan_trainer.py): a
``raise`` planted in torchtitan's loss, its gradient clipping or its MoE load-balancing optimizer hook,
in a copy of the installed package imported ahead of it, fails ``torchtitan-determinism`` (exit 1,
the rank's error naming the planted frame). In the model mode (``trainer = "model"``), the harness's
loop around torchtitan's model, the planted loss is never called: the run passes, which is why the
trainer mode exists.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
from pathlib import Path

import pytest

from harness.verdict import EXIT_FAIL, EXIT_PASS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed: pip install -c constraints.txt 'harness[torchtitan]'",
)

# Where each planted raise goes: a file of the package, and the function whose body it opens.
PLANTS = {
    "loss": ("components/loss.py", "cross_entropy_loss"),
    "clipping": ("distributed/utils.py", "clip_grad_norm_"),
    "load-balancing hook": ("components/optimizer/optimizer.py", "_update_expert_bias"),
}
ONE_STEP = ("--steps", 1, "--golden", "off", "--first-op", "off")


def plant_raise(path: Path, function: str) -> str:
    """``raise RuntimeError`` as the first statement of ``function`` (nested or not) in ``path``;
    returns the message it raises."""
    text = path.read_text()
    found = [node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.FunctionDef) and node.name == function]
    assert len(found) == 1, f"{path}: {len(found)} functions named {function}"
    first = found[0].body[0]
    lines = text.splitlines(keepends=True)
    indent = " " * first.col_offset
    message = f"planted in torchtitan's {function}"
    lines.insert(first.lineno - 1, f'{indent}raise RuntimeError("{message}")\n')
    path.write_text("".join(lines))
    return message


@pytest.fixture
def planted_titan(tmp_path: Path):
    """A copy of the installed torchtitan with one function raising, first on the ranks' path."""
    installed = Path(importlib.util.find_spec("torchtitan").submodule_search_locations[0])

    def plant(what: str) -> tuple[dict[str, object], str]:
        copy = tmp_path / "site"
        shutil.copytree(installed, copy / "torchtitan", ignore=shutil.ignore_patterns("__pycache__"))
        file, function = PLANTS[what]
        return {"PYTHONPATH": str(copy)}, plant_raise(copy / "torchtitan" / file, function)

    return plant


@pytest.mark.parametrize("what", sorted(PLANTS))
def test_a_raise_planted_in_torchtitans_trainer_path_fails_the_suite(
    run_harness, planted_titan, tmp_path: Path, what: str
) -> None:
    env, message = planted_titan(what)
    result = run_harness("run", "torchtitan-determinism", *ONE_STEP, "--out", tmp_path / "run", env=env, process=True)
    assert result.returncode == EXIT_FAIL, result.stdout + result.stderr
    assert message in result.stdout + result.stderr


def test_the_model_mode_never_calls_torchtitans_loss(run_harness, planted_titan, tmp_path: Path) -> None:
    env, message = planted_titan("loss")
    model_mode = ("--set", "trainer=model")
    result = run_harness(
        "run", "torchtitan-determinism", *ONE_STEP, *model_mode, "--out", tmp_path / "run", env=env, process=True
    )
    assert result.returncode == EXIT_PASS, result.stdout + result.stderr
    assert message not in result.stdout + result.stderr
