"""The coupling to DeepSpeed made loud: the DeepSpeed code the engine mirrors, overrides or calls is still
the code it was tested with, and an untested DeepSpeed says what differs."""

from __future__ import annotations

import warnings

import deepspeed
import pytest

import mlp_offload
from mlp_offload.adapter import compat
from mlp_offload.adapter.troubleshooting import met
from mlp_offload.adapter.zero3 import MLPOffloadStage3

STAGE3 = compat.STAGE3


def test_the_deepspeed_code_the_engine_relies_on_is_the_code_it_was_tested_with() -> None:
    # Run on every DeepSpeed: a release that changes any of them fails here, naming each.
    differ = compat.differences(MLPOffloadStage3)
    assert not differ, (
        f"DeepSpeed {deepspeed.__version__} differs from the fingerprints in mlp_offload/adapter/compat.py "
        "in "
        + ", ".join(f"{name} ({why})" for name, why in sorted(differ.items()))
        + ": review the engine against each, then regenerate the table with "
        "`python -m mlp_offload.adapter.compat`"
    )


def test_every_overridden_method_and_every_call_is_fingerprinted() -> None:
    coupled = set(compat.coupled_functions(MLPOffloadStage3))
    for name in ("step", "_create_fp32_partitions", "_rigid_load_state_dict", "_restore_from_bit16_weights"):
        assert f"{STAGE3}.{name}" in coupled
    # Touches the fp32 partitions we replace, without being overridden or called by us.
    assert f"{STAGE3}.set_full_hp_param" in coupled
    assert set(compat.CALLED) <= coupled
    assert coupled == set(compat.fingerprints())


# name, the installed DeepSpeed's version, fingerprints changed as {name: digest} (None: removed from
# the table), what the warning says (None: no warning)
VERSION_CASES = [
    ("a tested version: silent", "0.19.8", {}, None),
    (
        "an untested patch release, same code",
        "0.19.9",
        {},
        ["tested with DeepSpeed 0.19.8; this is 0.19.9", "none of the DeepSpeed code"],
    ),
    (
        "an untested release whose step changed",
        "0.19.9",
        {f"{STAGE3}.step": "0" * 16},
        ["this is 0.19.9", "runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.step (changed)"],
    ),
    (
        "a fingerprinted function gone, a coupled one new",
        "0.19.10",
        {"deepspeed.runtime.utils.retired_helper": "1" * 16, f"{STAGE3}.unscale_and_clip_grads": None},
        [
            "runtime.utils.retired_helper (gone)",
            "DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads (newly coupled)",
        ],
    ),
]


@pytest.mark.parametrize(
    ("version", "changes", "says"), [c[1:] for c in VERSION_CASES], ids=[c[0] for c in VERSION_CASES]
)
def test_an_untested_deepspeed_warns_once_naming_what_differs(
    monkeypatch: pytest.MonkeyPatch, version: str, changes: dict[str, str | None], says: list[str] | None
) -> None:
    table = {owner: dict(members) for owner, members in compat.FINGERPRINTS.items()}
    for name, digest in changes.items():
        owner, member = name.rsplit(".", 1)
        if digest is None:
            table[owner].pop(member)
        else:
            table.setdefault(owner, {})[member] = digest
    monkeypatch.setattr(compat, "FINGERPRINTS", table)
    monkeypatch.setattr(compat, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.check_deepspeed(version, MLPOffloadStage3)
        compat.check_deepspeed(version, MLPOffloadStage3)
    found = [w for w in caught if issubclass(w.category, compat.DeepSpeedVersionWarning)]
    if says is None:
        assert not found
        return
    assert len(found) == 1, "one warning per process"
    for text in says:
        assert text in str(found[0].message)
    assert met("deepspeed-version", str(found[0].message)), found[0].message


def test_another_deepspeed_series_is_refused_naming_the_tested_versions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    with pytest.raises(
        RuntimeError, match=r"supports DeepSpeed 0\.19\.x \(tested with 0\.19\.8\); this is 0\.20\.1"
    ):
        mlp_offload.install()
