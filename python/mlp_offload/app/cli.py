"""`mlp-offload`: the command line. `doctor [PATH...]` checks the machine and the paths before a job;
`probe DIR...` measures storage paths and saves their profile; `plan DIR...` applies the performance model
to a workload on those paths; `train` is the main job."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from mlp_offload import _core
from mlp_offload.app import doctor
from mlp_offload.app import train as train_job
from mlp_offload.app.tables import render_table
from mlp_offload.common import units
from mlp_offload.engine import accelerator_model, memory, profiles


def parse_size(text: str) -> int:
    """`"512M"` -> 536870912 (see `mlp_offload.common.units`), as an argparse type."""
    try:
        return units.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _mib(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 2**20:,.0f}"


def _pages(pages: dict[str, Any]) -> str:
    read = pages["huge_read_bytes_per_s"] / pages["small_read_bytes_per_s"]
    write = pages["huge_write_bytes_per_s"] / pages["small_write_bytes_per_s"]
    return f"{pages['chosen']} ({read:.2f}x, {write:.2f}x)"


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
        "pages",
        "locality",
    ]
    rows = []
    devices = [r["device_id"] for r in results]
    for r in results:
        shared = " (same device)" if devices.count(r["device_id"]) > 1 else ""
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
                _pages(r["pages"]),
                f"{r['locality']} ({r['fs_type']})",
            ]
        )
    lines = render_table(header, rows)
    lines.append(
        "mixed: reads and writes at once on that path alone; together: the same on every path at once; "
        "pages: the host buffers' pages the path's figures were measured with, and huge pages' read and "
        "write rates over 4 KiB pages' at the best settings; locality: whether other nodes mount the same "
        "files (a shared path's figures are this node's alone)"
    )
    if any(devices.count(d) > 1 for d in devices):
        lines.append("(same device): these paths are on one device and share its bandwidth")
    seen: set[str] = set()
    for r in results:
        if (sharing := r.get("sharing")) and r["device_id"] not in seen:
            seen.add(r["device_id"])
            lines.append(
                f"{r['device_name']} {r['device_id']}: {sharing['streams']} ranks at once: "
                f"{_mib(sharing['free_bytes_per_s'])} MiB/s each at its own limit; under "
                f"{sharing['limit']} requests in flight for the node, {_mib(sharing['shared_bytes_per_s'])} "
                f"MiB/s request by request, {_mib(sharing['turns_bytes_per_s'])} MiB/s by turns; the model "
                + (
                    f"limits the node, {profiles.sharing_choice(sharing)}"
                    if profiles.admission_helps(sharing)
                    else "leaves each rank its own limit"
                )
            )
    for r in results:
        for nodes in sorted(int(n) for n in r.get("across_nodes") or {}):
            lines.append(f"{r['path']}: {profiles.across_nodes_note(r, nodes)}")
    return "\n".join(lines)


def _progress(args: argparse.Namespace) -> Any:
    if args.quiet:
        return None
    return lambda line: print(line, file=sys.stderr, flush=True)


def _probe_options(args: argparse.Namespace) -> profiles.ProbeOptions:
    return profiles.ProbeOptions(
        bytes=args.bytes,
        sustained_bytes=args.sustained_bytes,
        chunk_sizes=args.chunk_sizes,
        depths=args.depths,
        engine=args.engine,
        together_secs=args.together_secs,
        ranks=args.ranks,
    )


def cmd_probe(args: argparse.Namespace) -> int:
    with _across_nodes() as nodes:
        options = _probe_options(args)
        profile = profiles.probe(args.dirs, options, _progress(args))
        if not args.no_save:
            file = profiles.save_profile(profile)
            if not args.quiet:
                print(f"profile saved in {file}", file=sys.stderr)
        if nodes > 1:
            profiles.measure_across_nodes(profile, options, progress=_progress(args), save=not args.no_save)
    if args.json:
        print(json.dumps(profile.probes, indent=2))
    else:
        print(render_probe_table(profile.probes))
    return 0


@contextlib.contextmanager
def _across_nodes() -> Iterator[int]:
    """Under torchrun (`WORLD_SIZE` above 1): the job's process group (gloo), one process per node, and
    the number of nodes; else 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        yield 1
        return
    if (local := int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) != 1:
        raise ValueError(
            "mlp-offload probe across nodes runs one process per node (torchrun --nproc-per-node 1), "
            f"not {local}"
        )
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        yield world
    finally:
        dist.destroy_process_group()


def parse_count(text: str) -> int:
    """`"1.3e9"`, `"130M"` -> a count (see `mlp_offload.common.units`), as an argparse type."""
    try:
        return units.parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# Budgets of the `plan` table, as fractions of what caching the whole state takes.
PLAN_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1)
# `plan --state-bytes`: the states DeepSpeed keeps with ZeRO-3 and an offloaded optimizer (fp32;
# half-precision master weights beside fp32 moments; bf16 weights and moments), and the last two with the
# master weights in the parameters (`master_in_params`).
STATE_BYTES_CHOICES = (12, 10, 6, 8, 4)
MASTER_IN_PARAMS_STATE_BYTES = (8, 4)
# The one with fp32 master weights: the others' are in half precision.
FP32_STATE_BYTES = 12


def node_part(profile: profiles.Profile, args: argparse.Namespace) -> list[float]:
    """Per path, one rank's part of what the probe measured: of each device the node's `--ranks` share,
    the way "auto" would share it, and of a shared path, its node's part among `--nodes`."""
    return [
        rank * node
        for rank, node in zip(
            profile.rank_share(args.ranks), profile.node_share(args.nodes, args.locality), strict=True
        )
    ]


def plan_at(
    profile: profiles.Profile, numels: list[int], host_memory: int, args: argparse.Namespace
) -> tuple[memory.ChunkLayout, dict[str, Any]]:
    """The streaming update's chunks within `host_memory`, and the model's plan for them."""
    layout = memory.chunk_layout(numels, host_memory, state_bytes=args.state_bytes)
    layout.require_a_buffer(host_memory)
    buffers, cache = memory.stream_buffers(layout.buffers, len(layout.chunks), None)
    rate = args.adam_bytes_per_s
    plan = profile.plan_stream(
        layout.sizes,
        buffers,
        cache,
        adam_secs_per_chunk=layout.buffer_bytes / rate if rate > 0 else 0.0,
        fwd_bwd_secs=args.fwd_bwd_secs,
        share=node_part(profile, args),
        param_bytes=args.params_on_nvme * args.params,
    )
    return layout, plan


def _check_plan_args(args: argparse.Namespace) -> None:
    """`--nodes` and `--locality` refused as they are wrong, before anything is probed."""
    if args.nodes < 1:
        raise ValueError(f"--nodes: {args.nodes} is not a number of nodes")
    if args.accelerator_elements_per_s:
        for key in ("adam_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s"):
            if getattr(args, key) <= 0:
                option = "--" + key.replace("_", "-")
                raise ValueError(
                    f"{option}: needed with --accelerator-elements-per-s (the split weighs both passes and "
                    "the copies each way)"
                )
        if args.params_on_nvme:
            raise ValueError(
                "--params-on-nvme: no chunk streams to the accelerator while parameters are on NVMe "
                "(accelerator_update_memory is off then): drop --accelerator-elements-per-s"
            )
    if args.locality is not None and (
        len(args.locality) != len(args.dirs) or not set(args.locality) <= {"node-local", "shared"}
    ):
        raise ValueError(
            f"--locality: {','.join(args.locality)}: one of node-local or shared per path, for "
            f"{len(args.dirs)} paths"
        )


def _plans_by_budget(
    profile: profiles.Profile, numels: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The plan at each of `PLAN_FRACTIONS` of the whole state as `host_memory` (at least two chunks)."""
    whole = memory.whole_state_bytes(numels, state_bytes=args.state_bytes)
    by_budget = []
    for fraction in PLAN_FRACTIONS:
        budget = max(int(whole * fraction), 2 * args.state_bytes * memory.chunk_align(args.state_bytes))
        budget_layout, budget_plan = plan_at(profile, numels, budget, args)
        by_budget.append(
            {
                "host_memory": budget,
                "fraction_of_state": fraction,
                "chunks": len(budget_layout.chunks),
                "cached_chunks": budget_plan["cached_subgroups"],
                "predicted_update_secs": budget_plan["predicted_update_secs"],
            }
        )
    return by_budget


def cmd_plan(args: argparse.Namespace) -> int:
    _check_plan_args(args)
    group = min(args.sub_group_size, args.params)
    numels = [group] * (args.params // group) + ([args.params % group] if args.params % group else [])
    # A budget that holds no chunk is refused before the paths are probed, not after.
    memory.chunk_layout(numels, args.host_memory, state_bytes=args.state_bytes).require_a_buffer(
        args.host_memory
    )
    profile, source = profiles.load_or_probe(
        args.dirs,
        _probe_options(args),
        reprobe=args.reprobe,
        max_age_s=args.max_age_hours * 3600,
        progress=_progress(args),
    )
    if not args.quiet:
        print(source, file=sys.stderr)
    layout, plan = plan_at(profile, numels, args.host_memory, args)
    by_budget = _plans_by_budget(profile, numels, args)
    split = _accelerator_split(layout, args)
    workload = {
        "params": args.params,
        "sub_group_size": group,
        "subgroups": len(numels),
        "chunks": len(layout.chunks),
        "state_bytes_per_param": args.state_bytes,
        "bytes_per_chunk": layout.buffer_bytes,
        "whole_state_bytes": memory.whole_state_bytes(numels, state_bytes=args.state_bytes),
        "host_memory": args.host_memory,
        "adam_bytes_per_s": args.adam_bytes_per_s,
        "fwd_bwd_secs": args.fwd_bwd_secs,
        "nodes": args.nodes,
        "params_on_nvme_bytes": args.params_on_nvme * args.params,
    }
    if args.json:
        print(
            json.dumps(
                {
                    "workload": workload,
                    "profile_source": profile.source,
                    "paths": profile.probes,
                    "locality": profile.localities(args.locality),
                    "node_share": profile.node_share(args.nodes, args.locality),
                    "plan": plan,
                    "by_host_memory": by_budget,
                    "accelerator_split": split,
                },
                indent=2,
            )
        )
    else:
        _print_plan(profile, args, workload, plan, by_budget)
        if split is not None:
            _print_split(split, len(layout.chunks), plan["io_floor_secs"])
    return 0


def _accelerator_split(layout: memory.ChunkLayout, args: argparse.Namespace) -> dict[str, Any] | None:
    """The chunks that stream to the accelerator beside the host's pass (`accelerator_update_memory`),
    as the engine's model chooses them once it has measured these rates (the same inputs,
    `accelerator_model`: the I/O floor is not weighed, the slots are the engine's); None without
    `--accelerator-elements-per-s`. The gradient in bf16, the parameters too: on the accelerator, or
    with `--params-in-host-memory` copied there and back."""
    if not args.accelerator_elements_per_s:
        return None
    elements = [count for _, _, count in layout.chunks]
    per_element = accelerator_model.ChunkBytes.of(
        args.state_bytes,
        2,
        2,
        4 if args.state_bytes == FP32_STATE_BYTES else 2,
        master_in_params=args.state_bytes in MASTER_IN_PARAMS_STATE_BYTES,
        on_host=args.params_in_host_memory,
    )
    slots = accelerator_model.slots_in(args.accelerator_memory, per_element.slot_bytes(max(elements)))
    rates = accelerator_model.Rates(
        args.adam_bytes_per_s / args.state_bytes,
        float(args.accelerator_elements_per_s),
        float(args.h2d_bytes_per_s),
        float(args.d2h_bytes_per_s),
    )
    return _core.accelerator_split(accelerator_model.split_inputs(elements, per_element, slots, rates))


def _print_split(split: dict[str, Any], chunks: int, io_floor_secs: float) -> None:
    """The split and the update it gives: no faster than the I/O floor, which the choice does not weigh
    (the engine's: `accelerator_model.split_inputs`)."""
    update, host_alone = (max(split[k], io_floor_secs) for k in ("predicted_secs", "host_only_secs"))
    print(
        f"\non the accelerator beside the host's pass: {len(split['device_chunks'])} of {chunks} chunks "
        f"({split['device_slots']} in flight), the update {update:.2f} s against {host_alone:.2f} s on "
        f"the host alone (host {split['host_secs']:.2f} s, accelerator {split['device_secs']:.2f} s, the "
        f"I/O floor {io_floor_secs:.2f} s; the choice weighs neither the floor nor host memory's bandwidth)"
    )


def _print_plan(
    profile: profiles.Profile,
    args: argparse.Namespace,
    workload: dict[str, Any],
    plan: dict[str, Any],
    by_budget: list[dict[str, Any]],
) -> None:
    """`mlp-offload plan`'s tables: the paths as probed and planned, the update's prediction, and the
    prediction as host memory grows."""
    probes = profile.probes
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
    localities = profile.localities(args.locality)
    node_shares = profile.node_share(args.nodes, args.locality)
    for p, locality, share in zip(probes, localities, node_shares, strict=True):
        if locality == "shared" and args.nodes > 1:
            print(
                f"{p['path']}: shared by {args.nodes} nodes, each planned with {share:.2f} of its "
                f"figures alone; {profiles.across_nodes_note(p, args.nodes)}"
            )
    w = workload
    print(
        f"\n{w['subgroups']} subgroups of up to {w['sub_group_size']:,} parameters in {w['chunks']} chunks "
        f"of {w['bytes_per_chunk'] / 2**20:,.1f} MiB of state ({w['state_bytes_per_param']} bytes a "
        f"parameter); {plan['cached_subgroups']} chunks stay in host memory"
    )
    print(f"I/O floor of the update phase: {plan['io_floor_secs']:.2f} s")
    if plan["hidden_io_secs"] > 0:
        print(f"of which forward and backward hide: {plan['hidden_io_secs']:.2f} s")
    print(f"predicted update phase: {plan['predicted_update_secs']:.2f} s")
    if w["params_on_nvme_bytes"]:
        gib = w["params_on_nvme_bytes"] / 2**30
        print(
            f"the parameters on the paths ({gib:,.2f} GiB): the forward and the backward each read them in "
            f"{plan['param_pass_secs']:.2f} s; the update writes them in {plan['param_write_secs']:.2f} s of "
            "its prediction"
        )
    whole_gib = w["whole_state_bytes"] / 2**30
    print(f"\nthe update as host memory grows (the whole state takes {whole_gib:,.2f} GiB):")
    rows = [
        [
            f"{b['host_memory'] / 2**30:,.2f} GiB",
            f"{b['fraction_of_state']:.0%}",
            f"{b['cached_chunks']} of {b['chunks']}",
            f"{b['predicted_update_secs']:.2f} s",
        ]
        for b in by_budget
    ]
    print("\n".join(render_table(["host_memory", "of the state", "chunks cached", "predicted update"], rows)))


def cmd_doctor(args: argparse.Namespace) -> int:
    """The report; with `--probe` the paths' profile first (saved, as training's first start would), so
    the report's profile row and the probe's table follow. 1 when a check failed."""
    if args.ranks < 1:
        raise ValueError(f"--ranks: {args.ranks} is not a number of ranks")
    max_age_s = args.max_age_hours * 3600
    probed = None
    if args.probe and args.dirs:
        try:
            probed, source = profiles.load_or_probe(
                args.dirs, doctor.probe_options(args.ranks), max_age_s=max_age_s, progress=_progress(args)
            )
            if not args.quiet:
                print(source, file=sys.stderr)
        except (OSError, ValueError) as e:
            # The paths' rows say what is wrong with them.
            print(f"mlp-offload doctor: not probed: {e}", file=sys.stderr)
    rows = doctor.check(args.dirs, args.model_size, ranks=args.ranks, max_age_s=max_age_s)
    if args.json:
        checks = [row.as_dict() for row in rows]
        print(json.dumps({"checks": checks, "probe": None if probed is None else probed.probes}, indent=2))
    else:
        print(doctor.render(rows))
        if probed is not None:
            print(f"\n{render_probe_table(probed.probes)}")
    return 1 if any(row.status == doctor.FAIL for row in rows) else 0


def build_parser() -> argparse.ArgumentParser:
    # Longer than 80 lines for a reason: one declaration per option of every command, read as a list.
    parser = argparse.ArgumentParser(prog="mlp-offload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "doctor",
        help="check this machine and the storage paths before a job (ds_report for mlp-offload)",
        description="One row per check, each ok, warn or fail, with what was found and, for a warning or a "
        "failure, what to do and its entry of docs/troubleshooting.md: Python, torch and DeepSpeed against "
        "the supported versions; the update kernel this CPU gets; io_uring or the thread pool; reserved "
        "and transparent huge pages; RLIMIT_MEMLOCK against the host buffers pin_memory locks; per path its "
        "file system, device, locality, O_DIRECT and free space (against --model-size's state), whether "
        "two paths share a device, and the saved probe profile's age. Without --probe it takes well under "
        "a second and writes nothing. Exits 1 when a check failed.",
    )
    check.add_argument("dirs", nargs="*", metavar="PATH", help="the storage directories a job will use")
    check.add_argument(
        "--model-size",
        type=parse_count,
        default=None,
        help="parameters whose optimizer state the paths hold (1.3e9; all of this node's ranks'): free "
        "space and pinned memory are checked against 12 bytes a parameter (fp32 state)",
    )
    check.add_argument(
        "--ranks",
        type=int,
        default=memory.local_ranks(),
        help="ranks of the job on this node: they divide the spare memory, and the probe and its saved "
        "profile are theirs (LOCAL_WORLD_SIZE, else 1)",
    )
    check.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    check.add_argument(
        "--probe",
        action="store_true",
        help="measure the paths first as a job's first start would (a minute or so; saved for jobs to "
        "reuse; a fresh saved profile is reused) and print the probe's table",
    )
    check.add_argument(
        "--max-age-hours",
        type=float,
        default=profiles.DEFAULT_MAX_AGE_S / 3600,
        help="a saved profile is reused up to this age (probe_max_age_hours: 168)",
    )
    check.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    check.set_defaults(func=cmd_doctor)
    probe = sub.add_parser(
        "probe",
        help="measure each storage path and save the profile",
        description="Measures each directory through mlp-offload's own engine with O_DIRECT: a sweep of "
        "chunk sizes and in-flight limits over --bytes picks the best settings; at those, read, write and "
        "mixed read+write bandwidth are measured over a working set of --sustained-bytes, in windows, "
        "until the rate settles after a first whole pass (so a cache in front of the device does not "
        "count); then, for several paths, all of them at once. Writes and removes a temporary file in "
        "each directory. The profile is saved per host "
        f"({profiles.profile_file()}; MLP_OFFLOAD_PROFILE_DIR moves it) for `plan` and training to reuse. "
        "Under torchrun with one process per node (--nnodes N --nproc-per-node 1), each node probes its "
        "paths, then each shared path (a network or parallel file system) is measured from every node "
        "alone and from all at once, for `plan --nodes` and training to divide it among the nodes.",
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
        "ZeRO-3 optimizer-state workload streamed in chunks: split weights per path, in-flight limits, how "
        "many chunks the host memory keeps cached, the I/O floor, the predicted update-phase time, and a "
        "table of how that time falls as host memory grows.",
    )
    plan.add_argument("dirs", nargs="+", metavar="DIR", help="existing, writable directories")
    plan.add_argument(
        "--params", type=parse_count, required=True, help="parameters of this rank (1.3e9, 130M)"
    )
    plan.add_argument(
        "--sub-group-size", type=parse_count, default=10**9, help="DeepSpeed's sub_group_size (1e9)"
    )
    plan.add_argument(
        "--host-memory", type=parse_size, required=True, help="host memory for the state's buffers (16G)"
    )
    plan.add_argument(
        "--state-bytes",
        type=int,
        choices=STATE_BYTES_CHOICES,
        default=memory.STATE_BYTES,
        help="bytes of optimizer state a parameter in the store: 12 (fp32), 10 (DeepSpeed's bf16 or fp16 "
        "master weights with fp32 moments), 6 (bf16 master weights and bf16_optimizer_states); 8 and 4 are "
        "those two with the master weights in the parameters (master_in_params, the default there)",
    )
    plan.add_argument(
        "--adam-bytes-per-s",
        type=parse_size,
        default=0,
        help="bytes of state CPU Adam updates per second, when known (e.g. 4G; 0: not modelled)",
    )
    plan.add_argument(
        "--fwd-bwd-secs", type=float, default=0.0, help="forward+backward time per step, when known"
    )
    plan.add_argument(
        "--accelerator-elements-per-s",
        type=parse_count,
        default=0,
        help="elements a second the accelerator's kernel of the update runs at, when known (2e10; with "
        "--adam-bytes-per-s, --h2d-bytes-per-s and --d2h-bytes-per-s: how many chunks stream to the "
        "accelerator beside the host's pass, as accelerator_update_memory chooses; 0: not modelled)",
    )
    plan.add_argument(
        "--h2d-bytes-per-s", type=parse_size, default=0, help="host-to-accelerator copy rate (25G)"
    )
    plan.add_argument(
        "--d2h-bytes-per-s", type=parse_size, default=0, help="accelerator-to-host copy rate (25G)"
    )
    plan.add_argument(
        "--accelerator-memory",
        type=parse_size,
        default=8 << 30,
        help="accelerator memory the update may use (accelerator_update_memory; 8G)",
    )
    plan.add_argument(
        "--params-in-host-memory",
        action="store_true",
        help="the parameters' partitions in host memory (offload_param: cpu), not on the accelerator: each "
        "chunk updated there copies them back, and out too with the master weights in them (--state-bytes "
        "8 or 4)",
    )
    plan.add_argument(
        "--params-on-nvme",
        type=int,
        choices=(0, 2, 4),
        default=0,
        metavar="BYTES",
        help="bytes a parameter kept on the paths too (ZeRO-Infinity, past offload_param.max_in_cpu): 2 in "
        "bf16 or fp16, 4 in fp32; the forward and the backward read them, the update writes them (0: the "
        "parameters in host memory)",
    )
    plan.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="nodes of the job: each plans with its part of the shared paths, from what the probe measured "
        "across nodes (1)",
    )
    plan.add_argument(
        "--locality",
        type=lambda s: s.split(","),
        default=None,
        help="comma-separated, per path: node-local or shared (default: from each file system's type)",
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
    parser.add_argument(
        "--bytes", type=parse_size, default=None, help="bytes per measurement of the settings sweep (256M)"
    )
    parser.add_argument(
        "--sustained-bytes",
        type=parse_size,
        default=None,
        help="working set of the sustained measurements at the best settings, run until the rate "
        "settles (2G)",
    )
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
    parser.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="ranks of the node: above 1, each device is also measured shared by that many streams (at "
        "most 4), request by request and by turns, for the model to pick (1)",
    )
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
