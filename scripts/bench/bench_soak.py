"""Soak benchmark: a swarm of tiny-a nodes on 127.0.0.1 left running for hours under churn and hostile
stretches, each process watched for growth.

Phases of --phase seconds repeat, by default in this order: calm (nothing happens), churn (one of the churned
nodes SIGKILLed and restarted every --kill-every seconds, same --out: same key, same checkpoints; never before the
last one restarted has trained again, since on a loaded machine a start can outlast the period), churn with a
stranger flooding junk, churn with a stranger sending the length flood (right answers padded to 2,000
characters). --phases sets another cycle; `junk` and `length` flood without churn, so that `--phases calm length`
alternates a flood with calm and the drift of a long run cancels in each cycle's ratio. The bootstrap-only node,
every node's first bootstrap peer, is stopped and started again at the start of every junk phase. With --smollm2
a SmolLM2-135M node takes part for the whole of the second cycle.
Nodes 0 and 1 are never killed: the survivors.

Every --sample seconds each live process's RSS, open descriptors, threads and CPU time, and the machine's busy
and stolen CPU time, are read from /proc, and each process's status endpoint is scraped (pool size, the pool's
and the message policy's duplicate memories, health); the disk used by each run folder every minute. The JSON is rewritten every few minutes while it runs (an
interrupted soak keeps what it measured) and at the end holds each node's rounds, ERROR lines and
tracebacks, each restart's resume, and a summary: per-hour slopes after --settle seconds, with 95%
intervals over 10-minute block means, and the survivors' pace in each phase against the calm phase of the
same cycle, beside the cores they and the machine used in it.

    .venv/bin/python scripts/bench/bench_soak.py --duration 7200 --smollm2 --out docs/bench/soak-2cpu.json
    .venv/bin/python scripts/bench/bench_soak.py --duration 7200 --metrics-rotate-mb 4 --out docs/bench/soak-rotate-4mb-2cpu.json
    .venv/bin/python scripts/bench/bench_soak.py --report docs/bench/soak-2cpu.json   # the tables and figure again
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_churn import Node, node_args, restart, restart_outcome
from node.argtypes import bounded, positive, script_parser
from node.lifecycle import exit_on_stop_signals
from node.threads import CLOCK_TICKS, machine_cpu_s
from node.swarm import free_port, wait_listening
from p2p.identity import load_or_create, peer_id

from lab.probe import FLOOD_ARGS, ProbeProcess

PHASES = ("calm", "churn", "churn+junk", "churn+length")  # one cycle, by default
KINDS = (*PHASES, "junk", "length")  # a flood without churn: an A/B against calm that churn does not confound
SURVIVORS = 2  # nodes 0 and 1 are never killed
DISK_EVERY_S = 60.0
SAVE_EVERY_S = 300.0
RESUME_WAIT_S = 120.0  # after the duration, how long the last restarted node has to resume
BLOCK_S = 600.0  # slopes are fitted to block means: neighbouring samples are not independent
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
       15: 2.13, 20: 2.09, 30: 2.04}  # two-sided t by degrees of freedom (the nearest lower entry is used)
GROWTH = ("rss_mb", "fds", "threads", "disk_mb", "state_mb", "pool", "pool_seen", "seen_messages")  # state: disk less metrics
DASHBOARD = re.compile(r"status: dashboard at (http://\S+/)")


@dataclass
class Watched(Node):
    """A node process and what was read of it over time (`samples`, one dict each)."""
    name: str = ""
    samples: list[dict] = field(default_factory=list)
    disk_mb: float | None = None
    disk_at: float = -math.inf
    log_from: int = 0  # where this start's lines begin in node.log (each start appends)

    def start(self) -> None:
        log = self.out / "node.log"
        self.log_from = log.stat().st_size if log.exists() else 0
        super().start()

    def sample(self, now: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if now - self.disk_at >= DISK_EVERY_S:
            self.disk_mb, self.disk_at = round(folder_mb(self.out), 3), now
        metrics = sum(map(file_mb, self.out.glob("metrics*.jsonl*")))  # the file, its archives, lines set aside
        row = {"t": round(now, 1), "pid": self.proc.pid, **process_stats(self.proc.pid), "disk_mb": self.disk_mb,
               "metrics_mb": round(metrics, 3), "state_mb": None if self.disk_mb is None else round(self.disk_mb - metrics, 3)}
        url = self.status_url()
        row.update(scrape(url) if url else {"starting": True})
        self.samples.append(row)

    def status_url(self) -> str | None:
        """Where this start's status endpoint listens (it picks any free port); None until it has said so."""
        with open(self.out / "node.log", "rb") as log:
            log.seek(self.log_from)
            found = DASHBOARD.findall(log.read().decode(errors="replace"))
        return found[-1] if found else None

    def log_problems(self) -> dict:
        text = (self.out / "node.log").read_text(errors="replace") if (self.out / "node.log").exists() else ""
        errors = [line for line in text.splitlines() if " ERROR " in line]
        return {"error_lines": errors[:20], "n_error_lines": len(errors), "tracebacks": text.count("Traceback")}


def process_stats(pid: int) -> dict:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    utime, stime = stat.rsplit(")", 1)[1].split()[11:13]  # fields 14 and 15, after the command's name
    return {"rss_mb": round(int(fields["VmRSS"].split()[0]) / 1024, 1), "threads": int(fields["Threads"]), "fds": fds,
            "cpu_s": round((int(utime) + int(stime)) / CLOCK_TICKS, 2)}


def machine_cpu() -> dict:
    """The whole machine's CPU seconds so far, busy and stolen by the hypervisor: a phase slower than its calm one
    is then charged to the soak's processes, to something else on the machine, or to a neighbour."""
    busy, steal = machine_cpu_s()
    return {"t": round(time.time(), 2), "busy_s": round(busy, 2), "steal_s": round(steal, 2)}


def scrape(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "status", timeout=5) as r:
            s = json.load(r)
    except (OSError, ValueError) as e:
        return {"scrape_failed": type(e).__name__}
    p2p = s.get("p2p") or {}
    row = {"healthy": s.get("healthy"), "peers": p2p.get("peers")}
    if "pool" in p2p:  # a node serves its status before its gossip has started: no counters yet
        row.update(pool=p2p["pool"].get("size"), pool_seen=p2p["pool"].get("seen"), seen_messages=p2p.get("seen_messages"))
    return row


def folder_mb(path: Path) -> float:
    """What a run folder holds. The node rotates checkpoints and metrics while it is read: os.walk skips a folder
    gone before it is listed, and a file gone before it is measured counts as nothing (a 2-hour soak once ended on
    `rglob` meeting a checkpoint removed under it)."""
    return sum(file_mb(Path(folder, name)) for folder, _, names in os.walk(path) for name in names)


def file_mb(path: Path) -> float:
    try:
        return path.stat().st_size / 2**20
    except FileNotFoundError:
        return 0.0


def parse_args() -> argparse.Namespace:
    p = script_parser(__doc__)
    p.add_argument("--nodes", type=bounded(int, ge=SURVIVORS + 1), default=5, help="tiny-a nodes (the first two survive)")
    p.add_argument("--duration", type=positive, default=7200.0, help="seconds of soak")
    p.add_argument("--phase", type=positive, default=600.0, help="seconds of each phase")
    p.add_argument("--phases", nargs="+", choices=KINDS, default=list(PHASES),
                   help="one cycle's phases, in order (default: %(default)s); `junk` and `length` flood without churn")
    p.add_argument("--kill-every", type=positive, default=120.0, help="seconds between kills in a churn phase (a kill waits "
                   "until the node restarted last has trained a round)")
    p.add_argument("--settle", type=bounded(float, ge=0), default=1800.0, help="seconds left out of the slopes")
    p.add_argument("--sample", type=positive, default=10.0, help="seconds between samples")
    p.add_argument("--smollm2", action="store_true", help="a SmolLM2-135M node for the whole second cycle")
    p.add_argument("--checkpoint-every", type=bounded(int, ge=1), default=5)
    p.add_argument("--metrics-rotate-mb", type=positive, default=None,
                   help="every node's run.metrics_rotate_mb (default: the node's, 32 MB, which a tiny node at 150 rounds a "
                        "minute reaches after about 2.5 hours; a soak that should rotate sets less)")
    p.add_argument("--cache-dir", type=Path, default=None, help="model cache (default: the node's)")
    p.add_argument("--workdir", type=Path, default=Path("runs/bench-soak"))
    p.add_argument("--out", type=Path, default=Path("runs/bench-soak.json"))
    p.add_argument("--report", type=Path, metavar="JSON", help="print the tables and draw the figure of a saved soak")
    return p.parse_args()


class Soak:
    """The processes, the schedule and the record. `run()` owns every process it starts and stops them all
    (SIGTERM, then SIGKILL after 120 s) however it ends."""

    def __init__(self, args: argparse.Namespace, console: Console):
        self.args, self.console = args, console
        self.bootstrap = self._watched(-1, "bootstrap", args.workdir / "bootstrap", bootstrap_only=True)
        first = [f"/ip4/127.0.0.1/tcp/{self.bootstrap.port}/p2p/{self._id(self.bootstrap)}"]
        self.nodes = [self._watched(k, f"node{k}", args.workdir / f"node{k}") for k in range(args.nodes)]
        first.append(f"/ip4/127.0.0.1/tcp/{self.nodes[0].port}/p2p/{self._id(self.nodes[0])}")
        self.flood_target = first[1]  # a survivor
        rotate = [] if args.metrics_rotate_mb is None else ["--run.metrics_rotate_mb", f"{args.metrics_rotate_mb:g}"]
        for n in self.nodes:
            n.args = node_args(n.k, n.out, n.port, first, args) + rotate
        self.smollm2 = None
        if args.smollm2:
            self.smollm2 = self._watched(args.nodes, "smollm2", args.workdir / "smollm2")
            self.smollm2.args = node_args(args.nodes, self.smollm2.out, self.smollm2.port, first, args) + ["--model", "smollm2-135m", *rotate]
        self.flood: ProbeProcess | None = None
        self.events: list[dict] = []
        self.machine: list[dict] = []  # machine_cpu at every sample
        self.restarts: list[dict] = []
        self.started = self.ended = None

    def _watched(self, k: int, name: str, out: Path, bootstrap_only: bool = False) -> Watched:
        out.mkdir(parents=True, exist_ok=True)
        port = free_port()
        args = [sys.executable, "-m", "node.cli", "run", "--bootstrap-only", "--out", str(out),
                "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--status.listen", "127.0.0.1:0"] if bootstrap_only else []
        return Watched(k, out, port, args, name=name)

    @staticmethod
    def _id(n: Node) -> str:
        return peer_id(load_or_create(n.out / "node.key"))

    def procs(self) -> list[Watched]:
        return [self.bootstrap, *self.nodes, *([self.smollm2] if self.smollm2 else [])]

    def run(self) -> None:
        try:
            for n in [self.bootstrap, *self.nodes]:
                n.start()
            if not all(wait_listening(n.port, n.proc, 300) for n in [self.bootstrap, *self.nodes]):
                raise SystemExit(f"a node did not start: see the node.log files under {self.args.workdir}")
            self._loop()
        finally:
            self.ended = self.ended or time.time()
            self._end_flood()
            for n in self.procs():
                stop(n)
            self.save()
            if not self.complete:
                self.console.print(f"stopped early: the partial record is in {self.args.out} (--report prints it)")

    @property
    def complete(self) -> bool:
        """It ran its duration (not stopped or failed)."""
        return None not in (self.started, self.ended) and self.ended >= self.started + self.args.duration

    def _loop(self) -> None:
        self.started = now = time.time()
        phase, next_kill, next_sample, next_save, turn = -1, math.inf, now, now + SAVE_EVERY_S, 0
        while (now := time.time()) < self.started + self.args.duration:
            if (index := int((now - self.started) // self.args.phase)) != phase:
                phase = index
                self._enter(phase, now)
                next_kill = now + self.args.kill_every if self._kind(phase)[0].startswith("churn") else math.inf
            if now >= next_kill and self._resumed():
                self.restarts.append({**restart(self.nodes[SURVIVORS + turn % (len(self.nodes) - SURVIVORS)]), "phase": phase})
                turn, next_kill = turn + 1, now + self.args.kill_every
            if now >= next_sample:
                for n in self.procs():
                    n.sample(now)
                self.machine.append(machine_cpu())
                next_sample += self.args.sample
            if now >= next_save:
                self.save()
                next_save += SAVE_EVERY_S
            time.sleep(0.5)
        self.ended = time.time()
        deadline = self.ended + RESUME_WAIT_S  # the last restart's resume is part of the record
        while not self._resumed() and time.time() < deadline:
            time.sleep(0.5)

    def _resumed(self) -> bool:
        """Whether the last restarted node has trained a round since: the next kill then hits a training node, not
        one still importing torch (on a loaded machine a start can outlast --kill-every)."""
        last = self.restarts[-1] if self.restarts else None
        return last is None or self.nodes[last["node"]].trained_since(last["at"])

    def _enter(self, phase: int, now: float) -> None:
        """Start phase number `phase`: the flood of its kind, the bootstrap restart, the SmolLM2 node's turn."""
        kind, cycle = self._kind(phase)
        self._end_flood()
        flood = kind.split("+")[-1] if kind.endswith(("junk", "length")) else None
        if flood:  # first: the bootstrap's stop below blocks, and the flood (aimed at a survivor) need not wait for it
            self.flood = ProbeProcess(self.args.workdir / "floods", f"{flood}{phase}", "--bootstrap", self.flood_target,
                                      "--rate", "2", "--groups", "8", "--completions", "8", "--chars", "200", "--unpaced",
                                      *FLOOD_ARGS[flood])
        if flood == "junk":
            stopping = time.time()
            code = stop(self.bootstrap)
            self.events.append({"t": now, "event": "bootstrap_restart", "exit_code": code, "stop_s": time.time() - stopping})
            self.bootstrap.start()
        first = phase % len(self.args.phases) == 0
        if self.smollm2 and cycle == 1 and first:
            self.smollm2.start()
            self.events.append({"t": now, "event": "smollm2_start"})
        if self.smollm2 and cycle == 2 and first:
            self.events.append({"t": now, "event": "smollm2_stop", "exit_code": stop(self.smollm2)})
        self.events.append({"t": now, "event": "phase", "phase": phase, "kind": kind, "cycle": cycle})
        self.console.log(f"phase {phase}: {kind} (cycle {cycle})")

    def _kind(self, phase: int) -> tuple[str, int]:
        """Phase number `phase`'s kind and cycle."""
        return self.args.phases[phase % len(self.args.phases)], phase // len(self.args.phases)

    def _end_flood(self) -> None:
        if self.flood is not None:
            cpu_s = process_stats(self.flood.proc.pid).get("cpu_s")  # the cores the attacker took from the swarm here
            published = self.flood.events("published")
            self.events.append({"t": time.time(), "event": "flood_end", "flood": self.flood.name, "cpu_s": cpu_s,
                                "published": len(published), "exit_code": self.flood.stop(),
                                "s_to_first_publish": published[0]["t"] - self.flood.started if published else None})
            self.flood = None

    def save(self) -> None:
        ids = {n.name: self._id(n) for n in self.procs()}
        record = {"command": "scripts/bench/bench_soak.py " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
                  "machine": platform.platform(), "python": platform.python_version(), "args": {
                      k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items() if k != "report"},
                  "started": self.started, "ended": self.ended,  # complete: it ran its duration (not stopped or failed)
                  "complete": self.complete,
                  "events": self.events, "machine_cpu": self.machine,
                  "restarts": [restart_outcome(self.nodes[r["node"]], r, ids[f"node{r['node']}"]) for r in self.restarts],
                  "processes": {n.name: {"samples": n.samples, "starts": n.starts, **n.log_problems(),
                                         "exit_code": n.proc.returncode if n.proc else None,
                                         **({"rounds": [[round(r["time"], 1), r["round"]] for r in n.rows() if r["round"] > 0]}
                                            if n is not self.bootstrap else {})} for n in self.procs()}}
        record["summary"] = summarize(record)
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, separators=(",", ":")))  # hours of samples: compact
        tmp.replace(self.args.out)


def stop(n: Node) -> int | None:
    """SIGTERM, then SIGKILL after 120 s; the exit code (None: it was not running)."""
    if n.proc is None:
        return None
    if n.proc.poll() is None:
        n.proc.send_signal(signal.SIGTERM)
        try:
            n.proc.wait(120)
        except subprocess.TimeoutExpired:
            n.kill()
    return n.proc.returncode


# -- analysis (also what --report reads) ---------------------------------------------------------


def slope_per_hour(points: list[tuple[float, float]], start: float) -> dict | None:
    """Least-squares slope of 10-minute block means after `start`, per hour, with its 95% interval."""
    blocks: dict[int, list[float]] = {}
    for t, v in points:
        if t >= start and v is not None:
            blocks.setdefault(int((t - start) // BLOCK_S), []).append(v)
    if len(blocks) < 3:
        return None
    xs = [(b + 0.5) * BLOCK_S / 3600 for b in sorted(blocks)]
    ys = [statistics.mean(blocks[b]) for b in sorted(blocks)]
    fit = statistics.linear_regression(xs, ys)
    residual = sum((y - fit.intercept - fit.slope * x) ** 2 for x, y in zip(xs, ys)) / (len(xs) - 2)
    se = math.sqrt(residual / sum((x - statistics.mean(xs)) ** 2 for x in xs))
    df = len(xs) - 2
    t = t95(df)
    return {"slope": fit.slope, "ci95": t * se, "mean": statistics.mean(ys), "blocks": len(xs)}


def t95(df: int) -> float:
    """The two-sided 95% t value for `df` degrees of freedom (the nearest lower table entry)."""
    return T95[max(k for k in T95 if k <= df)]


def slopes(samples: list[dict], start: float, keys: tuple[str, ...]) -> dict:
    return {k: slope_per_hour([(s["t"], s.get(k)) for s in samples], start) for k in keys}


def peaks(samples: list[dict]) -> dict:
    """The highest RSS, descriptors and threads any one start of a process reached (restarted processes: no slope)."""
    return {k: max((s[k] for s in samples if s.get(k) is not None), default=None) for k in GROWTH[:3]}


def pace(rounds: list[list[float]], samples: list[dict], events: list[dict], end: float) -> list[dict]:
    """Each phase's rounds per minute, from its first round to its last (a start's model loading is no round), and
    its mean RSS, descriptors and threads: the same phase of each cycle compares like with like, where a slope over
    the whole soak also follows the floods' load."""
    phases = [e for e in events if e["event"] == "phase"]
    out = []
    for e, nxt in zip(phases, [*phases[1:], {"t": end}]):
        times = [t for t, _ in rounds if e["t"] <= t < nxt["t"]]
        rate = 60 * (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 else None
        inside = [s for s in samples if e["t"] <= s["t"] < nxt["t"]]
        means = {k: statistics.mean(v) if (v := [s[k] for s in inside if s.get(k) is not None]) else None for k in GROWTH[:3]}
        out.append({"phase": e["phase"], "kind": e["kind"], "cycle": e["cycle"], "rounds_per_min": rate, **means,
                    "cpu_cores": cores([(s["t"], s.get("cpu_s"), s.get("pid")) for s in inside])})
    return out


def cores(series: list[tuple[float, float | None, object]]) -> float | None:
    """Mean cores used over a span, from samples (time, cumulative CPU seconds, process): a pair of samples across a
    restart (another process) counts no time."""
    pairs = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(series, series[1:])
             if a[1] is not None and b[1] is not None and a[2] == b[2]]
    span = sum(dt for dt, _ in pairs)
    return sum(used for _, used in pairs) / span if span else None


def machine_by_phase(machine: list[dict], events: list[dict], end: float) -> list[dict]:
    """The machine's busy and stolen cores in each phase."""
    phases = [e for e in events if e["event"] == "phase"]
    out = []
    for e, nxt in zip(phases, [*phases[1:], {"t": end}]):
        inside = [m for m in machine if e["t"] <= m["t"] < nxt["t"]]
        out.append({"phase": e["phase"], "kind": e["kind"], "cycle": e["cycle"],
                    **{f"{k}_cores": cores([(m["t"], m[f"{k}_s"], 0) for m in inside]) for k in ("busy", "steal")}})
    return out


def survivor_summary(p: dict, events: list[dict], start: float, settle: float, end: float) -> dict:
    rounds = [r for _, r in p["rounds"]]
    phases = pace(p["rounds"], p["samples"], events, end)
    calm = {ph["cycle"]: ph["rounds_per_min"] for ph in phases if ph["kind"] == "calm"}
    ratios = [ph["rounds_per_min"] / calm[ph["cycle"]] for ph in phases
              if ph["kind"] != "calm" and ph["rounds_per_min"] and calm.get(ph["cycle"])]
    return {"rounds": len(rounds), "exit_code": p["exit_code"], "error_lines": p["n_error_lines"], "tracebacks": p["tracebacks"],
            "rounds_contiguous": rounds == list(range(rounds[0], rounds[0] + len(rounds))) if rounds else False,
            "pace": phases, "pace_vs_calm_min": min(ratios, default=None), "pace_vs_calm_mean": statistics.mean(ratios) if ratios else None,
            "vs_calm": vs_calm(phases),
            "slopes_per_hour": slopes(p["samples"], start + settle, GROWTH)}


def vs_calm(phases: list[dict]) -> dict:
    """Each kind of phase against the calm phase of its cycle, over cycles: the pace and the pace per core used
    (rounds a minute over the survivor's cores), each a mean ratio with its 95% interval (None with one cycle)."""
    calm = {ph["cycle"]: ph for ph in phases if ph["kind"] == "calm" and ph["rounds_per_min"] and ph["cpu_cores"]}
    out = {}
    for kind in dict.fromkeys(ph["kind"] for ph in phases if ph["kind"] != "calm"):
        pairs = [(ph, calm[ph["cycle"]]) for ph in phases
                 if ph["kind"] == kind and ph["cycle"] in calm and ph["rounds_per_min"] and ph["cpu_cores"]]
        pace = [ph["rounds_per_min"] / c["rounds_per_min"] for ph, c in pairs]
        core = [ph["rounds_per_min"] / ph["cpu_cores"] / (c["rounds_per_min"] / c["cpu_cores"]) for ph, c in pairs]
        out[kind] = {"cycles": len(pairs), "pace": mean_ci(pace), "per_core": mean_ci(core)}
    return out


def mean_ci(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "ci95": None}
    ci = t95(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None
    return {"mean": statistics.mean(xs), "ci95": ci}


def rejoined(events: list[dict], samples: list[dict]) -> list[float | None]:
    """Seconds from each bootstrap restart to its first sample with a peer (None: none before the soak ended)."""
    restarts = [e["t"] for e in events if e["event"] == "bootstrap_restart"]
    return [next((s["t"] - t for s in samples if s["t"] > t and (s.get("peers") or 0) > 0), None) for t in restarts]


def summarize(record: dict) -> dict:
    if record["started"] is None:
        return {}
    args, procs = record["args"], record["processes"]
    end = record["ended"] or max((s["t"] for p in procs.values() for s in p["samples"]), default=record["started"])
    restarts = record["restarts"]
    survivors = {f"node{k}": survivor_summary(procs[f"node{k}"], record["events"], record["started"], args["settle"], end)
                 for k in range(SURVIVORS)}
    return {"hours": (end - record["started"]) / 3600, "survivors": survivors,
            "machine_by_phase": machine_by_phase(record.get("machine_cpu", []), record["events"], end),
            "peaks_of_restarted": {n: peaks(p["samples"]) for n, p in procs.items() if n not in survivors},
            "restarts": len(restarts), "resumed_from_checkpoint": sum(bool(r["resumed_from_checkpoint"]) for r in restarts),
            "peer_id_kept": sum(bool(r["peer_id_kept"]) for r in restarts),
            "rounds_redone": sum(r["last_round_before_kill"] - r["checkpoint_round"] for r in restarts),
            "bootstrap_restarts": sum(e["event"] == "bootstrap_restart" for e in record["events"]),
            "bootstrap_s_to_peers": rejoined(record["events"], procs["bootstrap"]["samples"]),
            "flood_messages": {e["flood"]: e["published"] for e in record["events"] if e["event"] == "flood_end"},
            "error_lines": {n: p["n_error_lines"] for n, p in procs.items()},
            "tracebacks": {n: p["tracebacks"] for n, p in procs.items()}, **sample_counts(procs)}


def sample_counts(procs: dict) -> dict:
    samples = [s for p in procs.values() for s in p["samples"]]
    return {"samples": len(samples), "scrapes_failed": sum("scrape_failed" in s for s in samples),
            "samples_starting": sum("starting" in s for s in samples),
            "unhealthy_samples": sum(s.get("healthy") is False for s in samples)}


def report(record: dict, console: Console) -> None:
    s = record["summary"]
    table = Table(title=f"soak: {s['hours']:.2f} h{'' if record['complete'] else ' (stopped before its duration)'}, "
                        f"{record['args']['nodes']} tiny-a nodes; slopes per hour after "
                        f"{record['args']['settle'] / 60:.0f} min (95% interval)")
    for col in ("process", "rounds", "contiguous", "ERROR", "pace vs calm (min)", *GROWTH):
        table.add_column(col, justify="right")
    for name, v in s["survivors"].items():
        slopes = [v["slopes_per_hour"][k] for k in GROWTH]
        table.add_row(name, str(v["rounds"]), str(v["rounds_contiguous"]), str(v["error_lines"]),
                      "-" if v["pace_vs_calm_min"] is None else f"{v['pace_vs_calm_min']:.2f}",
                      *("-" if sl is None else f"{sl['slope']:+.2f} ± {sl['ci95']:.2f}" for sl in slopes))
    console.print(table)
    console.print(phase_table(s))
    console.print(against_calm_table(s))
    console.print({k: v for k, v in s.items() if k not in ("survivors", "machine_by_phase")})


def phase_table(s: dict) -> Table:
    """Each phase's pace and the CPU behind it: the survivors' own cores, and the machine's busy and stolen ones."""
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    table = Table(title="each phase: survivors' rounds a minute (cores they used); the machine's busy and stolen cores")
    for col in ("phase", "kind", *s["survivors"], "machine busy", "stolen"):
        table.add_column(col, justify="right")
    machine = {m["phase"]: m for m in s.get("machine_by_phase", [])}
    for ph in next(iter(s["survivors"].values()))["pace"]:
        own = [next(p for p in v["pace"] if p["phase"] == ph["phase"]) for v in s["survivors"].values()]
        m = machine.get(ph["phase"], {})
        table.add_row(str(ph["phase"]), ph["kind"],
                      *(f"{fmt(p['rounds_per_min'], '.0f')} ({fmt(p.get('cpu_cores'), '.2f')})" for p in own),
                      fmt(m.get("busy_cores"), ".2f"), fmt(m.get("steal_cores"), ".2f"))
    return table


def against_calm_table(s: dict) -> Table:
    table = Table(title="each kind of phase against its cycle's calm one: pace, and pace per core used (mean, 95% interval)")
    for col in ("survivor", "kind", "cycles", "pace", "per core"):
        table.add_column(col, justify="right")
    fmt = lambda m: "-" if m["mean"] is None else f"{m['mean']:.2f}" + ("" if m["ci95"] is None else f" ± {m['ci95']:.2f}")  # noqa: E731
    for name, v in s["survivors"].items():
        for kind, r in v.get("vs_calm", {}).items():
            table.add_row(name, kind, str(r["cycles"]), fmt(r["pace"]), fmt(r["per_core"]))
    return table


def figure(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20, 7), sharex=True)
    for ax, key, label in zip(axes[:, :3].flat, ("rss_mb", "fds", "threads", "disk_mb", "pool", "seen_messages"),
                              ("RSS (MB, log)", "open descriptors", "threads", "run folder (MB, log)", "pool groups",
                               "message hashes remembered")):
        log_scale = key in ("rss_mb", "disk_mb")  # a SmolLM2 node's gigabytes beside tiny nodes' hundreds of MB
        shade_phases(ax, record)
        for color, (name, p) in enumerate(record["processes"].items()):
            survivor = name in ("bootstrap", *(f"node{k}" for k in range(SURVIVORS)))
            for i, pid in enumerate(dict.fromkeys(x["pid"] for x in p["samples"])):  # one line per process started
                pts = [((x["t"] - record["started"]) / 60, x[key]) for x in p["samples"]
                       if x["pid"] == pid and x.get(key) is not None and (x[key] > 0 or not log_scale)]
                if pts:
                    ax.plot(*zip(*pts), color=f"C{color}", lw=1.4 if survivor else 0.7, alpha=1.0 if survivor else 0.5,
                            label=name if i == 0 else None)
        ax.set(title=label, xlabel="minutes", yscale="log" if log_scale else "linear")
    phase_panels(axes[:, 3], record)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("soak: survivors bold; shading: churn (grey), junk flood (red), length flood (orange)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def phase_panels(axes, record: dict) -> None:
    """The survivors' pace and cores, one level a phase: what the phase tables say, in time."""
    spans = phase_spans(record)
    for ax, key, label in zip(axes, ("rounds_per_min", "cpu_cores"), ("survivors' rounds a minute, by phase",
                                                                    "survivors' cores used, by phase")):
        shade_phases(ax, record)
        for k, (name, v) in enumerate(record.get("summary", {}).get("survivors", {}).items()):
            for ph in v["pace"]:
                if ph[key] is not None and ph["phase"] in spans:
                    ax.hlines(ph[key], *spans[ph["phase"]][1:], color=f"C{k + 1}", lw=1.6, label=name if ph["phase"] == 0 else None)
        ax.set(title=label, xlabel="minutes")
    axes[0].legend(fontsize=7)


def phase_spans(record: dict) -> dict[int, tuple[str, float, float]]:
    """Each phase's kind and its first and last minute into the soak."""
    phases = [e for e in record["events"] if e["event"] == "phase"]
    return {e["phase"]: (e["kind"], (e["t"] - record["started"]) / 60, (nxt["t"] - record["started"]) / 60)
            for e, nxt in zip(phases, [*phases[1:], {"t": record["ended"] or phases[-1]["t"]}])}


def shade_phases(ax, record: dict) -> None:
    shade = {"churn": "0.93", "churn+junk": "mistyrose", "churn+length": "moccasin", "junk": "mistyrose",
             "length": "moccasin"}
    for kind, start, end in phase_spans(record).values():
        if kind in shade:
            ax.axvspan(start, end, color=shade[kind], lw=0)


def main() -> None:
    args = parse_args()
    console = Console(width=170)
    if args.report:
        try:
            record = json.loads(args.report.read_text())
            record["summary"] = summarize(record)  # from the raw series: an analysis changed since the run applies
        except (OSError, ValueError) as e:
            raise SystemExit(f"bench_soak.py: error: --report {args.report}: {e}") from None
        except (KeyError, TypeError, AttributeError) as e:
            raise SystemExit(f"bench_soak.py: error: --report {args.report}: not a soak record ({e!r})") from None
        report(record, console)
        figure(record, args.report.with_suffix(".png"))
        return
    exit_on_stop_signals()
    soak = Soak(args, console)
    soak.run()
    record = json.loads(args.out.read_text())
    report(record, console)
    figure(record, args.out.with_suffix(".png"))
    console.print(f"saved {args.out} and {args.out.with_suffix('.png')}", soft_wrap=True)


if __name__ == "__main__":
    main()
