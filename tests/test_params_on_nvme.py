"""The parameters on NVMe (`offload_param.device: "nvme"`, ZeRO-Infinity). Their partitions are objects
of our store behind DeepSpeed's parameter swapper (`mlp_offload.adapter.param_swapper`): its protocol on
real files. Past `offload_param.max_in_cpu` DeepSpeed keeps whole subgroups there, which the update reads
and writes through `adapter.nvme_partitions`: every precision mode, two ranks, accumulation with
clipping, frozen and tied parameters, activation checkpointing, checkpoints loaded whole or in part
(stock's too), a universal checkpoint at another degree, a kill -9 resumed anew and the README's section,
each bit-equal to stock. Ours needs no DeepSpeed async I/O op: stock runs its CPU offload, bit-equal to
its NVMe offload where that runs (the rows with stock's own ZeRO-Infinity run where the op is built, as
`make test` builds it, `make deepspeed-aio`; stock's own fails the other rows' configs: its prefetch
double-books a buffer, its load copies into a subgroup it has no buffer for)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conftest import ONE_NODE
from deepspeed_runs import (
    AIO_BUILT,
    SAVE_AT,
    STATE_MODES,
    assert_bit_equal,
    from_step,
    run_case,
    save_and_convert,
    section,
    stock_param_nvme_fails,
    stock_universal_resume,
    universal,
)
from mlp_offload import _core
from mlp_offload.adapter.param_swapper import (
    PARAMS_FOLDER,
    FetchCounts,
    FetchOrder,
    StoreParamSwapper,
    UpdateBehind,
    Writes,
    require_ours,
    swapper_class,
)
from mlp_offload.adapter.troubleshooting import met
from mlp_offload.engine import profiles
from mlp_offload.engine.buffers import MadeBuffers, page_aligned

pytestmark = pytest.mark.deepspeed


def ds_config(
    paths: list[Path],
    nvme_path: Path | None = None,
    zero: dict[str, Any] | None = None,
    ours: dict[str, Any] | None = None,
    **aio: int,
) -> Any:
    from deepspeed.runtime.config import DeepSpeedConfig

    offload = {"device": "nvme", "nvme_path": str(nvme_path or paths[0])}
    return DeepSpeedConfig(
        {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "offload_param": offload, **(zero or {})},
            "aio": aio,
            "mlp_offload": section(paths, **(ours or {})),
        }
    )


def partition(ds_id: int, numel: int, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A parameter as the swapper sees one: its id, its dtype and its partition, not yet on NVMe."""
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus

    tensor = torch.empty(0)
    tensor.ds_numel = numel  # type: ignore[attr-defined]
    tensor.status = PartitionedParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
    return SimpleNamespace(ds_id=ds_id, ds_tensor=tensor, dtype=dtype)


def written(swapper: StoreParamSwapper, param: Any, values: torch.Tensor) -> None:
    """As `zero.Init` writes a partition: into the swapper's buffer, then out."""
    swapper.get_buffer(param, values.numel()).copy_(values)
    param.ds_tensor.data = swapper.buffers[param.ds_id].data
    swapper.swap_out_and_release([param])


@pytest.fixture
def swapper(work_dirs: list[Path]) -> StoreParamSwapper:
    return StoreParamSwapper(ds_config(work_dirs[:2]), torch.bfloat16, rank=0)


def test_a_partition_goes_to_the_store_and_back_with_deepspeeds_statuses(swapper: StoreParamSwapper) -> None:
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus as Status

    values = [torch.randn(n).to(torch.bfloat16) for n in (600_000, 700_001)]
    params = [partition(i, v.numel()) for i, v in enumerate(values)]
    for param, v in zip(params, values, strict=True):
        written(swapper, param, v)
        assert param.ds_tensor.status == Status.NOT_AVAILABLE and param.ds_tensor.numel() == 1
    assert sorted(swapper.store.keys()) == ["param0", "param1"] and not swapper.buffers
    swapper.swap_in(params, async_op=True)
    assert [p.ds_tensor.status for p in params] == [Status.INFLIGHT] * 2
    with pytest.raises(RuntimeError, match="parameter 0: read asked for while its partition is"):
        swapper.swap_in(params[:1])
    swapper.synchronize_reads()
    for param, v in zip(params, values, strict=True):
        assert param.ds_tensor.status == Status.AVAILABLE and torch.equal(param.ds_tensor, v)
        # Page-aligned, so the store reads it with O_DIRECT.
        assert param.ds_tensor.data_ptr() % 4096 == 0
    addresses = {p.ds_tensor.data_ptr() for p in params}
    swapper.remove_partition_and_release_buffers(params)
    assert not swapper.buffers and params[0].ds_tensor.status == Status.NOT_AVAILABLE
    # Read again, each into a buffer let go before (no new memory to fault in), within the most held; each
    # once, though DeepSpeed's prefetch lists a parameter as often as its trace uses it.
    swapper.take_fetched()
    swapper.swap_in([*params, params[0]], async_op=False)
    assert swapper.take_fetched()["forward"].bytes == 2 * sum(v.numel() for v in values)
    assert {p.ds_tensor.data_ptr() for p in params} == addresses
    assert all(torch.equal(p.ds_tensor, v) for p, v in zip(params, values, strict=True))
    swapper.remove_partition_and_release_buffers(params)
    peak = swapper.peak_bytes
    assert swapper.held_bytes == 0 and swapper.free_bytes == peak
    # A partition of another size: the kept buffers go first, so the memory stays within the most held.
    written(swapper, partition(9, 900_000), torch.ones(900_000, dtype=torch.bfloat16))
    assert swapper.peak_bytes == peak and swapper.free_bytes + swapper.held_bytes <= peak
    # Read into DeepSpeed's own flat buffer, where it stays available.
    flat = torch.zeros(values[0].numel() + 8, dtype=torch.bfloat16)
    swapper.swap_into_buffer(params[0], flat.narrow(0, 8, values[0].numel()))
    assert torch.equal(flat[8:], values[0]) and params[0].ds_tensor.status == Status.AVAILABLE


def test_a_held_partition_is_copied_only_while_a_fetch_holds_it(swapper: StoreParamSwapper) -> None:
    """The update's copies out of and into a partition a fetch holds (`copy_held`): while it is in flight
    or let go, none (the update then reads and writes its object); held, both ways, and the write of the
    same values from other memory keeps it out of the cache when let go."""
    values = torch.randn(600_000).to(torch.bfloat16)
    param = partition(0, values.numel())
    written(swapper, param, values)
    swapper.cache_limit = 1 << 30
    out = torch.zeros_like(values)
    assert not swapper.copy_held(param, out)
    swapper.swap_in([param], async_op=True)
    assert not swapper.copy_held(param, out) and not out.any()
    swapper.synchronize_reads()
    assert swapper.copy_held(param, out) and torch.equal(out, values)
    new = (values.float() + 1).to(torch.bfloat16)
    assert swapper.copy_held(param, new, into=True) and torch.equal(param.ds_tensor, new)
    swapper.write_partitions([(param, new)])
    swapper.remove_partition_and_release_buffers([param])
    assert not swapper.copy_held(param, out, into=True) and param.ds_id not in swapper.cached
    swapper.read_partitions([(param, out)])
    assert torch.equal(out, new)
    swapper.store.close()


def test_the_partitions_keep_the_parameters_dtype_whatever_deepspeed_gives_the_swapper(
    swapper: StoreParamSwapper, caplog: pytest.LogCaptureFixture
) -> None:
    """DeepSpeed's `zero.Init` gives its swapper bfloat16 where the accelerator lacks fp16, whatever the
    model's dtype (`Init._set_dtype`; the fixture's swapper is built so): an fp32 model's partitions stay
    fp32, bit for bit; a partition of another dtype after the first is an error naming it."""
    values = torch.randn(600_000)
    param = partition(0, values.numel(), torch.float32)
    written(swapper, param, values)
    assert met("swapper-dtype", caplog.text), caplog.text
    swapper.swap_in([param], async_op=False)
    assert param.ds_tensor.dtype == torch.float32 and torch.equal(param.ds_tensor, values)
    assert swapper.take_fetched()["forward"].bytes == 4 * values.numel()
    with pytest.raises(RuntimeError, match=r"parameter 1: a partition of torch\.bfloat16 where the others"):
        swapper.get_buffer(partition(1, 600_000), 600_000)


@pytest.mark.parametrize(
    ("asked", "upcoming"),
    [
        ([], [0, 1, 2, 1, 0]),
        ([0], [1, 2, 1, 0]),
        ([0, 1, 2], [1, 0]),
        # The backward's second use of 1, then a partition out of order: its next place.
        ([0, 1, 2, 1], [0]),
        ([0, 2], [1, 0]),
        ([0, 1, 2, 1, 0], []),
        # Asked again after the order's end: its first place.
        ([0, 1, 2, 1, 0, 1], [2, 1, 0]),
        ([7], [0, 1, 2, 1, 0]),
    ],
)
def test_the_fetch_order_follows_the_step_before(asked: list[int], upcoming: list[int]) -> None:
    order = FetchOrder()
    for ds_id in [0, 1, 2, 1, 0]:
        order.asked(ds_id)
    assert list(order.upcoming()) == [], "no step before the first"
    order.end_step()
    for ds_id in asked:
        order.asked(ds_id)
    assert list(order.upcoming()) == upcoming


def test_partitions_are_read_ahead_in_the_order_the_step_before_fetched(swapper: StoreParamSwapper) -> None:
    """The second step's first fetch reads the next partitions ahead (within DeepSpeed's prefetch bucket,
    here all three), outside DeepSpeed's statuses; a fetch takes its partition from them; a partition
    written meanwhile is read again, not taken old; the step's end drops what no fetch took."""
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus as Status

    values = [torch.randn(600_000).to(torch.bfloat16) for _ in range(4)]
    params = [partition(i, v.numel()) for i, v in enumerate(values)]
    for param, v in zip(params, values, strict=True):
        written(swapper, param, v)

    def fetched(param: Any) -> torch.Tensor:
        swapper.swap_in([param], async_op=False)
        taken = param.ds_tensor.clone()
        swapper.remove_partition_and_release_buffers([param])
        return taken

    for param in params[:3]:
        fetched(param)
    assert swapper.take_fetched()["forward"].ahead_bytes == 0 and not swapper.ahead
    swapper.end_step()
    assert torch.equal(fetched(params[0]), values[0])
    assert sorted(swapper.ahead) == [1, 2] and params[1].ds_tensor.status == Status.NOT_AVAILABLE
    new = torch.ones(600_000, dtype=torch.bfloat16)
    written(swapper, params[2], new)
    assert sorted(swapper.ahead) == [1]
    assert torch.equal(fetched(params[1]), values[1]) and torch.equal(fetched(params[2]), new)
    # Both found read ahead: the fetch of 1 read 2 ahead again, after its write.
    assert swapper.take_fetched()["forward"].ahead_bytes == 2 * values[1].numel() * 2
    swapper.take_fetched()
    swapper.end_step()
    fetched(params[0])
    swapper.end_step()
    assert not swapper.ahead and swapper.held_bytes == 0


def test_a_partition_the_update_behind_step_has_yet_to_write_is_read_once_written(
    swapper: StoreParamSwapper,
) -> None:
    """With the update behind `step()` (`UpdateBehind`): a fetch of a partition whose subgroup is not
    done (DeepSpeed's prefetch runs ahead of the gathers that wait) leaves its read to
    `synchronize_reads`, which waits for the update to write it and then reads the new values; nothing
    not yet written is read ahead."""
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus as Status

    values = [torch.randn(600_000).to(torch.bfloat16) for _ in range(3)]
    params = [partition(i, v.numel()) for i, v in enumerate(values)]
    for param, v in zip(params, values, strict=True):
        written(swapper, param, v)
    for param in params:
        swapper.swap_in([param], async_op=False)
        swapper.remove_partition_and_release_buffers([param])
    swapper.end_step()
    new, done, waited = torch.ones(600_000, dtype=torch.bfloat16), {0}, []

    def wait(left: list[Any]) -> None:
        # The update reaches the subgroup of 1: it issues the partition's write, marks the subgroup done
        # and goes on while the write does (`NvmePartitions.let_go`).
        waited.append([p.ds_id for p in left])
        swapper.write_partitions([(params[1], new)], wait=False)
        done.add(1)

    swapper.behind = UpdateBehind(final=lambda p: p.ds_id in done, wait=wait)
    swapper.swap_in(params[:2], async_op=True)
    assert not swapper.ahead, "2 is not written: not read ahead"
    assert [p.ds_tensor.status for p in params[:2]] == [Status.INFLIGHT] * 2 and not waited
    swapper.synchronize_reads()
    assert waited == [[1]]
    # The read waited for the write.
    assert torch.equal(params[0].ds_tensor, values[0]) and torch.equal(params[1].ds_tensor, new)
    assert not swapper.writing
    swapper.remove_partition_and_release_buffers(params[:2])
    # Once its subgroup is done, it is read ahead again.
    done.add(2)
    swapper.swap_in(params[:1], async_op=False)
    assert sorted(swapper.ahead) == [1, 2]


# name, the cache's bytes (in partitions of 600,000 elements), which partitions a fetch then takes from it.
CACHES: list[tuple[str, int, list[int]]] = [
    ("off", 0, []),
    ("room for one", 1, [0]),
    ("room for every one", 3, [0, 1]),
]


@pytest.mark.parametrize(("room", "taken"), [pytest.param(*c[1:], id=c[0]) for c in CACHES])
def test_the_updates_writes_are_kept_for_the_next_fetch_as_far_as_the_cache_has_room(
    swapper: StoreParamSwapper, room: int, taken: list[int]
) -> None:
    """The parameters' cache: the update's writes (`keep=True`) keep a copy of each partition while the
    cache has room, and a fetch takes it rather than reading, also where its read waited for the update
    behind `step()`; any other write of a partition forgets its copy first."""
    numel, element = 600_000, 2
    values = [torch.randn(numel).to(torch.bfloat16) for _ in range(3)]
    params = [partition(i, numel) for i in range(3)]
    for param, v in zip(params, values, strict=True):
        written(swapper, param, v)
    # zero.Init's writes come before the engine gives the cache its room.
    assert not swapper.cached
    swapper.cache_limit = room * numel * element
    new = [torch.full((numel,), float(i), dtype=torch.bfloat16) for i in range(3)]
    writes = swapper.write_partitions([(params[0], new[0]), (params[1], new[1])], wait=False, keep=True)
    assert sorted(swapper.cached) == taken
    swapper.take_fetched()
    swapper.swap_in(params[:2], async_op=False)
    assert all(torch.equal(p.ds_tensor, v) for p, v in zip(params[:2], new, strict=False))
    forward = swapper.take_fetched()["forward"]
    assert (forward.bytes, forward.cached_bytes) == (
        (2 - len(taken)) * numel * element,
        len(taken) * numel * element,
    )
    assert not swapper.cached and swapper.cache_bytes == 0
    swapper.remove_partition_and_release_buffers(params[:2])
    # Settled as the update settles its writes (the buffers they went from, given back).
    writes.wait()
    swapper.writes_done(writes)
    # Let go, the fetched partitions stay in the cache with their values as far as it has room (the
    # backward's fetch of them reads nothing); no other buffer is held.
    kept = [0, 1][:room]
    assert list(swapper.cached) == kept and list(swapper.kept_on_release) == kept
    assert swapper.held_bytes == swapper.cache_bytes == len(kept) * numel * element
    # Behind `step()`: the fetch of 2 waits for the update to write it, and takes what it kept.
    done: set[int] = set()

    def wait(left: list[Any]) -> None:
        swapper.write_partitions([(params[2], new[2])], wait=False, keep=True)
        done.add(2)

    swapper.behind = UpdateBehind(final=lambda p: p.ds_id in done, wait=wait)
    # Counted in the phase the fetch ran in (the engine sets it at the backward's start and end).
    swapper.phase = "backward"
    swapper.swap_in(params[2:], async_op=False)
    assert torch.equal(params[2].ds_tensor, new[2])
    phases = swapper.take_fetched()
    assert phases["backward"].cached_bytes == (numel * element if room else 0), phases
    assert phases["backward"].bytes == (0 if room else numel * element), phases
    assert phases["forward"] == FetchCounts(), phases
    swapper.remove_partition_and_release_buffers(params[2:])
    # Kept, then written by another than the update: the copy is forgotten, the fetch reads the object.
    swapper.write_partitions([(params[2], new[2])], wait=False, keep=True)
    assert (2 in swapper.cached) == (room > 0)
    swapper.write_partitions([(params[2], values[2])])
    assert 2 not in swapper.cached
    swapper.swap_in(params[2:], async_op=False)
    assert (
        torch.equal(params[2].ds_tensor, values[2]) and swapper.take_fetched()["backward"].cached_bytes == 0
    )


def test_partitions_let_go_stay_cached_for_the_backward_and_the_update_until_written(
    swapper: StoreParamSwapper,
) -> None:
    """A fetched partition let go stays in the parameters' cache with its values: the next fetch of it
    and the update's read of it (`copy_cached`) read nothing. The update's writes take the room of the
    oldest of those. A buffer that does not hold its object's values (one being written) is not kept."""
    numel, element = 600_000, 2
    values = [torch.randn(numel).to(torch.bfloat16) for _ in range(3)]
    params = [partition(i, numel) for i in range(3)]
    for param, v in zip(params, values, strict=True):
        written(swapper, param, v)
    swapper.cache_limit = 2 * numel * element
    # The forward fetches 0, 1 and 2 and lets them go: the first two fit.
    for param in params:
        swapper.swap_in([param], async_op=False)
        swapper.remove_partition_and_release_buffers([param])
    assert list(swapper.kept_on_release) == [0, 1] and swapper.cache_bytes == 2 * numel * element
    # The backward fetches 1: taken from the cache, nothing read; let go, kept again.
    swapper.take_fetched()
    swapper.swap_in([params[1]], async_op=False)
    assert torch.equal(params[1].ds_tensor, values[1])
    fetched = swapper.take_fetched()["forward"]
    assert (fetched.bytes, fetched.cached_bytes) == (0, numel * element), fetched
    swapper.remove_partition_and_release_buffers([params[1]])
    # The update reads 0 from the cache (its copy stays), and 2 from the store.
    dest = torch.empty(numel, dtype=torch.bfloat16)
    assert swapper.copy_cached(0, dest) and torch.equal(dest, values[0]) and 0 in swapper.cached
    assert not swapper.copy_cached(2, dest)
    # Its write of 2 takes the room of the oldest kept on release (0), and is kept itself.
    new = torch.full((numel,), 2.0, dtype=torch.bfloat16)
    swapper.write_partitions([(params[2], new)], keep=True)
    assert list(swapper.cached) == [1, 2] and list(swapper.kept_on_release) == [1]
    assert swapper.held_bytes == swapper.cache_bytes == 2 * numel * element
    # A fetched partition written from other memory while its fetch holds it is not kept when let go,
    # its write done or not: its buffer no longer holds its object's values.
    swapper.cache_limit = 3 * numel * element
    for settled in (False, True):
        swapper.swap_in([params[0]], async_op=False)
        writes = swapper.write_partitions([(params[0], values[2])], wait=settled)
        swapper.remove_partition_and_release_buffers([params[0]])
        assert 0 not in swapper.cached
        writes.wait()
        swapper.writes_done(writes)
        swapper.swap_in([params[0]], async_op=False)
        assert torch.equal(params[0].ds_tensor, values[2])
        swapper.remove_partition_and_release_buffers([params[0]])


class Handle:
    """A store's request handle whose wait raises `error` (None: completes)."""

    def __init__(self, error: OSError | None, waited: list[int]) -> None:
        self.error, self.waited = error, waited

    def wait(self) -> None:
        self.waited.append(1)
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize(
    ("errors", "raised"),
    [
        ([None, None], None),
        ([OSError(5, "Input/output error", "path0/params/rank0/x"), None], "Input/output error"),
        ([None, OSError(28, "No space left on device")], "No space left"),
    ],
    ids=["complete", "the first failed", "the last failed"],
)
def test_writes_in_flight_are_all_waited_for_and_fail_for_every_waiter(
    errors: list[OSError | None], raised: str | None
) -> None:
    waited: list[int] = []
    writes = Writes([Handle(e, waited) for e in errors], list(range(len(errors))), [])
    for _ in range(2):
        if raised is None:
            writes.wait()
        else:
            with pytest.raises(OSError, match=raised):
                writes.wait()
    # Each handle once, every one though one failed (their memory is reused after).
    assert len(waited) == len(errors)


def test_nothing_is_read_ahead_with_deepspeeds_prefetch_off(work_dirs: list[Path]) -> None:
    swapper = StoreParamSwapper(
        ds_config(work_dirs[:1], zero={"stage3_prefetch_bucket_size": 0}), torch.bfloat16, rank=0
    )
    params = [partition(i, 600_000) for i in range(2)]
    for param in params:
        written(swapper, param, torch.zeros(600_000, dtype=torch.bfloat16))
    for _ in range(2):
        for param in params:
            swapper.swap_in([param], async_op=False)
            swapper.remove_partition_and_release_buffers([param])
            assert not swapper.ahead
        swapper.end_step()


def test_buffers_kept_for_the_next_reads_stay_within_what_deepspeed_keeps_gathered(
    work_dirs: list[Path],
) -> None:
    """Every partition held at once (a start-up), then let go: the buffers kept for the next reads are at
    most what DeepSpeed keeps gathered (`stage3_max_live_parameters`, `stage3_max_reuse_distance` and its
    prefetch bucket), here one partition's."""
    zero = {
        "stage3_max_live_parameters": 600_000,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
    }
    swapper = StoreParamSwapper(ds_config(work_dirs[:1], zero=zero), torch.bfloat16, rank=0)
    params = [partition(i, 600_000) for i in range(3)]
    for param in params:
        written(swapper, param, torch.zeros(600_000, dtype=torch.bfloat16))
    swapper.swap_in(params, async_op=False)
    assert swapper.peak_bytes == 3 * 1_200_000
    swapper.remove_partition_and_release_buffers(params)
    assert swapper.held_bytes == 0 and swapper.buffer_bytes() == 1_200_000


@pytest.mark.parametrize(
    ("offset", "bounced"),
    [
        # The flat copy's own page: the store moves the partition with O_DIRECT from it.
        (0, False),
        # After a layer norm of 384 bf16 elements (768 bytes): through a buffer of the swapper's.
        (384, True),
        # After 2048 elements, the next page: from it again.
        (2048, False),
    ],
    ids=["on the page", "after 768 bytes", "on the next page"],
)
def test_a_partition_at_any_offset_goes_to_the_disk_with_o_direct(
    swapper: StoreParamSwapper, offset: int, bounced: bool
) -> None:
    """The update's flat copy of a subgroup has partitions at any offset the ones before leave: each is
    written and read with O_DIRECT (through a buffer of the swapper's where its memory does not start on
    the store's alignment), none of it through the page cache, and the buffers are given back."""
    numel = 600_000
    values = torch.randn(numel).to(torch.bfloat16)
    param = partition(5, numel)
    written(swapper, param, torch.zeros(numel, dtype=torch.bfloat16))
    flat = page_aligned(offset + numel, torch.bfloat16, pages="small")
    copy = flat.narrow(0, offset, numel)
    copy.copy_(values)
    assert swapper.direct(copy) != bounced and swapper.held_bytes == 0
    buffered = sum(r["stats"]["bytes_buffered"] for r in swapper.store.path_reports())
    writes = swapper.write_partitions([(param, copy)], wait=False)
    # The copy is the write's until it is done; a bounce buffer, held until then, then given back.
    assert swapper.held_bytes == (2 * numel if bounced else 0)
    writes.wait()
    swapper.writes_done(writes)
    assert swapper.held_bytes == 0
    copy.zero_()
    swapper.read_partitions([(param, copy)])
    assert torch.equal(copy, values) and swapper.held_bytes == 0
    assert sum(r["stats"]["bytes_buffered"] for r in swapper.store.path_reports()) == buffered


def test_a_subgroups_update_is_written_rounded_as_torch_rounds(swapper: StoreParamSwapper) -> None:
    """`swap_out_partitioned_params`: fp32 masters rounded to nearest even into the objects."""
    master = torch.randn(600_000) * 1e3
    master[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40])
    param = partition(7, master.numel())
    written(swapper, param, torch.zeros(master.numel(), dtype=torch.bfloat16))
    swapper.reserve_partitioned_swap_space([master.numel()])
    swapper.swap_out_partitioned_params([param], [master])
    swapper.swap_in([param], async_op=False)
    assert torch.equal(param.ds_tensor.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))


def test_a_corrupt_partition_is_an_error_naming_its_object(
    swapper: StoreParamSwapper, work_dirs: list[Path]
) -> None:
    param = partition(3, 800_000)
    written(swapper, param, torch.ones(800_000, dtype=torch.bfloat16))
    files = sorted((work_dirs[0] / PARAMS_FOLDER / "rank0").glob("param3*"))
    assert files, list((work_dirs[0] / PARAMS_FOLDER).rglob("*"))
    with files[0].open("r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    swapper.swap_in([param])
    with pytest.raises(_core.CorruptObjectError, match="param3"):
        swapper.synchronize_reads()


def test_what_only_deepspeeds_nvme_optimizer_asks_is_refused_saying_why(swapper: StoreParamSwapper) -> None:
    with pytest.raises(RuntimeError, match="parameter 5: its partition is object param5 of mlp_offload's"):
        swapper.get_path(partition(5, 10))
    with pytest.raises(
        RuntimeError, match=r"offload_optimizer\.device nvme reads the parameters' swap files"
    ):
        swapper.reserve_available_buffers()


def test_deepspeeds_own_swapper_is_refused_saying_to_install_first(swapper: StoreParamSwapper) -> None:
    """A model built under `zero.Init` before `mlp_offload.install()` has DeepSpeed's own swapper and swap
    files: refused at start, naming the key and what to do. (A stand-in of its class: DeepSpeed's builds
    its async I/O op, which a bare pytest may not have.)"""

    class AsyncPartitionedParameterSwapper:
        pass

    require_ours(swapper)
    require_ours(None)
    with pytest.raises(ValueError, match=r"^zero_optimization\.offload_param: .*AsyncPartitioned") as e:
        require_ours(AsyncPartitionedParameterSwapper())
    assert met("stock-param-swapper", str(e.value)) and "mlp_offload.install() before" in str(e.value)


@pytest.mark.parametrize(
    ("block_size", "dtype", "swapped", "kept"),
    [(1 << 20, torch.bfloat16, 1 << 19, (1 << 19) - 1), (4 << 20, torch.float32, 1 << 20, (1 << 20) - 1)],
    ids=["1 MiB of bf16", "aio.block_size of 4 MiB, fp32"],
)
def test_which_partitions_go_to_nvme_is_deepspeeds_rule(
    block_size: int, dtype: torch.dtype, swapped: int, kept: int, work_dirs: list[Path]
) -> None:
    swapper = StoreParamSwapper(ds_config(work_dirs[:1], block_size=block_size), dtype, rank=0)
    assert swapper.swappable_tensor(numel=swapped) and not swapper.swappable_tensor(numel=kept)


@pytest.mark.parametrize(
    "limits, max_inflight, device_inflight",
    [
        ({"max_inflight": 3, "device_inflight": 5}, 3, 5),
        ({"max_inflight": 12, "device_inflight": "off"}, 12, None),
    ],
)
def test_the_partitions_store_takes_the_paths_limits_as_the_states_does(
    limits: dict[str, Any], max_inflight: int, device_inflight: int | None, work_dirs: list[Path]
) -> None:
    """The parameters' reads and writes share each path's requests in flight and its node-wide admission
    with the optimizer state's (`planning.open_store`): here, the configured ones."""
    swapper = StoreParamSwapper(ds_config(work_dirs[:2], ours=limits), torch.bfloat16, rank=0)
    reports = swapper.store.path_reports()
    assert [r["max_inflight"] for r in reports] == [max_inflight] * 2, reports
    assert [r["device_inflight"] for r in reports] == [device_inflight] * 2, reports
    swapper.store.close()


def huge_bytes_at(address: int) -> int:
    """The bytes in huge pages, transparent (`AnonHugePages`) or reserved (`Private_Hugetlb`), of the
    mapping of this process that holds `address` (`/proc/self/smaps`)."""
    found: int | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(x, 16) for x in first.split("-"))
            if found is not None:
                break
            found = 0 if start <= address < end else None
        elif found is not None and first in ("AnonHugePages:", "Private_Hugetlb:"):
            found += int(line.split()[1]) * 1024
    assert found is not None, f"no mapping holds {address:#x}"
    return found


@pytest.mark.parametrize("host_pages", ["huge", "small"])
def test_the_partitions_buffers_are_of_the_states_pages(host_pages: str, work_dirs: list[Path]) -> None:
    """The partitions' buffers take `host_pages`, as the state's do: in 4 KiB pages a partition's reads
    reach the device in requests of a fraction of the store's (the probe's `small_read_bytes_per_s`)."""
    swapper = StoreParamSwapper(
        ds_config(work_dirs[:1], ours={"host_pages": host_pages}), torch.float32, rank=0
    )
    values = torch.randn(2 << 20)
    param = partition(0, values.numel(), torch.float32)
    written(swapper, param, values)
    swapper.swap_in([param], async_op=False)
    buffer = swapper.buffers[param.ds_id]
    assert swapper.pages == host_pages and torch.equal(buffer, values)
    huge = huge_bytes_at(buffer.data_ptr())
    # The swapper's count of the buffers it made, as the kernel backed them (the step record's).
    made = swapper.take_made()
    assert made.bytes >= values.numel() * 4 and swapper.take_made() == MadeBuffers()
    if host_pages == "small":
        assert huge == 0 and made.huge_bytes == 0
    elif "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        assert huge > 0 and made.huge_bytes > 0
    swapper.store.close()


def test_ours_is_built_for_our_section_alone(work_dirs: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed import comm

    monkeypatch.setattr(comm, "get_rank", lambda: 0)
    built: list[torch.dtype] = []

    def stock(config: Any, dtype: torch.dtype) -> str:
        built.append(dtype)
        return "stock's"

    build = swapper_class(stock)
    config = ds_config(work_dirs[:1])
    assert isinstance(build(config, torch.float32), StoreParamSwapper)
    del config._param_dict["mlp_offload"]
    assert build(config, torch.float16) == "stock's" and built == [torch.float16]


def test_a_model_with_partitions_on_nvme_trains_bit_equal_to_stock(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """The 20M GPT (partitions of 1 MiB and more, which go to NVMe), its parameters on NVMe within
    `max_in_cpu`: ours writes them to the store at `zero.Init` and reads them into DeepSpeed's flat buffer,
    bit-equal to stock (its own NVMe offload where DeepSpeed's async I/O op is built, else its CPU
    offload, which agrees with it bit for bit), without the op and without writing `nvme_path`."""
    case = {"model": "gpt-20M", "fp32": True, "steps": 2, "offload_param": "nvme"}
    nvme_path, stocks = tmp_path / "nvme", tmp_path / "stock-nvme"
    nvme_path.mkdir()
    stocks.mkdir()
    stock_nvme = stock_param_nvme_fails(case) is None
    stock_case = {**case, "param_nvme_path": str(stocks)} if stock_nvme else {**case, "offload_param": "cpu"}
    stock = run_case(stock_case, tmp_path, "stock")
    ours_case = {**case, "param_nvme_path": str(nvme_path), "mlp_offload": section(work_dirs[:2])}
    ours = run_case(ours_case, tmp_path, "ours")
    assert_bit_equal(ours, stock)
    assert ours["param_swappers"] == ["StoreParamSwapper"] and not ours["async_io_loaded"]
    assert not any(nvme_path.rglob("*.swp")) and (not stock_nvme or any(stocks.rglob("*.swp")))
    folders = [p / PARAMS_FOLDER / "rank0" for p in work_dirs[:2]]
    assert [f for folder in folders for f in folder.iterdir() if f.name.startswith("param")]


# The 20M GPT with most subgroups past `max_in_cpu` (its partitions of 1 MiB and more as objects), the
# tiny GPT with most past it too (its partitions all under 1 MiB: each stays in host memory on its own).
TWENTY_M = {"model": "gpt-20M", "sub_group_size": 2_000_000, "param_max_in_cpu": 1_000_000}
TINY = {"param_max_in_cpu": 10_000}
FP32 = {"fp32": True}
# Ours' section for each: the 20M GPT's state in chunks of a few MiB, the tiny one's of 24K elements. The
# 20M GPT's `host_memory` holds its partitions on NVMe too (about 86 MiB of them at once in fp32, 31 MiB in
# half precision), and about 64 MiB of the state's buffers beside them.
BIG_CHUNKS = {"host_memory": "150M"}
BIG_CHUNKS_HALF = {"host_memory": "96M"}
SMALL_CHUNKS = {"host_memory": "200K", "update_chunk": "24K"}
BEHIND = {"overlap": True}

# name, the case (with `TWENTY_M` or `TINY`), ours' section's keys, ranks.
ROWS: list[tuple[str, dict[str, Any], dict[str, Any], int]] = [
    ("fp32, partitions on NVMe", {**TWENTY_M, **FP32}, BIG_CHUNKS, 1),
    (
        "bf16 weights and moments (the 6-byte state, master_in_params), partitions on NVMe",
        {**TWENTY_M, **STATE_MODES["bf16 weights and moments"][0]},
        BIG_CHUNKS_HALF,
        1,
    ),
    ("bf16, fp32 master weights", TINY, SMALL_CHUNKS, 1),
    ("bf16 weights", {**TINY, **STATE_MODES["bf16 weights"][0]}, SMALL_CHUNKS, 1),
    ("fp16 weights", {**TINY, **STATE_MODES["fp16 weights"][0]}, SMALL_CHUNKS, 1),
    ("two ranks", {**TINY, **FP32}, SMALL_CHUNKS, 2),
    ("accumulation 2, clipped", {**TINY, **FP32, "grad_accum": 2, "clip": 0.05}, SMALL_CHUNKS, 1),
    (
        "frozen and tied parameters",
        {**TINY, **FP32, "frozen": r"^pos\.", "tied": True, "persistence_threshold": 0},
        SMALL_CHUNKS,
        1,
    ),
    ("activation checkpointing", {**TINY, **FP32, "checkpointing": "reentrant"}, SMALL_CHUNKS, 1),
    # As large models are built (Hugging Face's `from_pretrained` under ZeRO-3): each parameter written
    # to NVMe as it is made, through our swapper (`mlp_offload.install()` first).
    ("the model built under zero.Init", {**TWENTY_M, "zero_init": True}, BIG_CHUNKS_HALF, 1),
    (
        "a checkpoint saved at step 2 and loaded, partitions on NVMe",
        {**TWENTY_M, **FP32, "checkpoint_at": 2},
        BIG_CHUNKS,
        1,
    ),
    # The update behind step() (`overlap`; on by default where every chunk is cached: the README's row
    # below): the next forward's fetches and DeepSpeed's prefetch wait for each subgroup's writes.
    ("behind step(), fp32, partitions on NVMe", {**TWENTY_M, **FP32}, {**BIG_CHUNKS, **BEHIND}, 1),
    (
        "behind step(), the 6-byte state, partitions on NVMe",
        {**TWENTY_M, **STATE_MODES["bf16 weights and moments"][0]},
        {**BIG_CHUNKS_HALF, **BEHIND},
        1,
    ),
    (
        "behind step(), two ranks, accumulation 2, clipped",
        {**TINY, **FP32, "grad_accum": 2, "clip": 0.05},
        {**SMALL_CHUNKS, **BEHIND},
        2,
    ),
]


@pytest.mark.parametrize(
    ("case", "keys", "ranks"),
    [pytest.param(*r[1:], marks=[ONE_NODE] if r[3] > 1 else [], id=r[0]) for r in ROWS],
)
def test_subgroups_past_max_in_cpu_train_bit_equal_to_stock(
    case: dict[str, Any], keys: dict[str, Any], ranks: int, work_dirs: list[Path], tmp_path: Path
) -> None:
    """Each row trains 3 steps (4 with a checkpoint) with subgroups on NVMe: each step's loss and gradient
    norm, the final fp32 weights, both moments and each partition bit-equal to stock; the update during
    backward as the plan chooses where the state streams, the update behind step() where the row asks
    for it."""
    case = {**case, "steps": 4 if "checkpoint_at" in case else 3, "offload_param": "nvme"}
    if "checkpoint_at" in case:
        case["checkpoint_dir"] = str(tmp_path / "checkpoint")
    stock = run_case({**case, "offload_param": "cpu"}, tmp_path, "stock", ranks=ranks)
    ours_section = section(work_dirs[:2], **keys)
    ours_case = {**case, "param_nvme_path": str(tmp_path / "nvme"), "mlp_offload": ours_section}
    if "checkpoint_at" in case:
        ours_case["resume_mlp_offload"] = ours_section
    ours = run_case(ours_case, tmp_path, "ours", ranks=ranks)
    for a, b in zip(ours.get("ranks", [ours]), stock.get("ranks", [stock]), strict=True):
        assert_bit_equal(a, b)
        assert a["param_swappers"] == ["StoreParamSwapper"] and not a["async_io_loaded"]
        start = next(r for r in a["telemetry"] if r["event"] == "start")
        assert start["overlap"]["on"] == ("overlap" in keys), start
        # The update during backward as the parameters in host memory have it: on where chunks stream,
        # but with the master weights in the parameters (`test_backward` has it kept and undone).
        streams = start["cached_chunks"] < start["chunks"]
        in_params = start["master_in_params"]["on"]
        assert start["overlap_backward"]["on"] == (streams and not in_params), start
        assert start["subgroups_on_nvme"] > 0, start
        steps = [r["params_on_nvme"] for r in a["telemetry"] if r["event"] == "step"]
        assert all(s["subgroups"] == start["subgroups_on_nvme"] for s in steps), steps
        if case.get("model") == "gpt-20M":
            # Every step writes back the subgroups on NVMe it updated; it reads them first where the
            # master weights are the parameters, and in fp32 only where their chunks are not updated
            # one after another (the later steps' order here updates them so).
            assert all(s["written_bytes"] > 0 for s in steps), steps
            # The forward and backward read the partitions on NVMe through our swapper, every step.
            assert all(s["fetched_bytes"] > 0 and s["fetch_wait_secs"] >= 0 for s in steps), steps
            assert all(0 <= s["backward_fetched_bytes"] <= s["fetched_bytes"] for s in steps), steps
            assert all((s["read_bytes"] > 0) == in_params for s in steps[1:]), steps
    if case.get("model") == "gpt-20M":
        # Partitions of 1 MiB and more are objects of the store on our paths, none in nvme_path.
        objects = [f for p in work_dirs[:2] for f in (p / PARAMS_FOLDER / "rank0").glob("param*")]
        assert objects and not any((tmp_path / "nvme").rglob("*.swp"))


# name, who saves (ours: None), `load_checkpoint`'s options.
LOADS: list[tuple[str, bool, dict[str, Any]]] = [
    ("stock saves, ours resumes", True, {}),
    ("load_module_only", False, {"load_module_only": True}),
    ("load_optimizer_states=False", False, {"load_optimizer_states": False}),
]


# Stock's side with its parameters on NVMe runs on DeepSpeed's async I/O op.
NEEDS_AIO = pytest.mark.skipif(
    not AIO_BUILT,
    reason="stock's NVMe offload of the parameters needs DeepSpeed's async I/O op: `make deepspeed-aio`",
)


@pytest.mark.parametrize(
    ("stock_saves", "options"),
    [pytest.param(*r[1:], marks=[NEEDS_AIO] if r[1] else [], id=r[0]) for r in LOADS],
)
def test_a_checkpoint_loads_into_subgroups_on_nvme_as_into_stocks(
    stock_saves: bool, options: dict[str, Any], work_dirs: list[Path], tmp_path: Path
) -> None:
    """A checkpoint at step 2 (stock's, with the same subgroups on NVMe, or ours), loaded whole or in
    part into ours with subgroups on NVMe: 4 steps as stock's save and load with its parameters in host
    memory give (stock's own load fails where subgroups are on NVMe: it copies into their flat buffer)."""
    case = {**TINY, **FP32, "steps": 4, "checkpoint_at": 2, "load_options": options}
    stock = run_case({**case, "checkpoint_dir": str(tmp_path / "stock")}, tmp_path, "stock")
    ours_section = section(work_dirs[:2], **SMALL_CHUNKS)
    ours_case = {
        **case,
        "offload_param": "nvme",
        "param_nvme_path": str(tmp_path / "nvme"),
        "checkpoint_dir": str(tmp_path / "ours"),
        "resume_mlp_offload": ours_section,
    }
    if not stock_saves:
        ours_case["mlp_offload"] = ours_section
    assert_bit_equal(run_case(ours_case, tmp_path, "ours"), stock)


@ONE_NODE
def test_a_universal_checkpoint_loads_at_another_degree(work_dirs: list[Path], tmp_path: Path) -> None:
    """Saved by ours on 2 ranks with subgroups on NVMe, converted by DeepSpeed's `ds_to_universal.py`,
    loaded by ours on 1 rank with subgroups on NVMe: as stock's own round with its parameters in host
    memory."""
    case = {**TINY, **FP32, "steps": SAVE_AT + 3}
    on_nvme = {"offload_param": "nvme", "param_nvme_path": str(tmp_path / "nvme")}
    ours = section(work_dirs[:2], **SMALL_CHUNKS)
    universal_dir = save_and_convert({**case, **on_nvme, "mlp_offload": ours}, 2, tmp_path, "saves")
    resume = {
        **case,
        **on_nvme,
        "mlp_offload": ours,
        "resume_at": SAVE_AT,
        "checkpoint_dir": str(universal_dir),
    }
    resumed = run_case(universal(resume), tmp_path, "resumed")
    (stock,) = stock_universal_resume({**case, "offload_param": "cpu"}, 2, 1, tmp_path)
    assert_bit_equal(resumed, stock)


KILLS = [
    # Some subgroups' partitions on NVMe written back, one held.
    ("in an update", "sigkill_in_update_at", "killed in step()"),
    # Half the modules' partitions fetched, the next ones read ahead, the rest on NVMe.
    ("in a forward", "sigkill_in_forward_at", "killed in a forward"),
]


@pytest.mark.parametrize(("kill", "said"), [pytest.param(*k[1:], id=k[0]) for k in KILLS])
def test_killed_the_job_resumes_in_a_new_process(
    kill: str, said: str, work_dirs: list[Path], tmp_path: Path
) -> None:
    """SIGKILL in step 3 (`KILLS`), after a checkpoint at step 2: a new process resumes from it (its
    `zero.Init` writes the partitions afresh, the load writes each from the checkpoint's weights), and
    steps 2 to 4 are stock's resume's."""
    case = {
        **TWENTY_M,
        **FP32,
        "steps": 5,
        "offload_param": "nvme",
        "param_nvme_path": str(tmp_path / "nvme"),
    }
    ours = section(work_dirs[:2], **BIG_CHUNKS)
    ckpt = str(tmp_path / "ckpt")
    killed = {**case, "save_at": 2, kill: 3, "checkpoint_dir": ckpt, "mlp_offload": ours}
    with pytest.raises(AssertionError, match=r"killed rank \d failed") as failed:
        run_case(killed, tmp_path, "killed")
    assert said in (tmp_path / "killed.rank0.log").read_text(), str(failed.value)[-2000:]
    resumed = run_case(
        {**case, "resume_at": 2, "checkpoint_dir": ckpt, "mlp_offload": ours}, tmp_path, "resumed"
    )
    stock_case = {
        **case,
        "offload_param": "cpu",
        "checkpoint_at": 2,
        "checkpoint_dir": str(tmp_path / "stock"),
    }
    assert_bit_equal(resumed, from_step(run_case(stock_case, tmp_path, "stock-resumed"), 2))


def test_stocks_own_zero_infinity_gives_the_same_bits(work_dirs: list[Path], tmp_path: Path) -> None:
    """The rows' reference: stock's own NVMe offload of the parameters, where it runs (DeepSpeed's async
    I/O op built, 50 buffers, no prefetch: its prefetch double-books a buffer on this model), agrees with
    ours bit for bit."""
    case = {**TWENTY_M, **FP32, "steps": 3, "offload_param": "nvme"}
    if why := stock_param_nvme_fails(case):
        pytest.skip(why)
    stock_options = {
        "zero_optimization.offload_param.buffer_count": 50,
        "zero_optimization.offload_param.buffer_size": 4_000_000,
        "zero_optimization.stage3_prefetch_bucket_size": 0,
    }
    (tmp_path / "stock-nvme").mkdir()
    stock_case = {**case, "param_nvme_path": str(tmp_path / "stock-nvme"), "ds_options": stock_options}
    stock = run_case(stock_case, tmp_path, "stock")
    assert any((tmp_path / "stock-nvme").rglob("*.swp"))
    ours_section = section(work_dirs[:2], **BIG_CHUNKS)
    ours_case = {**case, "param_nvme_path": str(tmp_path / "nvme"), "mlp_offload": ours_section}
    assert_bit_equal(run_case(ours_case, tmp_path, "ours"), stock)


@pytest.mark.parametrize(
    ("mode", "master_in_params"),
    [({}, False), (STATE_MODES["bf16 weights and moments"][0], True)],
    ids=["fp32 master weights", "the 6-byte state, master_in_params"],
)
def test_the_readmes_section_trains_with_subgroups_on_nvme(
    probed_paths: Callable[[int], list[Path]], tmp_path: Path, mode: dict[str, Any], master_in_params: bool
) -> None:
    """The README's section (the paths alone) with a ZeRO-Infinity config past `max_in_cpu`: it starts,
    the update during backward resolves off, the update behind step() on (every chunk cached), and it
    trains bit-equal to stock; the plan counts the partitions on NVMe, and each step's record has their
    reads' prediction and measured busy time; the parameters' cache holds them all: the backward takes
    what the forward let go from it, the update its master weights where they are in the parameters,
    and the forward what the update wrote."""
    case = {
        **TWENTY_M,
        **mode,
        "steps": 3,
        "offload_param": "nvme",
        "param_nvme_path": str(tmp_path / "nvme"),
    }
    stock = run_case({**case, "offload_param": "cpu"}, tmp_path, "stock")
    paths = [str(p) for p in probed_paths(1)]
    ours = run_case({**case, "mlp_offload": {"paths": paths}}, tmp_path, "ours")
    assert_bit_equal(ours, stock)
    start = next(r for r in ours["telemetry"] if r["event"] == "start")
    assert start["overlap"]["on"] and "every chunk stays in host memory" in start["overlap"]["why"], start
    assert not start["overlap_backward"]["on"], start
    source = start["host_memory_source"]
    assert "for the parameters on NVMe" in source and "and backward's buffers take" in source, source
    # The plan counts the partitions on NVMe: one pass's reads at the probe's read figure, and the
    # update's writes within its prediction.
    plan, params = start["plan"], start["params_on_nvme_bytes"]
    profile, _ = profiles.saved_profile(paths, profiles.ProbeOptions())
    assert profile is not None and start["weights"] == [0.5, 0.5], start
    # The two paths are one device: the parameters at the device's figure, which each path's shows.
    read, write = (max(p[key] for p in profile.probes) for key in ("read_bytes_per_s", "write_bytes_per_s"))
    assert params > 0 and plan["param_pass_secs"] == pytest.approx(params / read), start
    assert plan["param_write_secs"] == pytest.approx(params / write), start
    assert plan["predicted_update_secs"] >= plan["param_write_secs"], start
    # The parameters' cache holds every partition (the machine spares far more than this model takes): from
    # the second step, the forward takes what the last update wrote from it, none of it read back.
    assert start["params_cache_bytes"] == params, start
    # Each step's prediction of the forward's and backward's reads: the bytes the step before read (the
    # first: two passes) at the median rate of the last steps' reads after the first (the plan's read
    # figure before any: `ParamReads`).
    fetched, written = 2 * params, 0
    rates: list[float] = []
    for step in (r for r in ours["telemetry"] if r["event"] == "step"):
        on_nvme = step["params_on_nvme"]
        predicted = fetched / (statistics.median(rates[-3:]) if rates else params / plan["param_pass_secs"])
        assert on_nvme["predicted_read_secs"] == pytest.approx(predicted), step
        # Busy reading where anything was read: from the second step the forward takes the partitions from
        # the cache, and where DeepSpeed keeps them gathered for the backward nothing is read.
        reads = on_nvme["fetched_bytes"] + on_nvme["read_bytes"]
        assert (on_nvme["read_busy_secs"] > 0) == (reads > 0) and on_nvme["write_busy_secs"] > 0, step
        # The fetches read into page-aligned buffers, with O_DIRECT (the work disk takes it), and so does
        # the update into its flat copy: a partition at an offset there that O_DIRECT cannot take (after
        # a layer norm of 384 elements) through a buffer of the swapper's, none through the page cache.
        assert on_nvme["buffered_bytes"] == 0, step
        assert all(p["buffered_bytes"] == 0 for p in step["paths"]), step
        assert step["host_bytes"] > on_nvme["buffer_bytes"] > 0, step
        # The first step makes the buffers (the flat copies among them), later steps mostly reuse them.
        assert 0 <= on_nvme["buffers_made_huge_bytes"] <= on_nvme["buffers_made_bytes"], step
        assert step["step"] > 0 or on_nvme["buffers_made_bytes"] > 0, step
        # From the second step the swapper reads ahead in the order the step before fetched, what the
        # update behind step() has written (here the forward follows it closely: maybe none).
        assert 0 <= on_nvme["read_ahead_bytes"] <= on_nvme["fetched_bytes"], step
        assert step["step"] > 0 or on_nvme["read_ahead_bytes"] == 0, step
        # Counted apart, the backward's fetches: in the first step (DeepSpeed has no trace yet) it fetches
        # again what the forward let go, from the cache; later it keeps them gathered. From the second
        # step the forward takes what the update wrote from the cache: nothing is read back.
        assert on_nvme["backward_fetched_bytes"] == 0, step
        assert on_nvme["backward_fetch_wait_secs"] <= on_nvme["fetch_wait_secs"], step
        assert (on_nvme["backward_cached_bytes"] > 0) == (step["step"] == 0), step
        assert (on_nvme["fetched_bytes"] > 0) == (step["step"] == 0), step
        assert on_nvme["cached_bytes"] >= written and on_nvme["cached_bytes"] > 0, step
        # The update reads its master weights, where they are in the parameters, from the cache (the
        # first record counts the start-up's reads too, before anything was cached).
        assert on_nvme["read_bytes"] == 0 or step["step"] == 0, step
        assert (on_nvme["read_cached_bytes"] > 0) == master_in_params, step
        assert on_nvme["read_cached_bytes"] <= params, step
        rates += [reads / on_nvme["read_busy_secs"]] if reads > 0 and step["step"] > 0 else []
        fetched, written = on_nvme["fetched_bytes"], on_nvme["written_bytes"]


@ONE_NODE
def test_the_readmes_section_on_two_ranks_trains_with_the_swappers_probed_at_zero_init(
    probed_paths: Callable[[int], list[Path]], tmp_path: Path
) -> None:
    """Two ranks of the README's section with partitions on NVMe: each rank's swapper, built by `zero.Init`
    before the engine, loads the paths' profile (the node's first job probes there, the other rank waiting
    for it) and opens its store under the state store's limits and node-wide admission; both train
    bit-equal to stock, and the engine plans from the same profile."""
    case = {**TWENTY_M, "steps": 2, "offload_param": "nvme", "param_nvme_path": str(tmp_path / "nvme")}
    stock = run_case({**case, "offload_param": "cpu"}, tmp_path, "stock", ranks=2)
    paths = [str(p) for p in probed_paths(2)]
    ours = run_case({**case, "mlp_offload": {"paths": paths}}, tmp_path, "ours", ranks=2)
    for a, b in zip(ours["ranks"], stock["ranks"], strict=True):
        assert_bit_equal(a, b)
        assert a["param_swappers"] == ["StoreParamSwapper"], a["param_swappers"]
        start = next(r for r in a["telemetry"] if r["event"] == "start")
        assert start["plan"] is not None and start["subgroups_on_nvme"] > 0, start
        steps = [r["params_on_nvme"] for r in a["telemetry"] if r["event"] == "step"]
        assert all(s["fetched_bytes"] + s["cached_bytes"] > 0 for s in steps), steps
