"""`benches/threadwatch.py`, what `benches/e2e.py --watch-threads` reports with: a phase's wall time split
into on a CPU, waiting for one and blocked, and the stacks the thread was found in."""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))
from threadwatch import ThreadWatch, merge

# Hashed a piece at a time: hashlib lets go of the GIL over large inputs, so the thread needs it only between
# pieces. A pure-Python loop shares it with the sampler: watched here, it was blocked on it for 40% of the
# phase.
SPUN = bytes(4 << 20)


def spin(stop: threading.Event) -> None:
    hashed = hashlib.sha256()
    while not stop.is_set():
        hashed.update(SPUN)


def block(stop: threading.Event) -> None:
    stop.wait()


@pytest.mark.parametrize(
    ("work", "running"),
    [(spin, True), (block, False)],
    ids=["a thread that runs", "a thread that waits"],
)
def test_a_phase_splits_by_where_the_thread_was(
    work: Callable[[threading.Event], None], running: bool
) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,), name="watched")
    thread.start()
    assert thread.ident is not None
    # The thread's own CPU clock, read from outside: what the watch's "on a CPU" must agree with.
    cpu_clock = time.pthread_getcpuclockid(thread.ident)
    watch = ThreadWatch(lambda: {"watched": thread})
    try:
        start, cpu_start = time.perf_counter(), time.clock_gettime(cpu_clock)
        time.sleep(0.5)
        end, cpu_end = time.perf_counter(), time.clock_gettime(cpu_clock)
    finally:
        stop.set()
        thread.join()
        watch.stop()
    phase = watch.phase(start, end)["watched"]
    assert 0.4 < phase["secs"] <= end - start
    # The phase spans its first and last samples, inside [start, end]: its time on a CPU is the clock's
    # over [start, end] less at most the wall time at either edge (and a scheduler tick of slack, the
    # counters' last update). How much of the phase a thread that runs is given a CPU is the machine's
    # business (a loaded or virtual one steals some); that a thread that waits is given none is not.
    edges = (end - start) - phase["secs"]
    tick = 0.01
    assert cpu_end - cpu_start - edges - tick <= phase["on_cpu_secs"] <= cpu_end - cpu_start + tick, phase
    assert (
        0 <= phase["runnable_secs"] and phase["on_cpu_secs"] + phase["runnable_secs"] <= phase["secs"] + tick
    ), phase
    ran = phase["on_cpu_secs"] + phase["runnable_secs"]
    assert (ran / phase["secs"] > 0.2) if running else (ran / phase["secs"] < 0.05), phase
    top, _ = phase["stacks"][0]
    assert f"{work.__name__} (test_threadwatch.py:" in top, phase["stacks"][:3]
    both = merge([phase, phase])
    assert both["secs"] == phase["secs"] and both["samples"] == 2 * phase["samples"]
    assert both["stacks"][0] == (top, phase["stacks"][0][1] / phase["samples"])
