"""`make gpu-report` (benches/gpu_report.py) where there is no GPU: every part says it skipped and why,
in its record and in the report, and the command succeeds; a part it does not know is refused by name.
On a GPU the parts run (the report itself is run there, not this test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPORT = Path(__file__).resolve().parent.parent / "benches" / "gpu_report.py"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run the report itself")


def report(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPORT), *map(str, args)], capture_output=True, text=True, timeout=120
    )


def test_without_cuda_every_part_says_it_skipped_and_why(tmp_path: Path) -> None:
    listed = report("--list").stdout.split("\n")
    parts = [line.split()[0] for line in listed if line.strip()]
    assert {
        "accelerator-kernel",
        "bitexact",
        "bitexact-backward",
        "ds-suite",
        "lightning",
        "e2e-130M",
        "e2e-1B",
        "e2e-largest",
    } <= set(parts)
    proc = report("--out", tmp_path / "out", "--data", tmp_path / "data")
    assert proc.returncode == 0, proc.stderr
    for part in parts:
        record = json.loads((tmp_path / "out" / f"{part}.json").read_text())
        assert record["skipped"] is True
        assert record["outcome"].startswith("skipped: no CUDA device: torch.cuda.is_available() is False")
    table = (tmp_path / "out" / "report.md").read_text()
    assert all(f"| {part} | skipped: no CUDA device" in table for part in parts)


def test_an_unknown_part_is_refused_by_name(tmp_path: Path) -> None:
    proc = report("--out", tmp_path, "bitexact", "e2e-2B")
    assert proc.returncode == 2
    assert "e2e-2B: not among accelerator-kernel, ratio, accelerator-chunks, e2e-1B-split" in proc.stderr
