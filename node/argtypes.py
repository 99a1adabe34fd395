"""argparse types for the scripts' numeric flags: a count of 0 or a negative period would otherwise surface as
a traceback or a silent hang minutes into a benchmark; argparse turns these errors into its one-line usage
error naming the flag, before anything starts."""

from __future__ import annotations

import argparse
import json
import math
from typing import Callable

from pydantic import BaseModel, ValidationError

from p2p.config_errors import describe


def bounded(kind: type, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
            le: float | None = None) -> Callable[[str], float]:
    """A finite `kind` (int or float) within the given bounds."""
    checks = [(gt, lambda v, b: v > b, ">"), (ge, lambda v, b: v >= b, ">="),
              (lt, lambda v, b: v < b, "<"), (le, lambda v, b: v <= b, "<=")]

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite (got {text})")
        for bound, ok, sign in checks:
            if bound is not None and not ok(value, bound):
                raise argparse.ArgumentTypeError(f"must be {sign} {bound:g} (got {text})")
        return value

    return parse


count = bounded(int, ge=1)
positive = bounded(float, gt=0)
fraction = bounded(float, ge=0, le=1)


def json_of(model: type[BaseModel]) -> Callable[[str], dict]:
    """A JSON object that `model` accepts, returned as given (the child process that receives it builds the
    model itself): a bad knob is named here, not in a child's traceback."""

    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
            model.model_validate(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        except ValidationError as e:
            raise argparse.ArgumentTypeError(describe(e)) from None
        return value

    return parse


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser: described by the first paragraph of `doc` (its docstring), and whole flags only. argparse
    takes a prefix by default, so `sapo_experiment.py --seed 3` ran `--seeds 3`, and a flag added later turns a
    prefix that worked into an error."""
    return argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()), allow_abbrev=False)
