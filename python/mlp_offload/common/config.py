"""The `"mlp_offload"` section of a DeepSpeed config: typed, validated, every key documented.

```json
"mlp_offload": {
  "paths": ["/nvme0/offload", "/lustre/scratch/me/offload"],
  "host_memory": "auto",
  "weights": "auto",
  "adapt": true,
  "telemetry_file": "logs/mlp-offload-rank{rank}.jsonl"
}
```
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from mlp_offload.common import units

SECTION = "mlp_offload"


def _size(value: Any) -> Any:
    return value if value in (None, "auto", "deepspeed") else units.parse_size(value)


Size = Annotated[int, BeforeValidator(_size)]


class MLPOffloadConfig(BaseModel):
    """What the section may hold. Unknown keys are errors that name the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    paths: list[str] = Field(min_length=1)
    """Storage directories for the optimizer state, any number.

    Node-local NVMe, a parallel file system, ...: every path at once. Each rank uses its own `rank<N>`
    subdirectory in each."""

    host_memory: Size | Literal["auto", "deepspeed"] = "auto"
    """Host memory for the state's chunk buffers (the cache and the stream) and one chunk's fp32 gradient.

    A number of bytes, or a size such as `"16G"`. `"auto"`: what this rank can spare at start-up (the
    memory available, cgroup limits included, less a margin, divided among the node's local ranks, less
    what the first forward and backward take that is not yet given: the gathered parameters on a host,
    DeepSpeed's reduce buckets), never
    less than `"deepspeed"` and never more than the whole state needs. `"deepspeed"`: what stock
    DeepSpeed pins for its NVMe offload, for comparisons at equal memory. With parameters on NVMe (past
    `offload_param.max_in_cpu`), a size and `"auto"` hold their buffers too, the state getting the rest;
    what is left once every chunk is cached keeps the partitions the update wrote for the next forward
    (the parameters' cache)."""

    weights: list[float] | Literal["auto", "equal"] = "auto"
    """How each subgroup's state is split across `paths`.

    How each subgroup's state is split across `paths`. `"auto"`: the performance model's split from
    the saved probe profile of these paths (probed at start-up when there is none or it is stale);
    `"equal"`: the same share everywhere; or one weight per path."""

    path_locality: list[Literal["node-local", "shared"]] | Literal["auto"] = "auto"
    """Per path, whether only this node reaches it or every node of the job mounts it.

    Per path, whether only this node reaches it (`"node-local"`) or every node of the job mounts the
    same directory (`"shared"`). With `weights: "auto"`, a job of several nodes measures each shared
    path's bandwidth from all its nodes at once at start-up (once; the profile keeps it), and plans each
    node with its part. `"auto"`: from the file system's type: network and parallel file systems
    (Lustre, GPFS, BeeGFS, NFS, CephFS, GlusterFS, ...) are shared, the rest node-local."""

    adapt: bool = True
    """Move share between paths after every step, keeping a move only if the updates after it were no slower.

    After every step, move share from the busiest path to the idler ones; a move is kept only if the
    two updates after it were no slower than the two before (`WeightTuner`, docs/model.md)."""

    cache_chunks: int | Literal["auto"] = "auto"
    """Chunks kept in host memory across steps (each skips a read and a write a step).

    `"auto"`:
    every buffer `host_memory` holds, the stream's included (a step then reads and writes only what
    does not fit); a number: that many, the other buffers written back at the end of every step."""

    update_chunk: Size | Literal["auto"] = "auto"
    """Bytes of state per chunk: the unit of the streaming update's I/O, memory and compute.

    Bytes of state (the master weights and both Adam moments: 12 bytes per element in fp32, 10 or 6
    with DeepSpeed's state in half precision) per chunk, the unit of the streaming update's I/O, memory
    and compute. `"auto"`: up to 48 MiB, smaller when `host_memory` would otherwise hold fewer than 24
    chunks."""

    host_pages: Literal["auto", "huge", "small"] = "auto"
    """The pages of the host buffers: huge (2 MiB) or 4 KiB.

    The state's buffers, and those of the parameters on NVMe. `"huge"`: 2 MiB pages, which reach a
    device in whole requests: reserved ones (`MAP_HUGETLB`) where enough are free, else transparent ones;
    the start-up line reports any part of the state's left in 4 KiB pages, the step records the
    parameters'. `"small"`: 4 KiB pages. `"auto"`: huge, unless the probe measured them moving 5% less
    than 4 KiB pages on some path (huge without a probe profile)."""

    update_kernel: Literal["auto", "fused", "deepspeed"] = "auto"
    """How each chunk is updated: one fused pass in the Rust core, or DeepSpeed's own passes.

    `"fused"`: one pass, bit for bit what DeepSpeed's passes give; checked at start-up against DeepSpeed's
    CPU Adam on this CPU, and refused, naming what differed, if it does not agree. `"deepspeed"`:
    DeepSpeed's passes. `"auto"`: the fused pass where it agrees, else DeepSpeed's passes, saying why.
    Optimizers other than DeepSpeed's CPU Adam run their own; DeepSpeed's state in half precision needs
    the fused pass."""

    update_threads: Annotated[int, Field(ge=1, strict=True)] | Literal["auto"] = "auto"
    """Threads of the fused pass, each over its own range of a chunk.

    A number: that many. `"auto"`: torch's intra-op threads (`torch.get_num_threads()`), as DeepSpeed's
    CPU Adam takes OpenMP's; under torchrun with several ranks a node that is 1 unless `OMP_NUM_THREADS`
    is set. More may move more bytes a second, or none: `make bench-kernel` measures the pass per thread
    count. The start-up record says how many."""

    overlap: bool | Literal["auto"] = "auto"
    """Run the update behind the next forward: `step()` returns once the step's outcome is decided.

    `true`: the update runs on behind `step()` in chunk order, each parameter's fetch in the next forward
    waiting for its own subgroup only; bit for bit the same. It needs the fused pass (`update_kernel`).
    `false`: inside `step()`. `"auto"`: on when every chunk stays in host memory, off where the state
    streams. The start-up line says which, and why."""

    overlap_backward: bool | Literal["auto"] = "auto"
    """Update chunks during backward as their gradients become final; `step()` keeps or undoes them.

    At an accumulation boundary each chunk is updated once its gradients are final, at the step's outcome
    expected then (no overflow, the gradients unclipped, the hyperparameters as backward began); `step()`
    keeps the new versions where the outcome is that one, else forgets them and updates as without it, and
    so does anything that reads parameters or state in between. Bit for bit the same as without it. It
    needs the fused pass and the steps in chunk order. `"auto"`: where the plan finds that the update
    could run during backward, of the chunks whose update could begin before backward ends; `true`: every
    chunk it may take. Each step's record says what it did, and why (docs/design/overlap-backward.md)."""

    master_in_params: bool | Literal["auto"] = "auto"
    """Keep DeepSpeed's half-precision master weights in the parameters only, and the moments in the store.

    With DeepSpeed's master weights in the parameters' dtype (`bf16.bf16_master_weights_and_grads`,
    `fp16.fp16_master_weights_and_grads`), DeepSpeed copies them into the parameters after every step,
    so the parameters hold their bits: the store keeps the moments alone (8 or 4 bytes a parameter for
    10 or 6), bit for bit the same. Parameters changed outside the optimizer, which DeepSpeed's master
    weights would overwrite at the next step, are an error at that step. `"auto"`: on in those modes
    unless `overlap_backward` is `true` (whose undo needs the master weights apart; `"auto"` turns the
    update during backward off); `false`: the master weights in the store too. The start-up record says
    which, and why (docs/design/master-in-params.md)."""

    accelerator_update_memory: Size | Literal["auto"] = "auto"
    """Accelerator memory the update may use for chunks streamed there beside the host's pass.

    Each step the performance model sends some chunks' state and gradients to the accelerator, where the
    host pass's own arithmetic updates them (bit for bit the same, checked there at start-up), while the
    host's pass updates the others, so that both sides end together (Deep Optimizer States;
    docs/model.md). It weighs the measured rates of both passes and of the copies each way. `"auto"`:
    the accelerator memory free at the step; a size: at most that; `0`: off, every chunk the host's. It
    needs the fused pass, and a GPU with DeepSpeed's `offload_optimizer.pin_memory: true` (copies from
    pageable memory would hold the host's pass), or Triton's interpreter on DeepSpeed's CPU accelerator
    (`TRITON_INTERPRET=1`). With the master weights in the parameters (`master_in_params`), the kernel
    updates them in the partition and sums them there as the host pass does. Beside the update during
    backward (`overlap_backward`), the split takes its share of the chunks that one left to `step()`.
    The start-up record says whether it is on, and why; each step's record says what it chose, the
    rates it weighed, predicted and measured."""

    accelerator_update_chunks: Annotated[int, Field(ge=0, strict=True)] | Literal["auto"] = "auto"
    """Chunks the accelerator updates each step (`accelerator_update_memory`).

    `"auto"`: the performance model's choice each step, from the rates measured in the steps before
    (the first two steps with it on send one chunk there each to measure them; the first run of the
    kernel compiles it). A number: that many every step,
    whatever the model would choose (as many as the step has at most; none where the memory holds no
    chunk); `0`: off."""

    params_cache: Size | Literal["auto"] = "auto"
    """Host memory that keeps the parameters on NVMe that the next fetch or update would read back.

    With `offload_param` on NVMe past `max_in_cpu`, the update writes each subgroup's new parameters to
    the store; the parameters' cache keeps a copy of each partition in host memory until the next
    forward's fetch takes it, in place of reading back what was just written, and the partitions a fetch
    lets go, for the backward's fetch of them and the update's read (those give way to the update's
    writes, oldest first). `"auto"`: what
    `host_memory` leaves once every chunk is cached (with `host_memory: "auto"`, what this rank can spare
    beyond the state, the parameters' buffers and the backward's; none with `"deepspeed"` or where
    chunks stream), at most the partitions' bytes; a size: at most that, within the same room; `0`: off.
    The start-up record says how much (`params_cache_bytes`), each step's record what the fetches and
    the update took from it (`params_on_nvme.cached_bytes`, `params_on_nvme.read_cached_bytes`)."""

    engine: Literal["auto", "io_uring", "threads"] = "auto"
    """The I/O engine: io_uring where the kernel allows it, else a pread/pwrite thread pool."""

    chunk_size: Size | None = None
    """Bytes per I/O request (4M by default)."""

    max_inflight: int | None = Field(default=None, ge=1)
    """Requests in flight per path, for this rank.

    Requests in flight per path, for this rank. By default the count at which the probe moved the most
    with the store's requests (reads and writes together; the largest over the paths), else 8. The
    parameters' partitions on NVMe (`offload_param`) are read and written under the same limit."""

    device_inflight: int | Literal["auto", "off"] = "auto"
    """Requests in flight on each path's device for the whole node, all its ranks together.

    A number: on, at that count, each rank taking one of them for every request it submits and giving it
    back when the request completes. `"auto"`: on when the node runs more than one rank and the probe
    found a node-wide limit faster, at what one rank would put in flight alone (`max_inflight`) or more.
    `"off"`: each rank at its own `max_inflight`. The parameters' partitions on NVMe take their requests
    from the same limit."""

    device_sharing: Literal["auto", "shared", "turns"] = "auto"
    """How the node's ranks share a device under `device_inflight`: interleaved, or by turns.

    `"shared"`: each rank takes one request at a time, so their requests interleave. `"turns"`: a rank
    takes the whole limit for a turn (256 MiB of requests, or until it has nothing more to do), then the
    next in the kernel's queue. `"auto"`: `"turns"` where the probe measured them moving 5% more with
    this many ranks, else `"shared"`."""

    checksum: bool = True
    """A CRC32C of every stripe, checked on every read."""

    shadow_slots: bool = False
    """Two slots per chunk on disk, so a failed write leaves the previous state readable.

    Two slots per chunk on disk, so a failed write leaves the previous state readable, at twice the
    disk space. Off by default: one copy, as DeepSpeed keeps, but for the chunks `overlap_backward`
    updates during backward, which get a second one for their staged versions; checkpoints protect the
    state, and checksums make a torn write an error, never wrong numbers."""

    telemetry_file: str | None = None
    """JSON lines, one per step (and one at start-up with the plan); `{rank}` becomes the rank."""

    monitors: bool = True
    """Each step's figures to DeepSpeed's monitors, where its config enables one.

    Where the DeepSpeed config enables a monitor (`tensorboard`, `wandb`, `comet`, `csv_monitor`), each
    step's figures (phases, bytes per path, the cache, predicted against measured, the update during
    backward, host memory) are written to it through DeepSpeed's own monitor at the engine's sample
    count, named `mlp_offload/...` (docs/telemetry.md lists them). Nothing is written where no monitor
    is enabled. `false`: never."""

    probe_max_age_hours: float = Field(default=168.0, gt=0)
    """Reuse a saved probe profile up to this age (with `weights: "auto"`)."""

    @field_validator("weights")
    @classmethod
    def _weights(cls, value: Any) -> Any:
        if isinstance(value, list) and (any(w < 0 for w in value) or not any(w > 0 for w in value)):
            raise ValueError(f"{value} must be non-negative and not all zero")
        return value

    @field_validator("device_inflight")
    @classmethod
    def _device_inflight(cls, value: Any) -> Any:
        if isinstance(value, int) and not 1 <= value <= 32767:
            raise ValueError(f"{value} must be between 1 and 32767 (a semaphore's range)")
        return value

    @field_validator("cache_chunks")
    @classmethod
    def _cache(cls, value: Any) -> Any:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"{value} must be 0 or more")
        return value


def from_ds_config(ds_config: dict[str, Any] | None) -> MLPOffloadConfig | None:
    """The section of a DeepSpeed config dict, validated; None when there is none. Invalid input
    raises `ValueError` naming the key as `mlp_offload.<key>`."""
    if not ds_config or SECTION not in ds_config:
        return None
    section = ds_config[SECTION]
    if not isinstance(section, dict):
        raise ValueError(f"{SECTION}: must be an object with at least 'paths', not {type(section).__name__}")
    try:
        config = MLPOffloadConfig.model_validate(section)
    except ValidationError as e:
        # A union's members tag their errors' locations (`literal['auto']`): only keys and indices name
        # what the user wrote.
        problems = "; ".join(
            f"{SECTION}.{'.'.join(str(p) for p in err['loc'] if not (isinstance(p, str) and '[' in p))}: "
            f"{err['msg']}"
            for err in e.errors()
        )
        raise ValueError(problems) from None
    for key in ("weights", "path_locality"):
        value = getattr(config, key)
        if isinstance(value, list) and len(value) != len(config.paths):
            raise ValueError(f"{SECTION}.{key}: {len(value)} values for {len(config.paths)} paths")
    return config


# DeepSpeed's `aio` keys that mean what ours mean: bytes per request, requests in flight per path.
AIO_KEYS = {"block_size": "chunk_size", "queue_depth": "max_inflight"}
# What DeepSpeed's NVMe offload section keeps when it becomes a CPU offload section: the rest
# (`nvme_path`, `pipeline_read/write`, `fast_init`) is NVMe swapping, which the store replaces.
KEPT_OFFLOAD_KEYS = ("pin_memory", "buffer_count", "ratio")


def migrate_nvme_offload(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The one-line migration: a config with our section and DeepSpeed's own NVMe offload
    (`offload_optimizer.device: "nvme"`) runs as it is. Returns a copy in which the offload section is
    DeepSpeed's CPU offload (CPU Adam on host memory, as the engine needs), our `paths` default to
    `nvme_path`, and DeepSpeed's `aio.block_size` / `queue_depth` become our `chunk_size` /
    `max_inflight` unless ours are set. Other configs are returned unchanged."""
    if not isinstance(ds_config, dict) or not isinstance(ds_config.get(SECTION), dict):
        return ds_config
    offload = (ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    # DeepSpeed's `OffloadDeviceEnum` is a str, but its str() is its name ("OffloadDeviceEnum.nvme").
    device = offload.get("device", "")
    if str(getattr(device, "value", device)).lower() != "nvme":
        return ds_config
    config = copy.deepcopy(ds_config)
    section = config[SECTION]
    if "paths" not in section:
        nvme_path = offload.get("nvme_path")
        if not nvme_path:
            raise ValueError(
                f"{SECTION}.paths: not given, and zero_optimization.offload_optimizer.nvme_path is not "
                "set either"
            )
        section["paths"] = [str(p) for p in nvme_path] if isinstance(nvme_path, list) else [str(nvme_path)]
    for theirs, ours in AIO_KEYS.items():
        if theirs in (config.get("aio") or {}) and ours not in section:
            section[ours] = config["aio"][theirs]
    kept = {k: v for k, v in offload.items() if k in KEPT_OFFLOAD_KEYS}
    config["zero_optimization"]["offload_optimizer"] = {**kept, "device": "cpu"}
    return config
