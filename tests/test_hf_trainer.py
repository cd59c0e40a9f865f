"""The Hugging Face Trainer, which calls `deepspeed.initialize` itself, gets our engine after
`mlp_offload.install()` when its DeepSpeed config has our section, and ends bit for bit where the same
Trainer run with stock DeepSpeed ZeRO-3 CPU offload ends (bf16, gradient accumulation 2, clipping, a
warm-up scheduler, "auto" values filled in by the Trainer)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepspeed_runs import assert_bit_equal, harness_env

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

HARNESS = Path(__file__).with_name("hf_trainer_harness.py")


def train(paths: list[Path] | None, tmp_path: Path, name: str, port: int) -> dict[str, Any]:
    out = tmp_path / f"{name}.pt"
    env = harness_env(MASTER_PORT=str(port))
    arg = json.dumps(None if paths is None else [str(p) for p in paths])
    proc = subprocess.run(
        [sys.executable, str(HARNESS), arg, str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"{name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result: dict[str, Any] = torch.load(out, weights_only=False)
    return result


def test_the_trainer_uses_our_engine_and_matches_stock_deepspeed(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    stock = train(None, tmp_path, "stock", 29591)
    ours = train(work_dirs[:2], tmp_path, "ours", 29592)
    assert stock["optimizer_class"].startswith("deepspeed.runtime.zero.stage3.")
    assert ours["optimizer_class"] == "mlp_offload.zero3.MLPOffloadStage3"
    assert len(ours["losses"]) == 6
    assert_bit_equal(ours, stock)
    assert all(any(p.rglob("*.mlpo")) for p in work_dirs[:2]), "the state is in the paths"
