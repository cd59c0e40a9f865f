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
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
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
