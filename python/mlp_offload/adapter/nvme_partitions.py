"""The half-precision partitions of the subgroups DeepSpeed keeps on NVMe (past `offload_param.max_in_cpu`).

DeepSpeed gives such a subgroup no flat buffer in host memory (`fp16_partitioned_groups_flat[i] is None`): its
parameters' partitions of 1 MiB and more are objects of the parameters' store (`param_swapper`), the smaller
ones stay in host memory, each on its own. The engine reads and writes a subgroup's partition as one flat
tensor (the update writes the new parameters into it, the master weights are read from it). So
`NvmePartitions` gives one subgroup at a time a flat copy in host memory, read whole when it is first asked
for, and written back where it changed (by its checksum) when it is let go: at the subgroup's last chunk of a
step (DeepSpeed's `_reassign_or_swap_out_partitioned_parameters` writes it there too), when another subgroup
is asked for, at the end of an update during backward (whose undo writes it again), and at the end of start-up
and of a checkpoint's load. The host memory it takes is the largest subgroup's partition, as DeepSpeed's own
buffer for writing them (`reserve_partitioned_swap_space`): one page-aligned copy, made once and reused, so
that the partitions' reads and writes go to the disk with O_DIRECT (in memory of torch's allocator, aligned to
64 bytes, the store wrote them through the page cache, which at 3.5B with the host's memory nearly all taken
wrote at a tenth of the disk's rate), of the swapper's pages (`StoreParamSwapper.pages`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from mlp_offload.adapter.param_swapper import FetchCounts, Writes, no_fetches
from mlp_offload.engine.buffers import MadeBuffers, page_aligned
from mlp_offload.engine.state import crc32c_of
from mlp_offload.engine.telemetry import ParamsOnNvmeStep


def most_gathered_elements(opt: Any) -> int:
    """The most parameter elements DeepSpeed's optimizer `opt` keeps gathered at once in the forward and
    backward: `stage3_max_live_parameters`, and past it those it will use again within
    `stage3_max_reuse_distance` (it does not release them), and its prefetch bucket."""
    offload = opt.parameter_offload
    reused = offload._max_reuse_distance_in_numel
    return int(offload._max_available_parameters_in_numel + reused + opt.prefetch_elements)


@dataclass(frozen=True)
class Fetches:
    """DeepSpeed's fetches of the partitions on NVMe between two steps (`NvmePartitions.take_fetches`):
    what they did in each phase (`param_swapper.PHASES`), and the seconds the busiest path read and
    wrote, with the bytes through the page cache (None: not our swapper)."""

    phases: dict[str, FetchCounts] = field(default_factory=no_fetches)
    busy: tuple[float | None, float | None, int | None] = (None, None, None)

    def total(self) -> FetchCounts:
        """The phases' counts summed."""
        counts = self.phases.values()
        return FetchCounts(
            sum(c.bytes for c in counts),
            sum(c.wait_secs for c in counts),
            sum(c.ahead_bytes for c in counts),
            sum(c.cached_bytes for c in counts),
        )


class NvmePartitions:
    """The flat copy of at most one subgroup on NVMe (module docs), over DeepSpeed's optimizer `opt`."""

    def __init__(self, opt: Any) -> None:
        self._opt = opt
        # The subgroup held, its flat copy, and the copy's checksum as read (None: not read, see
        # `written_whole`).
        self.held: tuple[int, torch.Tensor, int | None] | None = None
        # Subgroups the running step's update writes whole before anything reads them (`StepUpdate`
        # says which): their copies are not read first, and are written back whole.
        self.written_whole: set[int] = set()
        # Bytes read, taken from the parameters' cache instead, and written since the last step record
        # (`step_record`).
        self.read_bytes = self.read_cached_bytes = 0
        self.written_bytes = 0
        # The memory of the flat copies `get` gives (module docs), made at the first: two where partitions
        # are objects, so that one subgroup's writes go on while the next one's update fills the other;
        # the writes from each still in flight, and which was written from last.
        self._memories: list[torch.Tensor] = []
        self._writes: list[Writes | None] = [None, None]
        self._in_use = self._written_last = 0

    def take_fetches(self) -> Fetches:
        """What DeepSpeed's fetches (the forward's and backward's) read since this was last called, and
        how long the parameters' paths were busy; the swapper's step ends, its reads ahead following
        this step's order from now on. Taken in `step()` before the update begins: behind `step()`,
        the update still runs while the next forward fetches."""
        # The parameters' swapper (ours: `UpdateSession.open` refuses another) holds what the fetches read,
        # its store how long its paths were busy.
        if (swapper := self.swapper()) is None:
            return Fetches()
        phases = swapper.take_fetched()
        busy = swapper.take_busy()
        swapper.end_step()
        return Fetches(phases, busy)

    def enter(self, phase: str) -> None:
        """The step's fetches from now on are `phase`'s (`param_swapper.PHASES`), where any is on NVMe."""
        if (swapper := self.swapper()) is not None:
            swapper.phase = phase

    def step_record(self, fetches: Fetches) -> ParamsOnNvmeStep | None:
        """The update's reads and writes since the last record, and the `fetches` before it (None where
        no subgroup is on NVMe)."""
        on_nvme = [i for i in range(len(self._opt.fp16_partitioned_groups_flat)) if self.on_nvme(i)]
        if not on_nvme:
            return None
        swapper = self.swapper()
        total, backward = fetches.total(), fetches.phases["backward"]
        made = MadeBuffers() if swapper is None else swapper.take_made()
        record: ParamsOnNvmeStep = {
            "subgroups": len(on_nvme),
            "read_bytes": self.read_bytes,
            "read_cached_bytes": self.read_cached_bytes,
            "written_bytes": self.written_bytes,
            "fetched_bytes": total.bytes,
            "fetch_wait_secs": total.wait_secs,
            "backward_fetched_bytes": backward.bytes,
            "backward_fetch_wait_secs": backward.wait_secs,
            "read_ahead_bytes": total.ahead_bytes,
            "cached_bytes": total.cached_bytes,
            "backward_cached_bytes": backward.cached_bytes,
            "read_busy_secs": fetches.busy[0],
            "write_busy_secs": fetches.busy[1],
            "buffered_bytes": fetches.busy[2],
            # The planner's (`UpdatePlanner.after_step`).
            "predicted_read_secs": None,
            "buffer_bytes": 0 if swapper is None else swapper.buffer_bytes(),
            "buffers_made_bytes": made.bytes,
            "buffers_made_huge_bytes": made.huge_bytes,
        }
        self.read_bytes = self.read_cached_bytes = self.written_bytes = 0
        return record

    def on_nvme(self, i: int) -> bool:
        return self._opt.fp16_partitioned_groups_flat[i] is None

    def partition_bytes(self) -> int:
        """The bytes of the partitions on NVMe (the swapper's, of 1 MiB and more) of the subgroups here."""
        return self._opt.dtype.itemsize * sum(
            part.ds_numel
            for i in range(len(self._opt.fp16_partitioned_groups_flat))
            if self.on_nvme(i)
            for _, part in self._params(i)
            if part.final_location == "nvme"
        )

    def most_held(self) -> int:
        """The most host memory the partitions on NVMe take at once: those the forward and the backward
        hold (at most what DeepSpeed keeps gathered: `most_gathered_elements`), and the update's flat copy
        of the largest subgroup here."""
        on_nvme = self.partition_bytes()
        if not on_nvme:
            return 0
        element = self._opt.dtype.itemsize
        copies = self._copies() * (self._largest() * element + self._most_bounced())
        return min(on_nvme, most_gathered_elements(self._opt) * element) + copies

    def _copies(self) -> int:
        """How many flat copies the update takes at once (`_memories`): two where a subgroup here has
        partitions as objects (the writes of one go on while the next is updated), else one."""
        return 2 if self.partition_bytes() else 1

    def _most_bounced(self) -> int:
        """The most bytes of one subgroup here that go to the disk and back through the swapper's
        buffers (`StoreParamSwapper.direct`): its partitions on NVMe at an offset of its flat copy (whose
        memory starts on a page) that the store cannot move with O_DIRECT."""
        swapper = self.swapper()
        if swapper is None:
            return 0
        element = self._opt.dtype.itemsize
        bounced = [0]
        for i in range(len(self._opt.fp16_partitioned_groups_flat)):
            if self.on_nvme(i):
                offsets = itertools.accumulate((part.ds_numel for _, part in self._params(i)), initial=0)
                bounced.append(
                    sum(
                        part.ds_numel * element
                        for (_, part), offset in zip(self._params(i), offsets, strict=False)
                        if part.final_location == "nvme" and offset * element % swapper.direct_align
                    )
                )
        return max(bounced)

    def _largest(self) -> int:
        """The elements of the largest subgroup here on NVMe."""
        flats = self._opt.fp16_partitioned_groups_flat_numel
        return max(int(flats[i]) for i in range(len(flats)) if self.on_nvme(i))

    def swapper(self) -> Any:
        """The parameters' swapper (ours with our section; None where no subgroup is on NVMe)."""
        return next(
            (
                p.nvme_swapper
                for i in range(len(self._opt.fp16_groups))
                if self.on_nvme(i)
                for p in self._opt.fp16_groups[i]
                if getattr(p, "nvme_swapper", None) is not None
            ),
            None,
        )

    def get(self, i: int) -> torch.Tensor:
        """Subgroup `i`'s partition as one flat tensor in host memory (another held one let go first)."""
        if self.held is not None and self.held[0] == i:
            return self.held[1]
        self.let_go()
        if not self._memories:
            self._memories = [self._page_aligned(self._largest()) for _ in range(self._copies())]
        # The memory not written from last: its writes have had the last subgroup's update to end in.
        self._in_use = (self._written_last + 1) % len(self._memories)
        if (writes := self._writes[self._in_use]) is not None:
            self._settle(self._in_use, writes)
        memory = self._memories[self._in_use]
        return self._hold(i, memory[: int(self._opt.fp16_partitioned_groups_flat_numel[i])])

    def _page_aligned(self, numel: int) -> torch.Tensor:
        """Memory for a flat copy of `numel` elements, of the parameters' buffers' pages."""
        swapper = self.swapper()
        assert swapper is not None, "a subgroup on NVMe has its partitions' swapper"
        return page_aligned(numel, self._opt.dtype, pages=swapper.pages, made=swapper.made)

    def flush(self) -> None:
        """Waits for the writes of the flat copies let go (`let_go`), raising what one met: at the end of
        an update, so that its step fails where a write did, and before anything else writes them."""
        for k, writes in enumerate(self._writes):
            if writes is not None:
                self._settle(k, writes)

    def _settle(self, k: int, writes: Writes) -> None:
        self._writes[k] = None
        try:
            writes.wait()
        finally:
            if (swapper := self.swapper()) is not None:
                swapper.writes_done(writes)

    def _hold(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        """Subgroup `i`'s partition in `flat`, read unless its update writes it whole, held."""
        if i in self.written_whole:
            self.held = (i, flat, None)
            return flat
        reads = []
        for (param, part), dest in self._slices(i, flat):
            if self._own_storage(part):
                dest.copy_(part.data)
            elif param.nvme_swapper.copy_held(param, dest):
                pass
            elif param.nvme_swapper.copy_cached(param.ds_id, dest):
                self.read_cached_bytes += dest.numel() * dest.element_size()
            else:
                reads.append((param, dest))
                self.read_bytes += dest.numel() * dest.element_size()
        if reads:
            reads[0][0].nvme_swapper.read_partitions(reads)
        self.held = (i, flat, crc32c_of(flat))
        return flat

    def let_go(self) -> None:
        """Writes the held copy back where it changed, and frees it. The writes of partitions that are
        objects go on after it returns (`flush`); a read of one waits for its write."""
        if self.held is None:
            return
        i, flat, crc = self.held
        self.held = None
        # Written once: asked for again, it is read (its update is done).
        self.written_whole.discard(i)
        if crc is not None and crc32c_of(flat) == crc:
            return
        writes = []
        for (param, part), src in self._slices(i, flat):
            if self._own_storage(part):
                # In host memory on its own (under 1 MiB).
                part.data.copy_(src)
            elif part.final_location == "nvme":
                # A partition on NVMe a fetch may hold now.
                param.nvme_swapper.copy_held(param, src, into=True)
            if part.final_location == "nvme" or not self._available(part):
                writes.append((param, src))
                self.written_bytes += src.numel() * src.element_size()
        if writes:
            # The held copy is always in `_memories` (`as_flat_buffers` holds none).
            # The next forward takes them from the parameters' cache, as far as it has room.
            pending = writes[0][0].nvme_swapper.write_partitions(writes, wait=False, keep=True)
            self._writes[self._in_use], self._written_last = pending, self._in_use

    @contextmanager
    def as_flat_buffers(self) -> Iterator[None]:
        """For DeepSpeed's own loader of a checkpoint, which copies into every subgroup's flat partition
        and points the parameters at it: each subgroup on NVMe gets a flat copy in DeepSpeed's list while
        it runs (the loader holds the whole state in host memory too); after it, each is written back,
        the partitions in host memory get their own storage again, those on NVMe are released."""
        opt = self._opt
        self.let_go()
        self.flush()
        on_nvme = [i for i in range(len(opt.fp16_partitioned_groups_flat)) if self.on_nvme(i)]
        own = {}
        for i in on_nvme:
            own[i] = [part.data if self._available(part) else None for _, part in self._params(i)]
            numel = int(opt.fp16_partitioned_groups_flat_numel[i])
            opt.fp16_partitioned_groups_flat[i] = self._hold(i, self._page_aligned(numel))
            self.held = None
        try:
            yield
        finally:
            for i in on_nvme:
                flat = opt.fp16_partitioned_groups_flat[i]
                opt.fp16_partitioned_groups_flat[i] = None
                self._write_back(i, flat, own[i])

    def _write_back(self, i: int, flat: torch.Tensor, own: list[torch.Tensor | None]) -> None:
        """`as_flat_buffers`' end for subgroup `i`: each partition's values from `flat` into its own
        storage (`own`) or its object."""
        writes, released = [], []
        for ((param, part), src), storage in zip(self._slices(i, flat), own, strict=True):
            if storage is not None:
                storage.copy_(src)
                part.data = storage
            # A partition on NVMe a fetch holds now is written too: its object must not stay behind
            # its buffer's values (the parameters' cache may keep that buffer once it is let go).
            if storage is None or part.final_location == "nvme":
                writes.append((param, src))
            if storage is None:
                released.append(param)
        if writes:
            swapper = writes[0][0].nvme_swapper
            swapper.write_partitions(writes)
            swapper.remove_partition_and_release_buffers(released)

    def _slices(self, i: int, flat: torch.Tensor) -> list[tuple[tuple[Any, Any], torch.Tensor]]:
        """Each (parameter, partition) of subgroup `i` with its slice of the subgroup's `flat` copy."""
        slices, offset = [], 0
        for param, part in self._params(i):
            slices.append(((param, part), flat.narrow(0, offset, part.ds_numel)))
            offset += part.ds_numel
        return slices

    def _params(self, i: int) -> list[tuple[Any, Any]]:
        opt = self._opt
        return list(zip(opt.fp16_groups[i], opt.fp16_partitioned_groups[i], strict=True))

    @classmethod
    def _own_storage(cls, part: Any) -> bool:
        """Whether the partition is in host memory on its own (not an object: under 1 MiB). One on NVMe
        that a fetch holds goes through the swapper (`copy_held`), whose fetches on another thread may let
        it go meanwhile (the update during backward)."""
        return part.final_location != "nvme" and cls._available(part)

    @staticmethod
    def _available(part: Any) -> bool:
        from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus

        return bool(part.status == PartitionedParamStatus.AVAILABLE)
