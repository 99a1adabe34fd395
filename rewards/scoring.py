"""Strict answer extraction and scoring.

The documented format: a completion holds exactly one `<answer>...</answer>` block, with nothing
but whitespace after it; free text before it (reasoning) is allowed. The extracted answer is
compared whole, so stuffing, repeating or listing several answers earns nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from rewards import builtin
from rewards.tasks import ANSWER_INSTRUCTION, CLOSE, OPEN, Task, TaskError, TaskRef

__all__ = ["ANSWER_INSTRUCTION", "CLOSE", "OPEN", "Score", "can_carry_signal", "carries_signal", "extract_answer",
           "group_carries_signal", "score_completion"]

MAX_ANSWER_CHARS = 256


@dataclass(frozen=True)
class Score:
    reward: float
    correct: bool
    formatted: bool


def extract_answer(completion: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """The single answer in `completion`, or None when the format is not met exactly."""
    if completion.count(OPEN) != 1 or completion.count(CLOSE) != 1:
        return None
    head, _, rest = completion.partition(OPEN)
    answer, _, tail = rest.partition(CLOSE)
    if CLOSE in head or tail.strip():
        return None
    answer = answer.strip()
    if not answer or len(answer) > max_chars:
        return None
    return answer


def score_completion(task: "Task", completion: str, format_weight: float = 0.0) -> Score:
    """Reward = correctness (0 or 1) + `format_weight` if the answer format is met."""
    answer = extract_answer(completion)
    if answer is None:
        return Score(reward=0.0, correct=False, formatted=False)
    correct = (task.verify(answer) >= 1.0) if task.verify else (answer == task.answer.strip())
    return Score(reward=float(correct) + format_weight, correct=correct, formatted=True)


def can_carry_signal(completions: list[str]) -> bool:
    """False when every completion yields the same extracted answer (or none does): any verifier then
    gives them equal rewards, so the group has zero GRPO advantage for every receiver."""
    return len({extract_answer(c) for c in completions}) > 1


def group_carries_signal(group) -> bool:
    """`carries_signal` for a group as it comes off the wire (anything with dataset, config, seed, index and
    completions): the check the gossip layer is handed, so that it never parses answers itself."""
    return carries_signal(TaskRef(group.dataset, group.config, group.seed, group.index), group.completions)


def carries_signal(ref: "TaskRef", completions: list[str]) -> bool:
    """Whether a group can teach any receiver. A built-in task is cheap to rebuild (its config is bounded
    by its own model; no sandbox needed), so it is regenerated and the group must hold both a right and
    a wrong completion: two different wrong answers score alike. For other datasets, whose regeneration
    may be costly, two different extracted answers (`can_carry_signal`)."""
    if ref.dataset not in builtin.DATASETS:
        return can_carry_signal(completions)
    try:
        task = builtin.regenerate(ref)
    except TaskError:  # a config no receiver can rebuild: nobody can score it
        return False
    return len({score_completion(task, c).correct for c in completions}) > 1
