"""Where a thread's wall time went, phase by phase, without a profiler (the GPU machine has none, and
may not allow ptrace): a thread of its own samples, every `interval` seconds, each watched thread's
Python stack (`sys._current_frames`) and its scheduler counters (`/proc/self/task/<tid>/schedstat`: time
on a CPU, and time runnable but waiting for one).

A phase's wall time then splits three ways: on a CPU, waiting for a CPU (the cores shared with other
threads: the update's pass beside the forward), and neither (blocked: on a lock, the GIL, the device,
an event), with the stacks the samples found it in. The sampler takes the GIL for each sample (tens of
microseconds): a thread that holds the GIL in one long C call is sampled when it lets go.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

# Frames of a sample's stack kept, innermost first.
FRAMES = 3


def where(frame: FrameType | None) -> str:
    """The innermost `FRAMES` frames of a stack, as `function (file:line) < caller (file:line) ...`."""
    parts: list[str] = []
    while frame is not None and len(parts) < FRAMES:
        code = frame.f_code
        parts.append(f"{code.co_name} ({Path(code.co_filename).name}:{frame.f_lineno})")
        frame = frame.f_back
    return " < ".join(parts) or "(no Python frame)"


def schedstat(native_id: int) -> tuple[int, int] | None:
    """A thread's nanoseconds on a CPU and runnable waiting for one, or None where the kernel keeps no
    such counters (or the thread has ended)."""
    try:
        fields = Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


class ThreadWatch:
    """Samples the threads `find()` returns (a name for each) until `stop()`; `phase(start, end)` says
    where each one's time went between two `time.perf_counter()` readings, from the samples taken then.
    `find` is called at each sample: a thread may start after the watch does."""

    def __init__(self, find: Callable[[], dict[str, threading.Thread]], interval: float = 0.002) -> None:
        self._find = find
        self._interval = interval
        self._samples: dict[str, list[tuple[float, tuple[int, int] | None, str]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="threadwatch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            frames = sys._current_frames()
            taken = []
            for name, thread in self._find().items():
                if thread.ident is None or thread.native_id is None:
                    continue
                counters = schedstat(thread.native_id)
                # A thread that ended since `find()` has no counters left to read: that is a sample not
                # taken, not a kernel without counters (which would blank the whole phase's split).
                if counters is None and not thread.is_alive():
                    continue
                # Timed after its counters are read (reading them lets go of the GIL, and getting it back
                # can take a switch interval): a sample timed inside a phase then holds counters from no
                # later than its time, never from after the phase, when the thread may have ended.
                taken.append((name, (time.perf_counter(), counters, where(frames.get(thread.ident)))))
            with self._lock:
                for name, sample in taken:
                    self._samples.setdefault(name, []).append(sample)

    def phase(self, start: float, end: float) -> dict[str, dict[str, Any]]:
        """Per thread sampled between `start` and `end`: the wall time its first and last samples span,
        of it on a CPU and waiting for one (None without scheduler counters), and its stacks, most
        often found first, with how many samples found each."""
        with self._lock:
            inside = {n: [s for s in samples if start <= s[0] <= end] for n, samples in self._samples.items()}
        result: dict[str, dict[str, Any]] = {}
        for name, samples in inside.items():
            if len(samples) < 2:
                continue
            (t0, counters0, _), (t1, counters1, _) = samples[0], samples[-1]
            on_cpu = runnable = None
            if counters0 is not None and counters1 is not None:
                on_cpu = (counters1[0] - counters0[0]) / 1e9
                runnable = (counters1[1] - counters0[1]) / 1e9
            result[name] = {
                "secs": t1 - t0,
                "on_cpu_secs": on_cpu,
                "runnable_secs": runnable,
                "samples": len(samples),
                "stacks": Counter(s[2] for s in samples).most_common(),
            }
        return result

    def forget(self, before: float) -> None:
        """Drops the samples taken before `before` (a phase already accounted for)."""
        with self._lock:
            for samples in self._samples.values():
                samples[:] = [s for s in samples if s[0] >= before]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def merge(phases: list[dict[str, Any]], top: int = 6) -> dict[str, Any]:
    """One thread's phase over several steps (`ThreadWatch.phase` entries): median seconds, on a CPU and
    waiting for one, and the `top` stacks over all their samples, each with its share of them."""

    def median(key: str) -> float | None:
        values = [p[key] for p in phases if p.get(key) is not None]
        return statistics.median(values) if values else None

    stacks: Counter[str] = Counter()
    for p in phases:
        stacks.update(dict(p["stacks"]))
    total = sum(stacks.values())
    return {
        "secs": median("secs"),
        "on_cpu_secs": median("on_cpu_secs"),
        "runnable_secs": median("runnable_secs"),
        "samples": total,
        "stacks": [(stack, count / total) for stack, count in stacks.most_common(top)],
    }
