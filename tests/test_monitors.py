"""Each step's figures where DeepSpeed's users already look (`monitors`): DeepSpeed's own monitors, read back
with their own readers (TensorBoard's event reader, the CSV monitor's files, a Weights & Biases run in offline
mode), and its step timers (`wall_clock_breakdown`). A real DeepSpeed run of the tests' model each."""

from __future__ import annotations

import csv
import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ONE_NODE
from deepspeed_runs import run_case, section
from mlp_offload.adapter.monitors import TIMER_NAMES
from mlp_offload.engine import telemetry

pytestmark = [pytest.mark.deepspeed, ONE_NODE]

STEPS = 3
PAGE = Path(__file__).resolve().parents[1] / "docs" / "telemetry.md"


@pytest.fixture(autouse=True)
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb writes its run under the test's directory, offline (no account, no network)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")


def monitored(tmp_path: Path, work_dirs: list[Path], **extra: Any) -> dict[str, Any]:
    """The tests' model for `STEPS` steps with TensorBoard, the CSV monitor and wandb (offline) on, and
    DeepSpeed's step timers printed; our section as given (`extra`)."""
    monitors = {
        "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run"},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"},
        "wandb": {"enabled": True, "project": "mlp-offload-tests"},
        "wall_clock_breakdown": True,
    }
    case = {"steps": STEPS, "ds_options": monitors, "mlp_offload": section(work_dirs[:1], **extra)}
    return run_case(case, tmp_path, "monitored")


def scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run's event files, as TensorBoard's own reader reads them: tag -> (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


# A wandb run's transaction log (`run-<id>.wandb`): LevelDB's log format under wandb's own header, as
# wandb's docs describe it; a record is a `wandb_internal_pb2.Record`.
WANDB_HEADER = b":W&B"
BLOCK, RECORD_HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[bytes]:
    """Each record of a wandb run's transaction log, its pieces joined."""
    data = path.read_bytes()
    assert data[:4] == WANDB_HEADER, f"{path}: not a wandb run's log"
    pos, pending = RECORD_HEADER, b""
    while pos + RECORD_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos : pos + RECORD_HEADER])
        if left < RECORD_HEADER or (length == 0 and kind == 0):
            pos += left  # a block's padding
            continue
        piece = data[pos + RECORD_HEADER : pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        pending = piece if kind in (FULL, FIRST) else pending + piece
        if kind in (FULL, LAST):
            yield pending


def wandb_scalars(wandb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of ours an offline wandb run logged: name -> (its step, value)."""
    from wandb.proto import wandb_internal_pb2

    (run_log,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    found: dict[str, list[tuple[int, float]]] = {}
    for data in wandb_records(run_log):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated, no stubs
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
        }
        for key, value in items.items():
            if key.startswith(telemetry.MONITOR_PREFIX):
                found.setdefault(key, []).append((int(items["_step"]), float(value)))
    return found


def documented() -> set[str]:
    """The monitor names docs/telemetry.md lists (a path's with `<i>`)."""
    return set(re.findall(r"^\| `(mlp_offload/[^`]+)` \|", PAGE.read_text(), re.MULTILINE))


def test_each_steps_figures_are_in_every_monitor_at_its_sample_count(
    tmp_path: Path, work_dirs: list[Path]
) -> None:
    result = monitored(tmp_path, work_dirs)
    records = [r for r in result["telemetry"] if r["event"] == "step"]
    assert result["telemetry"][0]["monitors"]["on"] is True
    assert len(records) == STEPS
    tb = scalars(tmp_path / "tb" / "run")
    # DeepSpeed's own lr at each step's sample count: ours are at the same ones.
    samples = [step for step, _ in tb["Train/Samples/lr"]]
    assert len(samples) == STEPS
    ours = {tag: points for tag, points in tb.items() if tag.startswith(telemetry.MONITOR_PREFIX)}
    expected = [dict(telemetry.monitor_events(r)) for r in records]
    for tag, points in ours.items():
        want = [(s, e[tag]) for s, e in zip(samples, expected, strict=True) if tag in e]
        assert [(s, pytest.approx(v, rel=1e-6)) for s, v in points] == want, tag
    # Every figure of every step is there, and each is a name the page lists.
    assert set(ours) == {name for e in expected for name in e}
    named = {re.sub(r"/path\d+/", "/path<i>/", tag) for tag in ours}
    assert named <= documented(), named - documented()
    assert {
        "mlp_offload/time/update_secs",
        "mlp_offload/chunks/cached",
        "mlp_offload/path0/read_bytes",
    } <= ours.keys()
    # The CSV monitor: a file per figure, a row per step.
    with (tmp_path / "csv" / "run" / "mlp_offload_time_update_secs.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "update_secs"] and [int(r[0]) for r in rows[1:]] == samples
    # wandb, offline: the same figures at the same steps.
    logged = wandb_scalars(tmp_path)
    assert [s for s, _ in logged["mlp_offload/time/update_secs"]] == samples
    assert set(logged) == set(ours)
    # DeepSpeed's step timers: the update's parts on its line, beside optimizer_step; here the update runs
    # behind step() (every chunk cached), so each step's line has the last one's.
    timed = [line for line in result["output"].splitlines() if "optimizer_step:" in line]
    assert len(timed) == STEPS
    with_parts = [line for line in timed if all(f"{name}:" in line for name in TIMER_NAMES.values())]
    assert len(with_parts) == STEPS - 1 and with_parts == timed[1:], timed


def test_nothing_is_written_with_monitors_false(tmp_path: Path, work_dirs: list[Path]) -> None:
    """`monitors: false`: DeepSpeed's monitors get DeepSpeed's figures alone, and its timers its own."""
    result = monitored(tmp_path, work_dirs, monitors=False)
    assert result["telemetry"][0]["monitors"] == {"on": False, "why": "off in the config"}
    tags = scalars(tmp_path / "tb" / "run")
    assert "Train/Samples/lr" in tags
    assert not [tag for tag in tags if tag.startswith(telemetry.MONITOR_PREFIX)]
