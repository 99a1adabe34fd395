"""Typed knobs of the gossip layer: addresses, identity, wire limits and the rollout pool."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from p2p.network import NetworkProfile, check_multiaddrs, load_network
from p2p.shards import MAX_LEVEL, ShardLevel, epoch_of

DEFAULT_PORT = 7420


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _addr_list(value: Any) -> Any:
    """Accept 'a,b' or 'a b' as well as a (JSON) list, so env vars and flags need no JSON."""
    if isinstance(value, str):
        if value.strip().startswith("["):
            return json.loads(value)
        return [part for part in value.replace(",", " ").split() if part]
    return value


AddrList = Annotated[list[str], NoDecode]  # SAPO_P2P__BOOTSTRAP="a,b" reaches _addr_list undecoded


def read_bootstrap_file(path: Path) -> list[str]:
    """An operator's bootstrap list: one full multiaddr per line, `#` comments; ValueError names the bad line."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    addrs = []
    for number, line in enumerate(lines, 1):
        if text := line.split("#", 1)[0].strip():
            try:
                addrs += check_multiaddrs([text], need_peer_id=True)
            except ValueError as e:
                raise ValueError(f"{path} line {number}: {e}") from None
    return addrs


class Limits(Section):
    """What a message may hold. Receivers enforce these; publishers split to stay inside them."""

    max_message_bytes: int = Field(256 * 1024, ge=1024, le=1_000_000,
                                   description="largest gossip message in bytes (libp2p silently drops ~1 MiB and up)")
    max_groups: int = Field(64, ge=1, description="rollout groups per message")
    max_completions: int = Field(64, ge=1, description="completions per group")
    max_completion_chars: int = Field(8192, ge=1, description="characters per completion")
    max_clock_skew_s: float = Field(30.0, ge=0, description="reject messages created further than this in the future")
    max_message_age_s: float = Field(300.0, gt=0, description="reject messages created longer ago than this")
    max_author_kib_per_s: int = Field(32, ge=1, description="most message bytes a second accepted from one author, "
                                      "after a burst of two of the largest messages; a node paces its own to stay under")


class PoolConfig(Section):
    size: int = Field(1024, ge=1, description="most rollout groups held from other peers")
    max_peer_share: float = Field(0.25, gt=0, le=1, description="most of the pool one peer may hold (its oldest go first)")
    unproven_share: float = Field(0.25, gt=0, le=1, description="most of the pool that peers whose groups have not yet "
                                  "carried learning signal here may hold together, however many identities they are")
    max_age_s: float = Field(300.0, gt=0, description="drop received groups older than this")


class ShardConfig(Section):
    """Rollout topic shards (docs/PROTOCOL.md section 7): what a node hears grows with its shard, not the swarm."""

    level: Literal["auto"] | Annotated[int, Field(ge=0, le=MAX_LEVEL)] = Field(
        "auto", description="shard level: auto follows the swarm's size; a number pins it (0: one topic for all, "
        "every node receives every rollout)")
    min_authors: int = Field(6, ge=2, description="fewest authors (this node included) a shard should hold; below "
                             "this the node moves to the parent shard")
    split_authors: int = Field(12, ge=4, description="authors in a shard at which the node moves to its child shard "
                               "(if that holds min_authors)")
    window_s: float = Field(120.0, gt=0, description="authors heard within this window count; longer than the "
                            "slowest peer's round")

    @model_validator(mode="after")
    def _split_in_two(self) -> "ShardConfig":
        if self.split_authors < 2 * self.min_authors:
            raise ValueError(f"split_authors ({self.split_authors}) must be at least twice min_authors "
                             f"({self.min_authors}): a shard splits in two")
        return self

    def level_of(self, peer: bytes, epoch_s: float, now: float) -> ShardLevel:
        return ShardLevel(peer, epoch_s, epoch_of(now, epoch_s), self.min_authors, self.split_authors, self.window_s,
                          pinned=None if self.level == "auto" else self.level)


class P2PConfig(Section):
    enabled: bool = Field(True, description="join the swarm; false runs a silo without any network")
    network: str = Field("local", description="network profile: local, testnet, or a profile file (namespace, "
                         "protocol, bootstrap peers); swarms on different networks never mix")
    listen: AddrList = Field(default_factory=lambda: [f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}"], min_length=1,
                              description="multiaddrs to listen on (tcp port 0 picks a free port)")
    announce: AddrList = Field(default_factory=list,
                                description="addresses to tell peers instead of the listen ones (a public IP or DNS name)")
    bootstrap: AddrList = Field(default_factory=list, description="full multiaddrs (with /p2p/<id>) of peers to join through")
    bootstrap_file: Path | None = Field(None, description="a file of more bootstrap multiaddrs, one per line (# comments): "
                                        "a network operator's list, read at start, so a new list needs no new release")
    dht: bool = Field(True, description="find the network's peers on a Kademlia DHT (the network's DHT bootstrap "
                      "peers, or dht_bootstrap): provide its rendezvous key and look it up (docs/network.md)")
    dht_bootstrap: AddrList = Field(default_factory=list, description="full multiaddrs of DHT peers to look the network "
                                    "up from, in place of the network profile's")
    upnp: bool = Field(True, description="ask the LAN's router (UPnP IGD, else NAT-PMP) to forward the listening port when the node "
                       "listens on a private address, and remove the mapping at stop")
    mdns: bool = Field(True, description="find peers of the network on the LAN with mDNS (only on the interfaces the node "
                       "listens on: none on 127.0.0.1)")
    key_file: Path | None = Field(None, description="Ed25519 identity, created on first run (default: <run.out_dir>/node.key)")
    reachability: Literal["auto", "public", "private"] = Field(
        "auto", description="whether peers can dial this node: auto asks peers to dial it back; a node they "
        "cannot dial (behind a home router) is reached through relays")
    relays: int = Field(2, ge=1, le=8, description="relays a node that cannot be dialed keeps a reservation with")
    relay_slots: int = Field(32, ge=0, description="peers behind NAT a dialable node relays for (0: none)")
    relay_after_s: float = Field(600.0, ge=0, description="how long a peer behind NAT must have taken part (its signed "
                                 "messages accepted here, with no silence of 20 minutes) before it may reserve one of this "
                                 "node's relay slots: a peer id and a computable group cost nothing, time does")
    relay_circuit_s: int = Field(600, ge=1, description="longest a relayed connection lasts before its peer dials "
                                 "it again (the reachability recheck period)")
    relay_circuit_mib: int = Field(64, ge=1, description="most bytes one relayed connection carries, both ways "
                                   "(12 authors sending 10 KB a second come to 72 MB in 10 minutes, over all of a peer's connections)")
    relay_kib_per_s: int = Field(256, ge=1, description="most bytes a second this node relays in all: relaying costs "
                                 "it CPU (6.3 MiB/s made a tiny-a round 3.2x as long, 512 KiB/s 1.20x, 256 KiB/s 1.06x: bench_hostile relay-abuse)")
    hole_punching: bool = Field(True, description="upgrade a peer reached through a relay to a direct connection by "
                                "hole punching (DCUtR); its dials count against the hint budget")
    max_peers: int = Field(32, ge=1, description="stop dialing discovered peers beyond this many connections")
    mesh_degree: int = Field(4, ge=1, le=32, description="GossipSub D: peers each message is pushed to (low D-D/3, high 2D)")
    heartbeat_s: float = Field(1.0, gt=0, le=60, description="GossipSub heartbeat interval")
    peer_exchange_s: float = Field(3.0, gt=0, description="ask a random peer for its peers this often")
    max_backoff_s: float = Field(60.0, ge=1, description="longest wait between redials of a lost bootstrap peer")
    max_messages_per_s: float = Field(100.0, gt=0, description="GossipSub spam limit per neighbour, own publishes included")
    limits: Limits = Field(default_factory=Limits)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    shards: ShardConfig = Field(default_factory=ShardConfig)

    _split = field_validator("listen", "announce", "bootstrap", "dht_bootstrap", mode="before")(_addr_list)

    @field_validator("listen", "announce")
    @classmethod
    def _valid(cls, v: list[str]) -> list[str]:
        for addr in v:  # the node adds its own id: with another one it would announce /p2p/<that id>/p2p/<its own>
            if re.search(r"/p2p/[^/]+$", addr):
                raise ValueError(f"{addr} ends in a peer id: give the address alone, the node adds its own /p2p/<id>")
        return check_multiaddrs(v, need_peer_id=False)

    @field_validator("bootstrap")
    @classmethod
    def _valid_bootstrap(cls, v: list[str]) -> list[str]:
        return check_multiaddrs(v, need_peer_id=True)

    @field_validator("dht_bootstrap")
    @classmethod
    def _valid_dht_bootstrap(cls, v: list[str]) -> list[str]:
        return check_multiaddrs(v, need_peer_id=True, dnsaddr=True)

    @field_validator("bootstrap_file", mode="before")
    @classmethod
    def _unset_when_empty(cls, v: Any) -> Any:
        return None if isinstance(v, str) and not v.strip() else v  # SAPO_P2P__BOOTSTRAP_FILE= (empty) unsets it

    @field_validator("bootstrap_file")
    @classmethod
    def _readable_list(cls, v: Path | None) -> Path | None:
        if v is not None:
            read_bootstrap_file(v)
        return v

    @field_validator("network")
    @classmethod
    def _known_network(cls, v: str) -> str:
        load_network(v)
        return v

    def profile(self) -> NetworkProfile:
        return load_network(self.network)

    def bootstrap_peers(self) -> list[str]:
        """Peers given here, then the operator's list, then the network's own: any one of them is enough to join."""
        listed = read_bootstrap_file(self.bootstrap_file) if self.bootstrap_file else []
        return list(dict.fromkeys([*self.bootstrap, *listed, *self.profile().bootstrap]))

    def dht_peers(self) -> list[str]:
        """The DHT peers to look the network up from: this config's, else the network profile's; none with dht off."""
        return (self.dht_bootstrap or list(self.profile().dht_bootstrap)) if self.dht else []

    def mesh_low(self) -> int:
        """GossipSub D_lo: below this many mesh peers the heartbeat grafts more."""
        return max(1, self.mesh_degree - self.mesh_degree // 3)

    def rollout_topic_base(self) -> str:
        """Shard topics are this plus `/s<bits>` (p2p.shards)."""
        profile = self.profile()
        return f"/sapo/{profile.namespace}/rollouts/{profile.protocol}"

    def peer_exchange_protocol(self) -> str:
        return f"/sapo/{self.profile().namespace}/peers/1.0.0"
