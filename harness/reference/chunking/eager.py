"""Eager chunking: run a region's body once per chunk, interleaved by the EP scheduler.

The roots are the MoE layers (``"moe"``) or whole transformer blocks (``"block"``). Their forward is
replaced, on the instance, by one that splits the input along the batch or sequence dim into one
chunk record each (:class:`~harness.reference.model.MoEChunk` or ``BlockChunk``), runs the stages of
every chunk in the scheduler's order, each under its chunk metadata (``chunk_id``, region fqn, role
``"body"``) and on buffer set ``chunk_id % num_buffer_sets``, and joins the chunk outputs with
``cat``. Parameter names do not change.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from harness.reference.chunking.schedule import EPScheduler, Owner
from harness.reference.ep.exchange import region
from harness.reference.model import BlockChunk, DeepseekV3ForCausalLM, MoE, MoEChunk, Stage

Chunk = MoEChunk | BlockChunk

SPLIT_DIMS = {"batch": 0, "seq": 1}


def chunk_metadata(chunk: int, fqn: str) -> dict:
    """The metadata contract shared with graph chunking; it lands in FX ``node.meta["custom"]``."""
    return {"chunk_id": chunk, "region": fqn, "role": "body"}


def _annotate(metadata: dict) -> contextlib.AbstractContextManager:
    """Annotate only while this thread traces (its proxy mode) and the tracer records node metadata.

    The annotation state is process-global, not per thread: logical ranks that run eagerly in
    threads would race on it and leave stale chunk metadata for the next trace. Preserving node
    metadata is process-global too: while one logical rank's thread compiles its attention
    (``compile_attention``), another rank's eager chunks must not annotate.
    """
    tracing = get_proxy_mode() is not None and fx_traceback.has_preserved_node_meta()
    return fx_traceback.annotate(metadata) if tracing else contextlib.nullcontext()


def run_chunked(
    stages: list[Stage],
    new_chunk: Callable[[torch.Tensor, int], Chunk],
    fqn: str,
    layer: int,
    x: torch.Tensor,
    chunks: int,
    dim: int,
    scheduler: EPScheduler,
) -> torch.Tensor:
    """Run ``stages`` on every chunk of ``x``, each chunk's record made by ``new_chunk(part, buffer_set)``."""
    if x.shape[dim] % chunks:
        raise ValueError(f"{fqn}: dim {dim} of size {x.shape[dim]} does not split into {chunks} chunks")
    records = [new_chunk(part, scheduler.buffer_set(c)) for c, part in enumerate(x.chunk(chunks, dim))]
    items = [(Owner(fqn, False, chunk), stage.kind) for chunk in range(chunks) for stage in stages]
    for index in scheduler.order_owned(items):
        chunk, stage = divmod(index, len(stages))
        with region(layer=layer, chunk=chunk), _annotate(chunk_metadata(chunk, fqn)):
            stages[stage].run(records[chunk])
    return torch.cat([record.out_BSD for record in records], dim)


def apply_eager_chunking(
    model: DeepseekV3ForCausalLM, *, chunks: int, roots: str = "moe", split: str = "batch", scheduler: EPScheduler
) -> list[str]:
    """Chunk every MoE region of ``model`` in place; return the fqns of the chunked roots."""
    if roots not in ("moe", "block"):
        raise ValueError(f"chunk roots must be 'moe' or 'block', got {roots!r}")
    if roots == "block" and split != "batch":
        raise ValueError("whole blocks can only be chunked along the batch: attention needs the full sequence")
    dim = SPLIT_DIMS[split]
    chunked = []
    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer.mlp, MoE):
            continue
        root = layer.mlp if roots == "moe" else layer
        fqn = f"model.layers.{i}" + (".mlp" if roots == "moe" else "")
        new_chunk = MoEChunk if roots == "moe" else BlockChunk

        # ``rope`` is what a block's forward takes after ``x``, and its stages need; an MoE takes none.
        def forward(x: torch.Tensor, *rope, root=root, fqn=fqn, new_chunk=new_chunk, layer_id=i) -> torch.Tensor:
            return run_chunked(root.stages(*rope), new_chunk, fqn, layer_id, x, chunks, dim, scheduler)

        root.forward = forward
        chunked.append(fqn)
    return chunked
