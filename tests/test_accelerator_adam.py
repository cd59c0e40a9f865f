"""The accelerator's pass (`engine.accelerator_adam`, a Triton kernel) against the host's fused pass (the
Rust kernel, itself checked against DeepSpeed's CPU Adam in `test_kernel.py`), bit for bit: every
precision mode of the state and `master_in_params`, every decay, the arithmetic of each kind of
DeepSpeed build (vector width, the tail's fusing, the bias correction's square root), a run of steps
with repeats and a jump, and NaN, infinities, subnormals and fp16's overflow in every array.

Without a GPU the kernel runs through Triton's interpreter, which computes `tl.fma` exactly and every
product, sum, quotient and square root of fp32 correctly rounded: the order of operations and where
they fuse are checked here. Whether the kernel asks a GPU for the same (no contraction, correctly rounded
division and square root) is checked by reading it (`test_the_kernel_asks_for_exact_arithmetic`) and in
the PTX that Triton compiles for an H100 here, without one (the compile rows at the end), and the
table runs on CUDA in the GPU report (`make gpu-report PARTS=accelerator-kernel`)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from mlp_offload import _core
from mlp_offload.engine import accelerator_adam
from mlp_offload.engine.accelerator_adam import AcceleratorAdam
from mlp_offload.engine.fused_update import FusedAdam, adam_group, crc32c_of
from mlp_offload.engine.state_dtypes import DTYPES, StateDtypes

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
ON_CUDA = os.environ.get("MLP_OFFLOAD_TEST_ACCELERATOR") == "cuda"
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
PACKAGE = Path(accelerator_adam.__file__).parent
# Adam steps of the calls, in order: a repeat (the next chunk of a subgroup), the next ones, a jump.
STEPS = [1, 1, 2, 3, 9]
# Two blocks of the kernel and a tail of every width's (37 is 5 past 16s and 8s, 1 past 4s).
N = 2 * accelerator_adam.block_for(DEVICE) + 37
VECTOR_TAIL = {"momentum": "gradient", "variance": "gradient", "others": True}


@pytest.fixture(scope="module", autouse=True)
def interpreted() -> Iterator[None]:
    """Without CUDA, Triton's interpreter while this file's tests run (Triton reads the variable when a
    kernel is made and as it runs), not left set for the worker's other tests."""
    before = os.environ.get("TRITON_INTERPRET")
    if not ON_CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    yield
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = before


class Row(NamedTuple):
    state: StateDtypes
    grad: torch.dtype
    # The dtype of the parameters written (None: none, as with fp32 training), unless in the state.
    params: torch.dtype | None
    group: dict[str, Any]
    adamw: bool
    arith: dict[str, Any]


ADAMW = {"weight_decay": 0.01}
TAILS = {
    "vector": VECTOR_TAIL,
    "old and separate, others unfused": {"momentum": "old", "variance": "separate", "others": False},
    "separate and old": {"momentum": "separate", "variance": "old", "others": True},
}


def row(state: StateDtypes, grad: torch.dtype, params: torch.dtype | None, **how: Any) -> Row:
    arith = {"vector_width": how.pop("width", 16), **TAILS[how.pop("tail", "vector")]}
    arith["bias_sqrt"] = how.pop("bias_sqrt", "float")
    return Row(state, grad, params, how.pop("group", ADAMW), how.pop("adamw", True), arith)


ROWS = {
    "fp32 state, fp32 training": row(StateDtypes(), F32, None),
    # DeepSpeed's fp32 partitions: the pass writes the new weights there too.
    "fp32 state, fp32 parameters": row(StateDtypes(), F32, F32),
    "fp32 state, bf16 parameters": row(StateDtypes(), BF16, BF16),
    "fp32 state, fp16 parameters": row(StateDtypes(), F16, F16, tail="old and separate, others unfused"),
    "bf16 weights": row(StateDtypes(BF16, F32), BF16, BF16),
    "bf16 weights and moments": row(StateDtypes(BF16, BF16), BF16, BF16, tail="separate and old"),
    "fp16 weights": row(StateDtypes(F16, F32), F16, F16),
    "fp16 weights and moments": row(StateDtypes(F16, F16), F16, F16, width=8),
    "bf16 master in the parameters": row(StateDtypes(BF16, BF16, True), BF16, None),
    "fp16 master in the parameters": row(StateDtypes(F16, F32, True), F16, None, width=4),
    "Adam with L2 decay": row(StateDtypes(), F32, None, adamw=False),
    "L2 decay, bf16 weights": row(StateDtypes(BF16, F32), BF16, BF16, adamw=False, tail="separate and old"),
    "no decay": row(StateDtypes(), BF16, BF16, group={"weight_decay": 0.0}),
    "no bias correction": row(StateDtypes(), F32, None, group={**ADAMW, "bias_correction": False}),
    "other betas and eps": row(StateDtypes(), F32, None, group={**ADAMW, "betas": (0.8, 0.95), "eps": 1e-6}),
    "every element in the scalar loop": row(StateDtypes(), F32, None, width=1, tail="separate and old"),
    "the bias correction's sqrt in double": row(StateDtypes(), F32, None, bias_sqrt="double"),
}
SPECIALS = [float("nan"), float("inf"), float("-inf"), 1e-40, -2e-41, -0.0, 3e-6, 7e4, 1e38]


def with_specials(x: torch.Tensor, generator: torch.Generator, every: int) -> torch.Tensor:
    """`x` with a special value at about one element in `every` (NaN, infinities, fp32 and fp16
    subnormals, -0.0, past fp16's range), the last element among them (in the tail)."""
    values = torch.tensor(SPECIALS)
    picks = torch.randint(0, every, x.shape, generator=generator) == 0
    picks[-1] = True
    x[picks] = values[torch.randint(0, len(values), (int(picks.sum()),), generator=generator)]
    return x


def inputs(r: Row, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A chunk's state bytes, its gradient and its parameters (None where none are written), on the host."""
    generator = torch.Generator().manual_seed(seed)
    state = torch.zeros(r.state.nbytes(N), dtype=torch.uint8)
    scales = [0.05, 1e-3, 1e-6][-len(r.state.arrays(state, N)) :]
    for array, scale in zip(r.state.arrays(state, N), scales, strict=True):
        values = torch.randn(N, generator=generator) * scale
        array.copy_(with_specials(values.abs() if scale == 1e-6 else values, generator, 13))
    grad = with_specials(torch.randn(N, generator=generator) * 1e-2, generator, 11).to(r.grad)
    half = r.state.master if r.state.master_in_params else r.params
    params = None
    if half is not None:
        params = with_specials(torch.randn(N, generator=generator) * 0.05, generator, 17).to(half)
    return state, grad, params


def kernel(r: Row) -> _core.AdamKernel:
    betas = r.group.get("betas", (0.9, 0.999))
    return _core.AdamKernel(*betas, **r.arith)


def torch_group(r: Row) -> dict[str, Any]:
    return {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, **r.group}


def host_run(r: Row, state: torch.Tensor, grad: torch.Tensor, params: torch.Tensor | None) -> None:
    fused = FusedAdam(kernel(r), adamw=r.adamw, threads=1, dtypes=r.state)
    group = adam_group(torch_group(r), r.adamw)
    for step in STEPS:
        fused.update(state, grad, params, group=group, step=step, grad_scale=1 / 1024)


def accelerator_arrays(
    r: Row, state: torch.Tensor, params: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The state's arrays as the accelerator's pass takes them: master, exp_avg, exp_avg_sq, and the
    parameters written (with `master_in_params` the parameters are the master, and none are written)."""
    arrays = [a.contiguous() for a in r.state.arrays(state, N)]
    if r.state.master_in_params:
        assert params is not None
        return params, arrays[0], arrays[1], None
    return arrays[0], arrays[1], arrays[2], params


def accelerator_run(
    r: Row, state: torch.Tensor, grad: torch.Tensor, params: torch.Tensor | None, arith: dict[str, Any]
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The same calls on the accelerator (`arith`: the kernel's build); the state's arrays and the
    parameters, back on the host."""
    on = [t.to(DEVICE) for t in accelerator_arrays(r, state, params) if t is not None]
    master, exp_avg, exp_avg_sq = on[:3]
    written = on[3] if len(on) > 3 else None
    update = AcceleratorAdam(kernel(r._replace(arith=arith)), dtypes=r.state)
    group = adam_group(torch_group(r), r.adamw)
    device_grad = grad.to(DEVICE)
    for step in STEPS:
        update.update(
            master, exp_avg, exp_avg_sq, device_grad, written, group=group, step=step, grad_scale=1 / 1024
        )
    if r.state.master_in_params:
        return [exp_avg.cpu(), exp_avg_sq.cpu()], master.cpu()
    return [master.cpu(), exp_avg.cpu(), exp_avg_sq.cpu()], None if written is None else written.cpu()


def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: the same bits, or both NaN (as `test_kernel.py` holds the host to DeepSpeed: x86
    takes a NaN operand's payload by instruction form, which each compiler chooses, and a GPU makes
    every NaN its canonical one)."""
    bits = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return (a.view(bits) == b.view(bits)) | (a.isnan() & b.isnan())


def differing(host: list[torch.Tensor], device: list[torch.Tensor]) -> list[str]:
    names = ["master", "exp_avg", "exp_avg_sq"][-len(host) :]
    return [
        f"{name}: {int((~same(a, b)).sum())} elements differ"
        for name, a, b in zip(names, host, device, strict=True)
        if a.dtype != b.dtype or not bool(same(a, b).all())
    ]


def run_both(r: Row, seed: int, device_arith: dict[str, Any]) -> list[str]:
    """What differs between the host's pass and the accelerator's (built for `device_arith`) on the same
    inputs, after the same calls."""
    state, grad, params = inputs(r, seed)
    device_arrays, device_params = accelerator_run(r, state.clone(), grad, _clone(params), device_arith)
    host_run(r, state, grad, params)
    host_arrays = [a.contiguous() for a in r.state.arrays(state, N)]
    different = differing(host_arrays, device_arrays)
    if params is not None and device_params is not None and not bool(same(params, device_params).all()):
        different.append("parameters differ")
    return different


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


@pytest.mark.parametrize("name", list(ROWS))
def test_the_accelerators_pass_is_bit_equal_to_the_hosts(name: str) -> None:
    r = ROWS[name]
    assert run_both(r, seed=len(name), device_arith=r.arith) == [], name


WITNESS_ROWS = ["fp32 state, fp32 training", "bf16 weights and moments", "fp16 weights"]


@pytest.mark.parametrize("name", WITNESS_ROWS)
def test_the_tails_fusing_is_the_builds(name: str) -> None:
    """An element whose bits the tail's fusing decides (`AdamKernel.witness`) in the tail: the
    accelerator's pass built for the row's arithmetic equals the host's, and one built for the vector
    code's everywhere does not, so the table tells fusings apart."""
    r = ROWS[name]._replace(arith={"vector_width": 16, **TAILS["old and separate, others unfused"]})
    kinds = DTYPES[r.state.master], DTYPES[r.state.moments]
    group = adam_group(torch_group(r), r.adamw)
    vector = kernel(r._replace(arith={"vector_width": 16, **VECTOR_TAIL}))
    found = kernel(r).witness(
        vector, group, step=1, grad_scale=1 / 1024, master_dtype=kinds[0], moments_dtype=kinds[1], seed=7
    )
    assert found is not None, "no element tells the two fusings apart"
    state, grad, params = inputs(r, seed=3)
    param, exp_avg, exp_avg_sq, grad_bits = found
    for array, value in zip(r.state.arrays(state, N), (param, exp_avg, exp_avg_sq), strict=True):
        array[-1] = value
    # The witness's bits, wrapped into the signed integer of the gradient's width.
    width = {F32: (32, torch.int32), BF16: (16, torch.int16), F16: (16, torch.int16)}[r.grad]
    signed = grad_bits - (1 << width[0]) if grad_bits >= 1 << (width[0] - 1) else grad_bits
    grad[-1] = torch.tensor([signed], dtype=width[1]).view(r.grad)[0]
    host_state, host_grad = state.clone(), grad.clone()
    host_run(r._replace(), host_state, host_grad, _clone(params))
    assert run_both(r, seed=3, device_arith=r.arith) == []
    same, other = (
        _last_bits(r, state, grad, params, r.arith),
        _last_bits(r, state, grad, params, vector.arith),
    )
    expected = [a.contiguous()[-1:] for a in r.state.arrays(host_state, N)]
    assert differing(expected, same) == []
    assert differing(expected, other) != [], "the vector code's fusing gave the tail's bits"


def _last_bits(
    r: Row, state: torch.Tensor, grad: torch.Tensor, params: torch.Tensor | None, arith: dict[str, Any]
) -> list[torch.Tensor]:
    arrays, _ = accelerator_run(r, state.clone(), grad, _clone(params), arith)
    return [a[-1:] for a in arrays]


def test_one_bias_state_serves_both_sides() -> None:
    """A chunk updated on the host at one step and on the accelerator at the next, through the host's
    own `AdamKernel` (as DeepSpeed's one `Adam_Optimizer` serves every subgroup): the bits of the host's
    pass at every step. With a bias state of its own, the accelerator's side would jump a step each
    call, and DeepSpeed's `pow` there is not its running product."""
    r = ROWS["fp32 state, bf16 parameters"]
    state, grad, params = inputs(r, seed=5)
    assert params is not None
    both_state, both_params = state.clone(), params.clone()
    shared = kernel(r)
    host, accelerator = (
        FusedAdam(shared, adamw=True, threads=1, dtypes=r.state),
        AcceleratorAdam(shared, dtypes=r.state),
    )
    alone = FusedAdam(kernel(r), adamw=True, threads=1, dtypes=r.state)
    group = adam_group(torch_group(r), True)
    for step in range(1, 13):
        alone.update(state, grad, params, group=group, step=step, grad_scale=1 / 1024)
        if step % 2:
            host.update(both_state, grad, both_params, group=group, step=step, grad_scale=1 / 1024)
            continue
        on = [t.to(DEVICE) for t in r.state.arrays(both_state, N)]
        written = both_params.to(DEVICE)
        master, exp_avg, exp_avg_sq = on
        accelerator.update(
            master, exp_avg, exp_avg_sq, grad.to(DEVICE), written, group=group, step=step, grad_scale=1 / 1024
        )
        for array, done in zip(r.state.arrays(both_state, N), on, strict=True):
            array.copy_(done.cpu())
        both_params.copy_(written.cpu())
    assert differing(list(r.state.arrays(state, N)), list(r.state.arrays(both_state, N))) == []
    assert bool(same(params, both_params).all())


def test_a_bad_argument_is_named() -> None:
    r = ROWS["fp32 state, fp32 training"]
    update = AcceleratorAdam(kernel(r), dtypes=r.state)
    group = adam_group(torch_group(r), True)
    ok = [torch.zeros(8, device=DEVICE) for _ in range(4)]
    with pytest.raises(ValueError, match=r"exp_avg_sq: .* 8 contiguous elements"):
        update.update(
            ok[0], ok[1], torch.zeros(9, device=DEVICE), ok[3], None, group=group, step=1, grad_scale=1.0
        )
    with pytest.raises(ValueError, match=r"master, exp_avg, exp_avg_sq: .*bfloat16"):
        update.update(ok[0].bfloat16(), ok[1], ok[2], ok[3], None, group=group, step=1, grad_scale=1.0)


# name, the parameters' dtype, and whose rows the kernel takes: its own (through the interpreter, rows
# of one element; on CUDA, the GPU's), or a GPU's (rows of 16) also through the interpreter.
CRC_ROWS = [("bf16", BF16, "its own"), ("fp16", F16, "its own"), ("bf16, a GPU's rows", BF16, "a GPU's")]


@pytest.mark.parametrize(("dtype", "rows"), [r[1:] for r in CRC_ROWS], ids=[r[0] for r in CRC_ROWS])
def test_the_parameters_crc32c_there_is_the_hosts(
    dtype: torch.dtype, rows: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the accelerator's side sums of the parameters (`crc32c_into`, where they are the master
    weights) is the host pass's and the store's CRC32C of their bytes, whatever their length: one
    element, a few, about a block, a part of a row past blocks; a wrong argument is named."""
    if rows == "a GPU's":
        monkeypatch.setitem(accelerator_adam.CRC_SHAPES, True, accelerator_adam.CRC_SHAPES[False])
    block_rows, run = accelerator_adam.CRC_SHAPES[DEVICE.type == "cpu"]
    block = block_rows * run
    lengths = [1, 2, 37, block - 1, block, block + run + 3, 2 * block + 37]
    if rows == "a GPU's" and not ON_CUDA:
        # Rows of 16 through the interpreter take seconds a block: a part of a row, and past a block.
        lengths = [37, block + run + 3]
    generator = torch.Generator().manual_seed(5)
    for n in lengths:
        half = with_specials(torch.randn(n, generator=generator), generator, 7).to(dtype)
        out = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        accelerator_adam.crc32c_into(half.to(DEVICE), out)
        assert int(out) & 0xFFFFFFFF == crc32c_of(half), n
    with pytest.raises(ValueError, match=r"16-bit elements into an int32, not torch\.float32 into"):
        accelerator_adam.crc32c_into(torch.zeros(4, device=DEVICE), out)


# What the kernel may call of Triton's: no `/`, `tl.sqrt`, `tl.fdiv` or `tl.math`'s approximations.
EXACT_CALLS = {
    "load",
    "store",
    "where",
    "fma",
    "sqrt_rn",
    "div_rn",
    "program_id",
    "arange",
    "full",
    "minimum",
    "jit",
    "static_range",
    "split",
    "reshape",
    "atomic_xor",
}


def _exact_call(func: ast.expr, own: set[str]) -> bool:
    """Whether a call in the kernel's module is one the exact arithmetic allows: the module's own
    functions, Triton's exact ones, and a tensor's `.to` (its conversions; the kernel rounds in integer
    arithmetic itself). Anything else (`tl.math.sqrt`, `x.sqrt()`, libdevice's) is not."""
    if isinstance(func, ast.Name):
        return func.id in own
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id in ("tl", "triton")
    ):
        return func.attr in EXACT_CALLS
    return isinstance(func, ast.Attribute) and func.attr == "to"


def test_the_kernel_asks_for_exact_arithmetic() -> None:
    """What the interpreter cannot show: on a GPU, `/` and `tl.sqrt` are approximate and the compiler
    contracts a product and a sum into an `fma` unless told not to. The kernel divides and takes square
    roots only correctly rounded, and its launch turns the contraction off."""
    source = ast.parse((PACKAGE / "_accelerator_kernel.py").read_text())
    divisions = [n.lineno for n in ast.walk(source) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)]
    assert divisions == [], f"a `/` at lines {divisions}: use tl.div_rn"
    powers = [n.lineno for n in ast.walk(source) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow)]
    assert powers == [], f"a `**` at lines {powers}"
    own = {n.name for n in source.body if isinstance(n, ast.FunctionDef)}
    others = sorted(
        {
            ast.unparse(n.func)
            for n in ast.walk(source)
            if isinstance(n, ast.Call) and not _exact_call(n.func, own)
        }
    )
    assert others == [], f"calls beyond the exact ones: {others}"
    launch = ast.parse((PACKAGE / "accelerator_adam.py").read_text())
    fusion = [
        k.value.value
        for n in ast.walk(launch)
        if isinstance(n, ast.Call)
        for k in n.keywords
        if k.arg == "enable_fp_fusion" and isinstance(k.value, ast.Constant)
    ]
    assert fusion == [False], "the launch must pass enable_fp_fusion=False"


# The kernel's variants compiled for a GPU here, each of its branches in one at least: name, its
# constants, and (where the tail fuses nothing) the `fma`s it asks for per element, all the vector
# path's (three for the moments and the denominator, one for the step, one for a decay).
VARIANTS: list[tuple[str, dict[str, Any], int | None]] = [
    (
        "fp32 state, bf16 parameters, AdamW, a tail that fuses nothing",
        {"MASTER": 0, "MOMENTS": 0, "GRAD": 1, "PARAMS": 1, "WRITES_PARAMS": True, "DECAY": 2},
        5,
    ),
    (
        "fp32 state, fp16 parameters, L2 decay, a tail that fuses nothing",
        {"MASTER": 0, "MOMENTS": 0, "GRAD": 2, "PARAMS": 2, "WRITES_PARAMS": True, "DECAY": 1},
        5,
    ),
    (
        "bf16 master in the parameters with bf16 moments, no decay",
        {"MASTER": 1, "MOMENTS": 1, "GRAD": 1, "PARAMS": 1, "WRITES_PARAMS": False, "DECAY": 0},
        None,
    ),
    (
        "fp16 weights, fp32 moments",
        {"MASTER": 2, "MOMENTS": 0, "GRAD": 2, "PARAMS": 2, "WRITES_PARAMS": True, "DECAY": 2},
        None,
    ),
]
# The tail's arithmetic by variant: none fused where the row counts the `fma`s, else fused.
UNFUSED_TAIL = {"MOMENTUM": 2, "VARIANCE": 2, "OTHERS": False}
FUSED_TAIL = {"MOMENTUM": 1, "VARIANCE": 0, "OTHERS": True}
KINDS = {0: "fp32", 1: "i16", 2: "i16"}
# A GPU target Triton compiles for without one: an H100's.
SM90 = ("cuda", 90, 32)


def _ptx(fn: Any, pointers: dict[str, str], constants: dict[str, Any], fusion: bool) -> str:
    """`fn` compiled by Triton for an sm_90 GPU (no GPU needed: its compiler and ptxas), as PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**pointers, **{name: "constexpr" for name in constants}}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget(*SM90), options={"enable_fp_fusion": fusion})
    return str(compiled.asm["ptx"])


def _adam_constants(name: str) -> dict[str, Any]:
    constants, fmas = next(v[1:] for v in VARIANTS if v[0] == name)
    tail = UNFUSED_TAIL if fmas is not None else FUSED_TAIL
    return {**constants, **tail, "HALF_STATE": constants["MASTER"] != 0, "BLOCK": accelerator_adam.BLOCK}


def _adam_ptx(module: Any, constants: dict[str, Any], fusion: bool) -> str:
    out = constants["PARAMS"] if constants["WRITES_PARAMS"] else constants["GRAD"]
    pointers = {
        "p_ptr": f"*{KINDS[constants['MASTER']]}",
        "m_ptr": f"*{KINDS[constants['MOMENTS']]}",
        "v_ptr": f"*{KINDS[constants['MOMENTS']]}",
        "g_ptr": f"*{KINDS[constants['GRAD']]}",
        "o_ptr": f"*{KINDS[out]}",
        "k_ptr": "*fp32",
        "n": "i32",
        "vector_end": "i32",
    }
    return _ptx(module.adam_kernel, pointers, constants, fusion)


def _instructions(ptx: str) -> dict[str, int]:
    """The PTX's floating-point and atomic instructions, counted, and whether it approximates or flushes
    subnormals anywhere."""
    found: dict[str, int] = {}
    for name in re.findall(r"\b((?:add|sub|mul|fma|div|sqrt|rcp|ex2|lg2|atom|red)\.[\w.]+)", ptx):
        found[name] = found.get(name, 0) + 1
    found["approximate or flushing"] = ptx.count(".approx") + ptx.count(".ftz")
    return found


def compile_for_a_gpu() -> dict[str, dict[str, int]]:
    """Each variant's instructions as Triton builds it for an H100 (with the contraction off, as the
    launch asks, and on, where the row counts `fma`s), and the CRC32C kernel's. Run in a process
    without Triton's interpreter, which patches Triton's language where it ran."""
    spec = importlib.util.spec_from_file_location("_kernel_for_a_gpu", PACKAGE / "_accelerator_kernel.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = {}
    for name, _, fmas in VARIANTS:
        found[name] = _instructions(_adam_ptx(module, _adam_constants(name), fusion=False))
        if fmas is not None:
            found[f"{name}, contracted"] = _instructions(
                _adam_ptx(module, _adam_constants(name), fusion=True)
            )
    rows, run = accelerator_adam.CRC_SHAPES[False]
    pointers = {
        "x_ptr": "*i16",
        "out_ptr": "*i32",
        "row_shifts_ptr": "*i32",
        "block_shifts_ptr": "*i32",
        "n": "i32",
        "zeros_crc": "i32",
    }
    crc = {"ROWS": rows, "RUN": run, "HALVINGS": rows.bit_length() - 1}
    found["crc32c"] = _instructions(_ptx(module.crc32c_kernel, pointers, crc, False))
    return found


@pytest.fixture(scope="module")
def for_a_gpu() -> dict[str, dict[str, int]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = "import json, test_accelerator_adam as t; print(json.dumps(t.compile_for_a_gpu()))"
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found: dict[str, dict[str, int]] = json.loads(done.stdout.splitlines()[-1])
    return found


EXACT_FLOATS = {"add.rn.f32", "sub.rn.f32", "mul.rn.f32", "fma.rn.f32", "div.rn.f32", "sqrt.rn.f32"}


def _inexact(found: dict[str, int]) -> list[str]:
    """What in a kernel's instructions may round otherwise than the host: an fp32 operation the
    assembler may contract (no `.rn`) or an approximation, a flush of subnormals."""
    floats = sorted(name for name in found if name.endswith(".f32") and name not in EXACT_FLOATS)
    return floats + (["approximate or flushing"] if found["approximate or flushing"] else [])


@pytest.mark.parametrize("name", [v[0] for v in VARIANTS])
def test_the_kernel_compiles_for_a_gpu_with_exact_arithmetic(
    name: str, for_a_gpu: dict[str, dict[str, int]]
) -> None:
    """What the interpreter cannot show, in the PTX Triton builds for an H100 here: the kernel compiles
    (Triton's compiler goes on past a `return` inside an `if`, where the interpreter runs Python), every
    fp32 product and sum is rounded on its own (`.rn`: the assembler contracts none), division and square
    root are the correctly rounded ones and nothing approximates or flushes subnormals; and where the
    tail fuses nothing, the `fma`s are the vector path's alone. The same kernel compiled with the
    contraction on fails the check (so it tells)."""
    found = for_a_gpu[name]
    assert _inexact(found) == [], found
    assert found.get("div.rn.f32") and found.get("sqrt.rn.f32"), found
    fmas = next(v[2] for v in VARIANTS if v[0] == name)
    if fmas is not None:
        # Two square roots an element: the vector path's and the tail's.
        assert found["fma.rn.f32"] == fmas * (found["sqrt.rn.f32"] // 2), found
        contracted = for_a_gpu[f"{name}, contracted"]
        assert _inexact(contracted) or contracted["fma.rn.f32"] > found["fma.rn.f32"], contracted


def test_the_parameters_crc32c_compiles_for_a_gpu(for_a_gpu: dict[str, dict[str, int]]) -> None:
    """The CRC32C kernel (`crc32c_into`) compiles for an H100 here, its sum one XOR into memory."""
    atomics = [name for name in for_a_gpu["crc32c"] if name.startswith(("atom", "red"))]
    assert atomics and all(".xor." in name for name in atomics), for_a_gpu["crc32c"]
