"""`mlp-offload`: the command line. `mlp-offload probe DIR...` measures each storage path."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Sequence
from typing import Any

from mlp_offload import _core

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`"512M"` -> 536870912. K/M/G/T are powers of 1024."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 512M or 2G")
    scale = 1024 ** " KMGT".index((m.group(2) or " ").upper())
    return int(float(m.group(1)) * scale)


def _mib(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 2**20:,.0f}"


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns under a header and a rule."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return lines


def render_probe_table(results: Sequence[dict[str, Any]]) -> str:
    header = ["path", "device", "engine", "O_DIRECT", "read MiB/s", "best read", "write MiB/s", "best write"]
    rows = []
    devices = [r["device_id"] for r in results]
    for r in results:
        shared = " (shared)" if devices.count(r["device_id"]) > 1 else ""
        rows.append(
            [
                str(r["path"]),
                f"{r['device_name']} {r['device_id']}{shared}",
                r["engine"],
                "yes" if r["direct_io"] else "no",
                _mib(r["read_bytes_per_s"]),
                f"{r['best_read']['chunk_size'] >> 20} MiB x{r['best_read']['max_inflight']}",
                _mib(r["write_bytes_per_s"]),
                f"{r['best_write']['chunk_size'] >> 20} MiB x{r['best_write']['max_inflight']}",
            ]
        )
    lines = render_table(header, rows)
    if any(devices.count(d) > 1 for d in devices):
        lines.append("(shared): these paths are on one device and share its bandwidth")
    return "\n".join(lines)


def cmd_probe(args: argparse.Namespace) -> int:
    results = []
    for path in args.dirs:

        def progress(line: str) -> None:
            if not args.quiet:
                print(line, file=sys.stderr, flush=True)

        results.append(
            _core.probe_bandwidth(
                path,
                bytes=args.bytes,
                chunk_sizes=args.chunk_sizes,
                depths=args.depths,
                engine=args.engine,
                progress=progress,
            )
        )
    for r in results:
        r["path"] = str(r["path"])
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(render_probe_table(results))
    return 0


def parse_count(text: str) -> int:
    """`"1.3e9"`, `"130M"`, `"20000000"` -> a count (K/M/G/T are powers of 1000 here)."""
    t = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9, "T": 10**12}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale != 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count like 1.3e9 or 130M") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return int(value)


# fp32 master weights plus Adam's exp_avg and exp_avg_sq, per parameter.
_STATE_BYTES_PER_PARAM = 12


def cmd_plan(args: argparse.Namespace) -> int:
    probes = [
        _core.probe_bandwidth(
            path,
            bytes=args.bytes,
            progress=None if args.quiet else lambda line: print(line, file=sys.stderr, flush=True),
        )
        for path in args.dirs
    ]
    group = min(args.sub_group_size, args.params)
    subgroup_bytes = group * _STATE_BYTES_PER_PARAM
    subgroups = -(-args.params // group)
    plan = _core.plan_update(
        [
            (p["device_id"], p["read_bytes_per_s"], p["write_bytes_per_s"], p["best_read"]["max_inflight"])
            for p in probes
        ],
        subgroups=subgroups,
        read_bytes_per_subgroup=subgroup_bytes,
        write_bytes_per_subgroup=subgroup_bytes,
        host_bytes_per_subgroup=subgroup_bytes,
        host_memory=args.host_memory,
        adam_secs_per_subgroup=args.adam_secs_per_subgroup,
    )
    workload = {
        "params": args.params,
        "sub_group_size": group,
        "subgroups": subgroups,
        "bytes_per_subgroup": subgroup_bytes,
        "host_memory": args.host_memory,
        "adam_secs_per_subgroup": args.adam_secs_per_subgroup,
    }
    if args.json:
        for p in probes:
            p["path"] = str(p["path"])
        print(json.dumps({"workload": workload, "paths": probes, "plan": plan}, indent=2))
        return 0
    header = ["path", "device", "read MiB/s", "write MiB/s", "weight", "in flight"]
    rows = [
        [
            str(p["path"]),
            f"{p['device_name']} {p['device_id']}",
            _mib(p["read_bytes_per_s"]),
            _mib(p["write_bytes_per_s"]),
            f"{w:.3f}",
            str(n),
        ]
        for p, w, n in zip(probes, plan["weights"], plan["max_inflight"], strict=True)
    ]
    print("\n".join(render_table(header, rows)))
    print(
        f"\n{subgroups} subgroups of {group:,} parameters "
        f"({subgroup_bytes / 2**20:,.0f} MiB of fp32 state each); "
        f"{plan['cached_subgroups']} stay in host memory"
    )
    print(f"I/O per uncached subgroup: {plan['io_secs_per_subgroup']:.3f} s")
    print(f"I/O floor of the update phase: {plan['io_floor_secs']:.2f} s")
    print(f"predicted update phase: {plan['predicted_update_secs']:.2f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlp-offload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    probe = sub.add_parser(
        "probe",
        help="measure each storage path's sequential read and write bandwidth",
        description="Measures each directory's sequential O_DIRECT read and write bandwidth through "
        "mlp-offload's own engine, over a sweep of chunk sizes and in-flight limits, and reports the "
        "best of each. Writes and removes a temporary file of --bytes in each directory.",
    )
    probe.add_argument("dirs", nargs="+", metavar="DIR", help="existing, writable directories")
    probe.add_argument("--json", action="store_true", help="print JSON instead of a table")
    probe.add_argument("--bytes", type=parse_size, default=None, help="bytes per measurement (512M)")
    probe.add_argument(
        "--chunk-sizes",
        type=lambda s: [parse_size(x) for x in s.split(",")],
        default=None,
        help="comma-separated chunk sizes to try (1M,4M,16M)",
    )
    probe.add_argument(
        "--depths",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="comma-separated in-flight limits to try (4,16)",
    )
    probe.add_argument("--engine", choices=["auto", "io_uring", "threads"], default="auto")
    probe.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    probe.set_defaults(func=cmd_probe)

    plan = sub.add_parser(
        "plan",
        help="probe the paths and plan an update phase: split weights, cache size, predicted time",
        description="Probes each directory, then applies the performance model (docs/model.md) to a "
        "ZeRO-3 optimizer-state workload: split weights per path, in-flight limits, how many subgroups "
        "the host memory keeps cached, the I/O floor and the predicted update-phase time.",
    )
    plan.add_argument("dirs", nargs="+", metavar="DIR", help="existing, writable directories")
    plan.add_argument(
        "--params", type=parse_count, required=True, help="parameters of this rank (1.3e9, 130M)"
    )
    plan.add_argument(
        "--sub-group-size", type=parse_count, default=10**9, help="DeepSpeed's sub_group_size (1e9)"
    )
    plan.add_argument("--host-memory", type=parse_size, required=True, help="host memory for buffers (16G)")
    plan.add_argument(
        "--adam-secs-per-subgroup", type=float, default=0.0, help="measured CPU Adam time per subgroup"
    )
    plan.add_argument("--bytes", type=parse_size, default=None, help="bytes per probe measurement (512M)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (OSError, ValueError) as e:
        print(f"mlp-offload: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
