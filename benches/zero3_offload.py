"""A first end-to-end figure: iteration and update time of a GPT-style model under real DeepSpeed ZeRO-3,
DeepSpeed's own NVMe offload against mlp-offload on the same path with the same pinned host memory.

    make bench-zero3                                  # 130M parameters, bf16, micro-batch 1, seq 128
    .venv/bin/python benches/zero3_offload.py --size 20M --rounds 1 --steps 4   # a quick look

Each (contender, round) runs in its own process, contenders interleaved round by round; the report gives
medians over the measured steps of every round (warm-up steps dropped) and the ratios to DeepSpeed.
Contenders:
- `deepspeed-nvme`: `offload_optimizer: {device: nvme, pipeline_read/write: true, buffer_count: 12}`;
- `mlp-offload`: `offload_optimizer: {device: cpu}` plus an `mlp_offload` section on the same path, with
  `host_memory` = DeepSpeed's pinned buffers (12 x largest subgroup x 4 bytes);
- `deepspeed-cpu`: the optimizer state in DRAM, the floor no offload can beat.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONTENDERS = ("deepspeed-nvme", "mlp-offload", "deepspeed-cpu")


def ds_config(contender: str, path: str, sub_group_size: int, buffer_count: int) -> dict[str, Any]:
    offload: dict[str, Any] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "sub_group_size": sub_group_size, "offload_optimizer": offload},
        "steps_per_print": 10**9,
    }
    if contender == "deepspeed-nvme":
        offload.update(
            device="nvme",
            nvme_path=path,
            pin_memory=True,
            pipeline_read=True,
            pipeline_write=True,
            buffer_count=buffer_count,
        )
    elif contender == "mlp-offload":
        offload.update(pin_memory=True, buffer_count=buffer_count)
        config["mlp_offload"] = {"paths": [path], "weights": "equal", "adapt": False}
    return config


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One contender, one round: build the engine, run the steps, time each phase."""
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    import deepspeed
    import torch

    import mlp_offload
    from mlp_offload.models import GPT

    torch.manual_seed(0)
    model = GPT.from_size(spec["size"], max_seq=spec["seq"])
    params = sum(p.numel() for p in model.parameters())
    config = ds_config(spec["contender"], spec["path"], spec["sub_group_size"], spec["buffer_count"])
    init = mlp_offload.initialize if spec["contender"] == "mlp-offload" else deepspeed.initialize
    t0 = time.perf_counter()
    engine, optimizer, _, _ = init(model=model, model_parameters=model.parameters(), config=config)
    init_secs = time.perf_counter() - t0
    data = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(spec["warmup"] + spec["steps"]):
        tokens = torch.randint(0, model.vocab, (1, spec["seq"] + 1), generator=data)
        t0 = time.perf_counter()
        loss = engine(tokens)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        steps.append({"forward": t1 - t0, "backward": t2 - t1, "update": t3 - t2, "iteration": t3 - t0})
    result = {"params": params, "init_secs": init_secs, "steps": steps[spec["warmup"] :]}
    telemetry = getattr(optimizer, "mlp_offload_telemetry", None)
    if telemetry:
        result["telemetry"] = telemetry
    engine.destroy()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="130M", help="model size: tiny, 20M, 130M (130M)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--sub-group-size", type=int, default=20_000_000)
    parser.add_argument("--buffer-count", type=int, default=12)
    parser.add_argument("--path", default="target/bench-zero3", help="the storage directory both use")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker.read_text())
        Path(spec["result"]).write_text(json.dumps(worker(spec)))
        return 0

    path = Path(args.path).resolve()
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in args.contenders.split(",")}
    for rnd in range(args.rounds):
        for contender in runs:
            target = path / contender
            # Each run starts from empty storage: no state or swap files of an earlier run.
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            spec = {
                "contender": contender,
                "size": args.size,
                "seq": args.seq,
                "sub_group_size": args.sub_group_size,
                "buffer_count": args.buffer_count,
                "path": str(target),
                "warmup": args.warmup,
                "steps": args.steps,
                "result": str(path / f"{contender}.result.json"),
            }
            spec_file = path / f"{contender}.spec.json"
            spec_file.write_text(json.dumps(spec))
            env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
            env.setdefault("TORCH_EXTENSIONS_DIR", str(Path("target/torch_extensions").resolve()))
            for key, value in {
                "RANK": "0",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
            }.items():
                env.setdefault(key, value)
            env["MASTER_PORT"] = str(29700 + rnd * 10 + list(runs).index(contender))
            print(f"round {rnd + 1}: {contender} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", str(spec_file)],
                env=env,
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                print(proc.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"{contender} failed in round {rnd + 1}")
            runs[contender].append(json.loads(Path(spec["result"]).read_text()))
    report = summarize(runs)
    report.update(
        {
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release()},
            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "args": {k: str(v) for k, v in vars(args).items() if k != "worker"},
        }
    )
    print_report(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**report, "runs": runs}, indent=2))
    return 0


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    medians: dict[str, dict[str, float]] = {}
    for contender, rounds in runs.items():
        steps = [s for r in rounds for s in r["steps"]]
        medians[contender] = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    base = medians.get("deepspeed-nvme")
    ratios = {}
    if base:
        for contender, m in medians.items():
            ratios[contender] = {k: base[k] / m[k] for k in ("update", "iteration")}
    params = next(iter(runs.values()))[0]["params"]
    return {"params": params, "median_secs": medians, "speedup_over_deepspeed_nvme": ratios}


def print_report(report: dict[str, Any]) -> None:
    print(f"{report['params'] / 1e6:.0f}M parameters; median seconds per iteration")
    print(
        f"{'contender':16} {'forward':>8} {'backward':>9} {'update':>8} {'iteration':>10}"
        "  update x  iteration x"
    )
    for contender, m in report["median_secs"].items():
        r = report["speedup_over_deepspeed_nvme"].get(contender, {})
        print(
            f"{contender:16} {m['forward']:8.3f} {m['backward']:9.3f} {m['update']:8.3f} "
            f"{m['iteration']:10.3f}  {r.get('update', float('nan')):8.2f} "
            f"{r.get('iteration', float('nan')):10.2f}"
        )
    print("x: DeepSpeed NVMe offload's median time over this contender's")


if __name__ == "__main__":
    sys.exit(main())
