"""The test harness itself: a run that does not end leaves its stacks and the next run runs; a forked run
imports little that its server had not preloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deepspeed_runs import (
    DEADLINE_MARGIN_S,
    IMPORTED_IN_RUN,
    HarnessRun,
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
    import signal

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
# scratch (two nodes, Megatron-DeepSpeed, the wheel, the main job) still import them as a user's process
# does. A new DeepSpeed or torch that imports a package of many modules only once it builds an engine, or
# our package left out of the server, goes past it (docs/history/testing.md has the counts).
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
