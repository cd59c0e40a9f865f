"""One step's update over the chunks, once `step()` has decided its outcome: DeepSpeed's per-subgroup
operations, chunk by chunk, through the pipeline; inside `step()`, or behind it (`overlap`)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator

from mlp_offload import _core
from mlp_offload.adapter import master_in_params, stale_gradients
from mlp_offload.adapter.chunk_update import ChunkUpdater
from mlp_offload.adapter.deepspeed_view import DeepSpeedView, StepSnapshot
from mlp_offload.adapter.nvme_partitions import Fetches
from mlp_offload.adapter.overlap_backward import Settled
from mlp_offload.adapter.session import UpdateSession
from mlp_offload.engine.accelerator_adam import AcceleratorAdam
from mlp_offload.engine.accelerator_chunks import StepSplit
from mlp_offload.engine.accelerator_model import ChunkBytes
from mlp_offload.engine.fused_update import stripe_sums
from mlp_offload.engine.pipeline import DeferredUpdate, StepStats
from mlp_offload.engine.planning import StepParts, StepTimes
from mlp_offload.engine.telemetry import AcceleratorStep, ChunksStep, OverlapStep


@dataclass
class StepUpdate:
    """The update of one step (`run`) and its record (`finish`), in a session (its chunks updated by
    `chunk_update`, over DeepSpeed's members in `view`). `snapshot`: each subgroup's Adam step
    before this update and the param groups as the step saw them; `grad_scale`: what the fused pass
    multiplies every gradient by (DeepSpeed's passes compute it themselves from `scaled_norm`);
    `settled`: the update during backward, whose kept chunks are done; `stale_ranges`: the step's
    gradients from earlier boundaries; `fwd_bwd_secs`, `backward_secs` and `parts`: the step record's
    times and parts known before the update (`finish` adds its own)."""

    session: UpdateSession
    view: DeepSpeedView
    chunk_update: ChunkUpdater
    start: float
    snapshot: StepSnapshot
    grad_scale: float
    scaled_norm: Any
    settled: Settled
    stale_ranges: stale_gradients.StaleRanges
    fwd_bwd_secs: float | None
    backward_secs: float
    parts: StepParts
    # Per subgroup, its chunks still to update (its parameters are whole again after the last).
    remaining: list[int] = field(init=False)
    # The param groups as the fused pass takes them, made once for the step.
    adam_groups: list[_core.AdamGroup] = field(init=False)
    # DeepSpeed's fetches of the partitions on NVMe since the last step (taken before the update, which
    # the next forward's fetches may run beside).
    fetches: Fetches = field(init=False)
    compute_secs: float = 0.0
    # The chunks this step streams to the accelerator (`AcceleratorChunks`), and the host pass's time
    # and elements over the others.
    split: StepSplit | None = None
    chunks_there: frozenset[int] = frozenset()
    update_pass: AcceleratorAdam | None = None
    host_secs: float = 0.0
    host_elements: int = 0
    # The chunks the split chose from (those the update during backward left).
    step_chunks: int = 0
    # The update of the subgroups kept on the accelerator, once it ran (None: none there).
    accelerator_record: AcceleratorStep | None = None
    end: float = 0.0
    # When step() returned (set by it; None while it has not).
    returned: float | None = None

    def __post_init__(self) -> None:
        state, fused = self.session.state, self.session.fused
        self.remaining = [len(chunks) for chunks in state.of_subgroup]
        for c in self.settled.committed:
            self.remaining[state.chunks[c][0]] -= 1
        self.adam_groups = [] if fused is None else fused.groups(self.snapshot.groups)
        self.fetches = self.view.on_nvme.take_fetches()
        self.end = self.start

    def run(self, subgroup_done: Callable[[int], None]) -> StepStats:
        """The chunk loop. The last writes go on while the next forward and backward run. The fused pass
        checksums the state as it reads and writes it, so the store does not hash it again."""
        session = self.session
        state, committed = session.state, self.settled.committed
        # Subgroups whose every chunk was updated during backward are done.
        for i in sorted({state.chunks[c][0] for c in committed}):
            if self.remaining[i] == 0:
                self.view.unflatten(i)
                subgroup_done(i)
        # Subgroups on NVMe that this update overwrites whole, one after another, are not read first: not
        # one with chunks the update during backward wrote (their values are in its partitions).
        during = {state.chunks[c][0] for c in committed}
        self.view.on_nvme.written_whole = self._written_whole() - during
        try:
            self._update_on_accelerator(subgroup_done)
            stats = self._chunk_loop(subgroup_done)
            # The last subgroups' parameters on NVMe still being written: the step ends with them.
            self.view.on_nvme.flush()
        finally:
            self.view.on_nvme.written_whole = set()
        self.end = time.perf_counter()
        self._record_chunks_there()
        if not committed:
            # The whole update ran here: what the plan of the update during backward goes by without a
            # prediction.
            session.planner.last_whole_update = self.end - self.start
        if self.settled.idle:
            state.give_back_idle_slots(())
        return stats if self.settled.stats is None else self.settled.stats.add(stats)

    def _update_on_accelerator(self, subgroup_done: Callable[[int], None]) -> None:
        """The subgroups kept on the accelerator (`offload_optimizer.ratio`), each in one call of the
        accelerator's pass, before the host's chunks: the first subgroups, which the next forward needs
        first. Their gradients go over from DeepSpeed's host buffer; the parameters are written there."""
        accelerator = self.session.state.accelerator
        if accelerator is None:
            return
        t = time.perf_counter()
        subgroups = range(len(accelerator.numels))
        grad_bytes = 0
        with self.chunk_update.copying_to_device():
            for i in subgroups:
                step = self.snapshot.steps[i] + 1
                grad = self.chunk_update.pass_gradient(i, 0, accelerator.numels[i], self.stale_ranges)
                grad_bytes += grad.numel() * grad.element_size()
                group = self.adam_groups[self.view.group_of(i)]
                accelerator.update(
                    i, grad, self.view.partition(i), group=group, step=step, grad_scale=self.grad_scale
                )
                self.view.after_fused_pass(i, step)
            if not get_accelerator().is_synchronized_device():
                get_accelerator().current_stream().synchronize()
        for i in subgroups:
            self.view.unflatten(i)
            subgroup_done(i)
        secs = time.perf_counter() - t
        self.compute_secs += secs
        self.accelerator_record = {
            "subgroups": len(subgroups),
            "elements": sum(accelerator.numels),
            "grad_bytes": grad_bytes,
            "secs": secs,
            "chunks": None,
        }

    def _record_chunks_there(self) -> None:
        """The step record's part of the chunks streamed to the accelerator, once every one ended: what
        was chosen and why, predicted and measured (the rates the next step's choice takes)."""
        there, split = self.session.accelerator_chunks, self.split
        if there is None or split is None:
            return
        measured = there.end(self.host_elements, self.host_secs)
        predicted = split.predicted or {}
        rates = split.rates
        record: ChunksStep = {
            "chunks": len(self.chunks_there),
            "host_chunks": self.step_chunks - len(self.chunks_there),
            "elements": sum(d.elements for d in there.dispatched),
            "host_elements": self.host_elements,
            "bytes_out": sum(d.out_bytes for d in there.dispatched),
            "bytes_back": sum(d.back_bytes for d in there.dispatched),
            "slots": split.slots if self.chunks_there else 0,
            "why": split.why,
            "predicted_secs": predicted.get("predicted_secs"),
            "predicted_host_only_secs": predicted.get("host_only_secs"),
            "predicted_host_secs": predicted.get("host_secs"),
            "predicted_device_secs": predicted.get("device_secs"),
            "memory": split.memory,
            "host_elements_per_s": rates.host_elements_per_s,
            "device_elements_per_s": rates.device_elements_per_s,
            "h2d_bytes_per_s": rates.h2d_bytes_per_s,
            "d2h_bytes_per_s": rates.d2h_bytes_per_s,
            "host_secs": self.host_secs,
            "device_secs": measured.wall_secs,
            "copy_out_secs": measured.copy_out_secs,
            "kernel_secs": measured.kernel_secs,
            "copy_back_secs": measured.copy_back_secs,
        }
        if self.accelerator_record is None:
            self.accelerator_record = {
                "subgroups": 0,
                "elements": 0,
                "grad_bytes": 0,
                "secs": 0.0,
                "chunks": None,
            }
        self.accelerator_record["chunks"] = record

    def _written_whole(self) -> set[int]:
        """The subgroups whose every element this update writes before anything reads it: all of them
        but where the update reads the parameters (the master weights in them), and for one whose chunks
        are not updated one after another (another subgroup's copy could push out a half-written one)."""
        state = self.session.state
        if state.stored.master_in_params:
            return set()
        runs = [state.chunks[c][0] for c in self.session.pipeline.order]
        starts = [i for k, i in enumerate(runs) if k == 0 or runs[k - 1] != i]
        return {i for i in set(starts) if starts.count(i) == 1}

    def _chunk_loop(self, subgroup_done: Callable[[int], None]) -> StepStats:
        """Every chunk's update, through the pipeline."""
        session = self.session
        pipeline, committed = session.pipeline, self.settled.committed
        if session.fused is not None:
            only: list[int] | None
            if self.settled.stats is not None:
                # What the update during backward left: the split takes its share of those.
                left = [c for c in pipeline.order if c not in committed]
                only = self._split_chunks(left) or left
            else:
                only = self._split_chunks(pipeline.order)
            with self.chunk_update.copying_to_device():
                stats = pipeline.run_step(
                    functools.partial(self.fused_chunk, subgroup_done=subgroup_done),
                    drain=False,
                    checksums_in_update=True,
                    only=only,
                )
        else:
            stats = pipeline.run_step(self.deepspeed_chunk, drain=False)
        return stats

    def _split_chunks(self, order: list[int]) -> list[int] | None:
        """The chunks of `order` (the pipeline's, or what the update during backward left of it) this
        step streams to the accelerator (`AcceleratorChunks.choose`), set aside in `chunks_there`: those
        the step takes first, so their copies and kernels run beside the host's pass over the rest. In
        chunk order (the forward needs the first chunks first) they are the last ones, taken first: the
        step's order, returned (None: `order` as it is)."""
        session = self.session
        there = session.accelerator_chunks
        if there is None or session.fused is None:
            return None
        self.step_chunks = len(order)
        if (none_why := self._none_there(order)) is not None:
            self.split = StepSplit([], 0, none_why)
            there.begin(self.split)
            return None
        ascending = session.pipeline.ascending
        # `choose` takes the last chunks of the order it is given.
        candidates = order if ascending else order[::-1]
        dtypes = session.dtypes
        elements = [session.state.chunks[c][2] for c in candidates]
        last_subgroup = session.state.chunks[candidates[-1]][0]
        grad_size = self.chunk_update.gradient(last_subgroup).element_size()
        params_size = self.view.partition_dtype.itemsize
        on_host = self.view.partition_on_host(last_subgroup)
        per_element = ChunkBytes.of(
            dtypes.bytes_per_element,
            grad_size,
            params_size,
            dtypes.master.itemsize,
            master_in_params=dtypes.master_in_params,
            on_host=on_host,
        )
        self.split = there.choose(elements, per_element)
        chosen = [candidates[k] for k in self.split.chunks]
        self.chunks_there = frozenset(chosen)
        there.begin(self.split)
        if not chosen:
            return None
        self.update_pass = AcceleratorAdam(session.fused.kernel, dtypes=dtypes)
        return chosen + [c for c in order if c not in self.chunks_there] if ascending else None

    def _none_there(self, order: list[int]) -> str | None:
        """Why no chunk of `order` can go to the accelerator this step, if none can."""
        session = self.session
        if not order:
            return "the update during backward updated every chunk"
        if session.dtypes != session.state.stored:
            # The kernel there takes the moments in the chunks' own layout.
            return (
                f"a checkpoint's load left the moments in {session.dtypes.moments} where the chunks keep "
                f"them in {session.state.stored.moments} (follow_loaded_moments): every chunk the host's"
            )
        return None

    def chunk_there(
        self,
        chunk: int,
        state_bytes: torch.Tensor,
        read_cuts: list[int] | None,
        write_cuts: list[int] | None,
        subgroup_done: Callable[[int], None],
    ) -> DeferredUpdate:
        """The update of one chunk on the accelerator, queued: its checksums as read now, as written once
        its copy back ended, when the pipeline finishes it (and the subgroup's last chunk is done). With
        the master weights in the parameters, it starts from those set apart, if any, and the
        parameters' sums there are checked as the host pass's are (`master_in_params`)."""
        session, view = self.session, self.view
        there, update_pass = session.accelerator_chunks, self.update_pass
        assert there is not None and update_pass is not None
        i, first, count = session.state.chunks[chunk]
        step = self.snapshot.steps[i] + 1
        in_params = session.state.stored.master_in_params
        set_apart = in_params and session.state.take_master_set_apart(chunk)
        read_sums = stripe_sums(state_bytes, read_cuts)
        # A gradient of its own: a reused buffer could change before its copy there ran.
        grad = self.chunk_update.pass_gradient(i, first, count, self.stale_ranges, own=True)
        args = {"group": self.adam_groups[view.group_of(i)], "step": step, "grad_scale": self.grad_scale}
        queued = there.dispatch(
            update_pass, session.dtypes, state_bytes, grad, view.partition(i)[first : first + count], args
        )

        def finish() -> tuple[list[int] | None, list[int] | None]:
            queued.wait()
            if in_params:
                as_read, as_written = queued.params_crcs()
                master_in_params.check_params(
                    session.state, chunk, None if set_apart else as_read, as_written
                )
            view.after_fused_pass(i, step)
            self._chunk_done(i, subgroup_done)
            return read_sums, stripe_sums(state_bytes, write_cuts)

        return DeferredUpdate(queued.done, finish, queued.wait)

    def _chunk_done(self, i: int, subgroup_done: Callable[[int], None]) -> None:
        """One more chunk of subgroup `i` updated: after its last, its parameters are whole."""
        self.remaining[i] -= 1
        if self.remaining[i] == 0:
            self.view.unflatten(i)
            # The copies to the device are queued on this thread's stream; the forward's all-gather
            # runs on another.
            self.chunk_update.sync_copies()
            subgroup_done(i)

    def fused_chunk(
        self,
        chunk: int,
        state_bytes: torch.Tensor,
        read_cuts: list[int] | None,
        write_cuts: list[int] | None,
        subgroup_done: Callable[[int], None],
    ) -> tuple[list[int] | None, list[int] | None] | DeferredUpdate:
        """The update of one chunk as one fused pass, checksums included; or queued on the accelerator."""
        if chunk in self.chunks_there:
            return self.chunk_there(chunk, state_bytes, read_cuts, write_cuts, subgroup_done)
        t = time.perf_counter()
        i, _, count = self.session.state.chunks[chunk]
        try:
            sums = self.chunk_update.fused(
                chunk,
                state_bytes,
                self.snapshot.steps[i] + 1,
                self.grad_scale,
                self.adam_groups,
                read_cuts,
                write_cuts,
                stale_ranges=self.stale_ranges,
            )
            self._chunk_done(i, subgroup_done)
            self.host_elements += count
            return sums
        finally:
            secs = time.perf_counter() - t
            self.compute_secs += secs
            self.host_secs += secs

    def deepspeed_chunk(self, chunk: int, state_bytes: torch.Tensor) -> None:
        """DeepSpeed's per-subgroup update on one chunk of it: every operation is elementwise, and chunk
        boundaries keep CPU Adam's vector path (see `memory.CHUNK_ALIGN`)."""
        t = time.perf_counter()
        i, first, _ = self.session.state.chunks[chunk]
        self.chunk_update.bind(chunk, state_bytes, self.snapshot.steps[i], self.stale_ranges)
        try:
            self.view.deepspeed_passes(i, self.scaled_norm, first)
            self.remaining[i] -= 1
            if self.remaining[i] == 0:
                self.view.unflatten(i)
        finally:
            self.view.unbind(i)
            self.compute_secs += time.perf_counter() - t

    def finish(self, stats: StepStats, waited_secs: float | None) -> None:
        """The step's record (`UpdatePlanner.after_step`), once its update ended; `waited_secs`: with the
        update behind `step()`, how long the next forward waited for subgroups."""
        session = self.session
        session.timers.ended(stats, self.compute_secs)
        overlap: OverlapStep | None = None
        if waited_secs is not None:
            returned = self.returned if self.returned is not None else time.perf_counter()
            overlap = {"step_returned_secs": returned - self.start, "forward_waited_secs": waited_secs}
        session.planner.after_step(
            session.store,
            stats,
            StepTimes(self.end - self.start, self.fwd_bwd_secs, self.backward_secs, self.compute_secs),
            dataclasses.replace(
                self.parts,
                overlap=overlap,
                params_on_nvme=self.view.on_nvme.step_record(self.fetches),
                accelerator_update=self.accelerator_record,
            ),
        )
        session.fp32_grads.clear()
