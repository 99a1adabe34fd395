"""Built-in tasks small enough that a tiny model can learn them on a CPU in minutes.

Each dataset has a typed config (its difficulty knobs) and a generator that draws one
question/answer pair from the reference's own random stream.
"""

from __future__ import annotations

import random
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rewards.tasks import Task, TaskError, TaskRef


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ArithConfig(_Config):
    max_operand: int = Field(9, ge=1, le=10**6, description="operands are drawn from 0..max_operand")
    ops: str = Field("+-", pattern=r"^[+\-*]+$", description="operators to draw from (+, -, *)")
    max_second: int | None = Field(None, ge=1, le=10**6, description="the second operand is drawn from 0..max_second "
                                   "(default: max_operand): one-digit by two-digit products are 9 and 99")


class ReverseConfig(_Config):
    min_len: int = Field(3, ge=1, le=64)
    max_len: int = Field(5, ge=1, le=64)
    alphabet: str = Field("abcdefghij", min_length=2)

    @model_validator(mode="after")
    def _lengths(self) -> "ReverseConfig":
        if self.min_len > self.max_len:
            raise ValueError("min_len must not exceed max_len")
        return self


class CountConfig(ReverseConfig):
    min_len: int = Field(4, ge=1, le=64)
    max_len: int = Field(8, ge=1, le=64)
    alphabet: str = Field("abc", min_length=2)


def _arith(cfg: ArithConfig, rng: random.Random) -> tuple[str, str]:
    op = rng.choice(cfg.ops)
    a, b = rng.randint(0, cfg.max_operand), rng.randint(0, cfg.max_second or cfg.max_operand)
    if op == "-" and b > a:
        a, b = b, a  # keep answers non-negative: one less thing for a tiny model to learn
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a}{op}{b}=?", str(value)


def _word(cfg: ReverseConfig, rng: random.Random) -> str:
    return "".join(rng.choice(cfg.alphabet) for _ in range(rng.randint(cfg.min_len, cfg.max_len)))


def _reverse(cfg: ReverseConfig, rng: random.Random) -> tuple[str, str]:
    word = _word(cfg, rng)
    return f"reverse {word}", word[::-1]


def _count(cfg: CountConfig, rng: random.Random) -> tuple[str, str]:
    word = _word(cfg, rng)
    letter = rng.choice(cfg.alphabet)
    return f"count {letter} in {word}", str(word.count(letter))


DATASETS: dict[str, tuple[type[_Config], Callable]] = {
    "arith": (ArithConfig, _arith),
    "reverse": (ReverseConfig, _reverse),
    "count": (CountConfig, _count),
}


def regenerate(ref: TaskRef) -> Task:
    config_cls, make = DATASETS[ref.dataset]
    try:
        cfg = config_cls(**ref.config)
    except ValidationError as e:
        raise TaskError(f"bad config for {ref.dataset!r}: {_first_error(e)}") from None
    if ref.index < 0:
        raise TaskError(f"task index must be >= 0, got {ref.index}")
    question, answer = make(cfg, ref.rng())
    return Task(ref=ref, question=question, answer=answer)


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "config"
    return f"{where}: {err['msg']}"
