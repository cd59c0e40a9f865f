"""What the engine does not honour fails at start, naming it: bad sections, DeepSpeed settings and
optimizers it does not reproduce bit for bit, a missing path; a path that refuses O_DIRECT is named in a
warning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deepspeed_runs import (
    STATE_MODES,
    assert_bit_equal,
    run_case,
    section,
)
from mlp_offload.adapter.troubleshooting import met


@pytest.mark.parametrize(
    ("extra", "message", "entry"),
    [
        ({"bogus": 1}, r"mlp_offload\.bogus", "section-key"),
        ({"host_memory": "1K"}, r"mlp_offload\.host_memory", "host-memory"),
        # 3 buffers of 24 KiB chunks, all 3 asked to cache: none left to stream the other chunks through.
        (
            {"host_memory": "100K", "update_chunk": "24K", "cache_chunks": 3},
            r"mlp_offload\.cache_chunks",
            "host-memory",
        ),
        ({"weights": [1.0, 2.0]}, r"mlp_offload\.weights", "section-key"),
        ({"paths": []}, r"mlp_offload\.paths", "section-key"),
    ],
)
def test_bad_sections_are_named_before_the_first_step(
    extra: dict[str, Any], message: str, entry: str, work_dirs: list[Path], tmp_path: Path
) -> None:
    """Each named as troubleshooting's entry says (`docs/troubleshooting.md`)."""
    case = {"mlp_offload": {**section(work_dirs[:1]), **extra}, "steps": 1}
    with pytest.raises(AssertionError, match=message) as e:
        run_case(case, tmp_path, "bad")
    assert met(entry, str(e.value)), str(e.value)[-2000:]


@pytest.mark.parametrize(
    ("ds_side", "extra"),
    [
        # DeepSpeed's master weights in fp32: the parameters hold them narrowed.
        ({}, {}),
        # In bf16, but the update during backward asked for: its undo needs them apart.
        (STATE_MODES["bf16 weights and moments"][0], {"overlap_backward": True}),
    ],
    ids=["fp32 master weights", "overlap_backward true"],
)
def test_master_in_params_true_where_it_cannot_be_is_named(
    ds_side: dict[str, Any], extra: dict[str, Any], work_dirs: list[Path], tmp_path: Path
) -> None:
    case = {**ds_side, "mlp_offload": section(work_dirs[:1], master_in_params=True, **extra), "steps": 1}
    with pytest.raises(AssertionError, match=r"mlp_offload\.master_in_params: true, but") as e:
        run_case(case, tmp_path, "bad")
    assert met("master-in-params", str(e.value)), str(e.value)[-2000:]


def test_a_missing_path_is_named(work_dirs: list[Path], tmp_path: Path) -> None:
    missing = work_dirs[0] / "not-there"
    with pytest.raises(AssertionError, match=str(missing)) as e:
        run_case({"mlp_offload": section([missing]), "steps": 1}, tmp_path, "missing")
    assert met("missing-path", str(e.value)), str(e.value)[-2000:]


@pytest.mark.parametrize(
    ("ds_case", "message"),
    [
        ({"client_optimizer": "SGD"}, r"optimizer is torch\.optim\.sgd\.SGD"),
        ({"client_optimizer": "Adagrad"}, r"optimizer is torch\.optim\.adagrad\.Adagrad"),
        ({"client_optimizer": "Adam", "client_options": {"amsgrad": True}}, r"'amsgrad'"),
    ],
    ids=["SGD", "Adagrad", "amsgrad"],
)
def test_what_we_do_not_honour_is_refused_by_name(
    ds_case: dict[str, Any], message: str, work_dirs: list[Path], tmp_path: Path
) -> None:
    """Optimizers whose state is not exp_avg and exp_avg_sq per element fail at start with an error
    naming them, never silently. Each DeepSpeed option is a row of `test_options.py`; an overlap set to
    true with parameters on NVMe past `max_in_cpu`, a row of `test_params_on_nvme.py`."""
    case = {**ds_case, "mlp_offload": section(work_dirs[:1]), "steps": 1}
    with pytest.raises(AssertionError, match=message):
        run_case(case, tmp_path, "refused")


def test_a_path_that_refuses_o_direct_is_named_in_a_warning(tmp_path: Path, ramfs: Path) -> None:
    # ramfs has no O_DIRECT: the store falls back to buffered I/O on that path and says so.
    mnt = ramfs
    ours = run_case({"steps": 2, "mlp_offload": section([mnt])}, tmp_path, "ramfs")
    warning = [line for line in ours["output"].splitlines() if met("o-direct-refused", line)]
    assert warning and str(mnt) in warning[0], ours["output"][-2000:]
    stock = run_case({"steps": 2}, tmp_path, "stock")
    assert_bit_equal(ours, stock)
