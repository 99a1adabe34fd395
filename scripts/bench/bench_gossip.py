"""Gossip benchmark: N probe processes on 127.0.0.1 publishing realistic rollout messages.

For each swarm size, every node publishes messages of G groups x C completions x K characters so
that the whole swarm publishes --rate messages per second (or, with --round-s, every node once per
round, as a SAPO node does); after a warm-up the soak is measured: delivery ratio (each message to
each node listening on a topic it names: every other node at shard level 0), p50/p95 propagation
latency (publisher's clock to the receiver's trio thread, same machine), CPU per message handled and
per round per node, and RSS growth per node over the soak (and over its second half: caches that fill
up level off, a leak does not). --shards sets every node's shard knobs ({"level": 0}: one topic for
all, protocol 1's dissemination). Prints a table and writes JSON.

    .venv/bin/python scripts/bench/bench_gossip.py --nodes 2 4 8 --rate 20 --soak 60 --out docs/bench/gossip-2cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libp2p.peer.id import ID

from node.argtypes import bounded, count, json_of, positive, script_parser
from node.lifecycle import exit_on_stop_signals
from p2p.config import P2PConfig, ShardConfig
from p2p.shards import publish_topics, shard_key, shard_topic

from lab.probe import ProbeProcess
from lab import netlab

SETTLE_S = 2.0  # messages published this close to the end may still be in flight


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def stats_at(probe: ProbeProcess, t: float) -> dict:
    """The probe's last stats line at or before time t."""
    before = [s for s in probe.events("stats") if s["t"] <= t]
    return before[-1] if before else probe.events("stats")[0]


@dataclass
class Soak:
    """A swarm's probes after their measured window, [start, end], and what the lab's lossy link counted."""
    probes: list[ProbeProcess]
    start: float
    end: float
    peers_at_start: int
    link: dict


def soak(n: int, per_node: float, args: argparse.Namespace, workdir: Path) -> Soak:
    """Start n probes publishing `per_node` messages a second (each in a network namespace of its own behind the
    lossy middle with --path), let them mesh, measure for --soak seconds, stop them."""
    shape = ["--groups", str(args.groups), "--completions", str(args.completions), "--chars", str(args.chars),
             "--mesh-degree", str(args.mesh_degree), "--max-peers", str(args.max_peers), "--shards", json.dumps(args.shards),
             "--unpaced"]  # a probe stands for many authors' load: past one author's byte budget at the default rates
    with contextlib.ExitStack() as stack:
        if args.path:
            lab = stack.enter_context(netlab.Lab(workdir, delay_ms=args.path[0] / 2, loss=args.path[1]))
            hosts = [lab.add_host() for _ in range(n)]
            where = [(h.cmd(), f"/ip4/{h.ip}/tcp/0") for h in hosts]
        else:
            where = [((), "/ip4/127.0.0.1/tcp/0")] * n
        probes: list[ProbeProcess] = []
        stack.callback(lambda: [p.stop() for p in probes])
        for i, (prefix, listen) in enumerate(where):
            join = ["--bootstrap", probes[0].addr] if probes else []
            probes.append(ProbeProcess(workdir, f"n{i}", "--rate", str(per_node), "--listen", listen, *join, *shape,
                                       prefix=prefix))
        for p in probes:
            p.wait_for(lambda p=p: p.stats().get("peers", 0) >= 1, 60, "a connection")
        time.sleep(args.warmup)  # peer exchange meshes the rest meanwhile
        start = time.time()
        peers_at_start = min(p.stats().get("peers", 0) for p in probes)
        time.sleep(args.soak)
        end = time.time()
        for p in probes:
            p.stop()
        return Soak(probes, start, end, peers_at_start, lab.link_counts() if args.path else {})


def deliveries(run: Soak) -> tuple[dict, int, list[float]]:
    """The messages published in the window (settled), how many of those each probe should have received (it
    read a topic the author published under), and the latencies of those it did."""
    ids = {p.peer_id: p for p in run.probes}
    base = P2PConfig(network="local").rollout_topic_base()

    def topics_at(probe: ProbeProcess, t: float) -> tuple[str, list[str]]:
        """The topic `probe` listened on at time t, and those it published under."""
        s = stats_at(probe, t)
        key = shard_key(ID.from_base58(probe.peer_id).to_bytes(), s["shard_epoch"])
        return shard_topic(base, key, s["shard_level"]), publish_topics(base, key, s["shard_level"])

    published = {(p.peer_id, e["round"]): e["created"] for p in run.probes for e in p.events("published")
                 if run.start <= e["created"] <= run.end - SETTLE_S}
    expected, latencies = 0, []
    for p in run.probes:
        got = {(e["peer"], e["round"]): e["at"] for e in p.events("received")}
        for (author, rnd), created in published.items():
            if author == p.peer_id or topics_at(p, created + 1)[0] not in topics_at(ids[author], created)[1]:
                continue
            expected += 1
            if (author, rnd) in got:
                latencies.append(got[(author, rnd)] - created)
    return published, expected, latencies


def usage(run: Soak, per_node: float) -> dict[str, list[float]]:
    """Each probe's CPU per message and per round, messages handled per round, and memory growth in the window."""
    out: dict[str, list[float]] = {k: [] for k in ("cpu_per_msg", "cpu_per_round", "handled_per_round", "rss_growth",
                                                   "rss_growth_late", "rss_end")}
    for p in run.probes:
        a, mid, b = stats_at(p, run.start), stats_at(p, (run.start + run.end) / 2), stats_at(p, run.end)
        handled = (b["accepted"] - a["accepted"]) + (b.get("published", 0) - a.get("published", 0))
        rounds = (b["t"] - a["t"]) * per_node
        out["cpu_per_msg"].append((b["cpu_s"] - a["cpu_s"]) / max(1, handled))
        out["cpu_per_round"].append((b["cpu_s"] - a["cpu_s"]) / rounds)
        out["handled_per_round"].append(handled / rounds)
        out["rss_growth"].append(100 * (b["rss_mb"] - a["rss_mb"]) / a["rss_mb"])
        out["rss_growth_late"].append(100 * (b["rss_mb"] - mid["rss_mb"]) / mid["rss_mb"])  # a leak keeps growing here
        out["rss_end"].append(b["rss_mb"])
    return out


def run_swarm(n: int, args: argparse.Namespace, workdir: Path) -> dict:
    per_node = 1 / args.round_s if args.round_s else args.rate / n
    run = soak(n, per_node, args, workdir)
    published, expected, latencies = deliveries(run)
    use = usage(run, per_node)
    return {
        "nodes": n, "rate_total_msg_s": n * per_node, "messages_published": len(published),
        "message_bytes": statistics.mean(e["bytes"] for p in run.probes for e in p.events("published")),
        "delivery_ratio": len(latencies) / expected if expected else float("nan"),
        "latency_p50_ms": 1000 * percentile(latencies, 0.50), "latency_p95_ms": 1000 * percentile(latencies, 0.95),
        "latency_max_ms": 1000 * max(latencies, default=float("nan")),
        "cpu_ms_per_message_per_node": 1000 * statistics.mean(use["cpu_per_msg"]),
        "round_s": 1 / per_node, "cpu_ms_per_round_per_node": 1000 * statistics.mean(use["cpu_per_round"]),
        "cpu_ms_per_round_per_node_max": 1000 * max(use["cpu_per_round"]),
        "messages_handled_per_round_per_node": statistics.mean(use["handled_per_round"]),
        "shard_levels": sorted(stats_at(p, run.end)["shard_level"] for p in run.probes),
        "rss_growth_pct_max": max(use["rss_growth"]), "rss_growth_second_half_pct_max": max(use["rss_growth_late"]),
        "rss_mb_end_max": max(use["rss_end"]), "rejected": sum(sum(p.stats().get("rejected", {}).values()) for p in run.probes),
        "peers_at_start_min": run.peers_at_start, "path_link_packets": run.link,
    }


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--nodes", type=bounded(int, ge=2), nargs="+", default=[2, 4, 8])
    p.add_argument("--rate", type=positive, default=20.0, help="messages per second published by the whole swarm")
    p.add_argument("--round-s", type=bounded(float, ge=0), default=0.0,
                   help="instead of --rate: every node publishes once per round")
    p.add_argument("--shards", type=json_of(ShardConfig), default={},
                   help='JSON of every node\'s shard knobs, e.g. {"level": 0}')
    p.add_argument("--soak", type=positive, default=60.0, help="measured seconds")
    p.add_argument("--warmup", type=bounded(float, ge=0), default=5.0, help="seconds after meshing before measuring")
    p.add_argument("--groups", type=count, default=8)
    p.add_argument("--completions", type=count, default=8)
    p.add_argument("--chars", type=count, default=200)
    p.add_argument("--mesh-degree", type=count, default=P2PConfig.model_fields["mesh_degree"].default,
                   help="GossipSub D of every node")
    p.add_argument("--max-peers", type=count, default=P2PConfig.model_fields["max_peers"].default,
                   help="every node's connection cap (below the swarm size: a sparse graph, as in a large swarm)")
    p.add_argument("--path", type=bounded(float, ge=0), nargs=2, metavar=("RTT_MS", "LOSS"),
                   help="run each node in a network namespace of its own (root), every path with this round "
                        "trip and packet loss (scripts/bench/lab/netlab.py)")
    p.add_argument("--out", type=Path, default=Path("runs/bench-gossip.json"))
    args = p.parse_args()
    if args.path and args.path[1] >= 1:
        p.error(f"argument --path: LOSS must be < 1 (got {args.path[1]:g})")
    exit_on_stop_signals()

    console = Console(width=160)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sapo-bench-gossip-") as tmp:
        for n in args.nodes:
            console.log(f"{n} nodes: meshing, {args.warmup:.0f} s warm-up, {args.soak:.0f} s soak")
            rows.append(run_swarm(n, args, Path(tmp) / f"n{n}"))
            console.log(rows[-1])

    pace = f"one message per node per {args.round_s:g} s" if args.round_s else f"{args.rate:g} msg/s swarm-wide"
    table = Table(title=f"gossip, {pace}, {args.groups}x{args.completions}x{args.chars} chars, shards {args.shards}")
    for col in ("nodes", "delivery", "p50 ms", "p95 ms", "CPU ms/msg/node", "CPU ms/round/node", "msgs/round/node",
                "RSS growth", "in 2nd half", "msg bytes"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["nodes"]), f"{100 * r['delivery_ratio']:.2f}%", f"{r['latency_p50_ms']:.1f}",
                      f"{r['latency_p95_ms']:.1f}", f"{r['cpu_ms_per_message_per_node']:.2f}",
                      f"{r['cpu_ms_per_round_per_node']:.0f}", f"{r['messages_handled_per_round_per_node']:.1f}",
                      f"{r['rss_growth_pct_max']:+.1f}%", f"{r['rss_growth_second_half_pct_max']:+.1f}%",
                      f"{r['message_bytes']:.0f}")
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "scripts/bench/bench_gossip.py " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
        "machine": platform.platform(), "python": platform.python_version(),
        "shape": {"groups": args.groups, "completions": args.completions, "chars": args.chars},
        "shards": args.shards, "max_peers": args.max_peers, "path_rtt_ms_loss": args.path,
        "soak_s": args.soak, "results": rows}, indent=2))
    console.print(f"saved {args.out}", soft_wrap=True)


if __name__ == "__main__":
    main()
