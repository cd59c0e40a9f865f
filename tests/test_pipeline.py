"""The update phase's chunk pipeline against the real store: order, cache, prefetch, and state kept
exact."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from conftest import mounted_tmpfs
from mlp_offload import CorruptObjectError, ObjectStore, WeightTuner, _core
from mlp_offload.common.config import MLPOffloadConfig
from mlp_offload.engine import memory, overlap, planning, profiles
from mlp_offload.engine import pipeline as pipeline_module
from mlp_offload.engine import state as state_module
from mlp_offload.engine.overlap import UpdateInFlight, update_thread
from mlp_offload.engine.pipeline import ChunkPipeline, KeptCopy, next_order
from mlp_offload.engine.planning import StepParts, StepTimes, UpdatePlanner
from mlp_offload.engine.state import ChunkedState
from mlp_offload.engine.telemetry import BackwardStep, GradsFinal


class Bumps:
    """Chunks of distinct sizes (chunk i filled with i), and an update that adds 1 to every byte of a
    chunk and records the order of each step's chunks (`seen`, a list per step)."""

    def __init__(self, chunks: int) -> None:
        self.sizes = [(64 << 10) + 4096 * i for i in range(chunks)]
        self.keys = [f"c{i}" for i in range(chunks)]
        self.seen: list[list[int]] = []

    def __call__(self, index: int, view: torch.Tensor) -> None:
        self.seen[-1].append(index)
        view.add_(1)

    def assert_stored(self, store: ObjectStore, steps: int) -> None:
        """Every chunk in the store as `steps` updates left it."""
        for i, size in enumerate(self.sizes):
            back = torch.empty(size, dtype=torch.uint8)
            store.read(self.keys[i], back).wait()
            assert torch.equal(back, torch.full((size,), i + steps, dtype=torch.uint8)), f"chunk {i}"


@pytest.mark.parametrize(
    ("chunks", "buffers", "cache", "cached"),
    [
        # By default every buffer keeps its chunk across steps, the stream's too.
        (5, 1, None, 1),  # one buffer: read, update, write, one chunk at a time
        (5, 2, None, 2),
        (13, 12, None, 12),  # one chunk more than the buffers: one read and one write a step
        (16, 14, None, 14),
        (5, 5, 4, 4),  # as many as asked, the other buffer written back at the end of each step
        (13, 12, 0, 0),  # none asked: the bare stream, every chunk read and written each step
        (4, 12, None, 4),  # all stay: after the first step no I/O at all
        (1, 3, None, 1),
        (8, 8, None, 8),  # as many buffers as chunks: everything stays, nothing streams
    ],
)
def test_every_step_updates_every_chunk_once_and_the_cache_skips_io(
    engine: str, work_dirs: list[Path], chunks: int, buffers: int, cache: int | None, cached: int
) -> None:
    bump = Bumps(chunks)
    sizes, keys, seen = bump.sizes, bump.keys, bump.seen
    with ObjectStore(work_dirs[:2], engine=engine) as store:
        pipeline = ChunkPipeline(store, keys, sizes, buffers, cache_slots=cache)
        assert pipeline.cache_slots == cached
        pipeline.initialize(lambda i, view: view.fill_(i))
        steps = 5
        for step in range(steps):
            seen.append([])
            # Odd steps leave their last writes in flight, as training does; even ones wait for them.
            drain = step % 2 == 0
            retained_before = len(pipeline.retained)
            order = pipeline.order
            stats = pipeline.run_step(bump, drain=drain)
            assert sorted(seen[-1]) == list(range(chunks)) and seen[-1] == order
            # Every step reads all but the chunks kept from the step before and those whose buffers
            # still hold them from the last writes (the initial ones, for the first step).
            assert stats.retained == retained_before
            assert stats.reads == chunks - (cached if step else 0) - stats.retained
            assert stats.writes == chunks - cached
            assert stats.cached == (cached if step else 0)
            assert pipeline.resident == sorted(order[chunks - cached :])
            held = len(pipeline.resident) + len(pipeline.retained)
            assert held <= pipeline.buffer_count, "the budget holds everything"
            if not drain and chunks > cached and pipeline.buffer_count > cached:
                assert pipeline.retained, "the last writes keep their buffers"
        pipeline.flush()
        assert not (pipeline.resident or pipeline.retained)
        bump.assert_stored(store, steps)


# chunks, buffers, cache_chunks, the chunks cached in chunk order
IN_CHUNK_ORDER = [
    # In chunk order the cached chunks come first and hold their buffers all step: a cache of every
    # buffer leaves the stream up to PIPELINE_BUFFERS of them, at least one.
    (5, 1, None, 0),
    (5, 2, None, 1),
    (13, 12, None, 1),
    (16, 14, None, 2),
    (5, 5, 4, 4),  # as many as asked: one buffer streams
    (13, 12, 0, 0),
    (4, 12, None, 4),  # all stay: the initial writes' buffers are kept, no read at all
    (8, 8, None, 8),
]


@pytest.mark.parametrize(("chunks", "buffers", "cache", "cached"), IN_CHUNK_ORDER)
def test_in_chunk_order_the_first_chunks_stay_and_the_rest_stream(
    engine: str, work_dirs: list[Path], chunks: int, buffers: int, cache: int | None, cached: int
) -> None:
    """`ascending` (the update behind the next forward): every step in chunk order, the first `cached`
    chunks kept in memory and skipped by the next step's reads."""
    bump = Bumps(chunks)
    sizes, keys, seen = bump.sizes, bump.keys, bump.seen
    with ObjectStore(work_dirs[:2], engine=engine) as store:
        pipeline = ChunkPipeline(store, keys, sizes, buffers, cache_slots=cache, ascending=True)
        assert pipeline.cache_slots == cached
        pipeline.initialize(lambda i, view: view.fill_(i))
        steps = 4
        for step in range(steps):
            seen.append([])
            kept_from_before = set(pipeline.retained) & set(range(cached))
            stats = pipeline.run_step(bump, drain=step % 2 == 0)
            assert seen[-1] == list(range(chunks))
            assert stats.cached == (cached if step else 0)
            assert stats.retained == len(kept_from_before)
            assert stats.reads == chunks - stats.cached - stats.retained
            assert stats.writes == chunks - cached
            assert pipeline.resident == list(range(cached))
            assert len(pipeline.resident) + len(pipeline.retained) <= pipeline.buffer_count
        pipeline.flush()
        bump.assert_stored(store, steps)


@pytest.mark.parametrize(("chunks", "buffers", "cache", "cached"), IN_CHUNK_ORDER)
def test_a_pipeline_goes_to_chunk_order_between_steps_and_back(
    engine: str, work_dirs: list[Path], chunks: int, buffers: int, cache: int | None, cached: int
) -> None:
    """`go_ascending` after steps in the cache's order (the plan choosing the update during backward):
    the chunks its smaller cache does not keep are written back, and from the next step on every step
    goes in chunk order with the first `cached` chunks kept. `go_latest_first` (the plan giving it up)
    then brings the cache before back, filled by the next step. Each chunk updated once a step, the
    store exact."""
    bump = Bumps(chunks)
    with ObjectStore(work_dirs[:2], engine=engine) as store:
        pipeline = ChunkPipeline(store, bump.keys, bump.sizes, buffers, cache_slots=cache)
        assert not pipeline.ascending and pipeline.cache_slots_in_chunk_order == cached
        latest_first = pipeline.cache_slots
        assert pipeline.cache_slots_latest_first == latest_first
        pipeline.initialize(lambda i, view: view.fill_(i))
        for _ in range(2):
            bump.seen.append([])
            pipeline.run_step(bump, drain=False)
        pipeline.go_ascending()
        assert pipeline.ascending and pipeline.cache_slots == cached and pipeline.order == list(range(chunks))
        assert set(pipeline.resident) <= set(range(cached))
        for step in range(2, 5):
            bump.seen.append([])
            stats = pipeline.run_step(bump, drain=False)
            assert bump.seen[-1] == list(range(chunks))
            assert stats.writes == chunks - cached and pipeline.resident == list(range(cached))
            assert step == 2 or stats.cached == cached
        pipeline.go_latest_first()
        assert not pipeline.ascending and pipeline.cache_slots == latest_first
        for step in range(5, 8):
            bump.seen.append([])
            order = pipeline.order
            stats = pipeline.run_step(bump, drain=step % 2 == 0)
            assert sorted(bump.seen[-1]) == list(range(chunks)) and bump.seen[-1] == order
            # The first step back keeps chunk order's cache; from the next on the whole cache is kept.
            assert stats.cached == (cached if step == 5 else latest_first)
            assert stats.writes == chunks - latest_first
            assert pipeline.resident == sorted(order[chunks - latest_first :])
            assert len(pipeline.resident) + len(pipeline.retained) <= pipeline.buffer_count
        pipeline.flush()
        bump.assert_stored(store, 8)


@pytest.mark.parametrize(
    ("chunks", "buffers", "first_part", "outcome"),
    [
        # The stream's chunks, last first, as their gradients come; all of them staged, then kept.
        (9, 6, None, "commit"),
        # The first part ends after two chunks (the step's outcome came first): those are kept, the
        # rest run in the second part.
        (9, 6, 2, "commit"),
        # The outcome says otherwise: the staged versions are forgotten and every chunk runs again.
        (9, 6, None, "discard"),
        (9, 6, 3, "discard"),
        (6, 2, None, "commit"),  # one buffer streams
        (6, 2, 4, "discard"),
    ],
)
def test_a_step_in_two_parts_stages_the_first_and_keeps_or_forgets_it(
    engine: str, work_dirs: list[Path], chunks: int, buffers: int, first_part: int | None, outcome: str
) -> None:
    """The update during backward (issue 30): the streamed chunks go first, staged, each once `ready`
    lets it; reads see the old versions until `commit`; after `discard` the store has the old versions
    and the second part updates those chunks again. Every chunk is updated once per step in the end."""
    bump = Bumps(chunks)
    with ObjectStore(work_dirs[:2], engine=engine) as store:
        pipeline = ChunkPipeline(store, bump.keys, bump.sizes, buffers, ascending=True)
        pipeline.initialize(lambda i, view: view.fill_(i))
        cached = pipeline.cache_slots
        streamed = list(range(chunks - 1, cached - 1, -1))
        for step in range(3):
            allowed: list[int] = []

            def ready(chunk: int, timeout: float, allowed: list[int] = allowed) -> bool | None:
                if first_part is not None and len(allowed) == first_part:
                    return False
                allowed.append(chunk)
                return True

            bump.seen.append([])
            first = pipeline.run_step(
                bump, only=streamed, staged=True, ready=ready, drain=False, ends_step=False
            )
            done = streamed[: len(allowed)]
            assert bump.seen[-1] == done and first.staged == done
            # Reads ahead of where a first part ends were made and dropped: bytes moved all the same.
            assert first.reads == len(done) if first_part is None else first.reads >= len(done)
            # Until the outcome is known, the store has every chunk's old version.
            for i in done:
                back = torch.empty(bump.sizes[i], dtype=torch.uint8)
                store.read(bump.keys[i], back).wait()
                assert int(back[0]) == i + step, (step, i)
            if outcome == "commit":
                pipeline.commit(done)
                rest = [c for c in range(chunks) if c not in done]
            else:
                pipeline.discard(done)
                rest = list(range(chunks))
            bump.seen[-1] = []
            second = pipeline.run_step(bump, only=rest, drain=step % 2 == 0)
            assert bump.seen[-1] == rest
            joined = first.add(second)
            assert joined.step == step and joined.staged == done
            assert joined.writes == len(done) + len(rest) - cached
            assert pipeline.resident == list(range(cached))
        # A cached chunk's current state is in memory only: staging it is refused.
        if cached:
            with pytest.raises(ValueError, match="staged: chunks \\[0"):
                pipeline.run_step(bump, only=[0], staged=True)
        pipeline.flush()
        bump.assert_stored(store, 3)


def test_cached_chunks_are_staged_in_place_and_undone_from_their_kept_copies(
    engine: str, work_dirs: list[Path]
) -> None:
    """Every chunk cached (the update during backward where the state fits in memory): a staged part
    updates cached chunks in their buffers, each with a kept copy of its state before, filled by the
    update; `commit` keeps the new state, `discard` gives the old one back. At most `kept_copies` are
    made, the first time they are wanted; too few ready, or a chunk still staged in a later step, is
    refused by name; an update that raises before it fills the copy leaves the chunk as it was, one
    that raises after is undone by `discard`; copies no boundary wants go back; none is made past what
    the rank can spare then."""
    chunks = 5
    bump = Bumps(chunks)

    def staged_bump(index: int, view: torch.Tensor, kept: KeptCopy | None = None) -> None:
        assert kept is not None, f"chunk {index}: cached, staged, and no kept copy"
        kept.state.copy_(view)
        kept.filled = True
        bump(index, view)

    def value(pipeline: ChunkPipeline, chunk: int) -> int:
        found = pipeline.in_memory(chunk)
        assert found is not None and found[1] == "resident"
        return int(found[0][0])

    with ObjectStore(work_dirs[:1], engine=engine) as store:
        pipeline = ChunkPipeline(store, bump.keys, bump.sizes, chunks, ascending=True, kept_copies=3)
        pipeline.initialize(lambda i, view: view.fill_(i))
        bump.seen.append([])
        pipeline.run_step(bump)
        assert pipeline.resident == list(range(chunks)) and pipeline.kept_copies == 0
        plenty = 1 << 40
        assert (
            pipeline.reserve_kept(5, lambda: plenty) == 3 and pipeline.kept_bytes == 3 * pipeline.buffer_size
        )
        with pytest.raises(ValueError, match=r"chunks \[0, 1, 2, 3\] are cached.*3 kept copies"):
            pipeline.run_step(staged_bump, only=[3, 2, 1, 0], staged=True)
        bump.seen.append([])
        first = pipeline.run_step(staged_bump, only=[4, 3, 2], staged=True, ends_step=False)
        assert first.staged == [4, 3, 2] and first.writes == 0 and first.cached == 3
        with pytest.raises(RuntimeError, match=r"chunks \[2, 3, 4\] have a staged update"):
            pipeline.run_step(bump)
        pipeline.commit([4, 3])
        pipeline.discard([2])
        assert [value(pipeline, c) for c in range(chunks)] == [1, 2, 3, 5, 6]
        pipeline.run_step(bump, only=[0, 1, 2])
        assert [value(pipeline, c) for c in range(chunks)] == [2, 3, 4, 5, 6]

        def fails(filled: bool) -> Callable[..., None]:
            def update(index: int, view: torch.Tensor, kept: KeptCopy | None = None) -> None:
                assert kept is not None
                if filled:
                    staged_bump(index, view, kept)
                raise OSError(5, "injected")

            return update

        for filled in (False, True):
            bump.seen.append([])
            with pytest.raises(OSError, match="injected"):
                pipeline.run_step(fails(filled), only=[4], staged=True)
            pipeline.discard([4])
            assert value(pipeline, 4) == 6 and pipeline.kept_copies == 3, filled
        # No boundary wants them: after `KEPT_IDLE_BOUNDARIES` of those, they go back.
        for _ in range(pipeline_module.KEPT_IDLE_BOUNDARIES):
            assert pipeline.kept_copies == 3 and pipeline.kept_short is None
            pipeline.reserve_kept(0, lambda: plenty)
        assert pipeline.kept_copies == 0
        # Made only while the rank can spare their bytes then: here one and a half copies' worth.
        spare = pipeline.buffer_size * 3 // 2
        assert pipeline.reserve_kept(3, lambda: spare) == 1 and pipeline.kept_copies == 1
        assert pipeline.kept_short is not None and "to spare now" in pipeline.kept_short
        pipeline.flush()


def test_while_a_step_runs_on_another_thread_the_pipeline_refuses_the_rest(work_dirs: list[Path]) -> None:
    """The update behind `step()` runs the step on its own thread: whatever else would touch the
    buffers in the meantime is refused by name, not raced."""
    sizes = [64 << 10] * 3
    keys = [f"c{i}" for i in range(3)]
    entered, release = threading.Event(), threading.Event()

    def held(index: int, view: torch.Tensor) -> None:
        entered.set()
        release.wait()

    with ObjectStore(work_dirs[:1]) as store:
        pipeline = ChunkPipeline(store, keys, sizes, 2, ascending=True)
        pipeline.initialize(lambda i, view: view.fill_(i))
        inflight = UpdateInFlight(
            lambda done: pipeline.run_step(held), subgroups=1, step=1, thread=update_thread()
        )
        entered.wait()
        for name, call in [
            ("in_memory", lambda: pipeline.in_memory(0)),
            ("replace", lambda: pipeline.replace(0, torch.zeros(sizes[0], dtype=torch.uint8))),
            ("flush", pipeline.flush),
            ("run_step", lambda: pipeline.run_step(held)),
        ]:
            with pytest.raises(RuntimeError, match=f"^{name}: the update phase is still running"):
                call()
        release.set()
        assert inflight.result().writes == 3 - pipeline.cache_slots
        pipeline.flush()


# Two subgroups: 0 in chunks of 10, 10 and 5 elements, 1 in one chunk of 8. Parameters: (id, subgroup,
# offset, count): "a" spans chunks 0 and 1, "b" chunk 1, "c" chunks 1 and 2, "d" chunk 3.
FINAL_CHUNKS = [(0, 0, 10), (0, 10, 10), (0, 20, 5), (1, 0, 8)]
FINAL_PARAMS = [("a", 0, 0, 12), ("b", 0, 12, 4), ("c", 0, 16, 9), ("d", 1, 0, 8)]


@pytest.mark.parametrize(
    ("arrivals", "leads"),
    [
        # In backward's order, one at a time: a chunk is final with the last of its parameters.
        ([("d", 1.0), ("c", 2.0), ("b", 3.0), ("a", 4.0)], [6.0, 6.0, 8.0, 9.0]),
        # A parameter seen twice in one boundary counts once (its first time).
        ([("d", 1.0), ("d", 5.0), ("c", 2.0), ("c", 6.0), ("b", 3.0), ("a", 4.0)], [6.0, 6.0, 8.0, 9.0]),
        # A parameter that got no gradient leaves its chunks final only at the end (lead 0).
        ([("d", 1.0), ("c", 2.0), ("a", 4.0)], [6.0, 0.0, 8.0, 9.0]),
        # Final after backward's end (DeepSpeed's finalize at step(), without the engine): no lead.
        ([("d", 11.0), ("a", 12.0), ("b", 12.0), ("c", 12.0)], [0.0, 0.0, 0.0, 0.0]),
        ([], [0.0, 0.0, 0.0, 0.0]),
    ],
)
def test_a_chunk_gradient_is_final_with_the_last_of_its_parameters(
    arrivals: list[tuple[str, float]], leads: list[float]
) -> None:
    grads = overlap.GradsFinal(FINAL_CHUNKS, FINAL_PARAMS)
    for pid, at in arrivals:
        grads.final(pid, at)
    assert grads.leads(10.0) == leads
    # A parameter reduced again changed the gradients of its chunks after they were final.
    again = {pid for pid, _ in arrivals if [p for p, _ in arrivals].count(pid) > 1}
    assert grads.changed == {c for pid in again for c in grads.chunks_of(pid)}
    # Waiting: a final chunk at once, another not before backward's end makes every chunk final.
    arrived = {pid for pid, _ in arrivals}
    final = [all(pid in arrived for pid, *_ in FINAL_PARAMS if c in grads.chunks_of(pid)) for c in range(4)]
    assert [grads.wait(c, 0.01) for c in range(4)] == final
    grads.end(10.0)
    assert all(grads.wait(c, 0.0) for c in range(len(leads)))
    # The next boundary starts afresh.
    grads.reset()
    grads.final("d", 7.0)
    assert grads.leads(10.0) == [0.0, 0.0, 0.0, 3.0] and not grads.changed


# When each chunk's gradient was final (seconds before backward's end), backward's length, each chunk's
# time; how much of the update could run before backward ended, and the chunks worth updating in it (in
# the order they would run).
COULD_RUN = [
    ("every gradient final at backward's end", [0.0, 0.0, 0.0], 2.0, 0.5, 0.0, []),
    ("one chunk final a second before, taking half of it", [1.0], 2.0, 0.5, 0.5, [0]),
    ("one chunk final a second before, taking longer", [1.0], 2.0, 3.0, 1.0, [0]),
    ("two chunks final at once: one after the other", [2.0, 2.0], 2.0, 1.5, 2.0, [1, 0]),
    ("in the order their gradients came, gaps left idle", [0.5, 2.0, 1.5], 2.0, 0.25, 0.75, [1, 2, 0]),
    ("a chunk that would begin after backward's end is left out", [2.0, 2.0, 1.0], 2.0, 1.5, 2.0, [1, 0]),
    ("no chunks", [], 2.0, 1.0, 0.0, []),
]


@pytest.mark.parametrize(
    ("leads", "backward", "per_chunk", "hidden", "chosen"),
    [c[1:] for c in COULD_RUN],
    ids=[c[0] for c in COULD_RUN],
)
def test_what_could_run_during_backward_follows_the_gradients_final_times(
    leads: list[float], backward: float, per_chunk: float, hidden: float, chosen: list[int]
) -> None:
    assert planning.could_run_in_backward(leads, backward, per_chunk) == pytest.approx(hidden)
    assert planning.chunks_for_backward(dict(enumerate(leads)), backward, per_chunk) == chosen


# When each chunk's gradient was final (seconds before a 10 s backward's end), when the update began,
# the chunks in the order they ran and when each ended (seconds from backward's start); what a chunk took.
CHUNK_TIMES = [
    ("every gradient final early: end to end", [9.5] * 4, 0.5, [0, 1, 2, 3], [1.5, 2.5, 3.5, 4.5], 1.0),
    ("the update began late: its first chunk from then", [9.0] * 3, 3.0, [0, 1, 2], [3.5, 4.0, 4.5], 0.5),
    (
        "a chunk waited for its gradient: from when it was final",
        [10.0, 9.0, 5.0, 5.0],
        0.0,
        [0, 1, 2, 3],
        # 1 s, 2 s, then 2 s from 5 s (not from 3 s), 2 s
        [1.0, 3.0, 7.0, 9.0],
        1.75,
    ),
    # 1 s, 1 s, 1 s and a stall of 5 s: the chunks behind a stall wait for it.
    ("the mean, not the median", [9.0] * 4, 1.0, [3, 2, 1, 0], [2.0, 3.0, 4.0, 9.0], 2.0),
    (
        "chunks that ended after backward left out",
        [9.0] * 4,
        1.0,
        [0, 1, 2, 3],
        [2.0, 3.0, 4.0, 12.0],
        1.0,
    ),
    ("too few to say", [9.0] * 4, 1.0, [0, 1, 2, 3], [2.0, 3.0, 11.0, 12.0], None),
    ("a chunk taken whose pass did not end", [9.0] * 4, 1.0, [0, 1, 2], [2.0, 3.0], None),
]


@pytest.mark.parametrize(
    ("leads", "began", "taken", "ended", "secs"),
    [c[1:] for c in CHUNK_TIMES],
    ids=[c[0] for c in CHUNK_TIMES],
)
def test_what_a_chunk_took_during_backward_counts_from_when_it_could_begin(
    leads: list[float], began: float, taken: list[int], ended: list[float], secs: float | None
) -> None:
    got = planning.secs_per_chunk_in_backward(leads, 10.0, began, taken[: len(ended)], ended)
    assert got == (None if secs is None else pytest.approx(secs))


# The chunks' gradient times in chunk order's stream, backward, each chunk's time, the chunks chunk
# order's smaller cache loses; whether going to chunk order pays, what could run during backward, and
# the I/O the lost cache costs.
CHUNK_ORDER = [
    (
        "gradients final only at backward's end: nothing to gain",
        [0.0, 0.0, 0.0],
        2.0,
        0.5,
        1,
        False,
        0.0,
        0.5,
    ),
    ("most of the update hidden, one chunk lost", [2.0, 2.0, 1.0], 2.0, 0.5, 1, True, 1.5, 0.5),
    ("as much lost as hidden", [1.0], 2.0, 0.5, 1, False, 0.5, 0.5),
    ("nothing lost: any gain pays", [0.1], 2.0, 0.5, 0, True, 0.1, 0.0),
]


@pytest.mark.parametrize(
    ("leads", "backward", "per_chunk", "lost", "pays", "hidden", "extra"),
    [c[1:] for c in CHUNK_ORDER],
    ids=[c[0] for c in CHUNK_ORDER],
)
def test_chunk_order_pays_where_backward_hides_more_than_the_cache_it_loses_costs(
    leads: list[float], backward: float, per_chunk: float, lost: int, pays: bool, hidden: float, extra: float
) -> None:
    got = planning.chunk_order_pays(leads, backward, per_chunk, lost)
    assert got[0] == pays and got[1:] == pytest.approx((hidden, extra))


def test_the_plan_predicts_what_the_update_during_backward_leaves_after_it(tmp_path: Path) -> None:
    """The streamed chunks (those after the cache in chunk order; every chunk, where all are cached and
    may have kept copies) share the update's predicted time and run as their gradients were final at the
    last boundary; the rest is left after backward."""
    planner = UpdatePlanner(MLPOffloadConfig(paths=[str(tmp_path)], weights="equal"), rank=0)
    stream = SimpleNamespace(order=[0, 1, 2, 3], cache_slots=1, kept_limit=0, kept_copies=0)
    planner._pipeline = stream  # type: ignore[assignment]
    # Chunks 1, 2, 3 stream, final 2, 1 and 0 s before a 2 s backward's end; 1 s each of a 3 s update:
    # chunks 1 and 2 run during backward, chunk 3 after it.
    grads: GradsFinal = {"backward_secs": 2.0, "lead_secs": [0.0, 2.0, 1.0, 0.0]}
    assert planner._left_after_backward(3.0, grads) == pytest.approx(1.0)
    # Gradients final only at backward's end: the whole update is left.
    at_the_end: GradsFinal = {"backward_secs": 2.0, "lead_secs": [0.0] * 4}
    assert planner._left_after_backward(3.0, at_the_end) == 3.0
    # A chunk took 2 s during the recent backwards (the median of their measures): chunk 1 runs from 0
    # to 2 s, chunk 2 begins at backward's end. 1 s of the update (chunk 1's, inside step()) is not left.
    for secs in (2.0, 2.0, 0.1):
        planner.observe_backward_chunks(secs)
    assert planner.backward_chunk_secs() == 2.0
    assert planner._left_after_backward(3.0, grads) == pytest.approx(2.0)
    # The cached chunk's compute (0.3 s) is not the streamed chunks' to share: each is 0.9 s of the 3 s
    # inside step(), and during backward 2 s; 0.9 s of the update is not left.
    assert planner._left_after_backward(3.0, grads, adam_secs_per_chunk=0.3) == pytest.approx(2.1)
    stream.cache_slots = 4
    assert planner._left_after_backward(3.0, grads) == 3.0, "nothing streams"
    # Every chunk cached, with kept copies: each chunk 0.75 s of the update; chunk 1 runs during backward
    # (2 s there), chunk 2 would begin at its end.
    stream.kept_limit = 4
    assert planner._left_after_backward(3.0, grads) == pytest.approx(2.25)
    # At 0.5 s a chunk during backward, chunks 1 and 2 begin before it ends (2 of them), but one kept
    # copy is held: one chunk's part.
    planner._backward_chunks.clear()
    planner.observe_backward_chunks(0.5)
    assert planner._left_after_backward(3.0, grads) == pytest.approx(1.5)
    stream.kept_copies = 1
    assert planner._left_after_backward(3.0, grads) == pytest.approx(2.25)
    # An update predicted at 0 s (every chunk cached, planned from the probe's profile under the
    # README's section), nothing measured during backward yet: nothing is left (it divided by zero).
    planner._backward_chunks.clear()
    assert planner._left_after_backward(0.0, grads) == 0.0


@pytest.fixture
def eight_mib(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs."""
    yield from mounted_tmpfs(tmp_path / "small", "8m")


def test_second_slots_keep_a_tenth_of_the_disk_free_or_raise_naming_the_file(eight_mib: Path) -> None:
    """`ChunkedState.with_second_slots` on a real file system running out of space: with `keep_free`,
    each chunk in turn gets its second slot while the path keeps a tenth of its file system free, then
    it stops, saying why; chunks that have one are taken without more room, also by a later process.
    Without `keep_free`, a full path raises ENOSPC naming the chunk's file, and the chunk stays as it
    was."""
    small = eight_mib
    chunk_bytes = 512 << 10
    # Four chunks of about 512 KiB of state each.
    numel = 4 * memory.chunk_layout([1 << 20], 1 << 30, chunk_bytes).elements
    layout = memory.chunk_layout([numel], 16 * chunk_bytes, chunk_bytes)
    with ObjectStore([small], shadow_slots=False) as store:
        state = ChunkedState(store, [numel], layout, cache_chunks=0, lock=False)
        state.initialize(lambda i: torch.zeros(numel, dtype=torch.bfloat16))
        chunks = list(range(len(layout.chunks)))
        assert len(chunks) == 4 and state.slotted == set()
        # Free: a tenth of the file system and two and a half chunks.
        fs = os.statvfs(small)
        keep = fs.f_blocks * fs.f_frsize // 10
        filler = small / "filler"
        filler.write_bytes(b"\0" * (fs.f_bavail * fs.f_frsize - keep - 5 * chunk_bytes // 2))
        assert state.with_second_slots([3, 2, 1, 0], keep_free=True) == [3, 2]
        assert state.slotted == {2, 3} and state.slot_bytes >= 2 * layout.sizes[0]
        assert (
            state.slots_short is not None
            and str(small) in state.slots_short
            and "chunk 1" in state.slots_short
        )
        # Those with a slot are taken without more room; the adding stops at the first without.
        assert state.with_second_slots([2, 1, 3], keep_free=True) == [2, 3]
        # Without keep_free the tenth is used, and a full path is an error naming the file.
        assert state.with_second_slots([1], keep_free=False) == [1]
        filler.unlink()
        subprocess.run(
            ["fallocate", "-l", str(os.statvfs(small).f_bavail * fs.f_frsize), str(filler)], check=True
        )
        with pytest.raises(OSError) as e:
            state.with_second_slots([0], keep_free=False)
        assert e.value.errno == errno.ENOSPC and e.value.filename.endswith(f"{state.keys[0]}.mlpo")
        assert state.slotted == {1, 2, 3}
        # Each staged write lands in its chunk's second slot; chunk 0 refuses one by name.
        view = torch.ones(layout.sizes[1], dtype=torch.uint8)
        store.write(state.keys[1], view, staged=True).wait()
        store.commit(state.keys[1])
        with pytest.raises(ValueError, match=f'shadow_slots: object "{state.keys[0]}"'):
            store.write(state.keys[0], torch.ones(layout.sizes[0], dtype=torch.uint8), staged=True)
        # Room for the manifest the store writes as it closes.
        filler.unlink()
        state.pipeline.close()
    # A later process on the same path (a job resumed) knows the second slots from the store's manifest,
    # and takes those chunks on a path with less than a tenth free.
    with ObjectStore([small], shadow_slots=False) as store:
        state = ChunkedState(store, [numel], layout, cache_chunks=0, lock=False)
        assert state.slotted == {1, 2, 3}
        filler.write_bytes(b"\0" * (os.statvfs(small).f_bavail * fs.f_frsize - keep // 2))
        assert state.with_second_slots([3, 2, 1], keep_free=True) == [3, 2, 1]
        assert state.slots_short is None and state.slot_bytes == 0
        filler.unlink()
        state.pipeline.close()


def test_second_slots_the_plan_stopped_choosing_go_back_to_the_file_system(eight_mib: Path) -> None:
    """`ChunkedState.give_back_idle_slots` on a real file system: a chunk's second slot, not chosen for
    `SLOT_IDLE_BOUNDARIES` boundaries in a row, goes back (its blocks free again, the chunk's contents
    as they were) once its current version lies in slot 0; one in slot 1 waits for its next write; a
    chosen chunk starts counting again. A later process knows which chunks kept theirs. With shadow
    slots every chunk keeps two."""
    small = eight_mib
    chunk_bytes = 512 << 10
    numel = 4 * memory.chunk_layout([1 << 20], 1 << 30, chunk_bytes).elements
    layout = memory.chunk_layout([numel], 16 * chunk_bytes, chunk_bytes)

    def contents(c: int) -> torch.Tensor:
        return torch.full((layout.sizes[c],), c + 1, dtype=torch.uint8)

    def free() -> int:
        fs = os.statvfs(small)
        return fs.f_bavail * fs.f_frsize

    with ObjectStore([small], shadow_slots=False) as store:
        state = ChunkedState(store, [numel], layout, cache_chunks=0, lock=False)
        keys = state.keys
        for c in range(4):
            store.write(keys[c], contents(c)).wait()
        assert state.with_second_slots([0, 1, 2, 3], keep_free=False) == [0, 1, 2, 3]
        # Chunk 1's current version in slot 1: staged there and kept.
        store.write(keys[1], contents(1), staged=True).wait()
        store.commit(keys[1])
        before = free()
        for _ in range(state_module.SLOT_IDLE_BOUNDARIES - 1):
            state.give_back_idle_slots({2, 3})
        assert state.slotted == {0, 1, 2, 3} and free() == before
        # The fourth: chunk 0 goes back, chunk 1 (in slot 1) waits; chunk 2, chosen until now, starts
        # counting.
        state.give_back_idle_slots({3})
        assert state.slotted == {1, 2, 3} and state.slots_given_back == 1
        assert state.slot_bytes_given_back >= layout.sizes[0]
        # Its blocks are free again (the manifest, rewritten, may take a page more or less).
        assert abs(free() - before - state.slot_bytes_given_back) <= 4096
        assert [store.slots(k) for k in keys] == [1, 2, 2, 2]
        # Chunk 1 after its next write (to slot 0); chunk 2 after its own idle boundaries.
        store.write(keys[1], contents(1)).wait()
        state.give_back_idle_slots({3})
        assert state.slotted == {2, 3} and state.slots_given_back == 2
        for _ in range(state_module.SLOT_IDLE_BOUNDARIES - 2):
            state.give_back_idle_slots({3})
        assert state.slotted == {3} and [store.slots(k) for k in keys] == [1, 1, 1, 2]
        for c in range(4):
            back = torch.empty(layout.sizes[c], dtype=torch.uint8)
            store.read(keys[c], back).wait()
            assert torch.equal(back, contents(c)), c
        # A chunk given back gets a slot again when chosen.
        assert state.with_second_slots([0], keep_free=False) == [0]
        state.pipeline.close()
    with ObjectStore([small], shadow_slots=False) as store:
        state = ChunkedState(store, [numel], layout, cache_chunks=0, lock=False)
        assert state.slotted == {0, 3}
        state.pipeline.close()
    # With shadow slots every chunk keeps its two.
    (small / "shadow").mkdir()
    with ObjectStore([small / "shadow"]) as store:
        state = ChunkedState(store, [numel], layout, cache_chunks=0, lock=False, shadow_slots=True)
        for c in range(4):
            store.write(state.keys[c], contents(c)).wait()
        for _ in range(state_module.SLOT_IDLE_BOUNDARIES):
            state.give_back_idle_slots(set())
        assert state.slotted == {0, 1, 2, 3} and state.slots_given_back == 0
        state.pipeline.close()


def test_an_update_behind_step_lets_done_subgroups_through_and_raises_its_own_error() -> None:
    """`UpdateInFlight`: a wait for subgroups already done returns while the update goes on; one for a
    subgroup the update failed before raises the update's own error (an `OSError` keeps its errno and
    file), noting the step; so does waiting for the whole update."""
    go_on = threading.Event()

    def run(done: Any) -> str:
        done(0)
        go_on.wait()
        done(1)
        raise OSError(errno.EIO, "Input/output error", "/paths/a/rank0/c2.mlpo")

    thread = update_thread()
    inflight = UpdateInFlight(run, subgroups=3, step=7, thread=thread)
    inflight.wait_for([0])
    go_on.set()
    inflight.wait_for([1, 0])
    with pytest.raises(OSError, match="Input/output error") as raised:
        inflight.wait_for([0, 2])
    assert raised.value.errno == errno.EIO and raised.value.filename == "/paths/a/rank0/c2.mlpo"
    assert "the update of step 7, before subgroup 2 was updated" in "".join(raised.value.__notes__)
    with pytest.raises(OSError, match="Input/output error"):
        inflight.result()
    assert inflight.waited_secs > 0

    def update_both(done: Callable[[int], None]) -> str:
        for i in range(2):
            done(i)
        return "stats"

    finished = UpdateInFlight(update_both, subgroups=2, step=8, thread=thread)
    assert finished.result() == "stats"
    finished.wait_for([1])
    thread.shutdown()


def sums_at(view: torch.Tensor, starts: list[int] | None) -> list[int] | None:
    """Each stripe's CRC32C of `view`'s bytes, cut at `starts` (None: none asked for)."""
    if starts is None:
        return None
    ends = [*starts[1:], view.numel()]
    return [_core.crc32c(view[a:b].numpy()) for a, b in zip(starts, ends, strict=True)]


def test_sums_from_the_update_are_the_stores_and_a_corrupt_read_is_kept_nowhere(
    engine: str, work_dirs: list[Path]
) -> None:
    """With `checksums_in_update`, the update hashes each chunk as read and as written (here in Python;
    the fused kernel in the engine): a store reopened later verifies every chunk with the sums it was
    given, and a chunk damaged on disk raises CorruptObjectError naming its file before anything made of
    it is written or cached."""
    chunks, size = 6, 3 * 4096 * 8
    keys = [f"c{i}" for i in range(chunks)]
    asked: list[tuple[list[int] | None, list[int] | None]] = []

    def bump(
        index: int, view: torch.Tensor, read_cuts: list[int] | None, write_cuts: list[int] | None
    ) -> Any:
        asked.append((read_cuts, write_cuts))
        read_sums = sums_at(view, read_cuts)
        view.add_(1)
        return read_sums, sums_at(view, write_cuts)

    with ObjectStore(work_dirs[:2], engine=engine, weights=[1.0, 2.0]) as store:
        pipeline = ChunkPipeline(store, keys, [size] * chunks, 3)
        pipeline.initialize(lambda i, view: view.fill_(i))
        for _ in range(3):
            pipeline.run_step(bump, drain=True, checksums_in_update=True)
        # Chunks read from the store were verified, at their stripes; cached ones were not read.
        assert any(r is not None for r, _ in asked) and all(r is None or r[0] == 0 for r, _ in asked)
        assert all(w is None or len(w) == 2 for _, w in asked), "two paths: two stripes per write"
        pipeline.flush()
    with ObjectStore(work_dirs[:2], engine=engine, weights=[1.0, 2.0]) as store:
        for i in range(chunks):
            back = torch.empty(size, dtype=torch.uint8)
            store.read(keys[i], back).wait()  # the store verifies the sums the update gave it
            assert torch.equal(back, torch.full((size,), i + 3, dtype=torch.uint8)), i
        pipeline = ChunkPipeline(store, keys, [size] * chunks, 3, cache_slots=0)
        victim = pipeline.order[0]
        path = work_dirs[1] / "rank0" / f"{keys[victim]}.mlpo"
        raw = bytearray(path.read_bytes())
        raw[123] ^= 0x10
        path.write_bytes(bytes(raw))
        before = {k: store.placement(k) for k in keys}
        with pytest.raises(CorruptObjectError, match="checksum mismatch") as e:
            pipeline.run_step(bump, drain=True, checksums_in_update=True)
        assert e.value.filename == str(path)
        assert victim not in pipeline.resident and store.placement(keys[victim]) == before[keys[victim]]


def test_replace_reaches_resident_retained_and_stored_chunks(engine: str, work_dirs: list[Path]) -> None:
    """What DeepSpeed's helpers and checkpoint loading write between steps becomes each chunk's state,
    wherever its current copy is: a cache slot, a buffer still holding its last write, or the store."""
    keys, sizes = [f"c{i}" for i in range(12)], [4096] * 12
    with ObjectStore(work_dirs[:1], engine=engine) as store:
        pipeline = ChunkPipeline(store, keys, sizes, 8, cache_slots=2)
        pipeline.initialize(lambda i, view: view.fill_(i))
        # The initial writes' last buffers are the first step's first chunks: no read for them.
        assert len(pipeline.retained) == 8 and pipeline.order[:8] == sorted(pipeline.retained, reverse=True)
        assert pipeline.run_step(lambda i, view: view.add_(1), drain=False).reads == 4
        resident, retained = pipeline.resident[0], pipeline.retained[0]
        stored = next(c for c in range(12) if c not in pipeline.resident + pipeline.retained)
        for chunk in (resident, retained, stored):
            pipeline.replace(chunk, torch.full((4096,), 100, dtype=torch.uint8))
        pipeline.run_step(lambda i, view: view.add_(1), drain=False)
        pipeline.flush()
        for chunk in range(12):
            back = torch.empty(4096, dtype=torch.uint8)
            store.read(keys[chunk], back).wait()
            expected = 101 if chunk in (resident, retained, stored) else chunk + 2
            assert torch.equal(back, torch.full((4096,), expected, dtype=torch.uint8)), chunk


@pytest.mark.parametrize(
    ("previous", "resident", "retained", "expected"),
    [
        ([0, 1, 2, 3], set(), set(), [3, 2, 1, 0]),  # no cache: the alternating order
        ([0, 1, 2, 3, 4], {3, 4}, {2}, [2, 4, 3, 1, 0]),  # retained, then resident, then the rest
        ([2, 4, 3, 1, 0], {1, 0}, {3}, [3, 0, 1, 4, 2]),
    ],
)
def test_the_next_order_starts_with_what_memory_holds(
    previous: list[int], resident: set[int], retained: set[int], expected: list[int]
) -> None:
    assert next_order(previous, resident, retained) == expected


def test_too_few_buffers_is_a_clear_error(work_dirs: list[Path]) -> None:
    with ObjectStore(work_dirs[:1]) as store:
        with pytest.raises(ValueError, match=r"^buffers:"):
            ChunkPipeline(store, ["a"], [4096], 0)
        with pytest.raises(ValueError, match=r"^cache_chunks:"):
            ChunkPipeline(store, ["a", "b", "c"], [4096] * 3, 2, cache_slots=2)
        with pytest.raises(ValueError, match=r"^keys:"):
            ChunkPipeline(store, ["a"], [4096] * 2, 2)


def fast_profile(paths: list[Path]) -> profiles.Profile:
    """A profile claiming 1 TB/s on every path: any prediction made from it alone is far too short."""
    probe = {
        "device_id": "d",
        "read_bytes_per_s": 1e12,
        "write_bytes_per_s": 1e12,
        "mixed_bytes_per_s": 1e12,
        "concurrent_bytes_per_s": 1e12,
        "best_read": {"max_inflight": 8},
    }
    return profiles.Profile([str(p) for p in paths], [dict(probe) for _ in paths], time.time())


# name, chunks, buffers (the cache is what the stream leaves)
PREDICTIONS = [("the state streamed", 24, 13), ("every chunk cached: no bytes move", 4, 12)]


@pytest.mark.parametrize(("chunks", "buffers"), [p[1:] for p in PREDICTIONS], ids=[p[0] for p in PREDICTIONS])
def test_each_step_is_predicted_from_what_the_steps_before_it_measured(
    work_dirs: list[Path], chunks: int, buffers: int
) -> None:
    """The probe's figure (here 1 TB/s) is replaced by the paths' measured bytes per busy second as
    soon as steps have measured them; with nothing to measure (all cached) the prediction still comes."""
    sizes = [4 << 20] * chunks
    with ObjectStore(work_dirs[:2]) as store:
        pipeline = ChunkPipeline(store, [f"c{i}" for i in range(chunks)], sizes, buffers)
        pipeline.initialize(lambda i, view: view.fill_(i))
        planner = UpdatePlanner(MLPOffloadConfig(paths=[str(p) for p in work_dirs[:2]]), rank=0)
        planner.profile, planner._pipeline = fast_profile(work_dirs[:2]), pipeline
        planner.tuner = WeightTuner(planner._replan()["path_bytes_per_s"])
        for step in range(5):
            stats = pipeline.run_step(lambda i, view: None, drain=False)
            times = StepTimes(stats.seconds, None if step == 0 else 0.01, 0.0, 0.001)
            planner.after_step(store, stats, times, StepParts())
        records = [r for r in planner.records if r["event"] == "step"]
        assert planner.prediction is not None and planner.prediction > 0
        if pipeline.cache_slots < chunks:
            # Four measured steps moved 2 x 20 chunks of 4 MiB each: the prediction follows what they took.
            took = sorted(r["pipeline_secs"] for r in records[1:])[len(records[1:]) // 2]
            assert planner.prediction > took / 4, (planner.prediction, took)
        planner.close()


def test_the_adam_time_per_chunk_counts_only_the_chunks_updated_inside_step(work_dirs: list[Path]) -> None:
    """Where the update during backward was kept, its chunks are not in the step's compute time: a chunk's
    Adam time is that over the chunks `step()` updated, and the next prediction (every chunk cached here:
    compute alone) is the same as a step that computed them all in the same time per chunk."""
    sizes = [4 << 20] * 4
    predictions = []
    for compute_secs, kept_chunks in ((0.4, 0), (0.2, 2)):
        with ObjectStore(work_dirs[:1]) as store:
            pipeline = ChunkPipeline(store, [f"c{i}" for i in range(4)], sizes, 12)
            pipeline.initialize(lambda i, view: view.fill_(i))
            planner = UpdatePlanner(MLPOffloadConfig(paths=[str(work_dirs[0])]), rank=0)
            planner.profile, planner._pipeline = fast_profile(work_dirs[:1]), pipeline
            stats = pipeline.run_step(lambda i, view: None, drain=False)
            # Only the keys the prediction reads.
            kept = cast(BackwardStep, {"chunks": kept_chunks, "kept": True})
            overlap_backward = kept if kept_chunks else None
            times = StepTimes(stats.seconds, 0.01, 0.0, compute_secs)
            planner.after_step(store, stats, times, StepParts(overlap_backward=overlap_backward))
            predictions.append(planner.prediction)
            planner.close()
    assert predictions[0] is not None and predictions[0] > 0.0
    assert predictions[1] == pytest.approx(predictions[0]), predictions


class LaterBumps(Bumps):
    """`Bumps` whose chunks in `later` are updated on a thread of their own after the call returns (as
    the accelerator's copies and kernel run on after their queueing): the update returns a
    `DeferredUpdate`, and the chunk's buffer must stay untouched until it is done."""

    def __init__(self, chunks: int, later: set[int]) -> None:
        super().__init__(chunks)
        self.later = later
        self.finished: list[int] = []

    def __call__(self, index: int, view: torch.Tensor) -> Any:
        if index not in self.later:
            return super().__call__(index, view)
        self.seen[-1].append(index)

        def later() -> None:
            time.sleep(0.005)
            view.add_(1)

        worker = threading.Thread(target=later)
        worker.start()

        def finish() -> None:
            assert not worker.is_alive(), "finished before it was done"
            self.finished.append(index)

        return pipeline_module.DeferredUpdate(lambda: not worker.is_alive(), finish, worker.join)


# chunks, buffers, cache_chunks, the chunks updated later
DEFERRED = [
    (6, 6, None, {4, 5}),  # every chunk cached: the later ones cached once done
    (8, 3, 0, {0, 1, 2}),  # the bare stream, as many later as buffers: the loop waits for them to free one
    (8, 4, 2, {1, 3, 5, 7}),  # cached and streamed, later ones among them
    (5, 2, None, {0, 1, 2, 3, 4}),  # every chunk later
]


@pytest.mark.parametrize(("chunks", "buffers", "cache", "later"), DEFERRED)
def test_updates_that_go_on_past_their_call_are_placed_once_done(
    engine: str, work_dirs: list[Path], chunks: int, buffers: int, cache: int | None, later: set[int]
) -> None:
    bump = LaterBumps(chunks, later)
    with ObjectStore(work_dirs[:2], engine=engine) as store:
        pipeline = ChunkPipeline(store, bump.keys, bump.sizes, buffers, cache_slots=cache)
        pipeline.initialize(lambda i, view: view.fill_(i))
        steps = 3
        for step in range(steps):
            bump.seen.append([])
            pipeline.run_step(bump, drain=step % 2 == 0)
            assert sorted(bump.seen[-1]) == list(range(chunks))
        assert sorted(bump.finished) == sorted(list(later) * steps), "each finished once a step"
        pipeline.flush()
        bump.assert_stored(store, steps)


def test_a_step_that_fails_waits_for_its_updates_still_going_on(work_dirs: list[Path]) -> None:
    """The host's update raises while a chunk's update goes on past its call: the step waits for that one
    (no copy may land in a buffer given back), finishes none, and raises the failure."""
    bump = LaterBumps(4, set())
    waited: list[int] = []
    with ObjectStore(work_dirs[:1]) as store:
        pipeline = ChunkPipeline(store, bump.keys, bump.sizes, 4, cache_slots=0)
        pipeline.initialize(lambda i, view: view.fill_(i))
        order = pipeline.order
        bump.later = {order[0]}

        def update(index: int, view: torch.Tensor) -> Any:
            if index == order[2]:
                raise OSError(errno.EIO, "the host's pass failed")
            result = bump(index, view)
            if isinstance(result, pipeline_module.DeferredUpdate):
                join = result.wait

                def wait() -> None:
                    join()
                    waited.append(index)

                result.done = lambda: False
                result.wait = wait
            return result

        bump.seen.append([])
        with pytest.raises(OSError, match="the host's pass failed"):
            pipeline.run_step(update)
        assert waited == [order[0]] and bump.finished == []
