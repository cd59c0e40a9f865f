"""One chunk's update: DeepSpeed's per-subgroup operations on the chunk's elements, as one fused pass
(`fused`) or as DeepSpeed's own passes on its tensors bound to the chunk (`bind`); the gradient they read
(DeepSpeed's half-precision host buffer, converted chunk by chunk: the delayed conversion); and, with the
partitions on an accelerator, the host scratch the pass writes the new parameters into and their copies to
the device on a stream of their own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator

from mlp_offload import _core
from mlp_offload.adapter import master_in_params, stale_gradients
from mlp_offload.adapter.deepspeed_view import DeepSpeedView
from mlp_offload.adapter.session import UpdateSession
from mlp_offload.engine.buffers import PinnedBufferPool, as_tensor
from mlp_offload.engine.pipeline import KeptCopy
from mlp_offload.engine.state import FP32


class ChunkUpdater:
    """The update of one chunk at a time in a session (over DeepSpeed's members in `view`), and the
    buffers it reuses from chunk to chunk: of a chunk's most elements (the settings' layout), the
    parameters in the partitions' dtype."""

    def __init__(self, session: UpdateSession, view: DeepSpeedView) -> None:
        self.session = session
        self.view = view
        settings = session.settings
        elements = settings.layout.elements
        # The pass writes the half-precision parameters: into the partition where it is in host memory,
        # else into a host scratch that is copied to the accelerator's partition.
        self.params_on_host = settings.params_on_host
        # The update thread's copies to and from the accelerator, and its reads of the norms there, go on a
        # stream of its own: on the default one they would wait for the compute queued on it.
        self.update_stream = (
            None if get_accelerator().is_synchronized_device() else get_accelerator().Stream()
        )
        # The fp32 gradient chunk of DeepSpeed's passes; with the fused pass and the partitions on an
        # accelerator, the host scratch of the new parameters: two slots of a chunk's half-precision
        # parameters, the pass writing one while the other's copy to the device runs. Registered with the
        # device where DeepSpeed pins (`pin_memory`): those copies then run without the host.
        self.scratch_pool: PinnedBufferPool | None = None
        if settings.pin and not self.params_on_host:
            self.scratch_pool = PinnedBufferPool(1, elements * FP32.itemsize)
            buffer = self.scratch_pool.acquire()
            assert buffer is not None
            self.grad = as_tensor(buffer, FP32)
        else:
            self.grad = torch.empty(elements, dtype=FP32)
        # Two slots of 2-byte parameters fill the chunk's fp32 gradient; fp32 parameters fill it alone,
        # and each chunk's pass waits for the last copy out of it.
        self.scratch_slots = FP32.itemsize // view.partition_dtype.itemsize
        # Per slot, the event after its last copy to the device (None: none queued since the last wait).
        self.scratch_copies: list[Any] = [None] * self.scratch_slots
        self.scratch_next = 0
        # Per subgroup, DeepSpeed's first and last gradient slices and the range they span (`half_grad`).
        self.half_grads: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def close(self) -> None:
        """Gives back the scratch (every copy out of it ended with the update that queued it,
        `sync_copies`) and the views of DeepSpeed's gradient buffer."""
        if self.scratch_pool is not None:
            self.scratch_pool.close()
        self.half_grads.clear()

    def bind(
        self, chunk: int, state_bytes: torch.Tensor, step: int, stale_ranges: stale_gradients.StaleRanges
    ) -> None:
        """Points DeepSpeed's fp32 tensor of the chunk's subgroup, its Adam state and its gradient at the
        chunk's elements, as if they were the whole subgroup, with the Adam step the subgroup had before
        this update (CPU Adam counts one per call). `stale_ranges`: the step's gradients from earlier
        boundaries (`stale`)."""
        i, first, count = self.session.state.chunks[chunk]
        grad = self.grad[:count]
        # The delayed conversion, in place into one reusable chunk-sized buffer (an exact widening),
        # unless a gradient setter left an fp32 gradient for the subgroup.
        grad.copy_(self.gradient(i)[first : first + count])
        if ranges := stale_ranges.get(i):
            stale_gradients.apply(grad, first, ranges)
        self.view.bind_chunk(i, state_bytes.view(FP32), step, grad)

    def fused(
        self,
        chunk: int,
        state_bytes: torch.Tensor,
        step: int,
        grad_scale: float,
        groups: list[_core.AdamGroup],
        read_cuts: list[int] | None,
        write_cuts: list[int] | None,
        kept_params: list[tuple[int, torch.Tensor]] | None = None,
        kept_state: KeptCopy | None = None,
        stale_ranges: stale_gradients.StaleRanges | None = None,
    ) -> tuple[list[int] | None, list[int] | None]:
        """DeepSpeed's per-subgroup update on one chunk as one fused pass (`fused_update.FusedAdam`): the
        same bits as `unscale_and_clip_grads`, CPU Adam at `step` (the subgroup's step after this update)
        and the copy into the half-precision partition, and the Adam state's step as CPU Adam leaves it;
        with the state's checksums as read and as written, cut at the store's stripes. `groups`: the
        optimizer's param groups as the step saw them, as the kernel takes them. `kept_params`,
        `kept_state`: see `FusedAdam.update` (`kept_state.filled` is set once the pass ran).
        `stale_ranges`: the step's gradients from earlier boundaries (`stale`). With the master weights
        in the parameters, the pass starts from those set apart, if any, and checks that nothing else
        changed the parameters (`master_in_params`)."""
        fused, state, view = self.session.fused, self.session.state, self.view
        assert fused is not None
        i, first, count = state.chunks[chunk]
        half = view.partition(i)[first : first + count]
        grad = self.pass_gradient(i, first, count, stale_ranges)
        in_params = state.stored.master_in_params
        set_apart = in_params and state.take_master_set_apart(chunk)
        params = half
        slot = self.scratch_next
        if not self.params_on_host:
            # The partition is on the accelerator: the pass writes the new parameters into a slot of the
            # host scratch (the fp32 gradient chunk of the budget, which only DeepSpeed's passes use),
            # copied over after it as they are, on this thread's stream, while the next chunk's pass
            # writes the other slot (half-precision parameters; fp32 ones have one slot). Its narrowing
            # is the one DeepSpeed's copy does on the host before that copy (`kernel_check.self_check`).
            # Where the pass is to keep what it overwrites, or reads the master weights there, it first
            # gets the parameters as they are.
            self.scratch_next = (slot + 1) % self.scratch_slots
            self._wait_for_scratch(slot)
            c = self.grad.numel()
            params = self.grad.view(half.dtype)[slot * c : slot * c + count]
            if kept_params is not None or in_params:
                params.copy_(half)
        cuts = (read_cuts, write_cuts)
        if in_params:
            # The parameters' checksums come with the state's: asked for on every pass.
            cuts = (read_cuts or [0], write_cuts or [0])
        sums = fused.update(
            state_bytes,
            grad,
            params,
            group=groups[view.group_of(i)],
            grad_scale=grad_scale,
            step=step,
            read_cuts=cuts[0],
            write_cuts=cuts[1],
            kept_params=kept_params,
            kept_state=None if kept_state is None else kept_state.state,
        )
        if kept_state is not None:
            kept_state.filled = True
        if in_params:
            master_in_params.check_params(
                state, chunk, None if set_apart else sums.params_read, sums.params_write
            )
        if params is not half:
            if self.scratch_pool is None:
                half.copy_(params)
            else:
                # From memory registered with the device: a copy that runs without the host, whose
                # event says when the slot may be written again; the subgroup's last chunk waits for
                # every one of its copies (`sync_copies`).
                half.copy_(params, non_blocking=True)
                copied = get_accelerator().Event()
                copied.record()
                self.scratch_copies[slot] = copied
        view.after_fused_pass(i, step)
        return (sums.read if read_cuts else None), (sums.write if write_cuts else None)

    def pass_gradient(
        self,
        i: int,
        first: int,
        count: int,
        stale_ranges: stale_gradients.StaleRanges | None,
        *,
        own: bool = False,
    ) -> torch.Tensor:
        """The gradient the fused pass reads for subgroup `i`'s elements `first..first + count`: DeepSpeed's
        half-precision one as it is (the pass widens it), else in the master weights' dtype where stale
        gradients or a gradient setter's fp32 one make it so. `own`: never in the buffer the next
        chunk's gradient reuses (a copy there may still read it)."""
        master = self.session.dtypes.master
        grad = self.gradient(i)[first : first + count]
        ranges = None if stale_ranges is None else stale_ranges.get(i)
        if ranges and stale_gradients.touches(first, count, ranges):
            # Parameters of the chunk got no gradient at this boundary: its gradient in the master
            # weights' dtype (DeepSpeed's gradient buffer's), those parameters' through the factors since
            # theirs. In the chunk's fp32 gradient buffer of the budget, where the parameters are on the
            # host (it is unused then); else a buffer of its own.
            room = self.grad.view(master) if self.params_on_host and not own else None
            # A subgroup on the accelerator is updated whole: more than a chunk's buffer holds.
            if room is not None and room.numel() >= count:
                widened = room[:count]
            else:
                widened = self._own_buffer(count, master, own)
            widened.copy_(grad)
            stale_gradients.apply(widened, first, ranges)
            grad = widened
        elif master != FP32 and grad.dtype != master:
            # A gradient setter's: DeepSpeed's buffer holds it in the master weights' dtype.
            grad = self._own_buffer(count, master, own).copy_(grad)
        return grad

    def _own_buffer(self, count: int, dtype: torch.dtype, own: bool) -> torch.Tensor:
        """A gradient's buffer of its own; one a copy to a GPU reads (`own`) pinned where DeepSpeed pins:
        a copy from pageable memory would wait for everything queued on its stream, holding the host's
        pass (torch keeps pinned memory until the copy has read it)."""
        pinned = own and self.session.settings.pin and get_accelerator().device_name() == "cuda"
        return torch.empty(count, dtype=dtype, pin_memory=pinned)

    def _wait_for_scratch(self, slot: int) -> None:
        """Waits until the last copy to the device out of scratch `slot` has read it."""
        copied, self.scratch_copies[slot] = self.scratch_copies[slot], None
        if copied is not None:
            copied.synchronize()

    @contextlib.contextmanager
    def copying_to_device(self) -> Iterator[None]:
        """A run of the update over chunks: its copies to the device on the update's own stream (on
        the thread's default one they would wait for the compute queued there: backward's, or the next
        forward's), every one waited for before it ends, raising or not."""
        with get_accelerator().stream(self.update_stream):
            try:
                yield
            finally:
                self.sync_copies()

    def sync_copies(self) -> None:
        """Waits for every copy to the device this thread queued: the new parameters are in the
        partitions, and every scratch slot free."""
        if not self.params_on_host and self.update_stream is not None:
            get_accelerator().current_stream().synchronize()
        self.scratch_copies = [None] * self.scratch_slots

    def gradient(self, i: int) -> torch.Tensor:
        """Subgroup `i`'s gradient for the update: the fp32 one a gradient setter left, else the
        half-precision one DeepSpeed reduced (converted by the caller)."""
        fp32 = self.session.fp32_grads.get(i)
        return fp32 if fp32 is not None else self.half_grad(i)

    def half_grad(self, i: int) -> torch.Tensor:
        """Subgroup `i`'s reduced gradient in DeepSpeed's host buffer (half precision, contiguous)."""
        first, last = self.view.half_grad_ends(i)
        known = self.half_grads.get(i)
        if known is not None and known[0] is first and known[1] is last:
            # DeepSpeed's slices of the buffer as they were: the same range (asked for once per chunk,
            # on caches the last chunk's pass has just flushed, where each torch call costs most).
            return known[2]
        n = self.view.numel(i)
        # The buffer lays partitions out subgroup after subgroup in this order: one contiguous range.
        whole = first.as_strided((n,), (1,), first.storage_offset())
        assert last.storage_offset() + last.numel() == whole.storage_offset() + n, "gradient layout changed"
        self.half_grads[i] = (first, last, whole)
        return whole
