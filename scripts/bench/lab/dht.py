"""py-libp2p Kademlia DHT servers that know each other: the public DHT's stand-in in tests and the network lab.

`DHTServers(n)` runs them on a trio thread of the calling process (on 127.0.0.1); `python -m scripts.bench.lab.dht
--listen-ip IP [--servers N] [--peer ADDR ...]` runs them as a process of their own (in a lab namespace), prints one
JSON line with their full multiaddrs once listening, and runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import AsyncExitStack

import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT, _encode_key
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr


async def serve(n: int, listen_ip: str, peers: list[str], started: Callable[[list[str], list[KadDHT]], None],
                stop: trio.Event) -> None:
    """`n` DHT servers on `listen_ip`, the first connected to `peers` (other implementations' servers) and the rest
    to the first; `started(addrs, dhts)` once they are, then until `stop`."""
    hosts = [new_host(key_pair=create_new_key_pair()) for _ in range(n)]
    async with AsyncExitStack() as stack:
        for h in hosts:
            await stack.enter_async_context(h.run(listen_addrs=[Multiaddr(f"/ip4/{listen_ip}/tcp/0")]))
        dhts = [KadDHT(h, DHTMode.SERVER) for h in hosts]
        for d in dhts:
            await stack.enter_async_context(background_trio_service(d))
        for h, d in zip(hosts[1:], dhts[1:]):
            await h.connect(info_from_p2p_addr(hosts[0].get_addrs()[0]))
            await d.add_peer(hosts[0].get_id())
            await dhts[0].add_peer(h.get_id())
        for addr in peers:
            info = info_from_p2p_addr(Multiaddr(addr))
            await hosts[0].connect(info)
            await dhts[0].add_peer(info.peer_id)
        started([str(h.get_addrs()[0]) for h in hosts], dhts)
        await stop.wait()


class DHTServers:
    """`n` servers on 127.0.0.1 on a trio thread of their own. `addrs`: their full multiaddrs."""

    def __init__(self, n: int):
        self.addrs: list[str] = []
        self.dhts: list[KadDHT] = []
        self._ready, self._token, self._stop = threading.Event(), None, None
        self._thread = threading.Thread(target=trio.run, args=(self._serve, n), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "the DHT servers did not start"

    async def _serve(self, n: int) -> None:
        self._token, self._stop = trio.lowlevel.current_trio_token(), trio.Event()

        def started(addrs: list[str], dhts: list[KadDHT]) -> None:
            self.addrs, self.dhts = addrs, dhts
            self._ready.set()
        await serve(n, "127.0.0.1", [], started, self._stop)

    def add_providers(self, key: str, providers: list[PeerInfo]) -> None:
        """Provider records for `key` on the first server, as a flood of fake providers would leave them."""
        store = self.dhts[0].provider_store
        for info in providers:
            trio.from_thread.run_sync(store.add_provider, _encode_key(key), info, trio_token=self._token)

    def remove_providers(self, key: str) -> None:
        trio.from_thread.run_sync(self.dhts[0].provider_store.providers.pop, _encode_key(key), None,
                                  trio_token=self._token)

    def close(self) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(timeout=10)


async def _main(args: argparse.Namespace) -> None:
    stop = trio.Event()

    async def on_signals() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                stop.set()
                return

    def started(addrs: list[str], _dhts: list[KadDHT]) -> None:
        print(json.dumps({"event": "listening", "addrs": addrs}), flush=True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_signals)
        await serve(args.servers, args.listen_ip, args.peer, started, stop)
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--listen-ip", default="127.0.0.1")
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--peer", action="append", default=[], help="full multiaddr of another DHT server to know")
    trio.run(_main, p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
