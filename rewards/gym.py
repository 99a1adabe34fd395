"""Adapter for reasoning-gym: any registered dataset, addressed as `rg/<name>` plus its config.

The config travels in the reference (including `size`, which some generators depend on), so a
peer rebuilds the exact entry. reasoning-gym's `score_answer` gives partial credit to answers
that merely contain the oracle; rewards are therefore binary (full score or nothing).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from rewards.tasks import Task, TaskError, TaskRef, UnknownDataset

PREFIX = "rg/"
DEFAULT_SIZE = 100_000


@lru_cache(maxsize=64)
def _dataset(name: str, config_json: str, seed: int) -> Any:
    import reasoning_gym  # imported on first use: it registers ~100 datasets
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise UnknownDataset(f"reasoning-gym has no dataset {name!r}")
    config = json.loads(config_json)
    try:
        return reasoning_gym.create_dataset(name, seed=seed, **config)
    except (TypeError, ValueError, AssertionError) as e:
        raise TaskError(f"bad config for {PREFIX}{name}: {e}") from None


@lru_cache(maxsize=None)
def numeric_defaults(name: str) -> dict[str, float]:
    """The numeric fields of a dataset's config with their defaults ({} for an unknown dataset)."""
    import dataclasses

    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        return {}
    return {f.name: f.default for f in dataclasses.fields(DATASETS[name][1])
            if isinstance(f.default, (int, float)) and not isinstance(f.default, bool)}


def regenerate(ref: TaskRef) -> Task:
    name = ref.dataset[len(PREFIX):]
    config = {"size": DEFAULT_SIZE, **ref.config}
    dataset = _dataset(name, json.dumps(config, sort_keys=True), ref.seed)
    if not 0 <= ref.index < config["size"]:
        raise TaskError(f"index {ref.index} outside 0..{config['size'] - 1} for {ref.dataset}")
    entry = dataset[ref.index]

    def verify(answer: str) -> float:
        return 1.0 if dataset.score_answer(answer, entry) >= 1.0 else 0.0

    return Task(ref=ref, question=entry["question"], answer=str(entry["answer"]), verify=verify)
