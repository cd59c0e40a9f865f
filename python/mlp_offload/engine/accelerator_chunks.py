"""Chunks streamed to the accelerator beside the host's pass (Deep Optimizer States, exactly): each step
the performance model (`_core.accelerator_split`, docs/model.md) chooses how many of the step's chunks
go there from the rates measured in the steps before; each goes over with its gradient, is updated by
the host pass's own arithmetic (`accelerator_adam.AcceleratorAdam`, bit for bit) and comes back into its
host buffer, while the host's pass updates the others. The copies and kernels of two chunks at a time run
on two streams of their own, so that one's copies run beside the other's kernel; the host thread only
queues them (`dispatch`), and the pipeline places each chunk once its copy back ended
(`pipeline.DeferredUpdate`). With the master weights in the parameters (`master_in_params`) the kernel
updates them in the partition, and their CRC32C before and after it is summed there, which the engine
checks as it checks the host pass's."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mlp_offload import _core
from mlp_offload.engine.accelerator_adam import AcceleratorAdam, crcs
from mlp_offload.engine.accelerator_model import (
    SLOTS,
    ChunkBytes,
    Rates,
    SlotLayout,
    params_copied,
    slots_in,
    split_inputs,
)
from mlp_offload.engine.state_dtypes import StateDtypes

# Steps the model may keep every chunk on the host before one chunk goes there again to measure: the
# rates it chose none by may have been a moment's (a kernel compiled for a new shape of chunk, another
# process on the accelerator), and none there measures nothing.
REMEASURE_STEPS = 20


@dataclass
class StepSplit:
    """One step's split: the chunks the accelerator updates (of the step's order), the slots they take
    and each one's bytes, why, and the model's prediction (None where no model chose it)."""

    chunks: list[int]
    slots: int
    why: str
    predicted: dict[str, Any] | None = None
    rates: Rates = field(default_factory=Rates)
    memory: int = 0
    slot_bytes: int = 0


@dataclass
class Dispatched:
    """One chunk queued on the accelerator: its end (an event on a GPU; None where it ran at once), and
    its stages' timings (events, or seconds where it ran at once)."""

    elements: int
    out_bytes: int
    back_bytes: int
    end: Any
    stages: list[Any]
    # Where it ran at once: when it began and ended (`time.perf_counter`).
    span: tuple[float, float] | None = None
    # With the master weights in the parameters: their CRC32C before and after the kernel, in host
    # memory once the chunk ended.
    params_sums: torch.Tensor | None = None

    def done(self) -> bool:
        return self.end is None or bool(self.end.query())

    def wait(self) -> None:
        if self.end is not None:
            self.end.synchronize()

    def since(self, first: Dispatched) -> float:
        """Seconds from `first`'s start to this one's end (once done): the wall time of the chunks
        between, whose stages overlap on a GPU's two streams."""
        if self.span is not None and first.span is not None:
            return self.span[1] - first.span[0]
        return float(first.stages[0].elapsed_time(self.end)) / 1e3

    def params_crcs(self) -> tuple[int, int]:
        """The parameters' CRC32C as the kernel read and wrote them (once done; `params_sums`)."""
        assert self.params_sums is not None, "summed only with the master weights in the parameters"
        return crcs(self.params_sums)

    def seconds(self) -> tuple[float, float, float]:
        """The copy out, the kernel and the copy back, in seconds (once done)."""
        if self.end is None:
            return tuple(self.stages)  # type: ignore[return-value]
        e = self.stages
        return tuple(e[k].elapsed_time(e[k + 1]) / 1e3 for k in range(3))  # type: ignore[return-value]


@dataclass
class Measured:
    """A step's chunks there as measured: each stage summed over the chunks, and the wall time from the
    first one's start to the last one's end."""

    copy_out_secs: float
    kernel_secs: float
    copy_back_secs: float
    wall_secs: float


class AcceleratorChunks:
    """The chunks a step streams to `device` (see the module docs). `memory`: the accelerator memory the
    update may use (None: what is free at each step); `pinned`: chunks every step (None: the model's
    choice). On a device other than CUDA the kernel runs through Triton's interpreter on the host, where
    no device memory is free or taken."""

    def __init__(self, device: torch.device, *, memory: int | None, pinned: int | None) -> None:
        self.device = device
        self.memory = memory
        self.pinned = pinned
        self.rates = Rates()
        # Whether a step's chunks there ran yet: the first one's times are the kernel's first launch
        # (Triton compiles it there), not its rate.
        self.warmed = False
        # Steps since the accelerator last updated a chunk.
        self.steps_without = 0
        on_gpu = device.type == "cuda"
        self.streams = [torch.cuda.Stream(device) for _ in range(SLOTS)] if on_gpu else []
        self.slot_tensors: list[torch.Tensor] = []
        self.queued = 0
        self.dispatched: list[Dispatched] = []

    def free_memory(self) -> int:
        """The accelerator memory the update may use at this step."""
        if self.device.type != "cuda":
            # Through the interpreter the chunks' copies are host memory: nothing on a device limits them.
            return self.memory if self.memory is not None else 1 << 62
        free, _ = torch.cuda.mem_get_info(self.device)
        # What torch's allocator holds unused is free to it too.
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return free if self.memory is None else min(free, self.memory)

    def choose(self, elements: list[int], per_element: ChunkBytes) -> StepSplit:
        """How many of the step's chunks (`elements` each, in the step's order, `per_element` bytes an
        element) the accelerator takes: the last ones of `elements`."""
        n = len(elements)
        memory = self.free_memory()
        slot = per_element.slot_bytes(max(elements))
        slots = slots_in(memory, slot)
        rates = replace(self.rates)

        def split(chunks: list[int], why: str, predicted: dict[str, Any] | None = None) -> StepSplit:
            return StepSplit(chunks, slots, why, predicted, rates, memory, slot)

        if slots == 0:
            return split([], f"{memory:,} bytes of accelerator memory free, less than a chunk's {slot:,}")
        if self.pinned is not None:
            k = min(self.pinned, n)
            return split(list(range(n - k, n)), f"accelerator_update_chunks is {self.pinned}")
        if self.rates.host_elements_per_s is None or not self.rates.device_known():
            why = "one chunk there measures the accelerator's rates"
            if not self.warmed:
                why += " (its first run of the kernel, which compiles it, measures none)"
            return split([n - 1], why)
        predicted = _core.accelerator_split(split_inputs(elements, per_element, slots, self.rates))
        chunks = list(predicted.pop("device_chunks"))
        if chunks:
            why = f"the model: {len(chunks)} of {n} chunks end both sides together"
        elif self.steps_without >= REMEASURE_STEPS:
            return split(
                [n - 1],
                f"one chunk there measures the accelerator's rates again: the model chose none for "
                f"{self.steps_without} steps",
            )
        else:
            why = f"the model: every chunk the host's is the fastest ({predicted['host_only_secs']:.4f} s)"
        return split(chunks, why, predicted)

    def begin(self, split: StepSplit) -> None:
        """A step's chunks on the accelerator begin: its slots' memory (none where the split sends none
        there)."""
        self.slot_tensors = [
            torch.empty(split.slot_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(split.slots if split.chunks else 0)
        ]
        self.queued = 0
        self.dispatched = []

    def end(self, host_elements: int, host_secs: float) -> Measured:
        """The step's chunks there ended (each waited for): the rates measured (not the first step's
        there: `warmed`), and the slots' memory given back. `host_elements`, `host_secs`: the host
        pass's over its chunks this step."""
        if host_elements and host_secs > 0:
            self.rates.host_elements_per_s = host_elements / host_secs
        stages = [d.seconds() for d in self.dispatched]
        measured = Measured(
            copy_out_secs=sum(s[0] for s in stages),
            kernel_secs=sum(s[1] for s in stages),
            copy_back_secs=sum(s[2] for s in stages),
            wall_secs=max((d.since(self.dispatched[0]) for d in self.dispatched), default=0.0),
        )
        timed = [(d, s) for d, s in zip(self.dispatched, stages, strict=True) if min(s) > 0]
        if timed:
            if self.warmed:
                self._take_rates(timed)
            self.warmed = True
        self.steps_without = 0 if self.dispatched else self.steps_without + 1
        self.slot_tensors = []
        return measured

    def _take_rates(self, timed: list[tuple[Dispatched, tuple[float, float, float]]]) -> None:
        """The accelerator's rates from a step's chunks there, each its typical chunk's (the upper
        median): a chunk whose kernel Triton compiled in its run (a new shape or decay) takes seconds
        where the others take milliseconds, and one such chunk of two or more moves no rate."""
        self.rates.device_elements_per_s = statistics.median_high(d.elements / s[1] for d, s in timed)
        self.rates.h2d_bytes_per_s = statistics.median_high(d.out_bytes / s[0] for d, s in timed)
        self.rates.d2h_bytes_per_s = statistics.median_high(d.back_bytes / s[2] for d, s in timed)

    def dispatch(
        self,
        update_pass: AcceleratorAdam,
        dtypes: StateDtypes,
        state: torch.Tensor,
        grad: torch.Tensor,
        params: torch.Tensor,
        kernel_args: dict[str, Any],
    ) -> Dispatched:
        """Queues one chunk's update: its state (`state`, the chunk's bytes in host memory) and its
        gradient go over, the kernel runs with `kernel_args` (`AcceleratorAdam.update`'s keywords; it
        is queued now, in the host thread's order of calls: one bias state), the new parameters go into
        `params` (on the accelerator, or copied back where they are on the host) and the state back into
        `state`. With the master weights in the parameters (`dtypes.master_in_params`) the kernel reads
        them from `params` (copied over where they are on the host) and writes them back there, and the
        parameters' CRC32C before and after it are summed there (`Dispatched.params_sums`), as the host
        pass sums them. The host memory of `state` and `grad` must stay until the chunk ends."""
        n = grad.numel()
        slot = self.queued % len(self.slot_tensors)
        self.queued += 1
        room = self.slot_tensors[slot]
        nbytes = dtypes.nbytes(n)
        on_device = params.device == self.device
        scratch = 0 if on_device else n * params.element_size()
        layout = SlotLayout.of(nbytes, n * grad.element_size(), scratch)
        assert layout.nbytes <= room.numel(), (
            f"a chunk of {n:,} elements ({grad.dtype} gradient) takes {layout.nbytes:,} bytes of a "
            f"slot, which has {room.numel():,}"
        )
        device_state = room[:nbytes]
        device_grad = room[layout.at_grad : layout.at_params].view(grad.dtype)[:n]
        device_params = params if on_device else room[layout.at_params :].view(params.dtype)[:n]
        in_params = dtypes.master_in_params
        arrays = dtypes.arrays(device_state, n)
        master, exp_avg, exp_avg_sq = (device_params, *arrays) if in_params else arrays
        marks = _Marks(self.streams[slot] if self.streams else None, self.device)
        sums = None
        with marks.queued():
            device_state.copy_(state[:nbytes], non_blocking=True)
            device_grad.copy_(grad, non_blocking=True)
            if in_params and not on_device:
                device_params.copy_(params, non_blocking=True)
            marks.mark()
            if in_params:
                sums = torch.zeros(2, dtype=torch.int32, device=self.device)
                update_pass.update_summing_params(
                    master, exp_avg, exp_avg_sq, device_grad, sums, **kernel_args
                )
                sums = self._sums_to_host(sums)
            else:
                update_pass.update(master, exp_avg, exp_avg_sq, device_grad, device_params, **kernel_args)
            marks.mark()
            state[:nbytes].copy_(device_state, non_blocking=True)
            if not on_device:
                params.copy_(device_params, non_blocking=True)
        params_out, params_back = params_copied(in_params, not on_device, params.element_size())
        out_bytes = nbytes + n * (grad.element_size() + params_out)
        back_bytes = nbytes + n * params_back
        dispatched = Dispatched(n, out_bytes, back_bytes, marks.end, marks.stages, marks.span, sums)
        self.dispatched.append(dispatched)
        return dispatched

    def _sums_to_host(self, sums: torch.Tensor) -> torch.Tensor:
        """`sums` copied to host memory on the chunk's stream, read once the chunk ended: reading them
        there would copy on the reading thread's stream, after whatever it queued (the next forward)."""
        if not self.streams:
            return sums
        host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
        return host.copy_(sums, non_blocking=True)


class _Marks:
    """The marks between one chunk's stages (copy out, kernel, copy back): events on its slot's stream,
    queued after whatever the caller's stream queued before (the update's own copies) and after the
    slot's last chunk; or, where the work runs as it is called (no stream), the times."""

    def __init__(self, stream: Any, device: torch.device) -> None:
        self.stream = stream
        self.device = device
        self.stages: list[Any] = []
        self.end: Any = None
        self.span: tuple[float, float] | None = None

    @contextlib.contextmanager
    def queued(self) -> Iterator[None]:
        """The chunk's work, marked at its start and end (and where `mark` is called in it)."""
        if self.stream is None:
            self.mark()
            yield
            self.mark()
            self.span = (self.stages[0], self.stages[-1])
            self.stages = [b - a for a, b in zip(self.stages, self.stages[1:], strict=False)]
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.mark()
            yield
            self.mark()
        self.end = self.stages[-1]

    def mark(self) -> None:
        if self.stream is None:
            self.stages.append(time.perf_counter())
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        self.stages.append(event)


# The start-up check's chunk: two of a GPU's blocks and a tail of every vector width.
CHECK_ELEMENTS = 2 * 1024 + 37
# Values the check puts among the random ones: NaN, infinities, subnormals, -0.0, past fp16's range.
CHECK_SPECIALS = [float("nan"), float("inf"), float("-inf"), 1e-40, -2e-41, -0.0, 7e4, 1e38]


def _check_inputs(
    dtypes: StateDtypes, grad_dtype: torch.dtype, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A chunk's state bytes and gradient for the check, random with specials, the last element one;
    with the master weights in the parameters, those too (else None)."""
    generator = torch.Generator().manual_seed(20261206)

    def values(scale: float) -> torch.Tensor:
        x = torch.randn(n, generator=generator) * scale
        picks = torch.randint(0, 13, (n,), generator=generator) == 0
        picks[-1] = True
        specials = torch.tensor(CHECK_SPECIALS)
        x[picks] = specials[torch.randint(0, len(specials), (int(picks.sum()),), generator=generator)]
        return x

    state = torch.zeros(dtypes.nbytes(n), dtype=torch.uint8)
    scales = (0.05, 1e-3, 1e-6)[1 if dtypes.master_in_params else 0 :]
    for array, scale in zip(dtypes.arrays(state, n), scales, strict=True):
        array.copy_(values(scale).abs() if scale == 1e-6 else values(scale))
    grad = values(1e-2).to(grad_dtype)
    return state, grad, values(0.05).to(dtypes.master) if dtypes.master_in_params else None


def check_on_device(
    arith: dict[str, Any],
    dtypes: StateDtypes,
    grad_dtype: torch.dtype,
    params_dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Any] | None:
    """Whether the accelerator's kernel on `device` gives the host pass's bits (the same, or both NaN)
    for a chunk of this build's arithmetic (`arith`) and these dtypes, over two steps, and, with the
    master weights in the parameters, the parameters' CRC32C that the host pass gives; None where it
    does, else what differs: the array, how many elements of how many, the first and its two values.
    Kernels of their own: the session's bias state is not touched."""
    from mlp_offload.engine.fused_update import FusedAdam, adam_group

    n = CHECK_ELEMENTS
    state, grad, master = _check_inputs(dtypes, grad_dtype, n)
    in_params = master is not None
    host_params = master if master is not None else torch.zeros(n, dtype=params_dtype)
    group = adam_group({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}, True)
    # A copy also where the device is the host's (through the interpreter): each pass its own state.
    device_state = state.to(device, copy=True)
    device_grad = grad.to(device)
    device_params = host_params.to(device, copy=True)
    host = FusedAdam(_core.AdamKernel(0.9, 0.999, **arith), adamw=True, threads=1, dtypes=dtypes)
    accelerator = AcceleratorAdam(_core.AdamKernel(0.9, 0.999, **arith), dtypes=dtypes)
    arrays = dtypes.arrays(device_state, n)
    device_master, exp_avg, exp_avg_sq = (device_params, *arrays) if in_params else arrays
    sums: list[tuple[int | None, int]] = []
    for step in (1, 2):
        how: dict[str, Any] = {"group": group, "step": step, "grad_scale": 1 / 1024}
        cuts = [0] if in_params else None
        host_sums = host.update(state, grad, host_params, read_cuts=cuts, write_cuts=cuts, **how)
        if in_params:
            there = torch.zeros(2, dtype=torch.int32, device=device)
            accelerator.update_summing_params(device_master, exp_avg, exp_avg_sq, device_grad, there, **how)
            sums += zip((host_sums.params_read, host_sums.params_write), crcs(there.cpu()), strict=True)
        else:
            accelerator.update(device_master, exp_avg, exp_avg_sq, device_grad, device_params, **how)
    names = ("exp_avg", "exp_avg_sq") if in_params else ("master weights", "exp_avg", "exp_avg_sq")
    pairs = list(zip(names, dtypes.arrays(state, n), dtypes.arrays(device_state.cpu(), n), strict=True))
    pairs.append(("parameters", host_params, device_params.cpu()))
    return _arrays_differ(pairs) or _sums_differ(sums)


def _arrays_differ(pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> dict[str, Any] | None:
    """Of each array's host and accelerator values, the first not the same bits (nor both NaN), as
    `check_on_device` says it."""
    for name, a, b in pairs:
        bits = {4: torch.int32, 2: torch.int16}[a.element_size()]
        same = (a.view(bits) == b.view(bits)) | (a.isnan() & b.isnan())
        if not bool(same.all()):
            first = int((~same).nonzero()[0])
            return {
                "array": name,
                "count": int((~same).sum()),
                "elements": a.numel(),
                "first": first,
                "host": float(a[first]),
                "there": float(b[first]),
            }
    return None


def _sums_differ(sums: list[tuple[int | None, int]]) -> dict[str, Any] | None:
    """Where the parameters' CRC32C there (before and after each step's kernel) is not the host pass's,
    what `check_on_device` says of it."""
    differing = [k for k, (host, there) in enumerate(sums) if host != there]
    if not differing:
        return None
    first = differing[0]
    return {
        "array": "the parameters' CRC32C (before and after each step)",
        "count": len(differing),
        "elements": len(sums),
        "first": first,
        "host": sums[first][0],
        "there": sums[first][1],
    }
