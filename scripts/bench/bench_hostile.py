"""Hostile-swarm benchmark over real libp2p on 127.0.0.1: free identities flooding useless groups.

Two tiny-a nodes train side by side: the *target* and an honest *neighbour* that joins through it. With
`--topology one-hop` the neighbour reaches the swarm only through the target (`p2p.max_peers` 1) and the
hostile probes connect to the target alone, so a flood at the target reaches the neighbour only if the
target forwards it; with `--topology direct` everyone dials whoever peer exchange names, so the flood
also arrives on the neighbour's own connections. H hostile probes (`lab/probe.py`, one fresh identity each) publish
2 messages a second of 8 well-formed `arith` groups of 8 completions: `--flood junk`, random text without an
answer (no learning signal for anyone), or `--flood answers`, random text ending in different wrong
answers (useless too, but only re-scoring shows it). After a warm-up, a window of W seconds is measured:

- the honest groups the target trains on per round (the neighbour's, by `external_sources`), beside what
  the neighbour offered: its informative groups published in the window per target round (a flood that
  slows the neighbour as much as the target leaves fewer honest groups per round to take);
- each node's CPU seconds per round, its process and sandbox worker together (the flood's cost to the node
  and to its neighbour; on a 2-core machine the probes' own CPU makes wall-clock rounds per second a
  measure of the harness more than of the node, so both are reported);
- the target's drops by reason.

Two floods carry signal, built to be learned rather than to waste time: `--flood masked`, groups of 4
right answers behind `zzzzzz` and 4 wrong ones (informative, yet the right rows are text no node would
write: under a rule that counts them as signal they prove their senders and take the honest slots while
adding no gradient), and `--flood wrapped`, the same with `--wrap TEXT` (default `z`: a one-character
prefix) before each right answer, text the node could learn to write. For these the table splits the
external groups a node trains on by sender (honest: the other node), and after the window every node's
final weights write 50 samples per task family with the node's own sampling: how many open with the wrap.
`--flood length` sends right answers padded with plausible working to 2,000 characters (the one attack Gensyn's
study of decentralised GRPO found its defences let through): the table adds the target's training seconds a
round and the longest mean length of any node's 50 samples per family after the window.

`--attack level-hijack` is an attack on the network layer instead of the pool: a swarm of `--sizes` N
honest nodes (3 tiny-a training nodes, the rest gossip probes publishing 4 groups every 2 s from the same
checkout) runs a window, then H strangers (`--hostile`; half subscribe to level 24 of their own shards, half
to every level of the first node's own shard, `--claim-shards-of`; none publishes) connect to the first
node for a window and leave, and a last window follows. Per window: each honest node's deepest shard
level and the external groups each training node uses per round. In every mode each run also keeps what
its honest processes left: ERROR lines and tracebacks (with the lines after each), exit codes after SIGTERM,
and rounds missing from or repeated in the training nodes' metrics ("lost" in the tables).

`--attack level-grind` is the same swarm and windows with strangers that cost more: their peer ids ground into the
first node's level-8 shard this epoch (about 256 key generations each), each pinned at level 8, claiming every level
of that node's shard (so that it probes level 8) and publishing one valid group with signal every 3 s there; with
`--computable` the groups are bare right and wrong answers, which anyone can compute and a node's selection finds
useful. `--lab` puts each honest node on a lab host of its own and the strangers on one more (one address, as one
machine's).

`--attack px-aim`: `--sizes` N gossip probes on one lab host, and for the middle window H strangers on another
that answer every peer-exchange ask with 32 made-up peers at random ports of 64 addresses of a third, which accepts
every connection and closes it (`lab/probe.py --lie-peers`).
Per window: the dials each honest node counted, failed hints, every connection attempt the honest host's packet
filter saw to the hinted one (a library's own dialer included), and ERROR lines; `--after` counts the last window
longer, by minute.

`--attack dht-eclipse` and `--attack dht-flood`: two honest DHT servers that know three hostile ones whose ids are ground
near the network's rendezvous key (`lab/dht.py`), each of whose answers names 20 made-up closer peers (and, for the
flood, 32 made-up providers) at 8 loopback hosts that count every connection. Two nodes that know only the five servers
start one lookup apart: when the second first hears the first and how many lookups each had made by then, then every
connection at the made-up hosts for `--window` seconds, by minute. Needs no lab (no root).

`--attack level-forward`: the same swarm and windows, each stranger sending, over its own connections, the signed
messages of 12 ids ground into the first node's level-8 shard (one group each every 2 s; `--computable` as above),
which never connect: forwarded Sybils.

`--attack dialback-liar` (lab): a relay, an honest peer and a liar that answers every dial-back request without
dialing, "reached" to a node behind NAT and "unreached" to a public one; each second, what the node believes.

`--attack mdns-spoof` (lab): on one LAN, made-up peer ids announced by mDNS at the addresses two nodes then listen on;
when each first hears the other.

`--attack relay-squat --computable`: each stranger publishes groups anyone can compute before it asks for a slot;
`--relay-after S` sets the relay's `p2p.relay_after_s` (relay-squat, relay-abuse).

`--code DIR` runs the nodes from another checkout (e.g. a `git worktree` of an older commit) for a
before/after comparison, `--rule` sets their swarm sampling rule; the hostile probes always run from this
one. Prints a table and writes JSON.

    .venv/bin/python scripts/bench/bench_hostile.py --hostile 0 1 6 --window 60 --seeds 2 --out docs/bench/hostile-2cpu.json
    .venv/bin/python scripts/bench/bench_hostile.py --flood wrapped --rule signal --hostile 0 6 --out docs/bench/hostile-wrapped-signal-2cpu.json
    .venv/bin/python scripts/bench/bench_hostile.py --attack level-hijack --sizes 3 9 --hostile 3 30 --window 45 --seeds 1 \
        --out docs/bench/hostile-level-hijack-2cpu.json
    .venv/bin/python scripts/bench/bench_hostile.py --attack px-aim --sizes 3 --hostile 30 --window 120 --after 600 \
        --seeds 1 --out docs/bench/hostile-px-aim-redials-after-2cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from node.argtypes import bounded, count, positive, script_parser
from node.lifecycle import exit_on_stop_signals
from node.progress import print_table
from node.selection_config import RULES
from node.swarm import free_port
from trainer.config import default_cache_dir

from lab.dht import HostileDHT, JsDHTServer
from lab.listeners import ConnectionCounter
from lab.probe import FLOOD_ARGS, ProbeProcess, json_lines, probe_module
from lab import netlab
from p2p.config import P2PConfig
from p2p.rendezvous import rendezvous_key

ROOT = Path(__file__).resolve().parents[2]

WARMUP_ROUNDS = 5
WRAPS = {"masked": "zzzzzz"}  # the wrap of each flood that carries signal; `wrapped` takes --wrap
SAMPLES = 50  # per task family, from each node's final weights


def node_args(out: Path, port: int, seed: int, cache: Path, rule: str, ip: str = "127.0.0.1") -> list[str]:
    return ["--out", str(out), "--rounds", "1000000", "--model.cache_dir", str(cache), "--tasks.eval_size", "10",
            "--selection.rule", rule,
            "--run.eval_every", "1000000", "--run.checkpoint_every", "1000000", "--run.seed", str(seed),
            "--status.listen", "127.0.0.1:0", "--listen", f"/ip4/{ip}/tcp/{port}",
            "--run.torch_threads", "1"]  # no idle threads spinning on a shared machine: CPU per round stays the node's


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its live descendants (the node's sandbox worker)."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total = (int(fields[11]) + int(fields[12])) / tick
        children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return total + sum(tree_cpu_s(c) for c in children)


def rows(out: Path) -> list[dict]:
    return json_lines(out / "metrics.jsonl")[1:]


def samples_after(out: Path, cache: Path, seed: int) -> dict[str, list[str]]:
    """SAMPLES completions per task family from the node's last checkpoint, with its own prompt and sampling."""
    from node.config import load_config
    from rewards import TaskSource
    from trainer import checkpoint
    from trainer.generation import SamplingParams
    from trainer.generation.hf import TransformersGenerator
    from trainer import presets
    from trainer.rollout import rollout

    cfg = load_config(overrides={"model": {"name": "tiny-a", "cache_dir": str(cache)}})
    policy = presets.load(cfg.model, weights_from=checkpoint.load_latest(out / "checkpoints").model_dir)
    g = cfg.generation
    params = SamplingParams(n=SAMPLES, temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens,
                            stop=tuple(g.stop), seed=seed)
    generator = TransformersGenerator(policy)
    return {family.name: rollout(generator, policy, TaskSource([family.mix()], seed=seed).draw(1), params)[0].completions
            for family in cfg.tasks.datasets}


def peer_id(code: Path, out: Path, env: dict, listen: str) -> tuple[str, str]:
    """The node's peer id and full address (its key is created on first use)."""
    ident = subprocess.run([sys.executable, "-m", "node.cli", "id", "--out", str(out), "--listen", listen],
                           cwd=code, env=env, capture_output=True, text=True, check=True)
    addr = next(line for line in ident.stdout.split() if line.startswith(f"{listen}/p2p/"))
    return addr.rsplit("/p2p/", 1)[1], addr


TRACEBACK_LINES = 80  # kept of a traceback, enough for its exception groups' causes


class Procs:
    """Processes of one run, each logging to its own file in `work`; stopped with SIGTERM, then killed."""

    def __init__(self, work: Path, code: Path):
        self.work, self.code = work, code
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, cwd: Path | None = None, prefix: list[str] = ()) -> subprocess.Popen:
        """`python -m ARGS` from `cwd` (the checkout under test by default), inside `prefix` (a lab
        namespace's `ip netns exec`) if given."""
        with open(self.work / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen([*prefix, sys.executable, "-m", *args], cwd=cwd or self.code,
                                                env=self.env, stdout=subprocess.DEVNULL, stderr=log)
        return self.procs[name]

    def probe(self, name: str, *args: str, cwd: Path | None = None, prefix: list[str] = ()) -> ProbeProcess:
        """A gossip probe of the checkout under test (or `cwd`'s), inside `prefix` if given."""
        probe = ProbeProcess(self.work, name, *args, prefix=prefix, cwd=cwd or self.code)
        self.procs[name] = probe.proc
        return probe

    def stop(self, names: list[str] | None = None) -> None:
        chosen = [self.procs[n] for n in (names if names is not None else list(self.procs))]
        for p in chosen:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in chosen:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()

    def wait_started(self, nodes: list[Path], timeout_s: float = 900) -> None:
        """Until every training node (by its run folder) has written WARMUP_ROUNDS rounds."""
        deadline = time.monotonic() + timeout_s
        while min(len(rows(out)) for out in nodes) < WARMUP_ROUNDS:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs.values()):
                raise RuntimeError(f"the swarm did not start (see {self.work})")
            time.sleep(0.5)

    def three_windows(self, window: float, hostile: int, addr: str, liar_args, prefix: list[str] = (),
                      on_mark=lambda: None, after: float | None = None, pieces: int = 1) -> dict[str, tuple[float, float]]:
        """Before, during and after an attack: `hostile` probes (`liar_args(h)` each, inside `prefix`) join
        through `addr` for the middle window, then leave; the last window lasts `after` (default `window`).
        `on_mark()` runs at each window's edge, and `pieces` times in all over the last. Returns each window's
        (start, end)."""
        marks = [time.time()]
        on_mark()
        time.sleep(window)
        marks.append(time.time())
        on_mark()
        liars = [f"liar{h}" for h in range(hostile)]
        for h, name in enumerate(liars):
            self.probe(name, "--bootstrap", addr, *liar_args(h), cwd=ROOT, prefix=prefix)
        time.sleep(window)
        self.stop(liars)
        marks.append(time.time())
        on_mark()
        for _ in range(pieces):
            time.sleep((window if after is None else after) / pieces)
            on_mark()
        marks.append(time.time())
        return dict(zip(("before", "attack", "after"), zip(marks, marks[1:])))

    def errors(self, name: str) -> list[str]:
        """ERROR lines and tracebacks in a process's log, each with the lines after it: printed, and kept in
        the result, since the log goes with the run's temporary folder."""
        lines = (self.work / f"{name}.log").read_text(errors="replace").splitlines()
        found = [error_excerpt(lines, i) for i, line in enumerate(lines)
                 if (" ERROR " in line or line.startswith("Traceback")) and not logged_with(lines, i)]
        for excerpt in found:
            print(f"{name}.log: " + excerpt.replace("\n", "\n    "), file=sys.stderr)
        return found

    def outcome(self, names: list[str], nodes: dict[str, Path] | None = None) -> dict:
        """What the honest processes `names` left behind, once stopped: their ERROR lines, their exit codes
        (SIGTERM ends each with 0 when it shuts down cleanly), and for the training nodes in `nodes` (name ->
        run folder) the rounds missing from or repeated in their metrics."""
        return {"errors": {n: self.errors(n) for n in names},
                "exit_codes": {n: self.procs[n].returncode for n in names},
                "round_gaps": {n: round_gaps(out) for n, out in (nodes or {}).items()}}


def logged_with(lines: list[str], i: int) -> bool:
    """Whether line i starts the traceback of an ERROR record just above it (`log.exception`): one error."""
    return lines[i].startswith("Traceback") and i > 0 and " ERROR " in lines[i - 1]


def error_excerpt(lines: list[str], i: int) -> str:
    """An ERROR line or a traceback at line i with the lines after it: a whole traceback, or 8 lines."""
    traceback = lines[i].startswith("Traceback") or (i + 1 < len(lines) and logged_with(lines, i + 1))
    return "\n".join(lines[i:i + (TRACEBACK_LINES + 1 if traceback else 8)])


def round_gaps(out: Path) -> int:
    """Rounds missing from a node's metrics or written twice: what a crash, a lost write or a second writer
    would leave."""
    seen = [r["round"] for r in rows(out)]
    distinct = len(set(seen))
    return (max(seen, default=0) - distinct) + (len(seen) - distinct)  # missing + repeated


def error_lines(run: dict) -> int:
    """ERROR lines and tracebacks of a run, all its honest processes together."""
    return sum(len(found) for found in run["errors"].values())


def lost(run: dict) -> int:
    """Honest processes that did not exit cleanly, and metrics rounds lost or repeated, in a run."""
    return sum(code != 0 for code in run["exit_codes"].values()) + sum(run["round_gaps"].values())


def sybil_args(flood: str, topology: str, wrap: str | None) -> list[str]:
    """A flooding probe's flags: what it sends, unpaced as an attacker's, and (one-hop) that it keeps to the target."""
    return ["--unpaced", *(["--max-peers", "1"] if topology == "one-hop" else []),
            *FLOOD_ARGS.get(flood, []),
            *(["--wrap", wrap] if wrap is not None else [])]


def run_flood(hostile: int, window: float, seed: int, code: Path, cache: Path, work: Path, flood: str,
              topology: str, rule: str, wrap: str | None) -> dict:
    procs = Procs(work, code)
    target_out, neighbour_out = work / "target", work / "neighbour"
    port, neighbour_port = free_port(), free_port()
    _, addr = peer_id(code, target_out, procs.env, f"/ip4/127.0.0.1/tcp/{port}")
    neighbour_id, _ = peer_id(code, neighbour_out, procs.env, f"/ip4/127.0.0.1/tcp/{neighbour_port}")
    try:
        nodes = [procs.start("target", "node.cli", "run", *node_args(target_out, port, seed, cache, rule)),
                 procs.start("neighbour", "node.cli", "run", *node_args(neighbour_out, neighbour_port, seed + 1, cache, rule),
                             "--bootstrap", addr, *(["--p2p.max_peers", "1"] if topology == "one-hop" else []))]
        for h in range(hostile):
            procs.start(f"sybil{h}", probe_module(ROOT), "--key", str(work / f"sybil{h}.key"), "--bootstrap", addr, "--rate", "2",
                        "--groups", "8", "--completions", "8", "--chars", "200", *sybil_args(flood, topology, wrap), cwd=ROOT)
        procs.wait_started([target_out, neighbour_out])
        t0, cpu0 = time.time(), [tree_cpu_s(p.pid) for p in nodes]
        time.sleep(window)
        t1, cpu1 = time.time(), [tree_cpu_s(p.pid) for p in nodes]
    finally:
        procs.stop()
    target = [r for r in rows(target_out) if t0 <= r["time"] <= t1]
    neighbour = [r for r in rows(neighbour_out) if t0 <= r["time"] <= t1]
    cpu_per_round = [(c1 - c0) / max(1, len(rs)) for c0, c1, rs in zip(cpu0, cpu1, (target, neighbour))]
    return {"hostile": hostile, "flood": flood, "rule": rule, "wrap": wrap, "topology": topology, "seed": seed,
            "window_s": t1 - t0, **what_they_write({"target": target_out, "neighbour": neighbour_out}, cache, seed,
                                                   wrap, flood == "length"),
            "target_train_s_per_round": mean_or((r["seconds_train"] for r in target), None),
            "target_cpu_s_per_round": cpu_per_round[0], "neighbour_cpu_s_per_round": cpu_per_round[1],
            "target_rounds_per_s": len(target) / (t1 - t0), "neighbour_rounds_per_s": len(neighbour) / (t1 - t0),
            **flood_rounds(target, neighbour, neighbour_id),
            **procs.outcome(["target", "neighbour"], {"target": target_out, "neighbour": neighbour_out})}


def what_they_write(outs: dict[str, Path], cache: Path, seed: int, wrap: str | None, length: bool) -> dict:
    """After a flood built to be learned: per node and family, how many of SAMPLES samples open with `wrap`,
    and (the length flood) their mean length in characters."""
    samples = {name: samples_after(out, cache, seed) for name, out in outs.items()} if wrap is not None or length else {}
    per = lambda f: {name: {family: f(texts) for family, texts in by_family.items()}  # noqa: E731
                     for name, by_family in samples.items()}
    return {"writes_wrap_of_50": per(lambda texts: sum(t.startswith(wrap) for t in texts)) if wrap is not None else None,
            "sample_chars_after": per(lambda texts: statistics.mean(map(len, texts))) if length else None}


def mean_or(values, default: float | None = 0.0) -> float | None:
    """The mean of a window's values, or `default` for a window with none (a node that wrote no round)."""
    values = list(values)
    return statistics.mean(values) if values else default


def flood_rounds(target: list[dict], neighbour: list[dict], neighbour_id: str) -> dict:
    """What the target trained on and refused in the window's rounds, and what the neighbour offered it."""
    dropped: dict[str, int] = {}
    for r in target:
        for reason, n in (r.get("external_dropped") or {}).items():
            dropped[reason] = dropped.get(reason, 0) + n
    # the groups of the neighbour the target trains on (a checkout older than `external_sources`: all it takes)
    honest = [(r["external_sources"] or {}).get(neighbour_id, 0) if "external_sources" in r else r["n_external"]
              for r in target]
    return {"honest_used_per_round": mean_or(honest),
            # what the neighbour offered: its informative local groups published in the window, per target round
            "honest_supply_per_round": sum(r["local_informative"] for r in neighbour) / max(1, len(target)),
            "external_used_per_round": mean_or(r["n_external"] for r in target),
            "inspected_per_round": mean_or(r.get("external_inspected") or 0 for r in target),
            "target_seconds": {phase: mean_or((r[f"seconds_{phase}"] for r in target), None)
                               for phase in ("generate", "train", "other")},
            "target_external_dropped": dropped, "target_p2p": target[-1].get("p2p") if target else None,
            # the messages the neighbour accepted in the window: the target's forwards of the flood among them
            "neighbour_accepted": window_delta(neighbour, "accepted"),
            "target_rejected_no_signal": window_delta(target, "rejected", "no_signal")}


def window_delta(rs: list[dict], *path: str) -> int | None:
    """How much a cumulative p2p counter of a node's metrics rows grew over them."""
    def value(r: dict) -> int:
        v = r.get("p2p") or {}
        for key in path[:-1]:
            v = v.get(key) or {}
        return v.get(path[-1]) or 0
    return value(rs[-1]) - value(rs[0]) if len(rs) > 1 else None


def probe_events(events: Path, kind: str = "stats") -> list[dict]:
    """A gossip probe's events of one kind, oldest first."""
    return [e for e in json_lines(events) if e.get("event") == kind]


HINTED_ADDRS = 64  # px-aim: the addresses the liars' made-up peers are spread over (a host cap is per address)


def run_px_aim(size: int, hostile: int, window: float, code: Path, work: Path, after: float) -> dict:
    """N gossip probes on one lab host; for the middle window H strangers on another answer every peer-exchange ask
    with 32 made-up peers at random ports of `HINTED_ADDRS` addresses of a third, which accepts every TCP connection
    and closes it (others' hosts). Per window: the dials each honest node counted, its failed hints, and every
    connection attempt from the honest host to the hinted one that its packet filter saw (what a library's own
    dialer adds is there, whatever the node counts); the last window lasts `after` seconds, also counted by minute."""
    procs = Procs(work, code)
    honest = [f"gossip{i}" for i in range(size)]
    syns: list[tuple[float, int]] = []
    with netlab.Lab(work / "lab") as lab:
        home, strangers, hinted = lab.add_host(), lab.add_host(), lab.add_open_host(HINTED_ADDRS)
        count_syns = lab.syn_counter(home, f"{hinted[0].rsplit('.', 1)[0]}.0/24")
        listen = ["--listen", f"/ip4/{home.ip}/tcp/0", "--rate", "0.5", "--groups", "1"]
        try:
            first = procs.start(honest[0], probe_module(procs.code), "--key", str(work / "gossip0.key"), *listen,
                                "--events", str(work / "gossip0.jsonl"), prefix=home.cmd())
            deadline = time.monotonic() + 120
            while not (ready := probe_events(work / "gossip0.jsonl", "ready")):
                if time.monotonic() > deadline or first.poll() is not None:
                    raise RuntimeError(f"the first node did not start (see {work})")
                time.sleep(0.5)
            addr = next(a for a in ready[0]["addrs"] if a.startswith(f"/ip4/{home.ip}/")) + f"/p2p/{ready[0]['peer_id']}"
            for name in honest[1:]:
                procs.start(name, probe_module(procs.code), "--key", str(work / f"{name}.key"), "--bootstrap", addr,
                            *listen, "--events", str(work / f"{name}.jsonl"), prefix=home.cmd())
            time.sleep(20)  # mesh
            phases = procs.three_windows(window, hostile, addr, lambda h: [
                "--lie-peers", ",".join(hinted), "--listen", f"/ip4/{strangers.ip}/tcp/0"], prefix=strangers.cmd(),
                on_mark=lambda: syns.append((time.time(), count_syns())), after=after, pieces=max(1, round(after / 60)))
        finally:
            procs.stop()
    after_marks = [c for t, c in syns if t >= phases["after"][0] - 1]
    return {"attack": "px-aim", "size": size, "hostile": hostile, "window_s": window, "after_s": after,
            "phases": {phase: px_window(work, honest, syns, a, b) for phase, (a, b) in phases.items()},
            "attempts_at_hinted_host_by_minute_after": [b - a for a, b in zip(after_marks, after_marks[1:])],
            **procs.outcome(honest)}


def px_window(work: Path, honest: list[str], syns: list[tuple[float, int]], a: float, b: float) -> dict:
    """One window of px-aim: what each honest node counted of its dials, and the attempts the filter saw."""
    per_node = {}
    for n in honest:
        inside = [e for e in probe_events(work / f"{n}.jsonl") if a <= e["t"] <= b]
        per_node[n] = {k: inside[-1].get(k, 0) - inside[0].get(k, 0) if inside else None
                       for k in ("dials", "dial_failed", "hints_failed")}
    counted = [c for t, c in syns if a - 1 <= t <= b + 1]  # the marks at the window's edges
    return {"nodes": per_node, "dials_per_node_per_min": statistics.mean((v["dials"] or 0) for v in per_node.values())
            * 60 / (b - a), "attempts_at_hinted_host": counted[-1] - counted[0]}


GRIND_LEVEL = 8  # level-grind: the strangers' ids are ground into the first node's shard this deep


def grind_keys(work: Path, target: str, names: list[str], level: int = GRIND_LEVEL) -> None:
    """Key files for `names` whose peer ids share the first `level` shard-key bits of `target`'s this epoch
    (about 2^level key generations each): authors the target's own shard, down to `level`, would hold."""
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    from p2p.network import load_network
    from p2p.shards import epoch_of, prefix, shard_key

    epoch = epoch_of(time.time(), load_network("local").shard_epoch_s)
    want = prefix(shard_key(ID.from_base58(target).to_bytes(), epoch), level)
    for name in names:
        while True:
            pair = create_new_key_pair()
            if prefix(shard_key(ID.from_pubkey(pair.public_key).to_bytes(), epoch), level) == want:
                break
        (work / f"{name}.key").write_bytes(pair.private_key.serialize())
        (work / f"{name}.key").chmod(0o600)


def run_level_hijack(size: int, hostile: int, window: float, seed: int, code: Path, cache: Path, work: Path,
                     rule: str, grind: bool = False, computable: bool = False, in_lab: bool = False,
                     forward: bool = False) -> dict:
    """Subscribe-only strangers (half at level 24 of their own shards, half claiming every level of the first
    node's); with `grind`, strangers whose ids are ground into the first node's level-8 shard, pinned there,
    each publishing one valid group every 3 s (`computable`: bare right and wrong answers, which anyone can
    compute and the node's selection counts as useful) and claiming its shards (the target probes level 8 and
    hears them); with `forward`, each stranger sends the signed messages of 12 ids ground into that shard over its
    own connections (`lab/probe.py --forward-signers`): Sybils a forwarder launders. With `in_lab`, every honest
    process on a lab host of its own and the strangers on one more (one address, as a single machine's), else all
    on 127.0.0.1."""
    procs = Procs(work, code)
    trainers = [f"node{i}" for i in range(min(3, size))]
    gossipers = [f"gossip{i}" for i in range(size - len(trainers))]
    with netlab.Lab(work / "lab") if in_lab else contextlib.nullcontext() as lab:
        hosts = {n: lab.add_host() if lab else None for n in [*trainers, *gossipers, "strangers"]}
        ip = {n: h.ip if h else "127.0.0.1" for n, h in hosts.items()}
        within = {n: h.cmd() if h else [] for n, h in hosts.items()}
        ports = {n: free_port() for n in trainers}
        target_id, addr = peer_id(code, work / trainers[0], procs.env, f"/ip4/{ip[trainers[0]]}/tcp/{ports[trainers[0]]}")
        try:
            for i, name in enumerate(trainers):
                procs.start(name, "node.cli", "run", *node_args(work / name, ports[name], seed + i, cache, rule, ip[name]),
                            *(["--bootstrap", addr] if i else []), prefix=within[name])
            for name in gossipers:
                procs.start(name, probe_module(procs.code), "--key", str(work / f"{name}.key"), "--bootstrap", addr,
                            "--rate", "0.5", "--groups", "4", "--events", str(work / f"{name}.jsonl"),
                            "--listen", f"/ip4/{ip[name]}/tcp/{free_port()}", prefix=within[name])
            procs.wait_started([work / n for n in trainers])
            liar_args = level_liar_args(work, target_id, hostile, grind, computable, forward)
            phases = procs.three_windows(window, hostile, addr, lambda h: [
                *liar_args(h), "--listen", f"/ip4/{ip['strangers']}/tcp/{free_port()}"], prefix=within["strangers"])
        finally:
            procs.stop()
    out = {phase: hijack_window(work, trainers, gossipers, a, b) for phase, (a, b) in phases.items()}
    return {"attack": "level-forward" if forward else "level-grind" if grind else "level-hijack", "size": size, "hostile": hostile, "seed": seed, "rule": rule,
            "window_s": window, "computable": computable, "lab": in_lab, "phases": out,
            **procs.outcome(trainers + gossipers, {n: work / n for n in trainers})}


def level_liar_args(work: Path, target_id: str, hostile: int, grind: bool, computable: bool, forward: bool = False):
    """Each stranger's probe flags: a forwarder of 12 ground ids' messages, ground ids pinned at the target's level-8
    shard publishing there (their keys written to `work`), or half claiming every level of the target's shard and half
    level 24 of their own."""
    if forward:
        return lambda h: ["--forward-signers", target_id, "--groups", "1", *(["--wrap", ""] if computable else [])]
    if grind:
        grind_keys(work, target_id, [f"liar{h}" for h in range(hostile)])
        return lambda h: ["--claim-shards-of", target_id, "--shards", json.dumps({"level": GRIND_LEVEL}),
                          "--rate", "0.33", "--groups", "1", *(["--wrap", ""] if computable else [])]
    return lambda h: (["--claim-shards-of", target_id] if h % 2 == 0 else ["--shards", json.dumps({"level": 24})])


def hijack_window(work: Path, trainers: list[str], gossipers: list[str], a: float, b: float) -> dict:
    """One window of a level hijack: every honest node's deepest shard level, and the trainers' external use."""
    per_node = {n: trainer_window([r for r in rows(work / n) if a <= r["time"] <= b]) for n in trainers}
    for n in gossipers:
        levels = [e["shard_level"] for e in probe_events(work / f"{n}.jsonl") if a <= e["t"] <= b and "shard_level" in e]
        per_node[n] = {"deepest_level": max(levels, default=None)}
    return {"nodes": per_node, "deepest_level": max((v["deepest_level"] or 0) for v in per_node.values()),
            "external_used_per_round": statistics.mean(per_node[n]["external_used_per_round"] for n in trainers)}


def trainer_window(rs: list[dict]) -> dict:
    """A training node's rounds in one window: the external groups it used and its shard level and mesh."""
    p2p = [r.get("p2p") or {} for r in rs]
    return {"rounds": len(rs), "external_used_per_round": mean_or(r["n_external"] for r in rs),
            "deepest_level": max((x.get("shard_level", 0) for x in p2p), default=None),
            "peers_max": max((r["peers"] for r in rs), default=0),
            # GossipSub mesh peers on our topic: strangers in the mesh crowd honest peers out
            "mesh_peers_mean": mean_or((x.get("mesh_peers") or 0 for x in p2p), None),
            "levels_probed": sorted({lv for x in p2p for lv in x.get("shard_probes", [])})}


RELAY_PORT = 4001


def relay_node(procs: Procs, lab, out: Path, *extra: str, train: tuple[int, Path, str] | None = None) -> str:
    """A public lab host running the checkout under test's node at RELAY_PORT, a bootstrap-only one or, with
    `train` (seed, cache, rule), a tiny-a training node; `extra`: more run flags. Returns its full address."""
    host = lab.add_host()
    listen = f"/ip4/{host.ip}/tcp/{RELAY_PORT}"
    _, addr = peer_id(procs.code, out, procs.env, listen)
    run_args = node_args(out, RELAY_PORT, *train, ip=host.ip) if train else \
        ["--bootstrap-only", "--out", str(out), "--listen", listen]
    procs.start("relay", "node.cli", "run", *run_args, "--p2p.reachability", "public", *extra, prefix=host.cmd())
    return addr


COMPUTABLE_S = 40  # relay-squat --computable: seconds each stranger publishes before it asks (34 probes on 2 cores
# took more than 10 s to have a group accepted: none was a participant yet)


def run_relay_squat(hostile: int, slots: int, window: float, code: Path, work: Path, pose_nat: bool = False,
                    computable: bool = False, relay_flags: list[str] = ()) -> dict:
    """H strangers ask a relay with `slots` slots for one each, straight away (with `pose_nat`, each after a
    dial-back on a closed port, passing for a peer behind NAT; with `computable`, after publishing a group a
    second of bare right and wrong answers, which anyone can compute, for `COMPUTABLE_S`), and stay; then they
    leave and two honest nodes behind NAT start, publishing a group a second: which of them gets a slot within
    `window`."""
    procs = Procs(work, code)
    publish = ["--rate", "1", "--groups", "1", "--wrap", "", "--squat-after", str(COMPUTABLE_S)] if computable else []
    with netlab.Lab(work / "lab") as lab:
        try:
            addr = relay_node(procs, lab, work / "relay", "--p2p.relay_slots", str(slots), *relay_flags)
            host = lab.add_host()
            strangers = [procs.probe(f"stranger{h}", "--listen", f"/ip4/{host.ip}/tcp/{RELAY_PORT + 1 + h}",
                                     "--bootstrap", addr, "--squat", *(["--closed-port", "9"] if pose_nat else []),
                                     *publish, cwd=ROOT, prefix=host.cmd()) for h in range(hostile)]
            granted = [s.wait_for(lambda s=s: s.events("squat"), 120, "an answer to its ask")[0]["granted"]
                       for s in strangers]
            procs.stop([s.name for s in strangers])
            homes = []
            for name in ("home0", "home1"):
                home = lab.add_host(nat=True)
                homes.append(procs.probe(name, "--listen", f"/ip4/{home.ip}/tcp/{RELAY_PORT}", "--bootstrap", addr,
                                         "--rate", "1", "--groups", "1", prefix=home.cmd()))
            started, got = time.monotonic(), {}
            while time.monotonic() - started < window and len(got) < len(homes):
                got.update({h.name: time.monotonic() - started for h in homes
                            if h.name not in got and h.stats().get("relays", 0) > 0})
                time.sleep(0.5)
        finally:
            procs.stop()
    return {"attack": "relay-squat", "hostile": hostile, "relay_slots": slots, "window_s": window, "pose_nat": pose_nat,
            "computable": computable, "relay_flags": list(relay_flags),
            "strangers_granted": sum(granted), "homes_with_slot": len(got), "seconds_to_slot": got,
            **procs.outcome(["relay", "home0", "home1"])}


def run_relay_abuse(hostile: int, window: float, seed: int, code: Path, cache: Path, work: Path, rule: str,
                    relay_flags: list[str] = ()) -> dict:
    """A training node serves as the relay for a peer behind NAT (which publishes a group a second: slots go to
    participants); for the middle window `hostile` strangers on one address send it random bytes through that
    relay as fast as they go. Per window: the relay's seconds and CPU seconds per round, and the bytes that
    arrived."""
    procs = Procs(work, code)
    with netlab.Lab(work / "lab") as lab:
        try:
            addr = relay_node(procs, lab, work / "relay", *relay_flags, train=(seed, cache, rule))
            home = lab.add_host(nat=True)
            sink = procs.probe("sink", "--listen", f"/ip4/{home.ip}/tcp/{RELAY_PORT}", "--bootstrap", addr, "--sink",
                               "--rate", "1", "--groups", "1", cwd=ROOT, prefix=home.cmd())
            procs.wait_started([work / "relay"])  # raises if any process ended
            sink.wait_for(lambda: sink.stats().get("relays", 0) > 0, 900, "a relay slot")
            relay_pid, cpu, strangers = procs.procs["relay"].pid, [], lab.add_host()
            phases = procs.three_windows(
                window, hostile, addr, lambda h: ["--listen", f"/ip4/{strangers.ip}/tcp/{RELAY_PORT + 1 + h}",
                                                  "--flood-through", f"{addr}/p2p-circuit/p2p/{sink.peer_id}"],
                prefix=strangers.cmd(), on_mark=lambda: cpu.append(tree_cpu_s(relay_pid)))
        finally:
            procs.stop()
    out = {}
    for (phase, (a, b)), cpu0, cpu1 in zip(phases.items(), cpu, cpu[1:]):
        rs = [r for r in rows(work / "relay") if a <= r["time"] <= b]
        got = [e.get("sink_bytes", 0) for e in sink.events("stats") if a <= e["t"] <= b]
        out[phase] = {"rounds": len(rs), "seconds_per_round": (b - a) / max(1, len(rs)),
                      "cpu_s_per_round": (cpu1 - cpu0) / max(1, len(rs)),
                      "relayed_mib_per_s": (got[-1] - got[0]) / 2**20 / (b - a) if got else 0.0}
    return {"attack": "relay-abuse", "hostile": hostile, "seed": seed, "window_s": window, "relay_flags": list(relay_flags),
            "phases": out,
            # against the windows around it: a tiny-a node's rounds shorten as it learns, so before alone flatters
            "round_time_ratio": out["attack"]["seconds_per_round"] / statistics.mean(
                out[k]["seconds_per_round"] for k in ("before", "after")),
            **procs.outcome(["relay", "sink"], {"relay": work / "relay"})}


def run_dialback_relayed(window: float, code: Path, work: Path, ports: list[int], relay_flags: list[str] = ()) -> dict:
    """A node behind NAT holds a slot on a public relay; a stranger reaches it through that relay and asks it
    to dial back `ports` (the relay listens on the first): the answer names the relay host's open ports
    unless the node refuses to dial over a relay."""
    procs = Procs(work, code)
    with netlab.Lab(work / "lab") as lab:
        try:
            addr = relay_node(procs, lab, work / "relay", *relay_flags)
            home_host = lab.add_host(nat=True)
            home = procs.probe("home", "--listen", f"/ip4/{home_host.ip}/tcp/{RELAY_PORT}", "--bootstrap", addr,
                               "--rate", "1", "--groups", "1", prefix=home_host.cmd())  # a participant: slots need one
            home.wait_for(lambda: home.stats().get("relays", 0) > 0, window, "a relay slot")
            host = lab.add_host()
            stranger = procs.probe("stranger", "--listen", f"/ip4/{host.ip}/tcp/{RELAY_PORT}", "--bootstrap", addr,
                                   "--ask-dialback", f"{addr}/p2p-circuit/p2p/{home.peer_id}", "--ports", *map(str, ports),
                                   cwd=ROOT, prefix=host.cmd())
            reply = stranger.wait_for(lambda: stranger.events("dialback"), 120, "a dial-back answer")[0]["reply"]
        finally:
            procs.stop()
    return {"attack": "dialback-relayed", "ports_asked": ports, "relay_listens_on": RELAY_PORT, "reply": reply,
            "relay_ports_reported_open": reply.get("reached", []),
            **procs.outcome(["relay", "home"])}


FAKE_HOSTS = [f"127.0.0.{k}" for k in range(2, 10)]  # dht-*: where the hostile servers' made-up peers are


def run_dht(flood: bool, window: float, code: Path, work: Path) -> dict:
    """One run of dht-eclipse (`flood` False) or dht-flood; see the module's docstring. The honest servers are
    js-libp2p's (`lab.dht.JsDHTServer`), which like kubo name only DHT servers in their answers: two nodes meet
    through a provider record or not at all (py-libp2p's servers name their clients too)."""
    node = shutil.which("node")
    if node is None:
        raise SystemExit("bench_hostile: --attack dht-* runs js-libp2p DHT servers: install Node.js (and run `npm ci` in "
                         "tests/interop)")
    counter = ConnectionCounter(FAKE_HOSTS)
    profile = P2PConfig(network="local").profile()
    hostile = HostileDHT(3, rendezvous_key(profile.namespace, profile.protocol), counter.addrs,
                         providers=32 if flood else 0)
    procs = Procs(work, code)
    honest: list[JsDHTServer] = []
    try:
        honest.append(JsDHTServer(node, hostile.addrs, work / "js-dht-0.log"))
        honest.append(JsDHTServer(node, [honest[0].addr, *hostile.addrs], work / "js-dht-1.log"))
        boot = [arg for addr in [h.addr for h in honest] + hostile.addrs for arg in ("--dht-bootstrap", addr)]
        start = time.time()
        a = procs.probe("a", "--rate", "1", "--groups", "1", *boot)
        counter.watch.add(a.proc.pid)
        a.wait_for(lambda: a.stats().get("dht_lookups", 0) >= 1, 120, "a's first lookup")
        b = procs.probe("b", "--rate", "1", "--groups", "1", *boot)
        counter.watch.add(b.proc.pid)
        met, lookups = None, {}
        while time.time() < start + window:
            if met is None and any(e["peer"] == a.peer_id for e in b.events("received")):
                met, lookups = time.time() - b.started, {n: p.stats().get("dht_lookups", 0) for n, p in (("a", a), ("b", b))}
            time.sleep(1)
        end = time.time()
        stats = {n: p.stats() for n, p in (("a", a), ("b", b))}
    finally:
        procs.stop()
        for servers in (*honest, hostile, counter):
            servers.close()
    by_node = {n: counter.by_minute(start, end, p.proc.pid) for n, p in (("a", a), ("b", b))}
    return {"attack": "dht-flood" if flood else "dht-eclipse", "window_s": window, "met_s": met,
            "lookups_when_met": lookups, "connections_to_made_up_hosts": counter.count,
            "connections_by_node": {n: sum(m) for n, m in by_node.items()},
            "connections_by_servers": counter.owners.count(None),  # the honest DHT servers dial the fakes too
            "connections_by_minute": by_node, "max_per_minute": max(max(m, default=0) for m in by_node.values()),
            "hostile_asked": hostile.asked,
            "nodes": {n: {k: st.get(k) for k in ("dht_lookups", "dht_providers", "dht_servers_dialed", "dht_servers_failed",
                                                 "dials", "hints_failed", "peers")} for n, st in stats.items()},
            **procs.outcome(["a", "b"])}


def dht_report(runs: list[dict], commit: str, window: float) -> None:
    table = Table(title=f"three hostile DHT servers near the key among five (code {commit}, {window:.0f} s)")
    for col in ("attack", "met after (s)", "lookups then (a / b)", "connections to made-up hosts: a / b / DHT servers",
                "most by a node in a minute", "a by minute", "ERROR lines / lost"):
        table.add_column(col)
    for r in runs:
        met = "never" if r["met_s"] is None else f"{r['met_s']:.1f}"
        table.add_row(r["attack"], met, " / ".join(str(v) for v in r["lookups_when_met"].values()) or "-",
                      " / ".join(str(v) for v in [*r["connections_by_node"].values(), r["connections_by_servers"]]),
                      str(r["max_per_minute"]), " ".join(map(str, r["connections_by_minute"]["a"])),
                      f"{error_lines(r)} / {lost(r)}")
    print_table(Console(), table)


def run_dialback_liar(lie: str, window: float, code: Path, work: Path) -> dict:
    """dialback-liar: in the lab, a public relay, an honest public peer, a liar on a third public host answering every
    dial-back `lie` without dialing, and the node under test, which knows the relay and the liar: behind a NAT that
    lets nothing in when the lie is "reached", public when it is "unreached". Each second of `window`: what the node
    believes and how many relays it holds."""
    procs = Procs(work, code)
    nat = lie == "reached"
    with netlab.Lab(work / "lab") as lab:
        relay_host, honest_host, liar_host, node_host = lab.add_host(), lab.add_host(), lab.add_host(), lab.add_host(nat=nat)
        publish = ["--rate", "1", "--groups", "1"]
        try:
            relay = procs.probe("relay", "--listen", f"/ip4/{relay_host.ip}/tcp/{RELAY_PORT}", *publish, prefix=relay_host.cmd())
            procs.probe("honest", "--listen", f"/ip4/{honest_host.ip}/tcp/{RELAY_PORT}", "--bootstrap", relay.addr,
                        *publish, prefix=honest_host.cmd())
            liar = procs.probe("liar", "--listen", f"/ip4/{liar_host.ip}/tcp/{RELAY_PORT}", "--bootstrap", relay.addr,
                               "--lie-dialback", lie, *publish, cwd=ROOT, prefix=liar_host.cmd())
            liar.ready()
            time.sleep(5)  # the relay and the honest peer settle their own reachability first
            node = procs.probe("node", "--listen", f"/ip4/{node_host.ip}/tcp/{RELAY_PORT}", "--bootstrap", relay.addr,
                               "--bootstrap", liar.addr, *publish, prefix=node_host.cmd())
            start, timeline = node.ready()["t"], []
            while time.time() < start + window:
                time.sleep(1)
                stats = node.stats()
                timeline.append([round(time.time() - start, 1), stats.get("reachability"), stats.get("relays")])
            others = {n: p.stats().get("reachability") for n, p in (("relay", relay),)}
        finally:
            procs.stop()
    verdicts = [(t, r) for t, r, _ in timeline if r not in (None, "unknown")]
    return {"attack": "dialback-liar", "lie": lie, "behind_nat": nat, "window_s": window,
            "first_verdict": verdicts[0][1] if verdicts else None, "first_verdict_s": verdicts[0][0] if verdicts else None,
            "final": timeline[-1][1] if timeline else None, "max_relays": max((r or 0 for _, _, r in timeline), default=0),
            "believed_public_s": sum(1 for _, r, _ in timeline if r == "public"), "relay_reachability": others["relay"],
            "timeline": timeline, **procs.outcome(["relay", "honest", "node"])}


def run_mdns_spoof(window: float, code: Path, work: Path) -> dict:
    """mdns-spoof: on one lab LAN, a spoofer announces made-up peer ids at the addresses two nodes will listen on
    (`lab/mdns_spoof.py`); then the nodes start, a second apart, with no bootstrap peer and no DHT. When each first
    hears the other, within `window`."""
    procs = Procs(work, code)
    with netlab.Lab(work / "lab") as lab:
        a_host, b_host, s_host = lab.add_lan(3)
        addrs = {n: f"/ip4/{h.ip}/tcp/{RELAY_PORT}" for n, h in (("a", a_host), ("b", b_host))}
        base = P2PConfig(network="testnet").rollout_topic_base()
        try:
            procs.start("spoofer", "scripts.bench.lab.mdns_spoof", "--topic-base", base, "--ip", s_host.ip,
                        *[arg for addr in addrs.values() for arg in ("--addr", addr)], cwd=ROOT, prefix=s_host.cmd())
            time.sleep(3)  # announced before the nodes listen
            nodes = {}
            for name, host in (("a", a_host), ("b", b_host)):
                nodes[name] = procs.probe(name, "--listen", addrs[name], "--network", "testnet", "--rate", "1", "--groups",
                                          "1", prefix=host.cmd())
                time.sleep(1)
            start, met = time.time(), {}
            while time.time() < start + window and len(met) < 2:
                for name, other in (("a", "b"), ("b", "a")):
                    if name not in met and any(e["peer"] == nodes[other].peer_id for e in nodes[name].events("received")):
                        met[name] = round(time.time() - start, 1)
                time.sleep(1)
            stats = {n: p.stats() for n, p in nodes.items()}
        finally:
            procs.stop()
    return {"attack": "mdns-spoof", "window_s": window, "heard_after_s": {n: met.get(n) for n in ("a", "b")},
            "nodes": {n: {k: st.get(k) for k in ("mdns_heard", "dials", "hints_failed", "peers")} for n, st in stats.items()},
            **procs.outcome(["a", "b"])}


def mdns_report(runs: list[dict], commit: str, window: float) -> None:
    table = Table(title=f"made-up mDNS records at two nodes' addresses (code {commit}, {window:.0f} s)")
    for col in ("a heard b after (s)", "b heard a after (s)", "hints failed (a / b)", "ERROR lines / lost"):
        table.add_column(col)
    for r in runs:
        table.add_row(*(str(r["heard_after_s"][n] or "never") for n in ("a", "b")),
                      " / ".join(str(r["nodes"][n]["hints_failed"]) for n in ("a", "b")), f"{error_lines(r)} / {lost(r)}")
    print_table(Console(), table)


def dialback_report(runs: list[dict], commit: str, window: float) -> None:
    table = Table(title=f"one dial-back liar among the peers asked (code {commit}, {window:.0f} s)")
    for col in ("the node", "lie", "first verdict (s)", "seconds believed public", "final", "most relays", "ERROR lines / lost"):
        table.add_column(col)
    for r in runs:
        table.add_row("behind NAT" if r["behind_nat"] else "public", r["lie"],
                      f"{r['first_verdict']} ({r['first_verdict_s']})", str(r["believed_public_s"]), str(r["final"]),
                      str(r["max_relays"]), f"{error_lines(r)} / {lost(r)}")
    print_table(Console(), table)


DHT_ATTACKS = ("dht-eclipse", "dht-flood", "dialback-liar", "mdns-spoof")  # discovery
RELAY_ATTACKS = ("relay-squat", "relay-abuse", "dialback-relayed")
SWARM_ATTACKS = ("level-hijack", "level-grind", "level-forward", "px-aim")  # honest swarms of --sizes nodes


def relay_report(runs: list[dict], commit: str, window: float) -> None:
    table = Table(title=f"{runs[0]['attack']} (code {commit}, {window:.0f} s windows)")
    for col in ("strangers", "outcome", "ERROR lines / lost"):
        table.add_column(col)
    for r in runs:
        if r["attack"] == "relay-squat":
            outcome = (f"{r['strangers_granted']} of {r['hostile']} strangers"
                       f"{' (after a dial-back on a closed port)' if r.get('pose_nat') else ''} got a slot of {r['relay_slots']}; "
                       f"{r['homes_with_slot']} of 2 homes behind NAT got one after they left")
        elif r["attack"] == "relay-abuse":
            ph = r["phases"]
            outcome = ("relayed MiB/s " + " / ".join(f"{ph[k]['relayed_mib_per_s']:.2f}" for k in ph) +
                       "; relay s/round " + " / ".join(f"{ph[k]['seconds_per_round']:.2f}" for k in ph) +
                       f" (before / attack / after; attack against the mean of the others: x{r['round_time_ratio']:.2f})")
        else:
            outcome = f"answer {r['reply']}: relay ports reported open {r['relay_ports_reported_open']}"
        table.add_row(str(r.get("hostile", 1)), outcome, f"{error_lines(r)} / {lost(r)}")
    print_table(Console(), table)


def level_hijack_report(runs: list[dict], commit: str, window: float) -> list[dict]:
    table = Table(title=f"subscribe-only strangers at one node (code {commit}, {window:.0f} s windows)")
    for col in ("nodes", "strangers", "seed", "deepest level before / attack / after",
                "external used / round before / attack / after", "ERROR lines / lost"):
        table.add_column(col)
    for r in runs:
        ph = r["phases"]
        table.add_row(str(r["size"]), str(r["hostile"]), str(r["seed"]),
                      " / ".join(str(ph[k]["deepest_level"]) for k in ("before", "attack", "after")),
                      " / ".join(f"{ph[k]['external_used_per_round']:.2f}" for k in ("before", "attack", "after")),
                      f"{error_lines(r)} / {lost(r)}")
    print_table(Console(), table)
    return [{"size": r["size"], "hostile": r["hostile"], "seed": r["seed"],
             **{f"deepest_level_{k}": r["phases"][k]["deepest_level"] for k in ("before", "attack", "after")},
             **{f"external_used_{k}": r["phases"][k]["external_used_per_round"] for k in ("before", "attack", "after")},
             "error_lines": error_lines(r), "lost": lost(r)} for r in runs]


def px_aim_report(runs: list[dict], commit: str, window: float) -> list[dict]:
    table = Table(title=f"peer-exchange answers aimed at one host (code {commit}, {window:.0f} s windows)")
    for col in ("nodes", "strangers", "dials / node / min before / attack / after",
                "connection attempts at the hinted host before / attack / after", "after, by minute", "ERROR lines / lost"):
        table.add_column(col)
    for r in runs:
        ph = r["phases"]
        table.add_row(str(r["size"]), str(r["hostile"]), " / ".join(f"{ph[k]['dials_per_node_per_min']:.1f}" for k in ph),
                      " / ".join(str(ph[k]["attempts_at_hinted_host"]) for k in ph),
                      " ".join(map(str, r["attempts_at_hinted_host_by_minute_after"])), f"{error_lines(r)} / {lost(r)}")
    print_table(Console(), table)
    return [{"size": r["size"], "hostile": r["hostile"], "after_s": r["after_s"],
             **{f"dials_per_node_per_min_{k}": r["phases"][k]["dials_per_node_per_min"] for k in r["phases"]},
             **{f"attempts_at_hinted_host_{k}": r["phases"][k]["attempts_at_hinted_host"] for k in r["phases"]},
             "attempts_by_minute_after": r["attempts_at_hinted_host_by_minute_after"],
             "error_lines": error_lines(r), "lost": lost(r)} for r in runs]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = script_parser(__doc__)
    p.add_argument("--attack", choices=("flood", *SWARM_ATTACKS, *RELAY_ATTACKS, *DHT_ATTACKS), default="flood",
                   help="flood: useless or hostile groups into the pool; level-hijack: subscribe-only strangers; level-grind: "
                   "strangers ground into a node's level-8 shard publishing there; "
                   "px-aim: peer-exchange answers aiming dials at one host; relay-squat: strangers taking relay "
                   "slots; relay-abuse: strangers pushing bytes through a training node's relay; dialback-relayed: "
                   "a dial-back asked through a relay (these four in a network lab of namespaces: root); dht-eclipse, "
                   "dht-flood: three hostile DHT servers near the rendezvous key; level-forward: one stranger forwarding "
                   "12 ground ids' messages; dialback-liar: a peer lying to dial-back requests (lab); mdns-spoof: made-up "
                   "mDNS records at two nodes' addresses (lab)")
    p.add_argument("--slots", type=count, default=4, help="relay-squat: the relay's p2p.relay_slots")
    p.add_argument("--pose-nat", action="store_true", help="relay-squat: each stranger first asks for a dial-back on "
                   "a closed port, passing for a peer behind NAT")
    p.add_argument("--computable", action="store_true", help="level-grind: the strangers publish groups of bare right "
                   "and wrong answers, which anyone can compute and a node's selection finds useful; relay-squat: they "
                   f"publish such groups for {COMPUTABLE_S} s before asking")
    p.add_argument("--relay-after", type=bounded(float, ge=0), help="relay-squat, relay-abuse, dialback-relayed: the "
                   "relay's p2p.relay_after_s, how long a home takes part before its slot (the checkout under test must "
                   "know it; default: its own default, 600 s, longer than a window)")
    p.add_argument("--lab", action="store_true", help="level-hijack, level-grind: each honest node on a lab host of its "
                   "own and the strangers on one more (root), not all on 127.0.0.1")
    p.add_argument("--after", type=positive, help="px-aim: seconds counted after the liars leave (default: --window)")
    p.add_argument("--sizes", type=bounded(int, ge=3), nargs="+", default=[3, 9], help="level-hijack, px-aim: honest nodes")
    p.add_argument("--hostile", type=bounded(int, ge=0), nargs="+", default=[0, 1, 6], help="hostile identities per arm (0: baseline)")
    p.add_argument("--window", type=positive, default=60.0, help="seconds measured per run, after the warm-up")
    p.add_argument("--seeds", type=count, default=2)
    p.add_argument("--flood", choices=("junk", "answers", "masked", "wrapped", "length"), default="junk",
                   help="what the hostile probes send: text without answers, different wrong answers, right answers "
                        "behind text no node writes (masked), or behind --wrap (wrapped), or padded to 2,000 characters "
                        "with plausible working (length)")
    p.add_argument("--wrap", default="z", help="--flood wrapped: the text before each right answer")
    p.add_argument("--rule", choices=RULES, default="guarded", help="the nodes' selection.rule")
    p.add_argument("--topology", choices=("one-hop", "direct"), default="one-hop",
                   help="one-hop: the flood reaches the neighbour only through the target; direct: on its own links too")
    p.add_argument("--code", type=Path, default=ROOT, help="checkout whose nodes and probes run")
    p.add_argument("--cache", type=Path, default=default_cache_dir(), help="model cache (tiny-a is built there)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if (args.attack in (*RELAY_ATTACKS, "px-aim", "dialback-liar", "mdns-spoof") or args.lab) and (why := netlab.unavailable()):
        p.error(f"--attack {args.attack} needs the network lab: {why}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_stop_signals()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.code, capture_output=True,
                            text=True).stdout.strip()
    attacks = relay_attacks if args.attack in RELAY_ATTACKS else swarm_attacks if args.attack in SWARM_ATTACKS else \
        dht_attacks if args.attack in DHT_ATTACKS else floods
    return save(args, {"command": shlex.join(sys.argv), "code": commit, "attack": args.attack,
                       **attacks(args, commit)})


def each_run(args: argparse.Namespace, one, *axes: list) -> list[dict]:
    """`one(work, *point)` for every point of the grid `axes` (seeds first), each in a fresh work folder; each
    run's JSON is printed as it ends, so a long grid shows its progress."""
    runs = []
    for point in itertools.product(*axes):
        with tempfile.TemporaryDirectory(prefix="sapo-hostile-") as work:
            runs.append(one(Path(work), *point))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "target_p2p"}), flush=True)
    return runs


def relay_attacks(args: argparse.Namespace, commit: str) -> dict:
    def one(work: Path, seed: int, h: int) -> dict:
        relay_flags = [] if args.relay_after is None else ["--p2p.relay_after_s", str(args.relay_after)]
        if args.attack == "relay-squat":
            return run_relay_squat(h, args.slots, args.window, args.code, work, args.pose_nat, args.computable, relay_flags)
        if args.attack == "relay-abuse":
            return run_relay_abuse(h, args.window, seed, args.code, args.cache, work, args.rule, relay_flags)
        return run_dialback_relayed(args.window, args.code, work, [RELAY_PORT, 22, 80, 443], relay_flags)
    runs = each_run(args, one, range(args.seeds), args.hostile)
    relay_report(runs, commit, args.window)
    return {"runs": runs}


def dht_attacks(args: argparse.Namespace, commit: str) -> dict:
    if args.attack == "mdns-spoof":
        runs = each_run(args, lambda work, seed: run_mdns_spoof(args.window, args.code, work), range(args.seeds))
        mdns_report(runs, commit, args.window)
        return {"runs": runs}
    if args.attack == "dialback-liar":
        runs = each_run(args, lambda work, seed, lie: run_dialback_liar(lie, args.window, args.code, work),
                        range(args.seeds), ["reached", "unreached"])
        dialback_report(runs, commit, args.window)
        return {"runs": runs}
    runs = each_run(args, lambda work, seed: run_dht(args.attack == "dht-flood", args.window, args.code, work),
                    range(args.seeds))
    dht_report(runs, commit, args.window)
    return {"runs": runs}


def swarm_attacks(args: argparse.Namespace, commit: str) -> dict:
    def one(work: Path, seed: int, size: int, h: int) -> dict:
        if args.attack in ("level-hijack", "level-grind", "level-forward"):
            return run_level_hijack(size, h, args.window, seed, args.code, args.cache, work, args.rule,
                                    grind=args.attack == "level-grind", computable=args.computable, in_lab=args.lab,
                                    forward=args.attack == "level-forward")
        return run_px_aim(size, h, args.window, args.code, work, args.after or args.window)
    runs = each_run(args, one, range(args.seeds), args.sizes, args.hostile)
    summary = (px_aim_report if args.attack == "px-aim" else level_hijack_report)(runs, commit, args.window)
    return {"rule": args.rule, "summary": summary, "runs": runs}


def floods(args: argparse.Namespace, commit: str) -> dict:
    wrap = args.wrap if args.flood == "wrapped" else WRAPS.get(args.flood)
    runs = each_run(args, lambda work, seed, h: run_flood(h, args.window, seed, args.code, args.cache, work, args.flood,
                                                          args.topology, args.rule, wrap),
                    range(args.seeds), args.hostile)
    base = [r for r in runs if r["hostile"] == 0]
    summary = [flood_row(h, [r for r in runs if r["hostile"] == h], base) for h in args.hostile]
    flood_report(summary, args, commit)
    return {"flood": args.flood, "rule": args.rule, "topology": args.topology, "summary": summary, "runs": runs}


def flood_row(h: int, arm: list[dict], base: list[dict]) -> dict:
    """One arm of a flood (H hostile identities, every seed): means, and shares of the arm without a flood."""
    row = {"hostile": h, **{k: statistics.mean(r[k] for r in arm) for k in (
        "honest_used_per_round", "honest_supply_per_round", "external_used_per_round", "inspected_per_round", "target_rounds_per_s",
        "neighbour_rounds_per_s", "target_cpu_s_per_round", "neighbour_cpu_s_per_round")},
           "neighbour_accepted": statistics.mean(r["neighbour_accepted"] or 0 for r in arm),
           "error_lines": sum(error_lines(r) for r in arm), "lost": sum(lost(r) for r in arm)}
    if arm[0]["writes_wrap_of_50"] is not None:  # the most of any node and family, in any seed
        row["writes_wrap_max"] = max(n for r in arm for node in r["writes_wrap_of_50"].values() for n in node.values())
    if arm[0].get("sample_chars_after") is not None:  # the longest of any node's families, in any seed
        row["sample_chars_max"] = max(c for r in arm for node in r["sample_chars_after"].values() for c in node.values())
        row["target_train_s_per_round"] = statistics.mean(r["target_train_s_per_round"] or 0 for r in arm)
    if base:
        row["share_of_no_flood"] = row["honest_used_per_round"] / statistics.mean(r["honest_used_per_round"] for r in base)
        row["neighbour_cpu_ratio"] = row["neighbour_cpu_s_per_round"] / statistics.mean(
            r["neighbour_cpu_s_per_round"] for r in base)
    return row


def flood_report(summary: list[dict], args: argparse.Namespace, commit: str) -> None:
    table = Table(title=f"free identities flooding ({args.flood}, {args.topology}; rule {args.rule}, code {commit}, "
                        f"{args.window:.0f} s windows, {args.seeds} seeds)")
    for col in ("hostile", "honest used / round", "share of 0", "honest offered / round", "all used / round", "inspected / round",
                "target CPU s / round", "neighbour CPU s / round", "neighbour rounds/s", "neighbour msgs accepted",
                f"writes wrap (of {SAMPLES})", "ERROR lines / lost"):
        table.add_column(col)
    for row in summary:
        table.add_row(str(row["hostile"]), f"{row['honest_used_per_round']:.2f}", f"{row.get('share_of_no_flood', float('nan')):.0%}",
                      f"{row['honest_supply_per_round']:.2f}", f"{row['external_used_per_round']:.2f}",
                      f"{row['inspected_per_round']:.1f}",
                      f"{row['target_cpu_s_per_round']:.2f}", f"{row['neighbour_cpu_s_per_round']:.2f}",
                      f"{row['neighbour_rounds_per_s']:.2f}", f"{row['neighbour_accepted']:.0f}",
                      str(row.get("writes_wrap_max", "-")), f"{row['error_lines']} / {row['lost']}")
        if "sample_chars_max" in row:
            table.add_row("", f"length: train s / round {row['target_train_s_per_round']:.2f}, longest sample mean after "
                          f"{row['sample_chars_max']:.0f} chars", *[""] * 10)
    print_table(Console(), table)


def save(args: argparse.Namespace, result: dict) -> int:
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**result, "machine": platform.machine(), "cpus": os.cpu_count()}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
