"""Kademlia lookups that a few hostile servers near the key can neither steer nor starve (p2p/kad.py), beside what
py-libp2p 0.8.1's own lookups do with the same answers."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from contextlib import AsyncExitStack

import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.network.config import RetryConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from p2p import kad
from p2p.hints import TOTAL_FAILURES, HintBudget
from p2p.host import NoBackgroundDials
from p2p.kad import FAILURES_PER_MINUTE, DialBudget, KadClient, Region, key_bytes
from p2p.rendezvous import rendezvous_key
from lab.dht import DHTServers, HostileDHT, JsDHTServer
from lab.listeners import ConnectionCounter
from tests.test_gossip import log_lines, spawn, wait_heard  # noqa: F401 - spawn is a fixture
from tests.test_interop import js_peer  # noqa: F401 - a fixture

KEY = rendezvous_key("local", 3)
FAKE_HOSTS = [f"127.0.0.{k}" for k in range(2, 10)]


def peer(n: int = 0) -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


@pytest.fixture
def dht(tmp_path):
    """Five DHT servers: two honest ones that know three hostile ones with ids ground near the key, whose made-up
    peers all sit at `FAKE_HOSTS`, where a listener counts every connection and closes it. The honest ones are
    py-libp2p's, or with `js` (the command that runs node) js-libp2p's, which name no client in their answers: two
    clients then meet only through provider records. Returns the honest servers' addresses, the hostile ones, the
    counter."""
    counter = ConnectionCounter(FAKE_HOSTS)
    made: list = []

    def make(closer: int = 20, providers: int = 0, js: str | None = None) -> tuple[list[str], HostileDHT, ConnectionCounter]:
        hostile = HostileDHT(3, KEY, counter.addrs, closer=closer, providers=providers)
        made.append(hostile)
        if js is None:
            honest = DHTServers(2)
            made.append(honest)
            honest.know(hostile.addrs)
            return honest.addrs, hostile, counter
        first = JsDHTServer(js, hostile.addrs, tmp_path / "js-dht-0.log")
        made.append(first)
        second = JsDHTServer(js, [first.addr, *hostile.addrs], tmp_path / "js-dht-1.log")
        made.append(second)
        return [first.addr, second.addr], hostile, counter

    yield make
    for servers in made:
        servers.close()
    counter.close()


async def clients(n: int, servers: list[str], stack: AsyncExitStack):
    """Hosts connected to `servers`, whose only dialer is the code under test, one attempt an address (as a node's)."""
    hosts = [new_host(key_pair=create_new_key_pair()) for _ in range(n)]
    for h in hosts:
        h.get_network().auto_connector = NoBackgroundDials(h.get_network())
        h.get_network().retry_config = RetryConfig(max_retries=0)
        await stack.enter_async_context(h.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]))
        for addr in servers:
            await h.connect(info_from_p2p_addr(Multiaddr(addr)))
    return hosts


def known(servers: list[str]) -> list[PeerInfo]:
    return [info_from_p2p_addr(Multiaddr(a)) for a in servers]


def test_the_librarys_lookup_dials_what_servers_near_the_key_name_and_keeps_their_addresses(dht):
    """Why p2p.kad exists: py-libp2p's iterative lookup writes every made-up closer peer into the host's address book
    for an hour and dials them by the dozen."""
    honest, hostile, counter = dht()

    async def scenario() -> tuple[int, int]:
        async with AsyncExitStack() as stack:
            (host,) = await clients(1, honest + hostile.addrs, stack)
            kad = KadDHT(host, DHTMode.CLIENT, enable_values=False)
            await stack.enter_async_context(background_trio_service(kad))
            for info in known(honest + hostile.addrs):
                await kad.add_peer(info.peer_id)
            with trio.move_on_after(40):
                await kad.peer_routing.find_closest_peers_network(key_bytes(KEY))
            stored = sum(1 for p in host.get_peerstore().peer_ids()
                         if any(str(a).startswith(tuple(f"/ip4/{h}/" for h in FAKE_HOSTS))
                                for a in host.get_peerstore().addrs(p)))
            return counter.count, stored

    dialed, stored = trio.run(scenario)
    assert dialed > 2 * FAILURES_PER_MINUTE and stored > 20, (dialed, stored)


def test_our_lookup_dials_few_made_up_servers_keeps_none_and_still_reaches_the_honest_region(dht):
    honest, hostile, counter = dht()

    async def scenario() -> tuple[Region, int]:
        async with AsyncExitStack() as stack:
            (host,) = await clients(1, honest + hostile.addrs, stack)
            client = KadClient(host, DialBudget(host, HintBudget(60.0)), lambda info: info.addrs)
            region = await client.lookup(key_bytes(KEY), known(honest + hostile.addrs))
            stored = [p for p in host.get_peerstore().peer_ids()
                      if any(str(a).startswith(tuple(f"/ip4/{h}/" for h in FAKE_HOSTS))
                             for a in host.get_peerstore().addrs(p))]
            return region, len(stored)

    region, stored = trio.run(scenario)
    assert counter.count <= FAILURES_PER_MINUTE and region.failed <= FAILURES_PER_MINUTE
    assert stored == 0
    assert {i.peer_id for i in known(honest + hostile.addrs)} <= set(region.servers)  # all five answered


def test_servers_no_path_reached_are_asked_while_the_region_has_room(dht, monkeypatch):
    """A path stops after `PATH_QUERIES`; the known servers it did not reach are asked after the walk. With no path
    asking anything, that step alone finds the region (it indexed an empty list of answers and raised)."""
    honest, hostile, _ = dht()
    monkeypatch.setattr(kad, "PATH_QUERIES", 0)

    async def scenario() -> Region:
        async with AsyncExitStack() as stack:
            (host,) = await clients(1, honest + hostile.addrs, stack)
            client = KadClient(host, DialBudget(host, HintBudget(60.0)), lambda info: info.addrs)
            return await client.lookup(key_bytes(KEY), known(honest + hostile.addrs))

    region = trio.run(scenario)
    assert set(region.servers) == {i.peer_id for i in known(honest + hostile.addrs)}


def test_an_answers_circuit_addresses_are_kept_as_the_relay_names_them_and_other_transports_left_out():
    """A home node's provider record lists circuits through its relays; js-libp2p's servers put the address they saw
    the provider at first. Kept: direct TCP addresses and TCP circuits, each once, at most `MAX_ADDRS`."""
    relay = peer()
    circuit = f"/ip4/198.18.1.2/tcp/4001/p2p/{relay}/p2p-circuit"
    raw = ["/ip4/198.18.2.2/tcp/51000", f"{circuit}/p2p/{peer(1)}", circuit, "/ip4/198.18.1.2/tcp/4001/p2p-circuit",
           "/ip4/198.18.2.2/udp/4001/quic-v1", f"/ip4/198.18.2.2/tcp/4001/p2p/{peer(1)}", "/ip4/198.18.2.3/tcp/1",
           "/ip4/198.18.2.4/tcp/1"]
    assert [str(a) for a in kad.tcp_addrs([Multiaddr(a).to_bytes() for a in raw] + [b"junk"])] == [
        "/ip4/198.18.2.2/tcp/51000", circuit, "/ip4/198.18.2.2/tcp/4001", "/ip4/198.18.2.3/tcp/1"]


def test_server_dials_in_flight_count_against_the_minutes_failures():
    """The three paths dial at once: each saw the same room left under `FAILURES_PER_MINUTE` and together they
    overdrew it. An attempt now holds its place until it succeeds."""
    class Unanswered:  # a host whose every dial hangs until the test lets go
        def __init__(self):
            self.attempts, self.release = 0, trio.Event()

        async def connect(self, info: PeerInfo) -> None:
            self.attempts += 1
            await self.release.wait()
            raise OSError("made up")

        def get_peerstore(self):
            return self

        def clear_addrs(self, peer_id: ID) -> None:
            pass

    host = Unanswered()
    budget = DialBudget(host, HintBudget(60.0))
    servers = [kad.Server(PeerInfo(peer(), [Multiaddr(f"/ip4/198.18.0.{i}/tcp/1")]), 0, None) for i in range(10)]

    async def _append(results: list[bool], dial) -> None:
        results.append(await dial)

    async def scenario() -> list[bool]:
        results: list[bool] = []
        async with trio.open_nursery() as nursery:
            for server in servers:
                nursery.start_soon(lambda s=server: _append(results, budget.dial(s)))
            await trio.sleep(0.1)
            assert host.attempts == FAILURES_PER_MINUTE and budget.exhausted(trio.current_time())
            host.release.set()
        return results

    results = trio.run(scenario)
    assert host.attempts == FAILURES_PER_MINUTE and results == [False] * len(servers)
    assert budget.failures.count(None, 0.0) == FAILURES_PER_MINUTE and budget.in_flight == 0


@pytest.mark.parametrize("flood", [0, 32], ids=["eclipse", "provider-flood"])
def test_a_provider_is_told_to_the_whole_region_and_found_first_among_made_up_ones(dht, flood):
    """Hostile servers nearest the key drop our record and answer with made-up closer peers, and under a flood with
    32 made-up providers each: the honest servers of the region hold the record, and the first picks, one per
    answering server, include the honest provider."""
    honest, hostile, _ = dht(providers=flood)

    async def scenario() -> tuple[ID, int, list[tuple[ID, PeerInfo]]]:
        async with AsyncExitStack() as stack:
            a, b = await clients(2, honest + hostile.addrs, stack)
            seeds = known(honest + hostile.addrs)
            ka, kb = (KadClient(h, DialBudget(h, HintBudget(60.0)), lambda info: info.addrs) for h in (a, b))
            told = await ka.provide(key_bytes(KEY), (await ka.lookup(key_bytes(KEY), seeds)).servers)
            region = await kb.lookup(key_bytes(KEY), seeds)
            return a.get_id(), told, region.picks({b.get_id()})

    a_id, told, picks = trio.run(scenario)
    assert told == 5 and sum(hostile.asked.values()) > 0 and hostile.asked.get("ADD_PROVIDER") == 3
    assert a_id in [info.peer_id for _, info in picks[:4]]
    assert len(picks) == 1 + 3 * flood  # every made-up provider once, after the honest one's turn


def test_picks_take_one_provider_from_each_server_in_turn_whatever_one_server_names():
    honest, liars = [peer() for _ in range(2)], [peer() for _ in range(3)]
    good = PeerInfo(peer(), [Multiaddr("/ip4/127.0.0.1/tcp/1")])
    fakes = {s: [PeerInfo(peer(), [Multiaddr("/ip4/127.0.0.2/tcp/1")]) for _ in range(32)] for s in liars}
    region = Region(honest + liars, {**fakes, **{s: [good] for s in honest}})
    for seed in range(20):
        picks = region.picks(set(), random.Random(seed))
        assert good.peer_id in [info.peer_id for _, info in picks[:4]]
        assert len({server for server, _ in picks[:4]}) == 4
    assert Region([], {liars[0]: [good]}).picks({good.peer_id}) == []  # ourselves, or an excluded peer, never


@pytest.mark.slow
@pytest.mark.parametrize("flood", [0, 32], ids=["eclipse", "provider-flood"])
def test_two_nodes_that_know_only_dht_servers_meet_within_two_lookups_beside_three_hostile_ones(spawn, dht, js_peer,  # noqa: F811
                                                                                                 flood):
    """The issue's case: three hostile servers nearest the key among five, under an eclipse (made-up closer peers, no
    providers) and under a provider flood (32 made-up providers per answer). The honest servers are js-libp2p's, which
    name no client: the nodes meet through a provider record or not at all. Each node opens at most
    `FAILURES_PER_MINUTE` server dials and `TOTAL_FAILURES` provider dials a minute to the made-up hosts."""
    honest, hostile, counter = dht(providers=flood, js=js_peer[0])
    boot = [arg for addr in honest + hostile.addrs for arg in ("--dht-bootstrap", addr)]
    start = time.monotonic()
    a = spawn("a", "--rate", "2", *boot)
    counter.watch.add(a.proc.pid)  # the servers dial the made-up hosts too: only the nodes' connections count here
    a.wait_for(lambda: a.stats().get("dht_lookups", 0) >= 1, 60, "a's first lookup")
    b = spawn("b", "--rate", "2", *boot)
    counter.watch.add(b.proc.pid)
    since = time.time()
    wait_heard(b, [a], since, timeout=60)
    assert b.stats().get("dht_lookups", 0) <= 2, b.stats()  # counted once its picks are dialed
    wait_heard(a, [b], since, timeout=30)
    b.wait_for(lambda: (b.stats().get("dht_providers") or 0) >= 1, 30, "a counted as found once it spoke our gossip")
    minutes = math.ceil((time.monotonic() - start) / 60)
    for node in (a, b):
        dials = counter.owners.count(node.proc.pid)
        assert dials <= (FAILURES_PER_MINUTE + TOTAL_FAILURES) * minutes, (dials, minutes)
        assert log_lines(node, " ERROR ") == [], log_lines(node, " ERROR ")
