"""What writing a step's figures to DeepSpeed's monitors costs a step (`monitors`), beside the step itself.

Takes a run of the main job (`mlp-offload train --out DIR`, its `telemetry.jsonl` and `summary.json`),
writes each of its step records through `MonitorWriter` into DeepSpeed's own `MonitorMaster` with
TensorBoard and the CSV monitor on (one process, rank 0 of a gloo group of one), and prints the median
milliseconds a step's write took against the run's median iteration:

    .venv/bin/python benches/monitor_write.py .mlp-offload/run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the main job's --out directory")
    parser.add_argument("--rounds", type=int, default=3, help="passes over the run's records (3)")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.comm as dist
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster

    from mlp_offload.adapter.monitors import MonitorWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_distributed(dist_backend="gloo", verbose=False)
    records = [json.loads(line) for line in (args.run / "telemetry.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    summary = json.loads((args.run / "summary.json").read_text())
    iteration = sum(summary["median_secs"].values())
    with tempfile.TemporaryDirectory() as out:
        config = {
            "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"},
            "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"},
        }
        monitor = MonitorMaster(get_monitor_config(config))
        writer = MonitorWriter(True)
        took = []
        for samples, record in enumerate(steps * args.rounds):
            start = time.perf_counter()
            writer.step_taken(monitor, samples)
            writer.record(record)
            took.append(time.perf_counter() - start)
    per_step = statistics.median(took)
    print(
        f"{len(took)} step records written to TensorBoard and the CSV monitor: {1000 * per_step:.2f} ms "
        f"a step (median), against the run's median iteration of {1000 * iteration:.1f} ms: "
        f"{100 * per_step / iteration:.2f}%"
    )


if __name__ == "__main__":
    main()
