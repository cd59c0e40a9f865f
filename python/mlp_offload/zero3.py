"""The ZeRO-3 optimizer with its fp32 state in mlp-offload's object store.

`MLPOffloadStage3` is DeepSpeed's own `DeepSpeedZeroOptimizer_Stage3` (0.19.x) with four changes; the rest
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

Bit-for-bit equality with `offload_optimizer.device: cpu` holds because every number goes through the
same operations: each is elementwise; chunk lengths are multiples of CPU Adam's vector block, so each
element takes the same code path as in a whole-subgroup call; and DeepSpeed 0.19.8's CPU Adam keeps its
bias correction per step, not per call, so neither the order nor the number of calls changes a result.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm
from deepspeed.runtime.zero import stage3
from deepspeed.runtime.zero.stage3 import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT, OPTIMIZER_STEP_TIMER

from mlp_offload import _core, memory, profiles
from mlp_offload.config import MLPOffloadConfig, from_ds_config
from mlp_offload.pipeline import ChunkPipeline, StepStats
from mlp_offload.store import ObjectStore

log = logging.getLogger("mlp_offload")

# DeepSpeed's own class, also when `install()` has already put its dispatcher in the module.
DeepSpeedZeroOptimizer_Stage3: Any = getattr(
    stage3.DeepSpeedZeroOptimizer_Stage3, "_mlp_offload_stock", stage3.DeepSpeedZeroOptimizer_Stage3
)

FP32 = torch.float32
# fp32 params, exp_avg and exp_avg_sq per element.
STATE_TENSORS = 3
STATE_BYTES = 4 * STATE_TENSORS


class MLPOffloadStage3(DeepSpeedZeroOptimizer_Stage3):
    """DeepSpeed's ZeRO-3 optimizer with the optimizer state in the object store (see module docs)."""

    overflow: bool  # set by DeepSpeed's overflow check

    def __init__(
        self, module: Any, init_optimizer: Any, param_names: Any, timers: Any, ds_config: Any, **kwargs: Any
    ):
        config = from_ds_config(ds_config)
        if config is None:
            raise ValueError(f"mlp_offload: the DeepSpeed config has no {'mlp_offload'!r} section")
        offload = kwargs.get("offload_optimizer_config")
        if offload is None or str(getattr(offload.device, "value", offload.device)) != "cpu":
            raise ValueError(
                'zero_optimization.offload_optimizer.device: mlp-offload needs "cpu" (CPU Adam on host '
                "memory); it replaces the NVMe swapping itself"
            )
        # Set before the base __init__, which calls the overridden hooks below.
        self._mlp_config: MLPOffloadConfig = config
        self._mlp_buffer_count = int(offload.buffer_count)
        self._mlp_pin = bool(offload.pin_memory)
        self._mlp_rank = dist.get_rank()
        self._mlp_store = ObjectStore(
            config.paths,
            rank=self._mlp_rank,
            engine=config.engine,
            chunk_size=config.chunk_size,
            max_inflight=config.max_inflight,
            weights=config.weights if isinstance(config.weights, list) else None,
            checksum=config.checksum,
            shadow_slots=config.shadow_slots,
        )
        self._mlp_pipeline: ChunkPipeline | None = None
        self._mlp_profile: profiles.Profile | None = None
        # When the last step ended (forward and backward run until the next one starts), and the update
        # time the model predicts for the next step.
        self._mlp_last_step_end: float | None = None
        # Backward time since the last step (all micro-batches), from DeepSpeed's backward hooks.
        self._mlp_backward_secs = 0.0
        self._mlp_backward_start = 0.0
        self._mlp_prediction: float | None = None
        self._mlp_step_log: list[dict[str, Any]] = []
        super().__init__(module, init_optimizer, param_names, timers, ds_config, **kwargs)
        self._mlp_start()

    # ----------------------------------------------------------------------------------------------
    # Construction hooks (called from DeepSpeed's __init__)

    def _swappable_optimizer_subgroup(self, sub_group_id: int) -> bool:
        # Every subgroup's state is in the store: the `safe_get/set_*` helpers go through the swap-in
        # and swap-out protocol, which `_StateSwapper` serves.
        return True

    def _configure_tensor_swapping(self, offload_optimizer_config: Any, aio_config: Any) -> None:
        pass

    def _create_fp32_partitions(self) -> None:
        """Leaves an empty fp32 tensor per subgroup in DeepSpeed's list; the state itself is written to
        the store chunk by chunk once the budget is known (`_mlp_start`)."""
        self.subgroup_to_device = dict.fromkeys(range(len(self.fp16_partitioned_groups_flat)), "cpu")
        self.optimizer_swapper = _StateSwapper(self)
        for i, fp16_flat in enumerate(self.fp16_partitioned_groups_flat):
            n = int(self.fp16_partitioned_groups_flat_numel[i])
            ids = self.fp16_partitioned_groups_flat_id[i]
            if fp16_flat is None:
                raise ValueError(
                    "zero_optimization.offload_param: parameters on NVMe are not supported with mlp_offload"
                )
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
        self.norm_for_param_grads[self.get_param_id(param)] = self._constant_buffered_norm2(grad_buffer)

    # ----------------------------------------------------------------------------------------------
    # Start-up: budget, plan, pipeline

    def _mlp_budget(self, numels: list[int]) -> tuple[int, str]:
        """The host memory for state, and how it was chosen (see `MLPOffloadConfig.host_memory`)."""
        host_memory = self._mlp_config.host_memory
        deepspeed_budget = self._mlp_buffer_count * max(numels) * 4
        if host_memory == "deepspeed":
            return deepspeed_budget, f"DeepSpeed's pinned budget ({self._mlp_buffer_count} buffers)"
        if host_memory != "auto":
            return int(host_memory), "configured"
        spare = memory.spare_host_memory()
        # Never more than caching the whole state takes.
        need = memory.whole_state_bytes(numels, self._mlp_update_chunk())
        budget = min(need, max(spare.bytes, deepspeed_budget))
        return budget, f"auto: {spare.describe()}; the whole state needs {need / 2**30:.2f} GiB"

    def _mlp_update_chunk(self) -> int | None:
        chunk = self._mlp_config.update_chunk
        return None if chunk == "auto" else int(chunk)

    def _mlp_start(self) -> None:
        config = self._mlp_config
        numels = [int(n) for n in self.fp16_partitioned_groups_flat_numel]
        host_memory, budget_source = self._mlp_budget(numels)
        layout = memory.chunk_layout(numels, host_memory, self._mlp_update_chunk())
        c, buffers = layout.elements, layout.buffers
        # Chunk -> (subgroup, first element, elements); chunks of one subgroup are adjacent.
        self._mlp_chunks = layout.chunks
        self._mlp_subgroup_chunks: list[list[int]] = [[] for _ in numels]
        for k, (i, _, _) in enumerate(self._mlp_chunks):
            self._mlp_subgroup_chunks[i].append(k)
        grad_bytes, buffer_bytes = memory.GRAD_BYTES * c, layout.buffer_bytes
        if buffers < 1:
            raise ValueError(
                f"mlp_offload.host_memory: {host_memory:,} bytes hold no chunk: one needs {buffer_bytes:,} "
                f"bytes of fp32 state ({c:,} elements x {STATE_BYTES}) plus {grad_bytes:,} for its fp32 "
                "gradient"
            )
        self._mlp_grad = torch.empty(c, dtype=FP32)
        keys = [self._mlp_key(k) for k in range(len(self._mlp_chunks))]
        self._mlp_remove_stale(keys)
        try:
            # The pipeline sizes the cache ("auto": what the buffers hold beyond its own) and checks it.
            self._mlp_pipeline = ChunkPipeline(
                self._mlp_store,
                keys,
                layout.sizes,
                buffers,
                cache_slots=None if config.cache_chunks == "auto" else config.cache_chunks,
                lock=self._mlp_pin,
            )
        except ValueError as e:
            raise ValueError(
                f"mlp_offload.{e} (host_memory {host_memory:,} holds {buffers} buffers "
                f"of {buffer_bytes:,} bytes)"
            ) from None
        cache = self._mlp_pipeline.cache_slots
        n_chunks = len(self._mlp_chunks)
        self._mlp_plan = self._mlp_make_plan()
        if self._mlp_plan is not None:
            self._mlp_prediction = self._mlp_plan["predicted_update_secs"]
        self._mlp_tuner = (
            _core.WeightTuner(self._mlp_plan["path_bytes_per_s"]) if config.adapt and self._mlp_plan else None
        )
        if self._mlp_plan is not None and config.weights == "auto":
            self._mlp_store.weights = self._mlp_plan["weights"]
        # The initial state, placed by the plan's weights, through the pool's buffers.
        self._mlp_pipeline.initialize(self._mlp_initial_state)
        self._mlp_telemetry = self._mlp_open_telemetry()
        self._mlp_emit(
            {
                "event": "start",
                "rank": self._mlp_rank,
                "paths": config.paths,
                "subgroups": len(numels),
                "largest_subgroup_elements": max(numels),
                "chunks": n_chunks,
                "chunk_elements": c,
                "host_memory": host_memory,
                "host_memory_source": budget_source,
                "buffers": self._mlp_pipeline.buffer_count,
                "buffer_bytes": buffer_bytes,
                "cached_chunks": cache,
                "weights": self._mlp_store.weights,
                "plan": self._mlp_plan,
            }
        )
        log.info(
            "mlp-offload: rank %d, %d subgroups in %d chunks of %.1f MiB over %d paths; host memory %.2f GiB "
            "(%s) = %d chunk buffers + %.1f MiB fp32 gradient, %d chunks cached; weights %s; "
            "predicted update %.2f s",
            self._mlp_rank,
            len(numels),
            n_chunks,
            buffer_bytes / 2**20,
            len(config.paths),
            host_memory / 2**30,
            budget_source,
            self._mlp_pipeline.buffer_count,
            grad_bytes / 2**20,
            cache,
            [round(w, 3) for w in self._mlp_store.weights],
            self._mlp_plan["predicted_update_secs"] if self._mlp_plan else float("nan"),
        )

    def _mlp_key(self, chunk: int) -> str:
        i, first, _ = self._mlp_chunks[chunk]
        return f"subgroup{i}.{first}"

    def _mlp_remove_stale(self, keys: list[str]) -> None:
        """A new engine starts from the model's weights: state left in these paths by an earlier run
        (another model, subgroup or chunk size) is removed, and objects of another size replaced."""
        wanted = set(keys)
        stale = [k for k in self._mlp_store.keys() if k.startswith("subgroup") and k not in wanted]
        for key in stale:
            self._mlp_store.delete(key)
        if stale:
            log.info("mlp-offload: removed %d state objects left by an earlier run", len(stale))
        for key, (_, _, count) in zip(keys, self._mlp_chunks, strict=True):
            size = self._mlp_store.size(key)
            if size is not None and size != STATE_BYTES * count:
                self._mlp_store.delete(key)

    def _mlp_initial_state(self, chunk: int, state_bytes: torch.Tensor) -> None:
        """A chunk's first state: the fp32 copy of its half-precision weights, zero moments."""
        i, first, count = self._mlp_chunks[chunk]
        state = state_bytes.view(FP32)
        state[:count].copy_(self.fp16_partitioned_groups_flat[i][first : first + count])  # exact widening
        state[count:].zero_()

    def _mlp_make_plan(self) -> dict[str, Any] | None:
        """The performance model's plan from the paths' profile (probing them when needed)."""
        config = self._mlp_config
        if config.weights != "auto":
            # Fixed weights: plan with the profile only when one is saved, never probe for it.
            profile, _ = profiles.saved_profile(
                config.paths, profiles.ProbeOptions(), config.probe_max_age_hours * 3600
            )
        else:
            profile, source = profiles.load_or_probe(
                config.paths, max_age_s=config.probe_max_age_hours * 3600, progress=None
            )
            log.info("mlp-offload: %s", source)
        self._mlp_profile = profile
        if profile is None:
            return None
        return self._mlp_replan()

    def _mlp_replan(
        self,
        fwd_bwd_secs: float = 0.0,
        adam_secs_per_chunk: float = 0.0,
        measured_bytes_per_s: list[float] | None = None,
        weights: list[float] | None = None,
    ) -> dict[str, Any]:
        """The model's plan for the stream, with the pipeline's chunks and buffers."""
        assert self._mlp_profile is not None and self._mlp_pipeline is not None
        pipeline = self._mlp_pipeline
        return self._mlp_profile.plan_stream(
            pipeline.sizes,
            pipeline.buffer_count,
            pipeline.cache_slots,
            fwd_bwd_secs=fwd_bwd_secs,
            adam_secs_per_chunk=adam_secs_per_chunk,
            measured_bytes_per_s=measured_bytes_per_s,
            weights=weights,
        )

    def _mlp_open_telemetry(self) -> Any:
        path = self._mlp_config.telemetry_file
        if not path:
            return None
        path = path.replace("{rank}", str(self._mlp_rank))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # Line-buffered and open as long as the optimizer lives: each record is on disk when written.
        return open(path, "a", buffering=1)

    def _mlp_emit(self, record: dict[str, Any]) -> None:
        self._mlp_step_log.append(record)
        if self._mlp_telemetry is not None:
            self._mlp_telemetry.write(json.dumps(record) + "\n")

    # ----------------------------------------------------------------------------------------------
    # Binding a subgroup's state to DeepSpeed's tensors

    def _mlp_bind_state(self, i: int, state_bytes: torch.Tensor) -> None:
        """Points DeepSpeed's fp32 tensor and its Adam state at subgroup `i`'s `[params | exp_avg |
        exp_avg_sq]`."""
        n = int(self.fp16_partitioned_groups_flat_numel[i])
        state = state_bytes.view(FP32)
        fp32 = self.fp32_partitioned_groups_flat[i]
        fp32.data = state[:n]
        adam = self.optimizer.state[fp32]
        adam.setdefault("step", 0)
        adam["exp_avg"] = state[n : 2 * n]
        adam["exp_avg_sq"] = state[2 * n : 3 * n]

    def _mlp_bind_chunk(self, chunk: int, state_bytes: torch.Tensor, step: int) -> None:
        """Points DeepSpeed's fp32 tensor of the chunk's subgroup, its Adam state and its gradient at the
        chunk's elements, as if they were the whole subgroup, with the Adam step the subgroup had before
        this update (CPU Adam counts one per call)."""
        i, first, count = self._mlp_chunks[chunk]
        state = state_bytes.view(FP32)
        fp32 = self.fp32_partitioned_groups_flat[i]
        fp32.data = state[:count]
        adam = self.optimizer.state[fp32]
        adam["step"] = step
        adam["exp_avg"] = state[count : 2 * count]
        adam["exp_avg_sq"] = state[2 * count :]
        grad = self._mlp_grad[:count]
        # The delayed conversion, in place into one reusable chunk-sized buffer (an exact widening).
        grad.copy_(self._mlp_half_grad(i)[first : first + count])
        fp32.grad = grad

    def _mlp_unbind(self, i: int) -> None:
        fp32 = self.fp32_partitioned_groups_flat[i]
        fp32.data = torch.empty(0, dtype=FP32)
        fp32.grad = None
        adam = self.optimizer.state[fp32]
        for key in ("exp_avg", "exp_avg_sq"):
            if key in adam:
                adam[key] = torch.empty(0, dtype=FP32)

    def _mlp_half_grad(self, i: int) -> torch.Tensor:
        """Subgroup `i`'s reduced gradient in DeepSpeed's host buffer (half precision, contiguous)."""
        slices = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition  # type: ignore[attr-defined]
        params = self.fp16_groups[i]
        first = slices[params[0].ds_id]
        n = int(self.fp16_partitioned_groups_flat_numel[i])
        # The buffer lays partitions out subgroup after subgroup in this order: one contiguous range.
        whole = first.as_strided((n,), (1,), first.storage_offset())
        last = slices[params[-1].ds_id]
        assert last.storage_offset() + last.numel() == whole.storage_offset() + n, "gradient layout changed"
        return whole

    # ----------------------------------------------------------------------------------------------
    # The step

    def backward_prologue(self) -> None:
        self._mlp_backward_start = time.perf_counter()
        super().backward_prologue()

    def backward_epilogue(self) -> None:
        super().backward_epilogue()
        self._mlp_backward_secs += time.perf_counter() - self._mlp_backward_start

    def step(self, closure: Any = None) -> None:
        """DeepSpeed's step with the subgroup loop replaced by the pipeline (same operations per subgroup)."""
        step_start = time.perf_counter()
        fwd_bwd = None if self._mlp_last_step_end is None else step_start - self._mlp_last_step_end
        self._pre_step()
        self._partition_all_parameters()
        self._overflow_check_and_loss_scale_update(update_scale=False)
        scaled_global_grad_norm = None
        if not self.overflow:
            self._apply_muon_to_accumulated_grads()
            norm_groups = self._get_norm_groups()
            scaled_global_grad_norm = combine_grad_norm_groups(norm_groups)
            if is_invalid_grad_norm(scaled_global_grad_norm):
                self.overflow = True
        if self._loss_scale_update_and_overflow_cleanup():
            # An fp16 overflow skips the update: no state is read, changed or written.
            self._mlp_emit({"event": "skipped", "rank": self._mlp_rank, "loss_scale": float(self.loss_scale)})
            self._mlp_last_step_end, self._mlp_backward_secs = time.perf_counter(), 0.0
            return
        self._global_grad_norm = scaled_global_grad_norm / self.loss_scale
        timer_names: set[str] = set()
        timer_names.add(OPTIMIZER_STEP_TIMER)
        self.timers(OPTIMIZER_STEP_TIMER).start()

        compute_secs = 0.0
        # Each subgroup's Adam step before this update, and how many of its chunks are still to come.
        steps = [int(self.optimizer.state[t].get("step", 0)) for t in self.fp32_partitioned_groups_flat]
        remaining = [len(chunks) for chunks in self._mlp_subgroup_chunks]

        def update(chunk: int, state_bytes: torch.Tensor) -> None:
            """DeepSpeed's per-subgroup update on one chunk of it: every operation is elementwise, and
            chunk boundaries keep CPU Adam's vector path (see `memory.CHUNK_ALIGN`)."""
            nonlocal compute_secs
            t = time.perf_counter()
            i, first, count = self._mlp_chunks[chunk]
            self._mlp_bind_chunk(chunk, state_bytes, steps[i])
            try:
                if self._muon_update_lacks_loss_scale(i):
                    self.fp32_partitioned_groups_flat[i].grad.mul_(self.loss_scale)
                self.unscale_and_clip_grads(i, scaled_global_grad_norm)
                self._optimizer_step(i)
                # DeepSpeed's `_reassign_or_swap_out_partitioned_parameters`, one chunk at a time.
                half = self.fp16_partitioned_groups_flat[i]
                half.data[first : first + count].copy_(self.fp32_partitioned_groups_flat[i].data)
                remaining[i] -= 1
                if remaining[i] == 0:
                    self._unflatten_partitioned_parameters(i)
            finally:
                self._mlp_unbind(i)
                compute_secs += time.perf_counter() - t

        assert self._mlp_pipeline is not None
        # The last writes go on while the next forward and backward run.
        stats = self._mlp_pipeline.run_step(update, drain=False)
        self.timers(OPTIMIZER_STEP_TIMER).stop()
        self._post_step(timer_names)
        self._mlp_after_step(stats, time.perf_counter() - step_start, fwd_bwd, compute_secs)
        self._mlp_last_step_end = time.perf_counter()
        self._mlp_backward_secs = 0.0

    def _mlp_after_step(
        self, stats: StepStats, seconds: float, fwd_bwd: float | None, compute_secs: float
    ) -> None:
        moved = None
        if self._mlp_tuner is not None:
            moved = self._mlp_tuner.observe(stats.per_path, stats.seconds)
            if moved is not None:
                self._mlp_store.weights = moved
        predicted = self._mlp_prediction
        if self._mlp_profile is not None and fwd_bwd is not None:
            # The next step's prediction, from what this one measured: forward and backward (which hide
            # the write-back), Adam and the gradient conversion per subgroup, each path's bandwidth.
            self._mlp_prediction = self._mlp_replan(
                fwd_bwd_secs=fwd_bwd,
                adam_secs_per_chunk=compute_secs / len(self._mlp_chunks),
                measured_bytes_per_s=self._mlp_tuner.estimates if self._mlp_tuner is not None else None,
                # At the tuner's split, which the next step's writes use; without a tuner the plan's.
                weights=self._mlp_tuner.weights if self._mlp_tuner is not None else None,
            )["predicted_update_secs"]
        per_path = []
        for path, p in zip(self._mlp_config.paths, stats.per_path, strict=True):
            moved_bytes = p["read_bytes"] + p["write_bytes"]
            per_path.append(
                {
                    "path": path,
                    "read_bytes": p["read_bytes"],
                    "write_bytes": p["write_bytes"],
                    "busy_secs": p["busy_secs"],
                    "bytes_per_s": moved_bytes / stats.seconds if stats.seconds > 0 else 0.0,
                }
            )
        self._mlp_emit(
            {
                "event": "step",
                "rank": self._mlp_rank,
                "step": stats.step,
                "update_secs": seconds,
                "pipeline_secs": stats.seconds,
                "read_wait_secs": stats.read_wait_seconds,
                "write_wait_secs": stats.write_wait_seconds,
                "reads": stats.reads,
                "writes": stats.writes,
                "cached": stats.cached,
                "retained": stats.retained,
                "paths": per_path,
                "weights_next": moved,
                "compute_secs": compute_secs,
                # Since the last step ended: forward (and whatever else ran) and backward, every micro-batch.
                "forward_secs": fwd_bwd - self._mlp_backward_secs if fwd_bwd is not None else None,
                "backward_secs": self._mlp_backward_secs,
                "fwd_bwd_secs": fwd_bwd,
                # Made before this step, from the steps before it (the start-up plan's for the first two).
                "predicted_update_secs": predicted,
            }
        )

    # ----------------------------------------------------------------------------------------------
    # Checkpoints: DeepSpeed's own ZeRO-3 format, so they load into stock DeepSpeed and back

    def _mlp_chunk_slices(self, chunk: int) -> tuple[int, list[slice]]:
        """A chunk's subgroup and where its `[params | exp_avg | exp_avg_sq]` lie in the subgroup's."""
        i, first, count = self._mlp_chunks[chunk]
        n = int(self.fp16_partitioned_groups_flat_numel[i])
        return i, [slice(k * n + first, k * n + first + count) for k in range(STATE_TENSORS)]

    def _mlp_current_state(self, i: int) -> torch.Tensor:
        """A fresh fp32 copy of subgroup `i`'s newest `[params | exp_avg | exp_avg_sq]`, gathered from its
        chunks: the pipeline's host copy where it has one, else the store's."""
        n = int(self.fp16_partitioned_groups_flat_numel[i])
        state = torch.empty(STATE_TENSORS * n, dtype=FP32)
        scratch = None
        for chunk in self._mlp_subgroup_chunks[i]:
            _, parts = self._mlp_chunk_slices(chunk)
            found = self._mlp_pipeline.in_memory(chunk) if self._mlp_pipeline is not None else None
            if found is not None:
                chunk_state = found[0].view(FP32)
            else:
                count = parts[0].stop - parts[0].start
                if scratch is None:
                    scratch = torch.empty(STATE_TENSORS * self._mlp_grad.numel(), dtype=FP32)
                chunk_state = scratch[: STATE_TENSORS * count]
                self._mlp_store.read(self._mlp_key(chunk), chunk_state).wait()
            for k, part in enumerate(parts):
                count = part.stop - part.start
                state[part].copy_(chunk_state[k * count : (k + 1) * count])
        return state

    def _mlp_store_state(self, i: int, state: torch.Tensor) -> None:
        """Makes subgroup `i`'s `[params | exp_avg | exp_avg_sq]` (fp32) current, chunk by chunk."""
        assert self._mlp_pipeline is not None
        scratch = torch.empty(STATE_TENSORS * self._mlp_grad.numel(), dtype=FP32)
        for chunk in self._mlp_subgroup_chunks[i]:
            _, parts = self._mlp_chunk_slices(chunk)
            count = parts[0].stop - parts[0].start
            chunk_state = scratch[: STATE_TENSORS * count]
            for k, part in enumerate(parts):
                chunk_state[k * count : (k + 1) * count].copy_(state[part])
            self._mlp_pipeline.replace(chunk, chunk_state.view(torch.uint8))

    def state_dict(self) -> Any:
        """DeepSpeed's ZeRO-3 optimizer state dict (`_rigid_state_dict`'s keys and layout), with each
        subgroup's fp32 weights and Adam moments brought in from the store. The whole optimizer state is
        in host memory while the checkpoint is written, as with DeepSpeed's own NVMe offload."""
        if self.elastic_checkpoint:
            raise NotImplementedError("mlp_offload: ZeRO-3 elastic checkpoints are not supported")
        subgroups = range(len(self.fp32_partitioned_groups_flat))
        for i in subgroups:
            self._mlp_bind_state(i, self._mlp_current_state(i))
        try:
            # DeepSpeed's own code; it refers to the tensors just bound, which stay valid after unbinding.
            saved = DeepSpeedZeroOptimizer_Stage3._rigid_state_dict(self)
            saved[FP32_FLAT_GROUPS] = [t.data for t in saved[FP32_FLAT_GROUPS]]
            # torch's state_dict shares each parameter's state dict, which unbinding empties: copy them.
            optimizer_state = saved[OPTIMIZER_STATE_DICT]
            optimizer_state["state"] = {k: dict(v) for k, v in optimizer_state["state"].items()}
        finally:
            for i in subgroups:
                self._mlp_unbind(i)
        return saved

    def load_state_dict(
        self,
        state_dict_list: Any,
        load_optimizer_states: bool = True,
        load_from_fp32_weights: bool = False,
        checkpoint_folder: Any = None,
        load_serial: Any = None,
        param_shapes: Any = None,
    ) -> None:
        """Loads a ZeRO-3 checkpoint saved by this engine or by stock DeepSpeed (same data-parallel
        degree): fp32 weights and Adam moments go to the store, the half-precision partitions follow."""
        if checkpoint_folder:
            raise NotImplementedError(
                "mlp_offload: universal checkpoints are not supported; load the ZeRO checkpoint instead"
            )
        saved = state_dict_list[dist.get_rank(group=self.dp_process_group)]
        subgroups = range(len(self.fp32_partitioned_groups_flat))
        fp32_groups = saved[FP32_FLAT_GROUPS]
        if len(fp32_groups) != len(subgroups):
            raise ValueError(
                f"checkpoint: {len(fp32_groups)} fp32 subgroups, this engine has {len(subgroups)} "
                "(another model, sub_group_size or data-parallel degree)"
            )
        for i in subgroups:
            n = int(self.fp16_partitioned_groups_flat_numel[i])
            if fp32_groups[i].numel() != n:
                raise ValueError(
                    f"checkpoint: subgroup {i} has {fp32_groups[i].numel():,} fp32 elements, this engine's "
                    f"{n:,} (another model, sub_group_size or data-parallel degree)"
                )
        assert self._mlp_pipeline is not None
        # The store alone then holds the current state (what is kept when the moments are not loaded),
        # and no host copy outlives the checkpoint.
        self._mlp_pipeline.flush()
        states = []
        for i in subgroups:
            n = int(self.fp16_partitioned_groups_flat_numel[i])
            keep = not load_optimizer_states
            state = self._mlp_current_state(i) if keep else torch.empty(STATE_TENSORS * n, dtype=FP32)
            self._mlp_bind_state(i, state)
            states.append(state)
        try:
            # DeepSpeed's own loader: loss scaling, the moments (torch's loader matches them to our fp32
            # tensors by position), the fp32 weights into the bound tensors, the half-precision partitions.
            DeepSpeedZeroOptimizer_Stage3._rigid_load_state_dict(self, saved, load_optimizer_states)
            for i, state in zip(subgroups, states, strict=True):
                n = int(self.fp16_partitioned_groups_flat_numel[i])
                adam = self.optimizer.state[self.fp32_partitioned_groups_flat[i]]
                # torch's loader replaces the moments with tensors of its own; ours still hold the rest.
                state[n : 2 * n].copy_(adam["exp_avg"])
                state[2 * n :].copy_(adam["exp_avg_sq"])
                self._mlp_store_state(i, state)
        finally:
            for i in subgroups:
                self._mlp_unbind(i)  # the loaded state lives in the store only

    @property
    def mlp_offload_telemetry(self) -> list[dict[str, Any]]:
        """Every record so far: the start-up plan, then one per step (the same as the JSON lines)."""
        return self._mlp_step_log

    def mlp_offload_flush(self) -> None:
        """Writes the cached subgroups back and syncs the store (at the end of training, before copying
        the store's directories)."""
        if self._mlp_pipeline is not None:
            self._mlp_pipeline.flush()
        self._mlp_store.sync()

    def destroy(self) -> None:
        if self._mlp_pipeline is not None:
            self._mlp_pipeline.close()
        self._mlp_store.close()
        if self._mlp_telemetry is not None:
            self._mlp_telemetry.close()
        super_destroy = getattr(super(), "destroy", None)
        if super_destroy is not None:
            super_destroy()


class _StateSwapper:
    """DeepSpeed's optimizer-swapper protocol over the store, for what still calls it: the
    `safe_get/set_*` helpers and checkpoint code swap one subgroup in, look or write, and swap it out."""

    def __init__(self, optimizer: MLPOffloadStage3) -> None:
        self.optimizer = optimizer
        self.swap_folder = optimizer._mlp_store.tiers[0]["path"]
        # Subgroup -> its whole state, gathered from its chunks while swapped in.
        self._held: dict[int, torch.Tensor] = {}

    def _index(self, parameter: torch.Tensor) -> int:
        for i, t in enumerate(self.optimizer.fp32_partitioned_groups_flat):
            if t is parameter:
                return i
        raise KeyError("not one of this optimizer's fp32 partitions")

    def is_swappable_tensor(self, tensor: Any = None, numel: Any = None) -> bool:
        return True

    def swap_in_optimizer_state(self, parameter: torch.Tensor, async_parameter: Any = None) -> None:
        opt = self.optimizer
        i = self._index(parameter)
        state = opt._mlp_current_state(i)
        self._held[i] = state
        opt._mlp_bind_state(i, state)
        # The gradient as DeepSpeed's own swap-in would hold it: fp32, converted from the half-precision one.
        parameter.grad = opt._mlp_half_grad(i).to(FP32)

    def swap_out_optimizer_state(self, parameter: torch.Tensor, async_swap: bool = False) -> None:
        opt = self.optimizer
        i = self._index(parameter)
        opt._mlp_store_state(i, self._held.pop(i))
        opt._mlp_unbind(i)

    def release_swap_buffers(self, parameter: torch.Tensor) -> None:
        i = self._index(parameter)
        self._held.pop(i, None)
        self.optimizer._mlp_unbind(i)

    def writeback_optimizer_state_and_gradients(
        self, parameter: torch.Tensor, write_opt_state: bool, write_gradients: bool
    ) -> None:
        # Gradients live in DeepSpeed's half-precision buffer, not in the store.
        if write_opt_state:
            self.swap_out_optimizer_state(parameter)
        else:
            self.release_swap_buffers(parameter)

    def swap_out_gradients(self, parameter: Any, gradient_offsets: Any, gradient_tensors: Any) -> None:
        pass

    def flush_gradients(self) -> None:
        pass

    def pre_backward(self) -> None:
        pass

    def post_backward(self) -> None:
        pass

    def init_timers(self) -> None:
        pass

    def log_timers(self) -> None:
        pass

    def purge_state(self) -> None:
        pass
