"""`mlp-offload probe` and `plan`, run as a user would: a subprocess on real directories."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from mlp_offload import _core
from mlp_offload.app.cli import parse_size


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlp_offload.app.cli", *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=300,
    )


PROBE = [
    sys.executable,
    "-m",
    "mlp_offload.app.cli",
    "probe",
    "--bytes",
    "16M",
    "--sustained-bytes",
    "64M",
    "--chunk-sizes",
    "1M,4M",
    "--depths",
    "2,8",
    "--together-secs",
    "0.5",
]
# The same small probe for `plan`.
PROBE_OPTIONS = PROBE[4:]


def test_probe_json_has_the_documented_fields(work_dirs: list[Path]) -> None:
    out = subprocess.run(
        [*PROBE, "--json", "-q", str(work_dirs[0]), str(work_dirs[1])],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    results = json.loads(out.stdout)
    assert [r["path"] for r in results] == [str(work_dirs[0]), str(work_dirs[1])]
    for r in results:
        assert r["read_bytes_per_s"] > 0 and r["write_bytes_per_s"] > 0
        assert r["mixed_bytes_per_s"] > 0 and r["concurrent_bytes_per_s"] > 0
        assert r["engine"] in ("io_uring", "threads") and r["direct_io"] is True
        # The work disk is the node's own; the mount's type and source say what it is across mounts.
        assert (r["locality"], r["fs_type"]) == ("node-local", _core.probe_directory(r["path"])["fs_type"])
        assert r["mount_source"] and "across_nodes" not in r
        assert {s["op"] for s in r["samples"]} == {"read", "write"} and len(r["samples"]) == 8
        # Host buffers of either page size at the best settings, and the pages the sustained figures used.
        pages = r["pages"]
        assert all(
            pages[f"{k}_bytes_per_s"] > 0 for k in ("small_read", "small_write", "huge_read", "huge_write")
        )
        assert pages["chosen"] == _core.pages_choice([pages])
        assert pages["huge_buffer"]["bytes"] >= 1 << 20
        if _core.block_counters(r["device_id"]) is None:
            continue  # a file system without a block device of its own: nothing the device saw
        # What the device saw is beside every figure: requests of some size.
        for activity in [*(s["device"] for s in r["samples"]), r["read_device"], r["write_device"]]:
            assert activity is not None and activity["read_requests"] + activity["write_requests"] > 0
        assert r["read_device"]["read_request_bytes"] > 0 and r["write_device"]["write_request_bytes"] > 0
    assert not any(p.name.startswith(".mlp-offload") for d in work_dirs for p in d.iterdir())
    alone = json.loads(run_cli(*PROBE[3:], "--json", "-q", "--no-save", str(work_dirs[2])).stdout)
    assert alone[0]["concurrent_bytes_per_s"] is None, "nothing to run together with"
    assert all(r["sharing"] is None for r in [*results, *alone]), "one rank: no sharing to measure"


def test_probe_for_a_node_of_ranks_measures_both_ways_of_sharing_each_device(work_dirs: list[Path]) -> None:
    """With `--ranks 3` each device is measured with 3 streams at once, each at its own limit, then under
    one node-wide limit request by request and by turns (once per device: both directories are on the
    work disk), and the table says what the model picks."""
    out = run_cli(
        *PROBE[3:], "--ranks", "3", "--json", "-q", "--no-save", str(work_dirs[0]), str(work_dirs[1])
    )
    results = json.loads(out.stdout)
    sharing = [r["sharing"] for r in results]
    assert sharing[0] == sharing[1], "one measurement per device"
    assert sharing[0]["streams"] == 3 and sharing[0]["limit"] == results[0]["best_read"]["max_inflight"]
    assert all(sharing[0][f"{way}_bytes_per_s"] > 0 for way in ("free", "shared", "turns")), sharing[0]
    table = run_cli(*PROBE[3:], "--ranks", "3", "-q", "--no-save", str(work_dirs[0])).stdout
    assert "3 ranks at once: " in table and "each at its own limit" in table, table
    assert "the model limits the node" in table or "the model leaves each rank its own limit" in table


MiB = 2**20
# the probe's figures for N ranks at once (MiB/s): each at its own limit, under a node-wide one request
# by request, by turns; whether the model limits the node, and how
SHARING_CHOICES = [
    ("no difference: no limit", (1000, 1000, 1000), False, "shared"),
    ("the limit within 5%: no limit", (1000, 1040, 1045), False, "shared"),
    ("contention, shared best", (600, 1000, 1000), True, "shared"),
    ("contention, turns 5% better", (600, 900, 1000), True, "turns"),
    ("a profile from before free was measured", (None, 1000, 1000), True, "shared"),
]


@pytest.mark.parametrize(
    ("rates", "limits", "way"), [c[1:] for c in SHARING_CHOICES], ids=[c[0] for c in SHARING_CHOICES]
)
def test_the_model_limits_the_node_only_where_the_probe_measured_it_faster(
    rates: tuple[int | None, int, int], limits: bool, way: str
) -> None:
    from mlp_offload.engine import profiles

    free, shared, turns = rates
    sharing = {"streams": 4, "limit": 8, "shared_bytes_per_s": shared * MiB, "turns_bytes_per_s": turns * MiB}
    if free is not None:
        sharing["free_bytes_per_s"] = free * MiB
    assert profiles.admission_helps(sharing) is limits
    assert profiles.sharing_choice(sharing) == way


# ranks; per path its device and what one rank alone moved on it (MiB/s); each device's sharing figures
# for 4 streams (free, shared, turns; None: not measured); the ways the ranks share each path's device
# (None: as "auto" picks); each path's expected part of its probed bandwidth
RANK_SHARES = [
    ("one rank owns its devices", 1, [("a", 1000)], {"a": (2000, 2000, 2000)}, None, [1.0]),
    (
        "4 ranks, no limit: a quarter of the total each",
        4,
        [("a", 1000)],
        {"a": (2000, 1800, 1700)},
        None,
        [0.5],
    ),
    ("4 ranks by turns (auto picks them)", 4, [("a", 1000)], {"a": (600, 900, 1000)}, None, [0.25]),
    ("a way set by hand", 4, [("a", 1000)], {"a": (600, 900, 1000)}, ["shared"], [0.225]),
    ("never more than alone", 2, [("a", 500)], {"a": (4000, 4000, 4000)}, None, [1.0]),
    (
        "two paths on one device share its part; another device its own",
        4,
        [("a", 600), ("a", 400), ("b", 1000)],
        {"a": (2000, 2000, 2000), "b": (1000, 1000, 1000)},
        None,
        [0.5, 0.5, 0.25],
    ),
    ("no sharing figures: as owning it", 4, [("a", 1000)], {"a": None}, None, [1.0]),
]


@pytest.mark.parametrize(
    ("ranks", "paths", "sharing", "ways", "expected"),
    [c[1:] for c in RANK_SHARES],
    ids=[c[0] for c in RANK_SHARES],
)
def test_each_rank_is_planned_with_its_part_of_a_shared_device(
    ranks: int,
    paths: list[tuple[str, int]],
    sharing: dict[str, tuple[int, int, int] | None],
    ways: list[str] | None,
    expected: list[float],
) -> None:
    """The model plans each of the node's ranks with the device's total for that many ranks, measured
    by the probe the way they share it, divided among them; and the predicted update of an I/O-bound
    plan grows as the part shrinks."""
    from mlp_offload.engine import profiles

    def figures(device: str) -> dict[str, Any] | None:
        rates = sharing[device]
        if rates is None:
            return None
        free, shared, turns = rates
        return {
            "streams": 4,
            "limit": 8,
            "free_bytes_per_s": free * MiB,
            "shared_bytes_per_s": shared * MiB,
            "turns_bytes_per_s": turns * MiB,
        }

    probes = [
        {
            "device_id": device,
            "read_bytes_per_s": alone * MiB,
            "write_bytes_per_s": alone * MiB,
            "mixed_bytes_per_s": alone * MiB,
            "concurrent_bytes_per_s": alone * MiB,
            "best_read": {"max_inflight": 8, "chunk_size": 1 << 20},
            "sharing": figures(device),
        }
        for device, alone in paths
    ]
    profile = profiles.Profile(paths=[f"/p{i}" for i in range(len(paths))], probes=probes, probed_at=0.0)
    assert profile.rank_share(ranks, ways) == pytest.approx(expected)
    sizes = [48 * MiB] * 64
    alone = profile.plan_stream(sizes, 8, 8)
    shared = profile.plan_stream(sizes, 8, 8, share=profile.rank_share(ranks, ways))
    slowest = min(expected)
    assert shared["predicted_update_secs"] >= alone["predicted_update_secs"] * (0.99 if slowest == 1 else 1.0)
    if all(part == expected[0] for part in expected):
        assert shared["predicted_update_secs"] == pytest.approx(
            alone["predicted_update_secs"] / slowest, rel=0.05
        )
    if len(paths) == 1:
        # A path probed alone has no concurrent figure: its mixed one stands for it.
        probes[0]["concurrent_bytes_per_s"] = None
        assert profile.rank_share(ranks, ways) == pytest.approx(expected)
        plan = profile.plan_stream(sizes, 8, 8, share=profile.rank_share(ranks, ways))
        assert plan["predicted_update_secs"] > 0


# name, nodes, configured localities, per path (locality, mixed MiB/s of its probe at start-up,
# {nodes: each node's MiB/s together}, this node's MiB/s alone in that measurement (None: as at
# start-up)), expected share of each path's figures
NODE_SHARES = [
    ("node-local: all its own", 4, None, [("node-local", 1000, None, None)], [1.0]),
    ("one node: all of a shared path", 1, None, [("shared", 1000, {"2": [300, 300]}, None)], [1.0]),
    ("measured with 2, planned for 2", 2, None, [("shared", 1000, {"2": [300, 340]}, None)], [0.32]),
    ("measured with 2, planned for 4", 4, None, [("shared", 1000, {"2": [300, 340]}, None)], [0.16]),
    ("not saturated: no more than alone", 2, None, [("shared", 500, {"2": [600, 600]}, None)], [1.0]),
    (
        "the start-up probe ran beside another node's: its half, above that probe",
        2,
        None,
        [("shared", 300, {"2": [400, 440]}, 800)],
        [1.4],
    ),
    ("its half, at most what it moved alone", 2, None, [("shared", 300, {"2": [600, 600]}, 450)], [1.5]),
    ("not measured: a lower bound", 4, None, [("shared", 1000, None, None)], [0.25]),
    (
        "the most nodes measured below",
        4,
        None,
        [("shared", 1000, {"2": [300, 300], "8": [50] * 8}, None)],
        [0.15],
    ),
    (
        "only more nodes measured: the fewest",
        2,
        None,
        [("shared", 1000, {"8": [50] * 8, "4": [200] * 4}, None)],
        [0.4],
    ),
    ("configured node-local", 2, ["node-local"], [("shared", 1000, {"2": [300, 300]}, None)], [1.0]),
    ("configured shared", 2, ["shared"], [("node-local", 1000, None, None)], [0.5]),
    (
        "node-local and shared",
        2,
        None,
        [("node-local", 3000, None, None), ("shared", 800, {"2": [400, 400]}, None)],
        [1.0, 0.5],
    ),
]


@pytest.mark.parametrize(
    ("nodes", "configured", "paths", "expected"),
    [c[1:] for c in NODE_SHARES],
    ids=[c[0] for c in NODE_SHARES],
)
def test_each_node_is_planned_with_its_part_of_a_shared_path(
    nodes: int,
    configured: list[str] | None,
    paths: list[tuple[str, int, dict[str, list[int]] | None, int | None]],
    expected: list[float],
) -> None:
    """The nodes share equally what the shared path moved with all of them at once, each at most what
    it moved alone in the same measurement; node-local paths are each node's own. This node is node0."""
    from mlp_offload.engine import profiles

    probes = [
        {
            "device_id": f"0:{i}",
            "locality": locality,
            "read_bytes_per_s": mixed * MiB,
            "write_bytes_per_s": mixed * MiB,
            "mixed_bytes_per_s": mixed * MiB,
            "concurrent_bytes_per_s": None,
            "best_read": {"max_inflight": 8, "chunk_size": 4 << 20},
            **(
                {}
                if measured is None
                else {
                    "across_nodes": {
                        n: {
                            "hosts": [f"node{k}" for k in range(len(rates))],
                            "alone_bytes_per_s": [(alone or mixed) * MiB] * len(rates),
                            "together_bytes_per_s": [r * MiB for r in rates],
                            "secs": 3.0,
                            "probed_at": 0.0,
                        }
                        for n, rates in measured.items()
                    }
                }
            ),
        }
        for i, (locality, mixed, measured, alone) in enumerate(paths)
    ]
    profile = profiles.Profile(paths=[f"/p{i}" for i in range(len(paths))], probes=probes, probed_at=0.0)
    assert profile.node_share(nodes, configured, host="node0") == pytest.approx(expected)
    for i in range(len(paths)):
        note = profiles.across_nodes_note(probes[i], nodes)
        assert ("not measured" in note) == ("across_nodes" not in probes[i]), note


# Two ranks of a gloo group, each standing in for a node (its host name replaced: one machine has one),
# measure one directory each as a shared path: argv is the rank, the port, the directory, the output.
ACROSS_NODES = """
import json, sys, types
import torch.distributed as dist
from mlp_offload.engine import profiles
rank, port, directory, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
profiles.socket = types.SimpleNamespace(gethostname=lambda: f"node{rank}")
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
probe = {"locality": "shared", "best_read": {"chunk_size": 1 << 20, "max_inflight": 4},
         "pages": {"chosen": "small"}, "mixed_bytes_per_s": 1e9}
profile = profiles.Profile([directory], [probe], 0.0)
options = profiles.ProbeOptions(sustained_bytes=8 << 20, together_secs=0.2)
try:
    nodes = profiles.measure_across_nodes(profile, options, save=False)
    result = {"nodes": nodes, "across_nodes": probe.get("across_nodes")}
except Exception as e:
    result = {"error": type(e).__name__, "message": str(e)}
# As a job ends: without it gloo's threads may still be joinable when the interpreter exits (SIGABRT).
dist.destroy_process_group()
open(out, "w").write(json.dumps(result))
"""


def across_nodes(dirs: list[Path], tmp_path: Path) -> list[dict[str, Any]]:
    from deepspeed_runs import free_port

    port = str(free_port())
    outs = [tmp_path / f"node{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-c", ACROSS_NODES, str(r), port, str(dirs[r]), str(outs[r])])
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    return [json.loads(o.read_text()) for o in outs]


def test_a_shared_path_is_measured_from_each_node_alone_and_from_all_at_once(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    results = across_nodes(work_dirs[:2], tmp_path)
    for result in results:
        assert result["nodes"] == 2, result
        measured = result["across_nodes"]["2"]
        assert measured["hosts"] == ["node0", "node1"]
        assert all(r > 0 for r in measured["alone_bytes_per_s"] + measured["together_bytes_per_s"])
        assert (measured["secs"], measured["together_secs"]) == (0.2, pytest.approx(0.6))
    figures = [{k: v for k, v in r["across_nodes"]["2"].items() if k != "probed_at"} for r in results]
    assert figures[0] == figures[1], "every rank keeps the same figures"
    assert not any(p.name.startswith(".mlp-offload") for d in work_dirs[:2] for p in d.iterdir())


def test_a_node_whose_measurement_fails_stops_every_rank_naming_it(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """Node 1's directory is missing: it raises its own error, and node 0, waiting for the next window,
    raises at once, naming node 1, the path and the error (not after the process group's timeout)."""
    missing = work_dirs[1] / "not-there"
    node0, node1 = across_nodes([work_dirs[0], missing], tmp_path)
    assert node1["error"] == "FileNotFoundError" and str(missing) in node1["message"], node1
    assert node0["error"] == "AcrossNodesError", node0
    assert "node1" in node0["message"] and str(missing) in node0["message"], node0


# name, what a path was probed on, what it is on now, whether the saved profile still holds
MOUNTS = [
    ("node-local, same device", ("node-local", "ext4", "/dev/vda1", "254:0"), ("ext4", "254:0"), True),
    ("node-local, another device", ("node-local", "ext4", "/dev/vda1", "254:0"), ("ext4", "259:1"), False),
    # A network mount's device number is new at every mount: its source names it.
    ("shared, mounted again", ("shared", "lustre", "mgs@tcp:/fs", "0:61"), ("lustre", "0:62"), True),
    ("shared, another source", ("shared", "lustre", "mgs@tcp:/fs", "0:61"), ("lustre", "0:61"), False),
]


@pytest.mark.parametrize(("before", "now", "holds"), [c[1:] for c in MOUNTS], ids=[c[0] for c in MOUNTS])
def test_a_saved_profile_holds_while_its_paths_sit_on_the_same_mounts(
    before: tuple[str, str, str, str], now: tuple[str, str], holds: bool
) -> None:
    from mlp_offload.engine import profiles

    locality, fs_type, source, device = before
    probed = {"locality": locality, "fs_type": fs_type, "mount_source": source, "device_id": device}
    other_source = source if holds or locality == "node-local" else "other@tcp:/fs"
    current = {**probed, "fs_type": now[0], "device_id": now[1], "mount_source": other_source}
    assert (profiles._identity(current) == profiles._identity(probed)) == holds


def test_jobs_of_other_ranks_on_the_same_paths_each_keep_their_profile(
    work_dirs: list[Path], profile_dir: Path
) -> None:
    """Profiles of one path saved for jobs of 1 and of 2 ranks on the node (the probe's options): each job
    finds its own, neither replaces the other (a 1-rank resume of a 2-rank run probed again at every
    switch), a profile saved again for the same options replaces that one, and a job of 4 ranks finds
    none measured with its options."""
    from mlp_offload.engine import profiles

    path = os.path.realpath(work_dirs[0])
    probe = _core.probe_directory(path)
    now = time.time()
    saved = [(1, now - 300), (2, now - 200), (1, now - 100)]
    for ranks, when in saved:
        options = asdict(profiles.ProbeOptions(ranks=ranks))
        profiles.save_profile(profiles.Profile([path], [probe], when, options))
    assert len(json.loads(next(profile_dir.glob("*.json")).read_text())["entries"]) == 2
    for ranks, when in saved[1:]:
        found, why = profiles.saved_profile([path], profiles.ProbeOptions(ranks=ranks))
        assert found is not None and found.probed_at == when, (ranks, why)
    found, why = profiles.saved_profile([path], profiles.ProbeOptions(ranks=4))
    assert found is None and why == "the saved profile was measured with other probe options"


def test_plan_for_several_nodes_gives_each_its_part_of_the_shared_paths(work_dirs: list[Path]) -> None:
    """`plan --nodes 4` on [node-local, shared] (named so, as the work disk is local): without a
    measurement across nodes, each node gets a quarter of the shared path's figures, a lower bound the
    plan says it is, and the update it predicts is no faster than for one node."""
    dirs = [str(work_dirs[0]), str(work_dirs[2])]
    plan = ("plan", *PROBE_OPTIONS, "--params", "100M", "--sub-group-size", "2e7", "--host-memory", "64M")
    one = json.loads(run_cli(*plan, "--json", "-q", "--locality", "node-local,shared", *dirs).stdout)
    four = json.loads(
        run_cli(*plan, "--json", "-q", "--locality", "node-local,shared", "--nodes", "4", *dirs).stdout
    )
    assert (one["node_share"], four["node_share"]) == ([1.0, 1.0], [1.0, 0.25])
    assert four["locality"] == ["node-local", "shared"] and four["workload"]["nodes"] == 4
    assert four["plan"]["predicted_update_secs"] >= one["plan"]["predicted_update_secs"]
    table = run_cli(*plan, "-q", "--locality", "node-local,shared", "--nodes", "4", *dirs).stdout
    assert "shared by 4 nodes, each planned with 0.25" in table and "not measured across nodes" in table
    for bad in (["--locality", "node-local"], ["--locality", "node-local,remote"], ["--nodes", "0"]):
        out = run_cli(*plan, *bad, *dirs, check=False)
        assert out.returncode == 2 and bad[0] in out.stderr, out.stderr


def test_plan_counts_the_states_bytes(work_dirs: list[Path]) -> None:
    """`plan --state-bytes`: the chunks, the whole state and the plan in the mode's bytes (fp32, 10 and 6
    bytes a parameter, and 8 and 4 with the master weights in the parameters), each chunk a whole number of
    4 KiB pages for every array."""
    dirs = [str(work_dirs[0])]
    plan = ("plan", *PROBE_OPTIONS, "--params", "100M", "--sub-group-size", "2e7", "--host-memory", "64M")
    workloads, predicted = {}, {}
    for state_bytes in (12, 10, 6, 8, 4):
        out = json.loads(run_cli(*plan, "--json", "-q", "--state-bytes", str(state_bytes), *dirs).stdout)
        workloads[state_bytes], predicted[state_bytes] = out["workload"], out["plan"]["predicted_update_secs"]
    for state_bytes, workload in workloads.items():
        assert workload["state_bytes_per_param"] == state_bytes
        elements = workload["bytes_per_chunk"] // state_bytes
        assert workload["bytes_per_chunk"] == state_bytes * elements
        assert elements % (1024 if state_bytes == 12 else 2048) == 0, workload
    assert workloads[6]["whole_state_bytes"] < 0.55 * workloads[12]["whole_state_bytes"]
    assert workloads[4]["whole_state_bytes"] < 0.7 * workloads[6]["whole_state_bytes"]
    assert predicted[4] < predicted[6] < predicted[10] < predicted[12] and predicted[8] < predicted[10]
    out = run_cli(*plan, "--state-bytes", "7", *dirs, check=False)
    assert out.returncode == 2 and "--state-bytes" in out.stderr, out.stderr


def test_probe_table_marks_shared_devices(work_dirs: list[Path]) -> None:
    out = subprocess.run(
        [*PROBE, str(work_dirs[0]), str(work_dirs[1])],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "read MiB/s" in out.stdout and "(same device)" in out.stdout
    assert "node-local (ext4)" in out.stdout, "the work disk is the node's own"
    assert "MiB/s" in out.stderr, "progress lines go to stderr"
    # Before any measurement, the first line says how long the probe takes at the first pass's rate.
    first = out.stderr.splitlines()[0]
    plan = re.search(r"the probe takes about (\d+)-(\d+) s \(([\d.]+)-([\d.]+) GiB moved\)$", first)
    assert plan and int(plan[1]) <= int(plan[2]) and float(plan[3]) < float(plan[4]), first


def test_probe_of_a_missing_directory_names_it(work_dirs: list[Path]) -> None:
    missing = work_dirs[0] / "nope"
    out = subprocess.run([*PROBE, str(missing)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and str(missing) in out.stderr


@pytest.mark.parametrize(
    ("text", "value"), [("512M", 512 << 20), ("4k", 4096), ("1.5G", 3 << 29), ("10", 10), ("2MiB", 2 << 20)]
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_plan_splits_by_device_and_sizes_the_cache(work_dirs: list[Path]) -> None:
    # Two directories on one disk share it: the device gives what both moved together, split evenly
    # between them (how the probe's figures fell between the two, 1:3 to 1:10 on this disk under load,
    # is noise, and would starve one).
    out = run_cli(
        *("plan", *PROBE_OPTIONS, "--params", "100M", "--sub-group-size", "2e7", "--host-memory", "2G"),
        *("--json", "-q", str(work_dirs[0]), str(work_dirs[1])),
    )
    result = json.loads(out.stdout)
    plan, workload = result["plan"], result["workload"]
    # 100M parameters in subgroups of 2e7, chunks of up to 4 Mi elements: 5 of each subgroup, of 4e6
    # elements rounded up to 1024 (45.8 MiB).
    assert workload["subgroups"] == 5 and workload["chunks"] == 25
    assert workload["bytes_per_chunk"] == 12 * 4_000_768
    paths = result["paths"]
    assert paths[0]["device_id"] == paths[1]["device_id"]
    assert all(p["concurrent_bytes_per_s"] > 0 for p in paths)
    assert plan["weights"] == pytest.approx([0.5, 0.5], rel=1e-9)
    # 2 GiB hold 42 chunk buffers besides the gradient chunk: more than the 25 chunks, so all stay cached.
    assert plan["cached_subgroups"] == 25 and plan["io_floor_secs"] == 0.0
    # The update as the budget grows: never slower with more memory, no I/O once everything is cached.
    times = [b["predicted_update_secs"] for b in result["by_host_memory"]]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]
    assert result["by_host_memory"][-1]["cached_chunks"] == result["by_host_memory"][-1]["chunks"]
    # With the parameters on the paths too (bf16, ZeRO-Infinity): the forward and the backward each read
    # their 200 MB at the device's read figure, and the update, all of whose state is cached, writes them.
    with_params = ("--params-on-nvme", "2", str(work_dirs[0]), str(work_dirs[1]))
    args = ("plan", *PROBE_OPTIONS, "--params", "100M", "--sub-group-size", "2e7", "--host-memory", "2G")
    on_nvme = json.loads(run_cli(*args, "--json", "-q", *with_params).stdout)
    read, write = (max(p[key] for p in on_nvme["paths"]) for key in ("read_bytes_per_s", "write_bytes_per_s"))
    assert on_nvme["workload"]["params_on_nvme_bytes"] == 200_000_000
    assert on_nvme["plan"]["param_pass_secs"] == pytest.approx(2e8 / read, rel=1e-9)
    assert on_nvme["plan"]["predicted_update_secs"] == pytest.approx(2e8 / write, rel=1e-9)
    table = run_cli(*args, "-q", *with_params).stdout
    assert "the forward and the backward each read them in" in table, table


def test_plan_says_how_many_chunks_stream_to_the_accelerator(work_dirs: list[Path]) -> None:
    """`plan --accelerator-elements-per-s` with the host pass's and the copies' rates: the chunks the
    engine's model would send to the accelerator beside the host's pass (the last ones), and the update
    it predicts against the host's alone; a rate missing is refused by its option."""
    args = ("plan", *PROBE_OPTIONS, "--params", "100M", "--sub-group-size", "2e7", "--host-memory", "2G")
    # The host pass at 1.8e9 elements a second (of 12 bytes), the kernel at 2e10, PCIe at 25 GB/s.
    rates = ("--adam-bytes-per-s", "21600000000", "--accelerator-elements-per-s", "2e10")
    copies = ("--h2d-bytes-per-s", "25000000000", "--d2h-bytes-per-s", "25000000000")
    out = json.loads(run_cli(*args, *rates, *copies, "--json", "-q", str(work_dirs[0])).stdout)
    split, chunks = out["accelerator_split"], out["workload"]["chunks"]
    # Every chunk cached (no I/O floor): the 100M elements on the host take 55.6 ms.
    assert split["host_only_secs"] == pytest.approx(1e8 / 1.8e9, rel=1e-9)
    there = split["device_chunks"]
    assert 0 < len(there) < chunks and there == list(range(chunks - len(there), chunks))
    assert split["predicted_secs"] < split["host_only_secs"] and split["device_slots"] == 2
    table = run_cli(*args, *rates, *copies, "-q", str(work_dirs[0])).stdout
    assert f"on the accelerator beside the host's pass: {len(there)} of {chunks} chunks" in table, table
    without = json.loads(run_cli(*args, "--json", "-q", str(work_dirs[0])).stdout)
    assert without["accelerator_split"] is None
    # Most chunks read from the disk each step (an I/O floor above both sides' compute): the chunks the
    # engine sends there all the same (its model weighs no storage time), the update no faster than the
    # floor. Weighing the floor, the split chose none: every count ties with it.
    io_bound = (*args[:-1], "256M", *rates, *copies, "-q", str(work_dirs[0]))
    out = json.loads(run_cli(*io_bound, "--json").stdout)
    floor, split = out["plan"]["io_floor_secs"], out["accelerator_split"]
    assert floor > split["host_only_secs"] and 0 < len(split["device_chunks"]) < out["workload"]["chunks"]
    assert f"the update {floor:.2f} s against {floor:.2f} s on the host alone" in run_cli(*io_bound).stdout
    refused = run_cli(*args, *rates, *copies[2:], str(work_dirs[0]), check=False)
    assert refused.returncode == 2 and "--h2d-bytes-per-s: needed" in refused.stderr, refused.stderr
    # The master weights in bf16 parameters (a 4-byte state), a host pass too slow to keep any chunk:
    # every chunk there, each copying 8 bytes an element out and 6 back with the parameters in host
    # memory (`--params-in-host-memory`, offload_param: cpu), 6 and 4 on the accelerator: a third more
    # over the copies out, half again over the last copy back.
    slow = ("--state-bytes", "4", "--adam-bytes-per-s", "1000000", "--accelerator-elements-per-s", "2e10")
    splits = [
        json.loads(run_cli(*args, *slow, *copies, *more, "--json", "-q", str(work_dirs[0])).stdout)
        for more in ((), ("--params-in-host-memory",))
    ]
    there, on_host = (s["accelerator_split"] for s in splits)
    assert len(there["device_chunks"]) == len(on_host["device_chunks"]) == chunks
    assert 8 / 6 < on_host["device_secs"] / there["device_secs"] < 6 / 4
    # With the parameters on NVMe the engine streams no chunk there: refused by the option.
    nvme = run_cli(*args, *rates, *copies, "--params-on-nvme", "2", str(work_dirs[0]), check=False)
    assert nvme.returncode == 2 and "--params-on-nvme: no chunk streams" in nvme.stderr, nvme.stderr


def test_plan_rejects_a_budget_below_one_chunk_before_it_probes(
    work_dirs: list[Path], profile_dir: Path
) -> None:
    out = run_cli(
        *("plan", "--bytes", "16M", "--params", "1e9", "--host-memory", "8K", str(work_dirs[0])), check=False
    )
    assert out.returncode == 2 and "host_memory" in out.stderr and "no chunk" in out.stderr
    assert not list(profile_dir.glob("*.json")), "the path was probed before the budget was refused"


def test_plan_reuses_a_fresh_saved_profile_and_probes_again_when_stale(
    work_dirs: list[Path], profile_dir: Path
) -> None:
    dirs = [str(work_dirs[0]), str(work_dirs[1])]
    plan = ("plan", *PROBE_OPTIONS, "--params", "100M", "--sub-group-size", "2e7", "--host-memory", "2G")
    # Each case: extra arguments, whether the saved profile is used.
    cases = [
        ((), True),
        (("--reprobe",), False),
        (("--max-age-hours", "0"), False),
        (("--bytes", "8M"), False),  # other probe options
    ]
    run_cli(*PROBE[3:], "-q", *dirs)
    saved = next(profile_dir.glob("*.json"))
    for extra, reused in cases:
        before = json.loads(saved.read_text())
        out = run_cli(*plan, *extra, "--json", *dirs)
        assert json.loads(out.stdout)["profile_source"] == ("saved" if reused else "probed"), extra
        assert ("using the profile" in out.stderr) == reused, out.stderr
        after = json.loads(saved.read_text())
        assert (after == before) == reused, f"{extra}: a new probe replaces the saved one"
        # Put the original back so every case starts from the same saved profile.
        saved.write_text(json.dumps(before))
