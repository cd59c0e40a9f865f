"""The performance model through the bindings: planning at a split chosen elsewhere (the tuner's)."""

from __future__ import annotations

from typing import Any

import pytest

from mlp_offload import _core

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
