"""Across nodes: two nodes on this machine (`cluster.TwoNodeCluster`), 2 ranks each launched by torchrun,
the state on a node-local directory and on a GlusterFS volume both nodes mount. Each run's ranks equal
stock DeepSpeed's same run bit for bit, and a checkpoint saved on the shared volume resumes on another
layout of the same 4 data-parallel ranks: from one node on two, and, after a node is killed, from two
nodes on the one left; converted to a universal checkpoint, on 2 ranks, one on each node."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster import GlusterVolume, TwoNodeCluster, cluster_unavailable
from conftest import is_root
from deepspeed_runs import HARNESS, RankServer, assert_bit_equal, free_port, harness_env
from mlp_offload.engine.profiles import ProbeOptions

if not is_root():
    pytest.skip("two nodes on one machine need root (network namespaces, mounts)", allow_module_level=True)
if why := cluster_unavailable():
    pytest.skip(why, allow_module_level=True)

# One cluster at a time: GlusterFS's daemon keeps its state in /var/lib/glusterd, one per machine.
# Each test runs 4 or more jobs of 4 ranks, beside the other worker's tests: it has run past pytest's
# 300 s (the CI run of c8673a6; docs/history/testing.md has their times).
pytestmark = [pytest.mark.xdist_group("two nodes"), pytest.mark.timeout(900)]

RANKS = 4
# Converts checkpoint folders to universal ones in one process: argv[1] is tests/support, then pairs of
# (checkpoint folder, universal folder).
CONVERT_PAIRS = (
    "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
    "from deepspeed_runs import convert_to_universal; "
    "[convert_to_universal(Path(a), Path(b)) for a, b in zip(sys.argv[2::2], sys.argv[3::2])]"
)


class Cluster(TwoNodeCluster):
    """Two nodes whose ranks are forked from a rank server on each node (`harness_server.py --ranks`),
    inside the node's namespaces, with torch, DeepSpeed and our package imported once: torchrun still
    launches every rank, its worker a `rank_client.py` that stands for the forked rank. Started from
    scratch, every rank of the tests' jobs imported them again, on the cores the other pytest worker's
    tests need (docs/history/testing.md)."""

    def __init__(self, root: Path, tag: str) -> None:
        super().__init__(root, tag)
        self.rank_servers = [
            RankServer(f"mlpo-ranks-{node.netns}", node_env(self, k), partial(self.command, k))
            for k, node in enumerate(self.nodes)
        ]

    def __exit__(self, *exc: object) -> None:
        for server in self.rank_servers:
            server.close()
        super().__exit__(*exc)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    tag = tmp_path.name[-8:].replace("_", "").lower()
    two = Cluster(tmp_path, tag)
    with two, GlusterVolume(two, tmp_path / "brick"):
        yield two


def node_env(cluster: TwoNodeCluster, index: int) -> dict[str, str]:
    """The environment of node `index`'s torchrun and rank server: one thread a rank, gloo on the node's
    veth, nothing of a launcher's."""
    env = harness_env(OMP_NUM_THREADS="1", **cluster.env(index))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def start_on(
    cluster: Cluster, nodes: int, case: dict[str, Any], name: str, ranks: int = RANKS
) -> list[tuple[Path, subprocess.Popen[bytes]]]:
    """Starts `case` on `ranks` ranks: half on each node (`nodes` 2) or all on node 0 (`nodes` 1); each
    node's log and torchrun."""
    spec = cluster.root / f"{name}.json"
    spec.write_text(json.dumps(case))
    port = free_port()
    per_node = ranks // nodes
    procs = []
    for k in range(nodes):
        log = cluster.root / f"{name}.node{k}.log"
        env = node_env(cluster, k)
        harness = [str(HARNESS), str(spec), str(result_file(cluster, name))]
        script = [*cluster.rank_servers[k].client(), *harness]
        argv = cluster.torchrun(k, script, port, per_node, nodes)
        with log.open("w") as sink:
            procs.append((log, subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env)))
    return procs


def result_file(cluster: TwoNodeCluster, name: str, rank: int | None = None) -> Path:
    return cluster.root / f"{name}.rank{'{rank}' if rank is None else rank}.pt"


def wait_for_nodes(
    procs: list[tuple[Path, subprocess.Popen[bytes]]], timeout: float = 600.0, grace: float = 30.0
) -> list[Path]:
    """Waits for every node's torchrun, and returns the logs of those that failed or are still running.
    Once one node has failed the others get `grace` seconds: their ranks may wait for the failed node's
    in gloo without end (a fresh clone's CI saw node 0 wait past pytest's 300 s for a node 1 whose rank
    had aborted), and the caller must see the failure in time to run stock's run once more."""
    deadline = time.monotonic() + timeout
    while any(proc.poll() is None for _, proc in procs) and time.monotonic() < deadline:
        if any(proc.poll() not in (None, 0) for _, proc in procs):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.2)
    return [log for log, proc in procs if proc.poll() != 0]


def run_on(
    cluster: Cluster, nodes: int, case: dict[str, Any], name: str, ranks: int = RANKS
) -> list[dict[str, Any]]:
    """`case` on `ranks` ranks (see `start_on`): every rank's result, rank by rank. A failed node's log ends
    the failure's message. Stock DeepSpeed's run (no `mlp_offload` section) is run once more, saying so,
    if a rank of it aborted or crashed: on this loaded machine gloo across the namespaces has aborted
    stock's rank 0 (`terminate called without an active exception`, SIGABRT) in a fresh clone's CI. A
    run of ours is never run again."""
    for attempt in (1, 2):
        procs = start_on(cluster, nodes, case, name, ranks)
        try:
            failed = wait_for_nodes(procs)
        finally:
            # Reaped as well as killed: a Popen left running warns when collected, and that warning
            # fails whichever test is running then (filterwarnings = error).
            for _, proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        if not failed:
            return [torch.load(result_file(cluster, name, r), weights_only=False) for r in range(ranks)]
        logs = "\n".join(f"{log.name}:\n{log.read_text()[-6000:]}" for log in failed)
        # A rank that aborted or crashed (its siblings are then ended with SIGTERM, whatever the cause).
        crashed = "(SIGABRT)" in logs or "(SIGSEGV)" in logs
        if attempt == 1 and "mlp_offload" not in case and crashed:
            # Shown in the warnings summary, not raised: `filterwarnings = error` made this warning
            # fail the test it was meant to let run again (a fresh clone's CI of 4ff6700).
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.warn(
                    f"{name}: a rank of stock's run crashed; running it once more:\n{logs}", stacklevel=2
                )
            continue
        raise AssertionError(f"{name}: {logs}")
    raise AssertionError("unreachable")


def section(cluster: TwoNodeCluster, name: str, weights: str = "equal") -> dict[str, Any]:
    """Ours on [the node's local directory, the shared volume], streaming (a few chunks cached); makes
    the directories on each node, as a job script would."""
    for node in cluster.nodes:
        (node.local_dir / name).mkdir(exist_ok=True)
    cluster.run(0, ["mkdir", "-p", str(cluster.shared / name)])
    return {
        "paths": [str(cluster.node_local / name), str(cluster.shared / name)],
        "weights": weights,
        "host_memory": "200K",
        "update_chunk": "24K",
    }


# A small probe, as `mlp-offload probe` takes it.
SMALL_PROBE = ["--bytes", "8M", "--sustained-bytes", "32M", "--chunk-sizes", "1M", "--depths", "4"]
SMALL_PROBE += ["--together-secs", "0.5"]


def probe_across_nodes(cluster: TwoNodeCluster, paths: list[str], profiles: Path) -> list[dict[str, Any]]:
    """`mlp-offload probe` of `paths` under torchrun, one process on each node; each node's saved
    profile entry, saved as the engine's (2 ranks per node) so that a job of ours reuses it."""
    port = free_port()
    procs = []
    for k in range(2):
        env = harness_env(OMP_NUM_THREADS="1", **cluster.env(k))
        argv = cluster.torchrun(
            k, ["-m", "mlp_offload.app.cli", "probe", *SMALL_PROBE, "-q", *paths], port, 1
        )
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env))
    try:
        # Well within the test's own timeout, so that a probe that hangs is named with its output.
        outs = [p.communicate(timeout=150)[0].decode() for p in procs]
    except subprocess.TimeoutExpired:
        outs = []
        for p in procs:
            p.kill()
            try:
                outs.append(p.communicate(timeout=10)[0].decode())
            except subprocess.TimeoutExpired:
                # Its children still hold the pipe; the cluster's teardown ends them.
                outs.append(f"(pid {p.pid}: no output, its children still hold the pipe)")
        raise AssertionError("the probe across nodes did not end in 150 s:\n" + "\n".join(outs)) from None
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    entries = []
    for node in cluster.nodes:
        file = profiles / f"{node.hostname}.json"
        saved = json.loads(file.read_text())
        (entry,) = saved["entries"]
        entry["options"] = asdict(ProbeOptions(ranks=RANKS // 2))
        file.write_text(json.dumps(saved))
        entries.append(entry)
    return entries


def test_four_ranks_resume_from_one_node_on_two_and_plan_their_part_of_the_volume(
    cluster: Cluster, profile_dir: Path
) -> None:
    """4 ranks on one node, with accumulation and clipping, on [node-local, shared volume]: bit-equal to
    stock DeepSpeed's same run; both save a checkpoint on the volume after 3 steps. `mlp-offload probe`
    under torchrun on both nodes finds the local directory node-local and the volume shared, and
    measures the volume from each node alone and from both at once. Then 4 ranks on 2 nodes resume
    each checkpoint (ours resumes ours, stock resumes stock's), ours split as the model plans from
    those figures, and end bit-equal to each other. A node whose profile lacks the measurement makes the
    job measure again at start-up, and each node plans with its part of the volume. Then each
    checkpoint, converted to a universal one, resumes on 2 nodes of 1 rank each, bit-equal."""
    case = {"grad_accum": 2, "clip": 0.05, "steps": 4, "save_at": 3}
    runs = {}
    for name, ours in (("stock", False), ("ours", True)):
        full = {**case, "checkpoint_dir": str(cluster.shared / f"ckpt-{name}")}
        if ours:
            full["mlp_offload"] = section(cluster, "state")
        runs[name] = run_on(cluster, 1, full, name)
    assert len({json.dumps(r["losses"]) for r in runs["stock"]}) == RANKS, "each rank has its own data"
    for rank, (a, b) in enumerate(zip(runs["ours"], runs["stock"], strict=True)):
        assert a["optimizer_class"] == "mlp_offload.adapter.zero3.MLPOffloadStage3", rank
        assert_bit_equal(a, b)
        start = next(r for r in a["telemetry"] if r["event"] == "start")
        assert start["cached_chunks"] < start["chunks"], "the state streams through both paths"

    ours_section = section(cluster, "resumed", weights="auto")
    entries = probe_across_nodes(cluster, ours_section["paths"], profile_dir)
    for entry in entries:
        assert [p["locality"] for p in entry["probes"]] == ["node-local", "shared"]
        assert entry["probes"][1]["fs_type"] == "fuse.glusterfs"
        measured = entry["probes"][1]["across_nodes"]["2"]
        assert measured["hosts"] == [n.hostname for n in cluster.nodes]
        assert all(r > 0 for r in measured["alone_bytes_per_s"] + measured["together_bytes_per_s"])
        assert "across_nodes" not in entry["probes"][0], "a node-local path is not measured across nodes"
    # Node 1 lost its measurement: the job measures again, on every node at once.
    node1 = profile_dir / f"{cluster.nodes[1].hostname}.json"
    saved = json.loads(node1.read_text())
    del saved["entries"][0]["probes"][1]["across_nodes"]
    node1.write_text(json.dumps(saved))

    resumed = {}
    for name, ours in (("stock", False), ("ours", True)):
        full = {**case, "steps": 6, "resume_at": 3, "checkpoint_dir": str(cluster.shared / f"ckpt-{name}")}
        full.pop("save_at")
        if ours:
            full["mlp_offload"] = ours_section
        resumed[name] = run_on(cluster, 2, full, f"{name}-resumed")
    saved_now = [json.loads((profile_dir / f"{n.hostname}.json").read_text()) for n in cluster.nodes]
    remeasured = [s["entries"][0]["probes"][1]["across_nodes"] for s in saved_now]
    before = entries[0]["probes"][1]["across_nodes"]["2"]["probed_at"]
    assert all(m["2"]["probed_at"] > before for m in remeasured), "both nodes saved the job's measurement"
    for rank, (a, b) in enumerate(zip(resumed["ours"], resumed["stock"], strict=True)):
        assert_bit_equal(a, b)
        start = next(r for r in a["telemetry"] if r["event"] == "start")
        # Each node plans with its part of the shared volume, as measured from both nodes at once.
        measured = remeasured[rank // 2]["2"]
        mixed = entries[rank // 2]["probes"][1]["mixed_bytes_per_s"]
        alone = measured["alone_bytes_per_s"][measured["hosts"].index(cluster.nodes[rank // 2].hostname)]
        share = min(alone, sum(measured["together_bytes_per_s"]) / 2) / mixed
        assert (start["nodes"], start["locality"]) == (2, ["node-local", "shared"]), rank
        assert start["node_share"] == pytest.approx([1.0, share]), rank
    # Each node's ranks kept their part in the node's own directory, and all four on the shared volume.
    for k in range(2):
        local = cluster.nodes[k].local_dir / "resumed"
        assert sorted(d.name for d in local.iterdir()) == [f"rank{2 * k}", f"rank{2 * k + 1}"], local
    assert cluster.shared_brick is not None
    shared = cluster.shared_brick / "resumed"
    assert sorted(d.name for d in shared.iterdir()) == [f"rank{r}" for r in range(RANKS)], shared

    # The checkpoints of the 4 ranks, converted on the volume (DeepSpeed's `ds_to_universal.py`), resume
    # on 2 nodes of 1 rank each: ours from ours', stock from stock's.
    universal = {**case, "steps": 6, "resume_at": 3, "ds_options": {"checkpoint.load_universal": True}}
    universal.pop("save_at")
    # Both in one process on node 0 (one DeepSpeed import in its namespace), as `convert_to_universal`
    # runs the converter.
    folders = [
        f"{cluster.shared}/{kind}-{name}/ckpt" for name in ("stock", "ours") for kind in ("ckpt", "universal")
    ]
    cluster.run(0, [sys.executable, "-c", CONVERT_PAIRS, str(HARNESS.parent), *folders])
    for name, ours in (("stock", False), ("ours", True)):
        full = {**universal, "checkpoint_dir": str(cluster.shared / f"universal-{name}")}
        if ours:
            full["mlp_offload"] = section(cluster, "universal")
        resumed[name] = run_on(cluster, 2, full, f"{name}-universal", ranks=2)
    for a, b in zip(resumed["ours"], resumed["stock"], strict=True):
        assert a["optimizer_class"] == "mlp_offload.adapter.zero3.MLPOffloadStage3"
        assert_bit_equal(a, b)


def test_a_node_killed_mid_update_resumes_as_stock_resumes(cluster: Cluster) -> None:
    """Ours, 4 ranks on 2 nodes, saves a checkpoint on the shared volume after 2 steps; in the next
    update node 1's ranks stop after 3 chunks and the whole node is SIGKILLed, then node 0 (the job is
    over, as a scheduler ends it). The same 4 ranks resume from that checkpoint on the node that is left,
    on the store paths the killed job left there: bit-equal to stock DeepSpeed's own resume, the same
    way, from its checkpoint after the same 2 steps on both nodes."""
    case = {"grad_accum": 2, "clip": 0.05, "steps": 3, "save_at": 2}
    resume = {"grad_accum": 2, "clip": 0.05, "steps": 5, "resume_at": 2}
    stock_ckpt, ours_ckpt = str(cluster.shared / "ckpt-stock"), str(cluster.shared / "ckpt-ours")
    run_on(cluster, 2, {**case, "checkpoint_dir": stock_ckpt}, "stock")
    stock = run_on(cluster, 1, {**resume, "checkpoint_dir": stock_ckpt}, "stock-resumed")

    ours = section(cluster, "state")
    marker = cluster.root / "stalled.rank{rank}"
    killed = {
        **case,
        "checkpoint_dir": ours_ckpt,
        "mlp_offload": ours,
        "stall_in_update_at": 2,
        "stall_node": 1,
        "stall_marker": str(marker),
    }
    procs = start_on(cluster, 2, killed, "ours")
    stalled = [Path(str(marker).replace("{rank}", str(r))) for r in (2, 3)]
    deadline = time.monotonic() + 300
    while not all(m.exists() for m in stalled):
        ended = [log for log, proc in procs if proc.poll() is not None]
        assert not ended and time.monotonic() < deadline, "\n".join(log.read_text()[-4000:] for log in ended)
        time.sleep(0.2)
    cluster.kill_node(1)
    cluster.kill_node(0)
    for _, proc in procs:
        proc.wait(timeout=60)
    assert not any(result_file(cluster, "ours", r).exists() for r in range(RANKS)), "no rank got to the end"

    resumed = run_on(cluster, 1, {**resume, "checkpoint_dir": ours_ckpt, "mlp_offload": ours}, "ours-resumed")
    for a, b in zip(resumed, stock, strict=True):
        assert_bit_equal(a, b)
