"""What a hostile peer does below gossip, for the lab probe (`lab/probe.py`): squat a relay slot, push bytes
through a relay, point a dial-back through one. Each runs on the probe's trio thread against its own
`GossipHost` (`Gossip.call` / `Gossip.spawn`) and counts what it got in the host's counters, which the
probe's stats events carry. No node imports this module."""

from __future__ import annotations

import logging
import os

import msgpack
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.protocol_muxer.multiselect_client import MultiselectClient
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from multiaddr import Multiaddr

from p2p.host import GossipHost
from p2p.reach import NONCE_BYTES

log = logging.getLogger(__name__)

SINK = TProtocol("/sapo-lab/sink/1.0.0")  # a byte sink: what a relayed flood is sent to
CHUNK = 64 << 10
CONNECT_TIMEOUT_S = 30.0


def peer_of(addr: str) -> ID:
    """The peer an address ends in (`.../p2p/<id>`, a circuit address's included)."""
    return ID.from_base58(addr.rsplit("/p2p/", 1)[1])


async def _connected(gh: GossipHost, peer: ID) -> bool:
    with trio.move_on_after(CONNECT_TIMEOUT_S):
        while peer not in gh.host.get_connected_peers():
            await trio.sleep(0.2)
        return True
    return False


async def reserve_slot(gh: GossipHost, relay: ID, closed_port: int | None = None) -> bool:
    """Ask `relay` for a circuit-relay slot at once, without first asking it to dial us back (which is
    what a participant does): a stranger squatting. With `closed_port`, first ask it to dial us back on that
    port alone, which it cannot reach: a stranger passing for a peer behind NAT. The slot is held while we
    stay connected."""
    if not await _connected(gh, relay):
        return False
    if closed_port is not None:
        with trio.move_on_after(CONNECT_TIMEOUT_S):
            try:
                stream = await gh.host.new_stream(relay, [gh.reach.dialback_protocol])
                await stream.write(msgpack.packb({"ports": [closed_port], "nonce": os.urandom(NONCE_BYTES)}))
                log.info("dial-back on closed port %d: %s", closed_port, msgpack.unpackb(await stream.read(1024)))
                await stream.close()
            except Exception as e:
                log.info("relay %s refused a dial-back: %s", relay, e)
    granted = False
    with trio.move_on_after(CONNECT_TIMEOUT_S):
        try:
            stream = await gh.host.new_stream(relay, [HOP_PROTOCOL])
            async with trio.open_nursery() as nursery:  # reserve() starts a refresher; a squatter needs none
                granted = await gh.reach.transport.reserve(stream, relay, nursery)
                nursery.cancel_scope.cancel()
        except Exception as e:
            log.info("relay %s refused a slot: %s", relay, e)
    gh.counts["slots_granted" if granted else "slots_refused"] += 1
    return granted


async def serve_sink(gh: GossipHost) -> None:
    """Read and count whatever arrives on the sink protocol."""
    async def sink(stream) -> None:
        try:
            while data := await stream.read(CHUNK):
                gh.counts["sink_bytes"] += len(data)
        except Exception:
            pass

    gh.host.set_stream_handler(SINK, sink)


async def flood_through(gh: GossipHost, circuit: str) -> None:
    """Send random bytes as fast as the path takes them to the sink of the peer at `circuit`
    (`<relay addr>/p2p-circuit/p2p/<peer>`), redialing when the relay ends the circuit; runs until
    cancelled."""
    peer = peer_of(circuit)
    chunk = os.urandom(CHUNK)
    while True:
        try:
            await gh.reach.transport.dial(Multiaddr(circuit))
            stream = await gh.host.new_stream(peer, [SINK])
            gh.counts["circuits_opened"] += 1
            while True:
                await stream.write(chunk)
                gh.counts["sent_bytes"] += len(chunk)
        except Exception as e:
            gh.counts["circuits_failed"] += 1
            log.info("relayed flood to %s stopped: %s", peer, e)
            await trio.sleep(1.0)


async def ask_dialback(gh: GossipHost, circuit: str, ports: list[int]) -> dict:
    """Reach the peer at `circuit` through its relay and ask it to dial us back at `ports`: over a relay
    the address it sees us at is the relay's, so an honest answer would be a scan of the relay's host."""
    with trio.move_on_after(CONNECT_TIMEOUT_S):
        try:
            # on the circuit itself: `host.new_stream` would take a direct connection the peer may have
            # dialed to us meanwhile, and a dial-back asked over that one is rightly answered
            conn = await gh.reach.transport.dial(Multiaddr(circuit))
            stream = await conn.new_stream()
            stream.set_protocol(await MultiselectClient().select_one_of([gh.reach.dialback_protocol],
                                                                        MultiselectCommunicator(stream)))
            await stream.write(msgpack.packb({"ports": ports}))
            reply = msgpack.unpackb(await stream.read(1024))
            await stream.close()
            return reply if isinstance(reply, dict) else {"reply": repr(reply)}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
    return {"error": "timed out"}


async def lie_dialback(gh: GossipHost, reached: bool) -> None:
    """Answer every dial-back request, of either protocol version, without dialing: "reached" on every port asked
    (a NAT'd node that believed it would call itself public) or on none (a public node would call itself private)."""
    async def answer(stream) -> None:
        try:
            request = msgpack.unpackb(await stream.read(1024))
            ports = request.get("ports", []) if isinstance(request, dict) else []
            await stream.write(msgpack.packb({"reached": ports if reached else []}))
            gh.counts["dialback_lies"] += 1
        except Exception as e:
            log.info("lying to a dial-back failed: %s", e)
        finally:
            await stream.close()

    base = str(gh.reach.dialback_protocol).rsplit("/", 1)[0]
    for version in ("1.0.0", "2.0.0"):
        gh.host.set_stream_handler(TProtocol(f"{base}/{version}"), answer)
