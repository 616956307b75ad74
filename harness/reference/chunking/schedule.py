"""The EP overlap scheduler shared by eager and graph chunking.

Both chunking paths hand it the same description of one region and direction: a sequence of
items (eager stages or graph nodes), each with its :class:`Owner` (root fqn, forward or backward,
chunk id) and kind (``"launch"``, ``"wait"`` or ``"compute"``), in each chunk's own order. The
scheduler returns one interleaving:

* chunks are visited in order 0..C-1 in forward and C-1..0 in backward;
* a chunk's k-th wait is held back until the next chunk has issued its k-th launch, so the next
  chunk's exchange is in flight while this chunk computes (launches first, compute as filler);
* buffer reuse: a chunk's first launch waits until the previous chunk on the same buffer set
  (``chunk - num_buffer_sets``) has issued its last launch (its combine). With one buffer set
  nothing can overlap, and chunks simply run one after another.

Compute never blocks, so the order of launches and waits depends only on each chunk's sequence
of launches and waits, not on how finely its compute is cut into items.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

KINDS = ("launch", "wait", "compute")


@dataclass(frozen=True)
class Owner:
    """Who a stage or graph node belongs to: one chunk of one direction of one chunked region."""

    root: str
    backward: bool
    chunk: int


@dataclass(frozen=True)
class EPScheduler:
    num_buffer_sets: int = 2
    reverse_backward: bool = True  # False only to inject the bug of running backward chunks in forward order

    def buffer_set(self, chunk: int) -> int:
        return chunk % self.num_buffer_sets

    def order_owned(self, items: Sequence[tuple[Owner, str]]) -> list[int]:
        """Order the items of one region and direction; returns indices into ``items``."""
        if len({(owner.root, owner.backward) for owner, _ in items}) != 1:
            raise ValueError("order_owned takes the items of exactly one region and direction")
        chunks = sorted({owner.chunk for owner, _ in items})
        if chunks != list(range(len(chunks))):
            raise ValueError(f"chunk ids must be 0..C-1, got {chunks}")
        per_chunk: list[list[int]] = [[] for _ in chunks]
        for index, (owner, kind) in enumerate(items):
            if kind not in KINDS:
                raise ValueError(f"unknown item kind {kind!r}")
            per_chunk[owner.chunk].append(index)
        kinds = [[items[i][1] for i in indices] for indices in per_chunk]
        backward = items[0][0].backward
        return [per_chunk[chunk][pos] for chunk, pos in self.order(kinds, backward=backward)]

    def order(self, kinds_per_chunk: list[list[str]], backward: bool = False) -> list[tuple[int, int]]:
        """Return ``(chunk, stage index)`` pairs covering every stage exactly once."""
        num_chunks = len(kinds_per_chunk)
        visit = list(range(num_chunks))
        if backward and self.reverse_backward:
            visit.reverse()
        cursor = [0] * num_chunks
        launched = [0] * num_chunks
        total_launches = [kinds.count("launch") for kinds in kinds_per_chunk]
        waited = [0] * num_chunks
        total = sum(map(len, kinds_per_chunk))
        schedule: list[tuple[int, int]] = []

        def ready(pos: int) -> bool:
            chunk = visit[pos]
            kind = kinds_per_chunk[chunk][cursor[chunk]]
            if kind == "wait" and pos + 1 < num_chunks and self.num_buffer_sets > 1:
                return launched[visit[pos + 1]] > waited[chunk]
            if kind == "launch" and launched[chunk] == 0 and pos >= self.num_buffer_sets:
                previous = visit[pos - self.num_buffer_sets]
                return launched[previous] == total_launches[previous]
            return True

        while len(schedule) < total:
            for pos, chunk in enumerate(visit):
                if cursor[chunk] < len(kinds_per_chunk[chunk]) and ready(pos):
                    kind = kinds_per_chunk[chunk][cursor[chunk]]
                    launched[chunk] += kind == "launch"
                    waited[chunk] += kind == "wait"
                    schedule.append((chunk, cursor[chunk]))
                    cursor[chunk] += 1
                    break
            else:
                raise RuntimeError(f"EP schedule deadlocked at cursors {cursor}")
        return schedule
