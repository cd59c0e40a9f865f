"""Each node's share of a shared tier: what the probe measures across nodes and plans with, against what
the update gets when both nodes run it at once, on a GlusterFS volume both nodes of a two-node cluster on
this machine mount (`tests/support/cluster.py`; root).

    make bench-cluster                       # 130M wide model, 1 rank per node, 3 measured steps

Steps, all in one run:
1. `mlp-offload probe` of the volume under torchrun, one process per node: each node's own figures,
   then the volume from each node alone and from both at once (`across_nodes`). Each node's plan takes
   its mixed figure times its share (`Profile.node_share(2)`).
2. `cargo bench`'s store-against-fio comparison on the volume, from node 0 (`MLP_OFFLOAD_BENCH_QUICK`).
3. The update alone: our engine on node 0 only (one rank, the model's whole state), state on the volume
   and streaming (`host_memory` well below the state), `benches/e2e.py`'s worker; per step, the bytes
   each rank moved on the volume over the seconds it was busy there (the telemetry's figure, which the
   tuner reads too).
4. The update on both nodes at once: the same job as 2 ranks, one per node.

It prints, per node: the plan's figure (mixed x share), the update's rate with both nodes, and their
ratio (the issue's target: within 15%); the node's part of what the volume gave, planned against
delivered; the same ratio for a plan without the measurement across nodes (the node's mixed figure
alone); the share the probe measured (both nodes over alone) beside the update's (both nodes over
node 0 alone); and each step's rate over the median of the node's steps before it (what the plan goes
by once the job runs). Then how far the volume itself moved between the probe and the update: both
nodes' updates over the probe's aggregate. JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

from cluster import GlusterVolume, TwoNodeCluster, cluster_unavailable  # noqa: E402
from deepspeed_runs import free_port, harness_env  # noqa: E402
from mlp_offload.app.tables import render_table  # noqa: E402
from mlp_offload.engine.profiles import Profile  # noqa: E402

E2E = ROOT / "benches" / "e2e.py"


def torchrun_all(
    cluster: TwoNodeCluster, nodes: int, script: list[str], env: dict[str, str], logs: Path
) -> None:
    """`script` under torchrun, one process on each of the first `nodes` nodes; raises with the log of a
    node that failed."""
    port = free_port()
    procs = []
    for k in range(nodes):
        node_env = {**harness_env(OMP_NUM_THREADS="1", **cluster.env(k)), **env}
        node_env["MLP_OFFLOAD_BENCH_RESULT"] = str(logs / f"result.node{k}.json")
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            node_env.pop(key, None)
        log = logs / f"node{k}.log"
        with log.open("w") as sink:
            argv = cluster.torchrun(k, script, port, 1, nodes)
            procs.append((log, subprocess.Popen(argv, env=node_env, stdout=sink, stderr=subprocess.STDOUT)))
    failed = [log for log, proc in procs if proc.wait(timeout=1800) != 0]
    if failed:
        raise SystemExit("\n".join(f"{log}:\n{log.read_text()[-4000:]}" for log in failed))


def bench_binary() -> str:
    """The `cargo bench` binary of `benches/io_throughput.rs`, built if needed."""
    out = subprocess.run(
        ["cargo", "bench", "--bench", "io_throughput", "--no-run", "--message-format", "json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    for line in out.stdout.splitlines():
        message = json.loads(line)
        if message.get("reason") == "compiler-artifact" and message.get("executable"):
            if message["target"]["name"] == "io_throughput":
                return str(message["executable"])
    raise SystemExit("cargo bench --no-run built no io_throughput binary")


def store_against_fio(cluster: TwoNodeCluster, state: Path, out: Path, sizes: str) -> dict[str, Any]:
    """`cargo bench`'s comparison of our store with fio (`MLP_OFFLOAD_BENCH_QUICK`), run on node 0 on
    the mounted volume: the report it writes."""
    env = {
        "MLP_OFFLOAD_BENCH_QUICK": "1",
        "MLP_OFFLOAD_BENCH_PATHS": str(state),
        "MLP_OFFLOAD_BENCH_SIZES": sizes,
        "MLP_OFFLOAD_BENCH_OUT": str(out),
    }
    argv = cluster.command(0, ["env", *(f"{k}={v}" for k, v in env.items()), bench_binary(), "--bench"])
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"cargo bench on the volume failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    print(done.stdout, file=sys.stderr)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def update_rates(result: dict[str, Any]) -> list[float]:
    """Per measured step, the bytes the rank moved on its one path over the seconds it was busy there."""
    records = [r for r in result["telemetry"] if r["event"] == "step"][-len(result["steps"]) :]
    return [
        (p["read_bytes"] + p["write_bytes"]) / p["busy_secs"]
        for p in (r["paths"][0] for r in records)
        if p["busy_secs"] > 0
    ]


def next_over_earlier(rates: list[float]) -> list[float]:
    """Each step's rate over the median of the steps before it, from the second step on."""
    return [rates[i] / statistics.median(rates[:i]) for i in range(1, len(rates))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.root).resolve()
    subprocess.run(["rm", "-rf", str(root)], check=True)
    root.mkdir(parents=True)
    profiles = root / "profiles"
    env = {"MLP_OFFLOAD_PROFILE_DIR": str(profiles)}
    with TwoNodeCluster(root, "bench") as cluster, GlusterVolume(cluster, root / "brick"):
        state = cluster.shared / "state"
        cluster.run(0, ["mkdir", "-p", str(state)])
        print("probe, each node alone, then across nodes ...", file=sys.stderr, flush=True)
        probe_logs = root / "probe"
        probe_logs.mkdir()
        probe = ["-m", "mlp_offload.app.cli", "probe", *args.probe.split(), "-q", str(state)]
        torchrun_all(cluster, 2, probe, env, probe_logs)
        saved = []
        hostnames = [node.hostname for node in cluster.nodes]
        for node in cluster.nodes:
            file = profiles / f"{node.hostname}.json"
            data = json.loads(file.read_text())
            (entry,) = data["entries"]
            # The engine (one rank per node) takes this profile as its own instead of probing again.
            entry["options"]["ranks"] = 1
            for key in ("bytes", "sustained_bytes", "chunk_sizes", "depths", "together_secs"):
                entry["options"][key] = None
            file.write_text(json.dumps(data))
            saved.append(entry)
        print("cargo bench against fio on the volume, node 0 ...", file=sys.stderr, flush=True)
        # Empty sizes: no comparison.
        fio = (
            store_against_fio(cluster, state, root / "vs-fio.json", args.fio_sizes)
            if args.fio_sizes
            else None
        )
        spec = {
            "contender": "mlp-offload",
            "model": "wide",
            "size": args.size,
            "seq": 128,
            "micro_batch": 1,
            "sub_group_size": args.sub_group_size,
            "paths": [str(state)],
            "warmup": 1,
            "steps": args.steps,
            "section_keys": {"host_memory": args.host_memory, "weights": "auto"},
            "trace_block": False,
        }
        spec_file = root / "spec.json"
        spec_file.write_text(json.dumps(spec))
        results: dict[str, list[dict[str, Any]]] = {}
        for name, nodes in (("alone", 1), ("both", 2)):
            print(f"the update, {name} ...", file=sys.stderr, flush=True)
            cluster.run(0, ["sh", "-c", f"rm -rf {state}/rank*"])
            logs = root / name
            logs.mkdir()
            torchrun_all(cluster, nodes, [str(E2E), "--worker", str(spec_file)], env, logs)
            results[name] = [json.loads((logs / f"result.node{k}.json").read_text()) for k in range(nodes)]
    alone_rates = update_rates(results["alone"][0])
    alone_update = statistics.median(alone_rates)
    per_node = []
    for k, entry in enumerate(saved):
        probe_k = entry["probes"][0]
        profile = Profile(entry["paths"], entry["probes"], entry["probed_at"])
        measured = probe_k["across_nodes"]["2"]
        # This node's windows in the measurement, and its part of the volume.
        at = measured["hosts"].index(hostnames[k])
        share = profile.node_share(2, host=hostnames[k])[0]
        planned = probe_k["mixed_bytes_per_s"] * share
        both_rates = update_rates(results["both"][k])
        both_update = statistics.median(both_rates)
        per_node.append(
            {
                "node": k,
                "probe_mixed_bytes_per_s": probe_k["mixed_bytes_per_s"],
                "probe_alone_bytes_per_s": measured["alone_bytes_per_s"][at],
                "probe_together_bytes_per_s": measured["together_bytes_per_s"][at],
                "node_share": share,
                "planned_bytes_per_s": planned,
                "update_both_bytes_per_s": both_update,
                "update_both_rates": both_rates,
                # What the plan goes by once the job runs: each step's rate over the median of the
                # node's steps before it (the planner's measured rates).
                "update_next_over_earlier": next_over_earlier(both_rates),
                "update_over_plan": both_update / planned,
                # What a plan of this node as the path's only user (no measurement across nodes) missed by.
                "update_over_alone_plan": both_update / probe_k["mixed_bytes_per_s"],
                "probe_share": measured["together_bytes_per_s"][at] / measured["alone_bytes_per_s"][at],
                "update_share": both_update / alone_update,
            }
        )
    # Each node's part of what the volume gave: planned (its plan over the nodes' plans) against
    # delivered (its update over both nodes' updates). How far the plan's rate misses is this part's miss
    # times the volume's own drift between the probe and the update (both nodes' updates over the
    # probe's aggregate).
    planned_sum = sum(n["planned_bytes_per_s"] for n in per_node)
    update_sum = sum(n["update_both_bytes_per_s"] for n in per_node)
    for n in per_node:
        n["part_planned"] = n["planned_bytes_per_s"] / planned_sum
        n["part_delivered"] = n["update_both_bytes_per_s"] / update_sum
    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "args": vars(args),
        "volume_update_over_probe": update_sum / sum(n["probe_together_bytes_per_s"] for n in per_node),
        "update_alone_bytes_per_s": alone_update,
        "update_alone_rates": alone_rates,
        "nodes": per_node,
        "store_vs_fio": fio,
        "steps": {name: [r["steps"] for r in rs] for name, rs in results.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default="target/bench-cluster", help="where the cluster lives (emptied)")
    parser.add_argument("--size", default="130M", help="wide model size (130M)")
    parser.add_argument("--sub-group-size", type=int, default=10_000_000)
    parser.add_argument("--host-memory", default="256M", help="host memory per rank, below the state (256M)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after one warm-up (3)")
    parser.add_argument(
        "--probe",
        default="--bytes 64M --sustained-bytes 512M --chunk-sizes 4M --depths 4,16 --together-secs 3",
        help="the probe's options",
    )
    parser.add_argument(
        "--fio-sizes",
        default="4M,16M",
        help="object sizes of the store-against-fio comparison (4M,16M; empty: none)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON report")
    args = parser.parse_args()
    if os.geteuid() != 0 or (why := cluster_unavailable()):
        raise SystemExit(f"bench-cluster: {why or 'needs root (network namespaces, mounts)'}")
    report = run(args)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    mib = 2**20
    print(f"update on node 0 alone: {report['update_alone_bytes_per_s'] / mib:,.0f} MiB/s")
    header = ["node", "probe mixed", "share", "plan (mixed x share)", "update, both nodes", "update/plan"]
    header += ["part: plan / update", "update/mixed", "share: probe", "share: update", "step/earlier"]
    rows = [
        [
            str(n["node"]),
            f"{n['probe_mixed_bytes_per_s'] / mib:,.0f} MiB/s",
            f"{n['node_share']:.2f}",
            f"{n['planned_bytes_per_s'] / mib:,.0f} MiB/s",
            f"{n['update_both_bytes_per_s'] / mib:,.0f} MiB/s",
            f"{n['update_over_plan']:.2f}",
            f"{n['part_planned']:.3f} / {n['part_delivered']:.3f}",
            f"{n['update_over_alone_plan']:.2f}",
            f"{n['probe_share']:.2f}",
            f"{n['update_share']:.2f}",
            ", ".join(f"{r:.2f}" for r in n["update_next_over_earlier"]),
        ]
        for n in report["nodes"]
    ]
    print("\n".join(render_table(header, rows)))
    print(
        f"the volume with both nodes: the update moved {report['volume_update_over_probe']:.2f}x the "
        "probe's aggregate"
    )
    if report["store_vs_fio"] is None:
        return 0
    print("\nthe store against fio on the volume, node 0 alone (best of depths 8 and 32):")
    fio_rows = [
        [
            r["op"],
            f"{r['object_bytes'] >> 20} MiB",
            f"{r['ours_bytes_per_s'] / mib:,.0f}",
            f"{r['fio_bytes_per_s'] / mib:,.0f}",
            f"{r['ratio']:.2f}",
        ]
        for r in report["store_vs_fio"]["per_path"]
    ]
    print("\n".join(render_table(["op", "request", "ours MiB/s", "fio MiB/s", "ratio"], fio_rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
