"""mkdocs hooks: the README becomes the site's home page, and CONTRIBUTING.md and LICENSE pages of it.
They live at the repository's root, where GitHub shows them; their links to `docs/` are rewritten to the
site's pages, so each file is written once and read in both places."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
# Root file -> its page in the site.
PAGES = {"README.md": "index.md", "CONTRIBUTING.md": "contributing.md", "LICENSE": "license.md"}


def site_links(text: str) -> str:
    """A root file's links as the site's: `docs/x.md` is `x.md`, and the root files are their pages."""
    text = re.sub(r"\]\(docs/", "](", text)
    for name, page in PAGES.items():
        text = text.replace(f"]({name})", f"]({page})")
    return text


def _content(name: str) -> str:
    text = (ROOT / name).read_text()
    if name == "LICENSE":
        return f"# License\n\n```text\n{text}```\n"
    return site_links(text)


def on_files(files: Files, config: Any, **_: Any) -> Files:
    for name, page in PAGES.items():
        files.append(File.generated(config, page, content=_content(name)))
    return files
