"""Trains a small GPT-style model with real DeepSpeed ZeRO-3 on the CPU, stock or with mlp-offload, and
returns the fp32 master weights and both Adam moments of every parameter, for bit-for-bit comparisons.

Run in its own process per case (`python tests/support/zero3_harness.py CASE.json OUT.pt`, or forked by
`harness_server.py` from a process that has imported everything already): DeepSpeed keeps process-wide
state (patched modules, the process group), so each engine gets a fresh process. With several ranks, one
process per rank (`RANK`, `WORLD_SIZE` in the environment), each writing its own OUT.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import gc
import hashlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def default_environment() -> None:
    """What a run's environment has unless the test says otherwise (also applied again in each child
    `harness_server.py` forks, whose environment is replaced by its run's)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed builds its CPU ops just in time with ninja, which it looks up on PATH: the one installed
    # next to this interpreter.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)


default_environment()

import torch  # noqa: E402

from deepspeed_runs import STACKS_SIGNAL  # noqa: E402
from mlp_offload.app.models import GPT, SIZES, llama  # noqa: E402

VOCAB, SEQ = SIZES["tiny"][0], 16
# DeepSpeed's AIO settings wherever a case puts something on NVMe (the optimizer or the parameters).
DEEPSPEED_AIO = {"block_size": 1 << 20, "queue_depth": 16}


def _dotted(config: dict[str, Any], key: str) -> tuple[dict[str, Any], str]:
    """The section of `config` that a dotted key's last part names a key of (made where missing)."""
    *sections, name = key.split(".")
    for part in sections:
        config = config.setdefault(part, {})
    return config, name


def ds_config(case: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": case.get("grad_accum", 1),
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": case.get("sub_group_size", 12000),
            "offload_optimizer": {"device": "cpu"},
            # DeepSpeed's default: the whole tiny model's gradients in one flush at backward's end.
            "reduce_bucket_size": case.get("reduce_bucket_size", 500_000_000),
        },
        "steps_per_print": 10**9,
    }
    if case.get("fp16"):
        config["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 2, "hysteresis": 1}
    elif not case.get("fp32"):
        config["bf16"] = {"enabled": True}
    if "save_16bit" in case or case.get("final_save"):
        # ZeRO-3 saves the 16-bit model only when asked to gather it.
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if "persistence_threshold" in case:
        # Parameters of fewer elements stay whole on every rank (DeepSpeed's default, 100,000, keeps
        # every parameter of the tiny model so); the others are gathered for each use and released.
        config["zero_optimization"]["stage3_param_persistence_threshold"] = case["persistence_threshold"]
    if "clip" in case:
        config["gradient_clipping"] = case["clip"]
    if "scheduler" in case:
        config["scheduler"] = case["scheduler"]
    if case.get("torch_adam"):
        # DeepSpeed runs torch's Adam/AdamW on the CPU instead of its own CPU Adam.
        config["optimizer"]["params"]["torch_adam"] = True
        config["zero_force_ds_cpu_optimizer"] = False
    if case.get("client_optimizer"):
        # A torch optimizer object passed to deepspeed.initialize.
        del config["optimizer"]
        config["zero_force_ds_cpu_optimizer"] = False
        # DeepSpeed asks for this before it takes an optimizer outside its tested list (SGD, Adagrad).
        config["zero_allow_untested_optimizer"] = True
    if "nvme_path" in case:
        # A DeepSpeed NVMe offload config, as its users have it (the one-line migration).
        config["zero_optimization"]["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": case["nvme_path"],
            "buffer_count": 5,
            "pipeline_read": True,
            "pipeline_write": True,
        }
        config["aio"] = dict(DEEPSPEED_AIO)
    if device := case.get("offload_param"):
        # The parameters' partitions offloaded too (ZeRO-Infinity), as Hugging Face's ZeRO-3 example
        # config has them.
        config["zero_optimization"]["offload_param"] = {"device": device, "pin_memory": True}
        if device == "nvme":
            config["zero_optimization"]["offload_param"]["nvme_path"] = case["param_nvme_path"]
            if "param_max_in_cpu" in case:
                config["zero_optimization"]["offload_param"]["max_in_cpu"] = case["param_max_in_cpu"]
            config["aio"] = dict(DEEPSPEED_AIO)
    if case.get("pipeline_loading"):
        # Ranks load a checkpoint one after another, each told by the one before (DeepSpeed's load_serial).
        config["zero_optimization"]["pipeline_loading_checkpoint"] = True
    for key, value in case.get("ds_options", {}).items():
        # One DeepSpeed option by its dotted key (the option table's rows), set last, over the above.
        where, name = _dotted(config, key)
        where[name] = value
    for key in case.get("ds_unset", []):
        # An option taken out (a row's deprecated key in place of its new one).
        where, name = _dotted(config, key)
        del where[name]
    if "mlp_offload" in case:
        config["mlp_offload"] = case["mlp_offload"]
    return config


def train(case: dict[str, Any]) -> dict[str, Any]:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as imported_before_install
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    import mlp_offload

    if case.get("fp16"):
        # This CPU lacks mkldnn fp16, so DeepSpeed's CPU accelerator declines fp16; the arithmetic works,
        # slowly, and both contenders run exactly the same DeepSpeed fp16 code.
        get_accelerator().is_fp16_supported = lambda: True
    if case.get("install_first"):
        # What a framework that calls deepspeed.initialize itself sees after mlp_offload.install().
        mlp_offload.install()

    def make_engine(ours: bool, section: dict[str, Any] | None, seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        # The variants below change the tests' GPT (its `tok`, `head` and `blocks`).
        with built_under_zero_init(case, section):
            model: Any = build_model(case.get("model", "gpt"))
        if frozen := case.get("frozen"):
            # Part of the model frozen, as a fine-tuning job has it: DeepSpeed leaves those parameters
            # out of the optimizer's groups.
            for param_name, p in model.named_parameters():
                p.requires_grad_(re.search(frozen, param_name) is None)
        if case.get("tied"):
            # The output head shares the token embedding's weight (GPT-2, Llama 3.2 1B and 3B, Gemma): one
            # parameter used first and last in forward, its gradient summed from both.
            model.head.weight = model.tok.weight
        if mode := case.get("checkpointing"):
            # Activation checkpointing (a Trainer's gradient_checkpointing): each block's forward is run
            # again in backward, its parameters gathered again there.
            model.blocks = torch.nn.ModuleList(Checkpointed(b, mode == "reentrant") for b in model.blocks)
        if case.get("layer_drop") or case.get("layer_drop_last_micro"):
            # The last block left out of some steps (LayerDrop), or of their last micro-step only: its
            # parameters get no gradient there.
            model.blocks[-1] = Droppable(model.blocks[-1])
        if case.get("param_groups"):
            decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
            no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
            params: Any = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        else:
            params = model.parameters()
        config = ds_config({k: v for k, v in case.items() if k != "mlp_offload"})
        if section is not None:
            config["mlp_offload"] = section
        init = mlp_offload.initialize if ours else deepspeed.initialize
        client: Any = None
        if name := case.get("client_optimizer"):
            params = list(params)
            options = {"lr": 3e-3, "weight_decay": 0.01, **case.get("client_options", {})}
            if name == "DeepSpeedCPUAdam":
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                client = DeepSpeedCPUAdam(params, **options)
            else:
                client = getattr(torch.optim, name)(params, **options)
        if file := case.get("config_file"):
            # The config as a file named on the command line (`--deepspeed_config`).
            import argparse

            Path(file).write_text(json.dumps(config))
            cli = argparse.Namespace(deepspeed_config=file, local_rank=int(os.environ["LOCAL_RANK"]))
            engine, optimizer, _, _ = init(args=cli, model=model, model_parameters=params, optimizer=client)
        else:
            engine, optimizer, _, _ = init(
                model=model, model_parameters=params, optimizer=client, config=config
            )
        return engine, optimizer

    section = case.get("mlp_offload")
    engine, optimizer = make_engine(section is not None and not case.get("plain_initialize"), section, 1234)
    # The host's random state after the engine is built (stock's `ratio` draws from it there; dropout and
    # anything else that draws later sees what it left).
    rng_after_init = hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest()
    if case.get("params_through_scratch"):
        # The path of a partition on an accelerator, on the CPU: the pass writes the new parameters into
        # the host scratch, copied to the partition after it (what a GPU's events and stream add is
        # checked on a GPU, `make gpu-report`).
        optimizer._mlp_chunk_update.params_on_host = False
    # Each data-parallel rank gets its own batches, as a sampler would give it.
    data = torch.Generator().manual_seed(99 + int(os.environ["RANK"]))
    losses = []
    # DeepSpeed's global gradient norm after each step (what a Trainer logs), or None where the step
    # left none.
    grad_norms: list[float | None] = []
    overflow_at = case.get("overflow_at_step")
    fail_at = case.get("immutable_at_step")
    samples: list[dict[str, int]] = []
    helper_reads: dict[str, torch.Tensor] = {}
    # How many views of DeepSpeed's gradient buffer our engine held while its states were offloaded.
    views_after_offload: list[int] = []
    between: list[dict[str, Any]] = []
    before_step: list[dict[str, Any]] = []
    # The eval batches, drawn apart from the training data, so both runs train on the same batches.
    data_between = torch.Generator().manual_seed(7 + int(os.environ["RANK"]))
    first_step = case.get("resume_at", 0)
    # The resident memory the load adds at its peak (bytes).
    load_peak: list[int] = []
    if first_step:
        # A new process resuming a job from its checkpoint: the batches of the steps before it are
        # drawn and dropped, as a sampler resumed at that step would.
        if case.get("load_refused"):
            return refused_load(engine, case["checkpoint_dir"])
        with peak_added(load_peak):
            engine.load_checkpoint(case["checkpoint_dir"], tag="ckpt", **case.get("load_options", {}))
        for _ in range(first_step * case.get("grad_accum", 1)):
            torch.randint(0, VOCAB, (2, SEQ), generator=data)
    for step in range(first_step, case.get("steps", 10)):
        if step == fail_at:
            return fail_step(engine, optimizer, case, data)
        if step == case.get("fault_at"):
            return fault_step(engine, case, data)
        if step == case.get("fill_at"):
            fill(case["fill"])
        if step == case.get("save_at"):
            engine.save_checkpoint(case["checkpoint_dir"], tag="ckpt")
        if step == case.get("sigkill_in_save_at"):
            # Every rank saves a later checkpoint (under a tag of its own: the job resumes from the last
            # whole one); one is killed in it, once one subgroup's state is read from the store.
            if os.environ["RANK"] == str(case.get("sigkill_rank", 0)):
                in_save(optimizer, after_subgroups=1, then=functools.partial(sigkill, optimizer, "in a save"))
            engine.save_checkpoint(case["checkpoint_dir"], tag="ckpt-killed")
        if step == case.get("sigkill_in_forward_at") and os.environ["RANK"] == str(
            case.get("sigkill_rank", 0)
        ):
            in_forward(engine, then=functools.partial(sigkill, optimizer, "in a forward"))
        if step == case.get("set_params_apart_at"):
            set_params_apart(engine)
        if step == case.get("sigkill_in_update_at") and os.environ["RANK"] == str(
            case.get("sigkill_rank", 0)
        ):
            in_update(optimizer, after_chunks=3, then=functools.partial(sigkill, optimizer))
            if case.get("hold_backward"):
                hold_backward(engine)
        # Which node: torchrun's GROUP_RANK; 0 where one node's ranks are started without it.
        node = os.environ.get("GROUP_RANK", "0")
        if step == case.get("stall_in_update_at") and node == str(case["stall_node"]):
            # This node's ranks stop mid-update, and say so, until the test kills the node.
            marker = Path(case["stall_marker"].replace("{rank}", os.environ["RANK"]))
            in_update(optimizer, after_chunks=3, then=functools.partial(stall, marker))
        if step == case.get("checkpoint_at"):
            # Save, drop the engine, build another from other initial weights (stock or ours, as the
            # case says), load, and go on with the same data.
            engine.save_checkpoint(case["checkpoint_dir"], tag="ckpt")
            engine.destroy()
            if case.get("drop_zero_files"):
                # A checkpoint without the ZeRO optimizer files: the model's weights only.
                for file in Path(case["checkpoint_dir"], "ckpt").glob("*optim_states.pt"):
                    file.unlink()
            resume = case.get("resume_mlp_offload")
            engine, optimizer = make_engine(resume is not None, resume, 4321)
            engine.load_checkpoint(case["checkpoint_dir"], tag="ckpt", **case.get("load_options", {}))
        if case.get("layer_drop"):
            engine.module.blocks[-1].dropped = step in case["layer_drop"]
        for micro in range(case.get("grad_accum", 1)):
            if case.get("layer_drop_last_micro"):
                last = micro == case.get("grad_accum", 1) - 1
                engine.module.blocks[-1].dropped = last and step in case["layer_drop_last_micro"]
            tokens = torch.randint(0, VOCAB, (2, SEQ), generator=data)
            loss = engine(tokens.to(engine.device))
            if step == overflow_at:
                loss = loss * float("inf")
            if step >= case.get("loss_spike_from", case.get("steps", 10)):
                # A loss spike from this step on: gradients this many times larger, clipped where the
                # steps before were not.
                loss = loss * case["loss_spike"]
            last_grad = None
            if step == case.get("first_param_grad_not_finite_at"):
                # Only the first parameter's gradient, final last in backward: the gradients final
                # before it are finite.
                first = next(engine.module.parameters())
                last_grad = first.register_hook(
                    functools.partial(not_finite, after_a_taken_chunk=engine.optimizer)
                )
            engine.backward(loss)
            if last_grad is not None:
                last_grad.remove()
            if step == case.get("read_before_step_at"):
                # What a hook between backward and step may read: the parameters' data as they are
                # (the persistent ones whole, the others empty), an eval pass, every parameter gathered.
                held = torch.cat(
                    [p.data.detach().flatten().float().cpu() for p in engine.module.parameters()]
                )
                before_step.append({"held": held, **read_between_steps(engine, data_between)})
            if step == case.get("helpers_at"):
                helper_reads.update(use_tensor_helpers(engine, case.get("helpers_on")))
            if step == case.get("offload_states_at"):
                views_after_offload.append(offload_and_reload_states(engine, optimizer))
            engine.step()
            if case.get("offload_states_after_every_step"):
                views_after_offload.append(offload_and_reload_states(engine, optimizer))
        losses.append(float(loss.detach()))
        norm = engine.get_global_grad_norm()
        grad_norms.append(None if norm is None else float(norm))
        if case.get("read_between_steps"):
            between.append(read_between_steps(engine, data_between))
        if case.get("sample_resources"):
            # Between steps with nothing running: the update behind step() done (the fused pass's
            # threads live as long as its call).
            getattr(optimizer, "mlp_offload_wait", lambda: None)()
            scratch = getattr(optimizer, "_mlp_norm_scratch", None)
            samples.append({**resources(), "norm_scratch": 0 if scratch is None else scratch.data_ptr()})
    final = final_save(engine, case["checkpoint_dir"]) if case.get("final_save") else {}
    state = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            # A frozen parameter has no optimizer state: its partition is all there is.
            state[name] = {"fp32": None, "exp_avg": None, "exp_avg_sq": None, "half": partition(p)}
            continue
        # The helpers first: they wait for an update still running behind step(), which writes the
        # partition.
        state[name] = {
            "fp32": safe_get_full_fp32_param(p).clone(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
            "half": partition(p),
        }
    from deepspeed.runtime.zero import stage3

    result: dict[str, Any] = {
        "state": state,
        "losses": losses,
        "grad_norms": grad_norms,
        "skipped": engine.skipped_steps,
        # The parameters every rank holds whole (DeepSpeed's persistence threshold), gathered at the end
        # of a step rather than for each use.
        "persistent_params": len(getattr(optimizer, "persistent_parameters", [])),
        "optimizer_class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "rng_after_init": rng_after_init,
        # Type checks under the name imported before mlp_offload.install() and the module's name now.
        "is_deepspeed_stage3": [
            isinstance(optimizer, imported_before_install),
            isinstance(optimizer, stage3.DeepSpeedZeroOptimizer_Stage3),
        ],
    }
    result.update(final)
    if case.get("offload_param") == "nvme":
        # Whose swapper holds the parameters' partitions on NVMe, and whether DeepSpeed's async I/O op
        # (which stock's swapper runs on) was loaded.
        params = engine.module.parameters()
        result["param_swappers"] = sorted(
            {type(p.nvme_swapper).__name__ for p in params if hasattr(p, "nvme_swapper")}
        )
        result["async_io_loaded"] = "async_io" in sys.modules
    if load_peak:
        result["load_added_bytes"] = load_peak[0]
    if samples:
        result["samples"] = samples
    if helper_reads:
        result["helper_reads"] = helper_reads
    if views_after_offload:
        result["half_grad_views_while_offloaded"] = views_after_offload
    if between:
        result["between_steps"] = between
    if before_step:
        result["before_step"] = before_step
    if directory := case.get("save_16bit"):
        result["saved_16bit"] = engine.save_16bit_model(directory)
    telemetry = getattr(optimizer, "mlp_offload_telemetry", None)
    if telemetry is not None:
        result["telemetry"] = telemetry
    chunks: dict[str, torch.Tensor] | None = None
    if telemetry is not None:
        # Each chunk's current state (cache or store), to compare with what destroy() leaves on disk.
        state_of = optimizer._mlp_session.state
        chunks = {}
        for i in range(len(state_of.numels)):
            whole = state_of.gather(i)
            for c in state_of.of_subgroup[i]:
                # The chunk's bytes as the store keeps them (`StateDtypes.pack`).
                parts = [whole[s] for s in state_of._slices(c)]
                chunks[state_of.keys[c]] = state_of.stored.pack(torch.cat(parts))
    if (wandb := sys.modules.get("wandb")) is not None and wandb.run is not None:
        # A run DeepSpeed's wandb monitor began, ended as a script's exit ends it (atexit, which a run
        # forked by the harness server does not reach): its history is then in its directory.
        wandb.finish()
    try:
        engine.destroy()
    except OSError as e:
        # Closing writes the store's manifest, which needs new blocks (a path that filled up).
        result["destroy_error"] = os_error(e)
        paths, rank = optimizer._mlp_config.paths, optimizer._mlp_rank
        store = mlp_offload.ObjectStore(paths, rank=rank)
        result["store_keys_after_destroy"] = sorted(store.keys())
        try:
            # The manifest on the full path is one write behind the others, and still cannot be replaced.
            store.close()
        except OSError as e:
            result["store_close_error"] = os_error(e)
        return result
    if chunks is not None:
        # What a fresh store over the same paths reads after destroy() (no mlp_offload_flush()).
        paths, rank = optimizer._mlp_config.paths, optimizer._mlp_rank
        with mlp_offload.ObjectStore(paths, rank=rank) as store:
            result["store_after_destroy_matches"] = sorted(store.keys()) == sorted(chunks) and all(
                torch.equal(store_read(store, key, expected), expected) for key, expected in chunks.items()
            )
    return result


def partition(p: Any) -> torch.Tensor | None:
    """This rank's partition of `p`, also where it lies on NVMe (read in through its swapper, stock's or
    ours, then released as a fetch releases it)."""
    if not hasattr(p, "ds_tensor"):
        return None
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus

    if p.ds_tensor.status != PartitionedParamStatus.NOT_AVAILABLE:
        return p.ds_tensor.clone()
    p.nvme_swapper.swap_in([p], async_op=False)
    values = p.ds_tensor.clone()
    p.nvme_swapper.remove_partition_and_release_buffers([p])
    return values


@contextlib.contextmanager
def built_under_zero_init(case: dict[str, Any], section: dict[str, Any] | None) -> Iterator[None]:
    """With `zero_init`: the model built under `deepspeed.zero.Init` with the case's config, each parameter
    partitioned (past `offload_param.max_in_cpu`, written to NVMe) as it is made, as large models are
    built (Hugging Face's `from_pretrained` under ZeRO-3); ours after `mlp_offload.install()`, as the README
    says."""
    if not case.get("zero_init"):
        yield
        return
    import deepspeed

    import mlp_offload

    config = ds_config({k: v for k, v in case.items() if k != "mlp_offload"})
    if section is not None:
        config["mlp_offload"] = section
        mlp_offload.install()
    with deepspeed.zero.Init(config_dict_or_path=config):
        yield


def build_model(name: str) -> torch.nn.Module:
    """The case's model, whose `forward(tokens)` returns the next-token loss: `"gpt"`, the tests' GPT
    (`mlp_offload.app.models.GPT`: plain `nn.Linear` layers, each used by its own module's forward), and
    `"gpt-20M"`, its 20M size;
    `"attention"`, blocks of torch's `nn.TransformerEncoderLayer`, whose `nn.MultiheadAttention` reads its
    `out_proj`'s parameters in its own forward (DeepSpeed fetches them for a module that does not own
    them); `"llama"`, Hugging Face's `LlamaForCausalLM` built from its config."""
    vocab, dim, layers, heads = SIZES["tiny"]
    if name == "gpt":
        return GPT.from_size("tiny", max_seq=SEQ)
    if name == "gpt-20M":
        # 17M parameters (204 MB of fp32 state): a state many times a small `host_memory`.
        return GPT.from_size("20M", max_seq=SEQ)
    if name == "attention":
        return AttentionLM(vocab, dim, layers, heads)
    if name == "llama":
        return CausalLMLoss(llama("tiny", vocab=vocab, max_seq=SEQ))
    raise ValueError(f"model: {name!r} is not one of gpt, attention, llama")


class AttentionLM(torch.nn.Module):
    """A causal decoder of torch's own `nn.TransformerEncoderLayer` blocks (pre-norm, no dropout)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(SEQ, dim)
        block = functools.partial(
            torch.nn.TransformerEncoderLayer,
            dim,
            heads,
            4 * dim,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = torch.nn.ModuleList(block() for _ in range(layers))
        self.ln = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1] - 1
        x = self.tok(tokens[:, :-1]) + self.pos(torch.arange(t, device=tokens.device))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.head(self.ln(x)).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))


class CausalLMLoss(torch.nn.Module):
    """A Hugging Face causal language model whose `forward(tokens)` returns its own loss."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=tokens, labels=tokens).loss
        return loss


class Checkpointed(torch.nn.Module):
    """A block whose activations are not kept: torch's activation checkpointing runs its forward again in
    backward."""

    def __init__(self, block: torch.nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.block = block
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        out: torch.Tensor = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return out


class Droppable(torch.nn.Module):
    """A block that passes its input through, without running, while `dropped`."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block
        self.dropped = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.dropped else self.block(x)


def final_save(engine: Any, checkpoint_dir: str) -> dict[str, Any]:
    """After training, the tools users run on what the job leaves: DeepSpeed's checkpoint of the last
    step read back by `zero_to_fp32`, and `save_16bit_model`'s file (rank 0 reads both)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    directory = os.path.join(checkpoint_dir, "final")
    engine.save_checkpoint(directory, tag="final")
    saved = engine.save_16bit_model(directory)
    if os.environ["RANK"] != "0":
        return {}
    fp32 = get_fp32_state_dict_from_zero_checkpoint(directory, tag="final")
    model = torch.load(os.path.join(directory, "pytorch_model.bin"), weights_only=False) if saved else None
    return {"final_fp32": fp32, "final_16bit": model}


def full_state(engine: Any) -> list[torch.Tensor]:
    """Every parameter's fp32 weights and moments (from the store, with ours), and its partition."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    tensors = []
    for p in engine.module.parameters():
        tensors.append(safe_get_full_fp32_param(p).clone())
        tensors += [safe_get_full_optimizer_state(p, key).clone() for key in ("exp_avg", "exp_avg_sq")]
        tensors.append(p.ds_tensor.clone())
    return tensors


def refused_load(engine: Any, checkpoint_dir: str) -> dict[str, Any]:
    """A load expected to be refused: its error, and whether the state is what it was before it."""
    before = full_state(engine)
    try:
        engine.load_checkpoint(checkpoint_dir, tag="ckpt")
    except Exception as e:  # what it was is the test's to read
        error: str | None = f"{type(e).__name__}: {e}"
    else:
        error = None
    after = full_state(engine)
    kept = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return {"refused": error, "state_kept": kept}


def store_read(store: Any, key: str, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    store.read(key, out).wait()
    return out


def use_tensor_helpers(engine: Any, names: str | None = None) -> dict[str, torch.Tensor]:
    """Between backward and step: reads through each of DeepSpeed's `safe_get_*` helpers and writes
    new values through its `safe_set_*` twin, one parameter each (of those whose names match `names`,
    where given); returns what was read."""
    from deepspeed import utils

    params = [p for n, p in engine.module.named_parameters() if names is None or re.search(names, n)]
    values = torch.Generator().manual_seed(5)

    def new(old: torch.Tensor) -> torch.Tensor:
        return torch.randn(old.shape, generator=values).to(old.dtype).abs()

    read: dict[str, torch.Tensor] = {}
    # name, get, set (value first, as DeepSpeed's setters take it), optimizer-state key
    helpers = [
        ("full_grad", utils.safe_get_full_grad, utils.safe_set_full_grad, None),
        ("local_grad", utils.safe_get_local_grad, utils.safe_set_local_grad, None),
        ("full_fp32", utils.safe_get_full_fp32_param, utils.safe_set_full_fp32_param, None),
        ("local_fp32", utils.safe_get_local_fp32_param, utils.safe_set_local_fp32_param, None),
        ("full_exp_avg", utils.safe_get_full_optimizer_state, utils.safe_set_full_optimizer_state, "exp_avg"),
        (
            "local_exp_avg_sq",
            utils.safe_get_local_optimizer_state,
            utils.safe_set_local_optimizer_state,
            "exp_avg_sq",
        ),
    ]
    # One parameter per helper (the model has more parameters than there are helpers).
    for p, (name, get, put, key) in zip(params, helpers, strict=False):
        old = (get(p, key) if key else get(p)).clone()
        read[name] = old
        if key:
            put(p, new(old), key)
        else:
            put(p, new(old))
    return read


def offload_and_reload_states(engine: Any, optimizer: Any) -> int:
    """DeepSpeed's `offload_states` then `reload_states` (what an RLHF loop calls around generation),
    of every state it moves with the optimizer offloaded (the others need its FusedAdam). Returns how
    many views of the gradient buffer our engine held in between (0 for stock)."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

    engine.offload_states(include=[State.lp_params, State.lp_grads, State.contiguous_grad_buffer])
    chunk_update = getattr(optimizer, "_mlp_chunk_update", None)
    views = 0 if chunk_update is None else len(chunk_update.half_grads)
    engine.reload_states()
    return views


def read_between_steps(engine: Any, data: torch.Generator) -> dict[str, Any]:
    """What a job may read between a step and the next forward: an eval pass's loss, then every
    parameter gathered whole (`GatheredParameters`), as the half-precision values the model holds."""
    import deepspeed

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=data)
    engine.eval()
    with torch.no_grad():
        eval_loss = float(engine(tokens.to(engine.device)))
    engine.train()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        gathered = torch.cat([p.detach().flatten().float().cpu() for p in params])
    return {"eval_loss": eval_loss, "gathered": gathered}


def proc_status() -> dict[str, str]:
    """This process's /proc/self/status, by field."""
    return dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())


def resources() -> dict[str, int]:
    """This process's resident memory (bytes), open file descriptors and threads, from /proc."""
    status = proc_status()
    return {
        "rss": int(status["VmRSS"].split()[0]) * 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": int(status["Threads"]),
    }


@contextlib.contextmanager
def peak_added(peak: list[int]) -> Iterator[None]:
    """Appends to `peak` the most resident memory the block added over what was resident before it: the
    kernel's high-water mark, reset first (`clear_refs`)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = int(proc_status()["VmRSS"].split()[0])
    yield
    peak.append((int(proc_status()["VmHWM"].split()[0]) - before) * 1024)


def set_params_apart(engine: Any) -> None:
    """Changes the last parameters' half-precision values (in chunks that stream: the first ones stay
    in memory) through DeepSpeed's `GatheredParameters(modifier_rank=0)`, as a user's code
    re-initialising a layer would: the partitions change, DeepSpeed's fp32 weights do not (the next step
    that is taken overwrites the change, a skipped one keeps it)."""
    import deepspeed

    params = [p for _, p in engine.module.named_parameters()][-3:]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        for p in params:
            p.mul_(1.5).add_(0.01)


def sigkill(optimizer: Any, where: str | None = None) -> None:
    """SIGKILL to this process, saying first where it was (`where`, else where the update was: in
    `step()` (on the caller's thread), during backward (the update during backward, backward still
    running) or behind `step()` (on the update thread, the next forward running))."""
    import threading

    if where is None:
        overlap_backward = getattr(optimizer, "_mlp_overlap_backward", None)
        backward_update = None if overlap_backward is None else overlap_backward.current
        if threading.current_thread() is threading.main_thread():
            where = "in step()"
        elif backward_update is not None and backward_update.backward_end is None:
            where = "during backward"
        else:
            where = "behind step()"
    print("killed", where, file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def hold_backward(engine: Any) -> None:
    """Makes the next backward wait, near its end (at the token embedding's output gradient, every later
    layer's gradients reduced), until something kills this process: a kill that the test expects during
    backward (`sigkill`'s "during backward") then comes there however slowly the machine runs."""
    embedding = next(m for m in engine.module.modules() if isinstance(m, torch.nn.Embedding))

    def wait(grad: torch.Tensor) -> torch.Tensor:
        time.sleep(120)
        raise RuntimeError("hold_backward: not killed within 120 s")

    def on_forward(module: Any, inputs: Any, output: torch.Tensor) -> None:
        handle.remove()
        output.register_hook(wait)

    handle = embedding.register_forward_hook(on_forward)


def not_finite(grad: torch.Tensor, after_a_taken_chunk: Any) -> torch.Tensor:
    """The gradient times infinity; with ours updating during backward, only once the update thread has
    taken a chunk (at most 60 s): else a slow machine's update thread may find the norms so far already
    not finite before its first chunk, and a row that means to undo taken chunks would undo none."""
    deadline = time.monotonic() + 60.0
    optimizer = after_a_taken_chunk
    overlap_backward = getattr(optimizer, "_mlp_overlap_backward", None)
    while overlap_backward is not None and overlap_backward.on and time.monotonic() < deadline:
        run = overlap_backward.current
        if run is None and overlap_backward.begun:
            break  # not tried at this boundary
        if run is not None and (run.taken or run.future is None or run.future.done()):
            break
        time.sleep(0.002)
    return grad * float("inf")


def stall(marker: Path) -> None:
    marker.touch()
    time.sleep(3600)


def in_update(optimizer: Any, after_chunks: int, then: Callable[[], Any]) -> None:
    """Makes the next update call `then()` (SIGKILL this process, or stall it) once `after_chunks` chunks
    are updated (their writes in flight or done, the rest not begun)."""
    pipeline = optimizer._mlp_session.pipeline
    run_step = pipeline.run_step

    def killing_run_step(update: Any, **kwargs: Any) -> Any:
        done = 0

        def update_then_maybe_die(chunk: int, view: torch.Tensor, *cuts: Any, **kept: Any) -> Any:
            nonlocal done
            # The fused update also takes and returns the chunk's checksums (`checksums_in_update`), and
            # during backward a cached chunk's kept copy.
            result = update(chunk, view, *cuts, **kept)
            done += 1
            if done == after_chunks:
                then()
            return result

        return run_step(update_then_maybe_die, **kwargs)

    pipeline.run_step = killing_run_step


def in_forward(engine: Any, then: Callable[[], Any]) -> None:
    """Makes the next forward call `then()` as it reaches the middle one of the modules with parameters of
    their own: the modules before it fetched (and, with parameters on NVMe, read ahead of it), the rest
    not."""
    owners = [m for m in engine.module.modules() if next(m.parameters(recurse=False), None) is not None]

    def reached(*_: Any) -> None:
        handle.remove()
        then()

    handle = owners[len(owners) // 2].register_forward_pre_hook(reached)


def in_save(optimizer: Any, after_subgroups: int, then: Callable[[], Any]) -> None:
    """Makes the next checkpoint's save call `then()` once it has read `after_subgroups` subgroups' state
    from the cache and the store (`ChunkedState.gather`)."""
    state = optimizer._mlp_session.state
    gather = state.gather
    done = 0

    def gather_then_maybe_die(i: int) -> torch.Tensor:
        nonlocal done
        whole: torch.Tensor = gather(i)
        done += 1
        if done == after_subgroups:
            then()
        return whole

    state.gather = gather_then_maybe_die


def fault_step(engine: Any, case: dict[str, Any], data: torch.Generator) -> dict[str, Any]:
    """Switches the case's fault on (a switch file of `faultfs.py`, or SIGKILL to its process: the path
    disappears), runs steps until one raises (at most three: the writes still in flight when a step
    returns complete during the next forward and backward, and their failure surfaces in the next
    step; with the update behind `step()`, in the forward after that), and reports the error and how
    many steps ran."""
    import signal

    fault = case["fault"]
    if "switch" in fault:
        Path(fault["switch"]).touch()
    else:
        os.kill(fault["kill"], signal.SIGKILL)
    for steps in (1, 2, 3):
        if error := step_error(engine, data):
            return {"error": error, "steps": steps}
    return {"error": {}, "steps": 3}


def step_error(engine: Any, data: torch.Generator) -> dict[str, Any]:
    """Runs one step; the `OSError` it raised, if any (type, errno, filename, message)."""
    try:
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=data)
        engine.backward(engine(tokens.to(engine.device)))
        engine.step()
    except OSError as e:
        return os_error(e)
    return {}


def os_error(e: OSError) -> dict[str, Any]:
    return {"type": type(e).__name__, "errno": e.errno, "filename": e.filename, "message": str(e)}


def fill(directory: str) -> None:
    """Takes every free block of the file system under `directory`, as another job's files would, and
    checks that nothing is left: a new file's first page now fails with ENOSPC."""
    import errno

    free = os.statvfs(directory)
    with open(os.path.join(directory, "filler"), "wb") as f:
        os.posix_fallocate(f.fileno(), 0, free.f_bavail * free.f_frsize)
    try:
        Path(directory, "probe").write_bytes(b"x" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    else:
        raise AssertionError(f"{directory} still has free space after the filler")


def fail_step(engine: Any, optimizer: Any, case: dict[str, Any], data: torch.Generator) -> dict[str, Any]:
    """Makes every object file immutable (writes then fail with EPERM), runs a step, and reports the
    error and whether a fresh store over the same paths reads every subgroup afterwards."""
    import subprocess

    import mlp_offload

    paths = case["mlp_offload"]["paths"]
    files = [str(f) for p in paths for f in Path(p).rglob("*.mlpo")]
    subprocess.run(["chattr", "+i", *files], check=True)
    try:
        error = step_error(engine, data)
    finally:
        subprocess.run(["chattr", "-i", *files], check=True)
    # Closed (synced, its directories unlocked), so a fresh store can open the same paths.
    optimizer._mlp_session.store.close()
    # Every object of a fresh store over the same paths: its size, or the error its read raised.
    readable: dict[str, Any] = {}
    with mlp_offload.ObjectStore(paths) as store:
        for key in store.keys():
            buf = torch.empty(store.size(key) or 0, dtype=torch.uint8)
            try:
                store.read(key, buf).wait()
                readable[key] = buf.numel()
            except mlp_offload.CorruptObjectError as e:
                readable[key] = f"{type(e).__name__}: {e}"
    return {"error": error, "readable": readable, "telemetry": optimizer.mlp_offload_telemetry}


def preload() -> None:
    """What `harness_server.py` imports once, before it forks the first run of this harness: Hugging
    Face's LLaMA (`build_model("llama")`), 5 s of imports that each run would pay again."""
    from transformers import LlamaForCausalLM  # noqa: F401


def main(spec: str, out: str) -> None:
    """Runs the case in file `spec` and saves its result to `out` (`{rank}` in it: this rank's number,
    for a launcher that starts every rank of a node with one command line)."""
    # What a run that did not end in time was doing, written to its log before it is killed.
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    case = json.loads(Path(spec).read_text())
    if "MASTER_PORT" not in os.environ or "port" in case:
        os.environ["MASTER_PORT"] = str(case.get("port", 29500))
    torch.save(train(case), out.replace("{rank}", os.environ["RANK"]))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
