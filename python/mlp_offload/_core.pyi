"""Type stubs for the native module `mlp_offload._core` (the Rust core's PyO3 bindings)."""

from collections.abc import Callable
from typing import Any, Self, final

__all__ = [
    "CorruptObjectError",
    "HostBuffer",
    "HostBufferPool",
    "IoHandle",
    "ObjectStore",
    "WeightTuner",
    "__version__",
    "block_activity",
    "block_counters",
    "io_uring_unavailable_reason",
    "pages_choice",
    "plan_update",
    "probe_bandwidth",
    "probe_directory",
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
    """Page-aligned host memory owned by the runtime; supports the buffer protocol (writable)."""

    def __new__(cls, nbytes: int, lock: bool = False) -> Self: ...
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
        self, key: str, address: int, nbytes: int, owner: object, weights: list[float] | None = None
    ) -> IoHandle: ...
    def read(self, key: str, address: int, nbytes: int, owner: object) -> IoHandle: ...
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
    """Alignment, tested O_DIRECT support and device identity of a directory."""

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
) -> dict[str, Any]:
    """The performance model's plan: weights, in-flight limits, cache size, I/O floor, predicted time.

    `paths` holds a dict per path: `device_id`, `read_bytes_per_s`, `write_bytes_per_s`, `best_inflight`,
    and optionally `mixed_bytes_per_s` and `concurrent_bytes_per_s`. `weights`, one per path: plan at
    that split instead of the model's own.
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
