"""Trains a tiny LLaMA-style model through a framework that drives DeepSpeed ZeRO-3 itself, on the CPU,
after `mlp_offload.install()`, and saves the final fp32 weights, Adam moments and bf16 partitions (what
`deepspeed_runs.assert_bit_equal` compares). Frameworks: the Hugging Face `Trainer`, Accelerate's
`Accelerator` with a `DeepSpeedPlugin` in a loop of the user's own, and PyTorch Lightning's
`DeepSpeedStrategy` (on CUDA where `DS_ACCELERATOR` is `cuda`).

`python tests/support/frameworks_harness.py SPEC.json OUT.pt`, or forked from `harness_server.py`
(`deepspeed_runs.HarnessRun(harness="frameworks_harness")`). SPEC holds `framework` (`trainer`,
`accelerate` or `lightning`), `paths` (storage paths for an `"mlp_offload"` section, or null for stock
DeepSpeed) and `variant`, the same for both runs of a comparison: `clip`, the framework's gradient
clipping instead of 1.0; `zero`, keys added to `zero_optimization`; `section`, keys added to our
section (the README's, `paths` alone, otherwise). One process per run (DeepSpeed keeps process-wide
state). The framework calls `deepspeed.initialize` itself: nothing here names our engine.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path
from typing import Any

# First, as in a ZeRO-3 harness run: its environment, set as it is imported (DS_ACCELERATOR before DeepSpeed
# is imported); `harness_server.py` calls `default_environment` again in each child it forks.
from zero3_harness import default_environment, partition  # noqa: F401

# isort: split
import torch

import mlp_offload
from deepspeed_runs import STACKS_SIGNAL
from mlp_offload.app.models import llama

VOCAB, SEQ = 256, 32


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.tokens = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def save(engine: Any, losses: list[float], out: str) -> None:
    """What the comparison needs from a DeepSpeed engine at the end of training."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer = engine.optimizer
    state = {
        name: {
            "fp32": safe_get_full_fp32_param(p).clone(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
            "half": partition(p),
        }
        for name, p in engine.module.named_parameters()
    }
    torch.save(
        {
            "state": state,
            "losses": losses,
            "skipped": engine.skipped_steps,
            "optimizer_class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
            "telemetry": getattr(optimizer, "mlp_offload_telemetry", None),
        },
        out,
    )


def with_variant(config: dict[str, Any], paths: list[str] | None, variant: dict[str, Any]) -> None:
    """Our section where `paths` are given, and the variant's keys (the spec's `variant`) in `config`:
    `zero` into its ZeRO section, `config` at its top (as `checkpoint.load_universal`)."""
    config["zero_optimization"].update(variant.get("zero", {}))
    config.update(variant.get("config", {}))
    if paths is not None:
        # The README's section (the paths alone) with the variant's keys.
        config["mlp_offload"] = {"paths": paths, **variant.get("section", {})}


def accelerate(paths: list[str] | None, out: str, variant: dict[str, Any]) -> None:
    """Accelerate's DeepSpeed integration with the optimizer and scheduler from the DeepSpeed config
    (`DummyOptim`, `DummyScheduler`), as its docs show it."""
    mlp_offload.install()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": variant.get("clip", 1.0),
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 1e-3}},
        "zero_optimization": {"stage": 3, "sub_group_size": 100_000, "offload_optimizer": {"device": "cpu"}},
    }
    with_variant(config, paths, variant)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    torch.manual_seed(1)
    model = llama("tiny", vocab=VOCAB, max_seq=SEQ)
    optimizer = DummyOptim(model.parameters())
    scheduler = DummyScheduler(optimizer)
    loader = torch.utils.data.DataLoader(RandomTokens(), batch_size=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = []
    for step, batch in enumerate(loader):
        if step == 6:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    save(model, losses, out)


def trainer(paths: list[str] | None, out: str, variant: dict[str, Any]) -> None:
    mlp_offload.install()
    from transformers import Trainer, TrainingArguments

    # "auto" values are the Trainer's to fill in, as users write them.
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"},
        },
        "zero_optimization": {"stage": 3, "sub_group_size": 100_000, "offload_optimizer": {"device": "cpu"}},
    }
    with_variant(config, paths, variant)
    # A job that saves a checkpoint every `save_steps` into `output_dir`, and one that resumes from one
    # of them (`resume_from`, a folder there) in a new process, as a restarted job does.
    save_steps = variant.get("save_steps")
    output_dir = os.path.join(os.path.dirname(out), variant.get("output_dir", "trainer-output"))
    args = TrainingArguments(
        output_dir=output_dir,
        deepspeed=config,
        use_cpu=True,  # the Trainer's own check refuses bf16 without a GPU otherwise
        bf16=True,
        max_steps=variant.get("steps", 6),
        warmup_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        weight_decay=0.01,
        max_grad_norm=variant.get("clip", 1.0),
        seed=1,
        report_to=[],
        save_strategy="no" if save_steps is None else "steps",
        save_steps=save_steps or 500,
        logging_steps=1,
        disable_tqdm=True,
    )
    torch.manual_seed(1)
    hf_trainer = Trainer(
        model=llama("tiny", vocab=VOCAB, max_seq=SEQ), args=args, train_dataset=RandomTokens()
    )
    resume_from = variant.get("resume_from")
    hf_trainer.train(
        resume_from_checkpoint=None if resume_from is None else os.path.join(output_dir, resume_from)
    )
    losses = [h["loss"] for h in hf_trainer.state.log_history if "loss" in h]
    save(hf_trainer.model_wrapped, losses, out)


def lightning(paths: list[str] | None, out: str, variant: dict[str, Any]) -> None:
    """PyTorch Lightning's `DeepSpeedStrategy(config=...)`, the optimizer from the DeepSpeed config,
    gradient accumulation 2 and clipping, as Lightning's docs show it. Lightning runs DeepSpeed only on
    CUDA; on DeepSpeed's CPU accelerator (`DS_ACCELERATOR=cpu`, the default here) the strategy's two
    CUDA checks are lifted (the accelerator's type, the devices' indices), the CPU device is given the
    index 0 that DeepSpeed takes as its rank, and everything else is
    Lightning's own code."""
    mlp_offload.install()
    import lightning as L
    from lightning.pytorch.strategies import DeepSpeedStrategy

    on_cuda = os.environ["DS_ACCELERATOR"] == "cuda"
    if not on_cuda:
        # The other CUDA-only check: CPU devices have no index to match the local ranks with.
        import lightning.pytorch.strategies.deepspeed as strategy_module

        strategy_module._validate_device_index_selection = lambda parallel_devices: None

    class Strategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            if on_cuda:
                super().setup_environment()
            else:
                super(DeepSpeedStrategy, self).setup_environment()

        @property
        def root_device(self) -> torch.device:
            # Lightning hands DeepSpeed the device's index as its rank; a CPU device has none.
            device: torch.device = super().root_device
            return device if on_cuda else torch.device("cpu", 0)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.model = llama("tiny", vocab=VOCAB, max_seq=SEQ)
            self.losses: list[float] = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(**batch).loss
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> None:
            return None  # DeepSpeed's, from the config

    # Batch size and accumulation are the Trainer's to set (Lightning refuses them in the config).
    config: dict[str, Any] = {
        "gradient_clipping": variant.get("clip", 1.0),
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "sub_group_size": 100_000, "offload_optimizer": {"device": "cpu"}},
    }
    with_variant(config, paths, variant)
    module = Module()
    trainer = L.Trainer(
        accelerator="cuda" if on_cuda else "cpu",
        devices=1,
        # DeepSpeed's safe_get_full_fp32_param gathers the offloaded fp32 partition, a host tensor: on
        # CUDA the group needs gloo beside NCCL (NCCL alone: "No backend type associated with device
        # type cpu", stock as ours).
        strategy=Strategy(config=config, process_group_backend="cpu:gloo,cuda:nccl" if on_cuda else None),
        precision="bf16-mixed",
        max_steps=3,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.dirname(out),
    )
    trainer.fit(module, torch.utils.data.DataLoader(RandomTokens(), batch_size=2))
    save(trainer.strategy.model, module.losses, out)


FRAMEWORKS = {"trainer": trainer, "accelerate": accelerate, "lightning": lightning}


def preload() -> None:
    """What the frameworks import before they train, imported by `harness_server.py` once, before it
    forks the first run of this harness."""
    from accelerate import Accelerator  # noqa: F401
    from transformers import Trainer  # noqa: F401

    try:
        from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: F401
    except ImportError:
        pass  # the Lightning test skips, saying so


def main(spec: str, out: str) -> None:
    """Runs the framework that file `spec` names and saves its result to `out`."""
    # What a run that did not end in time was doing, written to its log before it is killed.
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    run = json.loads(Path(spec).read_text())
    FRAMEWORKS[run["framework"]](run["paths"], out, run.get("variant", {}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
