"""Logical EP ranks hosted by threads in one or more processes.

An EP degree ``E`` runs in ``P`` processes (``P`` divides ``E``); process ``p`` hosts logical
ranks ``[p*E/P, (p+1)*E/P)``, one thread each. A collective first meets the local threads
(:class:`_Rendezvous`); the last thread to arrive then runs the process-level
``torch.distributed`` collective, if there is more than one process, for all of them.

Results never depend on the layout: the exchanges move data without arithmetic, and every
reduction is done after an all-gather, in logical-rank order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist


class GroupAborted(RuntimeError):
    """Raised in every waiting thread when another logical rank of the process failed."""


class _Rendezvous:
    """Each local rank deposits one item per call; the last arrival computes everybody's result."""

    def __init__(self, ranks: list[int]) -> None:
        self._ranks = ranks
        self._cv = threading.Condition()
        self._calls = {r: 0 for r in ranks}
        self._slots: dict[int, dict[str, Any]] = {}
        self._error: BaseException | None = None

    def meet(self, rank: int, item: Any, combine: Callable[[dict[int, Any]], dict[int, Any]]) -> Any:
        with self._cv:
            call = self._calls[rank]
            self._calls[rank] += 1
            slot = self._slots.setdefault(call, {"items": {}, "results": None, "taken": 0})
            slot["items"][rank] = item
            if len(slot["items"]) == len(self._ranks):
                try:
                    slot["results"] = combine(slot["items"])
                except BaseException as exc:
                    self._error = exc
                    self._cv.notify_all()
                    raise
                self._cv.notify_all()
            while slot["results"] is None:
                if self._error is not None:
                    raise GroupAborted(f"logical rank {rank}: a peer thread failed: {self._error!r}")
                self._cv.wait()
            slot["taken"] += 1
            if slot["taken"] == len(self._ranks):
                del self._slots[call]
            return slot["results"][rank]

    def abort(self, error: BaseException) -> None:
        with self._cv:
            self._error = error
            self._cv.notify_all()


@dataclass
class PendingExchange:
    """An all-to-all in flight; ``wait`` completes it once, whichever local rank asks first."""

    finish: Callable[[], None] | None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait(self) -> None:
        with self.lock:
            if self.finish is not None:
                self.finish()
                self.finish = None


class LogicalGroup:
    """The EP group as seen by one process: ``ep`` logical ranks, some of them local."""

    def __init__(self, ep: int) -> None:
        self.ep = ep
        self.distributed = dist.is_available() and dist.is_initialized()
        self.processes = dist.get_world_size() if self.distributed else 1
        self.process_rank = dist.get_rank() if self.distributed else 0
        if ep % self.processes:
            raise ValueError(f"{self.processes} processes cannot host EP degree {ep}: it must divide {ep}")
        self.per_process = ep // self.processes
        start = self.process_rank * self.per_process
        self.local_ranks = list(range(start, start + self.per_process))
        self._rendezvous = _Rendezvous(self.local_ranks)

    def abort(self, error: BaseException) -> None:
        self._rendezvous.abort(error)

    def _ranks_of(self, process: int) -> range:
        return range(process * self.per_process, (process + 1) * self.per_process)

    def all_to_all(
        self, rank: int, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], out: torch.Tensor
    ) -> PendingExchange:
        """Start sending ``send`` rows ``send_splits[d]`` to logical rank ``d``; land them in ``out``.

        ``out`` receives rows from logical ranks 0..E-1 in order, ``recv_splits[s]`` from ``s``.
        """
        item = (send, send_splits, recv_splits, out)
        return self._rendezvous.meet(rank, item, self._start_all_to_all)

    def _start_all_to_all(self, items: dict[int, tuple]) -> dict[int, PendingExchange]:
        pieces = {s: dict(zip(range(self.ep), send.split(splits))) for s, (send, splits, _, _) in items.items()}
        if not self.distributed or self.processes == 1:
            for d, (_, _, recv_splits, out) in items.items():
                torch.cat([pieces[s][d] for s in range(self.ep)], out=out[: sum(recv_splits)])
            done = PendingExchange(finish=None)
            return {r: done for r in items}

        # Process-level exchange: to process q go, in order, (local src s, dst d in q) pieces.
        local = self.local_ranks
        any_send = next(iter(items.values()))[0]
        send_parts = [pieces[s][d] for q in range(self.processes) for s in local for d in self._ranks_of(q)]
        staging_in = torch.cat(send_parts) if send_parts else any_send.new_empty((0, *any_send.shape[1:]))
        in_splits = [
            sum(pieces[s][d].shape[0] for s in local for d in self._ranks_of(q)) for q in range(self.processes)
        ]
        # From process q come (src s in q, local dst d) pieces, sized by the receivers' counts.
        recv_rows = {(s, d): items[d][2][s] for d in local for s in range(self.ep)}
        out_splits = [sum(recv_rows[(s, d)] for s in self._ranks_of(q) for d in local) for q in range(self.processes)]
        staging_out = any_send.new_empty((sum(out_splits), *any_send.shape[1:]))
        work = dist.all_to_all_single(staging_out, staging_in.contiguous(), out_splits, in_splits, async_op=True)

        def finish() -> None:
            work.wait()
            order = [(s, d) for q in range(self.processes) for s in self._ranks_of(q) for d in local]
            landed = dict(zip(order, staging_out.split([recv_rows[k] for k in order])))
            for d in local:
                out = items[d][3]
                rows = sum(items[d][2])
                torch.cat([landed[(s, d)] for s in range(self.ep)], out=out[:rows])

        pending = PendingExchange(finish=finish)
        return {r: pending for r in items}

    def all_gather(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every logical rank's ``tensor``, in logical-rank order (treat as read-only)."""
        return self._rendezvous.meet(rank, tensor, self._gather)

    def sum(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every logical rank's ``tensor`` in logical-rank order (the same bits whatever the
        layout), computed once per process and shared by its logical ranks (treat as read-only): each
        summing the gathered tensors itself would cost EP times the work and the memory."""
        return self._rendezvous.meet(rank, tensor, self._sum)

    def _sum(self, items: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        gathered = self._gather(items)[next(iter(items))]
        total = torch.stack(gathered).sum(0)
        return {r: total for r in items}

    def _gather(self, items: dict[int, torch.Tensor]) -> dict[int, list[torch.Tensor]]:
        stacked = torch.stack([items[r] for r in self.local_ranks])
        if self.distributed and self.processes > 1:
            parts = [torch.empty_like(stacked) for _ in range(self.processes)]
            dist.all_gather(parts, stacked.contiguous())
            stacked = torch.cat(parts)
        gathered = list(stacked.unbind(0))
        return {r: gathered for r in items}
