"""The update phase's subgroup pipeline against the real store: order, cache, and state kept exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mlp_offload import ObjectStore
from mlp_offload.pipeline import SubgroupPipeline, step_order


@pytest.mark.parametrize(
    ("subgroups", "buffers", "cache", "cached"),
    [
        (5, 1, None, 0),  # one buffer: read, update, write, one subgroup at a time
        (5, 2, None, 0),
        (5, 3, None, 0),  # the bare pipeline: nothing stays
        (5, 5, None, 2),  # some stay
        (5, 5, 4, 4),  # as many as asked, one buffer left for the rest
        (4, 9, None, 4),  # all stay: after the first step no I/O at all
        (1, 3, None, 0),
    ],
)
def test_every_step_updates_every_subgroup_once_and_the_cache_skips_io(
    engine: str, work_dirs: list[Path], subgroups: int, buffers: int, cache: int | None, cached: int
) -> None:
    sizes = [(64 << 10) + 4096 * i for i in range(subgroups)]
    seen: list[list[int]] = []

    def bump(index: int, view: torch.Tensor) -> None:
        seen[-1].append(index)
        view.add_(1)

    with ObjectStore(work_dirs[:2], engine=engine) as store:
        pipeline = SubgroupPipeline(store, sizes, buffers, cache_subgroups=cache)
        assert pipeline.cache_slots == cached
        pipeline.initialize(lambda i, view: view.fill_(i))
        steps = 4
        for step in range(steps):
            seen.append([])
            # Odd steps leave their last writes in flight, as training does; even ones wait for them.
            drain = step % 2 == 0
            retained_before = len(pipeline.retained)
            stats = pipeline.run_step(bump, drain=drain)
            assert seen[-1] == step_order(step, subgroups)
            # The first step reads everything; later ones skip the subgroups kept from the step before,
            # and those whose buffers still hold them from the last writes.
            assert stats.retained == retained_before
            assert stats.reads == subgroups - (cached if step else 0) - stats.retained
            assert stats.writes == subgroups - cached
            assert stats.cached == (cached if step else 0)
            assert sorted(pipeline.resident) == sorted(step_order(step, subgroups)[subgroups - cached :])
            if not drain and subgroups > cached:
                assert pipeline.retained, "the last writes keep their buffers"
        pipeline.flush()
        for i, size in enumerate(sizes):
            back = torch.empty(size, dtype=torch.uint8)
            store.read(pipeline.key(i), back).wait()
            assert torch.equal(back, torch.full((size,), i + steps, dtype=torch.uint8)), f"subgroup {i}"


def test_the_order_alternates() -> None:
    assert step_order(0, 3) == [0, 1, 2] and step_order(1, 3) == [2, 1, 0] and step_order(2, 3) == [0, 1, 2]


def test_too_few_buffers_is_a_clear_error(work_dirs: list[Path]) -> None:
    with ObjectStore(work_dirs[:1]) as store:
        with pytest.raises(ValueError, match=r"^buffers:"):
            SubgroupPipeline(store, [4096], 0)
        with pytest.raises(ValueError, match=r"^cache_subgroups:"):
            SubgroupPipeline(store, [4096] * 3, 2, cache_subgroups=2)
