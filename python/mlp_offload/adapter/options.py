"""Every DeepSpeed option that reaches the optimizer's paths, with what mlp-offload does with it.

Each row ends one of two ways: bit-equal to stock DeepSpeed with the same option (checked by a run of
each, `tests/test_options.py`), or refused at start by an error naming the key and what to use instead.
No option trains and differs. The table lists every field of DeepSpeed's config models for ZeRO (with
its offload, ZenFlow and leaf-module sections), `bf16`, `fp16`, `torch_autocast`, `data_types`, the
gradient settings and the optimizer's params; a field a new DeepSpeed adds fails the table's test until
it has a row, and a user who sets an option no row lists is warned by name at start (`check`).
`docs/options.md` is rendered from the table (`make docs-pages`), and so are the refused rows' parts of
the troubleshooting page and of the README's row of refusals (`refusals_markdown`, `readme_keys`): the
registry (`troubleshooting`) is what this module's messages come from, and imports nothing of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mlp_offload.adapter import troubleshooting

log = logging.getLogger("mlp_offload")

# The sections whose every key the table lists; DeepSpeed also reads bf16's under its old name.
SECTIONS = (
    "zero_optimization",
    "zero_optimization.offload_optimizer",
    "zero_optimization.offload_param",
    "zero_optimization.zenflow",
    "zero_optimization.leaf_module",
    "bf16",
    "fp16",
    "torch_autocast",
    "data_types",
    "optimizer.params",
)
OLD_NAMES = {"bfloat16": "bf16"}


def _true(value: Any) -> bool:
    return bool(value)


def _set(value: Any) -> bool:
    return value is not None


@dataclass(frozen=True)
class Option:
    """One DeepSpeed option: its dotted key as DeepSpeed's docs name it, what happens with it (one line
    for the docs), and for a refused one, the values refused and what to use instead."""

    key: str
    what: str
    refused: Callable[[Any], bool] | None = None
    instead: str = ""


def equal(key: str, what: str) -> Option:
    return Option(key, what)


def refused(key: str, what: str, instead: str, when: Callable[[Any], bool] = _set) -> Option:
    return Option(key, what, when, instead)


STOCK_PASSES = "DeepSpeed's code, run unchanged"
# The state in half precision: each value kept in its dtype (the mode's 10 or 6 bytes a parameter),
# rounded as DeepSpeed's CPU Adam rounds it.
HALF_STATE_HELD = "kept in its dtype: 10 bytes a parameter, 6 with bf16 moments"
STOCK_FAILS = "stock DeepSpeed 0.19.8 fails with it too"
NOT_ON_CPU = "not yet compared with stock DeepSpeed, which cannot run it on a CPU (a GPU's to check)"


def _zenflow(name: str) -> Option:
    return refused(
        f"zero_optimization.zenflow.{name}",
        "ZenFlow, another optimizer path (selective updates)",
        "remove the zenflow section",
    )


Z = "zero_optimization"
OO = f"{Z}.offload_optimizer"
OP = f"{Z}.offload_param"
# The parameters' partitions on NVMe with our section (`param_swapper`), where stock has fixed slots.
PARAMS_FOLDER = "params"
OWN_BUFFER = "each partition read from NVMe gets a buffer of its own, so no fetch waits for one"
OPT = "optimizer.params"

OPTIONS: tuple[Option, ...] = (
    refused(
        f"{Z}.stage",
        "mlp-offload is a ZeRO-3 optimizer; under another stage DeepSpeed would ignore the section",
        "set it to 3",
        lambda v: v != 3,
    ),
    equal(f"{Z}.contiguous_gradients", f"how DeepSpeed buffers reduced gradients: {STOCK_PASSES}"),
    equal(f"{Z}.reduce_scatter", f"the gradients' reduction: {STOCK_PASSES}"),
    equal(f"{Z}.reduce_bucket_size", "gradients reduced and their chunks final in buckets of this size"),
    equal(f"{Z}.use_multi_rank_bucket_allreduce", f"the gradients' reduction: {STOCK_PASSES}"),
    equal(f"{Z}.allgather_partitions", f"the parameters' gathering: {STOCK_PASSES}"),
    equal(f"{Z}.allgather_bucket_size", f"the parameters' gathering: {STOCK_PASSES}"),
    equal(f"{Z}.overlap_comm", f"the gradients' reduction on a side stream: {STOCK_PASSES}"),
    refused(
        f"{Z}.compute_grad_norm",
        f"{STOCK_FAILS} (false is for ZeRO-1 and 2 only)",
        "leave it at true",
        lambda v: not v,
    ),
    equal(f"{Z}.load_from_fp32_weights", "a checkpoint's load from its fp32 or its 16-bit weights"),
    refused(
        f"{Z}.elastic_checkpoint",
        "stock's ZeRO-3 cannot load an elastic checkpoint either",
        "set it to false",
        _true,
    ),
    equal(f"{Z}.sub_group_size", "the subgroups the state is cut into (each in chunks of the store)"),
    equal(f"{Z}.cpu_offload", f"deprecated: as {OO}.device cpu"),
    equal(f"{Z}.cpu_offload_param", f"deprecated: as {OP}.device cpu"),
    equal(f"{Z}.cpu_offload_use_pin_memory", "deprecated, read by nothing"),
    equal(f"{Z}.stage3_prefetch_bucket_size", f"the parameters' prefetch: {STOCK_PASSES}"),
    equal(f"{Z}.stage3_param_persistence_threshold", "parameters kept whole on every rank below this size"),
    equal(f"{Z}.stage3_model_persistence_threshold", "at most this many elements kept whole"),
    equal(f"{Z}.stage3_max_live_parameters", f"the parameters' prefetch: {STOCK_PASSES}"),
    equal(f"{Z}.stage3_max_reuse_distance", f"the parameters' release: {STOCK_PASSES}"),
    equal(f"{Z}.stage3_gather_16bit_weights_on_model_save", "the 16-bit model gathered at a save"),
    refused(
        f"{Z}.stage3_module_granularity_threshold",
        f"leaf modules by size: {STOCK_FAILS} (in backward, on the tests' GPT)",
        "leave it at 0",
        _true,
    ),
    equal(
        f"{Z}.stage3_use_all_reduce_for_fetch_params",
        f"the parameters gathered by an all-reduce: {STOCK_PASSES}",
    ),
    equal(f"{Z}.stage3_allgather_sequential", f"the parameters' gathering: {STOCK_PASSES}"),
    equal(f"{Z}.stage3_gather_fp16_weights_on_model_save", "deprecated: as stage3_gather_16bit_..."),
    equal(f"{Z}.ignore_unused_parameters", "read by ZeRO-1 and 2 only"),
    refused(f"{Z}.legacy_stage1", f"{STOCK_FAILS} (removed in DeepSpeed 0.5.9)", "set it to false", _true),
    equal(f"{Z}.round_robin_gradients", "read by ZeRO-1 and 2 only"),
    equal(f"{Z}.parameter_alignment", "read by ZeRO-1 and 2 only"),
    equal(f"{Z}.zero_hpz_partition_size", f"ZeRO++'s secondary partition of the parameters: {STOCK_PASSES}"),
    refused(
        f"{Z}.zero_quantized_weights", f"ZeRO++'s quantized weights: {NOT_ON_CPU}", "set it to false", _true
    ),
    refused(
        f"{Z}.zero_quantized_nontrainable_weights",
        f"ZeRO++'s quantized frozen weights: {NOT_ON_CPU}",
        "set it to false",
        _true,
    ),
    refused(
        f"{Z}.zero_quantized_gradients",
        f"ZeRO++'s quantized gradient reduction: {NOT_ON_CPU}",
        "set it to false",
        _true,
    ),
    equal(f"{Z}.memory_efficient_linear", f"ZeRO-3's linear layer: {STOCK_PASSES}"),
    equal(f"{Z}.pipeline_loading_checkpoint", "ranks load a checkpoint one after another"),
    equal(f"{Z}.override_module_apply", f"module.apply under ZeRO-3: {STOCK_PASSES}"),
    equal(f"{Z}.log_trace_cache_warnings", "logging only"),
    equal(f"{Z}.enable_sanity_checks", f"checks of the parameters' state: {STOCK_PASSES}"),
    equal(f"{Z}.save_muon_momentum_buffer_in_memory", "read with Muon only (refused as an optimizer)"),
    equal(f"{Z}.leaf_module.classes", f"leaf modules by class: {STOCK_PASSES}"),
    equal(f"{Z}.leaf_module.names", f"leaf modules by name: {STOCK_PASSES}"),
    equal(f"{Z}.leaf_module.name_suffixes", f"leaf modules by name: {STOCK_PASSES}"),
    refused(
        f"{OO}.device",
        "the state in the store, updated by CPU Adam on the host; nvme is rewritten to it",
        'set it to "cpu" or "nvme"',
        lambda v: v not in ("cpu", "nvme"),
    ),
    equal(f"{OO}.nvme_path", "with device nvme, the store's path when the section names none"),
    equal(f"{OO}.buffer_count", 'with host_memory "deepspeed", the bytes DeepSpeed would pin'),
    equal(f"{OO}.pin_memory", "the store's buffers pinned or not"),
    equal(f"{OO}.pipeline_read", "NVMe swapping's option, which the store replaces"),
    equal(f"{OO}.pipeline_write", "NVMe swapping's option, which the store replaces"),
    equal(f"{OO}.fast_init", "NVMe swapping's option, which the store replaces"),
    equal(
        f"{OO}.ratio",
        "stock keeps its first int((1 - ratio) x subgroups) subgroups' state on the accelerator, stepped by "
        "torch's AdamW (other bits than CPU Adam's; on DeepSpeed's CPU accelerator, none: its CPU Adam steps "
        "every one), whose first parameter group keeps the constructor's learning rate whatever the "
        "scheduler sets, and whose state no checkpoint holds; ours keeps the same ones there, updated by a "
        "Triton kernel with CPU Adam's own arithmetic (checked there at start-up), at the scheduler's "
        "learning rate, checkpointed with the rest: bit-equal to device: cpu, whatever the ratio",
    ),
    refused(f"{OO}.super_offload", "SuperOffload, another optimizer", "set it to false", _true),
    equal(f"{OO}.cpuadam_cores_perc", "read by SuperOffload only"),
    equal(
        f"{OP}.device",
        "cpu: DeepSpeed's own offload; nvme: the partitions of 1 MiB and more as objects of our store",
    ),
    equal(f"{OP}.nvme_path", f"not written: the partitions go to our paths' {PARAMS_FOLDER}/, said at start"),
    equal(f"{OP}.buffer_count", f"bounds nothing: {OWN_BUFFER}"),
    equal(f"{OP}.buffer_size", f"bounds nothing: {OWN_BUFFER}"),
    equal(
        f"{OP}.max_in_cpu",
        "past it, whole subgroups on NVMe: the update reads and writes them as it goes (during backward "
        "too, written again if undone)",
    ),
    equal(
        f"{OP}.pin_memory",
        "cpu: DeepSpeed's own; nvme: our partitions' buffers are page-aligned but not locked yet",
    ),
    *(
        _zenflow(name)
        for name in (
            "topk_ratio",
            "select_strategy",
            "select_interval",
            "update_interval",
            "overlap_step",
            "offload",
            "auto_ratio",
            "full_warm_up_rounds",
            "pt_reserved_cores_perc",
            "steps_per_epoch",
        )
    ),
    equal("bf16.enabled", "bf16 parameters and gradients, fp32 state"),
    equal("bf16.immediate_grad_update", "read by the bf16 optimizer (ZeRO-1) only"),
    equal("bf16.check_grad_overflow", "a step with a non-finite gradient skipped"),
    equal("bf16.bf16_master_weights_and_grads", f"bf16 master weights and gradients ({HALF_STATE_HELD})"),
    equal("bf16.bf16_optimizer_states", f"bf16 Adam moments ({HALF_STATE_HELD})"),
    equal("fp16.enabled", "fp16 parameters and gradients, fp32 state, loss scaling"),
    equal("fp16.auto_cast", "the inputs cast to fp16"),
    equal("fp16.loss_scale", "a static loss scale (0: dynamic)"),
    equal("fp16.initial_scale_power", "the dynamic loss scale's start"),
    equal("fp16.loss_scale_window", "the dynamic loss scale's window"),
    equal("fp16.hysteresis", "the dynamic loss scale's hysteresis"),
    equal("fp16.consecutive_hysteresis", "the dynamic loss scale's hysteresis"),
    equal("fp16.min_loss_scale", "the dynamic loss scale's floor"),
    equal("fp16.fp16_master_weights_and_grads", f"fp16 master weights and gradients ({HALF_STATE_HELD})"),
    equal("torch_autocast.enabled", "torch.autocast around forward, fp32 parameters"),
    refused(
        "torch_autocast.dtype",
        "torch.autocast's dtype; under float16 stock steps each subgroup through torch's GradScaler "
        "(the gradients divided by its scale, which backward never multiplied), not reproduced yet",
        'use "bfloat16", the default',
        lambda v: str(v) in ("float16", "fp16", "half", "torch.float16"),
    ),
    equal("torch_autocast.lower_precision_safe_modules", "torch.autocast's modules"),
    equal("data_types.grad_accum_dtype", "the dtype gradients are accumulated in"),
    equal("data_types.param_dtype", "the model's parameters' dtype"),
    equal("data_types.buffer_dtype", "the model's buffers' dtype"),
    equal("data_types.keep_in_fp32_modules", "buffers kept in fp32"),
    equal("communication_data_type", "the dtype gradients are reduced in"),
    refused(
        "prescale_gradients",
        f"gradients divided before their reduction: {STOCK_FAILS} (with reduce_scatter)",
        "set it to false",
        _true,
    ),
    refused(
        "gradient_predivide_factor",
        f"gradients divided before their reduction: {STOCK_FAILS} (with reduce_scatter)",
        "leave it at 1.0",
        lambda v: float(v) != 1.0,
    ),
    equal("gradient_clipping", "the gradients' norm clipped (DeepSpeed's default 1.0)"),
    equal(f"{OPT}.lr", "CPU Adam's or torch's, per chunk"),
    equal(f"{OPT}.betas", "CPU Adam's or torch's, per chunk"),
    equal(f"{OPT}.eps", "CPU Adam's or torch's, per chunk"),
    equal(f"{OPT}.weight_decay", "CPU Adam's or torch's, per chunk"),
    equal(f"{OPT}.bias_correction", "CPU Adam's or torch's, per chunk"),
    equal(f"{OPT}.adam_w_mode", "CPU Adam's or torch's, per chunk"),
    equal(f"{OPT}.torch_adam", "torch's Adam or AdamW in place of CPU Adam, per chunk"),
    equal(f"{OPT}.fp32_optimizer_states", "CPU Adam's moments in the master weights' dtype (fp32)"),
    refused(f"{OPT}.amsgrad", "a third moment, which the store does not hold", "set it to false", _true),
)

BY_KEY = {option.key: option for option in OPTIONS}

# The optimizers, from the config's `optimizer` or built by the client: whose state the store holds
# (refused by `adapter.zero3`, by their class, when not), and what happens.
OPTIMIZERS: tuple[tuple[str, str], ...] = (
    ("the config's Adam or AdamW (DeepSpeed's CPU Adam)", "bit-equal"),
    ("`DeepSpeedCPUAdam(...)` built by the client", "bit-equal"),
    (
        "`DeepSpeedCPUAdam(fp32_optimizer_states=False)`",
        "bit-equal (moments in the master weights' dtype: bf16 with bf16 master weights)",
    ),
    ("`torch.optim.Adam`, `torch.optim.AdamW` (or `torch_adam`)", "bit-equal"),
    ("`amsgrad: true`", "refused (a third moment)"),
    ("Muon (`optimizer.type`)", "refused (it orthogonalises whole matrices, not elements)"),
    ("any other (SGD, Adagrad, Lamb, 1-bit Adam, ...)", "refused, naming its class"),
)


def _section(config: dict[str, Any], dotted: str) -> dict[str, Any] | None:
    where: Any = config
    for part in dotted.split("."):
        if not isinstance(where, dict):
            return None
        names = [part, *(old for old, new in OLD_NAMES.items() if new == part)]
        where = next((where[name] for name in names if name in where), None)
    return where if isinstance(where, dict) else None


def given(config: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Each key the config sets in the table's sections and at its top level, dotted, with its value."""
    for key, value in config.items():
        if not isinstance(value, dict):
            yield key, value
    for dotted in SECTIONS:
        section = _section(config, dotted)
        for key, value in (section or {}).items():
            if f"{dotted}.{key}" not in SECTIONS:
                yield f"{dotted}.{key}", value


def _field_names() -> dict[str, str]:
    """The field name DeepSpeed's ZeRO config also accepts for a key the table lists by its alias."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {
        f"{Z}.{name}": f"{Z}.{field.alias}"
        for name, field in DeepSpeedZeroConfig.model_fields.items()
        if field.alias and field.alias != name
    }


# The configs checked already (their JSON's digest): the check runs where `deepspeed.initialize` starts
# and again where DeepSpeed builds the optimizer, for callers that bound `initialize` before `install`.
_CHECKED: set[str] = set()


def check(config: dict[str, Any]) -> None:
    """Refuses, naming each key and what to use instead, every option of `config` the table refuses
    (the ZeRO stage unset is 0); warns by name about options it sets that the table does not list."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=repr).encode()).hexdigest()
    if digest in _CHECKED:
        return
    names = _field_names()
    problems, unlisted = [], []
    zero = _section(config, Z)
    settings = list(given(config))
    if zero is None or "stage" not in zero:
        settings.append((f"{Z}.stage", 0))
    for key, value in settings:
        option = BY_KEY.get(names.get(key, key))
        if option is None:
            if "." in key:
                unlisted.append(key)
        elif option.refused is not None and option.refused(value):
            problems.append(
                troubleshooting.OPTION.message(
                    key=key, value=repr(value), what=option.what, instead=option.instead
                )
            )
    if problems:
        raise ValueError("; ".join(problems))
    _CHECKED.add(digest)
    if unlisted:
        log.warning("%s", troubleshooting.UNLISTED_OPTION.message(keys=", ".join(unlisted)))


def markdown() -> str:
    """`docs/options.md`: one line per option."""
    lines = [
        "# DeepSpeed's options with mlp-offload",
        "",
        "Generated from `mlp_offload/adapter/options.py` (`make docs-pages`); "
        "`tests/test_options.py` runs each row against stock DeepSpeed and checks this page. Every option "
        "is bit-equal to stock DeepSpeed with the same option, or refused at start naming the key; none "
        "trains and differs. An option set in these sections that no row lists is named in a warning at "
        "start.",
        "",
        "| option | with mlp-offload | what it is |",
        "|---|---|---|",
    ]
    for option in OPTIONS:
        verdict = "bit-equal" if option.refused is None else f"refused ({option.instead})"
        lines.append(f"| `{option.key}` | {verdict} | {option.what} |")
    lines += ["", "## Optimizers", "", "| optimizer | with mlp-offload |", "|---|---|"]
    lines += [f"| {name} | {verdict} |" for name, verdict in OPTIMIZERS]
    return "\n".join(lines) + "\n"


def refused_options() -> list[Option]:
    """The table's refused rows, in its order."""
    return [option for option in OPTIONS if option.refused is not None]


def _refused_values(option: Option) -> str:
    """The values refused, in words, from what the option row says to use instead."""
    if option.instead.startswith(("leave it at", "set it to", "use ")):
        return "any other value"
    return "any value"


def refusals_markdown() -> list[str]:
    """The troubleshooting page's section of the refused options (its lines, the blank one after it
    included): one row each, every one an `OPTION` refusal of the registry."""
    return [
        "### The refused DeepSpeed options",
        "",
        f"Each is an `{troubleshooting.OPTION.name}` refusal. Every other option is bit-equal to stock "
        "([`options.md`](options.md)).",
        "",
        "| option | refused | why | instead |",
        "|---|---|---|---|",
        *(f"| `{o.key}` | {_refused_values(o)} | {o.what} | {o.instead} |" for o in refused_options()),
        "",
    ]


def _short_key(key: str) -> str:
    key = key.removeprefix(f"{Z}.")
    return "`zenflow.*`" if key.startswith("zenflow.") else f"`{key}`"


def readme_keys() -> list[str]:
    """The refused keys as the README's row of refusals names them: without `zero_optimization.`, in
    backticks, ZenFlow's as one, each once."""
    return list(dict.fromkeys(_short_key(option.key) for option in refused_options()))
