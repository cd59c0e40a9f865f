"""`benches/threadwatch.py`, what `benches/e2e.py --watch-threads` reports with: a phase's wall time split
into on a CPU, waiting for one and blocked, and the stacks the thread was found in."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))
from threadwatch import ThreadWatch, merge


def spin(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


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
    watch = ThreadWatch(lambda: {"watched": thread})
    try:
        start = time.perf_counter()
        time.sleep(0.5)
        end = time.perf_counter()
    finally:
        stop.set()
        thread.join()
        watch.stop()
    phase = watch.phase(start, end)["watched"]
    assert 0.4 < phase["secs"] <= end - start
    # Running: on a CPU or runnable (a loaded machine's cores shared), all but the moments the sampler
    # takes the GIL from it. Waiting: neither.
    ran = phase["on_cpu_secs"] + phase["runnable_secs"]
    assert (ran / phase["secs"] > 0.8) if running else (ran / phase["secs"] < 0.2), phase
    top, _ = phase["stacks"][0]
    assert f"{work.__name__} (test_threadwatch.py:" in top, phase["stacks"][:3]
    both = merge([phase, phase])
    assert both["secs"] == phase["secs"] and both["samples"] == 2 * phase["samples"]
    assert both["stacks"][0] == (top, phase["stacks"][0][1] / phase["samples"])
