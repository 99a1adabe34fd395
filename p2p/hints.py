"""Which peer-exchange hints a node dials. Hints are untrusted: peer ids and ports cost a liar nothing,
so a liar's answers could aim a swarm's dials at any host (32 fresh ids advertising one port each made
the nodes try 57 ports of one IP 366 times in 62 s). Failed dials are therefore remembered three ways
within a window: by address (not dialed again), by host, all its ports together (left alone after
`HOST_FAILURES`), by the peer that gave the hint (not asked again after `SOURCE_FAILURES`), and all together:
past `TOTAL_FAILURES` failed addresses no hint is dialed until the oldest leaves the window, except a bootstrap peer's
(30 fresh liar ids, each naming other hosts, had 3 nodes open 421 connections to 56 hosts in 62 s).

A hinted peer is dialed address by address, at most `ADDRS_PER_PEER` of them (py-libp2p dials one TCP address per
peer): each attempt is charged to its own address, so an honest peer's second address is tried after its first
fails, and a made-up peer listing 8 addresses costs the ones dialed, not the whole budget for the window.
Addresses being dialed count against `TOTAL_FAILURES` until they are reached (`HintBudget.dialing`): peer exchange,
the DHT and mDNS dial at once, and each would otherwise see the same room left."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

HOST_FAILURES = 4  # failed dials to one host within a window before its hints are left alone
SOURCE_FAILURES = 4  # failed hints from one peer within a window before it is not asked again
TOTAL_FAILURES = 8  # failed connection attempts to hints of unproven sources within a window, all together
ADDRS_PER_PEER = 2  # addresses of one hinted peer dialed, one after another: a made-up peer costs 2 of TOTAL_FAILURES
REMEMBERED = 4096  # keys the discovery loop keeps per table (backoff, logged once): past it the oldest go


def host_of(key: str) -> str:
    """The host part of an address key (`/ip4/<ip>`, `/dns4/<name>`...); a key that names its peer (a relay circuit,
    a peer at an address heard over mDNS) is its own."""
    return key if "/p2p/" in key else "/".join(key.split("/")[:3])


class Recent:
    """How many times each key happened within the last `window_s` seconds, for at most `max_keys` keys."""

    def __init__(self, window_s: float, max_keys: int = REMEMBERED):
        self.window_s, self.max_keys = window_s, max_keys
        self._times: OrderedDict[Hashable, deque[float]] = OrderedDict()

    def add(self, key: Hashable, now: float) -> None:
        times = self._times.pop(key, None) or deque()
        times.append(now)
        self._times[key] = times  # most recent last
        while len(self._times) > self.max_keys:
            self._times.popitem(last=False)

    def count(self, key: Hashable, now: float) -> int:
        times = self._times.get(key)
        while times and times[0] < now - self.window_s:
            times.popleft()
        return len(times) if times else 0


class HintBudget:
    def __init__(self, window_s: float):
        self._addrs, self._hosts, self._sources = Recent(window_s), Recent(window_s), Recent(window_s)
        self._unproven = Recent(window_s)  # failures of every unproven source's hints, under one key
        self._in_flight = 0  # unproven hints' addresses chosen for a dial that has not ended

    def may_dial(self, key: str, now: float) -> bool:
        return not self._addrs.count(key, now) and self._hosts.count(host_of(key), now) < HOST_FAILURES

    def allowance(self, now: float, proven: bool) -> int:
        """How many addresses the next hinted dial may try: `ADDRS_PER_PEER`, within what is left of `TOTAL_FAILURES`
        unless the hint comes from a proven source (a bootstrap peer, whom the operator named)."""
        left = REMEMBERED if proven else TOTAL_FAILURES - self._unproven.count(None, now) - self._in_flight
        return max(0, min(ADDRS_PER_PEER, left))

    @contextmanager
    def dialing(self, addrs: int, proven: bool) -> Iterator[None]:
        """`addrs` addresses the caller chose within `allowance` and will dial: held from the rest of the allowance
        until the dial ends. Enter it before the next await, and record the failures before leaving it."""
        held = 0 if proven else addrs
        self._in_flight += held
        try:
            yield
        finally:
            self._in_flight -= held

    def may_ask(self, source: Hashable, now: float) -> bool:
        return self._sources.count(source, now) < SOURCE_FAILURES

    def missed(self, keys: list[str], now: float, proven: bool = False) -> None:
        """Connection attempts to these addresses failed, one each, whether or not the peer was reached at another."""
        for key in keys:
            self._addrs.add(key, now)
            if not proven:
                self._unproven.add(None, now)
        for host in {host_of(k) for k in keys}:
            self._hosts.add(host, now)

    def failed(self, keys: list[str], source: Hashable, now: float, proven: bool = False) -> None:
        """A dial of one hinted peer at these addresses failed: each was one connection attempt, and the hint is
        held against `source`."""
        self.missed(keys, now, proven)
        self._sources.add(source, now)
