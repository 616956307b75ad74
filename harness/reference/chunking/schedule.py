"""The EP overlap scheduler shared by eager and graph chunking.

Both chunking paths describe a chunked region the same way: per chunk, an ordered list of stage
kinds, each ``"launch"``, ``"wait"`` or ``"compute"``. The scheduler returns one interleaving:

* chunks are visited in order 0..C-1 in forward and C-1..0 in backward;
* a chunk's k-th wait is held back until the next chunk has issued its k-th launch, so the next
  chunk's exchange is in flight while this chunk computes (launches first, compute as filler);
* buffer reuse: a chunk's first launch waits until the previous chunk on the same buffer set
  (``chunk - num_buffer_sets``) has issued its last launch (its combine). With one buffer set
  nothing can overlap, and chunks simply run one after another.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EPScheduler:
    num_buffer_sets: int = 2

    def buffer_set(self, chunk: int) -> int:
        return chunk % self.num_buffer_sets

    def order(self, kinds_per_chunk: list[list[str]], backward: bool = False) -> list[tuple[int, int]]:
        """Return ``(chunk, stage index)`` pairs covering every stage exactly once."""
        num_chunks = len(kinds_per_chunk)
        visit = list(range(num_chunks))[::-1] if backward else list(range(num_chunks))
        cursor = [0] * num_chunks
        launched = [0] * num_chunks
        total_launches = [kinds.count("launch") for kinds in kinds_per_chunk]
        waited = [0] * num_chunks
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

        while len(schedule) < sum(map(len, kinds_per_chunk)):
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
