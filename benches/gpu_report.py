"""The GPU report: every check and measurement that needs CUDA, in parts of under 10 minutes each, so
that a GPU's minutes go to measuring. `make gpu-pack` here packs what the GPU machine lacks into `.gpu/`;
there, `source .gpu/setup.sh` installs it and `make gpu-report` (or this script) runs the parts.

    python benches/gpu_report.py [PART ...] [--out DIR] [--data DIR] [--list]

Parts, in this order (all by default; name some to run only those, one call each if need be):

- `accelerator-kernel`: the update's pass on the accelerator (`tests/test_accelerator_adam.py`: a Triton
  kernel) against the host's fused pass, on CUDA, bit for bit: whether the GPU divides, takes square roots
  and fuses exactly as the kernel asks (the interpreter here cannot tell);
- `ratio`: `offload_optimizer.ratio` with ours on CUDA (`tests/test_ratio.py`): its subgroups kept in the
  GPU's memory and updated there, bit-equal to stock's `device: cpu`;
- `accelerator-chunks`: chunks streamed to the GPU beside the host's pass
  (`tests/test_accelerator_chunks.py`), bit-equal to stock's `device: cpu` (the master weights in the
  parameters too, their CRC32C summed there), and the start-up check of the kernel there;
- `e2e-1B-split`, `e2e-1B-split-nvme`: LLaMA 1B with those chunks, the state in DRAM against DeepSpeed's
  `device: cpu` and its `ratio` 0.3 and 0.5, and streamed from NVMe against its NVMe offload (issue 82);
- `bitexact`: the bit-exact table on CUDA (`tests/test_bitexact.py`: bf16 and fp16, accumulation, clipping,
  one and two paths, the update behind the next forward on and off), against stock DeepSpeed's
  `device: cpu` on the same GPU;
- `bitexact-backward`: the rows of the update during backward (`tests/test_backward.py`) on CUDA, the
  planned ones among them, but the two-rank one (one GPU) and the one that forces the host scratch a GPU
  takes anyway;
- `ds-suite`: DeepSpeed's own ZeRO-3 offload tests on CUDA, stock and with our engine, among them the
  cases that skip on the CPU (`tests/deepspeed_suite/run.py`; `MLP_OFFLOAD_DS_TESTS` names the tests if
  `../shared/deepspeed-tests` is not there);
- `lightning`: PyTorch Lightning's `DeepSpeedStrategy(config=...)` with our section, bit-equal to stock
  Lightning with DeepSpeed (`tests/test_frameworks.py`);
- `e2e-130M`, `e2e-1B`, `e2e-1B-dram`, `e2e-1B-threads`, `e2e-1B-chunks`, `e2e-1B-forward`, `e2e-1B-backward`,
  `e2e-largest`, `e2e-largest-ours`:
  `benches/e2e.py` with the LLaMA-style 130M (134M with LLaMA's vocabulary) and 1B against DeepSpeed's
  pipelined NVMe offload and its `device: cpu`, and the largest LLaMA size whose state the data
  directory's free space holds for DeepSpeed's NVMe offload (16 bytes a parameter). At 1B, ours at
  DeepSpeed's memory and with half the state in memory (issue 29's (b) and (c)); as the README
  configures it with the update behind the next forward and during backward (the cached chunks, from
  kept copies), inside `step()`, and without the update during backward (issue 30's (d), and its 2x
  against `device: cpu`); and with half the state in memory, inside `step()` against behind the next
  forward (issue 30's (c), whose forward on the CPU had nothing to hide the update behind); and, at
  DeepSpeed's memory and with half the state in memory, the streamed chunks updated during backward
  against not (issue 30's (b) and (c), `e2e-1B-backward`); and every chunk cached, the engine's chunks
  of 4 Mi elements against 16 Mi and 1 Mi (`e2e-1B-chunks`);
- `kernel`: `benches/update_kernel.py` on the GPU machine's host, the update's per-chunk work, fused
  against DeepSpeed's passes, and per thread count (1, 2, 4, ... all) the fused pass against the host's
  own in-place read and write of the state: whether the update with the state in memory (0.56 s at 1B
  there on 2026-11-27) runs at the host's memory rate, and whether more threads take it further.

Each part writes `<out>/<part>.json` (outcome, seconds, where its output is) and `<out>/<part>.log` as it
runs, and `<out>/report.md` is rewritten after each part. Without CUDA a part says it skipped and why.
`--out` defaults to `$OUT/gpu-report` (the device tool's folder that comes back) or `bench-out/gpu-report`;
`--data` (the disk the state goes to) to `$DATA` (`.gpu/setup.sh` sets it) or `target/gpu-report-data`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The CPUs this process may run on: the update's thread counts the e2e-1B-dram part tries.
HOST_CPUS = len(os.sched_getaffinity(0))
# Each part must end within the device tool's 10 minutes a call, set-up included.
PART_TIMEOUT_SECS = 540
# Bytes on disk per parameter of DeepSpeed's NVMe offload (fp32 weights, two moments, fp32 gradients),
# the most of any contender.
DISK_BYTES_PER_PARAM = 16
# LLaMA sizes (mlp_offload.app.models.LLAMA_SIZES) by parameters with LLaMA's 32,000-token vocabulary.
LLAMA_PARAMS = {"130M": 134e6, "350M": 400e6, "1B": 1.2e9, "3B": 3.4e9, "7B": 6.7e9}


@dataclass
class Part:
    what: str
    # The command and its environment, from the output and data directories.
    command: Callable[[Path, Path], list[str]]
    env: dict[str, str] = field(default_factory=dict)


def pytest_workers() -> int:
    """pytest-xdist workers for a part's tests: one at a time, the bit-exact table's 30 rows took about a
    minute each on an H100's machine (16 cores), past a part's time; 12 workers ran 39 rows in 3 minutes
    there (2026-11-27). A quarter of the cores stay for DeepSpeed's JIT builds and the disk's threads."""
    return max(1, min(12, (os.cpu_count() or 1) * 3 // 4))


def pytest_part(*args: str) -> Callable[[Path, Path], list[str]]:
    def command(out: Path, data: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            str(pytest_workers()),
            "-p",
            "no:cacheprovider",
            # The GPU machine's pytest-benchmark warns under xdist, and the tests' warnings are errors.
            "-p",
            "no:benchmark",
            "-rA",
            *args,
        ]

    return command


def e2e_part(
    size: str | None,
    contenders: str,
    name: str,
    variants: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
) -> Callable[[Path, Path], list[str]]:
    """`benches/e2e.py` on LLaMA of `size` (None: the largest the disk holds) with these contenders,
    `--variant`s (NAME=JSON or BASE/NAME=JSON) and `extra` arguments."""

    def command(out: Path, data: Path) -> list[str]:
        chosen = size or largest_size(data)
        return [
            sys.executable,
            str(ROOT / "benches" / "e2e.py"),
            "--model",
            "llama",
            "--size",
            chosen,
            "--rounds",
            "1",
            "--warmup",
            "2",
            "--steps",
            "3",
            "--contenders",
            contenders,
            "--path",
            str(data / "e2e"),
            "--out",
            str(out / f"{name}.results.json"),
            # The whole report comes back with the summary.
            "--records",
            str(out / "records"),
            *(arg for variant in variants for arg in ("--variant", variant)),
            *extra,
        ]

    return command


def largest_size(data: Path) -> str:
    """The largest LLaMA size whose DeepSpeed NVMe offload state fits in `data`'s free space (with a tenth
    to spare)."""
    data.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(data).free * 0.9
    fitting = [s for s, n in LLAMA_PARAMS.items() if n * DISK_BYTES_PER_PARAM <= free]
    return fitting[-1] if fitting else "130M"


CUDA = {"MLP_OFFLOAD_TEST_ACCELERATOR": "cuda", "MLP_OFFLOAD_TEST_FORK": "0"}
ON_CPU = {"MLP_OFFLOAD_TEST_ACCELERATOR": "cpu", "MLP_OFFLOAD_TEST_FORK": "1", "DS_ACCELERATOR": "cpu"}
PARTS = {
    "accelerator-kernel": Part(
        "the update's pass on the accelerator (a Triton kernel) against the host's fused pass on CUDA: "
        "every precision mode, decay and tail arithmetic, bit for bit (issue 82's kernel table)",
        pytest_part("tests/test_accelerator_adam.py"),
        CUDA,
    ),
    "ratio": Part(
        "DeepSpeed's offload_optimizer.ratio with ours on CUDA: the first subgroups kept in the GPU's memory "
        "and updated there by the Triton kernel, bit-equal to stock's device: cpu (fp32, bf16, accumulation "
        "with clipping, the update during backward)",
        pytest_part("tests/test_ratio.py", "-k", "bit_equal"),
        CUDA,
    ),
    "accelerator-chunks": Part(
        "chunks streamed to the GPU beside the host's pass (accelerator_update_memory, Deep Optimizer "
        "States) on CUDA: the start-up check, the model's choice, some and every chunk, cached and streamed, "
        "the master weights in the parameters (their CRC32C summed on the GPU), and copied over from the "
        "partition in host memory and back (offload_param: cpu), bit-equal to stock's device: cpu (issue "
        "82's item 3)",
        pytest_part("tests/test_accelerator_chunks.py"),
        CUDA,
    ),
    "e2e-1B-split": Part(
        "LLaMA 1B, the state in DRAM: DeepSpeed device: cpu and its ratio 0.3 and 0.5 (ZeRO-Offload++) "
        "against ours with chunks streamed to the GPU beside the host's pass: as the README configures it "
        "(beside the update during backward), without the update during backward, behind the next "
        "forward and inside step(), and without the split, every contender with pin_memory, which the "
        "chunks there need (issue 82's targets: 2x device: cpu, ahead of stock's best ratio)",
        e2e_part(
            "1B",
            "ds-cpu,ds-cpu-ratio-0.3,ds-cpu-ratio-0.5,mlp-offload-default",
            "e2e-1B-split",
            (
                'default/split={"overlap_backward": false}',
                'default/split-serial={"overlap_backward": false, "overlap": false}',
                'default/host={"overlap_backward": false, "accelerator_update_memory": 0}',
            ),
            # The chunks there need page-locked host buffers: every contender pinned, stock's too.
            ("--pin-memory",),
        ),
    ),
    "e2e-1B-split-nvme": Part(
        "LLaMA 1B streamed from NVMe: DeepSpeed's pipelined NVMe offload against ours at its memory with "
        "chunks streamed to the GPU beside the host's pass, and without them (the update during backward "
        "off in both; issue 82's target: 2x DeepSpeed's NVMe offload)",
        e2e_part(
            "1B",
            "ds-nvme-pipelined",
            "e2e-1B-split-nvme",
            (
                'split={"overlap_backward": false}',
                'host={"overlap_backward": false, "accelerator_update_memory": 0}',
            ),
        ),
    ),
    "bitexact": Part(
        "the bit-exact table on CUDA against stock DeepSpeed's device: cpu",
        pytest_part("tests/test_bitexact.py", "-k", "test_state_is_bit_equal_to_deepspeed_cpu_offload"),
        CUDA,
    ),
    "bitexact-backward": Part(
        "the update during backward on CUDA (gradients copied to the host on DeepSpeed's stream, norms "
        "summed on the device, parameters through a host scratch), kept or undone, against stock",
        pytest_part(
            "tests/test_backward.py",
            "-k",
            "test_the_update_during_backward_is_kept_or_undone_bit_for_bit and not scratch and not ranks",
        ),
        CUDA,
    ),
    "ds-suite": Part(
        "DeepSpeed's own ZeRO-3 offload tests on CUDA, stock and with our engine",
        lambda out, data: [
            sys.executable,
            str(ROOT / "tests" / "deepspeed_suite" / "run.py"),
            "--out",
            str(out / "ds-suite.results.json"),
            *(
                ["--tests", os.environ["MLP_OFFLOAD_DS_TESTS"]]
                if "MLP_OFFLOAD_DS_TESTS" in os.environ
                else []
            ),
        ],
        {"MLP_OFFLOAD_TEST_ACCELERATOR": "cuda"},
    ),
    "lightning": Part(
        "Lightning's DeepSpeedStrategy with our section, bit-equal to stock",
        pytest_part("tests/test_frameworks.py", "-k", "lightning"),
        CUDA,
    ),
    "e2e-130M": Part(
        "LLaMA 130M: DeepSpeed NVMe (pipelined), DeepSpeed device: cpu, ours at its memory, ours (README)",
        e2e_part("130M", "ds-nvme-pipelined,ds-cpu,mlp-offload,mlp-offload-default", "e2e-130M"),
    ),
    "e2e-1B": Part(
        "LLaMA 1B: DeepSpeed NVMe (pipelined) against ours at its memory and with half the state in memory",
        e2e_part("1B", "ds-nvme-pipelined,mlp-offload,mlp-offload-half", "e2e-1B"),
    ),
    "e2e-1B-dram": Part(
        "LLaMA 1B: DeepSpeed device: cpu against ours as the README configures it (every chunk cached: the "
        "update behind the next forward, and during backward from kept copies where the plan expects it "
        "to begin before backward ends), none during backward, and the update inside step() (what ran "
        "1.29x DeepSpeed's iteration on an H100, 2026-11-27)",
        e2e_part(
            "1B",
            "ds-cpu,mlp-offload-default",
            "e2e-1B-dram",
            # The question first (what the update during backward from kept copies gives), where a
            # call's limit cuts the part short.
            ('default/nobwd={"overlap_backward": false}', 'default/serial={"overlap": false}'),
            # Where the forward's time goes beside the update behind it (0.67 s against 0.18 s without
            # it, on an H100, with no wait for a subgroup recorded).
            ("--watch-threads",),
        ),
    ),
    # Apart from e2e-1B-dram: six contenders of about 85 s each outran a call's 10 minutes (2026-11-27).
    "e2e-1B-threads": Part(
        "LLaMA 1B, every chunk cached: DeepSpeed device: cpu against ours with the pass on torch's threads "
        "(the default), on every CPU, and on every CPU but one (the forward's launching thread's) "
        "(update_threads)",
        e2e_part(
            "1B",
            "ds-cpu,mlp-offload-default",
            "e2e-1B-threads",
            (
                f'default/cpus={{"update_threads": {HOST_CPUS}}}',
                f'default/cpus-1={{"update_threads": {max(1, HOST_CPUS - 1)}}}',
            ),
            ("--watch-threads",),
        ),
    ),
    # The engine cuts 1B's subgroups into chunks of 4 Mi elements (240 of them); each chunk costs the
    # update thread its Python (0.1-0.2 ms a chunk on a CPU's caches the pass just flushed) and the pass
    # its threads' wake and join, which on 16 threads is a larger part of a chunk's 1.1-1.3 ms pass than
    # on 2. Whether larger chunks pay there (their last chunks' padding costs host memory).
    "e2e-1B-chunks": Part(
        "LLaMA 1B, every chunk cached: ours as the README configures it (chunks of 4 Mi elements) against "
        "chunks of 16 Mi and of 1 Mi elements (update_chunk)",
        e2e_part(
            "1B",
            "mlp-offload-default",
            "e2e-1B-chunks",
            # update_chunk is in bytes of state: 12 an element (fp32 weights and two moments).
            (
                f'default/16Mi={{"update_chunk": {12 * (16 << 20)}}}',
                f'default/1Mi={{"update_chunk": {12 * (1 << 20)}}}',
            ),
            ("--watch-threads",),
        ),
    ),
    "e2e-1B-forward": Part(
        "LLaMA 1B, half the state in memory: the update inside step() (the default where the state streams) "
        "against behind the next forward (overlap: true), whose 0.01 s forward on the CPU hid nothing",
        e2e_part("1B", "mlp-offload-half", "e2e-1B-forward", ('half/forward={"overlap": true}',)),
    ),
    "e2e-1B-backward": Part(
        "LLaMA 1B with half the state in memory: the streamed chunks updated during backward as the plan "
        "chooses (overlap_backward: auto, the default), every one (true) and none (false), without clipping "
        "(a clipped step undoes it); on an H100 true made the iteration 1.17-1.26x slower, and auto "
        "took none (2026-11-27)",
        e2e_part(
            "1B",
            "mlp-offload-half",
            "e2e-1B-backward",
            ('half/bwd={"overlap_backward": true}', 'half/off={"overlap_backward": false}'),
            ("--clip", "0"),
        ),
    ),
    "kernel": Part(
        "the update's per-chunk work on this host's CPUs, the fused pass against DeepSpeed's passes, over "
        "a working set (1.1 GiB) past its caches, and per thread count against the host's in-place read "
        "and write of the state: how near the host's memory rate the update runs (at 1B with the state in "
        "memory it took 0.56 s on an H100's host, 2026-11-27)",
        lambda out, data: [
            sys.executable,
            str(ROOT / "benches" / "update_kernel.py"),
            "--chunks",
            "24",
            "--rounds",
            "5",
            "--out",
            str(out / "kernel.results.json"),
        ],
    ),
    "e2e-largest": Part(
        "the largest LLaMA the disk holds: DeepSpeed NVMe (pipelined)",
        e2e_part(None, "ds-nvme-pipelined", "e2e-largest"),
    ),
    "e2e-largest-ours": Part(
        "the largest LLaMA the disk holds: ours at DeepSpeed's memory",
        e2e_part(None, "mlp-offload", "e2e-largest-ours"),
    ),
}


def cuda_missing() -> str | None:
    """Why there is no CUDA device to run on, or None."""
    try:
        import torch
    except ImportError as e:
        return f"torch does not import ({e})"
    if not torch.cuda.is_available():
        build = torch.version.cuda or "none"
        return f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA {build})"
    return None


def outcome_of(name: str, rc: int, log: str) -> str:
    """A part's outcome in a few words, from its exit status and the tail of its output."""
    if rc in (-9, 124):
        return f"timed out after {PART_TIMEOUT_SECS} s"
    summary = re.findall(r"^=* ?(\d+ (?:passed|failed|skipped|error)[^=\n]*?) ?=*$", log, re.MULTILINE)
    if summary:
        return summary[-1]
    return "ok" if rc == 0 else f"exit status {rc}"


def write_report(out: Path, records: list[dict[str, object]]) -> None:
    lines = ["# GPU report", "", "| part | outcome | seconds | what |", "|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['part']} | {r['outcome']} | {r['secs']:.0f} | {r['what']} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def run_part(name: str, part: Part, out: Path, data: Path, missing: str | None) -> dict[str, object]:
    record: dict[str, object] = {"part": name, "what": part.what, "secs": 0.0}
    if missing is not None:
        record.update(outcome=f"skipped: {missing}", skipped=True)
        print(f"gpu-report: {name}: skipped: {missing}", flush=True)
    else:
        command = part.command(out, data)
        env = {**os.environ, **part.env, "MLP_OFFLOAD_TEST_DIR": str(data / "tests")}
        log_path = out / f"{name}.log"
        print(f"gpu-report: {name}: {' '.join(command)}", flush=True)
        start = time.perf_counter()
        with log_path.open("w") as log:
            try:
                rc = subprocess.run(
                    command,
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=PART_TIMEOUT_SECS,
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        text = log_path.read_text(errors="replace")
        record.update(
            secs=time.perf_counter() - start,
            rc=rc,
            command=command,
            outcome=outcome_of(name, rc, text[-20000:]),
            log=str(log_path),
            skipped=False,
        )
        print(f"gpu-report: {name}: {record['outcome']} ({record['secs']:.0f} s)", flush=True)
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"among {', '.join(PARTS)} (all)")
    default_out = (
        Path(os.environ["OUT"]) / "gpu-report" if os.environ.get("OUT") else ROOT / "bench-out" / "gpu-report"
    )
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument(
        "--data", type=Path, default=Path(os.environ.get("DATA", ROOT / "target" / "gpu-report-data"))
    )
    parser.add_argument("--list", action="store_true", help="list the parts and exit")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run the parts on DeepSpeed's CPU accelerator instead of skipping them: a check of the report "
        "itself, not figures of a GPU",
    )
    args = parser.parse_args(argv)
    if args.list:
        for name, part in PARTS.items():
            print(f"{name:18} {part.what}")
        return 0
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"{', '.join(unknown)}: not among {', '.join(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.data.mkdir(parents=True, exist_ok=True)
    missing = None if args.cpu else cuda_missing()
    records = []
    for name in args.parts or list(PARTS):
        part = PARTS[name]
        if args.cpu:
            part = Part(f"{part.what} (on the CPU)", part.command, {**part.env, **ON_CPU})
        records.append(run_part(name, part, args.out, args.data, missing))
        write_report(args.out, records)
    failed = [r["part"] for r in records if not r.get("skipped") and r.get("rc") != 0]
    print(f"gpu-report: {len(records)} parts, report in {args.out / 'report.md'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
