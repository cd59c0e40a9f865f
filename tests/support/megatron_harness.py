"""One rank of Megatron-DeepSpeed's `pretrain_gpt.py`, as `tests/test_megatron.py` starts it under
`torch.distributed.run`: the tree's own script, run unchanged, with `mlp_offload.install()` first where
`MEGATRON_OURS` is 1 (the one line a user of ours adds). What it records, for the test to compare with
stock: every iteration's loss, gradient norm (the engine's) and skip (from Megatron's `train_step`), and
after training every parameter gathered (the bf16 weights, DeepSpeed's fp32 master weights and both Adam
moments, by DeepSpeed's own helpers), written to `MEGATRON_OUT/rank{RANK}.pt`.

Environment: `MEGATRON_TREE` (the extracted tree), `MEGATRON_OUT`, `MEGATRON_OURS`; the arguments are
`pretrain_gpt.py`'s."""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any


def gathered_state(engine: Any) -> dict[str, dict[str, Any]]:
    """Per parameter name: the bf16 (or fp32) weights gathered whole, and DeepSpeed's fp32 master
    weights and moments (`deepspeed.utils.safe_get_full_*`, collective on every rank)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    state: dict[str, dict[str, Any]] = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            half = param.data.detach().clone().cpu()
        state[name] = {
            "half": half,
            "fp32": safe_get_full_fp32_param(param).cpu(),
            "exp_avg": safe_get_full_optimizer_state(param, "exp_avg").cpu(),
            "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq").cpu(),
        }
    return state


def main(*args: str) -> None:
    """`pretrain_gpt.py` with `args` (this process's own where none are given), recorded."""
    tree = Path(os.environ["MEGATRON_TREE"])
    out = Path(os.environ["MEGATRON_OUT"])
    sys.path.insert(0, str(tree))
    if os.environ.get("MEGATRON_OURS") == "1":
        import mlp_offload

        mlp_offload.install()
    import megatron.training as training
    import torch

    record: dict[str, Any] = {"losses": [], "grad_norms": [], "skipped": []}
    train_step = training.train_step
    train = training.train

    def recorded_train_step(*args: Any, **kwargs: Any) -> Any:
        loss_dict, skipped, grad_norm, zeros = train_step(*args, **kwargs)
        record["losses"].append(float(loss_dict["lm loss"]))
        # With DeepSpeed, Megatron's own is None: the engine's (`train_step`'s third argument, `model`).
        norm = args[2][0].get_global_grad_norm() if grad_norm is None else grad_norm
        record["grad_norms"].append(None if norm is None else float(norm))
        record["skipped"].append(int(skipped))
        # Start-up's end (`benches/megatron_startup.py`): the first iteration done.
        record.setdefault("first_iteration_at", time.time())
        return loss_dict, skipped, grad_norm, zeros

    def train_then_gather(forward_step_func: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        iteration = train(forward_step_func, model, *args, **kwargs)
        record["state"] = gathered_state(model[0])
        torch.save(record, out / f"rank{os.environ['RANK']}.pt")
        return iteration

    # `pretrain()` looks both up in its module at call time.
    training.train_step = recorded_train_step
    training.train = train_then_gather
    script = tree / "pretrain_gpt.py"
    sys.argv = [str(script), *(args or sys.argv[1:])]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
