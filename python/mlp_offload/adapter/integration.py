"""Turning mlp-offload on in DeepSpeed: `initialize` (a drop-in for `deepspeed.initialize`) and `install`.

After `install()`, every `deepspeed.initialize` whose config has a top-level `"mlp_offload"` section gets
`MLPOffloadStage3` as its ZeRO-3 optimizer; configs without one get DeepSpeed's own, unchanged. This
works for frameworks that call `deepspeed.initialize` themselves (Hugging Face Trainer and Accelerate,
Megatron-DeepSpeed), as long as `install()` runs first. Target: DeepSpeed 0.19.x.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

from mlp_offload.adapter import compat, options, troubleshooting
from mlp_offload.common.config import SECTION, migrate_nvme_offload


def install() -> None:
    """Makes DeepSpeed build `MLPOffloadStage3` for configs with an `"mlp_offload"` section (idempotent)."""
    import deepspeed

    if not deepspeed.__version__.startswith(compat.SUPPORTED_SERIES):
        raise RuntimeError(
            troubleshooting.SERIES.message(
                series=compat.SUPPORTED_SERIES,
                tested=", ".join(compat.TESTED_DEEPSPEED),
                version=deepspeed.__version__,
            )
        )
    from deepspeed.runtime.zero import stage3

    from mlp_offload.adapter import checkpoint
    from mlp_offload.adapter.zero3 import MLPOffloadStage3

    # A patch release we did not test: say so, naming what changed in the code the engine relies on.
    compat.check_deepspeed(deepspeed.__version__, MLPOffloadStage3)

    stock = stage3.DeepSpeedZeroOptimizer_Stage3
    if getattr(stock, "_mlp_offload_installed", False):
        return
    _build_ours(stock, MLPOffloadStage3)
    _swap_params_through_our_store()
    _refuse_another_degree(deepspeed.runtime.engine.DeepSpeedEngine, MLPOffloadStage3, checkpoint)
    _tell_of_steps(deepspeed.runtime.engine.DeepSpeedEngine, MLPOffloadStage3)
    stock._mlp_offload_installed = True
    _migrate_in_initialize(deepspeed)


def _build_ours(stock: Any, ours: type) -> None:
    """DeepSpeed's ZeRO-3 optimizer class builds `ours` for a config with our section."""

    def dispatching_new(cls: type, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's class itself decides what it builds, so the name stays bound to DeepSpeed's class
        under every import and `isinstance(engine, DeepSpeedZeroOptimizer_Stage3)` holds for ours (a
        subclass). The object is returned uninitialised: Python then runs the `__init__` of its type."""
        ds_config = kwargs.get("ds_config", args[4] if len(args) > 4 else None)
        if isinstance(ds_config, dict) and SECTION in ds_config:
            # Checked where `initialize` started too (once per config), unless bound before install().
            options.check(ds_config)
            if cls is stock:
                return object.__new__(ours)
            if not issubclass(cls, ours):
                # Another optimizer of DeepSpeed's own that no option of the table names (the one known,
                # SuperOffload, is refused by its key above): never ignore our section.
                raise ValueError(troubleshooting.ANOTHER_ZERO_OPTIMIZER.message(optimizer=cls.__name__))
        return object.__new__(cls)

    # Subclasses (ours, DeepSpeed's SuperOffload) inherit it and build themselves.
    stock.__new__ = staticmethod(dispatching_new)


def _swap_params_through_our_store() -> None:
    """`zero.Init` builds its parameter swapper by this name at call time: for a config with our section
    it builds ours (`param_swapper`), also inside `deepspeed.initialize`."""
    from deepspeed.runtime.zero import partition_parameters

    from mlp_offload.adapter.param_swapper import swapper_class

    stock = partition_parameters.AsyncPartitionedParameterSwapper
    partition_parameters.AsyncPartitionedParameterSwapper = swapper_class(stock)


def _refuse_another_degree(engine_class: Any, ours: type, checkpoint: Any) -> None:
    """A ZeRO checkpoint of another data-parallel degree: refused as stock refuses it, saying how to
    convert it (stock's message does not)."""
    ds_load_zero_checkpoint = engine_class._load_zero_checkpoint

    @functools.wraps(ds_load_zero_checkpoint)
    def load_zero_checkpoint(engine: Any, load_dir: str, tag: Any, load_optimizer_states: bool = True) -> Any:
        if isinstance(engine.optimizer, ours):
            checkpoint.refuse_another_degree(engine, load_dir, tag, load_optimizer_states)
        return ds_load_zero_checkpoint(engine, load_dir, tag, load_optimizer_states=load_optimizer_states)

    engine_class._load_zero_checkpoint = load_zero_checkpoint


def _tell_of_steps(engine_class: Any, ours: Any) -> None:
    """After each step the engine takes, our optimizer gets the engine's monitor and sample count, where
    each step's figures go (`monitors.MonitorWriter`): DeepSpeed writes its own there the same way."""
    ds_take_model_step = engine_class._take_model_step

    @functools.wraps(ds_take_model_step)
    def take_model_step(engine: Any, *args: Any, **kwargs: Any) -> Any:
        taken = ds_take_model_step(engine, *args, **kwargs)
        if isinstance(engine.optimizer, ours):
            engine.optimizer._mlp_engine_step(engine.monitor, engine.global_samples)
        return taken

    engine_class._take_model_step = take_model_step


def _migrate_in_initialize(deepspeed: Any) -> None:
    """The one-line migration from DeepSpeed's NVMe offload: its config is rewritten before DeepSpeed
    reads it (`config.migrate_nvme_offload`), and our section's options checked. Callers reach
    `deepspeed.initialize` through the module, as the frameworks do."""
    ds_initialize = deepspeed.initialize

    @functools.wraps(ds_initialize)
    def initialize_with_migration(*args: Any, **kwargs: Any) -> Any:
        from deepspeed import load_ds_config

        for key in ("config", "config_params"):
            given = kwargs.get(key)
            if isinstance(given, (str, os.PathLike)):
                given = load_ds_config(str(given))
            if isinstance(given, dict):
                kwargs[key] = migrate_nvme_offload(given)
        # A config file named by the command line (`--deepspeed_config`), when no config is given.
        cli: Any = kwargs["args"] if "args" in kwargs else (args[0] if args else None)
        path = getattr(cli, "deepspeed_config", None)
        from_file = None
        if path is not None and kwargs.get("config") is None and kwargs.get("config_params") is None:
            loaded = load_ds_config(str(path))
            migrated = migrate_nvme_offload(loaded)
            if migrated is not loaded:
                # DeepSpeed takes one config: the rewritten one, from a copy of the arguments without it.
                cli = copy.copy(cli)
                cli.deepspeed_config = None
                if "args" in kwargs:
                    kwargs["args"] = cli
                else:
                    args = (cli, *args[1:])
                kwargs["config"] = migrated
            else:
                from_file = loaded
        for config in (kwargs.get("config"), kwargs.get("config_params"), from_file):
            if isinstance(config, dict) and SECTION in config:
                # Before DeepSpeed reads any of it: some options fail inside DeepSpeed before the
                # optimizer is built, and under another stage than 3 it would build none of ours.
                options.check(config)
        return ds_initialize(*args, **kwargs)

    deepspeed.initialize = initialize_with_migration


def initialize(*args: Any, **kwargs: Any) -> Any:
    """`deepspeed.initialize`, with mlp-offload installed first: same arguments, same return value."""
    import deepspeed

    install()
    return deepspeed.initialize(*args, **kwargs)
