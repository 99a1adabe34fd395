"""Deterministic streams of task references drawn from a weighted mix of datasets."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Container, Mapping, Sequence

from rewards.datasets import check_dataset, regenerate, stream_ref
from rewards.tasks import Task, TaskError

MAX_SKIPS = 10_000  # consecutive excluded draws after which a stream is taken to hold nothing else


@dataclass(frozen=True)
class DatasetMix:
    name: str
    config: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0


class TaskSource:
    """Draw the n-th task of a seeded stream; `position` is the whole state (saved in checkpoints). Tasks in
    `exclude` (the node's evaluation questions, `rewards.held_out`) are passed over and counted in `skipped`."""

    def __init__(self, mix: Sequence[DatasetMix], seed: int, position: int = 0, exclude: Container[Task] = ()):
        if not mix:
            raise ValueError("the task mix is empty")
        for item in mix:
            check_dataset(item.name, item.config)
        self.mix = list(mix)
        self.seed = seed
        self.position = position
        self.exclude = exclude
        self.skipped = 0

    def draw(self, n: int) -> list[Task]:
        tasks, run = [], 0
        while len(tasks) < n:
            task = self._task(self.position)
            self.position += 1
            if task not in self.exclude:
                tasks.append(task)
                run = 0
                continue
            self.skipped, run = self.skipped + 1, run + 1
            if run == MAX_SKIPS:
                raise TaskError(f"{MAX_SKIPS} draws in a row were evaluation questions: the task mix has no others")
        return tasks

    def _task(self, k: int) -> Task:
        rng = random.Random(f"{self.seed}:{k}")  # str seeds hash with sha512: stable across runs
        item = rng.choices(self.mix, weights=[m.weight for m in self.mix])[0]
        return regenerate(stream_ref(item.name, item.config, self.seed, k))
