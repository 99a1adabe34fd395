"""Sample completions for tasks and score them with this node's own verifier."""

from __future__ import annotations

from typing import Sequence

from rewards import Task
from trainer.groups import RolloutGroup, scored_group
from trainer.generation import Cancel, Generator, SamplingParams, never
from trainer.policy import Policy, encode_prompts


def rollout(generator: Generator, policy: Policy, tasks: Sequence[Task], params: SamplingParams,
            format_weight: float = 0.0, cancel: Cancel = never) -> list[RolloutGroup]:
    outputs = generator.generate(encode_prompts(policy, [t.prompt for t in tasks]), params, cancel)
    return [scored_group(task, [c.text for c in completions], format_weight,
                         truncated=[c.finish_reason == "length" for c in completions],
                         completion_ids=[c.token_ids for c in completions])
            for task, completions in zip(tasks, outputs)]


def mean_reward(groups: Sequence[RolloutGroup]) -> float | None:
    """The mean reward over every completion of `groups` (None for none)."""
    rewards = [x for g in groups for x in g.rewards]
    return sum(rewards) / len(rewards) if rewards else None


def accuracy(groups: Sequence[RolloutGroup]) -> float:
    flags = [c for g in groups for c in g.correct]
    return sum(flags) / max(1, len(flags))


def accuracy_by_dataset(groups: Sequence[RolloutGroup]) -> dict[str, float]:
    names = sorted({g.task.ref.dataset for g in groups})
    return {n: accuracy([g for g in groups if g.task.ref.dataset == n]) for n in names}


def evaluate(generator: Generator, policy: Policy, tasks: Sequence[Task], max_new_tokens: int,
             stop: Sequence[str], cancel: Cancel = never) -> list[RolloutGroup]:
    """Greedy completions of a fixed task set, scored: the numbers the learning claims rest on."""
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop=tuple(stop))
    return rollout(generator, policy, tasks, params, cancel=cancel)
