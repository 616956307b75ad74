"""A traced step recorded op by op (harness/op_divergence/record.py): a subject that traces inside its
first step, as torchtitan's GraphTrainer does, traces with the recorder paused, then runs the graph
node by node through it (harness/subject/titan_trainer.py's ``record_ops``)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from harness.op_divergence import OpRecorder


def _step() -> tuple:
    """A forward, a loss and its gradients by autograd.grad, as a traced training step holds them."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    params = list(model.parameters())

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(model(x).sum(), params)

    return step, torch.randn(2, 4, generator=torch.Generator().manual_seed(0))


def test_a_trace_inside_a_recording_is_paused_and_only_the_graph_run_is_recorded() -> None:
    step, x = _step()
    recorder = OpRecorder()
    with recorder:
        with recorder.paused():
            gm = make_fx(step)(x)
        recorder.step = 1
        grads = recorder.interpret(gm)(x)
    assert [g.shape for g in grads] == [torch.Size([4, 4]), torch.Size([4])]
    assert recorder.records and {r.step for r in recorder.records} == {1}  # none of the trace's fake ops
    assert {"aten.addmm.default", "aten.mm.default"} <= {r.op for r in recorder.records}
    assert all(None not in r.hashes for r in recorder.records if r.op == "aten.mm.default")


def test_without_the_pause_the_trace_meets_the_recorder_and_fails() -> None:
    step, x = _step()
    with pytest.raises(RuntimeError), OpRecorder():
        make_fx(step)(x)
