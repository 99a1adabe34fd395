"""Gossip benchmark: N probe processes on 127.0.0.1 publishing realistic rollout messages.

For each swarm size, every node publishes messages of G groups x C completions x K characters so
that the whole swarm publishes --rate messages per second; after a warm-up the soak is measured:
delivery ratio (each message to each other node), p50/p95 propagation latency (publisher's clock
to the receiver's trio thread, same machine), CPU seconds per message handled per node, and RSS
growth per node over the soak (and over its second half: caches that fill up level off, a leak
does not). Prints a table and writes JSON.

    .venv/bin/python scripts/bench_gossip.py --nodes 2 4 8 --rate 20 --soak 60 --out docs/bench/gossip-2cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from p2p.config import P2PConfig  # noqa: E402
from p2p.probe import ProbeProcess  # noqa: E402

SETTLE_S = 2.0  # messages published this close to the end may still be in flight


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def stats_at(probe: ProbeProcess, t: float) -> dict:
    """The probe's last stats line at or before time t."""
    before = [s for s in probe.events("stats") if s["t"] <= t]
    return before[-1] if before else probe.events("stats")[0]


def run_swarm(n: int, args: argparse.Namespace, workdir: Path) -> dict:
    shape = ["--groups", str(args.groups), "--completions", str(args.completions), "--chars", str(args.chars),
             "--mesh-degree", str(args.mesh_degree)]
    per_node = args.rate / n
    probes = [ProbeProcess(workdir, "n0", "--rate", str(per_node), *shape)]
    try:
        probes += [ProbeProcess(workdir, f"n{i}", "--rate", str(per_node), "--bootstrap", probes[0].addr, *shape)
                   for i in range(1, n)]
        for p in probes:
            p.wait_for(lambda p=p: p.stats().get("peers", 0) >= n - 1, 60, f"{n - 1} peers")
        time.sleep(args.warmup)
        start = time.time()
        time.sleep(args.soak)
        end = time.time()
    finally:
        for p in probes:
            p.stop()

    ids = {p.peer_id: p for p in probes}
    published = {(p.peer_id, e["round"]): e["created"] for p in probes for e in p.events("published")
                 if start <= e["created"] <= end - SETTLE_S}
    expected = delivered = 0
    latencies: list[float] = []
    for p in probes:
        got = {(e["peer"], e["round"]): e["at"] for e in p.events("received")}
        for (author, rnd), created in published.items():
            if author == p.peer_id:
                continue
            expected += 1
            if (author, rnd) in got:
                delivered += 1
                latencies.append(got[(author, rnd)] - created)

    cpu_per_msg, rss_growth, rss_growth_late, rss_end = [], [], [], []
    for p in probes:
        a, mid, b = stats_at(p, start), stats_at(p, (start + end) / 2), stats_at(p, end)
        handled = (b["accepted"] - a["accepted"]) + (b.get("published", 0) - a.get("published", 0))
        cpu_per_msg.append((b["cpu_s"] - a["cpu_s"]) / max(1, handled))
        rss_growth.append(100 * (b["rss_mb"] - a["rss_mb"]) / a["rss_mb"])
        rss_growth_late.append(100 * (b["rss_mb"] - mid["rss_mb"]) / mid["rss_mb"])  # a leak keeps growing here
        rss_end.append(b["rss_mb"])
    rejected = sum(sum(p.stats().get("rejected", {}).values()) for p in ids.values())
    return {
        "nodes": n, "rate_total_msg_s": args.rate, "messages_published": len(published),
        "message_bytes": statistics.mean(e["bytes"] for p in probes for e in p.events("published")),
        "delivery_ratio": delivered / expected if expected else float("nan"),
        "latency_p50_ms": 1000 * percentile(latencies, 0.50), "latency_p95_ms": 1000 * percentile(latencies, 0.95),
        "latency_max_ms": 1000 * max(latencies, default=float("nan")),
        "cpu_ms_per_message_per_node": 1000 * statistics.mean(cpu_per_msg),
        "rss_growth_pct_max": max(rss_growth), "rss_growth_second_half_pct_max": max(rss_growth_late),
        "rss_mb_end_max": max(rss_end), "rejected": rejected,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--rate", type=float, default=20.0, help="messages per second published by the whole swarm")
    p.add_argument("--soak", type=float, default=60.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds after meshing before measuring")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--completions", type=int, default=8)
    p.add_argument("--chars", type=int, default=200)
    p.add_argument("--mesh-degree", type=int, default=P2PConfig.model_fields["mesh_degree"].default,
                   help="GossipSub D of every node")
    p.add_argument("--out", type=Path, default=Path("runs/bench-gossip.json"))
    args = p.parse_args()

    console = Console()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sapo-bench-gossip-") as tmp:
        for n in args.nodes:
            console.log(f"{n} nodes: meshing, {args.warmup:.0f} s warm-up, {args.soak:.0f} s soak")
            rows.append(run_swarm(n, args, Path(tmp) / f"n{n}"))
            console.log(rows[-1])

    table = Table(title=f"gossip, {args.rate:g} msg/s swarm-wide, {args.groups}x{args.completions}x{args.chars} chars")
    for col in ("nodes", "delivery", "p50 ms", "p95 ms", "CPU ms/msg/node", "RSS growth", "in 2nd half", "msg bytes"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["nodes"]), f"{100 * r['delivery_ratio']:.2f}%", f"{r['latency_p50_ms']:.1f}",
                      f"{r['latency_p95_ms']:.1f}", f"{r['cpu_ms_per_message_per_node']:.2f}",
                      f"{r['rss_growth_pct_max']:+.1f}%", f"{r['rss_growth_second_half_pct_max']:+.1f}%",
                      f"{r['message_bytes']:.0f}")
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "scripts/bench_gossip.py " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
        "machine": platform.platform(), "python": platform.python_version(),
        "shape": {"groups": args.groups, "completions": args.completions, "chars": args.chars},
        "soak_s": args.soak, "results": rows}, indent=2))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
