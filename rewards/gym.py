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
def defaults(name: str) -> dict[str, Any]:
    """A dataset's config fields with the defaults this adapter builds it with, in JSON types (tuples
    as lists; `size` is the adapter's, `seed` comes from the reference): {} for an unknown dataset."""
    import dataclasses

    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        return {}
    out = {}
    for f in dataclasses.fields(DATASETS[name][1]):
        if f.name == "seed":
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return json.loads(json.dumps({**out, "size": DEFAULT_SIZE}, default=list))


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
