"""mlp-offload: multi-level, multi-path optimizer-state offload for DeepSpeed ZeRO-3.

`mlp_offload.initialize(...)` is `deepspeed.initialize(...)` with the optimizer state of configs that have
an `"mlp_offload"` section in our object store; `mlp_offload.install()` does the same for frameworks that
call `deepspeed.initialize` themselves. The heavy lifting is in the Rust core (`mlp_offload._core`).

The names of the adapter and the engine are imported on first use (PEP 562): every module of the engine
imports the core as `from mlp_offload import _core`, which runs this file first, and must not import the
adapter above it by doing so (`tests/test_layers.py`).
"""

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:  # what mypy and IDEs see: the names below, as if imported here
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

# The names imported on first use, and the module of each.
_LAZY = {
    "initialize": "mlp_offload.adapter.integration",
    "install": "mlp_offload.adapter.integration",
    "PinnedBufferPool": "mlp_offload.engine.buffers",
    "as_tensor": "mlp_offload.engine.buffers",
    "register_with_cuda": "mlp_offload.engine.buffers",
    "ObjectStore": "mlp_offload.engine.store",
}

if not TYPE_CHECKING:  # hidden from mypy, which then reports a name the package lacks instead of typing it

    def __getattr__(name: str) -> Any:
        """A name of `_LAZY`, imported from its module and kept here; any other is an AttributeError."""
        if name not in _LAZY:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
