"""Faults for real, inside real DeepSpeed ZeRO-3: a failed write, slow writes, a process killed in an update,
a failing or vanishing path, a path that fills up, a long run's memory, files and threads; each ends
naming what happened, and the job resumes from its checkpoint as stock's does."""

from __future__ import annotations

import errno
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import mounted_tmpfs
from deepspeed_runs import (
    assert_bit_equal,
    from_step,
    run_case,
    section,
)


@pytest.mark.parametrize(
    ("shadow_slots", "ds_case", "extra"),
    [
        pytest.param(True, {}, {}, id="shadow slots"),
        pytest.param(False, {}, {}, id="one copy (default)"),
        # The streamed chunks' new versions staged during backward (see KILLED_CASES) fail to be written.
        pytest.param(
            True,
            {"reduce_bucket_size": 20_000, "clip": 0.0},
            {"update_chunk": "24K", "overlap_backward": True},
            id="shadow slots, the update during backward",
        ),
    ],
)
def test_a_failed_write_raises_and_names_what_it_left(
    shadow_slots: bool, ds_case: dict[str, Any], extra: dict[str, Any], work_dirs: list[Path], tmp_path: Path
) -> None:
    """A step whose writes fail raises with the errno and the file. With shadow slots every object still
    reads back its last state; with one copy (the default) the store still opens, every object whose
    write did not fail reads back, and each one whose write failed is refused by name, never read wrong."""
    if os.geteuid() != 0:
        pytest.skip("chattr +i needs root")
    # Three steps, then the object files turn immutable: the fourth step's writes fail with EPERM.
    ours = section(work_dirs[:2], host_memory="deepspeed", shadow_slots=shadow_slots, **extra)
    result = run_case({**ds_case, "steps": 5, "immutable_at_step": 3, "mlp_offload": ours}, tmp_path, "fail")
    if extra.get("overlap_backward"):
        # The steps before were updated during backward, and kept; the failing one began so.
        records = [r for r in result["telemetry"] if r["event"] == "step"]
        assert len(records) == 3 and all(r["overlap_backward"]["kept"] for r in records), records
    error = result["error"]
    assert error, "the step must raise"
    assert error["errno"] == errno.EPERM and error["filename"].endswith(".mlpo"), error
    readable = result["readable"]
    assert len(readable) > 2
    refused = {k: v for k, v in readable.items() if isinstance(v, str)}
    if shadow_slots:
        assert not refused, "every object reads back, checksums and all"
    else:
        assert refused and len(refused) < len(readable), readable
        assert all("CorruptObjectError" in v and k in v for k, v in refused.items()), refused


def test_an_earlier_runs_state_in_the_paths_is_replaced(work_dirs: list[Path], tmp_path: Path) -> None:
    # Same paths, another subgroup size: the second run starts from its own model, not the old objects.
    first = run_case({"steps": 2, "mlp_offload": section(work_dirs[:1])}, tmp_path, "first")
    second_case = {"steps": 2, "sub_group_size": 30000, "mlp_offload": section(work_dirs[:1])}
    second = run_case(second_case, tmp_path, "second")
    stock = run_case({"steps": 2, "sub_group_size": 30000}, tmp_path, "stock")
    assert_bit_equal(second, stock)
    subgroups = [
        next(r for r in x["telemetry"] if r["event"] == "start")["subgroups"] for x in (first, second)
    ]
    assert subgroups[0] > subgroups[1]
    chunks = next(r for r in second["telemetry"] if r["event"] == "start")["chunks"]
    assert len(list(work_dirs[0].rglob("subgroup*.mlpo"))) == chunks


def blkio_root() -> Path | None:
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mnt, kind, opts, *_ = line.split()
        if kind == "cgroup" and "blkio" in opts.split(","):
            return Path(mnt)
    return None


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no overlap"])
def test_reads_wait_for_slow_writes(overlap: bool, work_dirs: list[Path], tmp_path: Path) -> None:
    """Writes throttled to 2 MiB/s (reads not), every chunk written back at the end of each step
    (`cache_chunks` 0): the last writes of each step are still in flight when the next step reads those
    objects. A read that did not wait would see the old state and break the bit-for-bit equality.
    Inside `step()` the next step starts on those chunks, in their buffers; behind it (chunk order) it
    reads them last, after their writes."""
    root = blkio_root()
    if os.geteuid() != 0 or root is None or not (root / "blkio.throttle.write_bps_device").exists():
        pytest.skip("needs root and the cgroup v1 blkio throttle")
    dev = os.stat(work_dirs[0]).st_dev
    cgroup = root / f"mlp-offload-test-{os.getpid()}"
    cgroup.mkdir()
    try:
        (cgroup / "blkio.throttle.write_bps_device").write_text(
            f"{os.major(dev)}:{os.minor(dev)} {2 << 20}\n"
        )
        ours = run_case(
            # The write-behind of step() alone: without the update during backward, whose staged writes
            # of the streamed chunks would leave step() none to retain.
            {
                "mlp_offload": section(
                    work_dirs[:1],
                    host_memory="deepspeed",
                    cache_chunks=0,
                    overlap=overlap,
                    overlap_backward=False,
                )
            },
            tmp_path,
            "slow",
            cgroup=cgroup,
        )
    finally:
        for pid in (cgroup / "cgroup.procs").read_text().split():
            (root / "cgroup.procs").write_text(pid)
        cgroup.rmdir()
    stock = run_case({}, tmp_path, "stock")
    assert_bit_equal(ours, stock)
    steps = [r for r in ours["telemetry"] if r["event"] == "step"]
    assert sum(r["write_wait_secs"] for r in steps) > 0.5, "the throttle must have slowed the writes"
    if not overlap:
        assert all(r["retained"] > 0 for r in steps[1:]), "steps start on subgroups whose writes ran on"


# name, the DeepSpeed side, extra section keys, where the kill comes (what the harness says as it kills),
# ranks
KILLED_CASES = [
    ("in step()", {}, {"overlap": False}, "in step()", 1),
    ("behind step(), the next forward running", {}, {"overlap": True}, "behind step()", 1),
    # DeepSpeed reduces in small buckets, so the streamed chunks are updated during backward, their new
    # versions staged beside the old ones: the kill comes while backward still runs (the harness holds
    # backward near its end until then: on a busy machine it could end before three chunks are updated,
    # which happened once with the stock runs not yet kept). No clipping
    # (DeepSpeed's default, 1.0, clips these gradients, and a clipped step's update is not tried then).
    (
        "in the update during backward",
        {"reduce_bucket_size": 20_000, "clip": 0.0},
        {"shadow_slots": True, "overlap_backward": True},
        "during backward",
        1,
    ),
    # Rank 1 of two dies there; rank 0 is ended wherever it is (its collective with rank 1 fails, or the
    # launcher kills it, as torchrun does), its own update during backward possibly half done. The
    # second slots come from the plan ("auto"), not from shadow_slots.
    (
        "rank 1 of two, in the update during backward",
        {"reduce_bucket_size": 20_000, "clip": 0.0},
        {"overlap_backward": True},
        "during backward",
        2,
    ),
]


@pytest.mark.parametrize(
    ("ds_case", "extra", "where", "ranks"), [c[1:] for c in KILLED_CASES], ids=[c[0] for c in KILLED_CASES]
)
def test_killed_in_an_update_the_job_resumes_from_its_last_checkpoint(
    ds_case: dict[str, Any],
    extra: dict[str, Any],
    where: str,
    ranks: int,
    stock_resumed: dict[str, Any],
    work_dirs: list[Path],
    tmp_path: Path,
) -> None:
    """SIGKILL in the middle of step 7's update (three chunks updated, writes in flight): inside
    `step()`, behind it while the next forward runs, or while backward runs (the update during
    backward, its versions staged), in the last rank; after a checkpoint at step 5, the job (every
    rank) resumes from that checkpoint in new processes on the same paths: the stores open (the dead
    processes' locks are gone) and steps 5 to 9 give what DeepSpeed's own resume from the same
    checkpoint gives, bit for bit, on every rank."""
    ours = section(work_dirs[:2], host_memory="64M", update_chunk="24K", cache_chunks=2, **extra)
    ckpt = str(tmp_path / "ckpt")
    killed_rank = ranks - 1
    killed = {
        "save_at": 5,
        "sigkill_in_update_at": 7,
        "sigkill_rank": killed_rank,
        "hold_backward": where == "during backward",
        "checkpoint_dir": ckpt,
        "mlp_offload": ours,
    }
    with pytest.raises(AssertionError, match=r"killed rank \d failed") as failed:
        run_case({**ds_case, **killed}, tmp_path, "killed", ranks=ranks)
    log = (tmp_path / f"killed.rank{killed_rank}.log").read_text()
    assert f"killed {where}" in log, (str(failed.value)[-2000:], log[-2000:])
    resumed = run_case(
        {**ds_case, "resume_at": 5, "checkpoint_dir": ckpt, "mlp_offload": ours},
        tmp_path,
        "resumed",
        ranks=ranks,
    )
    if ds_case or ranks > 1:
        stock_ckpt = str(tmp_path / "stock-ckpt")
        stock_case = {**ds_case, "checkpoint_at": 5, "checkpoint_dir": stock_ckpt}
        stock_resumed = run_case(stock_case, tmp_path, "stock-resumed", ranks=ranks)
    for ours_rank, stock_rank in zip(
        resumed.get("ranks", [resumed]), stock_resumed.get("ranks", [stock_resumed]), strict=True
    ):
        assert_bit_equal(ours_rank, from_step(stock_rank, 5))
    if extra.get("overlap_backward"):
        # The resumed job updates during backward again, and keeps what it did.
        for rank in resumed.get("ranks", [resumed]):
            steps = [r for r in rank["telemetry"] if r["event"] == "step"]
            assert all(r["overlap_backward"]["kept"] for r in steps), steps
            assert sum(r["overlap_backward"]["in_backward"] for r in steps) > 0, steps


FAULTFS = Path(__file__).parent / "support" / "faultfs.py"


@pytest.fixture
def faulty_path(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A path through `faultfs.py` (FUSE) whose reads or writes fail with EIO on demand, or which
    disappears when its process is killed."""
    if not Path("/dev/fuse").exists() or importlib.util.find_spec("mfusepy") is None:
        pytest.skip("needs /dev/fuse and mfusepy (libfuse)")
    backing, mount = tmp_path / "backing", tmp_path / "faulty"
    backing.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(FAULTFS), str(backing), str(mount)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "mounted", "the FUSE file system did not mount"
        yield {"backing": backing, "mount": mount, "pid": proc.pid}
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        subprocess.run(["fusermount3", "-u", "-z", str(mount)], check=False, capture_output=True)


# name, how the fault comes, the errno the step must name
FAULTS = [
    ("EIO on writes", ".fail-writes", {errno.EIO}),
    ("EIO on reads", ".fail-reads", {errno.EIO}),
    # A request the kernel had already handed to the dead FUSE process ends with ECONNABORTED; one made
    # after the connection is gone, with ENOTCONN. Which comes first depends on timing.
    ("the path disappears", None, {errno.ENOTCONN, errno.ECONNABORTED}),
]


# When the update runs: inside step() (the DeepSpeed side, extra section keys), or the streamed chunks'
# during backward (small reduce buckets, no clipping: see KILLED_CASES).
WHEN = [
    pytest.param({}, {}, id="in step()"),
    pytest.param(
        {"reduce_bucket_size": 20_000, "clip": 0.0},
        {"shadow_slots": True, "overlap_backward": True},
        id="during backward",
    ),
]


@pytest.mark.parametrize(("ds_case", "extra"), WHEN)
@pytest.mark.parametrize(("switch", "errnos"), [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
def test_a_failing_path_stops_the_step_naming_it_and_the_job_resumes_on_the_other(
    switch: str | None,
    errnos: set[int],
    ds_case: dict[str, Any],
    extra: dict[str, Any],
    faulty_path: dict[str, Any],
    stock_resumed: dict[str, Any],
    work_dirs: list[Path],
    tmp_path: Path,
) -> None:
    """Two paths, the second of which fails for real from step 7 (its reads or writes give EIO, or it
    disappears: ENOTCONN or ECONNABORTED), after a checkpoint at step 5, the state streaming through a
    small budget, updated in `step()` or during backward.
    Step 7 raises an `OSError` with that errno and an object's file on the failing path (or, for the
    writes still in flight when step 7 returned, step 8 does). A new process resumes from the checkpoint
    on the path that is left and trains steps 5 to 9 as DeepSpeed's own resume does, bit for bit."""
    failing = faulty_path["mount"]
    ckpt = str(tmp_path / "ckpt")
    both = section([work_dirs[0], failing], host_memory="200K", update_chunk="24K", **extra)
    fault = {"switch": str(faulty_path["backing"] / switch)} if switch else {"kill": faulty_path["pid"]}
    failed = run_case(
        {**ds_case, "save_at": 5, "fault_at": 7, "fault": fault, "checkpoint_dir": ckpt, "mlp_offload": both},
        tmp_path,
        "failed",
    )
    error = failed["error"]
    assert error, f"no step raised in {failed['steps']} steps"
    assert error["errno"] in errnos, error
    assert error["filename"].startswith(str(failing)) and error["filename"].endswith(".mlpo"), error
    left = section([work_dirs[0]], host_memory="200K", update_chunk="24K", **extra)
    resumed = run_case(
        {**ds_case, "resume_at": 5, "checkpoint_dir": ckpt, "mlp_offload": left}, tmp_path, "resumed"
    )
    if ds_case:
        stock_case = {**ds_case, "checkpoint_at": 5, "checkpoint_dir": str(tmp_path / "stock-ckpt")}
        stock_resumed = run_case(stock_case, tmp_path, "stock-resumed")
    assert_bit_equal(resumed, from_step(stock_resumed, 5))


@pytest.fixture
def filling_path(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs: a path that can be filled up for real."""
    yield from mounted_tmpfs(tmp_path / "filling", "64m")


def test_a_path_that_fills_up_mid_run_costs_no_step_and_the_manifest_names_it(
    filling_path: Path, stock_resumed: dict[str, Any], work_dirs: list[Path], tmp_path: Path
) -> None:
    """Another job takes every free block of the second path before step 3. Every object's blocks were
    reserved when it was created, so rewrites need none: training goes on bit-equal to DeepSpeed's
    uninterrupted run, and a checkpoint is saved at step 5. Only the store's manifest needs a new block
    when it changes: `destroy()` raises ENOSPC naming the manifest on the full path (the first path's,
    written first, is whole and current), and the store still opens. A new process resumes from the
    checkpoint on the same, still full, paths, bit-equal to DeepSpeed's own resume."""
    ckpt = str(tmp_path / "ckpt")
    both = section([work_dirs[0], filling_path], host_memory="200K", update_chunk="24K")
    full = run_case(
        {"fill_at": 3, "fill": str(filling_path), "save_at": 5, "checkpoint_dir": ckpt, "mlp_offload": both},
        tmp_path,
        "full",
    )
    assert_bit_equal(full, run_case({}, tmp_path, "stock"))
    error = full["destroy_error"]
    assert error["errno"] == errno.ENOSPC, error
    assert error["filename"].startswith(str(filling_path)) and "manifest" in error["filename"], error
    assert full["store_keys_after_destroy"], "the store opened empty"
    resumed = run_case({"resume_at": 5, "checkpoint_dir": ckpt, "mlp_offload": both}, tmp_path, "resumed")
    assert_bit_equal(resumed, from_step(stock_resumed, 5))
    assert resumed["destroy_error"]["errno"] == errno.ENOSPC, resumed["destroy_error"]


def test_a_long_run_holds_memory_files_and_threads_flat(work_dirs: list[Path], tmp_path: Path) -> None:
    """500 steps streaming chunks through two paths (reads and writes every step): after
    the first 50, resident memory grows by less than 1% (allocator noise) and the open files and threads
    do not change, and the boundary's norms widen into the same scratch every step (allocated anew,
    its page faults and its freeing cost a step more than the norms themselves). Samples, not timings."""
    ours = section(work_dirs[:2], host_memory="200K", update_chunk="24K")
    result = run_case({"steps": 500, "sample_resources": True, "mlp_offload": ours}, tmp_path, "soak")
    samples = result["samples"][50:]
    assert {s["fds"] for s in samples} == {samples[0]["fds"]}, "open files changed"
    assert {s["threads"] for s in samples} == {samples[0]["threads"]}, "threads changed"
    scratches = {s["norm_scratch"] for s in samples}
    assert len(scratches) == 1 and 0 not in scratches, f"the norms' scratch changed or went: {scratches}"
    early = max(s["rss"] for s in samples[:50])
    late = max(s["rss"] for s in samples[-50:])
    assert late <= early * 1.01, f"resident memory grew from {early / 2**20:.1f} to {late / 2**20:.1f} MiB"
