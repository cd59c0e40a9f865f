"""Megatron-DeepSpeed, the MLP-Offload artifact's harness: its own `pretrain_gpt.py` started as a user
starts it (`torch.distributed.run`), stock, then with `mlp_offload.install()` and our section, each row
bit-equal to stock (every iteration's loss, gradient norm and skip; every parameter's bf16 weights,
master weights and Adam moments, gathered after training).

The tree, its fixes and its data: `tests/support/megatron_tree.py`."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import megatron_tree
from deepspeed_runs import assert_bit_equal, keep, stock_cache
from megatron_tree import (
    GPT2,
    HARNESS,
    ITERATIONS,
    LLAMA,
    SNAPSHOT,
    ds_config,
    ours_config,
    prepare,
    pretrain_args,
    run_megatron,
)

pytestmark = [
    # On one worker: one tree and data set, each stock run and checkpoint made once for every row.
    pytest.mark.xdist_group("megatron"),
    pytest.mark.skipif(not SNAPSHOT.exists(), reason=f"Megatron-DeepSpeed's snapshot is absent: {SNAPSHOT}"),
]


@pytest.fixture(scope="session")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tree and data set of this session (`megatron_tree.prepare`)."""
    return prepare(tmp_path_factory.mktemp("megatron"))


def stock_run(
    megatron: dict[str, Path],
    tmp_path: Path,
    args: list[str],
    config: dict[str, Any],
    ranks: int,
    saving: list[str],
) -> list[dict[str, Any]]:
    """Stock's run of a row, once per configuration and code (`deepspeed_runs.stock_cache`, keyed here by
    the arguments, the config, the harness, the tree's preparation and fixes, and the snapshot too). A run
    made here adds `saving`'s arguments, which change nothing in its records (a kept run saves nothing)."""
    code = HARNESS.read_bytes() + Path(megatron_tree.__file__).read_bytes() + SNAPSHOT.name.encode()
    digest = hashlib.sha256(code).hexdigest()
    kept = stock_cache({"megatron": pretrain_args(args), "config": config, "harness": digest}, ranks)
    if kept is not None and kept.exists():
        return torch.load(kept, weights_only=False)
    results = run_megatron(megatron, tmp_path / "stock", [*args, *saving], config, ranks, False, forked=True)
    if kept is not None:
        keep(results, kept)
    return results


SAVE_AT = ITERATIONS // 2
SAVED_TAG = f"global_step{SAVE_AT}"  # DeepSpeed's name for the checkpoint at SAVE_AT
RESUMED = [*LLAMA, "--global-batch-size", "2"]


class Checkpoints:
    """Megatron's `--save` at iteration `SAVE_AT`, by stock or ours on the README's section: each made once
    for this module, by the first row's runs, which go on to the end, or where they did not save (a kept
    stock run, a row not selected) by a run that `--exit-interval` ends there; and stock's resume of
    stock's, the reference each resume is compared with."""

    def __init__(self, megatron: dict[str, Path], root: Path) -> None:
        self.megatron, self.root = megatron, root
        self.reference: list[dict[str, Any]] | None = None

    def config(self, who: str, paths: list[Path]) -> dict[str, Any]:
        config = ds_config(2, 1, 1, 0.0)
        return ours_config(config, "readme", paths) if who == "ours" else config

    def saving(self, who: str) -> list[str]:
        """The arguments that make a run of `RESUMED` save `who`'s checkpoints for this module."""
        return ["--save", str(self.root / f"{who}-saves"), "--save-interval", str(SAVE_AT)]

    def saved_by(self, who: str, paths: list[Path]) -> Path:
        saved = self.root / f"{who}-saves"
        if not (saved / SAVED_TAG).exists():
            args = [*RESUMED, *self.saving(who), "--exit-interval", str(SAVE_AT)]
            run_dir = self.root / f"{who}-saves-run"
            run_megatron(
                self.megatron, run_dir, args, self.config(who, paths), 1, who == "ours", False, forked=True
            )
        return saved

    def resume(self, who: str, saver: str, paths: list[Path], run_dir: Path) -> list[dict[str, Any]]:
        """`who`'s resume at `SAVE_AT` (`--load-tag`: the first row's runs saved the end too)."""
        saved = self.saved_by(saver, paths)
        args = [*RESUMED, "--load", str(saved), "--load-tag", SAVED_TAG]
        config = self.config(who, paths)
        return run_megatron(self.megatron, run_dir, args, config, 1, who == "ours", forked=True)

    def stocks_resume(self, paths: list[Path]) -> list[dict[str, Any]]:
        if self.reference is None:
            self.reference = self.resume("stock", "stock", paths, self.root / "stock-resumes-stock")
        return self.reference


@pytest.fixture(scope="module")
def checkpoints(megatron: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(megatron, tmp_path_factory.mktemp("megatron-checkpoints"))


# DeepSpeed 0.19's 10-byte state: bf16 master weights and gradients. (Its 6-byte state, bf16 moments
# too, needs a CPU Adam built with `fp32_optimizer_states=False`, which Megatron's `--cpu-optimizer` does
# not build: stock refuses it at start, as ours does.)
BF16_WEIGHTS = {"bf16_master_weights_and_grads": True}

ROWS = [
    # (id, style, ranks, accumulation, clip, DeepSpeed's "bf16" options, our config, saves: the run's
    # checkpoints are the resume rows')
    ("the artifact's llama style, 1 rank", LLAMA, 1, 1, 0.0, {}, "readme", True),
    ("GPT-2 style, tied head, 1 rank", GPT2, 1, 1, 0.0, {}, "readme", False),
    ("llama style, 2 ranks, clipping and accumulation 2", LLAMA, 2, 2, 1.0, {}, "readme", False),
    # Two things in one row, for time (a run less): the migration config, and the 10-byte state.
    (
        "llama style, bf16 master weights, the NVMe config plus {}",
        LLAMA,
        1,
        1,
        0.0,
        BF16_WEIGHTS,
        "nvme",
        False,
    ),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("style", "ranks", "accumulation", "clip", "bf16", "how", "saves"),
    [r[1:] for r in ROWS],
    ids=[r[0] for r in ROWS],
)
def test_pretrain_gpt_with_our_section_is_bit_equal_to_stock(
    megatron: dict[str, Path],
    probed_paths: Callable[[int], list[Path]],
    checkpoints: Checkpoints,
    tmp_path: Path,
    style: list[str],
    ranks: int,
    accumulation: int,
    clip: float,
    bf16: dict[str, bool],
    how: str,
    saves: bool,
) -> None:
    """Stock's `pretrain_gpt.py` (the optimizer offloaded to the CPU) against the same with `install()`
    and our section, on every rank: the same iterations' losses, gradient norms and skips, and the same
    gathered state."""
    args = [*style, "--global-batch-size", str(2 * accumulation * ranks)]
    config = ds_config(2, accumulation, ranks, clip)
    config["bf16"].update(bf16)
    # The row that saves makes the resumes' checkpoints: it runs what they resume.
    resumed = args == RESUMED and config == checkpoints.config("stock", []) and how == "readme"
    assert resumed or not saves, "the row that saves does not run what the resumes resume"
    stock = stock_run(megatron, tmp_path, args, config, ranks, checkpoints.saving("stock") if saves else [])
    paths = probed_paths(ranks) if how == "readme" else [tmp_path / "nvme"]
    paths[0].mkdir(exist_ok=True)
    ours_args = [*args, *(checkpoints.saving("ours") if saves else [])]
    ours_run = ours_config(config, how, paths)
    ours = run_megatron(megatron, tmp_path / "ours", ours_args, ours_run, ranks, True, forked=True)
    assert any((paths[0] / "rank0").glob("*.mlpo")), "our store is not on the first path"
    assert len(stock[0]["losses"]) == ITERATIONS
    master = torch.bfloat16 if bf16.get("bf16_master_weights_and_grads") else torch.float32
    assert {p["fp32"].dtype for p in stock[0]["state"].values()} == {master}, "not the row's master weights"
    for a, b in zip(ours, stock, strict=True):
        assert_bit_equal(a, b)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("saver", "resumer"),
    [("ours", "ours"), ("stock", "ours"), ("ours", "stock")],
    ids=["ours saves, ours resumes", "stock saves, ours resumes", "ours saves, stock resumes"],
)
def test_megatrons_save_and_load_in_a_new_process_resume_as_stock_resumes(
    checkpoints: Checkpoints,
    probed_paths: Callable[[int], list[Path]],
    tmp_path: Path,
    saver: str,
    resumer: str,
) -> None:
    """Megatron's own `--save` at iteration 4 and `--load` in a new process, stock and ours crossed, each
    resume bit-equal to stock's resume of stock's checkpoint (stock's CPU Adam recomputes its bias
    corrections in a new process, so its resumed run is the reference, not its uninterrupted one)."""
    paths = probed_paths(1)
    resumed = checkpoints.resume(resumer, saver, paths, tmp_path / "resume")
    reference = checkpoints.stocks_resume(paths)
    assert len(reference[0]["losses"]) == ITERATIONS - SAVE_AT
    assert_bit_equal(resumed[0], reference[0])
