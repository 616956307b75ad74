"""Trace a whole train step (forward, loss, backward) into one FX graph with ``make_fx``.

The graph takes ``(params, buffers, *batch)`` and returns ``(loss, grads)``; backward is traced
through ``torch.autograd.grad``, with no AOTAutograd partitioning, so forward and backward live in
one graph that a pass can chunk region by region.

Graph chunking needs two things from the trace:

* **A chunk symbol.** One dim of the batch (batch or sequence) is traced as a fresh symbolic size,
  and every other dim of every input is static, so duck sizing cannot unify the symbol with an
  unrelated dim that happens to be equal (heads, local experts, ...). Sizes derived from it appear
  in the graph as ``sym_size`` and integer arithmetic nodes, so a chunk's shapes follow the chunk.
* **Module ownership of backward nodes.** ``make_fx(record_module_stack=True)`` records
  ``nn_module_stack`` on forward nodes only. Autograd hooks on the forward's grad_fns (the ones
  AOTAutograd installs) stamp every backward node with its grad_fn's ``seq_nr``;
  :func:`inherit_forward_metadata` then copies the module stack and ``custom`` annotations of the
  forward node with that ``seq_nr``. Gradient-accumulation adds have no grad_fn of their own; they
  belong to the innermost module that holds all their terms, so a region's sums stay in the region.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, Sequence

import sympy
import torch
import torch.fx.config as fx_config
import torch.fx.traceback as fx_traceback
from torch import fx, nn
from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

LossFn = Callable[..., torch.Tensor]  # (model, *batch) -> scalar loss


@dataclass
class TracedStep:
    """A traced train step: ``gm(params, buffers, *batch) -> (loss, [grad per param])``."""

    gm: fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]
    symbol: sympy.Symbol | None  # the size of the chunk dim; None for a static trace
    chunk_dim: int | None
    size: int | None  # the chunk dim's size in the traced batch
    guards: list[sympy.Expr]  # what the trace assumed about the symbol


class _ScopeRoot:
    """The callable make_fx traces; ``_orig_mod`` makes it record module fqns relative to the model."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, loss_divisor: float) -> None:
        self._orig_mod = model
        self.loss_fn, self.loss_divisor = loss_fn, loss_divisor
        self.param_names = [n for n, _ in model.named_parameters()]
        self.buffer_names = [n for n, _ in model.named_buffers()]

    def __call__(self, params: list[torch.Tensor], buffers: list[torch.Tensor], *batch: torch.Tensor):
        state = {**dict(zip(self.param_names, params)), **dict(zip(self.buffer_names, buffers))}
        loss = self.loss_fn(_Functional(self._orig_mod, state), *batch)
        scaled = loss / self.loss_divisor
        setup_stacktrace_preservation_hooks([scaled.grad_fn])
        grads = torch.autograd.grad(scaled, params)
        return loss.detach(), list(grads)


class _Functional:
    """Calls the model with ``state`` swapped in, so that parameters are graph inputs."""

    def __init__(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.model, self.state = model, state

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.model, self.state, args)


def trace_train_step(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    loss_fn: LossFn,
    *,
    loss_divisor: float = 1.0,
    chunk_dim: int | None = None,
) -> TracedStep:
    """Trace forward, ``loss_fn`` and backward of ``model`` on fake copies of ``batch``.

    ``chunk_dim`` names the dim of every batch tensor that becomes the chunk symbol; None traces
    static shapes (enough for code that already chunks itself).
    """
    shape_env = ShapeEnv() if chunk_dim is not None else None
    fake_mode = FakeTensorMode(shape_env=shape_env, static_shapes=chunk_dim is None)
    root = _ScopeRoot(model, loss_fn, loss_divisor)
    params = [fake_mode.from_tensor(p, static_shapes=True) for p in model.parameters()]
    buffers = [fake_mode.from_tensor(b, static_shapes=True) for b in model.buffers()]
    fake_batch = [_fake_input(fake_mode, t, chunk_dim) for t in batch]
    with fx_traceback.preserve_node_meta(), _without_stack_traces():
        gm = make_fx(root, tracing_mode="fake" if chunk_dim is None else "symbolic", record_module_stack=True)(
            params, buffers, *fake_batch
        )
    inherit_forward_metadata(gm)
    if chunk_dim is None:
        return TracedStep(gm, root.param_names, root.buffer_names, None, None, None, [])
    size = fake_batch[0].shape[chunk_dim]
    if not isinstance(size, torch.SymInt) or not isinstance(size.node.expr, sympy.Symbol):
        raise RuntimeError(f"the chunk dim {chunk_dim} was specialised during tracing: {size}")
    symbol = size.node.expr
    guards = [g.expr for g in shape_env.guards if symbol in g.expr.free_symbols]
    return TracedStep(gm, root.param_names, root.buffer_names, symbol, chunk_dim, batch[0].shape[chunk_dim], guards)


@contextlib.contextmanager
def _without_stack_traces() -> Iterator[None]:
    """FX's module-stack tracer captures and symbolizes the Python stack of every node it creates,
    about a tenth of a symbolic trace; nothing here reads ``stack_trace`` (the gradient-accumulation
    marker comes from the autograd hooks' own stacks), and the graph is the same without it."""
    saved = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = saved


def _fake_input(fake_mode: FakeTensorMode, tensor: torch.Tensor, chunk_dim: int | None) -> torch.Tensor:
    """A fake copy of a batch tensor; only ``chunk_dim`` symbolic, shared by all batch tensors (duck)."""
    tensor = tensor.clone()  # a view would drag its base's sizes in as extra symbols
    if chunk_dim is None:
        return fake_mode.from_tensor(tensor, static_shapes=True)
    dims = [DimDynamic.DUCK if d == chunk_dim else DimDynamic.STATIC for d in range(tensor.dim())]
    return fake_mode.from_tensor(tensor, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))


def check_chunkable(traced: TracedStep, chunks: int) -> None:
    """Raise unless the traced graph also holds for one of ``chunks`` equal chunks.

    The graph was traced at the full size; a guard the trace recorded on the symbol (say, that it
    exceeds 2) might not hold for a chunk, and then the chunk's shapes would silently be wrong.
    """
    if traced.symbol is None or traced.size is None:
        raise ValueError("the step was traced without a chunk symbol")
    if traced.size % chunks:
        raise ValueError(f"chunk dim of size {traced.size} does not split into {chunks} chunks")
    broken = [g for g in traced.guards if not bool(g.subs(traced.symbol, traced.size // chunks))]
    if broken:
        raise ValueError(
            f"the trace assumed {broken} about the chunk size, which a chunk of {traced.size // chunks} breaks"
        )


def node_fqn(node: fx.Node) -> str:
    """The innermost module that produced ``node`` (its forward's, for backward nodes); "" if none."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def is_backward(node: fx.Node) -> bool:
    return bool(node.meta.get("autograd_backward", False))


def inherit_forward_metadata(gm: fx.GraphModule) -> None:
    """Give backward nodes the module stack and ``custom`` annotations of their forward node."""
    forward_of: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and not is_backward(node) and "seq_nr" in node.meta:
            forward_of.setdefault(node.meta["seq_nr"], node)  # the first node with it made the grad_fn
    for node in gm.graph.nodes:
        if not is_backward(node):
            continue
        if node.meta.get("is_gradient_acc"):
            node.meta.update(_accumulation_metadata(node))
        elif (source := forward_of.get(node.meta.get("seq_nr"))) is not None:
            node.meta["nn_module_stack"] = dict(source.meta.get("nn_module_stack") or {})
            if "custom" in source.meta:
                node.meta["custom"] = dict(source.meta["custom"])


def _accumulation_metadata(node: fx.Node) -> dict:
    """A gradient sum belongs to the innermost module holding all its terms, and to their chunk if shared.

    The terms are the gradients of one forward value's uses, so that module is where the value was
    used: the sum of a router's and the shared experts' input gradients stays in the MoE layer.
    """
    inputs = [n for n in node.all_input_nodes if n.op == "call_function"]
    if not inputs:
        return {}
    stacks = [list((n.meta.get("nn_module_stack") or {}).items()) for n in inputs]
    meta: dict = {"nn_module_stack": dict(os.path.commonprefix(stacks))}
    customs = {tuple(sorted((n.meta.get("custom") or {}).items())) for n in inputs}
    if len(customs) == 1 and (custom := customs.pop()):
        meta["custom"] = dict(custom)
    return meta
