"""Imported once, by the forkserver that DeepSpeed's `DistributedTest` forks every rank process from
(`suite_plugin` names it there, with DeepSpeed's CPU accelerator): torch, DeepSpeed's ZeRO-3 and CPU
Adam modules, our package (in the `ours` mode, through `sitecustomize`), and DeepSpeed's JIT ops. Each
rank then starts with them loaded, as `tests/support/harness_server.py` does for our own runs, instead of
paying 3-4 s of imports and op loading per rank per case. A rank is still a process of its own, forked from
the forkserver's state, not from an earlier case's. Nothing is preloaded on a GPU: forking after CUDA's
libraries initialised is not safe.

A failure here costs only the time: it is printed, and the ranks import what they need themselves."""

from __future__ import annotations

import gc
import sys
import traceback


def preload() -> None:
    # torch._dynamo and DeepSpeed's Muon (through its torch.compile decorators, torch._inductor) are
    # imported by DeepSpeed only once a rank builds an engine, as in `tests/support/harness_server.py`:
    # 2.5-4.5 s of every rank's start here.
    import deepspeed  # noqa: F401
    import torch._dynamo  # noqa: F401
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
    from deepspeed.runtime.zero import stage3  # noqa: F401
    from deepspeed.runtime.zero.muon import muon_optimizer  # noqa: F401

    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is not None:
            builder.load(verbose=False)


try:
    preload()
except Exception:  # the forkserver survives only ImportError of its own; the ranks load it themselves
    print("deepspeed-suite: preloading in the forkserver failed:", file=sys.stderr)
    traceback.print_exc()
# What was preloaded, out of the ranks' collections: ZeRO-3 runs `gc.collect()` as it builds its
# partitions, which otherwise walks every object of these modules in each rank.
gc.freeze()
