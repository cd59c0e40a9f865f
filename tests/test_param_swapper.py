"""The parameters' partitions on NVMe (`offload_param.device: "nvme"`) as objects of our store, behind
DeepSpeed's parameter swapper (`mlp_offload.adapter.param_swapper`): its protocol on real files, and a
model whose partitions go to NVMe trained bit-equal to stock, without DeepSpeed's async I/O op."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from deepspeed_runs import AIO_BUILT, assert_bit_equal, run_case, section
from mlp_offload import _core
from mlp_offload.adapter.param_swapper import PARAMS_FOLDER, StoreParamSwapper, swapper_class

pytestmark = pytest.mark.deepspeed


def ds_config(paths: list[Path], nvme_path: Path | None = None, **aio: int) -> Any:
    from deepspeed.runtime.config import DeepSpeedConfig

    offload = {"device": "nvme", "nvme_path": str(nvme_path or paths[0])}
    return DeepSpeedConfig(
        {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "offload_param": offload},
            "aio": aio,
            "mlp_offload": section(paths),
        }
    )


def partition(ds_id: int, numel: int) -> Any:
    """A parameter as the swapper sees one: its id and its partition, not yet on NVMe."""
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus

    tensor = torch.empty(0)
    tensor.ds_numel = numel  # type: ignore[attr-defined]
    tensor.status = PartitionedParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
    return SimpleNamespace(ds_id=ds_id, ds_tensor=tensor)


def written(swapper: StoreParamSwapper, param: Any, values: torch.Tensor) -> None:
    """As `zero.Init` writes a partition: into the swapper's buffer, then out."""
    swapper.get_buffer(param, values.numel()).copy_(values)
    param.ds_tensor.data = swapper.buffers[param.ds_id].data
    swapper.swap_out_and_release([param])


@pytest.fixture
def swapper(work_dirs: list[Path]) -> StoreParamSwapper:
    return StoreParamSwapper(ds_config(work_dirs[:2]), torch.bfloat16, rank=0)


def test_a_partition_goes_to_the_store_and_back_with_deepspeeds_statuses(swapper: StoreParamSwapper) -> None:
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus as Status

    values = [torch.randn(n).to(torch.bfloat16) for n in (600_000, 700_001)]
    params = [partition(i, v.numel()) for i, v in enumerate(values)]
    for param, v in zip(params, values, strict=True):
        written(swapper, param, v)
        assert param.ds_tensor.status == Status.NOT_AVAILABLE and param.ds_tensor.numel() == 1
    assert sorted(swapper.store.keys()) == ["param0", "param1"] and not swapper.buffers
    swapper.swap_in(params, async_op=True)
    assert [p.ds_tensor.status for p in params] == [Status.INFLIGHT] * 2
    with pytest.raises(RuntimeError, match="parameter 0: read asked for while its partition is"):
        swapper.swap_in(params[:1])
    swapper.synchronize_reads()
    for param, v in zip(params, values, strict=True):
        assert param.ds_tensor.status == Status.AVAILABLE and torch.equal(param.ds_tensor, v)
        # Page-aligned, so the store reads it with O_DIRECT.
        assert param.ds_tensor.data_ptr() % 4096 == 0
    swapper.remove_partition_and_release_buffers(params)
    assert not swapper.buffers and params[0].ds_tensor.status == Status.NOT_AVAILABLE
    # Read into DeepSpeed's own flat buffer, where it stays available.
    flat = torch.zeros(values[0].numel() + 8, dtype=torch.bfloat16)
    swapper.swap_into_buffer(params[0], flat.narrow(0, 8, values[0].numel()))
    assert torch.equal(flat[8:], values[0]) and params[0].ds_tensor.status == Status.AVAILABLE


def test_a_subgroups_update_is_written_rounded_as_torch_rounds(swapper: StoreParamSwapper) -> None:
    """`swap_out_partitioned_params`: fp32 masters rounded to nearest even into the objects."""
    master = torch.randn(600_000) * 1e3
    master[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40])
    param = partition(7, master.numel())
    written(swapper, param, torch.zeros(master.numel(), dtype=torch.bfloat16))
    swapper.reserve_partitioned_swap_space([master.numel()])
    swapper.swap_out_partitioned_params([param], [master])
    swapper.swap_in([param], async_op=False)
    assert torch.equal(param.ds_tensor.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))


def test_a_corrupt_partition_is_an_error_naming_its_object(
    swapper: StoreParamSwapper, work_dirs: list[Path]
) -> None:
    param = partition(3, 800_000)
    written(swapper, param, torch.ones(800_000, dtype=torch.bfloat16))
    files = sorted((work_dirs[0] / PARAMS_FOLDER / "rank0").glob("param3*"))
    assert files, list((work_dirs[0] / PARAMS_FOLDER).rglob("*"))
    with files[0].open("r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    swapper.swap_in([param])
    with pytest.raises(_core.CorruptObjectError, match="param3"):
        swapper.synchronize_reads()


def test_what_only_deepspeeds_nvme_optimizer_asks_is_refused_saying_why(swapper: StoreParamSwapper) -> None:
    with pytest.raises(RuntimeError, match="parameter 5: its partition is object param5 of mlp_offload's"):
        swapper.get_path(partition(5, 10))
    with pytest.raises(
        RuntimeError, match=r"offload_optimizer\.device nvme reads the parameters' swap files"
    ):
        swapper.reserve_available_buffers()


@pytest.mark.parametrize(
    ("block_size", "dtype", "swapped", "kept"),
    [(1 << 20, torch.bfloat16, 1 << 19, (1 << 19) - 1), (4 << 20, torch.float32, 1 << 20, (1 << 20) - 1)],
    ids=["1 MiB of bf16", "aio.block_size of 4 MiB, fp32"],
)
def test_which_partitions_go_to_nvme_is_deepspeeds_rule(
    block_size: int, dtype: torch.dtype, swapped: int, kept: int, work_dirs: list[Path]
) -> None:
    swapper = StoreParamSwapper(ds_config(work_dirs[:1], block_size=block_size), dtype, rank=0)
    assert swapper.swappable_tensor(numel=swapped) and not swapper.swappable_tensor(numel=kept)


def test_ours_is_built_for_our_section_alone(work_dirs: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed import comm

    monkeypatch.setattr(comm, "get_rank", lambda: 0)
    built: list[torch.dtype] = []

    def stock(config: Any, dtype: torch.dtype) -> str:
        built.append(dtype)
        return "stock's"

    build = swapper_class(stock)
    config = ds_config(work_dirs[:1])
    assert isinstance(build(config, torch.float32), StoreParamSwapper)
    del config._param_dict["mlp_offload"]
    assert build(config, torch.float16) == "stock's" and built == [torch.float16]


def test_a_model_with_partitions_on_nvme_trains_bit_equal_to_stock(
    work_dirs: list[Path], tmp_path: Path
) -> None:
    """The 20M GPT (partitions of 1 MiB and more, which go to NVMe), its parameters on NVMe within
    `max_in_cpu`: ours writes them to the store at `zero.Init` and reads them into DeepSpeed's flat buffer,
    bit-equal to stock (its own NVMe offload where DeepSpeed's async I/O op is built, else its CPU
    offload, which agrees with it bit for bit), without the op and without writing `nvme_path`."""
    case = {"model": "gpt-20M", "fp32": True, "steps": 2, "offload_param": "nvme"}
    nvme_path, stocks = tmp_path / "nvme", tmp_path / "stock-nvme"
    nvme_path.mkdir()
    stocks.mkdir()
    stock_case = {**case, "param_nvme_path": str(stocks)} if AIO_BUILT else {**case, "offload_param": "cpu"}
    stock = run_case(stock_case, tmp_path, "stock")
    ours_case = {**case, "param_nvme_path": str(nvme_path), "mlp_offload": section(work_dirs[:2])}
    ours = run_case(ours_case, tmp_path, "ours")
    assert_bit_equal(ours, stock)
    assert ours["param_swappers"] == ["StoreParamSwapper"] and not ours["async_io_loaded"]
    assert not any(nvme_path.rglob("*.swp")) and (not AIO_BUILT or any(stocks.rglob("*.swp")))
    folders = [p / PARAMS_FOLDER / "rank0" for p in work_dirs[:2]]
    assert [f for folder in folders for f in folder.iterdir() if f.name.startswith("param")]
