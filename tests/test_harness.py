"""The test harness itself: a run that does not end leaves its stacks and the next run runs; a forked run
imports little that its server had not preloaded; a rank forked for torchrun's worker ends with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deepspeed_runs import (
    DEADLINE_MARGIN_S,
    HARNESS,
    IMPORTED_IN_RUN,
    RANK_CLIENT,
    HarnessRun,
    RankServer,
    batch_timeout,
    free_port,
    harness_env,
    run_case,
    run_harness,
    runs_are_forked,
    section,
)

TEST_TIMEOUT_S = 240


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_run_that_does_not_end_leaves_its_stacks_and_the_next_run_runs(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """A run that hangs (here: stopped mid-update) is ended after its timeout with every thread's stack in
    its log, which says where it waited; one interrupted while it waits (as pytest's own timeout does)
    takes the worker's harness server and its runs with it; either way the next run of the worker runs,
    rather than reading an answer owed to the one before."""

    case = {
        "mlp_offload": section(work_dirs[:1], update_chunk="24K"),
        "steps": 3,
        "stall_in_update_at": 1,
        "stall_node": 0,
        "stall_marker": str(tmp_path / "stalled.rank{rank}"),
        "port": free_port(),
    }
    spec = tmp_path / "stalled.json"
    spec.write_text(json.dumps(case))
    run = HarnessRun(spec, tmp_path / "stalled.pt", tmp_path / "stalled.log", harness_env(WORLD_SIZE="1"))
    # Under the test's own timeout (pytest-timeout's, conftest.harness_deadline), a batch is given less.
    assert batch_timeout(600) <= TEST_TIMEOUT_S - DEADLINE_MARGIN_S
    assert run_harness([run], timeout=15) == [None]
    assert "in stall" in run.log.read_text(), run.log.read_text()[-4000:]

    def interrupt(signum: int, frame: Any) -> None:
        raise TimeoutError("the test's time is up")

    (tmp_path / "stalled.rank0").unlink()
    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.alarm(15)
        with pytest.raises(TimeoutError):
            run_harness([run], timeout=600)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert (tmp_path / "stalled.rank0").exists(), "the interrupted run did not reach its stall"
    ours = run_case({"mlp_offload": section(work_dirs[1:2]), "steps": 2}, tmp_path, "next")
    assert len(ours["losses"]) == 2


# What a forked run may still import: a few small modules DeepSpeed imports as it builds an engine. Our
# adapter and engine, which every run imported (stock's too), are the server's; the runs started from
# scratch (the wheel, the main job) still import them as a user's process does. A new DeepSpeed or torch
# that imports a package of many modules only once it builds an engine, or our package left out of the
# server, goes past it (docs/history/testing.md has the counts).
IMPORTS_PER_RUN = 50


def test_a_forked_run_imports_little_that_its_server_had_not_preloaded(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """Every run forked from the harness server starts from what the server imported once
    (`harness_server.preload`). DeepSpeed 0.19 imports torch._dynamo and torch._inductor (1,500 modules)
    only when it builds an engine: 2.5-4.5 s of every run here until the server preloaded them."""
    if not runs_are_forked():
        pytest.skip("runs start from scratch here (MLP_OFFLOAD_TEST_FORK=0, or an accelerator)")
    ours = run_case({"mlp_offload": section(work_dirs[:1]), "steps": 2}, tmp_path, "ours")
    line = next(x for x in ours["output"].splitlines() if x.startswith(IMPORTED_IN_RUN))
    count = int(line.removeprefix(IMPORTED_IN_RUN).split()[0])
    assert count <= IMPORTS_PER_RUN, f"the server's preload misses what every run imports: {line}"


# How a rank ends, and what `rank_client.py` (torchrun's worker) must then do: the rank's own exit,
# torchrun's SIGTERM forwarded to it, or the client killed outright (torchrun's SIGKILL), which must take
# the rank with it rather than leave it waiting in a collective.
RANK_ENDINGS = [
    pytest.param("fails", 1, id="the rank fails: its exit code is the client's"),
    pytest.param(
        "sigterm", -signal.SIGTERM, id="torchrun's SIGTERM reaches the rank, its signal the client's"
    ),
    pytest.param("sigkill", -signal.SIGKILL, id="the client killed: the rank goes too"),
]


@pytest.fixture(scope="module")
def ranks_address() -> Iterator[str]:
    server = RankServer(f"mlpo-test-ranks-{os.getpid()}", harness_env())
    server.client()
    yield server.address
    server.close()


@pytest.mark.skipif(not runs_are_forked(), reason="ranks are forked only where runs are (on the CPU)")
@pytest.mark.parametrize(("ending", "code"), RANK_ENDINGS)
def test_a_forked_ranks_end_is_its_clients(
    ranks_address: str, tmp_path: Path, ending: str, code: int
) -> None:
    """A rank forked by the rank server for `rank_client.py`, its case a file it waits to read (a FIFO),
    or not JSON: the client's exit is the rank's, torchrun's signals reach the rank, and a client that
    is killed takes its rank with it. Each writes to the client's stderr."""
    spec = tmp_path / "case.json"
    if ending == "fails":
        spec.write_text("not JSON")
    else:
        os.mkfifo(spec)
    argv = [
        sys.executable,
        str(RANK_CLIENT),
        ranks_address,
        str(HARNESS),
        str(spec),
        str(tmp_path / "out.pt"),
    ]
    env = harness_env(RANK="0")
    # Its stdin a pipe of its own, by which `wait_for_rank` knows its rank.
    client = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rank = wait_for_rank(client.pid) if ending != "fails" else None
    if ending == "sigterm":
        client.send_signal(signal.SIGTERM)
    elif ending == "sigkill":
        client.kill()
    _, stderr = client.communicate(timeout=60)
    assert client.returncode == code, stderr
    if ending == "fails":
        assert "JSONDecodeError" in stderr
    if rank is not None:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{rank}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{rank}").exists(), f"rank {rank} outlived its client"


def wait_for_rank(client: int) -> int:
    """The pid of the rank that the rank server forked for `client`: the process whose working directory
    and stdin are the client's, other than the client."""
    stdin = os.stat(f"/proc/{client}/fd/0")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != client:
                try:
                    fd0 = os.stat(entry / "fd" / "0")
                    is_rank = b"--ranks" in (entry / "cmdline").read_bytes()
                except (FileNotFoundError, PermissionError, ProcessLookupError):
                    continue
                if is_rank and (fd0.st_dev, fd0.st_ino) == (stdin.st_dev, stdin.st_ino):
                    return int(entry.name)
        time.sleep(0.05)
    raise AssertionError(f"no rank forked for client {client}")
