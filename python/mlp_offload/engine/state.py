"""Where the optimizer state lives: each subgroup's elements cut into chunks, one store object per chunk
(its params, exp_avg and exp_avg_sq in the dtypes DeepSpeed keeps them in, `StateDtypes.arrays`),
streamed through a `ChunkPipeline`; and the copies between a whole subgroup's `[params | exp_avg |
exp_avg_sq]` in fp32 (widened: exact) and its chunks, for what needs a subgroup at once (checkpoints,
DeepSpeed's `safe_get/set_*` helpers).

With the master weights in the parameters (`StateDtypes.master_in_params`), a chunk's object keeps its
moments alone, and its master weights are its part of DeepSpeed's half-precision partition: DeepSpeed
copies its master weights into the partition after every step, so the two hold the same bits, except
where something sets the master weights alone (its fp32-param setters, `set_master`). Those are kept
apart (`master_set_apart`) until the chunk's next update starts from them. Each chunk's parameters'
CRC32C as the engine left them (`params_crc`) lets the update find parameters changed outside the
optimizer, which DeepSpeed's master weights would have overwritten."""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Callable, Collection, Sequence

import torch

from mlp_offload.engine import memory
from mlp_offload.engine.accelerator_state import AcceleratorState
from mlp_offload.engine.fused_update import crc32c_of, same_bits
from mlp_offload.engine.pipeline import ChunkPipeline
from mlp_offload.engine.state_dtypes import FP32_STATE, StateDtypes
from mlp_offload.engine.store import ObjectStore

log = logging.getLogger("mlp_offload")

FP32 = torch.float32
STATE_TENSORS = memory.STATE_TENSORS
# Objects of this engine's state start with this; others in the same directories are left alone.
KEY_PREFIX = "subgroup"
# `with_second_slots(keep_free=True)` adds slots while each path keeps 1 / this of its file system free.
KEEP_FREE_PART = 10
# `give_back_idle_slots`: a second slot the plan has not chosen for this many boundaries in a row goes
# back to the file system. The plan's pick moves from boundary to boundary (docs/results.md), so a slot
# idle for one or two is likely wanted again soon, and giving it back would only make it again.
SLOT_IDLE_BOUNDARIES = 4


class ChunkedState:
    """The state of subgroups of `numels` elements, chunked by `layout`, in `store`.

    `layout.buffers` and `cache_chunks` size the pipeline (see `ChunkPipeline`); `lock` page-locks its
    buffers, of `pages` (`"small"` or `"huge"`); `ascending` runs every step in chunk order;
    `shadow_slots`: the store gives every object two slots; `kept_copies`: see `ChunkPipeline` (every
    chunk cached); `stored`: the dtypes each chunk keeps its arrays in (`layout.state_bytes` of them);
    `partition`: subgroup -> its half-precision partition (on the host or an accelerator), where the
    master weights are kept in the parameters (`stored.master_in_params`). `accelerator`: the first
    subgroups, kept whole on the accelerator and out of the store (the layout gives them no chunk); the
    whole-subgroup views (`gather`, `scatter`, `set_params`) go there for them.
    Objects left in the store by an earlier run (another model, subgroup or chunk size) are removed.
    """

    def __init__(
        self,
        store: ObjectStore,
        numels: Sequence[int],
        layout: memory.ChunkLayout,
        *,
        cache_chunks: int | None,
        lock: bool,
        pages: str = "small",
        ascending: bool = False,
        shadow_slots: bool = False,
        kept_copies: int = 0,
        stored: StateDtypes = FP32_STATE,
        partition: Callable[[int], torch.Tensor] | None = None,
        accelerator: AcceleratorState | None = None,
    ) -> None:
        if layout.state_bytes != stored.bytes_per_element:
            raise ValueError(
                f"a layout of {layout.state_bytes} bytes per element for a state kept in {stored} "
                f"({stored.bytes_per_element})"
            )
        if stored.master_in_params and partition is None:
            raise ValueError(f"a state kept as {stored} needs the partitions that hold its master weights")
        self.store = store
        self.stored = stored
        self.partition = partition
        self.accelerator = accelerator
        # Per chunk, master weights set apart from its parameters (`set_master`), and its parameters'
        # CRC32C as the engine last left them; with the master weights in the parameters only.
        self.master_set_apart: dict[int, torch.Tensor] = {}
        self.params_crc: dict[int, int] = {}
        self.numels = list(numels)
        self.layout = layout
        # Chunk -> (subgroup, first element, elements); chunks of one subgroup are adjacent.
        self.chunks = layout.chunks
        self.of_subgroup: list[list[int]] = [[] for _ in self.numels]
        for c, (i, _, _) in enumerate(self.chunks):
            self.of_subgroup[i].append(c)
        self.keys = [f"{KEY_PREFIX}{i}.{first}" for i, first, _ in self.chunks]
        self._remove_stale()
        # Chunks with a second slot on disk to stage into (every one with shadow slots; else those
        # `with_second_slots` gave one, here or in an earlier process on these paths, as the store's
        # manifest keeps them), the bytes the slots added here took, and why the last adding stopped
        # short.
        self.slotted: set[int] = (
            set(range(len(self.chunks)))
            if shadow_slots
            else {
                c for c, key in enumerate(self.keys) if store.size(key) is not None and store.slots(key) == 2
            }
        )
        self.slot_bytes = 0
        self.slots_short: str | None = None
        # Per chunk with a second slot of its own, the boundaries in a row the plan did not choose it
        # (`give_back_idle_slots`), and the chunks and bytes given back here so far.
        self.shadow_slots = shadow_slots
        self._slot_idle: dict[int, int] = {}
        self.slots_given_back = 0
        self.slot_bytes_given_back = 0
        self.pipeline = ChunkPipeline(
            store,
            self.keys,
            layout.sizes,
            layout.stream_buffers(kept_copies),
            cache_slots=cache_chunks,
            lock=lock,
            pages=pages,
            ascending=ascending,
            kept_copies=kept_copies,
        )

    def _remove_stale(self) -> None:
        wanted = set(self.keys)
        stale = [k for k in self.store.keys() if k.startswith(KEY_PREFIX) and k not in wanted]
        for key in stale:
            self.store.delete(key)
        if stale:
            log.info("mlp-offload: removed %d state objects left by an earlier run", len(stale))
        for key, size in zip(self.keys, self.layout.sizes, strict=True):
            if self.store.size(key) not in (None, size):
                self.store.delete(key)

    def initialize(self, half_precision: Callable[[int], torch.Tensor]) -> None:
        """Writes every chunk's first state: its part of `half_precision(subgroup)` in the master weights'
        dtype (as DeepSpeed's `.to(master dtype)`: exact from half precision to fp32 or the same dtype),
        zero moments. With the master weights in the parameters, the moments alone, and the parameters'
        checksums."""

        def fill(chunk: int, state_bytes: torch.Tensor) -> None:
            i, first, count = self.chunks[chunk]
            *master, exp_avg, exp_avg_sq = self.stored.arrays(state_bytes, count)
            for params in master:
                params.copy_(half_precision(i)[first : first + count])
            exp_avg.zero_()
            exp_avg_sq.zero_()

        self.pipeline.initialize(fill)
        if self.accelerator is not None:
            self.accelerator.initialize(half_precision)
        if self.stored.master_in_params:
            for chunk in range(len(self.chunks)):
                self.note_params(chunk)

    def params(self, chunk: int) -> torch.Tensor:
        """The chunk's part of its subgroup's half-precision partition, where it lies: with the master
        weights in the parameters, the master weights themselves."""
        assert self.partition is not None, "the partitions are known with the master weights in them"
        i, first, count = self.chunks[chunk]
        return self.partition(i)[first : first + count]

    def _host_params(self, chunk: int) -> torch.Tensor:
        """`params(chunk)` in host memory: itself there, else a copy."""
        return self.params(chunk).to("cpu")

    def note_params(self, chunk: int) -> None:
        """The chunk's parameters as they are now are its master weights' bits, as the engine left them
        (`params_crc`)."""
        self.params_crc[chunk] = crc32c_of(self._host_params(chunk))

    def params_as_left(self, chunk: int, as_read: int | None, as_written: int | None) -> bool:
        """After a pass that read the chunk's parameters as its master weights: whether they were as the
        engine left them (their CRC32C `as_read` against `params_crc`; True where either is unknown).
        The sum `as_written` is the next pass's to meet."""
        expected = self.params_crc.get(chunk)
        if as_written is not None:
            self.params_crc[chunk] = as_written
        return as_read is None or expected is None or as_read == expected

    def set_master(self, chunk: int, values: torch.Tensor) -> None:
        """With the master weights in the parameters: makes `values` (any float dtype, rounded to the
        master weights' as DeepSpeed's copy into them rounds) the chunk's master weights. Where they are
        its parameters' bits, the parameters hold them; else they are kept apart until the chunk's next
        update (`take_master_set_apart`), as DeepSpeed's master weights differ from its parameters
        until its next step."""
        master = values.to(device="cpu", dtype=self.stored.master, copy=True)
        params = self._host_params(chunk)
        if same_bits(master, params):
            self.master_set_apart.pop(chunk, None)
            self.params_crc[chunk] = crc32c_of(params)
        else:
            self.master_set_apart[chunk] = master

    def take_master_set_apart(self, chunk: int) -> bool:
        """Before the chunk's update: master weights kept apart (`set_master`) go into its parameters, from
        which the update starts, as DeepSpeed's starts from its master weights. Whether there were."""
        master = self.master_set_apart.pop(chunk, None)
        if master is None:
            return False
        self.params(chunk).copy_(master)
        return True

    def with_second_slots(self, chunks: list[int], keep_free: bool) -> list[int]:
        """Of `chunks`, in order, those with a second slot on disk to stage into: each one without gets
        its own now (`ObjectStore.add_shadow_slot`, the chunk's state's bytes again, split as its current
        version). With `keep_free`, only while every path it is on keeps a tenth of its file system
        free, and a path that is full stops the adding (`slots_short` says why); without, a full path
        raises, naming the file."""
        paths = [tier["path"] for tier in self.store.tiers]
        # Per path: bytes free to this process, and what must stay free.
        room: dict[int, list[int]] = {}
        for chunk in chunks:
            if chunk in self.slotted:
                continue
            key = self.keys[chunk]
            need: dict[int, int] = {}
            for path, nbytes in self.store.placement(key):
                need[path] = need.get(path, 0) + nbytes
            if keep_free:
                for path in need.keys() - room.keys():
                    fs = os.statvfs(paths[path])
                    room[path] = [fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize // KEEP_FREE_PART]
                short = [paths[p] for p, n in need.items() if room[p][0] - n < room[p][1]]
                if short:
                    self.slots_short = (
                        f"{short[0]} would keep less than a tenth of its file system free with chunk "
                        f"{chunk}'s second slot"
                    )
                    break
            try:
                self.slot_bytes += self.store.add_shadow_slot(key)
            except OSError as e:
                if not keep_free or e.errno != errno.ENOSPC:
                    raise
                self.slots_short = f"no room for chunk {chunk}'s second slot: {e}"
                break
            self.slotted.add(chunk)
            for path, nbytes in need.items():
                if path in room:
                    room[path][0] -= nbytes
        return [c for c in chunks if c in self.slotted]

    def give_back_idle_slots(self, chosen: Collection[int]) -> None:
        """After a boundary whose update during backward chose `chosen`: each chunk with a second slot of
        its own that was not chosen for `SLOT_IDLE_BOUNDARIES` boundaries in a row gives it back
        (`ObjectStore.remove_shadow_slot`), once its current version lies in slot 0 (each write of the
        chunk flips it: until then it is asked again at each boundary). So the disk the slots take
        follows the plan's pick down as well as up. Nothing with `shadow_slots`, where every object
        keeps two. No staged version may wait (the last step kept or forgot them)."""
        if self.shadow_slots:
            return
        for chunk in sorted(self.slotted):
            if chunk in chosen:
                self._slot_idle.pop(chunk, None)
                continue
            idle = self._slot_idle[chunk] = self._slot_idle.get(chunk, 0) + 1
            if idle < SLOT_IDLE_BOUNDARIES:
                continue
            given = self.store.remove_shadow_slot(self.keys[chunk])
            if given is None:
                continue
            self.slotted.discard(chunk)
            del self._slot_idle[chunk]
            self.slots_given_back += 1
            self.slot_bytes_given_back += given

    def _slices(self, chunk: int) -> list[slice]:
        """Where the chunk's `[params | exp_avg | exp_avg_sq]` lie in its subgroup's."""
        i, first, count = self.chunks[chunk]
        n = self.numels[i]
        return [slice(k * n + first, k * n + first + count) for k in range(STATE_TENSORS)]

    def _scratch(self) -> torch.Tensor:
        return torch.empty(self.layout.buffer_bytes, dtype=torch.uint8)

    def current_params(self, chunk: int) -> torch.Tensor:
        """A copy of the chunk's current master weights (in their dtype): its host copy's, else read from
        the store; with the master weights in the parameters, those set apart, else the parameters'."""
        if self.stored.master_in_params:
            return self._master(chunk).clone()
        count = self.chunks[chunk][2]
        return self.stored.arrays(self._current(chunk, self._scratch()), count)[0].clone()

    def _master(self, chunk: int) -> torch.Tensor:
        """With the master weights in the parameters: the chunk's in host memory (not to be written)."""
        set_apart = self.master_set_apart.get(chunk)
        return set_apart if set_apart is not None else self._host_params(chunk)

    def _arrays(self, chunk: int, chunk_state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The chunk's `(params, exp_avg, exp_avg_sq)` in `chunk_state` (its bytes); with the master
        weights in the parameters, its master weights first (`_master`: to read, not to write)."""
        arrays = self.stored.arrays(chunk_state, self.chunks[chunk][2])
        if self.stored.master_in_params:
            return (self._master(chunk), *arrays)
        return arrays

    def _current(self, chunk: int, scratch: torch.Tensor) -> torch.Tensor:
        """The chunk's newest bytes: the pipeline's host copy where it has one (edits to it are edits to
        that copy), else read from the store into `scratch`."""
        found = self.pipeline.in_memory(chunk)
        if found is not None:
            return found[0]
        chunk_state = scratch[: self.layout.sizes[chunk]]
        self.store.read(self.keys[chunk], chunk_state).wait()
        return chunk_state

    def accelerator_of(self, subgroup: int) -> AcceleratorState | None:
        """The accelerator's state, where the subgroup is kept whole (no chunk of it in the store)."""
        return self.accelerator if self.accelerator is not None and subgroup in self.accelerator else None

    def gather(self, subgroup: int) -> torch.Tensor:
        """A fresh fp32 copy of the subgroup's newest `[params | exp_avg | exp_avg_sq]` (widened: exact):
        per chunk, the pipeline's host copy where it has one, else the store's."""
        if (held := self.accelerator_of(subgroup)) is not None:
            return held.gather(subgroup)
        state = torch.empty(STATE_TENSORS * self.numels[subgroup], dtype=FP32)
        scratch = self._scratch()
        for chunk in self.of_subgroup[subgroup]:
            arrays = self._arrays(chunk, self._current(chunk, scratch))
            for part, array in zip(self._slices(chunk), arrays, strict=True):
                state[part].copy_(array)
        return state

    def set_params(self, subgroup: int, values: torch.Tensor) -> None:
        """Makes `values` (the subgroup's elements, any float dtype) its master weights, chunk by chunk,
        as DeepSpeed's copy into its master weights converts them; the moments stay."""
        if (held := self.accelerator_of(subgroup)) is not None:
            held.set_params(subgroup, values)
            return
        scratch = self._scratch()
        for chunk in self.of_subgroup[subgroup]:
            _, first, count = self.chunks[chunk]
            self.set_chunk_params(chunk, values[first : first + count], scratch)

    def set_chunk_params(self, chunk: int, values: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        """Makes `values` (the chunk's elements, any float dtype) its master weights; the moments stay."""
        if self.stored.master_in_params:
            self.set_master(chunk, values)
            return
        chunk_state = self._current(chunk, self._scratch() if scratch is None else scratch)
        self.stored.arrays(chunk_state, self.chunks[chunk][2])[0].copy_(values)
        # Written back too where the host copy was edited in place (a retained chunk's store copy).
        self.pipeline.replace(chunk, chunk_state)

    def scatter(self, subgroup: int, state: torch.Tensor) -> None:
        """Makes the subgroup's `[params | exp_avg | exp_avg_sq]` (fp32, values of the dtypes the chunks
        keep: exact) current, chunk by chunk: in the pipeline's host copy where it has one, and in the
        store."""
        if (held := self.accelerator_of(subgroup)) is not None:
            held.scatter(subgroup, state)
            return
        scratch = self._scratch()
        for chunk in self.of_subgroup[subgroup]:
            self.write(chunk, functools.partial(_copy_parts, state, self._slices(chunk)), scratch)

    def write(
        self,
        chunk: int,
        fill: Callable[[tuple[torch.Tensor, ...]], object],
        scratch: torch.Tensor | None = None,
    ) -> None:
        """Makes the chunk's state what `fill` writes into its `(params, exp_avg, exp_avg_sq)` (in the
        dtypes the chunk keeps them in) current: in the pipeline's host copy where it has one, and in
        the store. Only the chunk's bytes are in host memory beside the pipeline's (and with the master
        weights in the parameters, a copy of those, made current by `set_master`)."""
        chunk_state = (self._scratch() if scratch is None else scratch)[: self.layout.sizes[chunk]]
        arrays = self._arrays(chunk, chunk_state)
        if self.stored.master_in_params:
            # `fill` writes a copy: setting the master weights leaves the parameters as they are.
            arrays = (arrays[0].clone(), *arrays[1:])
        fill(arrays)
        self.pipeline.replace(chunk, chunk_state)
        if self.stored.master_in_params:
            self.set_master(chunk, arrays[0])


def _copy_parts(whole: torch.Tensor, parts: list[slice], arrays: tuple[torch.Tensor, ...]) -> None:
    """A chunk's arrays from where they lie in its subgroup's whole `[params | exp_avg | exp_avg_sq]`."""
    for array, part in zip(arrays, parts, strict=True):
        array.copy_(whole[part])
