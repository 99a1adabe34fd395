"""What crosses the swarm: the node's own groups go out as text once per round; groups other peers
shared come back in only after this node regenerates their tasks and scores them itself."""

from __future__ import annotations

import logging
import random
import time
from collections import Counter

from p2p.config import Limits
from p2p.pool import RolloutPool
from p2p.service import Gossip
from p2p.wire import WireGroup, pack_groups
from rewards import TaskRef, regenerate
from rewards.config import TasksConfig
from trainer.batch import RolloutGroup
from trainer.rollout import scored_group

log = logging.getLogger(__name__)


def to_wire(group: RolloutGroup) -> WireGroup:
    """Only the task reference and the completion texts: rewards stay home, receivers re-score."""
    ref = group.task.ref
    return WireGroup(dataset=ref.dataset, config=dict(ref.config), seed=ref.seed, index=ref.index,
                     completions=list(group.completions))


def publish_round(gossip: Gossip, model: str, round_: int, groups: list[RolloutGroup], limits: Limits) -> int:
    """Split the round's groups into messages under the limits and hand them over; returns groups shared."""
    payloads, skipped = pack_groups(gossip.peer_id, model, round_, time.time(), [to_wire(g) for g in groups], limits)
    if skipped:
        log.warning("round %d: %d group(s) exceed the wire limits on their own and were not shared", round_, skipped)
    for data in payloads:
        gossip.publish(data)
    return len(groups) - skipped


def take_external(pool: RolloutPool, j: int, rng: random.Random, tasks: TasksConfig) -> tuple[list[RolloutGroup], Counter[str]]:
    """Up to j usable groups from the pool, re-scored here; unusable ones are dropped and counted.

    Nothing the sender claims is used beyond the task reference and the texts: the task is rebuilt
    from the reference and every completion is scored by this node's verifier.
    """
    groups: list[RolloutGroup] = []
    dropped: Counter[str] = Counter()
    while len(groups) < j:
        batch = pool.sample(j - len(groups), rng)
        if not batch:
            break
        for pooled in batch:
            g = pooled.group
            if not tasks.accepts(g.dataset, g.config):
                dropped["not_accepted"] += 1
                continue
            try:
                task = regenerate(TaskRef(g.dataset, g.config, g.seed, g.index))
            except Exception as e:  # untrusted reference: any failure to rebuild it drops the group
                log.debug("cannot regenerate %s/%s from %s: %s", g.dataset, g.index, pooled.peer, e)
                dropped["unknown_task"] += 1
                continue
            groups.append(scored_group(task, g.completions, tasks.format_weight, source=pooled.peer))
    return groups, dropped
