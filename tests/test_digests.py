"""Digests and first-divergence localisation: on real tensors, then on hand-made digest records."""

from __future__ import annotations

import torch

from harness.digests import digest_all, first_divergence, parameters_hash
from harness.records import DigestLine

NAMES = ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight")


def _step(step: int, grads: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> DigestLine:
    return DigestLine(step, digest_all(grads), digest_all(params))


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(4, 3, generator=gen) for name in NAMES}


def _digest(t: torch.Tensor) -> list:
    return digest_all({"t": t})["t"]


def test_a_digest_is_a_bit_exact_hash_plus_max_abs_and_l2_in_fp64() -> None:
    t = torch.tensor([3.0, -4.0])
    digest = _digest(t)
    assert digest[1:] == [4.0, 5.0]
    assert _digest(t.clone())[0] == digest[0]
    assert _digest(torch.tensor([3.0, -4.0 + 2**-20]))[0] != digest[0]
    assert _digest(torch.tensor([0.0]))[0] != _digest(torch.tensor([-0.0]))[0]


def test_each_tensor_is_digested_on_its_own_whatever_its_neighbours() -> None:
    tensors = {"a": torch.randn(3, 2), "empty": torch.empty(0), "b": torch.randn(5), "c": torch.tensor([-7.0])}
    together = digest_all(tensors)
    assert list(together) == list(tensors)
    assert together == {name: _digest(t) for name, t in tensors.items()}
    assert together["empty"][1:] == [0.0, 0.0] and together["c"][1:] == [7.0, 7.0]


def test_the_parameters_hash_covers_every_tensor_in_order() -> None:
    a, b = torch.ones(2), torch.zeros(2)
    assert parameters_hash([a, b]) == parameters_hash([a.clone(), b.clone()])
    assert parameters_hash([a, b]) != parameters_hash([b, a])


def test_the_first_gradient_to_differ_is_named_in_backward_order() -> None:
    grads, params = _tensors(), _tensors(1)
    bad = {**grads, NAMES[1]: grads[NAMES[1]] * 1.001, NAMES[0]: grads[NAMES[0]] * 1.1}
    a = [_step(1, grads, params), _step(2, bad, params)]
    b = [_step(1, grads, params), _step(2, grads, params)]
    found = first_divergence(a, b, "bugged", "clean")
    # lm_head (last registered, first in backward) agrees; the MLP's down_proj is the first to differ.
    assert found["step"] == 2 and found["tensor"] == "gradient" and found["parameter"] == NAMES[1]
    assert abs(found["max_rel_diff"] - 1e-3) < 1e-6
    assert found["summary"].startswith(f"step 2: first gradient to differ is {NAMES[1]} (max abs ")


def test_parameters_that_differ_under_identical_gradients_point_at_the_optimizer() -> None:
    grads, params = _tensors(), _tensors(1)
    moved = {**params, NAMES[2]: params[NAMES[2]] + 1}
    found = first_divergence([_step(1, grads, moved)], [_step(1, grads, params)], "a", "b")
    assert found["tensor"] == "parameter" and found["parameter"] == NAMES[2]
    assert "gradients identical; first parameter to differ after the optimizer step" in found["summary"]


def test_nothing_to_localise_is_said_not_invented() -> None:
    same = [_step(1, _tensors(), _tensors(1))]
    assert "step" not in first_divergence(same, same, "a", "b")
    absent = first_divergence([], same, "a", "b")
    assert absent == {"summary": "no gradient digests recorded in arm 'a'"}


EXPERT_GRADIENT_BUG = """
import os

import torch
import torch.nn.functional as F

from harness.reference.model import GroupedExperts


class _ScaledGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight):
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.001  # the weight gradient of down_proj only: the input gradient is untouched


def forward(self, x, rows_per_expert):
    down_proj = _ScaledGradient.apply(self.down_proj)
    outs = []
    for e, part in enumerate(x.split(rows_per_expert)):
        gate, up = F.linear(part, self.gate_up_proj[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, down_proj[e]))
    return torch.cat(outs)


if os.environ.get("WORLD_SIZE") == "1":  # the inproc arm only
    GroupedExperts.forward = forward
"""


def test_a_failed_exact_check_names_the_module_whose_gradient_differs_first(run_harness, plant, tmp_path) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "logical-ranks", "--steps", 2, "--out", out, env=plant(EXPERT_GRADIENT_BUG))
    assert run.returncode == 1, run.stdout + run.stderr
    check = run.check(out, "procs vs inproc: grad_norm")
    assert check["status"] == "fail" and check["first_divergent_step"] == 1
    where = check["extra"]["first_gradient_divergence"]
    # Backward order starts at lm_head: the last MoE layer's experts are the first bugged module it meets.
    assert (where["step"], where["tensor"], where["parameter"]) == (
        1,
        "gradient",
        "model.layers.2.mlp.experts.down_proj",
    )
    assert abs(where["max_rel_diff"] - 1e-3) < 1e-5
    assert where["summary"] in check["detail"]
    assert where["summary"] in (out / "report.html").read_text()
