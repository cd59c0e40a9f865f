"""The telemetry's records: what `optimizer.mlp_offload_telemetry` holds and `telemetry_file` has one JSON
line each of. The start record comes first, then one step record per step (a skipped step's instead of it
where an fp16 overflow skipped the update). Each key's type and one line are here; `docs/telemetry.md` is
generated from them (`make docs-pages`) and
`tests/test_telemetry.py` checks the page and that a run's records have these keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypedDict, get_args, get_origin, get_type_hints

from mlp_offload.common.type_words import type_words


class HostPages(TypedDict):
    """The host buffers' pages: asked for, why, and how the kernel backed them."""

    pages: Annotated[str, "The pages asked for: `huge` or `small`."]
    source: Annotated[str, "Why: the config, or what the probe measured."]
    bytes: Annotated[int, "The buffers' bytes."]
    reserved_huge_bytes: Annotated[int, "Of them, in huge pages the machine reserved (`MAP_HUGETLB`)."]
    transparent_huge_bytes: Annotated[int, "Of them, in transparent huge pages."]


class UpdateKernel(TypedDict, total=False):
    """Which update runs per chunk, and why."""

    kernel: Annotated[str, "`fused` (one pass in the Rust core) or `deepspeed` (DeepSpeed's passes)."]
    why: Annotated[str, "Why, in words."]
    state_dtypes: Annotated[
        dict[str, str], "The master weights' and the moments' dtypes (`master`, `moments`)."
    ]
    simd: Annotated[str, "The fused pass's SIMD path (fused only)."]
    arith: Annotated[dict[str, Any], "DeepSpeed's build's arithmetic the pass reproduces (fused only)."]
    threads: Annotated[int, "The fused pass's threads, `update_threads` (fused only)."]


class OnAndWhy(TypedDict):
    """Whether a feature is on, and why."""

    on: Annotated[bool, "Whether it is on."]
    why: Annotated[str, "Why, in words."]


class AcceleratorAtStart(TypedDict):
    """Whether subgroups are updated on the accelerator (DeepSpeed's `offload_optimizer.ratio`), and why."""

    on: Annotated[bool, "Whether it is on."]
    why: Annotated[str, "Why, in words."]
    subgroups: Annotated[
        int, "The subgroups kept whole on the accelerator, the first ones (none in the store)."
    ]
    bytes: Annotated[int, "The accelerator memory their state takes."]
    chunks: Annotated[
        ChunksAtStart,
        "Whether chunks stream to the accelerator beside the host's pass (`accelerator_update_memory`).",
    ]


class ChunksAtStart(TypedDict):
    """Whether each step streams chunks to the accelerator beside the host's pass
    (`accelerator_update_memory`, `accelerator_update_chunks`), and why."""

    on: Annotated[bool, "Whether it is on."]
    why: Annotated[str, "Why, in words."]
    memory: Annotated[
        int | None, "The accelerator memory it may use, in bytes (null: what is free at each step)."
    ]
    chunks: Annotated[int | None, "Chunks every step (null: the performance model's choice each step)."]


class BackwardAtStart(TypedDict):
    """Whether chunks are updated during backward (`overlap_backward`), and why."""

    on: Annotated[bool, "Whether it is on."]
    why: Annotated[str, "Why, in words."]
    slotted_chunks: Annotated[int, "Chunks with a second slot on disk."]
    slot_bytes: Annotated[int, "The bytes the slots added for it took."]
    kept_copies_limit: Annotated[int, "The most kept copies in host memory for cached chunks."]


class InflightCount(TypedDict):
    """This rank's requests in flight per path, and why."""

    count: Annotated[int, "Requests in flight per path."]
    source: Annotated[str, "Why: the config, or the probe."]


class StartRecord(TypedDict):
    """The first record: the budget, the chunks, the kernel, the overlaps and the plan."""

    event: Annotated[Literal["start"], "`start`."]
    rank: Annotated[int, "The rank."]
    paths: Annotated[list[str], "The storage paths."]
    subgroups: Annotated[int, "DeepSpeed's subgroups on this rank."]
    largest_subgroup_elements: Annotated[int, "The largest subgroup's elements."]
    chunks: Annotated[int, "The chunks the subgroups are cut into."]
    chunk_elements: Annotated[int, "A chunk's most elements."]
    host_memory: Annotated[int, "The state's host memory, in bytes."]
    host_memory_source: Annotated[str, "How it was chosen (`host_memory`)."]
    buffers: Annotated[int, "Chunk buffers in the pool (the cache and the stream)."]
    buffer_bytes: Annotated[int, "A chunk buffer's bytes."]
    cached_chunks: Annotated[int, "Chunks kept in host memory across steps."]
    host_pages: Annotated[HostPages, "The host buffers' pages."]
    update_kernel: Annotated[UpdateKernel, "Which update runs per chunk, and why."]
    master_in_params: Annotated[
        OnAndWhy,
        "Whether the master weights are kept in the parameters and the store keeps the moments alone "
        "(`master_in_params`), and why.",
    ]
    accelerator_update: Annotated[
        AcceleratorAtStart,
        "Whether subgroups are updated on the accelerator (DeepSpeed's `offload_optimizer.ratio`), and why.",
    ]
    overlap: Annotated[OnAndWhy, "Whether the update runs behind the next forward (`overlap`), and why."]
    subgroups_on_nvme: Annotated[
        int, "Subgroups whose parameters DeepSpeed keeps on NVMe, past `offload_param.max_in_cpu`."
    ]
    params_on_nvme_bytes: Annotated[
        int,
        "The bytes of their partitions on NVMe, which the plan counts: read by the forward and the backward "
        "(`plan.param_pass_secs` each), written by the update (`plan.param_write_secs`).",
    ]
    params_cache_bytes: Annotated[
        int,
        "The parameters' cache: host memory that keeps the partitions on NVMe the update wrote until the "
        "next forward's fetch takes them, rather than reading them back (what `host_memory` leaves once "
        "every chunk is cached, at most the partitions' bytes and `params_cache`; 0: off).",
    ]
    monitors: Annotated[
        OnAndWhy, "Whether each step's figures go to DeepSpeed's monitors (`monitors`), and why."
    ]
    overlap_backward: Annotated[BackwardAtStart, "Whether chunks are updated during backward, and why."]
    weights: Annotated[list[float], "Each path's share of every chunk."]
    max_inflight: Annotated[InflightCount, "This rank's requests in flight per path, and why."]
    device_inflight: Annotated[list[int | None], "Per path, the node-wide limit on its device (null: none)."]
    device_sharing: Annotated[list[str], "Per path, how the node's ranks share its device."]
    rank_share: Annotated[list[float] | None, "Per path, this rank's part of its device's probed bandwidth."]
    nodes: Annotated[int, "The job's nodes."]
    locality: Annotated[list[str] | None, "Per path, `node-local` or `shared`."]
    node_share: Annotated[list[float] | None, "Per path, this node's part of a shared path's bandwidth."]
    plan: Annotated[
        dict[str, Any] | None, "The performance model's plan (docs/model.md); null without a profile."
    ]


class PathStep(TypedDict):
    """One path's figures in a step."""

    path: Annotated[str, "The path."]
    read_bytes: Annotated[int, "Bytes read since the last step ended."]
    write_bytes: Annotated[int, "Bytes written since the last step ended."]
    buffered_bytes: Annotated[
        int,
        "Of those read and written, the bytes through the page cache rather than with O_DIRECT (memory or a "
        "length O_DIRECT cannot take, or a path that refuses it).",
    ]
    busy_secs: Annotated[float, "Seconds with a request in flight."]
    bytes_per_s: Annotated[float, "Bytes moved over the step's pipeline seconds."]
    inflight_max: Annotated[int, "This rank's most requests in flight on the path so far."]
    device_inflight: Annotated[int | None, "The device's node-wide limit (null: no admission)."]
    node_inflight_max: Annotated[
        int | None, "The most requests in flight on the device, all ranks, seen so far."
    ]


class OverlapStep(TypedDict):
    """With the update behind `step()`: when `step()` returned and how long the next forward waited."""

    step_returned_secs: Annotated[float, "Seconds from `step()`'s start to its return."]
    forward_waited_secs: Annotated[float, "Seconds the next forward waited for subgroups."]


class GradsFinal(TypedDict):
    """When each chunk's gradient was final."""

    backward_secs: Annotated[float, "The boundary's backward's seconds."]
    lead_secs: Annotated[list[float], "Per chunk, how long before backward's end its gradient was final."]


class BackwardStep(TypedDict):
    """What the update during backward did at this boundary (`overlap_backward`)."""

    chunks: Annotated[int, "Chunks it took."]
    in_backward: Annotated[int, "Of them, those whose update ended before backward did."]
    chunk_secs: Annotated[float | None, "What a chunk took during backward, measured (null: too few)."]
    kept: Annotated[bool, "Whether `step()` kept its versions."]
    figures: Annotated[
        dict[str, int] | None, "Its part of the step's reads, reads_dropped, cached, retained, writes."
    ]
    why: Annotated[str, "Why it was kept, undone or not tried."]
    secs: Annotated[float, "Seconds from its start to its end."]
    planned: Annotated[int, "Chunks the plan chose."]
    slotted: Annotated[int, "Of them, those with a second slot to stage into."]
    stopped: Annotated[str | None, "Why it stopped before every chunk was taken (null: it did not)."]
    slotted_chunks: Annotated[int, "Chunks with a second slot on disk."]
    slot_bytes: Annotated[int, "The bytes the slots added took."]
    slots_short: Annotated[str | None, "Why adding slots stopped short (null: it did not)."]
    slots_given_back: Annotated[int, "Slots given back after the plan stopped choosing them."]
    slot_bytes_given_back: Annotated[int, "Their bytes."]
    kept_copies: Annotated[int, "Kept copies in host memory (cached chunks' states before)."]
    kept_bytes: Annotated[int, "Their bytes."]
    kept_short: Annotated[str | None, "Why making kept copies stopped short (null: it did not)."]
    chunk_order: Annotated[bool, "Whether the steps go in chunk order, which it needs."]
    chunk_order_why: Annotated[str, "What the plan found of chunk order."]


class StaleStep(TypedDict):
    """The parameters this boundary gave no gradient, updated with an earlier one as stock updates them."""

    params: Annotated[int, "Parameters updated with an earlier gradient."]
    kept_bytes: Annotated[int, "The bytes of those kept in fp32, outside `host_memory`."]
    diverged: Annotated[
        int, "Parameters whose gradients came in earlier micro-steps only (a warning names them)."
    ]


class AcceleratorStep(TypedDict):
    """The update on the accelerator in a step: the subgroups kept there (`offload_optimizer.ratio`), and
    the chunks streamed there beside the host's pass (`accelerator_update_memory`)."""

    subgroups: Annotated[int, "Subgroups updated there."]
    elements: Annotated[int, "Their elements."]
    grad_bytes: Annotated[int, "Bytes of their gradients copied there from DeepSpeed's host buffer."]
    secs: Annotated[float, "Seconds their update took, the copies included, before the host's chunks."]
    chunks: Annotated[
        ChunksStep | None, "The chunks streamed there beside the host's pass (null: off this step)."
    ]


class ChunksStep(TypedDict):
    """The chunks a step streamed to the accelerator beside the host's pass
    (`accelerator_update_memory`), predicted and measured."""

    chunks: Annotated[int, "Chunks updated there."]
    host_chunks: Annotated[int, "Chunks the host's pass updated."]
    elements: Annotated[int, "The elements of the chunks there."]
    host_elements: Annotated[int, "The elements of the host's chunks."]
    bytes_out: Annotated[
        int,
        "Bytes copied there: their state and gradients (and the master weights in the parameters where "
        "those are on the host).",
    ]
    bytes_back: Annotated[
        int, "Bytes copied back: their state (and the parameters where those are on the host)."
    ]
    slots: Annotated[int, "Chunks in flight there at once."]
    why: Annotated[str, "Why this many, in words."]
    predicted_secs: Annotated[
        float | None, "The model's update time for this split (null: no model chose it)."
    ]
    predicted_host_only_secs: Annotated[float | None, "The model's update time with every chunk the host's."]
    predicted_host_secs: Annotated[float | None, "The model's time of the host's pass over its chunks."]
    predicted_device_secs: Annotated[
        float | None, "The model's time of the chunks there, from the first copy out to the last copy back."
    ]
    memory: Annotated[int, "The accelerator memory the update might take at this step, in bytes."]
    host_elements_per_s: Annotated[
        float | None,
        "The host pass's rate the choice weighed, as the steps before measured it (null: not yet).",
    ]
    device_elements_per_s: Annotated[
        float | None, "The kernel's rate there the choice weighed (null: not yet)."
    ]
    h2d_bytes_per_s: Annotated[float | None, "The copies' rate there the choice weighed (null: not yet)."]
    d2h_bytes_per_s: Annotated[float | None, "The copies' rate back the choice weighed (null: not yet)."]
    host_secs: Annotated[float, "Seconds of the host's pass over its chunks."]
    device_secs: Annotated[float, "Seconds from the first chunk's start there to the last one's end."]
    copy_out_secs: Annotated[float, "Seconds of the copies there, summed over the chunks."]
    kernel_secs: Annotated[float, "Seconds of the kernel there, summed over the chunks."]
    copy_back_secs: Annotated[float, "Seconds of the copies back, summed over the chunks."]


class ParamsOnNvmeStep(TypedDict):
    """The update's reads and writes of the parameters DeepSpeed keeps on NVMe, past
    `offload_param.max_in_cpu` (`adapter.nvme_partitions`)."""

    subgroups: Annotated[int, "Subgroups whose parameters are on NVMe."]
    read_bytes: Annotated[int, "Bytes of their partitions the update read from the store."]
    read_cached_bytes: Annotated[
        int,
        "Bytes of their partitions the update took from the parameters' cache instead of reading them "
        "(the master weights, where they are in the parameters; not in `read_bytes`).",
    ]
    written_bytes: Annotated[int, "Bytes of their partitions the update wrote back (those it changed)."]
    fetched_bytes: Annotated[
        int,
        "Bytes of their partitions DeepSpeed's fetches (forward and backward) read between the last "
        "step's `step()` and this one's (behind `step()`, the next forward's fetches run beside the "
        "update).",
    ]
    fetch_wait_secs: Annotated[float, "Seconds those fetches waited for their reads."]
    backward_fetched_bytes: Annotated[
        int,
        "Of `fetched_bytes`, those the backward's fetches read (between DeepSpeed's `backward_prologue` "
        "and `backward_epilogue`); the rest, the forward's and any other fetch's (an evaluation's).",
    ]
    backward_fetch_wait_secs: Annotated[float, "Of `fetch_wait_secs`, the backward's fetches'."]
    read_ahead_bytes: Annotated[
        int,
        "Of the fetched bytes, those read ahead of their fetch, in the order the step before fetched "
        "(DeepSpeed's trace), within its prefetch bucket.",
    ]
    cached_bytes: Annotated[
        int,
        "Bytes of their partitions the fetches took from the parameters' cache instead of reading them "
        "(the update's last writes, and the partitions earlier fetches let go, kept in host memory: "
        "`params_cache_bytes`; not in `fetched_bytes`).",
    ]
    backward_cached_bytes: Annotated[int, "Of `cached_bytes`, those the backward's fetches took."]
    read_busy_secs: Annotated[
        float | None,
        "Seconds the parameters' busiest path had reads in flight over the same span (the fetches' and "
        "the last update's; null: not our swapper).",
    ]
    write_busy_secs: Annotated[float | None, "The same for writes."]
    buffered_bytes: Annotated[
        int | None,
        "Bytes of the partitions read and written through the page cache rather than with O_DIRECT since "
        "the last step, all paths (null: not our swapper).",
    ]
    predicted_read_secs: Annotated[
        float | None,
        "The plan's time for the forward's and the backward's reads of the partitions, made before this "
        "step: the bytes the step before read (two passes before the first step) at the median rate the "
        "busiest path read them in the last 3 steps that read any, the process's first left out (the "
        "plan's read figure before one did; null: no plan).",
    ]
    buffer_bytes: Annotated[
        int, "Host memory the partitions' buffers hold after the step, those kept for the next read included."
    ]
    buffers_made_bytes: Annotated[
        int,
        "Bytes of the partitions' buffers made since the last record (the update's flat copies included; "
        "after the first steps, reads reuse them).",
    ]
    buffers_made_huge_bytes: Annotated[
        int,
        "Of them, those the kernel backed with huge pages as it made them. Below `buffers_made_bytes` with "
        "`host_pages` huge: buffers under 2 MiB, or memory too fragmented (reads and writes of that memory "
        "reach the disk in smaller requests).",
    ]


class StepRecord(TypedDict):
    """One per step, once its update ended."""

    event: Annotated[Literal["step"], "`step`."]
    rank: Annotated[int, "The rank."]
    step: Annotated[int, "The step."]
    update_secs: Annotated[float, "The update's seconds, inside `step()` or behind it."]
    pipeline_secs: Annotated[float, "The chunk loop's seconds."]
    read_wait_secs: Annotated[float, "Seconds the loop waited for reads."]
    write_wait_secs: Annotated[float, "Seconds the loop waited for writes."]
    reads: Annotated[int, "Chunks read."]
    reads_dropped: Annotated[int, "Reads ahead of a part that ended before their chunks, read again."]
    writes: Annotated[int, "Chunks written."]
    cached: Annotated[int, "Chunks updated in the cache."]
    retained: Annotated[int, "Chunks updated in the buffer their last write left."]
    cached_chunks: Annotated[int | None, "Chunks the pipeline keeps in host memory across steps now."]
    paths: Annotated[list[PathStep], "Per path, its figures."]
    weights_next: Annotated[list[float] | None, "The tuner's next weights (null: no move)."]
    compute_secs: Annotated[float, "The update's compute: Adam and the gradient conversion, every chunk."]
    forward_secs: Annotated[float | None, "Since the last step ended, less backward (null at the first)."]
    backward_secs: Annotated[float, "Backward's seconds, every micro-batch."]
    fwd_bwd_secs: Annotated[float | None, "Since the last step ended (null at the first)."]
    predicted_update_secs: Annotated[float | None, "The update's time, predicted before this step."]
    predicted_after_backward_secs: Annotated[
        float | None, "With `overlap_backward`: what it leaves after backward, predicted before this step."
    ]
    overlap: Annotated[OverlapStep | None, "With the update behind `step()`: when it returned, and the wait."]
    grads_final: Annotated[GradsFinal | None, "When each chunk's gradient was final."]
    overlap_backward: Annotated[
        BackwardStep | None, "The update during backward (null: off, or nothing to say)."
    ]
    stale: Annotated[StaleStep | None, "The parameters updated with an earlier gradient."]
    params_on_nvme: Annotated[
        ParamsOnNvmeStep | None, "The parameters on NVMe past `max_in_cpu` (null: none there)."
    ]
    accelerator_update: Annotated[
        AcceleratorStep | None,
        "The subgroups kept on the accelerator and the chunks streamed there (null: neither this step).",
    ]
    host_bytes: Annotated[
        int,
        "Host memory the engine holds now: its chunk buffers, kept copies, stale gradients in fp32 and the "
        "buffers of the parameters on NVMe.",
    ]


class SkippedRecord(TypedDict):
    """In place of a step record where an fp16 overflow skipped the update."""

    event: Annotated[Literal["skipped"], "`skipped`."]
    rank: Annotated[int, "The rank."]
    loss_scale: Annotated[float, "The loss scale after the overflow."]
    overlap_backward: Annotated[BackwardStep | None, "The update during backward, undone."]


RECORDS: tuple[type, ...] = (StartRecord, StepRecord, SkippedRecord)


def keys_of(record_type: type) -> dict[str, tuple[Any, str]]:
    """Each key of a record type: its type and its one line."""
    hints = get_type_hints(record_type, include_extras=True)
    return {name: get_args(hint)[:2] for name, hint in hints.items()}


def _is_record(hint: Any) -> bool:
    """Whether a type is one of these records (a TypedDict)."""
    return isinstance(hint, type) and hasattr(hint, "__total__")


def _record_words(hint: Any) -> str | None:
    """A record held in another, as a link to its table."""
    if _is_record(hint):
        return f"[{hint.__name__}](#{hint.__name__.lower()})"
    return None


def _nested(record_type: type, seen: list[type]) -> None:
    for hint, _ in keys_of(record_type).values():
        for t in (hint, *get_args(hint), *(a for g in get_args(hint) for a in get_args(g))):
            if _is_record(t) and t not in seen:
                seen.append(t)
                _nested(t, seen)


def _record_type(hint: Any) -> type | None:
    """The record type a key's type holds (itself, or within `| None`), if it holds one."""
    for t in (hint, *get_args(hint)):
        if _is_record(t):
            return t
    return None


def mismatches(record: dict[str, Any], record_type: type | None = None, where: str = "") -> list[str]:
    """Where `record` (and the records it holds) has keys its type does not, or lacks required ones."""
    if record_type is None:
        by_event = {get_args(keys_of(r)["event"][0])[0]: r for r in RECORDS}
        record_type = by_event.get(record.get("event"))
        if record_type is None:
            return [f"{where}event {record.get('event')!r}: no such record"]
    keys = keys_of(record_type)
    required = getattr(record_type, "__required_keys__", frozenset(keys))
    found = [f"{where}{k}: not in {record_type.__name__}" for k in record if k not in keys]
    found += [f"{where}{k}: missing" for k in keys if k in required and k not in record]
    for name, (hint, _) in keys.items():
        value, inner = record.get(name), get_args(hint)
        nested = _record_type(hint)
        if nested is not None and isinstance(value, dict):
            found += mismatches(value, nested, f"{where}{name}.")
        elif inner and get_origin(hint) is list and (item := _record_type(inner[0])) and value:
            for i, v in enumerate(value):
                found += mismatches(v, item, f"{where}{name}[{i}].")
    return found


# Where the step records' figures go in DeepSpeed's monitors (`monitors`): each name under this prefix, so
# TensorBoard shows them as one group beside DeepSpeed's own (`Train/Samples/...`).
MONITOR_PREFIX = "mlp_offload/"


@dataclass(frozen=True)
class MonitorFigure:
    """One figure of a step record as a monitor's scalar: its name, what it is, and where the record
    holds it (`key`: a key of the record, or a key of a record it holds, after a `/`). A path's figure
    is named `path<i>/<key>`, once per path, `<i>` the path's index, and read from its `PathStep`."""

    name: str
    what: str
    key: str = ""

    def value(self, record: StepRecord) -> float | None:
        """The figure in `record` (None where the record has none: a first step's forward, no update
        during backward)."""
        held: Any = record
        for part in self.key.split("/"):
            held = None if held is None else held.get(part)
        return None if held is None else float(held)


MONITOR_FIGURES = (
    MonitorFigure("time/update_secs", "The update's seconds, inside `step()` or behind it.", "update_secs"),
    MonitorFigure(
        "time/predicted_update_secs",
        "The update's seconds as the plan predicted them.",
        "predicted_update_secs",
    ),
    MonitorFigure(
        "time/predicted_after_backward_secs",
        "With `overlap_backward`: what it leaves after backward, as predicted.",
        "predicted_after_backward_secs",
    ),
    MonitorFigure("time/pipeline_secs", "The chunk loop's seconds.", "pipeline_secs"),
    MonitorFigure("time/compute_secs", "The update's compute, every chunk.", "compute_secs"),
    MonitorFigure("time/read_wait_secs", "Seconds the loop waited for reads.", "read_wait_secs"),
    MonitorFigure("time/write_wait_secs", "Seconds the loop waited for writes.", "write_wait_secs"),
    MonitorFigure("time/forward_secs", "Forward (and all else) since the last step.", "forward_secs"),
    MonitorFigure("time/backward_secs", "Backward's seconds, every micro-batch.", "backward_secs"),
    MonitorFigure(
        "time/forward_waited_secs",
        "With the update behind `step()`: seconds the next forward waited for it.",
        "overlap/forward_waited_secs",
    ),
    MonitorFigure("chunks/reads", "Chunks read.", "reads"),
    MonitorFigure("chunks/writes", "Chunks written.", "writes"),
    MonitorFigure("chunks/cached", "Chunks updated in the cache (hits).", "cached"),
    MonitorFigure("chunks/retained", "Chunks updated in the buffer their last write left.", "retained"),
    MonitorFigure("chunks/reads_dropped", "Reads ahead dropped and read again.", "reads_dropped"),
    MonitorFigure("chunks/cached_chunks", "Chunks kept in host memory across steps.", "cached_chunks"),
    MonitorFigure("path<i>/read_bytes", "Bytes read from the path since the last step."),
    MonitorFigure("path<i>/write_bytes", "Bytes written to the path since the last step."),
    MonitorFigure("path<i>/busy_secs", "Seconds with a request in flight on the path."),
    MonitorFigure("path<i>/bytes_per_s", "Bytes moved over the pipeline's seconds."),
    MonitorFigure(
        "overlap_backward/chunks",
        "Chunks the update during backward took.",
        "overlap_backward/chunks",
    ),
    MonitorFigure(
        "overlap_backward/in_backward",
        "Of them, those whose update ended before backward did.",
        "overlap_backward/in_backward",
    ),
    MonitorFigure(
        "overlap_backward/kept",
        "1 where `step()` kept its versions, else 0.",
        "overlap_backward/kept",
    ),
    MonitorFigure("memory/host_bytes", "Host memory the engine holds now.", "host_bytes"),
    MonitorFigure("stale/params", "Parameters updated with an earlier gradient.", "stale/params"),
    MonitorFigure("stale/kept_bytes", "Their gradients kept in fp32.", "stale/kept_bytes"),
    MonitorFigure(
        "params_on_nvme/read_bytes",
        "Bytes of the parameters on NVMe the update read.",
        "params_on_nvme/read_bytes",
    ),
    MonitorFigure(
        "params_on_nvme/written_bytes",
        "Bytes of the parameters on NVMe the update wrote.",
        "params_on_nvme/written_bytes",
    ),
    MonitorFigure(
        "params_on_nvme/fetched_bytes",
        "Bytes of them the forward and backward read.",
        "params_on_nvme/fetched_bytes",
    ),
    MonitorFigure(
        "params_on_nvme/fetch_wait_secs",
        "Seconds the forward and backward waited for them.",
        "params_on_nvme/fetch_wait_secs",
    ),
    MonitorFigure(
        "params_on_nvme/backward_fetched_bytes",
        "Of the bytes read, the backward's.",
        "params_on_nvme/backward_fetched_bytes",
    ),
    MonitorFigure(
        "params_on_nvme/backward_fetch_wait_secs",
        "Of the seconds waited, the backward's.",
        "params_on_nvme/backward_fetch_wait_secs",
    ),
    MonitorFigure(
        "params_on_nvme/read_busy_secs",
        "Seconds their busiest path was reading.",
        "params_on_nvme/read_busy_secs",
    ),
    MonitorFigure(
        "params_on_nvme/predicted_read_secs",
        "The plan's time for the forward's and backward's reads.",
        "params_on_nvme/predicted_read_secs",
    ),
)


def monitor_events(record: StepRecord) -> list[tuple[str, float]]:
    """A step record's figures as a monitor's scalars (`MONITOR_FIGURES`), named with their prefix;
    the figures the record has none of (a first step's forward, no update during backward) left out."""
    events = []
    for figure in MONITOR_FIGURES:
        if not figure.key:
            key = figure.name.removeprefix("path<i>/")
            for i, path in enumerate(record["paths"]):
                figures: dict[str, Any] = dict(path)
                events.append((f"{MONITOR_PREFIX}path{i}/{key}", float(figures[key])))
        elif (value := figure.value(record)) is not None:
            events.append((MONITOR_PREFIX + figure.name, value))
    return events


def markdown() -> str:
    """`docs/telemetry.md`: one table per record, then one per record they hold."""
    seen: list[type] = list(RECORDS)
    for record_type in RECORDS:
        _nested(record_type, seen)
    lines = [
        "# Telemetry",
        "",
        "Generated from `mlp_offload/engine/telemetry.py` (`make docs-pages`); `tests/test_telemetry.py` "
        "checks this page and a run's records against it.",
        "`optimizer.mlp_offload_telemetry` holds the records, and `telemetry_file` has one JSON line "
        "each: the start record first, then one step record per step (a skipped record where an fp16 "
        "overflow skipped the update). A step's record comes once its update ends: "
        "`optimizer.mlp_offload_wait()` waits for it.",
    ]
    for record_type in seen:
        doc = (record_type.__doc__ or "").strip()
        lines += [
            "",
            f"## {record_type.__name__}",
            "",
            doc,
            "",
            "| key | type | what it is |",
            "|---|---|---|",
        ]
        for name, (hint, line) in keys_of(record_type).items():
            lines.append(f"| `{name}` | {type_words(hint, _record_words)} | {line} |")
    lines += [
        "",
        "## In DeepSpeed's monitors",
        "",
        "Where the DeepSpeed config enables a monitor (`tensorboard`, `wandb`, `comet`, `csv_monitor`), each "
        "step record's figures are written to it through DeepSpeed's own monitor, at the engine's sample "
        f"count of the step (its `global_samples`), each under `{MONITOR_PREFIX}`; `monitors: false` turns "
        "this off. A figure the record has none of (the first step's forward, no update during backward) "
        "is left out of that step. `<i>` is a path's index in `paths`.",
        "",
        "| name | what it is |",
        "|---|---|",
    ]
    lines += [f"| `{MONITOR_PREFIX}{figure.name}` | {figure.what} |" for figure in MONITOR_FIGURES]
    return "\n".join(lines) + "\n"
