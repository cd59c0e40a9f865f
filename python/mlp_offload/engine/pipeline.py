"""The update phase's I/O schedule: chunks of state streamed through one pool of host buffers.

The unit of I/O, host memory and compute is a chunk, one object in the store (the engine makes each a
slice of one subgroup's elements). One pool of equal buffers serves everything: `cache_slots` of them
(by default all) keep the chunks they hold when a step ends (resident). The next step updates those
first, with no read, and writes each only when its buffer is wanted for a chunk still to be read, so a
step reads and writes the same number of chunks: the state's bytes less the pool's. The rest stream
through the freed buffers, read ahead of their update and written behind it, so the paths have reads
and writes in flight at once.

The order of a step follows from the end of the one before:
1. the chunks whose buffers still hold them from the last write-back (retained: no read);
2. the resident ones, while the first reads and the retained chunks' writes run;
3. the rest, most recently written first.
The last `cache_slots` chunks of a step stay resident. With fewer cache slots than buffers (a number of
`cache_chunks`), the other buffers' writes are still in flight when the step ends and keep their
buffers (retained), and the initial writes leave the same. Either way, when forward and backward begin,
every buffer holds a chunk the next step takes first.

With the update overlapped with the next forward or with backward (`ascending`, from the start or from
`go_ascending` on), every step goes in chunk order, the order in which the forward needs the parameters:
the first `cache_slots` chunks stay resident and come first with no read, and the rest stream through the
other buffers, which the writes still in flight from the step before free as they complete. That cache
leaves the stream its buffers: with every buffer as cache, up to `memory.PIPELINE_BUFFERS` chunks fewer stay.
`go_latest_first` goes back to the order above, with its cache.

A part of a step may be staged (the update during backward, undone if the step's outcome is another):
a streamed chunk's new version goes to disk beside its old one; a cached chunk is updated in its buffer,
its state before copied by the pass into a kept copy of its own (`kept_copies` of them at most, made the
first time they are wanted, given back when the plan wants fewer), which `discard` copies back.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mlp_offload import _core
from mlp_offload.engine.buffers import PinnedBufferPool, as_tensor
from mlp_offload.engine.memory import cache_in_chunk_order, stream_buffers
from mlp_offload.engine.store import ObjectStore

# Boundaries in a row that want fewer kept copies than are held before the idle ones go back.
KEPT_IDLE_BOUNDARIES = 4

__all__ = ["ChunkPipeline", "DeferredUpdate", "KeptCopy", "StepStats", "next_order"]


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
    # Chunks whose buffer still held their state from the end of the last step (no read).
    retained: int = 0
    # Seconds spent waiting for reads, and for writes to free a buffer or to finish at the end.
    read_wait_seconds: float = 0.0
    write_wait_seconds: float = 0.0
    # Per path: bytes and busy seconds, in all and per direction (what `WeightTuner.observe` takes).
    per_path: list[dict[str, float]] = field(default_factory=list)
    # Chunks written as staged versions (`run_step(staged=True)`), in order.
    staged: list[int] = field(default_factory=list)
    # Of `reads`, those read ahead of a part that ended before their chunks (`ready` said never): the
    # part that updates them reads them again.
    reads_dropped: int = 0

    def add(self, other: StepStats) -> StepStats:
        """This part of a step and `other`, the next part, as one step (this one's number)."""
        out = StepStats(self.step, self.seconds + other.seconds, 0, 0, 0, 0, 0)
        for name in ("reads", "writes", "cached", "bytes_read", "bytes_written", "retained", "reads_dropped"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.read_wait_seconds = self.read_wait_seconds + other.read_wait_seconds
        out.write_wait_seconds = self.write_wait_seconds + other.write_wait_seconds
        out.per_path = [
            {k: a[k] + b[k] for k in a} for a, b in zip(self.per_path, other.per_path, strict=True)
        ] or other.per_path
        out.staged = self.staged + other.staged
        return out


@dataclass
class KeptCopy:
    """Where a staged part's update of a cached chunk copies the chunk's state before it (`state`,
    bytes), and whether the pass that copies it ran (`filled`, set by the update right after it): an
    update that raises before it leaves the chunk's buffer as it was, one that raises after it is
    undone from the copy."""

    state: torch.Tensor
    filled: bool = False


@dataclass
class DeferredUpdate:
    """A chunk's update that goes on after `update` returned it (on the accelerator, beside the host's
    pass): the chunk's buffer stays the update's until `done()`, or until `wait()` returns; `finish()`,
    called then, returns what `update` would have (the checksums as read and as written, with
    `checksums_in_update`). A step that fails waits for it without finishing it: no copy may land in a
    buffer given back."""

    done: Callable[[], bool]
    finish: Callable[[], tuple[list[int] | None, list[int] | None] | None]
    wait: Callable[[], None]


def next_order(
    previous: Sequence[int], resident: set[int], retained: set[int], *, ascending: bool = False
) -> list[int]:
    """The order of the step after one that went in `previous` order and left `resident` chunks cached
    and `retained` ones in their buffers: retained, resident, then the rest, each latest first; or, with
    `ascending`, chunk order whatever the last step left."""
    if ascending:
        return sorted(previous)
    latest_first = list(reversed(previous))
    return (
        [c for c in latest_first if c in retained]
        + [c for c in latest_first if c in resident and c not in retained]
        + [c for c in latest_first if c not in resident and c not in retained]
    )


class ChunkPipeline:
    """Drives one update phase per `run_step` over the objects `keys[c]` of `sizes[c]` bytes.

    `buffers` host buffers of the largest chunk's size make the budget (at least 1). `cache_slots` of
    them keep chunks across steps (default: every buffer, the stream's included; a number leaves the
    others to stream, written behind and so read ahead; see `memory.stream_buffers`); at least one must
    stay for the rest. `lock` page-locks the buffers (and registers them with CUDA when it is there);
    `pages` is `"small"` or `"huge"` (see `MLPOffloadConfig.host_pages`). `ascending`: every step in
    chunk order, the first chunks cached (see the module docs). `kept_copies`: the most cached chunks a
    staged part may update (each needs a buffer of its own for its state before; `reserve_kept`).

    A step may run on another thread than the caller's (`overlap.UpdateInFlight`): while it runs, every
    other method refuses, rather than race with it.
    """

    def __init__(
        self,
        store: ObjectStore,
        keys: Sequence[str],
        sizes: Sequence[int],
        buffers: int,
        *,
        cache_slots: int | None = None,
        lock: bool = False,
        pages: str = "small",
        ascending: bool = False,
        kept_copies: int = 0,
    ) -> None:
        if not sizes:
            raise ValueError("sizes: there are no chunks")
        if len(keys) != len(sizes):
            raise ValueError(f"keys: {len(keys)} keys for {len(sizes)} chunks")
        n = len(sizes)
        self.buffer_count, self.cache_slots = stream_buffers(buffers, n, cache_slots)
        self.cache_slots_in_chunk_order = cache_in_chunk_order(self.buffer_count, n, self.cache_slots)
        # What `go_latest_first` gives back.
        self.cache_slots_latest_first = self.cache_slots
        if ascending:
            self.cache_slots = self.cache_slots_in_chunk_order
        self.store = store
        self.keys = list(keys)
        self.sizes = list(sizes)
        self.buffer_size = max(self.sizes)
        self._pool = PinnedBufferPool(self.buffer_count, self.buffer_size, lock=lock, pages=pages)
        self._free: list[_core.HostBuffer] = []
        while (b := self._pool.acquire()) is not None:
            self._free.append(b)
        # Chunk -> buffer holding its current state, newer than the store's.
        self._resident: dict[int, _core.HostBuffer] = {}
        # Chunk -> (buffer, its write-back, maybe still in flight) from the end of the last step.
        self._retained: dict[int, tuple[_core.HostBuffer, _core.IoHandle]] = {}
        # Chunk -> (buffer, its staged write, maybe still in flight): what the buffer holds is not the
        # chunk's current state, so it is never used as such; the buffer is free once the write is done.
        self._staged_held: dict[int, tuple[_core.HostBuffer, _core.IoHandle]] = {}
        # Kept copies: the most there may be, the free ones (each its own pool, so that one given back
        # frees its memory), the cached chunks' states before their staged update (chunk -> its copy,
        # until `commit` or `discard`), and the copies the last boundaries wanted (`reserve_kept`).
        self.kept_limit = kept_copies
        self._lock, self._pages = lock, pages
        self._kept_free: list[tuple[PinnedBufferPool, _core.HostBuffer]] = []
        self._kept_held: dict[int, tuple[PinnedBufferPool, _core.HostBuffer]] = {}
        self._kept_wanted: deque[int] = deque(maxlen=KEPT_IDLE_BOUNDARIES)
        # Why the last `reserve_kept` made fewer than wanted, within the limit (None: it did not).
        self.kept_short: str | None = None
        self._order = list(range(n))
        self._ascending = ascending
        # Set while a step runs (on whichever thread).
        self._running = False
        self._step = 0
        self._snapshot = [r["stats"] for r in store.path_reports()]

    @property
    def page_report(self) -> dict[str, int]:
        """How the buffers' bytes are backed (see `_core.HostBufferPool.page_report`)."""
        return self._pool.page_report

    @property
    def ascending(self) -> bool:
        """Whether every step goes in chunk order."""
        return self._ascending

    def go_ascending(self) -> None:
        """From the next step on, every step in chunk order with its cache (`cache_slots_in_chunk_order`,
        the first chunks). The cached chunks that cache does not keep are written back now, their
        buffers freed as the writes land (retained, as the end of a step leaves them), so the next step
        has buffers to read the first chunks it lacks into: one step's more I/O."""
        self._idle("go_ascending")
        if self._ascending:
            return
        self._ascending = True
        self.cache_slots = self.cache_slots_in_chunk_order
        for c in sorted(self._resident):
            if c >= self.cache_slots:
                buffer = self._resident.pop(c)
                self._retained[c] = (buffer, self.store.write(self.keys[c], self.view(c, buffer)))
        self._order = next_order(self._order, set(self._resident), set(self._retained), ascending=True)

    def go_latest_first(self) -> None:
        """Back from `go_ascending`: from the next step on, each step in the order that follows from the
        one before (`next_order`), with the cache it had before chunk order. Nothing is written now: the
        next step's last chunks fill the larger cache."""
        self._idle("go_latest_first")
        if not self._ascending:
            return
        self._ascending = False
        self.cache_slots = self.cache_slots_latest_first
        self._order = next_order(self._order, set(self._resident), set(self._retained))

    @property
    def order(self) -> list[int]:
        """The order of the next step."""
        return list(self._order)

    def view(self, chunk: int, buffer: _core.HostBuffer) -> torch.Tensor:
        return as_tensor(buffer)[: self.sizes[chunk]]

    def _idle(self, what: str) -> None:
        if self._running:
            raise RuntimeError(f"{what}: the update phase is still running; wait for it first")

    def initialize(self, fill: Callable[[int, torch.Tensor], object]) -> None:
        """Creates every chunk's object from `fill(chunk, view)`, with as many writes in flight as there
        are buffers. The last ones written keep their buffers, and the first step begins with them."""
        self._idle("initialize")
        writing: deque[tuple[int, _core.HostBuffer, _core.IoHandle]] = deque()
        for c in range(len(self.sizes)):
            if not self._free:
                _, buffer, handle = writing.popleft()
                handle.wait()
                self._free.append(buffer)
            buffer = self._free.pop()
            view = self.view(c, buffer)
            fill(c, view)
            writing.append((c, buffer, self.store.write(self.keys[c], view)))
        self._retained = {c: (buffer, handle) for c, buffer, handle in writing}
        self._order = next_order(
            range(len(self.sizes)), set(), set(self._retained), ascending=self._ascending
        )

    @property
    def resident(self) -> list[int]:
        """Chunks cached in host memory, not written back since their last update."""
        return sorted(self._resident)

    @property
    def in_buffers(self) -> list[int]:
        """The chunks a staged part updates in their buffers, with kept copies: the resident ones, and
        (where there may be kept copies) the retained ones the cache keeps."""
        if not self.kept_limit:
            return self.resident
        cache = set(self._order[: self.cache_slots]) if self._ascending else set()
        return sorted(set(self._resident) | (set(self._retained) & cache))

    @property
    def retained(self) -> list[int]:
        """Chunks written back at the end of the last step whose buffers still hold their state."""
        return sorted(self._retained)

    def in_memory(self, chunk: int) -> tuple[torch.Tensor, str] | None:
        """The host copy of a chunk's current state and what it is (`"resident"`: newer than the store's;
        `"retained"`: the same as the store's once its write completes, which this waits for), or None
        when the store alone has it."""
        self._idle("in_memory")
        if (buffer := self._resident.get(chunk)) is not None:
            return self.view(chunk, buffer), "resident"
        if (entry := self._retained.get(chunk)) is not None:
            entry[1].wait()
            return self.view(chunk, entry[0]), "retained"
        return None

    def replace(self, chunk: int, state: torch.Tensor) -> None:
        """Makes `state` (bytes) the chunk's current state, in its host copy and in the store."""
        self._idle("replace")
        if (buffer := self._resident.get(chunk)) is not None:
            self.view(chunk, buffer).copy_(state)
            return
        if (entry := self._retained.get(chunk)) is not None:
            buffer, handle = entry
            handle.wait()
            view = self.view(chunk, buffer)
            view.copy_(state)
            self._retained[chunk] = (buffer, self.store.write(self.keys[chunk], view))
            self._retained[chunk][1].wait()
            return
        self.store.write(self.keys[chunk], state).wait()

    @property
    def kept_copies(self) -> int:
        """Kept copies held now, free or holding a cached chunk's state before its staged update."""
        return len(self._kept_free) + len(self._kept_held)

    @property
    def kept_bytes(self) -> int:
        return self.kept_copies * self.buffer_size

    def reserve_kept(self, wanted: int, spare: Callable[[], int]) -> int:
        """Makes `wanted` kept copies ready for a staged part (up to `kept_limit`), and gives back free
        ones no boundary wanted for `KEPT_IDLE_BOUNDARIES` in a row (the memory follows the plan's pick
        down as well as up). Each is made only while this rank can spare its bytes then (`spare()`, asked
        where one is to be made: the memory available, less the margin, over the node's ranks; the
        job's own memory grew since start-up); `kept_short` says why it made fewer. Returns how many
        cached chunks the part may take."""
        self._idle("reserve_kept")
        self._kept_wanted.append(wanted)
        target = min(self.kept_limit, max(self._kept_wanted))
        self.kept_short = None
        missing = min(wanted, self.kept_limit) - self.kept_copies
        spare_bytes = spare() if missing > 0 else 0
        for _ in range(missing):
            if spare_bytes < self.buffer_size:
                self.kept_short = (
                    f"{spare_bytes:,} bytes of host memory to spare now, less than a kept copy's "
                    f"{self.buffer_size:,}"
                )
                break
            spare_bytes -= self.buffer_size
            pool = PinnedBufferPool(1, self.buffer_size, lock=self._lock, pages=self._pages)
            buffer = pool.acquire()
            assert buffer is not None, "a pool of one buffer gave none"
            self._kept_free.append((pool, buffer))
        while self.kept_copies > target and self._kept_free:
            pool, _ = self._kept_free.pop()
            pool.close()
        return min(wanted, len(self._kept_free))

    def _take_buffer(self) -> _core.HostBuffer | None:
        if self._free:
            return self._free.pop()
        # A step that failed dropped its buffers; they came back to the pool when their last user went.
        return self._pool.acquire()

    def run_step(
        self,
        update: Callable[..., Any],
        *,
        drain: bool = True,
        checksums_in_update: bool = False,
        only: Sequence[int] | None = None,
        staged: bool = False,
        ready: Callable[[int, float], bool | None] | None = None,
        ends_step: bool = True,
    ) -> StepStats:
        """One update phase: `update(chunk, view)` changes each chunk's state in place.

        A step may also run in parts (with `ascending`, whose cache does not depend on the order):
        `only` runs these chunks, in this order; `ends_step=False` says more parts of the same step
        follow (`StepStats.add` joins their figures). `staged`: every write is staged
        (`ObjectStore.write(staged=True)`), so the chunks' new versions stay invisible until
        `commit(chunks)`, or are forgotten by `discard(chunks)`; `stats.staged` lists them. A cached chunk
        takes a kept copy (`reserve_kept`), handed to `update` as `kept=` (a `KeptCopy`): the update
        copies the state before into it and sets `filled`. `ready(chunk,
        timeout)`, called before each chunk's update while the reads ahead go on, says whether it may
        be updated now (True), not yet (None, after up to `timeout` seconds), or never in this part
        (False: the part ends there, and what was read ahead of it is dropped).

        With `drain=False` the step returns while its last writes are still in flight: they go on while
        forward and backward run, and their buffers keep the state, so the next step uses them without
        reading them back.

        With `checksums_in_update`, `update(chunk, view, read_cuts, write_cuts)` also hashes the chunk's
        state as it reads and writes it (where the store keeps checksums; else both cuts are None), and
        returns the CRC32C per stripe (`(read_sums, write_sums)`, cut at the stripe starts it was given,
        None where it was given None). The store then neither verifies the read nor hashes the write on
        its own threads; a chunk read from the store is verified here, after its update and before it is
        written or kept, so corrupt state never reaches the store or the cache.
        """
        self._idle("run_step")
        n = len(self.sizes)
        if only is not None:
            if not self._ascending:
                raise ValueError("only: a step runs in parts only in chunk order (ascending)")
            if len(set(only)) != len(only) or not all(0 <= c < n for c in only):
                raise ValueError(f"only: chunks {list(only)} are not distinct chunks of {n}")
        chunks = set(self._order if only is None else only)
        if staged and len(cached := sorted(chunks & set(self.in_buffers))) > len(self._kept_free):
            # A cached chunk's current state is its buffer alone: a staged update of it is undone from
            # its kept copy.
            raise ValueError(
                f"staged: chunks {cached} are cached, their current state in host memory only, and "
                f"{len(self._kept_free)} kept copies are ready for them (reserve_kept)"
            )
        if pending := sorted(chunks & set(self._kept_held)):
            raise RuntimeError(f"run_step: chunks {pending} have a staged update; commit or discard it first")
        self._running = True
        try:
            return self._run_step(update, drain, checksums_in_update, only, staged, ready, ends_step)
        finally:
            self._running = False

    def _free_staged(self, chunks: Iterable[int]) -> float:
        """Takes back the buffers of these chunks' staged writes, once done; the seconds waited."""
        waited = 0.0
        for c in chunks:
            if (entry := self._staged_held.pop(c, None)) is not None:
                t = time.perf_counter()
                try:
                    entry[1].wait()
                except Exception:
                    # The write's own outcome is the store's (commit refuses a version that failed).
                    pass
                waited += time.perf_counter() - t
                self._free.append(entry[0])
        return waited

    def commit(self, chunks: Iterable[int]) -> None:
        """Makes the staged versions of these chunks current (see `run_step(staged=True)`): a cached
        chunk's is already in its buffer, and its kept copy is free again."""
        self._idle("commit")
        chunks = list(chunks)
        self._free_staged(chunks)
        for c in chunks:
            if (kept := self._kept_held.pop(c, None)) is not None:
                self._kept_free.append(kept)
            else:
                self.store.commit(self.keys[c])

    def discard(self, chunks: Iterable[int]) -> None:
        """Forgets the staged versions of these chunks: the store's current ones stay, and a cached
        chunk's state before goes back into its buffer from its kept copy."""
        self._idle("discard")
        chunks = list(chunks)
        self._free_staged(chunks)
        for c in chunks:
            if (kept := self._kept_held.pop(c, None)) is not None:
                self.view(c, self._resident[c]).copy_(self.view(c, kept[1]))
                self._kept_free.append(kept)
            else:
                self.store.discard(self.keys[c])

    def _run_step(
        self,
        update: Callable[..., Any],
        drain: bool,
        checksums_in_update: bool,
        only: Sequence[int] | None,
        staged: bool,
        ready: Callable[[int, float], bool | None] | None,
        ends_step: bool,
    ) -> StepStats:
        n = len(self.sizes)
        order = self._order if only is None else list(only)
        if self._ascending:
            keep = set(self._order[: self.cache_slots])
        else:
            keep = set(order[n - self.cache_slots :]) if self.cache_slots else set()
        retained, self._retained = self._retained, {}
        stats = StepStats(self._step, 0.0, 0, 0, 0, 0, 0)
        start = time.perf_counter()
        stats.write_wait_seconds += self._free_staged(list(self._staged_held))
        if self._ascending:
            # The last step's final writes come last in chunk order: their buffers serve the stream now.
            for i in [i for i in retained if i not in keep]:
                buffer, handle = retained.pop(i)
                stats.write_wait_seconds += _waited(handle)
                self._free.append(buffer)
        loop = _StepLoop(self, update, checksums_in_update, staged, order, keep, retained, stats)
        try:
            for i in order:
                loop.read_ahead()
                if ready is not None and not loop.wait_ready(i, ready):
                    break
                loop.run_chunk(i)
            while loop.settle(block=True):
                pass
        except BaseException:
            loop.abandon_deferred()
            raise
        if drain:
            while loop.reclaim(block=True):
                pass
        if staged:
            self._staged_held.update((i, (buffer, handle)) for i, buffer, handle in loop.writing)
        else:
            self._retained = {i: (buffer, handle) for i, buffer, handle in loop.writing}
        # The whole step's order, also after a part of it (`only`).
        self._order = next_order(
            self._order, set(self._resident), set(self._retained), ascending=self._ascending
        )
        stats.seconds = time.perf_counter() - start
        stats.per_path.extend(self._path_figures())
        if ends_step:
            self._step += 1
        return stats

    def _path_figures(self) -> list[dict[str, float]]:
        """Per path, the bytes and busy seconds since the end of the last step: writes that ran on during
        forward and backward count in this one."""
        before, after = self._snapshot, [r["stats"] for r in self.store.path_reports()]
        self._snapshot = after
        return [
            {
                "read_bytes": a["bytes_read"] - b["bytes_read"],
                "read_busy_secs": (a["read_busy_ns"] - b["read_busy_ns"]) / 1e9,
                "write_bytes": a["bytes_written"] - b["bytes_written"],
                "buffered_bytes": a["bytes_buffered"] - b["bytes_buffered"],
                "write_busy_secs": (a["write_busy_ns"] - b["write_busy_ns"]) / 1e9,
                "busy_secs": (a["busy_ns"] - b["busy_ns"]) / 1e9,
            }
            for b, a in zip(before, after, strict=True)
        ]

    def flush(self) -> None:
        """Writes the cached chunks back and waits for every write, so the store alone holds the current
        state."""
        self._idle("flush")
        self._free_staged(list(self._staged_held))
        for buffer, handle in self._retained.values():
            handle.wait()
            self._free.append(buffer)
        self._retained.clear()
        handles = [(i, b, self.store.write(self.keys[i], self.view(i, b))) for i, b in self._resident.items()]
        for i, b, h in handles:
            h.wait()
            self._free.append(b)
            del self._resident[i]

    def close(self) -> None:
        """Gives the buffers back (and their CUDA registration); cached state not flushed is lost."""
        self._idle("close")
        self._free_staged(list(self._staged_held))
        for _, handle in self._retained.values():
            handle.wait()
        self._retained.clear()
        self._resident.clear()
        self._free.clear()
        self._pool.close()


def _waited(handle: _core.IoHandle) -> float:
    """Waits for a read or write; the seconds it took (raises what it raised)."""
    t = time.perf_counter()
    handle.wait()
    return time.perf_counter() - t


class _StepLoop:
    """One `run_step`'s chunk loop (`ChunkPipeline._run_step`): the reads ahead, the writes behind, and
    each chunk's buffer and update. `keep`: the chunks the cache keeps after this step; `retained`: the
    chunks whose last writes still hold their buffers."""

    def __init__(
        self,
        pipeline: ChunkPipeline,
        update: Callable[..., Any],
        checksums_in_update: bool,
        staged: bool,
        order: list[int],
        keep: set[int],
        retained: dict[int, tuple[_core.HostBuffer, _core.IoHandle]],
        stats: StepStats,
    ) -> None:
        self.pipeline = pipeline
        self.update = update
        self.checksums_in_update = checksums_in_update
        self.sums_here = checksums_in_update and pipeline.store.checksum
        self.staged = staged
        self.keep = keep
        self.retained = retained
        self.stats = stats
        self.to_read = deque(i for i in order if i not in pipeline._resident and i not in retained)
        self.reading: dict[int, tuple[_core.HostBuffer, _core.IoHandle]] = {}
        self.writing: deque[tuple[int, _core.HostBuffer, _core.IoHandle]] = deque()
        # Updates that go on past their call, in the order they began: each chunk's buffer, and what
        # placing it needs once it ends.
        self.deferred: deque[tuple[int, _core.HostBuffer, _Call]] = deque()

    def _wait_write(self, handle: _core.IoHandle) -> None:
        self.stats.write_wait_seconds += _waited(handle)

    def reclaim(self, block: bool) -> bool:
        """Frees the buffer of the oldest write if it is done (or, with `block`, once it is)."""
        if not self.writing or not (block or self.writing[0][2].done()):
            return False
        _, buffer, handle = self.writing.popleft()
        self._wait_write(handle)
        self.pipeline._free.append(buffer)
        return True

    def settle(self, block: bool) -> bool:
        """Places the chunk of the oldest deferred update once it ended (or, with `block`, waits for
        it): verified, then cached or written as `run_chunk` places one."""
        if not self.deferred or not (block or self.deferred[0][2].result.done()):
            return False
        i, buffer, call = self.deferred.popleft()
        call.result.wait()
        call.result = call.result.finish()
        self._place(i, buffer, None, self._sums(call))
        return True

    def abandon_deferred(self) -> None:
        """A step that failed: waits for every deferred update (their errors are the failure's), and
        drops their buffers, as a failed update drops its chunk's."""
        while self.deferred:
            _, _, call = self.deferred.popleft()
            try:
                call.result.wait()
            except Exception:
                pass

    def read_ahead(self) -> None:
        """Reads the next chunks into every buffer free, or freed by a write done."""
        p = self.pipeline
        while self.settle(block=False):
            pass
        while self.to_read:
            buffer = p._take_buffer()
            if buffer is None:
                if not self.reclaim(block=False):
                    return
                continue
            i = self.to_read.popleft()
            view = p.view(i, buffer)
            self.reading[i] = (buffer, p.store.read(p.keys[i], view, verify=not self.sums_here))
            self.stats.reads += 1
            self.stats.bytes_read += p.sizes[i]

    def wait_ready(self, i: int, ready: Callable[[int, float], bool | None]) -> bool:
        """Waits until `ready` says whether chunk `i` goes (reading ahead meanwhile). A part that ends
        here drops its reads ahead, their buffers free."""
        while (go := ready(i, 0.02)) is None:
            self.read_ahead()
        if go:
            return True
        self.stats.reads_dropped += len(self.reading)
        for buffer, handle in self.reading.values():
            try:
                handle.wait()
            except Exception:
                # Read again, and its error raised, by the part that updates the chunk.
                pass
            self.pipeline._free.append(buffer)
        self.reading.clear()
        return False

    def buffer_of(self, i: int) -> tuple[_core.HostBuffer, bool, bool]:
        """Chunk `i`'s buffer with its state: cached, retained from its last write, or read. Returns it,
        whether it was read, and whether it is cached (a staged update keeps a copy of it)."""
        p, stats = self.pipeline, self.stats
        if i in p._resident:
            stats.cached += 1
            return p._resident.pop(i), False, True
        if i in self.retained:
            # Its write from the last step reads this buffer: let it finish before changing it.
            buffer, handle = self.retained.pop(i)
            self._wait_write(handle)
            stats.retained += 1
            # Its buffer holds the store's state, and the cache keeps it: with kept copies, staged in
            # place as a resident chunk is (the first step after the initial writes).
            return buffer, False, bool(p.kept_limit) and i in self.keep
        while i not in self.reading:
            # Every buffer is resident or held by a write in flight: the oldest write frees one. (Reads
            # go out in order, and at least one buffer is not a cache slot.)
            if not self.writing:
                # The buffers are held by updates that go on: the oldest's chunk is placed once it ends.
                if self.settle(block=True):
                    continue
                raise RuntimeError(f"chunk {i}: no buffer to read into and no write to wait for")
            self.reclaim(block=True)
            self.read_ahead()
        buffer, handle = self.reading.pop(i)
        stats.read_wait_seconds += _waited(handle)
        return buffer, True, False

    def run_chunk(self, i: int) -> None:
        """Chunk `i`'s update in its buffer, then its write (or its place in the cache)."""
        p, stats = self.pipeline, self.stats
        buffer, was_read, cached = self.buffer_of(i)
        view = p.view(i, buffer)
        # A cached chunk in a staged part: the pass copies its state before into a kept copy.
        kept = p._kept_free.pop() if self.staged and cached else None
        copy = None if kept is None else KeptCopy(p.view(i, kept[1]))
        try:
            call = self._call(i, view, was_read, copy)
        except BaseException:
            if kept is not None and copy is not None:
                p._resident[i] = buffer
                if copy.filled:
                    # Staged: `discard` gives the state before back.
                    p._kept_held[i] = kept
                    stats.staged.append(i)
                else:
                    # The pass checks its arguments before it touches memory: the buffer is as it was.
                    p._kept_free.append(kept)
            raise
        if isinstance(call.result, DeferredUpdate):
            if self.staged:
                call.result.wait()
                raise ValueError(f"chunk {i}: a staged part's update does not go on past its call")
            self.deferred.append((i, buffer, call))
            return
        self._place(i, buffer, kept, self._sums(call))

    def _place(
        self,
        i: int,
        buffer: _core.HostBuffer,
        kept: tuple[PinnedBufferPool, _core.HostBuffer] | None,
        sums: tuple[list[int], list[int]] | None,
    ) -> None:
        """Chunk `i`, updated in `buffer`: held with its kept copy (staged), cached, or written."""
        p, stats = self.pipeline, self.stats
        view = p.view(i, buffer)
        if kept is not None:
            p._resident[i] = buffer
            p._kept_held[i] = kept
            stats.staged.append(i)
        elif i in self.keep and not self.staged:
            p._resident[i] = buffer
        else:
            self.writing.append((i, buffer, p.store.write(p.keys[i], view, sums=sums, staged=self.staged)))
            stats.writes += 1
            stats.bytes_written += p.sizes[i]
            if self.staged:
                stats.staged.append(i)

    def _call(self, i: int, view: torch.Tensor, was_read: bool, copy: KeptCopy | None) -> _Call:
        """Runs the update on chunk `i`'s state (with the checksums in it, asked for at the stripes the
        store reads and writes); what it returned, and what verifying it needs."""
        p = self.pipeline
        extra = {} if copy is None else {"kept": copy}
        if not self.checksums_in_update:
            return _Call(self.update(i, view, **extra))
        # Without the store's checksums, no cuts: the update hashes nothing.
        check = p.store.read_check(p.keys[i]) if was_read and self.sums_here else None
        read_cuts = check.starts if check is not None and check.has_sums else None
        write_cuts = None if i in self.keep or not self.sums_here else p.store.write_cuts(p.sizes[i])
        result = self.update(i, view, read_cuts, write_cuts, **extra)
        return _Call(result, check, read_cuts, write_cuts, copy is not None)

    def _sums(self, call: _Call) -> tuple[list[int], list[int]] | None:
        """With the checksums in the update, verifies the read's and returns the write's (its cuts and
        sums), else None."""
        if not self.checksums_in_update or call.kept or not self.sums_here:
            return None
        read_sums, write_sums = call.result
        if call.check is not None and call.read_cuts is not None:
            # Raises CorruptObjectError naming the stripe's file: nothing made of it is kept.
            self.pipeline.store.verify(call.check, read_sums)
        return None if call.write_cuts is None else (call.write_cuts, write_sums)


@dataclass
class _Call:
    """What a chunk's update returned (its checksums, or a `DeferredUpdate` until it ends), and what its
    verification takes: the store's record of the read, the cuts asked for, and whether it took a kept
    copy (whose chunk stays in host memory: no checksums)."""

    result: Any
    check: Any = None
    read_cuts: list[int] | None = None
    write_cuts: list[int] | None = None
    kept: bool = False
