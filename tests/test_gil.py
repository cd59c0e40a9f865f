"""Blocking calls release the GIL: Python code keeps running in another thread while one waits."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from mlp_offload import ObjectStore


def test_wait_releases_the_gil(engine: str, work_dirs: list[Path]) -> None:
    # One in-flight chunk at a time, so each wait lasts; repeated until the waits add up to a clear window
    # even on a disk with a fast write cache.
    with ObjectStore(work_dirs[:1], engine=engine, chunk_size=1 << 20, max_inflight=1) as store:
        data = torch.ones(64 << 20, dtype=torch.uint8)
        barrier = threading.Barrier(2)
        in_wait = threading.Event()
        finished = threading.Event()
        waited = 0.0
        ticks_during_wait = 0

        def io() -> None:
            nonlocal waited
            barrier.wait()
            for round_ in range(200):
                handle = (store.write if round_ % 2 == 0 else store.read)("big", data)
                start = time.perf_counter()
                in_wait.set()
                handle.wait()
                in_wait.clear()
                waited += time.perf_counter() - start
                if waited > 0.5:
                    break
            finished.set()

        def python_work() -> None:
            nonlocal ticks_during_wait
            barrier.wait()
            while not finished.is_set():
                if in_wait.is_set():
                    ticks_during_wait += 1
                time.sleep(0)  # a pure-Python loop: it only runs while it holds the GIL

        threads = [threading.Thread(target=io), threading.Thread(target=python_work)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert waited > 0.05, f"the waits were too short to tell anything ({waited:.3f} s)"
        # With the GIL held during wait(), the loop could not run at all while a wait was in progress.
        assert ticks_during_wait > 100, ticks_during_wait
