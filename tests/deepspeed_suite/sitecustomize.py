"""Loaded by Python itself in every process of DeepSpeed's test suite when the harness (`run.py`) puts
this directory on PYTHONPATH: the pytest process and each rank that `DistributedTest` spawns, where
pytest plugins and conftest hooks do not run.

`MLP_OFFLOAD_DS_SUITE` says what to do:
- `stock`: nothing changes in DeepSpeed; every ZeRO optimizer built is recorded.
- `ours`: `mlp_offload.install()`, and every ZeRO stage-3 engine whose optimizer is offloaded gets an
  `mlp_offload` section (its own store directory), then is recorded the same way, so the harness can
  prove that each case built our engine. A `zero.Init` whose config puts the parameters on NVMe with the
  optimizer offloaded gets the same section (the directory of the engine built next), so that its
  partitions go through our swapper, as a user's do who adds the section to the config both take.
Both modes mend two things in the suite's own code, the same way, so that the cases compare:
- 0.19.8's engine has no `sparse_tensor_module_names`, which the checkpoint tests compare (the snapshot is
  older); it is compared only where both engines have it.
- `unit.common.reduce_boolean_flags` (under `allclose_on_all_ranks`) makes its tensor on
  `get_accelerator().current_device()`, which DeepSpeed's CPU accelerator answers with LOCAL_RANK as a
  string ("0"), a device torch refuses: on the CPU accelerator every case comparing through it failed,
  stock and ours alike ("Invalid device string: '0'"), after its comparison had run. There the flags go
  on the CPU, one element each (gloo's all-gather takes no 0-dimensional tensor).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

MODE = os.environ.get("MLP_OFFLOAD_DS_SUITE")
RECORDS = os.environ.get("MLP_OFFLOAD_DS_SUITE_RECORDS", "")
STORES = os.environ.get("MLP_OFFLOAD_DS_SUITE_STORES", "")
# The running case's node id, written by the plugin: rank processes forked from DeepSpeed's long-lived
# forkserver do not see the pytest process's later environment.
CURRENT_CASE = os.environ.get("MLP_OFFLOAD_DS_SUITE_CURRENT", "")
# The optimizer's offload devices whose configs our engine takes (`nvme`: the state goes to our store).
OUR_DEVICES = ("cpu", "nvme")


_engines_built = 0


def _record(entry: dict[str, Any]) -> None:
    with open(CURRENT_CASE) as f:
        case = f.read()
    entry = {"case": case, "mode": MODE, "pid": os.getpid(), **entry}
    with open(os.path.join(RECORDS, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")


def _store() -> str:
    """The store directory of the engine built next: one per engine of a process (a checkpoint test
    holds two at once); the same names in every case, emptied between cases, so the probe's saved
    profile applies."""
    store = os.path.join(STORES, f"engine{_engines_built}")
    os.makedirs(store, exist_ok=True)
    return store


def _with_section(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of `config` with our section, on the store of the engine built next (the test's own dict
    stays as it wrote it)."""
    return {**config, "mlp_offload": {"paths": [_store()]}}


def _offload_device(zero: dict[str, Any], key: str) -> str:
    device = (zero.get(key) or {}).get("device") or "none"
    return str(getattr(device, "value", device))


def _patch_zero_init(partition_parameters: ModuleType) -> None:
    init = partition_parameters.Init.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("config_dict_or_path")
        zero = config.get("zero_optimization", {}) if isinstance(config, dict) else {}
        if (
            isinstance(config, dict)
            and MODE == "ours"
            and _offload_device(zero, "offload_param") == "nvme"
            and _offload_device(zero, "offload_optimizer") in OUR_DEVICES
        ):
            kwargs["config_dict_or_path"] = _with_section(config)
        init(self, *args, **kwargs)

    partition_parameters.Init.__init__ = __init__


def _param_swapper(engine: Any) -> str | None:
    """The class of the swapper of the engine's parameters on NVMe, None where none is."""
    for param in engine.module.parameters():
        if getattr(param, "nvme_swapper", None) is not None:
            return type(param.nvme_swapper).__name__
    return None


def _add_section_in_initialize(deepspeed: ModuleType) -> None:
    """A dict config with the optimizer on NVMe gets the section before `deepspeed.initialize` reads it,
    as a user's config has it: there ours rewrites `device: nvme` to the store (after `install()`, whose
    `deepspeed.initialize` this one calls). The others get it when their engine builds its optimizer."""
    initialize = deepspeed.initialize

    def initialize_with_section(*args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("config")
        zero = config.get("zero_optimization", {}) if isinstance(config, dict) else {}
        if (
            isinstance(config, dict)
            and zero.get("stage") == 3
            and _offload_device(zero, "offload_optimizer") == "nvme"
        ):
            kwargs["config"] = _with_section(config)
        return initialize(*args, **kwargs)

    setattr(deepspeed, "initialize", initialize_with_section)  # noqa: B010 (typed as DeepSpeed's own)


def _patch_engine(deepspeed: ModuleType) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    if MODE == "ours":
        import mlp_offload

        mlp_offload.install()
        _add_section_in_initialize(deepspeed)
    configure = DeepSpeedEngine._configure_zero_optimizer

    def configure_zero_optimizer(self: Any, optimizer: Any) -> Any:
        from deepspeed.runtime.utils import DummyOptim

        offload = self.zero_offload_optimizer()
        device = None if offload is None else str(getattr(offload.device, "value", offload.device))
        stage3_offload = (
            self.zero_optimization_stage() == 3
            and not isinstance(optimizer, DummyOptim)
            and device not in (None, "none")
        )
        swapped = stage3_offload and MODE == "ours" and device in OUR_DEVICES
        if swapped:
            global _engines_built
            if not isinstance(self.config, dict):
                raise RuntimeError(f"deepspeed-suite harness: config is {type(self.config)}, not a dict")
            if "mlp_offload" not in self.config:
                self.config = _with_section(self.config)
            _engines_built += 1
        built = configure(self, optimizer)
        if stage3_offload:
            ours = False
            if MODE == "ours":
                from mlp_offload.adapter.zero3 import MLPOffloadStage3

                ours = isinstance(built, MLPOffloadStage3)
            _record(
                {
                    "device": device,
                    "swapped": swapped,
                    "optimizer": type(built).__name__,
                    "ours": ours,
                    "param_swapper": _param_swapper(self),
                }
            )
        return built

    DeepSpeedEngine._configure_zero_optimizer = configure_zero_optimizer


def _patch_checkpoint_common(common: ModuleType) -> None:
    compare = common.compare_deepspeed_states

    def compare_deepspeed_states(saved_model: Any, loaded_model: Any) -> None:
        name = "sparse_tensor_module_names"
        if hasattr(saved_model, name) and hasattr(loaded_model, name):
            compare(saved_model, loaded_model)
            return
        # The rest of DeepSpeed's comparison, unchanged.
        assert hasattr(loaded_model, "module")
        assert saved_model.skipped_steps == loaded_model.skipped_steps
        assert saved_model.global_steps == loaded_model.global_steps

    setattr(common, "compare_deepspeed_states", compare_deepspeed_states)  # noqa: B010 (an undeclared module attribute)


def _patch_unit_common(common: ModuleType) -> None:
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    import torch

    dist = common.dist

    def reduce_boolean_flags(flag: bool, op: Callable[[list[bool]], bool] = all) -> bool:
        # DeepSpeed's, with the tensors on the CPU, and the flag one element (gloo's all-gather takes no
        # 0-dimensional tensor).
        if not dist.is_initialized():
            return flag
        tensor_flag = torch.tensor([1 if flag else 0], dtype=torch.int, device="cpu")
        tensor_flag_buf = torch.zeros(dist.get_world_size(), dtype=torch.int, device="cpu")
        dist.all_gather_into_tensor(tensor_flag_buf, tensor_flag)
        return op([bool(f) for f in tensor_flag_buf.tolist()])

    setattr(common, "reduce_boolean_flags", reduce_boolean_flags)  # noqa: B010 (an undeclared module attribute)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after a module has executed, in whichever process imports it."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        patch = self.patches.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        exec_module = loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        loader.exec_module = exec_then_patch
        return spec


if MODE in ("stock", "ours"):
    sys.meta_path.insert(
        0,
        _AfterImport(
            {
                "deepspeed": _patch_engine,
                "deepspeed.runtime.zero.partition_parameters": _patch_zero_init,
                "unit.checkpoint.common": _patch_checkpoint_common,
                "unit.common": _patch_unit_common,
            }
        ),
    )
