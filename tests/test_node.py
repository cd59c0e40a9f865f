"""Many ranks on one node, as separate processes: one probe per node, and a rank killed while it holds
node-wide admission does not block the others."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import mlp_offload
from deepspeed_runs import assert_bit_equal, run_case, section
from mlp_offload.engine import profiles

# Node-wide admission on the work disk's device: one semaphore per device and user, so these run one after
# another and never beside the other tests that use it (`pytest -n`).
pytestmark = pytest.mark.xdist_group("node-wide admission")

SMALL_PROBE = (
    "ProbeOptions(bytes=16 << 20, sustained_bytes=32 << 20, chunk_sizes=[1 << 20], depths=[2, 8], "
    "together_secs=0.3)"
)


def test_one_rank_of_a_node_probes_and_the_others_reuse_its_profile(work_dirs: list[Path]) -> None:
    """Four processes start at once and each asks for the profile of the same two paths: one probes,
    the other three wait for it and read what it saved."""
    script = textwrap.dedent(
        f"""
        import json, sys
        from mlp_offload.engine.profiles import ProbeOptions, load_or_probe
        profile, source = load_or_probe(sys.argv[1:], {SMALL_PROBE})
        print(json.dumps({{"source": source, "probed_at": profile.probed_at, "devices": profile.devices}}))
        """
    )
    paths = [str(p) for p in work_dirs[:2]]
    procs = [
        subprocess.Popen([sys.executable, "-c", script, *paths], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    probed = [o for o in outs if o["source"].startswith("probed now")]
    assert len(probed) == 1, [o["source"] for o in outs]
    assert len({o["probed_at"] for o in outs}) == 1, "every rank plans from the one probe"
    # Both directories are on the work disk: the profile says they share it.
    assert list(outs[0]["devices"].values()) == [[0, 1]]


def test_a_rank_waiting_for_the_probe_lock_still_takes_signals() -> None:
    """The node's probe lock is tried with this thread's signals blocked (on GlusterFS an interrupted
    lock request can hang the client), but never waited for so: a rank waiting for another's probe
    still takes a signal (here its handler ends the wait), and has its signals as before after."""
    script = textwrap.dedent(
        """
        import time
        from mlp_offload.engine.profiles import node_probe_lock
        with node_probe_lock():
            print("held", flush=True)
            time.sleep(60)
        """
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            before = signal.pthread_sigmask(signal.SIG_BLOCK, [])

            def interrupt(signum: int, frame: object) -> None:
                raise KeyboardInterrupt

            previous = signal.signal(signal.SIGALRM, interrupt)
            start = time.monotonic()
            try:
                signal.setitimer(signal.ITIMER_REAL, 0.3)
                with pytest.raises(KeyboardInterrupt), profiles.node_probe_lock():
                    pass
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            assert time.monotonic() - start < 10, "the signal ended the wait"
            assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
            holder.kill()
            holder.wait()
            with profiles.node_probe_lock():
                assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
        finally:
            holder.kill()
            holder.wait()


HOLDER = textwrap.dedent(
    """
    import sys, torch, mlp_offload
    store = mlp_offload.ObjectStore([sys.argv[1]], rank=int(sys.argv[2]), chunk_size=64 << 10,
                                    max_inflight=8, device_inflight=[2])
    data = torch.ones(64 << 20, dtype=torch.uint8)
    print("writing", flush=True)
    while True:  # until killed: requests of this rank always in flight or waiting
        store.write("big", data).wait()
    """
)


def test_a_rank_killed_while_it_holds_the_device_does_not_block_the_others(work_dirs: list[Path]) -> None:
    """Rank 1 writes without pause under a node-wide limit of 2 requests; rank 0 works beside it, then
    rank 1 is killed with SIGKILL, requests in flight. Had its requests died with it, the limit would be
    spent for good and rank 0's next write would never start; instead the kernel gives them back and
    rank 0 goes on at once."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(work_dirs[0]), "1"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "writing"
        store = mlp_offload.ObjectStore(
            [work_dirs[0]], rank=0, chunk_size=64 << 10, max_inflight=8, device_inflight=[2]
        )
        data = torch.arange(16 << 20, dtype=torch.int32).view(torch.uint8)
        assert store.write("before", data).wait(timeout=120), "no request passed beside the other rank"
        time.sleep(0.5)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=60)
        killed = time.perf_counter()
        for key in ("after0", "after1"):
            assert store.write(key, data).wait(timeout=120), "the dead rank's requests were not given back"
        back = torch.empty_like(data)
        assert store.read("after1", back).wait(timeout=120)
        assert torch.equal(back, data)
        print(f"two writes and a read of 64 MiB in {time.perf_counter() - killed:.2f} s after the kill")
        report = store.path_reports()[0]
        assert report["device_inflight"] == 2
        assert 1 <= report["stats"]["node_inflight_max"] <= 2
        assert report["stats"]["inflight_max"] <= 2
        store.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


def save_stale_profile(paths: list[Path], ranks: int) -> dict[str, Any]:
    """A real probe of `paths` (a small one) for a node of `ranks`, saved as the engine's profile of them,
    in which the first path claims 8 times what it gives, as a profile saved before its device slowed
    would: the plan then loads it with most of the state, and the tuners must move the split back.
    Returns the probe's measurement of how the ranks share the device."""
    from dataclasses import asdict

    from mlp_offload.engine import profiles

    small = profiles.ProbeOptions(
        bytes=16 << 20,
        sustained_bytes=32 << 20,
        chunk_sizes=[1 << 20],
        depths=[2, 8],
        together_secs=0.3,
        ranks=ranks,
    )
    profile = profiles.probe([str(p) for p in paths], small)
    for key in ("read_bytes_per_s", "write_bytes_per_s", "mixed_bytes_per_s", "concurrent_bytes_per_s"):
        if profile.probes[0].get(key):
            profile.probes[0][key] *= 8
    profile.options = asdict(profiles.ProbeOptions(ranks=ranks))
    profiles.save_profile(profile)
    sharing: dict[str, Any] = profile.probes[0]["sharing"]
    return sharing


# ranks, device_sharing
NODES = [(2, "auto"), (4, "turns")]


@pytest.mark.deepspeed
@pytest.mark.parametrize(("ranks", "sharing"), NODES, ids=[f"{r} ranks, {s}" for r, s in NODES])
def test_the_ranks_of_a_node_share_each_device_and_agree_on_the_split(
    ranks: int, sharing: str, work_dirs: list[Path], tmp_path: Path
) -> None:
    """N ranks of one node (gloo) on the same two paths, under node-wide admission of 2 requests per
    device while each rank may put 8 in flight, adapting the split from a stale profile: every rank's
    state equals stock DeepSpeed's N-rank run bit for bit; no rank put more than 2 requests in flight,
    and none saw more than 2 in flight on the device, all ranks together; every rank's tuner made the
    same moves at the same steps, so all hold the same split throughout; and the device is shared as
    asked, or ("auto") as the probe measured faster."""
    from mlp_offload.engine import profiles

    measured = save_stale_profile(work_dirs[:2], ranks)
    stock = run_case({}, tmp_path, "stock", ranks=ranks)
    extra = {
        "weights": "auto",
        "host_memory": "200K",
        "update_chunk": "24K",
        "device_inflight": 2,
        "device_sharing": sharing,
    }
    ours = run_case({"mlp_offload": section(work_dirs[:2], **extra)}, tmp_path, "ours", ranks=ranks)
    for a, b in zip(ours["ranks"], stock["ranks"], strict=True):
        assert_bit_equal(a, b)
    way = profiles.sharing_choice(measured) if sharing == "auto" else sharing
    moves = []
    for rank, result in enumerate(ours["ranks"]):
        start = next(r for r in result["telemetry"] if r["event"] == "start")
        assert start["device_inflight"] == [2, 2], rank
        assert start["device_sharing"] == [way, way], rank
        steps = [r for r in result["telemetry"] if r["event"] == "step"]
        for r in steps:
            for p in r["paths"]:
                assert p["device_inflight"] == 2
                assert 1 <= p["inflight_max"] <= 2, (rank, r["step"], p)
                assert 1 <= p["node_inflight_max"] <= 2, (rank, r["step"], p)
        moves.append([r["weights_next"] for r in steps])
    assert any(m is not None for m in moves[0]), "the stale profile's split was never moved"
    assert all(m == moves[0] for m in moves), "the ranks' tuners moved differently"
