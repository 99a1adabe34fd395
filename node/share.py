"""What the node shares: its own groups go out as text once per round, with no answers or rewards.
(What it takes back in is `node.selection`.)"""

from __future__ import annotations

import logging
import time

from p2p.config import Limits
from p2p.service import Gossip
from p2p.wire import WireGroup, WireMessage, decode, pack_groups
from trainer.groups import RolloutGroup

log = logging.getLogger(__name__)
SELF = "self"  # the sender name of this node's own groups in its pool (`self_message`)


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


def self_messages(model: str, round_: int, groups: list[RolloutGroup], limits: Limits) -> list[WireMessage]:
    """This node's own groups as they would arrive from a peer: packed, encoded and decoded by the wire
    codec, texts only (`selection.self_external`, the control of the swarm-vs-silo experiment)."""
    payloads, _ = pack_groups(SELF, model, round_, time.time(), [to_wire(g) for g in groups], limits)
    return [decode(data, limits) for data in payloads]
