"""What the tests that run real DeepSpeed in subprocesses share: the environment those processes get, and
the bit-for-bit comparison of two runs' results."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import torch


def harness_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a DeepSpeed run, with `overrides` on top: on the CPU, or on the
    accelerator that `MLP_OFFLOAD_TEST_ACCELERATOR` names (`cuda` in the GPU report)."""
    return {
        # DeepSpeed's just-in-time ops (cpu_adam, shm comm) build once into target/, not per run.
        "TORCH_EXTENSIONS_DIR": str(Path(__file__).resolve().parent.parent / "target" / "torch_extensions"),
        **os.environ,
        "DS_ACCELERATOR": os.environ.get("MLP_OFFLOAD_TEST_ACCELERATOR", "cpu"),
        "OMP_NUM_THREADS": "2",
        **overrides,
    }


def free_port() -> int:
    """A TCP port that nobody listens on now, for one run's rendezvous: tests that run at once (pytest -n)
    must not share one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def assert_bit_equal(ours: dict[str, Any], stock: dict[str, Any]) -> None:
    """Same skipped steps and losses; per parameter, the same fp32 weights, Adam moments and (where the
    run has them) half-precision partitions, bit for bit."""
    assert ours["skipped"] == stock["skipped"]
    assert ours["losses"] == stock["losses"]
    for name, tensors in stock["state"].items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            a, b = ours["state"][name][key], tensors[key]
            assert a.dtype == b.dtype == torch.float32, (name, key)
            assert torch.equal(a, b), f"{name}.{key} differs: max |diff| {(a - b).abs().max().item()}"
        if tensors["half"] is not None:
            assert torch.equal(ours["state"][name]["half"], tensors["half"]), f"{name} half-precision params"
