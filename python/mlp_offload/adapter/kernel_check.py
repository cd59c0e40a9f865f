"""The start-up check of the fused update pass (`engine.fused_update.FusedAdam`) against DeepSpeed's own
CPU Adam on this CPU.

What the Rust kernel cannot know from DeepSpeed's source is found at start-up, on this CPU, against
DeepSpeed's own kernel: a few small chunks of random numbers go through DeepSpeed's CPU Adam (a
temporary optimizer of its own, so the job's optimizer keeps its bias-correction history) with torch's
conversions around it, and through the fused kernel with each candidate arithmetic
(`_core.AdamKernel.candidates()`: DeepSpeed's build's vector width, how its compiler fused the scalar
loop's multiply-adds, the float or double `sqrt` of its bias correction). The first candidate that agrees
on every bit of every output is used; if none does, DeepSpeed's kernel is (`update_kernel: "auto"`) or
the engine refuses to start (`"fused"`), saying which output differed.

With DeepSpeed's master weights in half precision and its moments in bf16 (`state_dtypes.StateDtypes`),
the check runs DeepSpeed's kernel in those dtypes, on a state laid out as the job's; rounded to half
precision, most elements hide how the products were fused, so the candidates left are told apart by
elements that show it (`_core.AdamKernel.witness`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

from mlp_offload import _core
from mlp_offload.adapter import troubleshooting
from mlp_offload.engine.fused_update import FusedAdam, adam_group, crc32c_of, same_bits
from mlp_offload.engine.state_dtypes import DTYPES, FP32_STATE, StateDtypes

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


@dataclass
class CheckCall:
    """One call of the start-up check: its inputs, and DeepSpeed's outputs for them."""

    step: int
    state: torch.Tensor
    grad: torch.Tensor
    expected_state: torch.Tensor
    expected_params: torch.Tensor | None


def _check_inputs(
    n: int, grad_dtype: torch.dtype, generator: torch.Generator, dtypes: StateDtypes
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
    # Values of the state's dtypes (exact in fp32).
    state[:n] = state[:n].to(dtypes.master).float()
    state[n:] = state[n:].to(dtypes.moments).float()
    return state, grad


def _deepspeed_reference(
    ds_op: Any,
    group: dict[str, Any],
    adamw: bool,
    grad_scale: float,
    grad_dtype: torch.dtype,
    params_dtype: torch.dtype | None,
    generator: torch.Generator,
    dtypes: StateDtypes,
) -> list[CheckCall]:
    """DeepSpeed's outputs for `CHECK_CALLS` of random inputs, through DeepSpeed's own CPU Adam (a
    temporary optimizer id) and torch's conversions, as the engine's DeepSpeed path runs them: in
    `dtypes`, the gradient converted to the master weights' and multiplied there (`unscale_and_clip_grads`),
    CPU Adam on tensors of those dtypes, the master weights copied into the partition."""
    with _check_optimizer(ds_op, group, adamw):
        return [
            _deepspeed_call(
                ds_op, step, group, *_check_inputs(n, grad_dtype, generator, dtypes), grad_scale,
                params_dtype, dtypes,
            )
            for step, n in check_calls(group["betas"][1])
        ]  # fmt: skip


@contextlib.contextmanager
def _check_optimizer(ds_op: Any, group: dict[str, Any], adamw: bool) -> Iterator[None]:
    """DeepSpeed's CPU Adam optimizer `CHECK_OPTIMIZER_ID` with `group`'s settings, new (its bias state
    from step 0) while the block runs, destroyed after it."""
    beta1, beta2 = group["betas"]
    ds_op.create_adam(
        CHECK_OPTIMIZER_ID, group["lr"], beta1, beta2, group["eps"], group["weight_decay"], adamw, False
    )
    try:
        yield
    finally:
        ds_op.destroy_adam(CHECK_OPTIMIZER_ID)


def _deepspeed_call(
    ds_op: Any,
    step: int,
    group: dict[str, Any],
    state: torch.Tensor,
    grad: torch.Tensor,
    grad_scale: float,
    params_dtype: torch.dtype | None,
    dtypes: StateDtypes,
) -> CheckCall:
    """One call of DeepSpeed's CPU Adam (the check's optimizer id, created) on `state` (fp32, values of
    `dtypes`) and `grad`, as `_deepspeed_reference` describes."""
    n = grad.numel()
    beta1, beta2 = group["betas"]
    master = torch.empty(n, dtype=dtypes.master)
    master.copy_(grad)
    master.mul_(grad_scale)
    p = state[:n].to(dtypes.master, copy=True)
    m, v = (state[k * n : (k + 1) * n].to(dtypes.moments, copy=True) for k in (1, 2))
    ds_op.adam_update(
        CHECK_OPTIMIZER_ID, step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
        bool(group.get("bias_correction", True)), p, master, m, v,
    )  # fmt: skip
    params = None
    if params_dtype is not None:
        params = torch.empty(n, dtype=params_dtype)
        params.copy_(p)
    return CheckCall(step, state, grad, torch.cat([p.float(), m.float(), v.float()]), params)


def _witness_call(
    ds_op: Any,
    found: tuple[float, float, float, int],
    n: int,
    group: dict[str, Any],
    adamw: bool,
    grad_scale: float,
    grad_dtype: torch.dtype,
    params_dtype: torch.dtype | None,
    dtypes: StateDtypes,
) -> CheckCall:
    """DeepSpeed's output for `n` copies of one element `_core.AdamKernel.witness` found, as the first
    call (Adam step 1) of a new optimizer id."""
    param, exp_avg, exp_avg_sq, bits = found
    state = torch.tensor([param, exp_avg, exp_avg_sq]).repeat_interleave(n)
    wide = {torch.float32: torch.int32}.get(grad_dtype, torch.int16)
    signed = bits - (1 << 8 * grad_dtype.itemsize) if bits >= 1 << (8 * grad_dtype.itemsize - 1) else bits
    grad = torch.full((n,), signed, dtype=wide).view(grad_dtype)
    with _check_optimizer(ds_op, group, adamw):
        return _deepspeed_call(ds_op, 1, group, state, grad, grad_scale, params_dtype, dtypes)


def _listed(crc: int | None) -> list[int] | None:
    return None if crc is None else [crc]


def _first_difference(
    calls: list[CheckCall], fused: FusedAdam, group: _core.AdamGroup, grad_scale: float
) -> str | None:
    """Runs the check's calls through `fused` in order (`group`: their param group's record), with the
    checksums of the state as the engine runs it (they change the SIMD loop on CPUs with VPCLMULQDQ);
    where its outputs first differ from DeepSpeed's, or its checksums from the bytes', in words, or None
    when every bit agrees."""
    for call in calls:
        n = call.grad.numel()
        # The state laid out as the job keeps it; the master weights in the parameters where it keeps
        # them there.
        before = fused.stored.pack(call.state)
        packed = before.clone()
        params = None if call.expected_params is None else torch.empty_like(call.expected_params)
        in_params = fused.stored.master_in_params
        if in_params:
            params = call.state[:n].to(fused.dtypes.master)
        params_before = None if params is None else params.clone()
        sums = fused.update(
            packed, call.grad, params, grad_scale=grad_scale, step=call.step, group=group,
            read_cuts=[0], write_cuts=[0],
        )  # fmt: skip
        directions = [("read", sums.read, before), ("written", sums.write, packed)]
        if in_params:
            assert params is not None and params_before is not None
            directions += [("read", _listed(sums.params_read), params_before)]
            directions += [("written", _listed(sums.params_write), params)]
        for direction, crc, of in directions:
            expected = crc32c_of(of)
            if crc != [expected]:
                return f"the checksum of a {n}-element chunk as {direction} is {crc}, not [{expected}]"
        state = fused.stored.unpack(packed, n, params)
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
    dtypes: StateDtypes = FP32_STATE,
    stored: StateDtypes | None = None,
) -> tuple[FusedAdam | None, str]:
    """The fused kernel that agrees with `optimizer`'s (a `DeepSpeedCPUAdam`) own kernel on this CPU, bit
    for bit, for every param group's settings, with `grad_dtype` gradients, `params_dtype` half-precision
    parameters (None: none written) and the state in `dtypes`, its chunks kept in `stored` (None: in
    `dtypes`); or None and why not."""
    if not isinstance(optimizer, DeepSpeedCPUAdam):
        return None, f"the optimizer is {type(optimizer).__qualname__}, not DeepSpeed's CPU Adam"
    if dtypes.moments not in (torch.float32, dtypes.master):
        return (
            None,
            f"{dtypes.moments} moments: DeepSpeed's CPU Adam keeps them in fp32 or the weights' dtype",
        )
    if not dtypes.is_fp32 and grad_dtype != dtypes.master:
        return None, f"{grad_dtype} gradients where the master weights are {dtypes.master}"
    for dtype in (grad_dtype, params_dtype, dtypes.master, dtypes.moments):
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
            dtypes,
        )
        for group in optimizer.param_groups
    ]
    # Each param group's hyperparameters, once.
    records = [adam_group(group, adamw) for group in optimizer.param_groups]
    candidates = _core.AdamKernel.candidates()
    why = "no candidate arithmetic agreed"

    def fused(candidate: dict[str, Any], group: dict[str, Any]) -> FusedAdam:
        # A kernel of its own per group, as DeepSpeed's check optimizer was one per group.
        kernel = _core.AdamKernel(*group["betas"], simd=simd, **candidate)
        return FusedAdam(kernel, adamw=adamw, threads=threads, dtypes=dtypes, stored=stored)

    agreeing = []
    for candidate in candidates:
        difference = None
        for group, record, calls in zip(optimizer.param_groups, records, references, strict=True):
            difference = _first_difference(calls, fused(candidate, group), record, grad_scale)
            if difference is not None:
                break
        if difference is None:
            agreeing.append(candidate)
            if dtypes.is_fp32:
                break
        elif candidate == candidates[0]:
            why = f"with DeepSpeed's SIMD arithmetic, {difference}"
    if not dtypes.is_fp32:
        # Rounded to half precision, most elements hide how the products were fused.
        agreeing = _tell_apart(optimizer, agreeing, fused, grad_scale, grad_dtype, params_dtype, dtypes)
    if not agreeing:
        return None, why
    # The job's kernel starts as DeepSpeed's optimizer object did, from its constructor's betas.
    kernel = _core.AdamKernel(*optimizer.defaults["betas"], simd=simd, **agreeing[0])
    return FusedAdam(
        kernel, adamw=adamw, threads=threads, dtypes=dtypes, stored=stored
    ), f"agrees with DeepSpeed's CPU Adam ({agreeing[0]}{'' if dtypes.is_fp32 else f'; {dtypes}'})"


# Calls that tell candidates apart: of one element (the scalar loop, whatever a build's width) and of
# a vector's worth (DeepSpeed's vector code where a build has it for the state's dtypes).
WITNESS_CALLS = (1, 16)


def _tell_apart(
    optimizer: Any,
    agreeing: list[dict[str, Any]],
    fused: Callable[[dict[str, Any], dict[str, Any]], FusedAdam],
    grad_scale: float,
    grad_dtype: torch.dtype,
    params_dtype: torch.dtype | None,
    dtypes: StateDtypes,
) -> list[dict[str, Any]]:
    """Of the candidates that agreed with DeepSpeed on the random chunks, those that also agree on calls
    of elements that tell the first one's arithmetic apart from another's (`_core.AdamKernel.witness`),
    per param group and call size, the first first; where DeepSpeed agrees with none, none."""
    if not agreeing:
        return []
    adamw = bool(optimizer.adam_w_mode)
    master, moments = DTYPES[dtypes.master], DTYPES[dtypes.moments]

    def arithmetic(candidate: dict[str, Any], n: int, group: dict[str, Any]) -> tuple[Any, ...]:
        # A call of `n` elements, all in the vector code or all in the scalar loop.
        if n > 1 and fused(candidate, group).kernel.vector_width_for(master, moments) > 1:
            return ("vector",)
        return candidate["momentum"], candidate["variance"], candidate["others"]

    for group in optimizer.param_groups:
        record = adam_group(group, adamw)
        for n in WITNESS_CALLS:
            compared: list[dict[str, Any]] = []
            while True:
                first = agreeing[0]
                others = [
                    c
                    for c in agreeing[1:]
                    if c not in compared and arithmetic(c, n, group) != arithmetic(first, n, group)
                ]
                if not others:
                    break
                other = others[0]
                compared.append(other)
                found = fused(first, group).kernel.witness(
                    fused(other, group).kernel, record, step=1, grad_scale=grad_scale,
                    seed=len(compared), vector=arithmetic(first, n, group) == ("vector",),
                    other_vector=arithmetic(other, n, group) == ("vector",), master_dtype=master,
                    moments_dtype=moments,
                )  # fmt: skip
                if found is None:
                    continue
                call = _witness_call(
                    optimizer.ds_opt_adam,
                    found,
                    n,
                    group,
                    adamw,
                    grad_scale,
                    grad_dtype,
                    params_dtype,
                    dtypes,
                )
                agreeing = [
                    c
                    for c in agreeing
                    if _first_difference([call], fused(c, group), record, grad_scale) is None
                ]
                if not agreeing:
                    return []
    return agreeing


def choose_update_kernel(
    setting: str,
    optimizer: Any,
    grad_dtype: torch.dtype,
    params_dtype: torch.dtype | None,
    threads: int | None = None,
    dtypes: StateDtypes = FP32_STATE,
    stored: StateDtypes | None = None,
) -> tuple[FusedAdam | None, str]:
    """`update_kernel` ("auto", "fused", "deepspeed"): the fused kernel where it agrees with DeepSpeed's
    (see `self_check`), on `threads` threads (None: torch's), else None (DeepSpeed's passes), and why.
    `"fused"` refuses to start without it. A state in half precision (`dtypes`) needs it: the engine's
    DeepSpeed path runs on fp32 state only, so any other setting, or a check that fails, is refused."""
    if not dtypes.is_fp32 and setting == "deepspeed":
        raise ValueError(troubleshooting.UPDATE_KERNEL_HALF.message(dtypes=dtypes))
    if setting == "deepspeed":
        return None, "configured"
    fused, why = self_check(
        optimizer, grad_dtype, params_dtype, threads=threads, dtypes=dtypes, stored=stored
    )
    if fused is None and (setting == "fused" or not dtypes.is_fp32):
        needs = "" if dtypes.is_fp32 else f" (and the state in half precision, {dtypes}, needs it)"
        raise ValueError(troubleshooting.UPDATE_KERNEL.message(setting=setting, why=why, needs=needs))
    return fused, why
