"""`mlp-offload`: the command line. `probe DIR...` measures storage paths and saves their profile;
`plan DIR...` applies the performance model to a workload on those paths; `train` is the main job."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from mlp_offload import profiles, units
from mlp_offload import train as train_job


def parse_size(text: str) -> int:
    """`"512M"` -> 536870912 (see `mlp_offload.units`), as an argparse type."""
    try:
        return units.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    header = [
        "path",
        "device",
        "engine",
        "O_DIRECT",
        "read MiB/s",
        "best read",
        "write MiB/s",
        "best write",
        "mixed MiB/s",
        "together MiB/s",
    ]
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
                _mib(r["mixed_bytes_per_s"]),
                "-" if r["concurrent_bytes_per_s"] is None else _mib(r["concurrent_bytes_per_s"]),
            ]
        )
    lines = render_table(header, rows)
    lines.append(
        "mixed: reads and writes at once on that path alone; together: the same on every path at once"
    )
    if any(devices.count(d) > 1 for d in devices):
        lines.append("(shared): these paths are on one device and share its bandwidth")
    return "\n".join(lines)


def _progress(args: argparse.Namespace) -> Any:
    if args.quiet:
        return None
    return lambda line: print(line, file=sys.stderr, flush=True)


def _probe_options(args: argparse.Namespace) -> profiles.ProbeOptions:
    return profiles.ProbeOptions(
        bytes=args.bytes,
        chunk_sizes=args.chunk_sizes,
        depths=args.depths,
        engine=args.engine,
        together_secs=args.together_secs,
    )


def cmd_probe(args: argparse.Namespace) -> int:
    profile = profiles.probe(args.dirs, _probe_options(args), _progress(args))
    if not args.no_save:
        file = profiles.save_profile(profile)
        if not args.quiet:
            print(f"profile saved in {file}", file=sys.stderr)
    if args.json:
        print(json.dumps(profile.probes, indent=2))
    else:
        print(render_probe_table(profile.probes))
    return 0


def parse_count(text: str) -> int:
    """`"1.3e9"`, `"130M"` -> a count (see `mlp_offload.units`), as an argparse type."""
    try:
        return units.parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# fp32 master weights plus Adam's exp_avg and exp_avg_sq, per parameter.
_STATE_BYTES_PER_PARAM = 12


def cmd_plan(args: argparse.Namespace) -> int:
    profile, source = profiles.load_or_probe(
        args.dirs,
        _probe_options(args),
        reprobe=args.reprobe,
        max_age_s=args.max_age_hours * 3600,
        progress=_progress(args),
    )
    if not args.quiet:
        print(source, file=sys.stderr)
    probes = profile.probes
    group = min(args.sub_group_size, args.params)
    subgroup_bytes = group * _STATE_BYTES_PER_PARAM
    subgroups = -(-args.params // group)
    plan = profile.plan_subgroups(
        subgroups=subgroups,
        bytes_per_subgroup=subgroup_bytes,
        host_memory=args.host_memory,
        adam_secs_per_subgroup=args.adam_secs_per_subgroup,
        fwd_bwd_secs=args.fwd_bwd_secs,
    )
    workload = {
        "params": args.params,
        "sub_group_size": group,
        "subgroups": subgroups,
        "bytes_per_subgroup": subgroup_bytes,
        "host_memory": args.host_memory,
        "adam_secs_per_subgroup": args.adam_secs_per_subgroup,
        "fwd_bwd_secs": args.fwd_bwd_secs,
    }
    if args.json:
        print(
            json.dumps(
                {"workload": workload, "profile_source": profile.source, "paths": probes, "plan": plan},
                indent=2,
            )
        )
        return 0
    header = [
        "path",
        "device",
        "read MiB/s",
        "write MiB/s",
        "mixed MiB/s",
        "together MiB/s",
        "weight",
        "in flight",
    ]
    rows = [
        [
            str(p["path"]),
            f"{p['device_name']} {p['device_id']}",
            _mib(p["read_bytes_per_s"]),
            _mib(p["write_bytes_per_s"]),
            _mib(p["mixed_bytes_per_s"]),
            "-" if p["concurrent_bytes_per_s"] is None else _mib(p["concurrent_bytes_per_s"]),
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
    if plan["hidden_io_secs"] > 0:
        print(f"of which forward and backward hide: {plan['hidden_io_secs']:.2f} s")
    print(f"predicted update phase: {plan['predicted_update_secs']:.2f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlp-offload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    probe = sub.add_parser(
        "probe",
        help="measure each storage path and save the profile",
        description="Measures each directory through mlp-offload's own engine with O_DIRECT: sequential "
        "read and write bandwidth over a sweep of chunk sizes and in-flight limits (the best of each is "
        "kept), then reads and writes at once, then, for several paths, all of them at once. Writes and "
        "removes a temporary file of --bytes in each directory. The profile is saved per host "
        f"({profiles.profile_file()}; MLP_OFFLOAD_PROFILE_DIR moves it) for `plan` and training to reuse.",
    )
    probe.add_argument("dirs", nargs="+", metavar="DIR", help="existing, writable directories")
    probe.add_argument("--json", action="store_true", help="print JSON instead of a table")
    probe.add_argument("--no-save", action="store_true", help="do not save the profile")
    _add_probe_options(probe)
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
    plan.add_argument(
        "--fwd-bwd-secs", type=float, default=0.0, help="forward+backward time per step, when known"
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.add_argument(
        "--reprobe", action="store_true", help="measure the paths again even if a fresh profile is saved"
    )
    plan.add_argument(
        "--max-age-hours",
        type=float,
        default=profiles.DEFAULT_MAX_AGE_S / 3600,
        help="reuse saved profiles up to this age (168)",
    )
    _add_probe_options(plan)
    plan.set_defaults(func=cmd_plan)
    train = sub.add_parser(
        "train",
        help="the main job: train a small LLaMA-style model with the optimizer state offloaded",
        description="Trains a byte-level LLaMA-style model on the corpus mlp-offload ships, under DeepSpeed "
        "ZeRO-3 with the optimizer state in mlp-offload's store on the given paths, with a progress bar, a "
        "summary table (phase times, bytes per tier, predicted against measured update time) and a chart.",
    )
    train_job.add_arguments(train)
    train.set_defaults(func=train_job.run)
    return parser


def _add_probe_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bytes", type=parse_size, default=None, help="bytes per measurement (256M)")
    parser.add_argument(
        "--chunk-sizes",
        type=lambda s: [parse_size(x) for x in s.split(",")],
        default=None,
        help="comma-separated chunk sizes to try (1M,4M,16M)",
    )
    parser.add_argument(
        "--depths",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="comma-separated in-flight limits to try (4,16)",
    )
    parser.add_argument("--together-secs", type=float, default=None, help="seconds all paths run at once (3)")
    parser.add_argument("--engine", choices=["auto", "io_uring", "threads"], default="auto")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


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
