"""`Gossip`: the gossip layer as seen from the node, with trio kept on a thread of its own.

py-libp2p only runs on trio; the node runs torch in its main thread and has no event loop of its own
(docs/architecture.md says why). This class owns the trio thread from start to join: `publish` hands
bytes over without blocking (TrioToken.run_sync_soon), received messages come back through the
`on_message` callback on the trio thread (the asyncio probe wraps it in `loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import trio
from libp2p.custom_types import TProtocol

from p2p.addrbook import AddressBook
from p2p.config import P2PConfig
from p2p.host import GossipHost
from p2p.identity import load_or_create, peer_id
from p2p.policy import MessagePolicy
from p2p.wire import WireGroup, WireMessage

log = logging.getLogger(__name__)
T = TypeVar("T")


class P2PError(RuntimeError):
    """The gossip layer could not start (for example: the listen port is taken)."""


class Gossip:
    def __init__(self, cfg: P2PConfig, key_file: Path, on_message: Callable[[WireMessage], None],
                 signal: Callable[[WireGroup], bool], useful: Callable[[str], bool] | None = None):
        """`useful`: which authors (base58 peer ids) this node's selection has proven; they alone set its
        shard level (None: a node that uses no groups, every author counts)."""
        self.cfg, self._useful = cfg, useful
        self.key_pair = load_or_create(key_file)
        self.peer_id = peer_id(self.key_pair)
        self.book = AddressBook.beside(key_file)  # peers that proved themselves, redialed first at start
        self.policy = MessagePolicy(cfg.limits, cfg.rollout_topic_base(), cfg.profile().shard_epoch_s, signal=signal)
        self._on_message = on_message
        self._host: GossipHost | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._tasks: trio.Nursery | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, name="sapo-p2p", daemon=True)

    @property
    def alive(self) -> bool:
        """False once the trio thread has ended (stopped, or crashed after start)."""
        return self._thread.is_alive()

    @property
    def addrs(self) -> list[str]:
        return self._host.addrs if self._host else []

    def start(self, timeout: float = 30.0) -> "Gossip":
        quiet_libp2p_logs()
        self._thread.start()
        if not self._started.wait(timeout):
            self.stop()
            raise P2PError(f"the p2p host did not start within {timeout:.0f} s")
        if self._error is not None:
            self._thread.join(timeout)
            raise P2PError(f"cannot start the p2p host on {', '.join(self.cfg.listen)}: {_why(self._error)}")
        log.info("p2p: peer id %s, listening on %s", self.peer_id, " ".join(self.addrs))
        return self

    def publish(self, data: bytes) -> None:
        """Hand a message to the trio thread; never blocks, a full queue is counted as a drop."""
        host, token = self._host, self._token
        if host is None or token is None:
            raise RuntimeError("publish before start")
        try:
            token.run_sync_soon(host.enqueue, data)
        except trio.RunFinishedError:
            host.counts["publish_dropped"] += 1

    def subscribe_only(self, topics: list[str]) -> None:
        """Subscribe without reading or validating: what a peer does that claims to listen on shards
        (the lab probe plays one; levels must not follow such claims)."""
        for topic in topics:
            trio.from_thread.run(self._host.pubsub.subscribe, topic, trio_token=self._token)

    def call(self, fn: Callable[..., Awaitable[T]], *args) -> T:
        """Run `fn(host, *args)` on the trio thread and return its result (the lab probe's behaviours)."""
        return trio.from_thread.run(fn, self._host, *args, trio_token=self._token)

    def spawn(self, fn: Callable[..., Awaitable[object]], *args) -> None:
        """Run `fn(host, *args)` on the trio thread until it returns or the host stops."""
        async def until_stopped() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fn, self._host, *args)
                await self._stop.wait()
                nursery.cancel_scope.cancel()

        self._token.run_sync_soon(self._tasks.start_soon, until_stopped)

    def answer_peer_exchange(self, handler: Callable | None) -> None:
        """Answer peer exchange with `handler` (an async stream handler) instead of the node's own list,
        or not at all (None): how the lab probe and the tests play a peer that lies or stays silent."""
        host, protocol = self._host.host, TProtocol(self.cfg.peer_exchange_protocol())

        def swap() -> None:
            host.remove_stream_handler(protocol) if handler is None else host.set_stream_handler(protocol, handler)

        trio.from_thread.run_sync(swap, trio_token=self._token)

    def stats(self) -> dict[str, object]:
        """Read on the p2p thread, which changes the host's tables and counters between any two lines of another
        thread: read from the training loop, 30 strangers leaving at once raised 'dictionary changed size during
        iteration' there and stopped the node."""
        host, snapshot = self._host, {}
        if host is not None and self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                snapshot = trio.from_thread.run_sync(self._snapshot, host, trio_token=self._token)
        return {"peer_id": self.peer_id, "peers": 0, "mesh_peers": 0, **snapshot, **self.policy.stats(),
                "seen_messages": self.policy.remembered()}

    @staticmethod
    def _snapshot(host: GossipHost) -> dict[str, object]:
        live = host.stats()  # first: it counts the connected peers and the mesh afresh
        return {"peers": host.n_peers, "mesh_peers": host.n_mesh, **live, **host.counts, **LIBP2P_DROPS}

    def stop(self, timeout: float = 10.0, drain_s: float = 2.0) -> None:
        """Send what is queued (at most `drain_s`), then close the host."""
        if self._token is not None and self._stop is not None and self._thread.is_alive():
            try:
                self._token.run_sync_soon(self._begin_stop, drain_s)
            except trio.RunFinishedError:
                pass
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("p2p thread did not stop within %.0f s; abandoning it", timeout)

    def _begin_stop(self, drain_s: float) -> None:
        """On the trio thread: drain, then stop; or stop at once where the host never got to run its tasks."""
        if self._tasks is None:
            self._stop.set()
            return
        try:
            self._tasks.start_soon(self._drain_then_stop, drain_s)
        except RuntimeError:  # the nursery has closed: the host is ending already
            self._stop.set()

    async def _drain_then_stop(self, within: float) -> None:
        with trio.move_on_after(within):
            await self._host.drain()
        self._stop.set()

    def __enter__(self) -> "Gossip":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _thread_main(self) -> None:
        try:
            trio.run(self._trio_main)
        except BaseException as e:  # reported to start(), or logged if it happens later
            if not self._started.is_set():
                self._error = e
            else:
                log.error("p2p layer stopped: %s", _why(e))
        finally:
            self._started.set()

    async def _trio_main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        self._host = GossipHost(self.cfg, self.key_pair, self.policy, self._on_message, self._useful, self.book)
        async with trio.open_nursery() as nursery:
            self._tasks = nursery  # what `spawn` starts ends with the host
            await nursery.start(self._host.serve, self._stop)
            self._started.set()


def _why(e: BaseException) -> str:
    """The innermost useful message of an exception group or chain."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    text = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror
    return text


MUX_FAILED = "fail to upgrade mux for peer %s"  # py-libp2p's record of an inbound connection that agreed no muxer
# py-libp2p's record (with a whole traceback) of an identify answer it could not write: the asker left first
IDENTIFY_FAILED = "Error sending identify response to %s: %s (type: %s)\n%s"


class _Libp2pLogFilter(logging.Filter):
    """py-libp2p records below `level` (some of its loggers set their own, lower levels) and errors
    it logs for events that are expected (and that we report ourselves, once)."""

    NOISE = re.compile("|".join((
        "Nursery is closed to new arrivals", "Failed to read DHT message", "Stream reset",
        # a failed dial, a hint whose peer id does not match its address, a peer that does not speak
        # peer exchange: p2p.host logs each once, with what it does about it
        "Failed to open TCP stream", "failed to upgrade security", "Failed to open stream to peer",
        # a hole punch's dial that did not meet the peer's (counted, `punches_failed`)
        "Unexpected error opening TCP stream",
        # the relay's hop handler waits 30 s for a second message on every stream, and says so at
        # ERROR when the reservation's or the ended circuit's stream brings none
        "reading from hop stream",
        # a peer that went away (killed, offline): its connection resets and streams opened on it fail;
        # routine churn, seen in the peer count
        r"Error in handle_incoming for peer \S+: ConnectionClosedError", "MultiselectClient handshake: (read|write) failed",
        # a peer that dialed us and left or stalled before its connection was up (counted, `inbound_upgrade_failed`),
        # or left before our identify answer (counted, `identify_reply_failed`)
        re.escape(MUX_FAILED.removesuffix(" %s")), re.escape(IDENTIFY_FAILED.split(" %s")[0]))))

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("libp2p"):
            return True
        if record.levelno < self.level:
            return False
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        return not self.NOISE.search(text)


RPC_TOO_LARGE = "Inbound pubsub RPC from peer %s exceeded size limit: %s"  # py-libp2p's record for its size cap
LIBP2P_DROPS: Counter[str] = Counter()  # what py-libp2p reports only in its logs; process-wide
# the relay, its client, and hole punching over relayed connections
RELAY_LOGGERS = ("libp2p.relay.circuit_v2.protocol", "libp2p.relay.circuit_v2.transport", "libp2p.relay.circuit_v2.dcutr")


class _CountLibp2pRecords(logging.Filter):
    """Counts records py-libp2p logs for events it tells nobody else about, and lets a record through only
    at the level libp2p logs at here (`passes`). On pubsub: RPCs dropped for its inbound size cap. On the
    swarm: inbound connections that never agreed a muxer (a peer that left or stalled mid-handshake,
    `inbound_upgrade_failed`; 30 strangers leaving at once wrote one such ERROR line). On identify: answers
    the asker left before (`identify_reply_failed`; the same strangers wrote two, each with a traceback). On
    the relay: every error its hop and stop handlers log, all caused by what a peer did on the stream (reset
    it, sent a malformed or unexpected message, a stranger refused a slot) and each peer can cause any number
    of them; and on its client side, a reservation or its refresh that the relay reset or left unanswered, or
    a relayed connection the far peer dropped; counted as `relay_stream_errors`, logged only when the node
    logs at DEBUG."""

    def __init__(self, level: int, counted: Callable[[logging.LogRecord], str | None]):
        super().__init__()
        self.level, self.counted = level, counted

    def filter(self, record: logging.LogRecord) -> bool:
        if name := self.counted(record):
            LIBP2P_DROPS[name] += 1
        return record.levelno >= self.level


def quiet_libp2p_logs() -> None:
    """Route py-libp2p's logs through the node's handlers: errors only (warnings when the node
    logs at DEBUG), minus known noise. py-libp2p turns its own propagation off, which sends its
    records to Python's bare last-resort handler instead.

    The filter sits on the root handlers because a logger's filters do not see its children's records.
    """
    level = logging.WARNING if logging.getLogger().getEffectiveLevel() <= logging.DEBUG else logging.ERROR
    lib = logging.getLogger("libp2p")
    lib.propagate = True
    lib.setLevel(level)
    counted = {"libp2p.pubsub.pubsub": (level, lambda r: "dropped_rpc_too_large" if r.msg == RPC_TOO_LARGE else None),
               "libp2p.network.swarm": (level, lambda r: "inbound_upgrade_failed" if r.msg == MUX_FAILED else None),
               "libp2p.identity.identify.identify": (
                   level, lambda r: "identify_reply_failed" if r.msg == IDENTIFY_FAILED else None),
               **{name: (level if level < logging.ERROR else logging.CRITICAL,
                         lambda r: "relay_stream_errors" if r.levelno >= logging.ERROR else None) for name in RELAY_LOGGERS}}
    for name, (passes, count) in counted.items():
        logger = logging.getLogger(name)
        logger.setLevel(min(level, logging.WARNING))  # the size-cap record is a warning: counted, then filtered
        logger.filters = [f for f in logger.filters if not isinstance(f, _CountLibp2pRecords)] + \
            [_CountLibp2pRecords(passes, count)]
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _Libp2pLogFilter) for f in handler.filters):
            handler.addFilter(_Libp2pLogFilter(level))
