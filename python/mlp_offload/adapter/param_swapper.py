"""The parameters' partitions on NVMe as objects of our store, behind DeepSpeed's parameter swapper.

With `offload_param.device: "nvme"`, DeepSpeed's `zero.Init` keeps each partition of at least 1 MiB on
NVMe, through the object it builds as `AsyncPartitionedParameterSwapper(ds_config, dtype)` and hands
every parameter as `param.nvme_swapper`. For a config with our section, `install()` makes that object a
`StoreParamSwapper`: the same protocol (the methods DeepSpeed calls, the partitions' status and their
buffers), with the partitions as objects `param<ds_id>` of an `ObjectStore` on our `paths` (each path's
`params/rank<N>`, beside the state's `rank<N>`), checksummed, in page-aligned buffers sized to each
partition, of the state's buffers' pages (`planning.host_pages`), with the paths' requests in flight and
node-wide admission of the state's store (`planning.open_store`).

The parameters' cache (`Settings.params_cache`): where host memory is left once the state is cached
whole, the update's writes of the partitions keep a copy of each (`write_partitions(keep=True)`) until a
fetch takes it in place of a read; the next forward then reads none of what the update has just written.
A fetch's buffer, let go, stays there too while it holds its object's values (`clean`): the backward's
fetch and the update's read of that partition (`copy_cached`) then read nothing. Those give way to the
update's writes, oldest first.

What changes for the user: DeepSpeed's async I/O op is not needed, `offload_param.nvme_path` is not
written, and no fetch waits for a buffer: each partition in host memory has a buffer of its own
(`buffer_count` and `buffer_size`, stock's fixed slots, bound nothing; stock fails when a fetch needs
more slots than are free). The values are the same bits either way: a partition goes to the disk and
back as it is.
"""

from __future__ import annotations

import bisect
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlp_offload.adapter import troubleshooting
from mlp_offload.adapter.options import PARAMS_FOLDER
from mlp_offload.common.config import from_ds_config
from mlp_offload.engine.buffers import MadeBuffers, page_aligned
from mlp_offload.engine.planning import host_pages, load_profile, open_store

log = logging.getLogger("mlp_offload")

# DeepSpeed's rule of which partitions go to NVMe (`swappable_tensor`): at least its `MIN_AIO_BYTES`, or
# `aio.block_size` where larger.
MIN_SWAPPED_BYTES = 1 << 20


def key_of(param: Any) -> str:
    return f"param{param.ds_id}"


class FetchOrder:
    """The order in which the last step's fetches (the forward's and the backward's) asked for the
    partitions, and how far this step has got in it: DeepSpeed's trace repeats from step to step. A
    partition asked for out of that order moves the position to its next place in it (or its first)."""

    def __init__(self) -> None:
        self._last: list[int] = []
        # Each partition's places in `_last`.
        self._places: dict[int, list[int]] = {}
        self._this: list[int] = []
        self._position = 0

    def asked(self, ds_id: int) -> None:
        self._this.append(ds_id)
        places = self._places.get(ds_id)
        if places:
            i = bisect.bisect_left(places, self._position)
            self._position = (places[i] if i < len(places) else places[0]) + 1

    def upcoming(self) -> Iterator[int]:
        """The partitions the last step asked for after this step's position, in order, up to its end."""
        return iter(self._last[self._position :])

    def end_step(self) -> None:
        """The step's order becomes the one the next step goes by (unless it asked for nothing)."""
        if self._this:
            self._last, self._places = self._this, {}
            for place, ds_id in enumerate(self._last):
                self._places.setdefault(ds_id, []).append(place)
        self._this, self._position = [], 0


@dataclass
class FetchCounts:
    """What DeepSpeed's fetches in one phase of the step (`StoreParamSwapper.phase`) did: the bytes they
    read, the seconds they waited for them, the bytes of them found read ahead, and the bytes they took
    from the parameters' cache instead of reading."""

    bytes: int = 0
    wait_secs: float = 0.0
    ahead_bytes: int = 0
    cached_bytes: int = 0


# The phases of a step whose fetches are counted apart: the backward's (between DeepSpeed's
# `backward_prologue` and `backward_epilogue`), and the forward's (any other fetch: an evaluation's too).
PHASES = ("forward", "backward")


def no_fetches() -> dict[str, FetchCounts]:
    """Each phase's counts, none yet."""
    return {phase: FetchCounts() for phase in PHASES}


@dataclass(frozen=True)
class UpdateBehind:
    """The update running behind `step()` (`overlap`), as the parameters' reads see it: it writes the
    partitions of each subgroup on NVMe when the subgroup is done, while the next forward already fetches.
    `final(param)`: whether the partition's object holds this step's values (no update running, or its
    subgroup done); `wait(params)`: blocks until each is final, raising what the update raised."""

    final: Callable[[Any], bool]
    wait: Callable[[list[Any]], None]


class _NoRead:
    """A partition a fetch found in the parameters' cache: nothing to wait for."""

    @staticmethod
    def wait() -> None:
        return None


NO_READ = _NoRead()


def wait_all(handles: list[Any]) -> None:
    """Waits for every one of the store's `handles`, then raises the first error one met."""
    error: BaseException | None = None
    for handle in handles:
        try:
            handle.wait()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


class Writes:
    """Writes of the partitions `ds_ids` in flight (`StoreParamSwapper.write_partitions(wait=False)`):
    `wait()` returns once all are complete, or raises what one met, for every thread that waits (the
    update's thread before it reuses their memory, a fetch before it reads one of them)."""

    def __init__(self, handles: list[Any], ds_ids: list[int], bounces: list[torch.Tensor]) -> None:
        self.ds_ids = ds_ids
        self._handles = handles
        # The swapper's buffers the writes go from in place of memory O_DIRECT cannot take
        # (`StoreParamSwapper.direct`), given back once (`take_bounces`) after the wait.
        self._bounces = bounces
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def take_bounces(self) -> list[torch.Tensor]:
        """The bounce buffers, to give back: the first call after `wait()` has them, later ones none."""
        with self._lock:
            assert not self._handles, "bounce buffers given back only once their writes are done"
            bounces, self._bounces = self._bounces, []
        return bounces

    def wait(self) -> None:
        with self._lock:
            handles, self._handles = self._handles, []
            # Every one waited for, whatever one met: their memory is reused once this returns.
            try:
                wait_all(handles)
            except BaseException as error:
                self._error = self._error or error
            if self._error is not None:
                raise self._error


class StoreParamSwapper:
    """DeepSpeed's `AsyncPartitionedParameterSwapper` over our store (module docs). Reads are issued at
    once and waited for in `synchronize_reads`, as stock's; writes complete before the call returns."""

    def __init__(self, ds_config: Any, model_dtype: torch.dtype, *, rank: int | None = None) -> None:
        """As DeepSpeed builds its own (`ds_config`: its `DeepSpeedConfig`); `rank`: the global rank,
        DeepSpeed's where not given."""
        from deepspeed import comm as dist
        from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus

        config = from_ds_config(ds_config._param_dict)
        assert config is not None, "built only for a config with our section"
        self.status = PartitionedParamStatus
        self.dtype = model_dtype
        self.element_size = torch.tensor([], dtype=model_dtype).element_size()
        self.min_swapped_bytes = max(MIN_SWAPPED_BYTES, int(ds_config.aio_config["block_size"]))
        rank = dist.get_rank() if rank is None else rank
        roots = [Path(p) / PARAMS_FOLDER for p in config.paths]
        # A new job starts from the parameters its `zero.Init` writes, as stock's (it empties its folder).
        for root in roots:
            shutil.rmtree(root / f"rank{rank}", ignore_errors=True)
            root.mkdir(parents=True, exist_ok=True)
        # The paths' limits and node-wide admission, as the optimizer state's store will have them: the
        # profile is loaded (probed, the first time) here, before the engine's start.
        profile = load_profile(config)[0]
        self.store = open_store(config, profile, roots, rank=rank, shadow_slots=False)
        # The alignment of memory the store reads and writes with O_DIRECT on every path (its own rule);
        # other memory it would move through the page cache (`direct`).
        self.direct_align = max(max(512, r["tier"]["dio_mem_align"]) for r in self.store.path_reports())
        # The pages of the partitions' buffers, the state's buffers' (`host_pages`): in 4 KiB pages a
        # partition's reads reach the device in requests of a fraction of the store's.
        self.pages = host_pages(config, profile)[0]
        # The buffers made since they were last taken (`take_made`), the flat copies of `nvme_partitions`
        # included: the kernel may leave memory too fragmented for the huge pages asked for.
        self.made = MadeBuffers()
        # The partitions in host memory, by id: each one's own buffer, and the reads still in flight.
        self.buffers: dict[int, torch.Tensor] = {}
        # Buffers let go, by elements, kept for the next read of a partition of that size (the forward's
        # and backward's reads reuse them rather than fault in new memory): while those held and these
        # together stay within the most ever held at once, and within what DeepSpeed keeps gathered, which
        # `host_memory` leaves them (`nvme_partitions.most_gathered_elements`: a start-up that held every
        # partition at once keeps nothing more for it).
        self.free: dict[int, list[torch.Tensor]] = {}
        self.held_bytes = self.free_bytes = self.peak_bytes = 0
        zero = ds_config.zero_config
        gathered = zero.max_live_parameters + zero.max_reuse_distance + zero.prefetch_bucket_size
        self._gathered_elements = int(gathered)
        # What DeepSpeed's fetches read, waited for and took from the cache since it was last taken
        # (`take_fetched`), in each phase; the engine says which phase runs.
        self.fetches = no_fetches()
        self.phase = "forward"
        # Reads ahead of DeepSpeed's fetches, in the order the last step fetched (`FetchOrder`): each
        # partition's buffer and read, outside DeepSpeed's statuses until a fetch takes it; at most
        # DeepSpeed's prefetch bucket of them (the last one may pass it).
        self.order = FetchOrder()
        self.ahead: dict[int, tuple[torch.Tensor, Any]] = {}
        self.ahead_bytes = 0
        self._prefetch_elements = int(ds_config.zero_config.prefetch_bucket_size)
        self.params: dict[int, Any] = {}
        # Each path's counters when the busy times were last taken (`take_busy`).
        self._busy_ns = self._busy_counters()
        # Writes still in flight, by partition (`write_partitions(wait=False)`): a read of one waits for
        # its write first.
        self.writing: dict[int, Writes] = {}
        # DeepSpeed's reads not yet synchronized: each partition's read (None: left until the update
        # behind `step()` has written it).
        self.inflight: list[tuple[Any, Any]] = []
        self.numel: dict[int, int] = {}
        self.invalid_buffer = torch.tensor(1).half()
        # The update behind `step()`, where the engine runs one (`zero3`): a partition its subgroup's
        # update has yet to write is neither read ahead nor read before it is written (`swap_in`).
        self.behind: UpdateBehind | None = None
        # The parameters' cache (module docs): each partition's copy as the update last wrote it, within
        # `cache_limit` bytes (the settings', set by the engine). Its buffers count as held (`_take`).
        # The update's thread fills it while the next forward's fetches take from it: the cache and the
        # buffers' pool go under a lock.
        self.cached: dict[int, torch.Tensor] = {}
        self.cache_limit = self.cache_bytes = 0
        # Of those, the ones kept as a fetch let them go (`_let_go`), oldest first: the update's writes
        # take their room (`_keep`). The partitions whose buffer holds their object's values: read, or
        # written from it.
        self.kept_on_release: dict[int, None] = {}
        self.clean: set[int] = set()
        self._lock = threading.RLock()
        if ds_config.zero_config.offload_param.nvme_path:
            log.info(
                "offload_param.nvme_path: the parameters' partitions on NVMe go to mlp_offload.paths "
                "(each path's %s/rank%d), not to %s",
                PARAMS_FOLDER,
                rank,
                ds_config.zero_config.offload_param.nvme_path,
            )

    # What DeepSpeed asks of the swapper.

    def swappable_tensor(self, param: Any = None, numel: int | None = None) -> bool:
        """Whether a partition goes to NVMe: DeepSpeed's rule, by size."""
        if param is not None:
            numel = param.ds_tensor.ds_numel
        assert numel is not None, "a param or a numel"
        return self.min_swapped_bytes <= numel * self.element_size

    def available_swap_in_buffers(self) -> int:
        """Every partition gets a buffer of its own when it is read: never too few (DeepSpeed's prefetch
        stops at the count this gives)."""
        return 1 << 30

    def get_buffer(self, param: Any, numel: int) -> torch.Tensor:
        """A buffer of `numel` elements for a partition about to be written (`swap_out_and_release`)."""
        self._follow_dtype(param)
        self.numel[param.ds_id] = numel
        return self._buffer(param.ds_id, numel)

    def swap_out_and_release(self, params: list[Any], async_op: bool = False, **_: Any) -> None:
        """Writes each partition as its object, then lets its buffer go. The writes are complete
        before it returns (stock's `async_op` only defers its wait)."""
        for param in params:
            self.numel[param.ds_id] = param.ds_tensor.ds_numel
        self.write_partitions([(param, self.buffers[param.ds_id]) for param in params])
        self.remove_partition_and_release_buffers(params)

    def swap_in(self, params: list[Any], async_op: bool = True, swap_in_buffers: Any = None) -> None:
        """Issues a read of each partition into a buffer of its own; `synchronize_reads` makes them
        available. A partition listed twice is read once: DeepSpeed's prefetch lists each parameter as
        often as the step's trace uses it (the forward's and the backward's uses alike). A partition the
        update behind `step()` has yet to write (DeepSpeed's prefetch runs ahead of the subgroups the
        forward waits for) is read once it is written, in `synchronize_reads`."""
        assert swap_in_buffers is None, "DeepSpeed passes no buffers of its own to this swapper"
        params = list({param.ds_id: param for param in params}.values())
        for param in params:
            status = param.ds_tensor.status
            if status != self.status.NOT_AVAILABLE:
                raise RuntimeError(f"parameter {param.ds_id}: read asked for while its partition is {status}")
        for param in params:
            self.params[param.ds_id] = param
            self.order.asked(param.ds_id)
            nbytes = self.numel[param.ds_id] * self.element_size
            final = self._final(param)
            if final and (buffer := self._from_cache(param.ds_id)) is not None:
                read: Any = NO_READ
            elif (taken := self._take_ahead(param.ds_id)) is not None:
                buffer, read = taken
                self.fetches[self.phase].ahead_bytes += nbytes
                self.fetches[self.phase].bytes += nbytes
            else:
                buffer = self._take(self.numel[param.ds_id])
                read = self._read(param, buffer) if final else None
                self.fetches[self.phase].bytes += nbytes if final else 0
            self.buffers[param.ds_id] = buffer
            self.inflight.append((param, read))
            param.ds_tensor.status = self.status.INFLIGHT
        self._read_ahead()
        if not async_op:
            self.synchronize_reads()

    def _read_ahead(self) -> None:
        """Issues reads of the partitions the last step fetched next, not in host memory, while those
        read ahead stay under the limit (none with DeepSpeed's prefetch off: a bucket of 0)."""
        for ds_id in self.order.upcoming():
            if self.ahead_bytes >= self.ahead_limit:
                return
            param = self.params[ds_id]
            held = ds_id in self.ahead or ds_id in self.buffers or ds_id in self.cached
            if held or param.ds_tensor.status != self.status.NOT_AVAILABLE or not self._final(param):
                continue
            if ds_id in self.writing:
                # Its write still goes on (a read would wait here for it): its fetch reads it.
                continue
            buffer = self._take(self.numel[ds_id])
            read = self._read(param, buffer)
            with self._lock:
                self.ahead[ds_id] = (buffer, read)
                self.ahead_bytes += buffer.numel() * self.element_size

    def _take_ahead(self, ds_id: int) -> tuple[torch.Tensor, Any] | None:
        """Partition `ds_id`'s read ahead and its buffer, taken out of those read ahead, or None. Under
        the lock: the update during backward drops reads ahead (`write_partitions`) on its own thread."""
        with self._lock:
            taken = self.ahead.pop(ds_id, None)
            if taken is not None:
                self.ahead_bytes -= taken[0].numel() * self.element_size
            return taken

    def _drop_ahead(self, ds_id: int) -> None:
        """A read ahead no fetch will take (its partition about to be written, or the step ended):
        waited for and its buffer let go. An error it met is left to the next read of the object."""
        if (taken := self._take_ahead(ds_id)) is None:
            return
        buffer, read = taken
        try:
            read.wait()
        except OSError as e:
            # A corrupt object or a failed path: the object's next read raises it where it matters.
            log.info("parameter %d: a read ahead failed (%s); its next read meets it again", ds_id, e)
        self._give_back(buffer)

    def end_step(self) -> None:
        """The step's fetches are done: the reads ahead still unused are dropped, and the order they
        followed is the next step's."""
        for ds_id in list(self.ahead):
            self._drop_ahead(ds_id)
        self.order.end_step()

    def synchronize_reads(self) -> None:
        """Waits for the reads in flight, and for the update behind `step()` to write the partitions
        `swap_in` left to it, then reads those; each partition then lies in its buffer, available."""
        inflight, self.inflight = self.inflight, []
        started = time.perf_counter()
        left = [param for param, handle in inflight if handle is None]
        if left and self.behind is not None:
            self.behind.wait(left)
        reads = [self._deferred(param) if handle is None else handle for param, handle in inflight]
        for (param, _), handle in zip(inflight, reads, strict=True):
            handle.wait()
            param.ds_tensor.data = self.buffers[param.ds_id].data
            param.ds_tensor.status = self.status.AVAILABLE
            self.clean.add(param.ds_id)
        self.fetches[self.phase].wait_secs += time.perf_counter() - started

    def _deferred(self, param: Any) -> Any:
        """The read `swap_in` left until the update wrote the partition: from the cache where the update
        kept it (the buffer taken for the read given back), else issued now."""
        nbytes = self.numel[param.ds_id] * self.element_size
        if (cached := self._from_cache(param.ds_id)) is not None:
            self._give_back(self.buffers[param.ds_id])
            self.buffers[param.ds_id] = cached
            return NO_READ
        self.fetches[self.phase].bytes += nbytes
        return self._read(param, self.buffers[param.ds_id])

    def _from_cache(self, ds_id: int) -> torch.Tensor | None:
        """Partition `ds_id`'s copy in the cache, taken out of it (held from now on as its buffer), or
        None."""
        with self._lock:
            buffer = self._uncache(ds_id)
            if buffer is not None:
                self.fetches[self.phase].cached_bytes += buffer.numel() * self.element_size
            return buffer

    def _uncache(self, ds_id: int) -> torch.Tensor | None:
        """Partition `ds_id`'s copy, out of the cache (under the lock), or None."""
        buffer = self.cached.pop(ds_id, None)
        self.kept_on_release.pop(ds_id, None)
        if buffer is not None:
            self.cache_bytes -= buffer.numel() * self.element_size
        return buffer

    def copy_cached(self, ds_id: int, dest: torch.Tensor) -> bool:
        """Copies partition `ds_id`'s values from the cache into `dest`, if it has them (the update's
        read of a subgroup's partitions: the copy stays for the next fetch)."""
        with self._lock:
            if (buffer := self.cached.get(ds_id)) is None:
                return False
            dest.copy_(buffer)
            return True

    def _keep(self, writes: list[tuple[Any, torch.Tensor]]) -> None:
        """A copy of each written partition in the cache, while it has room (the first ones written),
        the copies kept as fetches let them go making room, oldest first."""
        for param, src in writes:
            nbytes = src.numel() * self.element_size
            with self._lock:
                while self.cache_bytes + nbytes > self.cache_limit and self.kept_on_release:
                    evicted = self._uncache(next(iter(self.kept_on_release)))
                    assert evicted is not None, "a copy kept on release is in the cache"
                    self._give_back(evicted)
                if self.cache_bytes + nbytes > self.cache_limit:
                    return
                buffer = self._take(src.numel())
                self.cache_bytes += nbytes
            buffer.copy_(src)
            with self._lock:
                self.cached[param.ds_id] = buffer

    def _cache_on_release(self, ds_id: int, buffer: torch.Tensor) -> bool:
        """Keeps a partition's buffer a fetch lets go in the cache, if it has room (the caller knows the
        buffer holds the object's values, `clean`, or those its write in flight writes): the backward's
        fetch of it, or the update's read, then reads nothing."""
        nbytes = buffer.numel() * self.element_size
        with self._lock:
            if ds_id in self.cached or self.cache_bytes + nbytes > self.cache_limit:
                return False
            self.cached[ds_id] = buffer
            self.kept_on_release[ds_id] = None
            self.cache_bytes += nbytes
            return True

    def _forget(self, ds_id: int) -> None:
        """Partition `ds_id`'s copy in the cache, if any, let go: its object is about to change."""
        with self._lock:
            if (buffer := self._uncache(ds_id)) is not None:
                self._give_back(buffer)

    def writes_done(self, writes: Writes) -> None:
        """`writes` (from `write_partitions(wait=False)`) were waited for: their partitions are read as
        any (those written again since keep their newer writes), their bounce buffers given back."""
        for ds_id in writes.ds_ids:
            if self.writing.get(ds_id) is writes:
                self.writing.pop(ds_id, None)
        for buffer in writes.take_bounces():
            self._give_back(buffer)

    def _wait_for_write(self, ds_id: int) -> None:
        """Waits for partition `ds_id`'s write still in flight, if one is."""
        if (writes := self.writing.get(ds_id)) is not None:
            try:
                writes.wait()
            finally:
                self.writes_done(writes)

    def direct(self, tensor: torch.Tensor) -> bool:
        """Whether the store moves `tensor`'s memory with O_DIRECT: where it starts on `direct_align`.
        The engine's flat copy of a subgroup (`nvme_partitions`) has a partition at any offset that
        the partitions before it leave (an odd 384 elements of a layer norm, a partition of an odd
        number of elements on several ranks): through the page cache its writes stall once the host's
        memory is nearly all taken, so each is read and written through a buffer of the swapper's."""
        return tensor.data_ptr() % self.direct_align == 0

    def _read(self, param: Any, dest: torch.Tensor) -> Any:
        """Issues the read of `param`'s object into `dest`, once a write of it still in flight is done."""
        self._wait_for_write(param.ds_id)
        return self.store.read(key_of(param), dest)

    def _final(self, param: Any) -> bool:
        """Whether `param`'s object holds this step's partition (`UpdateBehind`)."""
        return self.behind is None or self.behind.final(param)

    def take_fetched(self) -> dict[str, FetchCounts]:
        """What DeepSpeed's fetches did in each phase (`PHASES`) since the last call."""
        with self._lock:
            taken, self.fetches = self.fetches, no_fetches()
        return taken

    def take_busy(self) -> tuple[float, float, int]:
        """The seconds the store's busiest path had reads in flight, and writes, and the bytes all paths
        moved through the page cache, since the last call."""
        before, self._busy_ns = self._busy_ns, self._busy_counters()
        spans = list(zip(self._busy_ns, before, strict=True))
        reads = max(now[0] - was[0] for now, was in spans)
        writes = max(now[1] - was[1] for now, was in spans)
        return reads / 1e9, writes / 1e9, sum(now[2] - was[2] for now, was in spans)

    def buffer_bytes(self) -> int:
        """Host memory the partitions' buffers hold now: those in use and those kept for the next read."""
        return self.held_bytes + self.free_bytes

    def synchronize_writes(self) -> None:
        """Nothing waits: every write completed in the call that issued it."""

    def swap_into_buffer(self, param: Any, dest_buffer: torch.Tensor) -> None:
        """Reads the partition into DeepSpeed's own buffer (its flat buffer of the subgroup), where it
        then stays available."""
        if param.ds_tensor.status != self.status.NOT_AVAILABLE:
            raise RuntimeError(f"parameter {param.ds_id}: read into a buffer while available or in flight")
        self.read_partitions([(param, dest_buffer)])
        param.ds_tensor.data = dest_buffer.data
        param.ds_tensor.status = self.status.AVAILABLE

    def remove_partition_and_release_buffers(self, params: list[Any]) -> None:
        """Lets each partition's buffer go (its object is current); the partition is NOT_AVAILABLE."""
        for param in params:
            self._let_go(param.ds_id)
            param.ds_tensor.data = self.invalid_buffer.data
            param.ds_tensor.status = self.status.NOT_AVAILABLE

    def reserve_partitioned_swap_space(self, partition_num_elems: list[int]) -> None:
        """DeepSpeed reserves room to write a subgroup's partitions after its update: ours writes each
        from a buffer of its own (`swap_out_partitioned_params`)."""

    def swap_out_partitioned_params(self, dst_fp16_params: list[Any], src_fp32_params: list[Any]) -> None:
        """After a subgroup's update: each partition rounded from its fp32 master weights (torch's
        `copy_`, to nearest even, as stock's), written as its object, NOT_AVAILABLE."""
        assert len(dst_fp16_params) == len(src_fp32_params), (len(dst_fp16_params), len(src_fp32_params))
        writes = []
        for param, master in zip(dst_fp16_params, src_fp32_params, strict=True):
            half = self._new_buffer(master.numel())
            half.copy_(master)
            writes.append((param, half))
        self.write_partitions(writes)
        for param in dst_fp16_params:
            param.ds_tensor.status = self.status.NOT_AVAILABLE

    # What the engine asks, for the subgroups on NVMe (`nvme_partitions`): the objects alone, whatever
    # DeepSpeed's status of the partition.

    def read_partitions(self, reads: list[tuple[Any, torch.Tensor]]) -> None:
        """Reads each partition's object into its tensor, all in flight at once; a tensor the store
        cannot read into with O_DIRECT (`direct`) through a buffer of its own."""
        bounces = [None if self.direct(dest) else self._take(dest.numel()) for _, dest in reads]
        handles = [
            self._read(param, dest if bounce is None else bounce)
            for (param, dest), bounce in zip(reads, bounces, strict=True)
        ]
        try:
            # Every one waited for, whatever one met: the bounce buffers are reused once this returns.
            wait_all(handles)
            for (_, dest), bounce in zip(reads, bounces, strict=True):
                if bounce is not None:
                    dest.copy_(bounce)
        finally:
            for bounce in bounces:
                if bounce is not None:
                    self._give_back(bounce)

    def write_partitions(
        self, writes: list[tuple[Any, torch.Tensor]], wait: bool = True, keep: bool = False
    ) -> Writes:
        """Writes each tensor as its partition's object, all in flight at once: complete when it returns,
        or with `wait=False` when the `Writes` it returns is waited for (the tensors untouched until
        then; a read of one of them waits for it). A read ahead of one of them, or its copy in the
        cache, which would hold the old values, is dropped first; `keep`: the new values go into the
        cache, as far as it has room (the update's writes). A tensor the store cannot write from with
        O_DIRECT (`direct`) is copied into a buffer of its own first, given back once its write is done
        (`writes_done`)."""
        for param, src in writes:
            self._drop_ahead(param.ds_id)
            self._wait_for_write(param.ds_id)
            # Under the lock, as a fetch's buffer let go on another thread (`_let_go`): the update during
            # backward writes while the backward lets partitions go.
            with self._lock:
                self._forget(param.ds_id)
                # The partition's buffer holds the object's values where it is what is written (zero.Init's
                # writes, DeepSpeed's of a partition it changed); else it no longer vouches for them, and is
                # not cached when let go.
                held = self.buffers.get(param.ds_id)
                if held is not None and held.data_ptr() == src.data_ptr():
                    self.clean.add(param.ds_id)
                else:
                    self.clean.discard(param.ds_id)
        bounces, sources = [], []
        for param, src in writes:
            if not self.direct(src):
                bounce = self._take(src.numel())
                bounces.append(bounce.copy_(src))
                src = bounce
            sources.append((param, src))
        handles = [self.store.write(key_of(param), src) for param, src in sources]
        if keep and self.cache_limit:
            self._keep(writes)
        pending = Writes(handles, [param.ds_id for param, _ in writes], bounces)
        if wait:
            try:
                pending.wait()
            finally:
                self.writes_done(pending)
        else:
            for param, _ in writes:
                self.writing[param.ds_id] = pending
        return pending

    def reserve_available_buffers(self) -> list[torch.Tensor]:
        """Reached only by DeepSpeed's NVMe optimizer offload (`fast_init`), which ours replaces."""
        raise RuntimeError(
            "offload_optimizer.device nvme reads the parameters' swap files itself; with mlp_offload the "
            "optimizer's offload is the store's (the config's offload_optimizer must be DeepSpeed's cpu)"
        )

    def release_reserved_buffers(self) -> None:
        """Nothing is ever reserved (`reserve_available_buffers`)."""

    def get_path(self, param: Any, must_exist: bool = False) -> str:
        """Reached only by DeepSpeed's NVMe optimizer offload, which reads swap files itself."""
        raise RuntimeError(
            f"parameter {param.ds_id}: its partition is object {key_of(param)} of mlp_offload's store, not "
            "a swap file; only DeepSpeed's NVMe optimizer offload asks for the file, and mlp_offload's "
            "replaces it"
        )

    def _follow_dtype(self, param: Any) -> None:
        """The partitions' dtype is the parameters' own. DeepSpeed builds its swapper with `zero.Init`'s
        dtype, which on an accelerator without fp16 (DeepSpeed's CPU accelerator on some CPUs) is
        bfloat16 whatever dtype `Init` was given (`Init._set_dtype`: `dtype or torch.float16 if fp16 is
        supported else torch.bfloat16 ...`): fp32 partitions would be rounded into bf16 buffers of half
        their size, as stock's swapper does there. Ours takes the first partition's dtype, saying so."""
        if param.dtype == self.dtype:
            return
        if self.numel:
            raise RuntimeError(
                f"parameter {param.ds_id}: a partition of {param.dtype} where the others are {self.dtype}"
            )
        log.warning("%s", troubleshooting.SWAPPER_DTYPE.message(given=self.dtype, dtype=param.dtype))
        self.dtype = param.dtype
        self.element_size = torch.tensor([], dtype=param.dtype).element_size()

    @property
    def keep_limit(self) -> int:
        """The most bytes the partitions' buffers, held and kept, take: what DeepSpeed keeps gathered."""
        return self._gathered_elements * self.element_size

    @property
    def ahead_limit(self) -> int:
        """The most bytes read ahead of DeepSpeed's fetches: its prefetch bucket."""
        return self._prefetch_elements * self.element_size

    def _busy_counters(self) -> list[tuple[int, int, int]]:
        return [
            (r["stats"]["read_busy_ns"], r["stats"]["write_busy_ns"], r["stats"]["bytes_buffered"])
            for r in self.store.path_reports()
        ]

    def _buffer(self, ds_id: int, numel: int) -> torch.Tensor:
        """Partition `ds_id`'s buffer of `numel` elements, held until it is let go (`_let_go`)."""
        self.clean.discard(ds_id)
        self.buffers[ds_id] = buffer = self._take(numel)
        return buffer

    def _take(self, numel: int) -> torch.Tensor:
        """A buffer of `numel` elements, held until it is given back (`_give_back`)."""
        with self._lock:
            return self._take_locked(numel)

    def _take_locked(self, numel: int) -> torch.Tensor:
        nbytes = numel * self.element_size
        kept = self.free.get(numel)
        if kept:
            buffer = kept.pop()
            self.free_bytes -= nbytes
            if not kept:
                # No size without buffers stays: the loop below takes the first size's.
                del self.free[numel]
        else:
            # Kept buffers of other sizes go first, as far as the most held at once is exceeded otherwise.
            while self.free_bytes and self.held_bytes + self.free_bytes + nbytes > self.peak_bytes:
                size, buffers = next(iter(self.free.items()))
                buffers.pop()
                self.free_bytes -= size * self.element_size
                if not buffers:
                    del self.free[size]
            buffer = self._new_buffer(numel)
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes + self.free_bytes)
        return buffer

    def _let_go(self, ds_id: int) -> None:
        """Partition `ds_id`'s buffer, if it holds one: kept in the cache with its values where it has
        room, else for another read (`free`), or freed."""
        with self._lock:
            buffer = self.buffers.pop(ds_id, None)
            clean = ds_id in self.clean
            self.clean.discard(ds_id)
            if buffer is not None and not (clean and self._cache_on_release(ds_id, buffer)):
                self._give_back(buffer)

    def copy_held(self, param: Any, dest: torch.Tensor, *, into: bool = False) -> bool:
        """Copies `param`'s partition out of the buffer a fetch holds it in, available (`into`: `dest`
        into that buffer), if one does; under the lock, as the fetches let buffers go on another thread
        (the update during backward's reads and writes of a subgroup's partitions while the backward
        fetches and lets go)."""
        with self._lock:
            buffer = self.buffers.get(param.ds_id)
            if buffer is None or param.ds_tensor.status != self.status.AVAILABLE:
                return False
            if into:
                buffer.copy_(dest)
            else:
                dest.copy_(buffer)
            return True

    def _give_back(self, buffer: torch.Tensor) -> None:
        """A buffer no longer held: kept for another read (`free`) or freed."""
        nbytes = buffer.numel() * self.element_size
        with self._lock:
            self.held_bytes -= nbytes
            if self.held_bytes + self.free_bytes + nbytes <= min(self.peak_bytes, self.keep_limit):
                self.free.setdefault(buffer.numel(), []).append(buffer)
                self.free_bytes += nbytes

    def _new_buffer(self, numel: int) -> torch.Tensor:
        """Page-aligned memory of `numel` elements (O_DIRECT reads and writes straight into it)."""
        return page_aligned(numel, self.dtype, pages=self.pages, made=self.made)

    def take_made(self) -> MadeBuffers:
        """The buffers made since the last call (`made`)."""
        with self._lock:
            made, self.made = self.made, MadeBuffers()
        return made


def require_ours(swapper: Any) -> None:
    """Refuses the parameters' swapper of a model built under `zero.Init` before `install()` (DeepSpeed's
    own; None: no parameter on NVMe)."""
    if swapper is not None and not isinstance(swapper, StoreParamSwapper):
        raise ValueError(troubleshooting.STOCK_PARAM_SWAPPER.message(swapper=type(swapper).__name__))


def swapper_class(stock: Callable[[Any, torch.dtype], Any]) -> Callable[[Any, torch.dtype], Any]:
    """What `partition_parameters.AsyncPartitionedParameterSwapper` becomes: ours for a config with our
    section, else `stock`."""

    def build(ds_config: Any, model_dtype: torch.dtype) -> Any:
        if from_ds_config(getattr(ds_config, "_param_dict", None)) is not None:
            return StoreParamSwapper(ds_config, model_dtype)
        return stock(ds_config, model_dtype)

    build.stock = stock  # type: ignore[attr-defined]
    return build
