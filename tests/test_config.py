"""The `mlp_offload` section and the one-line migration from DeepSpeed's NVMe offload section."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import pytest

from mlp_offload.common import config_reference
from mlp_offload.common.config import MLPOffloadConfig, from_ds_config, migrate_nvme_offload


class OffloadDeviceEnum(str, enum.Enum):  # noqa: UP042 (DeepSpeed's shape: a StrEnum's str() is its value)
    """The shape of DeepSpeed's (`deepspeed.runtime.zero.offload_config`), without importing DeepSpeed."""

    nvme = "nvme"


NVME = {
    "device": "nvme",
    "nvme_path": "/nvme0/ds",
    "buffer_count": 6,
    "pin_memory": False,
    "pipeline_read": True,
}


def config(offload: dict[str, Any], section: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": offload}, **extra}
    if section is not None:
        ds["mlp_offload"] = section
    return ds


# name, DeepSpeed config, the offload section and our section after migration (None: unchanged)
MIGRATIONS = [
    (
        "paths default to nvme_path; NVMe-only keys go",
        config(NVME, {}),
        {"device": "cpu", "buffer_count": 6, "pin_memory": False},
        {"paths": ["/nvme0/ds"]},
    ),
    (
        "our paths win; aio maps to chunk_size and max_inflight",
        config(NVME, {"paths": ["/a", "/b"]}, aio={"block_size": 1 << 20, "queue_depth": 32}),
        {"device": "cpu", "buffer_count": 6, "pin_memory": False},
        {"paths": ["/a", "/b"], "chunk_size": 1 << 20, "max_inflight": 32},
    ),
    (
        "our max_inflight wins over aio's",
        config(NVME, {"max_inflight": 4}, aio={"queue_depth": 32}),
        {"device": "cpu", "buffer_count": 6, "pin_memory": False},
        {"paths": ["/nvme0/ds"], "max_inflight": 4},
    ),
    (
        # DeepSpeed's own tests (and code) write the device as its enum, a str whose str() is its name.
        "the device as DeepSpeed's OffloadDeviceEnum",
        config({"device": OffloadDeviceEnum.nvme, "nvme_path": "/nvme0/ds"}, {}),
        {"device": "cpu"},
        {"paths": ["/nvme0/ds"]},
    ),
    ("a CPU offload config stays as it is", config({"device": "cpu"}, {"paths": ["/a"]}), None, None),
    ("without our section DeepSpeed's NVMe offload stays", config(NVME, None), None, None),
]


@pytest.mark.parametrize(("name", "ds", "offload", "section"), MIGRATIONS, ids=[m[0] for m in MIGRATIONS])
def test_nvme_offload_configs_migrate(
    name: str, ds: dict[str, Any], offload: dict[str, Any] | None, section: dict[str, Any] | None
) -> None:
    before = repr(ds)
    migrated = migrate_nvme_offload(ds)
    assert repr(ds) == before, "the caller's config is not changed"
    if offload is None:
        assert migrated == ds
        return
    assert migrated["zero_optimization"]["offload_optimizer"] == offload
    assert migrated["mlp_offload"] == section


def test_nvme_offload_without_any_path_is_named() -> None:
    ds = config({"device": "nvme"}, {})
    with pytest.raises(ValueError, match=r"mlp_offload\.paths.*offload_optimizer\.nvme_path"):
        migrate_nvme_offload(ds)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"path_locality": ["shared"]}, r"mlp_offload\.path_locality: 1 values for 2 paths"),
        ({"path_locality": ["node-local", "remote"]}, r"mlp_offload\.path_locality\.1"),
        ({"path_locality": "yes"}, r"mlp_offload\.path_locality"),
        ({"weights": [1.0]}, r"mlp_offload\.weights: 1 values for 2 paths"),
    ],
)
def test_per_path_keys_name_themselves(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_ds_config({"mlp_offload": {"paths": ["/a", "/b"], **section}})


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"update_threads": 0}, r"mlp_offload\.update_threads"),
        ({"update_threads": "all"}, r"mlp_offload\.update_threads"),
        ({"update_threads": 2.5}, r"mlp_offload\.update_threads"),
        ({"update_threads": True}, r"mlp_offload\.update_threads"),
    ],
)
def test_bad_values_name_their_key(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_ds_config({"mlp_offload": {"paths": ["/a"], **section}})


def test_path_locality_is_per_path() -> None:
    section = {"paths": ["/a", "/b"], "path_locality": ["node-local", "shared"]}
    parsed = from_ds_config({"mlp_offload": section})
    assert parsed is not None and parsed.path_locality == ["node-local", "shared"]


def test_the_config_page_is_the_code() -> None:
    """docs/config.md is what `MLPOffloadConfig` says: every key, its type, default and docstring."""
    page = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    assert page.read_text() == config_reference.markdown(), (
        "docs/config.md differs from MLPOffloadConfig: `make docs-pages`"
    )


def test_every_key_has_one_line_and_a_type() -> None:
    """Each key's docstring opens with its one line, and its type reads as words (none is left as
    Python's own repr)."""
    docs = config_reference.field_docs()
    for name, info in MLPOffloadConfig.model_fields.items():
        assert docs[name].split("\n\n", 1)[0].endswith("."), name
        assert "typing" not in config_reference.field_type_words(info), name
