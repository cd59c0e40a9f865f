"""The dtypes DeepSpeed keeps a subgroup's optimizer state in (`StateDtypes`), and how a chunk keeps it.

With DeepSpeed's master weights in half precision (`bf16.bf16_master_weights_and_grads`,
`fp16.fp16_master_weights_and_grads`) and its moments in bf16 (`bf16.bf16_optimizer_states`), each value
is rounded as DeepSpeed's CPU Adam stores it and kept in those dtypes, so the chunks hold the mode's
bytes (`StateDtypes.arrays`: 6 or 10 a parameter, laid out as `_core.StateLayout.offsets` says).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mlp_offload import _core

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class StateDtypes:
    """The dtypes DeepSpeed keeps a subgroup's optimizer state in: its master weights (and their
    gradients: DeepSpeed's `master_weights_and_grads_dtype`) and its Adam moments; and, for how chunks
    keep them, whether the master weights are the half-precision parameters themselves
    (`master_in_params`: a chunk's bytes are its moments alone)."""

    master: torch.dtype = torch.float32
    moments: torch.dtype = torch.float32
    master_in_params: bool = False

    @property
    def is_fp32(self) -> bool:
        return self.master == torch.float32 and self.moments == torch.float32

    def __str__(self) -> str:
        where = " (in the parameters)" if self.master_in_params else ""
        return f"master weights {DTYPES[self.master]}{where}, moments {DTYPES[self.moments]}"

    @property
    def layout(self) -> _core.StateLayout:
        """The core's record of a chunk keeping values of these dtypes in these dtypes (made once per
        value of the record; a `ValueError` naming the field where DeepSpeed keeps no such state)."""
        return _layout(self)

    @property
    def bytes_per_element(self) -> int:
        """Bytes of state per parameter a chunk keeps: 12 in fp32, 10 or 6 in half precision; 8 or 4
        with the master weights in the parameters."""
        return (0 if self.master_in_params else self.master.itemsize) + 2 * self.moments.itemsize

    def nbytes(self, n: int) -> int:
        """Bytes of a chunk of `n` elements kept in these dtypes."""
        return self.bytes_per_element * n

    def arrays(self, state: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        """Views of the arrays a chunk's bytes keep in `state` (any dtype, at least `nbytes(n)`), each in
        its dtype, where `layout.offsets` lays them out (the wider arrays first, so each is aligned
        whatever `n` is): params, exp_avg and exp_avg_sq, or with `master_in_params` the moments alone."""
        offsets, total = self.layout.offsets(n)
        raw = state.view(torch.uint8)[:total]
        kept = zip(offsets, (self.master, self.moments, self.moments), strict=True)
        return tuple(
            raw[at : at + n * dtype.itemsize].view(dtype)
            for k, (at, dtype) in enumerate(kept)
            if k > 0 or not self.master_in_params
        )

    def pack(self, fp32: torch.Tensor) -> torch.Tensor:
        """`[params | exp_avg | exp_avg_sq]` in fp32 (values of these dtypes) as a chunk's bytes kept
        in them: each value's own bits (the moments alone with `master_in_params`)."""
        n = fp32.numel() // 3
        state = torch.empty(self.nbytes(n), dtype=torch.uint8)
        first = 1 if self.master_in_params else 0
        for k, array in enumerate(self.arrays(state, n), start=first):
            array.copy_(fp32[k * n : (k + 1) * n])
        return state

    def unpack(self, state: torch.Tensor, n: int, params: torch.Tensor | None = None) -> torch.Tensor:
        """A chunk's bytes kept in these dtypes as `[params | exp_avg | exp_avg_sq]` in fp32 (widened:
        exact); with `master_in_params` the master weights are `params`."""
        arrays = self.arrays(state, n)
        if self.master_in_params:
            assert params is not None, "the master weights are the parameters"
            arrays = (params, *arrays)
        return torch.cat([array.float() for array in arrays])


@functools.cache
def _layout(dtypes: StateDtypes) -> _core.StateLayout:
    # Kept here rather than on the record: the record stays a plain value (copied, pickled, compared).
    return _core.StateLayout(
        DTYPES[dtypes.master], DTYPES[dtypes.moments], master_in_params=dtypes.master_in_params
    )


FP32_STATE = StateDtypes()
