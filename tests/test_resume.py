"""A job resumed from its checkpoint in a new process, as a user restarts one: after a save at step 3 (or
a kill -9 after it), a new process loads the checkpoint and trains steps 3 to 7, bit-equal to stock
DeepSpeed's resume from its own checkpoint. The rows cover the factors below pairwise (each pair of
values meets in at least one row, `test_the_resume_matrix_covers_every_pair_of_factors`), starting from
the README's section on a model built on `nn.MultiheadAttention`."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import ONE_NODE
from deepspeed_runs import assert_bit_equal, run_case, stock_resume

SAVE_AT = 3
# Where a killed row's run dies: the step after the checkpoint it resumes from.
KILL_AT = 4

# Each factor and its values. `overlap` and `overlap_backward` as the section sets them ("auto": the key
# left out, as in the README's section); `state`: every chunk cached (the default budget) or the state
# streamed through a small one; `params`: DeepSpeed's default persistence threshold (every parameter of
# these small models held whole between uses) or 0 (each gathered for each use); `model`: see
# `zero3_harness.build_model`; `accumulation`: two micro-steps per step and clipping at 0.05 (DeepSpeed's
# default of 1.0 otherwise); `kill`: where the run before the resume dies (None: it saves and ends).
FACTORS: dict[str, list[Any]] = {
    "overlap": ["auto", True, False],
    "overlap_backward": ["auto", True, False],
    "state": ["cached", "streamed"],
    "params": ["persistent", "gathered"],
    "model": ["attention", "llama"],
    "ranks": [1, 2],
    "accumulation": [False, True],
    "kill": [None, "in step()", "behind step()", "during backward", "in a save"],
}


def overlap_on(row: dict[str, Any]) -> bool:
    """Whether the update runs behind the next forward: `true`, or "auto" where every chunk is cached."""
    return row["overlap"] is True or (row["overlap"] == "auto" and row["state"] == "cached")


def possible(row: dict[str, Any]) -> bool:
    """Whether the row's kill can come where it says: in step() only without the update behind it, behind
    step() only with it, during backward only where chunks are taken there (`true`, and no clipping,
    after which the update during backward is not tried)."""
    kill = row["kill"]
    if kill == "in step()":
        return not overlap_on(row)
    if kill == "behind step()":
        return overlap_on(row)
    if kill == "during backward":
        return row["overlap_backward"] is True and not row["accumulation"]
    return True


FIELDS = list(FACTORS)
# The rows, a value per factor in FIELDS' order. The first is the README's section on the model that
# crashed at the second step after a load (DeepSpeed's fetch trace, `_mlp_persistent_left_to_the_forward`).
ROWS: list[tuple[Any, ...]] = [
    ("auto", "auto", "cached", "persistent", "attention", 1, False, None),
    (True, True, "streamed", "gathered", "llama", 1, True, "behind step()"),
    (False, False, "cached", "gathered", "attention", 2, True, "in step()"),
    ("auto", False, "streamed", "persistent", "llama", 2, False, "in a save"),
    (True, True, "cached", "persistent", "attention", 2, False, "during backward"),
    (False, "auto", "streamed", "persistent", "llama", 1, False, "in step()"),
    ("auto", "auto", "cached", "gathered", "attention", 1, True, "in a save"),
    (True, False, "streamed", "persistent", "attention", 1, True, None),
    (False, True, "cached", "gathered", "llama", 2, False, None),
    ("auto", "auto", "cached", "persistent", "attention", 2, False, "behind step()"),
    ("auto", True, "streamed", "gathered", "llama", 1, False, "during backward"),
    ("auto", True, "streamed", "persistent", "attention", 1, False, "in step()"),
    (True, "auto", "cached", "persistent", "attention", 1, False, "in a save"),
    (False, True, "cached", "persistent", "attention", 1, False, "in a save"),
    ("auto", False, "cached", "persistent", "attention", 1, False, "behind step()"),
    (False, True, "cached", "persistent", "attention", 1, False, "during backward"),
]
MATRIX = [dict(zip(FIELDS, row, strict=True)) for row in ROWS]


def row_id(row: dict[str, Any]) -> str:
    keys = [f"{key}={row[key]}" for key in ("overlap", "overlap_backward") if row[key] != "auto"]
    section = ", ".join(keys) or "the README's section"
    accumulation = ", accumulation 2 and clipping" if row["accumulation"] else ""
    kill = f", killed {row['kill']}" if row["kill"] else ""
    return (
        f"{section}, {row['state']}, {row['params']}, {row['model']}, {row['ranks']} rank(s)"
        f"{accumulation}{kill}"
    )


def pairs(row: dict[str, Any]) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    return {((a, repr(row[a])), (b, repr(row[b]))) for a, b in itertools.combinations(FIELDS, 2)}


def test_the_resume_matrix_covers_every_pair_of_factors() -> None:
    """Every pair of values that some possible row has meets in a row of the matrix, and every row of it
    is possible."""
    every = [dict(zip(FIELDS, values, strict=True)) for values in itertools.product(*FACTORS.values())]
    wanted = set().union(*(pairs(row) for row in every if possible(row)))
    covered = set().union(*(pairs(row) for row in MATRIX))
    assert wanted <= covered, sorted(wanted - covered)
    assert all(possible(row) for row in MATRIX), [row_id(row) for row in MATRIX if not possible(row)]


def deepspeed_side(row: dict[str, Any]) -> dict[str, Any]:
    """The row's harness case without our section: the model, DeepSpeed's settings and the steps."""
    case: dict[str, Any] = {"model": row["model"], "steps": SAVE_AT + 5}
    if row["params"] == "gathered":
        case["persistence_threshold"] = 0
    if row["accumulation"]:
        case.update(grad_accum=2, clip=0.05)
    if row["kill"] == "during backward":
        # Small reduce buckets, so chunks' gradients are final before backward ends, and no clipping
        # (DeepSpeed's default clips these gradients, and a clipped step's update during backward is
        # not tried).
        case.update(reduce_bucket_size=20_000, clip=0.0)
    return case


def our_section(row: dict[str, Any], paths: list[Path]) -> dict[str, Any]:
    """The README's section (`paths` alone) with what the row changes."""
    section: dict[str, Any] = {"paths": [str(p) for p in paths]}
    section.update({key: row[key] for key in ("overlap", "overlap_backward") if row[key] != "auto"})
    if row["state"] == "streamed":
        section.update(host_memory="200K", update_chunk="24K")
    if row["kill"] == "during backward":
        # Chunks of 2,048 elements: enough of them final before backward's end for the kill to come
        # after three (a subgroup each, by default, where every chunk is cached: four of them).
        section["update_chunk"] = "24K"
    return section


def run_until_the_restart(row: dict[str, Any], case: dict[str, Any], tmp_path: Path) -> None:
    """Ours trains and saves at step 3; a row with a kill goes on and dies where it says, in its last rank
    (the others ended as a launcher ends them)."""
    ranks = row["ranks"]
    if row["kill"] is None:
        run_case({**case, "steps": SAVE_AT + 1, "save_at": SAVE_AT}, tmp_path, "saves", ranks=ranks)
        return
    killed_rank = ranks - 1
    kill = {"sigkill_rank": killed_rank, "save_at": SAVE_AT}
    if row["kill"] == "in a save":
        kill["sigkill_in_save_at"] = KILL_AT
    else:
        kill.update(sigkill_in_update_at=KILL_AT, hold_backward=row["kill"] == "during backward")
    with pytest.raises(AssertionError, match=r"killed rank \d failed") as failed:
        run_case({**case, **kill}, tmp_path, "killed", ranks=ranks)
    log = (tmp_path / f"killed.rank{killed_rank}.log").read_text()
    assert f"killed {row['kill']}" in log, (str(failed.value)[-2000:], log[-2000:])


@pytest.mark.deepspeed
@pytest.mark.parametrize(
    "row",
    [pytest.param(row, marks=[ONE_NODE] if row["ranks"] > 1 else []) for row in MATRIX],
    ids=[row_id(row) for row in MATRIX],
)
def test_a_job_restarted_from_its_checkpoint_trains_on_as_stock_resumes(
    row: dict[str, Any], probed_paths: Callable[[int], list[Path]], tmp_path: Path
) -> None:
    """The row's run saves at step 3 (and dies where the row says, after it); a new process on the same
    paths loads the checkpoint and trains steps 3 to 7: every step's loss and gradient norm, and the
    final fp32 weights, moments and half-precision partitions equal stock DeepSpeed's resume from its
    own checkpoint, on every rank. The update runs behind the forward where the row says it does."""
    ds_case = deepspeed_side(row)
    ckpt = str(tmp_path / "ckpt")
    section = our_section(row, probed_paths(row["ranks"]))
    case = {**ds_case, "checkpoint_dir": ckpt, "mlp_offload": section}
    run_until_the_restart(row, case, tmp_path)
    resumed = run_case({**case, "resume_at": SAVE_AT}, tmp_path, "resumed", ranks=row["ranks"])
    stock = stock_resume(ds_case, SAVE_AT, row["ranks"], tmp_path)
    for ours, theirs in zip(resumed.get("ranks", [resumed]), stock, strict=True):
        assert_bit_equal(ours, theirs)
        start = next(r for r in ours["telemetry"] if r["event"] == "start")
        assert start["overlap"]["on"] == overlap_on(row), start["overlap"]
        if row["overlap_backward"] != "auto":
            assert start["overlap_backward"]["on"] == row["overlap_backward"], start["overlap_backward"]


# name, who saves, who resumes: stock DeepSpeed, or ours with the README's section
ACROSS = [
    ("stock saves, ours resumes", "stock", "ours"),
    ("ours saves, stock resumes", "ours", "stock"),
]


@pytest.mark.deepspeed
@pytest.mark.parametrize(("saves", "resumes"), [c[1:] for c in ACROSS], ids=[c[0] for c in ACROSS])
def test_a_checkpoint_resumes_across_stock_and_ours_in_a_new_process(
    saves: str, resumes: str, probed_paths: Callable[[int], list[Path]], tmp_path: Path
) -> None:
    """On the model built on `nn.MultiheadAttention`, with the README's section: a checkpoint that stock
    DeepSpeed saved at step 3, resumed by ours in a new process, and one ours saved, resumed by stock:
    steps 3 to 7 bit-equal to stock's resume from its own checkpoint."""
    ds_case = {"model": "attention", "steps": SAVE_AT + 5}
    engines = {"stock": {}, "ours": {"mlp_offload": {"paths": [str(p) for p in probed_paths(1)]}}}
    ckpt = {"checkpoint_dir": str(tmp_path / "ckpt")}
    saving = {**ds_case, **ckpt, "steps": SAVE_AT + 1, "save_at": SAVE_AT, **engines[saves]}
    run_case(saving, tmp_path, "saves")
    resuming = {**ds_case, **ckpt, "resume_at": SAVE_AT, **engines[resumes]}
    resumed = run_case(resuming, tmp_path, "resumed")
    engine = "mlp_offload.adapter.zero3." if resumes == "ours" else "deepspeed.runtime.zero.stage3."
    assert resumed["optimizer_class"].startswith(engine), resumed["optimizer_class"]
    assert_bit_equal(resumed, stock_resume(ds_case, SAVE_AT, 1, tmp_path)[0])
