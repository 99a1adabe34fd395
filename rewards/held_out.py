"""Which questions a node never trains on: those of its own evaluation set, so that held-out means held out by
content, not merely drawn with another seed.

A family's questions repeat across seeds when it has few: one-digit products have 100. An evaluation of 193 products
tasks held 86 distinct questions, most of them among the draws of the node that trained on products. Excluding them
is free where a family is large and impossible where the evaluation covers it: a family whose fresh draws hit the
evaluation set more often than `MAX_COVERAGE` is held out by seed only, said once at start and recorded
(`HeldOut.record`).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from rewards.datasets import canonical_config
from rewards.source import DatasetMix, TaskSource
from rewards.tasks import Task

log = logging.getLogger(__name__)

MAX_COVERAGE = 0.5  # above this share of fresh draws in the evaluation set, excluding them would leave too little
PROBES = 256  # fresh draws per family that measure its coverage
PROBE_SEED_OFFSET = 1_000_003  # the probes' stream: not the evaluation's own


def content_key(question: str) -> str:
    """What makes two tasks the same question: their text, whitespace aside."""
    return " ".join(question.split())


def family_key(task: Task) -> str:
    """A family: a dataset with its config written out in full."""
    return json.dumps([task.ref.dataset, canonical_config(task.ref.dataset, task.ref.config)], sort_keys=True)


@dataclass(frozen=True)
class HeldOut:
    """The evaluation's questions no training may use, and each family's coverage (share of fresh draws that are
    evaluation questions): `by_seed` families are too small to exclude."""

    questions: frozenset[str]
    coverage: dict[str, float]
    by_seed: frozenset[str]

    def __contains__(self, task: Task) -> bool:
        return content_key(task.question) in self.questions

    def record(self) -> dict:
        return {"questions": len(self.questions), "families": {
            f: {"coverage": round(c, 3), "held_out_by": "seed" if f in self.by_seed else "content"}
            for f, c in self.coverage.items()}}


def held_out(eval_tasks: Sequence[Task], probes: int = PROBES) -> HeldOut:
    """The held-out questions of `eval_tasks`, less those of families too small to hold out by content."""
    by_family: dict[str, set[str]] = defaultdict(set)
    example: dict[str, Task] = {}
    for task in eval_tasks:
        family = family_key(task)
        by_family[family].add(content_key(task.question))
        example.setdefault(family, task)
    coverage, by_seed = {}, set()
    for family, questions in by_family.items():
        ref = example[family].ref
        fresh = TaskSource([DatasetMix(ref.dataset, ref.config)], seed=ref.seed + PROBE_SEED_OFFSET).draw(probes)
        coverage[family] = sum(content_key(t.question) in questions for t in fresh) / probes
        if coverage[family] > MAX_COVERAGE:
            by_seed.add(family)
            log.warning("%s %s: %.0f%% of fresh draws are evaluation questions (too few questions to hold out): its "
                        "evaluation is held out by seed only, and the node trains on its evaluation's questions",
                        ref.dataset, json.dumps(dict(ref.config), sort_keys=True), 100 * coverage[family])
    kept = frozenset(q for f, qs in by_family.items() if f not in by_seed for q in qs)
    return HeldOut(kept, coverage, frozenset(by_seed))
