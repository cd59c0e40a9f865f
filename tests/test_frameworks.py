"""Frameworks that call `deepspeed.initialize` themselves get our engine after `mlp_offload.install()`
when their DeepSpeed config has our section, and end bit for bit where the same run with stock DeepSpeed
ZeRO-3 CPU offload ends: the Hugging Face Trainer (bf16, gradient accumulation 2, clipping, a warm-up
scheduler, "auto" values filled in by the Trainer) and Accelerate's `Accelerator` with a `DeepSpeedPlugin`
(bf16, clipping, optimizer and scheduler from the DeepSpeed config), and PyTorch Lightning's
`DeepSpeedStrategy(config=...)` (bf16-mixed, accumulation 2, clipping, the optimizer from the config; on
DeepSpeed's CPU accelerator with the strategy's CUDA-only checks lifted, on CUDA as it is in the GPU
report, `make gpu-report`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from deepspeed_runs import (
    assert_bit_equal,
    convert_to_universal,
    free_port,
    rank_runs,
    run_harness,
)

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


def train(
    framework: str,
    paths: list[Path] | None,
    tmp_path: Path,
    name: str,
    variant: dict[str, Any] | None = None,
    ranks: int = 1,
) -> dict[str, Any]:
    """One run of `frameworks_harness.py`, a process of its own per rank (forked from the harness server,
    which has imported the frameworks once, on the CPU); rank 0's result."""
    spec = tmp_path / f"{name}.json"
    spec.write_text(
        json.dumps(
            {
                "framework": framework,
                "paths": None if paths is None else [str(p) for p in paths],
                "variant": variant or {},
            }
        )
    )
    runs = rank_runs(
        spec, tmp_path, name, ranks, harness="frameworks_harness", cwd=tmp_path, MASTER_PORT=str(free_port())
    )
    exits = run_harness(runs, timeout=600)
    for run, code in zip(runs, exits, strict=True):
        assert code == 0, f"{name}: exit {code}\n{run.log.read_text()[-8000:]}"
    result: dict[str, Any] = torch.load(runs[0].out, weights_only=False)
    return result


@pytest.mark.parametrize("framework", ["trainer", "accelerate", "lightning"])
def test_the_framework_uses_our_engine_and_matches_stock_deepspeed(
    framework: str, probed_paths: Callable[[int], list[Path]], tmp_path: Path
) -> None:
    if framework == "lightning":
        pytest.importorskip("lightning")
    stock = train(framework, None, tmp_path, "stock")
    paths = probed_paths(1)
    started = time.time()
    ours = train(framework, paths, tmp_path, "ours")
    assert stock["optimizer_class"].startswith("deepspeed.runtime.zero.stage3.")
    assert ours["optimizer_class"] == "mlp_offload.adapter.zero3.MLPOffloadStage3"
    assert len(ours["losses"]) == 6
    assert_bit_equal(ours, stock)
    # The paths are this worker's for the README's section: an earlier test's files may be there too.
    written = [[f for f in p.rglob("*.mlpo") if f.stat().st_mtime >= started] for p in paths]
    assert all(written), "the state is in the paths"


def test_the_trainer_with_the_readmes_section_trains_the_parameters_on_nvme_as_stock(
    probed_paths: Callable[[int], list[Path]], tmp_path: Path
) -> None:
    """ZeRO-Infinity's config as the Trainer's users write it, the parameters on NVMe past
    `offload_param.max_in_cpu` (every subgroup there), with the README's section: bit-equal to stock
    (its parameters on the CPU: its own NVMe offload needs DeepSpeed's async I/O op)."""
    nvme = {"device": "nvme", "nvme_path": str(tmp_path / "nvme"), "max_in_cpu": 10_000}
    stock = train("trainer", None, tmp_path, "stock", {"zero": {"offload_param": {"device": "cpu"}}})
    ours = train("trainer", probed_paths(1), tmp_path, "ours", {"zero": {"offload_param": nvme}})
    assert ours["optimizer_class"] == "mlp_offload.adapter.zero3.MLPOffloadStage3"
    assert_bit_equal(ours, stock)
    start = next(r for r in ours["telemetry"] if r["event"] == "start")
    assert start["subgroups_on_nvme"] == start["subgroups"], start


def test_the_trainer_resumes_its_checkpoint_in_a_new_process_as_stock_does(
    probed_paths: Callable[[int], list[Path]], tmp_path: Path
) -> None:
    """With the README's section, the Trainer saves its checkpoints every 3 of 8 steps (DeepSpeed's
    inside); a new process resumes from the first (`resume_from_checkpoint`) and trains steps 4 to 8:
    bit for bit what stock's resume from its own first checkpoint gives."""
    resumed = {}
    for name, paths in (("stock", None), ("ours", probed_paths(1))):
        job = {"steps": 8, "save_steps": 3, "output_dir": f"{name}-output"}
        train("trainer", paths, tmp_path, f"{name}-saves", job)
        resumed[name] = train(
            "trainer", paths, tmp_path, f"{name}-resumed", {**job, "resume_from": "checkpoint-3"}
        )
    assert resumed["ours"]["optimizer_class"] == "mlp_offload.adapter.zero3.MLPOffloadStage3"
    assert len(resumed["ours"]["losses"]) == 8
    assert_bit_equal(resumed["ours"], resumed["stock"])


def test_the_trainer_resumes_on_another_number_of_ranks_as_stock_does(
    probed_paths: Callable[..., list[Path]], tmp_path: Path
) -> None:
    """The Trainer on 2 ranks saves its checkpoints every 3 of 6 steps. The user converts the first with
    DeepSpeed's converter (`ds_to_universal`, into `global_step3_universal` beside it), sets
    `checkpoint.load_universal` in the config and resumes on 1 rank from the same folder
    (`resume_from_checkpoint`): bit for bit what stock's resume the same way from its own gives."""
    resumed = {}
    # One section for both jobs, as a user's: the paths' profiles of a job of 2 ranks and of 1.
    for name, paths in (("stock", None), ("ours", probed_paths(2, 1))):
        job: dict[str, Any] = {"steps": 6, "save_steps": 3, "output_dir": f"{name}-output"}
        train("trainer", paths, tmp_path, f"{name}-saves", job, ranks=2)
        saved = tmp_path / f"{name}-output" / "checkpoint-3"
        assert (saved / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").exists()
        convert_to_universal(saved / "global_step3", saved / "global_step3_universal")
        universal = {"resume_from": "checkpoint-3", "config": {"checkpoint": {"load_universal": True}}}
        resumed[name] = train("trainer", paths, tmp_path, f"{name}-resumed", {**job, **universal})
    assert resumed["ours"]["optimizer_class"] == "mlp_offload.adapter.zero3.MLPOffloadStage3"
    assert len(resumed["ours"]["losses"]) == 6
    assert_bit_equal(resumed["ours"], resumed["stock"])


# The streamed chunks updated during backward: a budget that streams most chunks, gradients reduced in
# buckets so that chunks are final before backward ends, clipping off in both runs (a clipped step would
# undo it).
DURING_BACKWARD = {
    "clip": 0.0,
    "zero": {"reduce_bucket_size": 20_000},
    "section": {
        "host_memory": "200K",
        "update_chunk": "24K",
        "shadow_slots": True,
        "overlap_backward": True,
    },
}


@pytest.mark.parametrize("framework", ["trainer", "accelerate"])
def test_the_update_during_backward_under_the_framework_matches_stock(
    framework: str, probed_paths: Callable[[int], list[Path]], tmp_path: Path
) -> None:
    """The framework's own loop (the Trainer's with accumulation 2 and its scheduler, Accelerate's with
    DeepSpeed's) with `overlap_backward`: bit for bit with stock DeepSpeed, and every step kept the
    streamed chunks it updated during backward."""
    stock = train(framework, None, tmp_path, "stock", DURING_BACKWARD)
    ours = train(framework, probed_paths(1), tmp_path, "ours", DURING_BACKWARD)
    assert_bit_equal(ours, stock)
    records = [r for r in ours["telemetry"] if r["event"] == "step"]
    assert len(records) == 6, [r["event"] for r in ours["telemetry"]]
    start = next(r for r in ours["telemetry"] if r["event"] == "start")
    streamed = start["chunks"] - start["cached_chunks"]
    assert streamed > 0, start
    for step, r in enumerate(records):
        spec = r["overlap_backward"]
        assert spec is not None and spec["kept"] and spec["chunks"] == streamed, (step, spec)
    # Chunks' updates ran before backward ended (not every step's need: on a loaded machine a step's
    # backward may end before the update thread runs).
    assert sum(r["overlap_backward"]["in_backward"] for r in records) > 0, records
