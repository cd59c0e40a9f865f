"""The installed wheel, checked where it runs: `scripts/aarch64.sh test` runs this under qemu-aarch64, in
an emulated Debian with torch's aarch64 wheel, from a directory outside the repository (pytest does not
collect it).

1. The import: the package and its native module come from the installed wheel, on aarch64.
2. A store round trip on both engines, striped over two directories, reopened from its manifest, and a
   corrupted stripe refused. io_uring where the emulator runs it; where it does not, the check says why,
   `engine: "auto"` must pick the thread pool and `"io_uring"` must refuse by name.
3. The probe, as users run it (`mlp-offload probe --json`, small sizes).
4. The update kernel against x86-64: a table of chunks (bf16 and fp16 gradients with inf, NaN and
   subnormals, tails of every vector width, three Adam steps, AdamW and Adam, several of DeepSpeed's
   arithmetics, the state in fp32 and in DeepSpeed's half-precision modes) through the fused pass with
   checksums. `--kernel-digests` prints a digest per row;
   `--expect-digests FILE` compares this machine's with another's (`scripts/aarch64.sh test` writes the
   x86-64 host's there, computed by its AVX-512 or AVX2 path): aarch64's path must give the same bits,
   CRC32C included. One thing differs by design of the two CPUs, not of the kernel: an invalid operation
   (inf/inf, where a gradient is inf) gives x86-64's default NaN (sign set) and aarch64's (sign clear), as
   DeepSpeed's own kernel does on each. So rows with inf and NaN among the gradients compare every
   number with each NaN's bits made one, and their checksums (over those NaNs) are left out.

5. Where DeepSpeed is installed: three ZeRO-3 steps with our engine against stock DeepSpeed's
   `device: cpu` on this machine, bit for bit (bf16, clipping, AdamW; the fused pass where its start-up
   check against DeepSpeed's CPU Adam here agrees, else DeepSpeed's passes, as the record says).

Prints one line per check and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# (gradient dtype, parameter dtype, elements): every tail of 16, 8 and 4 lanes, and a chunk over several
# of the pass's cache blocks.
KERNEL_CHUNKS = [
    ("bfloat16", "bfloat16", 4096 + 15),
    ("bfloat16", "bfloat16", 7),
    ("float16", "float16", 8192 * 2 + 1029),
    ("float16", "float16", 33),
    ("float32", "bfloat16", 1003),
]
# DeepSpeed's state in half precision (master weights, moments) and a chunk of each: its gradient and
# parameters in the master weights' dtype.
KERNEL_STATES = [
    ("bfloat16", "float32", 4096 + 15),
    ("bfloat16", "bfloat16", 4096 + 15),
    ("float16", "float32", 33),
    ("float16", "float16", 8192 * 2 + 1029),
]
# DeepSpeed's arithmetics (`_core.AdamKernel.candidates()` keywords): x86-64's AVX-512 and AVX2 builds, and
# a build without vectors (aarch64's, whose compiler fuses or not).
KERNEL_ARITHS: list[dict[str, Any]] = [
    {"vector_width": 16},
    {"vector_width": 8, "momentum": "old", "variance": "separate", "others": False},
    {
        "vector_width": 1,
        "momentum": "separate",
        "variance": "separate",
        "others": False,
        "bias_sqrt": "double",
    },
    {"vector_width": 1},
]
ADAM: dict[str, Any] = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "bias_correction": True}


def _bits(rng: np.random.Generator, n: int, dtype: str, specials: bool) -> np.ndarray:
    """`n` values of `dtype` from exactly rounded uniform numbers (the same bits on every machine), with
    `specials`, inf, -inf, NaN and a subnormal of the dtype among them."""
    values = ((rng.random(n) * 2 - 1) * 4).astype(np.float32)
    if dtype == "float32":
        out = values
    elif dtype == "float16":
        out = values.astype(np.float16)
    else:
        out = (values.view(np.uint32) >> 16).astype(np.uint16)
    if specials:
        special = {
            "float32": [np.inf, -np.inf, np.nan, 1e-40],
            "float16": [np.inf, -np.inf, np.nan, 1e-7],
        }
        if dtype == "bfloat16":
            out[1:5] = [0x7F80, 0xFF80, 0x7FC0, 0x0001]
        else:
            out[1:5] = np.array(special[dtype], dtype=out.dtype)
    return out


def _rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """Finite fp32 `values` rounded to nearest even in `dtype`: its bits (fp32 and fp16 as numpy's
    floats). In numpy: torch's conversions fail under the emulator (its cpuinfo cannot read the CPUs)."""
    if dtype == "float32":
        return values
    if dtype == "float16":
        return values.astype(np.float16).view(np.uint16)
    bits = values.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _one_nan(values: np.ndarray, dtype: str) -> np.ndarray:
    """`values` (the bits of `dtype`) with every NaN's bits made one pattern."""
    bits: np.ndarray[Any, np.dtype[np.unsignedinteger[Any]]]
    if dtype == "float32":
        bits = values.view(np.uint32).copy()
    else:
        bits = values.view(np.uint16).copy()
    exponent, mantissa = {"float32": (0x7F800000, 0x007FFFFF), "float16": (0x7C00, 0x03FF)}.get(
        dtype, (0x7F80, 0x007F)
    )
    nan = ((bits & exponent) == exponent) & ((bits & mantissa) != 0)
    bits[nan] = exponent | mantissa
    return bits


def kernel_digests() -> dict[str, str]:
    """Per row of the table: the SHA-256 of the state, the parameters and the checksums after each of three
    steps through the fused pass (`simd: "auto"`, the widest this CPU runs); the half-precision states also
    with the master weights in the parameters (`master_in_params`: the chunk's bytes the moments alone)."""
    from mlp_offload import _core

    digests = {}
    chunks = [(*chunk, "float32", "float32") for chunk in KERNEL_CHUNKS]
    chunks += [(master, master, n, master, moments) for master, moments, n in KERNEL_STATES]
    rows = [
        (a, arith, chunk, adamw, specials, in_params)
        for a, arith in enumerate(KERNEL_ARITHS)
        for chunk in chunks
        for adamw in (True, False)
        for specials in (False, True)
        for in_params in (False, True)
        if (chunk[2] >= 8 or not specials) and (chunk[3] != "float32" or not in_params)
    ]
    for a, arith, (grad_dtype, params_dtype, n, master, moments), adamw, specials, in_params in rows:
        weight_decay = 0.01 if adamw else 0.0
        rng = np.random.default_rng([a, n, adamw, specials])
        values = (rng.random(3 * n) * 2 - 1).astype(np.float32)
        values[2 * n :] = np.abs(values[2 * n :])
        # The state in its dtypes, laid out as the engine keeps it (the master weights in the parameters
        # with `in_params`).
        dtypes = (master, moments, moments)
        layout = _core.StateLayout(master, moments, master_in_params=in_params)
        offsets, total = layout.offsets(n)
        raw = np.zeros(total, dtype=np.uint8)
        params = np.zeros(n, dtype=np.uint16)
        arrays = [
            params
            if in_params and k == 0
            else raw[at : at + n * (4 if dtype == "float32" else 2)].view(
                np.float32 if dtype == "float32" else np.uint16
            )
            for k, (at, dtype) in enumerate(zip(offsets, dtypes, strict=True))
        ]
        for k, (array, dtype) in enumerate(zip(arrays, dtypes, strict=True)):
            array[:] = _rounded(values[k * n : (k + 1) * n], dtype)
        # Cut within the state's bytes, as the store's stripes cut it.
        cuts = ([0, 4 * n], [0, 8 * n]) if total == 12 * n else ([0, 2 * n], [0, 4 * n])
        if in_params:
            cuts = ([0, total // 2], [0])
        kernel = _core.AdamKernel(ADAM["beta1"], ADAM["beta2"], **arith)
        group = _core.AdamGroup(**ADAM, weight_decay=weight_decay, adamw=adamw)
        digest = hashlib.sha256()
        for step in (1, 2, 3):
            grad = _bits(rng, n, grad_dtype, specials)
            at = _core.ChunkArrays(
                raw.ctypes.data,
                grad.ctypes.data,
                grad_dtype,
                n,
                params=params.ctypes.data,
                params_dtype=params_dtype,
            )
            sums = kernel.update(
                at,
                layout,
                group,
                step=step,
                grad_scale=0.5,
                threads=2,
                read_cuts=cuts[0],
                write_cuts=cuts[1],
            )
            for array, dtype in zip(arrays, dtypes, strict=True):
                digest.update(_one_nan(array, dtype).tobytes())
            digest.update(_one_nan(params, params_dtype).tobytes())
            if not specials:
                digest.update(json.dumps(sums[:2] if not in_params else [*sums[:2], sums[3]]).encode())
        key = f"{json.dumps(arith, sort_keys=True)} {grad_dtype}->{params_dtype} n={n} adamw={adamw}"
        if master != "float32" or moments != "float32":
            key += f" state {master}/{moments}{' (master in params)' if in_params else ''}"
        digests[f"{key}{' specials' if specials else ''}"] = digest.hexdigest()
    return digests


def check_import() -> str:
    import mlp_offload
    from mlp_offload import _core

    machine = platform.machine()
    assert machine == "aarch64", f"running on {machine}, not aarch64"
    for module in (mlp_offload, _core):
        assert module.__file__ is not None and "site-packages" in module.__file__, module.__file__
    return f"mlp_offload {mlp_offload.__version__} from {Path(_core.__file__).name} on {machine}"


def round_trip(engine: str, base: Path) -> str:
    import torch

    import mlp_offload
    from mlp_offload import CorruptObjectError, ObjectStore, PinnedBufferPool, as_tensor

    paths = [base / f"{engine}-a", base / f"{engine}-b"]
    for p in paths:
        p.mkdir()
    nbytes = (5 << 20) + 12288
    pool = PinnedBufferPool(2, nbytes, lock=False)
    src, dst = pool.acquire(), pool.acquire()
    assert src is not None and dst is not None
    data = torch.from_numpy(np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8))
    as_tensor(src).copy_(data)
    with ObjectStore(paths, engine=engine, weights=[0.5, 0.5]) as store:
        got = store.engine
        store.write("chunk", src).wait()
        store.read("chunk", dst).wait()
        assert torch.equal(as_tensor(dst), data), "read back differs"
        placement = store.placement("chunk")
        assert len([p for p in placement if p[1] > 0]) == 2, placement
    as_tensor(dst).zero_()
    with ObjectStore(paths, engine=engine) as store:
        store.read("chunk", dst).wait()
        assert torch.equal(as_tensor(dst), data), "read back after reopening differs"
    stripe = paths[1] / "rank0" / "chunk.mlpo"
    stripe.write_bytes(bytes(b ^ 0xFF for b in stripe.read_bytes()))
    with ObjectStore(paths, engine=engine) as store:
        try:
            store.read("chunk", dst).wait()
        except CorruptObjectError as e:
            refused = str(e)
        else:
            raise AssertionError("a corrupted stripe was read without an error")
    assert "chunk.mlpo" in refused, refused
    pool.close()
    del mlp_offload
    return f"engine {got}: {nbytes:,} bytes over 2 paths, reopened, corruption refused"


def check_engines(base: Path) -> list[tuple[str, Callable[[], str]]]:
    from mlp_offload import ObjectStore, io_uring_unavailable_reason

    reason = io_uring_unavailable_reason()
    checks: list[tuple[str, Callable[[], str]]] = [
        ("store, thread pool", lambda: round_trip("threads", base))
    ]
    if reason is None:
        checks.insert(0, ("store, io_uring", lambda: round_trip("io_uring", base)))
    else:

        def falls_back() -> str:
            (base / "auto").mkdir()
            with ObjectStore([base / "auto"], engine="auto") as store:
                assert store.engine == "threads", store.engine
            try:
                ObjectStore([base / "auto"], engine="io_uring", rank=1)
            except (OSError, ValueError) as e:
                refusal = str(e)
            else:
                raise AssertionError('engine "io_uring" opened where io_uring is unavailable')
            return f"unavailable here ({reason}); auto picks the thread pool; io_uring refused: {refusal}"

        checks.insert(0, ("store, io_uring", falls_back))
    return checks


def check_probe(base: Path) -> str:
    d = base / "probe"
    d.mkdir()
    command = ["mlp-offload", "probe", str(d), "--no-save", "--json", "-q", "--bytes", "16M"]
    command += ["--sustained-bytes", "32M", "--chunk-sizes", "1M", "--depths", "4", "--together-secs", "1"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(command)}: {proc.stderr[-3000:]}"
    report = json.loads(proc.stdout)
    return f"mlp-offload probe: {json.dumps(report)[:300]}"


def zero3_run(ours: bool, out: Path, paths: list[str]) -> None:
    """Three ZeRO-3 steps of a tiny GPT (bf16, clipping, AdamW from the config), stock DeepSpeed's
    `device: cpu` or ours; saves what `check_zero3` compares. One process per run (DeepSpeed keeps
    process-wide state)."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    import mlp_offload
    from mlp_offload.app.models import GPT, SIZES

    torch.manual_seed(1234)
    model = GPT.from_size("tiny", max_seq=16)
    config: dict[str, object] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "sub_group_size": 12000, "offload_optimizer": {"device": "cpu"}},
        "steps_per_print": 10**9,
    }
    if ours:
        config["mlp_offload"] = {"paths": paths, "host_memory": "1M"}
    init = mlp_offload.initialize if ours else deepspeed.initialize
    engine, optimizer, _, _ = init(model=model, model_parameters=model.parameters(), config=config)
    data = torch.Generator().manual_seed(99)
    losses = []
    for _ in range(3):
        loss = engine(torch.randint(0, SIZES["tiny"][0], (2, 16), generator=data))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    state = {
        name: [
            safe_get_full_fp32_param(p).clone(),
            safe_get_full_optimizer_state(p, "exp_avg").clone(),
            safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
            p.ds_tensor.clone(),
        ]
        for name, p in engine.module.named_parameters()
    }
    kernel = optimizer.mlp_offload_telemetry[0]["update_kernel"] if ours else None
    torch.save({"losses": losses, "state": state, "kernel": kernel, "class": type(optimizer).__name__}, out)


def check_zero3(base: Path) -> str:
    """Our engine against stock DeepSpeed on this machine, bit for bit (each in a process of its own)."""
    import torch

    paths = [str(base / "zero3-a"), str(base / "zero3-b")]
    for p in paths:
        os.makedirs(p)
    results = {}
    for name in ("stock", "ours"):
        out = base / f"zero3-{name}.pt"
        command = [sys.executable, __file__, "--zero3-run", name, str(out), *paths]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "MASTER_PORT": str(port)}
        proc = subprocess.run(command, capture_output=True, text=True, timeout=3600, env=env)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-4000:]}"
        results[name] = torch.load(out, weights_only=False)
    ours, stock = results["ours"], results["stock"]
    assert ours["class"] == "MLPOffloadStage3", ours["class"]
    assert ours["losses"] == stock["losses"], (ours["losses"], stock["losses"])
    for name, tensors in stock["state"].items():
        for what, a, b in zip(
            ("fp32", "exp_avg", "exp_avg_sq", "half"), ours["state"][name], tensors, strict=True
        ):
            assert torch.equal(a, b), f"{name} {what} differs from stock DeepSpeed's"
    kernel = ours["kernel"]
    return f"3 steps bit-equal to stock DeepSpeed's device: cpu; kernel {kernel['kernel']}: {kernel['why']}"


def check_kernel(expect: Path) -> str:
    from mlp_offload import _core

    simd = _core.AdamKernel(0.9, 0.999).simd
    theirs = json.loads(expect.read_text())
    ours = kernel_digests()
    assert ours.keys() == theirs.keys(), "the two machines ran different tables"
    differ = [k for k in ours if ours[k] != theirs[k]]
    assert not differ, f"{len(differ)} of {len(ours)} rows differ from x86-64's, first: {differ[0]}"
    return f"{len(ours)} rows (3 steps each, checksums included) bit-equal to x86-64's; here simd {simd}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel-digests", action="store_true", help="print the kernel table's digests")
    parser.add_argument("--expect-digests", type=Path, help="the kernel digests of another machine")
    parser.add_argument("--zero3-run", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.zero3_run:
        which, out, *paths = args.zero3_run
        zero3_run(which == "ours", Path(out), paths)
        return 0
    if args.kernel_digests:
        json.dump(kernel_digests(), sys.stdout, indent=1)
        return 0
    failed = 0
    with tempfile.TemporaryDirectory(dir=os.environ.get("CHECK_DIR")) as tmp:
        base = Path(tmp)
        checks: list[tuple[str, Callable[[], str]]] = [("import", check_import)]
        checks += check_engines(base)
        checks.append(("probe", lambda: check_probe(base)))
        if args.expect_digests is not None:
            checks.append(("update kernel", lambda: check_kernel(args.expect_digests)))
        if importlib.util.find_spec("deepspeed") is not None:
            checks.append(("ZeRO-3", lambda: check_zero3(base)))
        else:
            print("skipped ZeRO-3: DeepSpeed is not installed here (scripts/aarch64.sh installs it)")
        for name, check in checks:
            try:
                print(f"ok      {name}: {check()}", flush=True)
            except Exception:
                failed += 1
                print(f"FAILED  {name}:\n{traceback.format_exc()}", flush=True)
    print(f"{len(checks) - failed} of {len(checks)} checks passed on {platform.machine()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
