"""The tensor-level object store, through the bindings, against real files and both engines."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import mlp_offload
from mlp_offload import CorruptObjectError, ObjectStore
from mlp_offload.adapter.troubleshooting import met

SIZES = [1, 511, 4096, 4097, 65_543, (1 << 20) + 3, 5 << 20]


def random_tensor(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("n_paths", [1, 3])
@pytest.mark.parametrize("nbytes", SIZES)
def test_round_trip_through_tensors_and_host_buffers(
    engine: str, work_dirs: list[Path], n_paths: int, nbytes: int
) -> None:
    with ObjectStore(work_dirs[:n_paths], engine=engine, chunk_size=1 << 16) as store:
        assert store.engine == engine
        data = random_tensor(nbytes, nbytes)
        # A plain torch tensor (64-byte aligned: the buffered path) ...
        store.write("plain", data).wait()
        back = torch.empty_like(data)
        store.read("plain", back).wait()
        assert torch.equal(back, data)
        # ... and runtime-owned page-aligned memory (the O_DIRECT path), viewed without a copy.
        buf = mlp_offload.HostBuffer(nbytes)
        view = mlp_offload.as_tensor(buf)
        view.copy_(data)
        store.write("aligned", buf).wait()
        out = mlp_offload.HostBuffer(nbytes)
        store.read("aligned", out).wait()
        assert torch.equal(mlp_offload.as_tensor(out), data)
        # Other dtypes and buffer-protocol objects.
        floats = torch.randn(max(nbytes // 4, 1), generator=torch.Generator().manual_seed(1))
        store.write("floats", floats).wait()
        arr = np.empty(floats.numel(), dtype=np.float32)
        store.read("floats", arr).wait()
        assert np.array_equal(arr, floats.numpy())


def test_a_staged_version_waits_for_commit_or_discard(engine: str, work_dirs: list[Path]) -> None:
    """Through the bindings: reads see the current version until `commit`; `discard` keeps it; a store
    without shadow slots stages an object given a second slot; each refusal names the key (the Rust
    tests cover the rest)."""
    versions = [random_tensor(65_543, seed) for seed in range(3)]
    with ObjectStore(work_dirs[:2], engine=engine, chunk_size=1 << 16) as store:
        store.write("obj", versions[0]).wait()
        store.write("obj", versions[1], staged=True).wait()
        back = torch.empty_like(versions[0])
        store.read("obj", back).wait()
        assert torch.equal(back, versions[0])
        store.commit("obj")
        store.read("obj", back).wait()
        assert torch.equal(back, versions[1])
        with pytest.raises(ValueError, match='commit: object "obj" has no staged version'):
            store.commit("obj")
        store.write("obj", versions[2], staged=True)
        assert store.discard("obj") and not store.discard("obj")
        store.read("obj", back).wait()
        assert torch.equal(back, versions[1])
        with pytest.raises(FileNotFoundError, match="new"):
            store.write("new", versions[0], staged=True)
    # Without shadow slots, an object stages once it has a second slot of its own.
    with ObjectStore(work_dirs[2:3], engine=engine, shadow_slots=False) as store:
        store.write("one", versions[0]).wait()
        with pytest.raises(ValueError, match='shadow_slots: object "one"'):
            store.write("one", versions[1], staged=True)
        assert store.slots("one") == 1
        assert store.add_shadow_slot("one") >= versions[0].numel() * versions[0].element_size()
        assert store.add_shadow_slot("one") == 0
        assert store.slots("one") == 2
        store.write("one", versions[1], staged=True).wait()
        store.commit("one")
        store.read("one", back).wait()
        assert torch.equal(back, versions[1])
        # Given back once the current version is in slot 0: after the commit it is in slot 1.
        added = store.add_shadow_slot("one") or versions[0].numel() * versions[0].element_size()
        assert store.remove_shadow_slot("one") is None and store.slots("one") == 2
        store.write("one", versions[2], staged=True).wait()
        with pytest.raises(ValueError, match='remove_shadow_slot: object "one" has a staged version'):
            store.remove_shadow_slot("one")
        store.commit("one")
        given = store.remove_shadow_slot("one")
        assert given is not None and given >= added and store.slots("one") == 1
        assert store.remove_shadow_slot("one") == 0
        store.read("one", back).wait()
        assert torch.equal(back, versions[2])
        for call in (store.add_shadow_slot, store.remove_shadow_slot, store.slots):
            with pytest.raises(FileNotFoundError, match="absent"):
                call("absent")
    (work_dirs[2] / "shadow").mkdir()
    with ObjectStore([work_dirs[2] / "shadow"], engine=engine) as store:
        store.write("two", versions[0]).wait()
        with pytest.raises(ValueError, match=r'shadow_slots: object "two".*shadow slots on'):
            store.remove_shadow_slot("two")


def test_errors_are_oserror_with_errno_and_path_or_valueerror(engine: str, work_dirs: list[Path]) -> None:
    missing = work_dirs[0] / "missing"
    with pytest.raises(FileNotFoundError) as e:
        ObjectStore([missing], engine=engine)
    assert e.value.errno == errno.ENOENT and e.value.filename == str(missing)

    cases = [
        (dict(engine="fast"), "engine"),
        (dict(weights=[1.0, 2.0]), "weights"),
        (dict(chunk_size=1000), "chunk_size"),
        (dict(max_inflight=0), "max_inflight"),
    ]
    for kwargs, key in cases:
        with pytest.raises(ValueError, match=key):
            ObjectStore(work_dirs[:1], **kwargs)  # type: ignore[arg-type]

    with ObjectStore(work_dirs[:1], engine=engine) as store:
        with pytest.raises(ValueError, match="key"):
            store.write("../../etc/passwd", torch.zeros(4))
        with pytest.raises(FileNotFoundError):
            store.read("absent", torch.zeros(4))
        store.write("four", torch.zeros(4)).wait()
        with pytest.raises(ValueError, match="buffer"):
            store.read("four", torch.zeros(5))
        with pytest.raises(ValueError, match="read-only"):
            store.read("four", b"0123456789abcdef")
        with pytest.raises(ValueError, match="contiguous"):
            store.write("strided", torch.zeros(4, 4).t())


def flip_a_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[777] ^= 0x5A
    path.write_bytes(bytes(raw))


def truncate(path: Path) -> None:
    os.truncate(path, 100_000)


# name, what happens to the object's file, what the error says
DAMAGE = [
    ("a flipped byte", flip_a_byte, "checksum mismatch"),
    ("a truncated file", truncate, "the file is truncated"),
]


@pytest.mark.parametrize(("damage", "says"), [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_a_damaged_object_raises_corrupt_object_error(
    engine: str, work_dirs: list[Path], damage: Callable[[Path], None], says: str
) -> None:
    """Damage found on the next read, after a reopen: EIO naming the object and its file, never data."""
    data = random_tensor(100_000 * 3, 3)
    with ObjectStore(work_dirs[:1], engine=engine, shadow_slots=False) as store:
        store.write("x", data).wait()
    path = work_dirs[0] / "rank0" / "x.mlpo"
    damage(path)
    with ObjectStore(work_dirs[:1], engine=engine, shadow_slots=False) as store:
        with pytest.raises(CorruptObjectError) as e:
            store.read("x", torch.empty_like(data)).wait()
    assert isinstance(e.value, OSError) and e.value.errno == errno.EIO
    assert e.value.filename == str(path) and says in str(e.value) and '"x"' in str(e.value)
    assert met("corrupt", str(e.value)), e.value


def test_out_of_space_names_the_path_and_keeps_other_objects(engine: str, small_tmpfs: Path) -> None:
    with ObjectStore([small_tmpfs], engine=engine) as store:
        old = random_tensor(200_000, 4)
        store.write("kept", old).wait()
        with pytest.raises(OSError) as e:
            store.write("too-big", torch.zeros(4 << 20, dtype=torch.uint8))
        assert e.value.errno == errno.ENOSPC and "too-big.mlpo" in e.value.filename
        assert met("enospc", str(e.value)), e.value
        back = torch.empty_like(old)
        store.read("kept", back).wait()
        assert torch.equal(back, old)


def test_reopen_and_telemetry(engine: str, work_dirs: list[Path]) -> None:
    data = random_tensor(3 << 20, 5)
    with ObjectStore(work_dirs[:2], engine=engine, weights=[2, 1]) as store:
        store.write("sg0.exp_avg", data).wait()
        (a, na), (b, nb) = store.placement("sg0.exp_avg")
        assert (a, b) == (0, 1) and na + nb == data.numel() and na > nb
        reports = store.path_reports()
        assert sum(r["stats"]["bytes_written"] for r in reports) >= data.numel()
        assert all(r["engine"] == engine for r in reports)
    for p in work_dirs[:2]:
        assert oct(os.stat(p / "rank0").st_mode & 0o777) == "0o700"
        assert oct(os.stat(p / "rank0" / "sg0.exp_avg.mlpo").st_mode & 0o777) == "0o600"
    with ObjectStore(work_dirs[:2], engine=engine) as store:
        assert store.keys() == ["sg0.exp_avg"] and store.size("sg0.exp_avg") == data.numel()
        back = torch.empty_like(data)
        store.read("sg0.exp_avg", back).wait()
        assert torch.equal(back, data)


def test_new_weights_move_objects_and_the_tuner_follows_measured_bandwidth(
    engine: str, work_dirs: list[Path]
) -> None:
    data = random_tensor(4 << 20, 6)
    with ObjectStore(work_dirs[:2], engine=engine) as store:
        store.write("sg", data).wait()
        reports = store.path_reports()
        assert all(r["stats"]["busy_ns"] > 0 for r in reports), "busy time is counted per path"
        # Only a write so far: the write clock ran, the read clock did not.
        assert all(r["stats"]["write_busy_ns"] > 0 and r["stats"]["read_busy_ns"] == 0 for r in reports)
        tuner = mlp_offload.WeightTuner([1000.0, 1000.0])
        # Path 1 took four times as long as path 0 for the same bytes, twice (a move is compared with
        # two steps): share moves to path 0, by the tuner's first step (5% of each weight), and the
        # object follows.
        per_path: list[dict[str, Any]] = [
            {
                "read_bytes": 2000,
                "read_busy_secs": 0.25,
                "write_bytes": 2000,
                "write_busy_secs": 0.25,
                "busy_secs": 0.5,
            },
            {
                "read_bytes": 2000,
                "read_busy_secs": 1,
                "write_bytes": 2000,
                "write_busy_secs": 1,
                "busy_secs": 2,
            },
        ]
        assert tuner.observe(per_path, 2.0) is None
        new = tuner.observe(per_path, 2.0)
        assert new is not None and new == pytest.approx([0.525, 0.475])
        store.weights = new
        assert store.weights == pytest.approx(new)
        store.write("sg", data).wait()
        (_, on_0), (_, on_1) = store.placement("sg")
        assert on_0 / (on_0 + on_1) == pytest.approx(new[0], abs=0.01)
        back = torch.empty_like(data)
        store.read("sg", back).wait()
        assert torch.equal(back, data)
        with pytest.raises(ValueError, match=r"^weights:"):
            store.weights = [1.0]
    # The move was on trial: steps the tuner did not see undo it.
    assert tuner.interrupted() == pytest.approx([0.5, 0.5])
    with pytest.raises(ValueError, match=r"^samples:"):
        tuner.observe([{"read_bytes": 1}], 1.0)
    with pytest.raises(ValueError, match=r"^smoothing:"):
        mlp_offload.WeightTuner([1.0], smoothing=0.0)


def test_a_closed_store_says_so(work_dirs: list[Path]) -> None:
    store = ObjectStore(work_dirs[:1])
    store.close()
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.keys()


def test_handles_poll_and_time_out(engine: str, work_dirs: list[Path]) -> None:
    with ObjectStore(work_dirs[:1], engine=engine) as store:
        h = store.write("p", torch.zeros(1 << 20, dtype=torch.uint8))
        assert h.wait(timeout=60.0) is True
        assert h.done()
        with pytest.raises(ValueError, match="timeout"):
            h.wait(timeout=-1.0)


def test_buffers_outlive_the_callers_reference(engine: str, work_dirs: list[Path]) -> None:
    """The store holds the source while the kernel writes it, the caller's reference dropped, and lets it
    go once the write is done (a weak reference to it says so: freed memory that is still mapped would
    read back right too). 64 MiB: the write cannot be done before `write` returns."""
    with ObjectStore(work_dirs[:1], engine=engine) as store:
        expected = random_tensor(64 << 20, 6)
        source = expected.clone()
        alive = weakref.ref(source)
        handle = store.write("big", source)
        del source
        assert alive() is not None, "the store holds the source while its write is in flight"
        handle.wait()
        gc.collect()
        assert alive() is None, "the store let the source go once its write was done"
        back = torch.empty_like(expected)
        store.read("big", back).wait()
        assert torch.equal(back, expected)


CRASH_SCRIPT = """
import os, sys, torch
from mlp_offload import ObjectStore
paths = sys.argv[1:]
with ObjectStore(paths, engine=os.environ["ENGINE"]) as store:
    for key in ("k0", "k1", "k2"):
        store.write(key, torch.full((70_000,), 7, dtype=torch.uint8)).wait()
store = ObjectStore(paths, engine=os.environ["ENGINE"])
{crash}
os._exit(0)  # a crash: no close, no sync, the lock left to the kernel
"""

# What a process did before it died, and the keys a store reopened afterwards holds.
CRASHES = [
    ("a delete", "store.delete('k1')", ["k0", "k2"]),
    (
        "a new object never synced",
        "store.write('k3', torch.ones(5000, dtype=torch.uint8)).wait()",
        ["k0", "k1", "k2"],
    ),
    ("a rewrite in flight", "store.write('k0', torch.zeros(70_000, dtype=torch.uint8))", ["k0", "k1", "k2"]),
    ("nothing: it held the store open", "pass", ["k0", "k1", "k2"]),
]


@pytest.mark.parametrize(("what", "crash", "keys"), CRASHES, ids=[c[0] for c in CRASHES])
def test_a_crash_leaves_a_store_that_opens(
    engine: str, work_dirs: list[Path], what: str, crash: str, keys: list[str]
) -> None:
    """A process killed in the middle of its work (os._exit: no close, no sync, no unlock) leaves a store
    the next process opens: its lock released by the kernel, deletes already in the manifest, files
    no manifest knows removed, every object it lists readable or refused by name."""
    paths = [str(p) for p in work_dirs[:2]]
    script = CRASH_SCRIPT.format(crash=crash)
    subprocess.run([sys.executable, "-c", script, *paths], check=True, env={**os.environ, "ENGINE": engine})
    with ObjectStore(paths, engine=engine) as store:
        assert sorted(store.keys()) == keys
        for key in keys:
            back = torch.empty(store.size(key) or 0, dtype=torch.uint8)
            try:
                store.read(key, back).wait()
            except CorruptObjectError as e:
                # Only the object whose rewrite the crash cut short may be refused, and by name.
                assert what == "a rewrite in flight" and key == "k0" and "k0" in str(e), e
                continue
            assert back.numel() == 70_000 and int(back[0]) in (0, 7)
        known = {f"{k}.mlpo" for k in keys}
        for path in work_dirs[:2]:
            assert {f.name for f in (path / "rank0").glob("*.mlpo")} <= known


def test_a_second_store_on_the_same_directory_is_refused_naming_the_holder(work_dirs: list[Path]) -> None:
    """Two stores on one rank directory would overwrite each other's objects: the second one is
    refused with the path and the holder's pid, in this process or another; another rank is another
    directory; closing releases it."""
    paths = work_dirs[:2]
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from mlp_offload import ObjectStore; s = ObjectStore(sys.argv[1:]);"
            " print('open', flush=True); sys.stdin.read()",
            *map(str, paths),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(BlockingIOError) as e:
            ObjectStore(paths)
        assert e.value.errno == errno.EWOULDBLOCK and e.value.filename == str(paths[0] / "rank0")
        assert f"process {holder.pid} " in str(e.value) and met("in-use", str(e.value)), e.value
        ObjectStore(paths, rank=1).close()
    finally:
        holder.communicate("")
    with ObjectStore(paths) as first:
        with pytest.raises(BlockingIOError, match=f"process {os.getpid()} "):
            ObjectStore(paths)
        first.write("k", torch.ones(10, dtype=torch.uint8)).wait()
    ObjectStore(paths).close()


# A store whose paths are gone when its process exits, with reads still in flight: its closing sync fails
# after the interpreter may have shut down, on one of the store's own threads.
EXIT_SCRIPT = """
import shutil, sys, torch
from mlp_offload import ObjectStore
store = ObjectStore([sys.argv[1]], engine=sys.argv[2])
buffers = [torch.zeros(8 << 20, dtype=torch.uint8) for _ in range(8)]
for i, b in enumerate(buffers):
    store.write(f"x{i}", b).wait()
shutil.rmtree(sys.argv[1])
pending = [store.read(f"x{i}", b) for i, b in enumerate(buffers)]
raise SystemExit(3)
"""


def test_a_store_failing_to_close_at_exit_says_so_without_a_panic(engine: str, work_dirs: list[Path]) -> None:
    """Its error, naming the file and the errno, reaches standard error (Python's logging while the
    interpreter runs, else directly), and the process exits as its program said; a record logged on the
    store's thread after the interpreter shut down panicked before."""
    # Which thread drops the store last varies: twice.
    for _ in range(2):
        path = work_dirs[0] / "gone"
        path.mkdir()
        done = subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT, str(path), engine],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 3, done.stderr[-2000:]
        assert "panicked" not in done.stderr, done.stderr[-2000:]
        assert "closing the object store" in done.stderr and "os error 2" in done.stderr, done.stderr[-2000:]
