"""The update's per-chunk CPU work, side by side in one run: the fused pass (`update_kernel: "fused"`)
against DeepSpeed's passes as the engine runs them with `update_kernel: "deepspeed"` (the half-precision
gradient widened into an fp32 chunk, `unscale_and_clip_grads`, CPU Adam, the copy into the
half-precision partition). With checksums of the chunk's state as read and as written: DeepSpeed's
passes with the store's own (CRC32C passes on two threads, as its checksum pool hashes), the fused one
with them in its pass (as the engine runs it), or as separate passes; and each without checksums.

    .venv/bin/python benches/update_kernel.py          # chunks of 4 Mi elements (48 MiB of state), bf16
    make bench-kernel                                  # the same, JSON to docs/data/bench-kernel.json

Chunks rotate over a working set larger than the CPU's caches, as chunks arrive from storage; the
variants run interleaved, round by round, over the same chunks; the figures are medians per chunk.
Bytes touched per element count each pass's reads and writes of memory (a write to memory not read in
the same pass also reads the line first, unless it bypasses the cache).

Then, per thread count (1, 2, 4, ... up to the CPUs this process may run on, torch's count among them),
the fused pass over cached chunks against the host's
own rate for a read and a write of each byte of state in place (`torch.Tensor.mul_`, 24 bytes per
element): how near the memory's rate the update runs, and whether more cores take it further.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

import torch

if TYPE_CHECKING:
    from mlp_offload.engine.fused_update import FusedAdam

# Per element, bytes read and written by each pass (bf16 gradient and parameters, fp32 state):
# widen (read 2, write 4 + the line's read 4), unscale (4 + 4), CPU Adam (16 + 12), the half copy
# (4, 2 + 2), a checksum pass over the state (12).
DEEPSPEED_BYTES = (2 + 8) + 8 + 28 + 8
CHECKSUM_BYTES = 2 * 12
# One pass: gradient 2, state 12 + 12, parameters 2 (stores that bypass the cache where the parameters
# are aligned for them, as a tensor of their own is; else 2 + the line's read 2); its checksums hash the
# state while it is in the core's cache.
FUSED_BYTES = 2 + 24 + 2
FUSED_PLAIN_STORES_BYTES = FUSED_BYTES + 2
# The host's reference: each element's state read and written in place.
IN_PLACE_BYTES = 24
# The update during backward first checks that the parameters are the old weights narrowed: in torch,
# the weights (4) narrowed into a new tensor (2 + 2) and compared with the parameters (2 + 2); in the pass,
# nothing more than it reads anyway (the parameters' line, in the core's cache).
TORCH_CHECK_BYTES = 4 + 4 + 4
# A cached chunk's update during backward: its state before copied into a kept copy in the pass, 12
# written with stores that bypass the cache (no read of the line first; 12 more with plain stores, which
# took 1.15x as long on the Xeon of 2026-11-27).
KEEP_STATE_BYTES = 12


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--elements", type=int, default=4 << 20, help="elements per chunk (4 Mi)")
    parser.add_argument("--chunks", type=int, default=6, help="chunks in the working set (6)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument(
        "--simd",
        default="auto",
        help="the fused pass's instructions: auto, avx512-clmul, avx2-clmul, ... (auto)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from mlp_offload import _core
    from mlp_offload.adapter import kernel_check
    from mlp_offload.engine import fused_update

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    n, threads = args.elements, torch.get_num_threads()
    param = torch.nn.Parameter(torch.zeros(4))
    ds = DeepSpeedCPUAdam([param], lr=1e-4, weight_decay=0.01, adamw_mode=True)
    fused, why = kernel_check.self_check(ds, dtype, dtype, simd=args.simd)
    if fused is None:
        raise SystemExit(f"the fused kernel cannot be used here: {why}")
    # Where the fused pass folds its checksums into the SIMD loop (VPCLMULQDQ), the same pass hashing
    # them block by block after and before it, as on CPUs without.
    blockwise = None
    unfolded = {"avx512-clmul": "avx512", "avx2-clmul": "avx2"}.get(fused.kernel.simd)
    if unfolded is not None:
        blockwise, why = kernel_check.self_check(ds, dtype, dtype, simd=unfolded)
        if blockwise is None:
            raise SystemExit(f"the fused kernel without VPCLMULQDQ cannot be used here: {why}")
    group = ds.param_groups[0]
    beta1, beta2 = group["betas"]
    record = fused_update.adam_group(group, fused.adamw)
    generator = torch.Generator().manual_seed(0)
    chunks = []
    for _ in range(args.chunks):
        state = torch.empty(3 * n)
        state[:n] = torch.randn(n, generator=generator) * 0.05
        state[n:] = torch.rand(2 * n, generator=generator) * 1e-4
        grad = (torch.randn(n, generator=generator) * 1e-2).to(dtype)
        chunks.append((state, grad, torch.empty(n, dtype=dtype)))
    # Per chunk, parameters one element off their alignment: the pass writes them with plain stores.
    shifted = {id(state): torch.empty(n + 1, dtype=dtype)[1:] for state, _, _ in chunks}
    # Per chunk, where the update during backward of a cached chunk keeps its state before.
    kept_states = {id(state): torch.zeros(3 * n) for state, _, _ in chunks}
    grad32 = torch.empty(n)
    scale = 1.0 / 3.0
    pool = ThreadPoolExecutor(2)
    step = [0]

    def checksums(state: torch.Tensor) -> None:
        # The store hashes each object's stripes in pieces on its checksum threads.
        halves = state.view(torch.uint8).chunk(2)
        list(pool.map(_core.crc32c, (h.numpy() for h in halves)))

    def deepspeed_passes(state: torch.Tensor, grad: torch.Tensor, half: torch.Tensor) -> None:
        grad32.copy_(grad)
        grad32.mul_(scale)
        p, m, v = state[:n], state[n : 2 * n], state[2 * n :]
        ds.ds_opt_adam.adam_update(
            ds.opt_id,
            step[0],
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            True,
            p,
            grad32,
            m,
            v,
        )
        half.copy_(p)

    def fused_pass(state: torch.Tensor, grad: torch.Tensor, half: torch.Tensor) -> None:
        fused.update(state, grad, half, grad_scale=scale, step=step[0], group=record)

    def fused_pass_shifted(state: torch.Tensor, grad: torch.Tensor, half: torch.Tensor) -> None:
        fused.update(state, grad, shifted[id(state)], grad_scale=scale, step=step[0], group=record)

    def fused_pass_summing(state: torch.Tensor, grad: torch.Tensor, half: torch.Tensor) -> None:
        # One stripe (one path), as read and as written.
        fused.update(
            state, grad, half, grad_scale=scale, step=step[0], group=record, read_cuts=[0], write_cuts=[0]
        )

    def torch_check_then_pass(state: torch.Tensor, grad: torch.Tensor, half: torch.Tensor) -> None:
        # What the update during backward ran before the pass checked the parameters itself.
        fused_update.same_bits(half, state[:n].to(half.dtype))
        fused_pass_summing(state, grad, half)

    def pass_keeping(state: torch.Tensor, grad: torch.Tensor, half: torch.Tensor) -> None:
        kept: list[tuple[int, torch.Tensor]] = []
        fused.update(
            state, grad, half, grad_scale=scale, step=step[0], group=record, read_cuts=[0], write_cuts=[0],
            kept_params=kept,
        )  # fmt: skip

    def pass_keeping_state(state: torch.Tensor, grad: torch.Tensor, half: torch.Tensor) -> None:
        kept: list[tuple[int, torch.Tensor]] = []
        # A cached chunk's state is not hashed (it is neither read from nor written to the store).
        fused.update(
            state, grad, half, grad_scale=scale, step=step[0], group=record, kept_params=kept,
            kept_state=kept_states[id(state)],
        )  # fmt: skip

    def blockwise_summing(state: torch.Tensor, grad: torch.Tensor, half: torch.Tensor) -> None:
        assert blockwise is not None
        blockwise.update(
            state, grad, half, grad_scale=scale, step=step[0], group=record, read_cuts=[0], write_cuts=[0]
        )

    def with_checksums(update: Callable[..., None]) -> Callable[..., None]:
        def run(state: torch.Tensor, grad: torch.Tensor, half: torch.Tensor) -> None:
            checksums(state)  # the read's verification
            update(state, grad, half)
            checksums(state)  # the write's sums

        return run

    variants: dict[str, tuple[Callable[..., None], int]] = {
        "deepspeed passes + checksums": (with_checksums(deepspeed_passes), DEEPSPEED_BYTES + CHECKSUM_BYTES),
        "deepspeed passes": (deepspeed_passes, DEEPSPEED_BYTES),
        "fused, checksums in the pass": (fused_pass_summing, FUSED_BYTES),
        "fused + checksum passes": (with_checksums(fused_pass), FUSED_BYTES + CHECKSUM_BYTES),
        "fused": (fused_pass, FUSED_BYTES),
        "fused, parameters unaligned": (fused_pass_shifted, FUSED_PLAIN_STORES_BYTES),
        "in backward: torch's check + fused": (torch_check_then_pass, FUSED_BYTES + TORCH_CHECK_BYTES),
        "in backward: checked in the pass": (pass_keeping, FUSED_BYTES),
        "in backward, cached: state kept": (pass_keeping_state, FUSED_BYTES + KEEP_STATE_BYTES),
        "fused (a cached chunk in step())": (fused_pass, FUSED_BYTES),
    }
    if blockwise is not None:
        variants["fused, checksums by blocks"] = (blockwise_summing, FUSED_BYTES)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rnd in range(args.rounds + 1):
        for name, (run, _) in variants.items():
            step[0] += 1
            for state, grad, half in chunks:
                t = time.perf_counter()
                run(state, grad, half)
                if rnd > 0:  # the first round warms up
                    times[name].append(time.perf_counter() - t)
    base = statistics.median(times["deepspeed passes + checksums"])
    rows = {}
    print(
        f"chunks of {n} elements ({12 * n / 2**20:.0f} MiB of state), {args.dtype}, {threads} threads, "
        f"fused: {fused.kernel.simd}; medians of {len(times['fused'])} chunks"
    )
    print(f"{'variant':36} {'ms/chunk':>9} {'GB/s of state':>14} {'x today':>8} {'bytes/element':>14}")
    for name, (_, touched) in variants.items():
        secs = statistics.median(times[name])
        rows[name] = {"secs_per_chunk": secs, "of_today": secs / base, "bytes_touched_per_element": touched}
        print(f"{name:36} {secs * 1e3:9.2f} {12 * n / secs / 1e9:14.1f} {secs / base:8.2f} {touched:14d}")
    print("x today: the variant's time over DeepSpeed's passes with checksums (what the engine ran before)")
    scaling = thread_scaling(chunks, fused_pass, fused, args.rounds)
    report = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release()},
        "args": vars(args) | {"out": str(args.out)},
        "threads": threads,
        "simd": fused.kernel.simd,
        "arith": fused.kernel.arith,
        "variants": rows,
        "threads_scaling": scaling,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"results: {args.out}", file=sys.stderr)
    return 0


def thread_scaling(
    chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    fused_pass: Callable[..., None],
    fused: FusedAdam,
    rounds: int,
) -> list[dict[str, float]]:
    """Per thread count (powers of two, torch's and the CPUs this process may run on), the fused pass
    over the chunks (cached, no checksums) and the host's in-place read and write of their state,
    round by round; medians per chunk, as GB/s of bytes touched. The engine runs the pass on torch's
    thread count (`torch.get_num_threads()`, marked)."""
    default = torch.get_num_threads()
    most = len(os.sched_getaffinity(0))
    counts = sorted({1 << k for k in range(most.bit_length()) if 1 << k <= most} | {default, most})
    n = chunks[0][1].numel()
    rows = []
    # Each over every chunk in turn: torch's OpenMP threads spin a while after each operation, and on the
    # cores the pass's threads would take.
    runs: dict[str, Callable[..., None]] = {
        "fused": fused_pass,
        "in place": lambda state, grad, half: state.mul_(1.0),
    }
    print(
        f"{'threads':>7} {'fused ms':>9} {'GB/s':>6} {'in place ms':>12} {'GB/s':>6} {'fused / in place':>17}"
    )
    try:
        for threads in counts:
            fused.threads = threads
            torch.set_num_threads(threads)
            times: dict[str, list[float]] = {name: [] for name in runs}
            for rnd in range(rounds + 1):
                for name, run in runs.items():
                    for state, grad, half in chunks:
                        t = time.perf_counter()
                        run(state, grad, half)
                        if rnd > 0:
                            times[name].append(time.perf_counter() - t)
            fused_secs, in_place_secs = (statistics.median(times[k]) for k in ("fused", "in place"))
            row = {
                "threads": threads,
                "fused_secs_per_chunk": fused_secs,
                "fused_gb_per_s": FUSED_BYTES * n / fused_secs / 1e9,
                "in_place_secs_per_chunk": in_place_secs,
                "in_place_gb_per_s": IN_PLACE_BYTES * n / in_place_secs / 1e9,
                "engines_default": threads == default,
            }
            rows.append(row)
            fused_rate, in_place_rate = row["fused_gb_per_s"], row["in_place_gb_per_s"]
            print(
                f"{threads:7d} {fused_secs * 1e3:9.2f} {fused_rate:6.1f} {in_place_secs * 1e3:12.2f} "
                f"{in_place_rate:6.1f} {fused_rate / in_place_rate:17.2f}"
                f"{'  (torch: the engine)' if threads == default else ''}"
            )
    finally:
        fused.threads = default
        torch.set_num_threads(default)
    print(
        f"GB/s: bytes touched a second (the fused pass {FUSED_BYTES} an element, in place {IN_PLACE_BYTES})"
    )
    return rows


if __name__ == "__main__":
    sys.exit(main())
