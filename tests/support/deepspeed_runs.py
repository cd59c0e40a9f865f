"""What the tests that run real DeepSpeed in subprocesses share: the environment those processes get,
running them (forked from `harness_server.py`, or from scratch), and the bit-for-bit comparison of two runs'
results."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


def harness_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a DeepSpeed run, with `overrides` on top: on the CPU, or on the
    accelerator that `MLP_OFFLOAD_TEST_ACCELERATOR` names (`cuda` in the GPU report)."""
    return {
        # DeepSpeed's just-in-time ops (cpu_adam, shm comm) build once into target/, not per run.
        "TORCH_EXTENSIONS_DIR": str(Path(__file__).resolve().parents[2] / "target" / "torch_extensions"),
        **os.environ,
        "DS_ACCELERATOR": os.environ.get("MLP_OFFLOAD_TEST_ACCELERATOR", "cpu"),
        "OMP_NUM_THREADS": "2",
        **overrides,
    }


SERVER = Path(__file__).with_name("harness_server.py")
# torchrun's worker where a rank server forks the ranks (`RankServer`).
RANK_CLIENT = Path(__file__).with_name("rank_client.py")
HARNESS = Path(__file__).with_name("zero3_harness.py")

# The signal on which a run writes every thread's Python stack to its log (`zero3_harness.main`): sent to
# a run that did not end in time, `STACKS_WAIT_S` before it is killed, so its log says where it waited.
STACKS_SIGNAL = signal.SIGUSR1
STACKS_WAIT_S = 2.0
# How the log of a run forked by `harness_server.py` ends: how many modules the run imported that the
# server had not preloaded, and their packages.
IMPORTED_IN_RUN = "harness_server: the run imported"

# When the running test's own timeout (pytest-timeout's) ends it, set by `conftest.harness_deadline`;
# None outside a test, or where it has none.
_test_deadline: float | None = None
# How long before that deadline a batch of runs is ended: time to dump the ranks' stacks, kill them and
# report, so a hung run fails its own test with its ranks' logs.
DEADLINE_MARGIN_S = 20.0


def set_test_deadline(seconds: float | None) -> None:
    """The running test ends in `seconds` from now (None: no limit, or the test is over)."""
    global _test_deadline
    _test_deadline = None if seconds is None else time.monotonic() + seconds


def batch_timeout(requested: float) -> float:
    """`requested`, or less where the test's deadline comes first (at least 1 s)."""
    if _test_deadline is None:
        return requested
    return max(1.0, min(requested, _test_deadline - DEADLINE_MARGIN_S - time.monotonic()))


@dataclass
class HarnessRun:
    """One process of a case: its spec file, result file, log, environment, cgroup (joined first), the
    harness that runs it (a module in tests/ with `main(spec, out)` and `default_environment()`) and its
    working directory (None: the caller's)."""

    spec: Path
    out: Path
    log: Path
    env: dict[str, str]
    cgroup: Path | None = None
    harness: str = "zero3_harness"
    cwd: Path | None = None


class HarnessServer:
    """A `harness_server.py` process: it has imported torch, DeepSpeed and mlp-offload once, and forks a
    fresh process for each run from there."""

    def __init__(self, env: dict[str, str], argv: Sequence[str] = (sys.executable, str(SERVER))) -> None:
        self._stderr = tempfile.NamedTemporaryFile("w+", prefix="harness-server-", suffix=".log")
        # A session of its own: its forked runs are in its process group, so `kill` ends them all.
        self._proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._answer()  # {"ready": pid} once everything is imported and loaded

    def _answer(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._stderr.seek(0)
            raise RuntimeError(
                f"the harness server ended ({self._proc.poll()}):\n{self._stderr.read()[-4000:]}"
            )
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, runs: list[HarnessRun], timeout: float) -> list[int | None]:
        """Each run's exit status (minus a signal's number), None where the batch timed out."""
        assert self._proc.stdin is not None
        batch = {
            "runs": [
                {
                    "harness": r.harness,
                    "spec": str(r.spec),
                    "out": str(r.out),
                    "log": str(r.log),
                    "env": r.env,
                    "cgroup": r.cgroup and str(r.cgroup),
                    "cwd": r.cwd and str(r.cwd),
                }
                for r in runs
            ],
            "timeout": timeout,
        }
        try:
            self._proc.stdin.write(json.dumps(batch) + "\n")
            self._proc.stdin.flush()
            exits: list[int | None] = self._answer()["exits"]
        except BaseException:
            # Ended without its answer (pytest's timeout, Ctrl-C, the server gone): that answer is still
            # owed, and the next batch would read it as its own and fail for nothing, as every later
            # test of a CI worker did once. So the server and its runs end here; the next batch starts a
            # fresh one.
            self.kill()
            raise
        return exits

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def kill(self) -> None:
        """Ends the server and every run it forked (its process group), at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        # Closed here, not when collected: an unclosed pipe warns then, and that warning fails whichever
        # test is running (filterwarnings = error).
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None and not pipe.closed:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()
        self._stderr.close()

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._close_pipes()


class RankServer:
    """A `harness_server.py --ranks` on the abstract socket `address` of its network namespace, started
    with `env` on first use and again once it has ended (its node killed): a launcher whose workers are
    `rank_client.py` gets its ranks forked from it. `where` wraps its command line (a node's
    namespaces)."""

    def __init__(
        self, address: str, env: dict[str, str], where: Callable[[list[str]], list[str]] = list
    ) -> None:
        self.address, self._env, self._where = address, env, where
        self._server: HarnessServer | None = None

    def client(self) -> list[str]:
        """What goes before the harness in torchrun's command line: `rank_client.py` and this server's
        address, the server started if it is not running; nothing where runs start from scratch
        (`runs_are_forked`: on an accelerator, or with `MLP_OFFLOAD_TEST_FORK=0`)."""
        if not runs_are_forked():
            return []
        if self._server is None or not self._server.alive:
            self.close()
            argv = self._where([sys.executable, str(SERVER), "--ranks", self.address])
            self._server = HarnessServer(self._env, argv)
        return [str(RANK_CLIENT), self.address]

    def close(self) -> None:
        """Ends the server and every rank it forked."""
        if self._server is not None:
            self._server.kill()
            self._server = None


_server: HarnessServer | None = None


def runs_are_forked() -> bool:
    """Whether runs are forked from a harness server here: on the CPU, unless `MLP_OFFLOAD_TEST_FORK=0`
    (forking after CUDA's libraries initialised is not safe: on an accelerator each run starts from
    scratch)."""
    return os.environ.get("MLP_OFFLOAD_TEST_FORK", "1") != "0" and harness_env()["DS_ACCELERATOR"] == "cpu"


def _harness_server() -> HarnessServer | None:
    """This worker's server for runs on the CPU, started on first use; None where each run starts from
    scratch instead (`runs_are_forked`)."""
    global _server
    if not runs_are_forked():
        return None
    if _server is None or not _server.alive:
        _server = HarnessServer(harness_env())
        atexit.register(_server.close)
    return _server


def run_harness(runs: list[HarnessRun], timeout: float = 600) -> list[int | None]:
    """Runs each run's harness (`zero3_harness.py`: the ranks of one case, at once): each exit status, None
    where it did not end within `timeout` seconds, or before the test's own deadline (`batch_timeout`),
    its threads' stacks in its log. A failed rank ends the others."""
    try:
        return _run_harness(runs, batch_timeout(timeout))
    finally:
        _unlink_shm_buffers(runs)


def _unlink_shm_buffers(runs: list[HarnessRun]) -> None:
    """DeepSpeed's shared-memory collectives (its CPU accelerator's, with several ranks) leave each rank's
    buffer in /dev/shm (64 MiB; its `shared_close` is never called): a suite of multi-rank cases would
    hold gigabytes of memory there. Removed once the case's ranks are gone, by the case's port."""
    ports = {r.env.get("MASTER_PORT") for r in runs}
    for r in runs:
        try:
            ports.add(str(json.loads(r.spec.read_text()).get("port")))
        except (OSError, ValueError, AttributeError):
            pass
    for port in ports - {None, "None"}:
        for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
            buffer.unlink(missing_ok=True)


def _run_harness(runs: list[HarnessRun], timeout: float) -> list[int | None]:
    server = _harness_server()
    if server is not None:
        return server.run(runs, timeout)
    procs = []
    for r in runs:
        command = [sys.executable, str(Path(__file__).with_name(f"{r.harness}.py")), str(r.spec), str(r.out)]
        if r.cgroup is not None:
            command = ["sh", "-c", f'echo $$ > {r.cgroup}/cgroup.procs && exec "$@"', "sh", *command]
        # Output to a file, not a pipe: a rank blocked on a full pipe would stall the others' collectives.
        with r.log.open("w") as sink:
            procs.append(
                subprocess.Popen(
                    command, stdout=sink, stderr=subprocess.STDOUT, text=True, env=r.env, cwd=r.cwd
                )
            )
    exits: list[int | None] = []
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            try:
                exits.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for late in procs:
                    if late.poll() is None:
                        late.send_signal(STACKS_SIGNAL)
                time.sleep(STACKS_WAIT_S)
                exits.append(None)
            if exits[-1] != 0:
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # the other ranks of a failed one would wait in a collective for ever
    return exits + [None] * (len(procs) - len(exits))


# Where stock runs are kept between tests (and between sessions, until anything they depend on changes).
STOCK_RUNS = Path(__file__).resolve().parents[2] / "target" / "stock-runs"
# DeepSpeed's async I/O op, which its NVMe offload (the optimizer's or the parameters') runs on: `make test`
# builds it first (`make deepspeed-aio`, about 2.5 minutes of two cores); where it is not built (a bare
# pytest, `make test-quick`) the rows that need it compare with stock's CPU offload, or skip, saying so.
AIO_BUILT = (
    Path(__file__).resolve().parents[2] / "target" / "torch_extensions" / "async_io" / "async_io.so"
).exists()


def stock_param_nvme_fails(case: dict[str, Any]) -> str | None:
    """Why stock's NVMe offload of the parameters cannot run `case` here (None: it can). It runs on
    DeepSpeed's async I/O op; and on an accelerator without fp16 (DeepSpeed's CPU accelerator on some
    CPUs) its `zero.Init` gives the parameters' swapper bfloat16 whatever the model's dtype
    (`Init._set_dtype`'s precedence), so an fp32 model fails in its first forward ("expected m1 and m2
    to have the same dtype"). Ours follows the parameters' dtype (`param_swapper`)."""
    if not AIO_BUILT:
        return "stock's NVMe offload needs DeepSpeed's async I/O op: `make deepspeed-aio` builds it"
    from deepspeed.accelerator import get_accelerator

    if case.get("fp32") and not get_accelerator().is_fp16_supported():
        return (
            "stock's NVMe offload of an fp32 model's parameters fails on an accelerator without fp16 "
            "(DeepSpeed's zero.Init gives its swapper bfloat16 there)"
        )
    return None


# Case keys whose runs leave what a test looks at besides the result (checkpoint files, a fault, a file
# system filled up, a killed process, resource samples), or name a path: such runs are never reused.
UNCACHED_KEYS = {
    "mlp_offload",
    "resume_mlp_offload",
    "checkpoint_dir",
    "checkpoint_at",
    "save_at",
    "save_16bit",
    "resume_at",
    "config_file",
    "nvme_path",
    "fault",
    "fault_at",
    "fill",
    "fill_at",
    "immutable_at_step",
    "sigkill_in_update_at",
    "sigkill_in_forward_at",
    "sigkill_in_save_at",
    "stall_in_update_at",
    "sample_resources",
}


def code_digest() -> str:
    """A digest of the code a stock run executes besides DeepSpeed and torch: the harness and the
    mlp_offload package (its models; `install()` where a case asks for it), native module included."""
    root = Path(__file__).resolve().parents[2]
    files = sorted([HARNESS, *Path(root, "python", "mlp_offload").rglob("*.py")])
    files += sorted(Path(root, "python", "mlp_offload").glob("_core*.so"))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()


def stock_cache(case: dict[str, Any], ranks: int) -> Path | None:
    """Where a stock DeepSpeed run of `case` on `ranks` ranks is kept: keyed by the case, the ranks (and
    so the threads each gets), the accelerator, our code (`code_digest`), DeepSpeed's and torch's
    versions, so a change to any of them runs it again. None for a case that is not a plain stock run
    (`UNCACHED_KEYS`)."""
    if UNCACHED_KEYS & case.keys():
        return None
    import deepspeed

    key = json.dumps(
        {
            "case": case,
            "ranks": ranks,
            "accelerator": os.environ.get("MLP_OFFLOAD_TEST_ACCELERATOR", "cpu"),
            "code": code_digest(),
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
        },
        sort_keys=True,
    )
    return STOCK_RUNS / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"


def keep(results: list[dict[str, Any]], path: Path) -> None:
    """Saves a stock run's results for `stock_cache`, whole or not at all (two workers may race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(results, tmp)
    tmp.replace(path)


def stock_resume(ds_case: dict[str, Any], save_at: int, ranks: int, tmp_path: Path) -> list[dict[str, Any]]:
    """Stock DeepSpeed's save at step `save_at` and its resume in a new process (every rank's result), run
    once per DeepSpeed side and kept as a stock run is (`stock_cache`)."""
    kept = stock_cache({**ds_case, "stock_resumes_at": save_at}, ranks)
    assert kept is not None
    if kept.exists():
        results: list[dict[str, Any]] = torch.load(kept, weights_only=False)
        return results
    ckpt = str(tmp_path / "stock-ckpt")
    saves = {**ds_case, "steps": save_at + 1, "save_at": save_at, "checkpoint_dir": ckpt}
    run_case(saves, tmp_path, "stock-saves", ranks=ranks)
    resumes = {**ds_case, "resume_at": save_at, "checkpoint_dir": ckpt}
    resumed = run_case(resumes, tmp_path, "stock", ranks=ranks)
    results = resumed.get("ranks", [resumed])
    keep(results, kept)
    return results


def _ports_below_the_ephemeral_range() -> range:
    """Ports no outgoing connection is given: the kernel picks those from `ip_local_port_range`."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(10_000, max(low, 12_000))


_PORT_SLICES = 32
_ports_handed_out = 0


def free_port() -> int:
    """A TCP port that nobody listens on now, for one run's rendezvous.

    Not one the kernel hands out (bind to port 0): those come from the ephemeral range, where any test's
    outgoing connection (a rank's to its store, gloo's pairs) may take it before the run's store listens on
    it, as a CI run saw (EADDRINUSE). So below that range, where only listeners that name their port bind;
    each pytest-xdist worker counts through a slice of its own (tests run at once never share one), starting
    at a place of its process's, and skips a port something still holds."""
    global _ports_handed_out
    ports = _ports_below_the_ephemeral_range()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    width = len(ports) // _PORT_SLICES
    first = ports.start + (int(worker) if worker.isdigit() else 0) % _PORT_SLICES * width
    for _ in range(width):
        offset = (os.getpid() * 97 + _ports_handed_out) % width
        _ports_handed_out += 1
        with socket.socket() as s:
            try:
                s.bind(("", first + offset))
            except OSError:
                continue
        return first + offset
    raise RuntimeError(f"no free TCP port in {first}..{first + width - 1}")


def failed_runs(name: str, runs: list[HarnessRun], exits: list[int | None]) -> str:
    """What the ranks of a failed case did: each one's exit, and the end of the log of each that did not
    end well (a run that did not end in time wrote its threads' stacks there)."""
    lines = []
    for rank, (run, code) in enumerate(zip(runs, exits, strict=True)):
        if code == 0:
            lines.append(f"{name} rank {rank} ended well")
            continue
        what = "did not end in time" if code is None else f"failed ({code})"
        log = run.log.read_text()[-8000:] if run.log.exists() else "(no log)"
        lines.append(f"{name} rank {rank} {what}:\n{log}")
    return "\n".join(lines)


def run_case(
    case: dict[str, Any],
    tmp_path: Path,
    name: str,
    cgroup: Path | None = None,
    ranks: int = 1,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Runs the harness on `case`, one process per rank, and returns rank 0's result (its stdout and
    stderr under `"output"`); with several ranks, every rank's result is under `"ranks"`. A stock run
    that leaves nothing else to look at is run once per configuration and code (`stock_cache`). `env`:
    variables set for the run (no stock run with them is kept)."""
    kept = stock_cache(case, ranks) if cgroup is None and not env else None
    if kept is not None and kept.exists():
        results: list[dict[str, Any]] = torch.load(kept, weights_only=False)
        return {**results[0], "ranks": results} if ranks > 1 else results[0]
    case = {**case, "port": free_port()}
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps(case))
    runs = rank_runs(spec, tmp_path, name, ranks, cgroup=cgroup)
    for run in runs:
        run.env.update(env or {})
    exits = run_harness(runs)
    if any(code != 0 for code in exits):
        raise AssertionError(failed_runs(name, runs, exits))
    results = []
    for run in runs:
        result: dict[str, Any] = torch.load(run.out, weights_only=False)
        result["output"] = run.log.read_text()
        results.append(result)
    if kept is not None:
        keep(results, kept)
    if ranks > 1:
        results[0]["ranks"] = results
    return results[0]


def rank_runs(
    spec: Path,
    tmp_path: Path,
    name: str,
    ranks: int,
    cgroup: Path | None = None,
    harness: str = "zero3_harness",
    cwd: Path | None = None,
    **env_overrides: str,
) -> list[HarnessRun]:
    """One `HarnessRun` of `spec` per rank of one node, its result and log in `tmp_path` under `name`:
    the machine's cores shared among the ranks, and the local world the world, as torchrun and
    DeepSpeed's launcher say; `env_overrides` on top."""
    env = harness_env(
        OMP_NUM_THREADS=str(max(1, 2 // ranks)),
        WORLD_SIZE=str(ranks),
        LOCAL_WORLD_SIZE=str(ranks),
        **env_overrides,
    )
    return [
        HarnessRun(
            spec,
            tmp_path / f"{name}.rank{rank}.pt",
            tmp_path / f"{name}.rank{rank}.log",
            {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            cgroup,
            harness,
            cwd,
        )
        for rank in range(ranks)
    ]


def section(paths: list[Path], **extra: Any) -> dict[str, Any]:
    """An `"mlp_offload"` section on `paths` with `extra` keys, its weights equal: without the probe that
    the README's section (`weights: "auto"`) runs on new paths first."""
    return {"paths": [str(p) for p in paths], "weights": "equal", **extra}


WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 8}}


# DeepSpeed's precision modes of the optimizer state (`tests/test_state_dtypes.py`), each: the harness's
# precision, DeepSpeed's options, and the dtypes our start-up record names.
STATE_MODES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "bf16 weights": (
        {"ds_options": {"bf16.bf16_master_weights_and_grads": True}},
        {"master": "bfloat16", "moments": "float32"},
    ),
    "bf16 weights and moments": (
        {"ds_options": {"bf16.bf16_master_weights_and_grads": True, "bf16.bf16_optimizer_states": True}},
        {"master": "bfloat16", "moments": "bfloat16"},
    ),
    "fp16 weights": (
        {"fp16": True, "ds_options": {"fp16.fp16_master_weights_and_grads": True}},
        {"master": "float16", "moments": "float32"},
    ),
}


def stock_side(case: dict[str, Any]) -> dict[str, Any]:
    """A row's case for the stock run: what only our engine has a path for (the parameters through the
    host scratch) left out, so the stock run is another row's, kept once (`stock_cache`)."""
    return {k: v for k, v in case.items() if k != "params_through_scratch"}


def check_chunk_counts(start: dict[str, Any], steps: list[dict[str, Any]]) -> None:
    """Every chunk is read, cached or still in its buffer from the last step's write-back, and written
    or kept in the step's cache, once a step: by the update during backward where step() kept it, else
    by the update after it (an update during backward that step() undid is in the step's figures too,
    its part said in its record)."""
    for r in steps:
        spec = r["overlap_backward"]
        undone = dict.fromkeys(("reads", "reads_dropped", "cached", "retained", "writes"), 0)
        if spec is not None and not spec["kept"] and spec["figures"] is not None:
            undone = spec["figures"]
        # A read ahead of a part that ended before its chunk (`reads_dropped`) is read again.
        taken = sum(r[k] - undone[k] for k in ("reads", "cached", "retained"))
        taken -= r["reads_dropped"] - undone["reads_dropped"]
        assert taken == start["chunks"], (r, spec)
        assert r["writes"] - undone["writes"] + r["cached_chunks"] == start["chunks"], (r, spec)


def from_step(run: dict[str, Any], step: int) -> dict[str, Any]:
    """`run` as a resume at `step` records it: its per-step records from that step on."""
    return {**run, "losses": run["losses"][step:], "grad_norms": run["grad_norms"][step:]}


def same_floats(a: list[Any], b: list[Any]) -> bool:
    """The same values, a NaN where the other has a NaN (stock's own runs may go to NaN: its resume with
    fp16 master weights does, `test_state_dtypes`)."""
    return len(a) == len(b) and all(
        x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
        for x, y in zip(a, b, strict=True)
    )


def convert_to_universal(checkpoint: Path, universal: Path) -> float:
    """DeepSpeed's converter (`ds_to_universal.py`) from one tag's folder to another, with its arguments'
    defaults and one worker, in this process (as DeepSpeed's own test runs it); the seconds it took."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    started = time.perf_counter()
    args = SimpleNamespace(
        input_folder=str(checkpoint),
        output_folder=str(universal),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    ds_to_universal(args)
    return time.perf_counter() - started


def assert_same_tensors(ours: dict[str, torch.Tensor], stock: dict[str, torch.Tensor]) -> None:
    """The same names, and each tensor of the same dtype and bits."""
    assert sorted(ours) == sorted(stock)
    for name, tensor in stock.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


def assert_bit_equal(ours: dict[str, Any], stock: dict[str, Any]) -> None:
    """Same skipped steps, losses and global gradient norms (where the runs record them); per parameter,
    the same master weights, Adam moments (of the same dtypes) and (where the run has them)
    half-precision partitions, bit for bit."""
    assert ours["skipped"] == stock["skipped"]
    assert same_floats(ours["losses"], stock["losses"]), (ours["losses"], stock["losses"])
    if "grad_norms" in stock:
        assert same_floats(ours["grad_norms"], stock["grad_norms"]), "the global gradient norms differ"
    for name, tensors in stock["state"].items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            a, b = ours["state"][name][key], tensors[key]
            if b is None:
                # A frozen parameter: no optimizer state in either run.
                assert a is None, (name, key)
                continue
            # fp32, or the master weights' and moments' dtypes where stock keeps them in half precision.
            assert a.dtype == b.dtype, (name, key, a.dtype, b.dtype)
            # Equal values, or the same bits (NaNs where stock's are).
            ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
            assert torch.equal(a, b) or torch.equal(a.view(ints), b.view(ints)), (
                f"{name}.{key} differs: max |diff| {(a - b).abs().max().item()}"
            )
        if tensors["half"] is not None:
            assert torch.equal(ours["state"][name]["half"], tensors["half"]), f"{name} half-precision params"


# A universal checkpoint's round (`test_universal.py`, `test_params_on_nvme.py`): saved at this step, loaded
# with DeepSpeed's `checkpoint.load_universal`.
SAVE_AT = 3
UNIVERSAL = {"checkpoint.load_universal": True}


def universal(case: dict[str, Any]) -> dict[str, Any]:
    """`case` with `checkpoint.load_universal` set, beside its other DeepSpeed options."""
    return {**case, "ds_options": {**case.get("ds_options", {}), **UNIVERSAL}}


def save_and_convert(
    case: dict[str, Any], ranks: int, tmp_path: Path, name: str, save_at: int = SAVE_AT
) -> Path:
    """`case` trained on `ranks` ranks and saved at step `save_at`, converted: the universal checkpoint's
    dir."""
    ckpt, universal_dir = tmp_path / f"{name}-ckpt", tmp_path / f"{name}-universal"
    run_case(
        {**case, "steps": save_at + 1, "save_at": save_at, "checkpoint_dir": str(ckpt)},
        tmp_path,
        name,
        ranks=ranks,
    )
    convert_to_universal(ckpt / "ckpt", universal_dir / "ckpt")
    return universal_dir


def stock_universal_resume(ds_case: dict[str, Any], saving: int, resuming: int, tmp_path: Path) -> list[Any]:
    """Stock DeepSpeed's save on `saving` ranks, converted, and resumed on `resuming` (every rank's
    result), run once per DeepSpeed side and kept as a stock run is (`stock_cache`)."""
    kept = stock_cache({**ds_case, "stock_universal": [SAVE_AT, saving]}, resuming)
    assert kept is not None
    if kept.exists():
        results: list[Any] = torch.load(kept, weights_only=False)
        return results
    universal_dir = save_and_convert(ds_case, saving, tmp_path, "stock-saves")
    resumes = {**ds_case, "resume_at": SAVE_AT, "checkpoint_dir": str(universal_dir)}
    resumed = run_case(universal(resumes), tmp_path, "stock", ranks=resuming)
    results = resumed.get("ranks", [resumed])
    keep(results, kept)
    return results
