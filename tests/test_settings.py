"""The settings resolved once at start (`adapter.settings.resolve`): the section, DeepSpeed's config and the
machine's facts in, one record out, every refusal by its key. A table: each row a config and facts, and
what the record says (whether each choice is on, and a phrase of why)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from mlp_offload import _core
from mlp_offload.adapter import session as session_module
from mlp_offload.adapter import settings as settings_module
from mlp_offload.adapter.settings import KernelChoice, Settings, StartFacts, resolve
from mlp_offload.common.config import MLPOffloadConfig
from mlp_offload.engine import memory
from mlp_offload.engine.fused_update import FusedAdam
from mlp_offload.engine.state_dtypes import StateDtypes

BF16 = torch.bfloat16
# Two subgroups of a million elements: 24 MiB of fp32 state.
NUMELS = (1 << 20, 1 << 20)
GIB = 1 << 30
PLENTY = memory.SpareMemory(8 * GIB, 10 * GIB, 2 * GIB, 1)
LITTLE = memory.SpareMemory(0, 2 * GIB, 2 * GIB, 1)


def facts(**changes: Any) -> StartFacts:
    """The tests' model on a machine with memory to spare, fp32 state, partitions on the host."""
    base = StartFacts(
        numels=NUMELS,
        buffer_count=4,
        pin_memory=False,
        master=torch.float32,
        params=BF16,
        fp32_moments=True,
        params_on_host=True,
        spare=lambda: PLENTY,
    )
    return dataclasses.replace(base, **changes)


class Kernels:
    """A kernel check that finds the fused pass (a real one of the core's) or not, and records what it
    was asked."""

    def __init__(self, fused: bool = True) -> None:
        self.fused = fused
        self.asked: list[tuple[str, StateDtypes, StateDtypes, int | None]] = []

    def __call__(
        self, setting: str, dtypes: StateDtypes, stored: StateDtypes, threads: int | None
    ) -> KernelChoice:
        self.asked.append((setting, dtypes, stored, threads))
        if not self.fused:
            return KernelChoice(None, "configured")
        kernel = _core.AdamKernel(0.9, 0.999)
        return KernelChoice(FusedAdam(kernel, adamw=True, threads=1, dtypes=dtypes, stored=dtypes), "agrees")


def settle(section: dict[str, Any], given: StartFacts | None = None, fused: bool = True) -> Settings:
    config = MLPOffloadConfig.model_validate({"paths": ["/unused"], **section})
    return resolve(config, given or facts(), Kernels(fused))


# A budget that streams: a quarter of the state, in chunks of 1 MiB of it.
STREAMS = {"host_memory": "6M", "update_chunk": "1M"}

ROWS: list[tuple[str, dict[str, Any], dict[str, Any], bool, dict[str, tuple[bool, str]]]] = [
    # name, section, facts, fused, {choice: (on, a phrase of why)}
    (
        "the README's section: every chunk cached, the update behind the forward",
        {},
        {},
        True,
        {
            "overlap": (True, "every chunk stays in host memory"),
            "overlap_backward": (False, "backward's compute runs on the cores"),
            "chunk_order": (True, "behind the next forward"),
            "master_in_params": (False, "do not hold their bits"),
        },
    ),
    (
        "DeepSpeed's passes: nothing runs beside the step",
        {},
        {},
        False,
        {
            "overlap": (False, "DeepSpeed's passes hold the GIL"),
            "overlap_backward": (False, "DeepSpeed's passes hold the GIL"),
            "chunk_order": (False, "nothing runs in chunk order"),
        },
    ),
    (
        "the state streams: the update during backward where the plan expects it",
        STREAMS,
        {},
        True,
        {
            "overlap": (False, "the state streams"),
            "overlap_backward": (True, "auto: the streamed chunks the plan expects"),
            "chunk_order": (False, "until the plan finds chunk order pays"),
        },
    ),
    (
        "overlap: true streams behind the step all the same, in chunk order",
        {**STREAMS, "overlap": True},
        {},
        True,
        {"overlap": (True, "on (the config)"), "chunk_order": (True, "behind the next forward")},
    ),
    (
        "overlap_backward: true streams every chunk during backward, from the start in chunk order",
        {**STREAMS, "overlap_backward": True},
        {},
        True,
        {
            "overlap_backward": (True, "on (the config): every streamed chunk"),
            "chunk_order": (True, "overlap_backward: true"),
        },
    ),
    (
        "off in the config",
        {"overlap": False, "overlap_backward": False, "master_in_params": False},
        {"master": BF16},
        True,
        {
            "overlap": (False, "off in the config"),
            "overlap_backward": (False, "off in the config"),
            "master_in_params": (False, "off in the config"),
        },
    ),
    (
        "every chunk cached, on an accelerator: updated during backward with kept copies",
        {},
        {"params_on_host": False},
        True,
        {"overlap_backward": (True, "auto: every chunk stays in host memory")},
    ),
    (
        "every chunk cached in a budget of just that: no kept copy, so not during backward",
        {"overlap_backward": True, "host_memory": str(memory.whole_state_bytes(NUMELS))},
        {},
        True,
        {"overlap_backward": (False, "leaves no room for a kept copy")},
    ),
    (
        "every chunk cached, overlap_backward: true: kept copies from the spare memory",
        {"overlap_backward": True},
        {},
        True,
        {"overlap_backward": (True, "on (the config): every chunk stays in host memory")},
    ),
    (
        "a DeepSpeed monitor enabled: each step's figures go to it",
        {},
        {"monitor": True},
        True,
        {"monitors": (True, "to the monitors the DeepSpeed config enables")},
    ),
    ("no DeepSpeed monitor", {}, {}, True, {"monitors": (False, "enables no monitor")}),
    (
        "monitors: false",
        {"monitors": False},
        {"monitor": True},
        True,
        {"monitors": (False, "off in the config")},
    ),
    (
        "bf16 master weights: kept in the parameters, the store holds the moments",
        {},
        {"master": BF16},
        True,
        {"master_in_params": (True, "the store keeps the moments alone")},
    ),
    (
        "bf16 master weights, streaming: the update during backward off for them",
        STREAMS,
        {"master": BF16},
        True,
        {
            "master_in_params": (True, "copied into them after every step"),
            "overlap_backward": (False, "master weights are kept in the parameters"),
        },
    ),
    (
        "the README's section with subgroups' parameters on NVMe: the update behind step(), not in backward",
        {},
        {"subgroups_on_nvme": 2},
        True,
        {
            "overlap": (True, "every chunk stays in host memory"),
            "overlap_backward": (False, "in host memory"),
        },
    ),
    (
        "a streamed state with subgroups' parameters on NVMe, overlap true: the update behind step()",
        {**STREAMS, "overlap": True},
        {"subgroups_on_nvme": 3, "params_on_host": False},
        True,
        {"overlap": (True, "on (the config)")},
    ),
    (
        "a streamed state with subgroups' parameters on NVMe: the update during backward as without them",
        STREAMS,
        {"subgroups_on_nvme": 1, "params_on_host": False},
        True,
        {"overlap_backward": (True, "auto: the streamed chunks the plan expects to begin")},
    ),
    (
        "a streamed state with subgroups' parameters on NVMe, overlap_backward true: on",
        {**STREAMS, "overlap_backward": True},
        {"subgroups_on_nvme": 3, "params_on_host": False},
        True,
        {"overlap_backward": (True, "on (the config): every streamed chunk")},
    ),
    (
        "the README's section: every subgroup the host's (ratio 1.0)",
        {},
        {},
        True,
        {"accelerator_update": (False, "offload_optimizer.ratio is 1.0")},
    ),
    (
        "ratio on DeepSpeed's CPU accelerator: stock's CPU Adam steps every subgroup, so does ours",
        {},
        {"offload_ratio": (0.3, "cpu")},
        True,
        {"accelerator_update": (False, "on DeepSpeed's CPU accelerator stock updates every subgroup")},
    ),
    (
        "ratio on a GPU that keeps no subgroup there (int(0.1 x 2) is 0)",
        {},
        {"offload_ratio": (0.9, "cuda")},
        True,
        {"accelerator_update": (False, "int((1 - ratio) x 2 subgroups) is 0")},
    ),
    (
        "bf16 master weights with overlap_backward: true: kept in the store",
        {**STREAMS, "overlap_backward": True},
        {"master": BF16},
        True,
        {
            "master_in_params": (False, "overlap_backward is true"),
            "overlap_backward": (True, "on (the config)"),
        },
    ),
]


@pytest.mark.parametrize(
    ("section", "given", "fused", "choices"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_each_choice_and_why(
    section: dict[str, Any], given: dict[str, Any], fused: bool, choices: dict[str, tuple[bool, str]]
) -> None:
    resolved = settle(section, facts(**given), fused)
    for name, (on, why) in choices.items():
        choice = getattr(resolved, name)
        assert (choice.on, why in choice.why) == (on, True), f"{name}: {choice}"
    # What the record holds agrees with itself: the dtypes follow master_in_params, the layout the dtypes,
    # the kept copies are there only where chunks are updated during backward and every one is cached.
    assert resolved.dtypes.master_in_params == resolved.master_in_params.on
    assert resolved.layout.state_bytes == resolved.dtypes.bytes_per_element
    assert (resolved.kept_copies > 0) == (resolved.overlap_backward.on and resolved.every_chunk_cached)
    every_chunk = resolved.overlap_backward.on and section.get("overlap_backward") is True
    assert resolved.backward_every_chunk == every_chunk
    assert (resolved.kernel.fused is not None) == fused


@pytest.mark.parametrize(
    ("section", "given", "bytes_", "source"),
    [
        (
            {},
            {},
            memory.whole_state_bytes(NUMELS),
            "10.0 GiB available less a 2.0 GiB margin, over 1 local rank(s); the whole state needs 0.03 GiB",
        ),
        ({}, {"master": BF16, "params": torch.float16}, memory.whole_state_bytes(NUMELS, None, 10), "auto: "),
        ({}, {"spare": lambda: LITTLE}, 4 * NUMELS[0] * 4, "auto: 2.0 GiB available less a 2.0 GiB margin"),
        ({"host_memory": "deepspeed"}, {}, 4 * NUMELS[0] * 4, "DeepSpeed's pinned budget (4 buffers)"),
        ({"host_memory": "deepspeed"}, {"master": BF16}, 4 * NUMELS[0] * 2, "(4 buffers)"),
        ({"host_memory": "6M"}, {}, 6 << 20, "configured"),
        # The buffers of the parameters on NVMe come out of the budget first, "deepspeed" aside (stock pins
        # its parameters' buffers beside its state's).
        (
            {"host_memory": "6M"},
            {"params_on_nvme_held": 1 << 20},
            5 << 20,
            "configured, less 0.00 GiB for the parameters on NVMe",
        ),
        ({}, {"params_on_nvme_held": 8 * GIB}, 4 * NUMELS[0] * 4, "less 8.00 GiB for the parameters on NVMe"),
        ({"host_memory": "deepspeed"}, {"params_on_nvme_held": 1 << 20}, 4 * NUMELS[0] * 4, "(4 buffers)"),
        # What the first backward takes that the machine has not given yet (DeepSpeed's reduce buckets, the
        # norms' scratch) is not spare.
        (
            {},
            {"backward_bytes": 8 * GIB},
            4 * NUMELS[0] * 4,
            "less 8.00 GiB the forward's and backward's buffers take",
        ),
    ],
    ids=[
        "auto, all cached",
        "auto, a 10-byte state",
        "auto, nothing to spare",
        "deepspeed",
        "deepspeed bf16",
        "a size",
        "a size, less the parameters on NVMe",
        "auto, the spare memory all the parameters'",
        "deepspeed, the parameters' beside it",
        "auto, the spare memory all the backward's",
    ],
)
def test_host_memory_and_where_it_came_from(
    section: dict[str, Any], given: dict[str, Any], bytes_: int, source: str
) -> None:
    resolved = settle(section, facts(**given))
    assert resolved.host_memory == bytes_ and source in resolved.host_memory_source


MIB = 1 << 20
WHOLE = memory.whole_state_bytes(NUMELS)
ON_NVME = {"params_on_nvme_bytes": 40 * MIB, "params_on_nvme_held": 10 * MIB}


@pytest.mark.parametrize(
    ("section", "given", "cache"),
    [
        ({}, ON_NVME, 40 * MIB),
        ({}, {**ON_NVME, "spare": lambda: memory.SpareMemory(WHOLE + 13 * MIB, 0, 0, 1)}, 3 * MIB),
        ({}, {**ON_NVME, "backward_bytes": 8 * GIB}, 0),
        ({"host_memory": "100M"}, ON_NVME, 40 * MIB),
        ({"host_memory": "50M"}, ON_NVME, 50 * MIB - 10 * MIB - WHOLE),
        ({"host_memory": "deepspeed"}, ON_NVME, 0),
        (STREAMS, {**ON_NVME, "params_on_nvme_held": MIB}, 0),
        ({}, {}, 0),
        ({"params_cache": "5M"}, ON_NVME, 5 * MIB),
        ({"params_cache": 0}, ON_NVME, 0),
        ({"host_memory": "50M", "params_cache": "1G"}, ON_NVME, 50 * MIB - 10 * MIB - WHOLE),
    ],
    ids=[
        "auto, room for every partition",
        "auto, room for some",
        "auto, the spare memory all the backward's",
        "a size with room for every partition",
        "a size with room for some",
        "deepspeed",
        "the state streams",
        "no partition on NVMe",
        "a size",
        "off",
        "a size past the room",
    ],
)
def test_the_parameters_cache_gets_what_host_memory_leaves_the_state(
    section: dict[str, Any], given: dict[str, Any], cache: int
) -> None:
    """The parameters' cache keeps the partitions the update wrote for the next forward's fetches: the
    host memory left once every chunk is cached, at most the partitions' bytes."""
    resolved = settle(section, facts(**given))
    assert resolved.params_cache == cache


def test_the_update_during_backwards_kept_copies_come_out_of_the_parameters_cache() -> None:
    """Every chunk cached and `overlap_backward: true`: the kept copies (a cached chunk's state before its
    update during backward) take host memory the parameters' cache then does not have (with 100M and
    none kept, it holds every partition: the table above)."""
    resolved = settle({"host_memory": "100M", "overlap_backward": True}, facts(**ON_NVME))
    kept = resolved.kept_copies * resolved.layout.buffer_bytes
    assert resolved.overlap_backward.on and kept > 0
    assert resolved.params_cache == 100 * MIB - 10 * MIB - WHOLE - kept


@pytest.mark.parametrize(
    ("section", "given", "error"),
    [
        ({"host_memory": "4K"}, {}, r"mlp_offload\.host_memory: 4,096 bytes hold no chunk"),
        (
            {"host_memory": "6M"},
            {"params_on_nvme_held": 7 << 20},
            r"host_memory: 0 bytes hold no chunk.*configured, less 0\.01 GiB for the parameters on NVMe",
        ),
        ({**STREAMS, "cache_chunks": 6}, {}, r"mlp_offload\.cache_chunks: 6 cached chunks leave none"),
        (
            {"master_in_params": True},
            {},
            r"master_in_params: true, but DeepSpeed's master weights are float32",
        ),
        (
            {"master_in_params": True, "overlap_backward": True},
            {"master": BF16},
            r"master_in_params: true, but overlap_backward is true",
        ),
    ],
    ids=[
        "a budget of no chunk",
        "a budget the parameters on NVMe take",
        "a cache of every buffer",
        "in params, fp32",
        "in params, backward true",
    ],
)
def test_what_cannot_be_is_refused_by_its_key(
    section: dict[str, Any], given: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        settle(section, facts(**given))


@pytest.mark.parametrize(
    ("ratio", "accelerator", "interpreted", "kept", "why"),
    [
        (0.3, "cuda", False, 1, "keeps the first 1 of 2 subgroups in the cuda accelerator"),
        (0.3, "cpu", False, 0, "on DeepSpeed's CPU accelerator stock updates every subgroup"),
        (0.3, "cpu", True, 1, "in host memory, through Triton's interpreter"),
        (0.9, "cpu", True, 0, "on DeepSpeed's CPU accelerator"),
    ],
    ids=["a GPU", "DeepSpeed's CPU accelerator", "Triton's interpreter", "the interpreter, none kept"],
)
def test_the_subgroups_kept_on_the_accelerator_have_no_chunk(
    ratio: float, accelerator: str, interpreted: bool, kept: int, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stock's first subgroups on the accelerator are kept there whole: the store's layout gives them no
    chunk, and their master weights stay apart from the parameters."""
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    resolved = settle({}, facts(offload_ratio=(ratio, accelerator), master=BF16))
    assert resolved.accelerator_subgroups == kept
    assert (resolved.accelerator_update.on, why in resolved.accelerator_update.why) == (kept > 0, True)
    assert {i for i, _, _ in resolved.layout.chunks} == set(range(kept, len(NUMELS)))
    assert resolved.numels == NUMELS and resolved.host_numels == (0,) * kept + NUMELS[kept:]
    assert resolved.master_in_params.on is (kept == 0)


def test_subgroups_on_the_accelerator_without_the_fused_pass_are_refused_by_the_key() -> None:
    with pytest.raises(
        ValueError, match=r"offload_optimizer\.ratio: 0\.3 keeps the first 1 of this rank's 2"
    ):
        settle({}, facts(offload_ratio=(0.3, "cuda")), fused=False)


@pytest.mark.parametrize(
    ("ratio", "subgroups", "accelerator", "kept"),
    [
        # Stock's rule, `int((1 - ratio) * subgroups)`, truncation and float error included.
        (0.8, 10, "cuda", 1),
        (0.9, 10, "cuda", 0),
        (0.3, 10, "cuda", 7),
        (0.0, 4, "cuda", 4),
        (0.5, 1, "cuda", 0),
        (1.0, 10, "cuda", 0),
        # DeepSpeed's CPU accelerator is named "cpu": every subgroup is CPU Adam's.
        (0.3, 10, "cpu", 0),
    ],
)
def test_the_subgroups_stock_keeps_on_the_accelerator(
    ratio: float, subgroups: int, accelerator: str, kept: int
) -> None:
    assert settings_module.stock_accelerator_subgroups(ratio, subgroups, accelerator) == kept


def test_the_machine_is_asked_once_and_only_where_a_choice_needs_it() -> None:
    asked: list[int] = []

    def spare() -> memory.SpareMemory:
        asked.append(1)
        return PLENTY

    settle({}, facts(spare=spare))
    assert len(asked) == 1, "host_memory auto and the kept copies share one answer"
    asked.clear()
    settle({"host_memory": "1G", "overlap_backward": False}, facts(spare=spare))
    assert not asked, "a configured budget needs no answer"


def test_the_kernel_is_checked_once_for_the_state_as_resolved() -> None:
    kernels = Kernels()
    config = MLPOffloadConfig.model_validate(
        {"paths": ["/unused"], "update_threads": 3, "update_kernel": "fused"}
    )
    resolved = resolve(config, facts(master=BF16, fp32_moments=False), kernels)
    dtypes = StateDtypes(BF16, BF16, True)
    assert kernels.asked == [("fused", dtypes, dtypes, 3)]
    assert resolved.dtypes == dtypes and resolved.update_threads == 3


def test_the_cache_and_buffers_are_the_pipelines() -> None:
    """The record's cache and buffers are the ones the pipeline computes from the same budget, in the order
    the steps start in (`UpdateSession.open` checks the built pipeline against them)."""
    streamed = settle({**STREAMS, "overlap": True})
    n = len(streamed.layout.chunks)
    count, slots = memory.stream_buffers(streamed.layout.buffers, n, None)
    assert (streamed.buffers, streamed.cache_slots) == (count, memory.cache_in_chunk_order(count, n, slots))
    assert streamed.cache_slots < slots, "chunk order leaves the stream its buffers"
    cached = settle({"overlap_backward": True})
    assert cached.every_chunk_cached and cached.buffers == len(cached.layout.chunks)


REFUSALS = [
    (
        "an offload to NVMe the adapter did not rewrite",
        {"device": "nvme", "nvme_path": "/tmp"},
        "SGD",
        r"needs \"cpu\"",
    ),
    ("SGD", {"device": "cpu"}, "SGD", r"the optimizer is torch\.optim\.sgd\.SGD"),
    ("AMSGrad", {"device": "cpu"}, "amsgrad", r"'amsgrad': true is not supported"),
    ("Adam", {"device": "cpu"}, "Adam", None),
]


@pytest.mark.deepspeed
@pytest.mark.parametrize(
    ("offload", "optimizer", "error"),
    [r[1:] for r in REFUSALS],
    ids=[r[0] for r in REFUSALS],
)
def test_deepspeeds_objects_the_engine_does_not_take_are_refused_by_name(
    offload: dict[str, Any], optimizer: str, error: str | None
) -> None:
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

    params = [torch.nn.Parameter(torch.zeros(256))]
    made = {
        "SGD": lambda: torch.optim.SGD(params, lr=0.1),
        "amsgrad": lambda: torch.optim.Adam(params, amsgrad=True),
        "Adam": lambda: torch.optim.Adam(params),
    }[optimizer]()
    refuse = settings_module.refuse_unsupported
    if error is None:
        refuse(DeepSpeedZeroOffloadOptimizerConfig(**offload), made)
        return
    with pytest.raises(ValueError, match=error):
        refuse(DeepSpeedZeroOffloadOptimizerConfig(**offload), made)


CHUNKS_THERE = {"accelerator_update_chunks": 2}

# name, the section, the facts, TRITON_INTERPRET, fused, on, why (a part)
CHUNK_CHOICES: list[tuple[str, dict[str, Any], dict[str, Any], bool, bool, bool, str]] = [
    (
        "the README's section on a GPU",
        {},
        {"offload_ratio": (1.0, "cuda"), "pin_memory": True},
        False,
        True,
        True,
        "on the cuda accelerator",
    ),
    ("on DeepSpeed's CPU accelerator", {}, {}, False, True, False, "DeepSpeed's accelerator is the CPU"),
    ("through Triton's interpreter", {}, {}, True, True, True, "through Triton's interpreter"),
    (
        "memory 0",
        {"accelerator_update_memory": 0},
        {"offload_ratio": (1.0, "cuda"), "pin_memory": True},
        False,
        True,
        False,
        "is 0",
    ),
    (
        "chunks 0",
        {"accelerator_update_chunks": 0},
        {"offload_ratio": (1.0, "cuda"), "pin_memory": True},
        False,
        True,
        False,
        "is 0",
    ),
    (
        "another accelerator",
        {},
        {"offload_ratio": (1.0, "hpu"), "pin_memory": True},
        False,
        True,
        False,
        "not on hpu",
    ),
    (
        "without the fused pass",
        {},
        {"offload_ratio": (1.0, "cuda"), "pin_memory": True},
        False,
        False,
        False,
        "fused pass",
    ),
    (
        # The kernel updates them in the partition, and their sums are checked there.
        "the master weights in the parameters",
        {},
        {"offload_ratio": (1.0, "cuda"), "master": BF16, "fp32_moments": False, "pin_memory": True},
        False,
        True,
        True,
        "the model's choice each step",
    ),
    (
        # The split takes its share of what the update during backward leaves.
        "the update during backward on",
        {"overlap_backward": True, "master_in_params": False},
        {"offload_ratio": (1.0, "cuda"), "pin_memory": True},
        False,
        True,
        True,
        "on the cuda accelerator",
    ),
    (
        "the README's section, the partitions on a GPU: the update during backward on too",
        {},
        {"offload_ratio": (1.0, "cuda"), "params_on_host": False, "pin_memory": True},
        False,
        True,
        True,
        "the model's choice each step",
    ),
    (
        "asked for, the update during backward on too",
        CHUNKS_THERE,
        {"offload_ratio": (1.0, "cuda"), "params_on_host": False, "pin_memory": True},
        False,
        True,
        True,
        "2 every step",
    ),
    (
        # DeepSpeed's default: copies to and from pageable memory would hold the host's pass.
        "the README's section on a GPU, pin_memory false",
        {},
        {"offload_ratio": (1.0, "cuda")},
        False,
        True,
        False,
        "pin_memory is false",
    ),
]


@pytest.mark.parametrize(
    ("section", "given", "interpreted", "fused", "on", "why"),
    [c[1:] for c in CHUNK_CHOICES],
    ids=[c[0] for c in CHUNK_CHOICES],
)
def test_whether_chunks_stream_to_the_accelerator_and_why(
    section: dict[str, Any],
    given: dict[str, Any],
    interpreted: bool,
    fused: bool,
    on: bool,
    why: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    resolved = settle(section, facts(**given), fused=fused)
    assert resolved.accelerator_chunks.on is on
    assert why in resolved.accelerator_chunks.why
    if given.get("params_on_host") is False or section.get("overlap_backward") is True:
        # Both on: neither gives way to the other.
        assert resolved.overlap_backward.on
    if given.get("master") == BF16:
        # Both on too: the master weights stay in the parameters.
        assert resolved.master_in_params.on and resolved.dtypes.master_in_params


@pytest.mark.parametrize(
    ("section", "given", "error"),
    [
        ({"accelerator_update_chunks": 2}, {}, "accelerator_update_chunks: chunks cannot stream .* the CPU"),
        ({"accelerator_update_memory": "1G"}, {}, "accelerator_update_memory: chunks cannot stream"),
        (
            {"accelerator_update_chunks": 2},
            {"offload_ratio": (1.0, "cuda")},
            "accelerator_update_chunks: chunks cannot stream .*pin_memory is false",
        ),
    ],
    ids=["chunks asked for on the CPU", "memory asked for on the CPU", "on a GPU, pin_memory false"],
)
def test_chunks_asked_for_where_they_cannot_be_are_refused_by_the_key(
    section: dict[str, Any], given: dict[str, Any], error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=error):
        settle(section, facts(**given))


class _View:
    """What the session's kernel check asks of DeepSpeed's partitions: a unit test's stand-in."""

    partition_dtype = BF16

    def __init__(self, ratio: tuple[float, str]) -> None:
        self.ratio = ratio

    def accelerator_device(self) -> torch.device:
        return torch.device("cpu")

    def offload_ratio(self) -> tuple[float, str]:
        return self.ratio


DIFFERS = {"array": "exp_avg_sq", "count": 3, "elements": 2085, "first": 7, "host": 1e-40, "there": 0.0}

# name, the facts' ratio, the check's answer (None: the real kernel through the interpreter), what
# follows: the chunks on after it, or the refusal's words
KERNEL_CHECKS: list[tuple[str, tuple[float, str], dict[str, Any] | None, bool | str]] = [
    ("chunks, the kernel agrees", (1.0, "cpu"), None, True),
    ("chunks, its bits differ: off, saying why", (1.0, "cpu"), DIFFERS, False),
    ("ratio's subgroups, the kernel agrees", (0.3, "cpu"), None, True),
    (
        "ratio's subgroups, its bits differ: refused by the key",
        (0.3, "cpu"),
        DIFFERS,
        r"offload_optimizer.ratio: 0.3 keeps the first 1 of this rank's 2 subgroups on the cpu accelerator.*"
        r"other bits than the host pass at start-up: exp_avg_sq, 3 of 2085 elements, the first at 7",
    ),
]


@pytest.mark.parametrize(
    ("ratio", "differs", "follows"), [c[1:] for c in KERNEL_CHECKS], ids=[c[0] for c in KERNEL_CHECKS]
)
def test_the_kernel_there_is_checked_before_the_update_runs_there(
    ratio: tuple[float, str],
    differs: dict[str, Any] | None,
    follows: bool | str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The session's start-up check of the accelerator's kernel (`check_on_device`, itself checked in
    test_accelerator_chunks) covers both of its users: chunks streamed there go off where its bits
    differ, and the subgroups `offload_optimizer.ratio` keeps there, which have no other home, are
    refused by the key."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    resolved = settle({}, facts(offload_ratio=ratio))
    assert resolved.accelerator_chunks.on or resolved.accelerator_subgroups
    if differs is not None:
        monkeypatch.setattr(session_module, "check_on_device", lambda *_: differs)
    if isinstance(follows, str):
        with pytest.raises(ValueError, match=follows):
            session_module._accelerator_kernel_checked(resolved, _View(ratio))  # type: ignore[arg-type]
        return
    checked = session_module._accelerator_kernel_checked(resolved, _View(ratio))  # type: ignore[arg-type]
    assert checked.accelerator_chunks.on is (follows and resolved.accelerator_chunks.on)
    if differs is not None:
        assert "other bits than the host pass" in checked.accelerator_chunks.why
