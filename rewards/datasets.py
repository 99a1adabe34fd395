"""The registry over every dataset a node knows (the built-in ones and reasoning-gym's): rebuild a task
from its reference, write a config out in full, check that a dataset can produce tasks.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from rewards import builtin, gym
from rewards.tasks import Task, TaskRef, UnknownDataset


def regenerate(ref: TaskRef) -> Task:
    """Rebuild the task a reference names; raises `UnknownDataset` or `TaskError`."""
    if ref.dataset.startswith(gym.PREFIX):
        return gym.regenerate(ref)
    if ref.dataset in builtin.DATASETS:
        return builtin.regenerate(ref)
    raise UnknownDataset(f"unknown dataset {ref.dataset!r} (built-in: {', '.join(builtin.DATASETS)}; reasoning-gym: '{gym.PREFIX}<name>')")


def canonical_config(dataset: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The config with the dataset's defaults written out, in JSON types, so that configs that make the
    same tasks compare equal (`{}` and `{"max_operand": 9, "ops": "+-"}` for arith). A config the dataset
    refuses, or an unknown dataset's, is returned as given."""
    if dataset.startswith(gym.PREFIX):
        full = {**gym.defaults(dataset[len(gym.PREFIX):]), **config}
        return json.loads(json.dumps(full, default=list))
    if dataset in builtin.DATASETS:
        try:
            return builtin.DATASETS[dataset][0](**config).model_dump(mode="json")
        except ValueError:
            pass
    return dict(config)


def stream_ref(name: str, config: Mapping[str, Any], seed: int, k: int) -> TaskRef:
    """The reference of the k-th task of stream `seed` (`rewards.source`): each adapter says how its streams map
    onto its entries."""
    if name.startswith(gym.PREFIX):
        return gym.stream_ref(name, dict(config), seed, k)
    return TaskRef(name, dict(config), seed=seed, index=k)


def check_dataset(name: str, config: Mapping[str, Any]) -> None:
    """Fail early, with the reason, if `name`/`config` cannot produce tasks."""
    regenerate(TaskRef(name, dict(config), seed=0, index=0))
