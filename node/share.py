"""What crosses the swarm: the node's rollout groups as wire text, published once per round."""

from __future__ import annotations

import logging
import time

from p2p.config import Limits
from p2p.service import Gossip
from p2p.wire import WireGroup, pack_groups
from trainer.batch import RolloutGroup

log = logging.getLogger(__name__)


def to_wire(group: RolloutGroup) -> WireGroup:
    """Only the task reference and the completion texts: rewards stay home, receivers re-score."""
    ref = group.task.ref
    return WireGroup(dataset=ref.dataset, config=dict(ref.config), seed=ref.seed, index=ref.index,
                     completions=list(group.completions))


def publish_round(gossip: Gossip, model: str, round_: int, groups: list[RolloutGroup], limits: Limits) -> int:
    """Split the round's groups into messages under the limits and hand them over; returns messages sent."""
    payloads, skipped = pack_groups(gossip.peer_id, model, round_, time.time(), [to_wire(g) for g in groups], limits)
    if skipped:
        log.warning("round %d: %d group(s) exceed the wire limits on their own and were not shared", round_, skipped)
    for data in payloads:
        gossip.publish(data)
    return len(payloads)
