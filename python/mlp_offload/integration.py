"""Turning mlp-offload on in DeepSpeed: `initialize` (a drop-in for `deepspeed.initialize`) and `install`.

After `install()`, every `deepspeed.initialize` whose config has a top-level `"mlp_offload"` section gets
`MLPOffloadStage3` as its ZeRO-3 optimizer; configs without one get DeepSpeed's own, unchanged. This
works for frameworks that call `deepspeed.initialize` themselves (Hugging Face Trainer and Accelerate,
Megatron-DeepSpeed), as long as `install()` runs first. Target: DeepSpeed 0.19.x.
"""

from __future__ import annotations

from typing import Any

from mlp_offload.config import SECTION

SUPPORTED_DEEPSPEED = ("0.19.",)


def install() -> None:
    """Makes DeepSpeed build `MLPOffloadStage3` for configs with an `"mlp_offload"` section (idempotent)."""
    import deepspeed

    if not deepspeed.__version__.startswith(SUPPORTED_DEEPSPEED):
        raise RuntimeError(
            f"mlp-offload supports DeepSpeed {', '.join(v + 'x' for v in SUPPORTED_DEEPSPEED)}; "
            f"this is {deepspeed.__version__}"
        )
    # SuperOffload subclasses the stock class at import: import it while the name is still the stock one.
    import deepspeed.runtime.superoffload.superoffload_stage3
    from deepspeed.runtime.zero import stage3

    if getattr(stage3.DeepSpeedZeroOptimizer_Stage3, "_mlp_offload_dispatch", False):
        return
    stock = stage3.DeepSpeedZeroOptimizer_Stage3

    class DispatchingStage3(stock):  # type: ignore[misc, valid-type]
        """What the engine constructs: ours when the config has our section, else DeepSpeed's own."""

        _mlp_offload_dispatch = True
        _mlp_offload_stock = stock

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            ds_config = kwargs.get("ds_config", args[4] if len(args) > 4 else None)
            if isinstance(ds_config, dict) and SECTION in ds_config:
                from mlp_offload.zero3 import MLPOffloadStage3

                # Not an instance of this class, so Python does not run __init__ a second time.
                return MLPOffloadStage3(*args, **kwargs)
            return stock(*args, **kwargs)

    DispatchingStage3.__name__ = stock.__name__
    DispatchingStage3.__qualname__ = stock.__qualname__
    stage3.DeepSpeedZeroOptimizer_Stage3 = DispatchingStage3


def initialize(*args: Any, **kwargs: Any) -> Any:
    """`deepspeed.initialize`, with mlp-offload installed first: same arguments, same return value."""
    import deepspeed

    install()
    return deepspeed.initialize(*args, **kwargs)
