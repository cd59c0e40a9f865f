"""mlp-offload: multi-level, multi-path optimizer-state offload for DeepSpeed ZeRO-3.

`mlp_offload.initialize(...)` is `deepspeed.initialize(...)` with the optimizer state of configs that have
an `"mlp_offload"` section in our object store; `mlp_offload.install()` does the same for frameworks that
call `deepspeed.initialize` themselves. The heavy lifting is in the Rust core (`mlp_offload._core`).
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
from mlp_offload.adapter.integration import initialize, install
from mlp_offload.engine.buffers import PinnedBufferPool, as_tensor, register_with_cuda
from mlp_offload.engine.store import ObjectStore

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
    "initialize",
    "install",
    "io_uring_unavailable_reason",
    "probe_bandwidth",
    "probe_directory",
    "register_with_cuda",
]
