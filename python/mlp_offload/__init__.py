"""mlp-offload: multi-level, multi-path optimizer-state offload for DeepSpeed ZeRO-3.

The heavy lifting is in the Rust core (`mlp_offload._core`); this package adapts it to torch tensors.
"""

from mlp_offload._core import (
    CorruptObjectError,
    HostBuffer,
    HostBufferPool,
    IoHandle,
    WeightTuner,
    __version__,
    io_uring_unavailable_reason,
    probe_bandwidth,
    probe_directory,
)
from mlp_offload.buffers import PinnedBufferPool, as_tensor, register_with_cuda
from mlp_offload.store import ObjectStore

__all__ = [
    "CorruptObjectError",
    "HostBuffer",
    "HostBufferPool",
    "IoHandle",
    "ObjectStore",
    "PinnedBufferPool",
    "WeightTuner",
    "__version__",
    "as_tensor",
    "io_uring_unavailable_reason",
    "probe_bandwidth",
    "probe_directory",
    "register_with_cuda",
]
