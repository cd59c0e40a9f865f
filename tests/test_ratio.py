"""DeepSpeed's `offload_optimizer.ratio` with our engine, against stock's `ratio` directly (DeepSpeed's CPU
accelerator: stock's CPU Adam steps every subgroup there, as with `device: cpu`): fp32 with the README's
section, bf16 streamed, accumulation with clipping, two ranks, and checkpoints both ways, bit for bit,
with the random state stock's construction leaves (its `ratio` draws one number there). Where stock
would keep subgroups on a GPU, the start-up refuses it by the key (`tests/test_settings.py`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from conftest import ONE_NODE
from deepspeed_runs import (
    SAVE_AT,
    STATE_MODES,
    assert_bit_equal,
    convert_to_universal,
    run_case,
    section,
    stock_universal_resume,
    universal,
)
from mlp_offload.adapter import options
from mlp_offload.engine import planning

RATIO = f"{options.OO}.ratio"
ON_CUDA = os.environ.get("MLP_OFFLOAD_TEST_ACCELERATOR") == "cuda"
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
    (
        "layers dropped from some steps (stale gradients), accumulation 2, ratio 0.5",
        {"fp32": True, "layer_drop": [1, 2, 5], "grad_accum": 2, "ds_options": {RATIO: 0.5}},
        STREAMS,
        1,
    ),
    (
        "fp16 with an overflow step, ratio 0.5",
        {"fp16": True, "overflow_at_step": 2, "ds_options": {RATIO: 0.5}},
        STREAMS,
        1,
    ),
    (
        "bf16 weights and moments, ratio 0.5",
        {"ds_options": {**STATE_MODES["bf16 weights and moments"][0]["ds_options"], RATIO: 0.5}},
        STREAMS,
        1,
    ),
    (
        # Without clipping, the host's chunks updated during backward are kept.
        "the update during backward, ratio 0.5",
        {"fp32": True, "clip": 0.0, "reduce_bucket_size": 20_000, "ds_options": {RATIO: 0.5}},
        {**STREAMS, "overlap_backward": True},
        1,
    ),
]


# Where the subgroups stock would keep on a GPU are: the store's, as on DeepSpeed's CPU accelerator stock
# updates them on the host; or kept apart and updated by the accelerator's kernel, through Triton's
# interpreter (`TRITON_INTERPRET=1`), as on a GPU.
WHERE = {
    "host": ({}, "on DeepSpeed's CPU accelerator stock updates every subgroup"),
    "accelerator": ({"TRITON_INTERPRET": "1"}, "through Triton's interpreter, as stock does"),
}
if ON_CUDA:
    # On a GPU (the GPU report) they are kept in its memory, updated by the compiled kernel.
    WHERE = {"accelerator": ({}, "in the cuda accelerator, as stock does")}


def stock_of(case: dict[str, Any]) -> dict[str, Any]:
    """Stock's side of a case: its `ratio` where that is `device: cpu` (the CPU accelerator); on a GPU,
    where its `ratio` runs torch's AdamW, `device: cpu` itself."""
    if not ON_CUDA:
        return case
    return {**case, "ds_options": {k: v for k, v in case["ds_options"].items() if k != RATIO}}


def _row_params() -> list[Any]:
    """Each row through the accelerator's path; the README's row through the store too (the other rows'
    store path is `device: cpu`'s, which `test_bitexact.py` covers)."""
    return [
        pytest.param(*r[1:], where, marks=[ONE_NODE] if r[3] > 1 else [], id=f"{r[0]}-{where}")
        for k, r in enumerate(ROWS)
        for where in WHERE
        if k == 0 or where == "accelerator"
    ]


@pytest.mark.parametrize(("ds_case", "extra", "ranks", "where"), _row_params())
def test_ratio_is_bit_equal_to_stocks_ratio(
    ds_case: dict[str, Any],
    extra: dict[str, Any],
    ranks: int,
    where: str,
    work_dirs: list[Path],
    tmp_path: Path,
) -> None:
    env, why = WHERE[where]
    case = {**ds_case, "steps": 5}
    stock = run_case(stock_of(case), tmp_path, "stock", ranks=ranks)
    ours_case = {**case, "mlp_offload": section(work_dirs[:1], **extra)}
    ours = run_case(ours_case, tmp_path, "ours", ranks=ranks, env=env)
    for a, b in zip(ours.get("ranks", [ours]), stock.get("ranks", [stock]), strict=True):
        assert a["optimizer_class"] == "mlp_offload.adapter.zero3.MLPOffloadStage3"
        assert_bit_equal(a, b)
        assert a["rng_after_init"] == b["rng_after_init"]
    start = ours["telemetry"][0]
    assert start["accelerator_update"]["on"] is (where == "accelerator")
    # Stock's rule: the first int((1 - ratio) x subgroups), each of 12 or 6 bytes an element there.
    subgroups = start["subgroups"] if where == "accelerator" else 0
    kept = int((1 - ds_case["ds_options"][RATIO]) * subgroups)
    assert start["accelerator_update"]["subgroups"] == kept
    assert (start["accelerator_update"]["bytes"] > 0) is (kept > 0)
    # Each step says what it updated there.
    steps = [r for r in ours["telemetry"] if r.get("event") == "step"]
    assert steps and all((r["accelerator_update"] is not None) is (kept > 0) for r in steps)
    if kept:
        assert {r["accelerator_update"]["subgroups"] for r in steps} == {kept}
    assert why in start["accelerator_update"]["why"]
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
    and loading itself, ours with subgroups on the accelerator (through the interpreter)."""
    if ON_CUDA:
        pytest.skip(
            "on a GPU stock's ratio steps its share with torch's AdamW, whose state no checkpoint saves"
        )
    case: dict[str, Any] = {
        "fp32": True,
        "steps": 6,
        "checkpoint_at": 3,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "ds_options": {RATIO: 0.5},
    }
    stock = run_case(stock_of({**case, "checkpoint_dir": str(tmp_path / "stock-ckpt")}), tmp_path, "stock")
    ours_section = section(work_dirs[:1], **STREAMS)
    if ours_saves:
        case["mlp_offload"] = ours_section
    if ours_resumes:
        case["resume_mlp_offload"] = ours_section
    both = run_case(case, tmp_path, "both", env=WHERE["accelerator"][0])
    assert both["optimizer_class"].startswith(
        "mlp_offload.adapter.zero3." if ours_resumes else "deepspeed.runtime.zero.stage3."
    )
    if ours_resumes:
        # The interpreter's environment reached the run (it does ours's save alike): subgroups there.
        assert both["telemetry"][0]["accelerator_update"]["subgroups"] > 0
    assert_bit_equal(both, stock)


@ONE_NODE
def test_a_universal_checkpoint_of_subgroups_on_the_accelerator(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """Ours with subgroups on the accelerator saves on 2 ranks, DeepSpeed's converter makes it universal,
    and ours on 1 rank resumes it in a new process: stock's `ratio` resuming its own, bit for bit."""
    ds_case = {"model": "gpt", "ds_options": {RATIO: 0.5}, "steps": SAVE_AT + 3}
    env = WHERE["accelerator"][0]
    if ON_CUDA:
        pytest.skip("one GPU: the save runs on two ranks")
    ckpt, universal_dir = tmp_path / "ckpt", tmp_path / "universal"
    saves = {**ds_case, "mlp_offload": section(work_dirs[:1])}
    saves |= {"steps": SAVE_AT + 1, "save_at": SAVE_AT, "checkpoint_dir": str(ckpt)}
    run_case(saves, tmp_path, "saves", ranks=2, env=env)
    convert_to_universal(ckpt / "ckpt", universal_dir / "ckpt")
    resume = {**ds_case, "mlp_offload": section(work_dirs[1:2])}
    resume |= {"resume_at": SAVE_AT, "checkpoint_dir": str(universal_dir)}
    resumed = run_case(universal(resume), tmp_path, "resumed", env=env)
    assert resumed["telemetry"][0]["accelerator_update"]["on"]
    assert_bit_equal(resumed, stock_universal_resume(stock_of(ds_case), 2, 1, tmp_path)[0])
