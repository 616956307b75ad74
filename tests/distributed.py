"""Run a function on real gloo ranks in fresh processes and collect what each rank returns; and
the token exchange a test needs to run a reference model's forward.

Tests start ranks through the ``run_on_ranks`` fixture (conftest.py), which marks them ``e2e``;
:func:`start_ranks` refuses to start any for a test that did not ask for it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.reference.ep.exchange import TokenExchange
from harness.reference.ep.group import LogicalGroup
from harness.reference.model import DeepseekV3Config


def _rank_main(rank: int, world: int, store_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        result = fn(*args)
        torch.save(result, os.path.join(store_dir, f"result{rank}.pt"))
    finally:
        dist.destroy_process_group()


# Set by the run_on_ranks fixture for the test that asked for it.
FIXTURE_ASKED = False


def start_ranks(world: int, fn: Callable, *args: Any) -> list[Any]:
    """``fn(*args)`` on ``world`` gloo ranks; returns the per-rank results in rank order."""
    if not FIXTURE_ASKED:
        raise RuntimeError("a test starts rank processes through the run_on_ranks fixture, which marks it e2e")
    with tempfile.TemporaryDirectory() as store_dir:
        mp.start_processes(_rank_main, args=(world, store_dir, fn, args), nprocs=world, start_method="spawn")
        return [torch.load(Path(store_dir) / f"result{r}.pt") for r in range(world)]


def cpu_exchange(group: LogicalGroup, rank: int, cfg: DeepseekV3Config, tokens: int) -> TokenExchange:
    """Logical rank ``rank``'s token exchange on CPU, in fp32, with room for ``tokens`` tokens each
    routed to ``cfg.num_experts_per_tok`` experts."""
    return TokenExchange(
        group,
        rank,
        hidden=cfg.hidden_size,
        capacity=tokens * cfg.num_experts_per_tok,
        num_buffer_sets=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
