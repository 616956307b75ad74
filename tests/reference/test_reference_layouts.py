"""Bitwise independence of the reference's numerics from the process layout of the EP group."""

from __future__ import annotations

import threading

import pytest
import torch

from harness.reference.chunking.trace_cache import GraphCache
from harness.reference.train import TrainConfig, Trainer, accelerator_identity


def trajectory(config: TrainConfig, steps: int) -> dict:
    """Losses, grad norms and every gradient of every logical rank hosted here, per step."""
    grads: dict = {}
    trainer = Trainer(
        config, grad_sink=lambda rank, step, g: grads.__setitem__((rank, step), {n: t.clone() for n, t in g.items()})
    )
    records = [trainer.step(s) for s in range(steps)]
    trainer.close()
    return {"metrics": [(r["loss"], r["grad_norm"]) for r in records], "grads": grads}


def merged(results: list[dict]) -> dict:
    out = {"metrics": results[0]["metrics"], "grads": {}}
    for r in results:
        assert r["metrics"] == out["metrics"], "processes disagree on the global loss"
        out["grads"].update(r["grads"])
    return out


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a["metrics"] == b["metrics"]
    assert a["grads"].keys() == b["grads"].keys()
    for key, grads in a["grads"].items():
        for name, g in grads.items():
            assert torch.equal(g, b["grads"][key][name]), f"gradient {name} of logical rank/step {key} differs"
    # Not vacuous: the gradients are real and the steps move the loss.
    some = next(iter(a["grads"].values()))
    assert all(g.abs().sum() > 0 for g in some.values())
    assert len({m[0] for m in a["metrics"]}) == len(a["metrics"])


@pytest.mark.parametrize("ep,layouts", [(2, (2, 1)), (4, (4, 2, 1))])
def test_loss_and_every_gradient_bitwise_equal_across_layouts(run_on_ranks, ep: int, layouts: tuple[int, ...]) -> None:
    config = TrainConfig(ep=ep, chunking="eager", chunks=2)
    runs = {}
    for processes in layouts:
        if processes == 1:
            runs[processes] = trajectory(config, 3)
        else:
            runs[processes] = merged(run_on_ranks(processes, trajectory, config, 3))
    reference = runs[layouts[0]]
    assert len(reference["grads"]) == ep * 3
    for processes in layouts[1:]:
        assert_bitwise_equal(reference, runs[processes])


def test_cli_prints_identical_output_for_two_and_one_process(run_reference) -> None:
    two, one = (run_reference("--ep", 2, "--ranks", ranks, "--steps", 5) for ranks in (2, 1))
    assert len(one.splitlines()) == 5
    assert two == one


def test_a_logical_ranks_pool_thread_drives_its_processes_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new thread's current GPU is cuda:0: without selecting it, the logical ranks of a process with
    LOCAL_RANK 1 would allocate on another process's GPU. Shown on CPU through the selection call."""
    trainer = Trainer(TrainConfig(ep=2))  # two logical ranks: two pool threads
    selected: list[tuple[int, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: selected.append((threading.get_ident(), d)))
    trainer.device = torch.device("cuda", 1)
    trainer._on_every_rank(lambda rank: (0.0, 0.0))
    assert sorted(d.index for _, d in selected) == [1, 1]
    assert threading.get_ident() not in dict(selected)  # on the pool's threads, each time a rank starts
    trainer.close()


def test_the_trace_cache_key_names_the_gpu_model_and_its_compute_capability(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """The attention backend is fixed into a traced graph: a graph traced on one GPU model must not be
    loaded on another at the same device index."""
    gpus = {"H200": (9, 0), "A100": (8, 0)}
    identities = {}
    for name, capability in gpus.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: f"NVIDIA {name}")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        identities[name] = accelerator_identity(torch.device("cuda", 0))
    assert identities["H200"] == {"name": "NVIDIA H200", "capability": [9, 0]}
    cache = GraphCache(tmp_path)
    slots = {name: cache.slot(device="cuda:0", accelerator=identity).path for name, identity in identities.items()}
    assert slots["H200"] != slots["A100"]
    assert accelerator_identity(torch.device("cpu")) is None
