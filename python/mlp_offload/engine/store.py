"""The object store at the level of tensors: any contiguous CPU tensor, `HostBuffer` or buffer-protocol
object can be written from or read into, without a copy."""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from os import PathLike
from typing import Any

import numpy as np
import torch

from mlp_offload import _core


def memory_of(obj: Any, *, writable: bool) -> tuple[int, int, Any]:
    """`(address, nbytes, owner)` of a contiguous host buffer; `owner` keeps the memory alive."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise ValueError(f"buffer: tensor is on {obj.device}, not in host memory")
        if not obj.is_contiguous():
            raise ValueError("buffer: tensor is not contiguous")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj
    if isinstance(obj, _core.HostBuffer):
        return obj.address, obj.nbytes, obj
    try:
        array = np.frombuffer(obj, dtype=np.uint8)
    except (TypeError, ValueError) as e:
        raise ValueError(f"buffer: {type(obj).__name__} is not a contiguous buffer ({e})") from None
    if writable and not array.flags.writeable:
        raise ValueError(f"buffer: {type(obj).__name__} is read-only and cannot be read into")
    return array.ctypes.data, array.nbytes, array


class ObjectStore:
    """Named objects on one or more storage paths, each placed on one path or striped across several.

    `device_inflight` (one per path, `None` for none) is the node-wide limit of requests in flight on
    each path's device, shared by every store of this user on the node on that device (node-wide
    admission, see the Rust crate's `admission` module); `device_sharing` (one per path, `"shared"` by
    default, or `"turns"`) says how.

    `write` and `read` return an `IoHandle` at once; `handle.wait()` blocks (without the GIL) and raises
    `OSError` (with `errno` and `filename`) on failure, `CorruptObjectError` on a checksum mismatch.
    The buffer must not be modified (write) or used (read) until the handle is done; it is kept alive
    until then. A read issued after a write of the same object sees that write.
    """

    def __init__(
        self,
        paths: Sequence[str | PathLike[str]],
        *,
        rank: int = 0,
        engine: str = "auto",
        chunk_size: int | None = None,
        max_inflight: int | None = None,
        weights: Sequence[float] | None = None,
        checksum: bool = True,
        shadow_slots: bool = True,
        device_inflight: Sequence[int | None] | None = None,
        device_sharing: Sequence[str] | None = None,
    ) -> None:
        def open_store() -> _core.ObjectStore:
            return _core.ObjectStore(
                [str(p) for p in paths],
                rank=rank,
                engine=engine,
                chunk_size=chunk_size,
                max_inflight=max_inflight,
                weights=list(weights) if weights is not None else None,
                checksum=checksum,
                shadow_slots=shadow_slots,
                device_inflight=list(device_inflight) if device_inflight is not None else None,
                device_sharing=list(device_sharing) if device_sharing is not None else None,
            )

        try:
            self._store = open_store()
        except BlockingIOError as e:
            # The rank directory is locked by a store of this process that nothing references any more
            # (an engine dropped without destroy(), in a reference cycle): collect it, then try once more.
            if f"process {os.getpid()} " not in str(e):
                raise
            gc.collect()
            self._store = open_store()

    def write(
        self,
        key: str,
        src: Any,
        *,
        weights: Sequence[float] | None = None,
        sums: tuple[list[int], list[int]] | None = None,
        staged: bool = False,
    ) -> _core.IoHandle:
        """Writes `src` as object `key` (created on first write, placed by `weights`). `sums`: each
        stripe's CRC32C of `src`, cut where `write_cuts` said, computed by the caller (the fused update
        computes them as it writes the bytes); the store then does not hash them again. `staged`: the new
        version lands beside the current one, which reads go on seeing, until `commit(key)` makes it
        current or `discard(key)` forgets it (needs a current version, and shadow slots or a slot added by
        `add_shadow_slot`)."""
        address, nbytes, owner = memory_of(src, writable=False)
        weights = list(weights) if weights else None
        return self._store.write(key, address, nbytes, owner, weights, sums, staged)

    def commit(self, key: str) -> None:
        """Makes the staged version of `key` current once its write has completed (no I/O); ValueError
        naming the key when there is none."""
        self._store.commit(key)

    def discard(self, key: str) -> bool:
        """Forgets the staged version of `key` once its write has completed; whether there was one."""
        return self._store.discard(key)

    def add_shadow_slot(self, key: str) -> int:
        """Gives `key` a second slot on disk of its own, its blocks reserved now, so it takes staged
        writes in a store with `shadow_slots=False` (and from then on alternates between its two slots);
        the bytes reserved, 0 when it had two. `OSError` (ENOSPC) naming the file when a path is full,
        the object as it was."""
        return self._store.add_shadow_slot(key)

    def remove_shadow_slot(self, key: str) -> int | None:
        """Gives back the second slot `add_shadow_slot` gave `key`: it goes back to one slot, written in
        place, and the slot's blocks go back to the file system; the bytes given back, 0 when it had one
        slot. Only while its current version is in slot 0: None, and nothing changes, while it is in
        slot 1 (its next write goes to slot 0). The manifest forgets the slot first, durably.
        `ValueError` naming the key while a staged version waits (commit or discard it first), and in a
        store with `shadow_slots`, whose every object keeps two."""
        return self._store.remove_shadow_slot(key)

    def slots(self, key: str) -> int:
        """How many slots `key` has on disk: 2 where it takes staged writes (every object with
        `shadow_slots`, else those `add_shadow_slot` gave one, also in an earlier process), else 1.
        `FileNotFoundError` naming the key when there is no such object."""
        return self._store.slots(key)

    def read(self, key: str, dst: Any, *, verify: bool = True) -> _core.IoHandle:
        """Reads object `key` into `dst`, which must have exactly the object's size in bytes. With
        `verify=False` the store does not check its checksums: the caller hashes what it read and calls
        `verify(read_check(key), sums)` before trusting anything made of it."""
        address, nbytes, owner = memory_of(dst, writable=True)
        return self._store.read(key, address, nbytes, owner, verify)

    def write_cuts(self, nbytes: int) -> list[int]:
        """Where each stripe of an `nbytes` object written now would start (the current split)."""
        return self._store.write_cuts(nbytes)

    def read_check(self, key: str) -> _core.ReadCheck:
        """What a read of `key` reads now (`starts`: where to cut its sums), for `verify`."""
        return self._store.read_check(key)

    def verify(self, check: _core.ReadCheck, sums: list[int]) -> None:
        """Raises `CorruptObjectError`, naming the stripe's file, where the caller's `sums` of what it read
        differ from the stored ones."""
        self._store.verify(check, sums)

    @property
    def checksum(self) -> bool:
        """Whether a CRC32C of every stripe is kept and checked."""
        return self._store.checksum

    def delete(self, key: str) -> None:
        self._store.delete(key)

    def size(self, key: str) -> int | None:
        return self._store.size(key)

    def keys(self) -> list[str]:
        return self._store.keys()

    def placement(self, key: str) -> list[tuple[int, int]]:
        return self._store.placement(key)

    def sync(self) -> None:
        self._store.sync()

    def close(self) -> None:
        self._store.close()

    @property
    def engine(self) -> str:
        return self._store.engine

    @property
    def tiers(self) -> list[dict[str, Any]]:
        return self._store.tiers

    def path_reports(self) -> list[dict[str, Any]]:
        return self._store.path_reports()

    @property
    def weights(self) -> list[float]:
        """The split of the next write; assigning moves each object to it on the object's next write."""
        return self._store.weights

    @weights.setter
    def weights(self, weights: Sequence[float]) -> None:
        self._store.weights = list(weights)

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
