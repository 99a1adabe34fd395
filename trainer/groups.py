"""`RolloutGroup`: a task and its G completions with this node's own scores, the unit every part of a
round passes along (generated, published, taken from the pool, selected, trained on). Torch-free, so the
node's policy modules can use it without loading the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from rewards import Score, Task, score_completion


@dataclass
class RolloutGroup:
    """G completions of one task. Rewards are always this node's own scores."""

    task: Task
    completions: list[str]
    rewards: list[float]
    truncated: list[bool]
    # Token ids from this node's own generator; None for text that came from elsewhere.
    completion_ids: list[list[int]] | None = None
    source: str = "local"
    correct: list[bool] = field(default_factory=list)
    # Rows a selection rule left out of the loss (node/selection.py, `guarded`); None: every row.
    used: list[bool] | None = None
    # Rows trained with the policy-shaped weight instead of the clipped ratio (`scoped`, trainer/loss.py); None: none.
    shaped: list[bool] | None = None


def scored_group(task: Task, texts: Sequence[str], format_weight: float, truncated: Sequence[bool] | None = None,
                 completion_ids: list[list[int]] | None = None, source: str = "local",
                 scores: Sequence[Score] | None = None) -> RolloutGroup:
    """Completions of a task with this node's verifier's scores, whoever generated them (`scores`:
    already scored in the sandbox of `rewards.untrusted`)."""
    scores = scores if scores is not None else [score_completion(task, t, format_weight) for t in texts]
    return RolloutGroup(task=task, completions=list(texts), rewards=[s.reward for s in scores],
                        truncated=list(truncated or [False] * len(texts)), completion_ids=completion_ids,
                        source=source, correct=[s.correct for s in scores])
