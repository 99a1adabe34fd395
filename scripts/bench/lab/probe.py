"""`python -m scripts.bench.lab.probe`: a gossip-only peer, no model, for tests, benchmarks and debugging a swarm.

It joins like a node, optionally publishes synthetic rollout messages at a fixed rate, and writes
one JSON line per event (ready, published, received, stats) so a harness can measure delivery,
latency, CPU and memory. Its main loop is asyncio (uvloop when installed), bridged to the trio
thread of `p2p.service.Gossip`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import random
import resource
import signal
import string
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import msgpack
import multihash
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX
from pydantic import ValidationError

from p2p.config import P2PConfig
from p2p.config_errors import describe
from p2p.host import GossipHost
from p2p.identity import IdentityError
from p2p.service import Gossip, P2PError
from p2p.shards import MAX_LEVEL, epoch_of, prefix, shard_key, shard_topic
from p2p.wire import WireGroup, WireMessage, pack_groups
from rewards import TaskRef, regenerate
from rewards.scoring import group_carries_signal
from . import attacks

log = logging.getLogger("sapo.probe")
ROOT = Path(__file__).resolve().parents[3]
UNPACED_KIB_PER_S = 1 << 30  # a budget no flood reaches
PAD = "12 + 9 = 21. 21 - 9 = 12. "  # the length flood's filler before each answer: working, right but needless
SIGNERS, SIGNER_LEVEL, SIGNER_EVERY_S = 12, 8, 2.0  # --forward-signers: ids ground into the target's level-8 shard
FLOOD_ARGS = {"junk": ["--junk"], "answers": ["--wrong"], "length": ["--pad", PAD, "--chars", "2000"]}  # a flood's flags


class ProbeError(RuntimeError):
    """A probe loop failed (a task reference it cannot build, a publish that raised)."""


def _peer_id(text: str) -> ID:
    try:
        peer = ID.from_base58(text)
        multihash.decode(peer.to_bytes())  # base58 alone decodes almost anything
        return peer
    except Exception:
        raise argparse.ArgumentTypeError(f"not a peer id: {text!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.lab.probe", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("--key", type=Path, required=True, help="identity key file (created if missing)")
    p.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    p.add_argument("--bootstrap", action="append", default=[], help="full multiaddr of a peer (repeatable)")
    p.add_argument("--dht-bootstrap", action="append", default=[], help="full multiaddr of a DHT peer to find the "
                   "network's peers through (repeatable)")
    p.add_argument("--network", default="local")
    p.add_argument("--rate", type=float, default=0.0, help="messages published per second (0: only listen)")
    p.add_argument("--groups", type=int, default=8, help="rollout groups per message")
    p.add_argument("--completions", type=int, default=8, help="completions per group")
    p.add_argument("--chars", type=int, default=200, help="characters per completion")
    p.add_argument("--unpaced", action="store_true", help="no byte budget (p2p.limits.max_author_kib_per_s): publish at "
                   "--rate past what receivers accept from one author, as an attacker would, and accept any author's bytes")
    p.add_argument("--junk", action="store_true", help="publish random text without answers (a useless flood)")
    p.add_argument("--wrong", action="store_true", help="publish only different wrong answers (useless, but only "
                   "scoring shows it); by default half the completions hold the task's right answer")
    p.add_argument("--wrap", help="publish groups whose first half is this text before the task's right answer and "
                   "second half wrong answers (the answer is regenerated from the task reference); --wrap '' publishes bare "
                   "right and wrong answers: groups anyone can compute from the public generator")
    p.add_argument("--pad", help="fill each completion to --chars with this text repeated before its answer "
                   "(right but needlessly long answers: the length attack)")
    p.add_argument("--claim-shards-of", metavar="PEER_ID", type=_peer_id,
                   help="also subscribe (without reading) to every level of this peer's shard this epoch: a peer "
                   "claiming to listen where the target would hear it")
    p.add_argument("--forward-signers", metavar="PEER_ID", type=_peer_id,
                   help=f"subscribe (without reading) to this peer's level-{SIGNER_LEVEL} shard and send there, every "
                   f"{SIGNER_EVERY_S:g} s, one valid message of each of {SIGNERS} ids ground into that shard, signed by "
                   "them and sent over this probe's connections alone: Sybils whose messages a forwarder launders")
    p.add_argument("--lie-dialback", choices=("reached", "unreached"), help="answer every dial-back request with "
                   "this, without dialing: a peer lying about a node's reachability")
    p.add_argument("--lie-peers", metavar="IP[,IP...]", help="answer peer exchange with 32 made-up peers, each at a "
                   "random port of one of these IPs: a peer aiming the swarm's dials at hosts")
    p.add_argument("--squat", action="store_true", help="ask the first bootstrap peer for a relay slot at once, "
                   "without the dial-back a participant asks first, and hold it: a stranger squatting a relay")
    p.add_argument("--closed-port", type=int, help="--squat: first ask for a dial-back on this port, which nothing "
                   "answers: a stranger passing for a peer behind NAT")
    p.add_argument("--squat-after", type=float, default=0.0, help="--squat: publish (--rate) this many seconds before "
                   "asking: a stranger whose groups the relay has accepted")
    p.add_argument("--sink", action="store_true", help="count the bytes peers send to the lab's sink protocol")
    p.add_argument("--flood-through", metavar="CIRCUIT", help="send random bytes as fast as they go to the sink of "
                   "the peer at this relayed address (<relay addr>/p2p-circuit/p2p/<peer>): a relay abused as a pipe")
    p.add_argument("--ask-dialback", metavar="CIRCUIT", help="reach the peer at this relayed address and ask it to "
                   "dial us back at --ports: a dial-back pointed at the relay's host")
    p.add_argument("--no-hole-punching", action="store_true", help="p2p.hole_punching off: a peer reached through a "
                   "relay stays reached through it (--ask-dialback: the request is not cut by a punch under way)")
    p.add_argument("--ports", type=int, nargs="+", default=[4001, 22, 80, 443], help="--ask-dialback: ports asked for")
    p.add_argument("--max-peers", type=int, default=P2PConfig.model_fields["max_peers"].default,
                   help="stop dialing discovered peers beyond this many connections")
    p.add_argument("--task", type=json.loads, default={"dataset": "arith", "config": {}, "seed": 0},
                   help='JSON {"dataset", "config", "seed"} of the published groups (the index counts up)')
    p.add_argument("--duration", type=float, default=0.0, help="seconds to run (0: until SIGINT/SIGTERM)")
    p.add_argument("--events", type=Path, help="JSON-lines event file (default: stdout)")
    p.add_argument("--shards", type=json.loads, default={},
                   help='JSON of p2p.shards knobs, e.g. {"level": 0} (one topic for all) or {"window_s": 10}')
    p.add_argument("--mesh-degree", type=int, default=P2PConfig.model_fields["mesh_degree"].default, help="GossipSub D")
    args = p.parse_args(argv)
    if args.squat and not args.bootstrap:
        p.error("--squat needs --bootstrap: the relay whose slot it takes")
    return args


def synthetic_groups(rng: random.Random, round_: int, n: int, completions: int, chars: int,
                     task: dict | None = None, junk: bool = False, wrap: str | None = None,
                     wrong: bool = False, pad: str | None = None) -> list[WireGroup]:
    """Groups for the task reference `task`: half their completions `chars` characters of random text
    ending in the task's right answer, half ending in random wrong ones (groups any receiver can learn
    from). With `wrong`, every completion ends in a different wrong answer (useless, and refused as
    `no_signal` by a receiver that scores built-in tasks); with `junk`, random text without any answer
    (refused by any receiver); with `wrap`, half `wrap` before the right answer and half bare wrong
    answers: groups that carry signal, built to teach the wrap; with `pad`, that text repeated instead of random
    text (plausible padding: the length attack)."""
    alphabet = string.ascii_letters + string.digits + " "
    task = task or {"dataset": "arith", "config": {}, "seed": 0}

    def completion(answer: str, k: int) -> str:
        if junk:
            return "".join(rng.choices(alphabet, k=chars))
        right = k < completions // 2 and not wrong
        answer = answer if right else str(rng.randrange(10**6))
        if wrap is not None:
            return f"{wrap if right else ''}<answer>{answer}</answer>"
        tail = f"<answer>{answer}</answer>"
        room = max(0, chars - len(tail))
        return (pad * (room // len(pad) + 1))[:room] + tail if pad else "".join(rng.choices(alphabet, k=room)) + tail

    def group(index: int) -> WireGroup:
        answer = "" if junk or wrong else regenerate(TaskRef(task["dataset"], task["config"], task["seed"], index)).answer
        return WireGroup(**task, index=index, completions=[completion(answer, k) for k in range(completions)])

    return [group(index) for index in range(round_ * n, round_ * n + n)]


def lying_peer_list(ips: str) -> Callable:
    """A peer-exchange answer of 32 fresh peer ids, each at a random port of one of `ips` (comma-separated), new
    ones each time."""
    hosts = ips.split(",")

    def addr() -> str:
        ip = random.choice(hosts)
        return f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{random.randrange(1024, 65536)}"

    async def answer(stream) -> None:
        entries = [{"id": ID.from_pubkey(create_new_key_pair().public_key).to_base58(), "addrs": [addr()]}
                   for _ in range(32)]
        await stream.write(msgpack.packb(entries))
        await stream.close()

    return answer


async def forward_signers(gh: GossipHost, target: ID, args: argparse.Namespace, cfg: P2PConfig) -> None:
    """--forward-signers, on the trio thread: the ground ids never connect; their signed messages go out as if this
    probe forwarded them (straight to the router: nothing here reads them)."""
    epoch = epoch_of(time.time(), cfg.profile().shard_epoch_s)
    want = prefix(shard_key(target.to_bytes(), epoch), SIGNER_LEVEL)
    signers = []
    while len(signers) < SIGNERS:  # about 2^SIGNER_LEVEL key generations each
        pair = create_new_key_pair()
        if prefix(shard_key(ID.from_pubkey(pair.public_key).to_bytes(), epoch), SIGNER_LEVEL) == want:
            signers.append(pair)
    topic = shard_topic(cfg.rollout_topic_base(), shard_key(target.to_bytes(), epoch), SIGNER_LEVEL)
    await gh.pubsub.subscribe(topic)  # where the target hears it listen: a level it probes
    rng = random.Random(0)
    for k in itertools.count():
        for pair in signers:
            author = ID.from_pubkey(pair.public_key)
            data = pack_groups(author.to_base58(), "probe", k, time.time(), synthetic_groups(
                rng, k, args.groups, args.completions, args.chars, args.task, args.junk, args.wrap, args.wrong, args.pad),
                cfg.limits)[0][0]
            msg = rpc_pb2.Message(from_id=author.to_bytes(), data=data, seqno=rng.randbytes(8), topicIDs=[topic])
            msg.signature = pair.private_key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
            await gh.gossipsub.publish(gh.me, msg)
            gh.counts["forwarded_signed"] += 1
        await trio.sleep(SIGNER_EVERY_S)


def usage() -> dict[str, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {"cpu_s": ru.ru_utime + ru.ru_stime, "rss_mb": rss_pages * resource.getpagesize() / 2**20}


async def run(args: argparse.Namespace, cfg: P2PConfig, out: IO[str]) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[WireMessage, float]] = asyncio.Queue()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def emit(event: str, **fields) -> None:
        out.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
        out.flush()

    def emit_received(msg: WireMessage, at: float) -> None:
        emit("received", peer=msg.peer, round=msg.round, created=msg.created, at=at, groups=len(msg.groups))

    def on_message(msg: WireMessage) -> None:  # trio thread: stamp now, hand over to asyncio
        loop.call_soon_threadsafe(inbox.put_nowait, (msg, time.time()))

    gossip = Gossip(cfg, args.key, on_message, signal=group_carries_signal)
    await asyncio.to_thread(gossip.start)
    if args.claim_shards_of:
        key = shard_key(args.claim_shards_of.to_bytes(), epoch_of(time.time(), cfg.profile().shard_epoch_s))
        await asyncio.to_thread(gossip.subscribe_only,
                                [shard_topic(cfg.rollout_topic_base(), key, lv) for lv in range(MAX_LEVEL + 1)])
    if args.forward_signers:
        gossip.spawn(forward_signers, args.forward_signers, args, cfg)
    if args.lie_peers:
        await asyncio.to_thread(gossip.answer_peer_exchange, lying_peer_list(args.lie_peers))
    if args.lie_dialback:
        await asyncio.to_thread(gossip.call, attacks.lie_dialback, args.lie_dialback == "reached")
    emit("ready", peer_id=gossip.peer_id, addrs=gossip.addrs)
    if args.sink:
        await asyncio.to_thread(gossip.call, attacks.serve_sink)
    if args.ask_dialback:
        emit("dialback", reply=await asyncio.to_thread(gossip.call, attacks.ask_dialback, args.ask_dialback, args.ports))
    if args.flood_through:
        gossip.spawn(attacks.flood_through, args.flood_through)

    async def receive() -> None:
        while True:
            emit_received(*await inbox.get())

    async def publish() -> None:
        rng = random.Random(gossip.peer_id)
        start, k = time.monotonic(), 0
        while True:
            await asyncio.sleep(max(0.0, start + k / args.rate - time.monotonic()))
            created = time.time()
            payloads, _ = pack_groups(gossip.peer_id, "probe", k, created,
                                      synthetic_groups(rng, k, args.groups, args.completions, args.chars, args.task,
                                                       args.junk, args.wrap, args.wrong, args.pad),
                                      cfg.limits)
            for data in payloads:
                gossip.publish(data)
            emit("published", round=k, created=created, bytes=sum(map(len, payloads)), messages=len(payloads))
            k += 1

    async def report() -> None:
        while True:
            await asyncio.sleep(1.0)
            emit("stats", **usage(), **gossip.stats())

    async def squat() -> None:  # then holds what it got until the probe stops
        await asyncio.sleep(args.squat_after)
        relay = attacks.peer_of(args.bootstrap[0])
        emit("squat", relay=str(relay), granted=await asyncio.to_thread(gossip.call, attacks.reserve_slot, relay,
                                                                        args.closed_port))
        await asyncio.Event().wait()

    tasks = [asyncio.create_task(c()) for c in (receive, report, *([publish] if args.rate > 0 else []),
                                                *([squat] if args.squat else []))]
    stopped = asyncio.create_task(stop.wait())
    try:  # the loops only end by failing: the first failure stops the probe, loudly
        await asyncio.wait([stopped, *tasks], timeout=args.duration or None, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            if t.done() and t.exception():
                raise ProbeError(f"{t.get_coro().__name__} failed: {t.exception()!r}") from t.exception()
    finally:
        for t in (stopped, *tasks):
            t.cancel()
        await asyncio.gather(stopped, *tasks, return_exceptions=True)
        await asyncio.to_thread(gossip.stop)
        while not inbox.empty():  # messages that crossed the bridge before the stop
            emit_received(*inbox.get_nowait())
        emit("stats", **usage(), **gossip.stats())
        emit("stopped")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        cfg = P2PConfig(network=args.network, listen=[args.listen], bootstrap=args.bootstrap,
                        dht_bootstrap=args.dht_bootstrap, mesh_degree=args.mesh_degree,
                        max_peers=args.max_peers, shards=args.shards, hole_punching=not args.no_hole_punching,
                        # a squatter asks for no dial-back of its own: the relay answers one a minute, and
                        # --closed-port's must be the one it dials
                        reachability="public" if args.squat else "auto",
                        limits={"max_author_kib_per_s": UNPACED_KIB_PER_S} if args.unpaced else {})
    except ValidationError as e:
        print(f"probe: {describe(e)}", file=sys.stderr)
        return 2
    out = open(args.events, "a") if args.events else sys.stdout
    try:
        try:
            import uvloop
            uvloop.run(run(args, cfg, out))
        except ImportError:
            asyncio.run(run(args, cfg, out))
    except (IdentityError, P2PError, ProbeError) as e:
        print(f"probe: {e}", file=sys.stderr)
        return 1
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


def probe_module(checkout: Path) -> str:
    """The probe's module name in `checkout`: bench_hostile's `--code` runs older checkouts, whose probe
    lived in tests/ before the lab moved to scripts/bench/lab/."""
    return "scripts.bench.lab.probe" if (checkout / "scripts" / "bench" / "lab" / "probe.py").exists() else "tests.probe"


def json_lines(path: Path) -> list[dict]:
    """The JSON lines a running process (a probe's events, a node's metrics.jsonl) has written so far; a line
    still being written, or torn by a kill, is left out."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class ProbeProcess:
    """Harness side: one probe in a child process, its events read back from its JSON-lines file."""

    def __init__(self, workdir: Path, name: str, *args: str, key: Path | None = None, prefix: Sequence[str] = (),
                 cwd: Path | None = None):
        """`prefix` runs the probe under another command, e.g. `ip netns exec NS` (which execs, so the
        child's PID stays the probe's); `cwd` runs another checkout's probe (by default this one's)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.events_path = workdir / f"{name}.events.jsonl"
        self.log_path = workdir / f"{name}.log"
        self.key = key or workdir / f"{name}.key"
        self.started = time.time()  # wall clock, as its events' "t"
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", probe_module(cwd or ROOT), "--key", str(self.key), "--events", str(self.events_path), *args],
                stdout=subprocess.DEVNULL, stderr=log_file, cwd=cwd or ROOT)
        self._ready: dict | None = None

    def events(self, kind: str | None = None) -> list[dict]:
        return [e for e in json_lines(self.events_path) if kind is None or e["event"] == kind]

    def wait_for(self, what: Callable[[], object], timeout: float, describe: str) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if result := what():
                return result
            if self.proc.poll() is not None:
                raise RuntimeError(f"probe {self.name} exited ({self.proc.returncode}) waiting for {describe}: "
                                   f"{self.log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"probe {self.name}: no {describe} within {timeout:.0f} s")

    def ready(self, timeout: float = 60.0) -> dict:
        if self._ready is None:
            self._ready = self.wait_for(lambda: self.events("ready"), timeout, "ready event")[0]
        return self._ready

    @property
    def peer_id(self) -> str:
        return self.ready()["peer_id"]

    @property
    def addr(self) -> str:
        return self.ready()["addrs"][0]

    def stats(self) -> dict:
        found = self.events("stats")
        return found[-1] if found else {}

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


if __name__ == "__main__":
    sys.exit(main())
