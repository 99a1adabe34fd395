"""Network profiles: which swarm a node joins (topic namespace, protocol version, bootstrap peers,
shard epoch).

`local` and `testnet` ship with the package (p2p/networks/*.toml); any other value of
`p2p.network` is read as the path of a profile file with the same fields.
"""

from __future__ import annotations

import tomllib
from functools import cache
from pathlib import Path

from multiaddr import Multiaddr
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from p2p.config_errors import describe
from p2p.shards import EPOCH_S

# The wire protocol's major version this sapo-node speaks (docs/PROTOCOL.md). It lives here, the lowest
# module that needs it: a profile names the version its network speaks, and p2p.wire encodes it.
VERSION = 3
SHIPPED = Path(__file__).with_name("networks")


def check_multiaddrs(addrs: list[str], need_peer_id: bool, dnsaddr: bool = False) -> list[str]:
    """`dnsaddr`: a `/dnsaddr/<name>/p2p/<id>` address (resolved through DNS TXT records, as kubo's bootstrap list
    is written) is accepted too."""
    for a in addrs:
        try:
            parsed = Multiaddr(a)
        except Exception as e:  # multiaddr raises several unrelated types for bad text
            raise ValueError(f"not a multiaddr: {a!r} ({e})") from None
        names = [p.name for p in parsed.protocols()]
        if dnsaddr and names[:1] == ["dnsaddr"]:
            if "p2p" not in names:
                raise ValueError(f"{a!r} has no /p2p/<peer id> part: a /dnsaddr name is resolved to one peer's addresses")
            continue
        if "tcp" not in names:  # py-libp2p would log the failure and carry on without the address
            raise ValueError(f"{a!r} has no /tcp/<port> part: nodes speak libp2p over TCP only")
        if need_peer_id and "p2p" not in names:
            raise ValueError(f"{a!r} has no /p2p/<peer id> part (run 'sapo id' on that node to get its full address)")
    return addrs


class NetworkProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    namespace: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$", description="topic and protocol namespace")
    protocol: int = Field(ge=1, description="wire protocol major version spoken on this network")
    bootstrap: tuple[str, ...] = Field((), description="full multiaddrs of the network's bootstrap peers")
    dht_bootstrap: tuple[str, ...] = Field((), description="full multiaddrs of Kademlia DHT peers its nodes find each "
                                           "other through (p2p.rendezvous)")
    shard_epoch_s: int = Field(EPOCH_S, ge=60, description="seconds between redraws of every peer's rollout shard "
                               "(docs/PROTOCOL.md section 7); all nodes of a network must agree")
    description: str = ""

    @field_validator("bootstrap")
    @classmethod
    def _full_addrs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_multiaddrs(list(v), need_peer_id=True))

    @field_validator("dht_bootstrap")
    @classmethod
    def _dht_addrs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_multiaddrs(list(v), need_peer_id=True, dnsaddr=True))


def shipped_networks() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.toml"))


@cache
def load_network(name: str) -> NetworkProfile:
    """The profile called `name`, or read from the file `name`; ValueError says what is wrong."""
    path = SHIPPED / f"{name}.toml" if name in shipped_networks() else Path(name)
    if not path.is_file():
        if "/" in name or name.endswith(".toml"):
            raise ValueError(f"network profile file {name} does not exist")
        raise ValueError(f"unknown network {name!r}: choose {' or '.join(shipped_networks())}, or give a profile file")
    try:
        profile = NetworkProfile.model_validate(tomllib.loads(path.read_text()))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"cannot read network profile {path}: {e}") from None
    except ValidationError as e:
        raise ValueError(f"network profile {path}: {describe(e, NetworkProfile)}") from None
    if profile.protocol != VERSION:
        advice = ("upgrade sapo-node, or choose another network" if profile.protocol > VERSION else
                  f"an older network: once its nodes run this sapo-node, its profile says protocol = {VERSION}")
        raise ValueError(f"network {name!r} speaks protocol {profile.protocol}; this sapo-node speaks {VERSION} ({advice})")
    return profile
