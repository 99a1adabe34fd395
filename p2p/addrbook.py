"""The address book: peers that proved themselves, kept in the node's folder so that a node that has ever been in
the swarm rejoins through them when its other sources of names (the DHT, mDNS, peer exchange, the bootstrap lists)
are unreachable or lie. None of those sources is trusted alone: what they name is only *heard of*.

After Bitcoin Core's address manager as hardened against the eclipse attacks of Heilman et al. (USENIX Security
2015), made small. `tried` holds peers that proved themselves (connected, on our gossip protocol, with messages our
validator accepted), at most `TRIED_PER_GROUP` from one network group of their own; `new` holds peers a source named
that answered our dial there (the host adds no peer a liar merely named), at most `NEW_PER_SOURCE` per network group
of whoever named them, so that one liar's network fills a bounded share of
it however many ids it makes up. Past a table's total bound, the oldest row of its largest group goes: an attacker
with many groups pushes the groups toward equal shares, never an honest group out. At every start the node redials
a few anchors (the most recently proven tried peers, from distinct groups) first, then the other tried peers, then
heard-of peers one per source group (feelers).

The book is one JSON file beside the node's key, written atomically (a temporary file, then a rename); a file that
does not read is one log line naming it, and the book starts empty.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from libp2p.peer.id import ID
from multiaddr import Multiaddr
from pydantic import BaseModel, ValidationError

from p2p.reach import subnet_of

log = logging.getLogger(__name__)

TRIED_MAX = 128  # proven peers kept
TRIED_PER_GROUP = 4  # ... from one network group: a /24 of free ids takes at most this many rows
NEW_MAX = 512  # heard-of peers kept
NEW_PER_SOURCE = 32  # ... from the answers of one source group: one liar's network fills at most 1/16 of `new`
ANCHORS = 3  # tried peers redialed first at every start, each from its own group
MAX_ADDRS = 4  # addresses kept per peer
STALE_S = 14 * 86400.0  # a tried peer not proven for this long is forgotten at its next failed dial
TOUCH_S = 60.0  # a peer proven (or heard of) again moves its time, and is saved again, only after this long
RECORD_S = 5.0  # how often the node looks for connected peers that proved themselves, and saves what changed
REJOIN_DIALS = 8  # dials of a rejoin round after the anchors: a stale book fails at most ANCHORS + this a round
REJOIN_RETRY_S = 15.0  # first wait before another round while the node has no peer at all; doubles to max_backoff_s
SOURCE = "the address book"  # the hint budget's name for the book's dials (`p2p.hints`)
VERSION = 1


@dataclass
class Entry:
    peer: str  # base58 peer id
    addrs: list[str]  # multiaddrs, dialed as given
    group: str  # tried: the peer's own network group; new: the group of whoever named it
    at: float  # wall clock: when last proven (tried) or last heard of (new)


class _File(BaseModel):
    """The file's form: what a hand edit or a torn disk write breaks is refused whole, never half-read."""
    version: Literal[1]
    tried: list[Entry]
    new: list[Entry]


def network_group(ip: str, peer: str) -> str:
    """The group a peer's (or a source's) connection counts in: its /24 (IPv4) or /48 (IPv6), where one owner's
    addresses mostly lie. Over loopback, the peer itself: a local swarm runs every node on 127.0.0.1, and those
    processes are told apart by their identity (their ports change at every start); a stranger cannot reach us from
    loopback."""
    return f"peer:{peer}" if ipaddress.ip_address(ip).is_loopback else subnet_of(ip)


@dataclass
class AddressBook:
    path: Path | None = None  # None: kept in memory only
    tried: dict[str, Entry] = field(default_factory=dict)  # peer -> entry
    new: dict[str, Entry] = field(default_factory=dict)
    changed: bool = False  # since the last save
    unsaved: bool = False  # the last save failed (logged once until one succeeds)

    @classmethod
    def beside(cls, key_file: Path) -> AddressBook:
        """The book of the node whose key is `key_file`, in its folder (`node.key` -> `node.peers.json`): nodes
        that share a folder, as a test's probes do, keep a book each."""
        return cls.load(key_file.with_name(f"{key_file.stem}.peers.json"))

    @classmethod
    def load(cls, path: Path | None) -> AddressBook:
        book = cls(path)
        if path is None or not path.exists():
            return book
        try:
            saved = _File.model_validate_json(path.read_bytes())
        except (OSError, ValidationError, ValueError) as e:
            log.warning("address book %s does not read (%s); starting with an empty book", path,
                        type(e).__name__ if isinstance(e, ValidationError) else e)
            return book
        tried, new = [e for e in saved.tried if _dialable(e)], [e for e in saved.new if _dialable(e)]
        if skipped := len(saved.tried) + len(saved.new) - len(tried) - len(new):
            log.warning("address book %s: skipped %d rows whose peer id or addresses do not read", path, skipped)
        for e in sorted(tried, key=lambda e: e.at):  # through the bounds: a file holds no more than a book
            book.proven(e.peer, e.addrs, e.group, e.at)
        for e in sorted(new, key=lambda e: e.at):
            book.heard(e.group, [(e.peer, e.addrs)], e.at)
        book.changed = False
        return book

    def save(self) -> None:
        """Atomically; a failure is logged (once while they last) and the book is kept to try again."""
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps({"version": VERSION, "tried": [asdict(e) for e in self.tried.values()],
                                       "new": [asdict(e) for e in self.new.values()]}))
            os.replace(tmp, self.path)
            self.changed = self.unsaved = False
        except OSError as e:
            log.log(logging.DEBUG if self.unsaved else logging.WARNING, "cannot save the address book %s: %s; "
                    "trying again as it changes", self.path, e.strerror or e)
            self.unsaved = True

    def proven(self, peer: str, addrs: list[str], group: str, now: float) -> None:
        """`peer`, of network group `group`, proved itself at `now`: into `tried` (out of `new`)."""
        addrs = addrs[:MAX_ADDRS]
        kept = self.tried.get(peer)
        if not addrs or kept and (kept.addrs, kept.group) == (addrs, group) and now - kept.at < TOUCH_S:
            return
        self.new.pop(peer, None)
        _add(self.tried, Entry(peer, addrs, group, now), TRIED_PER_GROUP, TRIED_MAX)
        self.changed = True

    def heard(self, source_group: str, peers: list[tuple[str, list[str]]], now: float) -> None:
        """A source of group `source_group` named these peers (id, addresses): into `new`, unless tried already. A
        peer named again keeps the source that named it first."""
        for peer, addrs in peers:
            if peer in self.tried or not addrs:
                continue
            if (kept := self.new.get(peer)) is None:
                _add(self.new, Entry(peer, addrs[:MAX_ADDRS], source_group, now), NEW_PER_SOURCE, NEW_MAX)
            elif now - kept.at >= TOUCH_S:
                kept.at = now
            else:
                continue
            self.changed = True

    def failed(self, peer: str, now: float) -> None:
        """A dial of `peer` from the book failed: a heard-of peer is forgotten, a tried one only once stale (a peer
        that proved itself is worth a dial at the next start, where a stranger's address is not)."""
        if self.new.pop(peer, None) is not None:
            self.changed = True
        elif (kept := self.tried.get(peer)) and now - kept.at > STALE_S:
            del self.tried[peer]
            self.changed = True

    def anchors(self) -> list[Entry]:
        """The `ANCHORS` most recently proven tried peers, one per group."""
        out, groups = [], set()
        for e in sorted(self.tried.values(), key=lambda e: -e.at):
            if e.group not in groups and len(out) < ANCHORS:
                out.append(e)
                groups.add(e.group)
        return out

    def candidates(self) -> list[tuple[Entry, bool]]:
        """Whom to dial after the anchors to rejoin, in order, each with whether it proved itself: the other tried
        peers (most recently proven first), then one heard-of peer per source group (most recently heard first)."""
        first = {e.peer for e in self.anchors()}
        rest = sorted((e for e in self.tried.values() if e.peer not in first), key=lambda e: -e.at)
        feelers: dict[str, Entry] = {}
        for e in sorted(self.new.values(), key=lambda e: -e.at):
            feelers.setdefault(e.group, e)
        return [(e, True) for e in rest] + [(e, False) for e in feelers.values()]


def _dialable(e: Entry) -> bool:
    try:
        ID.from_base58(e.peer)
        for a in e.addrs:
            Multiaddr(a)
        return True
    except Exception:  # noqa: BLE001 - whatever a torn or edited file holds
        return False


def _add(table: dict[str, Entry], entry: Entry, per_group: int, total: int) -> None:
    """Into `table`, replacing the peer's row; past `per_group` rows of its group the group's oldest goes, past
    `total` rows the oldest of the largest group."""
    table.pop(entry.peer, None)
    same = [e for e in table.values() if e.group == entry.group]
    if len(same) >= per_group:
        del table[min(same, key=lambda e: e.at).peer]
    if len(table) >= total:
        sizes = Counter(e.group for e in table.values())
        largest = max(sizes.values())
        del table[min((e for e in table.values() if sizes[e.group] == largest), key=lambda e: e.at).peer]
    table[entry.peer] = entry
