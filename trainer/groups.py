"""`RolloutGroup`: a task and its G completions with this node's own scores, the unit every part of a
round passes along (generated, published, taken from the pool, selected, trained on). Torch-free, so the
node's policy modules can use it without loading the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rewards import Task


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
