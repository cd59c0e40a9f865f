"""The engine's side of DeepSpeed's checkpoints and state helpers: ZeRO-3 checkpoints in DeepSpeed's own
format (so they load into stock DeepSpeed and back), universal checkpoints (`ds_to_universal.py`'s, loaded
at any data-parallel degree), and the optimizer-swapper protocol that DeepSpeed's `safe_get/set_*` helpers
swap subgroups in and out through. ZeRO-3 checkpoints and the helpers see whole subgroups, gathered from
and scattered to their chunks (`state.ChunkedState`); a universal checkpoint is loaded chunk by chunk."""

from __future__ import annotations

import dataclasses
import errno
import functools
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.checkpoint.constants import EP_IS_EXPERT_PARAM, PARAM
from deepspeed.runtime.zero import stage3
from deepspeed.runtime.zero.stage3 import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from mlp_offload.adapter import stale_gradients, troubleshooting
from mlp_offload.adapter.chunk_update import ChunkUpdater
from mlp_offload.adapter.deepspeed_view import DeepSpeedView
from mlp_offload.adapter.session import UpdateSession
from mlp_offload.engine.state import FP32, STATE_TENSORS

# DeepSpeed's own class (`install()` leaves the name bound to it).
DeepSpeedZeroOptimizer_Stage3: Any = stage3.DeepSpeedZeroOptimizer_Stage3


def state_dict(opt: Any, session: UpdateSession, view: DeepSpeedView) -> Any:
    """DeepSpeed's ZeRO-3 optimizer state dict (`_rigid_state_dict`'s keys and layout, DeepSpeed's own
    code run on `opt`), with each subgroup's fp32 weights and Adam moments brought in from the cache and
    the store. The whole optimizer state is in host memory while the checkpoint is written, as with
    DeepSpeed's NVMe offload."""
    if opt.elastic_checkpoint:
        raise NotImplementedError("mlp_offload: ZeRO-3 elastic checkpoints are not supported")
    subgroups = range(len(opt.fp32_partitioned_groups_flat))
    for i in subgroups:
        view.bind_state(i, session.state.gather(i), session.dtypes)
    try:
        # DeepSpeed's own code; it refers to the tensors just bound, which stay valid after unbinding.
        saved = DeepSpeedZeroOptimizer_Stage3._rigid_state_dict(opt)
        saved[FP32_FLAT_GROUPS] = [t.data for t in saved[FP32_FLAT_GROUPS]]
        # torch's state_dict shares each parameter's state dict, which unbinding empties: copy them.
        optimizer_state = saved[OPTIMIZER_STATE_DICT]
        optimizer_state["state"] = {k: dict(v) for k, v in optimizer_state["state"].items()}
    finally:
        for i in subgroups:
            view.unbind(i)
    return saved


def load_state_dict(
    opt: Any, session: UpdateSession, view: DeepSpeedView, saved: Any, load_optimizer_states: bool
) -> None:
    """Loads this rank's part of a ZeRO-3 checkpoint saved by this engine or by stock DeepSpeed (same
    data-parallel degree): fp32 weights and Adam moments go to the store, the half-precision partitions
    follow."""
    subgroups = range(len(opt.fp32_partitioned_groups_flat))
    numels = [int(n) for n in opt.fp16_partitioned_groups_flat_numel]
    fp32_groups = saved[FP32_FLAT_GROUPS]
    if len(fp32_groups) != len(subgroups):
        raise ValueError(
            troubleshooting.CHECKPOINT_LAYOUT.message(
                theirs=f"{len(fp32_groups)} fp32 subgroups", ours=len(subgroups)
            )
        )
    for i, n in enumerate(numels):
        if fp32_groups[i].numel() != n:
            raise ValueError(
                troubleshooting.CHECKPOINT_LAYOUT.message(
                    theirs=f"subgroup {i} has {fp32_groups[i].numel():,} fp32 elements", ours=f"{n:,}"
                )
            )
    state = session.state
    # The store alone then holds the current state (what is kept when the moments are not loaded), and
    # no host copy outlives the checkpoint.
    state.pipeline.flush()
    states = []
    for i, n in enumerate(numels):
        whole = state.gather(i) if not load_optimizer_states else torch.empty(STATE_TENSORS * n, dtype=FP32)
        view.bind_state(i, whole, session.dtypes)
        states.append(whole)
    try:
        # DeepSpeed's own loader: loss scaling, the moments (torch's loader matches them to our fp32
        # tensors by position), the fp32 weights into the bound tensors, the half-precision partitions.
        with view.on_nvme.as_flat_buffers():
            DeepSpeedZeroOptimizer_Stage3._rigid_load_state_dict(opt, saved, load_optimizer_states)
        if load_optimizer_states and numels:
            session.follow_loaded_moments(view.first_moments_dtype())
        for i, whole in enumerate(states):
            # The weights loaded into the bound tensors, and the moments torch's loader replaced with
            # tensors of its own, back into the state.
            view.collect_state(i, whole)
            state.scatter(i, whole)
    finally:
        for i in subgroups:
            view.unbind(i)  # the loaded state lives in the store only


def refuse_another_degree(engine: Any, load_dir: str, tag: Any, load_optimizer_states: bool) -> None:
    """Stock DeepSpeed's refusal of a ZeRO checkpoint saved at another data-parallel degree (in
    `DeepSpeedEngine._load_zero_checkpoint`, before any state is loaded), saying how to convert it."""
    saved, now = engine.loaded_checkpoint_dp_world_size, engine.seq_dp_world_size
    if not load_optimizer_states or engine.load_universal_checkpoint() or saved == now:
        return
    folder = os.path.join(load_dir, str(tag))
    raise ZeRORuntimeException(
        troubleshooting.ANOTHER_DEGREE.message(folder=folder, saved=saved, now=now, tag=f"{tag}_universal")
    )


# A universal checkpoint's state files of each parameter, in the order of a chunk's arrays.
UNIVERSAL_KEYS = ("fp32", "exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class UniversalPart:
    """A parameter's part of a subgroup on this rank, as stock's `load_hp_checkpoint_state` cuts it: the
    parameter's folder in the checkpoint, where its partition lies in the subgroup (`offset`, `numel`
    elements with padding), and where in the parameter's whole flat tensor (`start`, `real` elements
    there: the padding past them is zeros)."""

    name: str
    folder: str
    offset: int
    numel: int
    start: int
    real: int


def _mapped(folder: str, key: str, name: str) -> torch.Tensor:
    """Parameter `name`'s `key` tensor of a universal checkpoint, mapped rather than read: only what is
    copied out of it comes into memory, and only while it is referenced."""
    path = os.path.join(folder, f"{key}.pt")
    if not os.path.isfile(path):
        missing = troubleshooting.UNIVERSAL_MISSING.message(what=f"{key} for parameter {name}")
        raise FileNotFoundError(errno.ENOENT, missing, path)
    saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    if isinstance(saved, dict):
        if saved.get(EP_IS_EXPERT_PARAM, False):
            raise NotImplementedError(troubleshooting.UNIVERSAL_EXPERT.message(path=path))
        saved = saved[PARAM]
    return saved


def universal_parts(opt: Any, zero: str, keys: tuple[str, ...]) -> list[list[UniversalPart]]:
    """Per subgroup, its parameters' parts; checked before anything is loaded, so a checkpoint that does
    not fit leaves the state as it was: every parameter's `keys` files are there, each of its size
    (ZeRO-3's converter saves them flat)."""
    parts = []
    for i, group in enumerate(opt.fp16_groups):
        offset, of_subgroup = 0, []
        for param in group:
            name = opt.param_names.get(param)
            if name is None:
                raise ValueError("failed to find optimizer param in named params")
            folder = os.path.join(zero, name)
            for key in keys:
                numel = _mapped(folder, key, name).numel()
                if numel != param.ds_numel:
                    raise ValueError(
                        troubleshooting.UNIVERSAL_SIZE.message(
                            folder=zero,
                            name=name,
                            key=key,
                            numel=numel,
                            shape=tuple(param.ds_shape),
                            model=param.ds_numel,
                        )
                    )
            partition_group = opt._get_param_partition_group(param)
            ranks, rank = dist.get_world_size(group=partition_group), dist.get_rank(group=partition_group)
            numel = math.ceil(param.ds_numel / ranks)
            start = rank * numel
            real = max(0, min(numel, param.ds_numel - start))
            of_subgroup.append(UniversalPart(name, folder, offset, numel, start, real))
            offset += numel
        assert offset == int(opt.fp16_partitioned_groups_flat_numel[i]), (offset, i)
        parts.append(of_subgroup)
    return parts


def fill_from_universal(out: torch.Tensor, parts: list[UniversalPart], key: str, first: int) -> None:
    """`out` becomes the subgroup's `key` elements from `first` on (converted to its dtype, as stock's
    copy into its tensor converts them; the padding zeros)."""
    end = first + out.numel()
    for part in parts:
        lo, hi = max(first, part.offset), min(end, part.offset + part.numel)
        if lo >= hi:
            continue
        # Within the partition: [a, b), of which [a, min(b, real)) lies inside the parameter.
        a, b = lo - part.offset, hi - part.offset
        inside = min(b, part.real)
        target = out[lo - first : hi - first]
        if a < inside:
            whole = _mapped(part.folder, key, part.name).view(-1)
            target[: inside - a].copy_(whole[part.start + a : part.start + inside])
            del whole
        target[max(0, inside - a) :].zero_()


def load_universal(
    opt: Any,
    session: UpdateSession,
    view: DeepSpeedView,
    folder: str,
    load_optimizer_states: bool,
    load_from_fp32_weights: bool,
) -> None:
    """Loads a universal checkpoint (any data-parallel degree) as stock DeepSpeed's
    `_load_universal_checkpoint` does, chunk by chunk, so the host memory it adds is about a chunk:
    every state (`load_hp_checkpoint_state_from_checkpoint_dir_stage3`), or the weights alone
    (`load_module_checkpoint_state_from_checkpoint_dir_stage3`)."""
    zero = os.path.join(folder, "zero")
    if load_optimizer_states:
        _load_universal_state(opt, session, view, zero)
    else:
        _load_universal_weights(opt, session, zero, load_from_fp32_weights)
    # The partitioned parameters point into the half-precision partitions again (stock's last loop).
    for i, half in enumerate(opt.fp16_partitioned_groups_flat):
        if half is None:
            continue  # on NVMe: written back as each subgroup's chunks were loaded
        updated = opt.unflatten(half, opt.fp16_partitioned_groups[i])
        for partitioned_param, q in zip(opt.fp16_partitioned_groups[i], updated, strict=True):
            partitioned_param.data = q.data


def _load_universal_state(opt: Any, session: UpdateSession, view: DeepSpeedView, zero: str) -> None:
    """The master weights and both moments, in the master weights' dtype as stock loads them (its
    moments too: `zeros_like` the master weights), the Adam step and the hyperparameters of the
    checkpoint's first param group; the half-precision partitions from the master weights."""
    optim_path = os.path.join(zero, "optimizer_state.pt")
    if not os.path.isfile(optim_path):
        missing = troubleshooting.UNIVERSAL_MISSING.message(what="optimizer global state")
        raise FileNotFoundError(errno.ENOENT, missing, optim_path)
    parts = universal_parts(opt, zero, UNIVERSAL_KEYS)
    # The converter copies rank 0's whole ZeRO optimizer file there (its partition's state too): mapped,
    # only what is read of it (the loss scaler, the step, the hyperparameters) comes into memory.
    optim_sd = torch.load(optim_path, map_location="cpu", mmap=True, weights_only=False)
    saved = optim_sd[OPTIMIZER_STATE_DICT]
    state_step = saved["state"][0]["step"]
    DeepSpeedZeroOptimizer_Stage3._load_global_state_stage3(opt, optim_sd)
    state, master = session.state, session.dtypes.master
    state.pipeline.flush()
    scratch = torch.empty(state.layout.buffer_bytes, dtype=torch.uint8)
    for i, of_subgroup in enumerate(parts):
        half = view.partition(i)
        if state.accelerator_of(i) is not None:
            # Kept whole on the accelerator: loaded whole.
            arrays = tuple(torch.empty(half.numel(), dtype=master) for _ in UNIVERSAL_KEYS)
            _universal_chunk(of_subgroup, 0, master, half, arrays)
            state.scatter(i, torch.cat([a.to(FP32) for a in arrays]))
        for chunk in state.of_subgroup[i]:
            _, first, count = state.chunks[chunk]
            fill = functools.partial(
                _universal_chunk, of_subgroup, first, master, half[first : first + count]
            )
            state.write(chunk, fill, scratch)
        opt.optimizer.state[opt.fp32_partitioned_groups_flat[i]]["step"] = state_step
    view.settle_partitions()
    for param_group in opt.optimizer.param_groups:
        for key, value in saved["param_groups"][0].items():
            param_group[key] = [] if key == "params" else value
    session.follow_loaded_moments(master)


def _universal_chunk(
    parts: list[UniversalPart],
    first: int,
    master: torch.dtype,
    half: torch.Tensor,
    arrays: tuple[torch.Tensor, ...],
) -> None:
    """A chunk's arrays (from its subgroup's element `first` on) from the checkpoint, each rounded to the
    master weights' dtype first, and its part of the half-precision partition from its master weights."""
    for array, key in zip(arrays, UNIVERSAL_KEYS, strict=True):
        values = array if array.dtype == master else torch.empty(array.numel(), dtype=master)
        fill_from_universal(values, parts, key, first)
        array.copy_(values)
    half.copy_(arrays[0])


def _load_universal_weights(
    opt: Any, session: UpdateSession, zero: str, load_from_fp32_weights: bool
) -> None:
    """The half-precision partitions from the checkpoint's fp32 weights, and the master weights from them
    too (`load_from_fp32_weights`) or from the partitions; the moments stay."""
    parts = universal_parts(opt, zero, UNIVERSAL_KEYS[:1])
    state, master = session.state, session.dtypes.master
    scratch = torch.empty(state.layout.buffer_bytes, dtype=torch.uint8)
    for i, of_subgroup in enumerate(parts):
        half = opt.fp16_partitioned_groups_flat[i]
        if half is None:
            raise RuntimeError(
                "ZeRO-3 universal module-only checkpoint load requires available parameter "
                f"partitions for subgroup {i}."
            )
        if state.accelerator_of(i) is not None and load_from_fp32_weights:
            # Kept whole on the accelerator: its master weights whole.
            values = torch.empty(half.numel(), dtype=master)
            fill_from_universal(values, of_subgroup, "fp32", 0)
            half.data.copy_(values)
            state.set_params(i, values)
        elif state.accelerator_of(i) is not None:
            fill_from_universal(half.data, of_subgroup, "fp32", 0)
        for chunk in state.of_subgroup[i]:
            _, first, count = state.chunks[chunk]
            part = half.data[first : first + count]
            if not load_from_fp32_weights:
                fill_from_universal(part, of_subgroup, "fp32", first)
                continue
            # Read once: the master weights' dtype is fp32 or the partitions' own, so the partitions
            # from it are what stock's one conversion from fp32 gives.
            values = torch.empty(count, dtype=master)
            fill_from_universal(values, of_subgroup, "fp32", first)
            part.copy_(values)
            state.set_chunk_params(chunk, values, scratch)
    if not load_from_fp32_weights:
        opt.refresh_fp32_params()


class StateSwapper:
    """DeepSpeed's optimizer-swapper protocol over the store, for what still calls it: the
    `safe_get/set_*` helpers and checkpoint code swap one subgroup in, look or write, and swap it out.
    `settle` waits for the update behind the last step (and undoes one during backward) first."""

    def __init__(
        self,
        session: UpdateSession,
        view: DeepSpeedView,
        chunk_update: ChunkUpdater,
        settle: Callable[[], None],
    ) -> None:
        self.session = session
        self.view = view
        self.chunk_update = chunk_update
        self.settle = settle
        self.swap_folder = session.store.tiers[0]["path"]
        # Subgroup -> its whole state, gathered from its chunks while swapped in.
        self._held: dict[int, torch.Tensor] = {}

    def is_swappable_tensor(self, tensor: Any = None, numel: Any = None) -> bool:
        return True

    def swap_in_optimizer_state(self, parameter: torch.Tensor, async_parameter: Any = None) -> None:
        session = self.session
        # The update behind the last step first: it changes the state and reads the gradients.
        self.settle()
        i = self.view.fp32_index(parameter)
        whole = session.state.gather(i)
        self._held[i] = whole
        self.view.bind_state(i, whole, session.dtypes)
        # The gradient as DeepSpeed's own swap-in would hold it: in the master weights' dtype, the one a
        # setter left, else
        # converted from the half-precision one, where a parameter without a gradient at this boundary
        # has its last one times the factors of the steps since (`StaleGradients.held`).
        grad = self.chunk_update.gradient(i).to(session.dtypes.master, copy=True)
        if i not in session.fp32_grads:
            held = session.stale.held(r for r in session.param_ranges if r[1] == i)
            stale_gradients.apply(grad, 0, held.get(i, []))
        parameter.grad = grad

    def swap_out_optimizer_state(self, parameter: torch.Tensor, async_swap: bool = False) -> None:
        i = self.view.fp32_index(parameter)
        whole = self._held.pop(i)
        self.view.collect_state(i, whole)
        self.session.state.scatter(i, whole)
        self.view.unbind(i)

    def release_swap_buffers(self, parameter: torch.Tensor) -> None:
        i = self.view.fp32_index(parameter)
        self._held.pop(i, None)
        self.view.unbind(i)

    def writeback_optimizer_state_and_gradients(
        self, parameter: torch.Tensor, write_opt_state: bool, write_gradients: bool
    ) -> None:
        # A written gradient (DeepSpeed's gradient setters) is kept in fp32 for the subgroup until the
        # step uses it, as stock DeepSpeed's fp32 gradient buffer would hold it.
        self.settle()
        if write_gradients and parameter.grad is not None:
            self.session.fp32_grads[self.view.fp32_index(parameter)] = parameter.grad
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
