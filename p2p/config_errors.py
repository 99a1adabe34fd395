"""One line per problem in a pydantic ValidationError, for every surface that takes settings: the node's config,
network profiles, the probe's and the scripts' flags. It lives in p2p, the lowest layer that reports such
errors, so that every surface words a bad value the same way."""

from __future__ import annotations

import difflib
import json

from pydantic import BaseModel, ValidationError

UNION_TAGS = {"bool", "int", "float", "str", "none"}  # how pydantic names the members of a union in a location


def _field_of(loc: tuple) -> str:
    """The knob a location names, without the union member pydantic tried ("literal['auto']", "bool")."""
    parts = [str(p) for p in loc]
    while parts and not parts[-1].isdigit() and (not parts[-1].isidentifier() or parts[-1] in UNION_TAGS):
        parts.pop()
    return ".".join(parts) or "config"


def known_names(model: type[BaseModel], loc: tuple) -> list[str]:
    """The setting names a model accepts where `loc` points (its last part is the name tried)."""
    for part in loc[:-1]:
        inner = model.model_fields.get(str(part))
        if inner is None or not (isinstance(inner.annotation, type) and issubclass(inner.annotation, BaseModel)):
            return []
        model = inner.annotation
    return list(model.model_fields)


def describe(e: ValidationError, model: type[BaseModel] | None = None) -> str:
    """One line per problem: 'grpo.lr: Input should be greater than 0 (got -1)'; a value no member of a
    union takes ('auto' or a number) is one problem: 'Input should be 'auto' or less than or equal to 0.95'.
    The value is not repeated where the message already names it. Given the `model` that was validated, an
    unknown name ('[grpoo]', 'grpo.lrr') gets the nearest known one."""
    problems: dict[str, tuple[list[str], str]] = {}
    for err in e.errors():
        got, msg = err.get("input"), err["msg"].removeprefix("Value error, ")  # our validators' own words
        if err["type"] == "extra_forbidden" and model is not None:
            close = difflib.get_close_matches(str(err["loc"][-1]), known_names(model, err["loc"]), n=1)
            msg = "unknown setting" + (f" (did you mean {'.'.join(map(str, (*err['loc'][:-1], close[0])))}?)" if close else "")
        repeated = isinstance(got, (dict, list)) or err["type"] == "missing" or str(got) in msg
        shown = "" if repeated else f" (got {json.dumps(got, default=str)})"
        messages, _ = problems.setdefault(_field_of(err["loc"]), ([], shown))
        messages.append(msg if not messages else msg.removeprefix("Input should be "))
    return "; ".join(f"{where}: {' or '.join(messages)}{shown}" for where, (messages, shown) in problems.items())
