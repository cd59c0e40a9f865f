"""Blocking calls release the GIL: Python code keeps running in another thread while one waits."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from mlp_offload import ObjectStore


def test_wait_releases_the_gil(engine: str, work_dirs: list[Path]) -> None:
    # Enough I/O to take a while (hundreds of ms) even on a fast disk, through one in-flight chunk.
    with ObjectStore(work_dirs[:1], engine=engine, chunk_size=1 << 20, max_inflight=1) as store:
        data = torch.ones(256 << 20, dtype=torch.uint8)
        barrier = threading.Barrier(2)
        window: dict[str, float] = {}
        ticks_during_wait = 0

        def io() -> None:
            barrier.wait()
            window["start"] = time.perf_counter()
            store.write("big", data).wait()
            window["end"] = time.perf_counter()

        def python_work() -> None:
            nonlocal ticks_during_wait
            barrier.wait()
            deadline = time.perf_counter() + 30
            while "end" not in window and time.perf_counter() < deadline:
                if "start" in window:
                    ticks_during_wait += 1
                time.sleep(0)  # a pure-Python loop: it only runs while it holds the GIL

        threads = [threading.Thread(target=io), threading.Thread(target=python_work)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert window["end"] - window["start"] > 0.05, "the write was too short to tell anything"
        # With the GIL held during wait(), the loop could not have run at all in the window.
        assert ticks_during_wait > 100, ticks_during_wait
