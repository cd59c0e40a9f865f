"""The update's per-chunk work in one pass: `_core.AdamKernel` (`crates/mlp-offload-core/src/kernel/`)
in place of DeepSpeed's four passes (the cast of the half-precision gradient, `unscale_and_clip_grads`,
CPU Adam, the copy into the half-precision partition), bit for bit the same.

What the Rust kernel cannot know from DeepSpeed's source is found at start-up, on this CPU, against
DeepSpeed's own kernel: a few small chunks of random numbers go through DeepSpeed's CPU Adam (a
temporary optimizer of its own, so the job's optimizer keeps its bias-correction history) with torch's
conversions around it, and through the fused kernel with each candidate arithmetic
(`_core.AdamKernel.candidates()`: DeepSpeed's build's vector width, how its compiler fused the scalar
loop's multiply-adds, the float or double `sqrt` of its bias correction). The first candidate that agrees
on every bit of every output is used; if none does, DeepSpeed's kernel is (`update_kernel: "auto"`) or
the engine refuses to start (`"fused"`), saying which output differed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from mlp_offload import _core

log = logging.getLogger("mlp_offload")

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# An optimizer id of DeepSpeed's CPU Adam op for the start-up check, far above the ids DeepSpeedCPUAdam
# hands out (a counter from 0).
CHECK_OPTIMIZER_ID = 1 << 30
# (Adam step, elements) of the start-up check's calls, in order: chunks with vector bodies and scalar
# tails of every width, the same step twice (DeepSpeed keeps its bias state) and a next one (it multiplies
# beta^t on). `check_calls` adds one at a step that tells DeepSpeed's float and double `sqrt` apart.
CHECK_CALLS = ((1, 4096 + 15), (1, 31), (1, 15), (2, 4096 + 15), (2, 15), (2, 7))


def check_calls(beta2: float) -> tuple[tuple[int, int], ...]:
    """`CHECK_CALLS`, then a call at the first step where a float and a double square root of the bias
    correction differ for this `beta2` (a jump: DeepSpeed recomputes beta^t with `pow` there)."""
    witness = _core.AdamKernel.sqrt_witness(beta2)
    return CHECK_CALLS if witness is None else (*CHECK_CALLS, (witness, 64))


def _address(t: torch.Tensor, n: int, what: str) -> int:
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n or t.dtype not in DTYPES:
        raise ValueError(
            f"{what}: the fused update takes {n} contiguous CPU elements of float32, bfloat16 or float16, "
            f"not {t.numel()} {t.dtype} on {t.device}{'' if t.is_contiguous() else ' (strided)'}"
        )
    return t.data_ptr()


class FusedAdam:
    """DeepSpeed's update of one chunk as one pass of `kernel`, with `adamw` (DeepSpeed's `adamw_mode`) on
    `threads` threads."""

    def __init__(self, kernel: _core.AdamKernel, *, adamw: bool, threads: int) -> None:
        self.kernel = kernel
        self.adamw = adamw
        self.threads = threads

    def update(
        self,
        state: torch.Tensor,
        grad: torch.Tensor,
        params: torch.Tensor | None,
        *,
        grad_scale: float,
        step: int,
        group: dict[str, Any],
        read_cuts: list[int] | None = None,
        write_cuts: list[int] | None = None,
        kept_params: list[tuple[int, torch.Tensor]] | None = None,
        kept_state: torch.Tensor | None = None,
    ) -> tuple[list[int] | None, list[int] | None]:
        """One chunk: `state` its `[params | exp_avg | exp_avg_sq]` (fp32), `grad` its half-precision (or
        fp32) gradient before `grad_scale` (DeepSpeed's `1 / combined_scale`), `params` where the new
        half-precision parameters go; `step` the Adam step after this update and `group` the chunk's param
        group (lr, betas, eps, weight decay, bias correction), as DeepSpeed's CPU Adam takes them.
        Returns the state's CRC32C per stripe as read and as written, cut at `read_cuts`/`write_cuts`
        (the store's stripe starts), where given. Given `kept_params`, the pass appends to it the
        parameters as they were before it wherever they were not the old weights narrowed, a block at a
        time (its first element, its values), checked in the pass itself. Given `kept_state` (fp32, as
        many elements as `state`), the pass copies the state there as it was before it, a block at a
        time while the block is in the core's cache: the one copy of state kept nowhere else (a cached
        chunk's) that an undo needs, for one more write and no more reads."""
        n = grad.numel()
        beta1, beta2 = group["betas"]
        # The kernel runs without the GIL: the tensors are the caller's and outlive the call.
        read, write, kept = self.kernel.update(
            _address(state, 3 * n, "state"),
            _address(grad, n, "grad"),
            None if params is None else _address(params, n, "params"),
            count=n,
            grad_dtype=DTYPES[grad.dtype],
            params_dtype=DTYPES[params.dtype] if params is not None else "float32",
            grad_scale=grad_scale,
            step=step,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            bias_correction=bool(group.get("bias_correction", True)),
            adamw=self.adamw,
            threads=self.threads,
            read_cuts=read_cuts,
            write_cuts=write_cuts,
            keep_params=kept_params is not None,
            keep_state=None if kept_state is None else _address(kept_state, 3 * n, "kept_state"),
        )
        if kept_params is not None and kept and params is not None:
            kept_params.extend(
                (first, torch.frombuffer(bytearray(data), dtype=params.dtype)) for first, data in kept
            )
        return read, write


@dataclass
class CheckCall:
    """One call of the start-up check: its inputs, and DeepSpeed's outputs for them."""

    step: int
    state: torch.Tensor
    grad: torch.Tensor
    expected_state: torch.Tensor
    expected_params: torch.Tensor | None


def _check_inputs(
    n: int, grad_dtype: torch.dtype, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random `[params | exp_avg | exp_avg_sq]` and gradient, of magnitudes a training run has. The
    parameters' magnitudes spread from 0.05 down to 5e-6: where a parameter is about as small as its
    update, the rounding of each product (fused into its sum or not) shows in the result; with every
    parameter at 0.05 the products' roundings rarely did, and an AVX2 build's 7-element tails let a
    wrong fusing of the decay, denominator and parameter updates through (2026-11-28, an AMD EPYC)."""
    state = torch.empty(3 * n)
    spread = torch.pow(10.0, -4.0 * torch.rand(n, generator=generator))
    state[:n] = torch.randn(n, generator=generator) * 0.05 * spread
    state[n : 2 * n] = torch.randn(n, generator=generator) * 1e-3
    state[2 * n :] = torch.rand(n, generator=generator) * 1e-6
    grad = (torch.randn(n, generator=generator) * 1e-2).to(grad_dtype)
    return state, grad


def _deepspeed_reference(
    ds_op: Any,
    group: dict[str, Any],
    adamw: bool,
    grad_scale: float,
    grad_dtype: torch.dtype,
    params_dtype: torch.dtype | None,
    generator: torch.Generator,
) -> list[CheckCall]:
    """DeepSpeed's outputs for `CHECK_CALLS` of random inputs, through DeepSpeed's own CPU Adam (a
    temporary optimizer id) and torch's conversions, as the engine's DeepSpeed path runs them."""
    beta1, beta2 = group["betas"]
    lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
    bias_correction = bool(group.get("bias_correction", True))
    ds_op.create_adam(CHECK_OPTIMIZER_ID, lr, beta1, beta2, eps, decay, adamw, False)
    calls = []
    try:
        for step, n in check_calls(beta2):
            state, grad = _check_inputs(n, grad_dtype, generator)
            out = state.clone()
            grad32 = torch.empty(n)
            grad32.copy_(grad)
            grad32.mul_(grad_scale)
            p, m, v = out[:n], out[n : 2 * n], out[2 * n :]
            ds_op.adam_update(
                CHECK_OPTIMIZER_ID, step, lr, beta1, beta2, eps, decay, bias_correction, p, grad32, m, v
            )
            params = None
            if params_dtype is not None:
                params = torch.empty(n, dtype=params_dtype)
                params.copy_(p)
            calls.append(CheckCall(step, state, grad, out, params))
    finally:
        ds_op.destroy_adam(CHECK_OPTIMIZER_ID)
    return calls


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype and the same bits in every element (-0.0 is not 0.0; a NaN is its own payload)."""
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


def _first_difference(
    calls: list[CheckCall], fused: FusedAdam, group: dict[str, Any], grad_scale: float
) -> str | None:
    """Runs the check's calls through `fused` in order, with the checksums of the state as the engine runs
    it (they change the SIMD loop on CPUs with VPCLMULQDQ); where its outputs first differ from
    DeepSpeed's, or its checksums from the bytes', in words, or None when every bit agrees."""
    for call in calls:
        n = call.grad.numel()
        state = call.state.clone()
        params = None if call.expected_params is None else torch.empty_like(call.expected_params)
        sums = fused.update(
            state, call.grad, params, grad_scale=grad_scale, step=call.step, group=group,
            read_cuts=[0], write_cuts=[0],
        )  # fmt: skip
        for direction, crc, of in (("read", sums[0], call.state), ("written", sums[1], state)):
            expected = _core.crc32c(of.view(torch.uint8).numpy())
            if crc != [expected]:
                return f"the checksum of a {n}-element chunk as {direction} is {crc}, not [{expected}]"
        for name, ours, theirs in (
            ("params", state[:n], call.expected_state[:n]),
            ("exp_avg", state[n : 2 * n], call.expected_state[n : 2 * n]),
            ("exp_avg_sq", state[2 * n :], call.expected_state[2 * n :]),
            ("half-precision params", params, call.expected_params),
        ):
            if ours is not None and theirs is not None and not same_bits(ours, theirs):
                bits = {4: torch.int32, 2: torch.int16}[ours.element_size()]
                index = int((ours.view(bits) != theirs.view(bits)).nonzero()[0])
                return (
                    f"{name} of a {n}-element chunk at step {call.step} differ from DeepSpeed's first at "
                    f"element {index} ({ours[index].item()!r} against {theirs[index].item()!r})"
                )
    return None


def self_check(
    optimizer: Any,
    grad_dtype: torch.dtype,
    params_dtype: torch.dtype | None,
    *,
    simd: str = "auto",
    threads: int | None = None,
) -> tuple[FusedAdam | None, str]:
    """The fused kernel that agrees with `optimizer`'s (a `DeepSpeedCPUAdam`) own kernel on this CPU, bit
    for bit, for every param group's settings, with `grad_dtype` gradients and `params_dtype` half-precision
    parameters (None: none written); or None and why not."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not isinstance(optimizer, DeepSpeedCPUAdam):
        return None, f"the optimizer is {type(optimizer).__qualname__}, not DeepSpeed's CPU Adam"
    if not getattr(optimizer, "fp32_optimizer_states", True):
        return None, "DeepSpeed's CPU Adam keeps its moments in half precision (fp32_optimizer_states off)"
    for dtype in (grad_dtype, params_dtype):
        if dtype is not None and dtype not in DTYPES:
            return None, f"{dtype} is not float32, bfloat16 or float16"
    threads = threads or torch.get_num_threads()
    adamw = bool(optimizer.adam_w_mode)
    grad_scale = 1.0 / 3.0
    # DeepSpeed's outputs for every param group's settings, once (the same random numbers each time).
    references = [
        _deepspeed_reference(
            optimizer.ds_opt_adam,
            group,
            adamw,
            grad_scale,
            grad_dtype,
            params_dtype,
            torch.Generator().manual_seed(29),
        )
        for group in optimizer.param_groups
    ]
    candidates = _core.AdamKernel.candidates()
    why = "no candidate arithmetic agreed"
    for candidate in candidates:
        difference = None
        for group, calls in zip(optimizer.param_groups, references, strict=True):
            # A kernel of its own per group, as DeepSpeed's check optimizer was one per group.
            kernel = _core.AdamKernel(*group["betas"], simd=simd, **candidate)
            difference = _first_difference(
                calls, FusedAdam(kernel, adamw=adamw, threads=threads), group, grad_scale
            )
            if difference is not None:
                break
        if difference is None:
            # The job's kernel starts as DeepSpeed's optimizer object did, from its constructor's betas.
            kernel = _core.AdamKernel(*optimizer.defaults["betas"], simd=simd, **candidate)
            return FusedAdam(
                kernel, adamw=adamw, threads=threads
            ), f"agrees with DeepSpeed's CPU Adam ({candidate})"
        if candidate == candidates[0]:
            why = f"with DeepSpeed's SIMD arithmetic, {difference}"
    return None, why


def choose_update_kernel(
    setting: str,
    optimizer: Any,
    grad_dtype: torch.dtype,
    params_dtype: torch.dtype | None,
    threads: int | None = None,
) -> tuple[FusedAdam | None, str]:
    """`update_kernel` ("auto", "fused", "deepspeed"): the fused kernel where it agrees with DeepSpeed's
    (see `self_check`), on `threads` threads (None: torch's), else None (DeepSpeed's passes), and why.
    `"fused"` refuses to start without it."""
    if setting == "deepspeed":
        return None, "configured"
    fused, why = self_check(optimizer, grad_dtype, params_dtype, threads=threads)
    if fused is None and setting == "fused":
        raise ValueError(f'mlp_offload.update_kernel: "fused", but the fused kernel cannot be used: {why}')
    return fused, why
