"""Loading a universal checkpoint: ours against stock DeepSpeed with the optimizer in DRAM (stock's NVMe
offload loads none), the same universal checkpoint, side by side in one run: the time
`engine.load_checkpoint` takes and the resident memory it adds at its peak (the kernel's high-water mark,
reset just before), each contender in a process of its own, as a restarted job loads it.

The checkpoint: ours (`host_memory` 2G) trains one step of `WideTables(--size)` (bf16, DeepSpeed's
defaults otherwise) and saves; DeepSpeed's `ds_to_universal` converts it (one worker, timed); ours loads
with the README's section (`paths` alone). `--stock-size` sets the stock side's model apart where stock
cannot load at `--size` in this machine's memory (its load reads the converter's copy of rank 0's whole
ZeRO optimizer file beside its state in DRAM); ours is then measured at both sizes.

    .venv/bin/python benches/universal_load.py --size 1B --stock-size 270M \
        --out docs/data/universal-load.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from deepspeed_runs import convert_to_universal  # noqa: E402


def status(key: str) -> int:
    """A /proc/self/status memory figure, in bytes."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith(key)).split()[1]) * 1024


def engine_for(size: str, ours: bool, paths: list[str], universal: bool) -> Any:
    import deepspeed
    import torch

    import mlp_offload
    from mlp_offload.app.models import WideTables

    torch.manual_seed(1234)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "steps_per_print": 10**9,
    }
    if universal:
        config["checkpoint"] = {"load_universal": True}
    if ours:
        config["mlp_offload"] = {"paths": paths}
        if not universal:
            # The saving job caches less than the default would: its save gathers the whole state in
            # host memory beside the cache (the README's), and at 940M both do not fit in 24 GiB.
            config["mlp_offload"]["host_memory"] = "2G"
    init = mlp_offload.initialize if ours else deepspeed.initialize
    model = WideTables.from_size(size)
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
    return engine


def phase(args: argparse.Namespace) -> dict[str, Any]:
    """One contender's part, in this process: `save` (ours trains a step and saves) or `load`."""
    import torch

    ours = args.contender == "ours"
    engine = engine_for(args.size, ours, args.paths, universal=args.phase == "load")
    if args.phase == "save":
        tokens = torch.randint(0, 1 << 15, (1, 9), generator=torch.Generator().manual_seed(0))
        engine.backward(engine(tokens))
        engine.step()
        engine.save_checkpoint(args.checkpoint, tag="t")
        engine.destroy()
        return {}
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS:")
    started = time.perf_counter()
    engine.load_checkpoint(args.checkpoint, tag="t")
    secs = time.perf_counter() - started
    record: dict[str, Any] = {
        "load_secs": secs,
        "added_bytes": status("VmHWM:") - before,
        "rss_before": before,
    }
    telemetry = getattr(engine.optimizer, "mlp_offload_telemetry", None)
    if telemetry:
        start = next(r for r in telemetry if r["event"] == "start")
        record["host_memory"] = start["host_memory"]
        record["host_memory_source"] = start["host_memory_source"]
    engine.destroy()
    return record


def run_phase(work: Path, name: str, **spec: Any) -> dict[str, Any]:
    out = work / f"{name}.json"
    argv = [sys.executable, __file__, "--phase", spec["phase"], "--contender", spec["contender"]]
    argv += ["--size", spec["size"], "--checkpoint", str(spec["checkpoint"]), "--result", str(out)]
    argv += ["--paths", *spec.get("paths", [str(work / "unused")])]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    subprocess.run(argv, env=env, check=True)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def measure(work: Path, size: str, contenders: list[str]) -> dict[str, Any]:
    """At `size`: ours saves, the converter converts, each contender loads."""
    base = work / size
    shutil.rmtree(base, ignore_errors=True)
    paths = [base / "save-path0", base / "save-path1", base / "load-path0", base / "load-path1"]
    for p in paths:
        p.mkdir(parents=True)
    ckpt, universal = base / "ckpt", base / "universal"
    run_phase(base, "save", phase="save", contender="ours", size=size, checkpoint=ckpt, paths=paths[:2])
    figures: dict[str, Any] = {"convert_secs": convert_to_universal(ckpt / "t", universal / "t")}
    shutil.rmtree(ckpt)
    for p in paths[:2]:
        shutil.rmtree(p)
    for contender in contenders:
        figures[contender] = run_phase(
            base, contender, phase="load", contender=contender, size=size, checkpoint=universal,
            paths=[str(p) for p in paths[2:]],
        )  # fmt: skip
        print(f"{size} {contender}: {json.dumps(figures[contender])}", flush=True)
    shutil.rmtree(base)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1B")
    parser.add_argument("--stock-size", help="stock's model where it differs from --size")
    parser.add_argument("--work", type=Path, default=ROOT / "target" / "universal-load")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--phase", choices=["save", "load"], help=argparse.SUPPRESS)
    parser.add_argument("--contender", choices=["ours", "stock"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--paths", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        args.result.write_text(json.dumps(phase(args)))
        return
    sizes = {args.size: ["ours", "stock"]} if not args.stock_size else {}
    if args.stock_size:
        sizes = {args.stock_size: ["ours", "stock"], args.size: ["ours"]}
    report = {size: measure(args.work, size, contenders) for size, contenders in sizes.items()}
    for size, figures in report.items():
        line = f"{size}: converted in {figures['convert_secs']:.1f} s"
        for name in ("ours", "stock"):
            if name in figures:
                f = figures[name]
                line += (
                    f"; {name} loaded in {f['load_secs']:.1f} s, adding {f['added_bytes'] / 2**20:.0f} MiB"
                )
        if "stock" in figures:
            ours, stock = figures["ours"], figures["stock"]
            line += f" (ours/stock: time {ours['load_secs'] / stock['load_secs']:.2f}x, memory "
            line += f"{ours['added_bytes'] / stock['added_bytes']:.3f}x)"
        print(line)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
