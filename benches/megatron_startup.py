"""Start-up under Megatron-DeepSpeed: the time from launching `pretrain_gpt.py` (`torch.distributed.run`,
1 rank, the artifact's llama style of `tests/test_megatron.py`) to the end of its first iteration, stock
(the optimizer offloaded to the CPU) against ours with the README's section on two paths of the work disk:
once on new paths (the probe runs first; what it said beforehand of the probe's time, beside the time it
took) and then on the same paths, probed already. Medians of `--runs` runs each; the figures go to
`--out`.

    .venv/bin/python benches/megatron_startup.py --out docs/data/megatron-startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from megatron_tree import LLAMA, SNAPSHOT, ds_config, ours_config, prepare, run_megatron  # noqa: E402


def startup_secs(megatron: dict[str, Path], run_dir: Path, config: dict[str, object], ours: bool) -> float:
    """Launch to the end of the first iteration, in seconds."""
    record = run_megatron(megatron, run_dir, [*LLAMA, "--global-batch-size", "2"], config, 1, ours)[0]
    return float(record["first_iteration_at"] - record["launched_at"])


def probe_said(log: Path) -> dict[str, object]:
    """What a run on new paths said of its probe: how long it would take, before; how long it took."""
    text = log.read_text()
    before = re.search(r"the probe takes about (\d+)-(\d+) s", text)
    after = re.search(r"probed in ([\d.]+) s", text)
    if before is None or after is None:
        sys.exit(f"{log}: the probe's estimate or its time is not in the log")
    return {"estimate_secs": [int(before[1]), int(before[2])], "took_secs": float(after[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", type=Path, default=ROOT / "target" / "megatron-startup")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not SNAPSHOT.exists():
        sys.exit(f"Megatron-DeepSpeed's snapshot is absent: {SNAPSHOT}")
    shutil.rmtree(args.work, ignore_errors=True)
    megatron = prepare(args.work)
    paths = [args.work / "path0", args.work / "path1"]
    for p in paths:
        p.mkdir()
    # A profile directory of its own: the first run of ours finds these paths new.
    os.environ["MLP_OFFLOAD_PROFILE_DIR"] = str(args.work / "profiles")
    config = ds_config(2, 1, 1, 0.0)
    ours = ours_config(config, "readme", paths)
    runs: dict[str, list[float]] = {"stock": [], "ours, new paths": [], "ours, paths probed": []}
    runs["ours, new paths"].append(startup_secs(megatron, args.work / "ours-new", ours, True))
    probe = probe_said(args.work / "ours-new" / "log.txt")
    for i in range(args.runs):
        runs["stock"].append(startup_secs(megatron, args.work / f"stock-{i}", config, False))
        runs["ours, paths probed"].append(startup_secs(megatron, args.work / f"ours-{i}", ours, True))
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print("| run | start-up, median | runs |\n|---|---|---|")
    for k, v in runs.items():
        print(f"| {k} | {medians[k]:.2f} s | {', '.join(f'{x:.2f}' for x in v)} |")
    print(f"ours on probed paths - stock: {medians['ours, paths probed'] - medians['stock']:+.2f} s")
    print(f"the probe: said about {probe['estimate_secs']} s before, took {probe['took_secs']} s")
    if args.out:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        args.out.write_text(
            json.dumps({"when": when, "runs": runs, "medians": medians, "probe": probe}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
