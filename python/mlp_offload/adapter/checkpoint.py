"""The engine's side of DeepSpeed's checkpoints and state helpers: ZeRO-3 checkpoints in DeepSpeed's own
format (so they load into stock DeepSpeed and back), and the optimizer-swapper protocol that DeepSpeed's
`safe_get/set_*` helpers swap subgroups in and out through. Both see whole subgroups, gathered from and
scattered to their chunks (`state.ChunkedState`)."""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime.zero import stage3
from deepspeed.runtime.zero.stage3 import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT

from mlp_offload.adapter import stale_gradients
from mlp_offload.engine.state import FP32, STATE_TENSORS

# DeepSpeed's own class (`install()` leaves the name bound to it).
DeepSpeedZeroOptimizer_Stage3: Any = stage3.DeepSpeedZeroOptimizer_Stage3


def state_dict(opt: Any) -> Any:
    """DeepSpeed's ZeRO-3 optimizer state dict (`_rigid_state_dict`'s keys and layout), with each
    subgroup's fp32 weights and Adam moments brought in from the cache and the store. The whole
    optimizer state is in host memory while the checkpoint is written, as with DeepSpeed's NVMe offload."""
    if opt.elastic_checkpoint:
        raise NotImplementedError("mlp_offload: ZeRO-3 elastic checkpoints are not supported")
    subgroups = range(len(opt.fp32_partitioned_groups_flat))
    for i in subgroups:
        opt._mlp_bind_state(i, opt._mlp_state.gather(i))
    try:
        # DeepSpeed's own code; it refers to the tensors just bound, which stay valid after unbinding.
        saved = DeepSpeedZeroOptimizer_Stage3._rigid_state_dict(opt)
        saved[FP32_FLAT_GROUPS] = [t.data for t in saved[FP32_FLAT_GROUPS]]
        # torch's state_dict shares each parameter's state dict, which unbinding empties: copy them.
        optimizer_state = saved[OPTIMIZER_STATE_DICT]
        optimizer_state["state"] = {k: dict(v) for k, v in optimizer_state["state"].items()}
    finally:
        for i in subgroups:
            opt._mlp_unbind(i)
    return saved


def load_state_dict(opt: Any, saved: Any, load_optimizer_states: bool) -> None:
    """Loads this rank's part of a ZeRO-3 checkpoint saved by this engine or by stock DeepSpeed (same
    data-parallel degree): fp32 weights and Adam moments go to the store, the half-precision partitions
    follow."""
    subgroups = range(len(opt.fp32_partitioned_groups_flat))
    numels = [int(n) for n in opt.fp16_partitioned_groups_flat_numel]
    fp32_groups = saved[FP32_FLAT_GROUPS]
    if len(fp32_groups) != len(subgroups):
        raise ValueError(
            f"checkpoint: {len(fp32_groups)} fp32 subgroups, this engine has {len(subgroups)} "
            "(another model, sub_group_size or data-parallel degree)"
        )
    for i, n in enumerate(numels):
        if fp32_groups[i].numel() != n:
            raise ValueError(
                f"checkpoint: subgroup {i} has {fp32_groups[i].numel():,} fp32 elements, this engine's "
                f"{n:,} (another model, sub_group_size or data-parallel degree)"
            )
    state = opt._mlp_state
    # The store alone then holds the current state (what is kept when the moments are not loaded), and
    # no host copy outlives the checkpoint.
    state.pipeline.flush()
    states = []
    for i, n in enumerate(numels):
        whole = state.gather(i) if not load_optimizer_states else torch.empty(STATE_TENSORS * n, dtype=FP32)
        opt._mlp_bind_state(i, whole)
        states.append(whole)
    try:
        # DeepSpeed's own loader: loss scaling, the moments (torch's loader matches them to our fp32
        # tensors by position), the fp32 weights into the bound tensors, the half-precision partitions.
        DeepSpeedZeroOptimizer_Stage3._rigid_load_state_dict(opt, saved, load_optimizer_states)
        if load_optimizer_states and numels:
            first = opt.optimizer.state[opt.fp32_partitioned_groups_flat[0]]
            opt._mlp_follow_loaded_moments(first["exp_avg"].dtype)
        for i, whole in enumerate(states):
            # The weights loaded into the bound tensors, and the moments torch's loader replaced with
            # tensors of its own, back into the state.
            opt._mlp_collect_state(i, whole)
            state.scatter(i, whole)
    finally:
        for i in subgroups:
            opt._mlp_unbind(i)  # the loaded state lives in the store only


class StateSwapper:
    """DeepSpeed's optimizer-swapper protocol over the store, for what still calls it: the
    `safe_get/set_*` helpers and checkpoint code swap one subgroup in, look or write, and swap it out."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.swap_folder = optimizer._mlp_store.tiers[0]["path"]
        # Subgroup -> its whole state, gathered from its chunks while swapped in.
        self._held: dict[int, torch.Tensor] = {}

    def _index(self, parameter: torch.Tensor) -> int:
        for i, t in enumerate(self.optimizer.fp32_partitioned_groups_flat):
            if t is parameter:
                return i
        raise KeyError("not one of this optimizer's fp32 partitions")

    def is_swappable_tensor(self, tensor: Any = None, numel: Any = None) -> bool:
        return True

    def swap_in_optimizer_state(self, parameter: torch.Tensor, async_parameter: Any = None) -> None:
        opt = self.optimizer
        # The update behind the last step first: it changes the state and reads the gradients.
        opt._mlp_settle()
        i = self._index(parameter)
        whole = opt._mlp_state.gather(i)
        self._held[i] = whole
        opt._mlp_bind_state(i, whole)
        # The gradient as DeepSpeed's own swap-in would hold it: in the master weights' dtype, the one a
        # setter left, else
        # converted from the half-precision one, where a parameter without a gradient at this boundary
        # has its last one times the factors of the steps since (`StaleGradients.held`).
        grad = opt._mlp_gradient(i).to(opt._mlp_dtypes.master, copy=True)
        if i not in opt._mlp_fp32_grads:
            held = opt._mlp_stale.held(r for r in opt._mlp_param_ranges if r[1] == i)
            stale_gradients.apply(grad, 0, held.get(i, []))
        parameter.grad = grad

    def swap_out_optimizer_state(self, parameter: torch.Tensor, async_swap: bool = False) -> None:
        opt = self.optimizer
        i = self._index(parameter)
        whole = self._held.pop(i)
        opt._mlp_collect_state(i, whole)
        opt._mlp_state.scatter(i, whole)
        opt._mlp_unbind(i)

    def release_swap_buffers(self, parameter: torch.Tensor) -> None:
        i = self._index(parameter)
        self._held.pop(i, None)
        self.optimizer._mlp_unbind(i)

    def writeback_optimizer_state_and_gradients(
        self, parameter: torch.Tensor, write_opt_state: bool, write_gradients: bool
    ) -> None:
        # A written gradient (DeepSpeed's gradient setters) is kept in fp32 for the subgroup until the
        # step uses it, as stock DeepSpeed's fp32 gradient buffer would hold it.
        self.optimizer._mlp_settle()
        if write_gradients:
            self.optimizer._mlp_fp32_grads[self._index(parameter)] = parameter.grad
        if write_opt_state:
            self.swap_out_optimizer_state(parameter)
        else:
            self.release_swap_buffers(parameter)

    def swap_out_gradients(self, parameter: Any, gradient_offsets: Any, gradient_tensors: Any) -> None:
        pass

    def flush_gradients(self) -> None:
        pass

    def pre_backward(self) -> None:
        pass

    def post_backward(self) -> None:
        pass

    def init_timers(self) -> None:
        pass

    def log_timers(self) -> None:
        pass

    def purge_state(self) -> None:
        pass
