"""py-libp2p Kademlia DHT servers that know each other: the public DHT's stand-in in tests and the network lab; and
hostile ones that answer `/ipfs/kad/1.0.0` by hand.

`DHTServers(n)` runs them on a trio thread of the calling process (on 127.0.0.1); `python -m scripts.bench.lab.dht
--listen-ip IP [--servers N] [--peer ADDR ...]` runs them as a process of their own (in a lab namespace), prints one
JSON line with their full multiaddrs once listening, and runs until SIGTERM/SIGINT. `JsDHTServer` runs a js-libp2p one
(tests/interop/dht.mjs, whose packages `npm ci` installs there), which like kubo keeps only DHT servers in its routing
table: two clients meet through it only by provider records; `JsRelay` runs one that is also a limited circuit relay
v2 with kubo's limits (dht.mjs --relay): the public peer that is not a sapo node. `HostileDHT(n, key, ...)` runs `n`
servers whose ids are ground near a key (`GROUND_BITS`) and that answer every FIND_NODE and GET_PROVIDERS with made-up
closer peers, made-up providers or both, at addresses of the caller's choosing, and drop every ADD_PROVIDER.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import trio
import varint
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT, _encode_key
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.varint import read_varint_prefixed_bytes_limited
from multiaddr import Multiaddr

from p2p.kad import PROTOCOL as KAD

INTEROP = Path(__file__).resolve().parents[3] / "tests" / "interop"  # dht.mjs and its npm packages
GROUND_BITS = 8  # leading bits a hostile server's id shares with the key (about 256 key generations each)


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


class JsDHTServer:
    """A js-libp2p Kademlia DHT server (`INTEROP`/dht.mjs, run by `node`) that knows `peers`, on 127.0.0.1 or at
    `listen` inside `prefix` (a lab namespace's `ip netns exec`); its log goes to `log`."""

    def __init__(self, node: str, peers: list[str], log: Path, listen: str = "/ip4/127.0.0.1/tcp/0",
                 prefix: list[str] = (), flags: list[str] = ()):
        args = [arg for p in peers for arg in ("--peer", p)]
        with open(log, "wb") as stderr:
            self.proc = subprocess.Popen([*prefix, node, str(INTEROP / "dht.mjs"), "--seconds", "3600", "--listen",
                                          listen, *args, *flags], cwd=INTEROP, stdout=subprocess.PIPE, stderr=stderr,
                                         text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise RuntimeError(f"the js DHT server exited: {log.read_text()[-2000:]}")
        self.addr = json.loads(line)["addr"]
        self.peer_id = ID.from_base58(self.addr.rsplit("/p2p/", 1)[1])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class JsRelay(JsDHTServer):
    """A `JsDHTServer` that is also a limited circuit relay v2 server, as a kubo node that finds itself public runs one:
    reservations of `reservation_s` seconds, at most 128 and 8 per IP address; circuits of `circuit_s` seconds and
    `circuit_bytes` bytes (both directions together, as js-libp2p counts them); kubo's 3600 s, 120 s and 128 KiB unless
    a test shortens them. Circuit addresses through it: `<addr>/p2p-circuit/p2p/<peer>`."""

    def __init__(self, node: str, peers: list[str], log: Path, listen: str = "/ip4/127.0.0.1/tcp/0",
                 prefix: list[str] = (), circuit_s: int | None = None, circuit_bytes: int | None = None,
                 reservation_s: int | None = None):
        limits = {"--circuit-seconds": circuit_s, "--circuit-bytes": circuit_bytes,
                  "--reservation-seconds": reservation_s}
        flags = ["--relay", *(arg for flag, v in limits.items() if v is not None for arg in (flag, str(v)))]
        super().__init__(node, peers, log, listen, prefix, flags)


class TrioThread:
    """Servers on a trio thread of their own, started by `serve(started, stop)`, which calls `started()` once they
    listen; `call(fn, *args)` runs a function on that thread."""

    def __init__(self, serve: Callable[[Callable[[], None], trio.Event], Awaitable[None]]):
        self._ready, self._token, self._stop = threading.Event(), None, None
        self._thread = threading.Thread(target=trio.run, args=(self._main, serve), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "the DHT servers did not start"

    async def _main(self, serve) -> None:
        self._token, self._stop = trio.lowlevel.current_trio_token(), trio.Event()
        await serve(self._ready.set, self._stop)

    def call(self, fn, *args):
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def close(self) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(timeout=10)


class DHTServers(TrioThread):
    """`n` servers on 127.0.0.1 on a trio thread of their own. `addrs`: their full multiaddrs."""

    def __init__(self, n: int):
        self.addrs: list[str] = []
        self.dhts: list[KadDHT] = []

        async def run(ready: Callable[[], None], stop: trio.Event) -> None:
            def started(addrs: list[str], dhts: list[KadDHT]) -> None:
                self.addrs, self.dhts = addrs, dhts
                ready()
            await serve(n, "127.0.0.1", [], started, stop)
        super().__init__(run)

    def add_providers(self, key: str, providers: list[PeerInfo]) -> None:
        """Provider records for `key` on the first server, as a flood of fake providers would leave them."""
        for info in providers:
            self.call(_sync, self.dhts[0].provider_store.add_provider, _encode_key(key), info)

    def remove_providers(self, key: str) -> None:
        self.call(_sync, self.dhts[0].provider_store.providers.pop, _encode_key(key), None)

    def know(self, addrs: list[str]) -> None:
        """Every server connects to these servers and puts them in its routing table (and so in its answers)."""
        async def know() -> None:
            for dht in self.dhts:
                for addr in addrs:
                    info = info_from_p2p_addr(Multiaddr(addr))
                    await dht.host.connect(info)
                    await dht.add_peer(info.peer_id)
        self.call(know)


async def _sync(fn, *args):
    return fn(*args)


def ground_key_pair(key: bytes, bits: int = GROUND_BITS) -> KeyPair:
    """A key pair whose peer id's Kademlia position shares `bits` leading bits with `key`'s."""
    target = int.from_bytes(hashlib.sha256(key).digest(), "big") >> (256 - bits)
    while True:
        pair = create_new_key_pair()
        pid = ID.from_pubkey(pair.public_key)
        if int.from_bytes(hashlib.sha256(pid.to_bytes()).digest(), "big") >> (256 - bits) == target:
            return pair


def made_up_peers(n: int, addrs: list[str], per_peer: int, rng: random.Random) -> list[Message.Peer]:
    """`n` peer entries with fresh ids, each listing `per_peer` of `addrs`."""
    out = []
    for _ in range(n):
        peer = Message.Peer(id=ID.from_pubkey(create_new_key_pair().public_key).to_bytes())
        peer.addrs.extend(Multiaddr(a).to_bytes() for a in rng.sample(addrs, min(per_peer, len(addrs))))
        out.append(peer)
    return out


class HostileDHT(TrioThread):
    """`n` hostile DHT servers on `listen_ip`, ids ground near `key` (a hex multihash). Every FIND_NODE and
    GET_PROVIDERS is answered with `closer` made-up peers and, for GET_PROVIDERS, `providers` made-up providers, each
    at `per_peer` of the addresses `at` (fresh ids for every answer); ADD_PROVIDER is read and dropped. `asked` counts requests by
    type name."""

    def __init__(self, n: int, key: str, at: list[str], closer: int = 20, providers: int = 0, per_peer: int = 4,
                 listen_ip: str = "127.0.0.1"):
        self.addrs: list[str] = []
        self.asked: dict[str, int] = {}
        rng = random.Random(0)

        async def handle(stream) -> None:
            try:
                while True:
                    request = Message()
                    request.ParseFromString(await read_varint_prefixed_bytes_limited(stream, 64 * 1024))
                    kind = Message.MessageType.Name(request.type)
                    self.asked[kind] = self.asked.get(kind, 0) + 1
                    if request.type == Message.MessageType.ADD_PROVIDER:
                        continue
                    answer = Message(type=request.type, key=request.key)
                    answer.closerPeers.extend(made_up_peers(closer, at, per_peer, rng))
                    if request.type == Message.MessageType.GET_PROVIDERS:
                        answer.providerPeers.extend(made_up_peers(providers, at, per_peer, rng))
                    data = answer.SerializeToString()
                    await stream.write(varint.encode(len(data)) + data)
            except Exception:  # noqa: BLE001 - the asker closed the stream
                pass
            finally:
                await stream.close()

        async def run(ready: Callable[[], None], stop: trio.Event) -> None:
            hosts = [new_host(key_pair=ground_key_pair(bytes.fromhex(key))) for _ in range(n)]
            async with AsyncExitStack() as stack:
                for h in hosts:
                    await stack.enter_async_context(h.run(listen_addrs=[Multiaddr(f"/ip4/{listen_ip}/tcp/0")]))
                    h.set_stream_handler(KAD, handle)
                self.addrs = [str(h.get_addrs()[0]) for h in hosts]
                ready()
                await stop.wait()
        super().__init__(run)


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
