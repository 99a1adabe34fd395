"""The trio side of the gossip layer: a Noise-only libp2p host, GossipSub v1.1 and discovery.

Everything here runs inside one `trio.run` on the thread that `p2p.service.Gossip` owns. What to
accept is decided by `p2p.policy`; what to do with an accepted message by the `on_message` callback.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import random
import socket
import time
from collections import Counter
from collections.abc import Callable, Hashable

import msgpack
import trio
from libp2p import NOISE_PROTOCOL_ID, YAMUX_PROTOCOL_ID, ConnectionConfig, NoiseTransport, Yamux, new_host
from libp2p.network.auto_connector import AutoConnector
from libp2p.network.config import RetryConfig
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.address_validation import expand_wildcard_address
from multiaddr import Multiaddr

from p2p.addrbook import RECORD_S, REJOIN_DIALS, REJOIN_RETRY_S, SOURCE as BOOK_SOURCE, AddressBook, Entry, network_group
from p2p.bucket import Bucket
from p2p.config import P2PConfig
from p2p.hints import REMEMBERED, HintBudget
from p2p.lan import QUEUED, LanDiscovery
from p2p.peerstore import OrderedPeerStore
from p2p.policy import MessagePolicy
from p2p.portmap import PortMap, private_port
from p2p.punch import Punch
from p2p.pubsub import GuardedPubsub, gossipsub_router
from p2p.reach import Reach, is_circuit, remote_ip
from p2p.rendezvous import Rendezvous, rendezvous_key
from p2p.seen import SeenKeys
from p2p.shards import publish_topics, shard_topic, shared_bits, topic_level
from p2p.wire import Rejected, WireMessage, decode

log = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 10.0
EXCHANGE_MAX_PEERS = 32
EXCHANGE_MAX_BYTES = 64 * 1024
LINGER_S = 0.5  # after the last publish, how long a stopping node keeps its connections for peers to read it
HINT_DIALS_PER_ANSWER = 4  # new peers dialed from one peer-exchange answer: a liar's answer costs at most this
SHARD_CHECK_S = 2.0  # how often the shard level is re-decided
LAN_SOURCE = "mDNS"  # ... and one heard on the LAN
DELIVERED_TTL_S = 600.0  # a message is not handed on twice within this (the pool drops stale ones sooner)
ELSEWHERE = {  # why a connected peer on another rollout topic family shares nothing with this node
    "protocol": "another protocol version: rollouts do not cross versions (one of you should upgrade sapo-node)",
    "network": "another network than this node's {network!r}: it counts as a peer and shares nothing (start both with "
               "the same --network)"}


def advertised(addrs: list[Multiaddr]) -> list[Multiaddr]:
    """Listening on 0.0.0.0 means every interface: tell peers the concrete addresses."""
    out: list[Multiaddr] = []
    for a in addrs:
        out.extend(expand_wildcard_address(a) if "/ip4/0.0.0.0/" in str(a) or "/ip6/::/" in str(a) else [a])
    return out


def check_can_listen(addrs: list[str]) -> None:
    """py-libp2p logs a failed listen and carries on without it; fail before it gets the chance."""
    for text in addrs:
        a = Multiaddr(text)
        names = [p.name for p in a.protocols()]
        if "tcp" not in names or a.value_for_protocol("tcp") == "0" or names[0] not in ("ip4", "ip6"):
            continue
        family = socket.AF_INET if names[0] == "ip4" else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the real listener does
            s.bind((a.value_for_protocol(names[0]), int(a.value_for_protocol("tcp"))))


class NoBackgroundDials(AutoConnector):
    """py-libp2p's background connector, which never dials.

    Below its minimum connection count (50: a small swarm always is) it redials every peer in the address book
    about every 10 s, outside the node's hint budget: peers that liars had hinted were redialed for 9 minutes
    after the liars left (80 connections in the first 3.5), with the node's own counters flat. The node's own
    loops are its only dialers: the bootstrap peers with backoff, peer exchange within `p2p.hints`."""

    async def run_background_task(self, nursery) -> None:
        return

    async def maybe_connect(self) -> None:
        return


class GossipHost:
    def __init__(self, cfg: P2PConfig, key_pair: KeyPair, policy: MessagePolicy,
                 on_message: Callable[[WireMessage], None], useful: Callable[[str], bool] | None = None,
                 book: AddressBook | None = None):
        """`useful`: whether an author (base58 peer id) has proven itself to this node's selection; only such
        authors set its shard level (`ShardLevel.useful`). None: every author with valid rollouts. `book`: the
        node's address book (`p2p.addrbook`; None: one in memory, never saved)."""
        self.cfg = cfg
        self.policy = policy
        self.on_message = on_message
        self.counts: Counter[str] = Counter()  # published, publish_failed, publish_dropped, dials, dial_failed, exchange_failed, dropped_*
        self.addrs: list[str] = []
        # addresses and peers already logged as failing: each is logged once (while remembered)
        self._logged_hints, self._logged_silent, self._logged_other = (SeenKeys(math.inf, REMEMBERED) for _ in range(3))
        self.n_peers = 0
        self.n_mesh = 0  # GossipSub mesh peers on our shard topic: who our publishes reach first
        self.n_other_protocol = 0  # connected peers on this network's rollout topics of another protocol version
        self.n_other_network = 0  # connected peers gossiping rollouts on another network's topics
        self.reading: dict[str, trio.CancelScope] = {}  # every topic subscribed to -> its reader
        self.leaving: dict[str, float] = {}  # topics read but no longer wanted -> when to unsubscribe
        self._delivered = SeenKeys(DELIVERED_TTL_S, REMEMBERED)  # payload digests: it comes once per topic we read
        self.bootstrap_ids: set[ID] = set()  # never closed to make room
        self.hints = HintBudget(cfg.max_backoff_s)  # every hint's failures, whoever gave it (peer exchange, the DHT)
        self.rendezvous: Rendezvous | None = None
        self.lan: LanDiscovery | None = None
        self.portmap: PortMap | None = None
        self.mapped: list[Multiaddr] = []  # the router's address and port forwarded to us (UPnP, NAT-PMP)
        announce = [Multiaddr(a) for a in cfg.announce] or None
        self.host = new_host(
            key_pair=key_pair,
            sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)},
            muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
            connection_config=ConnectionConfig(max_connections_per_peer=1),  # also skips a 250 ms dial delay
            announce_addrs=announce, addrs_factory=None if announce else self._advertised,
            peerstore_opt=OrderedPeerStore(),
        )
        # one connection attempt per address dialed: the bootstrap loop keeps its own backoff, a hint is not
        # retried, and py-libp2p's 3 retries made each failed hint 4 connections to a host it may not know
        self.host.get_network().retry_config = RetryConfig(max_retries=0)
        self.host.get_network().auto_connector = NoBackgroundDials(self.host.get_network())
        self.host.get_addrs = self._addrs  # what identify and our provider record tell peers
        self.reach = Reach(cfg, self.host, self.counts)
        self.me = self.host.get_id()
        self.base = cfg.rollout_topic_base()
        self.shard = cfg.shards.level_of(self.me.to_bytes(), cfg.profile().shard_epoch_s, time.time())
        if useful is not None:
            self.shard.useful = lambda author: useful(ID(author).to_base58())
        self.topic = shard_topic(self.base, self.shard.key, self.shard.level)
        self.gossipsub = gossipsub_router(self.counts, cfg)
        self.pubsub = GuardedPubsub(self.host, self.gossipsub, strict_signing=True, counts=self.counts)
        # DCUtR for peers reached through a relay, its dials charged as hints; relayed connections closed once direct
        self.punch = Punch(self.host, self.counts, self.hints,
                           lambda info: self.reach.dialable(info, advertised(self.host.get_transport_addrs())))
        self.outbox_send, self.outbox_recv = trio.open_memory_channel[bytes](64)
        self.publishing = False
        self.last_published: float | None = None  # trio time
        limits = cfg.limits  # receivers allow an author two of the largest messages at once: one is ours
        self.own_budget = Bucket(limits.max_author_kib_per_s * 1024, limits.max_message_bytes)
        self.book = book if book is not None else AddressBook()

    def _addrs(self) -> list[Multiaddr]:
        """Our addresses as peers dial them, each ending in /p2p/<us>. py-libp2p's `get_addrs` strips the first /p2p/
        component of each address before appending ours, which cuts a circuit address at its relay's id: peers were
        told the relay's own address as ours (tests/test_punch.py)."""
        candidates = self.host.get_transport_addrs()
        if (observed := getattr(self.host, "_observed_addr_manager", None)) is not None:
            candidates += [a for a in observed.addrs() if a not in candidates]
        own = [Multiaddr(a) for a in self.cfg.announce] or self._advertised(candidates)
        me = Multiaddr(f"/p2p/{self.me}")
        return [a if str(a).endswith(str(me)) else a.encapsulate(me) for a in own]

    def _advertised(self, addrs: list[Multiaddr]) -> list[Multiaddr]:
        """What identify tells peers to dial (py-libp2p asks before `self.reach` exists)."""
        direct = advertised(addrs) + getattr(self, "mapped", [])
        return self.reach.advertised(direct) if hasattr(self, "reach") else direct

    async def serve(self, stop: trio.Event, task_status=trio.TASK_STATUS_IGNORED) -> None:
        check_can_listen(self.cfg.listen)
        listen = [Multiaddr(a) for a in self.cfg.listen]
        async with self.host.run(listen_addrs=listen), background_trio_service(self.pubsub), \
                background_trio_service(self.gossipsub):
            if len(self.host.get_transport_addrs()) < len(listen):
                raise OSError(errno.EADDRNOTAVAIL, "not every listen address could be opened (see the log above)")
            await self.pubsub.wait_until_ready()
            self.host.set_stream_handler(TProtocol(self.cfg.peer_exchange_protocol()), self._serve_peer_list)
            self.addrs = [str(a) for a in self.host.get_addrs()]
            await self._map_port()
            try:
                await self._run_tasks(stop, task_status)
            finally:
                if self.portmap:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(self.portmap.close)
            await self.pubsub.unsubscribe(self.topic)

    async def _map_port(self) -> None:
        """Ask the LAN's router to forward our port (`p2p.portmap`) before the dial-back check runs: a mapped port
        makes the node public, with no relay."""
        where = private_port(advertised(self.host.get_transport_addrs())) if self.cfg.upnp else None
        if where:
            self.portmap = PortMap(*where)
            if mapped := await trio.to_thread.run_sync(self.portmap.open):
                self.mapped = [mapped]
                self.addrs.append(f"{mapped}/p2p/{self.me}")
            else:
                log.info("port mapping: %s; peers reach this node if its port is forwarded by hand, or through relays",
                         self.portmap.why)

    async def _run_tasks(self, stop: trio.Event, task_status) -> None:
        """The node's discovery, gossip and reachability tasks, until `stop`."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self._follow_shard)
            nursery.start_soon(self._publish_outbox)
            nursery.start_soon(self._keep_bootstrap_peers)
            nursery.start_soon(self._exchange_peers)
            if self.cfg.dht_peers():
                nursery.start_soon(self._rendezvous)
            if self.cfg.mdns:
                nursery.start_soon(self._lan)
            nursery.start_soon(self.reach.run, self._connected, nursery)
            if self.cfg.hole_punching:
                await nursery.start(self.punch.run)
            nursery.start_soon(self._keep_book)
            task_status.started()
            await stop.wait()
            nursery.cancel_scope.cancel()

    # -- shards -------------------------------------------------------------------------------

    async def _follow_shard(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Read our shard's topic and the topics of the levels `ShardLevel` probes. When the shard
        changes (a new level or a new epoch), subscribe to the new one and keep the old one for
        `leave_after_s` more: publishers name three levels, and an author whose clock is a little behind
        still publishes into its old-epoch shard. A probe's topic is left as soon as the probe ends."""
        leave_after_s = 2 * self.cfg.limits.max_clock_skew_s + SHARD_CHECK_S
        async with trio.open_nursery() as nursery:
            while True:
                own = shard_topic(self.base, self.shard.key, self.shard.level)
                if own != self.topic and self.topic in self.reading:
                    log.info("shard %s -> %s (level %d, epoch %d)", self.topic, own, self.shard.level, self.shard.epoch)
                    self.leaving[self.topic] = trio.current_time() + leave_after_s
                self.topic = own
                wanted = {own, *(shard_topic(self.base, self.shard.key, lv) for lv in self.shard.probes)}
                for topic in wanted:
                    self.leaving.pop(topic, None)  # back to a shard not yet left
                    if topic not in self.reading:
                        self.pubsub.set_topic_validator(topic, self._validate, False)
                        self.reading[topic] = await nursery.start(self._read, await self.pubsub.subscribe(topic))
                for topic in [t for t in self.reading if t not in wanted]:
                    if trio.current_time() >= self.leaving.setdefault(topic, trio.current_time()):
                        del self.leaving[topic]
                        self.reading.pop(topic).cancel()
                        await self.pubsub.unsubscribe(topic)
                        self.pubsub.remove_topic_validator(topic)
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED
                await trio.sleep(SHARD_CHECK_S)
                self.shard.update(time.time(), self._hinted_levels())

    def _hinted_levels(self) -> list[int]:
        """For each connected peer on this network's protocol that subscribes to one of our own shards,
        that shard's level: where `ShardLevel` may look, never where it goes. Peers on another
        protocol's rollout topic are counted and logged once each."""
        hints: list[int] = []
        other: dict[str, set[ID]] = {"protocol": set(), "network": set()}
        for topic, peers in list(self.pubsub.peer_topics.items()):
            level = topic_level(self.base, topic)
            if level is not None:
                if topic == shard_topic(self.base, self.shard.key, level):
                    hints += [level] * len(peers)
                continue
            kind = self._elsewhere(topic)
            for peer in peers if kind else ():
                other[kind].add(peer)
                if (kind, peer) not in self._logged_other:
                    self._logged_other.add((kind, peer), 0.0)
                    log.warning("peer %s gossips rollouts on %s, %s", peer, topic, ELSEWHERE[kind].format(
                        network=self.cfg.network))
        self.n_other_protocol, self.n_other_network = len(other["protocol"]), len(other["network"])
        return hints

    def _elsewhere(self, topic: str) -> str | None:
        """"protocol" for a rollout topic of this network under another version, "network" for one of another
        network (`/sapo/<network>/rollouts/...`), None otherwise."""
        parts, own = topic.split("/"), self.base.split("/")
        if len(parts) < 5 or parts[1] != "sapo" or parts[3] != "rollouts":
            return None
        return "protocol" if parts[2] == own[2] else "network"

    def stats(self) -> dict[str, object]:
        now = time.time()
        reached = Counter(self.punch.how_reached(p) for p in self._connected())
        return {"reachability": self.reach.state.value, "relays": len(self.reach.reserved),
                "relayed_peers": reached["relayed"], "punched_peers": reached["punched"],
                "shard_level": self.shard.level, "shard_epoch": self.shard.epoch,
                "shard_authors": self.shard.authors(now, self.shard.level),
                "shard_topics": len(self.reading),  # own, probes, and for a while after a move the old one
                "shard_probes": sorted(self.shard.probes),
                "peers_other_protocol": self.n_other_protocol, "peers_other_network": self.n_other_network,
                "dht_providers": len(self.rendezvous.proven(set(self.pubsub.peers))) if self.rendezvous else None,
                "mdns": self.lan.active if self.lan else False,
                "port_mapping": self.portmap.why if self.portmap else None,
                "book_tried": len(self.book.tried), "book_new": len(self.book.new),
                "book_anchors_dialed": self.counts["book_anchors_dialed"], "book_rejoined": self.counts["book_rejoined"]}

    # -- address book -------------------------------------------------------------------------

    async def _keep_book(self) -> None:
        """Rejoin through the address book (`p2p.addrbook`) at start, record peers as they prove themselves and
        save what changed every `RECORD_S`, and once more at stop. While the node has no peer at all it runs
        another rejoin round, `REJOIN_RETRY_S` after the last, the wait doubling up to `max_backoff_s`: a stale
        book costs a few failed dials a minute, never a stream of them."""
        delay, due = REJOIN_RETRY_S, trio.current_time()
        try:
            while True:
                if trio.current_time() >= due:
                    await self._rejoin()
                    due, delay = trio.current_time() + delay, min(2 * delay, self.cfg.max_backoff_s)
                await trio.sleep(RECORD_S)
                self._record_proven()
                if self.book.changed:
                    self.book.save()
                if self._connected():  # once every peer is lost, a round within REJOIN_RETRY_S
                    delay, due = REJOIN_RETRY_S, trio.current_time() + REJOIN_RETRY_S
        finally:  # at stop: a few kilobytes written at once, nothing awaited
            self._record_proven()
            if self.book.changed:
                self.book.save()

    async def _rejoin(self) -> None:
        """The anchors all at once (a dead one costs its timeout once, not one each), then the book's other
        candidates one by one while the node wants peers, at most `REJOIN_DIALS` of them."""
        anchors, others = self.book.anchors(), self.book.candidates()  # before a failure drops a stale anchor
        async with trio.open_nursery() as nursery:
            for entry in anchors:
                nursery.start_soon(self._dial_from_book, entry, True, True)
        dials = 0
        for entry, proven in others:
            if dials == REJOIN_DIALS or not self._wants_peers():
                return
            dials += await self._dial_from_book(entry, proven) is not None

    async def _dial_from_book(self, entry: Entry, proven: bool, anchor: bool = False) -> bool | None:
        """Dial a peer of the book as a hint (`p2p.hints`): an address that failed within the window is not dialed
        again, whoever named it. A tried peer is a hint of a proven source (it once proved itself: its failures
        spend none of the allowance strangers' hints share, so a stale book does not stop the DHT's hints); a
        heard-of one is a stranger's. None: not dialed (connected, or no address the budget allows)."""
        peer, now = ID.from_base58(entry.peer), trio.current_time()  # the book keeps only rows that read
        info = PeerInfo(peer, [Multiaddr(a) for a in entry.addrs])
        addrs = [a for a in self.reach.dialable(info, advertised(self.host.get_transport_addrs()))
                 if self.hints.may_dial(_addr_key(a), now)][:self.hints.allowance(now, proven)]
        if peer == self.me or peer in self._connected() or not addrs:
            return None
        self.counts["book_anchors_dialed"] += anchor
        if await self._dial(PeerInfo(peer, addrs)):
            self.counts["book_rejoined"] += 1
            log.info("connected to %s from the address book", peer)
            return True
        self.host.get_peerstore().clear_addrs(peer)  # nothing else dials it (`NoBackgroundDials`)
        self.hints.failed([_addr_key(a) for a in addrs], BOOK_SOURCE, trio.current_time(), proven)
        self.book.failed(entry.peer, time.time())
        return False

    def _record_proven(self) -> None:
        """Connected peers on our gossip protocol whose messages our validator accepted (`reach.slots.participants`)
        proved themselves: into the book's tried table, at the addresses identify gave for them, grouped by the
        address they are connected from (which they cannot choose, unlike the ones they announce)."""
        store, now = self.host.get_peerstore(), time.time()
        for peer in self._connected():
            if peer not in self.pubsub.peers or peer not in self.reach.slots.participants \
                    or (ip := remote_ip(self.host, peer)) is None:
                continue
            try:
                addrs = [str(a) for a in store.addrs(peer)]
            except Exception:  # no addresses (yet, or expired): py-libp2p raises
                continue
            self.book.proven(peer.to_base58(), addrs, network_group(ip, peer.to_base58()), now)

    def _book_heard(self, source: Hashable, infos: list[PeerInfo]) -> None:
        """A peer a source named (a peer-exchange answer, a DHT server, an mDNS record) and our dial reached: into the
        book's new table under the source's network group (mDNS is a group of its own; a source that left before
        the dial ended, none). Only a peer that answered at that address: a rejoin redials no host a liar merely
        named (hinted fakes got no connection after their liars left, and keep getting none)."""
        group = str(source)
        if isinstance(source, ID):
            if (ip := remote_ip(self.host, source)) is None:
                return
            group = network_group(ip, source.to_base58())
        self.book.heard(group, [(i.peer_id.to_base58(), [str(a) for a in i.addrs]) for i in infos if i.peer_id != self.me],
                        time.time())

    # -- gossip -------------------------------------------------------------------------------

    def _validate(self, forwarder: ID, msg) -> bool:
        """GossipSub asks once per message, with the neighbour that brought it: the author is heard in our shard
        here, vouched for by its own connection, or by the forwarder's when it is not connected to us."""
        if msg.from_id == self.me.to_bytes():
            return True
        author = ID(msg.from_id)
        try:
            self.policy.check(msg.data, author.to_base58(), topics=list(msg.topicIDs))
        except Rejected as r:
            log.debug("rejected message from %s via %s: %s", author, forwarder, r)
            return False
        self.shard.hear(msg.from_id, time.time(), topic_level(self.base, msg.topicIDs[0]),  # one shard topic: checked
                        self._group(author) or self._group(forwarder) or forwarder.to_base58())
        return True

    async def _read(self, subscription, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            while True:
                msg = await subscription.get()  # drain at once: the subscription queue drops when full
                if msg.from_id != self.me.to_bytes():
                    self.reach.slots.participants.add(ID(msg.from_id), trio.current_time())  # may hold a relay slot
                    self._deliver(msg)

    def _deliver(self, msg) -> None:
        now = time.time()
        digest = hashlib.sha256(msg.data).digest()
        if digest in self._delivered:  # the same payload under a second topic we read (a probe, a move)
            return
        self._delivered.forget_expired(now)
        self._delivered.add(digest, now)
        try:
            self.on_message(decode(msg.data, self.cfg.limits))
        except Exception:  # a consumer bug must not stop the gossip layer
            log.exception("handling a received message failed")

    def _group(self, peer: ID) -> str | None:
        """The network group `peer` is connected to us from (`network_group`: its subnet, over loopback the peer
        itself), by which `ShardLevel` counts the authors it vouches for; None when it is not connected directly."""
        ip = remote_ip(self.host, peer)
        return None if ip is None else network_group(ip, peer.to_base58())

    async def _publish_outbox(self) -> None:
        async for data in self.outbox_recv:
            self.publishing = True
            if wait := self.own_budget.take(len(data), trio.current_time()):  # else peers refuse it: `over_budget`
                self.counts["publish_paced_s"] += wait
                await trio.sleep(wait)
            try:
                for topic in publish_topics(self.base, self.shard.key, self.shard.level):  # one message each
                    await self.pubsub.publish([topic], data)
                self.counts["published"] += 1
                self.last_published = trio.current_time()
            except Exception as e:
                self.counts["publish_failed"] += 1
                log.warning("publishing %d bytes failed: %s", len(data), e)
            finally:
                self.publishing = False

    async def drain(self) -> None:
        """Until every queued message is written and peers had LINGER_S to read the last: a node publishes its
        last round moments before it exits, and closing its connections at once lost that round."""
        while self.publishing or self.outbox_send.statistics().current_buffer_used:
            await trio.sleep(0.05)
        if self.last_published is not None:
            await trio.sleep_until(self.last_published + LINGER_S)

    def enqueue(self, data: bytes) -> None:
        """Called on the trio thread (via TrioToken.run_sync_soon): never blocks the caller."""
        try:
            self.outbox_send.send_nowait(data)
        except trio.WouldBlock:
            self.counts["publish_dropped"] += 1
            first = self.counts["publish_dropped"] == 1  # then counted only: a node past its budget drops every round
            log.log(logging.WARNING if first else logging.DEBUG, "publish queue full: dropped a %d-byte message (this "
                    "node publishes faster than p2p.limits.max_author_kib_per_s = %d KiB/s, which receivers enforce, or "
                    "than the network carries); further drops are counted in publish_dropped", len(data),
                    self.cfg.limits.max_author_kib_per_s)

    # -- discovery ----------------------------------------------------------------------------

    def _connected(self) -> set[ID]:
        peers = set(self.host.get_connected_peers())
        self.n_peers = len(peers)
        self.n_mesh = len(self.gossipsub.mesh.get(self.topic, ()))
        return peers

    async def _dial(self, info: PeerInfo) -> bool:
        """Directly, or through its relays when it lists any (it cannot be dialed directly then); address by
        address, each one connection attempt. py-libp2p's `connect` dials one TCP address of all those its peer
        store holds for the peer, and after a failure none for 60 s: each attempt here leaves it the one address,
        and our own budgets decide what is dialed again."""
        if info.peer_id in self.host.get_connected_peers():  # it dialed us meanwhile: keep the addresses identify gave
            return True
        self.counts["dials"] += 1
        relayed = [a for a in info.addrs if is_circuit(a)]
        for addr in relayed or info.addrs:
            with trio.move_on_after(DIAL_TIMEOUT_S):
                try:
                    if relayed:
                        await self.reach.dial(addr, info.peer_id)
                    else:
                        self.host.get_peerstore().clear_addrs(info.peer_id)
                        self.host.get_network().unblock_peer(info.peer_id)
                        await self.host.connect(PeerInfo(info.peer_id, [addr]))
                    return True
                except Exception as e:
                    log.debug("dial %s at %s failed: %s", info.peer_id, addr, e)
        self.counts["dial_failed"] += 1
        return False

    async def _keep_bootstrap_peers(self) -> None:
        """Dial every bootstrap peer; redial lost ones with exponential backoff and jitter."""
        infos = [i for i in (info_from_p2p_addr(Multiaddr(a)) for a in self.cfg.bootstrap_peers()) if i.peer_id != self.me]
        self.bootstrap_ids = {i.peer_id for i in infos}
        if not infos and self.cfg.network != "local" and self.cfg.dht_peers():
            log.info("network %r: no bootstrap peer besides this node; finding peers on the DHT, from %d DHT peers",
                     self.cfg.network, len(self.cfg.dht_peers()))
        elif not infos and self.cfg.network != "local":
            log.warning("network %r: no bootstrap peer besides this node: peers that know its address can join through "
                        "it, but it finds none itself; give the operator's list (--p2p.bootstrap_file, or "
                        "SAPO_P2P__BOOTSTRAP), --bootstrap, or DHT peers (--p2p.dht_bootstrap)", self.cfg.network)
        delay = {i.peer_id: 1.0 for i in infos}
        due = {i.peer_id: 0.0 for i in infos}
        while True:
            connected = self._connected()
            for info in infos:
                if info.peer_id in connected or trio.current_time() < due[info.peer_id]:
                    continue
                self.host.get_network().unblock_peer(info.peer_id)  # our backoff, not the swarm's 60 s ban
                if await self._dial(info):
                    log.info("connected to bootstrap peer %s", info.peer_id)
                    delay[info.peer_id] = 1.0
                else:
                    wait = delay[info.peer_id] * random.uniform(0.8, 1.2)
                    level = logging.WARNING if delay[info.peer_id] == 1.0 else logging.DEBUG
                    log.log(level, "bootstrap peer %s unreachable; retrying in %.0f s (backoff up to %.0f s)",
                            info.peer_id, wait, self.cfg.max_backoff_s)
                    due[info.peer_id] = trio.current_time() + wait
                    delay[info.peer_id] = min(2 * delay[info.peer_id], self.cfg.max_backoff_s)
            await trio.sleep(0.5)

    async def _serve_peer_list(self, stream) -> None:
        """Peer exchange, responder side: the peers we are connected to that speak our gossip, with their addresses.
        Not the others: a DHT server that dialed us is no swarm peer, and an asker that dialed it from our answer
        closed it again at its next sweep (`p2p.rendezvous`), some 200 dials a node in 10 minutes."""
        try:
            asker = stream.muxed_conn.peer_id
            store = self.host.get_peerstore()
            entries = []
            near = self.shard.key_of(asker.to_bytes())  # the asker's own shard first: those are the peers it most wants
            relayed = self.reach.relayed_entries()
            for pid in sorted((p for p in self._connected() if p != asker and p in self.pubsub.peers),
                              key=lambda p: -shared_bits(near, self.shard.key_of(p.to_bytes()))):
                if addrs := [*relayed.get(pid, []), *map(str, store.addrs(pid))][:8]:
                    entries.append({"id": pid.to_base58(), "addrs": addrs})
            await stream.write(msgpack.packb(entries[:EXCHANGE_MAX_PEERS]))
        except Exception as e:
            log.debug("serving the peer list failed: %s", e)
        finally:
            await stream.close()

    async def _exchange_peers(self) -> None:
        """Peer exchange, asking side: learn peers from a random neighbour and dial the new ones.

        Hints are untrusted (`p2p.hints`): a failed dial is held against its address, its host and the
        neighbour that gave it; one answer causes at most `HINT_DIALS_PER_ANSWER` dials, and a failing
        address is logged once. A neighbour that does not answer (peer exchange is optional for other
        implementations) is not asked again for a while.
        """
        silent = SeenKeys(self.cfg.max_backoff_s, REMEMBERED)  # neighbours that did not answer, not asked again yet
        wait = 0.3  # the first ask comes right after the bootstrap connection, to mesh quickly
        while True:
            await trio.sleep(wait)
            wait = self.cfg.peer_exchange_s * random.uniform(0.5, 1.0)
            connected, now = self._connected(), trio.current_time()
            silent.forget_expired(now)
            askable = [p for p in connected if p not in silent and self.hints.may_ask(p, now)]
            if not askable or not self._wants_peers():
                continue
            responder = random.choice(askable)
            infos = await self._ask_peer_list(responder)
            if infos is None:
                silent.add(responder, trio.current_time())
                continue
            await self._dial_hints(responder, infos, connected)

    async def _rendezvous(self) -> None:
        """Peers found on the DHT (`p2p.rendezvous`), dialed as hints under the same budget as peer exchange: each
        pick is charged to the server that named it, and one lookup dials at most `HINT_DIALS_PER_ANSWER` of them,
        taken round-robin over the servers (`Region.picks`)."""
        profile = self.cfg.profile()
        own = advertised(self.host.get_transport_addrs())
        self.rendezvous = Rendezvous(self.host, rendezvous_key(profile.namespace, profile.protocol), self.cfg.dht_peers(),
                                     self.counts, self.hints, lambda info: self.reach.dialable(info, own),
                                     connect=self.punch.seen.connect)

        async def found(picks: list[tuple[ID, PeerInfo]]) -> None:
            tried = 0
            for server, info in picks:
                if tried == HINT_DIALS_PER_ANSWER or not self._wants_peers():
                    return
                if info.peer_id not in self._connected() and self.hints.may_ask(server, trio.current_time()):
                    tried += 1
                    await self._dial_hints(server, [info], self._connected())

        await self.rendezvous.run(found, lambda: set(self.pubsub.peers), self.reach.keeps)

    async def _lan(self) -> None:
        """Peers announced on the LAN (`p2p.lan`), dialed as hints under the same budget as peer exchange."""
        send, receive = trio.open_memory_channel[PeerInfo](QUEUED)
        self.lan = LanDiscovery(self.host, self.base, advertised(self.host.get_transport_addrs()), send, self.counts)
        try:
            await trio.to_thread.run_sync(self.lan.start)
        except Exception as e:  # no multicast here (a container, a firewall): the other ways to find peers remain
            log.warning("mDNS unavailable (%s): peers on the LAN are found through bootstrap peers and the DHT only", e)
            await trio.to_thread.run_sync(self.lan.stop)
            return
        try:
            async for info in receive:
                if self._wants_peers():
                    await self._dial_hints(LAN_SOURCE, [info], self._connected())
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.lan.stop)

    async def _dial_hints(self, responder: Hashable, infos: list[PeerInfo], connected: set[ID]) -> None:
        """Dial the new peers of one answer, nearest our shard first, within the answer's and the addresses'
        budgets (`self.hints`): each peer address by address (`HintBudget.allowance`), every failed attempt
        charged to its address, and a peer reached at none of them to the responder. An mDNS answer's addresses
        are kept apart per peer id (`_addr_key`)."""
        budget = self.hints
        dials, proven = 0, responder in self.bootstrap_ids
        own = advertised(self.host.get_transport_addrs())
        random.shuffle(infos)  # then our own shard first: the peers whose rollouts we hear
        infos.sort(key=lambda i: -shared_bits(self.shard.key, self.shard.key_of(i.peer_id.to_bytes())))
        for info in infos:
            if dials == HINT_DIALS_PER_ANSWER or not budget.may_ask(responder, trio.current_time()):
                return
            now = trio.current_time()
            by_key = {_addr_key(a, info.peer_id if responder == LAN_SOURCE else None): a
                      for a in self.reach.dialable(info, own, alone=not self.pubsub.peers)}
            keys = [k for k in by_key if budget.may_dial(k, now)][:budget.allowance(now, proven)]
            if info.peer_id == self.me or info.peer_id in connected or not keys:
                continue
            with budget.dialing(len(keys), proven):
                if not await self._make_room(shared_bits(self.shard.key, self.shard.key_of(info.peer_id.to_bytes()))):
                    return  # hints are sorted: the rest are no nearer
                dials += 1
                missed = []
                for key in keys:
                    if await self._dial(PeerInfo(info.peer_id, [by_key[key]])):
                        break
                    missed.append(key)
                reached = len(missed) < len(keys)
                if reached:
                    budget.missed(missed, trio.current_time(), proven)
                else:
                    budget.failed(keys, responder, trio.current_time(), proven)
            if reached:
                self._book_heard(responder, [PeerInfo(info.peer_id, [by_key[k] for k in keys])])
                log.info("discovered peer %s", info.peer_id)
                continue
            self.host.get_peerstore().clear_addrs(info.peer_id)  # nothing else dials a failed hint (DHT, identify)
            self.book.failed(info.peer_id.to_base58(), time.time())  # ... nor the address book's rejoin
            self.counts["hints_failed"] += 1
            for key in (k for k in keys if k not in self._logged_hints):
                self._logged_hints.add(key, 0.0)
                log.info("hint %s (from %s) unreachable; not dialed again for %.0f s",
                         key, responder, self.cfg.max_backoff_s)

    def _wants_peers(self) -> bool:
        """Below `max_peers`, or short of `split_authors` neighbours on our shard's topic (then a nearer peer may
        take a farther one's place). Authors count toward a split by the network group of the connection that
        vouches for them (`_validate`), so a node splits only once that many of its shard are its own neighbours;
        shard keys are redrawn every epoch while connections stay, and with D neighbours as the bar a node would
        stop seeking its new shard's peers at about level 2, whatever the swarm's size."""
        return len(self._connected()) < self.cfg.max_peers \
            or len(self.pubsub.peer_topics.get(self.topic, ())) < self.cfg.shards.split_authors

    async def _make_room(self, shared: int) -> bool:
        """Whether a peer sharing `shared` key bits with us may be dialed: below `max_peers`; at it, only a
        peer of our own shard while fewer than `split_authors` neighbours listen on our shard's topic (`_wants_peers`),
        in place of the connected peer farthest from our shard that neither listens on it nor is a bootstrap peer."""
        connected = self._connected()
        if len(connected) < self.cfg.max_peers:
            return True
        listening = self.pubsub.peer_topics.get(self.topic, set())
        if shared < self.shard.level or len(listening) >= self.cfg.shards.split_authors:
            return False
        spare = [p for p in connected if p not in listening and p not in self.bootstrap_ids]
        if not spare:
            return False
        far = min(spare, key=lambda p: shared_bits(self.shard.key, self.shard.key_of(p.to_bytes())))
        if shared_bits(self.shard.key, self.shard.key_of(far.to_bytes())) >= shared:
            return False
        log.debug("closing %s to make room for a peer of our shard", far)
        await self.host.disconnect(far)
        return True

    async def _ask_peer_list(self, peer: ID) -> list[PeerInfo] | None:
        """The peer's answer, or None when it did not answer (logged once per peer)."""
        with trio.move_on_after(DIAL_TIMEOUT_S):
            try:
                stream = await self.host.new_stream(peer, [TProtocol(self.cfg.peer_exchange_protocol())])
                data = b""
                try:
                    while len(data) <= EXCHANGE_MAX_BYTES and (chunk := await stream.read(EXCHANGE_MAX_BYTES)):
                        data += chunk
                except Exception:  # EOF ends the answer; py-libp2p raises rather than returning b""
                    pass
                await stream.close()
                return _parse_peer_list(data)
            except Exception as e:
                if peer not in self._logged_silent:
                    self._logged_silent.add(peer, 0.0)
                    log.info("peer %s does not answer peer exchange (%s); asking others", peer, e or type(e).__name__)
        self.counts["exchange_failed"] += 1
        return None


def _addr_key(addr: Multiaddr, peer: ID | None = None) -> str:
    """What a dial's backoff is kept by: the address (many fresh peer ids at one address cost one dial),
    or, through a relay, the whole circuit (one unreachable peer does not bar its relay's others). With `peer`
    (an mDNS answer, which anyone on the LAN can send for any id at any address), that peer at the address: a
    made-up record bars only the id it made up, never the real peer announced there (py-libp2p reports an mDNS
    service only when it is first added, so a barred address lost the real announcement)."""
    if is_circuit(addr):
        return str(addr)
    bare = str(addr).split("/p2p/")[0]
    return f"{bare}/p2p/{peer}" if peer else bare


def _parse_peer_list(data: bytes) -> list[PeerInfo]:
    """Untrusted input: anything malformed is skipped, never raised."""
    try:
        entries = msgpack.unpackb(data[:EXCHANGE_MAX_BYTES], raw=False)
    except Exception:
        return []
    out = []
    for e in entries[:EXCHANGE_MAX_PEERS] if isinstance(entries, list) else []:
        try:
            out.append(PeerInfo(ID.from_base58(e["id"]), [Multiaddr(a) for a in e["addrs"][:8]]))
        except Exception:
            continue
    return out
