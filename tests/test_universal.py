"""A job resumed at another data-parallel degree through DeepSpeed's universal checkpoint: saved at step 3,
converted by DeepSpeed's own `ds_to_universal.py`, loaded with `checkpoint.load_universal` in a new
process at another number of ranks, and trained to step 7, bit-equal to stock DeepSpeed (the optimizer in
DRAM) doing the same from its own checkpoint. Stock's NVMe offload loads no universal checkpoint (its
engine copies the saved NVMe files instead: docs/reliability.md), so stock with `device: cpu` is the
reference. And what is refused: a ZeRO checkpoint of another degree without the conversion, and a
universal checkpoint of another model, with the state left as it was."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ONE_NODE
from deepspeed_runs import STATE_MODES, assert_bit_equal, harness_env, keep, run_case, stock_cache
from zero3_harness import build_model

SAVE_AT = 3
UNIVERSAL = {"checkpoint.load_universal": True}

# name, who saves, ranks saving, who resumes, ranks resuming, DeepSpeed's side of the case. "stock NVMe":
# stock's NVMe offload (its checkpoint converts; it loads none, so the reference is stock in DRAM).
ROWS = [
    ("ours on 2 ranks, ours on 1, the README's section", "ours", 2, "ours", 1, {"model": "attention"}),
    (
        "ours on 1 rank, ours on 2, fp16, accumulation 2 and clipping",
        "ours", 1, "ours", 2,
        {"model": "attention", "fp16": True, "grad_accum": 2, "clip": 0.05},
    ),
    (
        "stock on 2 ranks, ours on 1, a frozen block and a tied head",
        "stock", 2, "ours", 1,
        {"model": "gpt", "frozen": r"blocks\.0\.", "tied": True},
    ),
    ("stock's NVMe offload on 2 ranks, ours on 1", "stock NVMe", 2, "ours", 1, {"model": "attention"}),
    ("ours on 1 rank, stock on 2", "ours", 1, "stock", 2, {"model": "attention"}),
    *[
        (f"ours on 2 ranks, ours on 1, {mode}", "ours", 2, "ours", 1, {"model": "attention", **options})
        for mode, (options, _) in STATE_MODES.items()
    ],
    (
        # Stock reaches its loader of the weights alone this way: with `load_optimizer_states` false
        # its engine reads the ZeRO files first (`zero_to_fp32`), which a universal checkpoint has not.
        "ours on 2 ranks, ours on 1, the weights alone (load_module_only)",
        "ours", 2, "ours", 1,
        {"model": "attention", "load_options": {"load_module_only": True}},
    ),
]  # fmt: skip


def to_universal(checkpoint_dir: Path, universal_dir: Path) -> None:
    """DeepSpeed's converter on tag `ckpt`, as its docs run it: the universal checkpoint under the same
    tag in `universal_dir`."""
    command = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", str(checkpoint_dir / "ckpt"), "--output_folder", str(universal_dir / "ckpt"),
        "--num_extract_workers", "1", "--num_merge_workers", "1",
    ]  # fmt: skip
    done = subprocess.run(command, env=harness_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def save_and_convert(case: dict[str, Any], ranks: int, tmp_path: Path, name: str) -> Path:
    """`case` trained on `ranks` ranks and saved at step 3, converted: the universal checkpoint's dir."""
    ckpt, universal = tmp_path / f"{name}-ckpt", tmp_path / f"{name}-universal"
    run_case(
        {**case, "steps": SAVE_AT + 1, "save_at": SAVE_AT, "checkpoint_dir": str(ckpt)},
        tmp_path,
        name,
        ranks=ranks,
    )
    to_universal(ckpt, universal)
    return universal


def stock_universal_resume(ds_case: dict[str, Any], saving: int, resuming: int, tmp_path: Path) -> list[Any]:
    """Stock DeepSpeed's save on `saving` ranks, converted, and resumed on `resuming` (every rank's
    result), run once per DeepSpeed side and kept as a stock run is (`stock_cache`)."""
    kept = stock_cache({**ds_case, "stock_universal": [SAVE_AT, saving]}, resuming)
    assert kept is not None
    if kept.exists():
        results: list[Any] = torch.load(kept, weights_only=False)
        return results
    universal = save_and_convert(ds_case, saving, tmp_path, "stock-saves")
    resumes = {**ds_case, "resume_at": SAVE_AT, "checkpoint_dir": str(universal), "ds_options": UNIVERSAL}
    resumed = run_case(resumes, tmp_path, "stock", ranks=resuming)
    results = resumed.get("ranks", [resumed])
    keep(results, kept)
    return results


@pytest.mark.deepspeed
@pytest.mark.parametrize(
    ("saves", "saving", "resumes", "resuming", "ds_case"),
    [pytest.param(*row[1:], marks=[ONE_NODE]) for row in ROWS],
    ids=[row[0] for row in ROWS],
)
def test_a_universal_checkpoint_resumes_at_another_degree_as_stock_resumes(
    saves: str,
    saving: int,
    resumes: str,
    resuming: int,
    ds_case: dict[str, Any],
    probed_paths: Callable[[int], list[Path]],
    tmp_path: Path,
) -> None:
    """Saved by ours (the README's section) or stock on one number of ranks, converted, resumed on
    another, ours on other paths: every step's loss and gradient norm and the final fp32 weights, moments
    and partitions equal stock's resume from its own converted checkpoint, on every rank."""
    ds_case = {**ds_case, "steps": SAVE_AT + 5}
    nvme = tmp_path / "stock-nvme"
    nvme.mkdir()
    engines: dict[str, Callable[[int], dict[str, Any]]] = {
        "ours": lambda ranks: {"mlp_offload": {"paths": [str(p) for p in probed_paths(ranks)]}},
        "stock": lambda ranks: {},
        "stock NVMe": lambda ranks: {"nvme_path": str(nvme)},
    }
    universal = save_and_convert({**ds_case, **engines[saves](saving)}, saving, tmp_path, "saves")
    resume = {**ds_case, **engines[resumes](resuming), "resume_at": SAVE_AT, "checkpoint_dir": str(universal)}
    resumed = run_case({**resume, "ds_options": UNIVERSAL}, tmp_path, "resumed", ranks=resuming)
    stock = stock_universal_resume(ds_case, saving, resuming, tmp_path)
    engine = "mlp_offload.adapter.zero3." if resumes == "ours" else "deepspeed.runtime.zero.stage3."
    for ours, theirs in zip(resumed.get("ranks", [resumed]), stock, strict=True):
        assert ours["optimizer_class"].startswith(engine), ours["optimizer_class"]
        assert_bit_equal(ours, theirs)


def last_parameter(universal: Path, model: str) -> Path:
    """The folder of the model's last parameter, the one a loader in the model's order comes to last."""
    *_, (name, _) = build_model(model).named_parameters()
    return universal / "ckpt" / "zero" / name


@pytest.mark.deepspeed
@ONE_NODE
def test_what_does_not_fit_is_refused_by_name_and_the_state_stays(
    probed_paths: Callable[[int], list[Path]], tmp_path: Path
) -> None:
    """Ours saves on 2 ranks. Resumed on 1: the ZeRO checkpoint without `load_universal` is refused,
    naming the converter's command; the converted one with a parameter's moment of another size
    (the last the loader reads) is refused naming the parameter. Either way the engine's state is what
    it was before the load."""
    case: dict[str, Any] = {
        "model": "attention",
        "steps": SAVE_AT + 5,
        "mlp_offload": {"paths": [str(p) for p in probed_paths(2)]},
    }
    universal = save_and_convert(case, 2, tmp_path, "saves")
    resume = {
        **case,
        "mlp_offload": {"paths": [str(p) for p in probed_paths(1)]},
        "resume_at": SAVE_AT,
        "load_refused": True,
    }
    zero = run_case({**resume, "checkpoint_dir": str(tmp_path / "saves-ckpt")}, tmp_path, "zero")
    assert zero["state_kept"], zero
    assert "data-parallel degree of 2; this job has 1" in str(zero["refused"]), zero["refused"]
    assert "python -m deepspeed.checkpoint.ds_to_universal --input_folder" in str(zero["refused"]), zero
    folder = last_parameter(universal, case["model"])
    # ZeRO-3's converter saves each state flat, a tensor alone.
    moment = torch.load(folder / "exp_avg_sq.pt", weights_only=False)
    torch.save(moment[:-1].clone(), folder / "exp_avg_sq.pt")
    shapes = run_case(
        {**resume, "checkpoint_dir": str(universal), "ds_options": UNIVERSAL}, tmp_path, "shapes"
    )
    assert shapes["state_kept"], shapes
    assert f"parameter {folder.name}'s exp_avg_sq has" in str(shapes["refused"]), shapes["refused"]
