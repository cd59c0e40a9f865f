"""The few members of DeepSpeed's ZeRO-3 optimizer that the update's helpers use, behind one narrow view.

`ChunkUpdater`, `StepUpdate`, `OverlapBackward` and the checkpoints' swapper read and write DeepSpeed's
half-precision partitions, its gradient buffer, its fp32 tensors with their Adam state, its param groups
and loss scale, and run its per-subgroup passes. They do it through `DeepSpeedView`, never through the
optimizer itself, as DeepSpeed's own swappers are handed what they need and never reach back. Every
DeepSpeed member the view touches is listed in `METHODS` or `ATTRIBUTES`, and `adapter.compat`
fingerprints the DeepSpeed code that defines or sets each one (`tests/test_compat.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mlp_offload.adapter.nvme_partitions import NvmePartitions, most_gathered_elements
from mlp_offload.engine.state import FP32
from mlp_offload.engine.state_dtypes import StateDtypes

# DeepSpeed's methods the view calls, and its attributes the view reads or binds (by their names in
# `DeepSpeedZeroOptimizer_Stage3`; `adapter.compat` fingerprints the code behind each).
METHODS = (
    "_unflatten_partitioned_parameters",
    "_muon_update_lacks_loss_scale",
    "unscale_and_clip_grads",
    "_optimizer_step",
    "get_param_id",
)
ATTRIBUTES = (
    "fp16_groups",
    "fp16_partitioned_groups",
    "fp16_partitioned_groups_flat",
    "fp16_partitioned_groups_flat_numel",
    "fp32_partitioned_groups_flat",
    "sub_group_to_group_id",
    "param_dict",
    "__param_id_to_grad_partition",
    "optimizer",
    "loss_scale",
    "clip_grad",
    "dtype",
    "partial_offload",
)


@dataclass
class StepSnapshot:
    """What an update over the chunks goes by, as it was when it began: each subgroup's Adam step, and the
    param groups' hyperparameters (an lr scheduler changes them once `step()` returns)."""

    steps: list[int]
    groups: list[dict[str, Any]]

    def same_groups(self, other: list[dict[str, Any]]) -> bool:
        """Whether `other` holds the same hyperparameters as these groups (their parameter lists aside)."""

        def same(x: Any, y: Any) -> bool:
            if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
            return bool(x == y)

        return len(self.groups) == len(other) and all(
            ga.keys() == gb.keys() and all(same(ga[k], gb[k]) for k in ga if k != "params")
            for ga, gb in zip(self.groups, other, strict=True)
        )


class DeepSpeedView:
    """The members of one `DeepSpeedZeroOptimizer_Stage3` (`optimizer`) the helpers use. `tensor_steps`:
    the Adam optimizer keeps its step count in a tensor (torch's Adam and AdamW), not an int (DeepSpeed's
    CPU Adam)."""

    def __init__(self, optimizer: Any, tensor_steps: bool) -> None:
        self._opt = optimizer
        self._tensor_steps = tensor_steps
        # The subgroups DeepSpeed keeps on NVMe, past `offload_param.max_in_cpu` (none where it has a flat
        # partition for every one).
        self.on_nvme = NvmePartitions(optimizer)

    # ----------------------------------------------------------------------------------------------
    # The partitions and the gradient buffer

    def partition(self, i: int) -> torch.Tensor:
        """Subgroup `i`'s half-precision partition (its flat data); for a subgroup on NVMe, its flat copy
        in host memory (`NvmePartitions.get`), written back by `unflatten(i)` or `settle_partitions`."""
        flat = self._opt.fp16_partitioned_groups_flat[i]
        return self.on_nvme.get(i) if flat is None else flat.data

    def partition_on_host(self, i: int) -> bool:
        """Whether subgroup `i`'s partition is in host memory where DeepSpeed computes on an accelerator
        (`offload_param`: its flat copy, for a subgroup on NVMe), without fetching it."""
        flat = self._opt.fp16_partitioned_groups_flat[i]
        return flat is None or flat.device != self.accelerator_device()

    @property
    def partition_dtype(self) -> torch.dtype:
        """The half-precision partitions' dtype (the model's)."""
        dtype: torch.dtype = self._opt.dtype
        return dtype

    def settle_partitions(self) -> None:
        """The flat copy of a subgroup on NVMe, if one is held, written back where it changed and freed,
        and every write of one complete: the parameters' objects are current for the next fetch."""
        self.on_nvme.let_go()
        self.on_nvme.flush()

    def offload_ratio(self) -> tuple[float, str]:
        """DeepSpeed's `offload_optimizer.ratio` (its `partial_offload`) and the name its placement of
        subgroups compares with `"cpu"` (`get_accelerator()._name`)."""
        from deepspeed.accelerator import get_accelerator

        return float(self._opt.partial_offload), str(get_accelerator()._name)

    def accelerator_device(self) -> torch.device:
        """The device DeepSpeed computes on (the CPU on its CPU accelerator)."""
        from deepspeed.accelerator import get_accelerator

        return torch.device(get_accelerator().current_device_name())

    def backward_bytes(self, norm_buffer_size: int) -> int:
        """Host memory the first forward and backward take that the start-up has not: the parameters
        DeepSpeed gathers where it computes on the host (`most_gathered_elements`), its reduce buckets
        (made empty, their pages given when first written), and the gradient norms' fp64 scratch (the
        largest partition, up to DeepSpeed's norm buffer of `norm_buffer_size` elements)."""
        opt = self._opt
        buffers = [getattr(bucket, "buffer", None) for bucket in opt.ipg_buckets.values()]
        on_host = [b for b in buffers if b is not None and b.device.type == "cpu"]
        buckets = sum(b.numel() * b.element_size() for b in on_host)
        params = [p for group in opt.fp16_groups for p in group]
        largest = max(int(p.ds_tensor.numel()) for p in params)
        scratch = torch.float64.itemsize * min(largest, norm_buffer_size)
        return buckets + scratch + self._gathered_bytes(params)

    def _gathered_bytes(self, params: list[Any]) -> int:
        """The most the parameters DeepSpeed gathers for the forward and backward take at once, where they
        are gathered into host memory (an accelerator's memory holds them elsewhere)."""
        from deepspeed.accelerator import get_accelerator

        if torch.device(get_accelerator().current_device_name()).type != "cpu":
            return 0
        live = most_gathered_elements(self._opt)
        return min(sum(int(p.ds_numel) for p in params), live) * params[0].element_size()

    def numel(self, i: int) -> int:
        return int(self._opt.fp16_partitioned_groups_flat_numel[i])

    def param_id(self, param: Any) -> int:
        return int(self._opt.get_param_id(param))

    def param_half_grad(self, pid: int) -> torch.Tensor:
        """Parameter `pid`'s slice of DeepSpeed's host gradient buffer (half precision)."""
        opt = self._opt
        return self._grad_slices()[opt.param_dict[pid].ds_id]

    def half_grad_ends(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSpeed's slices of its gradient buffer of subgroup `i`'s first and last parameters."""
        params, slices = self._opt.fp16_groups[i], self._grad_slices()
        return slices[params[0].ds_id], slices[params[-1].ds_id]

    def _grad_slices(self) -> dict[Any, torch.Tensor]:
        slices: dict[Any, torch.Tensor] = self._opt._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        return slices

    def unflatten(self, i: int) -> None:
        """DeepSpeed re-points subgroup `i`'s parameters at its partition (after its last chunk); a
        subgroup on NVMe has its flat copy written back instead, as DeepSpeed writes it there."""
        if self.on_nvme.on_nvme(i):
            self.on_nvme.let_go()
        else:
            self._opt._unflatten_partitioned_parameters(i)

    # ----------------------------------------------------------------------------------------------
    # The Adam state and the param groups

    def snapshot(self) -> StepSnapshot:
        """Each subgroup's Adam step and the param groups as they are now."""
        opt = self._opt
        return StepSnapshot(
            steps=[int(opt.optimizer.state[t].get("step", 0)) for t in opt.fp32_partitioned_groups_flat],
            groups=[dict(group) for group in opt.optimizer.param_groups],
        )

    def group_of(self, i: int) -> int:
        """The param group of subgroup `i`."""
        return int(self._opt.sub_group_to_group_id[i])

    def fp32_index(self, tensor: torch.Tensor) -> int:
        """The subgroup whose fp32 tensor `tensor` is (what DeepSpeed's swapper protocol names)."""
        for i, t in enumerate(self._opt.fp32_partitioned_groups_flat):
            if t is tensor:
                return i
        raise KeyError("not one of this optimizer's fp32 partitions")

    def adam_state(self, i: int) -> dict[str, Any]:
        """The optimizer's state of subgroup `i`'s fp32 tensor."""
        opt = self._opt
        state: dict[str, Any] = opt.optimizer.state[opt.fp32_partitioned_groups_flat[i]]
        return state

    def first_moments_dtype(self) -> torch.dtype:
        """The dtype of the first subgroup's Adam moments (after a checkpoint's load)."""
        return self.adam_state(0)["exp_avg"].dtype

    def set_step(self, i: int, step: int) -> None:
        """Subgroup `i`'s Adam step, as the optimizer keeps it (an int, or torch's float tensor)."""
        self.adam_state(i)["step"] = self._step_value(step)

    def _step_value(self, step: int) -> Any:
        if not self._tensor_steps:
            return step
        # torch's Adam keeps it as a float tensor of its scalar dtype.
        return torch.tensor(
            float(step), dtype=torch.float64 if torch.get_default_dtype() == torch.float64 else FP32
        )

    def after_fused_pass(self, i: int, step: int) -> None:
        """Subgroup `i`'s Adam state as DeepSpeed's CPU Adam leaves it after a step the fused pass ran:
        the step, and the moments' keys (empty: the state is in the store)."""
        adam = self.adam_state(i)
        adam["step"] = self._step_value(step)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in adam:
                adam[key] = torch.empty(0, dtype=FP32)

    def bind_state(self, i: int, state_bytes: torch.Tensor, dtypes: StateDtypes) -> None:
        """Points DeepSpeed's fp32 tensor and its Adam state at subgroup `i`'s `[params | exp_avg |
        exp_avg_sq]` in fp32: at the state itself, or where DeepSpeed keeps them in half precision
        (`dtypes`), at copies in those dtypes (`collect_state` brings what was written to them back)."""
        n = self.numel(i)
        state = state_bytes.view(FP32)
        fp32 = self._opt.fp32_partitioned_groups_flat[i]
        fp32.data = state[:n].to(dtypes.master)
        adam = self._opt.optimizer.state[fp32]
        if "step" not in adam:
            adam["step"] = self._step_value(0)
        adam["exp_avg"] = state[n : 2 * n].to(dtypes.moments)
        adam["exp_avg_sq"] = state[2 * n : 3 * n].to(dtypes.moments)

    def collect_state(self, i: int, state_bytes: torch.Tensor) -> None:
        """Subgroup `i`'s state as DeepSpeed's tensors bound to it (`bind_state`) now hold it, back into
        `state_bytes` where they are copies (widened: exact)."""
        n = self.numel(i)
        state = state_bytes.view(FP32)
        fp32 = self._opt.fp32_partitioned_groups_flat[i]
        adam = self._opt.optimizer.state[fp32]
        for k, bound in enumerate((fp32.data, adam["exp_avg"], adam["exp_avg_sq"])):
            whole = state[k * n : (k + 1) * n]
            if bound.data_ptr() != whole.data_ptr():
                whole.copy_(bound)

    def bind_chunk(self, i: int, state: torch.Tensor, step: int, grad: torch.Tensor) -> None:
        """Points DeepSpeed's fp32 tensor of subgroup `i`, its Adam state and its gradient at one chunk's
        fp32 `[params | exp_avg | exp_avg_sq]` and gradient, as if they were the whole subgroup, at Adam
        step `step` (CPU Adam counts one per call)."""
        count = grad.numel()
        fp32 = self._opt.fp32_partitioned_groups_flat[i]
        fp32.data = state[:count]
        adam = self._opt.optimizer.state[fp32]
        adam["step"] = self._step_value(step)
        adam["exp_avg"] = state[count : 2 * count]
        adam["exp_avg_sq"] = state[2 * count :]
        fp32.grad = grad

    def unbind(self, i: int) -> None:
        """DeepSpeed's fp32 tensor of subgroup `i` and its moments empty again (the state is the store's)."""
        fp32 = self._opt.fp32_partitioned_groups_flat[i]
        fp32.data = torch.empty(0, dtype=FP32)
        fp32.grad = None
        adam = self._opt.optimizer.state[fp32]
        for key in ("exp_avg", "exp_avg_sq"):
            if key in adam:
                adam[key] = torch.empty(0, dtype=FP32)

    # ----------------------------------------------------------------------------------------------
    # DeepSpeed's passes and its scaling

    def deepspeed_passes(self, i: int, scaled_norm: Any, first: int) -> None:
        """DeepSpeed's per-subgroup update on the chunk bound to subgroup `i` (`bind_chunk`) at element
        `first`: unscale and clip, its optimizer's step, and the copy into the half-precision partition
        (its `_reassign_or_swap_out_partitioned_parameters`, one chunk at a time)."""
        opt = self._opt
        fp32 = opt.fp32_partitioned_groups_flat[i]
        if opt._muon_update_lacks_loss_scale(i):
            fp32.grad.mul_(opt.loss_scale)
        opt.unscale_and_clip_grads(i, scaled_norm)
        opt._optimizer_step(i)
        self.partition(i)[first : first + fp32.numel()].copy_(fp32.data)

    @property
    def loss_scale(self) -> Any:
        return self._opt.loss_scale

    @property
    def clip_grad(self) -> float:
        return float(self._opt.clip_grad)

    def clip_ratio(self, total_norm: Any) -> Any:
        """DeepSpeed's clipping ratio in `unscale_and_clip_grads` for a scaled gradient norm (a float, or a
        0-dim tensor: the same operations either way); it clips where this is above 1."""
        return ((total_norm / self._opt.loss_scale) + 1e-6) / self._opt.clip_grad

    def grad_scale(self, total_norm: Any) -> float:
        """What DeepSpeed's `unscale_and_clip_grads` multiplies every fp32 gradient by this step, from the
        same expressions (a float, or a 0-dim tensor's value: torch multiplies by it as a float)."""
        combined_scale = self._opt.loss_scale
        if self._opt.clip_grad > 0.0:
            clip = torch.clamp(self.clip_ratio(total_norm), min=1.0)
            combined_scale = clip * self._opt.loss_scale
        return float(1.0 / combined_scale)
