"""`python -m scripts.bench.lab.quic_probe`: can a sapo node listen and dial on QUIC beside TCP (issue 91)?

Hosts are built as `p2p/host.py` builds a node's (Noise only and yamux for TCP, one connection per peer, no
background dials, no dial retries) with py-libp2p's QUIC transport added beside TCP, and GossipSub is the node's own
(`p2p.pubsub`). One listening host runs in a child process (so that it can be killed as a crashed node is), two
dialers run here: one reaches it over TCP, one over QUIC, and every check runs on both, so that each QUIC number has
its TCP number from the same machine and minute beside it. Prints one JSON object (and writes it with --out).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import trio
from libp2p import NOISE_PROTOCOL_ID, YAMUX_PROTOCOL_ID, ConnectionConfig, NoiseTransport, Yamux, new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import RetryConfig
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.tools.anyio_service import background_trio_service
from libp2p.transport.quic.config import QUICTransportConfig
from multiaddr import Multiaddr

from node.argtypes import bounded, count, positive, script_parser
from p2p.config import P2PConfig
from p2p.host import NoBackgroundDials
from p2p.pubsub import GuardedPubsub, gossipsub_router

log = logging.getLogger("sapo.quic_probe")

ECHO = TProtocol("/sapo-probe/echo/1.0.0")  # writes back what it reads
SINK = TProtocol("/sapo-probe/sink/1.0.0")  # reads to EOF, answers with the byte count
TRANSPORTS = ("tcp", "quic")
STAMP = struct.Struct("!dI")  # a gossip payload starts with its send time and index
GOSSIP_LIMIT_PER_S = 10_000.0  # the spam limit in the gossip rate runs: measure the transport, not the node's limit
STEP_S = 0.05  # how often a waiting loop looks again
WAIT_S = 15.0  # the longest any setup step (connect, identify, mesh) may take
QUIET_S = 2.0  # a gossip run ends this long after its last delivery
AFTER_IDLE_MESSAGES = 20  # published at 10/s after the quiet spell
QUIC_KNOBS = {"quic_idle_s": "idle_timeout", "quic_read_timeout_s": "STREAM_READ_TIMEOUT"}  # flag -> config field
ROOT = Path(__file__).resolve().parents[3]


def listen_addrs(ip: str, transports: tuple[str, ...] = TRANSPORTS) -> list[Multiaddr]:
    return [Multiaddr(f"/ip4/{ip}/tcp/0" if t == "tcp" else f"/ip4/{ip}/udp/0/quic-v1") for t in transports]


def transport_of(addr: Multiaddr) -> str:
    return "quic" if "/quic" in str(addr) else "tcp"


def build_host(key_pair: KeyPair, listen: list[Multiaddr], quic: dict[str, float] | None = None) -> IHost:
    """A node's host as `p2p.host.GossipHost` builds it, with `listen` handed to `new_host`: py-libp2p picks its
    transports from the listen addresses (a QUIC one adds `QUICTransport`, which brings its own TLS 1.3 with the
    libp2p certificate and its own streams: Noise and yamux apply to TCP only). `quic`: `QUICTransportConfig`
    fields to change (`idle_timeout`: the only way a QUIC connection to a vanished peer ends, see `notice`;
    `STREAM_READ_TIMEOUT`: a stream with nothing to read this long is reset, GossipSub's included)."""
    quic = QUICTransportConfig(**quic) if quic else None
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)},
        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        connection_config=ConnectionConfig(max_connections_per_peer=1),
        listen_addrs=listen, enable_quic=quic is not None, quic_transport_opt=quic)
    host.get_network().retry_config = RetryConfig(max_retries=0)
    host.get_network().auto_connector = NoBackgroundDials(host.get_network())
    return host


def topic_of(transport: str) -> str:
    return f"sapo-probe/{transport}"


@dataclass
class Node:
    """A host with the node's GossipSub, running inside `stack`."""
    host: IHost
    pubsub: GuardedPubsub
    counts: Counter[str] = field(default_factory=Counter)

    @classmethod
    async def start(cls, stack: AsyncExitStack, listen: list[Multiaddr], quic: dict[str, float] | None = None) -> Node:
        counts: Counter[str] = Counter()
        host = build_host(create_new_key_pair(), listen, quic)
        router = gossipsub_router(counts, P2PConfig(max_messages_per_s=GOSSIP_LIMIT_PER_S))
        pubsub = GuardedPubsub(host, router, strict_signing=True, counts=counts)
        await stack.enter_async_context(host.run(listen_addrs=listen))
        await stack.enter_async_context(background_trio_service(pubsub))
        await stack.enter_async_context(background_trio_service(router))
        await pubsub.wait_until_ready()
        host.set_stream_handler(ECHO, _echo)
        host.set_stream_handler(SINK, _sink)
        return cls(host, pubsub, counts)

    def addr(self, transport: str) -> Multiaddr:
        return next(a for a in self.host.get_transport_addrs() if transport_of(a) == transport)

    def port(self, transport: str) -> int:
        a = self.addr(transport)
        return int(a.value_for_protocol("udp" if transport == "quic" else "tcp"))

    def connected(self, peer: ID) -> bool:
        return bool(self.host.get_network().get_connections(peer))


async def _echo(stream: INetStream) -> None:
    try:
        while data := await stream.read(65536):
            await stream.write(data)
    except StreamEOF:
        pass
    except Exception as e:  # a probe peer that goes away mid-stream is what some checks do on purpose
        log.debug("echo stream ended: %s", e)
    finally:
        await stream.close()


async def _sink(stream: INetStream) -> None:
    n = 0
    try:
        while True:
            try:
                data = await stream.read(65536)
            except StreamEOF:
                break
            if not data:
                break
            n += len(data)
        await stream.write(str(n).encode())
    except Exception as e:
        log.debug("sink stream ended: %s", e)
    finally:
        await stream.close()


async def read_exactly(stream: INetStream, n: int) -> bytes:
    out = b""
    while len(out) < n:
        if not (data := await stream.read(n - len(out))):
            raise EOFError(f"stream ended after {len(out)} of {n} bytes")
        out += data
    return out


async def wait_for(check: Callable[[], bool], limit_s: float = WAIT_S) -> float | None:
    """Seconds until `check()` holds, None if not within `limit_s`."""
    t0 = trio.current_time()
    with trio.move_on_after(limit_s):
        while not check():
            await trio.sleep(STEP_S)
        return round(trio.current_time() - t0, 3)
    return None


async def timed(what: Awaitable[Any], limit_s: float) -> dict[str, Any]:
    """Run `what` within `limit_s`: its value and seconds, or the exact error, or that it hung."""
    t0 = trio.current_time()
    with trio.move_on_after(limit_s):
        try:
            value = await what
            return {"ok": True, "s": round(trio.current_time() - t0, 3), "value": value}
        except Exception as e:
            return {"ok": False, "s": round(trio.current_time() - t0, 3), "error": f"{type(e).__name__}: {e}"}
    return {"ok": False, "s": limit_s, "error": f"hung: no answer within {limit_s} s"}


# ---- the listening node (a child process) ----

async def serve(ip: str, quic: dict[str, float]) -> None:
    """Listen on TCP and QUIC at `ip`, read both probe topics, obey one command a line on stdin:
    `publish TRANSPORT N SIZE RATE`, `conns` (where each connection comes from), `quit`."""
    async with AsyncExitStack() as stack:
        node = await Node.start(stack, listen_addrs(ip), quic)
        subs = [await node.pubsub.subscribe(topic_of(t)) for t in TRANSPORTS]
        async with trio.open_nursery() as nursery:
            for sub in subs:
                nursery.start_soon(_drain, sub)
            _say(event="listening", id=str(node.host.get_id()), addrs=[str(a) for a in node.host.get_transport_addrs()])
            stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
            async for line in _lines(stdin):
                cmd, *args = line.split()
                if cmd == "publish":
                    await _publish(node, args[0], *map(float, args[1:]))
                elif cmd == "conns":
                    _say(event="conns", conns=[
                        {"peer": str(peer), "remote": list(conn.muxed_conn.get_remote_address() or ()),
                         "transport": transport_of(conn.get_transport_addresses()[0])}
                        for peer, conns in node.host.get_network().get_connections_map().items() for conn in conns])
                elif cmd == "quit":
                    break
            nursery.cancel_scope.cancel()
    _say(event="closed")


async def _drain(sub) -> None:
    while True:
        await sub.get()


async def _publish(node: Node, transport: str, n: float, size: float, rate: float) -> None:
    t0 = trio.current_time()
    for i in range(int(n)):
        await trio.sleep_until(t0 + i / rate)
        await node.pubsub.publish(topic_of(transport), STAMP.pack(time.time(), i).ljust(int(size), b"x"))
    _say(event="published", n=int(n), s=round(trio.current_time() - t0, 3))


async def _lines(stream: trio.abc.ReceiveStream):
    buf = b""
    while chunk := await stream.receive_some(65536):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


# ---- the dialers (this process) ----

class Child:
    """The listening node's process: its stdout read as JSON events, commands written to its stdin."""

    def __init__(self, ip: str, quic: dict[str, float]):
        self.proc = subprocess.Popen([sys.executable, "-m", "scripts.bench.lab.quic_probe", "--serve", ip,
                                      "--serve-quic", json.dumps(quic)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        hello = self.next("listening")
        self.id = ID.from_base58(hello["id"])
        self.addrs = {transport_of(Multiaddr(a)): Multiaddr(a) for a in hello["addrs"]}

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def next(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # bounded: the child ends, and its stdout with it, on every path
            if line.startswith("{") and (msg := json.loads(line))["event"] == event:
                return msg
        raise RuntimeError(f"the listening node ended before saying {event!r} (exit {self.proc.wait(5)})")

    async def ask(self, line: str, event: str) -> dict[str, Any]:
        self.send(line)
        return await trio.to_thread.run_sync(self.next, event)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


async def connect(node: Node, child: Child, transport: str) -> dict[str, Any]:
    """Dial the child at its `transport` address only, then wait for identify to tell us its protocols."""
    dial = await timed(node.host.connect(PeerInfo(child.id, [child.addrs[transport]])), WAIT_S)
    out: dict[str, Any] = {"dial_s": dial["s"], "dial_ok": dial["ok"]}
    if not dial["ok"]:
        return {**out, "error": dial["error"]}
    conn = node.host.get_network().get_connections(child.id)[0]
    ps = node.host.get_peerstore()
    return {**out, "transport": transport_of(conn.get_transport_addresses()[0]),
            "identify_s": await wait_for(lambda: "/meshsub/1.1.0" in (ps.get_protocols(child.id) or [])),
            "identified_addrs": sorted(str(a) for a in ps.addrs(child.id))}


async def wrong_peer_id(node: Node, child: Child, transport: str) -> dict[str, Any]:
    """Dials of the child's address naming another peer id. QUIC skips Noise, so these check that its TLS handshake
    binds the address to the identity asked for: `bare` gives the id as the dial's peer (as `p2p.host` dials),
    `named` puts it in the address too, as a hint's multiaddr would."""
    addr = child.addrs[transport]
    out = {}
    for how, a in (("bare", addr), ("names_listener", Multiaddr(f"{addr}/p2p/{child.id}"))):
        other = ID.from_pubkey(create_new_key_pair().public_key)  # a fresh one: py-libp2p caches a failed peer
        r = await timed(node.host.connect(PeerInfo(other, [a])), WAIT_S)
        out[how] = {**r, "connected_to_asked_id": node.connected(other)}
    return out


async def echo_rtts(node: Node, peer: ID, rounds: int, size: int) -> dict[str, Any]:
    stream = await node.host.new_stream(peer, [ECHO])
    payload, rtts = os.urandom(size), []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await stream.write(payload)
        if await read_exactly(stream, size) != payload:
            raise ValueError("echo came back altered")
        rtts.append(time.perf_counter() - t0)
    await stream.close()
    return {"rounds": rounds, "bytes": size, "rtt_p50_ms": round(1000 * statistics.median(rtts), 2),
            "rtt_max_ms": round(1000 * max(rtts), 2)}


async def stream_rate(node: Node, peer: ID, messages: int, size: int) -> dict[str, Any]:
    """`messages` writes of `size` bytes on one stream, as fast as it takes them, until the peer counted them all."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    stream = await node.host.new_stream(peer, [SINK])
    payload = os.urandom(size)
    for _ in range(messages):
        await stream.write(payload)
    await stream.close_write()
    got = int((await stream.read(64)).decode())
    s = time.perf_counter() - t0
    return {"messages": messages, "bytes": size, "received_bytes": got, "s": round(s, 3),
            "messages_per_s": round(got / size / s, 1), "dialer_cpu_s": round(time.process_time() - cpu0, 2)}


async def gossip_rate(sub, child: Child, transport: str, n: int, size: int, rate: float) -> dict[str, Any]:
    """The child publishes `n` messages at `rate` on this transport's topic; what arrives in `sub`, and how late."""
    lags: list[float] = []
    seen: set[int] = set()

    async def collect() -> None:
        while True:
            with trio.move_on_after(QUIET_S if lags else WAIT_S):
                msg = await sub.get()
                sent, i = STAMP.unpack_from(msg.data)
                lags.append(time.time() - sent)
                seen.add(i)
                continue
            return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(collect)
        published = await child.ask(f"publish {transport} {n} {size} {rate}", "published")
    lags.sort()
    return {"rate": rate, "published": n, "publish_s": published["s"], "delivered": len(seen), "bytes": size,
            "delivered_per_s": round(len(seen) / max(published["s"], 1e-9), 1),
            **({"lag_p50_ms": round(1000 * lags[len(lags) // 2], 1),
                "lag_p95_ms": round(1000 * lags[int(0.95 * (len(lags) - 1))], 1)} if lags else {})}


async def port_seen(child: Child, dialers: dict[str, Node]) -> dict[str, Any]:
    """Which address the listener sees each dialer's connection come from, beside that dialer's own listening
    address: the same port means the dial left from the listening socket (what hole punching needs)."""
    conns = (await child.ask("conns", "conns"))["conns"]
    out = {}
    for t, node in dialers.items():
        seen = next(c for c in conns if c["peer"] == str(node.host.get_id()))
        out[t] = {"dialer_listens_on": str(node.addr(t)), "listener_sees": seen["remote"],
                  "transport": seen["transport"], "same_port": seen["remote"][1] == node.port(t)}
    return out


async def notice(dialers: dict[str, Node], child: Child, how: str, limit_s: float) -> dict[str, Any]:
    """End the child (`quit`: its host stops as a node's does; `kill`: SIGKILL, as a crash or power loss) and time
    how long each dialer takes to see the connection gone; where it does not, whether a new stream to it fails."""
    t0 = trio.current_time()
    if how == "quit":
        child.send("quit")
    else:
        child.proc.send_signal(signal.SIGKILL)
    out: dict[str, Any] = {}

    async def watch(t: str, node: Node) -> None:
        gone = await wait_for(lambda: not node.connected(child.id), limit_s)
        out[t] = {"noticed_s": None if gone is None else round(trio.current_time() - t0, 3)}
        if gone is None:
            out[t]["new_stream"] = await timed(echo_rtts(node, child.id, 1, 16), WAIT_S + limit_s)

    async with trio.open_nursery() as nursery:
        for t, node in dialers.items():
            nursery.start_soon(watch, t, node)
    return out


async def js_interop(node: Node, sub, script: Path, seconds: float) -> dict[str, Any]:
    """A js-libp2p peer with a QUIC transport (`script`: listens on QUIC at 127.0.0.1, reads and publishes 4 KiB on
    the QUIC probe topic, dials `--dial` if given, one JSON line per event) both ways: we dial it, it dials us."""
    out: dict[str, Any] = {}
    for direction in ("py_dials", "js_dials"):
        cmd = ["node", str(script), "--seconds", str(seconds)]
        cmd += ["--dial", f"{node.addr('quic')}/p2p/{node.host.get_id()}"] if direction == "js_dials" else []
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        events: list[dict[str, Any]] = []
        got = 0
        try:
            assert proc.stdout is not None
            hello = json.loads(proc.stdout.readline())
            js = ID.from_base58(hello["id"])
            if direction == "py_dials":
                out[direction] = {"dial": await timed(node.host.connect(PeerInfo(js, [Multiaddr(
                    hello["addrs"][0].split("/p2p/")[0])])), WAIT_S)}
            else:
                out[direction] = {"connected_s": await wait_for(lambda: node.connected(js))}
            out[direction]["mesh_s"] = await wait_for(
                lambda: js in node.pubsub.router.mesh.get(topic_of("quic"), set()))
            for _ in range(3):
                await node.pubsub.publish(topic_of("quic"), b"p" * 4096)
                await trio.sleep(0.2)
            with trio.move_on_after(seconds / 2):
                while got < 5:  # the js peer publishes 5
                    if (await sub.get()).from_id == js.to_bytes():
                        got += 1
        finally:
            proc.kill()
            assert proc.stdout is not None
            events = [json.loads(line) for line in proc.stdout if line.startswith("{")]
            proc.wait(10)
        out[direction].update(py_received_from_js=got,
                              js_received_from_py=sum(e["event"] == "received" for e in events),
                              js_identified=[e.get("agent") for e in events if e["event"] == "identify"],
                              js_errors=[e for e in events if "failed" in e["event"]])
    return out


async def probe(args: argparse.Namespace) -> dict[str, Any]:
    quic = quic_knobs(args)
    result: dict[str, Any] = {"libp2p": version("libp2p"), "aioquic": version("aioquic"), "cpus": os.cpu_count(),
                              "quic_config": {k: getattr(QUICTransportConfig(**quic), k) for k in QUIC_KNOBS.values()}}
    children: list[Child] = []
    try:
        async with AsyncExitStack() as stack:
            # each dialer listens on both transports too, as a node would: the source-port check needs that
            dialers = {t: await Node.start(stack, listen_addrs(args.dialer_ip), quic) for t in TRANSPORTS}
            children.append(child := Child(args.listener_ip, quic))
            result["connect"] = {t: await connect(n, child, t) for t, n in dialers.items()}
            # held from here to the end: GossipSub's streams must outlive quiet spells, as a node's do
            subs = {t: await n.pubsub.subscribe(topic_of(t)) for t, n in dialers.items()}
            result["mesh_s"] = {t: await wait_for(lambda: child.id in n.pubsub.router.mesh.get(topic_of(t), set()))
                                for t, n in dialers.items()}
            result["wrong_peer_id"] = {t: await wrong_peer_id(n, child, t) for t, n in dialers.items()}
            result["source_port"] = await port_seen(child, dialers)
            for t, n in dialers.items():
                result.setdefault("echo", {})[t] = await timed(echo_rtts(n, child.id, args.echoes, args.size), 60)
            for t, n in dialers.items():
                result.setdefault("stream", {})[t] = await timed(
                    stream_rate(n, child.id, args.messages, args.size), 120)
            for rate in args.gossip_rates:
                for t in TRANSPORTS:
                    result.setdefault("gossip", {}).setdefault(str(int(rate)), {})[t] = await timed(
                        gossip_rate(subs[t], child, t, int(rate * args.gossip_s), args.size, rate), 120)
            if args.idle_s:
                await trio.sleep(args.idle_s)
                result["after_idle"] = {"idle_s": args.idle_s, **{t: {
                    "still_connected": n.connected(child.id),
                    "gossip": await timed(gossip_rate(subs[t], child, t, AFTER_IDLE_MESSAGES, args.size, 10.0), 60),
                    "echo_on_a_new_stream": await timed(echo_rtts(n, child.id, 10, args.size), 40)}
                    for t, n in dialers.items()}}
            result["graceful_close"] = await notice(dialers, child, "quit", args.notice_s)
            children.append(crashed := Child(args.listener_ip, quic))
            result["reconnect"] = {t: await connect(n, crashed, t) for t, n in dialers.items()}
            result["kill"] = await notice(dialers, crashed, "kill", args.notice_s)
            if args.js_peer:
                result["js_interop"] = await js_interop(dialers["quic"], subs["quic"], args.js_peer, args.js_s)
            result["dialer_counts"] = {t: dict(n.counts) for t, n in dialers.items()}
    finally:
        for c in children:
            c.stop()
    return result


def quic_knobs(args: argparse.Namespace) -> dict[str, float]:
    return {field: getattr(args, flag) for flag, field in QUIC_KNOBS.items() if getattr(args, flag) is not None}


class ErrorLog(logging.Handler):
    """Every distinct WARNING-or-worse line logged during the probe, with how often: what a user would read."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.seen[f"{record.levelname} {record.name}: {record.getMessage()[:300]}"] += 1


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--listener-ip", default="127.0.0.2", help="loopback address the listening node binds")
    p.add_argument("--dialer-ip", default="127.0.0.3", help="loopback address the two dialers bind")
    p.add_argument("--size", type=count, default=4096, help="bytes per message")
    p.add_argument("--echoes", type=count, default=200, help="echo round trips per transport")
    p.add_argument("--messages", type=count, default=5000, help="messages written flat out on one stream")
    p.add_argument("--gossip-rates", type=positive, nargs="*", default=[100.0, 400.0], help="gossip messages/s to try")
    p.add_argument("--gossip-s", type=positive, default=5.0, help="seconds of publishing at each rate")
    p.add_argument("--idle-s", type=bounded(float, ge=0), default=120.0,
                   help="quiet time before checking the connections and gossip again (0: skip)")
    p.add_argument("--notice-s", type=positive, default=30.0, help="how long to wait for a dialer to notice a close")
    p.add_argument("--quic-idle-s", type=positive, help="QUIC idle timeout (default: py-libp2p's, 600 s)")
    p.add_argument("--quic-read-timeout-s", type=positive, help="QUIC stream read timeout (default: py-libp2p's, 30 s)")
    p.add_argument("--js-peer", type=Path, help="a js-libp2p QUIC peer script to try both ways (needs node)")
    p.add_argument("--js-s", type=positive, default=20.0, help="the js peer's lifetime per direction")
    p.add_argument("--out", type=Path, help="also write the JSON here (merged into the object there under --label)")
    p.add_argument("--label", default="default", help="the key this run's result gets in --out")
    p.add_argument("--serve", metavar="IP", help=argparse.SUPPRESS)  # the child process ...
    p.add_argument("--serve-quic", type=json.loads, default={}, help=argparse.SUPPRESS)  # ... and its QUIC knobs
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.serve:
        trio.run(serve, args.serve, args.serve_quic)
        return 0
    errors = ErrorLog()
    for name in ("", "libp2p"):  # py-libp2p's loggers do not propagate to the root
        logging.getLogger(name).addHandler(errors)
    logging.getLogger().setLevel(logging.WARNING)
    t0 = time.time()
    result = trio.run(probe, args)
    result.update(wall_s=round(time.time() - t0, 1), logged=dict(errors.seen.most_common(30)))
    print(json.dumps(result, indent=1))
    if args.out:
        merged = json.loads(args.out.read_text()) if args.out.exists() else {}
        merged[args.label] = result
        args.out.write_text(json.dumps(merged, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
