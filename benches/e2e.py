"""The end-to-end benchmark: ZeRO-3 training iterations of a LLaMA-style decoder (Hugging Face
`transformers`, random init, bf16) under real DeepSpeed, DeepSpeed's own NVMe offload against mlp-offload.

    make bench-e2e                                     # 130M parameters, micro-batch 1, seq 128
    .venv/bin/python benches/e2e.py --size 20M --rounds 1 --steps 2    # a quick look

Contenders (same model, data, seed and DeepSpeed settings; `sub_group_size` 2e7 by default):
- `ds-nvme-partitioned`, `ds-nvme-pipelined`: `offload_optimizer: {device: nvme}` with buffer_count 4
  (no pipelining) and 12 (pipelined reads and writes); the faster of the two is the baseline (a);
- `mlp-offload`: our engine on the same single path with the same pinned host memory as the pipelined
  baseline (12 x the largest subgroup x 4 bytes);
- `mlp-offload-2path`: the same budget on two paths, the work disk plus the test bed's bandwidth-capped
  loop device (`scripts/testbed.sh`), when this machine can host it (root, loop devices, cgroup v1 blkio);
- `mlp-offload-capped`: the same budget on the test bed's capped loop device alone;
- `mlp-offload-nochecksum`: `mlp-offload` without the CRC32C of every object (what checksums cost);
- `...-noadmit` after either: the same without node-wide admission (`device_inflight: "off"`), for
  `--ranks` above 1 (with one rank admission is off anyway);
- `ds-cpu`: the optimizer state in DRAM (`offload_optimizer: {device: cpu}`), the floor of any offload;
- `ds-cpu-ratio-0.3`, `ds-cpu-ratio-0.5`: the same with stock's `offload_optimizer.ratio` (ZeRO-Offload++):
  its first subgroups' state on the GPU, updated there by torch's AdamW (on DeepSpeed's CPU accelerator,
  `ds-cpu` itself);
- `mlp-offload+NAME`, one per `--variant NAME=JSON`: `mlp-offload` with those keys of our section, for
  A/B runs of a setting, e.g. `--variant inflight16='{"max_inflight": 16}'`; `--variant BASE/NAME=JSON`
  adds `mlp-offload-BASE+NAME` the same way, e.g. `--variant half/serial='{"overlap": false}'`.

`--ranks N` runs every contender as N data-parallel ranks of one node (gloo, `LOCAL_WORLD_SIZE` N, as
torchrun sets it), each with its share of the model's state: a step's phase times are the slowest
rank's (what the job waits for), its bytes all ranks' together, and the spread of the update time
between the ranks is reported per step (`make bench-node`).

Each (contender, round) runs in its own process, contenders interleaved round by round; figures are
medians over the measured steps of every round (warm-up steps dropped). The report has forward,
backward, update and iteration time, the ratios to the baseline, bytes moved per step (from
/proc/self/io, and per path from our telemetry), achieved bandwidth, the I/O floor (bytes moved over
the paths' measured mixed read/write bandwidth) and the update time over it, and the peak resident set.
It writes JSON and a PNG chart. On a machine with a GPU it runs unchanged (the model on the GPU).
`--watch-threads` adds, per phase, where the training thread's and our update thread's time went (on a
CPU, waiting for one, blocked) and the Python stacks they were found in (`benches/threadwatch.py`).
`--pin-memory` gives every contender DeepSpeed's `offload_optimizer.pin_memory: true` (the README's
section leaves DeepSpeed's default, false; on a GPU the chunks ours streams there need it).
`--torch-huge-pages` starts every contender (stock's too) with `THP_MEM_ALLOC_ENABLE=1`: torch's host
tensors of 2 MiB and more then ask for transparent huge pages. On the CPU the backward's compute
allocates its gradients and DeepSpeed's reduce-scatter buffers anew each step, and the first touch of
that memory in 4 KiB pages costs more than the copies that fill it (docs/results.md); on a GPU they are
the device's, from its caching allocator. The report records which.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blocktrace import BlockTrace, describe
from threadwatch import ThreadWatch, merge

CONTENDERS = (
    "ds-nvme-partitioned",
    "ds-nvme-pipelined",
    "mlp-offload",
    "mlp-offload-nochecksum",
    "mlp-offload-half",
    "mlp-offload-default",
    "mlp-offload-2path",
    "mlp-offload-2path-noadmit",
    "mlp-offload-capped",
    "mlp-offload-capped-noadmit",
    "ds-cpu",
    "ds-cpu-ratio-0.3",
    "ds-cpu-ratio-0.5",
)
# Contenders on the test bed's capped loop device (alone or beside the work disk).
TESTBED_CONTENDERS = tuple(c for c in CONTENDERS if "2path" in c or "capped" in c)
BASELINES = ("ds-nvme-partitioned", "ds-nvme-pipelined")
TESTBED = "scripts/testbed.sh"
TESTBED_MOUNT = "/mnt/mlp-offload-testbed"


# `--state`: the dtypes DeepSpeed keeps the optimizer state in, by its bf16 section's keys.
STATES: dict[str, dict[str, bool]] = {
    "fp32": {},
    "bf16-weights": {"bf16_master_weights_and_grads": True},
    "bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
}
# Bytes of state per parameter in DeepSpeed's dtypes (master weights and both moments); `-half` holds
# half of them.
STATE_BYTES = {"fp32": 12, "bf16-weights": 10, "bf16": 6}


def many_ranks() -> bool:
    """Whether this worker is one of several data-parallel ranks (`--ranks` above 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def ds_config(spec: dict[str, Any], params: int) -> dict[str, Any]:
    contender = spec["contender"]
    offload: dict[str, Any] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": spec["sub_group_size"],
            "offload_optimizer": offload,
        },
        "steps_per_print": 10**9,
    }
    # DeepSpeed's state in half precision, for every contender (`--state`).
    config["bf16"].update(STATES[spec.get("state", "fp32")])
    if spec.get("pin_memory"):
        # Page-locked host buffers for every contender, stock's too (the contenders below that pin
        # anyway keep it).
        offload["pin_memory"] = True
    if spec.get("clip") is not None:
        config["gradient_clipping"] = spec["clip"]
    if spec.get("reduce_bucket_size"):
        config["zero_optimization"]["reduce_bucket_size"] = spec["reduce_bucket_size"]
    elif many_ranks():
        # Every contender's backward with smaller buckets than DeepSpeed's defaults (5e8 elements reduced
        # at once, 1e9 kept gathered), so that four ranks fit this machine's memory beside one another.
        config["zero_optimization"].update(reduce_bucket_size=5e7, stage3_max_live_parameters=1e8)
    if spec.get("params_on_nvme") is not None:
        # ZeRO-Infinity: the parameters on NVMe too, for every contender, past `max_in_cpu`. Stock's slots
        # hold the largest parameter each, one slot per parameter: with its default 5 it dies in the
        # first backward ("Not enough buffers").
        largest, count = spec["param_shapes"]
        config["zero_optimization"]["offload_param"] = {
            "device": "nvme",
            "nvme_path": spec["paths"][0],
            "pin_memory": True,
            "max_in_cpu": spec["params_on_nvme"],
            "buffer_count": count,
            "buffer_size": largest,
        }
    if contender.startswith("ds-cpu-ratio-"):
        # ZeRO-Offload++: stock keeps the first subgroups' state on the GPU, updated by torch's AdamW there.
        offload["ratio"] = float(contender.removeprefix("ds-cpu-ratio-"))
    if contender.startswith("ds-nvme"):
        pipelined = contender == "ds-nvme-pipelined"
        offload.update(
            device="nvme",
            nvme_path=spec["paths"][0],
            pin_memory=True,
            pipeline_read=pipelined,
            pipeline_write=pipelined,
            buffer_count=12 if pipelined else 4,
        )
    elif contender.startswith("mlp-offload-default"):
        # The README's configuration as it stands: DeepSpeed's defaults, our section with paths only.
        config["mlp_offload"] = {"paths": spec["paths"], **spec.get("section_keys", {})}
    elif contender.startswith("mlp-offload"):
        # The pipelined baseline's pinned budget (buffer_count x largest subgroup x 4 bytes), or half the
        # state's bytes.
        offload.update(pin_memory=True, buffer_count=12)
        half = contender.startswith("mlp-offload-half")
        half_bytes = STATE_BYTES[spec.get("state", "fp32")] // 2 * params
        config["mlp_offload"] = {"paths": spec["paths"], "host_memory": half_bytes if half else "deepspeed"}
        if contender.endswith("-noadmit"):
            config["mlp_offload"]["device_inflight"] = "off"
        if contender.endswith("-nochecksum"):
            config["mlp_offload"]["checksum"] = False
        config["mlp_offload"].update(spec.get("section_keys", {}))
    return config


class DeviceWatch:
    """What reached the storage devices under `paths`, from their own block counters
    (`_core.block_counters`): per iteration, and per update phase (around `engine.step`). The counters are
    the device's, so they count every process's requests: the ranks of one node together, and whatever
    else runs (nothing, in a benchmark). Devices without counters (FUSE, tmpfs) are left out."""

    def __init__(self, paths: Sequence[str]) -> None:
        from mlp_offload import _core

        self._core = _core
        ids = {_core.probe_directory(p)["device_id"] for p in paths}
        self.devices = sorted(d for d in ids if _core.block_counters(d) is not None)

    def read(self) -> tuple[float, list[Any]]:
        return time.perf_counter(), [self._core.block_counters(d) for d in self.devices]

    def between(self, before: tuple[float, list[Any]], after: tuple[float, list[Any]]) -> dict[str, Any]:
        """The devices' activity between two readings, summed over devices (sizes and depths: the
        request-weighted means)."""
        secs = after[0] - before[0]
        each = [self._core.block_activity(b, a, secs) for b, a in zip(before[1], after[1], strict=True)]
        total: dict[str, Any] = {"secs": secs, "devices": self.devices}
        for k in ("read_bytes", "write_bytes", "read_requests", "write_requests", "queue_depth"):
            total[k] = sum(e[k] for e in each)
        for way in ("read", "write"):
            requests = total[f"{way}_requests"]
            total[f"{way}_request_bytes"] = total[f"{way}_bytes"] / requests if requests else 0.0
            total[f"{way}_merged"] = (
                sum(e[f"{way}_merged"] * e[f"{way}_requests"] for e in each) / requests if requests else 0.0
            )
        return total

    def wrap_step(self, engine: Any, updates: list[dict[str, Any]]) -> None:
        """Makes `engine.step()` append what reached the devices while it ran to `updates`."""
        step = engine.step

        def watched_step(*args: Any, **kwargs: Any) -> Any:
            before = self.read()
            try:
                return step(*args, **kwargs)
            finally:
                updates.append(self.between(before, self.read()))

        engine.step = watched_step


def proc_io() -> tuple[int, int]:
    """Bytes this process (all its threads, io_uring workers included) read from and wrote to storage."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One contender, one round: build the engine, run the steps, time each phase."""
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    import deepspeed
    import torch

    import mlp_offload
    from mlp_offload.app.models import GPT, WideTables, llama
    from mlp_offload.app.train import timed_iteration

    def build() -> Any:
        if spec["model"] == "gpt":
            return GPT.from_size(spec["size"], max_seq=spec["seq"])
        if spec["model"] == "wide":
            return WideTables.from_size(spec["size"])
        return llama(spec["size"], vocab=32000, max_seq=spec["seq"])

    rank = int(os.environ.get("RANK", "0"))
    with torch.device("meta"):
        shape = build()
    params = sum(p.numel() for p in shape.parameters())
    vocab = getattr(shape, "vocab", 32000)
    numels = [p.numel() for p in shape.parameters()]
    config = ds_config({**spec, "param_shapes": (max(numels), len(numels))}, params)
    torch.manual_seed(0)
    if many_ranks() or spec.get("params_on_nvme") is not None:
        # Many ranks build the model as large jobs do, each allocating only its own partition of every
        # parameter (a whole model in fp32 in each of four ranks would not fit this machine's memory);
        # with the parameters on NVMe each partition is written there as it is made (ours through our
        # store: `install()` first, as the README says).
        deepspeed.init_distributed(dist_backend="gloo")
        if spec["contender"].startswith("mlp-offload"):
            mlp_offload.install()
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build()
    else:
        model = build()
    init = mlp_offload.initialize if spec["contender"].startswith("mlp-offload") else deepspeed.initialize
    t0 = time.perf_counter()
    engine, optimizer, _, _ = init(model=model, model_parameters=model.parameters(), config=config)
    init_secs = time.perf_counter() - t0
    # Each data-parallel rank its own batches.
    data = torch.Generator().manual_seed(1 + rank)
    steps: list[dict[str, Any]] = []
    watch = DeviceWatch(spec["paths"]) if not spec["contender"].startswith("ds-cpu") else None
    updates: list[dict[str, Any]] = []
    traces: list[dict[str, Any]] = []
    if watch is not None:
        watch.wrap_step(engine, updates)
        if spec.get("trace_block"):
            trace_step(engine, BlockTrace(watch.devices), spec["warmup"], traces)
    threads = ThreadWatch(training_threads) if spec.get("watch_threads") else None
    for k in range(spec["warmup"] + spec["steps"]):
        tokens = torch.randint(0, vocab, (spec["micro_batch"], spec["seq"] + 1), generator=data)
        tokens = tokens.to(engine.device)
        io0 = proc_io()
        disk0 = watch.read() if watch else None
        if spec["model"] in ("gpt", "wide"):
            step = timed_iteration(engine, tokens)
        else:
            step = timed_iteration(engine, input_ids=tokens[:, :-1], labels=tokens[:, :-1])
        ended = time.perf_counter()
        io1 = proc_io()
        steps.append({**step, "bytes_read": io1[0] - io0[0], "bytes_written": io1[1] - io0[1]})
        if watch is not None and disk0 is not None:
            steps[-1]["disk"] = {"iteration": watch.between(disk0, watch.read()), "update": updates[-1]}
        if threads is not None:
            if k >= spec["warmup"]:
                steps[-1]["threads"] = phases_of(threads, step, ended)
            threads.forget(ended)
    if threads is not None:
        threads.stop()
    result: dict[str, Any] = {
        "params": params,
        "init_secs": init_secs,
        "steps": steps[spec["warmup"] :],
        "device": str(engine.device),
        # Kernel's high-water mark of the resident set, pinned buffers included (KiB on Linux).
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if hasattr(optimizer, "mlp_offload_wait"):
        # The last step's update may still run behind it; its record comes once it ends.
        optimizer.mlp_offload_wait()
    telemetry = getattr(optimizer, "mlp_offload_telemetry", None)
    if telemetry:
        result["telemetry"] = telemetry
        records = [t for t in telemetry if t["event"] == "step"]
        if len(records) == len(steps):
            for step, record in zip(steps, records, strict=True):
                if record.get("overlap") is not None:
                    # With the update behind step(), step() returns at once and the next forward and
                    # backward wait for it: the update's phase is its own wall time (which overlaps the
                    # next forward), and the iteration, measured, is what counts.
                    step["update_returned"] = step["update"]
                    step["update"] = record["update_secs"]
    if traces:
        result["block_trace"] = traces[0]
    engine.destroy()
    return result


def training_threads() -> dict[str, threading.Thread]:
    """The threads `--watch-threads` samples: the training loop's, and our update's where it runs on one."""
    found = {"main": threading.main_thread()}
    for thread in threading.enumerate():
        if thread.name.startswith("mlp-offload-update"):
            found["update"] = thread
    return found


def phases_of(threads: ThreadWatch, step: dict[str, Any], ended: float) -> dict[str, Any]:
    """Where each sampled thread's time went in each phase of `step` (`timed_iteration`'s, which runs
    them one after another and returned at `ended`)."""
    bounds = [ended]
    for phase in ("update", "backward", "forward"):
        bounds.insert(0, bounds[0] - step[phase])
    return {
        phase: threads.phase(bounds[i], bounds[i + 1])
        for i, phase in enumerate(("forward", "backward", "update"))
    }


def trace_step(engine: Any, trace: BlockTrace, warmup: int, traces: list[dict[str, Any]]) -> None:
    """Makes the first measured `engine.step()` (after `warmup` steps) record the requests its devices
    were sent (`blocktrace.py`), appended to `traces`."""
    step, calls = engine.step, [0]

    def traced_step(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] != warmup + 1:
            return step(*args, **kwargs)
        trace.start()
        try:
            return step(*args, **kwargs)
        finally:
            traces.append(trace.stop())

    engine.step = traced_step


def testbed_available() -> tuple[bool, str]:
    proc = subprocess.run(["bash", TESTBED, "check"], capture_output=True, text=True)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def path_bandwidths(paths: list[str], testbed_up: bool) -> list[float]:
    """Each path's mixed read/write bandwidth (bytes/s), probed now and saved (`mlp-offload probe`), in the
    test bed's cgroup when it is up so the loop device's cap applies: the I/O floor's denominator. Paths
    probed together give their concurrent figures."""
    command = [str(Path(sys.executable).with_name("mlp-offload")), "probe", *paths, "--json", "-q"]
    if testbed_up:
        command = ["bash", TESTBED, "run", "--", *command]
    probes = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    rates = [float(p.get("concurrent_bytes_per_s") or p["mixed_bytes_per_s"]) for p in probes]
    print(f"probed {paths}: {[f'{r / 2**20:.0f} MiB/s' for r in rates]}", file=sys.stderr)
    return rates


def fio_floor(paths: list[str], testbed_up: bool, size: str = "4G") -> float:
    """The paths' summed bandwidth (bytes/s) for half reads, half writes of 4 MiB at queue depth 16 with
    O_DIRECT, all paths at once, measured by fio over a working set of `size` per path for 10 s after 2 s
    of ramp: the I/O floor's denominator. 0 when fio is missing."""
    if shutil.which("fio") is None:
        return 0.0
    command = ["fio", "--output-format=json", "--group_reporting=0"]
    for i, path in enumerate(paths):
        command += [
            f"--name=floor{i}",
            f"--filename={Path(path) / 'fio-floor.dat'}",
            "--rw=rw",
            "--rwmixread=50",
            "--bs=4M",
            "--direct=1",
            "--ioengine=io_uring",
            "--iodepth=16",
            f"--size={size}",
            "--time_based",
            "--runtime=10",
            "--ramp_time=2",
        ]
    if testbed_up:
        command = ["bash", TESTBED, "run", "--", *command]
    try:
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    finally:
        for path in paths:
            (Path(path) / "fio-floor.dat").unlink(missing_ok=True)
    jobs = json.loads(out[out.index("{") :])["jobs"]
    rate = sum(1024.0 * (j["read"]["bw"] + j["write"]["bw"]) for j in jobs)
    print(f"fio floor {paths}: {rate / 2**20:.0f} MiB/s", file=sys.stderr)
    return rate


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        choices=("llama", "gpt", "wide"),
        default="llama",
        help="llama; gpt; wide: embedding tables with little compute (models.WideTables)",
    )
    parser.add_argument("--size", default="130M", help="model size, see mlp_offload.app.models (130M)")
    parser.add_argument(
        "--state",
        choices=list(STATES),
        default="fp32",
        help="the optimizer state's dtypes, for every contender: fp32, bf16-weights (bf16 master weights, "
        "fp32 moments) or bf16 (bf16 master weights and moments: 6 bytes a parameter)",
    )
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--sub-group-size", type=int, default=20_000_000)
    parser.add_argument(
        "--clip",
        type=float,
        default=None,
        help="DeepSpeed's gradient_clipping for every contender (its default: 1.0; 0 turns it off)",
    )
    parser.add_argument(
        "--reduce-bucket-size",
        type=int,
        default=None,
        help="DeepSpeed's zero_optimization.reduce_bucket_size for every contender (its default: 5e8)",
    )
    parser.add_argument(
        "--params-on-nvme",
        type=int,
        default=None,
        metavar="MAX_IN_CPU",
        help="the parameters on NVMe too, for every contender (ZeRO-Infinity), past this offload_param."
        "max_in_cpu (elements); stock's param swapper with a slot of the largest parameter per parameter",
    )
    parser.add_argument("--path", default="target/bench-e2e", help="the local storage directory")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="adds contender mlp-offload+NAME: mlp-offload with these keys of its section; BASE/NAME=JSON "
        "adds mlp-offload-BASE+NAME (e.g. half/, default/) (repeatable)",
    )
    parser.add_argument("--testbed-bps", default="500M", help="the second path's cap (500M)")
    parser.add_argument(
        "--ranks", type=int, default=1, help="data-parallel ranks of one node per contender (1)"
    )
    parser.add_argument(
        "--trace-block",
        action="store_true",
        help="record the requests the disk was sent in each contender's first measured update (root)",
    )
    parser.add_argument(
        "--watch-threads",
        action="store_true",
        help="sample the training thread and our update's thread every 2 ms: per phase, time on a CPU, "
        "waiting for one, and neither (blocked), and the Python stacks they were found in",
    )
    parser.add_argument(
        "--pin-memory",
        action="store_true",
        help="every contender with DeepSpeed's offload_optimizer.pin_memory: true (on a GPU, the chunks "
        "ours streams there beside the host's pass need it)",
    )
    parser.add_argument(
        "--torch-huge-pages",
        action="store_true",
        help="every contender with THP_MEM_ALLOC_ENABLE=1: torch's host tensors in transparent huge pages",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON results' summary; the chart goes beside it"
    )
    parser.add_argument(
        "--records",
        type=Path,
        default=Path("target") / "bench-records",
        help="where the whole report goes, every step's records included (target/bench-records)",
    )
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker.read_text())
        Path(os.environ["MLP_OFFLOAD_BENCH_RESULT"]).write_text(json.dumps(worker(spec)))
        return 0

    if args.trace_block and (why := BlockTrace.unavailable()):
        parser.error(f"--trace-block: {why}")
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        parser.error(f"--contenders: {', '.join(sorted(unknown))} not among {', '.join(CONTENDERS)}")
    args.section_keys = {}
    for variant in args.variant:
        name, _, keys = variant.partition("=")
        # BASE/NAME: the variant of another of our contenders (mlp-offload-BASE, e.g. half or default).
        base, _, name = name.rpartition("/")
        if base and f"mlp-offload-{base}" not in CONTENDERS:
            parser.error(f"--variant {variant!r}: no contender mlp-offload-{base}")
        try:
            section_keys = json.loads(keys)
        except json.JSONDecodeError as e:
            parser.error(f"--variant {variant!r}: the keys after '=' are not JSON ({e})")
        if not name or not isinstance(section_keys, dict):
            parser.error(f"--variant {variant!r}: expected NAME={{...}}, keys of the mlp_offload section")
        contender = f"mlp-offload-{base}+{name}" if base else f"mlp-offload+{name}"
        args.section_keys[contender] = section_keys
        contenders.append(contender)
    notes: list[str] = []
    testbed_up = False
    on_testbed = [c for c in contenders if c in TESTBED_CONTENDERS]
    if on_testbed:
        ok, why = testbed_available()
        if not ok:
            contenders = [c for c in contenders if c not in on_testbed]
            notes.append(f"{', '.join(on_testbed)} not run: this machine cannot host the test bed: {why}")
            print(notes[-1], file=sys.stderr)
    try:
        if any(c in TESTBED_CONTENDERS for c in contenders):
            subprocess.run(
                ["bash", TESTBED, "up", "--size", "6G", "--bps", args.testbed_bps],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            testbed_up = True
        report = run(args, contenders, testbed_up)
    finally:
        if testbed_up:
            subprocess.run(["bash", TESTBED, "down"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report["notes"] = notes
    print_report(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # The whole report beside the repository; its summary, which pages cite, at --out (docs/data is
        # kept small: tests/test_docs.py).
        whole = args.records / args.out.name
        whole.parent.mkdir(parents=True, exist_ok=True)
        whole.write_text(json.dumps(report, indent=2))
        args.out.write_text(json.dumps(summary_of(report, whole), indent=2))
        chart = args.out.with_suffix(".png")
        draw_chart(report, chart)
        print(f"results: {args.out} (every step's records: {whole}), chart: {chart}", file=sys.stderr)
    return 0


# A round's per-step records, which `summary_of` leaves out (the whole report goes to `--records`).
PER_STEP = ("steps", "telemetry")


def summary_of(report: dict[str, Any], whole: Path) -> dict[str, Any]:
    """The report without its rounds' per-step records (`PER_STEP`): the medians, ratios and per-round
    figures stay; where the whole report is said."""
    runs = {
        name: [{k: v for k, v in rnd.items() if k not in PER_STEP} for rnd in rounds]
        for name, rounds in report["runs"].items()
    }
    trimmed = f"each round's per-step records ({', '.join(PER_STEP)}) left out; the whole report: {whole}"
    return {**report, "runs": runs, "trimmed": trimmed}


def run(args: argparse.Namespace, contenders: list[str], testbed_up: bool) -> dict[str, Any]:
    root = Path(args.path).resolve()
    local = root / "data"
    second = Path(TESTBED_MOUNT) / "e2e"
    # Single-path contenders take turns in one directory (emptied before each run), so one profile of
    # it is every such contender's I/O floor; the two-path one has its own pair.
    paths_of = {c: [str(local / "one-path")] for c in contenders}
    for c in contenders:
        if "2path" in c:
            paths_of[c] = [str(local / "two-path"), str(second / "two-path")]
        elif "capped" in c:
            paths_of[c] = [str(second / "capped")]
    for paths in paths_of.values():
        for p in paths:
            Path(p).mkdir(parents=True, exist_ok=True)
    # Profiles first, of the very directories the contenders use: saved, so our engine plans from them
    # instead of probing inside a timed run, and the I/O floor has its bandwidth.
    bandwidths = {
        paths: path_bandwidths(list(paths), testbed_up) for paths in {tuple(p) for p in paths_of.values()}
    }
    floors = {paths: fio_floor(list(paths), testbed_up) for paths in bandwidths}
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    for rnd in range(args.rounds):
        for k, contender in enumerate(contenders):
            # Each run starts from empty storage: no state or swap files of an earlier run.
            run_paths = paths_of[contender]
            for p in run_paths:
                shutil.rmtree(p, ignore_errors=True)
                Path(p).mkdir(parents=True)
            spec = {
                "contender": contender,
                "model": args.model,
                "size": args.size,
                "seq": args.seq,
                "micro_batch": args.micro_batch,
                "sub_group_size": args.sub_group_size,
                "reduce_bucket_size": args.reduce_bucket_size,
                "clip": args.clip,
                "pin_memory": args.pin_memory,
                "state": args.state,
                "params_on_nvme": args.params_on_nvme,
                "paths": run_paths,
                "warmup": args.warmup,
                "steps": args.steps,
                "section_keys": args.section_keys.get(contender, {}),
                "trace_block": args.trace_block,
                "watch_threads": args.watch_threads,
            }
            spec_file = root / f"{contender}.spec.json"
            spec_file.write_text(json.dumps(spec))
            env = {**os.environ}
            if args.torch_huge_pages:
                env["THP_MEM_ALLOC_ENABLE"] = "1"
            if not _has_cuda():
                env["DS_ACCELERATOR"] = "cpu"
            env.setdefault("TORCH_EXTENSIONS_DIR", str(Path("target/torch_extensions").resolve()))
            env["MASTER_ADDR"] = "127.0.0.1"
            env["MASTER_PORT"] = str(29700 + (rnd * len(contenders) + k) % 200)
            if args.ranks > 1:
                # The node's cores shared among its ranks.
                env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.ranks))
            print(f"round {rnd + 1}/{args.rounds}: {contender} ...", file=sys.stderr, flush=True)
            ranks = launch(spec_file, root / contender, env, args.ranks, testbed_up)
            for result in ranks:
                result["paths"] = run_paths
                result["path_bytes_per_s"] = (
                    bandwidths[tuple(run_paths)] if not contender.startswith("ds-cpu") else []
                )
                result["fio_bytes_per_s"] = (
                    floors[tuple(run_paths)] if not contender.startswith("ds-cpu") else 0.0
                )
            runs[contender].append(merge_ranks(ranks))
            # Each run's figures as it ends: a bench cut off by a time limit keeps what it measured.
            print(f"  {contender}: {describe_run(runs[contender][-1])}", file=sys.stderr, flush=True)
            for line in describe_threads(watched_threads(runs[contender][-1]["steps"]) or {}):
                print(f"    {line}", file=sys.stderr, flush=True)
    for data_dir in (local, second):
        shutil.rmtree(data_dir, ignore_errors=True)
    report = summarize(runs)
    report.update(
        {
            "machine": {
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "kernel": platform.release(),
                "device": runs[contenders[0]][0]["device"],
                "torch_huge_pages": args.torch_huge_pages or os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
                "transparent_hugepage": transparent_hugepage(),
            },
            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "args": {k: str(v) for k, v in vars(args).items() if k != "worker"},
            "runs": runs,
        }
    )
    return report


def transparent_hugepage() -> str:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`), or why it is unknown."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    try:
        return mode.read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError) as e:
        return f"unknown ({e})"


def launch(
    spec_file: Path, stem: Path, env: dict[str, str], ranks: int, testbed_up: bool
) -> list[dict[str, Any]]:
    """Runs one contender as `ranks` processes of one node and returns each rank's result."""
    procs = []
    for rank in range(ranks):
        result, log = stem.with_suffix(f".rank{rank}.json"), stem.with_suffix(f".rank{rank}.log")
        rank_env = {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks),
            "MLP_OFFLOAD_BENCH_RESULT": str(result),
        }
        command = [sys.executable, __file__, "--worker", str(spec_file)]
        if testbed_up:
            # Only this process's I/O to the loop device is capped; every contender runs the same way.
            command = ["bash", TESTBED, "run", "--", *command]
        # Output to a file, not a pipe: a rank blocked on a full pipe would stall the others' collectives.
        with log.open("w") as sink:
            procs.append(
                (subprocess.Popen(command, env=rank_env, stdout=sink, stderr=subprocess.STDOUT), result, log)
            )
    try:
        for rank, (proc, _, log) in enumerate(procs):
            if proc.wait() != 0:
                print(log.read_text()[-4000:], file=sys.stderr)
                raise SystemExit(f"{stem.name} rank {rank} failed")
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()  # the other ranks of a failed one would wait in a collective for ever
    return [json.loads(result.read_text()) for _, result, _ in procs]


def merge_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's round as the job saw it: per step, each phase the slowest rank's time, bytes
    all ranks' together, and the spread of the update between ranks ((slowest - fastest) / slowest).
    Rank 0's telemetry stands for the ranks' (they keep one split)."""
    if len(ranks) == 1:
        return ranks[0]
    merged = dict(ranks[0])
    steps = []
    for per_rank in zip(*(r["steps"] for r in ranks), strict=True):
        step = {k: max(s[k] for s in per_rank) for k in ("forward", "backward", "update", "iteration")}
        for k in ("bytes_read", "bytes_written"):
            step[k] = sum(s[k] for s in per_rank)
        updates = [s["update"] for s in per_rank]
        step["update_spread"] = (max(updates) - min(updates)) / max(updates)
        if "disk" in per_rank[0]:
            # The device's own counters: every rank's requests already, so rank 0's reading stands.
            step["disk"] = per_rank[0]["disk"]
        if "threads" in per_rank[0]:
            # Rank 0's threads stand for the ranks' (each runs the same program).
            step["threads"] = per_rank[0]["threads"]
        steps.append(step)
    merged["steps"] = steps
    merged["ranks"] = len(ranks)
    merged["peak_rss_bytes"] = sum(r["peak_rss_bytes"] for r in ranks)
    return merged


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def describe_run(run: dict[str, Any]) -> str:
    """One round's medians over its measured steps, in a line."""
    steps = run["steps"]
    medians = {
        k: statistics.median(s[k] for s in steps) for k in ("iteration", "forward", "backward", "update")
    }
    return (
        f"iteration {medians['iteration']:.3f} s (forward {medians['forward']:.3f}, backward "
        f"{medians['backward']:.3f}, update {medians['update']:.3f}; medians of {len(steps)} steps)"
    )


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    phases = ("forward", "backward", "update", "iteration", "bytes_read", "bytes_written")
    rows: dict[str, dict[str, Any]] = {}
    for contender, rounds in runs.items():
        steps = [s for r in rounds for s in r["steps"]]
        row: dict[str, Any] = {k: statistics.median(s[k] for s in steps) for k in phases}
        row["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in rounds)
        moved = row["bytes_read"] + row["bytes_written"]
        # fio's figure where there is one, else our probe's.
        bandwidth = rounds[0].get("fio_bytes_per_s") or sum(rounds[0]["path_bytes_per_s"])
        row["io_floor_secs"] = (
            moved / bandwidth if not contender.startswith("ds-cpu") and bandwidth > 0 else 0.0
        )
        row["update_over_io_floor"] = row["update"] / row["io_floor_secs"] if row["io_floor_secs"] else None
        row["update_bytes_per_s"] = moved / row["update"] if not contender.startswith("ds-cpu") else 0.0
        if disks := [s["disk"] for s in steps if "disk" in s]:
            row["disk"] = disk_medians(disks)
        if watched := watched_threads(steps):
            row["threads"] = watched
        if spreads := [s["update_spread"] for s in steps if "update_spread" in s]:
            row["update_spread_median"] = statistics.median(spreads)
            row["update_spread_max"] = max(spreads)
        records = [t for r in rounds for t in r.get("telemetry", []) if t.get("event") == "step"]
        if records:
            row["per_path"] = per_path_medians(rounds[0]["paths"], records)
            # The engine predicts each step from the steps before it; the first two steps have only the
            # start-up plan's prediction, from the probe.
            measured = [t for t in records if t["step"] >= 2] or records
            predicted = [t["predicted_update_secs"] for t in measured if t.get("predicted_update_secs")]
            row["predicted_update_secs"] = statistics.median(predicted) if predicted else None
            startup = [t["predicted_update_secs"] for t in records if t["step"] < 2]
            row["startup_predicted_update_secs"] = startup[0] if startup else None
            steps_of = [t["update_secs"] for t in measured]
            row["measured_update_secs_of_predicted_steps"] = statistics.median(steps_of) if steps_of else None
            # With the update during backward: the prediction of what it leaves after backward, against
            # the update measured after backward on the steps that kept it.
            after = [
                (t["predicted_after_backward_secs"], t["update_secs"])
                for t in measured
                if t.get("predicted_after_backward_secs") is not None
                and (t.get("overlap_backward") or {}).get("kept")
            ]
            if after:
                row["predicted_after_backward_secs"] = statistics.median(a for a, _ in after)
                row["measured_after_backward_secs"] = statistics.median(m for _, m in after)
            if finals := [in_backward(t) for t in measured if t.get("grads_final")]:
                row["grads_final"] = {k: statistics.median(f[k] for f in finals) for k in finals[0]}
            starts = [t for r in rounds for t in r.get("telemetry", []) if t.get("event") == "start"]
            if on_nvme := params_on_nvme(starts[0], measured):
                row["params_on_nvme"] = on_nvme
        rows[contender] = row
    present = [b for b in BASELINES if b in rows]
    baseline = min(present, key=lambda b: rows[b]["iteration"]) if present else None
    ratios = {}
    if baseline:
        base = rows[baseline]
        for contender, m in rows.items():
            ratios[contender] = {k: base[k] / m[k] for k in ("update", "iteration")}
    params = next(iter(runs.values()))[0]["params"]
    return {"params": params, "baseline": baseline, "median": rows, "speedup_over_baseline": ratios}


def params_on_nvme(start: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Medians of the forward's and backward's reads of the parameters on NVMe (ours' telemetry): bytes,
    the seconds the busiest path read and the compute waited (the bytes and the wait also the
    backward's alone), the plan's prediction, what the fetches and the update took from the parameters'
    cache, and the rate read against the plan's (the probe's read figure at the plan's split; None
    where nothing was read)."""
    steps = [
        t["params_on_nvme"]
        for t in records
        if (t.get("params_on_nvme") or {}).get("read_busy_secs") is not None
    ]
    plan = start.get("plan") or {}
    if not steps or not plan.get("param_pass_secs"):
        return None
    row: dict[str, Any] = {
        k: statistics.median(s.get(k) or 0 for s in steps)
        for k in (
            "fetched_bytes",
            "backward_fetched_bytes",
            "read_busy_secs",
            "fetch_wait_secs",
            "backward_fetch_wait_secs",
            "predicted_read_secs",
            "cached_bytes",
            "read_cached_bytes",
        )
    }
    # The update's reads of the partitions (the master weights, where they are in the parameters) share
    # the busy time: the fetches' part of it is what their prediction is for.
    row["update_read_bytes"] = statistics.median(s["read_bytes"] for s in steps)
    busy = [s for s in steps if s["read_busy_secs"] > 0]
    row["fetch_busy_secs"] = statistics.median(
        [s["read_busy_secs"] * s["fetched_bytes"] / (s["fetched_bytes"] + s["read_bytes"]) for s in busy]
        or [0.0]
    )
    row["bytes_per_busy_s"] = (
        statistics.median((s["fetched_bytes"] + s["read_bytes"]) / s["read_busy_secs"] for s in busy)
        if busy
        else None
    )
    row["plan_bytes_per_s"] = start["params_on_nvme_bytes"] / plan["param_pass_secs"]
    return row


def watched_threads(steps: list[dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """Per phase and thread, where its time went over `steps` (`--watch-threads`; None without)."""
    watched = [s["threads"] for s in steps if "threads" in s]
    if not watched:
        return None
    return {
        phase: {
            name: merge([w[phase][name] for w in watched if name in w[phase]])
            for name in sorted({n for w in watched for n in w[phase]})
        }
        for phase in ("forward", "backward", "update")
    }


def in_backward(record: dict[str, Any]) -> dict[str, float]:
    """What one step's record says of the update during backward (issue 30, part 2), an estimate: the
    boundary's backward time, the share of chunks whose gradient was final before half of it had run,
    and how much of the update's time could have run before backward ended if each chunk were updated
    as soon as its gradient was final, one after another, each taking an equal part of the update's
    measured time (`update_secs` / chunks)."""
    from mlp_offload.engine.planning import could_run_in_backward

    backward = record["grads_final"]["backward_secs"]
    leads = record["grads_final"]["lead_secs"]
    hidden = could_run_in_backward(leads, backward, record["update_secs"] / len(leads))
    return {
        "backward_secs": backward,
        "final_by_half": sum(lead >= backward / 2 for lead in leads) / len(leads),
        "could_hide_secs": hidden,
        "update_secs": record["update_secs"],
    }


def disk_medians(disks: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over steps of what the devices' own counters saw: bytes per iteration, and during the update
    phase its bytes per second, request sizes, merged shares and queue depth."""
    it, up = [d["iteration"] for d in disks], [d["update"] for d in disks]

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "devices": disks[0]["update"]["devices"],
        "iteration_read_bytes": med(it, "read_bytes"),
        "iteration_write_bytes": med(it, "write_bytes"),
        "update_read_bytes": med(up, "read_bytes"),
        "update_write_bytes": med(up, "write_bytes"),
        "update_bytes_per_s": statistics.median((u["read_bytes"] + u["write_bytes"]) / u["secs"] for u in up),
        "update_read_request_bytes": med(up, "read_request_bytes"),
        "update_write_request_bytes": med(up, "write_request_bytes"),
        "update_read_merged": med(up, "read_merged"),
        "update_write_merged": med(up, "write_merged"),
        "update_queue_depth": med(up, "queue_depth"),
    }


def per_path_medians(paths: list[str], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per path, medians over steps of bytes moved (also while forward and backward ran) and of bytes
    per busy second."""
    out = []
    for i, path in enumerate(paths):
        moved = [t["paths"][i]["read_bytes"] + t["paths"][i]["write_bytes"] for t in records]
        rates = [
            (t["paths"][i]["read_bytes"] + t["paths"][i]["write_bytes"]) / t["paths"][i]["busy_secs"]
            for t in records
            if t["paths"][i]["busy_secs"] > 0
        ]
        out.append(
            {
                "path": path,
                "bytes_per_step": statistics.median(moved),
                "bytes_per_busy_s": statistics.median(rates) if rates else 0.0,
            }
        )
    return out


def print_report(report: dict[str, Any]) -> None:
    gib = 2**30
    ranks = int(report.get("args", {}).get("ranks", 1))
    of_ranks = f", {ranks} ranks of one node (each phase the slowest rank's)" if ranks > 1 else ""
    print(f"\n{report['params'] / 1e6:.0f}M parameters{of_ranks}; medians, seconds per iteration")
    print(
        f"{'contender':24} {'fwd':>6} {'bwd':>6} {'update':>7} {'iter':>6} {'upd x':>6} {'iter x':>6} "
        f"{'GiB/step':>8} {'MiB/s':>7} {'floor s':>7} {'upd/floor':>9} {'peak GiB':>8}"
    )
    base_disk = report["median"].get(report["baseline"] or "", {}).get("disk")
    for contender, m in report["median"].items():
        r = report["speedup_over_baseline"].get(contender, {})
        floor = m["update_over_io_floor"]
        print(
            f"{contender:24} {m['forward']:6.2f} {m['backward']:6.2f} {m['update']:7.2f} "
            f"{m['iteration']:6.2f} {r.get('update', math.nan):6.2f} {r.get('iteration', math.nan):6.2f} "
            f"{(m['bytes_read'] + m['bytes_written']) / gib:8.2f} {m['update_bytes_per_s'] / 2**20:7.0f} "
            f"{m['io_floor_secs']:7.2f} {floor if floor is not None else math.nan:9.2f} "
            f"{m['peak_rss_bytes'] / gib:8.2f}"
        )
        if d := m.get("disk"):
            rate = d["update_bytes_per_s"]
            of_base = f" ({rate / base_disk['update_bytes_per_s']:.2f}x the baseline's)" if base_disk else ""
            print(
                f"  disk ({', '.join(d['devices'])}): {(d['iteration_read_bytes']) / gib:.2f} GiB read, "
                f"{d['iteration_write_bytes'] / gib:.2f} GiB written per iteration; in the update "
                f"{(d['update_read_bytes'] + d['update_write_bytes']) / gib:.2f} GiB at {rate / 2**20:.0f} "
                f"MiB/s{of_base}, requests of {d['update_read_request_bytes'] / 1024:.0f} KiB read "
                f"({100 * d['update_read_merged']:.0f}% merged) and "
                f"{d['update_write_request_bytes'] / 1024:.0f} KiB written "
                f"({100 * d['update_write_merged']:.0f}% merged), {d['update_queue_depth']:.1f} queued"
            )
        for rnd, run in enumerate(report["runs"].get(contender, [])):
            if "block_trace" in run:
                print(
                    f"  requests of round {rnd + 1}'s first measured update: {describe(run['block_trace'])}"
                )
        for line in describe_threads(m.get("threads", {})):
            print(f"  {line}")
        if "update_spread_max" in m:
            print(
                f"  update spread between ranks: median {100 * m['update_spread_median']:.1f}%, "
                f"largest {100 * m['update_spread_max']:.1f}%"
            )
        for p in m.get("per_path", []):
            print(
                f"  {p['path']}: {p['bytes_per_step'] / gib:.2f} GiB/step, "
                f"{p['bytes_per_busy_s'] / 2**20:.0f} MiB per busy second"
            )
        if g := m.get("grads_final"):
            print(
                f"  gradients final in the boundary's backward ({g['backward_secs']:.2f} s): "
                f"{100 * g['final_by_half']:.0f}% of chunks by its half; of the update's "
                f"{g['update_secs']:.2f} s, {g['could_hide_secs']:.2f} s could run before it ends "
                "(estimate: each chunk as soon as its gradient is final, one at a time)"
            )
        if n := m.get("params_on_nvme"):
            rate = n["bytes_per_busy_s"]
            print(
                f"  parameters on NVMe: the forward and backward read {n['fetched_bytes'] / gib:.2f} GiB "
                f"(the backward {n['backward_fetched_bytes'] / gib:.2f}; "
                f"{n['cached_bytes'] / gib:.2f} GiB more taken from the cache, the update "
                f"{n['read_cached_bytes'] / gib:.2f} GiB), "
                f"the busiest path reading {n['fetch_busy_secs']:.2f} s for them "
                f"(predicted {n['predicted_read_secs']:.2f} s; {n['read_busy_secs']:.2f} s with the "
                f"update's {n['update_read_bytes'] / gib:.2f} GiB) "
                + (
                    f"at {rate / 2**20:.0f} MiB/s, {rate / n['plan_bytes_per_s']:.2f}x the plan's "
                    f"{n['plan_bytes_per_s'] / 2**20:.0f}"
                    if rate
                    else "(nothing read)"
                )
                + f"; the compute waited {n['fetch_wait_secs']:.2f} s "
                f"(the backward {n['backward_fetch_wait_secs']:.2f} s)"
            )
        if m.get("predicted_after_backward_secs") is not None:
            print(
                f"  predicted update after backward {m['predicted_after_backward_secs']:.2f} s (from the "
                f"steps before: the update inside step() predicted {m['predicted_update_secs']:.2f} s, "
                "less what could run during backward at the last boundary's gradient times), measured "
                f"{m['measured_after_backward_secs']:.2f} s on the steps that kept it"
            )
        elif m.get("predicted_update_secs"):
            print(
                f"  predicted update {m['predicted_update_secs']:.2f} s (from the steps before; at start-up "
                f"{m['startup_predicted_update_secs'] or math.nan:.2f} s), measured "
                f"{m['measured_update_secs_of_predicted_steps']:.2f} s on the same steps"
            )
    print(
        f"x: the baseline's ({report['baseline']}) median time over the contender's. "
        "GiB/step: bytes read and written per iteration (/proc/self/io); MiB/s: those bytes over the "
        "update time; floor: those bytes over fio's half-read, half-write bandwidth on the same paths, "
        "measured in this run (our probe's mixed figure when fio is missing). disk: the devices' own "
        "block counters (every process's requests), per iteration and during the update phase."
    )
    for note in report.get("notes", []):
        print(f"note: {note}")


def describe_threads(watched: dict[str, dict[str, Any]]) -> list[str]:
    """`watched_threads` in lines, one per phase and thread: where its time went, and its likeliest
    stacks."""
    lines = []
    for phase, named in watched.items():
        for name, t in named.items():
            split = ""
            if t["on_cpu_secs"] is not None and t["secs"]:
                blocked = max(0.0, t["secs"] - t["on_cpu_secs"] - t["runnable_secs"])
                split = (
                    f": {t['on_cpu_secs']:.3f} on a CPU, {t['runnable_secs']:.3f} waiting for one, "
                    f"{blocked:.3f} neither"
                )
            stacks = "; ".join(f"{100 * share:.0f}% {stack}" for stack, share in t["stacks"][:3])
            lines.append(
                f"{phase}, {name} thread: {t['secs']:.3f} s{split} ({t['samples']} samples: {stacks})"
            )
    return lines


def draw_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = list(report["median"])
    phases = ("forward", "backward", "update")
    colors = {"forward": "#8da0cb", "backward": "#66c2a5", "update": "#fc8d62"}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottoms = [0.0] * len(names)
    for phase in phases:
        values = [report["median"][n][phase] for n in names]
        ax.bar(names, values, bottom=bottoms, label=phase, color=colors[phase])
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    for i, n in enumerate(names):
        r = report["speedup_over_baseline"].get(n)
        if r:
            ax.annotate(
                f"{r['iteration']:.2f}x iter\n{r['update']:.2f}x update",
                (i, bottoms[i]),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_ylabel("seconds per iteration (median)")
    ax.set_ylim(0, max(bottoms) * 1.25)
    ax.set_title(
        f"ZeRO-3, {report['params'] / 1e6:.0f}M parameters, {report['machine']['device']}: "
        f"ratios to {report['baseline']}",
        fontsize=10,
    )
    ax.legend(loc="upper right")
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
