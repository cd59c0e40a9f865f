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
    # Subgroups whose buffer still held their state from the end of the last step (no read).
    retained: int = 0
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
        # Subgroup -> (buffer, its write-back, maybe still in flight) from the end of the last step.
        self._retained: dict[int, tuple[_core.HostBuffer, _core.IoHandle]] = {}
        self._step = 0
        self._snapshot = [r["stats"] for r in store.path_reports()]

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
        """Subgroups cached in host memory, not written back since their last update."""
        return sorted(self._resident)

    @property
    def retained(self) -> list[int]:
        """Subgroups written back at the end of the last step whose buffers still hold their state."""
        return sorted(self._retained)

    def in_memory(self, index: int) -> tuple[torch.Tensor, str] | None:
        """The host copy of a subgroup's current state and what it is (`"resident"`: newer than the
        store's; `"retained"`: the same as the store's once its write completes, which this waits for),
        or None when the store alone has it."""
        if (buffer := self._resident.get(index)) is not None:
            return self.view(index, buffer), "resident"
        if (entry := self._retained.get(index)) is not None:
            entry[1].wait()
            return self.view(index, entry[0]), "retained"
        return None

    def rewrite(self, index: int) -> None:
        """Writes a retained subgroup's buffer again (after someone changed it in place)."""
        buffer, handle = self._retained[index]
        handle.wait()
        new = self.store.write(self.key(index), self.view(index, buffer))
        new.wait()
        self._retained[index] = (buffer, new)

    def _take_buffer(self) -> _core.HostBuffer | None:
        if self._free:
            return self._free.pop()
        # A step that failed dropped its buffers; they came back to the pool when their last user went.
        return self._pool.acquire()

    def run_step(self, update: Callable[[int, torch.Tensor], None], *, drain: bool = True) -> StepStats:
        """One update phase: `update(index, view)` changes each subgroup's state in place.

        With `drain=False` the step returns while its last writes are still in flight: they go on while
        forward and backward run, and their buffers keep the state, so the next step (whose order starts
        where this one ended) uses them without reading them back.
        """
        n = len(self.sizes)
        order = step_order(self._step, n)
        keep = set(order[n - self.cache_slots :]) if self.cache_slots else set()
        retained, self._retained = self._retained, {}
        to_read = deque(i for i in order if i not in self._resident and i not in retained)
        reading: dict[int, tuple[_core.HostBuffer, _core.IoHandle]] = {}
        writing: deque[tuple[int, _core.HostBuffer, _core.IoHandle]] = deque()
        stats = StepStats(self._step, 0.0, 0, 0, 0, 0, 0)
        start = time.perf_counter()

        def reclaim(block: bool) -> bool:
            """Frees the buffer of the oldest write if it is done (or, with `block`, once it is)."""
            if not writing or not (block or writing[0][2].done()):
                return False
            _, buffer, handle = writing.popleft()
            t = time.perf_counter()
            handle.wait()
            stats.write_wait_seconds += time.perf_counter() - t
            self._free.append(buffer)
            return True

        def read_ahead() -> None:
            while to_read:
                buffer = self._take_buffer()
                if buffer is None:
                    if not reclaim(block=False):
                        return
                    continue
                i = to_read.popleft()
                reading[i] = (buffer, self.store.read(self.key(i), self.view(i, buffer)))
                stats.reads += 1
                stats.bytes_read += self.sizes[i]

        for i in order:
            read_ahead()
            if i in self._resident:
                buffer = self._resident.pop(i)
                stats.cached += 1
            elif i in retained:
                # Its write from the last step reads this buffer: let it finish before changing it.
                buffer, handle = retained.pop(i)
                t = time.perf_counter()
                handle.wait()
                stats.write_wait_seconds += time.perf_counter() - t
                stats.retained += 1
            else:
                while i not in reading:
                    # Every buffer is held by a write in flight: the oldest frees one. (Reads go out in
                    # order and cached or retained subgroups come first, so a write is in flight.)
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
                writing.append((i, buffer, self.store.write(self.key(i), self.view(i, buffer))))
                stats.writes += 1
                stats.bytes_written += self.sizes[i]
        if drain:
            while reclaim(block=True):
                pass
        self._retained = {i: (buffer, handle) for i, buffer, handle in writing}
        stats.seconds = time.perf_counter() - start
        # Since the end of the last step: writes that ran on during forward and backward count here.
        before, after = self._snapshot, [r["stats"] for r in self.store.path_reports()]
        self._snapshot = after
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
        """Writes the cached subgroups back and waits for every write, so the store alone holds the
        current state."""
        for buffer, handle in self._retained.values():
            handle.wait()
            self._free.append(buffer)
        self._retained.clear()
        handles = [(i, b, self.store.write(self.key(i), self.view(i, b))) for i, b in self._resident.items()]
        for i, b, h in handles:
            h.wait()
            self._free.append(b)
            del self._resident[i]

    def close(self) -> None:
        """Gives the buffers back (and their CUDA registration); cached state not flushed is lost."""
        for _, handle in self._retained.values():
            handle.wait()
        self._retained.clear()
        self._resident.clear()
        self._free.clear()
        self._pool.close()
