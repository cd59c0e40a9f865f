"""The package's layers: every module sits in one, and imports only its own layer and those below it
(app -> adapter -> engine -> common -> the Rust core). The package's `__init__` is the public API, which
only the application imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "mlp_offload"

# Each layer's rank: a module may import its own rank and lower ones. The public API (`mlp_offload`
# itself) gathers the adapter and the engine, so only the application is above it.
RANKS = {"app": 4, "api": 3.5, "adapter": 3, "engine": 2, "common": 1, "_core": 0}


def layer_of(module: str) -> str:
    """`mlp_offload.engine.state` -> "engine"; `mlp_offload` -> "api"; `mlp_offload._core` -> "_core"."""
    parts = module.split(".")
    assert parts[0] == "mlp_offload", module
    if len(parts) == 1:
        return "api"
    assert parts[1] in RANKS, f"{module} is in no layer"
    return parts[1]


def imported(tree: ast.Module) -> list[tuple[int, str]]:
    """Every module of the package that `tree` imports (a name from the package itself counts as that
    submodule where it is one, as `from mlp_offload import _core`), with its line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "mlp_offload"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mlp_offload":
            if node.module == "mlp_offload":
                names = [f"mlp_offload.{a.name}" for a in node.names]
                found += [(node.lineno, n if n.split(".")[1] in RANKS else "mlp_offload") for n in names]
            else:
                found.append((node.lineno, node.module))
    return found


def test_every_module_sits_in_a_layer_and_imports_only_downward() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 20, "the package's modules were not found"
    wrong = []
    for path in modules:
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(relative.parts)
        if parts[-1] == "__init__":
            parts.pop()
        module = ".".join(parts)
        if module == "mlp_offload":
            continue  # the public API
        layer = layer_of(module)
        assert layer in ("app", "adapter", "engine", "common"), f"{module} sits in no layer's subpackage"
        for line, target in imported(ast.parse(path.read_text())):
            if RANKS[layer_of(target)] > RANKS[layer]:
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} ({layer}) imports {target}")
    assert not wrong, "imports that run upward:\n" + "\n".join(wrong)


def test_the_check_finds_an_upward_import() -> None:
    """The check itself: an engine module importing the adapter is found, a downward import is not."""
    upward = ast.parse("from mlp_offload.adapter import zero3\nimport mlp_offload.common.units\n")
    ranks = [RANKS[layer_of(target)] for _, target in imported(upward)]
    assert ranks == [RANKS["adapter"], RANKS["common"]]
    assert [t for _, t in imported(ast.parse("from mlp_offload import _core, initialize"))] == [
        "mlp_offload._core",
        "mlp_offload",
    ]


def test_importing_the_package_leaves_deepspeed_unimported() -> None:
    """`import mlp_offload` (the store, the buffers, the CLI's probe) imports no DeepSpeed: operators
    probe their mounts where it is not installed, and DeepSpeed's import picks an accelerator, which
    should happen when a job asks for it. The adapter's modules that need it are imported by `install()`."""
    code = "import sys, mlp_offload; print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout[-2000:]
