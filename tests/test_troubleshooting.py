"""The registry of what a user can meet (`mlp_offload.adapter.troubleshooting`): its page and the
README's row of refusals are the code; every error the adapter raises at a user comes from it; every
entry whose text is made elsewhere is met for real by a test that matches it; io_uring refused by a
seccomp filter, as in a container, is met here."""

from __future__ import annotations

import ast
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

import seccomp
from mlp_offload.adapter import options, troubleshooting
from mlp_offload.adapter.troubleshooting import Trouble, met

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "python" / "mlp_offload" / "adapter"

# The adapter's raises whose text is not a user's to meet from the registry, and why.
NOT_FROM_THE_REGISTRY = {
    ("checkpoint.py", "state_dict"): "a guard: the option table refuses elastic_checkpoint at start",
    ("checkpoint.py", "universal_parts"): "DeepSpeed's own text, raised where stock raises it",
    ("checkpoint.py", "_load_universal_weights"): "DeepSpeed's own text, raised where stock raises it",
    ("deepspeed_view.py", "fp32_index"): "an internal lookup of the swapper protocol",
    ("options.py", "check"): "each part is troubleshooting.OPTION's message",
    ("troubleshooting.py", "readme"): "the docs' generator",
    ("param_swapper.py", "swap_in"): "a guard of DeepSpeed's status protocol, as its own assertion",
    ("param_swapper.py", "_follow_dtype"): "a guard: DeepSpeed's zero.Init builds a swapper per dtype",
    ("param_swapper.py", "swap_into_buffer"): "a guard of DeepSpeed's status protocol, as its own assertion",
    (
        "param_swapper.py",
        "reserve_available_buffers",
    ): "a guard: OFFLOAD_DEVICE refuses NVMe optimizer offload",
    ("param_swapper.py", "get_path"): "a guard: OFFLOAD_DEVICE refuses NVMe optimizer offload",
}


def test_the_page_and_the_readme_row_are_the_registry() -> None:
    hint = "`make docs-pages`"
    page = ROOT / "docs" / "troubleshooting.md"
    rendered = troubleshooting.markdown(options.refusals_markdown())
    assert page.read_text() == rendered, f"docs/troubleshooting.md differs: {hint}"
    readme = (ROOT / "README.md").read_text()
    assert troubleshooting.readme(readme, options.readme_keys()) == readme, (
        f"README.md's row of refusals differs: {hint}"
    )


def _from_registry(node: ast.AST) -> bool:
    """Whether `node` contains a call `troubleshooting.<ENTRY>.message(...)`."""
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "message"
        and isinstance(n.func.value, ast.Attribute)
        and isinstance(n.func.value.value, ast.Name)
        and n.func.value.value.id == "troubleshooting"
        for n in ast.walk(node)
    )


def _raises(tree: ast.Module) -> list[tuple[str, ast.Raise, ast.FunctionDef]]:
    """Each raise of a new exception, with the innermost function around it (`ast.walk` goes outside
    in, so an inner function's entry replaces its outer one's)."""
    found: dict[int, tuple[str, ast.Raise, ast.FunctionDef]] = {}
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                    found[id(node)] = (function.name, node, function)
    return list(found.values())


def _made_from_registry(raise_: ast.Raise, function: ast.AST, helpers: set[str]) -> bool:
    """The exception's text is the registry's: in the raise, in a name the function bound from it, or
    from a helper of the module that builds its exception from it."""
    assert isinstance(raise_.exc, ast.Call)
    if _from_registry(raise_) or getattr(raise_.exc.func, "id", None) in helpers:
        return True
    names = {n.id for n in ast.walk(raise_) if isinstance(n, ast.Name)}
    return any(
        isinstance(n, ast.Assign)
        and _from_registry(n.value)
        and any(getattr(t, "id", None) in names for t in n.targets)
        for n in ast.walk(function)
    )


def test_every_error_the_adapter_raises_comes_from_the_registry() -> None:
    unlisted, stale, used = [], set(NOT_FROM_THE_REGISTRY), set()
    for path in sorted(ADAPTER.glob("*.py")):
        tree = ast.parse(path.read_text())
        helpers = {
            f.name
            for f in tree.body
            if isinstance(f, ast.FunctionDef) and f.name.startswith("_") and _from_registry(f)
        }
        used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.isupper()}
        for function, raise_, node in _raises(tree):
            if _made_from_registry(raise_, node, helpers):
                continue
            stale.discard((path.name, function))
            if (path.name, function) not in NOT_FROM_THE_REGISTRY:
                unlisted.append(f"{path.name}:{raise_.lineno} in {function}")
    assert not unlisted, f"raised without an entry of the registry: {unlisted}"
    assert not stale, f"listed as not from the registry, but no such raise: {sorted(stale)}"
    constants = {name for name, value in vars(troubleshooting).items() if isinstance(value, Trouble)}
    formatted = {
        name for name in constants if getattr(troubleshooting, name) in troubleshooting.FORMATTED_HERE
    }
    assert formatted - used == set(), "entries formatted here that nothing says"


def test_every_text_made_elsewhere_is_met_by_a_test() -> None:
    """Each entry of `MET_BY_TESTS` is named in a test module that matches texts with `met`, by
    `met("<name>", ...)` or in a table whose rows it passes to `met`."""
    sources = [p.read_text() for p in (ROOT / "tests").rglob("*.py")]
    meeting = "\n".join(text for text in sources if re.search(r"\bmet\(", text))
    unmet = [t.name for t in troubleshooting.MET_BY_TESTS if f'"{t.name}"' not in meeting]
    assert not unmet, f"no test meets these entries: {unmet}"
    names = [t.name for t in troubleshooting.ENTRIES]
    assert len(names) == len(set(names)), "two entries of one name"


@pytest.mark.parametrize(
    ("says", "fields", "shown", "not_matched"),
    [
        ("{path} is full", {"path": "/a"}, "<path> is full", "/a is empty"),
        ("host {n:,} bytes", {"n": 4096}, "host <n> bytes", "host bytes"),
        ('set "x": {{"y": true}}, tag {tag!r}', {"tag": "t"}, 'set "x": {"y": true}, tag <tag>', "tag 't'"),
        ("no field (os error 2)", {}, "no field (os error 2)", "no field (os error 3)"),
    ],
)
def test_a_message_its_pattern_and_its_page_text(
    says: str, fields: dict[str, object], shown: str, not_matched: str
) -> None:
    trouble = Trouble("t", "T", says, troubleshooting.FAULT, "cause", "fix")
    assert trouble.pattern.search(f"[Errno 1] {trouble.message(**fields)}: 'x'")
    assert not trouble.pattern.search(not_matched)
    assert trouble.shown() == shown


# io_uring refused by a seccomp filter (`seccomp.DENY_IO_URING`), then the store imported and opened
# twice: io_uring asked for, and the default.
UNDER_SECCOMP = (
    seccomp.DENY_IO_URING
    + r"""
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from mlp_offload import ObjectStore
try:
    ObjectStore([sys.argv[1]], engine="io_uring")
    print("io_uring opened")
except ValueError as e:
    print(e)
with ObjectStore([sys.argv[1]]) as store:
    print("engine", store.engine)
"""
)


def test_io_uring_refused_by_seccomp_is_said(tmp_path: Path) -> None:
    """Asked for, io_uring refused is an error naming `engine`; by default, a warning and the thread
    pool, which then holds the store."""
    if not seccomp.supported():
        pytest.skip(f"no seccomp program for {platform.machine()}")
    run = subprocess.run(
        [sys.executable, "-c", UNDER_SECCOMP, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert met("io-uring-asked", out) and met("io-uring-fallback", out), out
    assert "engine threads" in out, out
