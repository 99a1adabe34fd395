"""Adapter for reasoning-gym: any registered dataset, addressed as `rg/<name>` plus its config.

The config travels in the reference (including `size`, which some generators depend on), so a peer rebuilds the
exact entry. reasoning-gym builds entry `i` of seed `s` from the seed `s + i`, so two streams whose seeds are close
(nodes `base + k` of one swarm, a node and its evaluation) would run through the same entries shifted: `stream_ref`
spreads each stream's seed apart by a hash. reasoning-gym's `score_answer` gives partial credit to answers that
merely contain the oracle; rewards are therefore binary (full score or nothing).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from typing import Any

from rewards.tasks import Task, TaskError, TaskRef, UnknownDataset

PREFIX = "rg/"
DEFAULT_SIZE = 100_000
STREAM_SEEDS = 2**31  # spread seeds lie below this, so seed + index stays below 2**32 (some generators seed numpy
# with it); two streams share entries with odds of about 2 * size / 2**31 (1e-4 a pair at the default size)


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


def stream_ref(name: str, config: dict[str, Any], seed: int, k: int) -> TaskRef:
    """The k-th reference of stream `seed`: after `size` entries a stream moves on to a fresh seed, since an index
    past the dataset's size is refused."""
    size = config.get("size", DEFAULT_SIZE)
    digest = hashlib.sha256(f"{PREFIX}stream:{seed}:{k // size}".encode()).digest()
    return TaskRef(name, config, seed=int.from_bytes(digest[:8], "big") % STREAM_SEEDS, index=k % size)


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
