"""The main job: train a small LLaMA-style model on the corpus we ship, with the optimizer state in
mlp-offload's store, and show where the time went.

`mlp-offload train` (what `make run` starts) trains a byte-level `LlamaForCausalLM` (random init, bf16,
DeepSpeed ZeRO-3 with `offload_optimizer: cpu` and an `mlp_offload` section) on
`mlp_offload/app/data/corpus.txt`. A progress bar shows loss and per-phase times; at the end a summary table
gives the phase times, the bytes each tier moved, and the update time the performance model predicted
against the measured one; the chart, the telemetry (JSON lines) and the summary (JSON) go to `--out`.

It runs as one process on one device (the GPU when there is one, else the CPU with
`DS_ACCELERATOR=cpu`); for several ranks, launch it with `deepspeed` or `torchrun` like any script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from mlp_offload.app.tables import render_table
from mlp_offload.common.units import parse_count, parse_size

# Steps left out of the medians: the first update writes every object and finds no cache.
WARMUP_STEPS = 2
# `--dtype auto` on a CPU: bf16 unless its matrix products are this many times slower than fp32's (some
# CPUs have no bf16 instructions and emulate them, 90x slower).
SLOW_BF16 = 2.0
DTYPES = ("auto", "bf16", "fp16", "fp32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--paths",
        nargs="+",
        default=[".mlp-offload/tier0"],
        metavar="DIR",
        help="storage directories (tiers) for the optimizer state; created when missing (.mlp-offload/tier0)",
    )
    parser.add_argument("--size", default="20M", help="model size: tiny, 20M, 130M, 350M, 1B, 3B, 7B (20M)")
    parser.add_argument("--steps", type=int, default=100, help="training steps (100)")
    parser.add_argument("--seq", type=int, default=128, help="tokens (bytes) per sequence (128)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per step (4)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (1e-3)")
    parser.add_argument(
        "--sub-group-size", type=parse_count, default=4_000_000, help="ZeRO-3 sub_group_size (4M)"
    )
    parser.add_argument(
        "--host-memory",
        default="deepspeed",
        help="host memory for the state's chunk buffers and cache (e.g. 512M); deepspeed (the default, so "
        "the tiers do the work): what DeepSpeed's NVMe offload would pin; auto: what the machine can spare",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="forward and backward precision (the optimizer state is fp32 either way); auto: bf16 on a "
        f"GPU, and on a CPU unless its bf16 matrix products are over {SLOW_BF16:g}x slower than fp32's",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(".mlp-offload/run"),
        help="chart, telemetry, summary (.mlp-offload/run)",
    )
    parser.add_argument(
        "--tensorboard",
        type=Path,
        default=None,
        metavar="DIR",
        help="DeepSpeed's TensorBoard monitor into DIR: its figures and each step's of mlp-offload",
    )
    parser.add_argument("--no-progress", action="store_true", help="one line per 10 steps, no bar")


def _set_up_environment() -> None:
    """A single process is its own launcher: rank 0 of 1. Without CUDA, DeepSpeed runs on the CPU."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29511")
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed builds its CPU Adam just in time with ninja, which sits beside this interpreter.
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def matmul_secs(dtype: Any, rows: int, inner: int, cols: int, limit_secs: float) -> float:
    """The fastest of four `rows x inner @ inner x cols` products in `dtype` on the CPU (the first, which
    warms up, is the slowest as a rule), or the first one's time when it alone takes over `limit_secs`."""
    import torch

    a = torch.randn(rows, inner).to(dtype)
    b = torch.randn(inner, cols).to(dtype)
    t = time.perf_counter()
    torch.mm(a, b)
    first = time.perf_counter() - t
    if first > limit_secs:
        return first
    best = first
    for _ in range(3):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return best


def compute_dtype(choice: str, size: str, rows: int) -> tuple[str, str]:
    """The precision forward and backward run in (`--dtype`), and why: `auto` is bf16 on a GPU; on a CPU
    bf16 unless a matrix product of the model's MLP shape is `SLOW_BF16` times slower in it than in
    fp32, then fp32."""
    import torch

    from mlp_offload.app.models import LLAMA_SIZES

    if choice != "auto":
        return choice, "--dtype"
    if torch.cuda.is_available():
        return "bf16", "a GPU"
    hidden, _, _, intermediate = LLAMA_SIZES[size]
    fp32 = matmul_secs(torch.float32, rows, hidden, intermediate, limit_secs=1.0)
    bf16 = matmul_secs(torch.bfloat16, rows, hidden, intermediate, limit_secs=20 * fp32)
    measured = (
        f"a {rows} x {hidden} x {intermediate} matrix product takes {bf16 * 1e3:.1f} ms in bf16 and "
        f"{fp32 * 1e3:.1f} ms in fp32 on this CPU"
    )
    if bf16 <= SLOW_BF16 * fp32:
        return "bf16", measured
    return "fp32", f"{measured} ({bf16 / fp32:.0f}x slower in bf16)"


def ds_config(
    args: argparse.Namespace, paths: list[str], telemetry: Path, dtype: str = "bf16"
) -> dict[str, Any]:
    section: dict[str, Any] = {"paths": paths, "telemetry_file": str(telemetry)}
    host_memory = args.host_memory
    section["host_memory"] = host_memory if host_memory in ("auto", "deepspeed") else parse_size(host_memory)
    # Mixed precision as chosen; fp32 has no section.
    precision: dict[str, Any] = {dtype: {"enabled": True}} if dtype in ("bf16", "fp16") else {}
    monitor: dict[str, Any] = {}
    if args.tensorboard is not None:
        monitor["tensorboard"] = {"enabled": True, "output_path": str(args.tensorboard), "job_name": "train"}
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": args.steps, "warmup_num_steps": max(1, args.steps // 10)},
        },
        **precision,
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": args.sub_group_size,
            # DeepSpeed's pipelined NVMe offload pins 12 buffers; "deepspeed" host memory matches it.
            "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 12},
        },
        "steps_per_print": 10**9,
        **monitor,
        "mlp_offload": section,
    }


def _train(engine: Any, corpus: Any, args: argparse.Namespace) -> list[dict[str, float]]:
    """The training loop: each step on random windows of the corpus, timed (`timed_iteration`), with a
    progress bar (or a line every 10 steps) and, after the warm-up, when the rest will end."""
    import torch

    windows = torch.Generator().manual_seed(args.seed + 1)
    steps: list[dict[str, float]] = []
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True)
    for step in range(args.steps):
        starts = torch.randint(0, len(corpus) - args.seq - 1, (args.micro_batch,), generator=windows)
        batch = torch.stack([corpus[s : s + args.seq] for s in starts.tolist()]).to(engine.device)
        record = timed_iteration(engine, input_ids=batch, labels=batch)
        steps.append(record)
        if step == WARMUP_STEPS:
            # Once the warm-up is over: how long the rest will take, said plainly (the bar keeps it current).
            each, rest = record["iteration"], args.steps - step - 1
            end = time.strftime("%H:%M:%S", time.localtime(time.time() + each * rest))
            message = (
                f"{each:.2f} s a step: the {rest} steps left end in about {each * rest / 60:.1f} min ({end})"
            )
            if bar is not None:
                bar.write(message, file=sys.stderr)
            else:
                print(message, file=sys.stderr)
        if bar is not None:
            bar.set_postfix(
                loss=f"{record['loss']:.3f}",
                fwd=f"{record['forward']:.2f}s",
                bwd=f"{record['backward']:.2f}s",
                upd=f"{record['update']:.2f}s",
            )
            bar.update()
        elif step % 10 == 0 or step == args.steps - 1:
            print(
                f"step {step + 1}/{args.steps}: loss {record['loss']:.3f}, "
                f"forward {record['forward']:.2f} s, backward {record['backward']:.2f} s, "
                f"update {record['update']:.2f} s",
                file=sys.stderr,
            )
    if bar is not None:
        bar.close()
    return steps


def run(args: argparse.Namespace) -> int:
    _set_up_environment()
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit(
            "mlp-offload train needs Hugging Face transformers: pip install 'mlp-offload[train]'"
        ) from None
    import torch

    import mlp_offload
    from mlp_offload.app.models import llama

    if args.steps <= WARMUP_STEPS:
        raise ValueError(f"--steps: {args.steps}; give more than the {WARMUP_STEPS} warm-up steps")
    paths = [str(Path(p).resolve()) for p in args.paths]
    for p in paths:
        Path(p).mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    telemetry = args.out / "telemetry.jsonl"
    telemetry.unlink(missing_ok=True)

    text = resources.files("mlp_offload.app").joinpath("data/corpus.txt").read_bytes()
    corpus = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    torch.manual_seed(args.seed)
    model = llama(args.size, vocab=256, max_seq=args.seq)
    params = sum(p.numel() for p in model.parameters())
    dtype, why = compute_dtype(args.dtype, args.size, args.micro_batch * args.seq)
    print(
        f"training a {params / 1e6:.1f}M-parameter LLaMA-style model on {len(text):,} bytes of text, "
        f"{args.steps} steps, in {dtype} ({why}); optimizer state on {', '.join(paths)}",
        file=sys.stderr,
    )
    engine, optimizer, _, _ = mlp_offload.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(args, paths, telemetry, dtype)
    )
    steps = _train(engine, corpus, args)
    # The store alone then holds the trained state, ready to be copied.
    optimizer.mlp_offload_flush()
    summary = {
        **summarize(steps, optimizer.mlp_offload_telemetry, paths, params),
        "dtype": dtype,
        "dtype_why": why,
    }
    engine.destroy()
    (args.out / "summary.json").write_text(json.dumps({**summary, "steps": steps}, indent=2))
    print_summary(summary)
    draw_chart(steps, summary, args.out / "chart.png")
    print(f"\nchart: {args.out / 'chart.png'}; telemetry: {telemetry}; summary: {args.out / 'summary.json'}")
    return 0


def timed_iteration(engine: Any, *inputs: Any, **named_inputs: Any) -> dict[str, float]:
    """One training iteration: forward (`engine(*inputs, **named_inputs)`, giving the loss or a model
    output with `.loss`), then DeepSpeed's backward and step, each timed on its own (the device
    synchronized in between, so a GPU's queued work counts where it ran)."""
    import torch
    from deepspeed.accelerator import get_accelerator

    synchronize = get_accelerator().synchronize
    synchronize()
    t0 = time.perf_counter()
    out = engine(*inputs, **named_inputs)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    synchronize()
    t1 = time.perf_counter()
    engine.backward(loss)
    synchronize()
    t2 = time.perf_counter()
    engine.step()
    synchronize()
    t3 = time.perf_counter()
    return {
        "loss": float(loss.detach()),
        "forward": t1 - t0,
        "backward": t2 - t1,
        "update": t3 - t2,
        "iteration": t3 - t0,
    }


def summarize(
    steps: list[dict[str, float]], telemetry: list[dict[str, Any]], paths: list[str], params: int
) -> dict[str, Any]:
    measured = steps[WARMUP_STEPS:]
    phases = {k: statistics.median(s[k] for s in measured) for k in ("forward", "backward", "update")}
    start = next(t for t in telemetry if t["event"] == "start")
    records = [t for t in telemetry if t["event"] == "step"][WARMUP_STEPS:]
    tiers = []
    for i, path in enumerate(paths):
        read = sum(t["paths"][i]["read_bytes"] for t in records)
        written = sum(t["paths"][i]["write_bytes"] for t in records)
        busy = sum(t["paths"][i]["busy_secs"] for t in records)
        tiers.append(
            {
                "path": path,
                "bytes_read_per_step": read / len(records),
                "bytes_written_per_step": written / len(records),
                "bytes_per_busy_s": (read + written) / busy if busy > 0 else 0.0,
            }
        )
    plan = start.get("plan") or {}
    # Each step's prediction was made before it ran, from what the steps before it measured.
    predictions = [t["predicted_update_secs"] for t in records if t["predicted_update_secs"] is not None]
    return {
        "params": params,
        "first_loss": steps[0]["loss"],
        "last_loss": statistics.mean(s["loss"] for s in steps[-5:]),
        "median_secs": phases,
        "predicted_update_secs": statistics.median(predictions) if predictions else None,
        "startup_predicted_update_secs": plan.get("predicted_update_secs"),
        "io_floor_secs": plan.get("io_floor_secs"),
        "subgroups": start["subgroups"],
        "chunks": start["chunks"],
        "cached_chunks": start["cached_chunks"],
        "host_memory": start["host_memory"],
        "weights": start["weights"],
        "tiers": tiers,
        "reads_per_step": statistics.median(t["reads"] for t in records),
        "retained_per_step": statistics.median(t["retained"] for t in records),
        "cached_per_step": statistics.median(t["cached"] for t in records),
    }


def print_summary(s: dict[str, Any]) -> None:

    m = s["median_secs"]
    print(
        f"\nloss {s['first_loss']:.3f} -> {s['last_loss']:.3f} (mean of the last 5 steps); "
        f"{s['subgroups']} subgroups in {s['chunks']} chunks, {s['cached_chunks']} cached, "
        f"host memory {s['host_memory'] / 2**20:,.0f} MiB"
    )
    print(f"median seconds per step after {WARMUP_STEPS} warm-up steps:")
    rows = [[k, f"{v:.3f}"] for k, v in m.items()] + [["iteration", f"{sum(m.values()):.3f}"]]
    print("\n".join(render_table(["phase", "seconds"], rows)))
    predicted = s["predicted_update_secs"]
    print(
        "update phase: measured {:.3f} s, predicted {} (I/O floor {}); per step {:.0f} reads, "
        "{:.0f} chunks reused from the last step's buffers, {:.0f} from the cache".format(
            m["update"],
            f"{predicted:.3f} s" if predicted is not None else "n/a (no profile)",
            f"{s['io_floor_secs']:.3f} s" if s["io_floor_secs"] is not None else "n/a",
            s["reads_per_step"],
            s["retained_per_step"],
            s["cached_per_step"],
        )
    )
    rows = [
        [
            t["path"],
            f"{w:.3f}",
            f"{t['bytes_read_per_step'] / 2**20:,.1f}",
            f"{t['bytes_written_per_step'] / 2**20:,.1f}",
            f"{t['bytes_per_busy_s'] / 2**20:,.0f}",
        ]
        for t, w in zip(s["tiers"], s["weights"], strict=True)
    ]
    header = ["tier", "weight", "read MiB/step", "written MiB/step", "MiB per busy s"]
    print("\n".join(render_table(header, rows)))


def draw_chart(steps: list[dict[str, float]], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    x = list(range(1, len(steps) + 1))
    fig, (loss_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4))
    loss_ax.plot(x, [s["loss"] for s in steps], color="#4c72b0")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title(f"{summary['params'] / 1e6:.1f}M-parameter LLaMA-style model, byte-level")
    bottom = [0.0] * len(steps)
    for phase, color in (("forward", "#8da0cb"), ("backward", "#66c2a5"), ("update", "#fc8d62")):
        values = [s[phase] for s in steps]
        time_ax.bar(x, values, bottom=bottom, color=color, label=phase, width=1.0)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    if summary["predicted_update_secs"] is not None:
        # Comparable with the bars' tops: measured forward and backward plus the predicted update.
        m = summary["median_secs"]
        predicted_step = m["forward"] + m["backward"] + summary["predicted_update_secs"]
        time_ax.axhline(
            predicted_step, color="black", linestyle="--", linewidth=1, label="fwd+bwd + predicted update"
        )
    time_ax.set_xlabel("step")
    time_ax.set_ylabel("seconds")
    time_ax.set_title("time per step")
    time_ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
