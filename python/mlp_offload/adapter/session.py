"""One engine session: what the update's helpers share, built once at start from the settings.

`UpdateSession.open` takes the resolved settings (`adapter.settings`) and DeepSpeed's partitions (through
`DeepSpeedView`), and builds, in this order: the plan's profile (a probe where none is saved), the store
over the paths, the chunked state and its pipeline, the gradients-final tracker, the update thread, the
plan, the initial state in the store, and the start record. `MLPOffloadStage3` holds the session and hands
it, with the view, to `ChunkUpdater`, `StepUpdate`, `OverlapBackward` and the checkpoints' swapper, which
read what they need from it and never reach back into the optimizer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from mlp_offload.adapter import troubleshooting
from mlp_offload.adapter.deepspeed_view import DeepSpeedView
from mlp_offload.adapter.monitors import MonitorWriter, UpdateTimers
from mlp_offload.adapter.param_swapper import StoreParamSwapper, require_ours
from mlp_offload.adapter.settings import Choice, KernelCheck, Settings
from mlp_offload.adapter.stale_gradients import StaleGradients
from mlp_offload.common.config import MLPOffloadConfig
from mlp_offload.engine import memory
from mlp_offload.engine.accelerator_chunks import AcceleratorChunks, check_on_device
from mlp_offload.engine.accelerator_state import AcceleratorState
from mlp_offload.engine.fused_update import FusedAdam, kernel_record
from mlp_offload.engine.overlap import GradsFinal, update_thread
from mlp_offload.engine.pipeline import ChunkPipeline
from mlp_offload.engine.planning import UpdatePlanner, open_store, start_line
from mlp_offload.engine.state import ChunkedState
from mlp_offload.engine.state_dtypes import StateDtypes
from mlp_offload.engine.store import ObjectStore
from mlp_offload.engine.telemetry import StartRecord

log = logging.getLogger("mlp_offload")

# Each parameter with a partition on this rank: its id, subgroup, offset in the subgroup, elements.
ParamRanges = list[tuple[int, int, int, int]]


def _accelerator_state(settings: Settings, view: DeepSpeedView) -> AcceleratorState | None:
    """The state of the subgroups kept on the accelerator (`offload_optimizer.ratio`), if any: in the
    accelerator's memory, updated with the fused pass's own kernel (one bias state for both sides)."""
    k = settings.accelerator_subgroups
    if k == 0:
        return None
    assert settings.kernel.fused is not None, "the settings refuse subgroups on the accelerator without it"
    numels = list(settings.numels[:k])
    return AcceleratorState(numels, view.accelerator_device(), settings.dtypes, settings.kernel.fused.kernel)


def _accelerator_kernel_checked(settings: Settings, view: DeepSpeedView) -> Settings:
    """Where the update runs on the accelerator, the kernel there checked once against the host pass
    (`accelerator_chunks.check_on_device`). Where its bits differ, chunks streamed there are off, saying
    why, and subgroups `offload_optimizer.ratio` keeps there are refused: their state has no other home."""
    if not (settings.accelerator_chunks.on or settings.accelerator_subgroups):
        return settings
    assert settings.kernel.fused is not None, "the settings update nothing there without it"
    half = view.partition_dtype
    differs = check_on_device(
        settings.kernel.fused.kernel.arith, settings.dtypes, half, half, view.accelerator_device()
    )
    if differs is None:
        return settings
    if settings.accelerator_subgroups:
        ratio, accelerator = view.offload_ratio()
        raise ValueError(
            troubleshooting.RATIO.message(
                ratio=ratio,
                count=settings.accelerator_subgroups,
                subgroups=len(settings.numels),
                accelerator=accelerator,
                why=troubleshooting.KERNEL_DIFFERS.format(**differs),
            )
        )
    said = troubleshooting.ACCELERATOR_KERNEL_DIFFERS.message(**differs)
    log.warning("%s", said)
    return dataclasses.replace(settings, accelerator_chunks=Choice(False, f"off: {said}"))


@dataclass
class UpdateSession:
    """The engine of one optimizer (module docs). `fused` and `dtypes` are the update's kernel and the
    state's dtypes now: the settings' at start, the moments' after a checkpoint's load
    (`follow_loaded_moments`). `fp32_grads`: per subgroup, the fp32 gradient DeepSpeed's gradient setters
    wrote, until the step uses it (else the half-precision gradient is converted chunk by chunk).
    `monitor` and `timers`: each step's figures on their way to DeepSpeed's monitors and step timers."""

    config: MLPOffloadConfig
    settings: Settings
    rank: int
    store: ObjectStore
    planner: UpdatePlanner
    state: ChunkedState
    stale: StaleGradients
    grads_final: GradsFinal
    param_ranges: ParamRanges
    check_kernel: KernelCheck
    spare: Callable[[], memory.SpareMemory]
    update_thread: ThreadPoolExecutor | None
    max_inflight: tuple[int, str]
    fused: FusedAdam | None = None
    # The chunks each step streams to the accelerator beside the host's pass (None: off).
    accelerator_chunks: AcceleratorChunks | None = None
    dtypes: StateDtypes = field(default_factory=StateDtypes)
    fp32_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    monitor: MonitorWriter = field(default_factory=lambda: MonitorWriter(False))
    timers: UpdateTimers = field(default_factory=UpdateTimers)

    @property
    def pipeline(self) -> ChunkPipeline:
        return self.state.pipeline

    @classmethod
    def open(
        cls,
        config: MLPOffloadConfig,
        settings: Settings,
        view: DeepSpeedView,
        rank: int,
        param_ranges: ParamRanges,
        check_kernel: KernelCheck,
        spare: Callable[[], memory.SpareMemory],
    ) -> UpdateSession:
        """The session of `settings` over DeepSpeed's partitions (`view`): the profile, the store and the
        chunked state (module docs); `start` writes the initial state. `param_ranges`: every parameter
        with a partition here; `check_kernel`, `spare`: the settings' (for a checkpoint's moments, and
        the kept copies' memory while training)."""
        require_ours(view.on_nvme.swapper())
        settings = _accelerator_kernel_checked(settings, view)
        planner = UpdatePlanner(config, rank)
        # Before the store opens: its node-wide admission takes the device limits the profile gives.
        planner.load_profile()
        store = open_store(config, planner.profile, config.paths, rank=rank, shadow_slots=config.shadow_slots)
        try:
            accelerator = _accelerator_state(settings, view)
            state = ChunkedState(
                store,
                settings.numels,
                settings.layout,
                cache_chunks=settings.cache_chunks,
                lock=settings.pin,
                pages=planner.host_pages()[0],
                ascending=settings.chunk_order.on,
                shadow_slots=config.shadow_slots,
                kept_copies=settings.kept_copies,
                stored=settings.dtypes,
                partition=view.partition,
                accelerator=accelerator,
            )
        except BaseException:
            # Nothing is left holding the paths (the store's locks) or the telemetry file.
            store.close()
            planner.close()
            raise
        pipeline = state.pipeline
        assert (pipeline.buffer_count, pipeline.cache_slots) == (settings.buffers, settings.cache_slots), (
            "the pipeline's buffers and cache are the settings'"
        )
        # The plan predicts what the update during backward leaves once the steps go in chunk order.
        planner.overlap_backward = settings.overlap_backward.on and settings.chunk_order.on
        planner.params_on_nvme_bytes = settings.params_on_nvme_bytes
        stale = StaleGradients()
        stale.dtype = settings.dtypes.master
        monitor = MonitorWriter(settings.monitors.on)
        planner.listener = monitor.record
        on_thread = settings.overlap.on or settings.overlap_backward.on
        return cls(
            config=config,
            settings=settings,
            rank=rank,
            store=store,
            planner=planner,
            state=state,
            stale=stale,
            grads_final=GradsFinal(state.chunks, param_ranges),
            param_ranges=param_ranges,
            check_kernel=check_kernel,
            spare=spare,
            update_thread=update_thread() if on_thread else None,
            max_inflight=planner.max_inflight(),
            fused=settings.kernel.fused,
            accelerator_chunks=(
                AcceleratorChunks(
                    view.accelerator_device(),
                    memory=settings.accelerator_update_memory,
                    pinned=settings.accelerator_update_chunks,
                )
                if settings.accelerator_chunks.on
                else None
            ),
            dtypes=settings.dtypes,
            monitor=monitor,
        )

    def start(self, view: DeepSpeedView) -> None:
        """The plan, the initial state in the store (placed by the plan's weights, through the pool's
        buffers), the second slots `overlap_backward: true` wants, and the start record."""
        pipeline = self.pipeline
        # How the buffers are backed before the initial state fills them.
        page_report = pipeline.page_report
        plan = self.planner.plan(pipeline, self.store)
        swapper = view.on_nvme.swapper()
        if plan is not None and self.config.weights == "auto" and isinstance(swapper, StoreParamSwapper):
            # The parameters on NVMe go to the plan's split too (each on its next write), as it plans them.
            swapper.store.weights = plan["weights"]
        self.state.initialize(view.partition)
        view.settle_partitions()
        if self.settings.backward_every_chunk:
            # Every streamed chunk is updated during backward: each gets its second slot now, so a full
            # disk shows at start-up, naming the file.
            self.state.with_second_slots(pipeline.order[pipeline.cache_slots :], keep_free=False)
        record = self.start_record(page_report, plan)
        self.planner.emit(record)
        log.info("%s", start_line(record))

    def start_record(self, page_report: dict[str, int], plan: dict[str, Any] | None) -> StartRecord:
        """The start record (the telemetry's first): the settings, and what the profile and the store
        made of the paths. `page_report`: how the kernel backed the buffers."""
        settings, pipeline, planner = self.settings, self.pipeline, self.planner
        layout = settings.layout
        pages, pages_source = planner.host_pages()
        reports = self.store.path_reports()
        return {
            "event": "start",
            "rank": self.rank,
            "paths": self.config.paths,
            "subgroups": len(settings.numels),
            "largest_subgroup_elements": max(settings.numels),
            "chunks": len(layout.chunks),
            "chunk_elements": layout.elements,
            "host_memory": settings.host_memory,
            "host_memory_source": settings.host_memory_source,
            "buffers": pipeline.buffer_count,
            "buffer_bytes": layout.buffer_bytes,
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
            "update_kernel": kernel_record(settings.kernel.fused, settings.dtypes, settings.kernel.why),
            # Whether the master weights are kept in the parameters, and why.
            "master_in_params": {"on": settings.master_in_params.on, "why": settings.master_in_params.why},
            # Whether subgroups are updated on the accelerator (`offload_optimizer.ratio`), and why.
            "accelerator_update": {
                "on": settings.accelerator_update.on,
                "why": settings.accelerator_update.why,
                "subgroups": settings.accelerator_subgroups,
                "bytes": 0 if self.state.accelerator is None else self.state.accelerator.nbytes,
                "chunks": {
                    "on": settings.accelerator_chunks.on,
                    "why": settings.accelerator_chunks.why,
                    "memory": settings.accelerator_update_memory,
                    "chunks": settings.accelerator_update_chunks,
                },
            },
            # Whether the update runs behind the next forward, and why.
            "overlap": {"on": settings.overlap.on, "why": settings.overlap.why},
            # Subgroups whose parameters are on NVMe, read and written by the update as it goes.
            "subgroups_on_nvme": settings.subgroups_on_nvme,
            "params_on_nvme_bytes": settings.params_on_nvme_bytes,
            "params_cache_bytes": settings.params_cache,
            # Whether each step's figures go to DeepSpeed's monitors, and why.
            "monitors": {"on": settings.monitors.on, "why": settings.monitors.why},
            # Whether chunks are updated during backward, and why.
            "overlap_backward": {
                "on": settings.overlap_backward.on,
                "why": settings.overlap_backward.why,
                # Chunks with a second slot on disk, and the bytes the ones added for it took.
                "slotted_chunks": len(self.state.slotted),
                "slot_bytes": self.state.slot_bytes,
                # The most kept copies in host memory for cached chunks (made when first wanted).
                "kept_copies_limit": pipeline.kept_limit,
            },
            "weights": self.store.weights,
            # This rank's requests in flight per path, and why.
            "max_inflight": {"count": self.max_inflight[0], "source": self.max_inflight[1]},
            # Per path, the node-wide limit of requests in flight on its device (None: no admission).
            "device_inflight": [r["device_inflight"] for r in reports],
            "device_sharing": [r["device_sharing"] for r in reports],
            # Per path, this rank's part of its device's probed bandwidth, which the plan takes.
            "rank_share": planner.rank_share,
            # The job's nodes, each path's locality, and this node's part of a shared path among them.
            "nodes": planner.nodes,
            "locality": planner.locality,
            "node_share": planner.node_share,
            "plan": plan,
        }

    def follow_loaded_moments(self, dtype: torch.dtype) -> None:
        """The moments a checkpoint's load left in `dtype`. torch's `Optimizer.load_state_dict` casts
        every state tensor to its parameter's dtype, so after stock DeepSpeed loads a checkpoint its
        moments are in the master weights' dtype (fp32 moments saved beside bf16 master weights come
        back bf16), and its CPU Adam runs on them in that dtype from then on. The fused pass follows,
        checked again against DeepSpeed's kernel in those dtypes; the chunks keep their layout (fp32
        moments hold the narrower values exactly)."""
        if dtype == self.dtypes.moments:
            return
        dtypes = StateDtypes(self.dtypes.master, dtype)
        log.warning(
            "mlp_offload: the checkpoint's load left the Adam moments in %s, as DeepSpeed's (torch's "
            "load_state_dict casts them to the master weights' dtype): the update goes on with %s",
            dtype,
            dtypes,
        )
        stored = self.state.stored
        fused = self.check_kernel(
            self.config.update_kernel, dtypes, stored, self.settings.update_threads
        ).fused
        assert fused is not None, "choose_update_kernel refuses a state in half precision without it"
        old = self.fused
        if old is not None and fused.kernel.arith == old.kernel.arith:
            # The same arithmetic: the kernel, and so DeepSpeed's bias-correction history, stays.
            fused = FusedAdam(
                old.kernel, adamw=fused.adamw, threads=fused.threads, dtypes=dtypes, stored=stored
            )
        self.fused = fused
        self.dtypes = dtypes

    def close(self) -> None:
        """Closes the update thread, the pipeline, the store and the telemetry (the caller has written
        back what it keeps); the store and the telemetry whatever the others raised."""
        try:
            if self.update_thread is not None:
                self.update_thread.shutdown()
            self.pipeline.close()
        finally:
            self.store.close()
            self.planner.close()
