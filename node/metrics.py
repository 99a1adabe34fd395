"""Per-round metrics, one JSON object per line in `metrics.jsonl`."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Evaluation:
    """The held-out measurement: greedy accuracy and, with `tasks.eval_samples` k, the expected accuracy (the mean
    over k completions per task at the sampling temperature), each overall and per dataset. All None: not evaluated."""
    accuracy: float | None = None
    by_dataset: dict[str, float] | None = None
    expected: float | None = None
    expected_by_dataset: dict[str, float] | None = None


@dataclass
class RoundMetrics:
    round: int
    time: float
    reward_mean: float | None
    accuracy_train: float | None
    eval_accuracy: float | None
    n_local: int
    n_external: int
    tokens_generated: int
    seconds_generate: float
    seconds_train: float
    seconds_other: float
    seconds_push: float = 0.0  # of seconds_train, pushing the new weights into the generator
    eval_by_dataset: dict[str, float] | None = None
    eval_expected: float | None = None  # expected held-out accuracy: the mean over tasks.eval_samples completions a task
    eval_expected_by_dataset: dict[str, float] | None = None
    batch_reward_mean: float | None = None  # the paper's metric: mean reward of the round's training batch, local + external groups
    groups_trained: int = 0
    groups_dropped_uniform: int = 0
    local_informative: int = 0  # local groups whose rewards differ (the others carry no gradient)
    external_inspected: int = 0  # pool groups re-scored this round
    external_informative: int = 0  # of those, groups whose rewards differ
    loss: float | None = None
    kl: float | None = None
    clip_frac: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    weight_version: int = 0
    n_external_used: int = 0  # external groups that carried signal into the loss
    external_masked: int = 0  # external completions masked as off this policy's support
    external_gated: int = 0  # external completions to push up that the support gate left out (rule `guarded`)
    external_shaped: int = 0  # external completions trained with the policy-shaped weight (rule `scoped`)
    n_peer_tasks: int = 0  # of n_local, tasks of peers' groups sampled here (selection.when_short = peer_tasks)
    external_held_back: int = 0  # pool groups of peers tried without use left out of the round's order (kept pooled)
    seconds_gate: float = 0.0  # of the round, seconds computing this node's log-probs of external completions
    support_cutoff: float | None = None  # the support gate's cut-off after the round (mean token log-prob)
    external_reward_mean: float | None = None  # this node's scores of the external completions
    external_peers: int = 0  # distinct peers the round's external groups came from
    external_sources: dict[str, int] | None = None  # groups taken this round, by the peer that shared them
    external_dropped: dict[str, int] | None = None  # pool groups this node could not use, by reason
    peers: int = 0
    groups_published: int = 0  # local groups shared with the swarm this round
    n_external_received: int = 0  # groups other peers shared that entered the pool this round
    p2p: dict | None = None  # cumulative gossip and pool counters, drops by reason included
    micro_batch: int = 0  # sequences per forward and backward pass this round
    memory_peak_gb: float | None = None  # this round's peak: resident size on a host, reserved on a CUDA card


class MetricsLog:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, m: RoundMetrics) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(m)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def rewind(self, to_round: int) -> int:
        """On resume, set aside lines of rounds after the checkpoint (they will be run again), and lines that
        are not a round's (torn by a crash mid-write, or edited by hand).

        Nothing is deleted: those lines move, byte for byte, to `metrics.rolled-back.jsonl`. Returns how many moved.
        """
        if not self.path.exists():
            return 0
        keep, moved, unreadable = [], [], 0
        for line in self.path.read_bytes().splitlines():
            if line.strip():
                round_ = _round_of(line)
                unreadable += round_ is None
                (moved if round_ is None or round_ > to_round else keep).append(line)
        if moved:
            with open(self.path.with_name("metrics.rolled-back.jsonl"), "ab") as f:
                f.write(b"".join(line + b"\n" for line in moved))
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(b"".join(line + b"\n" for line in keep))
            os.replace(tmp, self.path)
            log.warning("moved %d metrics lines %s to metrics.rolled-back.jsonl%s", len(moved),
                        f"after round {to_round}" if to_round >= 0 else "of an earlier start that left no checkpoint",
                        f" ({unreadable} of them not a round's line)" if unreadable else "")
        return len(moved)


    def start_accuracy(self) -> float | None:
        """Held-out accuracy before the first step (round 0's line), for a resumed node's learning watch."""
        if not self.path.exists():
            return None
        for line in self.path.read_bytes().splitlines():
            if _round_of(line) == 0:
                return json.loads(line).get("eval_accuracy")
        return None


def _round_of(line: bytes) -> int | None:
    """The round a metrics line records, or None where it is not a round's line."""
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return None
    round_ = record.get("round") if isinstance(record, dict) else None
    return round_ if type(round_) is int else None
