from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# What the tests share (the harnesses, their server, the runs' comparison, the test cluster, the faulty file
# system) is in support/, imported by its modules' names, as the harnesses import each other there.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# OpenMP's waiting threads sleep at once (libgomp spins first by default). Two pytest workers on two cores
# each run torch and DeepSpeed's CPU Adam on two OpenMP threads: spinning, the waiting threads took the
# cores from the working ones (docs/history/testing.md, "OpenMP's threads wait passively").
# Set before torch loads libgomp, which reads it once; every run and harness server started from here
# inherits it. The threads, and what each computes, are the same either way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import mlp_offload
from mlp_offload.engine import profiles

ENGINES = ["io_uring", "threads"]

# Tests whose ranks share the work disk's device through node-wide admission run one after another, never
# beside each other (`pytest -n`): one node-wide semaphore per device and user.
ONE_NODE = pytest.mark.xdist_group("node-wide admission")

# The modules every test of which starts DeepSpeed (a training run, or its CPU Adam op): their tests are
# marked `deepspeed`, which `make test-python-quick` leaves out (`-m "not deepspeed"`), and where DeepSpeed
# is not installed each module is skipped before it is imported. Modules of which only some tests start
# DeepSpeed mark those tests themselves.
NEEDS_DEEPSPEED = {
    "test_backward.py",
    "test_bitexact.py",
    "test_checkpoints.py",
    "test_cluster.py",
    "test_compat.py",
    "test_faults.py",
    "test_frameworks.py",
    "test_harness.py",
    "test_kernel.py",
    "test_megatron.py",
    "test_options.py",
    "test_refusals.py",
    "test_state_dtypes.py",
    "test_wheel.py",
}


class _WithoutDeepSpeed(pytest.Module):
    """A module of `NEEDS_DEEPSPEED` where DeepSpeed is not installed: skipped, never imported."""

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        pytest.skip("DeepSpeed is not installed", allow_module_level=True)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if module_path.name not in NEEDS_DEEPSPEED:
        return None
    installed = importlib.util.find_spec("deepspeed") is not None
    module = (pytest.Module if installed else _WithoutDeepSpeed).from_parent(parent, path=module_path)
    module.add_marker(pytest.mark.deepspeed)
    return module


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    """Every test that takes `engine` runs once per I/O engine."""
    if request.param == "io_uring" and (why := mlp_offload.io_uring_unavailable_reason()):
        pytest.skip(f"io_uring unavailable here: {why}")
    return request.param


@pytest.fixture(autouse=True)
def profile_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Saved probe profiles go to a directory of the test's own (subprocesses inherit it)."""
    d = tmp_path / "profiles"
    monkeypatch.setenv("MLP_OFFLOAD_PROFILE_DIR", str(d))
    return d


@pytest.fixture(autouse=True)
def harness_deadline(request: pytest.FixtureRequest) -> Iterator[None]:
    """The DeepSpeed runs a test starts end before pytest-timeout would end the test: a hung run then
    fails its test with its ranks' logs and stacks, and the worker's harness server is ready for the next
    (`deepspeed_runs.batch_timeout`)."""
    import deepspeed_runs

    marker = request.node.get_closest_marker("timeout")
    if marker is not None:
        limit = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        limit = request.config.getoption("timeout", None) or request.config.getini("timeout")
    deepspeed_runs.set_test_deadline(float(limit) if limit else None)
    yield
    deepspeed_runs.set_test_deadline(None)


def work_disk() -> Path:
    """Where the tests' storage paths go: the work disk (not /tmp, which may be tmpfs elsewhere)."""
    base = Path(os.environ.get("MLP_OFFLOAD_TEST_DIR", Path(__file__).resolve().parent.parent / "target"))
    base.mkdir(parents=True, exist_ok=True)
    return base


@pytest.fixture
def work_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Path]]:
    """Three directories on the work disk."""
    base = work_disk()
    root = Path(tmp_path_factory.mktemp("store", numbered=True))
    import tempfile

    with tempfile.TemporaryDirectory(dir=base, prefix="pytest-") as d:
        paths = [Path(d) / f"path{i}" for i in range(3)]
        for p in paths:
            p.mkdir()
        yield paths
    del root


@pytest.fixture(scope="session")
def probed_root() -> Iterator[Path]:
    """This worker's directory for `probed_paths`, on the work disk (as `work_dirs`)."""
    import tempfile

    with tempfile.TemporaryDirectory(dir=work_disk(), prefix="pytest-probed-") as d:
        yield Path(d)


def work_disk_profile(ranks: int) -> profiles.Profile:
    """The work disk's profile for jobs of `ranks` ranks a node: two directories of
    `target/pytest-probes/` probed as the README's section probes them, once for both workers (the
    node's probe lock makes the worker that asks second wait and reuse it), and kept from session to
    session while fresh, as a user's saved profile is (docs/history/testing.md: what a probe costs the
    suite)."""
    root = work_disk() / "pytest-probes"
    pair = [root / f"{ranks}-ranks" / f"path{i}" for i in range(2)]
    for path in pair:
        path.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLP_OFFLOAD_PROFILE_DIR", str(root / "profiles"))
        return profiles.load_or_probe(pair, profiles.ProbeOptions(ranks=ranks))[0]


@pytest.fixture
def probed_paths(probed_root: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[Path]]:
    """Two directories on the work disk for the README's section (`weights: "auto"`, which probes new
    paths first), given the job's ranks per node, and those of later jobs on the same paths (a resume on
    another number of ranks): the same ones for every test of this worker that asks, as a user's jobs
    reuse their paths, with the work disk's profile for each rank count saved for them, as a user's
    second job finds it (`work_disk_profile`: both pairs are on the one device the probe measured). The
    tests on this worker run one at a time; a test of several ranks is in the `xdist_group` of the other
    tests whose ranks share the device."""
    monkeypatch.setenv("MLP_OFFLOAD_PROFILE_DIR", str(probed_root / "profiles"))

    def paths(ranks: int, *later_ranks: int) -> list[Path]:
        # One pair per rank count: the probe measures how a node's ranks share a device.
        pair = [probed_root / f"{ranks}-ranks" / f"path{i}" for i in range(2)]
        for path in pair:
            path.mkdir(parents=True, exist_ok=True)
        keys = [os.path.realpath(p) for p in pair]
        for each in (ranks, *later_ranks):
            measured = work_disk_profile(each)
            probes = [{**probe, "path": key} for probe, key in zip(measured.probes, keys, strict=True)]
            profiles.save_profile(profiles.Profile(keys, probes, measured.probed_at, measured.options))
        return pair

    return paths


@pytest.fixture(scope="module")
def stock_resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DeepSpeed's own round trip: stock saves at step 5, a stock engine resumes and, at the end, saves
    the 16-bit model (its directories under `"dir"`)."""
    from deepspeed_runs import run_case

    d = tmp_path_factory.mktemp("stock")
    case = {"checkpoint_at": 5, "checkpoint_dir": str(d / "ckpt"), "save_16bit": str(d / "model16")}
    return {**run_case(case, d, "stock-resumed"), "dir": d}


def is_root() -> bool:
    return os.geteuid() == 0


def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `mnt` (root only), for running out of space for real; unmounted after."""
    yield from _mounted(mnt, "tmpfs", "-o", f"size={size}")


def mounted_ramfs(mnt: Path) -> Iterator[Path]:
    """A ramfs at `mnt` (root only): no O_DIRECT on any kernel (tmpfs has it since Linux 6.6), no size."""
    yield from _mounted(mnt, "ramfs")


def _mounted(mnt: Path, kind: str, *options: str, source: str = "") -> Iterator[Path]:
    if not is_root():
        pytest.skip(f"mounting a {kind} needs root")
    mnt.mkdir()
    subprocess.run(["mount", "-t", kind, *options, source or kind, str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A ramfs (`mounted_ramfs`)."""
    yield from mounted_ramfs(tmp_path / "ramfs")


@pytest.fixture
def dirs_with_room(work_dirs: list[Path], tmp_path: Path) -> Iterator[list[Path]]:
    """Three directories on a file system that keeps far more than a tenth of itself free, the room the
    update during backward leaves every path (`KEEP_FREE_PART`): `work_dirs` where the work disk does
    (a shared disk may not: CI's once kept 9.7%), else a 1 GiB ext4 image mounted through a loop device
    (root only), with O_DIRECT as the disk's."""
    from mlp_offload.engine.state import KEEP_FREE_PART

    fs = os.statvfs(work_dirs[0])
    if fs.f_bavail * KEEP_FREE_PART > 2 * fs.f_blocks:
        yield work_dirs
        return
    if not is_root():
        pytest.skip("the work disk keeps less than a fifth free, and mounting an ext4 image needs root")
    image = tmp_path / "room.ext4"
    subprocess.run(["truncate", "-s", "1G", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    mounted = _mounted(tmp_path / "room", "ext4", "-o", "loop", source=str(image))
    mnt = next(mounted)
    paths = [mnt / f"path{i}" for i in range(3)]
    for path in paths:
        path.mkdir()
    yield paths
    next(mounted, None)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs."""
    yield from mounted_tmpfs(tmp_path / "small", "2m")


# Each test phase's worker, id and wall-clock span, as the run's reports arrive (with pytest-xdist, in the
# controlling process): the summary says what ran beside the slowest, so a test slowed by its neighbour
# (two cores shared by several ranks) shows in CI's log.
SLOWEST_WITH_NEIGHBOURS = 3
_spans: list[tuple[str, str, float, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when in ("setup", "call") and report.stop - report.start >= 1.0:
        gateway = getattr(getattr(report, "node", None), "gateway", None)
        name = f"{report.nodeid} ({report.when})"
        _spans.append((getattr(gateway, "id", "main"), name, report.start, report.stop))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    slowest = sorted(_spans, key=lambda s: s[3] - s[2])[-SLOWEST_WITH_NEIGHBOURS:]
    if not slowest or all(worker == "main" for worker, *_ in _spans):
        return
    terminalreporter.section("the slowest, and what ran beside them")
    for worker, name, start, stop in reversed(slowest):
        terminalreporter.write_line(f"{stop - start:.1f} s [{worker}] {name}")
        for other, beside, b_start, b_stop in _spans:
            shared = min(stop, b_stop) - max(start, b_start)
            if other != worker and shared >= 1.0:
                terminalreporter.write_line(f"    {shared:6.1f} s beside [{other}] {beside}")
