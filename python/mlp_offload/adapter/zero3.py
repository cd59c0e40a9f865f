"""The ZeRO-3 optimizer with its fp32 state in mlp-offload's object store.

`MLPOffloadStage3` is DeepSpeed's own `DeepSpeedZeroOptimizer_Stage3` (0.19.x) with six changes; the rest
(partitioning, gradient reduction, norms, clipping, loss scaling, CPU Adam, the copy back to half
precision, the `safe_get/set_*` helpers) is DeepSpeed's code, run unchanged:

1. The fp32 master weights and both Adam moments live in the store in chunks: slices of a subgroup's
   elements (up to 48 MiB of state each), one object per chunk, `[params | exp_avg | exp_avg_sq]` in fp32,
   split across every path.
2. Backward records only the gradient norms DeepSpeed needs: the reduced half-precision gradient stays
   where DeepSpeed put it (its host buffer) and nothing is cast or written.
3. `step()` streams the chunks through `ChunkPipeline`: one pool of chunk buffers within `host_memory`
   holds the cache and the reads ahead and writes behind. Per chunk, DeepSpeed's own per-subgroup
   operations run on the chunk's elements: the half-precision gradient converted into one reusable fp32
   chunk (an exact widening, as DeepSpeed's own cast), unscale and clip, CPU Adam, the copy into the
   half-precision partition.
4. After each step the `WeightTuner` moves share from the busiest path to the idler ones, and keeps a move
   only if the two updates after it were no slower than the two before.
5. With `overlap` (the fused pass; by default only when every chunk stays in memory), `step()` returns
   once the step's outcome is decided, and the chunk loop runs on behind it (`overlap.UpdateInFlight`),
   in chunk order. Each parameter's all-gather waits for its own subgroup; the persistent parameters,
   which DeepSpeed gathers at the end of its step and after a checkpoint, are gathered by the next
   forward's fetches instead, at every forward (`_mlp_persistent_left_to_the_forward`).
   Everything else that reads parameters, state or gradients first waits for the whole update
   (`_mlp_settle`).
6. With `overlap_backward`, chunks are updated during the boundary's backward as their gradients become
   final, at the outcome expected then, and `step()` keeps them or undoes them (`adapter.overlap_backward`,
   whose docstring lists what it changes here).

Bit-for-bit equality with `offload_optimizer.device: cpu` holds because every number goes through the
same operations: each is elementwise; chunk lengths are multiples of CPU Adam's vector block, so each
element takes the same code path as in a whole-subgroup call; and DeepSpeed 0.19.8's CPU Adam keeps its
bias correction per step, not per call, so neither the order nor the number of calls changes a result.

This module only translates DeepSpeed's hooks into calls on the engine's session: `adapter.settings`
resolves every setting once at start, `adapter.session` builds the session from them (the store, the
chunked state and its pipeline, the plan, the telemetry), and the helpers take the session and a narrow
view of DeepSpeed (`adapter.deepspeed_view`), never the optimizer: `adapter.chunk_update` (one chunk's
update), `adapter.step_update` (one step's update over the chunks), `adapter.overlap_backward` (the
update during backward), `adapter.checkpoint` (DeepSpeed's checkpoints and its swapper protocol).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.monitor.config import get_monitor_config
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm
from deepspeed.runtime.zero.stage3 import OPTIMIZER_STEP_TIMER
from deepspeed.runtime.zero.utils import get_norm_dtype

from mlp_offload.adapter import checkpoint, kernel_check, troubleshooting
from mlp_offload.adapter.checkpoint import DeepSpeedZeroOptimizer_Stage3, StateSwapper
from mlp_offload.adapter.chunk_update import ChunkUpdater
from mlp_offload.adapter.deepspeed_view import DeepSpeedView
from mlp_offload.adapter.overlap_backward import BackwardUpdate, OverlapBackward, own_copies
from mlp_offload.adapter.param_swapper import UpdateBehind
from mlp_offload.adapter.session import ParamRanges, UpdateSession
from mlp_offload.adapter.settings import KernelChoice, StartFacts, refuse_unsupported, resolve
from mlp_offload.adapter.step_update import StepUpdate
from mlp_offload.common.config import MLPOffloadConfig, from_ds_config
from mlp_offload.engine import memory
from mlp_offload.engine.overlap import UpdateInFlight
from mlp_offload.engine.pipeline import StepStats
from mlp_offload.engine.planning import StepParts
from mlp_offload.engine.state_dtypes import StateDtypes

log = logging.getLogger("mlp_offload")

# DeepSpeed's `_constant_buffered_norm2` buffer size: the parts whose norms it sums.
_NORM_BUFFER_SIZE = int(
    inspect.signature(DeepSpeedZeroOptimizer_Stage3._constant_buffered_norm2)
    .parameters["buffer_size"]
    .default
)


__all__ = ["DeepSpeedZeroOptimizer_Stage3", "MLPOffloadStage3"]


class MLPOffloadStage3(DeepSpeedZeroOptimizer_Stage3):
    """DeepSpeed's ZeRO-3 optimizer with the optimizer state in the object store (see module docs)."""

    overflow: bool  # set by DeepSpeed's overflow check
    persistent_parameters: list[Any]  # set by DeepSpeed's __init__: parameters every rank keeps whole
    # Set once DeepSpeed's __init__ has partitioned the model (`_mlp_start`).
    _mlp_session: UpdateSession
    _mlp_view: DeepSpeedView
    _mlp_chunk_update: ChunkUpdater
    _mlp_overlap_backward: OverlapBackward

    def __init__(
        self, module: Any, init_optimizer: Any, param_names: Any, timers: Any, ds_config: Any, **kwargs: Any
    ):
        config = from_ds_config(ds_config)
        if config is None:
            raise ValueError(troubleshooting.NO_SECTION.message())
        offload = kwargs.get("offload_optimizer_config")
        # DeepSpeed's options are checked before this (`adapter.options`); the objects here.
        refuse_unsupported(offload, init_optimizer)
        self._mlp_config: MLPOffloadConfig = config
        # Whether DeepSpeed's config enables one of its monitors (each step's figures go there).
        self._mlp_monitor = bool(get_monitor_config(ds_config).enabled)
        # DeepSpeed's `offload_optimizer` section (its buffers and pinning count in the settings).
        self._mlp_offload: Any = offload
        self._mlp_rank = dist.get_rank()
        # When the last step ended (forward and backward run until the next one starts).
        self._mlp_last_step_end: float | None = None
        # Backward time since the last step (all micro-batches), from DeepSpeed's backward hooks; when the
        # last backward started and ended (the one before a step ends its accumulation boundary).
        self._mlp_backward_secs = 0.0
        self._mlp_backward_start = 0.0
        self._mlp_backward_end = 0.0
        # The update running behind `step()`, until something waits for it (`_mlp_settle`), and what
        # records it then (the step's telemetry).
        self._mlp_inflight: UpdateInFlight[StepStats] | None = None
        # What records the update running behind `step()` once it ends (`StepUpdate.finish`).
        self._mlp_finish_update: Callable[[StepStats, float | None], None] = lambda stats, waited: None
        # The boundary's gradient norms widen each host gradient into this (`_mlp_grad_norm`). Kept from
        # one boundary to the next (8 bytes per element of the largest partition): freed in each step()
        # and touched afresh in the next backward, its freeing and page faults cost a large share of a
        # wide model's iteration; kept, the peak stays below DeepSpeed's (docs/results.md, "The update
        # behind the next forward"). Never allocated where the gradients are on an accelerator: their
        # norms are DeepSpeed's there.
        self._mlp_norm_scratch: torch.Tensor | None = None
        super().__init__(module, init_optimizer, param_names, timers, ds_config, **kwargs)
        self._mlp_start()

    # ----------------------------------------------------------------------------------------------
    # Construction hooks (called from DeepSpeed's __init__)

    def _swappable_optimizer_subgroup(self, sub_group_id: int) -> bool:
        # Every subgroup's state is in the store: the `safe_get/set_*` helpers go through the swap-in
        # and swap-out protocol, which `StateSwapper` serves (set at start, `_mlp_start`).
        return True

    def _configure_tensor_swapping(self, offload_optimizer_config: Any, aio_config: Any) -> None:
        pass

    def _create_fp32_partitions(self) -> None:
        """Leaves an empty fp32 tensor per subgroup in DeepSpeed's list; the state itself is written to
        the store chunk by chunk once the settings are resolved (`_mlp_start`)."""
        self.subgroup_to_device = dict.fromkeys(range(len(self.fp16_partitioned_groups_flat)), "cpu")
        for i in range(len(self.fp16_partitioned_groups_flat)):
            n = int(self.fp16_partitioned_groups_flat_numel[i])
            ids = self.fp16_partitioned_groups_flat_id[i]
            # DeepSpeed tags tensors with attributes (`ds_id`), which torch's types do not declare.
            placeholder: Any = torch.empty(0, dtype=self.master_weights_and_grads_dtype)
            placeholder.ds_id = f"{ids[0]}_{ids[-1]}"
            placeholder.requires_grad = True
            self.fp32_partitioned_groups_flat.append(placeholder)
            self._create_momentum_buffer(n, i, placeholder.ds_id)
        for param_group in self.optimizer.param_groups:
            param_group["params"] = []

    def initialize_optimizer_states(self) -> None:
        # CPU Adam creates its state at the first step; ours is already in the store (zero moments).
        pass

    def _offload_grad_partition_at_boundary(
        self, param: Any, grad_buffer: Any, offload_fp32_gradients: Any, offload_fp32_offsets: Any
    ) -> None:
        # Only the norm: the half-precision gradient stays in DeepSpeed's host buffer until its subgroup
        # is updated (delayed conversion); no fp32 copy, no storage I/O in backward.
        norm = self._mlp_grad_norm(grad_buffer)
        pid = self.get_param_id(param)
        self.norm_for_param_grads[pid] = norm
        self._mlp_session.stale.reduced(pid)
        self._mlp_overlap_backward.gradient_final(pid, norm)

    def partition_grads(self, params_to_release: list[Any], grad_partitions: list[Any]) -> Any:
        if not self.is_gradient_accumulation_boundary():
            # A micro-step before the boundary's last: DeepSpeed sums these into its host buffer, and
            # copies into its fp32 buffer only what the last micro-step reduces (`stale`).
            for param in params_to_release:
                self._mlp_session.stale.touched(self.get_param_id(param))
        return super().partition_grads(params_to_release, grad_partitions)

    def _mlp_grad_norm(self, grad: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's `_constant_buffered_norm2(grad)`, bit for bit: per part of its buffer size, the part
        widened to the norm dtype (fp64) and its 2-norm squared, summed, the square root. In host memory
        each part is widened into one scratch tensor, kept for the next boundary, where DeepSpeed
        allocates a new one per parameter: on the CPU the page faults of that fresh memory cost several
        times the copy and the norm together (64 Mi bf16 elements: 150 ms to widen into new memory, 18 ms
        into the scratch). The same values go through the same kernel: widening is exact, and the norm of a
        contiguous fp64 tensor does not depend on where it lies."""
        dtype = get_norm_dtype()
        if grad.device.type != "cpu" or grad.dtype == dtype:
            return self._constant_buffered_norm2(grad)
        norm: torch.Tensor | None = None
        for part in grad.view(-1).split(_NORM_BUFFER_SIZE):
            n = part.numel()
            scratch = self._mlp_norm_scratch
            if scratch is None or scratch.numel() < n or scratch.dtype != dtype:
                # Once: as large as this rank's largest gradient partition gets.
                largest = max(int(p.ds_tensor.numel()) for group in self.fp16_groups for p in group)
                scratch = torch.empty(max(n, min(largest, _NORM_BUFFER_SIZE)), dtype=dtype)
                self._mlp_norm_scratch = scratch
            wide = scratch[:n]
            wide.copy_(part.data)
            squared = wide.norm(2) ** 2.0
            norm = squared if norm is None else norm + squared
        assert norm is not None, "a gradient partition of no elements"
        return norm**0.5

    # ----------------------------------------------------------------------------------------------
    # Start-up: the settings, the session, the hooks

    def _mlp_start(self) -> None:
        """Once DeepSpeed has partitioned the model: the settings resolved (`settings.resolve`), the
        session opened over them, its helpers, the gathers hooked where the update runs on its thread,
        and the initial state written (`UpdateSession.start`)."""
        view = DeepSpeedView(self, tensor_steps=not isinstance(self.optimizer, DeepSpeedCPUAdam))
        facts = self._mlp_facts(view)
        settings = resolve(self._mlp_config, facts, self._mlp_check_kernel)
        session = UpdateSession.open(
            self._mlp_config,
            settings,
            view,
            self._mlp_rank,
            self._mlp_param_ranges(),
            self._mlp_check_kernel,
            facts.spare,
        )
        self._mlp_view, self._mlp_session = view, session
        if (swapper := view.on_nvme.swapper()) is not None:
            swapper.cache_limit = settings.params_cache
        self._mlp_chunk_update = ChunkUpdater(session, view)
        self._mlp_overlap_backward = OverlapBackward(session, view, self._mlp_chunk_update)
        self.optimizer_swapper = StateSwapper(session, view, self._mlp_chunk_update, self._mlp_settle)
        if session.update_thread is not None:
            self._mlp_wait_in_gathers()
        session.start(view)

    def _mlp_facts(self, view: DeepSpeedView) -> StartFacts:
        """What the settings follow from in DeepSpeed's config and optimizer, and the machine."""
        offload, flats = self._mlp_offload, self.fp16_partitioned_groups_flat
        first = flats[0]
        return StartFacts(
            numels=tuple(int(n) for n in self.fp16_partitioned_groups_flat_numel),
            buffer_count=int(offload.buffer_count),
            pin_memory=bool(offload.pin_memory),
            master=self.master_weights_and_grads_dtype,
            params=self.dtype,
            # With `fp32_optimizer_states` off (`bf16_optimizer_states`), CPU Adam keeps the moments in
            # the master weights' dtype.
            fp32_moments=getattr(self.optimizer, "fp32_optimizer_states", True),
            # DeepSpeed keeps a subgroup past `offload_param.max_in_cpu` on NVMe (no flat partition).
            params_on_host=first is None or first.device.type == "cpu",
            subgroups_on_nvme=sum(flat is None for flat in flats),
            params_on_nvme_bytes=view.on_nvme.partition_bytes(),
            params_on_nvme_held=view.on_nvme.most_held(),
            backward_bytes=view.backward_bytes(_NORM_BUFFER_SIZE),
            spare=memory.spare_host_memory,
            monitor=self._mlp_monitor,
            offload_ratio=view.offload_ratio(),
        )

    def _mlp_check_kernel(
        self, setting: str, dtypes: StateDtypes, stored: StateDtypes, threads: int | None
    ) -> KernelChoice:
        """`update_kernel`'s choice (`kernel_check.choose_update_kernel`) against this optimizer, the
        gradients and the partitions in the model's dtype."""
        half = self.dtype
        fused, why = kernel_check.choose_update_kernel(
            setting, self.optimizer, half, half, threads=threads, dtypes=dtypes, stored=stored
        )
        return KernelChoice(fused, why)

    def _mlp_param_ranges(self) -> ParamRanges:
        """Each parameter with a partition here: its id, subgroup, offset in it, elements. DeepSpeed's own
        test in partition_grads: a partition of padding gets no gradient."""
        return [
            (self.get_param_id(p), i, *self.grad_position[self.get_param_id(p)][1:])
            for i, group in enumerate(self.fp16_groups)
            for p in group
            if p.partition_numel() * self._get_param_partition_rank(p) < p.ds_numel
        ]

    # ----------------------------------------------------------------------------------------------
    # The update behind the next forward

    def _mlp_wait_in_gathers(self) -> None:
        """Makes every all-gather of the module's parameters (DeepSpeed's fetches and prefetches,
        `GatheredParameters`, the persistent parameters' gather) first wait for the subgroups of the
        trainable ones among them, while an update runs behind `step()`."""
        subgroup_of = {id(p): i for i, group in enumerate(self.fp16_groups) for p in group}

        def subgroups(params: Iterable[Any]) -> list[int]:
            return sorted({subgroup_of[id(p)] for p in params if id(p) in subgroup_of})

        def wait_for(params: list[Any]) -> None:
            if (inflight := self._mlp_inflight) is not None:
                try:
                    inflight.wait_for(subgroups(params))
                except BaseException:
                    # Raised once, as a failed step() raises it: what the update left stays.
                    self._mlp_inflight = None
                    raise

        def final(param: Any) -> bool:
            inflight, i = self._mlp_inflight, subgroup_of.get(id(param))
            return inflight is None or i is None or inflight.is_done(i)

        def after_update(gather: Callable[..., Any], owner: Any) -> Callable[..., Any]:
            @functools.wraps(gather)
            def gather_after_update(param_list: Any = None, *args: Any, **kwargs: Any) -> Any:
                params = [owner] if param_list is None else param_list
                self._mlp_overlap_backward.touched(params)
                wait_for(params)
                handle = gather(param_list, *args, **kwargs)
                if self._mlp_overlap_backward.on:
                    own_copies(params)
                return handle

            return gather_after_update

        # Every parameter, frozen ones too: DeepSpeed gathers a list through its first member's method.
        for p in self.module.parameters():
            if hasattr(p, "all_gather_coalesced"):
                p.all_gather = after_update(p.all_gather, p)
                p.all_gather_coalesced = after_update(p.all_gather_coalesced, p)
        if self._mlp_overlap_backward.on:
            # DeepSpeed gathered the persistent parameters before these wrappers were in place.
            own_copies(self.module.parameters())
        # DeepSpeed's prefetch of the partitions on NVMe reads them outside the gathers.
        if (swapper := self._mlp_view.on_nvme.swapper()) is not None:
            swapper.behind = UpdateBehind(final, wait_for)

    def _mlp_settle(self) -> None:
        """Waits for the update running behind `step()`, if one is, and records it; raises what it
        raised, once. An update during backward that `step()` has not settled is undone first:
        whatever calls this reads parameters, state or gradients as they were before it."""
        self._mlp_overlap_backward.abandon("state or parameters were read before step()")
        inflight, self._mlp_inflight = self._mlp_inflight, None
        if inflight is not None:
            self._mlp_finish_update(inflight.result(), inflight.waited_secs)

    @contextlib.contextmanager
    def _mlp_persistent_left_to_the_forward(self) -> Iterator[None]:
        """With `overlap`, leaves out DeepSpeed's gathers of the persistent parameters ahead of the next
        forward (at a step's end, and after a checkpoint is saved or loaded): each forward gathers them
        where it uses them, each once its subgroup is updated. So every forward starts with them
        partitioned, the first one in a process too.

        It has to be every forward. A module whose forward reads a parameter of another module while that
        parameter is partitioned (`nn.MultiheadAttention` reads its `out_proj`'s) makes it, once and for
        good, one of its own external parameters (DeepSpeed's `ZeROOrderedDict`), and DeepSpeed's fetch
        trace takes each module's parameters as they were when it recorded the trace. After
        `load_checkpoint` in a new process, DeepSpeed's gather left the first forward with them whole,
        the trace without them, and the next forward's fetches out of step with the trace ("tracing
        error")."""
        if not self._mlp_session.settings.overlap.on:
            yield
            return
        persistent, self.persistent_parameters = self.persistent_parameters, []
        try:
            yield
        finally:
            self.persistent_parameters = persistent

    def _post_step(self, timer_names: Any) -> None:
        # The update still runs: DeepSpeed's gather here would wait for it.
        with self._mlp_persistent_left_to_the_forward():
            super()._post_step(timer_names)

    def checkpoint_event_prologue(self) -> None:
        self._mlp_settle()
        super().checkpoint_event_prologue()

    def checkpoint_event_epilogue(self) -> None:
        with self._mlp_persistent_left_to_the_forward():
            super().checkpoint_event_epilogue()

    def offload_states(self, *args: Any, **kwargs: Any) -> None:
        """DeepSpeed's, once the update behind `step()` has ended: it moves the half-precision
        partitions that update writes and the gradient buffer it reads (an update during backward is
        undone first, as for any read before `step()`). The views of the gradient buffer kept from
        step to step go too: they would keep its memory past the move."""
        self._mlp_settle()
        self._mlp_chunk_update.half_grads.clear()
        super().offload_states(*args, **kwargs)

    # ----------------------------------------------------------------------------------------------
    # The step

    def backward_prologue(self) -> None:
        # Backward writes the gradients the update reads.
        self._mlp_settle()
        self._mlp_backward_start = time.perf_counter()
        self._mlp_overlap_backward.backward_started()
        self._mlp_view.on_nvme.enter("backward")
        super().backward_prologue()

    def backward_epilogue(self) -> None:
        super().backward_epilogue()
        self._mlp_view.on_nvme.enter("forward")
        self._mlp_backward_end = time.perf_counter()
        self._mlp_backward_secs += self._mlp_backward_end - self._mlp_backward_start
        self._mlp_overlap_backward.backward_ended(self._mlp_backward_end)

    def step(self, closure: Any = None) -> None:
        """DeepSpeed's step with the subgroup loop replaced by the pipeline (same operations per subgroup),
        which runs on behind this call with `overlap`: the update during backward settled, the step's
        outcome decided, the stale gradients taken, the update run, and recorded once it ends."""
        session, view = self._mlp_session, self._mlp_view
        backward_update = self._mlp_overlap_backward.take()
        self._mlp_settle()
        step_start = time.perf_counter()
        fwd_bwd = None if self._mlp_last_step_end is None else step_start - self._mlp_last_step_end
        backward_secs, self._mlp_backward_secs = self._mlp_backward_secs, 0.0
        boundary = self._mlp_overlap_backward.boundary_ended(
            backward_update, self._mlp_backward_start, self._mlp_backward_end
        )
        scaled_global_grad_norm = self._mlp_scaled_norm()
        if self._loss_scale_update_and_overflow_cleanup():
            self._mlp_skip_step(backward_update)
            return
        self._global_grad_norm = scaled_global_grad_norm / self.loss_scale
        timer_names: set[str] = {OPTIMIZER_STEP_TIMER}
        self.timers(OPTIMIZER_STEP_TIMER).start()
        # What `unscale_and_clip_grads` multiplies every fp32 gradient by this step (the fused pass
        # applies it; DeepSpeed's passes compute it themselves).
        step_factor = view.grad_scale(scaled_global_grad_norm)
        grad_scale = step_factor if session.fused is not None else 1.0
        # The param groups as this step sees them: an lr scheduler changes them once step() returns.
        snapshot = view.snapshot()
        settled = self._mlp_overlap_backward.settle(backward_update, grad_scale, snapshot.groups, boundary)
        if backward_update is not None:
            # Its subgroups' Adam steps before it (a kept one has moved them on).
            snapshot.steps = backward_update.snapshot.steps
        # The parameters this boundary gave no gradient (after the update during backward has ended: it
        # reads what this changes).
        stale_ranges, stale_record = session.stale.take(
            step_factor, session.param_ranges, view.param_half_grad, session.fp32_grads, self._mlp_param_name
        )
        update = StepUpdate(
            session,
            view,
            self._mlp_chunk_update,
            step_start,
            snapshot,
            grad_scale,
            scaled_global_grad_norm,
            settled,
            stale_ranges,
            fwd_bwd,
            backward_secs,
            StepParts(grads_final=boundary.record, overlap_backward=settled.record, stale=stale_record),
        )
        behind = session.settings.overlap.on
        if behind:
            steps = snapshot.steps
            assert session.update_thread is not None
            self._mlp_inflight = UpdateInFlight(
                update.run, len(steps), step=max(steps) + 1, thread=session.update_thread
            )
            self._mlp_finish_update = update.finish
        else:
            update.finish(update.run(lambda i: None), None)
        self.timers(OPTIMIZER_STEP_TIMER).stop()
        # With `wall_clock_breakdown`, the update's parts on DeepSpeed's line (behind step(): the last
        # one's, which ended before this step began).
        timer_names |= session.timers.take_into(self.timers)
        self._post_step(timer_names)
        update.returned = time.perf_counter()
        self._mlp_last_step_end = time.perf_counter()

    def _mlp_scaled_norm(self) -> Any:
        """DeepSpeed's step up to its outcome: the parameters partitioned, the overflow check, and the
        scaled global gradient norm (None on an overflow, which a norm not finite is too)."""
        self._pre_step()
        self._partition_all_parameters()
        self._overflow_check_and_loss_scale_update(update_scale=False)
        if self.overflow:
            return None
        self._apply_muon_to_accumulated_grads()
        scaled_global_grad_norm = combine_grad_norm_groups(self._get_norm_groups())
        if is_invalid_grad_norm(scaled_global_grad_norm):
            self.overflow = True
        return scaled_global_grad_norm

    def _mlp_param_name(self, pid: int) -> str:
        return str(self.param_names.get(self.param_dict[pid], pid))

    def _mlp_skip_step(self, backward_update: BackwardUpdate | None) -> None:
        """An fp16 overflow skips the update: no state is read, changed or written (what the update
        during backward changed is undone)."""
        session = self._mlp_session
        record = self._mlp_overlap_backward.skipped_step(backward_update)
        session.stale.skipped()
        session.planner.emit(
            {
                "event": "skipped",
                "rank": self._mlp_rank,
                "loss_scale": float(self.loss_scale),
                "overlap_backward": record,
            }
        )
        self._mlp_last_step_end = time.perf_counter()
        session.fp32_grads.clear()

    # ----------------------------------------------------------------------------------------------
    # Checkpoints (DeepSpeed's own ZeRO-3 format) and the end of training

    def state_dict(self) -> Any:
        """DeepSpeed's ZeRO-3 optimizer state dict, the state gathered from the cache and the store."""
        self._mlp_settle()
        return checkpoint.state_dict(self, self._mlp_session, self._mlp_view)

    def _restore_from_bit16_weights(self) -> None:
        """DeepSpeed's `refresh_fp32_params` (a checkpoint loaded without its optimizer states, or only
        the module): the fp32 weights become the half-precision partitions, widened; the moments stay."""
        self._mlp_settle()
        view = self._mlp_view
        for i in range(len(self.fp16_partitioned_groups_flat)):
            self._mlp_session.state.set_params(i, view.partition(i))
        view.settle_partitions()

    def _rigid_load_state_dict(self, state_dict: Any, load_optimizer_states: bool = True) -> None:
        """Loads this rank's part of a ZeRO-3 checkpoint saved by this engine or by stock DeepSpeed
        (same data-parallel degree) into the store. DeepSpeed's own `load_state_dict` calls it, and does
        the rest itself: the elastic-checkpoint refusal, `load_serial`, the persistent parameters."""
        self._mlp_settle()
        checkpoint.load_state_dict(self, self._mlp_session, self._mlp_view, state_dict, load_optimizer_states)

    def _load_universal_checkpoint(
        self, checkpoint_folder: Any, load_optimizer_states: bool, load_from_fp32_weights: bool
    ) -> None:
        """A universal checkpoint (`ds_to_universal.py`'s, of any data-parallel degree) into the store,
        chunk by chunk, as stock DeepSpeed loads it (`checkpoint.load_universal`)."""
        self._mlp_settle()
        checkpoint.load_universal(
            self,
            self._mlp_session,
            self._mlp_view,
            checkpoint_folder,
            load_optimizer_states,
            load_from_fp32_weights,
        )

    def _mlp_engine_step(self, monitor: Any, samples: int) -> None:
        """DeepSpeed's engine took a step (`integration` calls this after `_take_model_step`): its monitor
        and its sample count, for the step's figures (`monitors.MonitorWriter`)."""
        self._mlp_session.monitor.step_taken(monitor, samples)

    @property
    def mlp_offload_telemetry(self) -> list[dict[str, Any]]:
        """Every record so far: the start-up plan, then one per step (the same as the JSON lines)."""
        return self._mlp_session.planner.records

    def mlp_offload_wait(self) -> None:
        """Waits for the update running behind the last `step()` (with `overlap`), so the state and the
        telemetry are the step's; raises what it raised. Whatever reads them through DeepSpeed waits on
        its own. Call it on every rank: recording the update takes the ranks' tuners' agreement, a
        collective (`adapt`)."""
        self._mlp_settle()

    def mlp_offload_flush(self) -> None:
        """Writes the cached chunks back and syncs the store (at the end of training, before copying the
        store's directories)."""
        self._mlp_settle()
        self._mlp_session.pipeline.flush()
        self._mlp_session.store.sync()

    def destroy(self) -> None:
        """Writes the cached chunks back, so the store holds the state of one step (the last), not
        a mix of steps under a valid manifest; then closes the pipeline, the store and telemetry."""
        session = getattr(self, "_mlp_session", None)
        if session is not None:
            try:
                self._mlp_settle()
                session.pipeline.flush()
            finally:
                session.close()
                self._mlp_chunk_update.close()
                # What the engine held of DeepSpeed's host memory between steps goes with it.
                self._mlp_norm_scratch = None
        super_destroy = getattr(super(), "destroy", None)
        if super_destroy is not None:
            super_destroy()
