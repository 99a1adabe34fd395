"""Whether the node is learning, said in one line when it is not. In its first rounds, per task family, the
pass rate and the share of groups that carry signal: a family whose groups are all wrong (too hard, or the
answer never closes within max_new_tokens) or all right (too easy) teaches nothing, and the line names the
setting to change. At every evaluation, held-out accuracy against its start: a fall to below half of it,
beyond what the evaluation's noise explains, is a collapse (most often a learning rate too high for the
model): `Collapsed`, which the node warns about and trains on, or with `run.stop_on_collapse` stops on, its
earlier checkpoints and metrics kept. An evaluation too small to rest a stop on only warns.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass

from node.selection import informative
from trainer.groups import RolloutGroup

log = logging.getLogger(__name__)

FIRST_ROUNDS = 5  # rounds of the node's own groups the first report rests on
MIN_GROUPS = 4  # a family with fewer groups by then is reported when it has this many
TRUNCATED_MOST = 0.5  # all wrong and more than this share cut off at max_new_tokens: the length, not the task
COLLAPSE_SHARE = 0.5  # held-out accuracy below this share of its start ...
COLLAPSE_SIGMAS = 3.0  # ... and further below it than this many binomial standard errors of the start
STOP_MIN_TASKS = 100  # a stop rests on an evaluation of at least this many tasks; a smaller one only warns


class Collapsed(RuntimeError):
    """Held-out accuracy fell far below its start; the message says by how much and the likely cause."""


@dataclass
class Tally:
    groups: int = 0
    informative: int = 0  # groups GRPO gets a gradient from (node.selection.informative)
    all_wrong: int = 0
    all_right: int = 0
    completions: int = 0
    correct: int = 0
    truncated: int = 0

    def add(self, g: RolloutGroup) -> None:
        right = sum(g.correct)
        self.groups += 1
        self.informative += informative(g)
        self.all_wrong += right == 0
        self.all_right += right == len(g.correct)
        self.completions += len(g.correct)
        self.correct += right
        self.truncated += sum(g.truncated)


class LearningWatch:
    def __init__(self, max_new_tokens: int, lr: float, eval_size: int):
        self.max_new_tokens, self.lr, self.eval_size = max_new_tokens, lr, eval_size
        self.families: dict[str, Tally] = defaultdict(Tally)
        self.rounds = 0
        self.reported: set[str] = set()
        self.start: float | None = None  # held-out accuracy before the first step

    def observe(self, groups: list[RolloutGroup]) -> list[str]:
        """Count a round's own groups; the warnings due now (each family is judged once)."""
        self.rounds += 1
        for g in groups:
            self.families[g.task.ref.dataset].add(g)
        if self.rounds < FIRST_ROUNDS:
            return []
        due = {name: t for name, t in self.families.items() if name not in self.reported and t.groups >= MIN_GROUPS}
        self.reported |= set(due)
        if due and len(self.reported) == len(due):  # the first report: every family's figures, in one line
            log.info("first %d rounds, per task family: %s", self.rounds, "; ".join(
                f"{name} pass rate {t.correct / t.completions:.2f}, signal in {t.informative}/{t.groups} groups"
                for name, t in sorted(due.items())))
        warnings = [w for name, t in sorted(due.items()) if (w := self._no_signal(name, t))]
        for w in warnings:
            log.warning("%s", w)
        return warnings

    def _no_signal(self, name: str, t: Tally) -> str | None:
        if t.informative:
            return None
        head = f"tasks: {name} gave no signal in its first {t.groups} groups:"
        if t.all_wrong == t.groups:
            cut = t.truncated / t.completions
            if cut > TRUNCATED_MOST:
                return (f"{head} every completion wrong, {cut:.0%} of them cut off at generation.max_new_tokens "
                        f"{self.max_new_tokens} before the answer closed: raise generation.max_new_tokens")
            return (f"{head} every completion wrong: too hard for this model; lower its difficulty (its config in "
                    "tasks.datasets) or leave it out")
        if t.all_right == t.groups:
            return (f"{head} every completion right: too easy to teach anything; raise its difficulty (its config in "
                    "tasks.datasets) or leave it out")
        return (f"{head} each group all right or all wrong: raise generation.completions_per_group or "
                "generation.temperature")

    def evaluated(self, round_: int, accuracy: float | None) -> None:
        """Held-out accuracy at `round_` (0: the start); `Collapsed` when it fell far below the start."""
        if accuracy is None:
            return
        if self.start is None:
            self.start = accuracy
            return
        noise = math.sqrt(self.start * (1 - self.start) / self.eval_size)
        if accuracy >= COLLAPSE_SHARE * self.start or self.start - accuracy <= COLLAPSE_SIGMAS * noise:
            return
        why = (f"held-out accuracy fell from {self.start:.3f} to {accuracy:.3f} by round {round_}: the model is "
               f"unlearning; most likely grpo.lr {self.lr:g} is too high for it (lower it, e.g. --grpo.lr "
               f"{self.lr / 10:g}, and resume), or in a swarm peers' groups pull it away (selection.rule guarded)")
        if self.eval_size < STOP_MIN_TASKS:
            log.warning("%s; not stopping on an evaluation of %d tasks (tasks.eval_size; %d or more stop the node)",
                        why, self.eval_size, STOP_MIN_TASKS)
            return
        raise Collapsed(why)
