"""The state of the subgroups kept on the accelerator (DeepSpeed's `offload_optimizer.ratio`: its first
subgroups), whole and out of the store, in the dtypes DeepSpeed keeps them in, updated there by the
accelerator's pass (`accelerator_adam.AcceleratorAdam`), bit for bit the host pass's. `ChunkedState`
hands their whole-subgroup views (checkpoints, DeepSpeed's state helpers) here."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlp_offload import _core
from mlp_offload.engine.accelerator_adam import AcceleratorAdam
from mlp_offload.engine.state_dtypes import StateDtypes

FP32 = torch.float32


class AcceleratorState:
    """Subgroups `0..len(numels)` of `numels` elements each, on `device`, in `dtypes` (their master
    weights apart from the parameters), updated with `kernel`'s arithmetic and bias state (the host
    pass's own `_core.AdamKernel`)."""

    def __init__(
        self, numels: list[int], device: torch.device, dtypes: StateDtypes, kernel: _core.AdamKernel
    ) -> None:
        if dtypes.master_in_params:
            raise ValueError(
                f"a state kept on the accelerator keeps its master weights apart, not as {dtypes}"
            )
        self.numels = numels
        self.device = device
        self.dtypes = dtypes
        self.update_pass = AcceleratorAdam(kernel, dtypes=dtypes)
        # Per subgroup: master weights, exp_avg, exp_avg_sq.
        self.arrays: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __contains__(self, subgroup: int) -> bool:
        return subgroup < len(self.numels)

    @property
    def nbytes(self) -> int:
        """The accelerator memory the state takes."""
        return sum(self.dtypes.nbytes(n) for n in self.numels)

    def initialize(self, half_precision: Callable[[int], torch.Tensor]) -> None:
        """Each subgroup's first state: its half-precision partition in the master weights' dtype (as
        DeepSpeed's `.to(master dtype)`: exact), zero moments."""
        master, moments = self.dtypes.master, self.dtypes.moments
        self.arrays = [
            (
                half_precision(i).to(self.device, master, copy=True),
                torch.zeros(n, dtype=moments, device=self.device),
                torch.zeros(n, dtype=moments, device=self.device),
            )
            for i, n in enumerate(self.numels)
        ]

    def gather(self, subgroup: int) -> torch.Tensor:
        """A fresh fp32 host copy of the subgroup's `[params | exp_avg | exp_avg_sq]` (widened: exact)."""
        return torch.cat([a.to("cpu", FP32) for a in self.arrays[subgroup]])

    def scatter(self, subgroup: int, state: torch.Tensor) -> None:
        """Makes the subgroup's `[params | exp_avg | exp_avg_sq]` (fp32 values of its dtypes) current."""
        n = self.numels[subgroup]
        for k, array in enumerate(self.arrays[subgroup]):
            array.copy_(state[k * n : (k + 1) * n])

    def set_params(self, subgroup: int, values: torch.Tensor) -> None:
        """Makes `values` (any float dtype) the subgroup's master weights, as DeepSpeed's copy converts
        them; the moments stay."""
        self.arrays[subgroup][0].copy_(values)

    def update(
        self,
        subgroup: int,
        grad: torch.Tensor,
        partition: torch.Tensor,
        *,
        group: _core.AdamGroup,
        step: int,
        grad_scale: float,
    ) -> None:
        """DeepSpeed's update of the subgroup (`FusedAdam.update`'s, on the accelerator): `grad` its
        gradient before `grad_scale` (on the host or here), the new parameters into `partition` (here, or
        through a copy where it lies elsewhere)."""
        master, exp_avg, exp_avg_sq = self.arrays[subgroup]
        params = (
            partition if partition.device == self.device else torch.empty_like(partition, device=self.device)
        )
        self.update_pass.update(
            master,
            exp_avg,
            exp_avg_sq,
            grad.to(self.device),
            params,
            group=group,
            step=step,
            grad_scale=grad_scale,
        )
        if params is not partition:
            partition.copy_(params)
