"""Verifiable tasks: regenerate a task from its reference anywhere, and score answers strictly.

Rewards never come from the wire: any node regenerates a task from its `TaskRef` and scores
completions with its own verifier.
"""

from rewards.scoring import Score, can_carry_signal, extract_answer, score_completion
from rewards.source import TaskSource
from rewards.datasets import regenerate
from rewards.tasks import Task, TaskError, TaskRef, UnknownDataset

__all__ = [
    "Score",
    "Task",
    "TaskError",
    "TaskRef",
    "TaskSource",
    "UnknownDataset",
    "can_carry_signal",
    "extract_answer",
    "regenerate",
    "score_completion",
]
