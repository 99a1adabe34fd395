"""Task references, tasks and the answer format every verifier reads: the definitions the rest of
rewards/ builds on (the registry that turns a reference back into a task is rewards/datasets.py).

A `TaskRef` is everything a peer needs to rebuild a question and its oracle answer, so rollouts
can cross the network without carrying (forgeable) answers or rewards.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

OPEN, CLOSE = "<answer>", "</answer>"
ANSWER_INSTRUCTION = f"Reply with {OPEN}final answer{CLOSE}."


class TaskError(ValueError):
    """A reference that names a known dataset but cannot be regenerated (bad config or index)."""

    reason = "unknown_task"  # the drop it counts as when the reference came from a peer


class UnknownDataset(TaskError):
    """A reference to a dataset this node does not know."""


@dataclass(frozen=True)
class TaskRef:
    dataset: str
    config: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    index: int = 0

    def key(self) -> str:
        """Canonical text form: equal references have equal keys on every machine."""
        return json.dumps([self.dataset, dict(self.config), self.seed, self.index], sort_keys=True, separators=(",", ":"))

    def __hash__(self) -> int:
        return hash(self.key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TaskRef) and self.key() == other.key()

    def rng(self) -> random.Random:
        """A generator seeded from the reference alone (stable across processes, unlike `hash`)."""
        digest = hashlib.sha256(self.key().encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "big"))


@dataclass(frozen=True)
class Task:
    ref: TaskRef
    question: str
    answer: str
    # The dataset's own verifier; None means exact match of the extracted answer.
    verify: Callable[[str], float] | None = field(default=None, compare=False, repr=False)

    @property
    def prompt(self) -> str:
        return task_prompt(self.question)


def task_prompt(question: str) -> str:
    """What a model is asked: the question and the answer format the verifier reads."""
    return f"{question}\n{ANSWER_INSTRUCTION}\n"
