"""The fused update kernel against DeepSpeed's CPU Adam itself (its JIT-built op on this CPU) with torch's
conversions around it, as the engine's DeepSpeed path runs them: every size's vector tail, every
hyperparameter mode, a run of steps with repeats and a jump, gradients with infinities, NaN and
subnormals, bf16, fp16 and fp32."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mlp_offload import _core
from mlp_offload.engine import fused_update
from mlp_offload.engine.state_dtypes import FP32_STATE, StateDtypes

# DeepSpeed builds its CPU Adam just in time, once, into target/ (as the harness's runs do).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parent.parent / "target" / "torch_extensions")
)
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

from deepspeed.ops.adam import DeepSpeedCPUAdam

from mlp_offload.adapter import kernel_check

# Sizes: within one vector, every tail length of a 16-wide build, several vectors, a chunk's worth.
SIZES = [1, 5, 15, 16, 17, 31, 33, 127, 128, 129, 1000, 4096 + 13]
# Adam steps of the calls, in order: repeats (the chunks of one subgroup), the next ones, a jump.
STEPS = [1, 1, 2, 3, 3, 4, 9, 10]
# name, optimizer settings
MODES = [
    ("AdamW with decay", {"adamw_mode": True, "weight_decay": 0.01}),
    ("Adam with L2 decay", {"adamw_mode": False, "weight_decay": 0.01}),
    ("no decay", {"adamw_mode": True, "weight_decay": 0.0}),
    ("negative decay is none", {"adamw_mode": True, "weight_decay": -0.1}),
    ("no bias correction", {"adamw_mode": True, "weight_decay": 0.01, "bias_correction": False}),
    ("other betas and eps", {"adamw_mode": True, "weight_decay": 0.01, "betas": (0.8, 0.95), "eps": 1e-6}),
]
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The state in half precision: DeepSpeed's master weights (and gradients, and the partition) in the
# dtype, its moments in fp32 or in that dtype too (`fp32_optimizer_states` off).
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
STATE_DTYPES = {
    "fp32 state": None,
    "bf16 weights": StateDtypes(BF16, FP32),
    "bf16 weights and moments": StateDtypes(BF16, BF16),
    "fp16 weights": StateDtypes(FP16, FP32),
    "fp16 weights and moments": StateDtypes(FP16, FP16),
}


def optimizer(**settings: Any) -> Any:
    param = torch.nn.Parameter(torch.zeros(4))
    return DeepSpeedCPUAdam([param], lr=1e-3, **settings)


def inputs(
    n: int, dtype: torch.dtype, generator: torch.Generator, specials: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    state = torch.empty(3 * n)
    state[:n] = torch.randn(n, generator=generator) * 0.05
    state[n : 2 * n] = torch.randn(n, generator=generator) * 1e-3
    state[2 * n :] = torch.rand(n, generator=generator) * 1e-6
    grad = torch.randn(n, generator=generator) * 1e-2
    if specials:
        values = torch.tensor(
            [float("inf"), float("-inf"), float("nan"), 1e-40, -2e-41, 0.0, -0.0, 6e-8, 1e4]
        )
        picks = torch.randint(0, 7, (n,), generator=generator) == 0
        grad[picks] = values[torch.randint(0, len(values), (int(picks.sum()),), generator=generator)]
        state[2 * n :][torch.randint(0, 11, (n,), generator=generator) == 0] = 1e-42
    return state, grad.to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: the same bits, or both NaN (x86 takes a NaN operand's payload by instruction form,
    which each compiler chooses)."""
    bits = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return (a.view(bits) == b.view(bits)) | (a.isnan() & b.isnan())


@pytest.mark.parametrize("half", list(HALF))
@pytest.mark.parametrize(("name", "settings"), MODES, ids=[m[0] for m in MODES])
def test_every_element_is_deepspeeds(name: str, settings: dict[str, Any], half: str) -> None:
    dtype = HALF[half]
    ds = optimizer(**settings)
    fused, why = kernel_check.self_check(ds, dtype, dtype)
    assert fused is not None, why
    _run_beside_deepspeed(ds, fused, dtype, None, f"{name}, {half}")


@pytest.mark.parametrize("dtypes", list(STATE_DTYPES)[1:])
@pytest.mark.parametrize(("name", "settings"), MODES, ids=[m[0] for m in MODES])
def test_every_element_of_a_state_in_half_precision_is_deepspeeds(
    name: str, settings: dict[str, Any], dtypes: str
) -> None:
    state_dtypes = STATE_DTYPES[dtypes]
    assert state_dtypes is not None
    dtype = state_dtypes.master
    ds = optimizer(**settings, fp32_optimizer_states=state_dtypes.moments == FP32)
    fused, why = kernel_check.self_check(ds, dtype, dtype, dtypes=state_dtypes)
    assert fused is not None, why
    _run_beside_deepspeed(ds, fused, dtype, state_dtypes, f"{name}, {dtypes}")


def _run_beside_deepspeed(
    ds: Any,
    fused: fused_update.FusedAdam,
    dtype: torch.dtype,
    state_dtypes: StateDtypes | None,
    what: str,
) -> None:
    """Calls of every size at `STEPS` through DeepSpeed's kernel (its optimizer's op and id) and ours, in
    step: every output the same bits. `state_dtypes`: the state in half precision (None: fp32)."""
    group = ds.param_groups[0]
    beta1, beta2 = group["betas"]
    record = fused_update.adam_group(group, fused.adamw)
    generator = torch.Generator().manual_seed(7)
    # Two kernels in step: DeepSpeed's own (through the optimizer's op and id) and ours.
    for call, step in enumerate(STEPS):
        for n in SIZES:
            state, grad = inputs(n, dtype, generator, specials=call % 2 == 1)
            scale = 1.0 / (1.0 + call)
            master, moments = (
                (FP32, FP32) if state_dtypes is None else (state_dtypes.master, state_dtypes.moments)
            )
            state[:n] = state[:n].to(master).float()
            state[n:] = state[n:].to(moments).float()
            # DeepSpeed's path: the gradient into the master weights' dtype, unscaled there, CPU Adam on
            # tensors of the state's dtypes, the master weights copied into the partition.
            grad_master = torch.empty(n, dtype=master)
            grad_master.copy_(grad)
            grad_master.mul_(scale)
            p = state[:n].to(master, copy=True)
            m, v = (state[k * n : (k + 1) * n].to(moments, copy=True) for k in (1, 2))
            ds.ds_opt_adam.adam_update(
                ds.opt_id, step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                group["bias_correction"], p, grad_master, m, v,
            )  # fmt: skip
            theirs = torch.cat([p.float(), m.float(), v.float()])
            their_params = torch.empty(n, dtype=dtype)
            their_params.copy_(p)
            # Ours on the state laid out as the engine keeps it (`fused.stored`: the dtypes' own bytes).
            packed = fused.stored.pack(state)
            our_params = torch.empty(n, dtype=dtype)
            fused.update(packed, grad, our_params, grad_scale=scale, step=step, group=record)
            ours = fused.stored.unpack(packed, n)
            for name, a, b in (("state", ours, theirs), ("params", our_params, their_params)):
                agree = same(a, b)
                assert bool(agree.all()), (
                    f"{what}, step {step}, {n} elements: {name}[{int((~agree).nonzero()[0])}] differs"
                )


def test_the_check_names_what_it_cannot_fuse() -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    torch_adam = torch.optim.AdamW([param])
    fused, why = kernel_check.self_check(torch_adam, torch.bfloat16, torch.bfloat16)
    assert fused is None and "AdamW" in why
    assert kernel_check.choose_update_kernel("auto", torch_adam, torch.bfloat16, torch.bfloat16)[0] is None
    with pytest.raises(ValueError, match=r"mlp_offload\.update_kernel.*AdamW"):
        kernel_check.choose_update_kernel("fused", torch_adam, torch.bfloat16, torch.bfloat16)
    fused, why = kernel_check.choose_update_kernel("deepspeed", optimizer(), torch.bfloat16, torch.bfloat16)
    assert fused is None and why == "configured"
    # The state in half precision runs on the fused pass only.
    half_state = StateDtypes(BF16, FP32)
    with pytest.raises(ValueError, match=r'update_kernel: "deepspeed" runs on fp32 state only.*"auto"'):
        kernel_check.choose_update_kernel("deepspeed", optimizer(), BF16, BF16, dtypes=half_state)
    with pytest.raises(ValueError, match=r"update_kernel: 'auto'.*AdamW.*half precision.*needs it"):
        kernel_check.choose_update_kernel("auto", torch_adam, BF16, BF16, dtypes=half_state)


def test_a_wrong_arithmetic_is_caught_by_the_check() -> None:
    """The check fails, naming the output, for an arithmetic DeepSpeed's build does not have: so a CPU or
    compiler whose DeepSpeed differs gets DeepSpeed's kernel, not wrong bits."""
    ds = optimizer(adamw_mode=True, weight_decay=0.01)
    fused, _ = kernel_check.self_check(ds, torch.bfloat16, torch.bfloat16)
    assert fused is not None
    found = fused.kernel.arith
    for wrong in (
        {**found, "others": not found["others"]},
        {**found, "vector_width": 8 if found["vector_width"] != 8 else 16},
    ):
        calls = kernel_check._deepspeed_reference(
            ds.ds_opt_adam,
            ds.param_groups[0],
            True,
            0.5,
            torch.bfloat16,
            torch.bfloat16,
            torch.Generator().manual_seed(1),
            FP32_STATE,
        )
        bad = fused_update.FusedAdam(_core.AdamKernel(*ds.defaults["betas"], **wrong), adamw=True, threads=1)
        group = fused_update.adam_group(ds.param_groups[0], True)
        difference = kernel_check._first_difference(calls, bad, group, 0.5)
        assert difference is not None and "differ from DeepSpeed's" in difference, wrong


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"simd": "sse9"}, "simd"),
        ({"momentum": "sideways"}, "momentum"),
        ({"bias_sqrt": "half"}, "bias_sqrt"),
        ({"vector_width": 0}, "vector_width"),
    ],
)
def test_bad_kernel_settings_are_named(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        _core.AdamKernel(0.9, 0.999, **kwargs)


def test_bad_tensors_are_named() -> None:
    fused = fused_update.FusedAdam(_core.AdamKernel(0.9, 0.999), adamw=True, threads=1)
    group = _core.AdamGroup(1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    state, grad = torch.zeros(30), torch.zeros(10, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"state: .* 120 contiguous bytes .* not 116"):
        fused.update(state[:29].clone(), grad, None, grad_scale=1.0, step=1, group=group)
    with pytest.raises(ValueError, match=r"params.*strided"):
        fused.update(
            state, grad, torch.zeros(20, dtype=torch.bfloat16)[::2], grad_scale=1.0, step=1, group=group
        )
    with pytest.raises(ValueError, match="grad"):
        fused.update(state, torch.zeros(10, dtype=torch.int32), None, grad_scale=1.0, step=1, group=group)


# The records the kernel takes, each refusing bad input by the name of the argument: the keywords given
# to `_core.StateLayout` (beside fp32 master weights and moments) and to `_core.ChunkArrays` (beside a
# state, a bf16 gradient and a count), and the argument the `ValueError` names, where either record
# refuses it or `AdamKernel.update` refuses the two together.
RECORD_ROWS: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("a dtype no torch name spells", {"master": "bf16"}, {}, "master"),
    ("a stored dtype no torch name spells", {"stored_moments": "fp32"}, {}, "stored_moments"),
    ("fp16 moments beside bf16 master weights", {"master": "bfloat16", "moments": "float16"}, {}, "moments"),
    (
        "bf16 kept where fp16 values are",
        {"master": "float16", "stored_master": "bfloat16"},
        {},
        "stored_master",
    ),
    ("fp32 master weights in the parameters", {"master_in_params": True}, {}, "master_in_params"),
    ("a gradient dtype no torch name spells", {}, {"grad_dtype": "int8"}, "grad_dtype"),
    ("params without their dtype", {}, {"params": 4096}, "params_dtype"),
    ("keep_params without params", {}, {"keep_params": True}, "keep_params"),
    (
        "master weights in the parameters, and no params",
        {"master": "bfloat16", "moments": "bfloat16", "master_in_params": True},
        {},
        "params",
    ),
]


@pytest.mark.parametrize(
    ("layout_keys", "arrays_keys", "key"),
    [row[1:] for row in RECORD_ROWS],
    ids=[row[0] for row in RECORD_ROWS],
)
def test_bad_records_are_named(layout_keys: dict[str, Any], arrays_keys: dict[str, Any], key: str) -> None:
    state, grad = torch.zeros(30), torch.zeros(10, dtype=torch.bfloat16)
    group = _core.AdamGroup(1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    with pytest.raises(ValueError, match=rf"^{key}: "):
        layout = _core.StateLayout(**{"master": "float32", "moments": "float32"} | layout_keys)
        at: dict[str, Any] = {"state": state.data_ptr(), "grad": grad.data_ptr(), "grad_dtype": "bfloat16"}
        arrays = _core.ChunkArrays(**at | {"count": 10} | arrays_keys)
        _core.AdamKernel(0.9, 0.999).update(arrays, layout, group, step=1, grad_scale=1.0, threads=1)
    # The free function the layout's `offsets` replaced is gone.
    assert not hasattr(_core, "state_layout")


def test_a_process_forked_after_a_pass_starts_its_own_threads() -> None:
    """The pass's worker threads are kept between passes, in the process that started them: a child
    forked after a pass (a data loader's worker, a framework's helper process) has none of them, and its
    passes start their own, end, and compute what the parent's did."""
    fused = fused_update.FusedAdam(_core.AdamKernel(0.9, 0.999), adamw=True, threads=3)
    group = fused_update.adam_group(
        {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}, True
    )
    n = 1 << 16
    state, grad = inputs(n, torch.bfloat16, torch.Generator().manual_seed(3), specials=False)
    want, want_params = state.clone(), torch.empty(n, dtype=torch.bfloat16)
    fused.update(want, grad, want_params, grad_scale=0.5, step=1, group=group)
    got, got_params = state.clone(), torch.empty(n, dtype=torch.bfloat16)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fused.update(got, grad, got_params, grad_scale=0.5, step=1, group=group)
            # Bit for bit, in numpy: torch's OpenMP threads do not survive a fork either.
            bits = [
                t.view(torch.int32 if t.element_size() == 4 else torch.int16).numpy()
                for t in (got, want, got_params, want_params)
            ]
            code = 0 if (bits[0] == bits[1]).all() and (bits[2] == bits[3]).all() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (ended := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if ended == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's pass did not end within 30 s")
    assert os.waitstatus_to_exitcode(ended[1]) == 0, "the forked child's pass differs from the parent's"
