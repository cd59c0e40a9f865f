"""What the engine takes from DeepSpeed's internals, and whether the installed DeepSpeed still has it.

`MLPOffloadStage3` mirrors DeepSpeed's `step`, overrides its hooks and reads private attributes. A
DeepSpeed release that changes one of those methods can break training without any error, so the
source of every DeepSpeed function the engine depends on is fingerprinted here, for the versions we
tested. A function counts as coupled when
- the engine overrides it (any method of `DeepSpeedZeroOptimizer_Stage3` that `MLPOffloadStage3`
  defines again),
- it touches the state the engine replaces (`REPLACED_STATE`: the fp32 partitions, the NVMe swapper,
  the gradient partitions we read in half precision), or
- the engine calls or wraps it (`CALLED`), or
- it sets a member that the helpers' narrow view of DeepSpeed reads (`deepspeed_view.ATTRIBUTES`), or the
  view calls it (`deepspeed_view.METHODS`).

The fused update kernel (`crates/mlp-offload-core/src/kernel/`) mirrors DeepSpeed's C++ CPU Adam, so
the files it was written from are fingerprinted too (`MIRRORED_SOURCES`). (Its start-up check compares
its bits with DeepSpeed's kernel on every run, and falls back to DeepSpeed's when they differ; this says
which file to read when they do.)

`tests/test_compat.py` fails naming each function whose source differs from `FINGERPRINTS`, and each
function that became coupled or stopped existing. `install()` warns once, naming the tested versions
and what changed, when the installed DeepSpeed is not one of them. After reviewing a new release
against the engine, `python -m mlp_offload.adapter.compat` prints the table for it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import os
import textwrap
import warnings
from typing import Any

# DeepSpeed releases the engine was tested with (the bit-exact tables and DeepSpeed's own suite).
TESTED_DEEPSPEED = ("0.19.8",)
# The minor series the engine is written for; others are refused (`integration.install`).
SUPPORTED_SERIES = "0.19."

STAGE3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
# Attributes of DeepSpeed's ZeRO-3 optimizer whose contents the engine replaces: a method that touches
# one sees our state, not DeepSpeed's, and must still do the right thing with it.
REPLACED_STATE = (
    "fp32_partitioned_groups_flat",
    "optimizer_swapper",
    "_swappable_optimizer_subgroup",
    "__param_id_to_grad_partition",
)
# Functions the engine calls, or wraps, by name (outside the overridden and state-touching methods).
CALLED = (
    "deepspeed.initialize",
    "deepspeed.runtime.engine.DeepSpeedEngine._configure_zero_optimizer",
    "deepspeed.runtime.engine.DeepSpeedEngine._load_zero_checkpoint",
    # Each step's figures to DeepSpeed's monitors at its sample count, after its step (`monitors`), and
    # the update's parts among its step timers (`wall_clock_breakdown`).
    "deepspeed.runtime.engine.DeepSpeedEngine._take_model_step",
    "deepspeed.monitor.monitor.MonitorMaster.write_events",
    "deepspeed.monitor.config.get_monitor_config",
    "deepspeed.utils.timer.SynchronizedWallClockTimer.log",
    "deepspeed.utils.timer.SynchronizedWallClockTimer.get_mean",
    "deepspeed.runtime.utils.combine_grad_norm_groups",
    "deepspeed.runtime.utils.is_invalid_grad_norm",
    "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam.step",
    f"{STAGE3}._pre_step",
    f"{STAGE3}._load_global_state_stage3",
    f"{STAGE3}.load_hp_checkpoint_state",
    f"{STAGE3}._partition_all_parameters",
    f"{STAGE3}._overflow_check_and_loss_scale_update",
    f"{STAGE3}._apply_muon_to_accumulated_grads",
    # The boundary's gradient norms, mirrored with a scratch tensor (`_mlp_grad_norm`).
    f"{STAGE3}._constant_buffered_norm2",
    "deepspeed.runtime.zero.utils.get_norm_dtype",
    f"{STAGE3}._get_norm_groups",
    f"{STAGE3}._loss_scale_update_and_overflow_cleanup",
    f"{STAGE3}._muon_update_lacks_loss_scale",
    f"{STAGE3}._unflatten_partitioned_parameters",
    # The update behind step(): every gather goes through a parameter's `all_gather`/`_coalesced`
    # (attached here, wrapped by the engine), the coordinator gathers a list through its first member's,
    # and releases every parameter, persistent ones too, at the step's start.
    "deepspeed.runtime.zero.partition_parameters.Init._convert_to_deepspeed_param",
    "deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator."
    "__all_gather_params_",
    "deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator."
    "release_and_reset_all",
    # A module's forward that reads another module's parameter while it is partitioned gathers it there
    # and makes it one of its own external parameters, which the fetch trace then expects: why every
    # forward starts with the persistent parameters partitioned (`_mlp_persistent_left_to_the_forward`).
    "deepspeed.runtime.zero.parameter_offload.ZeROOrderedDict.__getitem__",
)

# Source digests (`source_digest`) in DeepSpeed 0.19.8 by module or class:
# `python -m mlp_offload.adapter.compat`.
FINGERPRINTS: dict[str, dict[str, str]] = {
    "deepspeed": {
        "initialize": "82505af39fb2e68e",
    },
    "deepspeed.monitor.config": {
        "get_monitor_config": "b1a98827aff81dbc",
    },
    "deepspeed.monitor.monitor.MonitorMaster": {
        "write_events": "e2bc9f28bace2e8f",
    },
    "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam": {
        "step": "a294a6fcd8f2b9ca",
    },
    "deepspeed.runtime.engine.DeepSpeedEngine": {
        "_configure_zero_optimizer": "2865a9d0327716e7",
        "_load_zero_checkpoint": "178566fb831f64e6",
        "_take_model_step": "b5e1145cf37b0f2a",
    },
    "deepspeed.runtime.utils": {
        "combine_grad_norm_groups": "37a114f1037dc520",
        "is_invalid_grad_norm": "6afd483e2c88e25e",
    },
    "deepspeed.runtime.zero.parameter_offload.ZeROOrderedDict": {
        "__getitem__": "2e025aef27af87fc",
    },
    "deepspeed.runtime.zero.partition_parameters.Init": {
        "_convert_to_deepspeed_param": "109d5ce0cfbc889c",
    },
    "deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator": {
        "__all_gather_params_": "a42800097d2e0851",
        "release_and_reset_all": "40a4b2424248f246",
    },
    "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3": {
        "__init__": "cd4b2ccda90d4f45",
        "_apply_muon_to_accumulated_grads": "b267fa92278f2641",
        "_apply_muon_updates_cpu_offload": "8bf7b89176bda107",
        "_configure_tensor_swapping": "9e0f9f50413098ff",
        "_constant_buffered_norm2": "6feb2ed6e42555fd",
        "_create_fp32_partitions": "867e41591b0a1c57",
        "_create_momentum_buffer": "8186c5a29fe28725",
        "_create_next_swappable_fp32_groups": "350d3278248814c8",
        "_finalize_offload_gradient_accumulation": "eacb35ddd70414c5",
        "_get_fp32_grad_state_partition": "3de05026991c2244",
        "_get_fp32_opt_state_partition": "d3f911190262b0be",
        "_get_norm_groups": "ece0a2b4a699826c",
        "_load_global_state_stage3": "eeaca9afc3ffb4b4",
        "_load_universal_checkpoint": "d312327ea9d00cda",
        "_loss_scale_update_and_overflow_cleanup": "01d06a8c6fb45da7",
        "_muon_update_lacks_loss_scale": "6b43590e899a9238",
        "_muon_update_sub_group": "5ccd645108e1cd1d",
        "_offload_grad_partition_at_boundary": "f03c6a33201a054c",
        "_optimizer_states_and_gradient_swap_in": "6c1ce179c5aab507",
        "_optimizer_states_and_gradient_swap_out": "f2a4ae0e3c6fa4fd",
        "_optimizer_step": "fa43626f0a6e5c54",
        "_overflow_check_and_loss_scale_update": "6b954b254505749b",
        "_partition_all_parameters": "a146f85c0b0c9f85",
        "_partitioned_params_swap_out": "c7b3a46bd85fdfb5",
        "_post_step": "feaee230b6a1ce67",
        "_pre_step": "b4b52433b28df485",
        "_prepare_fp32_grad_for_sub_group": "1697b83f64237c07",
        "_prepare_sub_group": "ca57568ad86bd254",
        "_reassign_or_swap_out_partitioned_parameters": "0caffa936674edf2",
        "_release_sub_group": "31475e7f11762f3e",
        "_release_swap_buffers": "eac8892b5f8f1556",
        "_restore_from_bit16_weights": "8a4431d160dc5632",
        "_restore_from_fp32_weights": "c169b990d4cf263e",
        "_rigid_load_state_dict": "77da80dc68ede0da",
        "_rigid_state_dict": "04afcb774be0650c",
        "_set_fp32_optimizer_param_groups": "995f8b1c4f323f5a",
        "_setup_for_real_optimizer": "6c8852daaf78362f",
        "_swap_out_offload_fp32_gradients": "9f4f18433f6e7cf9",
        "_swappable_optimizer_subgroup": "062115394dd24df6",
        "_unflatten_partitioned_parameters": "7a42ba4d6bdb9f0c",
        "_unpin_offload_buffers": "8a6c76574d121b2d",
        "_writeback_swap_state": "b3b4e0f00b23f8d3",
        "backward_epilogue": "0b55028b62dba4f0",
        "backward_prologue": "1b9ad8d1a8a7864c",
        "checkpoint_event_epilogue": "2b1042907cf22895",
        "checkpoint_event_prologue": "d32f3d66bf433689",
        "destroy": "1c8f6a96609fe60e",
        "dump_post_step_gradients": "c8959c2d90285817",
        "finalize_gradient_accumulation_boundary": "46cb396087b90926",
        "get_fp32_grad_partitions": "60a7178eaa06cdb2",
        "get_param_id": "45790ba1d04f6ad4",
        "independent_gradient_partition_epilogue": "e8bc243cb6b99135",
        "initialize_optimizer_states": "055673a537e1e98f",
        "load_hp_checkpoint_state": "d4d9b0cabd2d7c14",
        "load_hp_checkpoint_state_from_checkpoint_dir_stage3": "461ec0c7c73fcd93",
        "load_module_checkpoint_state_from_checkpoint_dir_stage3": "715152efb90ba6c4",
        "offload_states": "d54d61eee6e39303",
        "partition_grads": "3ca6b17c5709c583",
        "reload_states": "c35ef217d1d7c5e1",
        "set_fp32_grad_for_param": "a971d5e687b1b501",
        "set_full_hp_param": "979c00565b832f1d",
        "set_local_grad_for_param": "18e616a14341bbc7",
        "set_local_hp_param": "70de41c6023731ab",
        "state_dict": "1bbb464edd904376",
        "step": "1dfecf4f2fb70970",
        "unscale_and_clip_grads": "f91e4807114004ae",
        "update_fp32_grad_for_param_vectorized": "6e3c184dd41765ec",
    },
    "deepspeed.runtime.zero.utils": {
        "get_norm_dtype": "0689d2a104ef0dfe",
    },
    "deepspeed.utils.timer.SynchronizedWallClockTimer": {
        "get_mean": "fa84335122445bb0",
        "log": "f5f7012dea4b9194",
    },
}


# The C++ of DeepSpeed's CPU Adam that the fused kernel mirrors (`Step_AVX`, its scalar tail,
# `IncrementStep`, `update_state`), under the `deepspeed` package: file digests in DeepSpeed 0.19.8.
MIRRORED_SOURCES: dict[str, str] = {
    "ops/csrc/includes/cpu_adam.h": "d269bd3a7adcd2b6",
    "ops/csrc/adam/cpu_adam_impl.cpp": "b9f44e950995ad05",
    "ops/csrc/includes/simd.h": "525321614f3f817d",
}


def file_digest(relative: str) -> str | None:
    """A digest of a file of the installed `deepspeed` package, or None when it has no such file."""
    import deepspeed

    path = os.path.join(os.path.dirname(deepspeed.__file__), relative)
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except FileNotFoundError:
        return None


def fingerprints() -> dict[str, str]:
    """`FINGERPRINTS` by dotted name."""
    return {
        f"{owner}.{member}": digest
        for owner, table in FINGERPRINTS.items()
        for member, digest in table.items()
    }


class DeepSpeedVersionWarning(UserWarning):
    """The installed DeepSpeed is not a version mlp-offload was tested with."""


def _module_and_path(name: str) -> tuple[Any, list[str]] | None:
    """The longest importable module prefix of a dotted name, and the rest of it."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            return importlib.import_module(".".join(parts[:split])), parts[split:]
        except ImportError:
            continue
    return None


@functools.cache
def _definitions(module: Any) -> tuple[list[str], ast.Module]:
    """A module's source lines and syntax tree (read once: the ZeRO-3 module is long)."""
    source = inspect.getsource(module)
    return source.splitlines(keepends=True), ast.parse(source)


def _text(lines: list[str], node: ast.stmt) -> str:
    """A definition's source, decorators included, indentation removed."""
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return textwrap.dedent("".join(lines[first - 1 : node.end_lineno]))


def source_of(name: str) -> str | None:
    """The source of a function or method (decorators included) as its module defines it, found by
    name in the module's syntax tree (DeepSpeed's decorators do not all keep `__wrapped__`), or None when
    it is not defined there."""
    found = _module_and_path(name)
    if found is None:
        return None
    module, path = found
    lines, tree = _definitions(module)
    body: list[ast.stmt] = tree.body
    node: ast.stmt | None = None
    for i, part in enumerate(path):
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if i == len(path) - 1 else (ast.ClassDef,)
        node = next((n for n in body if isinstance(n, kinds) and n.name == part), None)
        if node is None:
            return None
        body = getattr(node, "body", [])
    assert node is not None
    return _text(lines, node)


def source_digest(name: str) -> str | None:
    """A digest of the function's source, or None when it is not defined where named."""
    source = source_of(name)
    return None if source is None else hashlib.sha256(source.encode()).hexdigest()[:16]


def _touching_replaced_state() -> list[str]:
    """The methods of DeepSpeed's ZeRO-3 optimizer whose source names a `REPLACED_STATE` attribute."""
    module_name, class_name = STAGE3.rsplit(".", 1)
    lines, tree = _definitions(importlib.import_module(module_name))
    found = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for method in node.body:
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if any(attr in _text(lines, method) for attr in REPLACED_STATE):
                        found.append(f"{STAGE3}.{method.name}")
    return found


def _setting_viewed_members() -> list[str]:
    """The methods of DeepSpeed's ZeRO-3 optimizer that assign a member the view reads (`self.<member> =`,
    or an annotated assignment), and the view's methods that DeepSpeed's class defines."""
    # Imported here: the view imports torch, and the versions above are read where torch need not load
    # (`mlp-offload doctor`).
    from mlp_offload.adapter import deepspeed_view

    module_name, class_name = STAGE3.rsplit(".", 1)
    _, tree = _definitions(importlib.import_module(module_name))
    viewed = set(deepspeed_view.ATTRIBUTES)
    found = []
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name == class_name):
            continue
        for method in node.body:
            if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if method.name in deepspeed_view.METHODS or any(
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
                and target.attr in viewed
                for assign in ast.walk(method)
                if isinstance(assign, (ast.Assign, ast.AnnAssign))
                for target in (assign.targets if isinstance(assign, ast.Assign) else [assign.target])
            ):
                found.append(f"{STAGE3}.{method.name}")
    return found


def coupled_functions(engine: type) -> list[str]:
    """Every DeepSpeed function `engine` (a subclass of DeepSpeed's ZeRO-3 optimizer) depends on."""
    module_name, class_name = STAGE3.rsplit(".", 1)
    stock = getattr(importlib.import_module(module_name), class_name)
    overridden = [
        f"{STAGE3}.{name}"
        for name, value in vars(engine).items()
        if callable(value) and not name.startswith("_mlp") and name in vars(stock)
    ]
    coupled = set(overridden) | set(_touching_replaced_state()) | set(CALLED) | set(_setting_viewed_members())
    return sorted(coupled)


def differences(engine: type) -> dict[str, str]:
    """Function -> how it differs from `FINGERPRINTS`: "changed", "gone", "newly coupled" (coupled
    now, not fingerprinted) or "no longer coupled" (fingerprinted, no longer coupled)."""
    found: dict[str, str] = {}
    known = fingerprints()
    coupled = coupled_functions(engine)
    for name in coupled:
        digest = source_digest(name)
        if digest is None:
            found[name] = "gone"
        elif name not in known:
            found[name] = "newly coupled"
        elif digest != known[name]:
            found[name] = "changed"
    for name in known.keys() - set(coupled):
        found[name] = "gone" if source_digest(name) is None else "no longer coupled"
    for relative, known_digest in MIRRORED_SOURCES.items():
        digest = file_digest(relative)
        if digest != known_digest:
            found[f"deepspeed/{relative}"] = "gone" if digest is None else "changed"
    return found


def check_deepspeed(version: str, engine: type) -> None:
    """Warns, once per process, when `version` is not one the engine was tested with, naming the tested
    versions and every coupled function that differs from them."""
    global _warned
    if version in TESTED_DEEPSPEED or _warned:
        return
    _warned = True
    changed = differences(engine)
    detail = (
        "; of the DeepSpeed code the engine mirrors, overrides or calls, these differ: "
        + ", ".join(f"{name.removeprefix('deepspeed.')} ({why})" for name, why in sorted(changed.items()))
        if changed
        else "; none of the DeepSpeed code the engine mirrors, overrides or calls differs"
    )
    warnings.warn(
        DeepSpeedVersionWarning(
            f"mlp-offload was tested with DeepSpeed {', '.join(TESTED_DEEPSPEED)}; "
            f"this is {version}{detail}. Check a few steps against stock DeepSpeed before relying on it."
        ),
        stacklevel=3,
    )


_warned = False


def main() -> None:
    """Prints `FINGERPRINTS` for the installed DeepSpeed."""
    from mlp_offload.adapter.zero3 import MLPOffloadStage3

    print("FINGERPRINTS: dict[str, dict[str, str]] = {")
    owner = None
    for name in coupled_functions(MLPOffloadStage3):
        name_owner, member = name.rsplit(".", 1)
        if name_owner != owner:
            print("    }," if owner else "", f'    "{name_owner}": {{', sep="\n" if owner else "")
            owner = name_owner
        print(f'        "{member}": "{source_digest(name)}",')
    print("    },\n}")
    print("MIRRORED_SOURCES: dict[str, str] = {")
    for relative in MIRRORED_SOURCES:
        print(f'    "{relative}": "{file_digest(relative)}",')
    print("}")


if __name__ == "__main__":
    main()
