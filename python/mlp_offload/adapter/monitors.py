"""Where DeepSpeed's users already look: its monitors and its step timers.

`MonitorWriter` writes each step record's figures (`engine.telemetry.monitor_events`) to DeepSpeed's own
`MonitorMaster` (TensorBoard, Weights & Biases, Comet, its CSV monitor: whichever the DeepSpeed config
enables) at the engine's sample count of that step. The records come from the planner as they are
emitted; the monitor and the sample count come from the engine after each of its steps
(`integration` wraps `DeepSpeedEngine._take_model_step`). A step's record comes inside `step()`, or later
where the update runs behind it, so the two are paired in order. Where no monitor is enabled nothing is
kept or written (`monitors: false`, or a config without one).

`UpdateTimers` gives DeepSpeed's `wall_clock_breakdown` the update's parts: its reads, its pass, its
writes and its waits, as timers of DeepSpeed's own group, logged on the line of `optimizer_step`
(`_post_step`). The parts overlap (the pipeline reads ahead and writes behind the pass), so they need not
add up to the step. An update behind `step()` is logged at the next step, once it ended.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from deepspeed.utils.timer import NoopTimer

from mlp_offload.engine.pipeline import StepStats
from mlp_offload.engine.telemetry import StepRecord, monitor_events

# The update's parts as DeepSpeed's timers (in its style: `optimizer_step`, `optimizer_swap_in_state`).
TIMER_NAMES = {
    "read": "mlp_offload_read",
    "pass": "mlp_offload_pass",
    "write": "mlp_offload_write",
    "wait": "mlp_offload_wait",
}


# The most step records waiting for their step's sample count (`MonitorWriter`).
RECORDS_WAITING = 16


class MonitorWriter:
    """Each step record to DeepSpeed's monitor, at its step's sample count (module docs). `on`: the
    section's `monitors`; off for good once the engine's monitor says it is not enabled."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self._monitor: Any = None
        # Step and skipped records, and the engine's sample counts of its steps, each waiting for the
        # other (one of each per step, in order). Records wait for a step or two at most: more only where
        # no engine steps (an optimizer stepped by hand), and then they are never written.
        self._records: deque[dict[str, Any]] = deque(maxlen=RECORDS_WAITING)
        self._samples: deque[int] = deque()

    def record(self, record: dict[str, Any]) -> None:
        """A record the planner emitted (the start record has no step)."""
        if self.on and record["event"] != "start":
            self._records.append(record)
            self._write()

    def step_taken(self, monitor: Any, samples: int) -> None:
        """DeepSpeed's engine took a step: its monitor (`MonitorMaster`) and its `global_samples` then."""
        if not self.on:
            return
        if not monitor.enabled:
            # No monitor in the config: nothing to keep, now or later.
            self.on = False
            self._records.clear()
            return
        self._monitor = monitor
        self._samples.append(samples)
        self._write()

    def _write(self) -> None:
        while self._records and self._samples and self._monitor is not None:
            record, samples = self._records.popleft(), self._samples.popleft()
            if record["event"] == "step":
                step: StepRecord = record  # type: ignore[assignment]
                self._monitor.write_events([(name, value, samples) for name, value in monitor_events(step)])


class MeasuredTimer:
    """A timer of DeepSpeed's group (`SynchronizedWallClockTimer`) holding durations measured elsewhere
    (`add`): `elapsed` and `mean` as DeepSpeed's timers give them, in milliseconds."""

    def __init__(self, name: str) -> None:
        self.name_ = name
        self.started_ = False
        self._start = 0.0
        self.records: list[float] = []

    def add(self, seconds: float) -> None:
        self.records.append(seconds)

    def start(self) -> None:
        # Timed on the host too, as DeepSpeed's host timers are, should anything start it.
        self.started_, self._start = True, time.perf_counter()

    def stop(self, reset: bool = False, record: bool = False) -> None:
        if self.started_:
            self.add(time.perf_counter() - self._start)
        self.started_ = False

    def reset(self) -> None:
        self.records = []

    def elapsed(self, reset: bool = True) -> float:
        milliseconds = 1000.0 * sum(self.records)
        if reset:
            self.reset()
        return milliseconds

    def mean(self) -> float:
        return 1000.0 * sum(self.records) / len(self.records) if self.records else 0.0


def update_parts(stats: StepStats, compute_secs: float) -> dict[str, float]:
    """An update's parts in seconds: its reads and its writes (the busiest path's, the paths working at
    once), its pass (every chunk's compute), and the loop's waits for reads and for writes."""
    return {
        "read": max((p["read_busy_secs"] for p in stats.per_path), default=0.0),
        "pass": compute_secs,
        "write": max((p["write_busy_secs"] for p in stats.per_path), default=0.0),
        "wait": stats.read_wait_seconds + stats.write_wait_seconds,
    }


class UpdateTimers:
    """The update's parts for DeepSpeed's step timers (module docs): set when an update ends, taken into
    DeepSpeed's timers by the next `_post_step` that logs them."""

    def __init__(self) -> None:
        self._parts: dict[str, float] | None = None

    def ended(self, stats: StepStats, compute_secs: float) -> None:
        self._parts = update_parts(stats, compute_secs)

    def take_into(self, timers: Any) -> set[str]:
        """The parts of the update that ended last into `timers` (DeepSpeed's group: its no-op one
        without `wall_clock_breakdown`), and their names for its log."""
        parts, self._parts = self._parts, None
        if parts is None or isinstance(timers, NoopTimer):
            return set()
        held = timers.get_timers()
        for part, seconds in parts.items():
            name = TIMER_NAMES[part]
            timer = held.get(name)
            if not isinstance(timer, MeasuredTimer):
                timer = held[name] = MeasuredTimer(name)
            timer.add(seconds)
        return set(TIMER_NAMES.values())
