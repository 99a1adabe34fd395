"""The address book (p2p/addrbook.py): peers that proved themselves, kept on disk and redialed first at start."""

from __future__ import annotations

import json
import logging
import time

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from lab.dht import DHTServers
from p2p.addrbook import (ANCHORS, NEW_MAX, NEW_PER_SOURCE, REJOIN_DIALS, STALE_S, TRIED_MAX, TRIED_PER_GROUP,
                          AddressBook, network_group)
from p2p.config import P2PConfig
from p2p.hints import ADDRS_PER_PEER, TOTAL_FAILURES
from p2p.host import GossipHost
from p2p.policy import MessagePolicy
from rewards.scoring import group_carries_signal
from tests.test_gossip import log_lines, spawn, wait_heard  # noqa: F401 - spawn is a fixture


def fresh() -> str:
    return ID.from_pubkey(create_new_key_pair().public_key).to_base58()


def addr(ip: str, port: int = 4001) -> str:
    return f"/ip4/{ip}/tcp/{port}"


def test_network_groups_are_slash_24_and_slash_48_and_each_peer_on_loopback():
    assert network_group("203.0.113.7", "A") == network_group("203.0.113.200", "B") == "203.0.113.0/24"
    assert network_group("203.0.114.7", "A") != "203.0.113.0/24"
    assert network_group("2001:db8:1:2::1", "A") == network_group("2001:db8:1:ffff::9", "B") == "2001:db8:1::/48"
    assert network_group("127.0.0.1", "A") != network_group("127.0.0.1", "B")  # a local swarm: one group per node


def test_one_source_group_fills_new_only_to_its_share_and_a_many_group_flood_pushes_out_no_honest_group():
    book, now = AddressBook(), 1000.0
    honest = [fresh() for _ in range(3)]
    book.heard("198.51.100.0/24", [(p, [addr(f"198.51.100.{k}")]) for k, p in enumerate(honest, 1)], now)
    book.heard("203.0.113.0/24", [(fresh(), [addr("192.0.2.1", 1000 + k)]) for k in range(5 * NEW_PER_SOURCE)], now + 1)
    assert sum(e.group == "203.0.113.0/24" for e in book.new.values()) == NEW_PER_SOURCE
    for g in range(2 * NEW_MAX // NEW_PER_SOURCE):  # a liar with many networks: twice the table's worth
        book.heard(f"10.{g}.0.0/24", [(fresh(), [addr(f"10.{g}.0.{k}")]) for k in range(NEW_PER_SOURCE)], now + 2 + g)
    assert len(book.new) == NEW_MAX
    assert all(p in book.new for p in honest)  # the largest groups gave up rows, never the small honest one


def test_one_network_group_fills_tried_only_to_its_bound_and_tried_is_bounded_in_total():
    book = AddressBook()
    for k in range(3 * TRIED_PER_GROUP):
        book.proven(fresh(), [addr(f"203.0.113.{k}")], "203.0.113.0/24", 1000.0 + k)
    assert len(book.tried) == TRIED_PER_GROUP
    assert min(e.at for e in book.tried.values()) == 1000.0 + 2 * TRIED_PER_GROUP  # the group's most recent stay
    for g in range(2 * TRIED_MAX):
        book.proven(fresh(), [addr(f"10.{g // 256}.{g % 256}.1")], f"10.{g // 256}.{g % 256}.0/24", 2000.0 + g)
    assert len(book.tried) == TRIED_MAX
    assert sum(e.group == "203.0.113.0/24" for e in book.tried.values()) <= TRIED_PER_GROUP


def test_a_heard_of_peer_that_proves_itself_moves_to_tried_and_is_not_heard_back_into_new():
    book, peer = AddressBook(), fresh()
    book.heard("the DHT", [(peer, [addr("198.51.100.1")])], 1000.0)
    book.proven(peer, [addr("198.51.100.1")], "198.51.100.0/24", 1001.0)
    book.heard("the DHT", [(peer, [addr("203.0.113.9")])], 1002.0)  # a liar re-homing it
    assert peer in book.tried and peer not in book.new and book.tried[peer].addrs == [addr("198.51.100.1")]


def test_anchors_are_the_most_recently_proven_tried_peers_of_distinct_groups():
    book = AddressBook()
    rows = [("203.0.113.0/24", 1005.0), ("203.0.113.0/24", 1004.0), ("198.51.100.0/24", 1003.0),
            ("192.0.2.0/24", 1001.0), ("192.0.2.0/24", 1002.0), ("10.0.0.0/24", 1000.0)]
    peers = {}
    for k, (group, at) in enumerate(rows):
        peers[at] = fresh()
        book.proven(peers[at], [addr(f"{group[:-5]}.{k + 1}")], group, at)
    anchors = book.anchors()
    assert [e.at for e in anchors] == [1005.0, 1003.0, 1002.0] and len(anchors) == ANCHORS
    rest = [e.at for e, proven in book.candidates()]
    assert rest == [1004.0, 1001.0, 1000.0]  # the other tried peers, most recent first


def test_a_stale_book_forgets_a_heard_of_peer_at_its_first_failure_and_a_tried_one_only_once_stale():
    book, now = AddressBook(), 10 * STALE_S
    heard, recent, stale = fresh(), fresh(), fresh()
    book.heard("mDNS", [(heard, [addr("192.168.1.5")])], now)
    book.proven(recent, [addr("198.51.100.1")], "198.51.100.0/24", now - 60)
    book.proven(stale, [addr("203.0.113.1")], "203.0.113.0/24", now - 2 * STALE_S)
    for peer in (heard, recent, stale):
        book.failed(peer, now)
    assert set(book.tried) == {recent} and not book.new


def test_the_book_survives_a_save_and_load_and_leaves_no_temporary_file(tmp_path):
    book = AddressBook.beside(tmp_path / "node.key")
    tried, heard = fresh(), fresh()
    book.proven(tried, [addr("198.51.100.1"), "/ip6/2001:db8::1/tcp/4001"], "198.51.100.0/24", 1000.0)
    book.heard("the DHT", [(heard, [addr("203.0.113.1")])], 1001.0)
    assert book.changed
    book.save()
    assert not book.changed and [p.name for p in tmp_path.iterdir()] == ["node.peers.json"]
    again = AddressBook.beside(tmp_path / "node.key")
    assert again.tried == book.tried and again.new == book.new and not again.changed


@pytest.mark.parametrize("text", ["{not json", '{"version": 1, "tried": [{"peer": 3}], "new": []}',
                                  '{"version": 99, "tried": [], "new": []}', "\x00" * 64])
def test_a_book_that_does_not_read_is_one_log_line_naming_it_and_an_empty_book(tmp_path, caplog, text):
    path = tmp_path / "node.peers.json"
    path.write_text(text)
    with caplog.at_level(logging.INFO, logger="p2p.addrbook"):
        book = AddressBook.load(path)
    assert not book.tried and not book.new
    assert len(caplog.records) == 1 and str(path) in caplog.records[0].getMessage()
    assert path.read_text() == text  # left for its owner to look at until the book saves over it


def test_rows_that_do_not_read_are_skipped_and_the_rest_kept(tmp_path, caplog):
    path, good = tmp_path / "node.peers.json", fresh()
    path.write_text(json.dumps({"version": 1, "new": [], "tried": [
        {"peer": good, "addrs": [addr("198.51.100.1")], "group": "198.51.100.0/24", "at": 1.0},
        {"peer": "not a peer id", "addrs": [addr("198.51.100.2")], "group": "198.51.100.0/24", "at": 2.0},
        {"peer": fresh(), "addrs": ["not an address"], "group": "203.0.113.0/24", "at": 3.0}]}))
    with caplog.at_level(logging.INFO, logger="p2p.addrbook"):
        book = AddressBook.load(path)
    assert list(book.tried) == [good] and len(caplog.records) == 1 and "skipped 2 rows" in caplog.text


def test_a_stale_book_costs_one_bounded_round_of_dials_and_spends_no_strangers_allowance():
    """A book whose peers are all gone: a round dials the anchors and `REJOIN_DIALS` others, one connection attempt
    each; the next round only the peers not dialed yet, none twice within the hint window; the unproven allowance the
    DHT's and peer exchange's hints share stays whole. Each dead peer sits at a loopback address of its own
    (127.0.0.k), as peers of distinct hosts would."""
    accepted: list[str] = []

    async def main() -> tuple[GossipHost, int]:
        cfg = P2PConfig(network="local", listen=["/ip4/127.0.0.1/tcp/0"])
        book = AddressBook()
        node = GossipHost(cfg, create_new_key_pair(), MessagePolicy(cfg.limits, cfg.rollout_topic_base(),
                          signal=group_carries_signal), on_message=lambda m: None, book=book)
        async with trio.open_nursery() as nursery:
            for k in range(2, 2 + ANCHORS + REJOIN_DIALS + 4):
                ip = f"127.0.0.{k}"
                [listener] = await trio.open_tcp_listeners(0, host=ip)

                async def hang_up(stream: trio.SocketStream, ip: str = ip) -> None:
                    accepted.append(ip)
                    await stream.aclose()

                nursery.start_soon(trio.serve_listeners, hang_up, [listener])
                book.proven(fresh(), [addr(ip, listener.socket.getsockname()[1])], f"peer:{k}", time.time() - 60 + k)
            async with node.host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                for _ in range(3):  # at once: every address dialed is still within its window
                    await node._rejoin()
                    rounds.append(len(accepted))
                allowance = node.hints.allowance(trio.current_time(), proven=False)
            nursery.cancel_scope.cancel()
        return node, allowance

    rounds: list[int] = []
    node, allowance = trio.run(main)
    assert rounds == [ANCHORS + REJOIN_DIALS, ANCHORS + REJOIN_DIALS + 4, ANCHORS + REJOIN_DIALS + 4]
    assert len(set(accepted)) == len(accepted)
    assert node.counts["book_anchors_dialed"] == ANCHORS and node.counts["book_rejoined"] == 0
    assert allowance == min(ADDRS_PER_PEER, TOTAL_FAILURES)  # strangers' hints are dialed as if the book were empty
    assert len(node.book.tried) == ANCHORS + REJOIN_DIALS + 4  # proven peers, recently: kept for the next start


@pytest.mark.slow
def test_a_node_restarted_with_the_dht_unreachable_rejoins_through_its_address_book(spawn, tmp_path):  # noqa: F811
    """The issue's "done when": a and b meet through the DHT; a stops, the DHT goes away, and a restarted with the
    same key (so the same folder and book) and only the dead DHT address hears b again within a minute. b must let the
    returning id into its mesh: GossipSub's backoff for a's id (set when a left) refused its GRAFTs, and the node
    stayed connected and unfed (`CountingGossipSub.add_peer` clears a peer's backoff when it connects anew)."""
    servers = DHTServers(1)
    dht = servers.addrs[0]
    try:
        a = spawn("a", "--rate", "2", "--dht-bootstrap", dht)
        b = spawn("b", "--rate", "2", "--dht-bootstrap", dht)
        since = time.time()
        wait_heard(a, [b], since, timeout=60)
        a.wait_for(lambda: a.stats().get("book_tried") == 1, 30, "b proven in a's book")
    finally:
        servers.close()
    assert a.stop() == 0
    b.wait_for(lambda: b.stats().get("peers") == 0, 30, "a and the DHT server gone")
    saved = json.loads((tmp_path / "a.peers.json").read_text())
    assert [e["peer"] for e in saved["tried"]] == [b.peer_id]
    again = spawn("a-again", "--rate", "2", "--dht-bootstrap", dht, key=a.key)
    restarted = again.ready()["t"]
    wait_heard(again, [b], restarted, timeout=60)
    again.wait_for(lambda: again.stats().get("book_rejoined") == 1, 10, "the rejoin counted")
    assert again.stats()["book_anchors_dialed"] == 1
    wait_heard(b, [again], restarted, timeout=30)
    for node in (again, b):
        assert log_lines(node, " ERROR ") == [] and "Traceback" not in node.log_path.read_text()
