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
        k_tensor = _constants_on(on, constants)
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

    def update_summing_params(
        self,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
        sums: torch.Tensor,
        **how: Any,
    ) -> None:
        """`update` with the master weights in the parameters (`master`, nothing written elsewhere), and
        their CRC32C as it reads and as it writes them into `sums` (two int32 on the device, zero
        before; `crcs` reads them), as the host pass sums them (`PassSums.params_read`,
        `params_write`)."""
        crc32c_into(master, sums[:1])
        self.update(master, exp_avg, exp_avg_sq, grad, None, **how)
        crc32c_into(master, sums[1:])

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


def _constants_on(device: torch.device, constants: list[float]) -> torch.Tensor:
    """The call's constants in fp32 on `device`, copied there without holding the host: a copy from
    pageable memory would wait for everything queued on the stream (on a chunk's slot, the chunk
    before it there), so from pinned memory, which torch keeps until the copy has read it."""
    on_gpu = device.type == "cuda"
    host = torch.tensor(constants, dtype=torch.float32, pin_memory=on_gpu)
    return host.to(device, non_blocking=True) if on_gpu else host


def crcs(sums: torch.Tensor) -> tuple[int, int]:
    """The two CRC32Cs `update_summing_params` left in `sums` (int32 bits, on the host), as numbers."""
    before, after = (v & 0xFFFFFFFF for v in sums.tolist())
    return before, after


def crc32c_into(half: torch.Tensor, out: torch.Tensor) -> None:
    """The CRC32C of `half`'s bytes (contiguous 16-bit elements on the accelerator), as the host pass sums
    the parameters it reads and writes (`fused_update.crc32c_of`), XOR-ed into `out` (one int32 on the
    same device, zero before), queued on the current stream."""
    if half.element_size() != 2 or not half.is_contiguous() or out.dtype != torch.int32:
        raise ValueError(
            f"the accelerator's CRC32C sums contiguous 16-bit elements into an int32, not "
            f"{half.dtype}{'' if half.is_contiguous() else ' (strided)'} into {out.dtype}"
        )
    n = half.numel()
    rows, run = CRC_SHAPES[half.device.type == "cpu"]
    if half.device.type == "cpu":
        # Through the interpreter a block costs its size whatever `n` is: a small chunk takes a small one
        # (on a GPU each size would be a kernel compiled).
        rows = min(rows, 1 << max(1, (-(-n // run) - 1).bit_length()))
    programs = max(1, -(-n // (rows * run)))
    row_shifts, block_shifts = _crc_tables(half.device, rows, run, 1 << (programs - 1).bit_length())
    with _quiet_interpreter(half.device):
        _crc_kernel()[(programs,)](
            half.view(torch.int16),
            out,
            row_shifts,
            block_shifts,
            n,
            _as_int32(_zeros_crc(n)),
            ROWS=rows,
            RUN=run,
            HALVINGS=rows.bit_length() - 1,
        )


# The CRC32C kernel's rows of elements a program, and elements a row, on a GPU and through the
# interpreter (`CRC_SHAPES[interpreted]`). On a GPU each row's register runs over its 16 elements one
# after another, and only a row's sum is carried over the bytes after it (32 steps of bits): a sixteenth
# of that an element. The interpreter's cost is its operations, whatever their width: rows of one.
CRC_SHAPES = {False: (256, 16), True: (1 << 14, 1)}
# CRC32C's polynomial, reflected (`checksum.rs`'s POLY).
CRC_POLY = 0x82F63B78
# x^0 and x^16 mod P, reflected (bit 31 is x^0).
_X0, _X16 = 1 << 31, 1 << 15


def _mul_mod_p(a: int, b: int) -> int:
    """a(x) b(x) mod P(x), both reflected: `checksum.rs`'s `mul_mod_p`, for the kernel's tables."""
    product = 0
    for bit in range(32):
        if a & (1 << (31 - bit)):
            product ^= b
        b = (b >> 1) ^ CRC_POLY if b & 1 else b >> 1
    return product


def _powers(step: int, count: int) -> list[int]:
    """x^(k step) mod P for k in 0..count, where `step` is x^step's residue."""
    powers = [_X0]
    while len(powers) < count:
        powers.append(_mul_mod_p(step, powers[-1]))
    return powers


@functools.lru_cache(maxsize=64)
def _zeros_crc(n: int) -> int:
    """The CRC32C of `n` zero 16-bit elements: its all-ones start carried over their bytes, ended."""
    carry, square = _X0, _X16
    while n:
        if n & 1:
            carry = _mul_mod_p(square, carry)
        square = _mul_mod_p(square, square)
        n >>= 1
    return _mul_mod_p(carry, 0xFFFFFFFF) ^ 0xFFFFFFFF


def _as_int32(residue: int) -> int:
    return residue - (1 << 32) if residue >> 31 else residue


@functools.lru_cache(maxsize=16)
def _crc_tables(
    device: torch.device, rows: int, run: int, programs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's carries on `device` (as int32 bits): x^(16 run r) for each of a block's `rows`,
    x^(16 run rows b) for each of `programs` blocks (a power of two, so that few sizes are cached)."""
    per_row = _powers(_X16, run + 1)[-1]
    row_shifts = _powers(per_row, rows + 1)
    per_block = row_shifts.pop()

    def on_device(residues: list[int]) -> torch.Tensor:
        return torch.tensor([_as_int32(r) for r in residues], dtype=torch.int32).to(device)

    return on_device(row_shifts), on_device(_powers(per_block, programs))


@functools.cache
def _crc_kernel() -> Any:
    from mlp_offload.engine import _accelerator_kernel

    return _accelerator_kernel.crc32c_kernel


def _quiet_interpreter(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Triton's interpreter (the kernel on a CPU device) computes with numpy, which warns where IEEE
    arithmetic overflows, divides by zero or meets a NaN, as the kernel means it to."""
    return numpy.errstate(all="ignore") if device.type == "cpu" else contextlib.nullcontext()
