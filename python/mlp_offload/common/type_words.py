"""Types as the JSON the reference pages document holds them, in words: for the config's page
(`config_reference`) and the telemetry's (`engine.telemetry`)."""

from __future__ import annotations

import json
import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin

# Python's types as JSON holds them.
JSON_NAMES: dict[Any, str] = {bool: "bool", int: "int", float: "float", str: "string", Any: "any"}


def type_words(hint: Any, special: Callable[[Any], str | None] | None = None) -> str:
    """`hint` in words: unions as `a \\| b`, literal strings quoted, lists and objects of their items.
    `special`, where it gives words for a type (itself or within another), has the last word on it."""
    if special is not None and (words := special(hint)) is not None:
        return words
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return " \\| ".join(type_words(a, special) for a in args)
    if origin is Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in args)
    if origin is list:
        item = type_words(args[0], special)
        return f"list of ({item})" if "|" in item else f"list of {item}"
    if origin is dict:
        return f"object of {type_words(args[1], special)}"
    if hint is type(None):
        return "`null`"
    return JSON_NAMES.get(hint, str(hint))
