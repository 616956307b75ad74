"""Token exchange state of one logical EP rank: receive buffer sets, exchanges in flight, events.

The custom ops in :mod:`harness.reference.ep.ops` carry only tensors and ints, so they find the
exchange of the logical rank that runs them through a thread-local binding (:func:`bind`). Their
backward finds it on the autograd graph instead (saved by the forward): autograd may run a
backward on a thread of its own, which has no binding (on CUDA, its per-device worker thread).

Buffer sets behave like MinimalAsyncEP's symmetric-memory buffers: an exchange lands in the
receive pool of its ``buffer_set`` and a wait reads that pool. Two exchanges in flight on one
set therefore corrupt each other's data. Nothing here guards against it: the harness checks it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch
from torch.fx.node import has_side_effect

from harness.reference.ep.group import LogicalGroup, PendingExchange

EventSink = Callable[[int, dict], None]

# Which receive pool each launch op writes: dispatch-like exchanges carry tokens to experts.
POOL_OF = {"dispatch": "dispatch", "dispatch_data": "dispatch", "combine": "combine", "combine_data": "combine"}

_local = threading.local()


def bound_exchange() -> "TokenExchange | None":
    """The exchange bound to this thread, or None (tracing with fake tensors binds none)."""
    return getattr(_local, "exchange", None)


def current_exchange() -> "TokenExchange":
    exchange = bound_exchange()
    if exchange is None:
        raise RuntimeError("no token exchange bound to this thread; run the model under ep.exchange.bind()")
    return exchange


def current_region() -> dict:
    """Where the running op sits: ``{"phase", "layer", "chunk"}``; saved by autograd for backward."""
    return dict(getattr(_local, "region", {"phase": "fwd", "layer": -1, "chunk": 0}))


@contextlib.contextmanager
def region(**fields: object) -> Iterator[None]:
    previous = current_region()
    _local.region = {**previous, **fields}
    try:
        yield
    finally:
        _local.region = previous


def set_region(phase: str, layer: int, chunk: int) -> None:
    """Set where the next exchange ops sit. Graphs call this before each op: they have no ``with``."""
    _local.region = {"phase": phase, "layer": layer, "chunk": chunk}


has_side_effect(set_region)


@contextlib.contextmanager
def bind(exchange: "TokenExchange") -> Iterator[None]:
    previous = getattr(_local, "exchange", None)
    _local.exchange = exchange
    try:
        yield
    finally:
        _local.exchange = previous


class TokenExchange:
    """One logical rank's end of the EP token exchange."""

    def __init__(
        self,
        group: LogicalGroup,
        rank: int,
        *,
        hidden: int,
        capacity: int,
        num_buffer_sets: int,
        dtype: torch.dtype,
        device: torch.device,
        event_sink: EventSink | None = None,
    ) -> None:
        self.group, self.rank = group, rank
        self.num_buffer_sets = num_buffer_sets
        # Preallocated receive pools, one per (pool, buffer set); rows are tokens, never resized.
        self.pools = {
            (pool, b): torch.empty((capacity, hidden), dtype=dtype, device=device)
            for pool in ("dispatch", "combine")
            for b in range(num_buffer_sets)
        }
        self._in_flight: dict[tuple[str, int], PendingExchange] = {}
        self.event_sink = event_sink
        self.step = 0
        self._seq = 0

    def _emit(self, op_name: str, op: str, buffer_set: int, rows: int, **counts: list[int]) -> None:
        """Records one event; a launch adds its rows per destination rank sent and per source rank received."""
        if self.event_sink is None:
            return
        where = current_region()
        event = {
            "step": self.step,
            "phase": where["phase"],
            "layer": where["layer"],
            "chunk": where["chunk"],
            "kind": POOL_OF[op_name],
            "op": op,
            "name": op_name,
            "buffer_set": buffer_set,
            "seq": self._seq,
            "rows": rows,
            **counts,
        }
        self._seq += 1
        self.event_sink(self.rank, event)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Per-expert counts [E, local experts] out; the same for this rank's experts in. Blocking."""
        received = torch.empty_like(counts)
        ones = [1] * self.group.ep
        self.group.all_to_all(self.rank, counts.contiguous(), ones, ones, received).wait()
        return received

    def launch(
        self,
        op_name: str,
        x: torch.Tensor,
        send_counts: torch.Tensor,
        recv_counts: torch.Tensor,
        recv_rows: int,
        buffer_set: int,
    ) -> torch.Tensor:
        if not 0 <= buffer_set < self.num_buffer_sets:
            raise ValueError(f"buffer_set {buffer_set} outside the {self.num_buffer_sets} preallocated sets")
        key = (POOL_OF[op_name], buffer_set)
        pool = self.pools[key]
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = sum(recv)
        if rows != recv_rows:
            raise RuntimeError(f"{op_name}: the counts say {rows} rows arrive, the caller expects {recv_rows}")
        if rows > pool.shape[0]:
            raise RuntimeError(f"{op_name}: {rows} rows exceed the receive pool capacity {pool.shape[0]}")
        earlier = self._in_flight.get(key)
        if earlier is not None:
            earlier.wait()  # writes to one pool land in launch order: a reuse overwrites, predictably
        self._in_flight[key] = self.group.all_to_all(self.rank, x.contiguous(), send, recv, pool)
        self._emit(op_name, "launch", buffer_set, rows, send_counts=send, recv_counts=recv)
        return x.new_empty((rows, x.shape[-1]))

    def wait(self, op_name: str, pending: torch.Tensor, buffer_set: int) -> torch.Tensor:
        key = (POOL_OF[op_name], buffer_set)
        exchange = self._in_flight.pop(key, None)
        if exchange is not None:
            exchange.wait()
        self._emit(op_name, "wait", buffer_set, pending.shape[0])
        return self.pools[key][: pending.shape[0]].clone()
