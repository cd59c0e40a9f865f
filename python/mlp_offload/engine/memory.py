"""How much host memory a rank can spare, and how one step's state is cut into chunks within it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

# fp32 weights, exp_avg and exp_avg_sq per element (a state in half precision keeps fewer:
# `state_dtypes.StateDtypes.bytes_per_element`, each function's `state_bytes`); and the fp32 gradient of
# one chunk.
STATE_TENSORS = 3
STATE_BYTES = 4 * STATE_TENSORS
GRAD_BYTES = 4
# Left to everything else on the node: forward and backward, the data loader, the page cache.
MARGIN_FRACTION = 0.15
MARGIN_MIN = 2 << 30
# Chunk lengths are multiples of this many elements: DeepSpeed's CPU Adam rounds its SIMD loop to 128
# elements (AVX-512, span 8), so every chunk but a subgroup's last runs the vector path for every element,
# as the whole subgroup would; and 12 bytes x 1024 keeps every chunk's object 4 KiB-aligned for O_DIRECT
# (`chunk_align`: twice as many for a state of 10 or 6 bytes).
CHUNK_ALIGN = 1024
PAGE_BYTES = 4096


def chunk_align(state_bytes: int = STATE_BYTES) -> int:
    """Elements a chunk's length is a multiple of: `CHUNK_ALIGN`'s, as many times as it takes for every
    array of a state of `state_bytes` bytes per element to start and end on a 4 KiB page."""
    # Every state but fp32's has a 2-byte array (6 = 2 + 2 + 2, 10 = 2 + 4 + 4).
    smallest = 4 if state_bytes == STATE_BYTES else 2
    align = CHUNK_ALIGN
    while (align * smallest) % PAGE_BYTES or (align * state_bytes) % PAGE_BYTES:
        align += CHUNK_ALIGN
    return align


# Chunks of at most 48 MiB of state (4 Mi elements): large enough to keep requests long, small enough
# for a budget of a GiB to hold two dozen.
MAX_CHUNK_ELEMENTS = 4 << 20
# A budget is cut into at least this many chunk buffers when it can be: the stream's and as many again.
TARGET_BUFFERS = 24


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_headroom() -> int | None:
    """Bytes this process's memory cgroup still allows (its limit less what is not reclaimable), or None
    when it has no limit."""
    for limit_file, usage_file, stat_file in (
        ("memory.max", "memory.current", "memory.stat"),  # cgroup v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat"),  # v1
    ):
        root = Path("/sys/fs/cgroup")
        limit, usage = _read_int(root / limit_file), _read_int(root / usage_file)
        if limit is None or usage is None or limit >= 1 << 60:
            continue
        inactive_file = 0
        try:
            for line in (root / stat_file).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file"):
                    inactive_file = int(value)
        except (OSError, ValueError):
            pass
        return max(0, limit - (usage - inactive_file))
    return None


def local_ranks() -> int:
    """Ranks on this node, from what torchrun and the DeepSpeed launcher set."""
    for key in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


@dataclass(frozen=True)
class SpareMemory:
    bytes: int
    available: int
    margin: int
    ranks: int

    def describe(self) -> str:
        return (
            f"{self.available / 2**30:.1f} GiB available less a {self.margin / 2**30:.1f} GiB margin, "
            f"over {self.ranks} local rank(s)"
        )


def spare_host_memory() -> SpareMemory:
    """What this rank may use: the memory available now (the cgroup's limit included), less a margin,
    divided among the node's local ranks."""
    vm = psutil.virtual_memory()
    available = vm.available
    if (headroom := _cgroup_headroom()) is not None:
        available = min(available, headroom)
    margin = max(MARGIN_MIN, int(MARGIN_FRACTION * vm.total))
    ranks = local_ranks()
    return SpareMemory(max(0, available - margin) // ranks, available, margin, ranks)


def chunk_elements(
    largest: int, budget: int, requested_bytes: int | None, state_bytes: int = STATE_BYTES
) -> int:
    """Elements per chunk: `requested_bytes` of state (`state_bytes` a parameter), else as large as
    `MAX_CHUNK_ELEMENTS` while the budget still holds `TARGET_BUFFERS` of them; a multiple of
    `chunk_align`, never past the largest subgroup (rounded up)."""
    align = chunk_align(state_bytes)
    ceiling = -(-largest // align) * align
    if requested_bytes is not None:
        wanted = requested_bytes // state_bytes
    else:
        wanted = min(MAX_CHUNK_ELEMENTS, budget // (state_bytes * TARGET_BUFFERS))
    return min(ceiling, max(align, wanted // align * align))


@dataclass(frozen=True)
class ChunkLayout:
    """Subgroups cut into chunks within a host-memory budget."""

    elements: int
    """Elements of a buffer: the largest chunk's (each subgroup's own chunks may be shorter)."""
    chunks: list[tuple[int, int, int]]
    """Per chunk: its subgroup, its first element there, its elements. Chunks of a subgroup are adjacent,
    of one size (its last may be shorter)."""
    buffers: int
    """Chunk buffers the budget holds besides the gradient chunk (may be 0: too small a budget)."""
    state_bytes: int = STATE_BYTES
    """Bytes of state per element (`state_dtypes.StateDtypes.bytes_per_element`)."""

    @property
    def buffer_bytes(self) -> int:
        return self.state_bytes * self.elements

    @property
    def sizes(self) -> list[int]:
        return [self.state_bytes * count for _, _, count in self.chunks]

    def stream_buffers(self, kept_copies: int) -> int:
        """The buffers the pipeline streams through: all of them, or with kept copies (every chunk
        cached) one per chunk, the budget's buffers beyond them being the copies'."""
        return min(self.buffers, len(self.chunks)) if kept_copies else self.buffers

    def require_a_buffer(self, host_memory: int) -> None:
        """A `ValueError` naming `host_memory` when the budget holds no chunk beside its gradient."""
        if self.buffers < 1:
            raise ValueError(
                f"host_memory: {host_memory:,} bytes hold no chunk: one needs {self.buffer_bytes:,} bytes of "
                f"state ({self.elements:,} elements x {self.state_bytes}) plus "
                f"{GRAD_BYTES * self.elements:,} for its fp32 gradient"
            )


def chunk_layout(
    numels: Sequence[int],
    host_memory: int,
    update_chunk: int | None = None,
    state_bytes: int = STATE_BYTES,
) -> ChunkLayout:
    """How subgroups of `numels` elements stream through `host_memory` bytes (`update_chunk`: bytes of
    state per chunk, else `chunk_elements`' choice; the largest chunks when the budget caches them all),
    a state of `state_bytes` bytes per element."""
    largest = _largest_elements(numels, update_chunk, state_bytes)
    if host_memory >= _cached_bytes(numels, largest, state_bytes):
        c = largest
    else:
        c = chunk_elements(max(numels), host_memory, update_chunk, state_bytes)
    elements, chunks = _cut(numels, c, chunk_align(state_bytes))
    buffers = max(0, (host_memory - GRAD_BYTES * elements) // (state_bytes * elements))
    return ChunkLayout(elements, chunks, buffers, state_bytes)


def _cut(numels: Sequence[int], most: int, align: int) -> tuple[int, list[tuple[int, int, int]]]:
    """Each subgroup cut into as few chunks of at most `most` elements as it takes, of even size (rounded
    up to the alignment): the buffer's elements (the largest chunk) and the chunks. Cut at `most` itself,
    a subgroup of 4.77 chunks ended in a chunk of 0.77 with a whole buffer of its own: 5% of the memory
    at LLaMA 1B's 2e7-element subgroups, and a budget's last chunk of 1280 elements read and written as
    one request."""
    elements, chunks = align, []
    for i, n in enumerate(numels):
        pieces = max(1, -(-n // most))
        size = max(1, -(-n // (pieces * align))) * align  # an empty subgroup has no chunk
        elements = max(elements, size)
        chunks += [(i, first, min(size, n - first)) for first in range(0, n, size)]
    return elements, chunks


def _largest_elements(numels: Sequence[int], update_chunk: int | None, state_bytes: int) -> int:
    """Elements per chunk with no budget to fit: what `update_chunk` asks for, else the largest chunk."""
    return chunk_elements(max(numels), 1 << 62, update_chunk, state_bytes)


def _cached_bytes(numels: Sequence[int], most: int, state_bytes: int) -> int:
    elements, chunks = _cut(numels, most, chunk_align(state_bytes))
    return len(chunks) * state_bytes * elements + GRAD_BYTES * elements


def whole_state_bytes(
    numels: Sequence[int], update_chunk: int | None = None, state_bytes: int = STATE_BYTES
) -> int:
    """The budget that caches every chunk, of the largest size `update_chunk` allows, with its gradient
    (a state of `state_bytes` bytes per element)."""
    return _cached_bytes(numels, _largest_elements(numels, update_chunk, state_bytes), state_bytes)


# Buffers the stream needs besides a cache of a fixed size (`cache_chunks`), and the most worth allocating
# beyond the chunks: reads ahead, the chunk being updated, writes behind. With 6 the reads waited behind
# writes that held the buffers; 12 moved 20-40% more bytes per second on this machine's disk
# (docs/results.md). Fewer still work (down to one: read, update, write, one at a time).
PIPELINE_BUFFERS = 12


def stream_buffers(buffers: int, chunks: int, cache: int | None) -> tuple[int, int]:
    """The buffers worth allocating out of `buffers` for `chunks` chunks, and how many of them keep
    their chunks across steps (`cache`, or "auto" when None: every buffer, the stream's included, which
    then evicts a chunk only for one it must read). A cache that leaves no buffer for the uncached chunks
    is a `ValueError` naming `cache_chunks`."""
    if buffers < 1:
        raise ValueError(f"buffers: {buffers} host buffers; the pipeline needs at least 1")
    count = min(buffers, chunks + PIPELINE_BUFFERS)
    if cache is None:
        return count, min(chunks, count)
    slots = min(cache, chunks)
    if chunks > slots > buffers - 1:
        raise ValueError(
            f"cache_chunks: {slots} cached chunks leave none of the {buffers} buffers for the others"
        )
    return count, slots


def cache_in_chunk_order(buffers: int, chunks: int, cache_slots: int) -> int:
    """The cache of `stream_buffers`' `cache_slots` in chunk order: the cached chunks come first and hold
    their buffers all step, so a cache of every buffer ("auto") leaves the stream its buffers."""
    if chunks > cache_slots >= buffers:
        return buffers - min(PIPELINE_BUFFERS, max(1, buffers - 1))
    return cache_slots


def describe_pages(pages: str, source: str, report: dict[str, int]) -> str:
    """The host buffers' pages in words, for the start-up line: what was asked, why, and what the kernel
    gave (reserved or transparent huge pages, or 4 KiB ones where memory was too fragmented)."""
    total = report["bytes"]
    if pages == "small" or total == 0:
        return f"host buffers in 4 KiB pages ({source})"
    huge = report["reserved_huge_bytes"] + report["transparent_huge_bytes"]
    parts = []
    if report["reserved_huge_bytes"]:
        parts.append(f"{report['reserved_huge_bytes'] / 2**30:.2f} GiB reserved")
    if report["transparent_huge_bytes"]:
        parts.append(f"{report['transparent_huge_bytes'] / 2**30:.2f} GiB transparent")
    got = " + ".join(parts) or "none"
    small = f", {(total - huge) / 2**30:.2f} GiB in 4 KiB pages" if huge < total else ""
    return f"host buffers in huge pages ({source}): {got} of {total / 2**30:.2f} GiB{small}"
