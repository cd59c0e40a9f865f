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

This module holds DeepSpeed's hooks and the step's outline; the rest is the engine's (`engine.state`:
the chunks and their objects; `engine.planning`: budget, plan, tuner, the plan of the update during
backward, telemetry) and the adapter's (`adapter.step_update`: one step's update over the chunks;
`adapter.overlap_backward`: the update during backward; `adapter.checkpoint`: DeepSpeed's checkpoints
and its swapper protocol).
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
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm
from deepspeed.runtime.zero.stage3 import OPTIMIZER_STEP_TIMER
from deepspeed.runtime.zero.utils import get_norm_dtype

from mlp_offload.adapter import checkpoint, kernel_check, master_in_params, stale_gradients, troubleshooting
from mlp_offload.adapter.checkpoint import DeepSpeedZeroOptimizer_Stage3, StateSwapper
from mlp_offload.adapter.chunk_update import ChunkUpdater
from mlp_offload.adapter.overlap_backward import BackwardUpdate, OverlapBackward, StepSnapshot
from mlp_offload.adapter.step_update import StepUpdate
from mlp_offload.common.config import MLPOffloadConfig, from_ds_config
from mlp_offload.engine import fused_update, memory, overlap, state_dtypes
from mlp_offload.engine.overlap import UpdateInFlight, update_thread
from mlp_offload.engine.pipeline import StepStats
from mlp_offload.engine.planning import (
    StepParts,
    UpdatePlanner,
    cache_chunks,
    host_memory_budget,
    kept_copies_room,
    start_line,
    update_chunk,
)
from mlp_offload.engine.state import FP32, ChunkedState
from mlp_offload.engine.store import ObjectStore
from mlp_offload.engine.telemetry import StaleStep, StartRecord

log = logging.getLogger("mlp_offload")

# DeepSpeed's `_constant_buffered_norm2` buffer size: the parts whose norms it sums.
_NORM_BUFFER_SIZE = int(
    inspect.signature(DeepSpeedZeroOptimizer_Stage3._constant_buffered_norm2)
    .parameters["buffer_size"]
    .default
)

# The optimizers whose state is ours to hold: per element, exp_avg and exp_avg_sq beside the weights.
ADAM_OPTIMIZERS = (DeepSpeedCPUAdam, torch.optim.Adam, torch.optim.AdamW)


def _check_optimizer(optimizer: Any) -> None:
    """Refuses, by name, an optimizer whose state the store does not hold."""
    if not isinstance(optimizer, ADAM_OPTIMIZERS):
        kind = type(optimizer)
        raise ValueError(
            troubleshooting.OPTIMIZER.message(optimizer=f"{kind.__module__}.{kind.__qualname__}")
        )
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            raise ValueError(troubleshooting.AMSGRAD.message())


def _offload_device(offload: Any) -> str:
    """The device of a DeepSpeed offload section (`offload_optimizer` or `offload_param`, a pydantic
    model whose `device` is an enum or its string)."""
    return str(getattr(offload.device, "value", offload.device))


def _check_params_offload(params_offload: Any, param_groups: list[dict[str, Any]], world: int) -> None:
    """Refuses, before DeepSpeed partitions the model and builds its NVMe swapper, parameters offloaded
    to NVMe past `offload_param.max_in_cpu`: DeepSpeed then keeps the partitions of the subgroups past
    it on NVMe alone, and the update (which writes each subgroup's half-precision partition in host
    memory) has nowhere to write them. Within it, every partition has its place in host memory and the
    update runs as with `device: cpu`."""
    if params_offload is None or _offload_device(params_offload) != "nvme":
        return
    # DeepSpeed's count (stage3.py): each trainable parameter's partition, ceil(numel / ranks), summed.
    elements = sum(
        -(-int(getattr(p, "ds_numel", p.numel())) // world)
        for group in param_groups
        for p in group["params"]
        if p.requires_grad
    )
    if elements > int(params_offload.max_in_cpu):
        raise ValueError(
            troubleshooting.PARAMS_ON_NVME.message(
                max_in_cpu=int(params_offload.max_in_cpu), elements=elements
            )
        )


def _is_its_partition(param: Any) -> bool:
    """Whether the parameter's data is its partition's memory (where one rank holds it whole)."""
    partition = getattr(param, "ds_tensor", None)
    return (
        partition is not None
        and param.data.numel() > 0
        and param.data.untyped_storage().data_ptr() == partition.untyped_storage().data_ptr()
    )


__all__ = ["DeepSpeedZeroOptimizer_Stage3", "MLPOffloadStage3"]


def _budget_error(error: ValueError, host_memory: int, layout: memory.ChunkLayout) -> ValueError:
    """`error`, whose text begins with a key of our section, named as the config's key
    (mlp_offload.host_memory, mlp_offload.cache_chunks), with what the budget holds."""
    return ValueError(
        troubleshooting.HOST_MEMORY.message(
            problem=error, host_memory=host_memory, buffers=layout.buffers, buffer_bytes=layout.buffer_bytes
        )
    )


class MLPOffloadStage3(DeepSpeedZeroOptimizer_Stage3):
    """DeepSpeed's ZeRO-3 optimizer with the optimizer state in the object store (see module docs)."""

    overflow: bool  # set by DeepSpeed's overflow check
    persistent_parameters: list[Any]  # set by DeepSpeed's __init__: parameters every rank keeps whole
    _mlp_planner: UpdatePlanner  # set, with the store, once DeepSpeed's __init__ has cut the subgroups
    _mlp_store: ObjectStore
    _mlp_state: ChunkedState  # set once DeepSpeed's __init__ has partitioned the model
    _mlp_grads_final: overlap.GradsFinal  # set with it

    def __init__(
        self, module: Any, init_optimizer: Any, param_names: Any, timers: Any, ds_config: Any, **kwargs: Any
    ):
        config = from_ds_config(ds_config)
        if config is None:
            raise ValueError(troubleshooting.NO_SECTION.message())
        offload = kwargs.get("offload_optimizer_config")
        if offload is None or _offload_device(offload) != "cpu":
            raise ValueError(troubleshooting.OFFLOAD_DEVICE.message())
        # DeepSpeed's options are checked before this (`adapter.options`); the objects here.
        _check_optimizer(init_optimizer)
        _check_params_offload(
            kwargs.get("offload_param_config"),
            init_optimizer.param_groups,
            dist.get_world_size(group=kwargs.get("dp_process_group")),
        )
        # Set before the base __init__, which calls the overridden hooks below.
        self._mlp_config: MLPOffloadConfig = config
        # DeepSpeed's CPU Adam counts its steps in an int; torch's optimizers in a tensor.
        self._mlp_tensor_steps = not isinstance(init_optimizer, DeepSpeedCPUAdam)
        # Subgroup -> its fp32 gradient, where DeepSpeed's gradient setters wrote one (else the
        # half-precision gradient is converted chunk by chunk); cleared by each step.
        self._mlp_fp32_grads: dict[int, torch.Tensor] = {}
        self._mlp_buffer_count = int(offload.buffer_count)
        self._mlp_pin = bool(offload.pin_memory)
        self._mlp_rank = dist.get_rank()
        # The profile and the store come in `_create_fp32_partitions`, once the subgroups' sizes are known
        # and the budget checked against them.
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
        # The update during backward (`overlap_backward`), turned on at start (`_mlp_start`).
        self._mlp_overlap_backward = OverlapBackward(self)
        # What records the update running behind `step()` once it ends (`StepUpdate.finish`).
        self._mlp_finish_update: Callable[[StepStats, float | None], None] = lambda stats, waited: None
        # The boundary's gradient norms widen each host gradient into this (`_mlp_grad_norm`). Kept from
        # one boundary to the next (8 bytes per element of the largest partition): freed in each step()
        # and touched afresh in the next backward, its freeing and page faults cost a large share of a
        # wide model's iteration; kept, the peak stays below DeepSpeed's (docs/results.md, "The update
        # behind the next forward"). Never allocated where the gradients are on an accelerator: their
        # norms are DeepSpeed's there.
        self._mlp_norm_scratch: torch.Tensor | None = None
        # Which parameters' gradients each boundary reduced, and the factors the steps since applied to
        # the others' (`stale`): a parameter without a gradient is updated as stock DeepSpeed updates it.
        self._mlp_stale = stale_gradients.StaleGradients()
        # The dtypes DeepSpeed keeps the state in, and the fused pass (None: DeepSpeed's kernel): both
        # chosen at start (`_mlp_start`), the moments' again after a load (`_mlp_follow_loaded_moments`).
        self._mlp_dtypes = state_dtypes.FP32_STATE
        self._mlp_fused: fused_update.FusedAdam | None = None
        super().__init__(module, init_optimizer, param_names, timers, ds_config, **kwargs)
        self._mlp_start()

    # ----------------------------------------------------------------------------------------------
    # Construction hooks (called from DeepSpeed's __init__)

    def _swappable_optimizer_subgroup(self, sub_group_id: int) -> bool:
        # Every subgroup's state is in the store: the `safe_get/set_*` helpers go through the swap-in
        # and swap-out protocol, which `StateSwapper` serves.
        return True

    def _configure_tensor_swapping(self, offload_optimizer_config: Any, aio_config: Any) -> None:
        pass

    def _create_fp32_partitions(self) -> None:
        """Checks a configured budget against the subgroups, opens the store (`_mlp_open_store`), and
        leaves an empty fp32 tensor per subgroup in DeepSpeed's list; the state itself is written to the
        store chunk by chunk once the budget is known (`_mlp_start`)."""
        self._mlp_check_configured_budget([int(n) for n in self.fp16_partitioned_groups_flat_numel])
        self._mlp_open_store()
        self.subgroup_to_device = dict.fromkeys(range(len(self.fp16_partitioned_groups_flat)), "cpu")
        self.optimizer_swapper = StateSwapper(self)
        for i, fp16_flat in enumerate(self.fp16_partitioned_groups_flat):
            n = int(self.fp16_partitioned_groups_flat_numel[i])
            ids = self.fp16_partitioned_groups_flat_id[i]
            if fp16_flat is None:
                # Refused at start (`_check_params_offload`) unless DeepSpeed's count changes.
                raise ValueError(
                    "zero_optimization.offload_param: parameters on NVMe are not supported with mlp_offload "
                    f"past offload_param.max_in_cpu (subgroup {i} has no partition in host memory)"
                )
            # DeepSpeed tags tensors with attributes (`ds_id`), which torch's types do not declare.
            placeholder: Any = torch.empty(0, dtype=self.master_weights_and_grads_dtype)
            placeholder.ds_id = f"{ids[0]}_{ids[-1]}"
            placeholder.requires_grad = True
            self.fp32_partitioned_groups_flat.append(placeholder)
            self._create_momentum_buffer(n, i, placeholder.ds_id)
        for param_group in self.optimizer.param_groups:
            param_group["params"] = []

    def _mlp_check_configured_budget(self, numels: list[int]) -> None:
        """A configured budget (a size, or `"deepspeed"`) that holds no chunk, or a `cache_chunks` that
        leaves it no buffer to stream through, refused here: the first hook that knows the subgroups'
        sizes, before the paths are probed (`_mlp_open_store`), not after a probe of each. `_mlp_start`
        checks again whatever the budget (with `"auto"`, what this rank can spare once DeepSpeed has
        allocated)."""
        if self._mlp_config.host_memory != "auto":
            self._mlp_budget(numels)

    def _mlp_budget(self, numels: list[int]) -> tuple[int, str, memory.ChunkLayout, int]:
        """The state's host memory and how it was chosen, its chunks, and how many of them the cache
        keeps; a budget that holds no chunk, or a cache that leaves no buffer to stream through, is a
        `ValueError` named as the config's key."""
        config = self._mlp_config
        master_bytes = torch.empty(0, dtype=self.master_weights_and_grads_dtype).element_size()
        state_bytes = self._mlp_state_dtypes().bytes_per_element
        host_memory, source = host_memory_budget(
            config, numels, self._mlp_buffer_count, master_bytes, state_bytes
        )
        layout = memory.chunk_layout(numels, host_memory, update_chunk(config), state_bytes)
        try:
            layout.require_a_buffer(host_memory)
            _, cache_slots = memory.stream_buffers(layout.buffers, len(layout.chunks), cache_chunks(config))
        except ValueError as e:
            raise _budget_error(e, host_memory, layout) from None
        return host_memory, source, layout, cache_slots

    def _mlp_open_store(self) -> None:
        """The paths' profile (a probe with `weights: "auto"`, `UpdatePlanner.load_profile`), then the
        store over the paths."""
        config = self._mlp_config
        self._mlp_planner = UpdatePlanner(config, self._mlp_rank)
        # Before the store opens: its node-wide admission takes the device limits the profile gives.
        self._mlp_planner.load_profile()
        self._mlp_inflight_count = self._mlp_planner.max_inflight()
        self._mlp_store = ObjectStore(
            config.paths,
            rank=self._mlp_rank,
            engine=config.engine,
            chunk_size=config.chunk_size,
            max_inflight=self._mlp_inflight_count[0],
            weights=config.weights if isinstance(config.weights, list) else None,
            checksum=config.checksum,
            shadow_slots=config.shadow_slots,
            device_inflight=self._mlp_planner.device_inflight(),
            device_sharing=self._mlp_planner.device_sharing(),
        )

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
        self._mlp_stale.reduced(pid)
        self._mlp_overlap_backward.gradient_final(pid, norm)

    def partition_grads(self, params_to_release: list[Any], grad_partitions: list[Any]) -> Any:
        if not self.is_gradient_accumulation_boundary():
            # A micro-step before the boundary's last: DeepSpeed sums these into its host buffer, and
            # copies into its fp32 buffer only what the last micro-step reduces (`stale`).
            for param in params_to_release:
                self._mlp_stale.touched(self.get_param_id(param))
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
    # Start-up: budget, chunks, plan, initial state

    def _mlp_state_dtypes(self) -> state_dtypes.StateDtypes:
        """The dtypes DeepSpeed keeps the state in: its master weights' (`master_weights_and_grads_dtype`,
        from `bf16_master_weights_and_grads` or `fp16_master_weights_and_grads`), and its CPU Adam's
        moments (fp32, or with `fp32_optimizer_states` off, as `bf16_optimizer_states` turns it off, the
        weights'). The store keeps each array in its dtype (`state_dtypes.StateDtypes.arrays`), and the
        master weights in the parameters where they hold their bits (`master_in_params`)."""
        master = self.master_weights_and_grads_dtype
        fp32_moments = getattr(self.optimizer, "fp32_optimizer_states", True)
        in_params, _ = self._mlp_master_in_params()
        return state_dtypes.StateDtypes(master, torch.float32 if fp32_moments else master, in_params)

    def _mlp_master_in_params(self) -> tuple[bool, str]:
        """Whether the master weights are kept in the parameters (`master_in_params.choose`), and why."""
        params = self.fp16_partitioned_groups_flat[0].dtype
        return master_in_params.choose(self._mlp_config, self.master_weights_and_grads_dtype, params)

    def _mlp_choose_kernel(
        self, dtypes: state_dtypes.StateDtypes, stored: state_dtypes.StateDtypes
    ) -> tuple[fused_update.FusedAdam | None, str]:
        """`update_kernel`'s choice for the state in `dtypes` kept in `stored`
        (`kernel_check.choose_update_kernel`), the gradients and the partitions in the model's dtype."""
        config = self._mlp_config
        half = self.fp16_partitioned_groups_flat[0].dtype
        threads = None if config.update_threads == "auto" else config.update_threads
        return kernel_check.choose_update_kernel(
            config.update_kernel, self.optimizer, half, half, threads=threads, dtypes=dtypes, stored=stored
        )

    def _mlp_follow_loaded_moments(self, dtype: torch.dtype) -> None:
        """The moments a checkpoint's load left in `dtype`. torch's `Optimizer.load_state_dict` casts
        every state tensor to its parameter's dtype, so after stock DeepSpeed loads a checkpoint its
        moments are in the master weights' dtype (fp32 moments saved beside bf16 master weights come
        back bf16), and its CPU Adam runs on them in that dtype from then on. The fused pass follows,
        checked again against DeepSpeed's kernel in those dtypes; the chunks keep their layout (fp32
        moments hold the narrower values exactly)."""
        if dtype == self._mlp_dtypes.moments:
            return
        dtypes = state_dtypes.StateDtypes(self._mlp_dtypes.master, dtype)
        log.warning(
            "mlp_offload: the checkpoint's load left the Adam moments in %s, as DeepSpeed's (torch's "
            "load_state_dict casts them to the master weights' dtype): the update goes on with %s",
            dtype,
            dtypes,
        )
        stored = self._mlp_state.stored
        fused, _ = self._mlp_choose_kernel(dtypes, stored)
        assert fused is not None, "choose_update_kernel refuses a state in half precision without it"
        old = self._mlp_fused
        if old is not None and fused.kernel.arith == old.kernel.arith:
            # The same arithmetic: the kernel, and so DeepSpeed's bias-correction history, stays.
            fused = fused_update.FusedAdam(
                old.kernel, adamw=fused.adamw, threads=fused.threads, dtypes=dtypes, stored=stored
            )
        self._mlp_fused = fused
        self._mlp_dtypes = dtypes

    def _mlp_start(self) -> None:
        """Once DeepSpeed has partitioned the model: the budget and its chunks, the update's kernel, the
        overlaps and the chunked state, the scratch, the plan, the initial state in the store, and the
        start record."""
        numels = [int(n) for n in self.fp16_partitioned_groups_flat_numel]
        host_memory, budget_source, layout, cache_slots = self._mlp_budget(numels)
        first_half = self.fp16_partitioned_groups_flat[0]
        params_on_host = first_half.device.type == "cpu"
        self._mlp_dtypes = self._mlp_state_dtypes()
        self._mlp_stale.dtype = self._mlp_dtypes.master
        # The chunks keep the state in DeepSpeed's dtypes: the mode's bytes.
        self._mlp_fused, kernel_why = self._mlp_choose_kernel(self._mlp_dtypes, self._mlp_dtypes)
        pages = self._mlp_planner.host_pages()
        try:
            every_cached = cache_slots == len(layout.chunks)
            whys = self._mlp_open_state(numels, host_memory, layout, every_cached, params_on_host, pages[0])
        except ValueError as e:
            raise _budget_error(e, host_memory, layout) from None
        whys["kernel"] = kernel_why
        whys["master_in_params"] = self._mlp_master_in_params()[1]
        self._mlp_chunk_update = ChunkUpdater(
            self, layout.elements, first_half.element_size(), params_on_host
        )
        # Each parameter with a partition here: its id, subgroup, offset in it, elements. DeepSpeed's own
        # test in partition_grads: a partition of padding gets no gradient.
        self._mlp_param_ranges = [
            (self.get_param_id(p), i, *self.grad_position[self.get_param_id(p)][1:])
            for i, group in enumerate(self.fp16_groups)
            for p in group
            if p.partition_numel() * self._get_param_partition_rank(p) < p.ds_numel
        ]
        self._mlp_grads_final = overlap.GradsFinal(self._mlp_state.chunks, self._mlp_param_ranges)
        if self._mlp_overlap or self._mlp_overlap_backward.on:
            self._mlp_update_thread = update_thread()
            self._mlp_wait_in_gathers()
        pipeline = self._mlp_state.pipeline
        # How the buffers are backed before the initial state fills them.
        page_report = pipeline.page_report
        plan = self._mlp_planner.plan(pipeline, self._mlp_store)
        # The initial state, placed by the plan's weights, through the pool's buffers.
        self._mlp_state.initialize(lambda i: self.fp16_partitioned_groups_flat[i])
        if self._mlp_overlap_backward.on and self._mlp_config.overlap_backward is True:
            # Every streamed chunk is updated during backward: each gets its second slot now, so a full
            # disk shows at start-up, naming the file.
            self._mlp_state.with_second_slots(pipeline.order[pipeline.cache_slots :], keep_free=False)
        self._mlp_report_start(numels, host_memory, budget_source, layout, (*pages, page_report), whys, plan)

    def _mlp_open_state(
        self,
        numels: list[int],
        host_memory: int,
        layout: memory.ChunkLayout,
        every_cached: bool,
        params_on_host: bool,
        pages: str,
    ) -> dict[str, str]:
        """Whether the update runs behind `step()` and during backward, and the chunked state over the
        store (its pipeline sizes the cache, "auto": every chunk when all fit, else what the stream
        leaves, and checks it). Returns why each overlap is on or off."""
        config = self._mlp_config
        fused = self._mlp_fused is not None
        self._mlp_overlap, overlap_why = overlap.choose_overlap(config.overlap, fused, every_cached)
        kept_copies = 0
        if every_cached and config.overlap_backward is not False and fused:
            kept_copies = kept_copies_room(config, host_memory, layout)
        backward = self._mlp_overlap_backward
        backward.on, backward_why = overlap.choose_overlap_backward(
            config.overlap_backward, fused, not every_cached, params_on_host, kept_copies
        )
        if backward.on and self._mlp_dtypes.master_in_params:
            backward.on, backward_why = False, master_in_params.BACKWARD_OFF
        self._mlp_state = ChunkedState(
            self._mlp_store,
            numels,
            layout,
            cache_chunks=cache_chunks(config),
            lock=self._mlp_pin,
            pages=pages,
            # The update during backward needs chunk order too (the first chunks cached): from the
            # start with `overlap_backward: true`, else once the plan finds it pays (`step()`).
            ascending=self._mlp_overlap or (backward.on and config.overlap_backward is True),
            shadow_slots=config.shadow_slots,
            kept_copies=kept_copies if backward.on else 0,
            stored=self._mlp_dtypes,
            partition=lambda i: self.fp16_partitioned_groups_flat[i].data,
        )
        pipeline = self._mlp_state.pipeline
        if backward.on and pipeline.cache_slots_in_chunk_order == pipeline.cache_slots:
            # Chunk order costs its cache nothing here: from the start.
            pipeline.go_ascending()
        # The plan predicts what the update during backward leaves once the steps go in chunk order.
        self._mlp_planner.overlap_backward = backward.on and pipeline.ascending
        return {"overlap": overlap_why, "overlap_backward": backward_why}

    def _mlp_report_start(
        self,
        numels: list[int],
        host_memory: int,
        budget_source: str,
        layout: memory.ChunkLayout,
        host_pages: tuple[str, str, dict[str, int]],
        whys: dict[str, str],
        plan: dict[str, Any] | None,
    ) -> None:
        """The start record (the telemetry's first) and the start-up line. `host_pages`: the pages asked
        for, why, and how the kernel backed the buffers."""
        config = self._mlp_config
        pipeline = self._mlp_state.pipeline
        c, buffer_bytes = layout.elements, layout.buffer_bytes
        pages, pages_source, page_report = host_pages
        reports = self._mlp_store.path_reports()
        record: StartRecord = {
            "event": "start",
            "rank": self._mlp_rank,
            "paths": config.paths,
            "subgroups": len(numels),
            "largest_subgroup_elements": max(numels),
            "chunks": len(layout.chunks),
            "chunk_elements": c,
            "host_memory": host_memory,
            "host_memory_source": budget_source,
            "buffers": pipeline.buffer_count,
            "buffer_bytes": buffer_bytes,
            "cached_chunks": pipeline.cache_slots,
            # The pages asked for, why, and how the kernel backed the buffers.
            "host_pages": {
                "pages": pages,
                "source": pages_source,
                "bytes": page_report["bytes"],
                "reserved_huge_bytes": page_report["reserved_huge_bytes"],
                "transparent_huge_bytes": page_report["transparent_huge_bytes"],
            },
            # Which update runs per chunk (the fused pass or DeepSpeed's), and why.
            "update_kernel": fused_update.kernel_record(self._mlp_fused, self._mlp_dtypes, whys["kernel"]),
            # Whether the master weights are kept in the parameters, and why.
            "master_in_params": {"on": self._mlp_dtypes.master_in_params, "why": whys["master_in_params"]},
            # Whether the update runs behind the next forward, and why.
            "overlap": {"on": self._mlp_overlap, "why": whys["overlap"]},
            # Whether chunks are updated during backward, and why.
            "overlap_backward": {
                "on": self._mlp_overlap_backward.on,
                "why": whys["overlap_backward"],
                # Chunks with a second slot on disk, and the bytes the ones added for it took.
                "slotted_chunks": len(self._mlp_state.slotted),
                "slot_bytes": self._mlp_state.slot_bytes,
                # The most kept copies in host memory for cached chunks (made when first wanted).
                "kept_copies_limit": pipeline.kept_limit,
            },
            "weights": self._mlp_store.weights,
            # This rank's requests in flight per path, and why.
            "max_inflight": {"count": self._mlp_inflight_count[0], "source": self._mlp_inflight_count[1]},
            # Per path, the node-wide limit of requests in flight on its device (None: no admission).
            "device_inflight": [r["device_inflight"] for r in reports],
            "device_sharing": [r["device_sharing"] for r in reports],
            # Per path, this rank's part of its device's probed bandwidth, which the plan takes.
            "rank_share": self._mlp_planner.rank_share,
            # The job's nodes, each path's locality, and this node's part of a shared path among them.
            "nodes": self._mlp_planner.nodes,
            "locality": self._mlp_planner.locality,
            "node_share": self._mlp_planner.node_share,
            "plan": plan,
        }
        self._mlp_planner.emit(record)
        log.info("%s", start_line(record))

    # ----------------------------------------------------------------------------------------------
    def _mlp_step_value(self, step: int) -> Any:
        """An Adam step count as the optimizer keeps it."""
        if not self._mlp_tensor_steps:
            return step
        # torch's Adam keeps it as a float tensor of its scalar dtype.
        return torch.tensor(
            float(step), dtype=torch.float64 if torch.get_default_dtype() == torch.float64 else FP32
        )

    def _mlp_bind_state(self, i: int, state_bytes: torch.Tensor) -> None:
        """Points DeepSpeed's fp32 tensor and its Adam state at subgroup `i`'s `[params | exp_avg |
        exp_avg_sq]`: at the state itself, or where DeepSpeed keeps them in half precision, at copies in
        its dtypes (`_mlp_collect_state` brings what was written to them back)."""
        n = int(self.fp16_partitioned_groups_flat_numel[i])
        state = state_bytes.view(FP32)
        fp32 = self.fp32_partitioned_groups_flat[i]
        dtypes = self._mlp_dtypes
        fp32.data = state[:n].to(dtypes.master)
        adam = self.optimizer.state[fp32]
        if "step" not in adam:
            adam["step"] = self._mlp_step_value(0)
        adam["exp_avg"] = state[n : 2 * n].to(dtypes.moments)
        adam["exp_avg_sq"] = state[2 * n : 3 * n].to(dtypes.moments)

    def _mlp_collect_state(self, i: int, state_bytes: torch.Tensor) -> None:
        """Subgroup `i`'s state as DeepSpeed's tensors bound to it (`_mlp_bind_state`) now hold it, back
        into `state_bytes` where they are copies (widened: exact)."""
        n = int(self.fp16_partitioned_groups_flat_numel[i])
        state = state_bytes.view(FP32)
        fp32 = self.fp32_partitioned_groups_flat[i]
        adam = self.optimizer.state[fp32]
        for k, bound in enumerate((fp32.data, adam["exp_avg"], adam["exp_avg_sq"])):
            whole = state[k * n : (k + 1) * n]
            if bound.data_ptr() != whole.data_ptr():
                whole.copy_(bound)

    def _mlp_unbind(self, i: int) -> None:
        fp32 = self.fp32_partitioned_groups_flat[i]
        fp32.data = torch.empty(0, dtype=FP32)
        fp32.grad = None
        adam = self.optimizer.state[fp32]
        for key in ("exp_avg", "exp_avg_sq"):
            if key in adam:
                adam[key] = torch.empty(0, dtype=FP32)

    def _mlp_clip_ratio(self, total_norm: Any) -> Any:
        """DeepSpeed's clipping ratio in `unscale_and_clip_grads` for a scaled gradient norm (a float, or a
        0-dim tensor: the same operations either way); it clips where this is above 1."""
        return ((total_norm / self.loss_scale) + 1e-6) / self.clip_grad

    def _mlp_grad_scale(self, total_norm: Any) -> float:
        """What DeepSpeed's `unscale_and_clip_grads` multiplies every fp32 gradient by this step, from the
        same expressions (a float, or a 0-dim tensor's value: torch multiplies by it as a float)."""
        combined_scale = self.loss_scale
        if self.clip_grad > 0.0:
            clip = torch.clamp(self._mlp_clip_ratio(total_norm), min=1.0)
            combined_scale = clip * self.loss_scale
        return float(1.0 / combined_scale)

    # ----------------------------------------------------------------------------------------------
    # The update behind the next forward

    def _mlp_wait_in_gathers(self) -> None:
        """Makes every all-gather of the module's parameters (DeepSpeed's fetches and prefetches,
        `GatheredParameters`, the persistent parameters' gather) first wait for the subgroups of the
        trainable ones among them, while an update runs behind `step()`."""
        subgroup_of = {id(p): i for i, group in enumerate(self.fp16_groups) for p in group}

        def subgroups(params: Iterable[Any]) -> list[int]:
            return sorted({subgroup_of[id(p)] for p in params if id(p) in subgroup_of})

        def after_update(gather: Callable[..., Any], owner: Any) -> Callable[..., Any]:
            @functools.wraps(gather)
            def gather_after_update(param_list: Any = None, *args: Any, **kwargs: Any) -> Any:
                params = [owner] if param_list is None else param_list
                self._mlp_overlap_backward.touched(params)
                if (inflight := self._mlp_inflight) is not None:
                    try:
                        inflight.wait_for(subgroups(params))
                    except BaseException:
                        # Raised once, as a failed step() raises it: what the update left stays.
                        self._mlp_inflight = None
                        raise
                handle = gather(param_list, *args, **kwargs)
                if self._mlp_overlap_backward.on:
                    self._mlp_own_copies(params)
                return handle

            return gather_after_update

        # Every parameter, frozen ones too: DeepSpeed gathers a list through its first member's method.
        for p in self.module.parameters():
            if hasattr(p, "all_gather_coalesced"):
                p.all_gather = after_update(p.all_gather, p)
                p.all_gather_coalesced = after_update(p.all_gather_coalesced, p)
        if self._mlp_overlap_backward.on:
            # DeepSpeed gathered the persistent parameters before these wrappers were in place.
            self._mlp_own_copies(self.module.parameters())

    def _mlp_own_copies(self, params: Iterable[Any]) -> None:
        """Gives each persistent parameter among `params` whose data is its partition (DeepSpeed's
        "gather" where one rank holds the whole parameter, `NoGatherHandle`) a copy of its own. The
        update during backward writes the partitions before `step()`; a persistent parameter stays
        whole between uses, and its new values would show to whatever reads it between backward and
        `step()` (an eval pass, a hook), where stock's show after `step()`. DeepSpeed gathers these
        again at each step's end (the next forward does, behind an update still running), and each
        gather here copies again. Persistent parameters are small by DeepSpeed's threshold
        (`stage3_param_persistence_threshold`)."""
        for p in params:
            if getattr(p, "ds_persist", False) and _is_its_partition(p):
                p.data = p.data.clone()

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
        if not self._mlp_overlap:
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
        super().backward_prologue()

    def backward_epilogue(self) -> None:
        super().backward_epilogue()
        self._mlp_backward_end = time.perf_counter()
        self._mlp_backward_secs += self._mlp_backward_end - self._mlp_backward_start
        self._mlp_overlap_backward.backward_ended(self._mlp_backward_end)

    def _mlp_snapshot(self) -> StepSnapshot:
        """Each subgroup's Adam step and the param groups as they are now."""
        return StepSnapshot(
            steps=[int(self.optimizer.state[t].get("step", 0)) for t in self.fp32_partitioned_groups_flat],
            groups=[dict(group) for group in self.optimizer.param_groups],
        )

    def step(self, closure: Any = None) -> None:
        """DeepSpeed's step with the subgroup loop replaced by the pipeline (same operations per subgroup),
        which runs on behind this call with `overlap`: the update during backward settled, the step's
        outcome decided, the stale gradients taken, the update run, and recorded once it ends."""
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
        step_factor = self._mlp_grad_scale(scaled_global_grad_norm)
        grad_scale = step_factor if self._mlp_fused is not None else 1.0
        # The param groups as this step sees them: an lr scheduler changes them once step() returns.
        snapshot = self._mlp_snapshot()
        settled = self._mlp_overlap_backward.settle(backward_update, grad_scale, snapshot.groups, boundary)
        if backward_update is not None:
            # Its subgroups' Adam steps before it (a kept one has moved them on).
            snapshot.steps = backward_update.snapshot.steps
        stale_ranges, stale_record = self._mlp_take_stale(step_factor)
        update = StepUpdate(
            self,
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
        if self._mlp_overlap:
            steps = snapshot.steps
            self._mlp_inflight = UpdateInFlight(
                update.run, len(steps), step=max(steps) + 1, thread=self._mlp_update_thread
            )
            self._mlp_finish_update = update.finish
        else:
            stats = update.run(lambda i: None)
        self.timers(OPTIMIZER_STEP_TIMER).stop()
        self._post_step(timer_names)
        update.returned = time.perf_counter()
        if not self._mlp_overlap:
            update.finish(stats, None)
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

    def _mlp_skip_step(self, backward_update: BackwardUpdate | None) -> None:
        """An fp16 overflow skips the update: no state is read, changed or written (what the update
        during backward changed is undone)."""
        record = self._mlp_overlap_backward.skipped_step(backward_update)
        self._mlp_stale.skipped()
        self._mlp_planner.emit(
            {
                "event": "skipped",
                "rank": self._mlp_rank,
                "loss_scale": float(self.loss_scale),
                "overlap_backward": record,
            }
        )
        self._mlp_last_step_end = time.perf_counter()
        self._mlp_fp32_grads.clear()

    def _mlp_take_stale(self, step_factor: float) -> tuple[stale_gradients.StaleRanges, StaleStep]:
        """The parameters this boundary gave no gradient, updated with their last one as DeepSpeed's
        buffer holds it (the update during backward left their chunks to this step); this step's factor
        is the one `unscale_and_clip_grads` applies. After the update during backward has ended: it reads
        what this changes. With their record."""
        stale_ranges = self._mlp_stale.taken(
            step_factor, self._mlp_param_ranges, self._mlp_chunk_update.param_half_grad
        )
        record: StaleStep = {
            "params": sum(len(ranges) for ranges in stale_ranges.values()),
            # Their fp32 gradients kept, outside host_memory (as stock keeps every one).
            "kept_bytes": self._mlp_stale.kept_bytes(),
            "diverged": len(self._mlp_stale.diverged),
        }
        if diverged := self._mlp_stale.diverged:
            names = [self.param_names.get(self.param_dict[pid], str(pid)) for pid in diverged]
            log.warning(
                "mlp_offload: %d parameter(s) got gradients in earlier micro-steps of this accumulation "
                "boundary but none in its last (%s): stock DeepSpeed updates them with their gradient of an "
                "earlier boundary and drops these; mlp-offload updates them with these, so this step differs "
                "from stock's",
                len(names),
                ", ".join(names[:5]) + (", ..." if len(names) > 5 else ""),
            )
        # A subgroup whose fp32 gradient a gradient setter wrote has it whole (`_mlp_fp32_grads`).
        return {i: r for i, r in stale_ranges.items() if i not in self._mlp_fp32_grads}, record

    # ----------------------------------------------------------------------------------------------
    # Checkpoints (DeepSpeed's own ZeRO-3 format) and the end of training

    def state_dict(self) -> Any:
        """DeepSpeed's ZeRO-3 optimizer state dict, the state gathered from the cache and the store."""
        self._mlp_settle()
        return checkpoint.state_dict(self)

    def _restore_from_bit16_weights(self) -> None:
        """DeepSpeed's `refresh_fp32_params` (a checkpoint loaded without its optimizer states, or only
        the module): the fp32 weights become the half-precision partitions, widened; the moments stay."""
        self._mlp_settle()
        for i, half in enumerate(self.fp16_partitioned_groups_flat):
            self._mlp_state.set_params(i, half)

    def _rigid_load_state_dict(self, state_dict: Any, load_optimizer_states: bool = True) -> None:
        """Loads this rank's part of a ZeRO-3 checkpoint saved by this engine or by stock DeepSpeed
        (same data-parallel degree) into the store. DeepSpeed's own `load_state_dict` calls it, and does
        the rest itself: the elastic-checkpoint refusal, `load_serial`, the persistent parameters."""
        self._mlp_settle()
        checkpoint.load_state_dict(self, state_dict, load_optimizer_states)

    def _load_universal_checkpoint(
        self, checkpoint_folder: Any, load_optimizer_states: bool, load_from_fp32_weights: bool
    ) -> None:
        """A universal checkpoint (`ds_to_universal.py`'s, of any data-parallel degree) into the store,
        chunk by chunk, as stock DeepSpeed loads it (`checkpoint.load_universal`)."""
        self._mlp_settle()
        checkpoint.load_universal(self, checkpoint_folder, load_optimizer_states, load_from_fp32_weights)

    @property
    def mlp_offload_telemetry(self) -> list[dict[str, Any]]:
        """Every record so far: the start-up plan, then one per step (the same as the JSON lines)."""
        return self._mlp_planner.records

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
        if hasattr(self, "_mlp_state"):
            self._mlp_state.pipeline.flush()
        self._mlp_store.sync()

    def destroy(self) -> None:
        """Writes the cached chunks back, so the store holds the state of one step (the last), not
        a mix of steps under a valid manifest; then closes the pipeline, the store and telemetry."""
        if hasattr(self, "_mlp_state"):
            try:
                self._mlp_settle()
                self._mlp_state.pipeline.flush()
            finally:
                if self._mlp_overlap or self._mlp_overlap_backward.on:
                    self._mlp_update_thread.shutdown()
                self._mlp_state.pipeline.close()
                if (chunk_update := getattr(self, "_mlp_chunk_update", None)) is not None:
                    chunk_update.close()
                # What the engine held of DeepSpeed's host memory between steps goes with it.
                self._mlp_norm_scratch = None
        self._mlp_store.close()
        self._mlp_planner.close()
        super_destroy = getattr(super(), "destroy", None)
        if super_destroy is not None:
            super_destroy()
