"""DeepSpeed's own tests with our engine swapped in, compared with the same cases run stock.

    python tests/deepspeed_suite/run.py [--tests DIR_OR_TARBALL] [--only REGEX] [--out FILE]

Finds DeepSpeed's `tests/` tree (`--tests`, else `$DEEPSPEED_TESTS`, else the snapshot in
`../shared/deepspeed-tests/`), unpacks a tarball into `target/`, selects the cases of `CASES` (every case
in the tree whose config has ZeRO stage 3 with the optimizer offloaded, by file and case id), and runs
them twice with DeepSpeed's CPU accelerator (as many ranks as each case asks for): stock, then with our
engine swapped in by `sitecustomize.py`. A case's verdict:

- `pass`: passed stock and with ours, and every stage-3 engine with an offloaded optimizer it built was
  ours (the records written in the rank processes say so);
- `REGRESSION`: passed stock, failed with ours;
- `HARNESS`: passed with ours without building our engine where stock built a stage-3 offload engine, or
  built none at all, or without our parameters' swapper where stock kept parameters on NVMe: the case
  proves nothing about our engine, which is a failure of the harness;
- `refused`: fails with ours on an error that names a setting we do not honour (`REFUSALS`), where
  honouring it is not possible;
- `stock skipped` / `stock failed`: not comparable (reason given); `not ours`: stock built no such
  engine.

Stock's cases with anything on NVMe run on DeepSpeed's async I/O op: `make test` builds it first
(`make deepspeed-aio`); where it is not built, the first such case builds it.

Exits 1 on any REGRESSION or HARNESS verdict; prints a table and writes every outcome as JSON. Skips,
saying so, when the tests are not found. The project holds no copy of DeepSpeed's code: the tree is
unpacked under `target/`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SHARED_SNAPSHOT = ROOT.parent / "shared" / "deepspeed-tests"
WORK = ROOT / "target" / "deepspeed-suite"


@dataclass(frozen=True)
class Cases:
    """The cases of one test file that build ZeRO stage 3 with an offloaded optimizer."""

    file: str
    ids: str  # regex over the part of the node id after the file
    what: str
    # False: the cases skip themselves on DeepSpeed's CPU accelerator, always (by its device name), after
    # their ranks have started: left out there, run on a GPU.
    on_cpu: bool = True


CASES = [
    Cases(
        "unit/checkpoint/test_zero_optimizer.py",
        r"::TestZeROCheckpoint::test_(not_)?load_optimizer_state\[3-True-",
        "checkpoint save and load, with and without the optimizer states (`cpu_offload: true`)",
    ),
    Cases(
        "unit/checkpoint/test_lr_scheduler.py",
        r"\[3-True\]",
        "checkpoints with and without an lr scheduler",
        # "CPU accelerator does not support this test.", 34 s a case to start two ranks and skip.
        on_cpu=False,
    ),
    Cases(
        "unit/runtime/zero/test_zero_tensor_fragment.py",
        r"\[cpu-3-",
        "safe_get/set_* of fp32 params, gradients and optimizer states; their updates (also torch Adam)",
    ),
    Cases(
        "unit/runtime/zero/test_zero_grad_clip.py",
        r"-cpu\]",
        "gradient clipping and the norm it reports",
    ),
    Cases(
        "unit/runtime/zero/test_zero_offloadpp.py",
        r"::TestZeroPartialOffloadConfigSweep::",
        "partial offload (`ratio`)",
    ),
    Cases(
        "unit/v1/zero/test_zero_coalesce_grad_reduction.py",
        r"::TestCoalesceCpuOffload::.*\[3-",
        "coalesced gradient reduction with CPU offload, bit-exact against the uncoalesced run",
    ),
    Cases(
        "unit/v1/zero/test_offload_states.py",
        r"::TestDynamicOffloadStatesZero3::.*\[True-False-True-",
        "offload_states / reload_states with the optimizer offloaded (pinned, blocking)",
    ),
    # Not `unit/v1/zero/test_zero.py`: its `test_offload_optimizer` returns before building an engine
    # unless contiguous gradients are on, which it never sets (so it builds none with offload, and without
    # it DeepSpeed's fused Adam, whose build took 83-107 s of a fresh clone's suite), and
    # `TestZeroOffloadOptim` is ZeRO stage 1: on any accelerator neither builds a stage-3 offload engine.
    Cases(
        "unit/runtime/zero/test_nvme_checkpointing.py",
        # Each pair of the parameters' and the optimizer's devices with either on NVMe, but for `nvme-none`
        # (the optimizer not offloaded: no engine of ours to build). fp16: skipped where the CPU has none.
        r"\[(none-nvme|cpu-nvme|nvme-cpu|nvme-nvme)\]",
        "ZeRO-Infinity's checkpoint saved and loaded into a new engine, the parameters and the optimizer on "
        "NVMe (fp16; skipped where the CPU has none)",
    ),
    Cases(
        "unit/v1/zero/test_zero_user_backward.py",
        r"::TestUnmanagedGradientAccumulationNvmeOffload::",
        "unmanaged gradient accumulation with the optimizer, and the parameters too, on NVMe",
    ),
    Cases(
        "unit/runtime/half_precision/test_fp16.py",
        # The module skips whole where the accelerator has no fp16. Of its stage-3 `cpu_offload` cases,
        # `TestZeroAllowUntestedOptimizer` is refused by DeepSpeed before any engine is built and
        # `TestZeroEmptyPartition` skips itself at stage 3.
        r"::Test(AdamFP16ZeroOneCycleCompatibility|ZeroStaticScale)::test\[True-3\]",
        "fp16 under a OneCycle schedule of lr and momentum, and with a static loss scale (skipped where "
        "the CPU has no fp16)",
    ),
    Cases(
        "unit/v1/pin_memory/test_destroy_unpin.py",
        r"\[3\]",
        "destroy() releases the optimizer's pinned host memory",
    ),
    Cases(
        "unit/v1/zero/test_zero_user_backward.py",
        r"Offload.*\[3\]",
        "unmanaged gradient accumulation with the optimizer offloaded",
    ),
    Cases(
        "unit/v1/half_precision/test_with_autocast.py",
        r"\[z3_",
        "gradients and parameters against DDP under torch.autocast",
    ),
    Cases(
        "unit/ops/muon/test_muon.py",
        # Collected only where the CPU has fp16. Muon: one pair (refused); Adam: the sizes, once each
        # (the last flag is Muon's, and the lr changes nothing the engine does differently), 6 of 32.
        r"\[(muon-3-0\.01-32-5-True-(True|False)|adam-3-0\.01-\d+-\d+-True-False)\]",
        "Muon (refused by name) and Adam from the config with the optimizer offloaded, fp16 (skipped "
        "where the CPU has none)",
    ),
    Cases(
        "unit/runtime/zenflow/test_zf.py",
        r"::TestZenFlowDistributed::.*\[auto-auto-auto-True-0-3\]",
        "ZenFlow's selective offload at stage 3",
    ),
    Cases(
        "unit/v1/half_precision/test_bf16.py",
        r"zero_stage_3_(bf16_opt_states_)?cpu_offload",
        "bf16 master weights and gradients against DDP",
    ),
]

# Errors that refuse a setting by name, with why it is not honoured: (node-id regex, message regex, why).
REFUSALS: list[tuple[str, str, str]] = [
    (
        r"test_zero_offloadpp\.py",
        r"offload_optimizer\.ratio",
        "on a GPU, stock's ratio keeps its first subgroups on the accelerator, stepped by torch's AdamW; "
        "ours does not update subgroups there yet (on DeepSpeed's CPU accelerator it runs, as stock's)",
    ),
    (
        # Collected only where the CPU has fp16 (DeepSpeed's CPU accelerator asks oneDNN): an Intel Xeon
        # with AVX512-FP16 has it, an AMD EPYC has not.
        r"test_muon\.py::.*\[muon-",
        r"the optimizer is \S*Muon\S*; mlp-offload runs DeepSpeed's CPU Adam",
        "Muon's update orthogonalises each whole matrix (Newton-Schulz), not element by element as the "
        "store's chunks are updated; not built",
    ),
]


def find_tests(given: str | None) -> Path | None:
    """The directory holding DeepSpeed's `unit/` tests, unpacking a tarball under target/ once."""
    candidates = (
        [given, os.environ.get("DEEPSPEED_TESTS")] if given or os.environ.get("DEEPSPEED_TESTS") else []
    )
    if not candidates:
        candidates = [str(p) for p in sorted(SHARED_SNAPSHOT.glob("tests-*.tar.gz"))]
    for candidate in filter(None, candidates):
        path = Path(candidate).resolve()
        if path.is_file() and path.name.endswith(".tar.gz"):
            digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
            unpacked = ROOT / "target" / "deepspeed-tests" / digest
            if not (unpacked / ".complete").exists():
                shutil.rmtree(unpacked, ignore_errors=True)
                unpacked.mkdir(parents=True)
                with tarfile.open(path) as tar:
                    tar.extractall(unpacked, filter="data")
                (unpacked / ".complete").touch()
            path = unpacked
        for tests in (path, path / "tests", *path.glob("*/tests")):
            if (tests / "unit" / "common.py").is_file():
                return tests
    return None


def suite_env(tests: Path, mode: str, run_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    # DeepSpeed's CPU accelerator, or the one the GPU report names (`cuda`).
    accelerator = os.environ.get("MLP_OFFLOAD_TEST_ACCELERATOR", "cpu")
    if accelerator == "cpu":
        # The CPU accelerator counts LOCAL_SIZE as its devices: the 2- and 4-rank cases run instead of
        # skipping.
        env["LOCAL_SIZE"] = "4"
    env.update(
        {
            "DS_ACCELERATOR": accelerator,
            # Fresh rank processes per case (they inherit the case's name and load sitecustomize).
            "DS_DISABLE_REUSE_DIST_ENV": "1",
            "DS_UNITTEST_TIMEOUT": "300",
            "TORCH_EXTENSIONS_DIR": str(ROOT / "target" / "torch_extensions"),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(tests)]),
            "MLP_OFFLOAD_DS_SUITE": mode,
            "MLP_OFFLOAD_DS_SUITE_RECORDS": str(run_dir / "records"),
            "MLP_OFFLOAD_DS_SUITE_STORES": str(run_dir / "stores"),
            "MLP_OFFLOAD_DS_SUITE_OUTCOMES": str(run_dir / "outcomes.jsonl"),
            "MLP_OFFLOAD_DS_SUITE_CURRENT": str(run_dir / "current-case"),
            # Probed once, by the first case's engines, then reused (the store paths do not change).
            "MLP_OFFLOAD_PROFILE_DIR": str(WORK / "profiles"),
            "PYTHONDONTWRITEBYTECODE": "1",
            # Both modes' ranks share two cores: OpenMP's waiting threads sleep rather than spin (as in
            # `tests/conftest.py`).
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
            # DeepSpeed builds its ops with the venv's ninja.
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        }
    )
    return env


def pytest_command(*args: str) -> list[str]:
    # The suite's own conftest.py applies; ours (and our pytest settings) do not. Its `pytest.ini` leaves
    # out the cases marked `sequential` (run on their own in DeepSpeed's CI, as the NVMe ones are): `-m ""`
    # takes them too, and `CASES` selects.
    return [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "suite_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-m",
        "",
        *args,
    ]


def collect(tests: Path, only: str | None) -> list[tuple[str, bool]]:
    """The selected cases: node id, and whether it runs in rank processes of its own (a DistributedTest;
    the others run in the pytest process, some on a fixed port)."""
    listing = WORK / "collected.txt"
    WORK.mkdir(parents=True, exist_ok=True)
    files = sorted({c.file for c in CASES})
    env = suite_env(tests, "collect", WORK)
    on_cpu = env["DS_ACCELERATOR"] == "cpu"
    env["MLP_OFFLOAD_DS_SUITE_LISTING"] = str(listing)
    done = subprocess.run(
        pytest_command("--collect-only", *files), cwd=tests, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(
            f"deepspeed-suite: collecting the cases failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    selected = []
    for line in listing.read_text().splitlines():
        nodeid, dist = line.rsplit(" ", 1)
        file, _, rest = nodeid.partition("::")
        if any(c.file == file and re.search(c.ids, "::" + rest) and (c.on_cpu or not on_cpu) for c in CASES):
            if only is None or re.search(only, nodeid):
                selected.append((nodeid, dist == "True"))
    return selected


MODES = ("stock", "ours")


def run_modes(tests: Path, cases: list[tuple[str, bool]]) -> dict[str, tuple[dict, dict, float]]:
    """Runs the cases stock and with ours, one pytest process per mode. The cases with rank processes
    of their own run in both modes at the same time (their ranks mostly wait on start-up and on each
    other, so two runs share two cores well; each mode takes its ports from its own range); the others,
    which run in the pytest process and may use a fixed port, run one mode after the other. Returns,
    per mode, each case's outcome, its engine records, and the mode's seconds."""
    for mode in MODES:
        shutil.rmtree(WORK / mode, ignore_errors=True)
        (WORK / mode / "records").mkdir(parents=True)
    seconds = dict.fromkeys(MODES, 0.0)
    distributed = [c for c, dist in cases if dist]
    in_process = [c for c, dist in cases if not dist]
    # Per phase its cases, and the modes run at once in each of its batches.
    phases: list[tuple[list[str], list[tuple[str, ...]]]] = [
        (distributed, [MODES]),
        (in_process, [(m,) for m in MODES]),
    ]
    for phase_cases, batches in phases:
        if not phase_cases:
            continue
        for batch in batches:
            started = time.monotonic()
            running = []
            for mode in batch:
                env = suite_env(tests, mode, WORK / mode)
                # DeepSpeed's tests pick ports from a range per xdist worker: one range per mode.
                env["PYTEST_XDIST_WORKER"] = f"gw{MODES.index(mode) + 1}"
                log = (WORK / mode / "pytest.log").open("a")
                command = pytest_command("--timeout", "600", *phase_cases)
                running.append((mode, subprocess.Popen(command, cwd=tests, env=env, stdout=log, stderr=log)))
            for mode, process in running:
                process.wait()
                seconds[mode] += time.monotonic() - started
    results = {}
    for mode in MODES:
        run_dir = WORK / mode
        outcomes: dict[str, dict] = {}
        path = run_dir / "outcomes.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            entry = json.loads(line)
            # A failed teardown after a passed call still fails the case.
            if entry["case"] not in outcomes or entry["outcome"] != "passed":
                outcomes[entry["case"]] = entry
        records: dict[str, list[dict]] = {}
        for file in (run_dir / "records").glob("*.jsonl"):
            for line in file.read_text().splitlines():
                entry = json.loads(line)
                records.setdefault(entry["case"], []).append(entry)
        shutil.rmtree(run_dir / "stores", ignore_errors=True)
        results[mode] = (outcomes, records, seconds[mode])
    return results


def verdict(case: str, stock: dict | None, ours: dict | None, stock_built: list, ours_built: list) -> str:
    if stock is None:
        return "stock failed: no outcome (see stock/pytest.log)"
    if stock["outcome"] == "skipped":
        return f"stock skipped: {stock['reason']}"
    if stock["outcome"] != "passed":
        passed = ours is not None and ours["outcome"] == "passed"
        return f"stock failed: {stock['reason']}" + (" (passed with ours)" if passed else "")
    if not any(r["device"] in ("cpu", "nvme") for r in stock_built):
        devices = sorted({r["device"] for r in stock_built}) or ["none built"]
        return f"not ours: stock built no stage-3 engine with the optimizer offloaded ({', '.join(devices)})"
    if ours is None:
        return "REGRESSION: no outcome with ours (see ours/pytest.log)"
    if ours["outcome"] != "passed":
        for case_pattern, message, _ in REFUSALS:
            if re.search(case_pattern, case) and re.search(message, ours["reason"]):
                return f"refused: {ours['reason']}"
        return f"REGRESSION: {ours['reason']}"
    swapped = [r for r in ours_built if r["swapped"]]
    if not swapped or not all(r["ours"] for r in swapped):
        return "HARNESS: passed without building our engine"
    # Where stock kept parameters on NVMe, ours must have kept them in our store.
    if any(r.get("param_swapper") for r in stock_built) and not all(
        r.get("param_swapper") == "StoreParamSwapper" for r in swapped
    ):
        return "HARNESS: passed without our parameters' swapper"
    return "pass"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", help="DeepSpeed's tests/ directory, a checkout holding it, or a tarball")
    parser.add_argument("--only", help="a regex over node ids: run only the selected cases that match")
    parser.add_argument("--out", default=str(WORK / "results.json"))
    args = parser.parse_args()
    tests = find_tests(args.tests)
    if tests is None:
        print(
            "deepspeed-suite: SKIPPED: DeepSpeed's tests not found (give --tests, set DEEPSPEED_TESTS to a "
            f"DeepSpeed checkout, or put the snapshot in {SHARED_SNAPSHOT})"
        )
        return 0
    selected = collect(tests, args.only)
    cases = [c for c, _ in selected]
    print(f"deepspeed-suite: {len(cases)} cases from {tests}, stock and with mlp-offload, CPU accelerator")
    results = run_modes(tests, selected)
    stock, stock_records, stock_secs = results["stock"]
    ours, ours_records, ours_secs = results["ours"]
    rows = []
    for case in cases:
        rows.append(
            {
                "case": case,
                "stock": stock.get(case),
                "ours": ours.get(case),
                "engines_stock": stock_records.get(case, []),
                "engines_ours": ours_records.get(case, []),
                "verdict": verdict(
                    case,
                    stock.get(case),
                    ours.get(case),
                    stock_records.get(case, []),
                    ours_records.get(case, []),
                ),
            }
        )
    width = max(len(r["case"]) for r in rows) if rows else 0
    for r in rows:
        print(f"{r['case']:<{width}}  {r['verdict']}")
    counts: dict[str, int] = {}
    for r in rows:
        key = r["verdict"].split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    print(
        "deepspeed-suite: "
        + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        + f" (stock {stock_secs:.0f} s, ours {ours_secs:.0f} s)"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {"tests": str(tests), "stock_secs": stock_secs, "ours_secs": ours_secs, "cases": rows}, indent=1
        )
    )
    bad = [r for r in rows if r["verdict"].startswith(("REGRESSION", "HARNESS"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
