"""Runtime-owned, page-aligned host memory as torch tensors, registered with CUDA when there is one.

Nothing here calls `Tensor.pin_memory()`, which raises on a CPU-only torch build.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlp_offload import _core
from mlp_offload.engine.memory import PAGE_BYTES


def as_tensor(buffer: _core.HostBuffer, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A 1-D tensor viewing `buffer` without a copy; the buffer lives as long as the tensor."""
    itemsize = dtype.itemsize
    if buffer.nbytes % itemsize:
        raise ValueError(f"dtype: {buffer.nbytes} bytes is not a whole number of {dtype} elements")
    if buffer.nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype)


@dataclass
class MadeBuffers:
    """The bytes of the buffers `page_aligned` made, and of them those the kernel backed with huge pages
    (reserved or transparent) as it made them."""

    bytes: int = 0
    huge_bytes: int = 0


def page_aligned(
    numel: int, dtype: torch.dtype, *, pages: str, made: MadeBuffers | None = None
) -> torch.Tensor:
    """`numel` elements of `dtype` in page-aligned host memory of their own, of `pages` (`"small"` or
    `"huge"`, as `HostBufferPool`'s): the store reads and writes it with O_DIRECT (memory it cannot hand
    to O_DIRECT, as torch's allocator's 64-byte aligned memory, goes through the page cache), in requests
    as large as its pages are contiguous. Counted in `made`, where given."""
    nbytes = numel * dtype.itemsize
    rounded = max(PAGE_BYTES, -(-nbytes // PAGE_BYTES) * PAGE_BYTES)
    buffer = _core.HostBuffer(rounded, pages=pages)
    if made is not None:
        report = buffer.page_report
        made.bytes += report["bytes"]
        made.huge_bytes += report["reserved_huge_bytes"] + report["transparent_huge_bytes"]
    return as_tensor(buffer, dtype)[:numel]


def register_with_cuda(address: int, nbytes: int) -> bool:
    """Page-locks and registers host memory with CUDA so copies run at pinned speed. False without CUDA."""
    if not torch.cuda.is_available() or nbytes == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    if int(err) != 0:
        raise OSError(f"cudaHostRegister of {nbytes} bytes at {address:#x} failed with CUDA error {int(err)}")
    return True


def unregister_from_cuda(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def _unregister_all(memory: object, addresses: Sequence[int]) -> None:
    """Unregisters a pool's buffers; `memory` (the pool's core object) is held until then, so the
    memory is still there while CUDA lets go of it."""
    for address in addresses:
        unregister_from_cuda(address)


class PinnedBufferPool:
    """A fixed pool of equally sized host buffers of 4 KiB or huge `pages` (`"small"`, `"huge"`); with
    `lock` (DeepSpeed's `pin_memory`), locked in RAM and registered with CUDA when present.

    `acquire` gives a `HostBuffer` (view it with `as_tensor`); it returns to the pool when the buffer
    and every tensor viewing it are gone. The CUDA registration ends at `close()`, or when the pool is
    collected without one (an engine never destroyed), before its memory is freed.
    """

    def __init__(self, count: int, buffer_size: int, *, lock: bool = True, pages: str = "small") -> None:
        self._pool = _core.HostBufferPool(count, buffer_size, lock=lock, pages=pages)
        every = [self._pool.acquire() for _ in range(count)]
        self._addresses = [b.address for b in every if b is not None]
        self.cuda_registered = False
        if lock:
            for address in self._addresses:
                self.cuda_registered = register_with_cuda(address, buffer_size)
        del every
        self._unregister = weakref.finalize(self, _unregister_all, self._pool, self._addresses)
        if not self.cuda_registered:
            self._unregister.detach()

    def acquire(self) -> _core.HostBuffer | None:
        return self._pool.acquire()

    @property
    def buffer_size(self) -> int:
        return self._pool.buffer_size

    @property
    def count(self) -> int:
        return self._pool.count

    @property
    def available(self) -> int:
        return self._pool.available

    @property
    def locked(self) -> bool:
        return self._pool.locked

    @property
    def pages(self) -> str:
        return self._pool.pages

    @property
    def page_report(self) -> dict[str, int]:
        return self._pool.page_report

    def close(self) -> None:
        """Unregisters the buffers from CUDA; the memory itself goes when the pool object does."""
        self._unregister()
        self.cuda_registered = False
