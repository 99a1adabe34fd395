"""py-libp2p's peer store with a peer's signed address record ordered the way libp2p's specification orders it."""

from __future__ import annotations

import logging

from libp2p.peer.envelope import Envelope
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStore

log = logging.getLogger(__name__)


class OrderedPeerStore(PeerStore):
    """A signed peer record no newer than the one kept is ignored, not refused.

    A peer signs a new record of its addresses whenever they change, and its records reach us over several
    streams (identify, each gossip RPC), so an older one can arrive after a newer one. py-libp2p 0.8.1 then
    reports a failure, and its pubsub drops the whole RPC that carried the record, the rollouts in it included
    (seen in CI: a stranger's node dropped a relay's RPC). Go's peer store ignores such a record without an
    error; so does this one. A record signed by a key other than its peer's is still refused."""

    def consume_peer_record(self, envelope: Envelope, ttl: int) -> bool:
        try:
            record = envelope.record()
            signed_by_its_peer = ID.from_pubkey(envelope.public_key) == record.peer_id
        except Exception:  # noqa: BLE001 - a record that does not read: the base class refuses it
            return super().consume_peer_record(envelope, ttl)
        kept = self.peer_record_map.get(record.peer_id)
        if signed_by_its_peer and kept is not None and record.seq < kept.seq:
            log.debug("ignored an older address record of %s (seq %d, kept %d)", record.peer_id, record.seq, kept.seq)
            return True
        return super().consume_peer_record(envelope, ttl)
