"""`docs/config.md`, the reference of the `"mlp_offload"` section, generated from `MLPOffloadConfig`: each
field's type, default and docstring (its first paragraph is the key's one line, the rest its details).
`make docs-pages` writes it; `tests/test_config.py` checks
that the page is what the code says."""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
import typing
from typing import Annotated, Any, get_args, get_origin

from annotated_types import Ge, Gt, MinLen
from pydantic import BeforeValidator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from mlp_offload.common import config as config_module
from mlp_offload.common.config import MLPOffloadConfig
from mlp_offload.common.type_words import type_words

# Pages that explain a key at length, where one is written.
DESIGN_PAGES = {
    "host_memory": "design/host-memory.md",
    "host_pages": "design/host-memory.md",
    "update_kernel": "design/update-kernel.md",
    "update_threads": "design/update-kernel.md",
    "overlap": "design/overlap.md",
    "overlap_backward": "design/overlap-backward.md",
    "master_in_params": "design/master-in-params.md",
    "device_inflight": "design/admission.md",
    "device_sharing": "design/admission.md",
}


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal after its annotation in the class body), dedented."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(MLPOffloadConfig)))
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _config_words(annotation: Any) -> str | None:
    """The config's own types: `size` (bytes, or a string such as `"16G"`), and a bounded `int`."""
    if get_origin(annotation) is not Annotated:
        return None
    args = get_args(annotation)
    if any(isinstance(m, BeforeValidator) and m.func is config_module._size for m in args[1:]):
        return "size"
    words = type_words(args[0], _config_words)
    for info in (m for m in args[1:] if isinstance(m, FieldInfo)):
        words += "".join(_bound_words(m) for m in info.metadata)
    return words


def field_type_words(info: FieldInfo) -> str:
    """A field's type with its bounds (`Field(ge=...)`), which bound its value where it is not null."""
    bounds = "".join(_bound_words(m) for m in info.metadata)
    words = type_words(info.annotation, _config_words)
    if bounds and words.endswith(" \\| `null`"):
        return words.removesuffix(" \\| `null`") + bounds + " \\| `null`"
    return words + bounds


def _bound_words(bound: Any) -> str:
    if isinstance(bound, Ge):
        return f" ≥ {bound.ge}"
    if isinstance(bound, Gt):
        return f" > {bound.gt}"
    if isinstance(bound, MinLen):
        return f", at least {bound.min_length}"
    return ""


def default_words(info: FieldInfo) -> str:
    """A field's default as JSON, or "required"."""
    return "required" if info.default is PydanticUndefined else f"`{json.dumps(info.default)}`"


def markdown() -> str:
    """`docs/config.md`: a table of every key, then each key's details."""
    docs = field_docs()
    fields = MLPOffloadConfig.model_fields
    example = typing.cast(str, config_module.__doc__).split("```json\n", 1)[1].split("```", 1)[0]
    lines = [
        '# The `"mlp_offload"` section',
        "",
        "Generated from `MLPOffloadConfig` "
        "(`make docs-pages`); `tests/test_config.py` "
        "checks this page against the code. The section goes beside ZeRO-3 with the optimizer offloaded "
        '(`"offload_optimizer": {"device": "cpu"}`, or DeepSpeed\'s NVMe section as it is); `paths` is '
        "the one key it needs. An unknown key is an error that names it.",
        "",
        "```json",
        example.rstrip(),
        "```",
        "",
        "| key | type | default | what it is |",
        "|---|---|---|---|",
    ]
    for name, info in fields.items():
        one_line = docs[name].split("\n\n", 1)[0].replace("\n", " ")
        lines.append(
            f"| [`{name}`](#{name}) | {field_type_words(info)} | {default_words(info)} | {one_line} |"
        )
    lines += ["", "## Each key", ""]
    for name in fields:
        # The first paragraph is the table's line; a key that has no more says it again.
        paragraphs = docs[name].split("\n\n")
        lines += [f"### {name}", "", *(p + "\n" for p in paragraphs[1:] or paragraphs)]
        if name in DESIGN_PAGES:
            lines += [f"More: [{DESIGN_PAGES[name]}]({DESIGN_PAGES[name]}).", ""]
    return "\n".join(lines).rstrip() + "\n"
