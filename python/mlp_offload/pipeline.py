"""The update phase's I/O schedule: subgroups in alternating order, the last ones kept in host memory,
reads ahead and writes behind within a fixed number of host buffers.

Each subgroup's optimizer state is one object in the store. With `buffers` host buffers of the largest
subgroup's size, `buffers - PIPELINE_BUFFERS` subgroups stay cached between steps: the ones updated last
in a step are first in the next (the order alternates), so they skip one read and one write. The rest is
read ahead of its update, as far as free buffers allow, and written back behind it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mlp_offload import _core
from mlp_offload.buffers import PinnedBufferPool, as_tensor
from mlp_offload.store import ObjectStore

# One buffer being read ahead, one being updated, one being written behind.
PIPELINE_BUFFERS = 3


@dataclass
class StepStats:
    """What one update phase did."""

    step: int
    seconds: float
    reads: int
    writes: int
    cached: int
    bytes_read: int
    bytes_written: int
    # Seconds spent waiting for reads, and for writes to free a buffer or to finish at the end.
    read_wait_seconds: float = 0.0
    write_wait_seconds: float = 0.0
    # Per path: bytes and busy seconds, in all and per direction (what `WeightTuner.observe` takes).
    per_path: list[dict[str, float]] = field(default_factory=list)


def step_order(step: int, subgroups: int) -> list[int]:
    """Ascending on even steps, descending on odd ones: the last of one step are the first of the next."""
    order = list(range(subgroups))
    return order if step % 2 == 0 else order[::-1]


class SubgroupPipeline:
    """Drives one update phase per `run_step` over subgroup objects `{prefix}{i}` in `store`.

    `sizes` are the subgroups' state sizes in bytes; `buffers` is how many host buffers of the largest
    size the budget allows (at least 1). `cache_subgroups` (default: `buffers - PIPELINE_BUFFERS`, at
    least 0) of them hold subgroups across steps; at least one buffer must stay for the rest.
    `lock` page-locks the buffers (and registers them with CUDA when it is there).
    """

    def __init__(
        self,
        store: ObjectStore,
        sizes: Sequence[int],
        buffers: int,
        *,
        cache_subgroups: int | None = None,
        prefix: str = "sg",
        lock: bool = False,
    ) -> None:
        if not sizes:
            raise ValueError("sizes: there are no subgroups")
        if buffers < 1:
            raise ValueError(f"buffers: {buffers} host buffers; the pipeline needs at least 1")
        n = len(sizes)
        cache = max(0, buffers - PIPELINE_BUFFERS) if cache_subgroups is None else cache_subgroups
        cache = min(cache, n)
        if n > cache > buffers - 1:
            raise ValueError(
                f"cache_subgroups: {cache} cached subgroups leave none of the {buffers} buffers "
                "for the others"
            )
        self.store = store
        self.sizes = list(sizes)
        self.prefix = prefix
        self.cache_slots = cache
        self.buffer_count = min(buffers, n + PIPELINE_BUFFERS)
        self._pool = PinnedBufferPool(self.buffer_count, max(self.sizes), lock=lock)
        self._free: list[_core.HostBuffer] = []
        while (b := self._pool.acquire()) is not None:
            self._free.append(b)
        # Subgroup -> buffer holding its current state; not yet written back.
        self._resident: dict[int, _core.HostBuffer] = {}
        self._step = 0

    def key(self, index: int) -> str:
        return f"{self.prefix}{index}"

    def view(self, index: int, buffer: _core.HostBuffer) -> torch.Tensor:
        return as_tensor(buffer)[: self.sizes[index]]

    def initialize(self, fill: Callable[[int, torch.Tensor], None]) -> None:
        """Creates every subgroup's object from `fill(index, view)`."""
        buffer = self._free[0]
        for i in range(len(self.sizes)):
            view = self.view(i, buffer)
            fill(i, view)
            self.store.write(self.key(i), view).wait()

    @property
    def resident(self) -> list[int]:
        return sorted(self._resident)

    def resident_view(self, index: int) -> torch.Tensor | None:
        """The state of a cached subgroup (newer than the store's), or None when it is not cached."""
        buffer = self._resident.get(index)
        return None if buffer is None else self.view(index, buffer)

    def _take_buffer(self) -> _core.HostBuffer | None:
        if self._free:
            return self._free.pop()
        # A step that failed dropped its buffers; they came back to the pool when their last user went.
        return self._pool.acquire()

    def run_step(self, update: Callable[[int, torch.Tensor], None]) -> StepStats:
        """One update phase: `update(index, view)` changes each subgroup's state in place."""
        n = len(self.sizes)
        order = step_order(self._step, n)
        keep = set(order[n - self.cache_slots :]) if self.cache_slots else set()
        to_read = deque(i for i in order if i not in self._resident)
        reading: dict[int, tuple[_core.HostBuffer, _core.IoHandle]] = {}
        writing: deque[tuple[_core.HostBuffer, _core.IoHandle]] = deque()
        stats = StepStats(self._step, 0.0, 0, 0, 0, 0, 0)
        before = [r["stats"] for r in self.store.path_reports()]
        start = time.perf_counter()

        def reclaim(block: bool) -> None:
            while writing and (block or writing[0][1].done()):
                buffer, handle = writing.popleft()
                t = time.perf_counter()
                handle.wait()
                stats.write_wait_seconds += time.perf_counter() - t
                self._free.append(buffer)
                block = False

        def read_ahead() -> None:
            reclaim(block=False)
            while to_read and (buffer := self._take_buffer()) is not None:
                i = to_read.popleft()
                reading[i] = (buffer, self.store.read(self.key(i), self.view(i, buffer)))
                stats.reads += 1
                stats.bytes_read += self.sizes[i]

        for i in order:
            read_ahead()
            if i in self._resident:
                buffer = self._resident.pop(i)
                stats.cached += 1
            else:
                while i not in reading:
                    # Every buffer is held by a write in flight: the oldest frees one. (Reads go out in
                    # order and at least PIPELINE_BUFFERS buffers are never cached, so one is in flight.)
                    if not writing:
                        raise RuntimeError(f"subgroup {i}: no buffer to read into and no write to wait for")
                    reclaim(block=True)
                    read_ahead()
                buffer, handle = reading.pop(i)
                t = time.perf_counter()
                handle.wait()
                stats.read_wait_seconds += time.perf_counter() - t
            update(i, self.view(i, buffer))
            if i in keep:
                self._resident[i] = buffer
            else:
                writing.append((buffer, self.store.write(self.key(i), self.view(i, buffer))))
                stats.writes += 1
                stats.bytes_written += self.sizes[i]
        while writing:
            reclaim(block=True)
        stats.seconds = time.perf_counter() - start
        after = [r["stats"] for r in self.store.path_reports()]
        for b, a in zip(before, after, strict=True):
            stats.per_path.append(
                {
                    "read_bytes": a["bytes_read"] - b["bytes_read"],
                    "read_busy_secs": (a["read_busy_ns"] - b["read_busy_ns"]) / 1e9,
                    "write_bytes": a["bytes_written"] - b["bytes_written"],
                    "write_busy_secs": (a["write_busy_ns"] - b["write_busy_ns"]) / 1e9,
                    "busy_secs": (a["busy_ns"] - b["busy_ns"]) / 1e9,
                }
            )
        self._step += 1
        return stats

    def flush(self) -> None:
        """Writes the cached subgroups back, so the store alone holds the current state."""
        handles = [(i, b, self.store.write(self.key(i), self.view(i, b))) for i, b in self._resident.items()]
        for i, b, h in handles:
            h.wait()
            self._free.append(b)
            del self._resident[i]

    def close(self) -> None:
        """Gives the buffers back (and their CUDA registration); cached state not flushed is lost."""
        self._resident.clear()
        self._free.clear()
        self._pool.close()
