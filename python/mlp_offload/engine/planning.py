"""The engine's plan and telemetry: what the performance model predicts for each step (the host memory and
the chunks are the settings', `adapter.settings`), how the `WeightTuner` moves the split (the same move
on every rank), the plan of the update during backward, and the records that say so."""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

import torch
import torch.distributed as torch_dist

from mlp_offload import _core
from mlp_offload.common.config import MLPOffloadConfig
from mlp_offload.engine import memory, profiles
from mlp_offload.engine.pipeline import ChunkPipeline, StepStats
from mlp_offload.engine.store import ObjectStore
from mlp_offload.engine.telemetry import (
    AcceleratorStep,
    BackwardStep,
    GradsFinal,
    OverlapStep,
    ParamsOnNvmeStep,
    PathStep,
    SkippedRecord,
    StaleStep,
    StartRecord,
    StepRecord,
)

log = logging.getLogger("mlp_offload")

# Step records kept in memory (the telemetry file has them all): a run of a million steps must not grow.
RECORDS_KEPT = 10_000
# Steps whose measured bandwidth the next prediction takes (per path, the median): a shared disk swings
# by tens of percent from one step to the next.
PREDICTION_STEPS = 3


# A rank's requests in flight per path, and their size, when the config does not say (the store's
# defaults).
DEFAULT_MAX_INFLIGHT = 8
DEFAULT_CHUNK_SIZE = profiles.DEFAULT_CHUNK_SIZE


class RankAgreement:
    """One step as every rank of the job sees it: each path's bytes and busy times averaged over the
    ranks, and the slowest rank's time (the step the job waits for). Ranks whose tuners observe the
    same figures from the same plan make the same moves, so the job keeps one split: ranks share the
    devices (and a shared file system across nodes), so one rank's load is the others' slowness, and
    tuners reacting to each other's load would drift apart. Reduced over a gloo group of the job's
    ranks (CPU tensors whatever the accelerator's backend); one rank alone keeps its own figures."""

    def __init__(self) -> None:
        self._group: Any = None
        self.ranks = 1
        if torch_dist.is_available() and torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
            # Collective: every rank builds its engine, and so this, in the same order.
            self._group = torch_dist.new_group(backend="gloo")
            self.ranks = torch_dist.get_world_size()

    def reduce(
        self, per_path: list[dict[str, float]], seconds: float
    ) -> tuple[list[dict[str, float]], float]:
        if self._group is None:
            return per_path, seconds
        keys = sorted(per_path[0])
        sums = torch.tensor([p[k] for p in per_path for k in keys], dtype=torch.float64)
        slowest = torch.tensor([seconds], dtype=torch.float64)
        torch_dist.all_reduce(sums, op=torch_dist.ReduceOp.SUM, group=self._group)
        torch_dist.all_reduce(slowest, op=torch_dist.ReduceOp.MAX, group=self._group)
        means = (sums / self.ranks).tolist()
        width = len(keys)
        samples = []
        for i in range(len(per_path)):
            sample: dict[str, float] = dict(zip(keys, means[i * width : (i + 1) * width], strict=True))
            # Byte counts stay whole numbers, as the tuner takes them.
            samples.append({k: round(v) if k.endswith("_bytes") else v for k, v in sample.items()})
        return samples, float(slowest.item())


def job_nodes() -> int:
    """The job's nodes: its ranks over the node's (as torchrun and Slurm place them, alike on every
    node); 1 without torch.distributed."""
    if not torch_dist.is_available() or not torch_dist.is_initialized():
        return 1
    return max(1, torch_dist.get_world_size() // memory.local_ranks())


def load_profile(config: MLPOffloadConfig) -> tuple[profiles.Profile | None, int]:
    """The paths' profile, and the job's nodes: with `weights: "auto"` the saved one or a new probe (one
    per node: the node's other ranks wait for it and reuse it), and in a job of several nodes, their
    shares of the shared paths (`profiles.measure_across_nodes`, collective); with fixed weights only a
    saved one. Every store of the job's paths takes its limits from it (`open_store`)."""
    # With several ranks on the node, the probe also measures how they best share each device.
    options = profiles.ProbeOptions(ranks=memory.local_ranks())
    max_age_s = config.probe_max_age_hours * 3600
    if config.weights != "auto":
        # Fixed weights: plan with the profile only when one is saved, never probe for it.
        return profiles.saved_profile(config.paths, options, max_age_s)[0], job_nodes()
    started = time.monotonic()
    profile, source = profiles.load_or_probe(
        config.paths, options, max_age_s=max_age_s, progress=_ProbeNotice()
    )
    if profile.source == "probed":
        log.warning("mlp-offload: probed in %.1f s: %s", time.monotonic() - started, source)
    else:
        log.info("mlp-offload: %s", source)
    # A job of several nodes measures its shared paths from all of them at once (a collective).
    nodes = profiles.measure_across_nodes(
        profile,
        options,
        localities(config, profile),
        progress=lambda line: log.info("mlp-offload: %s", line),
    )
    return profile, nodes


def localities(config: MLPOffloadConfig, profile: profiles.Profile | None) -> list[str] | None:
    """Per path, `"node-local"` or `"shared"`: as configured (`path_locality`), else as probed; None with
    neither."""
    configured: list[str] | None = None if config.path_locality == "auto" else [*config.path_locality]
    return configured if profile is None else profile.localities(configured)


def max_inflight(config: MLPOffloadConfig, profile: profiles.Profile | None) -> tuple[int, str]:
    """This rank's requests in flight per path, and why (see `MLPOffloadConfig.max_inflight`): the
    configured count; else the count at which the probe moved the most with the store's requests, reads
    and writes together (`profiles.Profile.store_inflight`); else `DEFAULT_MAX_INFLIGHT`."""
    if config.max_inflight is not None:
        return config.max_inflight, "configured"
    request = config.chunk_size or DEFAULT_CHUNK_SIZE
    found = profile.store_inflight(request) if profile is not None else None
    if found is None:
        return DEFAULT_MAX_INFLIGHT, f"default (no probe of {request:,}-byte requests)"
    return found, f"auto, as the probe measured fastest with {request:,}-byte requests"


def device_inflight(config: MLPOffloadConfig, profile: profiles.Profile | None) -> list[int | None]:
    """Per path, the node-wide limit of requests in flight on its device, or None (see
    `MLPOffloadConfig.device_inflight`). With `"auto"`: none where the probe measured the node's ranks
    moving as much at their own limits as under any node-wide one (`profiles.admission_helps`); elsewhere
    what one rank would put in flight alone (`max_inflight`), or more where the probe found the device
    fastest with more bytes in flight (its best in-flight count times its best request size, in this
    store's requests), which the node's ranks then share instead of each using it."""
    n = len(config.paths)
    limit = config.device_inflight
    if limit == "off" or (limit == "auto" and memory.local_ranks() == 1):
        return [None] * n
    if isinstance(limit, int):
        return [limit] * n
    own = max_inflight(config, profile)[0]
    if profile is None:
        return [own] * n
    request = config.chunk_size or DEFAULT_CHUNK_SIZE
    return [
        max(own, -(-p["best_read"]["max_inflight"] * p["best_read"]["chunk_size"] // request))
        if profiles.admission_helps(p.get("sharing"))
        else None
        for p in profile.probes
    ]


def device_sharing(config: MLPOffloadConfig, profile: profiles.Profile | None) -> list[str]:
    """Per path, how the node's ranks share its device (see `MLPOffloadConfig.device_sharing`): with
    `"auto"`, the way the probe measured faster for as many ranks at once."""
    if config.device_sharing != "auto":
        return [config.device_sharing] * len(config.paths)
    if profile is None:
        return ["shared"] * len(config.paths)
    return [profiles.sharing_choice(p.get("sharing")) for p in profile.probes]


def host_pages(config: MLPOffloadConfig, profile: profiles.Profile | None) -> tuple[str, str]:
    """The host buffers' pages (`"huge"` or `"small"`), the state's and the parameters' alike, and why
    (see `MLPOffloadConfig.host_pages`): with `"auto"`, what the profile's figures call for
    (`_core.pages_choice`)."""
    if config.host_pages != "auto":
        return config.host_pages, "configured"
    if profile is None:
        return "huge", "auto, no probe profile"
    return _core.pages_choice([p["pages"] for p in profile.probes]), "auto, as the probe measured"


def open_store(
    config: MLPOffloadConfig,
    profile: profiles.Profile | None,
    roots: Sequence[str | os.PathLike[str]],
    *,
    rank: int,
    shadow_slots: bool,
) -> ObjectStore:
    """A store over `roots` (the configured paths, or folders in each of them, in order) with the
    config's engine, request size, split and checksums, and the limits `profile` gives: the optimizer
    state's store and the parameters' share every path's requests in flight and its node-wide admission
    alike."""
    return ObjectStore(
        roots,
        rank=rank,
        engine=config.engine,
        chunk_size=config.chunk_size,
        max_inflight=max_inflight(config, profile)[0],
        weights=config.weights if isinstance(config.weights, list) else None,
        checksum=config.checksum,
        shadow_slots=shadow_slots,
        device_inflight=device_inflight(config, profile),
        device_sharing=device_sharing(config, profile),
    )


class _ProbeNotice:
    """The probe's progress: its first line, how long the probe takes at the first path's first rate,
    is said where a user sees it (a warning), with that the job is probing its paths before the first
    step and that later jobs will not; each measurement after is logged at INFO."""

    def __init__(self) -> None:
        self.announced = False

    def __call__(self, line: str) -> None:
        if self.announced:
            log.info("mlp-offload: %s", line)
            return
        self.announced = True
        log.warning(
            "mlp-offload: probing the paths before the first step (once: the profile is saved in %s, "
            "and later jobs on these paths start without probing); %s; each measurement at INFO",
            profiles.profile_file(),
            line,
        )


def _in_backward(
    leads: dict[int, float], backward_secs: float, secs_per_chunk: float
) -> Iterator[tuple[int, float, float]]:
    """Each chunk of `leads` (chunk -> how long before backward's end its gradient was final) updated
    as soon as its gradient is final, latest-final last, one after another, each taking
    `secs_per_chunk`: `(chunk, start, end)`, in seconds from backward's start."""
    end = 0.0
    for chunk in sorted(leads, key=lambda c: (-leads[c], -c)):
        start = max(backward_secs - leads[chunk], end)
        end = start + secs_per_chunk
        yield chunk, start, end


class _Chunks(Protocol):
    """What `chunks_backward_may_take` reads of a `ChunkPipeline`."""

    @property
    def order(self) -> list[int]: ...
    @property
    def cache_slots(self) -> int: ...
    @property
    def kept_limit(self) -> int: ...


def chunks_backward_may_take(pipeline: _Chunks) -> list[int]:
    """The chunks an update during backward may take, in chunk order: every one where the pipeline may
    make kept copies (every chunk cached, with room), else the streamed ones (in chunk order the first
    `cache_slots` stay in host memory, and their state is nowhere else to undo from)."""
    return pipeline.order if pipeline.kept_limit else pipeline.order[pipeline.cache_slots :]


def chunks_for_backward(leads: dict[int, float], backward_secs: float, secs_per_chunk: float) -> list[int]:
    """The chunks worth updating during backward, in the order they would run (see `_in_backward`):
    those whose update could begin before backward ends. One that would begin only after it gains
    nothing there, and would hold a second copy on disk for nothing."""
    return [c for c, start, _ in _in_backward(leads, backward_secs, secs_per_chunk) if start < backward_secs]


def could_run_in_backward(leads: Sequence[float], backward_secs: float, secs_per_chunk: float) -> float:
    """How many seconds of an update of `len(leads)` chunks could run before backward ends (see
    `_in_backward`; `leads`: per chunk, how long before backward's end its gradient was final)."""
    return sum(
        max(0.0, min(end, backward_secs) - start)
        for _, start, end in _in_backward(dict(enumerate(leads)), backward_secs, secs_per_chunk)
    )


# The fewest chunks updated before backward ended whose times say what a chunk takes there.
CHUNK_TIMES_NEEDED = 3


def secs_per_chunk_in_backward(
    leads: Sequence[float],
    backward_secs: float,
    began_secs: float,
    taken: Sequence[int],
    ended_secs: Sequence[float],
) -> float | None:
    """What a chunk's update took during backward, measured: the mean, over the chunks whose update
    ended before backward did, of the seconds from when it could begin (its gradient final, at
    `backward_secs - leads[chunk]`, and the chunk before it done; the first, the update's start at
    `began_secs`) to its end. `taken`, `ended_secs`: the chunks in the order they ran and when each ended.
    All times in seconds from backward's start. None with fewer than `CHUNK_TIMES_NEEDED` such chunks.

    Backward's compute shares the CPU and the disk with it (on the CPU, the very cores), so a chunk takes
    longer here than inside `step()`; where the update is bound by its reads, this is a read's time.
    The mean, not the median: the plan adds chunks' times up, and a few stalled chunks (at 940M on this
    machine a tenth of them took over twice the median) cost the chunks behind them their time."""
    times = []
    free = began_secs
    for chunk, end in zip(taken, ended_secs, strict=True):
        if end > backward_secs:
            break
        times.append(end - max(free, backward_secs - leads[chunk]))
        free = end
    if len(times) < CHUNK_TIMES_NEEDED:
        return None
    return statistics.mean(times)


def chunk_order_pays(
    leads: Sequence[float], backward_secs: float, secs_per_chunk: float, cache_lost: int
) -> tuple[bool, float, float]:
    """Whether going to chunk order, which the update during backward needs, pays: what of the update of
    the chunks that stream in chunk order could run during backward (`leads`: theirs, see
    `could_run_in_backward`), against the I/O of the `cache_lost` chunks the smaller cache of chunk order
    no longer keeps (each read and written every step, `secs_per_chunk` each). Returns whether it pays,
    the first and the second."""
    hidden = could_run_in_backward(leads, backward_secs, secs_per_chunk)
    extra = cache_lost * secs_per_chunk
    return hidden > extra, hidden, extra


@dataclass
class StepTimes:
    """A step's times, in seconds: its update (inside `step()`, or behind it until it ended), forward
    and backward since the last step ended (None for the first), backward alone (every micro-batch),
    and the update's compute (Adam and the gradient conversion, every chunk)."""

    update_secs: float
    fwd_bwd_secs: float | None
    backward_secs: float
    compute_secs: float


@dataclass
class StepParts:
    """The step record's parts the engine knows: `overlap`, with the update behind `step()`, when
    `step()` returned and how long the next forward waited for subgroups; `grads_final`, the boundary's
    backward time and, per chunk, how long before its end the chunk's gradient was final
    (`overlap.GradsFinal`); `overlap_backward`, the update during backward and whether it was kept;
    `stale`, the parameters this boundary gave no gradient, updated with an earlier one
    (`mlp_offload.adapter.stale_gradients`); `params_on_nvme`, the update's reads and writes of the
    parameters on NVMe (`mlp_offload.adapter.nvme_partitions`); `accelerator_update`, the subgroups
    kept on the accelerator (`engine.accelerator_state`)."""

    overlap: OverlapStep | None = None
    grads_final: GradsFinal | None = None
    overlap_backward: BackwardStep | None = None
    stale: StaleStep | None = None
    params_on_nvme: ParamsOnNvmeStep | None = None
    accelerator_update: AcceleratorStep | None = None


def start_line(record: StartRecord) -> str:
    """The start-up line of a start record (`MLPOffloadStage3`'s, the telemetry's first)."""
    pages = record["host_pages"]
    page_report = {k: pages[k] for k in ("bytes", "reserved_huge_bytes", "transparent_huge_bytes")}
    described_pages = memory.describe_pages(pages["pages"], pages["source"], page_report)
    grad_mib = memory.GRAD_BYTES * record["chunk_elements"] / 2**20
    kernel = record["update_kernel"]
    weights = [round(w, 3) for w in record["weights"]]
    predicted = record["plan"]["predicted_update_secs"] if record["plan"] else float("nan")
    r = record
    params = ""
    if r["plan"] and r["plan"]["param_write_secs"] > 0:
        params = (
            f" (of which the parameters' writes {r['plan']['param_write_secs']:.2f} s); forward and backward "
            f"each read the parameters on NVMe in {r['plan']['param_pass_secs']:.2f} s"
        )
    return (
        f"mlp-offload: rank {r['rank']}, {r['subgroups']} subgroups in {r['chunks']} chunks of "
        f"{r['buffer_bytes'] / 2**20:.1f} MiB over {len(r['paths'])} paths; host memory "
        f"{r['host_memory'] / 2**30:.2f} GiB ({r['host_memory_source']}) = {r['buffers']} chunk "
        f"buffers + {grad_mib:.1f} MiB fp32 gradient, {r['cached_chunks']} chunks cached; "
        f"{described_pages}; update kernel: {kernel['kernel']} ({kernel['why']}); overlap with the next "
        f"forward: {r['overlap']['why']}; with backward: {r['overlap_backward']['why']}; on the "
        f"accelerator: {r['accelerator_update']['why']}; chunks streamed there: "
        f"{r['accelerator_update']['chunks']['why']}; weights {weights}; predicted update "
        f"{predicted:.2f} s{params}"
    )


@dataclass
class ParamReads:
    """The forward's and backward's reads of the parameters on NVMe, predicted before each step: the bytes
    the step before fetched (two passes of them before any step) at the median rate the busiest path read
    them in the last `PREDICTION_STEPS` steps that read any, leaving out the process's first (the plan's
    read figure before one did). The rate measured, not the probe's: the reads share the disk with the
    update's writes and the CPU with the compute, and come one fetch at a time."""

    fetched: int | None = None
    rates: deque[float] = field(default_factory=lambda: deque(maxlen=PREDICTION_STEPS))

    def predict(self, plan_bytes_per_s: float, params_bytes: int) -> float:
        """Seconds of reading the next step, given the plan's read figure and the partitions' bytes."""
        fetched = 2 * params_bytes if self.fetched is None else self.fetched
        return fetched / (statistics.median(self.rates) if self.rates else plan_bytes_per_s)

    def observe(self, fetched: int, read: int, busy_secs: float | None, *, first: bool) -> None:
        """A step's fetched bytes, all bytes read, and the busiest path's seconds of reading them (None:
        not measured)."""
        self.fetched = fetched
        if not first and read > 0 and busy_secs:
            self.rates.append(read / busy_secs)


class UpdatePlanner:
    """The plan at start-up, the tuner after each step, the next step's prediction, and the telemetry
    records of both (kept in `records`, and written as JSON lines to `config.telemetry_file`)."""

    def __init__(self, config: MLPOffloadConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        # The start record, then the newest `RECORDS_KEPT` others.
        self._start: list[dict[str, Any]] = []
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECORDS_KEPT)
        self.profile: profiles.Profile | None = None
        self.tuner: _core.WeightTuner | None = None
        self.prediction: float | None = None
        # Whether chunks are updated during backward (`overlap_backward`, set by the
        # engine), and then the next step's prediction of the update left after backward.
        self.overlap_backward = False
        self.prediction_after_backward: float | None = None
        # The bytes of the parameters on NVMe (set by the engine), which the plan counts, its prediction
        # of one pass's reads of them (the forward's, or the backward's), and each step's prediction of
        # its forward's and backward's reads from the steps before (`ParamReads`).
        self.params_on_nvme_bytes = 0
        self.param_pass_secs: float | None = None
        self._param_reads = ParamReads()
        # What a streamed chunk's update took during the recent boundaries' backwards, measured
        # (`secs_per_chunk_in_backward`).
        self._backward_chunks: deque[float] = deque(maxlen=PREDICTION_STEPS)
        # The last update that ran whole inside `step()` (set by the engine): what the plan of the update
        # during backward goes by before the model predicts one.
        self.last_whole_update: float | None = None
        # What the plan found of chunk order, which the update during backward needs ("auto").
        self.order_why = "the plan waits for one boundary's gradient times"
        self._pipeline: ChunkPipeline | None = None
        # Per recent step, each path's bytes per busy second (the first step left out: it also holds
        # the initial writes of the whole state).
        self._measured: deque[list[float]] = deque(maxlen=PREDICTION_STEPS)
        # Set by `plan` from the profile: per path, how the node's ranks share its device and this
        # rank's part of its bandwidth.
        self._ways = ["free"] * len(config.paths)
        self._share: list[float] | None = None
        # Nodes of the job, and per path this node's part of a shared path's bandwidth among them.
        self.nodes = 1
        self.node_share: list[float] | None = None
        self._agreement = RankAgreement() if config.adapt else None
        self._file = self._open(config.telemetry_file)
        # What else each record goes to as it is emitted (the adapter's writer to DeepSpeed's monitors).
        self.listener: Callable[[dict[str, Any]], None] | None = None

    def _open(self, path: str | None) -> TextIO | None:
        if not path:
            return None
        path = path.replace("{rank}", str(self.rank))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # Line-buffered and open as long as the optimizer lives: each record is on disk when written.
        return open(path, "a", buffering=1)

    @property
    def records(self) -> list[dict[str, Any]]:
        """The telemetry records in memory: the start, then the newest `RECORDS_KEPT` others."""
        return [*self._start, *self._recent]

    def emit(self, record: StartRecord | StepRecord | SkippedRecord) -> None:
        """Keeps the record and writes its JSON line (`engine.telemetry` has the records' keys)."""
        (self._start if record["event"] == "start" else self._recent).append(dict(record))
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        if self.listener is not None:
            self.listener(dict(record))

    def load_profile(self) -> None:
        """The paths' profile and the job's nodes (`load_profile`, the module's)."""
        self.profile, self.nodes = load_profile(self.config)

    @property
    def locality(self) -> list[str] | None:
        """Per path, `"node-local"` or `"shared"` (`localities`)."""
        return localities(self.config, self.profile)

    def host_pages(self) -> tuple[str, str]:
        """The host buffers' pages and why (`host_pages`, the module's)."""
        return host_pages(self.config, self.profile)

    @property
    def rank_share(self) -> list[float] | None:
        """Per path, this rank's part of the probed bandwidth of its device, shared by the node's ranks
        (`profiles.Profile.rank_share`) and, for a shared path, by the job's nodes
        (`profiles.Profile.node_share`); None before `plan` or without a profile."""
        return self._share

    def max_inflight(self) -> tuple[int, str]:
        """This rank's requests in flight per path, and why (`max_inflight`, the module's)."""
        return max_inflight(self.config, self.profile)

    def device_inflight(self) -> list[int | None]:
        """Per path, the node-wide limit of requests in flight on its device (`device_inflight`)."""
        return device_inflight(self.config, self.profile)

    def device_sharing(self) -> list[str]:
        """Per path, how the node's ranks share its device (`device_sharing`)."""
        return device_sharing(self.config, self.profile)

    def plan(self, pipeline: ChunkPipeline, store: ObjectStore) -> dict[str, Any] | None:
        """The performance model's plan from the profile `load_profile` found; with `weights: "auto"` the
        store takes its split, and with `adapt` the tuner starts from it."""
        config = self.config
        self._pipeline = pipeline
        if self.profile is None:
            return None
        # How the node's ranks share each path's device, and so each rank's part of its bandwidth.
        ranks = memory.local_ranks()
        self._ways = [
            "free" if inflight is None else sharing
            for inflight, sharing in zip(self.device_inflight(), self.device_sharing(), strict=True)
        ]
        self.node_share = self.profile.node_share(self.nodes, self.locality)
        self._share = [
            rank * node
            for rank, node in zip(self.profile.rank_share(ranks, self._ways), self.node_share, strict=True)
        ]
        plan = self._replan()
        self.prediction = plan["predicted_update_secs"]
        self.param_pass_secs = plan["param_pass_secs"]
        if config.adapt:
            self.tuner = _core.WeightTuner(plan["path_bytes_per_s"])
        if config.weights == "auto":
            store.weights = plan["weights"]
        return plan

    def _replan(
        self,
        fwd_bwd_secs: float = 0.0,
        adam_secs_per_chunk: float = 0.0,
        measured_bytes_per_s: list[float] | None = None,
        weights: list[float] | None = None,
    ) -> dict[str, Any]:
        """The model's plan for the stream, with the pipeline's chunks and buffers."""
        assert self.profile is not None and self._pipeline is not None
        pipeline = self._pipeline
        plan = self.profile.plan_stream(
            pipeline.sizes,
            pipeline.buffer_count,
            pipeline.cache_slots,
            fwd_bwd_secs=fwd_bwd_secs,
            adam_secs_per_chunk=adam_secs_per_chunk,
            measured_bytes_per_s=measured_bytes_per_s,
            weights=weights,
            share=self._share,
            request=self.config.chunk_size or DEFAULT_CHUNK_SIZE,
            param_bytes=self.params_on_nvme_bytes,
        )
        # What the store runs with (a configured count included).
        plan["max_inflight"] = [self.max_inflight()[0]] * len(plan["max_inflight"])
        return plan

    def after_step(self, store: ObjectStore, stats: StepStats, times: StepTimes, parts: StepParts) -> None:
        """The tuner's move (the store's next writes take it), the next step's prediction, and this
        step's record."""
        moved = None
        if self.tuner is not None:
            # Every rank's tuner sees the same step and so makes the same move.
            assert self._agreement is not None
            moved = self.tuner.observe(*self._agreement.reduce(stats.per_path, stats.seconds))
            if moved is not None:
                store.weights = moved
        predicted, predicted_after_backward = self.prediction, self.prediction_after_backward
        if parts.params_on_nvme is not None:
            on_nvme = parts.params_on_nvme
            on_nvme["predicted_read_secs"] = self._predicted_fetch_secs()
            # The process's first step is left out (its forward is the first to touch the buffers).
            self._param_reads.observe(
                on_nvme["fetched_bytes"],
                on_nvme["fetched_bytes"] + on_nvme["read_bytes"],
                on_nvme["read_busy_secs"],
                first=times.fwd_bwd_secs is None,
            )
        self._predict(stats, times, parts)
        fwd_bwd = times.fwd_bwd_secs
        record: StepRecord = {
            "event": "step",
            "rank": self.rank,
            "step": stats.step,
            "update_secs": times.update_secs,
            "pipeline_secs": stats.seconds,
            "read_wait_secs": stats.read_wait_seconds,
            "write_wait_secs": stats.write_wait_seconds,
            "reads": stats.reads,
            "reads_dropped": stats.reads_dropped,
            "writes": stats.writes,
            "cached": stats.cached,
            "retained": stats.retained,
            # The chunks the pipeline keeps in host memory across steps now (chunk order keeps fewer).
            "cached_chunks": self._pipeline.cache_slots if self._pipeline is not None else None,
            "paths": self._path_records(store, stats),
            "weights_next": moved,
            "compute_secs": times.compute_secs,
            # Since the last step ended: forward (and whatever else ran) and backward, every micro-batch.
            "forward_secs": fwd_bwd - times.backward_secs if fwd_bwd is not None else None,
            "backward_secs": times.backward_secs,
            "fwd_bwd_secs": fwd_bwd,
            # Made before this step, from the steps before it (the start-up plan's for the first two).
            "predicted_update_secs": predicted,
            # With the update during backward on: what it leaves after backward, made before this step
            # (a step that does not try it, or undoes it, runs the whole update in step()).
            "predicted_after_backward_secs": predicted_after_backward,
            "overlap": parts.overlap,
            "grads_final": parts.grads_final,
            "overlap_backward": parts.overlap_backward,
            "stale": parts.stale,
            "params_on_nvme": parts.params_on_nvme,
            "accelerator_update": parts.accelerator_update,
            "host_bytes": self._host_bytes(parts),
        }
        self.emit(record)

    def _predicted_fetch_secs(self) -> float | None:
        """The forward's and backward's reads of the parameters on NVMe, predicted before the step
        (`ParamReads`); None without a plan or partitions on NVMe."""
        if self.param_pass_secs is None or not self.params_on_nvme_bytes:
            return None
        nbytes = self.params_on_nvme_bytes
        return self._param_reads.predict(nbytes / self.param_pass_secs, nbytes)

    def _host_bytes(self, parts: StepParts) -> int:
        """Host memory the engine holds after a step: the pipeline's buffers and kept copies, the stale
        gradients kept in fp32 (outside `host_memory`), and the buffers of the parameters on NVMe."""
        pipeline = self._pipeline
        held = 0 if pipeline is None else pipeline.buffer_count * pipeline.buffer_size + pipeline.kept_bytes
        held += parts.params_on_nvme["buffer_bytes"] if parts.params_on_nvme is not None else 0
        return held + (parts.stale["kept_bytes"] if parts.stale is not None else 0)

    def _predict(self, stats: StepStats, times: StepTimes, parts: StepParts) -> None:
        """The next step's prediction, from what the last steps measured: forward and backward (which
        hide the write-back), Adam and the gradient conversion per chunk, and each path's bandwidth in
        the recent steps (not the tuner's smoothed figure, which starts from the probe's)."""
        rates = [
            (p["read_bytes"] + p["write_bytes"]) / p["busy_secs"] if p["busy_secs"] > 0 else 0.0
            for p in stats.per_path
        ]
        # By turns, a rank is busy on a device only in its own turns, so its bytes per busy second are
        # the whole device's: its part is that over the ranks taking turns.
        rates = [
            r / memory.local_ranks() if way == "turns" else r
            for r, way in zip(rates, self._ways, strict=True)
        ]
        if times.fwd_bwd_secs is not None and all(r > 0 for r in rates):
            # Only steps in which every path moved bytes say what each path gives.
            self._measured.append(rates)
        if self.profile is None or times.fwd_bwd_secs is None:
            return
        assert self._pipeline is not None
        measured = (
            [statistics.median(step[i] for step in self._measured) for i in range(len(rates))]
            if self._measured
            # No step moved bytes on every path yet (or everything is cached): the tuner's figures.
            else (self.tuner.estimates if self.tuner is not None else None)
        )
        # The chunks the update during backward updated, when kept, are not in this step's compute.
        backward = parts.overlap_backward
        committed = backward["chunks"] if backward is not None and backward["kept"] else 0
        adam_secs_per_chunk = times.compute_secs / max(1, len(self._pipeline.sizes) - committed)
        self.prediction = self._replan(
            fwd_bwd_secs=times.fwd_bwd_secs,
            adam_secs_per_chunk=adam_secs_per_chunk,
            measured_bytes_per_s=measured,
            # At the tuner's split, which the next step's writes use; without a tuner the plan's.
            weights=self.tuner.weights if self.tuner is not None else None,
        )["predicted_update_secs"]
        if self.overlap_backward and parts.grads_final is not None:
            self.prediction_after_backward = self._left_after_backward(
                self.prediction, parts.grads_final, adam_secs_per_chunk
            )

    def _path_records(self, store: ObjectStore, stats: StepStats) -> list[PathStep]:
        """The step record's figures per path."""
        records: list[PathStep] = []
        for path, p, report in zip(self.config.paths, stats.per_path, store.path_reports(), strict=True):
            moved_bytes = p["read_bytes"] + p["write_bytes"]
            records.append(
                {
                    "path": path,
                    "read_bytes": int(p["read_bytes"]),
                    "write_bytes": int(p["write_bytes"]),
                    "buffered_bytes": int(p["buffered_bytes"]),
                    "busy_secs": p["busy_secs"],
                    "bytes_per_s": moved_bytes / stats.seconds if stats.seconds > 0 else 0.0,
                    # This rank's most requests in flight on the path so far; with node-wide admission,
                    # the device's limit and the most requests in flight on it, all ranks together,
                    # that this rank saw when it took one.
                    "inflight_max": report["stats"]["inflight_max"],
                    "device_inflight": report["device_inflight"],
                    "node_inflight_max": report["stats"]["node_inflight_max"],
                }
            )
        return records

    def update_secs_to_plan_by(self) -> float | None:
        """The update's time the plan of the update during backward goes by: the performance model's
        prediction, else the last update measured whole inside `step()`; None before either."""
        return self.prediction or self.last_whole_update

    def backward_chunks(
        self, candidates: list[int], leads: list[float] | None, backward_secs: float
    ) -> tuple[list[int], str]:
        """The chunks of `candidates` (the streamed ones, and the cached ones where they may have kept
        copies) to update during this boundary's backward, in the order they run (`chunks_for_backward`):
        by when each one's gradient was final in the last boundary's backward (`leads`, which took
        `backward_secs`), each taking what a chunk took during the last boundaries' backwards
        (`backward_chunk_secs`), else the update's predicted time over the candidates
        (`update_secs_to_plan_by`). None, and why, when there is nothing yet to plan by or nothing would
        begin before backward ends."""
        if leads is None:
            return [], "not tried: the plan waits for one boundary's gradient times"
        assert self._pipeline is not None
        if not self._pipeline.ascending:
            return [], f"not tried: {self.order_why}"
        update_secs = self.update_secs_to_plan_by()
        if update_secs is None:
            return [], "not tried: no update predicted or measured yet to plan by"
        secs_per_chunk = self.backward_chunk_secs() or update_secs / len(candidates)
        chosen = chunks_for_backward({c: leads[c] for c in candidates}, backward_secs, secs_per_chunk)
        if not chosen:
            return [], "not tried: the plan expects no chunk's update to begin before backward ends"
        return chosen, ""

    def weigh_chunk_order(self, leads: list[float], backward_secs: float) -> None:
        """With `overlap_backward: "auto"`, before chunk order: whether it pays (`chunk_order_pays`, from
        this boundary's gradient times and the update's time per streamed chunk,
        `update_secs_to_plan_by`); if so the pipeline goes to chunk order for this step's update, and the
        update during backward can begin at the next boundary. `order_why` says what the plan found."""
        pipeline = self._pipeline
        assert pipeline is not None
        update_secs = self.update_secs_to_plan_by()
        if update_secs is None:
            self.order_why = "no update predicted or measured yet to plan by"
            return
        streamed = max(1, len(pipeline.sizes) - pipeline.cache_slots)
        in_order = pipeline.cache_slots_in_chunk_order
        lost = pipeline.cache_slots - in_order
        pays, hidden, extra = chunk_order_pays(leads[in_order:], backward_secs, update_secs / streamed, lost)
        self.order_why = (
            f"in chunk order {hidden:.2f} s of the update could run during the last backward, against "
            f"{extra:.2f} s more I/O a step for a cache {lost} chunks smaller"
        )
        if pays:
            pipeline.go_ascending()
            self.overlap_backward = True

    def observe_backward_chunks(self, secs: float) -> None:
        """A boundary's measure of what a streamed chunk's update took during its backward."""
        self._backward_chunks.append(secs)

    def backward_chunk_secs(self) -> float | None:
        """What a streamed chunk's update takes during backward: the median of the recent boundaries'
        measures; None before one. Backward's compute shares the CPU and the disk with it, so it may take
        longer there than its part of the update inside `step()`."""
        return statistics.median(self._backward_chunks) if self._backward_chunks else None

    def _left_after_backward(
        self, update_secs: float, grads_final: GradsFinal, adam_secs_per_chunk: float = 0.0
    ) -> float:
        """Of an update predicted to take `update_secs` inside `step()`, what the update during backward
        leaves after backward: the cached chunks' compute (`adam_secs_per_chunk` each) and the streamed
        chunks (those after the cache in chunk order) each taking an equal part of the rest inside
        `step()`, and during backward what a chunk took there lately (`backward_chunk_secs`, else the
        same part), updated as soon as their gradients are final at the times the last boundary's
        gradients were (`grads_final`), one after another; the chunks left, and the cached ones, in
        `step()`. Where the cached chunks too may be updated during backward (kept copies: every chunk
        cached), every chunk takes an equal part, and no more chunks run during backward than there
        are kept copies."""
        pipeline = self._pipeline
        assert pipeline is not None
        kept = pipeline.kept_limit > 0
        taken = chunks_backward_may_take(pipeline)
        if not taken:
            return update_secs
        leads = [grads_final["lead_secs"][c] for c in taken]
        # Without kept copies the cached chunks are only computed, never read or written: always left
        # for step().
        cached = 0.0 if kept else min(update_secs, pipeline.cache_slots * adam_secs_per_chunk)
        in_step = (update_secs - cached) / len(taken)
        in_backward = self.backward_chunk_secs() or in_step
        if in_backward <= 0:
            # An update the model predicts at 0 s (every chunk cached: it moves no bytes), and nothing
            # measured during backward yet: nothing to leave.
            return max(0.0, update_secs)
        # Chunks (a last one in part) done before backward ends, each of which step() no longer runs.
        done = could_run_in_backward(leads, grads_final["backward_secs"], in_backward) / in_backward
        if kept:
            # No more than the kept copies held (the limit, before any is made).
            done = min(done, pipeline.kept_copies or pipeline.kept_limit)
        return max(0.0, update_secs - done * in_step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
