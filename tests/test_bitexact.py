"""mlp-offload inside real DeepSpeed ZeRO-3 (CPU accelerator): after ten steps of the same model, seed
and data, the fp32 master weights and both Adam moments equal DeepSpeed's own `offload_optimizer.device:
cpu` bit for bit, in every configuration below, with the update behind the next forward and inside
`step()`; two ranks; what is read between a step and the next forward. Each run is its own process
(`support/zero3_harness.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ONE_NODE
from deepspeed_runs import (
    WARMUP,
    assert_bit_equal,
    check_chunk_counts,
    run_case,
    section,
    stock_side,
)

ONE_CYCLE = {
    "type": "OneCycle",
    "params": {
        "cycle_min_lr": 1e-4,
        "cycle_max_lr": 3e-3,
        "cycle_first_step_size": 3,
        "cycle_min_mom": 0.85,
        "cycle_max_mom": 0.95,
        "decay_step_size": 2,
        "decay_lr_rate": 0.1,
        "decay_mom_rate": 0.05,
    },
}


# name, the DeepSpeed side of the case, the mlp_offload section's extra keys, paths used
CASES = [
    ("bf16, one path, DeepSpeed's pinned budget", {}, {"host_memory": "deepspeed"}, 1),
    ("bf16, the default budget: all in memory", {}, {}, 1),
    ("bf16, three paths, some cached", {}, {"host_memory": "64M", "cache_chunks": 2}, 3),
    ("bf16, every chunk cached", {}, {"host_memory": "64M", "cache_chunks": 1000}, 2),
    # DeepSpeed's own passes per chunk instead of the fused kernel (every other row of CPU Adam fuses).
    (
        "DeepSpeed's passes (update_kernel: deepspeed), clipping",
        {"clip": 0.05},
        {"host_memory": "200K", "update_chunk": "24K", "update_kernel": "deepspeed"},
        2,
    ),
    # Chunks of 2048 elements: six or so per subgroup, the last of each shorter; DeepSpeed reduces the
    # gradients in small buckets, so most chunks' gradients are final before backward ends.
    # The fused pass on 3 threads (the harness gives torch 2): each over its own range of a chunk.
    (
        "chunks of a few thousand elements, the pass on 3 threads",
        {"reduce_bucket_size": 20_000},
        {"host_memory": "200K", "update_chunk": "24K", "update_threads": 3},
        2,
    ),
    (
        "a subgroup larger than the whole budget",
        {"sub_group_size": 100_000},
        {"host_memory": "300K", "update_chunk": "24K"},
        2,
    ),
    # Without checksums: the fused pass hashes nothing.
    (
        "a budget of three chunks, no checksums",
        {},
        {"host_memory": "40K", "update_chunk": "12K", "checksum": False},
        2,
    ),
    ("gradient accumulation 2", {"grad_accum": 2}, {"host_memory": "64M"}, 2),
    # torch's optimizers in place of DeepSpeed's CPU Adam: from the config, and as an object.
    (
        "torch's AdamW (torch_adam: true)",
        {"torch_adam": True},
        {"host_memory": "200K", "update_chunk": "24K"},
        2,
    ),
    ("a torch.optim.Adam object", {"client_optimizer": "Adam"}, {"host_memory": "64M"}, 1),
    ("clipping active", {"clip": 0.05}, {"host_memory": "200K", "update_chunk": "24K", "cache_chunks": 1}, 2),
    (
        "two parameter groups and a scheduler",
        {
            "param_groups": True,
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 5},
            },
        },
        {"host_memory": "64M"},
        3,
    ),
    # DeepSpeed's OneCycle cycles the momentum too: beta1 changes every step, and with it the bias
    # corrections DeepSpeed's CPU Adam keeps between calls.
    (
        "a OneCycle schedule of lr and momentum",
        {"scheduler": ONE_CYCLE},
        {"host_memory": "200K", "update_chunk": "24K"},
        2,
    ),
    # Fine-tuning with part of the model frozen: the embeddings and every layer norm have no optimizer
    # state, and the subgroups are cut from what is left.
    (
        "the embeddings and layer norms frozen",
        {"frozen": r"^(tok|pos)\.|\.ln"},
        {"host_memory": "200K", "update_chunk": "24K"},
        2,
    ),
    # LayerDrop: the last block does not run in some steps, so its parameters get no gradient there.
    # DeepSpeed updates them with the gradient of their last boundary, which its fp32 buffer still holds,
    # times every step's unscale-and-clip factor since (`mlp_offload.adapter.stale_gradients`). Clipped by
    # DeepSpeed's default (1.0) in some steps, with accumulation and the update during backward (which
    # leaves those chunks to step()); and in fp16, whose loss scale divides them again each step, with an
    # overflow.
    (
        "the last block dropped from some steps, accumulation, the update during backward",
        {"layer_drop": [1, 2, 5], "grad_accum": 2},
        {"host_memory": "200K", "update_chunk": "24K", "overlap_backward": True},
        2,
    ),
    # Nine steps in a row without: from the eighth factor below 1 (DeepSpeed's default clipping; this
    # model's norms are above 1 then), the gradient is kept in fp32 and multiplied once a step.
    (
        "the last block dropped from nine steps in a row, its gradient kept",
        {"layer_drop": list(range(1, 10))},
        {"host_memory": "200K", "update_chunk": "24K"},
        2,
    ),
    (
        "fp16, the last block dropped from some steps and an overflow",
        {"layer_drop": [1, 2, 5], "fp16": True, "overflow_at_step": 3},
        {"host_memory": "200K", "update_chunk": "24K"},
        2,
    ),
    # DeepSpeed keeps a parameter of under 100,000 elements whole on every rank (every one of this
    # model's); with a threshold of 0 each is gathered for each use in forward and backward and released
    # after it, as the parameters of the models people offload are. The head shares the token
    # embedding's weight (GPT-2, Llama 3.2 1B and 3B): one parameter gathered twice in forward and in
    # backward, its gradient final only at backward's end.
    (
        "each parameter gathered for its use, the head tied, the update during backward",
        {"persistence_threshold": 0, "tied": True, "reduce_bucket_size": 20_000, "clip": 0.0},
        {"host_memory": "200K", "update_chunk": "24K", "overlap_backward": True},
        2,
    ),
    # Activation checkpointing: each block's forward runs again in backward and gathers its parameters
    # again there, after the chunks of the blocks behind it have been updated. Unclipped, as the row
    # above and the one below: DeepSpeed's default clipping at 1.0 clips these gradients, and the update
    # during backward is then not tried.
    (
        "activation checkpointing (reentrant), each parameter gathered for its use",
        {
            "checkpointing": "reentrant",
            "persistence_threshold": 0,
            "clip": 0.0,
            "reduce_bucket_size": 20_000,
        },
        {"host_memory": "200K", "update_chunk": "24K", "overlap_backward": True},
        2,
    ),
    (
        "the parameters offloaded too (offload_param: cpu)",
        {"offload_param": "cpu", "persistence_threshold": 0, "reduce_bucket_size": 20_000, "clip": 0.0},
        {"host_memory": "200K", "update_chunk": "24K", "overlap_backward": True},
        2,
    ),
    # No mixed precision (what `mlp-offload train` picks on a CPU whose bf16 is slow).
    ("fp32 throughout", {"fp32": True}, {"host_memory": "200K", "update_chunk": "24K"}, 2),
    # The path of a partition on an accelerator (the parameters through the host scratch), where fp32
    # parameters fill the scratch's two half-precision slots alone (the stock run is the row above's).
    (
        "fp32 throughout, the parameters through the host scratch",
        {"fp32": True, "params_through_scratch": True},
        {"host_memory": "200K", "update_chunk": "24K"},
        2,
    ),
    ("fp16 with a forced overflow step", {"fp16": True, "overflow_at_step": 3}, {"host_memory": "64M"}, 2),
]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no overlap"])
@pytest.mark.parametrize(("name", "ds_case", "extra", "n_paths"), CASES, ids=[c[0] for c in CASES])
def test_state_is_bit_equal_to_deepspeed_cpu_offload(
    name: str,
    ds_case: dict[str, Any],
    extra: dict[str, Any],
    n_paths: int,
    overlap: bool,
    work_dirs: list[Path],
    tmp_path: Path,
) -> None:
    """Every row with the update behind the next forward (the default) and inside `step()`."""
    stock = run_case(stock_side(ds_case), tmp_path, "stock")
    ours_section = section(work_dirs[:n_paths], overlap=overlap, **extra)
    ours = run_case({**ds_case, "mlp_offload": ours_section}, tmp_path, "ours")
    assert_bit_equal(ours, stock)
    steps = [r for r in ours["telemetry"] if r["event"] == "step"]
    start = next(r for r in ours["telemetry"] if r["event"] == "start")
    assert start["chunks"] > 2, "the state must span several chunks"
    # DeepSpeed's CPU Adam runs fused unless configured otherwise; torch's optimizers run their own.
    torch_optimizer = ds_case.get("torch_adam") or ds_case.get("client_optimizer")
    fused = not torch_optimizer and extra.get("update_kernel") != "deepspeed"
    assert start["update_kernel"]["kernel"] == ("fused" if fused else "deepspeed"), start["update_kernel"]
    # On torch's threads (the harness's OMP_NUM_THREADS), as DeepSpeed's CPU Adam on OpenMP's, unless
    # the row sets its own.
    threads = extra.get("update_threads", 2) if fused else None
    assert start["update_kernel"].get("threads") == threads, start["update_kernel"]
    # The update runs behind step() where asked and the fused pass runs; each step's record says so.
    assert start["overlap"]["on"] == (overlap and fused), start["overlap"]
    assert all((r["overlap"] is not None) == start["overlap"]["on"] for r in steps)
    if "sub_group_size" not in ds_case:
        assert start["subgroups"] > 2, "the model must span several subgroups"
    if ds_case.get("overflow_at_step") is not None:
        assert ours["skipped"] == 1 and len(steps) == 9
    # Parameters without a gradient at a boundary are updated with an earlier one (`stale`); kept in
    # fp32 once long without.
    assert all(r["stale"]["diverged"] == 0 for r in steps)
    if extra.get("overlap_backward") is True and ds_case.get("clip") == 0.0:
        # Unclipped, the update during backward is kept.
        assert all(r["overlap_backward"]["kept"] and r["overlap_backward"]["chunks"] > 0 for r in steps), (
            steps
        )
    # Every parameter of this model is held whole on every rank unless the row's threshold says not.
    assert (ours["persistent_params"] == 0) == ("persistence_threshold" in ds_case), ours["persistent_params"]
    if "layer_drop" in ds_case:
        assert any(r["stale"]["params"] > 0 for r in steps), [r["stale"] for r in steps]
    kept = [r["stale"]["kept_bytes"] > 0 for r in steps]
    assert any(kept) == ("kept" in name), [r["stale"] for r in steps]
    if extra.get("update_chunk"):
        assert start["chunks"] > start["subgroups"], "subgroups of several chunks"
    if isinstance(extra.get("host_memory"), str) and extra["host_memory"].endswith("K"):
        budget = int(extra["host_memory"][:-1]) << 10
        held = start["buffers"] * start["buffer_bytes"] + 4 * start["chunk_elements"]
        assert held <= budget, "the pool and the gradient chunk fit the budget"
        assert start["buffers"] * start["buffer_bytes"] < start["chunks"] * 12 * start["chunk_elements"]
    # Every chunk is read, cached or still in its buffer from the last step's write-back, and written or
    # kept, every step.
    for r in steps[1:]:
        assert r["forward_secs"] > 0 and r["backward_secs"] > 0 and r["update_secs"] > 0, r
    # When each chunk's gradient was final: before backward ended, where DeepSpeed flushed its buckets
    # during backward (with one flush at the end, every lead is about 0).
    for r in steps:
        leads = r["grads_final"]["lead_secs"]
        assert len(leads) == start["chunks"] and min(leads) >= 0.0, r["grads_final"]
        assert max(leads) <= r["grads_final"]["backward_secs"], r["grads_final"]
    if "reduce_bucket_size" in ds_case:
        assert all(sum(t > 0 for t in r["grads_final"]["lead_secs"]) > start["chunks"] // 2 for r in steps)
    check_chunk_counts(start, steps)
    for r in steps:
        # The cache of the step: smaller from the step the plan goes to chunk order on (the update
        # during backward, by default).
        chunk_order = r["overlap_backward"] is not None and r["overlap_backward"]["chunk_order"]
        assert r["cached_chunks"] == start["cached_chunks"] or chunk_order, r
    used = [p for p in work_dirs[:n_paths] if any(p.rglob("*.mlpo"))]
    assert len(used) == n_paths, "every path holds a share of the state"
    # destroy() without mlp_offload_flush() leaves the last step's state, cached chunks included.
    assert ours["store_after_destroy_matches"]


@ONE_NODE
def test_two_data_parallel_ranks_are_bit_equal_to_deepspeed(work_dirs: list[Path], tmp_path: Path) -> None:
    """Two ranks (torch.distributed over gloo, as across nodes), each with its own batches, sharing the
    same two paths: every rank's state equals stock DeepSpeed's two-rank run, and each rank keeps its
    partition in its own directory of each path."""
    stock = run_case({}, tmp_path, "stock", ranks=2)
    ours = run_case({"mlp_offload": section(work_dirs[:2], host_memory="64M")}, tmp_path, "ours", ranks=2)
    assert stock["losses"] != stock["ranks"][1]["losses"], "the ranks must see different data"
    for rank, (a, b) in enumerate(zip(ours["ranks"], stock["ranks"], strict=True)):
        assert a["optimizer_class"] == "mlp_offload.adapter.zero3.MLPOffloadStage3", rank
        assert_bit_equal(a, b)
        # By default ("auto") the update runs behind step() where every chunk stays in memory, as here.
        start = next(r for r in a["telemetry"] if r["event"] == "start")
        assert start["cached_chunks"] == start["chunks"], start
        assert start["overlap"] == {"on": True, "why": "on: every chunk stays in host memory"}, rank
    for path in work_dirs[:2]:
        assert sorted(d.name for d in path.iterdir() if any(d.glob("*.mlpo"))) == ["rank0", "rank1"], path


# name, the DeepSpeed side of the case, the mlp_offload section's extra keys, ranks
BETWEEN_STEPS = [
    (
        "clipping, a scheduler changing the lr every step, chunks of a few thousand elements",
        {"clip": 0.05, "scheduler": WARMUP},
        {"host_memory": "200K", "update_chunk": "24K"},
        1,
    ),
    (
        "two ranks, fp16 with an overflow step",
        {"fp16": True, "overflow_at_step": 2},
        {"host_memory": "64M"},
        2,
    ),
]


@pytest.mark.parametrize(
    ("ds_case", "extra", "ranks"), [c[1:] for c in BETWEEN_STEPS], ids=[c[0] for c in BETWEEN_STEPS]
)
def test_what_is_read_between_a_step_and_the_next_forward_is_the_updated_model(
    ds_case: dict[str, Any], extra: dict[str, Any], ranks: int, work_dirs: list[Path], tmp_path: Path
) -> None:
    """After every step, while our update still runs behind it, an eval pass and a gathered read of every
    parameter: both see what stock DeepSpeed's see once its step has returned, bit for bit, and the
    training after them goes on bit-equal."""
    case = {**ds_case, "steps": 6, "read_between_steps": True}
    stock = run_case(case, tmp_path, "stock", ranks=ranks)
    ours_section = section(work_dirs[:2], overlap=True, **extra)
    ours = run_case({**case, "mlp_offload": ours_section}, tmp_path, "ours", ranks=ranks)
    for rank, (a, b) in enumerate(zip(ours.get("ranks", [ours]), stock.get("ranks", [stock]), strict=True)):
        assert_bit_equal(a, b)
        start = next(r for r in a["telemetry"] if r["event"] == "start")
        assert start["overlap"]["on"], start["overlap"]
        assert len(a["between_steps"]) == 6, rank
        for step, (x, y) in enumerate(zip(a["between_steps"], b["between_steps"], strict=True)):
            assert x["eval_loss"] == y["eval_loss"], (rank, step)
            assert torch.equal(x["gathered"], y["gathered"]), (rank, step)


def test_offload_states_right_after_a_step_waits_for_the_update_behind_it(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """DeepSpeed's `offload_states` and `reload_states` right after every `step()` (an RLHF loop frees
    memory for generation so), while our update still runs behind the step: they move the partitions
    it writes, so they wait for it. Training after them is bit-equal to stock doing the same, and what
    our engine keeps of the gradient buffer goes while it is offloaded."""
    case = {"steps": 6, "offload_states_after_every_step": True}
    stock = run_case(case, tmp_path, "stock")
    extra = {"overlap": True, "host_memory": "200K", "update_chunk": "24K"}
    ours = run_case({**case, "mlp_offload": section(work_dirs[:2], **extra)}, tmp_path, "ours")
    assert_bit_equal(ours, stock)
    start = next(r for r in ours["telemetry"] if r["event"] == "start")
    assert start["overlap"]["on"] and start["chunks"] > start["cached_chunks"], start
    assert ours["half_grad_views_while_offloaded"] == [0] * 6


def test_after_install_deepspeed_without_our_section_is_stock(work_dirs: list[Path], tmp_path: Path) -> None:
    """Configs without our section build DeepSpeed's own class; with it, plain `deepspeed.initialize`
    builds ours, which is a `DeepSpeedZeroOptimizer_Stage3` under the name imported before `install()`
    and the one imported after (DeepSpeed's checkpoint code and users check the type)."""
    stock = run_case({"steps": 3}, tmp_path, "stock")
    installed = run_case({"steps": 3, "install_first": True}, tmp_path, "installed")
    assert (
        installed["optimizer_class"]
        == stock["optimizer_class"]
        == ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3")
    )
    assert_bit_equal(installed, stock)
    # With the section, plain deepspeed.initialize (as a framework would call it) builds ours.
    ours = run_case(
        {"steps": 3, "install_first": True, "plain_initialize": True, "mlp_offload": section(work_dirs[:1])},
        tmp_path,
        "ours",
    )
    assert ours["optimizer_class"] == "mlp_offload.adapter.zero3.MLPOffloadStage3"
    assert ours["is_deepspeed_stage3"] == installed["is_deepspeed_stage3"] == [True, True]
    assert_bit_equal(ours, stock)


@pytest.mark.parametrize("given_as", ["dict", "file named by --deepspeed_config"])
def test_a_deepspeed_nvme_config_plus_our_section_runs_as_it_is(
    given_as: str, work_dirs: list[Path], tmp_path: Path
) -> None:
    """The one-line migration: DeepSpeed's own `offload_optimizer: {device: nvme, nvme_path}` config,
    with `"mlp_offload": {}` added and nothing else changed, runs our engine on `nvme_path`, bit-equal
    to DeepSpeed's CPU offload; also when the config is a file named on the command line."""
    stock = run_case({}, tmp_path, "stock")
    case: dict[str, Any] = {"nvme_path": str(work_dirs[0]), "mlp_offload": {"host_memory": "64M"}}
    if given_as != "dict":
        case["config_file"] = str(tmp_path / "ds_config.json")
    ours = run_case(case, tmp_path, "migrated")
    assert ours["optimizer_class"] == "mlp_offload.adapter.zero3.MLPOffloadStage3"
    start = next(r for r in ours["telemetry"] if r["event"] == "start")
    assert start["paths"] == [str(work_dirs[0])]
    assert any((work_dirs[0] / "rank0").glob("*.mlpo"))
    assert_bit_equal(ours, stock)


@pytest.mark.parametrize(
    "ds_case",
    [
        {"helpers_at": 4},
        # The helpers on the last block's parameters, which got no gradient since step 2 (clipped steps):
        # their gradients as DeepSpeed's fp32 buffer holds them, the last one times each step's factor
        # since; the setters write some, into subgroups that hold others.
        {"helpers_at": 4, "helpers_on": r"^blocks\.1\.", "layer_drop": [2, 3, 4], "clip": 0.05},
    ],
    ids=["every parameter with a gradient", "on parameters without a gradient since two clipped steps"],
)
def test_deepspeeds_tensor_helpers_read_and_write_as_in_stock(
    ds_case: dict[str, Any], work_dirs: list[Path], tmp_path: Path
) -> None:
    """Between backward and step 4, each `safe_get_*` helper reads one parameter's gradient, weights or
    Adam state (full and local) and its `safe_set_*` twin writes new values; the state is then partly
    cached, partly streaming. What the helpers read, and where training ends, equal stock DeepSpeed doing
    the same, bit for bit."""
    ours = section(work_dirs[:2], host_memory="200K", update_chunk="24K", cache_chunks=2)
    stock = run_case(ds_case, tmp_path, "stock")
    mine = run_case({**ds_case, "mlp_offload": ours}, tmp_path, "ours")
    assert sorted(mine["helper_reads"]) == sorted(stock["helper_reads"]) and len(stock["helper_reads"]) == 6
    for name, tensor in stock["helper_reads"].items():
        assert torch.equal(mine["helper_reads"][name], tensor), name
    assert_bit_equal(mine, stock)


def test_gradients_of_earlier_micro_steps_alone_are_used_and_named(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """With accumulation over two micro-steps, the last block is dropped from the last micro-step of step
    2: its parameters get gradients in the first micro-step only. Stock DeepSpeed copies into its fp32
    gradient buffer only what the boundary's last micro-step reduces, and updates them with their
    gradient of step 1; ours updates them with the gradients they got, and says so, naming them. The
    steps before are bit-equal."""
    case = {"layer_drop_last_micro": [2], "grad_accum": 2, "steps": 4}
    stock = run_case(case, tmp_path, "stock")
    mine = run_case({**case, "mlp_offload": section(work_dirs[:1], host_memory="64M")}, tmp_path, "ours")
    assert mine["losses"][:3] == stock["losses"][:3] and mine["losses"][3] != stock["losses"][3]
    warned = [line for line in mine["output"].splitlines() if "earlier micro-steps" in line]
    assert len(warned) == 1 and "12 parameter(s)" in warned[0], warned
    assert "blocks.1.block.qkv.weight" in warned[0] and "differs from stock's" in warned[0], warned[0]
