"""DeepSpeed's `offload_optimizer.ratio` with our engine, against stock's `ratio` directly (DeepSpeed's CPU
accelerator: stock's CPU Adam steps every subgroup there, as with `device: cpu`): fp32 with the README's
section, bf16 streamed, accumulation with clipping, two ranks, and checkpoints both ways, bit for bit,
with the random state stock's construction leaves (its `ratio` draws one number there). Where stock
would keep subgroups on a GPU, the start-up refuses it by the key (`tests/test_settings.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import ONE_NODE
from deepspeed_runs import assert_bit_equal, run_case, section
from mlp_offload.adapter import options
from mlp_offload.engine import planning

RATIO = f"{options.OO}.ratio"
STREAMS = {"host_memory": "200K", "update_chunk": "24K"}

# name, the DeepSpeed side (its ratio among its options), the section's extra keys (None: the README's,
# all in memory), ranks
ROWS: list[tuple[str, dict[str, Any], dict[str, Any], int]] = [
    ("fp32, the README's section, ratio 0.5", {"fp32": True, "ds_options": {RATIO: 0.5}}, {}, 1),
    ("bf16 streamed, ratio 0.3", {"ds_options": {RATIO: 0.3}}, STREAMS, 1),
    (
        "accumulation 2 with clipping, ratio 0.5",
        {"grad_accum": 2, "clip": 0.05, "fp32": True, "ds_options": {RATIO: 0.5}},
        STREAMS,
        1,
    ),
    ("two ranks, ratio 0.5", {"fp32": True, "ds_options": {RATIO: 0.5}}, {"host_memory": "64M"}, 2),
]


@pytest.mark.parametrize(
    ("ds_case", "extra", "ranks"),
    [pytest.param(*r[1:], marks=[ONE_NODE] if r[3] > 1 else [], id=r[0]) for r in ROWS],
)
def test_ratio_is_bit_equal_to_stocks_ratio(
    ds_case: dict[str, Any], extra: dict[str, Any], ranks: int, work_dirs: list[Path], tmp_path: Path
) -> None:
    case = {**ds_case, "steps": 5}
    stock = run_case(case, tmp_path, "stock", ranks=ranks)
    ours = run_case({**case, "mlp_offload": section(work_dirs[:1], **extra)}, tmp_path, "ours", ranks=ranks)
    for a, b in zip(ours.get("ranks", [ours]), stock.get("ranks", [stock]), strict=True):
        assert a["optimizer_class"] == "mlp_offload.adapter.zero3.MLPOffloadStage3"
        assert_bit_equal(a, b)
        assert a["rng_after_init"] == b["rng_after_init"]
    start = ours["telemetry"][0]
    assert start["accelerator_update"]["on"] is False
    assert "on DeepSpeed's CPU accelerator stock updates every subgroup" in start["accelerator_update"]["why"]
    # Said at start, on the start line too.
    assert f"on the accelerator: {start['accelerator_update']['why']}" in planning.start_line(start)


def test_stocks_ratio_draws_from_the_host_random_state(tmp_path: Path) -> None:
    """What the row's random-state check tells apart: stock's construction with a ratio below 1 draws a
    number that one without does not."""
    case = {"fp32": True, "steps": 1}
    with_ratio = run_case({**case, "ds_options": {RATIO: 0.5}}, tmp_path, "ratio")
    without = run_case(case, tmp_path, "plain")
    assert with_ratio["rng_after_init"] != without["rng_after_init"]


# name, whether ours saves, whether ours resumes
CHECKPOINTS = [("stock saves, ours resumes", False, True), ("ours saves, stock resumes", True, False)]


@pytest.mark.parametrize(
    ("ours_saves", "ours_resumes"), [c[1:] for c in CHECKPOINTS], ids=[c[0] for c in CHECKPOINTS]
)
def test_a_checkpoint_with_ratio_moves_both_ways_with_stocks(
    ours_saves: bool, ours_resumes: bool, work_dirs: list[Path], tmp_path: Path
) -> None:
    """Saved at step 3 and loaded into a new engine, three more steps: the bits of stock's `ratio` saving
    and loading itself."""
    case: dict[str, Any] = {
        "fp32": True,
        "steps": 6,
        "checkpoint_at": 3,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "ds_options": {RATIO: 0.5},
    }
    stock = run_case({**case, "checkpoint_dir": str(tmp_path / "stock-ckpt")}, tmp_path, "stock")
    ours_section = section(work_dirs[:1], **STREAMS)
    if ours_saves:
        case["mlp_offload"] = ours_section
    if ours_resumes:
        case["resume_mlp_offload"] = ours_section
    both = run_case(case, tmp_path, "both")
    assert both["optimizer_class"].startswith(
        "mlp_offload.adapter.zero3." if ours_resumes else "deepspeed.runtime.zero.stage3."
    )
    assert_bit_equal(both, stock)
