"""Deterministic streams of task references drawn from a weighted mix of datasets."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from rewards.datasets import check_dataset, regenerate
from rewards.tasks import Task, TaskRef


@dataclass(frozen=True)
class DatasetMix:
    name: str
    config: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0


class TaskSource:
    """Draw the n-th task of a seeded stream; `position` is the whole state (saved in checkpoints)."""

    def __init__(self, mix: Sequence[DatasetMix], seed: int, position: int = 0):
        if not mix:
            raise ValueError("the task mix is empty")
        for item in mix:
            check_dataset(item.name, item.config)
        self.mix = list(mix)
        self.seed = seed
        self.position = position

    def draw(self, n: int) -> list[Task]:
        tasks = [self._task(self.position + i) for i in range(n)]
        self.position += n
        return tasks

    def _task(self, k: int) -> Task:
        rng = random.Random(f"{self.seed}:{k}")  # str seeds hash with sha512: stable across runs
        item = rng.choices(self.mix, weights=[m.weight for m in self.mix])[0]
        return regenerate(TaskRef(item.name, dict(item.config), seed=self.seed, index=k))
