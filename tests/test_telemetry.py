"""The telemetry's records (`mlp_offload.engine.telemetry`): the page generated from them, and the check
that a record has their keys (a run's records are checked in `tests/test_backward.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlp_offload.engine import telemetry

PAGE = Path(__file__).resolve().parents[1] / "docs" / "telemetry.md"


def test_the_telemetry_page_is_the_code() -> None:
    assert PAGE.read_text() == telemetry.markdown(), (
        "docs/telemetry.md differs from engine/telemetry.py: `make docs-pages`"
    )


def test_every_key_says_what_it_is() -> None:
    for record_type in telemetry.RECORDS:
        for name, (_, line) in telemetry.keys_of(record_type).items():
            assert line.endswith("."), (record_type.__name__, name)


def skipped(**changes: Any) -> dict[str, Any]:
    record = {"event": "skipped", "rank": 0, "loss_scale": 1024.0, "overlap_backward": None}
    return {**record, **changes}


@pytest.mark.parametrize(
    ("record", "found"),
    [
        (skipped(), []),
        (skipped(extra=1), ["extra: not in SkippedRecord"]),
        ({k: v for k, v in skipped().items() if k != "rank"}, ["rank: missing"]),
        (skipped(event="other"), ["event 'other': no such record"]),
        (
            skipped(overlap_backward={"chunks": 1}),
            [
                f"overlap_backward.{k}: missing"
                for k in telemetry.keys_of(telemetry.BackwardStep)
                if k != "chunks"
            ],
        ),
    ],
    ids=["as documented", "a key too many", "a key missing", "an unknown event", "a record it holds"],
)
def test_mismatches_are_named(record: dict[str, Any], found: list[str]) -> None:
    assert telemetry.mismatches(record) == found
