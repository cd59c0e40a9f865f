"""Type stubs for the native module `mlp_offload._core` (the Rust core's PyO3 bindings)."""

from collections.abc import Callable
from typing import Any, Self, final

__all__ = [
    "AdamGroup",
    "AdamKernel",
    "ChunkArrays",
    "CorruptObjectError",
    "HostBuffer",
    "HostBufferPool",
    "IoHandle",
    "ObjectStore",
    "ReadCheck",
    "StateLayout",
    "WeightTuner",
    "__version__",
    "accelerator_split",
    "block_activity",
    "block_counters",
    "crc32c",
    "io_uring_unavailable_reason",
    "pages_choice",
    "plan_update",
    "probe_bandwidth",
    "probe_directory",
    "probe_shared_path",
]

__version__: str

class CorruptObjectError(OSError):
    """A stored object is not what was written (checksum mismatch, truncated file, failed last write)."""

@final
class IoHandle:
    """An operation in flight."""

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks (GIL released) until done and raises its error; False if `timeout` seconds pass first."""
    def done(self) -> bool:
        """Whether the operation has finished (then `wait()` returns at once)."""

@final
class HostBuffer:
    """Page-aligned host memory owned by the runtime, of small (4 KiB) or huge (2 MiB) `pages`; supports
    the buffer protocol (writable)."""

    def __new__(cls, nbytes: int, lock: bool = False, pages: str = "small") -> Self: ...
    @property
    def page_report(self) -> dict[str, int]:
        """How the buffer's bytes are backed: `bytes`, `reserved_huge_bytes` (`MAP_HUGETLB`),
        `transparent_huge_bytes` (as `/proc/self/smaps` reports them)."""
    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def locked(self) -> bool: ...
    def __len__(self) -> int: ...

@final
class HostBufferPool:
    """A fixed set of equally sized `HostBuffer`s of small (4 KiB) or huge (2 MiB) pages, optionally
    locked in RAM."""

    def __new__(cls, count: int, buffer_size: int, lock: bool = True, pages: str = "small") -> Self: ...
    @property
    def pages(self) -> str:
        """The pages asked for: `"small"` or `"huge"`."""
    @property
    def page_report(self) -> dict[str, int]:
        """How the buffers' bytes are backed: `bytes`, `reserved_huge_bytes` (`MAP_HUGETLB`),
        `transparent_huge_bytes` (as `/proc/self/smaps` reports them)."""
    def acquire(self) -> HostBuffer | None:
        """A free buffer, or None when every buffer is in use."""
    @property
    def buffer_size(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def available(self) -> int: ...
    @property
    def locked(self) -> bool: ...

@final
class StateLayout:
    """How a chunk keeps a state: `master`, `moments` the dtypes DeepSpeed keeps it in (torch's names:
    "float32", "bfloat16", "float16"; each value rounded to them as its CPU Adam stores it),
    `stored_master`, `stored_moments` the dtypes the chunk keeps each array in (None: the same; fp32 may
    hold values of a narrower one), and whether the master weights are the half-precision parameters
    themselves (`master_in_params`: the chunk keeps its moments alone). Checked once here: a
    `ValueError` naming the argument where DeepSpeed keeps no such state."""

    def __new__(
        cls,
        master: str,
        moments: str,
        *,
        stored_master: str | None = None,
        stored_moments: str | None = None,
        master_in_params: bool = False,
    ) -> Self: ...
    @property
    def master(self) -> str: ...
    @property
    def moments(self) -> str: ...
    @property
    def stored_master(self) -> str:
        """The dtype the chunk keeps the master weights in (`master` where none was given)."""
    @property
    def stored_moments(self) -> str:
        """The dtype the chunk keeps the moments in (`moments` where none was given)."""
    @property
    def master_in_params(self) -> bool: ...
    def offsets(self, count: int) -> tuple[list[int], int]:
        """Where a chunk of `count` elements keeps the state: each array's first byte (params, exp_avg,
        exp_avg_sq; the wider arrays first; with `master_in_params` the params' is past the moments),
        and the chunk's bytes."""

@final
class AdamGroup:
    """Adam's hyperparameters of one param group, as DeepSpeed's CPU Adam takes them (`adamw`: its
    `adamw_mode`); made once per param group and step (`engine.fused_update.adam_group`)."""

    def __new__(
        cls,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        bias_correction: bool,
        adamw: bool,
    ) -> Self: ...
    @property
    def lr(self) -> float: ...
    @property
    def beta1(self) -> float: ...
    @property
    def beta2(self) -> float: ...
    @property
    def eps(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def bias_correction(self) -> bool: ...
    @property
    def adamw(self) -> bool: ...

@final
class ChunkArrays:
    """One chunk's addresses and element types for `AdamKernel.update`: `state` its bytes (laid out as
    the update's `StateLayout.offsets` says), `grad` `count` elements of `grad_dtype`, `params` `count`
    of `params_dtype` where the new half-precision parameters go (with `StateLayout.master_in_params`,
    the master weights themselves), if anywhere; `keep_state` room for as many bytes as the state's,
    where the state before the pass is copied; `keep_params`: the parameters before the pass come back
    where they are not the old weights narrowed (needs `params`). Checked once here: a `ValueError`
    naming the argument."""

    def __new__(
        cls,
        state: int,
        grad: int,
        grad_dtype: str,
        count: int,
        *,
        params: int | None = None,
        params_dtype: str | None = None,
        keep_state: int | None = None,
        keep_params: bool = False,
    ) -> Self: ...
    @property
    def state(self) -> int: ...
    @property
    def grad(self) -> int: ...
    @property
    def grad_dtype(self) -> str: ...
    @property
    def count(self) -> int: ...
    @property
    def params(self) -> int | None: ...
    @property
    def params_dtype(self) -> str | None: ...
    @property
    def keep_state(self) -> int | None: ...
    @property
    def keep_params(self) -> bool: ...

@final
class AdamKernel:
    """DeepSpeed's CPU Adam update of one chunk in one pass, with the gradient's widening and unscaling and
    the half-precision copy (see `mlp_offload.engine.fused_update`), keeping DeepSpeed's per-optimizer
    bias state."""

    def __new__(
        cls,
        beta1: float,
        beta2: float,
        *,
        vector_width: int = 16,
        momentum: str = "gradient",
        variance: str = "gradient",
        others: bool = True,
        bias_sqrt: str = "float",
        simd: str = "auto",
    ) -> Self: ...
    @staticmethod
    def candidates() -> list[dict[str, Any]]:
        """Every arithmetic a DeepSpeed build may have, as constructor keywords, the likeliest first."""
    @staticmethod
    def sqrt_witness(beta2: float) -> int | None:
        """The first Adam step (from 3) at which a float and a double square root give another bias
        correction for a call that jumps there, or None."""
    @property
    def simd(self) -> str:
        """The SIMD instructions the pass uses: `"avx512-clmul"`, `"avx512"`, `"avx2-clmul"`, `"avx2"` or
        `"scalar"`."""
    @property
    def arith(self) -> dict[str, Any]:
        """The DeepSpeed arithmetic it matches, as `candidates()` gives it."""
    def witness(
        self,
        other: AdamKernel,
        group: AdamGroup,
        *,
        step: int,
        grad_scale: float,
        master_dtype: str,
        moments_dtype: str,
        seed: int,
        vector: bool = False,
        other_vector: bool = False,
    ) -> tuple[float, float, float, int] | None:
        """One element's inputs `(param, exp_avg, exp_avg_sq, grad_bits)` whose outputs with this
        kernel's arithmetic (its vector code's with `vector`, else its scalar loop's) differ from
        `other`'s at Adam step `step` with `group`'s hyperparameters (the bias state not advanced), the
        state in these dtypes; None if no random element from `seed` does."""
    def constants(self, group: AdamGroup, step: int) -> dict[str, Any]:
        """The per-element constants of a call at Adam step `step` with `group`'s hyperparameters, the
        bias state advanced as `update` advances it: `beta1`, `beta2`, `one_minus_beta1`,
        `one_minus_beta2`, `bias_correction2`, `eps`, `step_size`, `decay` (`"none"`, `"l2"` or
        `"adamw"`) and `decay_value` (Adam's decay or AdamW's `-lr x decay`), as the accelerator's pass
        takes them."""
    def vector_width_for(self, master_dtype: str, moments_dtype: str) -> int:
        """The vector width of the DeepSpeed build it matches for a state in these dtypes (1: every
        element takes the scalar loop)."""
    def update(
        self,
        arrays: ChunkArrays,
        layout: StateLayout,
        group: AdamGroup,
        *,
        step: int,
        grad_scale: float,
        threads: int,
        read_cuts: list[int] | None = None,
        write_cuts: list[int] | None = None,
    ) -> tuple[
        list[int] | None, list[int] | None, list[tuple[int, bytes]] | None, tuple[int | None, int | None]
    ]:
        """One chunk in place at `arrays`' addresses (GIL released), its state laid out as `layout`
        says, with `group`'s hyperparameters, on `threads` threads; the bias correction advances as
        DeepSpeed's would at `step`, the gradient multiplied by `grad_scale` first.
        Returns the state's CRC32C per stripe as read and as written, cut at `read_cuts`/`write_cuts`
        (stripe starts), where given; and with `arrays.keep_params`, the parameters before the pass that
        were not the old weights narrowed, a block at a time: (first element, their bytes). With
        `arrays.keep_state`, the state before the pass is copied there in the pass. Each value is
        rounded to `layout`'s dtypes as DeepSpeed's CPU Adam stores it (`grad` and `params` then of the
        master weights' dtype where that is half precision). With `layout.master_in_params`, `params`
        are the master weights themselves (a `ValueError` naming `params` where none are given), the
        state and the kept state the moments alone, `keep_params` keeps every parameter, and the last
        item is the parameters' CRC32C as read and as written (where the state's were asked for; else
        None)."""

@final
class ObjectStore:
    """The virtual-tier object store over raw addresses (see `mlp_offload.ObjectStore` for tensors)."""

    def __new__(
        cls,
        paths: list[str],
        *,
        rank: int = 0,
        engine: str = "auto",
        chunk_size: int | None = None,
        max_inflight: int | None = None,
        weights: list[float] | None = None,
        checksum: bool = True,
        shadow_slots: bool = True,
        device_inflight: list[int | None] | None = None,
        device_sharing: list[str] | None = None,
    ) -> Self: ...
    def write(
        self,
        key: str,
        address: int,
        nbytes: int,
        owner: object,
        weights: list[float] | None = None,
        sums: tuple[list[int], list[int]] | None = None,
        staged: bool = False,
    ) -> IoHandle:
        """Writes the bytes as `key`; `sums` (stripe starts as `write_cuts` gave them, and each stripe's
        CRC32C) spares the store hashing them, if the split is still that one; `staged` keeps the new
        version beside the current one until `commit` or `discard`."""
    def commit(self, key: str) -> None:
        """Makes the staged version of `key` current."""
    def discard(self, key: str) -> bool:
        """Forgets the staged version of `key`; whether there was one."""
    def add_shadow_slot(self, key: str) -> int:
        """Gives `key` a second slot of its own; the bytes reserved (0 when it had two)."""
    def remove_shadow_slot(self, key: str) -> int | None:
        """Gives back the slot `add_shadow_slot` gave `key`: the bytes (0 with one), None while current
        in slot 1."""
    def read(self, key: str, address: int, nbytes: int, owner: object, verify: bool = True) -> IoHandle:
        """Reads `key` into the bytes; `verify=False` leaves its checksums to the caller (`verify`)."""
    def slots(self, key: str) -> int:
        """How many slots `key` has on disk: 2 where it takes staged writes, else 1."""
    def write_cuts(self, nbytes: int) -> list[int]:
        """Where each stripe of an `nbytes` object written now would start."""
    def read_check(self, key: str) -> ReadCheck:
        """What a read of `key` reads now, for `verify`."""
    def verify(self, check: ReadCheck, sums: list[int]) -> None:
        """Compares a read's stripe sums with the stored ones; `CorruptObjectError` on a mismatch."""
    @property
    def checksum(self) -> bool: ...
    def delete(self, key: str) -> None: ...
    def sync(self) -> None: ...
    def close(self) -> None: ...
    def keys(self) -> list[str]: ...
    def size(self, key: str) -> int | None: ...
    def placement(self, key: str) -> list[tuple[int, int]]: ...
    @property
    def engine(self) -> str: ...
    @property
    def tiers(self) -> list[dict[str, Any]]: ...
    def path_reports(self) -> list[dict[str, Any]]: ...
    @property
    def weights(self) -> list[float]: ...
    @weights.setter
    def weights(self, weights: list[float]) -> None: ...

@final
class ReadCheck:
    """What a read without the store's verification read, for `ObjectStore.verify`."""

    @property
    def starts(self) -> list[int]:
        """Each stripe's first byte in the object, ascending from 0."""
    @property
    def has_sums(self) -> bool:
        """Whether the object has checksums to verify."""

@final
class WeightTuner:
    """Keeps placement weights balanced by the time each path was busy, step by step."""

    def __new__(
        cls, bytes_per_s: list[float], *, smoothing: float = 0.5, tolerance: float = 0.05
    ) -> Self: ...
    @property
    def weights(self) -> list[float]: ...
    @property
    def kept_weights(self) -> list[float]:
        """The weights of the last kept move (the split settled on so far, without a move on trial)."""
    @property
    def estimates(self) -> list[float]: ...
    def observe(self, samples: list[dict[str, Any]], step_secs: float) -> list[float] | None:
        """One step's figures per path (`read_bytes`, `read_busy_secs`, `write_bytes`, `write_busy_secs`,
        `busy_secs`) and the step's time; the new weights when they moved, else None."""
    def interrupted(self) -> list[float]:
        """Steps ran that the tuner did not see (another split, a pause): a move on trial is undone and
        judging starts afresh. The weights to use from here."""

def probe_directory(path: str) -> dict[str, Any]:
    """Alignment, tested O_DIRECT support, device identity, the mount's type and its locality
    (`"node-local"` or `"shared"`) of a directory."""

def probe_shared_path(
    path: str,
    *,
    chunk_size: int,
    max_inflight: int,
    pages: str,
    expected_bytes_per_s: float,
    working_bytes: int,
    steps: int,
    step: Callable[[int], float | None],
    engine: str = "auto",
) -> list[float | None]:
    """One node's part of measuring a directory other nodes share: a probe file of `working_bytes`,
    then per window `step(i)` (the caller's barrier across the nodes, returning the seconds this node
    measures in it, or None) and mixed reads and writes that long. One rate or None per window."""

def probe_bandwidth(
    paths: list[str],
    *,
    bytes: int | None = None,
    sustained_bytes: int | None = None,
    chunk_sizes: list[int] | None = None,
    depths: list[int] | None = None,
    engine: str = "auto",
    together_secs: float | None = None,
    ranks: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Per directory: the best chunk size and in-flight limit of a sweep over `bytes`; at those, read,
    write and mixed read+write bandwidth sustained over `sustained_bytes` until the rate settles; all
    paths at once; and with `ranks` above 1, each device shared by that many streams (at most 4)
    request by request and by turns (`sharing`)."""

def io_uring_unavailable_reason() -> str | None:
    """Why io_uring cannot be used in this process, or None when it can."""

def accelerator_split(inputs: dict[str, Any]) -> dict[str, Any]:
    """Which of a step's chunks the accelerator updates beside the host, and the time predicted.

    `inputs`: `chunk_elements` (in the step's order), `state_bytes_per_element`, `grad_bytes_per_element`,
    `params_h2d_bytes_per_element`, `params_d2h_bytes_per_element`, `host_elements_per_s`,
    `device_elements_per_s`, `h2d_bytes_per_s`, `d2h_bytes_per_s`, `device_slots` (0 to 2: the slots
    the accelerator's memory holds, `accelerator_model.slots_in`), `host_memory_bytes_per_s` (0: not
    limiting), `host_bytes_per_element`, `io_secs`. Returns `device_chunks` (the last ones),
    `device_slots`, `host_secs`, `device_secs`, `memory_secs`, `predicted_secs` and `host_only_secs`. A
    rate that is not a positive number, or more than 2 slots, is a ValueError naming it."""

def plan_update(
    paths: list[dict[str, Any]],
    *,
    subgroups: int,
    read_bytes_per_subgroup: int,
    write_bytes_per_subgroup: int,
    host_bytes_per_subgroup: int,
    host_memory: int,
    pipeline_buffers: int = 3,
    adam_secs_per_subgroup: float = 0.0,
    fwd_bwd_secs: float = 0.0,
    weights: list[float] | None = None,
    param_bytes: int = 0,
) -> dict[str, Any]:
    """The performance model's plan: weights, in-flight limits, cache size, I/O floor, predicted time.

    `paths` holds a dict per path: `device_id`, `read_bytes_per_s`, `write_bytes_per_s`, `best_inflight`,
    and optionally `mixed_bytes_per_s` and `concurrent_bytes_per_s`. `weights`, one per path: plan at
    that split instead of the model's own. `param_bytes`: the parameters kept on the paths (ZeRO-Infinity's),
    read by the forward and the backward (`param_pass_secs` each) and written by the update
    (`param_write_secs`, within `predicted_update_secs`).
    """

def pages_choice(paths: list[dict[str, Any]]) -> str:
    """The host buffers' pages (`"huge"` or `"small"`) that each path's `pages` probe figures call for."""

def block_counters(device_id: str) -> tuple[int, int, int, int, int, int, int, int] | None:
    """Device `major:minor`'s block counters, to pass to `block_activity`; None where it has none."""

def block_activity(
    before: tuple[int, int, int, int, int, int, int, int],
    after: tuple[int, int, int, int, int, int, int, int],
    secs: float,
) -> dict[str, Any]:
    """What reached the device between two `block_counters` readings `secs` apart: bytes and requests per
    direction, mean request sizes, merged shares, mean queue depth, busy share."""

def crc32c(buffer: Any) -> int:
    """The CRC32C of a contiguous buffer-protocol object's bytes (GIL released), as the store keeps it."""
