"""`python -m scripts.bench.lab.mdns_spoof --topic-base BASE --ip IP --addr ADDR [--addr ...]`: on a lab LAN, announce a
made-up peer id at each of these addresses (real peers' addresses) under the network's mDNS service type, and keep
announcing until SIGTERM: a neighbour that dials one fails the handshake there, as if the address were dead."""

from __future__ import annotations

import argparse
import secrets
import signal
import sys

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.discovery.mdns.broadcaster import PeerBroadcaster
from libp2p.peer.id import ID
from zeroconf import Zeroconf

from p2p.lan import service_type


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--topic-base", required=True, help="the network's rollout topic base (its service type's source)")
    p.add_argument("--ip", required=True, help="this host's LAN address, where zeroconf announces")
    p.add_argument("--addr", action="append", required=True, help="a real peer's /ip4/IP/tcp/PORT address")
    args = p.parse_args(argv)
    kind = service_type(args.topic_base)
    zeroconf = Zeroconf(interfaces=[args.ip])
    for addr in args.addr:
        fake = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
        PeerBroadcaster(zeroconf=zeroconf, service_type=kind, service_name=f"{secrets.token_hex(16)}.{kind}", peer_id=fake,
                        port=int(addr.split("/")[4]), listen_addrs=[addr]).register()
        print(f"announced {fake} at {addr}", flush=True)
    try:
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
    finally:
        zeroconf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
