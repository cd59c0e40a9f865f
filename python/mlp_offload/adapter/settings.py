"""The engine's settings, resolved once at start.

`resolve` takes the `mlp_offload` section, what DeepSpeed's config and optimizer say (`StartFacts`), the
machine's facts (what this rank can spare) and the check of the fused kernel, and returns one frozen
record (`Settings`): host memory and where it came from, the chunks, the cache, the kept copies, the
state's dtypes with `master_in_params`, the update kernel, both overlaps and the order of the steps,
each with why. Every setting is decided here, in one function, and nowhere else: the session is built
from the record (`adapter.session`), and the start record renders it. A setting that cannot be is refused
here, named as its key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mlp_offload.adapter import troubleshooting
from mlp_offload.common.config import MLPOffloadConfig
from mlp_offload.engine import memory
from mlp_offload.engine.fused_update import FusedAdam
from mlp_offload.engine.state_dtypes import DTYPES, StateDtypes


@dataclass(frozen=True)
class Choice:
    """Whether something is on, and why, in words for the start record."""

    on: bool
    why: str


@dataclass(frozen=True)
class KernelChoice:
    """The update's kernel: the fused pass (None: DeepSpeed's passes), and why."""

    fused: FusedAdam | None
    why: str


def refuse_unsupported(offload: Any, optimizer: Any) -> None:
    """Refuses, by name, what DeepSpeed's config and objects ask of the engine that it does not do:
    the optimizer not offloaded to the host (`offload_optimizer.device`), an optimizer whose state the
    store does not hold. Before DeepSpeed's `__init__`, which would partition the model."""
    if offload is None or _offload_device(offload) != "cpu":
        raise ValueError(troubleshooting.OFFLOAD_DEVICE.message())
    _check_optimizer(optimizer)


def _check_optimizer(optimizer: Any) -> None:
    """Refuses, by name, an optimizer whose state the store does not hold: Adam's, per element exp_avg
    and exp_avg_sq beside the weights, is (DeepSpeed's CPU Adam, or torch's Adam and AdamW)."""
    # Imported here: DeepSpeed is being built when this runs, and the resolution needs none of it.
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not isinstance(optimizer, (DeepSpeedCPUAdam, torch.optim.Adam, torch.optim.AdamW)):
        kind = type(optimizer)
        raise ValueError(
            troubleshooting.OPTIMIZER.message(optimizer=f"{kind.__module__}.{kind.__qualname__}")
        )
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            raise ValueError(troubleshooting.AMSGRAD.message())


def _offload_device(offload: Any) -> str:
    """The device of a DeepSpeed offload section (`offload_optimizer` or `offload_param`, a pydantic
    model whose `device` is an enum or its string)."""
    return str(getattr(offload.device, "value", offload.device))


# `update_kernel`'s check (the setting) for a state of these dtypes kept in those (`stored`), on this many
# threads (None: torch's): `adapter.kernel_check.choose_update_kernel` against the job's optimizer.
KernelCheck = Callable[[str, StateDtypes, StateDtypes, "int | None"], KernelChoice]


@dataclass(frozen=True)
class StartFacts:
    """What the resolution reads besides the section, once DeepSpeed has partitioned the model.

    `numels`: each subgroup's elements on this rank. `buffer_count`, `pin_memory`: DeepSpeed's
    `offload_optimizer` section. `master`: the master weights' dtype (`master_weights_and_grads_dtype`);
    `params`: the half-precision partitions'; `fp32_moments`: CPU Adam's `fp32_optimizer_states`;
    `params_on_host`: whether the partitions are in host memory. `offload_ratio`: DeepSpeed's
    `offload_optimizer.ratio` and its accelerator's name (`DeepSpeedView.offload_ratio`). `spare`: what this
    rank can spare now (`memory.spare_host_memory`), asked once, where it is needed. `monitor`: whether the
    DeepSpeed config enables one of its monitors. `subgroups_on_nvme`: the subgroups whose parameters
    DeepSpeed keeps on NVMe, past `offload_param.max_in_cpu` (no flat partition in host memory);
    `params_on_nvme_bytes`, the bytes of their partitions there; `params_on_nvme_held`, the most host memory
    those take at once (`NvmePartitions.most_held`), which `host_memory` holds beside the state.
    `backward_bytes`: host memory the first backward takes that `spare` does not see yet
    (`DeepSpeedView.backward_bytes`)."""

    numels: tuple[int, ...]
    buffer_count: int
    pin_memory: bool
    master: torch.dtype
    params: torch.dtype
    fp32_moments: bool
    params_on_host: bool
    spare: Callable[[], memory.SpareMemory]
    monitor: bool = False
    subgroups_on_nvme: int = 0
    params_on_nvme_bytes: int = 0
    params_on_nvme_held: int = 0
    backward_bytes: int = 0
    offload_ratio: tuple[float, str] = (1.0, "cpu")


@dataclass(frozen=True)
class Settings:
    """Every setting of the engine, as resolved at start (`resolve`)."""

    numels: tuple[int, ...]
    """Each subgroup's elements on this rank."""
    host_memory: int
    """The state's host memory, in bytes, and how it was chosen (`host_memory_source`)."""
    host_memory_source: str
    layout: memory.ChunkLayout
    """The subgroups cut into chunks within it."""
    cache_chunks: int | None
    """`cache_chunks` as configured (None: "auto")."""
    buffers: int
    """Chunk buffers the pipeline allocates (the cache and the stream)."""
    cache_slots: int
    """Chunks the cache keeps across steps, in the order the steps start in."""
    kept_copies: int
    """The most kept copies in host memory (cached chunks updated during backward)."""
    dtypes: StateDtypes
    """The dtypes DeepSpeed keeps the state in, and whether the master weights are the parameters."""
    master_in_params: Choice
    kernel: KernelChoice
    update_threads: int | None
    """The fused pass's threads (None: torch's)."""
    overlap: Choice
    """The update behind the next forward."""
    overlap_backward: Choice
    """Chunks updated during backward."""
    chunk_order: Choice
    """Whether the steps go in chunk order from the start (the overlaps need it)."""
    backward_every_chunk: bool
    """With `overlap_backward: true`: the update during backward takes every chunk it may (each
    streamed one with its second slot from the start), in chunk order from the start; with "auto" the
    plan chooses the chunks and whether to go to chunk order."""
    monitors: Choice
    """Whether each step's figures go to DeepSpeed's monitors."""
    pin: bool
    """Whether host buffers are page-locked (DeepSpeed's `pin_memory`)."""
    params_on_host: bool
    subgroups_on_nvme: int
    """Subgroups whose parameters DeepSpeed keeps on NVMe (past `offload_param.max_in_cpu`)."""
    params_on_nvme_bytes: int
    """The bytes of their partitions there (the plan counts their reads and writes)."""
    params_cache: int
    """The parameters' cache: host memory that keeps the partitions the update wrote until a fetch takes
    them (`_params_cache_room`)."""
    accelerator_update: Choice
    """Subgroups updated on the accelerator (DeepSpeed's `offload_optimizer.ratio`)."""
    accelerator_subgroups: int
    """How many: the first ones, their state kept whole on the accelerator and out of the store."""
    accelerator_chunks: Choice
    """Whether each step streams chunks to the accelerator beside the host's pass."""
    accelerator_update_memory: int | None
    """The accelerator memory that may take (None: what is free at each step)."""
    accelerator_update_chunks: int | None
    """Chunks every step (None: the model's choice)."""

    @property
    def host_numels(self) -> tuple[int, ...]:
        """Each subgroup's elements in the store: none of those on the accelerator."""
        return _store_numels(self.numels, self.accelerator_subgroups)

    @property
    def every_chunk_cached(self) -> bool:
        return self.cache_slots == len(self.layout.chunks)


def resolve(config: MLPOffloadConfig, facts: StartFacts, check_kernel: KernelCheck) -> Settings:
    """The settings of `config` for a model and machine of `facts`, the update kernel as `check_kernel`
    finds it. A setting that cannot be is a `ValueError` naming its key."""
    spare = _Spare(facts.spare)
    accelerator_update, on_accelerator = _accelerator_update(facts)
    in_params = _master_in_params(config, facts, on_accelerator)
    numels = facts.numels
    # The store holds the other subgroups alone.
    facts = dataclasses.replace(facts, numels=_store_numels(numels, on_accelerator))
    moments = torch.float32 if facts.fp32_moments else facts.master
    dtypes = StateDtypes(facts.master, moments, in_params.on)
    host_memory, source = _host_memory(config, facts, dtypes.bytes_per_element, spare)
    update_chunk = _auto_as_none(config.update_chunk)
    layout = memory.chunk_layout(facts.numels, host_memory, update_chunk, dtypes.bytes_per_element)
    cache_chunks = _auto_as_none(config.cache_chunks)
    try:
        layout.require_a_buffer(host_memory)
        buffers, cache_slots = memory.stream_buffers(layout.buffers, len(layout.chunks), cache_chunks)
    except ValueError as e:
        raise ValueError(
            troubleshooting.HOST_MEMORY.message(
                problem=e,
                host_memory=host_memory,
                source=source,
                buffers=layout.buffers,
                buffer_bytes=layout.buffer_bytes,
            )
        ) from None
    threads = _auto_as_none(config.update_threads)
    kernel = check_kernel(config.update_kernel, dtypes, dtypes, threads)
    fused = kernel.fused is not None
    if on_accelerator and not fused:
        raise ValueError(
            troubleshooting.RATIO.message(
                **_ratio_fields(facts, on_accelerator),
                why=f"the fused pass, whose arithmetic the accelerator's kernel has, is off ({kernel.why})",
            )
        )
    every_cached = cache_slots == len(layout.chunks)
    overlap = _overlap(config.overlap, fused, every_cached)
    kept_copies = 0
    if every_cached and config.overlap_backward is not False and fused:
        kept_copies = _kept_copies_room(config, host_memory, layout, spare)
    backward = _overlap_backward(config, fused, every_cached, facts.params_on_host, kept_copies, in_params.on)
    if not backward.on:
        kept_copies = 0
    buffers, cache_slots = memory.stream_buffers(
        layout.stream_buffers(kept_copies), len(layout.chunks), cache_chunks
    )
    chunks_there = _accelerator_chunks(config, facts, kernel)
    # Where every chunk is cached, the state takes what caching it whole takes, its gradient's included,
    # and its kept copies (the update during backward's).
    whole = memory.whole_state_bytes(facts.numels, update_chunk, dtypes.bytes_per_element)
    state_held = whole + kept_copies * layout.buffer_bytes if every_cached else None
    params_cache = _params_cache_room(config, facts, host_memory, state_held, spare)
    in_order = memory.cache_in_chunk_order(buffers, len(layout.chunks), cache_slots)
    chunk_order = _chunk_order(config, overlap.on, backward.on, in_order == cache_slots)
    return Settings(
        numels=numels,
        host_memory=host_memory,
        host_memory_source=source,
        layout=layout,
        cache_chunks=cache_chunks,
        buffers=buffers,
        cache_slots=in_order if chunk_order.on else cache_slots,
        kept_copies=kept_copies,
        dtypes=dtypes,
        master_in_params=in_params,
        kernel=kernel,
        update_threads=threads,
        overlap=overlap,
        overlap_backward=backward,
        chunk_order=chunk_order,
        backward_every_chunk=backward.on and config.overlap_backward is True,
        monitors=_monitors(config, facts.monitor),
        pin=facts.pin_memory,
        params_on_host=facts.params_on_host,
        subgroups_on_nvme=facts.subgroups_on_nvme,
        params_on_nvme_bytes=facts.params_on_nvme_bytes,
        params_cache=params_cache,
        accelerator_update=accelerator_update,
        accelerator_subgroups=on_accelerator,
        accelerator_chunks=chunks_there,
        accelerator_update_memory=_auto_as_none(config.accelerator_update_memory),
        accelerator_update_chunks=_auto_as_none(config.accelerator_update_chunks),
    )


def _chunks_asked(config: MLPOffloadConfig) -> list[str]:
    """The keys that ask for chunks on the accelerator: set, and not to 0."""
    return [
        key
        for key in ("accelerator_update_memory", "accelerator_update_chunks")
        if getattr(config, key) not in ("auto", 0)
    ]


def _auto_as_none(value: int | str) -> int | None:
    """A number-or-"auto" key's value: None for "auto"."""
    return None if value == "auto" else int(value)


def _accelerator_chunks(config: MLPOffloadConfig, facts: StartFacts, kernel: KernelChoice) -> Choice:
    """Whether each step streams chunks to the accelerator beside the host's pass
    (`accelerator_update_memory`), and why: of the chunks the update during backward (`overlap_backward`)
    left, where it ran. Where it cannot be, "auto" says why at start; a size or a number of chunks asked
    for is an error naming the key."""
    memory_setting, chunks_setting = config.accelerator_update_memory, config.accelerator_update_chunks
    if memory_setting == 0:
        return Choice(False, "off: accelerator_update_memory is 0")
    if chunks_setting == 0:
        return Choice(False, "off: accelerator_update_chunks is 0")
    accelerator = facts.offload_ratio[1]
    interpreted = accelerator == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    why_not = None
    if accelerator == "cpu" and not interpreted:
        why_not = "DeepSpeed's accelerator is the CPU (TRITON_INTERPRET=1 runs the kernel there, slowly)"
    elif accelerator not in ("cpu", "cuda"):
        why_not = f"the accelerator's kernel runs on CUDA (or Triton's interpreter), not on {accelerator}"
    elif importlib.util.find_spec("triton") is None:
        why_not = "Triton, which runs the accelerator's kernel, is not installed"
    elif kernel.fused is None:
        why_not = f"the fused pass, whose arithmetic the accelerator's kernel has, is off ({kernel.why})"
    elif facts.subgroups_on_nvme:
        why_not = f"{facts.subgroups_on_nvme} subgroups' parameters are on NVMe"
    elif accelerator == "cuda" and not facts.pin_memory:
        # CUDA copies from and to pageable memory are synchronous: each chunk there would hold the host
        # thread that queues it until its copy back ended, the host's pass waiting beside it.
        why_not = (
            "DeepSpeed's offload_optimizer.pin_memory is false, and copies from pageable host memory would "
            "hold the host's pass until each chunk there ends (pin_memory: true streams them beside it)"
        )
    if why_not is None:
        where = (
            "through Triton's interpreter in host memory"
            if interpreted
            else f"on the {accelerator} accelerator"
        )
        chose = "the model's choice each step" if chunks_setting == "auto" else f"{chunks_setting} every step"
        return Choice(True, f"on: chunks stream {where} beside the host's pass, {chose}, bit-equal")
    if asked := _chunks_asked(config):
        raise ValueError(troubleshooting.ACCELERATOR_CHUNKS.message(key=asked[0], why=why_not))
    return Choice(False, f"off: {why_not}")


class _Spare:
    """What this rank can spare, asked of the machine at most once per resolution."""

    def __init__(self, ask: Callable[[], memory.SpareMemory]) -> None:
        self._ask = ask
        self._found: memory.SpareMemory | None = None

    def __call__(self) -> memory.SpareMemory:
        if self._found is None:
            self._found = self._ask()
        return self._found


def _master_in_params(config: MLPOffloadConfig, facts: StartFacts, on_accelerator: int) -> Choice:
    """Whether the master weights are kept in the parameters (`master_in_params`), and why;
    `master_in_params: true` where they cannot be is refused, saying why."""
    setting = config.master_in_params
    if setting is False:
        return Choice(False, "off in the config")
    master, params = facts.master, facts.params
    why_not = None
    if master == torch.float32 or master != params:
        why_not = (
            f"DeepSpeed's master weights are {DTYPES[master]} and the parameters {DTYPES[params]}, so "
            "the parameters do not hold their bits"
        )
    elif config.overlap_backward is True:
        why_not = (
            "overlap_backward is true, and undoing a chunk's update during backward needs the master "
            "weights apart from the parameters"
        )
    elif on_accelerator:
        why_not = f"{on_accelerator} subgroups are kept on the accelerator, with their master weights apart"
    if why_not is None:
        return Choice(
            True,
            f"on: DeepSpeed's master weights are the parameters' {DTYPES[master]}, copied into them after "
            "every step; the store keeps the moments alone",
        )
    if setting is True:
        raise ValueError(troubleshooting.MASTER_IN_PARAMS.message(why=why_not))
    return Choice(False, f"off: {why_not}")


def _store_numels(numels: tuple[int, ...], on_accelerator: int) -> tuple[int, ...]:
    """Each subgroup's elements in the store: none of the first `on_accelerator`, kept there."""
    return (0,) * on_accelerator + tuple(numels[on_accelerator:])


def _ratio_rule(ratio: float, subgroups: int) -> int:
    """Stock's rule for `offload_optimizer.ratio`, truncation included: subgroup i is the CPU's from
    `int((1 - ratio) * subgroups)` on, the ones before it the accelerator's."""
    return int((1 - ratio) * subgroups)


def stock_accelerator_subgroups(ratio: float, subgroups: int, accelerator: str) -> int:
    """How many subgroups, the first ones, stock DeepSpeed keeps on the accelerator with
    `offload_optimizer.ratio` (`_ratio_rule`), where the accelerator is not DeepSpeed's CPU one."""
    return 0 if accelerator == "cpu" else _ratio_rule(ratio, subgroups)


def _accelerator_update(facts: StartFacts) -> tuple[Choice, int]:
    """Whether subgroups are updated on the accelerator, why, and how many (`offload_optimizer.ratio`):
    those stock keeps there, the first `int((1 - ratio) x subgroups)`, whose state we keep there too,
    updated by the host pass's own arithmetic (`engine.accelerator_adam`) where stock runs torch's
    AdamW, so the bits are `device: cpu`'s. On DeepSpeed's CPU accelerator stock keeps none there, and
    neither do we, but where Triton's interpreter is on (`TRITON_INTERPRET=1`, how the tests run the
    accelerator's kernel without a GPU): there they are kept apart in host memory, as a GPU would keep
    them."""
    ratio, accelerator = facts.offload_ratio
    subgroups = len(facts.numels)
    if ratio == 1.0:
        return Choice(False, "off: offload_optimizer.ratio is 1.0, every subgroup the host's"), 0
    interpreted = accelerator == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    on_accelerator = (
        _ratio_rule(ratio, subgroups)
        if interpreted
        else stock_accelerator_subgroups(ratio, subgroups, accelerator)
    )
    if on_accelerator and importlib.util.find_spec("triton") is None:
        raise ValueError(
            troubleshooting.RATIO.message(
                **_ratio_fields(facts, on_accelerator),
                why="Triton, which runs the accelerator's kernel, is not installed",
            )
        )
    if on_accelerator:
        where = (
            "host memory, through Triton's interpreter" if interpreted else f"the {accelerator} accelerator"
        )
        return (
            Choice(
                True,
                f"on: offload_optimizer.ratio {ratio} keeps the first {on_accelerator} of {subgroups} "
                f"subgroups in {where}, as stock does, updated there by CPU Adam's own arithmetic where "
                "stock runs torch's AdamW (its first group at the constructor's learning rate, its state "
                "in no checkpoint): bit-equal to device: cpu, at the scheduler's learning rate, "
                "checkpointed",
            ),
            on_accelerator,
        )
    where = (
        "on DeepSpeed's CPU accelerator stock updates every subgroup with CPU Adam"
        if accelerator == "cpu"
        else f"int((1 - ratio) x {subgroups} subgroups) is 0, so stock keeps none on the accelerator"
    )
    return Choice(
        False, f"off: offload_optimizer.ratio is {ratio}, but {where}; so does ours, bit for bit"
    ), 0


def _ratio_fields(facts: StartFacts, on_accelerator: int) -> dict[str, object]:
    ratio, accelerator = facts.offload_ratio
    return {
        "ratio": ratio,
        "count": on_accelerator,
        "subgroups": len(facts.numels),
        "accelerator": accelerator,
    }


def _host_memory(
    config: MLPOffloadConfig, facts: StartFacts, state_bytes: int, spare: _Spare
) -> tuple[int, str]:
    """The host memory for the state, and how it was chosen (`host_memory`): `"deepspeed"`, what
    DeepSpeed's NVMe offload would pin (`buffer_count` buffers of the largest subgroup's master weights);
    a size as configured; `"auto"`, what this rank can spare, never more than caching the whole state
    takes, never less than DeepSpeed would pin."""
    deepspeed_budget = facts.buffer_count * max(facts.numels) * facts.master.itemsize
    if config.host_memory == "deepspeed":
        return deepspeed_budget, f"DeepSpeed's pinned budget ({facts.buffer_count} buffers)"
    held = facts.params_on_nvme_held
    # The parameters on NVMe take their buffers first (DeepSpeed's own pins them beside its state's).
    params = f", less {held / 2**30:.2f} GiB for the parameters on NVMe" if held else ""
    if config.host_memory != "auto":
        return max(0, int(config.host_memory) - held), f"configured{params}"
    update_chunk = None if config.update_chunk == "auto" else int(config.update_chunk)
    need = memory.whole_state_bytes(facts.numels, update_chunk, state_bytes)
    later = facts.backward_bytes
    budget = min(need, max(spare().bytes - held - later, deepspeed_budget))
    backward = f", less {later / 2**30:.2f} GiB the forward's and backward's buffers take" if later else ""
    whole = f"the whole state needs {need / 2**30:.2f} GiB"
    return budget, f"auto: {spare().describe()}{params}{backward}; {whole}"


def _params_cache_room(
    config: MLPOffloadConfig,
    facts: StartFacts,
    host_memory: int,
    state_held: int | None,
    spare: Callable[[], memory.SpareMemory],
) -> int:
    """The parameters' cache (`Settings.params_cache`): the next forward's fetches take the partitions
    the update wrote from host memory rather than read them back. It gets what is left once every chunk
    is cached (`state_held`: what the state takes; None where chunks stream), at most the partitions'
    bytes: with `host_memory: "auto"`, what this rank can spare beyond the state, the parameters' own
    buffers and the backward's; with a size, what it leaves beyond those; none with "deepspeed"
    (DeepSpeed's pinned budget for the state, whose NVMe offload reads every partition back). At most
    `params_cache` where that is a size (0: off)."""
    if not facts.params_on_nvme_bytes or state_held is None or config.host_memory == "deepspeed":
        return 0
    if config.host_memory == "auto":
        room = spare().bytes - facts.params_on_nvme_held - facts.backward_bytes - state_held
    else:
        # The configured size, less the parameters' buffers (`_host_memory`).
        room = host_memory - state_held
    limit = facts.params_on_nvme_bytes if config.params_cache == "auto" else int(config.params_cache)
    return max(0, min(limit, facts.params_on_nvme_bytes, room))


def _kept_copies_room(
    config: MLPOffloadConfig, host_memory: int, layout: memory.ChunkLayout, spare: _Spare
) -> int:
    """Where every chunk is cached: how many kept copies (a cached chunk's state before its update during
    backward) host memory has room for, at most one per chunk. With `host_memory: "auto"`, what this rank
    can spare beyond the state's budget; else the budget's buffers beyond the chunks."""
    n = len(layout.chunks)
    if config.host_memory == "auto":
        room = max(0, spare().bytes - host_memory) // layout.buffer_bytes
    else:
        room = max(0, layout.buffers - n)
    return min(n, room)


def _overlap(setting: bool | str, fused: bool, every_chunk_cached: bool) -> Choice:
    """Whether the update runs behind `step()` (`overlap`), and why."""
    if setting is False:
        return Choice(False, "off in the config")
    if not fused:
        # The update thread must not hold the GIL while the forward runs.
        return Choice(False, "off: DeepSpeed's passes hold the GIL, the update runs inside step()")
    if setting is True:
        return Choice(True, "on (the config)")
    if every_chunk_cached:
        return Choice(True, "on: every chunk stays in host memory")
    # In chunk order the cache keeps the stream's buffers fewer chunks, and the chunks the last writes
    # left in their buffers are read again: more bytes than the next forward's compute hides, unless the
    # forward is long (docs/results.md, "The update behind the next forward").
    return Choice(False, "off: the state streams (overlap: true runs it behind step() all the same)")


# Why the update during backward is off where the master weights are in the parameters.
BACKWARD_OFF_IN_PARAMS = (
    "off: the master weights are kept in the parameters (master_in_params), and undoing a chunk's "
    "update would need them apart (master_in_params: false keeps them in the store)"
)


def _overlap_backward(
    config: MLPOffloadConfig,
    fused: bool,
    every_chunk_cached: bool,
    params_on_host: bool,
    kept_copies: int,
    master_in_params: bool,
) -> Choice:
    """Whether chunks are updated during backward (`overlap_backward`), and why. With the
    half-precision parameters on an accelerator too: its path there (events, norms on the device, a
    stream of its own, a host scratch) ran bit-exact on an H100 (`make gpu-report`'s bitexact-backward
    part, docs/results.md). Where every chunk is cached, the chunks updated during backward are cached
    ones, each with a kept copy of its state before in host memory: `kept_copies` of them at most.
    Where it would be on, the master weights in the parameters turn it off (`master_in_params` refuses
    `true` with `overlap_backward: true`, so only "auto" meets this)."""
    choice = _backward_where_it_can(config, fused, every_chunk_cached, params_on_host, kept_copies)
    if choice.on and master_in_params:
        return Choice(False, BACKWARD_OFF_IN_PARAMS)
    return choice


def _backward_where_it_can(
    config: MLPOffloadConfig, fused: bool, every_chunk_cached: bool, params_on_host: bool, kept_copies: int
) -> Choice:
    """`_overlap_backward`'s choice before the master weights' place is weighed."""
    setting = config.overlap_backward
    if setting is False:
        return Choice(False, "off in the config")
    if not fused:
        return Choice(False, "off: DeepSpeed's passes hold the GIL, which backward needs")
    if not every_chunk_cached:
        if setting is True:
            return Choice(
                True,
                "on (the config): every streamed chunk as its gradient is final, kept if the step agrees",
            )
        return Choice(
            True,
            "auto: the streamed chunks the plan expects to begin before backward ends, as their gradients "
            "are final, kept if the step agrees",
        )
    if kept_copies == 0:
        return Choice(
            False,
            "off: every chunk stays in host memory, and host_memory leaves no room for a kept copy of one "
            "(its state before the update, to undo it)",
        )
    how = (
        f"every chunk stays in host memory: as its gradient is final, updated in place, its state before "
        f"kept in host memory (up to {kept_copies} chunks), kept if the step agrees"
    )
    if setting is True:
        return Choice(True, f"on (the config): {how}")
    if params_on_host:
        # The update is the CPU's work and backward's compute is too, on the same cores; and the kept
        # copies take memory the job may want, for no gain measured on a CPU (docs/results.md, "Every
        # chunk in memory: the cached chunks updated during backward").
        return Choice(
            False,
            "off: every chunk stays in host memory, and backward's compute runs on the cores the update "
            "would (true turns it on)",
        )
    return Choice(True, f"auto: {how}, as many as the plan expects to begin before backward ends")


def _monitors(config: MLPOffloadConfig, monitor: bool) -> Choice:
    """Whether each step's figures are written to DeepSpeed's monitors (`monitors`), and why."""
    if not config.monitors:
        return Choice(False, "off in the config")
    if not monitor:
        return Choice(False, "off: the DeepSpeed config enables no monitor")
    return Choice(True, "on: to the monitors the DeepSpeed config enables, at its sample count")


def _chunk_order(config: MLPOffloadConfig, overlap: bool, backward: bool, costs_no_cache: bool) -> Choice:
    """Whether the steps go in chunk order (the first chunks cached) from the start: the update behind
    the next forward needs it, and so does the update during backward, from the start with
    `overlap_backward: true` or where chunk order costs the cache nothing; with `"auto"` otherwise once
    the plan finds it pays (`UpdatePlanner.weigh_chunk_order`)."""
    if overlap:
        return Choice(True, "the update behind the next forward runs in chunk order")
    if not backward:
        return Choice(False, "the cache's order: nothing runs in chunk order")
    if config.overlap_backward is True:
        return Choice(True, "the update during backward runs in chunk order (overlap_backward: true)")
    if costs_no_cache:
        return Choice(True, "the update during backward runs in chunk order, which costs the cache nothing")
    return Choice(False, "the cache's order until the plan finds chunk order pays")
