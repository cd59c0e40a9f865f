"""Writes the pages generated from the code (`make docs-pages`): the config reference, the telemetry's
records, DeepSpeed's options, troubleshooting and the README's row of refusals. The tests check each
against its source, so a change to the code that leaves its page behind fails them."""

from __future__ import annotations

from pathlib import Path

from mlp_offload.adapter import options, troubleshooting
from mlp_offload.common import config_reference
from mlp_offload.engine import telemetry

ROOT = Path(__file__).resolve().parents[1]


def troubleshooting_page() -> str:
    """The registry's page with the option table's refusals, which the table renders."""
    return troubleshooting.markdown(options.refusals_markdown())


PAGES = {
    "docs/config.md": config_reference.markdown,
    "docs/telemetry.md": telemetry.markdown,
    "docs/options.md": options.markdown,
    "docs/troubleshooting.md": troubleshooting_page,
}


def main() -> None:
    for name, render in PAGES.items():
        (ROOT / name).write_text(render())
    readme = ROOT / "README.md"
    readme.write_text(troubleshooting.readme(readme.read_text(), options.readme_keys()))
    print(f"wrote {', '.join(PAGES)} and README.md's row of refusals")


if __name__ == "__main__":
    main()
