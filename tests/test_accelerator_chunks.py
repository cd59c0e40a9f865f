"""Chunks streamed to the accelerator beside the host's pass (`accelerator_update_memory`, Deep
Optimizer States), against stock DeepSpeed's `device: cpu`, bit for bit: the accelerator's side runs the
kernel through Triton's interpreter on DeepSpeed's CPU accelerator (`TRITON_INTERPRET=1`), with every
copy there and back, so that each path and each split is checked here: the model's choice (one chunk
the first step, to measure, then its own), some chunks and every chunk, cached and streamed, in chunk
order behind the next forward and in the cache's order inside `step()`, with checksums, stale
gradients, an fp16 overflow, two ranks and the master weights in the parameters. The model's split
is table-tested with hand-worked figures in `crates/mlp-offload-core/src/accelerator_update.rs`; the
engine's choice around it, and the start-up check of the kernel there, below."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ONE_NODE
from deepspeed_runs import STATE_MODES, assert_bit_equal, run_case, section
from mlp_offload import _core
from mlp_offload.adapter import options, troubleshooting
from mlp_offload.engine import accelerator_adam, accelerator_chunks, accelerator_model, planning
from mlp_offload.engine.accelerator_adam import AcceleratorAdam
from mlp_offload.engine.accelerator_chunks import AcceleratorChunks, Dispatched, StepSplit
from mlp_offload.engine.accelerator_model import ChunkBytes, Rates
from mlp_offload.engine.state_dtypes import StateDtypes

ON_CUDA = os.environ.get("MLP_OFFLOAD_TEST_ACCELERATOR") == "cuda"
INTERPRETED = {} if ON_CUDA else {"TRITON_INTERPRET": "1"}
STREAMS = {"host_memory": "200K", "update_chunk": "24K"}
# DeepSpeed's side of the update during backward's rows (test_backward's): gradients final in small
# buckets, most before backward ends; unclipped.
BACKWARD = {"reduce_bucket_size": 20_000, "clip": 0.0}

# name, the DeepSpeed case, the section's extra keys (the README's section otherwise: the model's
# choice of chunks; `accelerator_update_chunks` pins it), ranks
ROWS: list[tuple[str, dict[str, Any], dict[str, Any], int]] = [
    ("fp32, the README's section: the model's choice", {"fp32": True}, {}, 1),
    ("fp32, the README's section: 2 chunks", {"fp32": True}, {"accelerator_update_chunks": 2}, 1),
    (
        "bf16 streamed, inside step(): every chunk",
        {},
        {**STREAMS, "overlap": False, "accelerator_update_chunks": 1000},
        1,
    ),
    (
        "bf16 streamed behind the next forward, stale gradients, accumulation 2 with clipping: 3 chunks",
        {"layer_drop": [1, 2], "grad_accum": 2, "clip": 0.05},
        {**STREAMS, "overlap": True, "accelerator_update_chunks": 3},
        1,
    ),
    (
        "fp16 with an overflow step, streamed: 2 chunks",
        {"fp16": True, "overflow_at_step": 2},
        {**STREAMS, "accelerator_update_chunks": 2},
        1,
    ),
    ("two ranks: 1 chunk", {"fp32": True}, {"host_memory": "64M", "accelerator_update_chunks": 1}, 2),
    (
        # The split takes its share of what the update during backward left to step().
        "bf16 streamed, the update during backward kept every step: what it left there",
        BACKWARD,
        {**STREAMS, "shadow_slots": True, "overlap_backward": True, "accelerator_update_chunks": 2},
        1,
    ),
    (
        "every chunk cached, the update during backward from kept copies: every one, none left there",
        BACKWARD,
        {"host_memory": "8M", "overlap_backward": True, "accelerator_update_chunks": 2},
        1,
    ),
    (
        "bf16 streamed, the update during backward undone (clipped): 2 chunks of them all",
        {**BACKWARD, "clip": 0.05},
        {**STREAMS, "shadow_slots": True, "overlap_backward": True, "accelerator_update_chunks": 2},
        1,
    ),
    (
        # The slots' layout of a 6-byte state, its master weights apart from the parameters.
        "bf16 weights and moments, streamed: 2 chunks",
        STATE_MODES["bf16 weights and moments"][0],
        {**STREAMS, "master_in_params": False, "accelerator_update_chunks": 2},
        1,
    ),
    (
        # The README's section: the master weights in the parameters, updated there in the partition,
        # the parameters' sums checked there; DeepSpeed's setters set them apart before step 3.
        "bf16 weights and moments in the parameters, streamed, DeepSpeed's helpers before step(): 2 chunks",
        {**STATE_MODES["bf16 weights and moments"][0], "helpers_at": 3},
        {**STREAMS, "accelerator_update_chunks": 2},
        1,
    ),
    (
        "fp16 weights in the parameters, streamed: 2 chunks",
        STATE_MODES["fp16 weights"][0],
        {**STREAMS, "accelerator_update_chunks": 2},
        1,
    ),
    (
        # On a GPU the master weights go over from the partition in host memory and come back; on
        # DeepSpeed's CPU accelerator that memory is the device's, and DeepSpeed's offload of the
        # parameters is checked beside the split.
        "bf16 weights and moments in the parameters in host memory (offload_param: cpu): 2 chunks",
        {**STATE_MODES["bf16 weights and moments"][0], "offload_param": "cpu"},
        {**STREAMS, "accelerator_update_chunks": 2},
        1,
    ),
]


def pinned_on_cuda(case: dict[str, Any]) -> dict[str, Any]:
    """A case as a GPU runs it, both sides: with DeepSpeed's `pin_memory`, without which chunks stay on
    the host there (copies from pageable memory would hold the host's pass); through the interpreter,
    as it is."""
    if not ON_CUDA:
        return case
    return {**case, "ds_options": {**case.get("ds_options", {}), f"{options.OO}.pin_memory": True}}


def _steps(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in result["telemetry"] if r.get("event") == "step"]


@pytest.mark.parametrize(
    ("ds_case", "extra", "ranks"),
    [pytest.param(*r[1:], marks=[ONE_NODE] if r[3] > 1 else [], id=r[0]) for r in ROWS],
)
def test_chunks_on_the_accelerator_are_bit_equal_to_stocks_cpu_offload(
    ds_case: dict[str, Any], extra: dict[str, Any], ranks: int, work_dirs: list[Path], tmp_path: Path
) -> None:
    case = pinned_on_cuda({**ds_case, "steps": 4})
    stock = run_case(case, tmp_path, "stock", ranks=ranks)
    ours = run_case(
        {**case, "mlp_offload": section(work_dirs[:1], **extra)},
        tmp_path,
        "ours",
        ranks=ranks,
        env=INTERPRETED,
    )
    for a, b in zip(ours.get("ranks", [ours]), stock.get("ranks", [stock]), strict=True):
        assert_bit_equal(a, b)
    start = ours["telemetry"][0]["accelerator_update"]["chunks"]
    assert start["on"] and "beside the host's pass" in start["why"]
    assert f"chunks streamed there: {start['why']}" in planning.start_line(ours["telemetry"][0])
    there = [r["accelerator_update"]["chunks"] for r in _steps(ours)]
    assert there and all(r is not None for r in there)
    pinned = extra.get("accelerator_update_chunks")
    # Per step, the chunks the split chose from: those the update during backward left.
    total = ours["telemetry"][0]["chunks"]
    left = [total - _kept_in_backward(r) for r in _steps(ours)]
    if pinned is None:
        # One chunk measures the rates (the first step's run compiles the kernel: the second's
        # measures); then the model's choice, with its prediction and the rates it weighed.
        assert [r["chunks"] for r in there[:2]] == [1, 1] and all("measures" in r["why"] for r in there[:2])
        assert there[1]["device_elements_per_s"] is None
        assert all(r["predicted_secs"] is not None and "the model" in r["why"] for r in there[2:])
        assert all(r["device_elements_per_s"] and r["h2d_bytes_per_s"] for r in there[2:])
    else:
        assert [r["chunks"] for r in there] == [min(pinned, n) for n in left]
    assert [r["host_chunks"] + r["chunks"] for r in there] == left
    if extra.get("overlap_backward") is True and not ds_case.get("clip"):
        # Both in one step: chunks kept from backward, and what it left (if any) the split's.
        assert all(n < total for n in left), left
        assert all(
            r["chunks"] if n else "updated every chunk" in r["why"] for r, n in zip(there, left, strict=True)
        )
    # Back: the 4 bytes of bf16 moments an element, and the parameters where they are in host memory.
    back = 6 if ds_case.get("offload_param") == "cpu" and ON_CUDA else 4
    moments_in_bf16 = ds_case.get("ds_options", {}).get("bf16.bf16_optimizer_states")
    for r in there:
        if moments_in_bf16 and extra.get("master_in_params", True):
            assert r["bytes_back"] == back * r["elements"]
        assert (r["bytes_out"] > 0) is (r["chunks"] > 0)
        assert (r["kernel_secs"] > 0) is (r["chunks"] > 0)
        # The wall time there: each stage's sum within it (one after another through the interpreter).
        stages = r["copy_out_secs"] + r["kernel_secs"] + r["copy_back_secs"]
        assert r["device_secs"] >= stages * 0.999 if r["chunks"] else r["device_secs"] == 0
    # Every element each step, on one side or the other (none in a step skipped for an overflow).
    whole = {r["host_elements"] + r["elements"] for r, n in zip(there, left, strict=True) if n == total}
    assert len(whole - {0}) <= 1


def test_parameters_changed_outside_the_optimizer_stop_the_step_there(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """With the master weights in the parameters (the default in this mode), `GatheredParameters(
    modifier_rank=0)` changes the last parameters before step 3, whose chunks the accelerator updates:
    their sums there stop that step, naming the parameters' subgroup, as the host pass's do
    (test_state_dtypes)."""
    mode = STATE_MODES["bf16 weights and moments"][0]
    case = pinned_on_cuda({**mode, "steps": 4, "set_params_apart_at": 3})
    keys = {**STREAMS, "accelerator_update_chunks": 1000}
    with pytest.raises(AssertionError) as stopped:
        run_case({**case, "mlp_offload": section(work_dirs[:1], **keys)}, tmp_path, "ours", env=INTERPRETED)
    assert troubleshooting.met("params-changed", str(stopped.value)), str(stopped.value)[-3000:]


def _kept_in_backward(step: dict[str, Any]) -> int:
    """The chunks the update during backward updated and `step()` kept, in a step's record."""
    backward = step.get("overlap_backward")
    return backward["chunks"] if backward is not None and backward["kept"] else 0


def test_the_split_changes_between_steps_and_stays_bit_equal(work_dirs: list[Path], tmp_path: Path) -> None:
    """The model's choice over a run: the first two steps one chunk, then as the measured rates say
    (through the interpreter, the host's pass is the faster: none), one again after REMEASURE_STEPS of
    none, bit for bit stock's whatever it chose."""
    case = pinned_on_cuda({"steps": 3 + accelerator_chunks.REMEASURE_STEPS})
    stock = run_case(case, tmp_path, "stock")
    extra = {**STREAMS, "overlap_backward": False}
    ours = run_case(
        {**case, "mlp_offload": section(work_dirs[:1], **extra)}, tmp_path, "ours", env=INTERPRETED
    )
    assert_bit_equal(ours, stock)
    there = [r["accelerator_update"]["chunks"] for r in _steps(ours)]
    counts = [r["chunks"] for r in there]
    # The model's choices follow the rates measured on a shared machine: mostly none (the interpreter
    # is far slower than the host's pass), now and then one. After REMEASURE_STEPS of none, one goes
    # there whatever it would choose, and only then is it said to measure again.
    assert counts[:2] == [1, 1] and len(set(counts)) > 1, counts
    idle = accelerator_chunks.REMEASURE_STEPS
    for k in range(2, len(counts)):
        after_none = k >= idle + 2 and not any(counts[k - idle : k])
        assert counts[k] > 0 if after_none else "again" not in there[k]["why"], (k, counts)


def _chooser(
    rates: Rates | None, *, memory: int | None = None, pinned: int | None = None
) -> AcceleratorChunks:
    chooser = AcceleratorChunks(torch.device("cpu"), memory=memory, pinned=pinned)
    if rates is not None:
        chooser.rates = rates
    return chooser


M = 1 << 20
MEASURED = Rates(
    host_elements_per_s=1.8e9, device_elements_per_s=2e10, h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9
)
# fp32 state, bf16 gradients and parameters: on the accelerator, and in host memory (copied back).
FP32 = ChunkBytes.of(12, 2, 2, 4, master_in_params=False, on_host=False)
FP32_PARAMS_ON_HOST = ChunkBytes.of(12, 2, 2, 4, master_in_params=False, on_host=True)
SLOT = FP32.slot_bytes(16 * M)

# name, rates measured, memory, pinned, chunks there (the last of 64), slots, why (a part)
CHOICES: list[tuple[str, Rates | None, int | None, int | None, int, int, str]] = [
    ("nothing measured yet: one chunk measures", None, None, None, 1, 2, "measures"),
    ("measured, PCIe bound: the model's 31", MEASURED, None, None, 31, 2, "the model: 31 of 64"),
    ("pinned: that many whatever the model", MEASURED, None, 5, 5, 2, "accelerator_update_chunks is 5"),
    ("pinned past the chunks: every one", MEASURED, None, 100, 64, 2, "accelerator_update_chunks is 100"),
    ("memory for one slot: one in flight", MEASURED, SLOT, None, 21, 1, "the model: 21 of 64"),
    ("memory short of a slot: none", MEASURED, SLOT - 1, 5, 0, 0, "less than a chunk's"),
    (
        "a slow accelerator: the host alone",
        # One chunk's kernel there (1.68 s) outlasts the host's whole pass (0.60 s).
        Rates(1.8e9, 1e7, 25e9, 25e9),
        None,
        None,
        0,
        2,
        "every chunk the host's is the fastest",
    ),
]


@pytest.mark.parametrize(
    ("rates", "memory", "pinned", "count", "slots", "why"),
    [c[1:] for c in CHOICES],
    ids=[c[0] for c in CHOICES],
)
def test_the_choice_of_chunks(
    rates: Rates | None, memory: int | None, pinned: int | None, count: int, slots: int, why: str
) -> None:
    """`AcceleratorChunks.choose` over 64 chunks of 16 Mi elements, fp32 state, bf16 gradients (the rows
    of `accelerator_update.rs`, which work the model's figures out by hand)."""
    split = _chooser(rates, memory=memory, pinned=pinned).choose([16 * M] * 64, FP32)
    assert split.chunks == list(range(64 - count, 64))
    assert split.slots == slots
    assert why in split.why
    if "the model" in why:
        assert split.predicted is not None and split.predicted["predicted_secs"] > 0
    if count and split.predicted is not None:
        assert split.predicted["predicted_secs"] < split.predicted["host_only_secs"]


@pytest.mark.parametrize(
    ("master_in_params", "on_host", "copied"),
    [(False, False, (0, 0)), (True, False, (0, 0)), (False, True, (0, 2)), (True, True, (2, 2))],
    ids=["fp32 there", "in the parameters there", "fp32 on the host", "in the parameters on the host"],
)
def test_the_parameters_a_chunk_copies(
    master_in_params: bool, on_host: bool, copied: tuple[int, int]
) -> None:
    """The partition on the accelerator is updated in place; from host memory (`offload_param`) the new
    parameters come back, and the master weights in them go out first."""
    assert accelerator_model.params_copied(master_in_params, on_host, 2) == copied


# name, bytes an element, a chunk's elements, its slot's bytes (each array aligned to 256)
SLOT_ROOMS = [
    ("fp32 there: the state, room for an fp32 gradient", FP32, 16 * M, 16 * 16 * M),
    ("fp32 on the host: the parameters' scratch too", FP32_PARAMS_ON_HOST, 16 * M, 18 * 16 * M),
    ("1000 elements: each array aligned", FP32, 1000, 12032 + 4096),
    ("1000 elements with the scratch", FP32_PARAMS_ON_HOST, 1000, 12032 + 4096 + 2048),
    (
        "bf16 weights and moments there: a bf16 gradient, 6 + 2",
        ChunkBytes.of(6, 2, 2, 2, master_in_params=False, on_host=False),
        16 * M,
        8 * 16 * M,
    ),
    (
        "bf16 moments in the parameters on the host: 4 + 2 + 2",
        ChunkBytes.of(4, 2, 2, 2, master_in_params=True, on_host=True),
        16 * M,
        8 * 16 * M,
    ),
]


@pytest.mark.parametrize(
    ("per_element", "elements", "room"), [r[1:] for r in SLOT_ROOMS], ids=[r[0] for r in SLOT_ROOMS]
)
def test_a_slots_room(per_element: ChunkBytes, elements: int, room: int) -> None:
    """A slot holds a chunk's state, its gradient in the wider of its own dtype and the master weights'
    (stale gradients and a setter's go over in the latter), and the parameters' scratch only where they
    are copied (`dispatch` lays it out so)."""
    assert per_element.slot_bytes(elements) == room


def test_a_chunk_past_its_slots_room_is_named() -> None:
    """`dispatch` lays a chunk out as `slot_bytes` made its room (`SlotLayout`), the gradient in its own
    dtype (an fp32 one here, a stale gradient's, in a slot of bf16 gradients' chunks): a chunk past the
    step's chunks' room (the alignment leaves a few elements' slack) is named with both sizes before
    anything is copied."""
    chunks = _chooser(None, pinned=1)
    chunks.begin(chunks.choose([1000], FP32))
    state = torch.zeros(12 * 1100, dtype=torch.uint8)
    grad = torch.zeros(1100, dtype=torch.float32)
    params = torch.zeros(1100, dtype=torch.bfloat16)
    with pytest.raises(
        AssertionError, match=r"1,100 elements .* takes 17,920 bytes of a slot, which has 16,128"
    ):
        chunks.dispatch(None, StateDtypes(), state, grad, params, {})  # type: ignore[arg-type]


def test_the_parameters_copy_counts_in_the_choice() -> None:
    """The memory of two fp32 slots: both in flight, 31 chunks there, with the partition on the
    accelerator; where each chunk copies its parameters back to host memory, their scratch leaves room
    for one slot (18 bytes an element of 32), and its serial copies take 20 (`accelerator_update.rs`'s
    rows, worked by hand)."""
    there = _chooser(MEASURED, memory=2 * SLOT).choose([16 * M] * 64, FP32)
    on_host = _chooser(MEASURED, memory=2 * SLOT).choose([16 * M] * 64, FP32_PARAMS_ON_HOST)
    assert (len(there.chunks), there.slots) == (31, 2)
    assert (len(on_host.chunks), on_host.slots) == (20, 1)


def _step(
    chooser: AcceleratorChunks, kernel_secs: float, first_kernel_secs: float | None = None
) -> StepSplit:
    """One step over 64 chunks of 16 Mi elements (fp32 state, bf16 gradients) as if its chunks there took
    `kernel_secs` each (the first `first_kernel_secs`, if given), and their copies PCIe's time at 25
    GB/s; the host's at 1.8e9 elements a second."""
    split = chooser.choose([16 * M] * 64, FP32)
    chooser.begin(split)
    copy = 16 * M * 14 / 25e9
    kernels = [kernel_secs] * len(split.chunks)
    if first_kernel_secs is not None and kernels:
        kernels[0] = first_kernel_secs
    chooser.dispatched = [
        Dispatched(16 * M, 16 * M * 14, 16 * M * 12, None, [copy, k, copy], (t, t + 2 * copy + k))
        for t, k in enumerate(kernels)
    ]
    host = (64 - len(split.chunks)) * 16 * M
    chooser.end(host, host / 1.8e9)
    return split


def test_the_first_run_there_compiles_and_measures_no_rate() -> None:
    """The first step's chunk there (Triton compiles the kernel in its run: seconds) sets no rate; the
    second's measures, and the model chooses from it."""
    chooser = _chooser(None)
    first = _step(chooser, kernel_secs=5.0)
    assert first.chunks == [63] and "compiles" in first.why
    assert chooser.rates.device_elements_per_s is None
    second = _step(chooser, kernel_secs=16 * M / 2e10)
    assert second.chunks == [63] and "compiles" not in second.why
    assert chooser.rates.device_elements_per_s == pytest.approx(2e10)
    third = _step(chooser, kernel_secs=16 * M / 2e10)
    assert len(third.chunks) == 31 and "the model" in third.why
    assert third.rates.device_elements_per_s == pytest.approx(2e10)


def test_a_model_that_chose_none_measures_again() -> None:
    """Rates that make the host alone the fastest (a slow moment there) are measured again, one chunk,
    after REMEASURE_STEPS steps of none; the rates then measured are the model's."""
    chooser = _chooser(Rates(1.8e9, 1e7, 25e9, 25e9))
    chooser.warmed = True
    for _ in range(accelerator_chunks.REMEASURE_STEPS):
        assert _step(chooser, kernel_secs=1.0).chunks == []
    again = _step(chooser, kernel_secs=16 * M / 2e10)
    assert (
        again.chunks == [63] and "again" in again.why and str(accelerator_chunks.REMEASURE_STEPS) in again.why
    )
    assert chooser.steps_without == 0
    assert len(_step(chooser, kernel_secs=16 * M / 2e10).chunks) == 31


def test_a_chunk_whose_kernel_compiled_in_its_run_moves_no_rate() -> None:
    """Of a step's chunks there, one whose run compiled the kernel (a new shape of chunk) is not the
    typical chunk, whose rates the model takes: the next step's choice stays."""
    chooser = _chooser(MEASURED)
    chooser.warmed = True
    fast = 16 * M / 2e10
    assert len(_step(chooser, kernel_secs=fast, first_kernel_secs=5.0).chunks) == 31
    assert chooser.rates.device_elements_per_s == pytest.approx(2e10)
    assert len(_step(chooser, kernel_secs=fast).chunks) == 31


SPLIT_INPUTS = accelerator_model.split_inputs([M] * 4, FP32, 2, Rates(1e9, 0.0, 1e9, 1e9))
# name, inputs the binding is given, what its ValueError names
BAD_SPLIT_INPUTS = [
    ("a rate that is not one", SPLIT_INPUTS, "device_elements_per_s"),
    (
        "more slots than two",
        {**SPLIT_INPUTS, "device_elements_per_s": 1e9, "device_slots": 3},
        "device_slots",
    ),
    ("a key the model does not know", {**SPLIT_INPUTS, "device_memory": 1 << 30}, "device_memory"),
]


@pytest.mark.parametrize(
    ("inputs", "named"), [r[1:] for r in BAD_SPLIT_INPUTS], ids=[r[0] for r in BAD_SPLIT_INPUTS]
)
def test_the_split_binding_names_what_is_wrong(inputs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        _core.accelerator_split(inputs)


CHECKED = [
    ("fp32 state, fp32 parameters", StateDtypes(), torch.float32),
    ("fp32 state, bf16 parameters", StateDtypes(), torch.bfloat16),
    ("bf16 weights and moments", StateDtypes(torch.bfloat16, torch.bfloat16), torch.bfloat16),
    ("fp16 weights", StateDtypes(torch.float16, torch.float32), torch.float16),
    (
        "bf16 weights and moments in the parameters",
        StateDtypes(torch.bfloat16, torch.bfloat16, True),
        torch.bfloat16,
    ),
    ("fp16 weights in the parameters", StateDtypes(torch.float16, torch.float32, True), torch.float16),
]
ARITH = {
    "vector_width": 16,
    "momentum": "gradient",
    "variance": "gradient",
    "others": True,
    "bias_sqrt": "float",
}


@pytest.mark.parametrize(("dtypes", "half"), [c[1:] for c in CHECKED], ids=[c[0] for c in CHECKED])
def test_the_start_up_check_passes_the_kernel_and_names_what_differs(
    dtypes: StateDtypes, half: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check a session runs before it streams chunks there (`check_on_device`): the kernel as it is
    passes; one whose second moment is a bit off at the last step is named, with the first element
    that differs."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if ON_CUDA else "cpu")
    assert accelerator_chunks.check_on_device(ARITH, dtypes, half, half, device) is None
    real = AcceleratorAdam.update

    def a_bit_off(self: AcceleratorAdam, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        if kwargs["step"] == 1:
            return
        exp_avg_sq = args[2]
        exp_avg_sq.view({4: torch.int32, 2: torch.int16}[exp_avg_sq.element_size()])[5] ^= 1

    monkeypatch.setattr(AcceleratorAdam, "update", a_bit_off)
    differs = accelerator_chunks.check_on_device(ARITH, dtypes, half, half, device)
    assert differs is not None
    assert (differs["array"], differs["count"], differs["first"]) == ("exp_avg_sq", 1, 5)
    said = troubleshooting.ACCELERATOR_KERNEL_DIFFERS.message(**differs)
    assert "exp_avg_sq, 1 of 2085 elements, the first at 5" in said


def test_the_start_up_check_names_parameters_summed_otherwise_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the master weights in the parameters, the check also compares the parameters' CRC32C there
    with the host pass's: a sum off by a bit is named."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if ON_CUDA else "cpu")
    real = accelerator_adam.crc32c_into

    def off_by_a_bit(half: torch.Tensor, out: torch.Tensor) -> None:
        real(half, out)
        out ^= 1

    monkeypatch.setattr(accelerator_adam, "crc32c_into", off_by_a_bit)
    dtypes = StateDtypes(torch.bfloat16, torch.bfloat16, True)
    differs = accelerator_chunks.check_on_device(ARITH, dtypes, torch.bfloat16, torch.bfloat16, device)
    assert differs is not None
    assert (differs["array"], differs["count"], differs["elements"], differs["first"]) == (
        "the parameters' CRC32C (before and after each step)",
        4,
        4,
        0,
    )
    assert differs["there"] == differs["host"] ^ 1
