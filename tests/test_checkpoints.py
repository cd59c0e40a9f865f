"""DeepSpeed's checkpoints with our engine: ours and stock's load both ways, bit for bit, with DeepSpeed's
`zero_to_fp32` and `save_16bit_model`; partial loads; ranks loading one after another; a checkpoint
without its ZeRO files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ONE_NODE
from deepspeed_runs import (
    WARMUP,
    assert_bit_equal,
    assert_same_tensors,
    run_case,
    section,
)

# name, the paths ours saves on (indices into work_dirs; None: stock saves), the paths ours resumes on
# (None: stock resumes)
CHECKPOINT_CASES: list[tuple[str, list[int] | None, list[int] | None]] = [
    ("ours saves, ours resumes", [0, 1], [0, 1]),
    ("stock saves, ours resumes", None, [0, 1]),
    ("ours saves, stock resumes", [0, 1], None),
    # The job restarted on another set of tiers: the checkpoint, not the store, carries the state.
    ("ours saves on two paths, resumes on two others", [0, 1], [2, 3]),
]


@pytest.mark.parametrize(
    ("name", "saves_on", "resumes_on"), CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES]
)
def test_a_checkpoint_resumes_bit_for_bit_and_interoperates_with_deepspeed(
    name: str,
    saves_on: list[int] | None,
    resumes_on: list[int] | None,
    stock_resumed: dict[str, Any],
    work_dirs: list[Path],
    tmp_path: Path,
) -> None:
    """`engine.save_checkpoint` at step 5, a new engine from other initial weights, `load_checkpoint`,
    five more steps, `save_16bit_model`: the same state and the same 16-bit model as DeepSpeed's own
    save and resume, bit for bit; and DeepSpeed's `zero_to_fp32` reads our checkpoint as it reads its
    own. Two subgroups are cached when the checkpoint is taken, so it must include host copies newer
    than the store's."""
    dirs = [*work_dirs, work_dirs[0].parent / "path3"]
    dirs[3].mkdir(exist_ok=True)
    case: dict[str, Any] = {
        "checkpoint_at": 5,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "save_16bit": str(tmp_path / "model16"),
    }
    if saves_on is not None:
        case["mlp_offload"] = section([dirs[i] for i in saves_on], host_memory="64M", cache_chunks=2)
    if resumes_on is not None:
        case["resume_mlp_offload"] = section([dirs[i] for i in resumes_on], host_memory="64M", cache_chunks=2)
    resumed = run_case(case, tmp_path, "resumed")
    assert_bit_equal(resumed, stock_resumed)
    ours_resumes = resumes_on is not None
    expected = (
        "mlp_offload.adapter.zero3.MLPOffloadStage3" if ours_resumes else "deepspeed.runtime.zero.stage3."
    )
    assert resumed["optimizer_class"].startswith(expected)
    assert resumed["saved_16bit"] and stock_resumed["saved_16bit"]
    assert_same_tensors(
        torch.load(tmp_path / "model16" / "pytorch_model.bin"),
        torch.load(stock_resumed["dir"] / "model16" / "pytorch_model.bin"),
    )
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    assert_same_tensors(
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), tag="ckpt"),
        get_fp32_state_dict_from_zero_checkpoint(str(stock_resumed["dir"] / "ckpt"), tag="ckpt"),
    )


# name, the case's DeepSpeed side, `load_checkpoint` options
PARTIAL_LOADS = [
    ("load_module_only", {}, {"load_module_only": True}),
    ("load_optimizer_states=False", {}, {"load_optimizer_states": False}),
    ("load_lr_scheduler_states=False", {"scheduler": WARMUP}, {"load_lr_scheduler_states": False}),
    # A checkpoint of the model's weights only: DeepSpeed widens them into fp32, moments zero.
    ("no ZeRO optimizer files, load_module_only", {"drop_zero_files": True}, {"load_module_only": True}),
]


@pytest.mark.parametrize(
    ("ds_case", "options"), [p[1:] for p in PARTIAL_LOADS], ids=[p[0] for p in PARTIAL_LOADS]
)
def test_partial_checkpoint_loads_match_deepspeed(
    ds_case: dict[str, Any], options: dict[str, Any], work_dirs: list[Path], tmp_path: Path
) -> None:
    """A checkpoint loaded in part (the rest from the new engine's own start), saved and loaded by ours,
    gives what DeepSpeed gives doing the same, bit for bit."""
    ours = section(work_dirs[:2], host_memory="64M", cache_chunks=2)

    def case(name: str) -> dict[str, Any]:
        return {
            **ds_case,
            "checkpoint_at": 5,
            "checkpoint_dir": str(tmp_path / name),
            "load_options": options,
        }

    stock = run_case(case("stock"), tmp_path, "stock")
    resumed = run_case({**case("ours"), "mlp_offload": ours, "resume_mlp_offload": ours}, tmp_path, "ours")
    assert_bit_equal(resumed, stock)


@ONE_NODE
def test_two_ranks_loading_a_checkpoint_one_after_another_match_deepspeed(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """`pipeline_loading_checkpoint`: rank 1 loads only once rank 0 has loaded and told it (DeepSpeed's
    `load_serial`, run by DeepSpeed's own code around ours). Two ranks save at step 5, resume, and end
    where DeepSpeed's two ranks doing the same end, bit for bit."""
    ours = section(work_dirs[:2], host_memory="64M", cache_chunks=2)

    def case(name: str) -> dict[str, Any]:
        return {"checkpoint_at": 5, "checkpoint_dir": str(tmp_path / name), "pipeline_loading": True}

    stock = run_case(case("stock"), tmp_path, "stock", ranks=2)
    resumed = run_case(
        {**case("ours"), "mlp_offload": ours, "resume_mlp_offload": ours}, tmp_path, "ours", ranks=2
    )
    for rank, (a, b) in enumerate(zip(resumed["ranks"], stock["ranks"], strict=True)):
        assert a["optimizer_class"] == "mlp_offload.adapter.zero3.MLPOffloadStage3", rank
        assert_bit_equal(a, b)


def test_a_checkpoint_without_zero_files_fails_as_in_stock_naming_the_file(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """Loaded in full, a checkpoint whose ZeRO optimizer files are gone fails in DeepSpeed 0.19.8 itself
    with FileNotFoundError naming the missing file; ours fails the same way, before touching the store."""
    ours = section(work_dirs[:2], host_memory="64M")
    for name, extra in (("stock", {}), ("ours", {"mlp_offload": ours, "resume_mlp_offload": ours})):
        case = {"checkpoint_at": 5, "checkpoint_dir": str(tmp_path / name), "drop_zero_files": True, **extra}
        with pytest.raises(AssertionError, match=r"No such file or directory: .*optim_states\.pt"):
            run_case(case, tmp_path, name)
