"""The performance model through the bindings: planning at a split chosen elsewhere (the tuner's), and the
host buffers' pages it chooses."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest

from mlp_offload import _core

# `MLPOffloadConfig.host_pages`'s settings.
HostPages = Literal["auto", "huge", "small"]

# Path a costs 0.32 s per 480 MB subgroup on its own, path b 0.96 s: the model's own split is 3:1.
PATHS = [
    {"device_id": "a", "read_bytes_per_s": 1.5e9, "write_bytes_per_s": 1.5e9, "best_inflight": 16},
    {"device_id": "b", "read_bytes_per_s": 0.5e9, "write_bytes_per_s": 0.5e9, "best_inflight": 16},
]
WORK: dict[str, Any] = {
    "subgroups": 10,
    "read_bytes_per_subgroup": 240_000_000,
    "write_bytes_per_subgroup": 240_000_000,
    "host_bytes_per_subgroup": 240_000_000,
    "host_memory": 3 * 240_000_000,
}


@pytest.mark.parametrize(
    ("weights", "weights_out", "io_secs"),
    [
        (None, [0.75, 0.25], 0.24),
        ([3.0, 1.0], [0.75, 0.25], 0.24),
        ([2.0, 1.0], [2 / 3, 1 / 3], 0.32),
        ([1.0, 0.0], [1.0, 0.0], 0.32),
    ],
)
def test_plan_at_a_given_split_is_paced_by_the_slowest_path(
    weights: list[float] | None, weights_out: list[float], io_secs: float
) -> None:
    plan = _core.plan_update(PATHS, **WORK, weights=weights)
    assert plan["weights"] == pytest.approx(weights_out)
    assert plan["io_secs_per_subgroup"] == pytest.approx(io_secs)


@pytest.mark.parametrize("weights", [[1.0], [float("nan"), 1.0], [0.0, 0.0], [-1.0, 2.0]])
def test_a_bad_split_is_a_value_error_naming_weights(weights: list[float]) -> None:
    with pytest.raises(ValueError, match=r"^weights:"):
        _core.plan_update(PATHS, **WORK, weights=weights)


def pages_probe(
    small_read: float, huge_read: float, small_write: float = 1e9, huge_write: float = 1e9
) -> dict:
    return {
        "small_read_bytes_per_s": small_read,
        "huge_read_bytes_per_s": huge_read,
        "small_write_bytes_per_s": small_write,
        "huge_write_bytes_per_s": huge_write,
    }


# name, host_pages, each path's pages figures (None: no profile), pages, why
HOST_PAGES = [
    ("configured huge", "huge", [pages_probe(3e9, 1e9)], "huge", "configured"),
    ("configured small", "small", [pages_probe(1e9, 3e9)], "small", "configured"),
    ("auto without a profile", "auto", None, "huge", "auto, no probe profile"),
    ("auto, huge faster here", "auto", [pages_probe(1.4e9, 4.4e9)], "huge", "auto, as the probe measured"),
    ("auto, a tie", "auto", [pages_probe(3e9, 2.96e9)], "huge", "auto, as the probe measured"),
    (
        "auto, huge slower on one path of two",
        "auto",
        [pages_probe(1.4e9, 4.4e9), pages_probe(3e9, 3e9, 3e9, 2.5e9)],
        "small",
        "auto, as the probe measured",
    ),
]


@pytest.mark.parametrize(
    ("name", "setting", "figures", "pages", "why"), HOST_PAGES, ids=[h[0] for h in HOST_PAGES]
)
def test_host_pages_follow_the_setting_or_the_probe(
    name: str, setting: HostPages, figures: list[dict] | None, pages: str, why: str, tmp_path: Path
) -> None:
    from mlp_offload.common.config import MLPOffloadConfig
    from mlp_offload.engine import profiles
    from mlp_offload.engine.planning import UpdatePlanner

    paths = [str(tmp_path / f"p{i}") for i in range(len(figures) if figures else 1)]
    planner = UpdatePlanner(MLPOffloadConfig(paths=paths, host_pages=setting, weights="equal"), rank=0)
    if figures is not None:
        planner.profile = profiles.Profile(paths, [{"pages": f} for f in figures], probed_at=0.0)
    assert planner.host_pages() == (pages, why)


def samples(request: int, rates: dict[int, tuple[float, float]]) -> list[dict[str, Any]]:
    """A probe's samples at `request` bytes: per in-flight count, (read, write) MiB/s."""
    return [
        {"op": op, "chunk_size": request, "max_inflight": depth, "bytes_per_s": rate * 2**20}
        for depth, pair in rates.items()
        for op, rate in zip(("read", "write"), pair, strict=True)
    ]


M4 = 4 << 20
# name, the config's max_inflight, each path's samples (None: no probe), expected (count, why)
MAX_INFLIGHT = [
    ("configured wins", 4, [samples(M4, {16: (2800, 5700)})], (4, "configured")),
    (
        "the probe's fastest at the store's request size, reads and writes together",
        None,
        [samples(M4, {4: (2730, 5320), 16: (2790, 5760)}) + samples(16 << 20, {64: (9000, 9000)})],
        (16, "auto, as the probe measured fastest with 4,194,304-byte requests"),
    ),
    (
        "a faster write does not make up for a slower read at equal bytes",
        None,
        [samples(M4, {4: (2000, 4000), 16: (1000, 9000)})],
        (4, "auto, as the probe measured fastest with 4,194,304-byte requests"),
    ),
    (
        "the largest over the paths (they share one limit)",
        None,
        [samples(M4, {4: (900, 900), 16: (800, 800)}), samples(M4, {4: (2000, 2000), 16: (2500, 2500)})],
        (16, "auto, as the probe measured fastest with 4,194,304-byte requests"),
    ),
    (
        "no samples at the store's request size",
        None,
        [samples(1 << 20, {16: (2800, 5700)})],
        (8, "default (no probe of 4,194,304-byte requests)"),
    ),
    ("no probe", None, None, (8, "default (no probe of 4,194,304-byte requests)")),
]


@pytest.mark.parametrize(
    ("name", "configured", "probed", "expected"), MAX_INFLIGHT, ids=[m[0] for m in MAX_INFLIGHT]
)
def test_requests_in_flight_follow_the_config_or_the_probe(
    name: str,
    configured: int | None,
    probed: list[list[dict[str, Any]]] | None,
    expected: tuple[int, str],
    tmp_path: Path,
) -> None:
    from mlp_offload.common.config import MLPOffloadConfig
    from mlp_offload.engine import profiles
    from mlp_offload.engine.planning import UpdatePlanner

    paths = [str(tmp_path / f"p{i}") for i in range(len(probed) if probed else 1)]
    config = MLPOffloadConfig(paths=paths, max_inflight=configured, weights="equal")
    planner = UpdatePlanner(config, rank=0)
    if probed is not None:
        planner.profile = profiles.Profile(paths, [{"samples": s} for s in probed], probed_at=0.0)
    assert planner.max_inflight() == expected


GiB = 1 << 30


@pytest.mark.parametrize(
    ("steps", "predicted"),
    [
        # Before any step: two passes over the partitions (2 GiB at 1 GiB/s, the plan's figure).
        ([], 2.0),
        # The first step of the process is left out: its bytes, the plan's rate.
        ([(1 * GiB, 1 * GiB, 4.0, True)], 1.0),
        # After it, the rate the steps measured (fetched and the update's reads over the busy time).
        ([(1 * GiB, 1 * GiB, 4.0, True), (GiB // 2, GiB, 2.0, False)], 1.0),
        # The median of the last three (0.25, 0.5 and 0.125 GiB/s).
        ([(GiB, GiB, secs, False) for secs in (1.0, 4.0, 2.0, 8.0)], 4.0),
        ([(GiB, GiB, secs, False) for secs in (1.0, 4.0, 2.0)], 2.0),
        # Not measured (no swapper's busy time): the plan's rate.
        ([(GiB, GiB, None, False)], 1.0),
    ],
)
def test_the_parameters_reads_are_predicted_at_the_rate_the_steps_before_read(
    steps: list[tuple[int, int, float | None, bool]], predicted: float
) -> None:
    from mlp_offload.engine.planning import ParamReads

    reads = ParamReads()
    for fetched, read, busy, first in steps:
        reads.observe(fetched, read, busy, first=first)
    assert reads.predict(plan_bytes_per_s=GiB, params_bytes=GiB) == pytest.approx(predicted)


@pytest.mark.parametrize(
    ("report", "words"),
    [
        (
            {"bytes": 2 << 30, "reserved_huge_bytes": 0, "transparent_huge_bytes": 2 << 30},
            "2.00 GiB transparent of 2.00",
        ),
        (
            {"bytes": 2 << 30, "reserved_huge_bytes": 1 << 30, "transparent_huge_bytes": 1 << 29},
            "1.00 GiB reserved + 0.50 GiB transparent of 2.00 GiB, 0.50 GiB in 4 KiB pages",
        ),
        (
            {"bytes": 1 << 30, "reserved_huge_bytes": 0, "transparent_huge_bytes": 0},
            "none of 1.00 GiB, 1.00 GiB in 4 KiB",
        ),
    ],
)
def test_the_start_up_line_says_what_pages_the_kernel_gave(report: dict, words: str) -> None:
    """Fewer huge pages than asked for read as troubleshooting's entry says."""
    from mlp_offload.adapter.troubleshooting import met
    from mlp_offload.engine.memory import describe_pages

    line = describe_pages("huge", "configured", report)
    assert words in line
    short = report["reserved_huge_bytes"] + report["transparent_huge_bytes"] < report["bytes"]
    assert met("huge-pages-short", line) == short, line
    assert describe_pages("small", "configured", report) == "host buffers in 4 KiB pages (configured)"
