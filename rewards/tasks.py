"""Task references and the registry that turns a reference back into a task.

A `TaskRef` is everything a peer needs to rebuild a question and its oracle answer, so rollouts
can cross the network without carrying (forgeable) answers or rewards.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from rewards.scoring import ANSWER_INSTRUCTION


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


def regenerate(ref: TaskRef) -> Task:
    """Rebuild the task a reference names; raises `UnknownDataset` or `TaskError`."""
    from rewards import builtin, gym

    if ref.dataset.startswith(gym.PREFIX):
        return gym.regenerate(ref)
    if ref.dataset in builtin.DATASETS:
        return builtin.regenerate(ref)
    raise UnknownDataset(f"unknown dataset {ref.dataset!r} (built-in: {', '.join(builtin.DATASETS)}; reasoning-gym: '{gym.PREFIX}<name>')")


def canonical_config(dataset: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The config with the dataset's defaults written out, in JSON types, so that configs that make the
    same tasks compare equal (`{}` and `{"max_operand": 9, "ops": "+-"}` for arith). A config the dataset
    refuses, or an unknown dataset's, is returned as given."""
    from rewards import builtin, gym

    if dataset.startswith(gym.PREFIX):
        full = {**gym.defaults(dataset[len(gym.PREFIX):]), **config}
        return json.loads(json.dumps(full, default=list))
    if dataset in builtin.DATASETS:
        try:
            return builtin.DATASETS[dataset][0](**config).model_dump(mode="json")
        except ValueError:
            pass
    return dict(config)


def check_dataset(name: str, config: Mapping[str, Any]) -> None:
    """Fail early, with the reason, if `name`/`config` cannot produce tasks."""
    regenerate(TaskRef(name, dict(config), seed=0, index=0))
