"""Runtime-owned host buffers: page-aligned, viewed by torch without a copy, pooled, CUDA-registered."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

import mlp_offload


@pytest.mark.parametrize(
    ("nbytes", "dtype"),
    [(4096, torch.uint8), (12_288, torch.float32), (10, torch.bfloat16), (1 << 20, torch.float16)],
)
def test_host_buffer_is_aligned_and_shared_with_torch(nbytes: int, dtype: torch.dtype) -> None:
    buf = mlp_offload.HostBuffer(nbytes)
    assert buf.address % 4096 == 0 and buf.nbytes == nbytes == len(buf)
    view = mlp_offload.as_tensor(buf, dtype)
    assert view.data_ptr() == buf.address
    view.fill_(1)
    # The write through torch is visible through the buffer protocol (read here as an independent copy).
    # (typeshed spells the buffer protocol `__buffer__`, which Python 3.11's C slots do not declare)
    copy = torch.frombuffer(bytearray(memoryview(buf)), dtype=torch.uint8)  # type: ignore[arg-type]
    assert torch.equal(copy, torch.ones_like(view).view(torch.uint8))


def test_tensor_keeps_buffer_alive() -> None:
    """A tensor viewing a buffer holds a reference to it for as long as the tensor lives, and only so long
    (the buffer's reference count says so: freed memory that is still mapped would not)."""
    buf = mlp_offload.HostBuffer(1 << 16)
    alone = sys.getrefcount(buf)
    view = mlp_offload.as_tensor(buf, torch.float32)
    gc.collect()
    assert sys.getrefcount(buf) == alone + 1, "the view holds the buffer"
    view.fill_(3.0)
    assert float(view.sum()) == 3.0 * view.numel()
    del view
    gc.collect()
    assert sys.getrefcount(buf) == alone, "the view let the buffer go with it"


def test_pool_recycles_buffers_when_views_die() -> None:
    pool = mlp_offload.PinnedBufferPool(2, 1 << 16)
    assert pool.available == 2 and pool.count == 2
    a = pool.acquire()
    assert a is not None
    view = mlp_offload.as_tensor(a)
    b = pool.acquire()
    assert pool.acquire() is None and pool.available == 0
    del a
    gc.collect()
    assert pool.available == 0, "a live tensor view keeps its buffer out of the pool"
    del view, b
    gc.collect()
    assert pool.available == 2
    pool.close()


def test_dtype_must_divide_the_buffer() -> None:
    with pytest.raises(ValueError, match="dtype"):
        mlp_offload.as_tensor(mlp_offload.HostBuffer(6), torch.float32)


class FakeCudart:
    """Records cudaHostRegister/Unregister calls (this machine has no CUDA)."""

    def __init__(self) -> None:
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.registered.append(address)
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0


@pytest.mark.parametrize(
    ("pin_memory", "closed"),
    [(True, True), (True, False), (False, True)],
    ids=["pinned, closed", "pinned, dropped without close", "not pinned"],
)
def test_cuda_registration_follows_pin_memory_and_ends_with_the_pool(
    monkeypatch: pytest.MonkeyPatch, pin_memory: bool, closed: bool
) -> None:
    """Registered with CUDA only when pinned (DeepSpeed's `pin_memory`), and unregistered exactly once:
    at close, or when a pool nobody closed is collected (an engine never destroyed, as the Trainer's)."""
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    pool = mlp_offload.PinnedBufferPool(3, 1 << 16, lock=pin_memory)
    expected = 3 if pin_memory else 0
    assert len(cudart.registered) == expected and pool.cuda_registered == pin_memory
    if closed:
        pool.close()
        pool.close()
    del pool
    gc.collect()
    assert sorted(cudart.unregistered) == sorted(cudart.registered)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pool_is_registered_with_cuda_and_copies_round_trip() -> None:
    pool = mlp_offload.PinnedBufferPool(2, 64 << 20)
    assert pool.cuda_registered
    buf = pool.acquire()
    assert buf is not None
    host = mlp_offload.as_tensor(buf, torch.float32)
    host.copy_(torch.arange(host.numel(), dtype=torch.float32))
    dev = host.to("cuda", non_blocking=True)
    back = mlp_offload.as_tensor(mlp_offload.HostBuffer(buf.nbytes), torch.float32)
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, host)
    del host, buf
    pool.close()


# pages asked for, buffer size, whether huge pages may back it
PAGES = [
    ("small", 4 << 20, False),
    ("huge", 4 << 20, True),
    # Smaller than a huge page: 4 KiB pages whatever was asked.
    ("huge", 1 << 20, False),
]


@pytest.mark.parametrize(("pages", "size", "may_be_huge"), PAGES)
def test_pool_pages_are_reported_as_the_kernel_backed_them(pages: str, size: int, may_be_huge: bool) -> None:
    pool = mlp_offload.PinnedBufferPool(2, size, lock=False, pages=pages)
    report = pool.page_report
    assert pool.pages == pages and report["bytes"] == 2 * size
    huge = report["reserved_huge_bytes"] + report["transparent_huge_bytes"]
    assert huge <= report["bytes"]
    if not may_be_huge:
        assert huge == 0, report
    elif "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        # Where the kernel gives transparent huge pages at all, 8 MiB of unfragmented memory gets some.
        assert huge > 0, report
    buf = pool.acquire()
    assert buf is not None
    view = mlp_offload.as_tensor(buf, torch.float32)
    assert view.abs().sum() == 0  # zeroed
    view.fill_(1.0)
    assert view.sum() == view.numel()
    del view, buf
    pool.close()


@pytest.mark.parametrize(("pages", "size", "may_be_huge"), PAGES)
def test_a_buffers_pages_are_reported_as_the_kernel_backed_them(
    pages: str, size: int, may_be_huge: bool
) -> None:
    """A buffer of its own (the parameters' partitions on NVMe take these) gets the pages asked for, as
    a pool's buffers do."""
    report = mlp_offload.HostBuffer(size, pages=pages).page_report
    huge = report["reserved_huge_bytes"] + report["transparent_huge_bytes"]
    assert report["bytes"] == size and huge <= size
    if not may_be_huge:
        assert huge == 0, report
    elif "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        assert huge > 0, report


def test_unknown_pages_are_named() -> None:
    with pytest.raises(ValueError, match=r"pages.*'large'|pages.*\"large\""):
        mlp_offload.PinnedBufferPool(1, 1 << 20, pages="large")
    with pytest.raises(ValueError, match=r"pages.*'large'|pages.*\"large\""):
        mlp_offload.HostBuffer(1 << 20, pages="large")
