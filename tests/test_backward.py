"""The update during backward (`overlap_backward`), inside real DeepSpeed ZeRO-3: kept where the step's
outcome is the one it assumed, undone otherwise, bit for bit stock DeepSpeed's either way; what is read
between backward and step is the model before the step."""

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
from mlp_offload.adapter import overlap_backward
from mlp_offload.engine import planning, telemetry

# A budget that caches every chunk of these rows' model and leaves room for a kept copy of each; one
# slot per chunk on disk (none is added: the chunks are staged in memory).
EVERY_CHUNK_CACHED = {"host_memory": "8M", "shadow_slots": False}

# The first step of the loss spike in the row whose steps leave chunk order.
SPIKE = 3

# ZeRO-Infinity: subgroups past `offload_param.max_in_cpu`, their partitions on NVMe. The 20M GPT's
# partitions of 1 MiB and more are objects of the parameters' store (chunks of a few MiB, streamed), the
# tiny GPT's are in host memory each on its own. Stock's side has them in host memory (the same bits).
ON_NVME = {"offload_param": "nvme", "param_max_in_cpu": 1_000_000}
ON_NVME_20M = {**ON_NVME, "model": "gpt-20M", "sub_group_size": 2_000_000, "steps": 5}
ON_NVME_20M_KEYS = {"host_memory": "150M", "update_chunk": "auto"}


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
    # Every step clipped: the update during backward is never tried, so the plan never weighs chunk
    # order, whose smaller cache would cost I/O every step for nothing.
    (
        "as the plan chooses, every step clipped",
        {"clip": 0.05},
        {"shadow_slots": False, "overlap_backward": "auto"},
        "never tried",
        1,
    ),
    # Clipped from the fourth step on (a loss spike): after three clipped steps in a row the plan leaves
    # chunk order, and the whole cache comes back.
    (
        "as the plan chooses, clipped from the fourth step",
        {"clip": 50.0, "loss_spike_from": SPIKE, "loss_spike": 1000.0, "steps": 8},
        {"shadow_slots": False, "overlap_backward": "auto"},
        "back to the cache's order",
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
    # The parameters on NVMe: each subgroup's partitions are written as its chunks are updated (in
    # place: undone, they are written again from the weights before), while the backward fetches others.
    ("parameters on NVMe: kept every step", {**ON_NVME_20M, "fp32": True}, ON_NVME_20M_KEYS, "kept", 1),
    (
        "parameters on NVMe: clipping, stopped by the norms so far, undone",
        {**ON_NVME_20M, "fp32": True, "clip": 0.05},
        ON_NVME_20M_KEYS,
        "clipping",
        1,
    ),
    (
        "parameters past max_in_cpu in host memory on their own, two ranks, accumulation 2",
        {**ON_NVME, "param_max_in_cpu": 10_000, "grad_accum": 2},
        {},
        "kept",
        2,
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
    dirs_with_room: list[Path],
    tmp_path: Path,
) -> None:
    """Each chunk updated as its gradient is final and staged; `step()` keeps it where the outcome is the
    one assumed (no overflow, no clipping, the same hyperparameters), else undoes it, as does anything
    that reads the state or parameters before `step()`: every row bit-equal to stock DeepSpeed, on every
    rank."""
    # No clipping (DeepSpeed's default clips at 1.0, which these gradients pass) unless the row asks.
    case = {"reduce_bucket_size": 20_000, "steps": 6, "clip": 0.0, **ds_case}
    stock_case, case = on_each_side(case, tmp_path)
    stock = run_case(stock_side(stock_case), tmp_path, "stock", ranks=ranks)
    keys = {"host_memory": "200K", "update_chunk": "24K", "shadow_slots": True, "overlap_backward": True}
    mlp = section(dirs_with_room[:2], **{**keys, **extra})
    ours = run_case({**case, "mlp_offload": mlp}, tmp_path, "ours", ranks=ranks)
    for a, b in zip(ours.get("ranks", [ours]), stock.get("ranks", [stock]), strict=True):
        assert_bit_equal(a, b)
        check_backward_records(a, outcome, case["steps"])
        if case.get("offload_param") == "nvme":
            check_partitions_on_nvme(a, objects=case.get("model") == "gpt-20M")
        if (at := case.get("set_params_apart_at")) is not None:
            # Chunks with parameters set apart were taken before the step undid them.
            records = [r for r in a["telemetry"] if r["event"] in ("step", "skipped")]
            assert records[at]["overlap_backward"]["chunks"] > 0, records[at]


def on_each_side(case: dict[str, Any], tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A row's case for stock's run and for ours: with the parameters on NVMe (`ON_NVME`), stock's are in
    host memory (the same bits, and no async I/O op needed), ours under the test's folder."""
    if case.get("offload_param") != "nvme":
        return case, case
    return {**case, "offload_param": "cpu"}, {**case, "param_nvme_path": str(tmp_path / "nvme")}


def check_partitions_on_nvme(ours: dict[str, Any], objects: bool) -> None:
    """Subgroups were on NVMe every step, and (`objects`) their partitions written to the store's objects
    as their chunks were updated, during backward where it was kept."""
    start = next(r for r in ours["telemetry"] if r["event"] == "start")
    assert start["subgroups_on_nvme"] > 0, start
    steps = [r for r in ours["telemetry"] if r["event"] == "step"]
    assert all(r["params_on_nvme"]["subgroups"] == start["subgroups_on_nvme"] for r in steps), steps
    if objects:
        assert start["params_on_nvme_bytes"] > 0, start
        assert all(r["params_on_nvme"]["written_bytes"] > 0 for r in steps), steps


def check_backward_records(ours: dict[str, Any], outcome: str, steps: int) -> None:
    """What each step's record says of the update during backward, against the row's `outcome`."""
    start = next(r for r in ours["telemetry"] if r["event"] == "start")
    assert start["overlap_backward"]["on"], start["overlap_backward"]
    records = [r for r in ours["telemetry"] if r["event"] in ("step", "skipped")]
    assert len(records) == steps
    # Every record, and each one it holds, has the keys `engine.telemetry` documents.
    assert [m for r in ours["telemetry"] for m in telemetry.mismatches(r)] == []
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
    if what == "never tried":
        check_never_tried_records(start, records)
        return
    if what == "back to the cache's order":
        check_back_to_the_cache_order(start, records)
        return
    # Every streamed chunk has its second slot from the start.
    assert start["overlap_backward"]["slotted_chunks"] >= streamed, start["overlap_backward"]
    undone = []
    for step, r in enumerate(records):
        spec = r["overlap_backward"]
        if spec is not None and spec["why"].startswith("not tried"):
            # After a step whose gradients were clipped, until one that is not.
            previous = records[step - 1]["overlap_backward"]["why"]
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
    assert what == "clipping" or sum(r["overlap_backward"]["in_backward"] for r in records) > 0


def check_chunk_secs(spec: dict[str, Any]) -> None:
    """A boundary's measure of what a chunk took during its backward: from the chunks that ended before
    backward did, when there were enough of them."""
    if spec["in_backward"] < planning.CHUNK_TIMES_NEEDED:
        assert spec["chunk_secs"] is None, spec
    else:
        assert spec["chunk_secs"] > 0.0, spec


def check_planned_records(start: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """`overlap_backward: "auto"`: nothing at the first boundary (the plan waits for its gradients'
    times), nor until the plan has an update's time to weigh chunk order by and finds it pays (at once
    where the cache loses nothing to it); then the chunks the plan chose, each with the second slot it
    was given then (and no other chunk), kept every step; the rest updated in `step()`."""
    assert start["overlap_backward"]["slotted_chunks"] == 0, start["overlap_backward"]
    whys = [r["overlap_backward"]["why"] for r in records]
    assert whys[0] == "not tried: the plan waits for one boundary's gradient times", whys
    tried = [step for step, why in enumerate(whys) if not why.startswith("not tried")]
    assert tried, whys
    first = tried[0]
    # Then, until it is tried: without a probe profile the first update's time comes from the first
    # step; after that only what the plan found of the last boundary's times (which a loaded machine
    # moves) holds it back: chunk order not paying, or no chunk that would begin before backward ends.
    in_order_from_start = records[0]["overlap_backward"]["chunk_order"]
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
        spec = r["overlap_backward"]
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
    assert sum(r["overlap_backward"]["in_backward"] for r in records) > 0


def check_never_tried_records(start: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """`overlap_backward: "auto"` with every step clipped: never tried, the steps never in chunk order,
    and the whole cache kept every step."""
    assert start["chunks"] > start["cached_chunks"], start
    for step, r in enumerate(records):
        spec = r["overlap_backward"]
        assert spec["why"].startswith("not tried") and spec["chunks"] == 0, (step, spec)
        assert not spec["chunk_order"], (step, spec)
        assert spec["chunk_order_why"] == "not weighed: this step's gradients were clipped", (step, spec)
        assert step == 0 or r["cached"] == start["cached_chunks"], (step, r)


def check_back_to_the_cache_order(start: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """`overlap_backward: "auto"`, the steps clipped from the fourth on (`SPIKE`): in chunk order before,
    and at the last of `CLIPPED_STEPS_BACK` clipped steps in a row the cache's order again, whose next
    step finds the whole cache."""
    back = SPIKE + overlap_backward.CLIPPED_STEPS_BACK - 1
    assert back == len(records) - 3, "the row's steps end two steps after the way back"
    whys = [r["overlap_backward"]["why"] for r in records]
    assert all(w == "not tried: the last step's gradients were clipped" for w in whys[SPIKE + 1 :]), whys
    order = [r["overlap_backward"]["chunk_order"] for r in records]
    assert order[SPIKE - 1 :] == [True] * (back - SPIKE + 1) + [False] * 3, order
    steps = overlap_backward.CLIPPED_STEPS_BACK
    why = records[back]["overlap_backward"]["chunk_order_why"]
    assert why == f"back to the cache's order: {steps} steps in a row clipped", why
    assert records[back]["cached"] < start["cached_chunks"], records[back]
    assert [r["cached"] for r in records[back + 1 :]] == [start["cached_chunks"]] * 2, records


# name, the DeepSpeed side, ranks
BEFORE_STEP = [
    # One rank: DeepSpeed's "gather" makes a parameter's data its partition, which the update during
    # backward writes before step(); a persistent parameter (all of this model's, by DeepSpeed's
    # default threshold) stays so between uses.
    ("one rank, every parameter held whole", {}, {}, 1),
    ("one rank, each parameter gathered for its use", {"persistence_threshold": 0}, {}, 1),
    ("two ranks, every parameter held whole", {}, {}, 2),
    # The gathers read the partitions' objects, which the update wrote: undone, they are written again
    # before any is read.
    (
        "parameters on NVMe, each gathered for its use",
        {**ON_NVME_20M, "fp32": True, "persistence_threshold": 0, "steps": 5},
        ON_NVME_20M_KEYS,
        1,
    ),
]


@pytest.mark.parametrize(
    ("ds_case", "extra", "ranks"),
    [pytest.param(*c[1:], marks=[ONE_NODE] if c[3] > 1 else []) for c in BEFORE_STEP],
    ids=[c[0] for c in BEFORE_STEP],
)
def test_what_is_read_between_backward_and_step_is_the_model_before_the_step(
    ds_case: dict[str, Any], extra: dict[str, Any], ranks: int, work_dirs: list[Path], tmp_path: Path
) -> None:
    """Between backward and step 3, with chunks already updated during backward: the parameters' data
    as they are, an eval pass, and every parameter gathered see the model before the step, as stock's
    do, bit for bit; training goes on bit-equal. (With one rank the parameters held whole showed the
    update's values before.)"""
    case = {"reduce_bucket_size": 20_000, "clip": 0.0, "steps": 6, "read_before_step_at": 3, **ds_case}
    stock_case, case = on_each_side(case, tmp_path)
    stock = run_case(stock_case, tmp_path, "stock", ranks=ranks)
    keys = {"host_memory": "200K", "update_chunk": "24K", "overlap_backward": True, **extra}
    ours = run_case({**case, "mlp_offload": section(work_dirs[:2], **keys)}, tmp_path, "ours", ranks=ranks)
    for rank, (a, b) in enumerate(zip(ours.get("ranks", [ours]), stock.get("ranks", [stock]), strict=True)):
        assert_bit_equal(a, b)
        (x,), (y,) = a["before_step"], b["before_step"]
        assert torch.equal(x["held"], y["held"]), rank
        assert x["eval_loss"] == y["eval_loss"], rank
        assert torch.equal(x["gathered"], y["gathered"]), rank
        specs = [r["overlap_backward"] for r in a["telemetry"] if r["event"] == "step"]
        # Chunks were taken before the reads; the gathered read undid them (step() had not decided).
        read_at = specs[3]
        assert read_at["chunks"] > 0 and read_at["why"] == "parameters were gathered before step()", read_at
        assert all(s["kept"] and s["chunks"] > 0 for k, s in enumerate(specs) if k != 3), specs
