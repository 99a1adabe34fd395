"""Churn benchmark: a swarm of tiny-a nodes on 127.0.0.1 in which a third of the nodes are SIGKILLed and
restarted (same --out: same key, same checkpoints) every --period seconds.

Nodes 0..2 are never killed (0 and 1 are every node's bootstrap peers); the others form groups of a third
of the swarm, killed in turn. Measured, and printed and saved as JSON:
- survivors: still running at the end, rounds never failing (no ERROR line, no gap in round numbers) and
  their round rate before and during the churn;
- each restart: the round it resumed at against its newest checkpoint before the kill, its peer id, and the
  seconds from restart to its first round, to its first round with a peer, and to the first round in which
  a group from the swarm entered its pool;
- survivors' RSS and pool size over time (first against last third of the churn): bounded, or growing.

    .venv/bin/python scripts/bench/bench_churn.py --nodes 9 --period 60 --duration 600 --out docs/bench/churn-2cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from node.argtypes import bounded, count, positive, script_parser
from node.lifecycle import exit_on_stop_signals
from node.metrics import MetricsLog
from node.swarm import free_port, wait_listening
from p2p.config import PoolConfig
from p2p.identity import load_or_create, peer_id

SURVIVORS = 3  # nodes 0..2 are never killed
SAMPLE_S = 5.0
REJOIN_WAIT_S = 90.0  # after the churn, the last restarts' time to get a swarm group (41.5 s at most over 30 restarts)
POOL_CAP = PoolConfig().size  # the nodes run with the default pool


@dataclass
class Node:
    k: int
    out: Path
    port: int
    args: list[str]
    proc: subprocess.Popen | None = None
    starts: list[float] = field(default_factory=list)  # wall-clock start of each (re)start
    rss: list[tuple[float, float]] = field(default_factory=list)  # (time, MB)

    def start(self) -> None:
        with open(self.out / "node.log", "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts.append(time.time())

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def rows(self) -> list[dict]:
        """Every round it wrote, its rotated archives included (a soak of hours rotates the file)."""
        return MetricsLog(self.out / "metrics.jsonl").rows()

    def trained_since(self, t: float) -> bool:
        """Whether the live metrics file's last line is a round written since `t` (read from its tail: a soak's file
        can be megabytes; a file just rotated is empty until the next round)."""
        path = self.out / "metrics.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - 65536))
                row = json.loads(f.read().rstrip().rsplit(b"\n", 1)[-1])
        except (OSError, ValueError):
            return False
        return isinstance(row, dict) and row.get("round", 0) > 0 and row.get("time", 0) >= t

    def checkpoint_round(self) -> int:
        done = [int(p.name.split("-")[1]) for p in (self.out / "checkpoints").glob("round-*") if p.name[6:].isdigit()]
        return max(done, default=0)

    def sample_rss(self) -> None:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return
        kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        self.rss.append((time.time(), kb / 1024))


def node_args(k: int, out: Path, port: int, bootstrap: list[str], args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "node.cli", "run", "--out", str(out), "--rounds", "1000000",
           "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--status.listen", "127.0.0.1:0",
           "--local", "2", "--external", "2", "--tasks", "arith,reverse", "--generation.completions_per_group", "4",
           "--tasks.eval_size", "10", "--run.eval_every", "1000000", "--run.checkpoint_every", str(args.checkpoint_every),
           "--run.torch_threads", "1"]
    if args.cache_dir:
        cmd += ["--model.cache_dir", str(args.cache_dir)]
    for b in bootstrap:
        if f"/tcp/{port}/" not in b:
            cmd += ["--bootstrap", b]
    return cmd


def first_after(rows: list[dict], since: float, pred) -> float | None:
    return next((r["time"] - since for r in rows if r["time"] >= since and pred(r)), None)


def got_swarm_group(row: dict) -> bool:
    """A round in which a group from the swarm entered the node's pool."""
    return (row.get("n_external_received") or 0) > 0


def rejoined(nodes: list[Node], restarts: list[dict]) -> bool:
    """Whether each restarted node has had a swarm group since its last restart (an earlier restart's window was
    closed by the next kill, so waiting cannot change it); one read of each node's metrics."""
    last = {r["node"]: r["at"] for r in restarts}
    return all(first_after(nodes[k].rows(), at, got_swarm_group) is not None for k, at in last.items())


def thirds(series: list[tuple[float, float]], start: float, end: float) -> tuple[float, float]:
    """Mean of the first and of the last third of (time, value) samples between start and end."""
    span = (end - start) / 3
    first = [v for t, v in series if start <= t < start + span]
    last = [v for t, v in series if end - span <= t <= end]
    return (statistics.mean(first) if first else float("nan"), statistics.mean(last) if last else float("nan"))


def parse_args() -> argparse.Namespace:
    p = script_parser(__doc__)
    p.add_argument("--nodes", type=int, default=9)
    p.add_argument("--period", type=positive, default=60.0, help="seconds between kills")
    p.add_argument("--duration", type=positive, default=600.0, help="seconds of churn")
    p.add_argument("--warmup", type=bounded(float, ge=0), default=60.0, help="seconds before the first kill")
    p.add_argument("--checkpoint-every", type=count, default=5)
    p.add_argument("--cache-dir", type=Path, default=None, help="model cache (default: the node's)")
    p.add_argument("--workdir", type=Path, default=Path("runs/bench-churn"))
    p.add_argument("--out", type=Path, default=Path("runs/bench-churn.json"))
    args = p.parse_args()
    if args.nodes < SURVIVORS + 3:
        p.error(f"--nodes must be at least {SURVIVORS + 3}: {SURVIVORS} survivors and a third to kill")
    return args


def plan_nodes(args: argparse.Namespace) -> tuple[list[Node], list[list[int]]]:
    """The nodes (0 and 1 are everyone's bootstrap peers) and the groups killed in turn: a third each, never
    one of the first SURVIVORS."""
    ports = [free_port() for _ in range(args.nodes)]
    outs = [args.workdir / f"node{k}" for k in range(args.nodes)]
    for out in outs:
        out.mkdir(parents=True, exist_ok=True)
    bootstrap = [f"/ip4/127.0.0.1/tcp/{ports[k]}/p2p/{peer_id(load_or_create(outs[k] / 'node.key'))}" for k in (0, 1)]
    nodes = [Node(k, outs[k], ports[k], node_args(k, outs[k], ports[k], bootstrap, args)) for k in range(args.nodes)]
    third = max(1, args.nodes // 3)
    step = (args.nodes - SURVIVORS) // third
    return nodes, [list(range(SURVIVORS + i, args.nodes, step)) for i in range(step)]


def churn(nodes: list[Node], groups: list[list[int]], args: argparse.Namespace, console: Console
          ) -> tuple[list[dict], float, float]:
    """Start every node, then for --duration kill and restart one group every --period seconds; wait until every
    restarted node has had a swarm group (REJOIN_WAIT_S at most); stop them all (SIGTERM, then SIGKILL after 120 s).
    Returns each restart and the churn's start and end."""
    restarts: list[dict] = []
    try:
        for node in nodes:
            node.start()
        if not all(wait_listening(n.port, n.proc, 300) for n in nodes):
            raise SystemExit("a node did not start: see its node.log under " + str(args.workdir))
        console.log(f"{args.nodes} nodes up; churn: groups {groups} in turn, every {args.period:g} s")
        time.sleep(args.warmup)
        churn_start = time.time()
        next_kill, turn, end = churn_start, 0, churn_start + args.duration
        while time.time() < end or next_kill < end:  # every kill due within --duration, however late the loop runs
            for node in nodes:
                node.sample_rss()
            if time.time() >= next_kill:
                restarts += [restart(nodes[k]) for k in groups[turn % len(groups)]]
                console.log(f"killed and restarted nodes {groups[turn % len(groups)]}")
                turn += 1
                next_kill += args.period
            time.sleep(SAMPLE_S)
        churn_end = time.time()
        deadline = churn_end + REJOIN_WAIT_S
        while time.time() < deadline and not rejoined(nodes, restarts):
            for node in nodes:
                node.sample_rss()
            time.sleep(SAMPLE_S)
    finally:
        for node in nodes:
            if node.proc and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in nodes:
            if node.proc:
                try:
                    node.proc.wait(120)
                except subprocess.TimeoutExpired:
                    node.kill()
    return restarts, churn_start, churn_end


def restart(node: Node) -> dict:
    node.kill()  # then read what it left: the newest complete checkpoint is what it resumes from
    checkpoint = node.checkpoint_round()
    rounds_before = max((r["round"] for r in node.rows()), default=0)
    node.start()
    return {"node": node.k, "at": node.starts[-1], "checkpoint_round": checkpoint, "last_round_before_kill": rounds_before}


def restart_outcome(node: Node, r: dict, peer_before: str) -> dict:
    """Whether a restart resumed from its checkpoint with its identity, and how soon it trained, met a peer and
    got a swarm group."""
    rows, since = node.rows(), r["at"]
    resumed = next((row["round"] for row in rows if row["time"] >= since and row["round"] > 0), None)
    return {**r, "resumed_round": resumed, "resumed_from_checkpoint": resumed == r["checkpoint_round"] + 1,
            "peer_id_kept": peer_before == peer_id(load_or_create(node.out / "node.key")),
            "s_to_first_round": first_after(rows, since, lambda row: row["round"] > 0),
            "s_to_peer": first_after(rows, since, lambda row: (row.get("peers") or 0) >= 1),
            "s_to_swarm_group": first_after(rows, since, got_swarm_group)}


def survivor(node: Node, churn_start: float, churn_end: float) -> dict:
    """A never-killed node: its exit, whether its rounds ran on without a gap, its pace, memory and pool."""
    rows = [r for r in node.rows() if r["round"] > 0]
    rounds = [r["round"] for r in rows]
    log_errors = [line for line in (node.out / "node.log").read_text(errors="replace").splitlines() if " ERROR " in line]
    before = [r for r in rows if r["time"] < churn_start]
    during = [r for r in rows if churn_start <= r["time"] <= churn_end]
    pool = [(r["time"], float(((r.get("p2p") or {}).get("pool") or {}).get("size", 0))) for r in rows]
    rss, pools = thirds(node.rss, churn_start, churn_end), thirds(pool, churn_start, churn_end)
    return {
        "node": node.k, "exit_code": node.proc.returncode, "rounds": len(rows), "error_lines": len(log_errors),
        "rounds_contiguous": rounds == list(range(rounds[0], rounds[0] + len(rounds))) if rounds else False,
        "rounds_per_min_before": 60 * len(before) / max(1.0, churn_start - min((r["time"] for r in rows), default=churn_start)),
        "rounds_per_min_during": 60 * len(during) / (churn_end - churn_start),
        "rss_mb_first_third": rss[0], "rss_mb_last_third": rss[1], "pool_first_third": pools[0], "pool_last_third": pools[1],
        "pool_max": max((v for _, v in pool), default=0), "rss_mb_max": max((v for _, v in node.rss), default=0),
        "peers_last": rows[-1].get("peers") if rows else None}


def summarize(restarts: list[dict]) -> dict:
    def stat(key: str) -> dict:
        values = sorted(v for r in restarts if (v := r[key]) is not None)
        return {"n": len(values), "missing": len(restarts) - len(values),
                "median": statistics.median(values) if values else None, "max": max(values, default=None)}

    return {"restarts": len(restarts), "resumed_from_checkpoint": sum(r["resumed_from_checkpoint"] for r in restarts),
            "peer_id_kept": sum(r["peer_id_kept"] for r in restarts),
            **{k: stat(k) for k in ("s_to_first_round", "s_to_peer", "s_to_swarm_group")}}


def survivors_table(survivors: list[dict], args: argparse.Namespace) -> Table:
    table = Table(title=f"churn: {args.nodes} nodes, a third killed every {args.period:g} s for {args.duration:g} s")
    for col in ("survivor", "exit", "rounds", "contiguous", "ERROR lines", "rounds/min before", "during",
                "RSS MB first/last third (max)", f"pool first/last third (max; cap {POOL_CAP})", "peers at end"):
        table.add_column(col, justify="right")
    for s in survivors:
        table.add_row(f"node{s['node']}", str(s["exit_code"]), str(s["rounds"]), str(s["rounds_contiguous"]),
                      str(s["error_lines"]), f"{s['rounds_per_min_before']:.1f}", f"{s['rounds_per_min_during']:.1f}",
                      f"{s['rss_mb_first_third']:.0f} / {s['rss_mb_last_third']:.0f} ({s['rss_mb_max']:.0f})",
                      f"{s['pool_first_third']:.0f} / {s['pool_last_third']:.0f} ({s['pool_max']:.0f})", str(s["peers_last"]))
    return table


def main() -> None:
    args = parse_args()
    exit_on_stop_signals()
    console = Console(width=160)
    nodes, groups = plan_nodes(args)
    ids = {n.k: peer_id(load_or_create(n.out / "node.key")) for n in nodes}
    restarts, churn_start, churn_end = churn(nodes, groups, args, console)
    restarts = [restart_outcome(nodes[r["node"]], r, ids[r["node"]]) for r in restarts]
    survivors = [survivor(node, churn_start, churn_end) for node in nodes[:SURVIVORS]]
    summary = summarize(restarts)
    console.print(survivors_table(survivors, args))
    console.print(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "scripts/bench/bench_churn.py " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
        "machine": platform.platform(), "python": platform.python_version(), "pool_cap": POOL_CAP, "summary": summary,
        "survivors": survivors, "restarts": restarts}, indent=2))
    console.print(f"saved {args.out}", soft_wrap=True)


if __name__ == "__main__":
    main()
