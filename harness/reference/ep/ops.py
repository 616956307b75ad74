"""MinimalAsyncEP-style token exchange as separate launch and wait custom ops.

Launch ops (``dispatch``, ``dispatch_data``, ``combine``, ``combine_data``) start an exchange into
the receive pool of ``buffer_set`` and return a placeholder of ``recv_rows`` rows; its
contents mean nothing until the matching wait op (``wait_<launch>``) returns the landed rows.
The placeholder carries the data dependency and the gradient from wait back to launch.

Autograd: the backward of ``dispatch`` is a ``combine_data`` plus its wait, the backward of
``combine`` a ``dispatch_data`` plus its wait, on the same buffer set. Waits pass gradients
through. All ops are registered as side-effecting, so FX dead-code elimination keeps them.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.fx.node import has_side_effect

from harness.reference.ep.exchange import bind, bound_exchange, current_exchange, current_region, region

NAMESPACE = "harness_ep"
LAUNCH_OPS = ("dispatch", "dispatch_data", "combine", "combine_data")
# The reverse exchange that carries a launch's gradient back.
REVERSE = {"dispatch": "combine_data", "combine": "dispatch_data"}


def _define_launch(name: str):
    @torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())
    def launch(x: Tensor, send_counts: Tensor, recv_counts: Tensor, recv_rows: int, buffer_set: int = 0) -> Tensor:
        return current_exchange().launch(name, x, send_counts, recv_counts, recv_rows, buffer_set)

    @launch.register_fake
    def _(x: Tensor, send_counts: Tensor, recv_counts: Tensor, recv_rows: int, buffer_set: int = 0) -> Tensor:
        return x.new_empty((recv_rows, x.shape[-1]))

    return launch


def _define_wait(name: str):
    @torch.library.custom_op(f"{NAMESPACE}::wait_{name}", mutates_args=())
    def wait(pending: Tensor, buffer_set: int = 0) -> Tensor:
        return current_exchange().wait(name, pending, buffer_set)

    @wait.register_fake
    def _(pending: Tensor, buffer_set: int = 0) -> Tensor:
        return torch.empty_like(pending)

    return wait


_launch = {name: _define_launch(name) for name in LAUNCH_OPS}
_wait = {name: _define_wait(name) for name in LAUNCH_OPS}


@torch.library.custom_op(f"{NAMESPACE}::exchange_counts", mutates_args=())
def exchange_counts(counts: Tensor) -> Tensor:
    """Per-expert token counts [EP, local experts] out, the counts for this rank's experts in.

    Blocking, and deliberately not a token-exchange marker: it sizes the exchange, moves no tokens.
    """
    return current_exchange().exchange_counts(counts)


@exchange_counts.register_fake
def _(counts: Tensor) -> Tensor:
    return torch.empty_like(counts)


def _save_launch_context(ctx, inputs, output) -> None:
    x, ctx.send_counts, ctx.recv_counts, _, ctx.buffer_set = inputs
    ctx.send_rows = x.shape[0]
    ctx.region = current_region()
    # The exchange travels with the graph, not with the thread: the backward may run elsewhere.
    ctx.exchange = bound_exchange()


def _reverse_backward(name: str):
    reverse = REVERSE[name]

    def backward(ctx, grad: Tensor):
        binding = bind(ctx.exchange) if ctx.exchange is not None else contextlib.nullcontext()
        with binding, region(**{**ctx.region, "phase": "bwd"}):
            pending = _launch[reverse](
                grad.contiguous(), ctx.recv_counts, ctx.send_counts, ctx.send_rows, ctx.buffer_set
            )
            return _wait[reverse](pending, ctx.buffer_set), None, None, None, None

    return backward


def _wait_backward(ctx, grad: Tensor):
    return grad, None


for _name in REVERSE:
    _launch[_name].register_autograd(_reverse_backward(_name), setup_context=_save_launch_context)
    _wait[_name].register_autograd(_wait_backward)


def _overload(name: str) -> torch._ops.OpOverload:
    return getattr(getattr(torch.ops, NAMESPACE), name).default


LAUNCH_OVERLOADS = frozenset(_overload(n) for n in LAUNCH_OPS)
WAIT_OVERLOADS = frozenset(_overload(f"wait_{n}") for n in LAUNCH_OPS)
for _target in LAUNCH_OVERLOADS | WAIT_OVERLOADS:
    has_side_effect(_target)

dispatch = _launch["dispatch"]
combine = _launch["combine"]
wait_dispatch = _wait["dispatch"]
wait_combine = _wait["combine"]
