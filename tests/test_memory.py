"""How the state is cut into chunks within a budget, and what a rank can spare."""

from __future__ import annotations

import pytest

from mlp_offload.engine import memory

MiB = 1 << 20


@pytest.mark.parametrize(
    ("numels", "budget", "requested", "elements", "chunks", "buffers"),
    [
        # Large budget: chunks of up to 4 Mi elements (48 MiB); 2e7 is 4.77 of them, so 5 of 4e6 (rounded
        # up to the alignment), not 4 of 4 Mi and one of 0.77 in a buffer as large: 178 buffers, not 170.
        ([20_000_000] * 2, 8 << 30, None, 4_000_768, 10, 178),
        # DeepSpeed's pinned budget for 2e7-element subgroups (12 buffers) would hold 18 chunks of 4 Mi:
        # smaller ones, 3_333_120 elements for 24 buffers less the gradient's share, cut 6.0004 a
        # subgroup: 7 even chunks, so 27 buffers.
        ([20_000_000] * 5, 12 * 20_000_000 * 4, None, 2_857_984, 35, 27),
        # DeepSpeed's default 4 buffers: smaller still.
        ([20_000_000] * 5, 4 * 20_000_000 * 4, None, 1_052_672, 95, 24),
        # A subgroup smaller than a chunk is one chunk of its own (rounded up to the alignment).
        ([3000, 5000], 64 * MiB, None, 5120, 2, 1091),
        # Asked for: 24 KiB of state per chunk is 2048 elements.
        ([12_000], 200 << 10, 24 << 10, 2048, 6, 8),
        # A budget too small for one chunk holds none (the engine names host_memory).
        ([12_000], 8 << 10, None, 1024, 12, 0),
    ],
)
def test_chunk_layout(
    numels: list[int], budget: int, requested: int | None, elements: int, chunks: int, buffers: int
) -> None:
    layout = memory.chunk_layout(numels, budget, requested)
    assert (layout.elements, len(layout.chunks), layout.buffers) == (elements, chunks, buffers)
    assert layout.elements % memory.CHUNK_ALIGN == 0
    # The chunks tile every subgroup exactly, in order, in as few chunks as the budget's chunk size allows
    # (the layout's own on a budget that caches every chunk, else `chunk_elements`'), of one size (the
    # last may be shorter), and the buffer holds the largest.
    most = memory.chunk_elements(max(numels), budget, requested)
    for i, n in enumerate(numels):
        mine = [(first, count) for s, first, count in layout.chunks if s == i]
        size = mine[0][1]
        assert [f for f, _ in mine] == list(range(0, n, size)) and sum(c for _, c in mine) == n
        assert len(mine) == -(-n // most) and size <= layout.elements
    if layout.buffers:
        used = layout.buffers * layout.buffer_bytes + memory.GRAD_BYTES * layout.elements
        assert used <= budget < used + layout.buffer_bytes, "the pool fills the budget to the chunk"


@pytest.mark.parametrize(
    ("state_bytes", "align"),
    [(12, 1024), (10, 2048), (6, 2048)],  # fp32; half-precision weights, fp32 moments; bf16 all three
)
def test_a_state_is_cut_in_its_own_bytes(state_bytes: int, align: int) -> None:
    """Chunks, buffers and the whole state in the state's bytes per element; every chunk but a subgroup's
    last a whole number of 4 KiB pages in each of its arrays (2 or 4 bytes an element)."""
    numels = [20_000_000, 7_000_001]
    budget = 12 * 20_000_000 * 4
    layout = memory.chunk_layout(numels, budget, None, state_bytes)
    assert memory.chunk_align(state_bytes) == align and layout.elements % align == 0
    assert layout.buffer_bytes == state_bytes * layout.elements and layout.state_bytes == state_bytes
    assert layout.buffers == (budget - memory.GRAD_BYTES * layout.elements) // layout.buffer_bytes
    whole = memory.chunk_layout(numels, 1 << 40, None, state_bytes)
    for _, first, _ in whole.chunks + layout.chunks:
        assert first % align == 0 and (state_bytes * first) % memory.PAGE_BYTES == 0
    cached = memory.whole_state_bytes(numels, None, state_bytes)
    assert cached == len(whole.chunks) * whole.buffer_bytes + memory.GRAD_BYTES * whole.elements
    fp32 = memory.whole_state_bytes(numels)
    assert cached <= fp32 * (state_bytes + 1) / 12


def test_whole_state_caches_every_chunk() -> None:
    numels = [20_000_000, 7_000_000]
    whole = memory.whole_state_bytes(numels)
    layout = memory.chunk_layout(numels, whole)
    assert layout.buffers == len(layout.chunks)
    assert memory.stream_buffers(layout.buffers, len(layout.chunks), None)[1] == len(layout.chunks)


@pytest.mark.parametrize(
    ("buffers", "chunks", "cache", "expected"),
    [
        (30, 100, None, (30, 30)),  # by default every buffer keeps its chunk across steps
        (4, 100, None, (4, 4)),
        (200, 10, None, (22, 10)),  # no more buffers than chunks plus the stream
        (10, 10, None, (10, 10)),  # every chunk fits: all cached, nothing streams
        (9, 10, None, (9, 9)),  # one chunk read and one written a step
        (20, 100, 3, (20, 3)),  # as many as asked: the other 17 written back every step
        (5, 5, 5, (5, 5)),  # every chunk cached: nothing streams
    ],
)
def test_stream_buffers(buffers: int, chunks: int, cache: int | None, expected: tuple[int, int]) -> None:
    assert memory.stream_buffers(buffers, chunks, cache) == expected


def test_a_cache_that_leaves_no_stream_buffer_is_named() -> None:
    with pytest.raises(ValueError, match=r"^cache_chunks: 4 cached chunks leave none of the 4 buffers"):
        memory.stream_buffers(4, 10, 4)
    with pytest.raises(ValueError, match=r"^buffers:"):
        memory.stream_buffers(0, 10, None)


def test_spare_memory_is_shared_by_the_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = memory.spare_host_memory()
    assert alone.ranks == 1 and alone.margin >= memory.MARGIN_MIN
    assert 0 <= alone.bytes <= alone.available
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    shared = memory.spare_host_memory()
    assert shared.ranks == 4
    # The same machine a moment later: a quarter, give or take what other processes did meanwhile.
    assert shared.bytes == pytest.approx(alone.bytes / 4, rel=0.2, abs=256 * MiB)
    assert "4 local rank(s)" in shared.describe()
