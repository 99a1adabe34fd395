"""One line per problem in a pydantic ValidationError, for every surface that takes settings: the node's config,
network profiles, the probe's and the scripts' flags. It lives in p2p, the lowest layer that reports such
errors, so that every surface words a bad value the same way."""

from __future__ import annotations

import json

from pydantic import ValidationError

UNION_TAGS = {"bool", "int", "float", "str", "none"}  # how pydantic names the members of a union in a location


def _field_of(loc: tuple) -> str:
    """The knob a location names, without the union member pydantic tried ("literal['auto']", "bool")."""
    parts = [str(p) for p in loc]
    while parts and not parts[-1].isdigit() and (not parts[-1].isidentifier() or parts[-1] in UNION_TAGS):
        parts.pop()
    return ".".join(parts) or "config"


def describe(e: ValidationError) -> str:
    """One line per problem: 'grpo.lr: Input should be greater than 0 (got -1)'; a value no member of a
    union takes ('auto' or a number) is one problem: 'Input should be 'auto' or less than or equal to 0.95'.
    The value is not repeated where the message already names it."""
    problems: dict[str, tuple[list[str], str]] = {}
    for err in e.errors():
        got, msg = err.get("input"), err["msg"].removeprefix("Value error, ")  # our validators' own words
        repeated = isinstance(got, (dict, list)) or err["type"] == "missing" or str(got) in msg
        shown = "" if repeated else f" (got {json.dumps(got, default=str)})"
        messages, _ = problems.setdefault(_field_of(err["loc"]), ([], shown))
        messages.append(msg if not messages else msg.removeprefix("Input should be "))
    return "; ".join(f"{where}: {' or '.join(messages)}{shown}" for where, (messages, shown) in problems.items())
