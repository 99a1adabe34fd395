"""Whether the node is learning, said in one line when it is not. In its first rounds, per task family, the
pass rate and the share of groups that carry signal: a family whose groups are all wrong (too hard, the answer
never closes within max_new_tokens, or the model writes no answer tag at all: untrained or random weights) or all
right (too easy) teaches nothing, and the line names the setting to change, or what the model lacks. At every
evaluation, held-out accuracy against its start, overall and per task family: a fall beyond what two evaluations'
noise explains, and large enough to matter, is said once, naming the family and the likely cause (most often a learning rate too high for the model); an overall fall to below half the
start is a collapse: `Collapsed`, which the node warns about and trains on, or with `run.stop_on_collapse` stops
on, its earlier checkpoints and metrics kept. An evaluation too small to rest a stop on only warns. Before the
first full evaluation an early probe (`probe_rounds`) measures a subset of the held-out tasks against its own
start, and only warns.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from node.metrics import Evaluation
from node.selection import informative
from rewards.tasks import OPEN
from trainer.groups import RolloutGroup

log = logging.getLogger(__name__)

FIRST_ROUNDS = 5  # rounds of the node's own groups the first report rests on
MIN_GROUPS = 4  # a family with fewer groups by then is reported when it has this many
TRUNCATED_MOST = 0.5  # all wrong and more than this share cut off at max_new_tokens: the length, not the task
OVERALL = "overall"  # the whole set's accuracy, beside its families'
FALL_SIGMAS = 3.0  # a fall is clear beyond this many standard errors of the difference of two evaluations ...
FALL_MIN = 0.05  # ... and at least this large: a set of 1,000+ tasks calls a few points' drift clear
MIN_TASKS = 10  # fewer tasks (a family's, or the set's) are not judged: one task is more than 10 points
COLLAPSE_SHARE = 0.5  # a clear fall of overall held-out accuracy to below this share of its start is a collapse
STOP_MIN_TASKS = 100  # a stop rests on an evaluation of at least this many tasks; a smaller one only warns
PROBE_FIRST = 8  # the early probe's first round (one probe in a node's first 10); then every doubling


class Collapsed(RuntimeError):
    """Held-out accuracy fell far below its start; the message says by how much and the likely cause."""


def probe_rounds(eval_every: int, rounds: int) -> list[int]:
    """The early probe's rounds: 8, 16, 32, ... before the first full evaluation (`run.eval_every`) and the last
    round, so that a rate that destroys the model in its first rounds is seen then, not at round `eval_every`."""
    due, r = [], PROBE_FIRST
    while r < min(eval_every, rounds):
        due.append(r)
        r *= 2
    return due


def fall_sigmas(before: float, now: float, n: int) -> float:
    """How many standard errors of the difference `now` lies below `before`, two accuracies on one set of `n` tasks:
    sqrt(p0 (1 - p0) / n + p1 (1 - p1) / n), at least one task's worth (all right to all wrong is n, not infinite)."""
    se = math.sqrt((before * (1 - before) + now * (1 - now)) / n)
    return (before - now) / max(se, 1 / n)


def clear_fall(before: float, now: float, n: int) -> bool:
    """A fall beyond the noise of two evaluations of `n` tasks, and large enough to matter."""
    return before - now >= FALL_MIN and fall_sigmas(before, now, n) > FALL_SIGMAS


@dataclass
class Series:
    """One set of held-out tasks measured again and again (the full evaluation, or the early probe's subset): its
    tasks per family, its start, and the falls already said (at what accuracy), so that a fall is said once."""
    where: str  # how its lines name it, after "held-out accuracy"
    counts: dict[str, int]  # tasks per family, and OVERALL
    start: dict[str, float] = field(default_factory=dict)  # accuracy before the first step, overall and per family
    said: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, where: str, families: Mapping[str, int]) -> "Series":
        return cls(where, {**families, OVERALL: sum(families.values())})

    def begins(self, now: dict[str, float]) -> bool:
        """Take `now` as the start when there is none yet (round 0's, or the first evaluation that did not fail)."""
        if self.start:
            return False
        self.start = now
        return True

    def falls(self, now: dict[str, float]) -> list[str]:
        """The families (then OVERALL) whose fall from the start is new: not said before, or further by another clear
        margin from where it was said. One that is no longer a clear fall is forgotten: a later fall is a new one."""
        new = []
        for key in sorted(now, key=lambda k: (k == OVERALL, k)):
            start, n = self.start.get(key), self.counts.get(key, 0)
            if start is None or n < MIN_TASKS:
                continue
            if not clear_fall(start, now[key], n):
                self.said.pop(key, None)
            elif key not in self.said or clear_fall(self.said[key], now[key], n):
                self.said[key] = now[key]
                new.append(key)
        return new


def accuracies(evaluation: Evaluation) -> dict[str, float]:
    """Greedy held-out accuracy, OVERALL and per family (the expected one of `tasks.eval_samples` has no binomial
    standard error: its task-to-task spread, as large as greedy's, is not kept)."""
    if evaluation.accuracy is None:
        return {}
    return {OVERALL: evaluation.accuracy, **(evaluation.by_dataset or {})}


@dataclass
class Tally:
    groups: int = 0
    informative: int = 0  # groups GRPO gets a gradient from (node.selection.informative)
    all_wrong: int = 0
    all_right: int = 0
    completions: int = 0
    correct: int = 0
    truncated: int = 0
    opened: int = 0  # completions that began an answer (its open tag): a model that never does has no format to lengthen

    def add(self, g: RolloutGroup) -> None:
        right = sum(g.correct)
        self.groups += 1
        self.informative += informative(g)
        self.all_wrong += right == 0
        self.all_right += right == len(g.correct)
        self.completions += len(g.correct)
        self.correct += right
        self.truncated += sum(g.truncated)
        self.opened += sum(OPEN in c for c in g.completions)


class LearningWatch:
    def __init__(self, max_new_tokens: int, lr: float, held_out: Mapping[str, int], probe: Mapping[str, int],
                 target_kl: float | None = None):
        """`held_out`, `probe`: the tasks per family of the full evaluation and of the early probe; `target_kl`: the
        step-size controller's (grpo.target_kl), None when the rate is fixed."""
        self.max_new_tokens, self.lr, self.target_kl = max_new_tokens, lr, target_kl
        self.families: dict[str, Tally] = defaultdict(Tally)
        self.rounds = 0
        self.reported: set[str] = set()
        self.held_out = Series.of("", held_out)
        self.probe = Series.of(" in the early probe", probe)

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
            if not t.opened:
                return (f"{head} every completion wrong, none with an {OPEN} tag ({cut:.0%} cut off at "
                        f"generation.max_new_tokens {self.max_new_tokens}): the model does not write the answer format "
                        "(an untrained or randomly initialised one never does), so nothing it writes can score; more "
                        "tokens help only a model still reasoning at the cut: start from one that follows the prompt's "
                        "format, or show it a worked example (model.plain_example)")
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

    def evaluated(self, round_: int, evaluation: Evaluation) -> list[str]:
        """The full evaluation at `round_` (0: the start): each new clear fall, of a family or overall, said in one
        line; `Collapsed` at each evaluation whose overall accuracy fell clearly to below half its start (its line
        then says the overall fall)."""
        now, series = accuracies(evaluation), self.held_out
        if series.begins(now):
            return []
        collapse = self._collapse(round_, now)
        if collapse:
            series.said[OVERALL] = now[OVERALL]
        warnings = self._say(series, round_, now)
        if collapse is None:
            return warnings
        if series.counts[OVERALL] < STOP_MIN_TASKS:
            log.warning("%s; not stopping on an evaluation of %d tasks (tasks.eval_size; %d or more stop the node)",
                        collapse, series.counts[OVERALL], STOP_MIN_TASKS)
            return [*warnings, collapse]
        raise Collapsed(collapse)

    def probed(self, round_: int, evaluation: Evaluation) -> list[str]:
        """The early probe at `round_` (0: its start): each new clear fall said in one line; it never stops the node."""
        now = accuracies(evaluation)
        return [] if self.probe.begins(now) else self._say(self.probe, round_, now)

    def _collapse(self, round_: int, now: dict[str, float]) -> str | None:
        start, n = self.held_out.start.get(OVERALL), self.held_out.counts[OVERALL]
        if start is None or OVERALL not in now or n < MIN_TASKS:
            return None
        if now[OVERALL] >= COLLAPSE_SHARE * start or not clear_fall(start, now[OVERALL], n):
            return None
        return f"{self._fall(self.held_out, OVERALL, round_, now[OVERALL])}, below half its start: {self._cause()}"

    def _say(self, series: Series, round_: int, now: dict[str, float]) -> list[str]:
        warnings = [f"{self._fall(series, key, round_, now[key])}: {self._cause()}" for key in series.falls(now)]
        for w in warnings:
            log.warning("%s", w)
        return warnings

    @staticmethod
    def _fall(series: Series, key: str, round_: int, now: float) -> str:
        start, n = series.start[key], series.counts[key]
        family = "" if key == OVERALL else f" of {key}"
        return (f"held-out accuracy{family}{series.where} fell from {start:.3f} to {now:.3f} by round {round_} ({n} "
                f"tasks, {fall_sigmas(start, now, n):.1f} standard errors of the difference)")

    def _cause(self) -> str:
        swarm = "; or in a swarm peers' groups pull it away (selection.rule guarded)"
        if self.target_kl is None:
            return (f"the model is unlearning; most likely grpo.lr {self.lr:g} is too high for it: lower it, e.g. "
                    f"--grpo.lr {self.lr / 10:g}, and resume{swarm}")
        return (f"the model is unlearning; most likely its steps are too large for it: the rate adapts from grpo.lr "
                f"{self.lr:g} toward steps of grpo.target_kl {self.target_kl:g}; lower the target, e.g. --grpo.target_kl "
                f"{self.target_kl / 4:g}, and resume{swarm}")
