"""The README as a user reads it: short, install and quick start first, and every figure it quotes the
one the headline table of docs/results.md gives with its command, commit and data. docs/data holds only
the data a page or the code names, and stays small. (The site's links, anchors and pages are checked by
`make docs`, `mkdocs build --strict`, in `make test`.)"""

from __future__ import annotations

import fnmatch
import itertools
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text().splitlines()
NUMBER = re.compile(r"\d+(?:\.\d+)?")
DATA = ROOT / "docs" / "data"
# What a page links to or shows, and what a bench writes there: each run's medians and figures per run,
# the per-step records left in git history (docs/results.md's opening).
DATA_LIMIT_BYTES = 1_000_000
# A data file as pages and code name it: a path, a glob (`run-*.json`) or braces (`-{before,after}.json`).
DATA_NAME = re.compile(r"[\w.{},*/-]+\.(?:json|png)")
# Where it is named: the pages (the README and CONTRIBUTING.md too), and the code that writes or reads it.
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")]
CODE = [ROOT / "Makefile"] + [
    path
    for folder in ("benches", "scripts", "tests", "python")
    for path in (ROOT / folder).rglob("*")
    if path.suffix in (".py", ".sh", ".rs")
]


def _table_after(lines: list[str], heading: str) -> list[list[str]]:
    """The cells of the first table after `heading`, its header and rule left out."""
    start = lines.index(heading)
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def test_the_readme_is_short_and_starts_with_what_a_user_needs() -> None:
    assert len(README) <= 200, f"README.md has {len(README)} lines"
    for heading in ("## Measured", "## Install", "## Quick start"):
        assert README.index(heading) < 60, f"{heading} at line {README.index(heading) + 1}"


def test_every_figure_the_readme_quotes_is_in_the_results_headline_table() -> None:
    results = (ROOT / "docs" / "results.md").read_text().splitlines()
    headline = _table_after(results, "## The figures the README quotes")
    measured = {number for row in headline for number in NUMBER.findall(row[0])}
    rows = _table_after(README, "## Measured")
    assert rows, "README.md's table of measured figures"
    for workload, _, speed_up, *_ in rows:
        missing = [n for n in NUMBER.findall(speed_up) if n not in measured]
        assert not missing, f"README's {workload!r}: {missing} not in docs/results.md's headline table"


def _expanded(name: str) -> list[str]:
    """`a-{b,c}-{1,2}.json` as its four names."""
    parts = re.split(r"\{([^{}]*)\}", name)
    choices = [part.split(",") if i % 2 else [part] for i, part in enumerate(parts)]
    return ["".join(chosen) for chosen in itertools.product(*choices)]


def _names_in(source: Path, *, bare: bool) -> Iterator[str]:
    """The data files `source` names, relative to docs/data: by path (`docs/data/x.json`, `../data/x.json`)
    and, where `bare`, by name alone (`x.json`); a glob only by path (the code's `*.json` are its own)."""
    for match in DATA_NAME.findall(source.read_text()):
        if "data/" in match or (bare and "*" not in match):
            yield from (name.rsplit("data/", 1)[-1] for name in _expanded(match))


def _named_data() -> set[str]:
    """Every data file a page names, or the code by its path."""
    return {
        *(name for page in PAGES for name in _names_in(page, bare=True)),
        *(name for code in CODE for name in _names_in(code, bare=False)),
    }


def _data_files() -> list[Path]:
    return sorted(path for path in DATA.rglob("*") if path.is_file())


def test_every_data_file_is_named_by_a_page_or_the_code() -> None:
    named = _named_data()
    globs = [name for name in named if "*" in name]
    unnamed = [
        rel
        for rel in (path.relative_to(DATA).as_posix() for path in _data_files())
        if rel not in named and not any(fnmatch.fnmatchcase(rel, glob) for glob in globs)
    ]
    assert not unnamed, f"docs/data files no page or code names (delete them: git keeps them): {unnamed}"


def test_the_data_stays_small() -> None:
    size = sum(path.stat().st_size for path in _data_files())
    assert size < DATA_LIMIT_BYTES, f"docs/data holds {size:,} bytes: leave per-step records to git history"
