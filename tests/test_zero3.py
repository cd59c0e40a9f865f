"""mlp-offload inside real DeepSpeed ZeRO-3 (CPU accelerator): after ten steps of the same model, seed
and data, the fp32 master weights and both Adam moments equal DeepSpeed's own `offload_optimizer.device:
cpu` bit for bit, in every configuration below. Each run is its own process (`zero3_harness.py`)."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import mounted_tmpfs
from deepspeed_runs import (
    DEADLINE_MARGIN_S,
    IMPORTED_IN_RUN,
    HarnessRun,
    assert_bit_equal,
    batch_timeout,
    free_port,
    from_step,
    harness_env,
    run_case,
    run_harness,
    runs_are_forked,
    section,
)
from mlp_offload import overlap

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

pytestmark = pytest.mark.deepspeed
# Tests whose ranks share the work disk's device through node-wide admission run one after another, never
# beside each other (`pytest -n`): one node-wide semaphore per device and user.
ONE_NODE = pytest.mark.xdist_group("node-wide admission")


WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 8}}

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
    # times every step's unscale-and-clip factor since (`mlp_offload.stale`). Clipped by DeepSpeed's
    # default (1.0) in some steps, with accumulation and the update during backward (which leaves those
    # chunks to step()); and in fp16, whose loss scale divides them again each step, with an overflow.
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
        assert all(r["speculation"]["kept"] and r["speculation"]["chunks"] > 0 for r in steps), steps
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
        chunk_order = r["speculation"] is not None and r["speculation"]["chunk_order"]
        assert r["cached_chunks"] == start["cached_chunks"] or chunk_order, r
    used = [p for p in work_dirs[:n_paths] if any(p.rglob("*.mlpo"))]
    assert len(used) == n_paths, "every path holds a share of the state"
    # destroy() without mlp_offload_flush() leaves the last step's state, cached chunks included.
    assert ours["store_after_destroy_matches"]


def stock_side(case: dict[str, Any]) -> dict[str, Any]:
    """A row's case for the stock run: what only our engine has a path for (the parameters through the
    host scratch) left out, so the stock run is another row's, kept once (`stock_cache`)."""
    return {k: v for k, v in case.items() if k != "params_through_scratch"}


def check_chunk_counts(start: dict[str, Any], steps: list[dict[str, Any]]) -> None:
    """Every chunk is read, cached or still in its buffer from the last step's write-back, and written
    or kept in the step's cache, once a step: by the update during backward where step() kept it, else
    by the update after it (an update during backward that step() undid is in the step's figures too,
    its part said in its record)."""
    for r in steps:
        spec = r["speculation"]
        undone = dict.fromkeys(("reads", "reads_dropped", "cached", "retained", "writes"), 0)
        if spec is not None and not spec["kept"] and spec["figures"] is not None:
            undone = spec["figures"]
        # A read ahead of a part that ended before its chunk (`reads_dropped`) is read again.
        taken = sum(r[k] - undone[k] for k in ("reads", "cached", "retained"))
        taken -= r["reads_dropped"] - undone["reads_dropped"]
        assert taken == start["chunks"], (r, spec)
        assert r["writes"] - undone["writes"] + r["cached_chunks"] == start["chunks"], (r, spec)


# A budget that caches every chunk of these rows' model and leaves room for a kept copy of each; one
# slot per chunk on disk (none is added: the chunks are staged in memory).
EVERY_CHUNK_CACHED = {"host_memory": "8M", "shadow_slots": False}

# The streamed chunks updated during backward (`overlap_backward`): DeepSpeed reduces in small buckets,
# so most gradients are final before backward ends; the budget streams; shadow slots keep the old
# versions. name, the DeepSpeed side, extra section keys, what each step's record says of it
BACKWARD_CASES = [
    ("kept every step", {}, {}, "kept", 1),
    # Without shadow slots: every streamed chunk gets its own second slot at start-up.
    ("kept every step, one slot per chunk but the streamed ones", {}, {"shadow_slots": False}, "kept", 1),
    # The default: from the second boundary, the chunks the plan chose, each given its second slot.
    (
        "as the plan chooses (the default)",
        {},
        {"shadow_slots": False, "overlap_backward": "auto"},
        "planned",
        1,
    ),
    # A cache of fewer chunks than buffers is chunk order's too: the steps go in chunk order from the
    # start.
    (
        "as the plan chooses, a cache of two chunks",
        {},
        {"shadow_slots": False, "overlap_backward": "auto", "cache_chunks": 2},
        "planned",
        1,
    ),
    ("and the rest behind the next forward", {}, {"overlap": True}, "kept", 1),
    ("gradient accumulation 2", {"grad_accum": 2}, {}, "kept", 1),
    ("two ranks, a scheduler changing the lr every step", {"scheduler": WARMUP}, {}, "kept", 2),
    (
        "two ranks, each parameter gathered for its use, the head tied, activation checkpointing",
        {"persistence_threshold": 0, "tied": True, "checkpointing": "non-reentrant"},
        {},
        "kept",
        2,
    ),
    ("clipping: stopped by the norms so far, undone, then not tried", {"clip": 0.05}, {}, "clipping", 1),
    ("fp16, an overflow step undone", {"fp16": True, "overflow_at_step": 3}, {}, "skipped at 3", 1),
    ("bf16, a gradient not finite", {"overflow_at_step": 3}, {}, "skipped at 3", 1),
    ("DeepSpeed's helpers between backward and step", {"helpers_at": 4}, {}, "read at 4", 1),
    ("DeepSpeed's offload_states between backward and step", {"offload_states_at": 4}, {}, "read at 4", 1),
    # The parameters changed apart from the weights before a skipped step: the step keeps the changed
    # ones (the forward after it sees them), so undoing must give back those, not the weights narrowed.
    # Only the gradient final last is not finite: the chunks final before it were taken.
    (
        "parameters set apart from the weights, then a step skipped",
        {"set_params_apart_at": 3, "first_param_grad_not_finite_at": 3},
        {},
        "skipped at 3",
        1,
    ),
    # A partition on an accelerator: the pass writes the parameters into a host scratch copied over
    # after it (every step kept here but the skipped one), and first gets them there where it keeps
    # what it overwrites.
    (
        "as on an accelerator: through the host scratch, parameters set apart, then a step skipped",
        {"params_through_scratch": True, "set_params_apart_at": 3, "first_param_grad_not_finite_at": 3},
        {},
        "skipped at 3",
        1,
    ),
    # Every chunk cached, and room for kept copies: the chunks are updated in their buffers, each one's
    # state before copied by the pass, and given back from that copy when undone.
    ("every chunk cached: kept copies, kept every step", {}, EVERY_CHUNK_CACHED, "kept", 1),
    (
        "every chunk cached: fp16, parameters set apart (written through the host), an overflow step",
        {
            "fp16": True,
            "params_through_scratch": True,
            "set_params_apart_at": 3,
            "first_param_grad_not_finite_at": 3,
        },
        EVERY_CHUNK_CACHED,
        "skipped at 3",
        1,
    ),
    (
        "every chunk cached: DeepSpeed's helpers between backward and step",
        {"helpers_at": 4},
        EVERY_CHUNK_CACHED,
        "read at 4",
        1,
    ),
]


@pytest.mark.parametrize(
    ("name", "ds_case", "extra", "outcome", "ranks"),
    # Several ranks share the node's devices: one at a time with the other tests that do.
    [pytest.param(*c, marks=[ONE_NODE] if c[4] > 1 else []) for c in BACKWARD_CASES],
    ids=[c[0] for c in BACKWARD_CASES],
)
def test_the_update_during_backward_is_kept_or_undone_bit_for_bit(
    name: str,
    ds_case: dict[str, Any],
    extra: dict[str, Any],
    outcome: str,
    ranks: int,
    work_dirs: list[Path],
    tmp_path: Path,
) -> None:
    """Each chunk updated as its gradient is final and staged; `step()` keeps it where the outcome is the
    one assumed (no overflow, no clipping, the same hyperparameters), else undoes it, as does anything
    that reads the state or parameters before `step()`: every row bit-equal to stock DeepSpeed, on every
    rank."""
    # No clipping (DeepSpeed's default clips at 1.0, which these gradients pass) unless the row asks.
    case = {"reduce_bucket_size": 20_000, "steps": 6, "clip": 0.0, **ds_case}
    stock = run_case(stock_side(case), tmp_path, "stock", ranks=ranks)
    keys = {"host_memory": "200K", "update_chunk": "24K", "shadow_slots": True, "overlap_backward": True}
    ours = run_case(
        {**case, "mlp_offload": section(work_dirs[:2], **{**keys, **extra})}, tmp_path, "ours", ranks=ranks
    )
    for a, b in zip(ours.get("ranks", [ours]), stock.get("ranks", [stock]), strict=True):
        assert_bit_equal(a, b)
        check_backward_records(a, outcome)
        if (at := case.get("set_params_apart_at")) is not None:
            # Chunks with parameters set apart were taken before the step undid them.
            records = [r for r in a["telemetry"] if r["event"] in ("step", "skipped")]
            assert records[at]["speculation"]["chunks"] > 0, records[at]


def check_backward_records(ours: dict[str, Any], outcome: str) -> None:
    """What each step's record says of the update during backward, against the row's `outcome`."""
    start = next(r for r in ours["telemetry"] if r["event"] == "start")
    assert start["overlap_backward"]["on"], start["overlap_backward"]
    records = [r for r in ours["telemetry"] if r["event"] in ("step", "skipped")]
    assert len(records) == 6
    check_chunk_counts(start, [r for r in records if r["event"] == "step"])
    what, _, at = outcome.partition(" at ")
    streamed = start["chunks"] - start["cached_chunks"]
    # Every chunk cached: they are the ones taken, each with a kept copy.
    every_cached = streamed == 0
    if every_cached:
        assert start["overlap_backward"]["kept_copies_limit"] == start["chunks"], start["overlap_backward"]
    if what == "planned":
        check_planned_records(start, records)
        return
    # Every streamed chunk has its second slot from the start.
    assert start["overlap_backward"]["slotted_chunks"] >= streamed, start["overlap_backward"]
    undone = []
    for step, r in enumerate(records):
        spec = r["speculation"]
        if spec is not None and spec["why"].startswith("not tried"):
            # After a step whose gradients were clipped, until one that is not.
            previous = records[step - 1]["speculation"]["why"]
            assert "scale was" in previous or previous.startswith("not tried"), (step, spec)
            assert what == "clipping" and spec["chunks"] == 0, (step, spec)
            continue
        assert spec is not None, step
        if spec["stopped"] is not None:
            # Stopped by the gradients' norms so far: they already clip at the row's 0.05, or (the
            # overflow step) are not finite. Then undone.
            assert not spec["kept"], (step, spec)
            assert spec["chunks"] < (start["chunks"] if every_cached else streamed), (step, spec)
            if what == "clipping":
                assert "already clips at 0.05" in spec["stopped"], (step, spec)
            else:
                assert what == "skipped" and step == int(at) and "not finite" in spec["stopped"], (step, spec)
                assert r["event"] == "skipped" and "skipped" in spec["why"], (step, spec)
            undone.append(step)
            continue
        assert what != "clipping" and spec["chunks"] > 0, (step, spec)
        if spec["kept"]:
            assert r["event"] == "step" and (what == "kept" or step != int(at)), (step, spec)
            if every_cached:
                # Every chunk taken, in its buffer with a kept copy (at the first step the buffers still
                # hold the initial writes): nothing written, no second slot on disk.
                assert spec["chunks"] == start["chunks"] == spec["kept_copies"], (step, spec)
                assert r["writes"] == 0 and spec["slotted_chunks"] == 0, (step, r)
            else:
                # Only the chunks that stream were taken; the cached ones stay in memory, never written.
                assert spec["chunks"] == r["writes"] == streamed, (step, spec, r["writes"])
            assert step == 0 or r["cached"] == start["cached_chunks"], (step, r["cached"])
            check_chunk_secs(spec)
            continue
        undone.append(step)
        if what == "read" and step == int(at):
            assert "read before step()" in spec["why"], (step, spec)
        elif what == "skipped" and step == int(at):
            assert r["event"] == "skipped" and "skipped" in spec["why"], (step, spec)
        else:
            # (fp16) A loss scale that grew in the step: another scale.
            assert what == "skipped" and "scale was" in spec["why"], (step, spec)
    assert what == "kept" or (int(at) in undone if at else undone), undone
    # Chunks' updates ran before backward ended.
    assert what == "clipping" or sum(r["speculation"]["in_backward"] for r in records) > 0


def check_chunk_secs(spec: dict[str, Any]) -> None:
    """A boundary's measure of what a chunk took during its backward: from the chunks that ended before
    backward did, when there were enough of them."""
    if spec["in_backward"] < overlap.CHUNK_TIMES_NEEDED:
        assert spec["chunk_secs"] is None, spec
    else:
        assert spec["chunk_secs"] > 0.0, spec


def check_planned_records(start: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """`overlap_backward: "auto"`: nothing at the first boundary (the plan waits for its gradients'
    times), nor until the plan has an update's time to weigh chunk order by and finds it pays (at once
    where the cache loses nothing to it); then the chunks the plan chose, each with the second slot it
    was given then (and no other chunk), kept every step; the rest updated in `step()`."""
    assert start["overlap_backward"]["slotted_chunks"] == 0, start["overlap_backward"]
    whys = [r["speculation"]["why"] for r in records]
    assert whys[0] == "not tried: the plan waits for one boundary's gradient times", whys
    tried = [step for step, why in enumerate(whys) if not why.startswith("not tried")]
    assert tried, whys
    first = tried[0]
    # Then, until it is tried: without a probe profile the first update's time comes from the first
    # step; after that only what the plan found of the last boundary's times (which a loaded machine
    # moves) holds it back: chunk order not paying, or no chunk that would begin before backward ends.
    in_order_from_start = records[0]["speculation"]["chunk_order"]
    nothing_begins = "not tried: the plan expects no chunk's update to begin before backward ends"
    for step, why in enumerate(whys[1:first], 1):
        found = why.removeprefix("not tried: ")
        assert (
            (step == 1 and found == "no update predicted or measured yet to plan by")
            or (found.startswith("in chunk order ") and not in_order_from_start)
            or why == nothing_begins
        ), (step, whys)
    chunk_bytes = start["buffer_bytes"]
    for step, r in enumerate(records[first:], first):
        spec = r["speculation"]
        if spec["why"] == nothing_begins:
            continue
        streamed = start["chunks"] - r["cached_chunks"]
        assert spec["chunk_order"] and spec["kept"] and spec["stopped"] is None, (step, spec)
        assert spec["slots_short"] is None, (step, spec)
        assert 0 < spec["planned"] == spec["slotted"] == spec["chunks"] <= streamed, (step, spec)
        # Second slots for the chosen chunks alone, each the chunk's state again.
        assert spec["planned"] <= spec["slotted_chunks"] < start["chunks"], (step, spec)
        held = spec["slot_bytes"] - spec["slot_bytes_given_back"]
        assert 0 < held <= spec["slotted_chunks"] * chunk_bytes, (step, spec)
        assert r["writes"] == streamed, (step, r["writes"])
        check_chunk_secs(spec)
    # A cache of fewer chunks than buffers loses nothing to chunk order: in chunk order from the start,
    # tried from the first boundary with gradient times unless the plan found nothing to take there.
    assert not in_order_from_start or first == 1 or whys[1] == nothing_begins, whys
    assert sum(r["speculation"]["in_backward"] for r in records) > 0


@ONE_NODE
def test_two_data_parallel_ranks_are_bit_equal_to_deepspeed(work_dirs: list[Path], tmp_path: Path) -> None:
    """Two ranks (torch.distributed over gloo, as across nodes), each with its own batches, sharing the
    same two paths: every rank's state equals stock DeepSpeed's two-rank run, and each rank keeps its
    partition in its own directory of each path."""
    stock = run_case({}, tmp_path, "stock", ranks=2)
    ours = run_case({"mlp_offload": section(work_dirs[:2], host_memory="64M")}, tmp_path, "ours", ranks=2)
    assert stock["losses"] != stock["ranks"][1]["losses"], "the ranks must see different data"
    for rank, (a, b) in enumerate(zip(ours["ranks"], stock["ranks"], strict=True)):
        assert a["optimizer_class"] == "mlp_offload.zero3.MLPOffloadStage3", rank
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


# name, the DeepSpeed side, ranks
BEFORE_STEP = [
    # One rank: DeepSpeed's "gather" makes a parameter's data its partition, which the update during
    # backward writes before step(); a persistent parameter (all of this model's, by DeepSpeed's
    # default threshold) stays so between uses.
    ("one rank, every parameter held whole", {}, 1),
    ("one rank, each parameter gathered for its use", {"persistence_threshold": 0}, 1),
    ("two ranks, every parameter held whole", {}, 2),
]


@pytest.mark.parametrize(
    ("ds_case", "ranks"),
    [pytest.param(*c[1:], marks=[ONE_NODE] if c[2] > 1 else []) for c in BEFORE_STEP],
    ids=[c[0] for c in BEFORE_STEP],
)
def test_what_is_read_between_backward_and_step_is_the_model_before_the_step(
    ds_case: dict[str, Any], ranks: int, work_dirs: list[Path], tmp_path: Path
) -> None:
    """Between backward and step 3, with chunks already updated during backward: the parameters' data
    as they are, an eval pass, and every parameter gathered see the model before the step, as stock's
    do, bit for bit; training goes on bit-equal. (With one rank the parameters held whole showed the
    update's values before.)"""
    case = {**ds_case, "reduce_bucket_size": 20_000, "clip": 0.0, "steps": 6, "read_before_step_at": 3}
    stock = run_case(case, tmp_path, "stock", ranks=ranks)
    keys = {"host_memory": "200K", "update_chunk": "24K", "overlap_backward": True}
    ours = run_case({**case, "mlp_offload": section(work_dirs[:2], **keys)}, tmp_path, "ours", ranks=ranks)
    for rank, (a, b) in enumerate(zip(ours.get("ranks", [ours]), stock.get("ranks", [stock]), strict=True)):
        assert_bit_equal(a, b)
        (x,), (y,) = a["before_step"], b["before_step"]
        assert torch.equal(x["held"], y["held"]), rank
        assert x["eval_loss"] == y["eval_loss"], rank
        assert torch.equal(x["gathered"], y["gathered"]), rank
        specs = [r["speculation"] for r in a["telemetry"] if r["event"] == "step"]
        # Chunks were taken before the reads; the gathered read undid them (step() had not decided).
        read_at = specs[3]
        assert read_at["chunks"] > 0 and read_at["why"] == "parameters were gathered before step()", read_at
        assert all(s["kept"] and s["chunks"] > 0 for k, s in enumerate(specs) if k != 3), specs


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


def save_stale_profile(paths: list[Path], ranks: int) -> dict[str, Any]:
    """A real probe of `paths` (a small one) for a node of `ranks`, saved as the engine's profile of them,
    in which the first path claims 8 times what it gives, as a profile saved before its device slowed
    would: the plan then loads it with most of the state, and the tuners must move the split back.
    Returns the probe's measurement of how the ranks share the device."""
    from dataclasses import asdict

    from mlp_offload import profiles

    small = profiles.ProbeOptions(
        bytes=16 << 20,
        sustained_bytes=32 << 20,
        chunk_sizes=[1 << 20],
        depths=[2, 8],
        together_secs=0.3,
        ranks=ranks,
    )
    profile = profiles.probe([str(p) for p in paths], small)
    for key in ("read_bytes_per_s", "write_bytes_per_s", "mixed_bytes_per_s", "concurrent_bytes_per_s"):
        if profile.probes[0].get(key):
            profile.probes[0][key] *= 8
    profile.options = asdict(profiles.ProbeOptions(ranks=ranks))
    profiles.save_profile(profile)
    sharing: dict[str, Any] = profile.probes[0]["sharing"]
    return sharing


# ranks, device_sharing
NODES = [(2, "auto"), (4, "turns")]


@ONE_NODE
@pytest.mark.parametrize(("ranks", "sharing"), NODES, ids=[f"{r} ranks, {s}" for r, s in NODES])
def test_the_ranks_of_a_node_share_each_device_and_agree_on_the_split(
    ranks: int, sharing: str, work_dirs: list[Path], tmp_path: Path
) -> None:
    """N ranks of one node (gloo) on the same two paths, under node-wide admission of 2 requests per
    device while each rank may put 8 in flight, adapting the split from a stale profile: every rank's
    state equals stock DeepSpeed's N-rank run bit for bit; no rank put more than 2 requests in flight,
    and none saw more than 2 in flight on the device, all ranks together; every rank's tuner made the
    same moves at the same steps, so all hold the same split throughout; and the device is shared as
    asked, or ("auto") as the probe measured faster."""
    from mlp_offload import profiles

    measured = save_stale_profile(work_dirs[:2], ranks)
    stock = run_case({}, tmp_path, "stock", ranks=ranks)
    extra = {
        "weights": "auto",
        "host_memory": "200K",
        "update_chunk": "24K",
        "device_inflight": 2,
        "device_sharing": sharing,
    }
    ours = run_case({"mlp_offload": section(work_dirs[:2], **extra)}, tmp_path, "ours", ranks=ranks)
    for a, b in zip(ours["ranks"], stock["ranks"], strict=True):
        assert_bit_equal(a, b)
    way = profiles.sharing_choice(measured) if sharing == "auto" else sharing
    moves = []
    for rank, result in enumerate(ours["ranks"]):
        start = next(r for r in result["telemetry"] if r["event"] == "start")
        assert start["device_inflight"] == [2, 2], rank
        assert start["device_sharing"] == [way, way], rank
        steps = [r for r in result["telemetry"] if r["event"] == "step"]
        for r in steps:
            for p in r["paths"]:
                assert p["device_inflight"] == 2
                assert 1 <= p["inflight_max"] <= 2, (rank, r["step"], p)
                assert 1 <= p["node_inflight_max"] <= 2, (rank, r["step"], p)
        moves.append([r["weights_next"] for r in steps])
    assert any(m is not None for m in moves[0]), "the stale profile's split was never moved"
    assert all(m == moves[0] for m in moves), "the ranks' tuners moved differently"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"bogus": 1}, r"mlp_offload\.bogus"),
        ({"host_memory": "1K"}, r"mlp_offload\.host_memory"),
        # 3 buffers of 24 KiB chunks, all 3 asked to cache: none left to stream the other chunks through.
        ({"host_memory": "100K", "update_chunk": "24K", "cache_chunks": 3}, r"mlp_offload\.cache_chunks"),
        ({"weights": [1.0, 2.0]}, r"mlp_offload\.weights"),
        ({"paths": []}, r"mlp_offload\.paths"),
    ],
)
def test_bad_sections_are_named_before_the_first_step(
    extra: dict[str, Any], message: str, work_dirs: list[Path], tmp_path: Path
) -> None:
    case = {"mlp_offload": {**section(work_dirs[:1]), **extra}, "steps": 1}
    with pytest.raises(AssertionError, match=message):
        run_case(case, tmp_path, "bad")


TEST_TIMEOUT_S = 240


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_run_that_does_not_end_leaves_its_stacks_and_the_next_run_runs(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """A run that hangs (here: stopped mid-update) is ended after its timeout with every thread's stack in
    its log, which says where it waited; one interrupted while it waits (as pytest's own timeout does)
    takes the worker's harness server and its runs with it; either way the next run of the worker runs,
    rather than reading an answer owed to the one before."""
    import signal

    case = {
        "mlp_offload": section(work_dirs[:1], update_chunk="24K"),
        "steps": 3,
        "stall_in_update_at": 1,
        "stall_node": 0,
        "stall_marker": str(tmp_path / "stalled.rank{rank}"),
        "port": free_port(),
    }
    spec = tmp_path / "stalled.json"
    spec.write_text(json.dumps(case))
    run = HarnessRun(spec, tmp_path / "stalled.pt", tmp_path / "stalled.log", harness_env(WORLD_SIZE="1"))
    # Under the test's own timeout (pytest-timeout's, conftest.harness_deadline), a batch is given less.
    assert batch_timeout(600) <= TEST_TIMEOUT_S - DEADLINE_MARGIN_S
    assert run_harness([run], timeout=15) == [None]
    assert "in stall" in run.log.read_text(), run.log.read_text()[-4000:]

    def interrupt(signum: int, frame: Any) -> None:
        raise TimeoutError("the test's time is up")

    (tmp_path / "stalled.rank0").unlink()
    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.alarm(15)
        with pytest.raises(TimeoutError):
            run_harness([run], timeout=600)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert (tmp_path / "stalled.rank0").exists(), "the interrupted run did not reach its stall"
    ours = run_case({"mlp_offload": section(work_dirs[1:2]), "steps": 2}, tmp_path, "next")
    assert len(ours["losses"]) == 2


# What a forked run may still import: our engine's modules, which `mlp_offload.install` imports when a run
# puts our engine in (left out of the server, as a user's process imports them then), and a few dozen small
# ones DeepSpeed imports as it builds an engine: 52 in all here. A new DeepSpeed or torch that imports a
# package of hundreds of modules only once it builds an engine goes past it.
IMPORTS_PER_RUN = 150


def test_a_forked_run_imports_little_that_its_server_had_not_preloaded(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """Every run forked from the harness server starts from what the server imported once
    (`harness_server.preload`). DeepSpeed 0.19 imports torch._dynamo and torch._inductor (1,500 modules)
    only when it builds an engine: 2.5-4.5 s of every run here until the server preloaded them."""
    if not runs_are_forked():
        pytest.skip("runs start from scratch here (MLP_OFFLOAD_TEST_FORK=0, or an accelerator)")
    ours = run_case({"mlp_offload": section(work_dirs[:1]), "steps": 2}, tmp_path, "ours")
    line = next(x for x in ours["output"].splitlines() if x.startswith(IMPORTED_IN_RUN))
    count = int(line.removeprefix(IMPORTED_IN_RUN).split()[0])
    assert count <= IMPORTS_PER_RUN, f"the server's preload misses what every run imports: {line}"


def test_a_missing_path_is_named(work_dirs: list[Path], tmp_path: Path) -> None:
    missing = work_dirs[0] / "not-there"
    with pytest.raises(AssertionError, match=str(missing)):
        run_case({"mlp_offload": section([missing]), "steps": 1}, tmp_path, "missing")


@pytest.mark.parametrize(
    ("shadow_slots", "ds_case", "extra"),
    [
        pytest.param(True, {}, {}, id="shadow slots"),
        pytest.param(False, {}, {}, id="one copy (default)"),
        # The streamed chunks' new versions staged during backward (see KILLED_CASES) fail to be written.
        pytest.param(
            True,
            {"reduce_bucket_size": 20_000, "clip": 0.0},
            {"update_chunk": "24K", "overlap_backward": True},
            id="shadow slots, the update during backward",
        ),
    ],
)
def test_a_failed_write_raises_and_names_what_it_left(
    shadow_slots: bool, ds_case: dict[str, Any], extra: dict[str, Any], work_dirs: list[Path], tmp_path: Path
) -> None:
    """A step whose writes fail raises with the errno and the file. With shadow slots every object still
    reads back its last state; with one copy (the default) the store still opens, every object whose
    write did not fail reads back, and each one whose write failed is refused by name, never read wrong."""
    if os.geteuid() != 0:
        pytest.skip("chattr +i needs root")
    # Three steps, then the object files turn immutable: the fourth step's writes fail with EPERM.
    ours = section(work_dirs[:2], host_memory="deepspeed", shadow_slots=shadow_slots, **extra)
    result = run_case({**ds_case, "steps": 5, "immutable_at_step": 3, "mlp_offload": ours}, tmp_path, "fail")
    if extra.get("overlap_backward"):
        # The steps before were updated during backward, and kept; the failing one began so.
        records = [r for r in result["telemetry"] if r["event"] == "step"]
        assert len(records) == 3 and all(r["speculation"]["kept"] for r in records), records
    error = result["error"]
    assert error, "the step must raise"
    assert error["errno"] == errno.EPERM and error["filename"].endswith(".mlpo"), error
    readable = result["readable"]
    assert len(readable) > 2
    refused = {k: v for k, v in readable.items() if isinstance(v, str)}
    if shadow_slots:
        assert not refused, "every object reads back, checksums and all"
    else:
        assert refused and len(refused) < len(readable), readable
        assert all("CorruptObjectError" in v and k in v for k, v in refused.items()), refused


def test_an_earlier_runs_state_in_the_paths_is_replaced(work_dirs: list[Path], tmp_path: Path) -> None:
    # Same paths, another subgroup size: the second run starts from its own model, not the old objects.
    first = run_case({"steps": 2, "mlp_offload": section(work_dirs[:1])}, tmp_path, "first")
    second_case = {"steps": 2, "sub_group_size": 30000, "mlp_offload": section(work_dirs[:1])}
    second = run_case(second_case, tmp_path, "second")
    stock = run_case({"steps": 2, "sub_group_size": 30000}, tmp_path, "stock")
    assert_bit_equal(second, stock)
    subgroups = [
        next(r for r in x["telemetry"] if r["event"] == "start")["subgroups"] for x in (first, second)
    ]
    assert subgroups[0] > subgroups[1]
    chunks = next(r for r in second["telemetry"] if r["event"] == "start")["chunks"]
    assert len(list(work_dirs[0].rglob("subgroup*.mlpo"))) == chunks


def blkio_root() -> Path | None:
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mnt, kind, opts, *_ = line.split()
        if kind == "cgroup" and "blkio" in opts.split(","):
            return Path(mnt)
    return None


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no overlap"])
def test_reads_wait_for_slow_writes(overlap: bool, work_dirs: list[Path], tmp_path: Path) -> None:
    """Writes throttled to 2 MiB/s (reads not), every chunk written back at the end of each step
    (`cache_chunks` 0): the last writes of each step are still in flight when the next step reads those
    objects. A read that did not wait would see the old state and break the bit-for-bit equality.
    Inside `step()` the next step starts on those chunks, in their buffers; behind it (chunk order) it
    reads them last, after their writes."""
    root = blkio_root()
    if os.geteuid() != 0 or root is None or not (root / "blkio.throttle.write_bps_device").exists():
        pytest.skip("needs root and the cgroup v1 blkio throttle")
    dev = os.stat(work_dirs[0]).st_dev
    cgroup = root / f"mlp-offload-test-{os.getpid()}"
    cgroup.mkdir()
    try:
        (cgroup / "blkio.throttle.write_bps_device").write_text(
            f"{os.major(dev)}:{os.minor(dev)} {2 << 20}\n"
        )
        ours = run_case(
            # The write-behind of step() alone: without the update during backward, whose staged writes
            # of the streamed chunks would leave step() none to retain.
            {
                "mlp_offload": section(
                    work_dirs[:1],
                    host_memory="deepspeed",
                    cache_chunks=0,
                    overlap=overlap,
                    overlap_backward=False,
                )
            },
            tmp_path,
            "slow",
            cgroup=cgroup,
        )
    finally:
        for pid in (cgroup / "cgroup.procs").read_text().split():
            (root / "cgroup.procs").write_text(pid)
        cgroup.rmdir()
    stock = run_case({}, tmp_path, "stock")
    assert_bit_equal(ours, stock)
    steps = [r for r in ours["telemetry"] if r["event"] == "step"]
    assert sum(r["write_wait_secs"] for r in steps) > 0.5, "the throttle must have slowed the writes"
    if not overlap:
        assert all(r["retained"] > 0 for r in steps[1:]), "steps start on subgroups whose writes ran on"


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
    assert ours["optimizer_class"] == "mlp_offload.zero3.MLPOffloadStage3"
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
    assert ours["optimizer_class"] == "mlp_offload.zero3.MLPOffloadStage3"
    start = next(r for r in ours["telemetry"] if r["event"] == "start")
    assert start["paths"] == [str(work_dirs[0])]
    assert any((work_dirs[0] / "rank0").glob("*.mlpo"))
    assert_bit_equal(ours, stock)


@pytest.mark.parametrize(
    ("ds_case", "message"),
    [
        ({"client_optimizer": "SGD"}, r"optimizer is torch\.optim\.sgd\.SGD"),
        ({"client_optimizer": "Adagrad"}, r"optimizer is torch\.optim\.adagrad\.Adagrad"),
        ({"client_optimizer": "Adam", "client_options": {"amsgrad": True}}, r"'amsgrad'"),
        ({"offload_ratio": 0.5}, r"offload_optimizer\.ratio: 0\.5"),
        (
            {"super_offload": True},
            r"SuperOffloadOptimizer_Stage3 \(set by zero_optimization\.offload_optimizer\.super_offload",
        ),
        (
            {"offload_param": "nvme", "param_max_in_cpu": 10_000},
            r"offload_param: parameters on NVMe .* past offload_param\.max_in_cpu \(10,000 elements; "
            r"this rank's partitions hold 66,624",
        ),
        # The optimizer state in half precision: bf16 master weights (10 bytes of state per parameter), also
        # with bf16 moments (6 bytes), and fp16 master weights.
        (
            {"precision_options": {"bf16_master_weights_and_grads": True}},
            r"bf16\.bf16_master_weights_and_grads: mlp_offload does not reproduce .* set it to false",
        ),
        (
            {"precision_options": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
            r"bf16\.bf16_master_weights_and_grads and bf16\.bf16_optimizer_states: .* set them to false",
        ),
        (
            {"fp16": True, "precision_options": {"fp16_master_weights_and_grads": True}},
            r"fp16\.fp16_master_weights_and_grads: mlp_offload does not reproduce",
        ),
    ],
    ids=[
        "SGD",
        "Adagrad",
        "amsgrad",
        "partial offload ratio",
        "SuperOffload",
        "parameters on NVMe",
        "bf16 master weights",
        "bf16 master weights and moments",
        "fp16 master weights",
    ],
)
def test_what_we_do_not_honour_is_refused_by_name(
    ds_case: dict[str, Any], message: str, work_dirs: list[Path], tmp_path: Path
) -> None:
    """Optimizers whose state is not exp_avg and exp_avg_sq per element, and DeepSpeed settings the
    engine does not honour, fail at start with an error naming them, never silently."""
    case = {**ds_case, "mlp_offload": section(work_dirs[:1]), "steps": 1}
    if ds_case.get("offload_param") == "nvme":
        case["param_nvme_path"] = str(tmp_path / "params")
    with pytest.raises(AssertionError, match=message):
        run_case(case, tmp_path, "refused")


def test_a_path_that_refuses_o_direct_is_named_in_a_warning(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a ramfs needs root")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    # ramfs has no O_DIRECT (tmpfs has it since Linux 6.6): the store falls back to buffered I/O on
    # that path and says so.
    subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], check=True)
    try:
        ours = run_case({"steps": 2, "mlp_offload": section([mnt])}, tmp_path, "ramfs")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    warning = [line for line in ours["output"].splitlines() if "refuses O_DIRECT" in line]
    assert warning and str(mnt) in warning[0], ours["output"][-2000:]
    stock = run_case({"steps": 2}, tmp_path, "stock")
    assert_bit_equal(ours, stock)


@pytest.fixture(scope="module")
def stock_resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DeepSpeed's own round trip: stock saves at step 5, a stock engine resumes and, at the end, saves
    the 16-bit model (its directories under `"dir"`)."""
    d = tmp_path_factory.mktemp("stock")
    case = {"checkpoint_at": 5, "checkpoint_dir": str(d / "ckpt"), "save_16bit": str(d / "model16")}
    return {**run_case(case, d, "stock-resumed"), "dir": d}


# name, the paths ours saves on (indices into work_dirs; None: stock saves), the paths ours resumes on
# (None: stock resumes)
CHECKPOINT_CASES: list[tuple[str, list[int] | None, list[int] | None]] = [
    ("ours saves, ours resumes", [0, 1], [0, 1]),
    ("stock saves, ours resumes", None, [0, 1]),
    ("ours saves, stock resumes", [0, 1], None),
    # The job restarted on another set of tiers: the checkpoint, not the store, carries the state.
    ("ours saves on two paths, resumes on two others", [0, 1], [2, 3]),
]


@pytest.mark.parametrize(
    ("name", "saves_on", "resumes_on"), CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES]
)
def test_a_checkpoint_resumes_bit_for_bit_and_interoperates_with_deepspeed(
    name: str,
    saves_on: list[int] | None,
    resumes_on: list[int] | None,
    stock_resumed: dict[str, Any],
    work_dirs: list[Path],
    tmp_path: Path,
) -> None:
    """`engine.save_checkpoint` at step 5, a new engine from other initial weights, `load_checkpoint`,
    five more steps, `save_16bit_model`: the same state and the same 16-bit model as DeepSpeed's own
    save and resume, bit for bit; and DeepSpeed's `zero_to_fp32` reads our checkpoint as it reads its
    own. Two subgroups are cached when the checkpoint is taken, so it must include host copies newer
    than the store's."""
    dirs = [*work_dirs, work_dirs[0].parent / "path3"]
    dirs[3].mkdir(exist_ok=True)
    case: dict[str, Any] = {
        "checkpoint_at": 5,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "save_16bit": str(tmp_path / "model16"),
    }
    if saves_on is not None:
        case["mlp_offload"] = section([dirs[i] for i in saves_on], host_memory="64M", cache_chunks=2)
    if resumes_on is not None:
        case["resume_mlp_offload"] = section([dirs[i] for i in resumes_on], host_memory="64M", cache_chunks=2)
    resumed = run_case(case, tmp_path, "resumed")
    assert_bit_equal(resumed, stock_resumed)
    ours_resumes = resumes_on is not None
    expected = "mlp_offload.zero3.MLPOffloadStage3" if ours_resumes else "deepspeed.runtime.zero.stage3."
    assert resumed["optimizer_class"].startswith(expected)
    assert resumed["saved_16bit"] and stock_resumed["saved_16bit"]
    assert_same_tensors(
        torch.load(tmp_path / "model16" / "pytorch_model.bin"),
        torch.load(stock_resumed["dir"] / "model16" / "pytorch_model.bin"),
    )
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    assert_same_tensors(
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), tag="ckpt"),
        get_fp32_state_dict_from_zero_checkpoint(str(stock_resumed["dir"] / "ckpt"), tag="ckpt"),
    )


def assert_same_tensors(ours: dict[str, torch.Tensor], stock: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(stock)
    for name, tensor in stock.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


# name, the DeepSpeed side, extra section keys, where the kill comes (what the harness says as it kills),
# ranks
KILLED_CASES = [
    ("in step()", {}, {"overlap": False}, "in step()", 1),
    ("behind step(), the next forward running", {}, {"overlap": True}, "behind step()", 1),
    # DeepSpeed reduces in small buckets, so the streamed chunks are updated during backward, their new
    # versions staged beside the old ones: the kill comes while backward still runs (the harness holds
    # backward near its end until then: on a busy machine it could end before three chunks are updated,
    # which happened once with the stock runs not yet kept). No clipping
    # (DeepSpeed's default, 1.0, clips these gradients, and a clipped step's update is not tried then).
    (
        "in the update during backward",
        {"reduce_bucket_size": 20_000, "clip": 0.0},
        {"shadow_slots": True, "overlap_backward": True},
        "during backward",
        1,
    ),
    # Rank 1 of two dies there; rank 0 is ended wherever it is (its collective with rank 1 fails, or the
    # launcher kills it, as torchrun does), its own update during backward possibly half done. The
    # second slots come from the plan ("auto"), not from shadow_slots.
    (
        "rank 1 of two, in the update during backward",
        {"reduce_bucket_size": 20_000, "clip": 0.0},
        {"overlap_backward": True},
        "during backward",
        2,
    ),
]


@pytest.mark.parametrize(
    ("ds_case", "extra", "where", "ranks"), [c[1:] for c in KILLED_CASES], ids=[c[0] for c in KILLED_CASES]
)
def test_killed_in_an_update_the_job_resumes_from_its_last_checkpoint(
    ds_case: dict[str, Any],
    extra: dict[str, Any],
    where: str,
    ranks: int,
    stock_resumed: dict[str, Any],
    work_dirs: list[Path],
    tmp_path: Path,
) -> None:
    """SIGKILL in the middle of step 7's update (three chunks updated, writes in flight): inside
    `step()`, behind it while the next forward runs, or while backward runs (the update during
    backward, its versions staged), in the last rank; after a checkpoint at step 5, the job (every
    rank) resumes from that checkpoint in new processes on the same paths: the stores open (the dead
    processes' locks are gone) and steps 5 to 9 give what DeepSpeed's own resume from the same
    checkpoint gives, bit for bit, on every rank."""
    ours = section(work_dirs[:2], host_memory="64M", update_chunk="24K", cache_chunks=2, **extra)
    ckpt = str(tmp_path / "ckpt")
    killed_rank = ranks - 1
    killed = {
        "save_at": 5,
        "sigkill_in_update_at": 7,
        "sigkill_rank": killed_rank,
        "hold_backward": where == "during backward",
        "checkpoint_dir": ckpt,
        "mlp_offload": ours,
    }
    with pytest.raises(AssertionError, match=r"killed rank \d failed") as failed:
        run_case({**ds_case, **killed}, tmp_path, "killed", ranks=ranks)
    log = (tmp_path / f"killed.rank{killed_rank}.log").read_text()
    assert f"killed {where}" in log, (str(failed.value)[-2000:], log[-2000:])
    resumed = run_case(
        {**ds_case, "resume_at": 5, "checkpoint_dir": ckpt, "mlp_offload": ours},
        tmp_path,
        "resumed",
        ranks=ranks,
    )
    if ds_case or ranks > 1:
        stock_ckpt = str(tmp_path / "stock-ckpt")
        stock_case = {**ds_case, "checkpoint_at": 5, "checkpoint_dir": stock_ckpt}
        stock_resumed = run_case(stock_case, tmp_path, "stock-resumed", ranks=ranks)
    for ours_rank, stock_rank in zip(
        resumed.get("ranks", [resumed]), stock_resumed.get("ranks", [stock_resumed]), strict=True
    ):
        assert_bit_equal(ours_rank, from_step(stock_rank, 5))
    if extra.get("overlap_backward"):
        # The resumed job updates during backward again, and keeps what it did.
        for rank in resumed.get("ranks", [resumed]):
            steps = [r for r in rank["telemetry"] if r["event"] == "step"]
            assert all(r["speculation"]["kept"] for r in steps), steps
            assert sum(r["speculation"]["in_backward"] for r in steps) > 0, steps


FAULTFS = Path(__file__).with_name("faultfs.py")


@pytest.fixture
def faulty_path(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A path through `faultfs.py` (FUSE) whose reads or writes fail with EIO on demand, or which
    disappears when its process is killed."""
    if not Path("/dev/fuse").exists() or importlib.util.find_spec("mfusepy") is None:
        pytest.skip("needs /dev/fuse and mfusepy (libfuse)")
    backing, mount = tmp_path / "backing", tmp_path / "faulty"
    backing.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(FAULTFS), str(backing), str(mount)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "mounted", "the FUSE file system did not mount"
        yield {"backing": backing, "mount": mount, "pid": proc.pid}
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        subprocess.run(["fusermount3", "-u", "-z", str(mount)], check=False, capture_output=True)


# name, how the fault comes, the errno the step must name
FAULTS = [
    ("EIO on writes", ".fail-writes", {errno.EIO}),
    ("EIO on reads", ".fail-reads", {errno.EIO}),
    # A request the kernel had already handed to the dead FUSE process ends with ECONNABORTED; one made
    # after the connection is gone, with ENOTCONN. Which comes first depends on timing.
    ("the path disappears", None, {errno.ENOTCONN, errno.ECONNABORTED}),
]


# When the update runs: inside step() (the DeepSpeed side, extra section keys), or the streamed chunks'
# during backward (small reduce buckets, no clipping: see KILLED_CASES).
WHEN = [
    pytest.param({}, {}, id="in step()"),
    pytest.param(
        {"reduce_bucket_size": 20_000, "clip": 0.0},
        {"shadow_slots": True, "overlap_backward": True},
        id="during backward",
    ),
]


@pytest.mark.parametrize(("ds_case", "extra"), WHEN)
@pytest.mark.parametrize(("switch", "errnos"), [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
def test_a_failing_path_stops_the_step_naming_it_and_the_job_resumes_on_the_other(
    switch: str | None,
    errnos: set[int],
    ds_case: dict[str, Any],
    extra: dict[str, Any],
    faulty_path: dict[str, Any],
    stock_resumed: dict[str, Any],
    work_dirs: list[Path],
    tmp_path: Path,
) -> None:
    """Two paths, the second of which fails for real from step 7 (its reads or writes give EIO, or it
    disappears: ENOTCONN or ECONNABORTED), after a checkpoint at step 5, the state streaming through a
    small budget, updated in `step()` or during backward.
    Step 7 raises an `OSError` with that errno and an object's file on the failing path (or, for the
    writes still in flight when step 7 returned, step 8 does). A new process resumes from the checkpoint
    on the path that is left and trains steps 5 to 9 as DeepSpeed's own resume does, bit for bit."""
    failing = faulty_path["mount"]
    ckpt = str(tmp_path / "ckpt")
    both = section([work_dirs[0], failing], host_memory="200K", update_chunk="24K", **extra)
    fault = {"switch": str(faulty_path["backing"] / switch)} if switch else {"kill": faulty_path["pid"]}
    failed = run_case(
        {**ds_case, "save_at": 5, "fault_at": 7, "fault": fault, "checkpoint_dir": ckpt, "mlp_offload": both},
        tmp_path,
        "failed",
    )
    error = failed["error"]
    assert error, f"no step raised in {failed['steps']} steps"
    assert error["errno"] in errnos, error
    assert error["filename"].startswith(str(failing)) and error["filename"].endswith(".mlpo"), error
    left = section([work_dirs[0]], host_memory="200K", update_chunk="24K", **extra)
    resumed = run_case(
        {**ds_case, "resume_at": 5, "checkpoint_dir": ckpt, "mlp_offload": left}, tmp_path, "resumed"
    )
    if ds_case:
        stock_case = {**ds_case, "checkpoint_at": 5, "checkpoint_dir": str(tmp_path / "stock-ckpt")}
        stock_resumed = run_case(stock_case, tmp_path, "stock-resumed")
    assert_bit_equal(resumed, from_step(stock_resumed, 5))


@pytest.fixture
def filling_path(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs: a path that can be filled up for real."""
    yield from mounted_tmpfs(tmp_path / "filling", "64m")


def test_a_path_that_fills_up_mid_run_costs_no_step_and_the_manifest_names_it(
    filling_path: Path, stock_resumed: dict[str, Any], work_dirs: list[Path], tmp_path: Path
) -> None:
    """Another job takes every free block of the second path before step 3. Every object's blocks were
    reserved when it was created, so rewrites need none: training goes on bit-equal to DeepSpeed's
    uninterrupted run, and a checkpoint is saved at step 5. Only the store's manifest needs a new block
    when it changes: `destroy()` raises ENOSPC naming the manifest on the full path (the first path's,
    written first, is whole and current), and the store still opens. A new process resumes from the
    checkpoint on the same, still full, paths, bit-equal to DeepSpeed's own resume."""
    ckpt = str(tmp_path / "ckpt")
    both = section([work_dirs[0], filling_path], host_memory="200K", update_chunk="24K")
    full = run_case(
        {"fill_at": 3, "fill": str(filling_path), "save_at": 5, "checkpoint_dir": ckpt, "mlp_offload": both},
        tmp_path,
        "full",
    )
    assert_bit_equal(full, run_case({}, tmp_path, "stock"))
    error = full["destroy_error"]
    assert error["errno"] == errno.ENOSPC, error
    assert error["filename"].startswith(str(filling_path)) and "manifest" in error["filename"], error
    assert full["store_keys_after_destroy"], "the store opened empty"
    resumed = run_case({"resume_at": 5, "checkpoint_dir": ckpt, "mlp_offload": both}, tmp_path, "resumed")
    assert_bit_equal(resumed, from_step(stock_resumed, 5))
    assert resumed["destroy_error"]["errno"] == errno.ENOSPC, resumed["destroy_error"]


# name, the case's DeepSpeed side, `load_checkpoint` options
PARTIAL_LOADS = [
    ("load_module_only", {}, {"load_module_only": True}),
    ("load_optimizer_states=False", {}, {"load_optimizer_states": False}),
    ("load_lr_scheduler_states=False", {"scheduler": WARMUP}, {"load_lr_scheduler_states": False}),
    # A checkpoint of the model's weights only: DeepSpeed widens them into fp32, moments zero.
    ("no ZeRO optimizer files, load_module_only", {"drop_zero_files": True}, {"load_module_only": True}),
]


@pytest.mark.parametrize(
    ("ds_case", "options"), [p[1:] for p in PARTIAL_LOADS], ids=[p[0] for p in PARTIAL_LOADS]
)
def test_partial_checkpoint_loads_match_deepspeed(
    ds_case: dict[str, Any], options: dict[str, Any], work_dirs: list[Path], tmp_path: Path
) -> None:
    """A checkpoint loaded in part (the rest from the new engine's own start), saved and loaded by ours,
    gives what DeepSpeed gives doing the same, bit for bit."""
    ours = section(work_dirs[:2], host_memory="64M", cache_chunks=2)

    def case(name: str) -> dict[str, Any]:
        return {
            **ds_case,
            "checkpoint_at": 5,
            "checkpoint_dir": str(tmp_path / name),
            "load_options": options,
        }

    stock = run_case(case("stock"), tmp_path, "stock")
    resumed = run_case({**case("ours"), "mlp_offload": ours, "resume_mlp_offload": ours}, tmp_path, "ours")
    assert_bit_equal(resumed, stock)


def test_a_long_run_holds_memory_files_and_threads_flat(work_dirs: list[Path], tmp_path: Path) -> None:
    """500 steps streaming chunks through two paths (reads and writes every step): after
    the first 50, resident memory grows by less than 1% (allocator noise) and the open files and threads
    do not change, and the boundary's norms widen into the same scratch every step (allocated anew,
    its page faults and its freeing cost a step more than the norms themselves). Samples, not timings."""
    ours = section(work_dirs[:2], host_memory="200K", update_chunk="24K")
    result = run_case({"steps": 500, "sample_resources": True, "mlp_offload": ours}, tmp_path, "soak")
    samples = result["samples"][50:]
    assert {s["fds"] for s in samples} == {samples[0]["fds"]}, "open files changed"
    assert {s["threads"] for s in samples} == {samples[0]["threads"]}, "threads changed"
    scratches = {s["norm_scratch"] for s in samples}
    assert len(scratches) == 1 and 0 not in scratches, f"the norms' scratch changed or went: {scratches}"
    early = max(s["rss"] for s in samples[:50])
    late = max(s["rss"] for s in samples[-50:])
    assert late <= early * 1.01, f"resident memory grew from {early / 2**20:.1f} to {late / 2**20:.1f} MiB"


@ONE_NODE
def test_two_ranks_loading_a_checkpoint_one_after_another_match_deepspeed(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """`pipeline_loading_checkpoint`: rank 1 loads only once rank 0 has loaded and told it (DeepSpeed's
    `load_serial`, run by DeepSpeed's own code around ours). Two ranks save at step 5, resume, and end
    where DeepSpeed's two ranks doing the same end, bit for bit."""
    ours = section(work_dirs[:2], host_memory="64M", cache_chunks=2)

    def case(name: str) -> dict[str, Any]:
        return {"checkpoint_at": 5, "checkpoint_dir": str(tmp_path / name), "pipeline_loading": True}

    stock = run_case(case("stock"), tmp_path, "stock", ranks=2)
    resumed = run_case(
        {**case("ours"), "mlp_offload": ours, "resume_mlp_offload": ours}, tmp_path, "ours", ranks=2
    )
    for rank, (a, b) in enumerate(zip(resumed["ranks"], stock["ranks"], strict=True)):
        assert a["optimizer_class"] == "mlp_offload.zero3.MLPOffloadStage3", rank
        assert_bit_equal(a, b)


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


def test_a_checkpoint_without_zero_files_fails_as_in_stock_naming_the_file(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """Loaded in full, a checkpoint whose ZeRO optimizer files are gone fails in DeepSpeed 0.19.8 itself
    with FileNotFoundError naming the missing file; ours fails the same way, before touching the store."""
    ours = section(work_dirs[:2], host_memory="64M")
    for name, extra in (("stock", {}), ("ours", {"mlp_offload": ours, "resume_mlp_offload": ours})):
        case = {"checkpoint_at": 5, "checkpoint_dir": str(tmp_path / name), "drop_zero_files": True, **extra}
        with pytest.raises(AssertionError, match=r"No such file or directory: .*optim_states\.pt"):
            run_case(case, tmp_path, name)
