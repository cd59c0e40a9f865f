"""The README as a user reads it: short, install and quick start first, and every figure it quotes the
one the headline table of docs/results.md gives with its command, commit and data. (The site's links,
anchors and pages are checked by `make docs`, `mkdocs build --strict`, in `make test`.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text().splitlines()
NUMBER = re.compile(r"\d+(?:\.\d+)?")


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
