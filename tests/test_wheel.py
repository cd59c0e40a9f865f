"""The package as users get it: the portable wheel (`make dist`'s command) installed into a new virtual
environment, with no editable install and no repository on `sys.path`, run from a directory outside the
repository.

Its dependencies (torch, DeepSpeed, transformers: several GB) come from the development environment
through a path file, since CI has no time to download them again; the path file adds only that
directory, so the development environment's editable `mlp_offload.pth` is not read, and the package
itself comes from the wheel alone (checked).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from deepspeed_runs import free_port

# Builds and installs the wheel, then trains with it: a DeepSpeed run. Both tests on one pytest worker,
# which builds the wheel once: two builds at once race in the one cargo target directory. `make setup`
# built the module the same way (`make build-dev`), so the build here reuses its crates and only packs
# the wheel (a full release build took both cores for 1-4 minutes beside the other worker's tests).
pytestmark = pytest.mark.xdist_group("the wheel")
ROOT = Path(__file__).resolve().parent.parent
DEV_BIN = Path(sys.executable).parent


def run(command: list[str | Path], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", **env}
    full_env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"{command}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built and installed into `<dir>/venv`; returns `<dir>`, outside the repository."""
    d = tmp_path_factory.mktemp("wheel")
    dist = d / "dist"
    maturin: list[str | Path] = [
        DEV_BIN / "maturin",
        "build",
        "--release",
        "--zig",
        "--compatibility",
        "manylinux2014",
    ]
    run(
        [*maturin, "-i", sys.executable, "-o", dist],
        cwd=ROOT,
        PATH=f"{DEV_BIN}{os.pathsep}{os.environ['PATH']}",
    )
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    assert wheels[0].name.startswith("mlp_offload-") and "-abi3-" in wheels[0].name
    assert f"manylinux2014_{platform.machine()}" in wheels[0].name, wheels[0].name
    venv = d / "venv"
    run([sys.executable, "-m", "venv", venv], cwd=d)
    purelib = Path(
        run(
            [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=d,
        ).stdout.strip()
    )
    (purelib / "dev-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheels[0]], cwd=d)
    return d


def test_the_installed_package_comes_from_the_wheel(installed: Path) -> None:
    python = installed / "venv" / "bin" / "python"
    probe = "import mlp_offload, mlp_offload._core as c; print(mlp_offload.__file__); print(c.__file__)"
    files = run([python, "-c", probe], cwd=installed).stdout.split()
    assert all(f.startswith(str(installed / "venv")) for f in files), files
    assert not any(str(ROOT) in f for f in files), files


# The newest glibc the manylinux2014 tag allows the module to need.
MANYLINUX2014_GLIBC = (2, 17)


def test_the_module_needs_nothing_newer_than_glibc_2_17(installed: Path) -> None:
    """Every C library function the module calls resolves on glibc 2.17: versioned at most 2.17, or weak
    (looked up at run time). An unversioned strong reference (statx, called through glibc 2.28's wrapper,
    was one) links against zig's 2.17 stubs but fails at import on an older system."""
    python = installed / "venv" / "bin" / "python"
    module = run([python, "-c", "import mlp_offload._core as c; print(c.__file__)"], cwd=installed).stdout
    symbols = run(["nm", "-D", "--undefined-only", module.strip()], cwd=installed).stdout.splitlines()
    too_new = []
    for line in symbols:
        kind, name = line.split()[-2:]
        if kind.lower() == "w" or name.startswith(("Py", "_Py")):
            continue
        version = name.partition("@GLIBC_")[2]
        if not version or tuple(int(x) for x in version.split(".")[:2]) > MANYLINUX2014_GLIBC:
            too_new.append(name)
    assert not too_new, f"needs more than glibc 2.17: {too_new}"


def test_the_installed_cli_probes_plans_and_trains(installed: Path) -> None:
    bin_dir = installed / "venv" / "bin"
    tier = installed / "tier0"
    tier.mkdir(exist_ok=True)
    assert "plan" in run([bin_dir / "mlp-offload", "--help"], cwd=installed).stdout
    probe = ("--bytes", "16M", "--sustained-bytes", "64M", "--chunk-sizes", "1M,4M", "--depths", "2,8")
    workload = ("--together-secs", "0.5", "--params", "100M", "--host-memory", "256M", "--json")
    plan = run([bin_dir / "mlp-offload", "plan", *probe, *workload, tier], cwd=installed)
    planned = json.loads(plan.stdout)
    assert planned["plan"]["predicted_update_secs"] > 0 and len(planned["by_host_memory"]) > 1
    # A few ZeRO-3 steps through mlp_offload.initialize, as `make run` does them.
    out = installed / "run"
    job = ("--size", "tiny", "--steps", "3", "--no-progress", "--paths", tier, "--out", out)
    run(
        [bin_dir / "mlp-offload", "train", *job],
        cwd=installed,
        PATH=f"{bin_dir}{os.pathsep}{DEV_BIN}{os.pathsep}{os.environ['PATH']}",
        TORCH_EXTENSIONS_DIR=str(ROOT / "target" / "torch_extensions"),
        MASTER_PORT=str(free_port()),
    )
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["steps"]) == 3 and summary["subgroups"] >= 1
