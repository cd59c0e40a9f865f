"""The requests a block device was sent, from the kernel's own block tracepoints (`block_rq_issue`,
`block_rq_complete` through tracefs, what blktrace records; blktrace's own ioctl is refused in some VMs,
the tracepoints are not): their sizes, how reads and writes interleave, how many were at the device at
once over time, and which threads issued them. Root only; `BlockTrace.unavailable()` says why not.

    trace = BlockTrace(["254:0"])
    trace.start()
    ...                       # the update phase
    summary = trace.stop()    # dict: see `summarize`
"""

from __future__ import annotations

import os
import re
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TRACEFS = Path("/sys/kernel/tracing")
EVENTS = ("block/block_rq_issue", "block/block_rq_complete")
# A trace line: task-pid [cpu] flags timestamp: event: major,minor rwbs [bytes] (cmd) sector + sectors ...
LINE = re.compile(
    r"^\s*(?P<task>.+?)-(?P<pid>\d+)\s+\[(?P<cpu>\d+)\]\s+\S+\s+(?P<ts>\d+\.\d+): "
    r"block_rq_(?P<event>issue|complete): (?P<major>\d+),(?P<minor>\d+) (?P<rwbs>\S+) (?:\d+ )?\(.*?\) "
    r"(?P<sector>\d+) \+ (?P<sectors>\d+)"
)


class BlockTrace:
    """Records the requests of devices `devices` (`major:minor`) between `start` and `stop`."""

    def __init__(self, devices: Sequence[str], buffer_kib: int = 16384) -> None:
        self.devices = {tuple(int(x) for x in d.split(":")) for d in devices}
        self.buffer_kib = buffer_kib

    @staticmethod
    def unavailable() -> str | None:
        """Why the tracepoints cannot be used here, or None."""
        if os.geteuid() != 0:
            return "tracing block requests needs root"
        if not (TRACEFS / "events" / "block" / "block_rq_issue").exists():
            return f"no block tracepoints under {TRACEFS} (mount tracefs there)"
        return None

    def _write(self, name: str, value: str) -> None:
        (TRACEFS / name).write_text(value)

    def start(self) -> None:
        self._write("tracing_on", "0")
        self._write("buffer_size_kb", str(self.buffer_kib))
        self._write("trace", "")
        for event in EVENTS:
            self._write(f"events/{event}/enable", "1")
        self._write("tracing_on", "1")

    def stop(self) -> dict[str, Any]:
        self._write("tracing_on", "0")
        for event in EVENTS:
            self._write(f"events/{event}/enable", "0")
        text = (TRACEFS / "trace").read_text()
        self._write("trace", "")
        return summarize(text, self.devices)


def summarize(text: str, devices: set[tuple[int, ...]]) -> dict[str, Any]:
    """What a trace of `block_rq_issue`/`block_rq_complete` lines says about `devices`' requests: how many
    of each direction and their sizes (percentiles, KiB), how reads and writes interleave (runs of one
    direction in issue order), the number at the device over time (its time-weighted mean and
    percentiles), and which tasks issued them (the task in whose context each request went out)."""
    issued: list[tuple[float, str, int, str]] = []
    events: list[tuple[float, int]] = []
    lost = "LOST" in text
    for line in text.splitlines():
        m = LINE.match(line)
        if m is None or (int(m["major"]), int(m["minor"])) not in devices:
            continue
        rwbs, ts = m["rwbs"], float(m["ts"])
        direction = "read" if "R" in rwbs else "write" if "W" in rwbs else None
        if direction is None or int(m["sectors"]) == 0:
            continue  # flushes and the like carry no data
        if m["event"] == "issue":
            issued.append((ts, direction, int(m["sectors"]) * 512, m["task"].strip()))
            events.append((ts, +1))
        else:
            events.append((ts, -1))
    out: dict[str, Any] = {"requests": len(issued), "lost_events": lost}
    if not issued:
        return out
    for direction in ("read", "write"):
        sizes = sorted(b for _, d, b, _ in issued if d == direction)
        out[direction] = {
            "requests": len(sizes),
            "bytes": sum(sizes),
            "kib_p10_p50_p90": [sizes[int(q * (len(sizes) - 1))] / 1024 for q in (0.1, 0.5, 0.9)]
            if sizes
            else [],
        }
    # Runs of one direction in issue order: long runs are phases, runs of 1 alternate request by request.
    runs, last = [], None
    for _, direction, _, _ in issued:
        if direction == last:
            runs[-1] += 1
        else:
            runs.append(1)
            last = direction
    out["direction_runs"] = {
        "count": len(runs),
        "median_length": statistics.median(runs),
        "longest": max(runs),
    }
    # Requests at the device over time: +1 at each issue, -1 at each completion, weighted by how long each
    # count lasted. Only where every request's completion was traced: the kernel completes some requests
    # in batches without an event each, and then the count only grows (the block counters' mean depth,
    # which the bench reports beside it, holds either way).
    tasks = Counter(re.sub(r"[-:/]?\d+$", "", task) for _, _, _, task in issued)
    out["issued_by"] = dict(tasks.most_common(6))
    completions = sum(1 for _, change in events if change < 0)
    out["completions"] = completions
    if completions < 0.98 * len(issued):
        out["at_device"] = None
        return out
    events.sort()
    depth, weighted, samples = 0, 0.0, []
    for (t0, change), (t1, _) in zip(events, [*events[1:], events[-1]], strict=True):
        depth = max(0, depth + change)
        weighted += depth * (t1 - t0)
        samples.append(depth)
    span = events[-1][0] - events[0][0]
    samples.sort()
    out["at_device"] = {
        "mean": weighted / span if span > 0 else 0.0,
        "p50": samples[len(samples) // 2],
        "p90": samples[int(0.9 * (len(samples) - 1))],
        "max": samples[-1],
        "secs": span,
    }
    return out


def describe(summary: dict[str, Any]) -> str:
    """One line of a summary."""
    if not summary.get("requests"):
        return "no requests traced"
    parts = []
    for direction in ("read", "write"):
        d = summary.get(direction) or {}
        if d.get("requests"):
            p10, p50, p90 = d["kib_p10_p50_p90"]
            parts.append(f"{d['requests']} {direction}s of {p10:.0f}/{p50:.0f}/{p90:.0f} KiB (p10/p50/p90)")
    runs, at = summary["direction_runs"], summary["at_device"]
    by = ", ".join(f"{task} {n}" for task, n in summary["issued_by"].items())
    depth = (
        f"at the device {at['mean']:.1f} on average (p50 {at['p50']}, p90 {at['p90']}, max {at['max']})"
        if at is not None
        else "completions batched (no depth from the trace)"
    )
    return (
        f"{'; '.join(parts)}; reads and writes in {runs['count']} runs (median {runs['median_length']:.0f}, "
        f"longest {runs['longest']}); {depth}; issued by {by}"
        + ("; events were lost" if summary["lost_events"] else "")
    )
