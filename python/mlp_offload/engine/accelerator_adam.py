"""The update's pass on the accelerator: DeepSpeed's CPU Adam as the fused pass computes it on the host
(`crates/mlp-offload-core/src/kernel/`: `adam_element` and `rounded_element` are its specification), as
one Triton kernel, bit for bit the same. So where a chunk is updated changes only the speed.

How it holds to the host's bits:
- The per-call constants come from the host's `_core.AdamKernel.constants`, one bias state for every
  chunk wherever it is updated (DeepSpeed's one `Adam_Optimizer`), in an fp32 tensor: no scalar
  argument is ever widened or narrowed on the way.
- A fused multiply-add (`tl.fma`) exactly where DeepSpeed's build fuses: its vector code's everywhere
  but a call's last `n % vector_width` elements, which take the tail's fusing that the start-up check
  found (`_core.AdamKernel.arith`). Everything else is a separate product and sum: the kernel is
  launched with `enable_fp_fusion=False`, so the compiler contracts nothing.
- Division and square root correctly rounded (`tl.div_rn`, `tl.sqrt_rn`), not the approximate ones a
  GPU's `/` and `tl.sqrt` give; no flush to zero.
- Every conversion between fp32 and bf16 or fp16 in integer arithmetic on the bits, as the host's
  `Elem` does it: nearest-even, NaN payloads, infinities and subnormals included, whatever the
  accelerator's own conversions do with them.

On a machine without a GPU the kernel runs through Triton's interpreter (`TRITON_INTERPRET=1`, set
before the first call), which computes an `fma` exactly; that is how `make test` checks it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import numpy
import torch

from mlp_offload import _core
from mlp_offload.engine.state_dtypes import DTYPES, StateDtypes

# Elements per program: a multiple of every vector width DeepSpeed builds with. Through Triton's
# interpreter (a CPU device) each program's operations are numpy's over the block: a large one keeps the
# interpreter's overhead per element small.
BLOCK = 1024
INTERPRETED_BLOCK = 1 << 14


def block_for(device: torch.device) -> int:
    """Elements per program of the kernel on `device`."""
    return INTERPRETED_BLOCK if device.type == "cpu" else BLOCK


# The order of the constants in the tensor the kernel reads them from.
CONSTANTS = (
    "beta1",
    "beta2",
    "one_minus_beta1",
    "one_minus_beta2",
    "bias_correction2",
    "eps",
    "step_size",
    "decay_value",
)

# The kernel's codes of an element type and of a way to compute `old * beta + grad * (1 - beta)`.
KIND_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MOMENT_CODES = {"gradient": 0, "old": 1, "separate": 2}
DECAY_CODES = {"none": 0, "l2": 1, "adamw": 2}

# The integer view of a 16-bit element type, through which the kernel loads and stores its bits.
_BITS_VIEW = {torch.float32: torch.float32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, imported at the first call: Triton reads `TRITON_INTERPRET` when a kernel is
    made, so a process that sets it before its first update runs the interpreter."""
    from mlp_offload.engine import _accelerator_kernel

    return _accelerator_kernel.adam_kernel


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS_VIEW[t.dtype])


class AcceleratorAdam:
    """DeepSpeed's CPU Adam update of a subgroup's (or a chunk's) state held on the accelerator, with
    the gradient's unscaling and the half-precision copy, in one kernel: the host's fused pass
    (`fused_update.FusedAdam`), bit for bit. `kernel` is the host pass's own `_core.AdamKernel`, so that
    the bias state is one, and its arithmetic (found at start-up) is the one matched (DeepSpeed's
    `adamw_mode` is in each call's `group`); `dtypes` the state's."""

    def __init__(self, kernel: _core.AdamKernel, *, dtypes: StateDtypes) -> None:
        self.kernel = kernel
        self.dtypes = dtypes
        arith = kernel.arith
        self.tail = (MOMENT_CODES[arith["momentum"]], MOMENT_CODES[arith["variance"]], bool(arith["others"]))
        self.vector_width = kernel.vector_width_for(DTYPES[dtypes.master], DTYPES[dtypes.moments])

    def update(
        self,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
        params: torch.Tensor | None,
        *,
        group: _core.AdamGroup,
        step: int,
        grad_scale: float,
    ) -> None:
        """One call of DeepSpeed's CPU Adam on these tensors, in place, all on one device and
        contiguous: `master` the master weights (with `dtypes.master_in_params`, the half-precision
        parameters themselves, and `params` None), the moments, `grad` the gradient before `grad_scale`
        (DeepSpeed's `1 / combined_scale`), `params` where the new half-precision parameters go, if
        anywhere; `group` and `step` as `FusedAdam.update` takes them. Its last `n % vector_width`
        elements take DeepSpeed's scalar loop's arithmetic, as a call's do."""
        n = grad.numel()
        tensors = [master, exp_avg, exp_avg_sq, grad] + ([] if params is None else [params])
        self._check(tensors, n)
        k = self.kernel.constants(group, step)
        constants = [k[name] for name in CONSTANTS] + [grad_scale]
        on = grad.device
        k_tensor = torch.tensor(constants, dtype=torch.float32).to(on)
        out = grad if params is None else params
        momentum, variance, others = self.tail
        block = block_for(on)
        with _quiet_interpreter(on):
            _kernel()[(max(1, -(-n // block)),)](
                _bits(master),
                _bits(exp_avg),
                _bits(exp_avg_sq),
                _bits(grad),
                _bits(out),
                k_tensor,
                n,
                # A build without SIMD (width 1) runs every element through its scalar loop.
                0 if self.vector_width == 1 else n - n % self.vector_width,
                MASTER=KIND_CODES[master.dtype],
                MOMENTS=KIND_CODES[exp_avg.dtype],
                GRAD=KIND_CODES[grad.dtype],
                PARAMS=KIND_CODES[out.dtype],
                WRITES_PARAMS=params is not None,
                DECAY=DECAY_CODES[k["decay"]],
                MOMENTUM=momentum,
                VARIANCE=variance,
                OTHERS=others,
                HALF_STATE=not self.dtypes.is_fp32,
                BLOCK=block,
                enable_fp_fusion=False,
            )

    def _check(self, tensors: list[torch.Tensor], n: int) -> None:
        device = tensors[0].device
        for name, t in zip(("master", "exp_avg", "exp_avg_sq", "grad", "params"), tensors, strict=False):
            if t.device != device or not t.is_contiguous() or t.numel() != n or t.dtype not in KIND_CODES:
                raise ValueError(
                    f"{name}: the accelerator's pass takes {n} contiguous elements of float32, bfloat16 "
                    f"or float16 on {device}, not {t.numel()} {t.dtype} on {t.device}"
                    f"{'' if t.is_contiguous() else ' (strided)'}"
                )
        want = [self.dtypes.master, self.dtypes.moments, self.dtypes.moments]
        got = [t.dtype for t in tensors[:3]]
        if got != want:
            raise ValueError(f"master, exp_avg, exp_avg_sq: {got} where the state is {self.dtypes}")


def _quiet_interpreter(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Triton's interpreter (the kernel on a CPU device) computes with numpy, which warns where IEEE
    arithmetic overflows, divides by zero or meets a NaN, as the kernel means it to."""
    return numpy.errstate(all="ignore") if device.type == "cpu" else contextlib.nullcontext()
