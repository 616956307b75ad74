"""The traced train step of the graph arms: trace, chunk, set buffer sets, schedule, check, mark regions.

This is where the generic passes of :mod:`~harness.reference.chunking.graph` meet this reference's
MinimalAsyncEP-style ops: which nodes are launches and waits, what each MoE layer must exchange,
and how a running exchange op learns its (phase, layer, chunk) for its events.

Two arms build a :class:`GraphStep`:

* ``"graph"``: the *unchunked* model traced with a symbolic chunk dim, then the chunk pass, the
  buffer-set pass and the scheduler;
* ``"eager-traced"``: the eagerly chunked model (already tagged with chunk metadata) traced with
  static shapes, then the same scheduler.

Both get the same static checks, and export their scheduled exchange ops as plain data for checks
outside the reference. A fault, for proving the checks catch real bugs, breaks one step
of the ``"graph"`` arm. A pass that rejects the graph is reported as a failed check, and the graph
runs without that pass, so the run shows its consequences as well.

The work splits where the trace cache (:mod:`~harness.reference.chunking.trace_cache`) stores it:
:func:`schedule_graph` runs the passes that need the trace's fake values and yields a
:class:`ScheduledGraph`; :func:`finish_graph_step` runs the rest, the checks and the export, on a
graph fresh from the trace or loaded from the cache alike.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
from torch import fx, nn
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch.fx.passes.regional_inductor import regional_inductor

from harness.reference.chunking import FAULTS
from harness.reference.chunking.checks import (
    GraphCheck,
    check_buffer_sets,
    check_chunk_order,
    check_exchange_counts,
    check_launch_wait_pairs,
    export_exchange_graph,
)
from harness.reference.chunking.graph import (
    ChunkingError,
    ExchangeMarkers,
    assign_buffer_sets,
    chunk_regions,
    match_root,
    owner_of,
    schedule_regions,
)
from harness.reference.chunking.schedule import EPScheduler
from harness.reference.chunking.trace import (
    LossFn,
    TracedStep,
    check_chunkable,
    is_backward,
    node_fqn,
    trace_train_step,
)
from harness.reference.chunking.trace_cache import CacheSlot
from harness.reference.ep import ops
from harness.reference.ep.exchange import POOL_OF, region, set_region
from harness.reference.model import MoE

ROOT_PATTERNS = {"moe": "model.layers.*.mlp", "block": "model.layers.*"}

MARKERS = ExchangeMarkers(
    is_launch=lambda n: n.op == "call_function" and n.target in ops.LAUNCH_OVERLOADS,
    is_wait=lambda n: n.op == "call_function" and n.target in ops.WAIT_OVERLOADS,
    pool=lambda n: POOL_OF[n.target._opname.removeprefix("wait_")],
)
# What one MoE layer exchanges per chunk: backward reverses each forward exchange (no recompute).
EXPECTED_PER_LAYER = {
    "fwd": Counter(dispatch=1, wait_dispatch=1, combine=1, wait_combine=1),
    "bwd": Counter(dispatch_data=1, wait_dispatch_data=1, combine_data=1, wait_combine_data=1),
}


@dataclass
class GraphStep:
    """One traced train step, ready to run: ``step(params, buffers, *batch) -> (loss, grads)``.

    ``build`` says where the graph came from and what each stage cost: ``origin`` (``"trace"`` or
    ``"cache"``), ``cache`` (``"off"``, ``"hit"``, ``"miss"`` or why an entry was unusable), ``entry``
    (the cache entry's path, with a cache) and ``seconds`` per stage (trace and passes, or load; then
    finish: the last passes and the checks).
    """

    gm: fx.GraphModule
    checks: list[GraphCheck] = field(default_factory=list)
    exported: dict = field(default_factory=dict)  # the exchange ops as plain data (export_exchange_graph)
    boxed: bool = False  # regional Inductor leaves a graph that takes one flat list and returns a flat tuple
    build: dict = field(default_factory=dict)

    def __call__(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], *batch: torch.Tensor):
        # Graph inputs must have the strides they were traced with; region() restores the
        # thread's exchange region after the graph's set_region calls.
        batch = tuple(t.contiguous() for t in batch)
        with torch.no_grad(), region():
            if not self.boxed:
                return self.gm(list(params), list(buffers), *batch)
            loss, *grads = self.gm([*params, *buffers, *batch])
            return loss, grads


@dataclass(frozen=True)
class GraphPasses:
    """What the passes make of a traced step; ``fault`` breaks one of them on purpose (FAULTS)."""

    chunks: int
    chunk_roots: str = "moe"
    num_buffer_sets: int = 2
    fault: str = "none"
    inductor_pattern: str | None = None  # modules compiled with regional Inductor, after the checks' passes

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {self.fault!r}")


@dataclass
class ScheduledGraph:
    """A traced step after the chunk, buffer-set and scheduler passes, with those passes' own checks:
    what the trace cache stores (no fake values, no callables outside torch)."""

    gm: fx.GraphModule
    pass_checks: list[GraphCheck]


def build_graph_step(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    loss_fn: LossFn,
    passes: GraphPasses,
    *,
    mode: str,
    chunk_dim: int = 0,
    loss_divisor: float = 1.0,
    cache: CacheSlot | None = None,
) -> GraphStep:
    """Trace ``model``'s train step on ``batch``'s shapes and turn it into the ``mode`` arm's graph.

    For ``"eager-traced"``, ``model`` must already be eagerly chunked the same way. With ``cache``,
    the scheduled graph is loaded from it when present and stored in it when traced; either way
    the finishing passes and every static check run on it (:func:`finish_graph_step`). An entry that
    holds anything but a :class:`ScheduledGraph` is a miss. A graph compiled with regional Inductor
    is never cached: Inductor needs the trace's fake values.
    """
    if mode not in ("graph", "eager-traced"):
        raise ValueError(f"mode must be 'graph' or 'eager-traced', got {mode!r}")
    if passes.inductor_pattern is not None:
        cache = None
    build: dict = {"cache": "off" if cache is None else "miss", "seconds": {}}
    began = time.perf_counter()
    scheduled = cache.load(ScheduledGraph) if cache is not None else None
    if scheduled is not None:
        build["origin"], build["seconds"]["load"] = "cache", time.perf_counter() - began
    else:
        symbolic = chunk_dim if mode == "graph" else None
        traced = trace_train_step(model, batch, loss_fn, loss_divisor=loss_divisor, chunk_dim=symbolic)
        traced_at = time.perf_counter()
        scheduled = schedule_graph(traced, model, passes)
        if cache is not None:
            cache.store(scheduled)
        build["origin"] = "trace"
        build["seconds"].update(trace=traced_at - began, passes=time.perf_counter() - traced_at)
    if cache is not None:
        build.update(cache=cache.status, entry=str(cache.path))
    finishing = time.perf_counter()
    step = finish_graph_step(scheduled, model, passes)
    build["seconds"]["finish"] = time.perf_counter() - finishing
    step.build = build
    return step


def compile_graph_step(traced: TracedStep, model: nn.Module, passes: GraphPasses) -> GraphStep:
    """Run every pass on a traced step, in place: the graph arm's if it has a chunk symbol, else eager-traced's."""
    return finish_graph_step(schedule_graph(traced, model, passes), model, passes)


def schedule_graph(traced: TracedStep, model: nn.Module, passes: GraphPasses) -> ScheduledGraph:
    """The passes that need the trace's fake values: chunking and buffer sets (a graph with a chunk
    symbol only), then the scheduler. Everything they decide is in the graph and its metadata."""
    gm = traced.gm
    fault = passes.fault
    checks: list[GraphCheck] = []
    if traced.symbol is not None:
        check_chunkable(traced, passes.chunks)
        unchunked = check_exchange_counts(gm, MARKERS, chunks=None, **_counts(model, passes))
        checks.append(replace(unchunked, name="graph:unchunked-exchange-counts"))
        chunk_regions(
            gm,
            symbol=traced.symbol,
            chunks=passes.chunks,
            root_pattern=ROOT_PATTERNS[passes.chunk_roots],
            is_launch=MARKERS.is_launch,
            backward=fault != "clone-forward-only",
        )
        checks.append(_buffer_set_pass(gm, passes.num_buffer_sets, skip=fault == "skip-buffer-pass"))
    elif fault != "none":
        raise ValueError(f"fault {fault!r} breaks a graph-chunking pass: it needs a graph traced with a chunk symbol")
    scheduler = EPScheduler(passes.num_buffer_sets, reverse_backward=fault != "forward-order-backward")
    schedule_regions(gm, scheduler, MARKERS)
    return ScheduledGraph(gm, checks)


def finish_graph_step(scheduled: ScheduledGraph, model: nn.Module, passes: GraphPasses) -> GraphStep:
    """The passes after scheduling, then the static checks and the export; the same for a fresh and a
    cached graph.

    ``inductor_pattern`` names modules (say ``model.layers.*.self_attn``) whose nodes, forward and
    backward, are compiled with Inductor; everything else runs op by op.
    """
    gm = scheduled.gm
    if passes.fault == "drop-wait":
        drop_first_wait(gm)
    mark_exchange_regions(gm, lambda fqn: moe_layer(model, fqn))
    if passes.inductor_pattern is not None:
        gm = compile_regions(gm, passes.inductor_pattern)
    counts = _counts(model, passes)
    checks = [
        *scheduled.pass_checks,
        check_exchange_counts(gm, MARKERS, chunks=passes.chunks, **counts),
        check_launch_wait_pairs(gm, MARKERS),
        check_buffer_sets(gm, MARKERS, passes.num_buffer_sets),
        check_chunk_order(gm, MARKERS),
    ]
    exported = export_exchange_graph(gm, MARKERS, counts["root_pattern"])
    return GraphStep(gm, checks, exported, boxed=passes.inductor_pattern is not None)


def _counts(model: nn.Module, passes: GraphPasses) -> dict:
    """What check_exchange_counts expects: each matched root exchanges EXPECTED_PER_LAYER."""
    pattern = ROOT_PATTERNS[passes.chunk_roots]
    roots = [r for r in (match_root(f, pattern) for f in moe_fqns(model)) if r]
    return dict(root_pattern=pattern, roots=roots, expected=EXPECTED_PER_LAYER)


def moe_fqns(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, MoE)]


def moe_layer(model: nn.Module, fqn: str) -> int:
    """The layer id of the MoE at or under ``fqn`` (eager block chunking runs MoE stages from the block)."""
    return next(m for m in model.get_submodule(fqn).modules() if isinstance(m, MoE)).layer_id


def _buffer_set_pass(gm: fx.GraphModule, num_buffer_sets: int, *, skip: bool) -> GraphCheck:
    name = "graph:buffer-set-pass"
    if skip:
        return GraphCheck(name, "skip", "buffer-set pass skipped (fault injection)")
    try:
        count = assign_buffer_sets(gm, num_buffer_sets)
    except ChunkingError as error:
        return GraphCheck(name, "fail", str(error), [str(error)])
    return GraphCheck(name, "pass", f"{count} buffer_set arguments set from chunk ids")


def drop_first_wait(gm: fx.GraphModule) -> None:
    """Fault injection: the first wait's users read its launch's placeholder, never the landed rows."""
    wait = next(n for n in gm.graph.nodes if MARKERS.is_wait(n))
    wait.replace_all_uses_with(wait.args[0])
    gm.graph.erase_node(wait)
    gm.recompile()


def compile_regions(gm: fx.GraphModule, pattern: str) -> fx.GraphModule:
    """Regional Inductor: compile the nodes of the modules matching ``pattern``, one region per module and direction."""
    marked = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and (root := match_root(node_fqn(node), pattern)):
            if owner_of(node) is not None:
                raise ChunkingError(
                    f"{node.name} of {root} is in a chunk body: compile regions outside the chunked ones"
                )
            region_id = f"{root} {'bwd' if is_backward(node) else 'fwd'}"
            node.meta["custom"] = {
                **(node.meta.get("custom") or {}),
                "compile_with_inductor": {"inductor_region": region_id},
            }
            marked += 1
    if not marked:
        raise ChunkingError(f"no nodes of modules matching {pattern!r} to compile")
    placeholders = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    with tracing(TracingContext(detect_fake_mode(placeholders))):
        return regional_inductor(gm)


def mark_exchange_regions(gm: fx.GraphModule, layer_of: Callable[[str], int]) -> None:
    """Before every exchange op, set the (phase, layer, chunk) its events report, from node metadata."""
    for node in list(gm.graph.nodes):
        if MARKERS.is_launch(node) or MARKERS.is_wait(node):
            owner = owner_of(node)
            where = ("bwd" if is_backward(node) else "fwd", layer_of(node_fqn(node)), owner.chunk if owner else 0)
            with gm.graph.inserting_before(node):
                gm.graph.call_function(set_region, where)
    gm.recompile()
