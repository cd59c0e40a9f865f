"""DeepSpeed's options, one at a time: each row of the option table (`mlp_offload.adapter.options`) set
to a value a user would set, stock DeepSpeed against ours. Every row ends bit-equal (each step's loss
and gradient norm, the final fp32 weights, both moments and the half-precision partitions) or refused at
start by an error naming the key; none trains and differs. The table lists every field of DeepSpeed's
config models, and `docs/options.md` is the table rendered."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import ONE_NODE
from deepspeed_runs import assert_bit_equal, run_case, section, stock_param_nvme_fails
from mlp_offload.adapter import options

ROOT = Path(__file__).resolve().parents[1]
Z, OO, OP, OPT = "zero_optimization", options.OO, options.OP, options.OPT
STEPS = 5
# What some rows need besides their option: a checkpoint saved and loaded at step 2; bf16 or fp16 (the
# rest run in fp32: bf16's matrix products are slow on some CPUs).
CHECKPOINT = {"checkpoint_at": 2}
BF16 = {"bf16": True}
FP16 = {"fp16": True}
# Parameters on NVMe: stock's through DeepSpeed's async I/O op where it runs them (`stock_param_nvme_fails`).
PARAMS_ON_NVME = {"offload_param": "nvme"}

# The table's key, the value a user would set, what else the row's case needs, ranks.
ROWS: list[tuple[str, Any, dict[str, Any], int]] = [
    (f"{Z}.stage", 2, {}, 1),
    (f"{Z}.contiguous_gradients", False, {}, 1),
    (f"{Z}.reduce_scatter", False, {}, 2),
    (f"{Z}.reduce_bucket_size", 20_000, {}, 1),
    (f"{Z}.use_multi_rank_bucket_allreduce", False, {}, 2),
    (f"{Z}.allgather_partitions", False, {}, 2),
    (f"{Z}.allgather_bucket_size", 20_000, {}, 1),
    (f"{Z}.overlap_comm", True, {}, 1),
    (f"{Z}.compute_grad_norm", False, {}, 1),
    (f"{Z}.load_from_fp32_weights", False, CHECKPOINT, 1),
    (f"{Z}.elastic_checkpoint", True, {}, 1),
    (f"{Z}.sub_group_size", 5_000, {}, 1),
    (f"{Z}.cpu_offload", True, {"ds_unset": [OO]}, 1),
    (f"{Z}.cpu_offload_param", True, {}, 1),
    (f"{Z}.cpu_offload_use_pin_memory", True, {}, 1),
    (f"{Z}.stage3_prefetch_bucket_size", 20_000, {"persistence_threshold": 0}, 1),
    (f"{Z}.stage3_param_persistence_threshold", 1_000, {}, 1),
    (f"{Z}.stage3_model_persistence_threshold", 20_000, {}, 1),
    (f"{Z}.stage3_max_live_parameters", 20_000, {"persistence_threshold": 0}, 1),
    (f"{Z}.stage3_max_reuse_distance", 0, {"persistence_threshold": 0}, 1),
    (f"{Z}.stage3_gather_16bit_weights_on_model_save", True, {}, 1),
    (f"{Z}.stage3_module_granularity_threshold", 10_000, {"persistence_threshold": 0}, 1),
    (f"{Z}.stage3_use_all_reduce_for_fetch_params", True, {}, 2),
    (f"{Z}.stage3_allgather_sequential", True, {"persistence_threshold": 0}, 1),
    (f"{Z}.stage3_gather_fp16_weights_on_model_save", True, {}, 1),
    (f"{Z}.ignore_unused_parameters", False, {}, 1),
    (f"{Z}.legacy_stage1", True, {}, 1),
    (f"{Z}.round_robin_gradients", True, {}, 1),
    (f"{Z}.parameter_alignment", True, {}, 1),
    (f"{Z}.zero_hpz_partition_size", 2, {}, 2),
    (f"{Z}.zero_quantized_weights", True, {}, 1),
    (f"{Z}.zero_quantized_nontrainable_weights", True, {}, 1),
    (f"{Z}.zero_quantized_gradients", True, {}, 1),
    (f"{Z}.memory_efficient_linear", False, {}, 1),
    (f"{Z}.pipeline_loading_checkpoint", True, CHECKPOINT, 1),
    (f"{Z}.override_module_apply", False, {}, 1),
    (f"{Z}.log_trace_cache_warnings", True, {"persistence_threshold": 0}, 1),
    (f"{Z}.enable_sanity_checks", True, {}, 1),
    (f"{Z}.save_muon_momentum_buffer_in_memory", True, {}, 1),
    (f"{Z}.leaf_module.classes", ["mlp_offload.app.models.Block"], {"persistence_threshold": 0}, 1),
    (f"{Z}.leaf_module.names", ["blocks.0"], {"persistence_threshold": 0}, 1),
    (f"{Z}.leaf_module.name_suffixes", ["1"], {"persistence_threshold": 0}, 1),
    (f"{OO}.device", "none", {}, 1),
    (f"{OO}.nvme_path", "(the row's directory)", {"nvme": True}, 1),
    (f"{OO}.buffer_count", 8, {}, 1),
    (f"{OO}.pin_memory", False, {}, 1),
    (f"{OO}.pipeline_read", True, {}, 1),
    (f"{OO}.pipeline_write", True, {}, 1),
    (f"{OO}.fast_init", True, {}, 1),
    (f"{OO}.ratio", 0.5, {}, 1),
    (f"{OO}.super_offload", True, {}, 1),
    (f"{OO}.cpuadam_cores_perc", 0.5, {}, 1),
    (f"{OP}.device", "cpu", {"persistence_threshold": 0}, 1),
    (f"{OP}.nvme_path", "(the row's directory)", {**PARAMS_ON_NVME, "persistence_threshold": 0}, 1),
    (f"{OP}.buffer_count", 6, {**PARAMS_ON_NVME, "persistence_threshold": 0}, 1),
    (f"{OP}.buffer_size", 50_000, {**PARAMS_ON_NVME, "persistence_threshold": 0}, 1),
    (f"{OP}.max_in_cpu", 100_000_000, {**PARAMS_ON_NVME, "persistence_threshold": 0}, 1),
    (f"{OP}.pin_memory", False, {"offload_param": "cpu", "persistence_threshold": 0}, 1),
    (f"{Z}.zenflow.topk_ratio", 0.05, {}, 1),
    (f"{Z}.zenflow.select_strategy", "step", {}, 1),
    (f"{Z}.zenflow.select_interval", 2, {}, 1),
    (f"{Z}.zenflow.update_interval", 2, {}, 1),
    (f"{Z}.zenflow.overlap_step", True, {}, 1),
    (f"{Z}.zenflow.offload", True, {}, 1),
    (f"{Z}.zenflow.auto_ratio", 0.9, {}, 1),
    (f"{Z}.zenflow.full_warm_up_rounds", 2, {}, 1),
    (f"{Z}.zenflow.pt_reserved_cores_perc", 0.25, {}, 1),
    (f"{Z}.zenflow.steps_per_epoch", 10, {}, 1),
    ("bf16.enabled", True, BF16, 1),
    ("bf16.immediate_grad_update", True, BF16, 1),
    ("bf16.check_grad_overflow", False, BF16, 1),
    ("bf16.bf16_master_weights_and_grads", True, BF16, 1),
    (
        "bf16.bf16_optimizer_states",
        True,
        {**BF16, "ds_options": {"bf16.bf16_master_weights_and_grads": True}},
        1,
    ),
    ("fp16.enabled", True, FP16, 1),
    ("fp16.auto_cast", True, FP16, 1),
    ("fp16.loss_scale", 1024.0, FP16, 1),
    ("fp16.initial_scale_power", 8, FP16, 1),
    ("fp16.loss_scale_window", 100, FP16, 1),
    ("fp16.hysteresis", 1, FP16, 1),
    ("fp16.consecutive_hysteresis", True, FP16, 1),
    ("fp16.min_loss_scale", 8, FP16, 1),
    ("fp16.fp16_master_weights_and_grads", True, FP16, 1),
    ("torch_autocast.enabled", True, {}, 1),
    ("torch_autocast.dtype", "float16", {"ds_options": {"torch_autocast.enabled": True}}, 1),
    (
        "torch_autocast.lower_precision_safe_modules",
        ["torch.nn.modules.linear.Linear"],
        {"ds_options": {"torch_autocast.enabled": True}},
        1,
    ),
    ("data_types.grad_accum_dtype", "fp32", BF16, 1),
    ("data_types.param_dtype", "bf16", BF16, 1),
    ("data_types.buffer_dtype", "fp32", BF16, 1),
    ("data_types.keep_in_fp32_modules", ["ln"], BF16, 1),
    ("communication_data_type", "fp32", BF16, 1),
    ("prescale_gradients", True, {}, 2),
    ("gradient_predivide_factor", 2.0, {}, 2),
    ("gradient_clipping", 0.3, {}, 1),
    (f"{OPT}.lr", 1e-3, {}, 1),
    (f"{OPT}.betas", [0.8, 0.99], {}, 1),
    (f"{OPT}.eps", 1e-6, {}, 1),
    (f"{OPT}.weight_decay", 0.1, {}, 1),
    (f"{OPT}.bias_correction", False, {}, 1),
    (f"{OPT}.adam_w_mode", False, {"ds_options": {"optimizer.type": "Adam"}}, 1),
    (f"{OPT}.torch_adam", True, {"ds_options": {"zero_force_ds_cpu_optimizer": False}}, 1),
    (f"{OPT}.fp32_optimizer_states", False, {}, 1),
    (f"{OPT}.amsgrad", True, {}, 1),
]


def _case(key: str, value: Any, extra: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    case: dict[str, Any] = {k: v for k, v in extra.items() if k not in ("ds_options", "nvme", "bf16")}
    if not extra.get("bf16") and not extra.get("fp16"):
        case["fp32"] = True
    if isinstance(value, str) and value == "(the row's directory)":
        value = str(tmp_path / "nvme")
        Path(value).mkdir()
    if extra.get("nvme"):
        # Ours: DeepSpeed's NVMe section, rewritten for the store (`config.migrate_nvme_offload`).
        case["nvme_path"] = value
    if case.get("offload_param") == "nvme":
        case["param_nvme_path"] = str(tmp_path / "params")
    if "checkpoint_at" in case:
        case["checkpoint_dir"] = str(tmp_path / "checkpoint")
    case["ds_options"] = {**extra.get("ds_options", {}), key: value}
    return {**case, "steps": STEPS}


def test_the_table_lists_every_field_of_deepspeeds_config_models() -> None:
    """Every field of the models DeepSpeed reads these sections with, by the name its docs give (the
    alias where there is one); a field a new DeepSpeed adds fails here until the table has its row."""
    from deepspeed.runtime import constants, precision_config
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig
    from deepspeed.runtime.zero import config, leaf_module_config, offload_config

    models = {
        Z: config.DeepSpeedZeroConfig,
        OO: offload_config.DeepSpeedZeroOffloadOptimizerConfig,
        OP: offload_config.DeepSpeedZeroOffloadParamConfig,
        f"{Z}.zenflow": ZenFlowConfig,
        f"{Z}.leaf_module": leaf_module_config.DeepSpeedZeroLeafModuleConfig,
        "bf16": precision_config.DeepSpeedBF16Config,
        "fp16": precision_config.DeepSpeedFP16Config,
    }
    fields = {
        f"{prefix}.{field.alias or name}"
        for prefix, model in models.items()
        for name, field in model.model_fields.items()
        if f"{prefix}.{field.alias or name}" not in models
    }
    # Read from plain dicts, by the constants DeepSpeed names them with.
    fields |= {
        f"torch_autocast.{getattr(constants, name)}"
        for name in dir(constants)
        if name.startswith("TORCH_AUTOCAST_") and not name.endswith(("_DEFAULT", "_FORMAT"))
    }
    fields |= {
        f"data_types.{getattr(constants, name)}"
        for name in ("GRAD_ACCUM_DTYPE", "PARAM_DTYPE", "BUFFER_DTYPE", "KEEP_IN_FP32_MODULES")
    }
    listed = {option.key for option in options.OPTIONS}
    assert not fields - listed, f"DeepSpeed's fields without a row: {sorted(fields - listed)}"
    others = {
        "communication_data_type",
        "prescale_gradients",
        "gradient_predivide_factor",
        "gradient_clipping",
        *(f"{OPT}.{name}" for name in ("lr", "betas", "eps", "weight_decay", "bias_correction")),
        *(f"{OPT}.{name}" for name in ("adam_w_mode", "torch_adam", "fp32_optimizer_states", "amsgrad")),
    }
    assert listed == fields | others, f"rows of no field: {sorted(listed - fields - others)}"


def test_every_row_of_the_table_is_run() -> None:
    assert [row[0] for row in ROWS] == [option.key for option in options.OPTIONS]


@pytest.mark.parametrize(
    ("key", "value", "extra", "ranks"),
    # Runs of two ranks one at a time, as every test of several ranks on one node.
    [pytest.param(*row, marks=[ONE_NODE] if row[3] > 1 else [], id=f"{row[0]}={row[1]!r}") for row in ROWS],
)
def test_every_option_is_bit_equal_to_stock_or_refused_by_name(
    key: str, value: Any, extra: dict[str, Any], ranks: int, work_dirs: list[Path], tmp_path: Path
) -> None:
    case = _case(key, value, extra, tmp_path)
    option = options.BY_KEY[key]
    ours_section = section(work_dirs[:1], host_memory="200K", update_chunk="24K")
    ours_case = {**case, "mlp_offload": ours_section}
    if "checkpoint_at" in case:
        # The engine built again to load the checkpoint is ours too.
        ours_case["resume_mlp_offload"] = ours_section
    if option.refused is not None and option.refused(case["ds_options"][key]):
        with pytest.raises(AssertionError, match=f"{re.escape(key)}: .*{re.escape(option.instead)}"):
            run_case(ours_case, tmp_path, "ours", ranks=ranks)
        return
    # Stock's NVMe offload agrees with its CPU offload bit for bit; the latter needs no async I/O op.
    stock_case = {k: v for k, v in case.items() if k != "nvme_path"}
    if "nvme_path" in case:
        stock_case["ds_options"] = {k: v for k, v in case["ds_options"].items() if k != key}
    if case.get("offload_param") == "nvme" and stock_param_nvme_fails(case):
        # So do its parameters' (ours needs no async I/O op: `param_swapper`).
        stock_case["offload_param"] = "cpu"
    stock = run_case(stock_case, tmp_path, "stock", ranks=ranks)
    ours = run_case(ours_case, tmp_path, "ours", ranks=ranks)
    assert ours["optimizer_class"] == "mlp_offload.adapter.zero3.MLPOffloadStage3"
    for a, b in zip(ours.get("ranks", [ours]), stock.get("ranks", [stock]), strict=True):
        assert_bit_equal(a, b)


def test_the_options_page_is_the_table() -> None:
    assert (ROOT / "docs" / "options.md").read_text() == options.markdown(), (
        "docs/options.md differs from the table: `make docs-pages`"
    )


# The config (beside a ZeRO-3 CPU offload section), what the check says: the error's words, or None;
# the warning's keys, or None.
CHECKS: list[tuple[str, dict[str, Any], str | None, list[str] | None]] = [
    ("the README's config", {}, None, None),
    (
        "a field DeepSpeed added after the table",
        {Z: {"stage": 3, "new_knob": 1}, "bf16": {"enabled": True, "newer": 2}},
        None,
        [f"{Z}.new_knob", "bf16.newer"],
    ),
    ("a key by its field name", {Z: {"stage": 3, "param_persistence_threshold": 0}}, None, None),
    ("bf16 by its old name", {"bfloat16": {"enabled": True, "new_knob": 2}}, None, ["bf16.new_knob"]),
    (
        "two refused at once",
        {
            Z: {
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "super_offload": True},
                "elastic_checkpoint": True,
            },
        },
        r"elastic_checkpoint: True: .*super_offload: True",
        None,
    ),
    (
        "the top level's other keys are not ours",
        {"train_batch_size": 4, "wall_clock_breakdown": True},
        None,
        None,
    ),
]


@pytest.mark.parametrize(("config", "error", "warned"), [c[1:] for c in CHECKS], ids=[c[0] for c in CHECKS])
def test_the_check_refuses_and_warns_by_name(
    config: dict[str, Any], error: str | None, warned: list[str] | None, caplog: pytest.LogCaptureFixture
) -> None:
    base: dict[str, Any] = {Z: {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "mlp_offload": {}}
    config = {**base, **config}
    if error is not None:
        with pytest.raises(ValueError, match=error):
            options.check(config)
        return
    with caplog.at_level(logging.WARNING, logger="mlp_offload"):
        options.check(config)
    messages = [r.getMessage() for r in caplog.records]
    if warned is None:
        assert not messages, messages
    else:
        assert len(messages) == 1 and all(key in messages[0] for key in warned), messages


@pytest.mark.parametrize("stage", [None, 0, 1, 2])
def test_a_section_under_another_stage_than_3_is_refused(stage: int | None) -> None:
    zero = {} if stage is None else {"stage": stage}
    with pytest.raises(ValueError, match=rf"{Z}\.stage: {stage or 0}: .* set it to 3"):
        options.check({Z: zero, "mlp_offload": {}})


# An optimizer as the client builds it or the config names it, and the error that refuses it (None:
# bit-equal). Torch's SGD, Adagrad and amsgrad are refused in `test_refusals.py`.
OPTIMIZER_ROWS: list[tuple[str, dict[str, Any], str | None]] = [
    ("DeepSpeedCPUAdam built by the client", {"client_optimizer": "DeepSpeedCPUAdam"}, None),
    (
        "DeepSpeedCPUAdam(fp32_optimizer_states=False)",
        {"client_optimizer": "DeepSpeedCPUAdam", "client_options": {"fp32_optimizer_states": False}},
        None,
    ),
    ("Muon from the config", {"ds_options": {"optimizer.type": "Muon"}}, r"the optimizer is \S*Muon"),
]


@pytest.mark.parametrize(
    ("case", "error"), [r[1:] for r in OPTIMIZER_ROWS], ids=[r[0] for r in OPTIMIZER_ROWS]
)
def test_every_optimizer_is_bit_equal_to_stock_or_refused_by_name(
    case: dict[str, Any], error: str | None, work_dirs: list[Path], tmp_path: Path
) -> None:
    case = {**case, "fp32": True, "steps": STEPS}
    ours_case = {**case, "mlp_offload": section(work_dirs[:1], host_memory="200K", update_chunk="24K")}
    if error is not None:
        with pytest.raises(AssertionError, match=error):
            run_case(ours_case, tmp_path, "ours")
        return
    stock = run_case(case, tmp_path, "stock")
    assert_bit_equal(run_case(ours_case, tmp_path, "ours"), stock)
