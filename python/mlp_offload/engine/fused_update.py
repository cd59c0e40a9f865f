"""The update's per-chunk work in one pass: `_core.AdamKernel` (`crates/mlp-offload-core/src/kernel/`)
in place of DeepSpeed's four passes (the cast of the half-precision gradient, `unscale_and_clip_grads`,
CPU Adam, the copy into the half-precision partition), bit for bit the same.

What the Rust kernel cannot know from DeepSpeed's source (its build's arithmetic) is found at start-up,
on this CPU, against DeepSpeed's own kernel (`mlp_offload.adapter.kernel_check`). With DeepSpeed's
state in half precision, each value is rounded as DeepSpeed's CPU Adam stores it and kept in the
dtypes DeepSpeed keeps it in (`state_dtypes.StateDtypes`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from mlp_offload import _core
from mlp_offload.engine.state_dtypes import DTYPES, FP32_STATE, StateDtypes
from mlp_offload.engine.telemetry import UpdateKernel


def adam_group(group: dict[str, Any], adamw: bool) -> _core.AdamGroup:
    """Adam's hyperparameters of a torch param group (lr, betas, eps, weight decay, bias correction: on
    unless the group says otherwise), with `adamw` (DeepSpeed's `adamw_mode`), as the pass takes them:
    made once per param group and step, not per chunk."""
    beta1, beta2 = group["betas"]
    return _core.AdamGroup(
        group["lr"],
        beta1,
        beta2,
        group["eps"],
        group["weight_decay"],
        bool(group.get("bias_correction", True)),
        adamw,
    )


def _address(t: torch.Tensor, n: int, what: str) -> int:
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n or t.dtype not in DTYPES:
        raise ValueError(
            f"{what}: the fused update takes {n} contiguous CPU elements of float32, bfloat16 or float16, "
            f"not {t.numel()} {t.dtype} on {t.device}{'' if t.is_contiguous() else ' (strided)'}"
        )
    return t.data_ptr()


def _state_address(t: torch.Tensor, nbytes: int, what: str) -> int:
    size = t.numel() * t.element_size()
    if t.device.type != "cpu" or not t.is_contiguous() or size != nbytes:
        raise ValueError(
            f"{what}: the fused update takes a state of {nbytes} contiguous bytes in CPU memory, not "
            f"{size} on {t.device}{'' if t.is_contiguous() else ' (strided)'}"
        )
    return t.data_ptr()


class PassSums(NamedTuple):
    """A pass's checksums: the state's CRC32C per stripe as read and as written, where asked for; with
    the master weights in the parameters, the parameters' own as read and as written (where the state's
    were asked for)."""

    read: list[int] | None
    write: list[int] | None
    params_read: int | None = None
    params_write: int | None = None


class FusedAdam:
    """DeepSpeed's update of one chunk as one pass of `kernel`, with `adamw` (DeepSpeed's `adamw_mode`) on
    `threads` threads, the state's values in `dtypes`, its chunks kept in `stored` (by default the same
    dtypes; fp32 arrays may hold values of narrower ones): `layout`, checked once here (a `ValueError`
    naming the field where DeepSpeed keeps no such state)."""

    def __init__(
        self,
        kernel: _core.AdamKernel,
        *,
        adamw: bool,
        threads: int,
        dtypes: StateDtypes = FP32_STATE,
        stored: StateDtypes | None = None,
    ) -> None:
        self.kernel = kernel
        self.adamw = adamw
        self.threads = threads
        self.dtypes = dtypes
        self.stored = dtypes if stored is None else stored
        self.layout = _core.StateLayout(
            DTYPES[dtypes.master],
            DTYPES[dtypes.moments],
            stored_master=DTYPES[self.stored.master],
            stored_moments=DTYPES[self.stored.moments],
            master_in_params=self.stored.master_in_params,
        )

    def groups(self, param_groups: list[dict[str, Any]]) -> list[_core.AdamGroup]:
        """The param groups as the pass takes them (`adam_group`), made once for an update over chunks."""
        return [adam_group(group, self.adamw) for group in param_groups]

    def update(
        self,
        state: torch.Tensor,
        grad: torch.Tensor,
        params: torch.Tensor | None,
        *,
        group: _core.AdamGroup,
        step: int,
        grad_scale: float,
        read_cuts: list[int] | None = None,
        write_cuts: list[int] | None = None,
        kept_params: list[tuple[int, torch.Tensor]] | None = None,
        kept_state: torch.Tensor | None = None,
    ) -> PassSums:
        """One chunk: `state` its bytes (any dtype: `stored.arrays` lays them out), `grad` its
        half-precision (or fp32) gradient before `grad_scale` (DeepSpeed's `1 / combined_scale`), `params`
        where the new half-precision parameters go (with `stored.master_in_params`, the master weights
        themselves, read and written); `group` the chunk's param group's hyperparameters (`adam_group`)
        and `step` the Adam step after this update, as DeepSpeed's CPU Adam takes them.
        Returns the state's CRC32C per stripe as read and as written, cut at `read_cuts`/`write_cuts`
        (the store's stripe starts), where given (`PassSums`). Given `kept_params`, the pass appends to
        it the parameters as they were before it wherever they were not the old weights narrowed (every
        one, where they are the master weights), a block at a time (its first element, its values),
        checked in the pass itself. Given `kept_state` (as many bytes as `state`), the pass copies the
        state there as it was before it, a block at a time while the block is in the core's cache: the
        one copy of state kept nowhere else (a cached chunk's) that an undo needs, for one more write and
        no more reads."""
        n = grad.numel()
        nbytes = self.stored.nbytes(n)
        arrays = _core.ChunkArrays(
            _state_address(state, nbytes, "state"),
            _address(grad, n, "grad"),
            DTYPES[grad.dtype],
            n,
            params=None if params is None else _address(params, n, "params"),
            params_dtype=None if params is None else DTYPES[params.dtype],
            keep_state=None if kept_state is None else _state_address(kept_state, nbytes, "kept_state"),
            keep_params=kept_params is not None,
        )
        # The kernel runs without the GIL: the tensors are the caller's and outlive the call.
        read, write, kept, (params_read, params_write) = self.kernel.update(
            arrays,
            self.layout,
            group,
            step=step,
            grad_scale=grad_scale,
            threads=self.threads,
            read_cuts=read_cuts,
            write_cuts=write_cuts,
        )
        if kept_params is not None and kept and params is not None:
            kept_params.extend(
                (first, torch.frombuffer(bytearray(data), dtype=params.dtype)) for first, data in kept
            )
        return PassSums(read, write, params_read, params_write)


def crc32c_of(t: torch.Tensor) -> int:
    """The CRC32C of a contiguous CPU tensor's bytes, as the store and the pass sum them."""
    return _core.crc32c(t.view(torch.uint8).numpy())


def stripe_sums(t: torch.Tensor, cuts: list[int] | None) -> list[int] | None:
    """The CRC32C of each stripe of a chunk's bytes `t`, cut at `cuts` (the stripes' starts), as the
    fused pass sums them; None where no cuts were asked for."""
    if cuts is None:
        return None
    ends = [*cuts[1:], t.numel()]
    return [crc32c_of(t[a:b]) for a, b in zip(cuts, ends, strict=True)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype and the same bits in every element (-0.0 is not 0.0; a NaN is its own payload)."""
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


def kernel_record(fused: FusedAdam | None, dtypes: StateDtypes, why: str) -> UpdateKernel:
    """The start record's account of the update's kernel (the fused pass or DeepSpeed's), and why."""
    record: UpdateKernel = {
        "kernel": "deepspeed" if fused is None else "fused",
        "why": why,
        "state_dtypes": {"master": DTYPES[dtypes.master], "moments": DTYPES[dtypes.moments]},
    }
    if fused is not None:
        # `update_threads`: by default torch's intra-op threads, as DeepSpeed's CPU Adam takes OpenMP's.
        record["simd"], record["arith"], record["threads"] = (
            fused.kernel.simd,
            fused.kernel.arith,
            fused.threads,
        )
    return record
