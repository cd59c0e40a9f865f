"""Runs `zero3_harness.py` cases (and `frameworks_harness.py` runs) in processes forked from one that has
already imported torch, DeepSpeed and mlp-offload and loaded DeepSpeed's just-in-time ops: each run still
has a process of its own (fresh DeepSpeed state, its own pid, exit status and log), without paying 2-4 s
of imports and op loading first (a framework's run, 10-15 s: transformers, Accelerate, Lightning).

Started by `deepspeed_runs.HarnessServer` (one per pytest worker) with the environment of a CPU run. It
reads one JSON line per batch from stdin, `{"runs": [{"harness", "spec", "out", "log", "env", "cgroup",
"cwd"}...], "timeout": s}` (the ranks of one case), forks a child per run and answers one JSON line,
`{"exits": [code...]}`: 0, the exit code, minus the signal that ended it (as `subprocess` reports it), or
None where the batch timed out. A failed rank ends the others, which would otherwise wait in a collective
for ever.

With `--ranks ADDRESS` it serves ranks instead (`serve_ranks`): it forks each rank that torchrun's worker,
`rank_client.py`, asks it for, started inside a node's namespaces in the two-node tests.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

# Imported first: it sets a run's environment as it is imported (`harness` returns it to each run).
import zero3_harness  # noqa: F401
from deepspeed_runs import IMPORTED_IN_RUN, STACKS_SIGNAL, STACKS_WAIT_S


def preload() -> None:
    """What every run would load first: DeepSpeed's ZeRO-3 and CPU Adam modules and its JIT ops (CPU
    Adam, the shared-memory collectives), kept by DeepSpeed's op cache for the children; and what
    DeepSpeed imports only once it builds an engine: torch's optimizer base class imports torch._dynamo
    at the first param group, and ZeRO's optimizer check imports DeepSpeed's Muon, whose torch.compile
    decorators import torch._inductor (sympy, networkx, triton's bindings), 1,500 modules and 2.5-4.5 s
    of every run here before this server loaded them once. Then what every run imports as it builds an
    engine, stock's too (the harness's models, config and records are our package's): our adapter and
    engine, and the modules DeepSpeed's engine imports only then."""
    import cpuinfo
    import deepspeed.module_inject.auto_ep_layer
    import deepspeed.runtime.superoffload.superoffload_stage3  # noqa: F401
    import torch._dynamo  # noqa: F401
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
    from deepspeed.runtime.zero import stage3  # noqa: F401
    from deepspeed.runtime.zero.muon import muon_optimizer  # noqa: F401

    from mlp_offload.adapter import integration, zero3  # noqa: F401

    # DeepSpeed asks py-cpuinfo about this CPU each time it makes a CPU Adam (and each time it checks its
    # ops' flags); py-cpuinfo answers from a fresh interpreter each time, about 1.2 s of CPU here, a
    # fifth of a short two-rank case. The answer does not change while this server lives: asked once.
    answer = cpuinfo.get_cpu_info()
    cpuinfo.get_cpu_info = lambda: answer

    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is not None:
            builder.load()


@functools.cache
def harness(name: str) -> ModuleType:
    """The harness module a run names, imported here before the first fork, with what it preloads."""
    module = importlib.import_module(name)
    if hasattr(module, "preload"):
        module.preload()
    return module


def run_child(run: dict[str, Any]) -> int:
    """In the forked child: the run's log as stdout and stderr (unless it has them already), its
    environment, its cgroup, its working directory, then the case."""
    if "log" in run:
        fd = os.open(run["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.clear()
    os.environ.update(run["env"])
    module = harness(run["harness"])
    if hasattr(module, "default_environment"):
        module.default_environment()
    if run.get("cgroup"):
        # Joined first, so the throttle applies to everything the run does.
        Path(run["cgroup"], "cgroup.procs").write_text(str(os.getpid()))
    if run.get("cwd"):
        os.chdir(run["cwd"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    loaded = set(sys.modules)
    args = run["args"] if "args" in run else [run["spec"], run["out"]]
    try:
        module.main(*args)
        return 0
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        # What the preload missed costs every run its import again; the test of the preload reads this.
        imported = set(sys.modules) - loaded
        packages = sorted({name.partition(".")[0] for name in imported})
        print(f"{IMPORTED_IN_RUN} {len(imported)} modules, of {', '.join(packages)}", file=sys.stderr)


def wait_all(pids: list[int], timeout: float) -> list[int | None]:
    """Each child's exit (as `subprocess` gives it); a failed one ends the rest, a timeout ends all, each
    writing its threads' stacks to its log first."""
    exits: dict[int, int | None] = {}
    deadline = time.monotonic() + timeout
    while len(exits) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                late = [p for p in pids if p not in exits]
                for p in late:
                    os.kill(p, STACKS_SIGNAL)
                time.sleep(STACKS_WAIT_S)
                for p in late:
                    os.kill(p, signal.SIGKILL)
                    os.waitpid(p, 0)
                    exits[p] = None
                break
            time.sleep(0.02)
            continue
        exits[pid] = os.waitstatus_to_exitcode(status)
        if exits[pid] != 0:
            for p in pids:
                if p not in exits:
                    os.kill(p, signal.SIGKILL)
    return [exits.get(p) for p in pids]


def fork_run(run: dict[str, Any], before: Callable[[], None] = lambda: None) -> int:
    """Forks a child that calls `before`, then runs `run` (`run_child`) and exits with its code; the
    child's pid."""
    harness(run["harness"])  # imported here, once, so the children need not
    # Everything this server holds, out of the children's collections: DeepSpeed's ZeRO-3 runs
    # `gc.collect()` as it builds its partitions, which otherwise walks every object of the preloaded
    # modules in each run (docs/history/testing.md).
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            before()
            code = run_child(run)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def serve() -> None:
    preload()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        batch = json.loads(line)
        pids = [fork_run(run) for run in batch["runs"]]
        print(json.dumps({"exits": wait_all(pids, batch["timeout"])}), flush=True)


def accept_rank(listener: socket.socket, ranks: dict[int, socket.socket]) -> None:
    """Forks the rank a `rank_client.py` asks for, its stdin, stdout and stderr the client's, and tells
    the client its pid."""
    conn, _ = listener.accept()
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    run = json.loads(message)

    def as_the_client() -> None:
        listener.close()
        for other in ranks.values():
            other.close()
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.argv = [run["file"], *run["args"]]

    pid = fork_run(run, as_the_client)
    for fd in fds:
        os.close(fd)
    conn.send(json.dumps({"pid": pid}).encode())
    ranks[pid] = conn


def serve_ranks(address: str) -> None:
    """Serves the ranks that torchrun starts as `rank_client.py` workers (the two-node tests' and
    Megatron-DeepSpeed's), on the abstract socket `address` of its network namespace: a rank forked from
    here is in this server's namespaces (a node's, in the two-node tests), without importing torch and
    DeepSpeed again. Each rank's exit goes to its client; a client that goes (torchrun killed it) takes
    its rank with it. Ends when stdin closes."""
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + address)
    listener.listen(16)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    ranks: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([sys.stdin, listener, *ranks.values()], [], [], 0.05)
        if sys.stdin in readable and not sys.stdin.readline():
            return
        if listener in readable:
            accept_rank(listener, ranks)
        for pid, conn in list(ranks.items()):
            if conn in readable and not conn.recv(1):
                # The client went without its answer: its rank goes too, as torchrun meant.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        while ranks and (ended := os.waitpid(-1, os.WNOHANG))[0]:
            if ended[0] in ranks:
                conn = ranks.pop(ended[0])
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(ended[1])}).encode())
                conn.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ranks"]:
        serve_ranks(sys.argv[2])
    else:
        serve()
