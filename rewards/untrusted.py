"""Tasks that other peers name: bounded before any work, then regenerated and scored in a sandbox.

Three lines of defence, cheapest first: a config this node draws itself is trusted as it stands;
any other is checked against the dataset's own defaults (`check_bounds`); what passes runs in
`rewards.sandbox` under a deadline and a memory cap. A config that timed out, ran out of memory or
crashed the worker is remembered and refused without work afterwards, so a flood of one bad config
costs one deadline, not one per message; a config of the node's own is never refused, only the
group that failed is dropped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from rewards.sandbox import Sandbox, SandboxError
from rewards.scoring import Score, score_completion
from rewards.datasets import regenerate
from rewards.tasks import Task, TaskError, TaskRef

log = logging.getLogger(__name__)

BOUND_FACTOR = 4  # an untrusted number may be this many times the dataset's default (or BOUND_FLOOR)
BOUND_FLOOR = 16
MAX_SIZE = 10**6  # reasoning-gym `size`: task indices run below it
REMEMBERED_FAILURES = 4096
SANDBOX_FAILURES = ("regen_timeout", "regen_memory", "regen_crashed")
# every reason `UntrustedTasks.score` can drop a group for (a TaskError's own reason, or the sandbox's)
DROP_REASONS = ("unknown_task", "config_bounds", *SANDBOX_FAILURES, "regen_failed")


def check_bounds(dataset: str, config: Mapping[str, Any]) -> None:
    """Refuse, before any work, an untrusted reasoning-gym config whose numbers exceed what the
    dataset's defaults suggest (`min_x`/`max_x` pairs share the larger default). Built-in datasets
    bound their own configs in their pydantic models. Raises `TaskError` with reason `config_bounds`."""
    from rewards import gym

    if not dataset.startswith(gym.PREFIX):
        return
    defaults = {k: v for k, v in gym.defaults(dataset[len(gym.PREFIX):]).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "size"}
    for key, value in config.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            raise _bounds(f"{key} = {value} is not a finite number")
        if key == "size":
            if not 1 <= value <= MAX_SIZE:
                raise _bounds(f"size = {value} outside 1..{MAX_SIZE}")
            continue
        stem = key.removeprefix("min_").removeprefix("max_")
        default = max((abs(defaults[k]) for k in (key, f"min_{stem}", f"max_{stem}") if k in defaults), default=0)
        limit = max(BOUND_FACTOR * default, BOUND_FLOOR)
        if abs(value) > limit:
            raise _bounds(f"{key} = {value} exceeds {limit:g} ({BOUND_FACTOR}x the dataset's default, at least {BOUND_FLOOR})")


def _bounds(detail: str) -> TaskError:
    e = TaskError(detail)
    e.reason = "config_bounds"
    return e



def score_in_worker(ref: tuple, completions: Sequence[str], format_weight: float,
                    trusted: bool) -> tuple[str, str, list[tuple]]:
    """Runs in the sandbox: bound the config, regenerate the task, score every completion."""
    if not trusted:
        check_bounds(ref[0], ref[1])
    task = regenerate(TaskRef(*ref))
    scores = [score_completion(task, c, format_weight) for c in completions]
    return task.question, task.answer, [dataclasses.astuple(s) for s in scores]


class UntrustedTasks:
    """Regenerates and scores peers' tasks without letting one of them stall or sink the node."""

    def __init__(self, timeout_s: float, memory_mb: int, warm: tuple[str, ...] = ()):
        self.timeout_s = timeout_s
        self.sandbox = Sandbox(f"{__name__}:score_in_worker", memory_mb, warm)
        self._failed: OrderedDict[str, str] = OrderedDict()  # config key -> reason, oldest first
        self._warned: set[str] = set()  # reasons logged once at WARNING; the rest go to DEBUG and the counts

    def score(self, ref: TaskRef, completions: Sequence[str], format_weight: float,
              trusted: bool) -> tuple[Task, list[Score]]:
        """The task and the completions' scores, or `SandboxError` whose `reason` names the drop
        (unknown_task, config_bounds, regen_timeout, regen_memory, regen_crashed, regen_failed).
        `trusted`: the config is one this node draws itself, so it is not bounded."""
        config_key = json.dumps([ref.dataset, dict(ref.config)], sort_keys=True)
        if not trusted and (reason := self._failed.get(config_key)) is not None:
            raise SandboxError(reason, "this config failed before")
        try:
            ref_tuple = (ref.dataset, dict(ref.config), ref.seed, ref.index)
            question, answer, scores = self.sandbox.call((ref_tuple, list(completions), format_weight, trusted),
                                                         self.timeout_s)
        except SandboxError as e:
            if e.reason not in DROP_REASONS:  # an exception's own `reason` (UnicodeError has one) is no label
                e.reason = "regen_failed"
            if e.reason in SANDBOX_FAILURES:
                # A config this node draws itself runs its own code: a deadline missed there is a busy
                # machine, not a hostile config, and refusing it would cut the node off from every peer's
                # group of its own family for the rest of the run (seen: 1,048 `reverse` groups dropped
                # after one timeout in the first round on an overloaded machine). Only the group is dropped.
                if not trusted:
                    self._remember(config_key, e.reason)
                level = logging.DEBUG if e.reason in self._warned else logging.WARNING
                self._warned.add(e.reason)
                log.log(level, "a peer's task of %s with config %s: %s (%s)", ref.dataset,
                        json.dumps(dict(ref.config))[:200], e,
                        "a config of this node's own: only this group is dropped" if trusted
                        else "this config is refused from now on")
            raise
        return Task(ref=ref, question=question, answer=answer), [Score(*s) for s in scores]

    def _remember(self, config_key: str, reason: str) -> None:
        self._failed[config_key] = reason
        while len(self._failed) > REMEMBERED_FAILURES:
            self._failed.popitem(last=False)

    def start(self) -> None:
        self.sandbox.start()

    def ready(self, wait: float) -> bool:
        return self.sandbox.ready(wait)

    def close(self) -> None:
        self.sandbox.close()
