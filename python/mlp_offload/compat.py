"""What the engine takes from DeepSpeed's internals, and whether the installed DeepSpeed still has it.

`MLPOffloadStage3` mirrors DeepSpeed's `step`, overrides its hooks and reads private attributes. A
DeepSpeed release that changes one of those methods can break training without any error, so the
source of every DeepSpeed function the engine depends on is fingerprinted here, for the versions we
tested. A function counts as coupled when
- the engine overrides it (any method of `DeepSpeedZeroOptimizer_Stage3` that `MLPOffloadStage3`
  defines again),
- it touches the state the engine replaces (`REPLACED_STATE`: the fp32 partitions, the NVMe swapper,
  the gradient partitions we read in half precision), or
- the engine calls or wraps it (`CALLED`).

`tests/test_compat.py` fails naming each function whose source differs from `FINGERPRINTS`, and each
function that became coupled or stopped existing. `install()` warns once, naming the tested versions
and what changed, when the installed DeepSpeed is not one of them. After reviewing a new release
against the engine, `python -m mlp_offload.compat` prints the table for it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
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
    "deepspeed.runtime.utils.combine_grad_norm_groups",
    "deepspeed.runtime.utils.is_invalid_grad_norm",
    "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam.step",
    f"{STAGE3}._pre_step",
    f"{STAGE3}._partition_all_parameters",
    f"{STAGE3}._overflow_check_and_loss_scale_update",
    f"{STAGE3}._apply_muon_to_accumulated_grads",
    f"{STAGE3}._get_norm_groups",
    f"{STAGE3}._loss_scale_update_and_overflow_cleanup",
    f"{STAGE3}._muon_update_lacks_loss_scale",
    f"{STAGE3}._unflatten_partitioned_parameters",
)

# Source digests (`source_digest`) in DeepSpeed 0.19.8 by module or class: `python -m mlp_offload.compat`.
FINGERPRINTS: dict[str, dict[str, str]] = {
    "deepspeed": {
        "initialize": "41f9f099fcf91927",
    },
    "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam": {
        "step": "5087412e98e777fd",
    },
    "deepspeed.runtime.engine.DeepSpeedEngine": {
        "_configure_zero_optimizer": "bfb60fb6e6da4b0d",
    },
    "deepspeed.runtime.utils": {
        "combine_grad_norm_groups": "7370916933ac5353",
        "is_invalid_grad_norm": "f51bdb9f619ef5ce",
    },
    "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3": {
        "__init__": "4b6abf3c50e9fc10",
        "_apply_muon_to_accumulated_grads": "d954d2fe3471298e",
        "_apply_muon_updates_cpu_offload": "8118febb849edc15",
        "_configure_tensor_swapping": "75cdf5844dab6e8b",
        "_create_fp32_partitions": "8f0c20d2a0401373",
        "_create_momentum_buffer": "73b905aad5b39a95",
        "_create_next_swappable_fp32_groups": "705dd786c215de40",
        "_finalize_offload_gradient_accumulation": "679a033b22b124c6",
        "_get_fp32_grad_state_partition": "9f3326d625e452d2",
        "_get_fp32_opt_state_partition": "d5834f46b354478b",
        "_get_norm_groups": "1b079baf0be23588",
        "_load_universal_checkpoint": "fec6ca7534cae19f",
        "_loss_scale_update_and_overflow_cleanup": "a1ab8e3aaf592733",
        "_muon_update_lacks_loss_scale": "08b25bd2e9a6360a",
        "_muon_update_sub_group": "c85eade90d620092",
        "_offload_grad_partition_at_boundary": "9eea82cddee25fcf",
        "_optimizer_states_and_gradient_swap_in": "9217e565c565cf1b",
        "_optimizer_states_and_gradient_swap_out": "20c4b187b8104001",
        "_optimizer_step": "fe3c9c5813087a7e",
        "_overflow_check_and_loss_scale_update": "75ae5dc07e50d82f",
        "_partition_all_parameters": "6a228b8ffd8d1d2a",
        "_partitioned_params_swap_out": "c5c303eef9fec897",
        "_post_step": "d32eb3074137fe09",
        "_pre_step": "0c1a34ee0d5aa289",
        "_prepare_fp32_grad_for_sub_group": "7d2ddddfd8ac5db8",
        "_prepare_sub_group": "35d806f141e97e29",
        "_reassign_or_swap_out_partitioned_parameters": "082dcb44891af112",
        "_release_sub_group": "ebde3fca8c27c118",
        "_release_swap_buffers": "5412d32b35aed693",
        "_restore_from_bit16_weights": "1718f9402185bd7d",
        "_restore_from_fp32_weights": "825235a7cef62e6c",
        "_rigid_load_state_dict": "2b97ce59ae021ead",
        "_rigid_state_dict": "48159e8608c0c04e",
        "_set_fp32_optimizer_param_groups": "b0a65c6a9daaac95",
        "_setup_for_real_optimizer": "0230b3e769765e67",
        "_swap_out_offload_fp32_gradients": "43cdf51198b9b385",
        "_swappable_optimizer_subgroup": "1fc1bd378f910a35",
        "_unflatten_partitioned_parameters": "959c6cf88351736b",
        "_unpin_offload_buffers": "a74a779f60c7e31e",
        "_writeback_swap_state": "b7a51fa23d2eb809",
        "backward_epilogue": "397edbcb0c479657",
        "backward_prologue": "dd6ca84ba0590ab6",
        "destroy": "6c7cbd9ed9427cdd",
        "dump_post_step_gradients": "605883eef8864c6e",
        "finalize_gradient_accumulation_boundary": "9d0d316d73eb6757",
        "get_fp32_grad_partitions": "a8407290c490ca7f",
        "independent_gradient_partition_epilogue": "9c0c44e4909c417e",
        "initialize_optimizer_states": "7c4649dc4a9bfc60",
        "load_hp_checkpoint_state_from_checkpoint_dir_stage3": "cc48e84b25bc0929",
        "load_module_checkpoint_state_from_checkpoint_dir_stage3": "021d07edd150881d",
        "offload_states": "af6ca5a1a3c232f0",
        "partition_grads": "ef0ab1c41f74894c",
        "reload_states": "85f04a613c593107",
        "set_fp32_grad_for_param": "43528c474dc6d43b",
        "set_full_hp_param": "fe22f137100f4617",
        "set_local_grad_for_param": "c3c133f6a43d3934",
        "set_local_hp_param": "869b05d1c3458597",
        "state_dict": "c8276bc1d97b1c2c",
        "step": "588aaf2c337d5634",
        "unscale_and_clip_grads": "0fe1c92e67ff4e17",
        "update_fp32_grad_for_param_vectorized": "74243a52d353d4e1",
    },
}


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


def _definitions(module: Any) -> tuple[str, ast.Module]:
    source = inspect.getsource(module)
    return source, ast.parse(source)


def source_of(name: str) -> str | None:
    """The source of a function or method (decorators included) as its module defines it, found by
    name in the module's syntax tree (DeepSpeed's decorators do not all keep `__wrapped__`), or None when
    it is not defined there."""
    found = _module_and_path(name)
    if found is None:
        return None
    module, path = found
    source, tree = _definitions(module)
    body: list[ast.stmt] = tree.body
    node: ast.stmt | None = None
    for i, part in enumerate(path):
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if i == len(path) - 1 else (ast.ClassDef,)
        node = next((n for n in body if isinstance(n, kinds) and n.name == part), None)
        if node is None:
            return None
        body = getattr(node, "body", [])
    assert node is not None
    segment = ast.get_source_segment(source, node)
    decorators = "".join(
        f"@{ast.get_source_segment(source, d)}\n" for d in getattr(node, "decorator_list", [])
    )
    return decorators + textwrap.dedent(" " * node.col_offset + (segment or ""))


def source_digest(name: str) -> str | None:
    """A digest of the function's source, or None when it is not defined where named."""
    source = source_of(name)
    return None if source is None else hashlib.sha256(source.encode()).hexdigest()[:16]


def _touching_replaced_state() -> list[str]:
    """The methods of DeepSpeed's ZeRO-3 optimizer whose source names a `REPLACED_STATE` attribute."""
    module_name, class_name = STAGE3.rsplit(".", 1)
    source, tree = _definitions(importlib.import_module(module_name))
    found = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for method in node.body:
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    text = ast.get_source_segment(source, method) or ""
                    if any(attr in text for attr in REPLACED_STATE):
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
    return sorted(set(overridden) | set(_touching_replaced_state()) | set(CALLED))


def differences(engine: type) -> dict[str, str]:
    """Coupled function -> what differs from `FINGERPRINTS`: "changed", "gone" or "newly coupled"."""
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
    from mlp_offload.zero3 import MLPOffloadStage3

    print("FINGERPRINTS: dict[str, dict[str, str]] = {")
    owner = None
    for name in coupled_functions(MLPOffloadStage3):
        name_owner, member = name.rsplit(".", 1)
        if name_owner != owner:
            print("    }," if owner else "", f'    "{name_owner}": {{', sep="\n" if owner else "")
            owner = name_owner
        print(f'        "{member}": "{source_digest(name)}",')
    print("    },\n}")


if __name__ == "__main__":
    main()
