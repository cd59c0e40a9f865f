"""A job resumed at another data-parallel degree through DeepSpeed's universal checkpoint: saved at step 3,
converted by DeepSpeed's own `ds_to_universal.py`, loaded with `checkpoint.load_universal` in a new
process at another number of ranks, and trained to step 7, bit-equal to stock DeepSpeed (the optimizer in
DRAM) doing the same from its own checkpoint. Stock's NVMe offload loads no universal checkpoint (its
engine copies the saved NVMe files instead: docs/reliability.md), so stock with `device: cpu` is the
reference. And what is refused: a ZeRO checkpoint of another degree without the conversion, and a
universal checkpoint of another model, with the state left as it was."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ONE_NODE
from deepspeed_runs import (
    AIO_BUILT,
    SAVE_AT,
    STATE_MODES,
    assert_bit_equal,
    assert_same_tensors,
    run_case,
    save_and_convert,
    stock_universal_resume,
    universal,
)
from zero3_harness import build_model

# name, who saves, ranks saving, who resumes, ranks resuming, DeepSpeed's side of the case. "stock NVMe":
# stock's NVMe offload (its checkpoint converts; it loads none, so the reference is stock in DRAM). Each of
# DeepSpeed's precision modes of the state (`STATE_MODES`) in a row, on the tests' GPT (in those modes
# stock's parameter fetch trace fails on 2 ranks of the `nn.MultiheadAttention` model).
ROWS = [
    # With the tools users run on what the job leaves (`final_save`: zero_to_fp32, save_16bit_model).
    (
        "ours on 2 ranks, ours on 1, the README's section",
        "ours", 2, "ours", 1,
        {"model": "attention", "final_save": True},
    ),
    (
        "ours on 1 rank, ours on 2, fp16 weights, accumulation 2 and clipping",
        "ours", 1, "ours", 2,
        {"model": "gpt", **STATE_MODES["fp16 weights"][0], "grad_accum": 2, "clip": 0.05,
         "final_save": True},
    ),
    (
        "stock on 2 ranks, ours on 1, bf16 weights and moments, a frozen block and a tied head",
        "stock", 2, "ours", 1,
        {"model": "gpt", **STATE_MODES["bf16 weights and moments"][0], "frozen": r"blocks\.0\.",
         "tied": True},
    ),
    ("stock's NVMe offload on 2 ranks, ours on 1", "stock NVMe", 2, "ours", 1, {"model": "attention"}),
    (
        "ours on 1 rank, stock on 2, bf16 weights",
        "ours", 1, "stock", 2,
        {"model": "gpt", **STATE_MODES["bf16 weights"][0]},
    ),
    (
        # Stock reaches its loader of the weights alone this way: with `load_optimizer_states` false
        # its engine reads the ZeRO files first (`zero_to_fp32`), which a universal checkpoint has not.
        "ours on 2 ranks, ours on 1, the weights alone (load_module_only)",
        "ours", 2, "ours", 1,
        {"model": "attention", "load_options": {"load_module_only": True}},
    ),
]  # fmt: skip


def needs(saves: str) -> list[pytest.MarkDecorator]:
    """Stock's NVMe offload runs on DeepSpeed's async I/O op (`AIO_BUILT`)."""
    why = "stock's NVMe offload needs DeepSpeed's async I/O op: `make deepspeed-aio` builds it"
    return [pytest.mark.skipif(saves == "stock NVMe" and not AIO_BUILT, reason=why)]


@pytest.mark.deepspeed
@pytest.mark.parametrize(
    ("saves", "saving", "resumes", "resuming", "ds_case"),
    [pytest.param(*row[1:], marks=[ONE_NODE, *needs(row[1])]) for row in ROWS],
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
    and partitions equal stock's resume from its own converted checkpoint, on every rank; where the row
    says, so do `zero_to_fp32` on a checkpoint saved after it and `save_16bit_model`'s file."""
    ds_case = {**ds_case, "steps": SAVE_AT + 5}
    nvme = tmp_path / "stock-nvme"
    nvme.mkdir()
    engines: dict[str, Callable[[int], dict[str, Any]]] = {
        "ours": lambda ranks: {"mlp_offload": {"paths": [str(p) for p in probed_paths(ranks)]}},
        "stock": lambda ranks: {},
        "stock NVMe": lambda ranks: {"nvme_path": str(nvme)},
    }
    universal_dir = save_and_convert({**ds_case, **engines[saves](saving)}, saving, tmp_path, "saves")
    resume = {
        **ds_case,
        **engines[resumes](resuming),
        "resume_at": SAVE_AT,
        "checkpoint_dir": str(universal_dir),
    }
    resumed = run_case(universal(resume), tmp_path, "resumed", ranks=resuming)
    stock = stock_universal_resume(ds_case, saving, resuming, tmp_path)
    engine = "mlp_offload.adapter.zero3." if resumes == "ours" else "deepspeed.runtime.zero.stage3."
    for ours, theirs in zip(resumed.get("ranks", [resumed]), stock, strict=True):
        assert ours["optimizer_class"].startswith(engine), ours["optimizer_class"]
        assert_bit_equal(ours, theirs)
    if ds_case.get("final_save"):
        ours, theirs = resumed, stock[0]
        assert_same_tensors(ours["final_fp32"], theirs["final_fp32"])
        assert_same_tensors(ours["final_16bit"], theirs["final_16bit"])


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
    universal_dir = save_and_convert(case, 2, tmp_path, "saves")
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
    folder = last_parameter(universal_dir, case["model"])
    # ZeRO-3's converter saves each state flat, a tensor alone.
    moment = torch.load(folder / "exp_avg_sq.pt", weights_only=False)
    torch.save(moment[:-1].clone(), folder / "exp_avg_sq.pt")
    shapes = run_case(universal({**resume, "checkpoint_dir": str(universal_dir)}), tmp_path, "shapes")
    assert shapes["state_kept"], shapes
    assert f"parameter {folder.name}'s exp_avg_sq has" in str(shapes["refused"]), shapes["refused"]


# Of `test_the_load_adds_at_most_host_memory_plus_a_tenth`: the budget, and its bytes.
LOAD_BUDGET, LOAD_BUDGET_BYTES = "16M", 16 << 20


@pytest.mark.deepspeed
@ONE_NODE
def test_the_load_adds_at_most_host_memory_plus_a_tenth(
    probed_paths: Callable[[int], list[Path]], tmp_path: Path
) -> None:
    """A model whose fp32 state (204 MB) is 12 times `host_memory` (16 MiB): ours saves on 2 ranks, and
    the load of the converted checkpoint on 1, in a new process, adds at most `host_memory` plus a tenth
    to the resident memory at its peak (the kernel's high-water mark, reset before the load)."""
    # Saved after the first step: what the load reads is the same size at any step.
    case: dict[str, Any] = {"model": "gpt-20M", "fp32": True, "steps": 1}
    ours = {"paths": [str(p) for p in probed_paths(2)], "host_memory": LOAD_BUDGET}
    universal_dir = save_and_convert({**case, "mlp_offload": ours}, 2, tmp_path, "saves", save_at=1)
    resume = universal({**case, "resume_at": 1, "checkpoint_dir": str(universal_dir)})
    resume["mlp_offload"] = {**ours, "paths": [str(p) for p in probed_paths(1)]}
    resumed = run_case(resume, tmp_path, "resumed")
    assert resumed["load_added_bytes"] <= LOAD_BUDGET_BYTES * 1.1, resumed["load_added_bytes"]
