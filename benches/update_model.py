"""Checks the performance model on real paths: predicted against measured update-phase I/O time, the
model's split against fixed splits side by side, and the weights following a path that slows down.

Run through `make bench-model` (work disk plus the bandwidth-capped test bed); by hand:
    scripts/testbed.sh run -- .venv/bin/python benches/update_model.py --paths DIR_A DIR_B
The update phase here is I/O only (the update itself does nothing), so its time is the I/O time the
model predicts. Every configuration runs the same subgroup pipeline the DeepSpeed engine uses.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlp_offload import ObjectStore, WeightTuner
from mlp_offload.app.cli import parse_size
from mlp_offload.app.tables import render_table
from mlp_offload.engine import profiles
from mlp_offload.engine.pipeline import ChunkPipeline

MiB = 1 << 20

# Whole objects of these sizes stream through three buffers (one read ahead, one updated, one written
# behind); the rest of the buffers cache.
STREAM_BUFFERS = 3
# name, objects, bytes of state per object, host buffers (cache = buffers - 3)
WORKLOADS = [
    ("12 x 64 MiB, 1 cached", 12, 64 * MiB, 4),
    ("8 x 128 MiB, 3 cached", 8, 128 * MiB, 6),
    ("6 x 256 MiB, none cached", 6, 256 * MiB, 3),
]
# Steps from the probe's split while the tuner balances the paths, before the rounds start (a move
# takes three: one that still reads the old split, two it is judged on).
CALIBRATION_STEPS = 24
FIXED_SPLITS = {"all-local": [1.0, 0.0], "3:1": [3.0, 1.0], "2:1": [2.0, 1.0], "1:1": [1.0, 1.0]}
ADAPTING = "model, adapting"


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def plan_for(
    profile: profiles.Profile,
    subgroups: int,
    size: int,
    buffers: int,
    measured: Sequence[float] | None = None,
    weights: Sequence[float] | None = None,
) -> dict[str, Any]:
    """The model's plan from the probe, or from bandwidths measured while steps ran (`measured`); at
    its own split, or at `weights`."""
    return profile.plan_subgroups(
        subgroups=subgroups,
        bytes_per_subgroup=size,
        host_memory=buffers * size,
        measured_bytes_per_s=measured,
        pipeline_buffers=STREAM_BUFFERS,
        weights=None if weights is None else list(weights),
    )


def open_pipeline(
    paths: Sequence[str], plan: dict[str, Any], subgroups: int, size: int, buffers: int
) -> tuple[ObjectStore, ChunkPipeline]:
    store = ObjectStore(paths, max_inflight=max(plan["max_inflight"]), weights=plan["weights"])
    keys = [f"bench-sg{i}" for i in range(subgroups)]
    pipeline = ChunkPipeline(store, keys, [size] * subgroups, buffers, cache_slots=buffers - STREAM_BUFFERS)
    pipeline.initialize(lambda i, view: view.fill_(i % 251))
    return store, pipeline


def no_update(index: int, view: Any) -> None:
    pass


def compare_splits(
    paths: Sequence[str],
    profile: profiles.Profile,
    workload: tuple[str, int, int, int],
    reps: int,
    steps: int,
) -> dict[str, Any]:
    name, subgroups, size, buffers = workload
    probed = plan_for(profile, subgroups, size, buffers)
    store, pipeline = open_pipeline(paths, probed, subgroups, size, buffers)
    rounds: list[dict[str, Any]] = []
    try:
        # Calibration: steps from the probe's split while the tuner searches, as it does while
        # training. "model" is the split the tuner kept, held for every round like the fixed splits,
        # and its predicted time the model's plan at that split from the tuner's measured bandwidths.
        # "model, adapting" runs the tuner's current weights and lets it go on searching through its
        # steps, as training does: its cost over "model" is the search's. The other configurations ran
        # in between, so each round it starts judging afresh.
        tuner = WeightTuner(probed["path_bytes_per_s"])
        store.weights = tuner.weights
        for _ in range(CALIBRATION_STEPS):
            adapt(tuner, store, pipeline.run_step(no_update))
        kept = tuner.kept_weights
        plan = plan_for(profile, subgroups, size, buffers, tuner.estimates, kept)
        for rep in range(reps):
            configs = {"model": kept, "probe only": probed["weights"], **FIXED_SPLITS}
            secs: dict[str, float] = {}
            adapting_weights = []
            # A new order each round. Rotating one order kept every configuration behind the same one,
            # and a throttle's burst credit carries over from one configuration to the next: 2:1 always
            # followed 3:1, which leaves the second path credit, and the model always followed 1:1,
            # which spends it.
            names = [*configs, ADAPTING]
            random.Random(rep).shuffle(names)
            for config in names:
                adapting = config == ADAPTING
                store.weights = tuner.interrupted() if adapting else configs[config]
                # Two steps move every object to the new split (cached ones are written a step later);
                # until then a step's reads come from the last configuration's split. The tuner sees
                # them as it would in training, and knows the first is not comparable.
                times = []
                for step in range(2 + steps):
                    if adapting:
                        adapting_weights.append(store.weights)
                    stats = pipeline.run_step(no_update)
                    if step >= 2:
                        times.append(stats.seconds)
                    if adapting:
                        adapt(tuner, store, stats)
                secs[config] = statistics.median(times)
                log(f"{name}: round {rep + 1} {config}: {secs[config]:.3f} s")
            rounds.append({"adapting_weights": adapting_weights, "median_secs": secs})
    finally:
        for i in range(subgroups):
            store.delete(pipeline.keys[i])
        store.close()
    names = list(rounds[0]["median_secs"])
    return {
        "workload": name,
        "subgroups": subgroups,
        "bytes_per_subgroup": size,
        "buffers": buffers,
        "probe_only_plan": probed,
        "plan": plan,
        "model_weights": kept,
        "rounds": rounds,
        "median_secs": {c: statistics.median(r["median_secs"][c] for r in rounds) for c in names},
        "predicted_secs": plan["predicted_update_secs"],
        "measured_over_predicted": statistics.median(
            r["median_secs"]["model"] / plan["predicted_update_secs"] for r in rounds
        ),
        "measured_over_predicted_per_round": [
            r["median_secs"]["model"] / plan["predicted_update_secs"] for r in rounds
        ],
        "probe_only_measured_over_predicted": statistics.median(
            r["median_secs"]["probe only"] / probed["predicted_update_secs"] for r in rounds
        ),
        # Per round, then the median over rounds: each ratio compares runs minutes apart at most.
        "others_over_model": {
            c: statistics.median(r["median_secs"][c] / r["median_secs"]["model"] for r in rounds)
            for c in names
            if c != "model"
        },
    }


def adapt(tuner: WeightTuner, store: ObjectStore, stats: Any) -> list[float] | None:
    """What the engine does after each step: the tuner sees each path's figures, the store its new
    weights when they moved."""
    moved = tuner.observe(stats.per_path, stats.seconds)
    if moved is not None:
        store.weights = moved
    return moved


def set_cap(testbed: str, bps: str) -> None:
    subprocess.run([testbed, "up", "--bps", bps], check=True, stdout=subprocess.DEVNULL)


def adaptation(
    paths: Sequence[str], profile: profiles.Profile, testbed: str, cap_from: str, cap_to: str, steps: int
) -> dict[str, Any]:
    name, subgroups, size, buffers = WORKLOADS[0]
    plan = plan_for(profile, subgroups, size, buffers)
    tuner = WeightTuner(plan["path_bytes_per_s"])
    store, pipeline = open_pipeline(paths, plan, subgroups, size, buffers)
    cap_at = steps // 3
    record: list[dict[str, Any]] = []
    try:
        pipeline.run_step(no_update)
        for step in range(steps):
            if step == cap_at:
                set_cap(testbed, cap_to)
                log(f"adaptation: second path capped at {cap_to}/s before step {step}")
            weights = store.weights
            stats = pipeline.run_step(no_update)
            adapt(tuner, store, stats)
            record.append(
                {
                    "step": step,
                    "capped": step >= cap_at,
                    "seconds": stats.seconds,
                    "weights": weights,
                    "per_path": stats.per_path,
                }
            )
            log(f"adaptation: step {step}: {stats.seconds:.3f} s, weights {[round(w, 3) for w in weights]}")
        # The same cap with the weights the plan started from: what the run would cost without adapting.
        store.weights = plan["weights"]
        static = [pipeline.run_step(no_update).seconds for _ in range(4)][2:]
    finally:
        set_cap(testbed, cap_from)
        for i in range(subgroups):
            store.delete(pipeline.keys[i])
        store.close()
    before = statistics.median(r["seconds"] for r in record[:cap_at])
    adapted = statistics.median(r["seconds"] for r in record[-3:])
    return {
        "workload": name,
        "cap_from": cap_from,
        "cap_to": cap_to,
        "cap_before_step": cap_at,
        "steps": record,
        "median_secs_before_cap": before,
        "first_capped_step_secs": record[cap_at]["seconds"],
        "median_secs_last_3_adapted": adapted,
        "median_secs_capped_with_starting_weights": statistics.median(static),
        "final_weights": record[-1]["weights"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--paths", nargs=2, required=True, metavar="DIR", help="the local path, then the other"
    )
    parser.add_argument("--reps", type=int, default=5, help="rounds of every configuration (5)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per configuration and round (3)")
    parser.add_argument(
        "--testbed", default="scripts/testbed.sh", help="test bed script, for changing the cap"
    )
    parser.add_argument("--cap-from", default="500M", help="the test bed's cap to restore (500M)")
    parser.add_argument(
        "--cap-to", default="", help="cap the second path to this mid-run (150M); empty: skip"
    )
    parser.add_argument("--adapt-steps", type=int, default=15, help="steps of the adaptation run (15)")
    parser.add_argument("--probe-bytes", type=parse_size, default=None, help="bytes per probe measurement")
    parser.add_argument(
        "--cap-local", default="", help="also cap the first path's disk at this (1200M), for steady figures"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    paths = [str(Path(p).resolve()) for p in args.paths]
    for p in paths:
        Path(p).mkdir(parents=True, exist_ok=True)
    if args.cap_local:
        subprocess.run([args.testbed, "cap", paths[0], args.cap_local], check=True)
    try:
        return run(args, paths)
    finally:
        if args.cap_local:
            subprocess.run([args.testbed, "cap", paths[0], "0"], check=True)


def run(args: argparse.Namespace, paths: list[str]) -> int:
    profile = profiles.probe(paths, profiles.ProbeOptions(bytes=args.probe_bytes), log)
    profiles.save_profile(profile)
    results: dict[str, Any] = {
        "machine": {"host": platform.node(), "kernel": platform.release(), "cpus": _cpus()},
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "paths": paths,
        "local_path_capped_at": args.cap_local or None,
        "profile": profile.probes,
        "workloads": [compare_splits(paths, profile, w, args.reps, args.steps) for w in WORKLOADS],
    }
    if args.cap_to:
        results["adaptation"] = adaptation(
            paths, profile, args.testbed, args.cap_from, args.cap_to, args.adapt_steps
        )
    print_report(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        log(f"results written to {args.out}")
    return 0


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def print_report(results: dict[str, Any]) -> None:
    rows = []
    others = [ADAPTING, "probe only", *FIXED_SPLITS]
    for w in results["workloads"]:
        m = w["median_secs"]
        rows.append(
            [
                w["workload"],
                "/".join(f"{x:.2f}" for x in w["model_weights"]),
                f"{w['predicted_secs']:.2f}",
                f"{m['model']:.2f}",
                f"{w['measured_over_predicted']:.3f}",
                *(f"{m[c]:.2f} ({w['others_over_model'][c]:.2f}x)" for c in others),
            ]
        )
    header = ["workload", "model split", "predicted s", "model s", "measured/predicted", *others]
    print("\n".join(render_table(header, rows)))
    print("(x): that split's step time over the model's in the same round, median over rounds")
    for w in results["workloads"]:
        p = w["probe_only_plan"]
        print(
            f"{w['workload']}: probe-only split {'/'.join(f'{x:.2f}' for x in p['weights'])}, predicted "
            f"{p['predicted_update_secs']:.2f} s, "
            f"measured/predicted {w['probe_only_measured_over_predicted']:.3f}"
        )
    if a := results.get("adaptation"):
        print(
            f"\nadaptation ({a['workload']}, second path {a['cap_from']} -> {a['cap_to']} before step "
            f"{a['cap_before_step']}):\n"
            f"  step time before the cap {a['median_secs_before_cap']:.2f} s, first capped step "
            f"{a['first_capped_step_secs']:.2f} s, last 3 steps {a['median_secs_last_3_adapted']:.2f} s; "
            f"same cap with the starting weights {a['median_secs_capped_with_starting_weights']:.2f} s\n"
            f"  weights {[round(x, 3) for x in a['steps'][0]['weights']]} -> "
            f"{[round(x, 3) for x in a['final_weights']]}"
        )


if __name__ == "__main__":
    sys.exit(main())
