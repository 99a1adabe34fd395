r"""Discrete-event model of rollout dissemination: what one node pays per round, and what it gets, in a
swarm of N nodes, under protocol 3's shards and under one topic for all (shards pinned at level 0,
which is how protocol 1 disseminated).

Real code where it can be: every node's level is chosen by `p2p.shards.ShardLevel` from the authors it
is delivered, an author publishes one message on each of its `publish_topics`, each passing `topics_problem`; the
validation cost is measured here on real signed messages (`MessagePolicy.check` and libp2p's signature
check); a sample of --pool-nodes nodes keeps a real `RolloutPool` and picks its J external groups in
`node.selection.fair_order`, inspecting up to `max_inspect` groups, each carrying signal with
probability --signal-rate (re-scoring itself is not run).

Modelled, not run: every node publishes one message of the round's groups per round (its own period,
uniform in 0.75-1.25 x --round-s, first one within a round of joining); the swarm grows from 8 nodes,
doubling every --growth-s, to N, and is measured after the last node has listened a full window; a
node re-decides its level when it joins, once per own round and at each epoch boundary (all clocks
agree), with the levels of those of its 8 nearest peers by shard key whose shard contains it as the
hints it may probe (what shard-sorted peer exchange finds), reading its probes' topics too; each
topic's subscribers form a GossipSub mesh (random, degree D..2D, rebuilt at most every 10 s while its
subscribers change), and a message reaches every subscriber of its topics
in the mesh components its author's sends enter (TCP: no loss). A node is connected to the `max_peers` joined
peers nearest it by shard key (the order it dials hints in and peer exchange answers in); it hears an author
as `ShardLevel` counts it in the node, vouched for by the author's own connection when they are connected
or the author sent it the message, else by the mesh neighbour that brought it (each node its own address
block). A subscriber receives a message about
deg - 1 times (once from each mesh peer but the one it forwarded to first); a message's first copy is
validated, every copy costs transport. CPU per copy is taken from the real 2-node gossip benchmark
(docs/bench/gossip-20msgs-2cpu.json: CPU per message handled, minus the validation share); control
traffic (IHAVE/IWANT, heartbeats) and the pool's own bookkeeping (measured and reported apart) are
not in the CPU estimate.

    .venv/bin/python scripts/bench/simulate_swarm.py --schemes shards --out docs/bench/simulate-swarm-shards.json
    .venv/bin/python scripts/bench/simulate_swarm.py --nodes 8 100 1000 --schemes one-topic \
        --out docs/bench/simulate-swarm-one-topic.json
    .venv/bin/python scripts/bench/simulate_swarm.py --nodes 10000 --schemes one-topic --pool-nodes 2 \
        --out docs/bench/simulate-swarm-one-topic-10000.json
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX, signature_validator

from node.argtypes import bounded, count, fraction, positive, script_parser
from node.selection import fair_order
from p2p.config import Limits, P2PConfig, PoolConfig, ShardConfig
from p2p.policy import MessagePolicy
from p2p.pool import RolloutPool
from p2p.shards import EPOCH_S, epoch_of, prefix, publish_topics, shard_key, shard_topic, topic_level, topics_problem
from p2p.wire import VERSION, WireGroup, WireMessage, pack_groups
from rewards.scoring import group_carries_signal

from lab.probe import UNPACED_KIB_PER_S, synthetic_groups

BASE = "/sapo/sim/rollouts/3"
NEIGHBOURS = 8  # XOR-closest peers whose subscriptions a node sees
REMESH_S = 10.0
GOSSIP_BENCH = Path(__file__).resolve().parents[2] / "docs/bench/gossip-20msgs-2cpu.json"


def measure_validation(args: argparse.Namespace, samples: int = 300) -> dict[str, float]:
    """Milliseconds of CPU to validate one message of the simulated shape: libp2p's signature check
    plus `MessagePolicy.check`, on real signed messages."""
    keys = create_new_key_pair()
    author = ID.from_pubkey(keys.public_key)
    topics = publish_topics(BASE, shard_key(author.to_bytes(), epoch_of(time.time(), EPOCH_S)), 3)[1:2]  # one a message
    rng = random.Random(0)
    now = time.time()
    payloads = [pack_groups(author.to_base58(), "sim", r, now, synthetic_groups(
        rng, r, args.groups, args.completions, args.chars), Limits())[0][0] for r in range(samples)]
    msgs = []
    for r, data in enumerate(payloads):
        m = rpc_pb2.Message(from_id=author.to_bytes(), data=data, seqno=r.to_bytes(8, "big"), topicIDs=topics)
        m.signature = keys.private_key.sign(PUBSUB_SIGNING_PREFIX.encode() + m.SerializeToString())
        msgs.append(m)
    # one author's messages all checked at one instant: past its byte budget, whose cost is measured, not its effect
    policy = MessagePolicy(Limits(max_author_kib_per_s=UNPACED_KIB_PER_S), BASE, signal=group_carries_signal)
    t0 = time.process_time()
    assert all(map(signature_validator, msgs))
    t1 = time.process_time()
    for m in msgs:
        policy.check(m.data, author.to_base58(), list(m.topicIDs), now=now)
    t2 = time.process_time()
    return {"signature_ms": 1000 * (t1 - t0) / samples, "check_ms": 1000 * (t2 - t1) / samples,
            "message_bytes": statistics.mean(map(len, payloads))}


def copy_ms(validate_ms: float) -> float:
    """Transport CPU per message copy crossing a node, from the real 2-node benchmark: there every message
    handled is one copy (sent or received, no forwarding) and half of them were validated."""
    two = json.loads(GOSSIP_BENCH.read_text())["results"][0]
    assert two["nodes"] == 2
    return two["cpu_ms_per_message_per_node"] - validate_ms / 2


@dataclass
class Mesh:
    """One topic's GossipSub mesh among its subscribers, and the messages it carried while it stood
    (counted per mesh component, so a topic of 10,000 nodes costs O(1) per message)."""

    members: list[int]
    built: float
    degree: dict[int, int]
    neighbours: dict[int, list[int]]
    component: dict[int, int]  # node -> component id
    size: Counter[int]  # component id -> nodes
    carried: Counter[int] = field(default_factory=Counter)  # component id -> measured messages that reached it
    own: Counter[int] = field(default_factory=Counter)  # author -> its measured messages counted in `carried`

    @classmethod
    def build(cls, members: set[int], d: int, rng: random.Random, t: float) -> "Mesh":
        order = sorted(members)
        rng.shuffle(order)
        adj: dict[int, set[int]] = {v: set() for v in order}
        for v in order:  # each node grafts up to D peers that are not yet at 2D
            free = [u for u in rng.sample(order, min(len(order), 4 * d + 1)) if u != v and u not in adj[v]
                    and len(adj[u]) < 2 * d]
            for u in free[:max(0, d - len(adj[v]))]:
                adj[v].add(u)
                adj[u].add(v)
        component, cid = {}, 0
        for v in order:
            if v in component:
                continue
            stack = [v]
            component[v] = cid
            while stack:
                for u in adj[stack.pop()]:
                    if u not in component:
                        component[u] = cid
                        stack.append(u)
            cid += 1
        return cls(order, t, {v: len(a) for v, a in adj.items()}, {v: sorted(a) for v, a in adj.items()}, component,
                   Counter(component.values()))

    def settle(self, totals: list["Totals"]) -> None:
        """Charge every member for the messages the mesh carried to it: each is received about deg - 1
        times (once from every mesh peer but the one it forwarded to first), validated once and
        forwarded to every mesh peer but its source."""
        for v in self.members:
            k = self.carried[self.component[v]] - self.own[v]
            deg = self.degree[v]
            totals[v].copies_in += k * max(1, deg - 1)
            totals[v].first_in += k
            totals[v].copies_out += k * max(0, deg - 1)
        self.carried.clear()
        self.own.clear()


@dataclass
class Totals:
    """What one node paid over the measured window."""

    copies_in: float = 0.0
    first_in: int = 0
    copies_out: float = 0.0
    rounds: int = 0


class Swarm:
    """N nodes joining over time (8 at once, then doubling every --growth-s) and publishing each round."""

    def __init__(self, n: int, pinned: int | None, args: argparse.Namespace, seed: int):
        self.n, self.args, self.rng = n, args, random.Random(seed)
        self.d = P2PConfig.model_fields["mesh_degree"].default
        self.max_peers = P2PConfig.model_fields["max_peers"].default
        shards = ShardConfig(level="auto" if pinned is None else pinned)
        self.ids = [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]  # stand for peer ids
        self.level = [shards.level_of(peer, EPOCH_S, 0.0) for peer in self.ids]
        self.pinned = pinned is not None
        self.epoch = 0
        self.joined: list[tuple[bytes, int]] = []  # (shard key this epoch, node) of the nodes that joined, sorted
        self.members: dict[str, set[int]] = defaultdict(set)
        self.meshes: dict[str, Mesh] = {}
        self.dirty: set[str] = set()  # topics whose subscribers changed since their mesh was built
        self.totals = [Totals() for _ in range(n)]
        self.tracked = set(self.rng.sample(range(n), min(n, args.pool_nodes)))
        self.pools = {i: RolloutPool(PoolConfig()) for i in self.tracked}
        self.heard: dict[int, set[int]] = {i: set() for i in self.tracked}  # authors delivered while measured
        self.picks: list[dict] = []
        self.delivered = self.expected = 0
        self.pool_add_s: list[float] = []  # CPU of each RolloutPool.add, measured
        self.level_changes = self.level_changes_measured = 0

    def join_time(self, i: int) -> float:
        return 0.0 if i < 8 else self.args.growth_s * math.log2(i / 8)

    @property
    def warmup_s(self) -> float:
        """Until every node has joined and listened a full window."""
        return self.join_time(self.n - 1) + ShardConfig().window_s + self.args.settle_s

    def topic(self, i: int) -> str:
        return shard_topic(BASE, self.level[i].key, self.level[i].level)

    def topics(self, i: int) -> set[str]:
        """What the node reads: its shard's topic and those of the levels it probes."""
        return {self.topic(i), *(shard_topic(BASE, self.level[i].key, lv) for lv in self.level[i].probes)}

    def mesh(self, topic: str, t: float) -> Mesh:
        """The topic's mesh, rebuilt when its subscribers changed, at most every REMESH_S (GossipSub grafts
        newcomers at its heartbeats; a node that left is skipped at once, it pruned its links)."""
        mesh = self.meshes.get(topic)
        if mesh is None or (topic in self.dirty and t - mesh.built >= REMESH_S):
            if mesh is not None:
                mesh.settle(self.totals)
            self.dirty.discard(topic)
            mesh = self.meshes[topic] = Mesh.build(self.members[topic], self.d, self.rng, t)
        return mesh

    def move(self, i: int, old: set[str], new: set[str]) -> None:
        for topic in old - new:
            self.members[topic].discard(i)
            self.dirty.add(topic)
        for topic in new - old:
            self.members[topic].add(i)
            self.dirty.add(topic)

    def hinted_levels(self, i: int) -> list[int]:
        """The levels of the XOR-closest joined peers (what a DHT lookup of the node's own key finds) whose
        shard contains the node: what its connected peers' subscriptions hint at."""
        at = bisect.bisect_left(self.joined, (shard_key(self.ids[i], self.epoch), i))
        near = self.joined[max(0, at - NEIGHBOURS // 2):at + NEIGHBOURS // 2 + 1]
        mine = self.level[i].key
        return [self.level[j].level for key, j in near
                if j != i and prefix(key, self.level[j].level) == prefix(mine, self.level[j].level)]

    def connected(self, v: int, i: int) -> bool:
        """Whether either node is among the other's `max_peers` nearest joined peers by shard key (sorted keys:
        as in `hinted_levels`, the nearest are the neighbours in that order)."""
        at = {j: bisect.bisect_left(self.joined, (shard_key(self.ids[j], self.epoch), j)) for j in (v, i)}

        def near(j: int, k: int) -> bool:
            lo = max(0, min(at[j] - self.max_peers // 2, len(self.joined) - self.max_peers - 1))
            return lo <= at[k] <= lo + self.max_peers

        return near(v, i) or near(i, v)

    def voucher(self, v: int, i: int, entry: list[int], mesh: Mesh) -> int:
        """Whose connection vouches for author `i`'s message at `v`: the author's, when they are connected or it
        sent the message to `v` itself, else the mesh neighbour whose copy came first (any of them)."""
        if v in entry or self.connected(v, i) or not mesh.neighbours[v]:
            return i
        return self.rng.choice(mesh.neighbours[v])

    def run(self) -> None:
        a = self.args
        period = [a.round_s * self.rng.uniform(0.75, 1.25) for _ in range(self.n)]
        events = [(self.join_time(i), i, -1) for i in range(self.n)]
        end = self.warmup_s + a.measure_s
        events += [(k * EPOCH_S, -1, 0) for k in range(1, int(end // EPOCH_S) + 1)]
        heapq.heapify(events)
        while events:
            t, i, r = heapq.heappop(events)
            if t >= end:
                continue
            if i < 0:  # a new epoch: every node moves to its new shard (their clocks agree here)
                self.epoch = epoch_of(t, EPOCH_S)
                self.joined = sorted((shard_key(self.ids[j], self.epoch), j) for _, j in self.joined)
                for _, j in self.joined:
                    self.relevel(t, j)
                continue
            if r < 0:  # joins: listens at once, first publishes within its first round
                bisect.insort(self.joined, (shard_key(self.ids[i], self.epoch), i))
                self.relevel(t, i, joining=True)
                heapq.heappush(events, (t + self.rng.uniform(0, period[i]), i, 0))
                continue
            measured = t >= self.warmup_s
            self.publish(t, i, r, measured)
            if measured:
                self.totals[i].rounds += 1
                if i in self.pools:
                    self.select(t, i)
            self.relevel(t, i)
            heapq.heappush(events, (t + period[i], i, r + 1))
        for mesh in self.meshes.values():
            mesh.settle(self.totals)

    def relevel(self, t: float, i: int, joining: bool = False) -> None:
        old = set() if joining else self.topics(i)
        changed = self.level[i].update(t, self.hinted_levels(i))
        self.level_changes += changed and not joining
        self.level_changes_measured += changed and t >= self.warmup_s
        self.move(i, old, self.topics(i))

    def publish(self, t: float, i: int, r: int, measured: bool) -> None:
        topics = publish_topics(BASE, self.level[i].key, self.level[i].level)
        assert all(topics_problem(BASE, [topic], self.ids[i], [self.epoch]) is None for topic in topics)
        own, msg, heard = self.topic(i), None, set()  # a listener reading two of its topics takes it once
        for topic in topics:
            if not self.members.get(topic):
                continue
            mesh = self.mesh(topic, t)
            if topic == own and i in mesh.component:  # to the author's mesh peers on its own topic
                entry, sends = [i], mesh.degree[i]
            else:  # fanout: to D subscribers of a topic it is not meshed on
                entry = self.rng.sample(mesh.members, min(self.d, len(mesh.members)))
                sends = len(entry)
            reached = {mesh.component[v] for v in entry}
            if measured:
                self.totals[i].copies_out += sends
                mine = i in mesh.component and mesh.component[i] in reached
                self.expected += len(mesh.members) - (i in mesh.component)
                self.delivered += sum(mesh.size[c] for c in reached) - mine
                mesh.carried.update(reached)
                mesh.own[i] += mine
            # every listener hears the author (pinned levels need not: only the tracked nodes' pools do)
            for v in (mesh.members if not self.pinned else self.tracked & self.members[topic]):
                if v == i or mesh.component.get(v) not in reached or v not in self.members[topic]:
                    continue
                self.level[v].hear(self.ids[i], t, topic_level(BASE, topic),
                                   group=self.ids[self.voucher(v, i, entry, mesh)])
                if v in heard:
                    continue
                heard.add(v)
                if v in self.pools and t >= self.warmup_s - PoolConfig().max_age_s:
                    msg = msg or self.message(t, i, r)
                    t0 = time.process_time()
                    self.pools[v].add(msg, now=t)
                    self.pool_add_s.append(time.process_time() - t0)
                    if measured:
                        self.heard[v].add(i)

    def message(self, t: float, i: int, r: int) -> WireMessage:
        groups = [WireGroup(dataset="arith", config={}, seed=i, index=r * self.args.groups + g,
                            completions=[f"<answer>{c}</answer>" for c in range(self.args.completions)])
                  for g in range(self.args.groups)]
        return WireMessage(v=VERSION, peer=str(i), model="sim", round=r, created=t, groups=groups)

    def select(self, t: float, i: int) -> None:
        """The node's round: J informative groups from its pool, at most max_inspect inspected."""
        pool, a = self.pools[i], self.args
        held = pool.groups(now=t)
        found, inspected = 0, 0
        for pooled in fair_order(held, self.rng):
            if found == a.external_groups or inspected == a.max_inspect:
                break
            if not pool.take(pooled):
                continue
            inspected += 1
            found += self.rng.random() < a.signal_rate
        self.picks.append({"filled": found == a.external_groups, "pool_peers": len({g.peer for g in held})})


def summarize(swarm: Swarm, scheme: str, costs: dict[str, float]) -> dict:
    per_round = [(tot.copies_in / tot.rounds, tot.first_in / tot.rounds, tot.copies_out / tot.rounds)
                 for tot in swarm.totals if tot.rounds]
    copies_in, first_in, copies_out = (statistics.mean(col) for col in zip(*per_round))
    cpu = [(c_in + c_out) * costs["copy_ms"] + f * costs["validate_ms"] for c_in, f, c_out in per_round]
    levels = [s.level for s in swarm.level]
    return {
        "nodes": swarm.n, "scheme": scheme, "warmup_s": swarm.warmup_s,
        "rounds_measured_per_node": statistics.mean(t.rounds for t in swarm.totals),
        "msgs_in_per_round": copies_in, "msgs_validated_per_round": first_in, "msgs_out_per_round": copies_out,
        "kb_in_per_round": copies_in * costs["message_bytes"] / 1024,
        "kb_out_per_round": copies_out * costs["message_bytes"] / 1024,
        "cpu_ms_per_round_mean": statistics.mean(cpu), "cpu_ms_per_round_max": max(cpu),
        "delivery_ratio": swarm.delivered / swarm.expected if swarm.expected else float("nan"),
        "authors_heard_tracked_mean": statistics.mean(map(len, swarm.heard.values())),
        "levels": {str(lv): levels.count(lv) for lv in sorted(set(levels))},
        "level_changes_after_joining": swarm.level_changes,
        "level_changes_per_node_measured": swarm.level_changes_measured / swarm.n,
        "j_filled_ratio": statistics.mean(p["filled"] for p in swarm.picks),
        "pool_peers_mean": statistics.mean(p["pool_peers"] for p in swarm.picks),
        "pool_nodes": len(swarm.pools), "pool_add_ms_mean": 1000 * statistics.mean(swarm.pool_add_s),
    }


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--nodes", type=bounded(int, ge=2), nargs="+", default=[8, 100, 1000, 10000])
    p.add_argument("--schemes", nargs="+", choices=["shards", "one-topic"], default=["shards", "one-topic"])
    p.add_argument("--round-s", type=positive, default=30.0, help="mean round time")
    p.add_argument("--growth-s", type=positive, default=60.0, help="the swarm doubles every this many seconds until N")
    p.add_argument("--settle-s", type=bounded(float, ge=0), default=120.0,
                   help="measuring starts this long after the first window of the last node to join")
    p.add_argument("--measure-s", type=positive, default=300.0, help="simulated seconds measured")
    p.add_argument("--groups", type=count, default=4, help="groups per message (I)")
    p.add_argument("--completions", type=count, default=8, help="completions per group (G)")
    p.add_argument("--chars", type=count, default=300, help="characters per completion")
    p.add_argument("--external-groups", type=count, default=4, help="J")
    p.add_argument("--max-inspect", type=count, default=64)
    p.add_argument("--signal-rate", type=fraction, default=0.4, help="chance that an inspected group carries signal")
    p.add_argument("--pool-nodes", type=count, default=8, help="nodes that keep a real pool and select from it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/simulate-swarm.json"))
    args = p.parse_args()

    console = Console(width=200)
    measured = measure_validation(args)
    costs = {**measured, "validate_ms": measured["signature_ms"] + measured["check_ms"]}
    costs["copy_ms"] = copy_ms(costs["validate_ms"])
    console.log(f"measured per message: {costs}")
    rows = []
    for n in args.nodes:
        for scheme in args.schemes:
            t0 = time.monotonic()
            swarm = Swarm(n, None if scheme == "shards" else 0, args, args.seed)
            swarm.run()
            rows.append(summarize(swarm, scheme, costs))
            console.log(f"{n} nodes, {scheme}: {time.monotonic() - t0:.0f} s", rows[-1])

    table = Table(title=f"per node per round ({args.round_s:g} s rounds, {args.groups}x{args.completions}x"
                        f"{args.chars}-char groups, {costs['message_bytes'] / 1024:.1f} KB messages)")
    for col in ("nodes", "scheme", "msgs in", "validated", "msgs out", "KB in", "CPU ms (max)", "delivery",
                "authors heard", "J filled", "pool peers", "levels"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["nodes"]), r["scheme"], f"{r['msgs_in_per_round']:.1f}",
                      f"{r['msgs_validated_per_round']:.1f}", f"{r['msgs_out_per_round']:.1f}",
                      f"{r['kb_in_per_round']:.0f}", f"{r['cpu_ms_per_round_mean']:.0f} ({r['cpu_ms_per_round_max']:.0f})",
                      f"{100 * r['delivery_ratio']:.2f}%", f"{r['authors_heard_tracked_mean']:.1f}",
                      f"{100 * r['j_filled_ratio']:.0f}%", f"{r['pool_peers_mean']:.1f}",
                      " ".join(f"{k}:{v}" for k, v in r["levels"].items()))
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "scripts/bench/simulate_swarm.py " + " ".join(sys.argv[1:]),
                                    "costs_ms": costs, "params": {k: str(v) for k, v in vars(args).items()},
                                    "results": rows}, indent=2))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
