"""`sapo swarm`: a local swarm of node processes on 127.0.0.1, watched live, summarised at the end.

The launcher owns its children from start to stop: the bootstrap node first (its address is known
before it starts, from its key and a reserved port), the others pointed at it. Ctrl-C, SIGTERM or
the end of the run stops every child with SIGTERM (each checkpoints and exits), then SIGKILL after
a grace period. Per-node metrics stay in each node's folder; `summary.json` and `summary.png` sum
them up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from node.figure import plot
from node.metrics import MetricsLog
from node.preflight import check_out_dir, out_dir_locked
from node.progress import print_table
from p2p.identity import IdentityError, load_or_create, peer_id
from rewards.config import TasksConfig

log = logging.getLogger(__name__)

STOP_GRACE_S = 60.0
PLAIN_EVERY_S = 15.0  # progress line period when the output is not a terminal
EVAL_SEED = TasksConfig.model_fields["eval_seed"].default  # the held-out set's seed, no node's run.seed
COMPANION_ROUNDS = 10**6  # "until the others finish": the runner stops a companion long before


class SwarmError(RuntimeError):
    """The swarm could not start; the message carries the failing node's own last words."""


@dataclass
class SwarmSpec:
    nodes: int
    rounds: int
    local: int
    external: int
    presets: list[str]
    out: Path
    seed: int = 0
    extra: list[str] = field(default_factory=list)  # passed to every `sapo run`
    task_mixes: list[str] = field(default_factory=list)  # `--tasks` values given to the nodes in turn
    # given in turn: a companion runs until every other node has finished, then is stopped (with its checkpoint), so a
    # fast model beside a slow one shares for as long as the slow one trains, as it would with no common clock
    companions: list[bool] = field(default_factory=list)
    # given in turn: node k runs `rounds` times its multiple, so that a model that rounds twice as fast beside a slow
    # one does twice the rounds and both share for the whole run; its silo runs as many
    round_multiples: list[int] = field(default_factory=list)
    network: bool = True  # False: N unconnected silos (no p2p at all), for baselines
    baseline: bool = False  # also run each node alone (I + J local groups, no network) beside the swarm
    memory_gb: float | None = None  # each node's share of the machine's memory (`share_memory` sets it)

    def silo(self) -> "SwarmSpec":
        """The same nodes alone: same models, seeds, task mixes and rounds, all I + J groups local."""
        return SwarmSpec(nodes=self.nodes, rounds=self.rounds, local=self.local + self.external, external=0,
                         presets=self.presets, out=self.out / "silo", seed=self.seed, extra=self.extra,
                         task_mixes=self.task_mixes, companions=self.companions,
                         round_multiples=self.round_multiples, network=False, memory_gb=self.memory_gb)

    def arms(self) -> list["SwarmSpec"]:
        """Every group of processes the run starts: the swarm, and its silo with `baseline`."""
        return [self, self.silo()] if self.baseline else [self]

    def processes(self) -> int:
        """How many nodes share the machine: every arm's."""
        return sum(arm.nodes for arm in self.arms())

    def preset(self, k: int) -> str:
        return self.presets[k % len(self.presets)]

    def node_args(self, k: int) -> list[str]:
        """What differs between nodes besides their ports: model, seed, rounds and task mix."""
        mix = ["--tasks", self.task_mixes[k % len(self.task_mixes)]] if self.task_mixes else []
        return ["--model", self.preset(k), "--seed", str(self.node_seed(k)), "--rounds", str(self.node_rounds(k)), *mix]

    def node_seed(self, k: int) -> int:
        """Node k's run.seed: the swarm's seed plus k, stepping over the held-out set's (a node refuses to train on it)."""
        seed = self.seed + k
        return seed + 1 if self.seed <= EVAL_SEED <= seed else seed

    def companion(self, k: int) -> bool:
        return bool(self.companions) and self.companions[k % len(self.companions)]

    def node_rounds(self, k: int) -> int:
        if self.companion(k):
            return COMPANION_ROUNDS
        return self.rounds * (self.round_multiples[k % len(self.round_multiples)] if self.round_multiples else 1)

    def run_flags(self, k: int, processes: int, cache_dir: Path | None) -> list[str]:
        """Node k's `sapo run` flags but its folder, ports and bootstrap peer; the user's own flags come last
        and win. `processes`: how many nodes share the machine's cores."""
        flags = [*self.node_args(k), "--local", str(self.local), "--external", str(self.external),
                 "--p2p.enabled", str(self.network).lower(), "--run.wait_for_peers", str(self.nodes - 1),
                 # one machine, N nodes: without a share each, torch's thread pools spin against each other
                 "--run.torch_threads", str(max(1, (os.cpu_count() or 1) // processes))]
        if self.memory_gb:
            flags += ["--run.memory_gb", f"{self.memory_gb:g}"]
        if cache_dir is not None:
            flags += ["--model.cache_dir", str(cache_dir)]
        return [*flags, *self.extra]


@dataclass
class Child:
    name: str
    preset: str
    out: Path
    proc: subprocess.Popen
    dashboard: str
    rounds: int  # what it runs (a companion: until the runner stops it)
    companion: bool = False
    rows: list[dict] = field(default_factory=list)
    _read: int = 0
    _file: tuple[int, int] | None = None  # (device, inode) of the metrics file read so far

    def refresh(self) -> None:
        """Read the metrics lines written since the last call (a torn last line waits for the next).
        A resumed node rewinds its metrics by replacing the file, and a long run rotates it into archives: then the
        archives are read and the file again from the start."""
        path = self.out / "metrics.jsonl"
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != self._file or st.st_size < self._read:
                    self._file, self._read = (st.st_dev, st.st_ino), 0
                    self.rows = list(MetricsLog(path).archived_rows())
                f.seek(self._read)
                chunk = f.read()
        except FileNotFoundError:
            return
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._read += len(complete)
        for line in complete.splitlines():
            try:
                self.rows.append(json.loads(line))
            except json.JSONDecodeError:  # torn by a crash mid-write; the node sets it aside when it resumes
                pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.2)
    return False


def share_memory(spec: SwarmSpec, cache_dir: Path | None) -> SwarmSpec:
    """`spec` with each node's share of the machine's memory, every node of every arm planned in its share
    before any starts (the plans are logged, with what they add up to); `SwarmError` when they cannot fit."""
    from node.flags import config_from_flags
    from node.planner import fit_together
    from trainer.memory import MemoryPlanError
    from trainer.policy import ModelLoadError

    nodes = {f"{prefix}{k} ({arm.preset(k)})": config_from_flags(arm.run_flags(k, spec.processes(), cache_dir))
             for arm, prefix in zip(spec.arms(), ("node", "silo")) for k in range(arm.nodes)}
    try:
        shared = fit_together(nodes)
    except MemoryPlanError as e:
        raise SwarmError(str(e)) from None
    except ModelLoadError as e:
        raise SwarmError(f"model.name: {e}") from None
    for line in shared.lines():
        log.info("%s", line)
    return replace(spec, memory_gb=shared.share_gb)


def start(spec: SwarmSpec, cache_dir: Path | None, processes: int, prefix: str = "node") -> list[Child]:
    """Start the swarm's nodes, the bootstrap node first; `processes` is how many share the machine."""
    spec.out.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    bootstrap = ""
    log.info("starting %s: %s%s", f"{prefix}0..{prefix}{spec.nodes - 1}" if spec.nodes > 1 else f"{prefix}0",
             ", ".join(spec.preset(k) for k in range(spec.nodes)),
             f"; {prefix}0 is the bootstrap peer, the others start once it listens" if spec.network and spec.nodes > 1 else "")
    for k in range(spec.nodes):
        out = spec.out / f"node{k}"
        out.mkdir(parents=True, exist_ok=True)
        port, status_port = free_port(), free_port()
        if k == 0 and spec.network:  # read (or made) before node0 starts, so that its key has one creator
            try:
                bootstrap = f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id(load_or_create(out / 'node.key'))}"
            except IdentityError as e:
                raise SwarmError(f"{prefix}0: {e}") from None
        args = [sys.executable, "-m", "node.cli", "run", "--out", str(out),
                "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--status.listen", f"127.0.0.1:{status_port}",
                *(["--bootstrap", bootstrap] if k and bootstrap else []), *spec.run_flags(k, processes, cache_dir)]
        with open(out / "node.log", "ab") as logf:
            proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        children.append(Child(f"{prefix}{k}", spec.preset(k), out, proc, f"http://127.0.0.1:{status_port}/",
                              spec.node_rounds(k), spec.companion(k)))
        if k == 0 and spec.network:
            if not wait_listening(port, proc, timeout=300):
                stop(children)
                if proc.returncode == 0:  # it resumed from a checkpoint of its last round: nothing left to run
                    raise SwarmError(f"{spec.out} holds a swarm that has run its {spec.node_rounds(0)} rounds ({prefix}0 "
                                     "resumed from its last checkpoint and stopped): raise --rounds to go on, or pass "
                                     "another --out")
                raise SwarmError(f"the bootstrap node did not start ({last_line(out)}); see {out / 'node.log'}")
    return children


def last_line(out: Path) -> str:
    """The last thing a node wrote to its log, on one line."""
    path = out / "node.log"
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " ".join(lines[-1].split()) if lines else "no output"


def stop(children: list[Child], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to every child still running (each checkpoints), SIGKILL to any left after `grace`."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s; killing it", c.name, grace)
            c.proc.kill()
            c.proc.wait()


def _last(rows: list[dict], key: str):
    return next((r[key] for r in reversed(rows) if r.get(key) is not None), None)


def total(rows: list[dict], key: str) -> int:
    return sum(r.get(key) or 0 for r in rows)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _state(c: Child) -> str:
    if c.proc.poll() is not None:
        return f"exit {c.proc.returncode}"
    return "running" if c.rows else "starting"


def table(children: list[Child]) -> Table:
    """One row per node. Short headers, spelt out in the caption, and the dashboards under the table: at 80
    columns every cell still reads whole."""
    dashboards = "; ".join(f"{c.name} {c.dashboard}" for c in children)
    t = Table(title="sapo swarm", box=None, padding=(0, 1), pad_edge=False, collapse_padding=True, show_edge=False,
              header_style="bold underline",
              caption=f"out: messages published, in: groups received, ext: external groups used/inspected, local: "
                      f"share of local groups with signal. Dashboards: {dashboards}. Ctrl-C stops every node with a "
                      "checkpoint", caption_justify="left")
    for col in ("node", "model", "round", "reward", "eval", "peers", "out", "in", "ext", "local", "state"):
        t.add_column(col, justify="left" if col in ("node", "model", "state") else "right", no_wrap=True)
    for c in children:
        rows = c.rows
        p2p = _last(rows, "p2p") or {}
        t.add_row(c.name, c.preset, f"{rows[-1]['round'] if rows else 0}/{'-' if c.companion else c.rounds}", _fmt(_last(rows, "reward_mean")),
                  _fmt(_last(rows, "eval_accuracy")), str(_last(rows, "peers") or 0), str(p2p.get("published", 0)),
                  str(total(rows, "n_external_received")),
                  f"{total(rows, 'n_external_used')}/{total(rows, 'external_inspected')}",
                  f"{total(rows, 'local_informative') / max(total(rows, 'n_local'), 1):.0%}", _state(c))
    return t


def node_summary(c: Child) -> dict:
    c.refresh()
    trained = [r for r in c.rows if r["round"] > 0]
    evals = [(r["round"], r["eval_accuracy"]) for r in c.rows if r.get("eval_accuracy") is not None]
    cumulative = sum(r["reward_mean"] for r in trained)
    return {
        "name": c.name, "model": c.preset, "companion": c.companion, "exit_code": c.proc.returncode, "rounds": len(trained),
        "failure": failure(c),
        "cumulative_reward": cumulative, "mean_reward": cumulative / len(trained) if trained else None,
        "eval_first": evals[0][1] if evals else None, "eval_last": evals[-1][1] if evals else None,
        **{name: total(trained, key) for name, key in (
            ("external_used", "n_external_used"), ("external_in_batch", "n_external"),
            ("external_inspected", "external_inspected"), ("external_informative", "external_informative"),
            ("local_groups", "n_local"), ("local_informative", "local_informative"),
            ("tokens_generated", "tokens_generated"))},
        "seconds": sum(r["seconds_generate"] + r["seconds_train"] + r["seconds_other"] for r in trained),
        "memory_peak_gb": max((r["memory_peak_gb"] for r in trained if r.get("memory_peak_gb")), default=None),
    }


def failure(c: Child) -> str | None:
    """Why a node's run cannot count, or None: it exited non-zero, was killed, or ended short of its rounds
    (a companion has no rounds of its own: the runner stops it)."""
    code, reached = c.proc.returncode, max((r["round"] for r in c.rows), default=0)
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in {s.value for s in signal.Signals} else f"signal {-code}"
        how = f"killed by {name}" + (" (as the kernel's out-of-memory killer does)" if code == -signal.SIGKILL else "")
    elif code:
        how = f"exit {code}"
    elif not c.companion and reached < c.rounds:
        how = f"ended at round {reached} of {c.rounds}"
    else:
        return None
    return f"{c.name} ({c.preset}) {how}; its last log line: {last_line(c.out)}"


def summarize(spec: SwarmSpec, children: list[Child], silos: list[Child] = (), stopped: bool = False) -> dict:
    """summary.json, and the figure when the run is whole: a run that was stopped, or lost a node, compares
    nothing."""
    nodes = [node_summary(c) for c in children]
    alone = [node_summary(c) for c in silos]
    failed = [n["failure"] for n in nodes + alone if n["failure"]]
    summary = {"nodes": spec.nodes, "rounds": spec.rounds, "local": spec.local, "external": spec.external,
               "presets": spec.presets, "seed": spec.seed, "memory_gb": spec.memory_gb,
               "complete": not failed and not stopped, "stopped": stopped, "failed": failed, "per_node": nodes,
               "cumulative_reward_mean": sum(n["cumulative_reward"] for n in nodes) / max(1, len(nodes))}
    if silos:
        summary["baseline"] = {"local": spec.local + spec.external, "per_node": alone,
                               "cumulative_reward_mean": sum(n["cumulative_reward"] for n in alone) / len(alone)}
        if summary["complete"]:
            summary["vs_baseline"] = summary["cumulative_reward_mean"] / max(1e-9, summary["baseline"]["cumulative_reward_mean"]) - 1
    (spec.out / "summary.json").write_text(json.dumps(summary, indent=2))
    figure = spec.out / "summary.png"
    if not summary["complete"]:
        figure.unlink(missing_ok=True)  # an earlier run's figure would stand for this one
    else:
        plot({"swarm": children, "alone": silos}, figure, f"{spec.nodes} nodes, I={spec.local} local + J={spec.external} external"
             + (f" (alone: each node by itself, {spec.local + spec.external} local)" if silos else ""))
    return summary


def progress_lines(children: list[Child], elapsed: float) -> list[str]:
    """One plain line per node, for output that is not a terminal (CI logs, `| tee`)."""
    lines = []
    for c in children:
        rows = c.rows
        lines.append(f"[{elapsed:5.0f} s] {c.name} ({c.preset}) round {rows[-1]['round'] if rows else 0}/"
                     f"{'-' if c.companion else c.rounds}, reward {_fmt(_last(rows, 'reward_mean'))}, "
                     f"eval {_fmt(_last(rows, 'eval_accuracy'))}, peers {_last(rows, 'peers') or 0}, "
                     f"external used {total(rows, 'n_external_used')}, {_state(c)}")
    return lines


def watch(children: list[Child], console: Console, live: bool, stopping) -> None:
    """Show the swarm until every node (companions aside) is done or `stopping()`, then stop it: a live
    table on a terminal; elsewhere a progress line per node every `PLAIN_EVERY_S` and the final table at
    full width (a pipe gets no live updates, and rich would squeeze the table to 80 columns)."""
    started, shown = time.monotonic(), 0.0
    view = Live(table(children), console=console, refresh_per_second=2, transient=not live) \
        if console.is_terminal else contextlib.nullcontext()
    with view:
        while not stopping() and any(c.proc.poll() is None for c in children if not c.companion):
            for c in children:
                c.refresh()
            if console.is_terminal:
                view.update(table(children))
            elif time.monotonic() - shown >= PLAIN_EVERY_S:
                shown = time.monotonic()
                print("\n".join(progress_lines(children, shown - started)), file=console.file, flush=True)
            time.sleep(0.5)
        if stopping():
            console.print("stopping every node (each writes a checkpoint)...")
        stop(children)
        for c in children:
            c.refresh()
        if console.is_terminal:
            view.update(table(children))
    if not console.is_terminal and live:
        print_table(console, table(children))


def run(spec: SwarmSpec, cache_dir: Path | None = None, console: Console | None = None, live: bool = True) -> dict:
    """Plan every node's memory, start the swarm, show it until every node is done or a stop signal arrives,
    then summarise. `SwarmError` when it cannot start."""
    console = console or Console(stderr=True)
    stopping = False

    def request_stop(signum, frame) -> None:
        nonlocal stopping
        if stopping:
            raise KeyboardInterrupt
        stopping = True

    spec = share_memory(spec, cache_dir)
    check_out_dir(spec.out, "--out")
    with out_dir_locked(spec.out, setting="--out"):  # a second swarm here would resume our nodes' runs as its own
        previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        nodes: list[Child] = []
        silos: list[Child] = []
        children = nodes  # everything to show and stop
        try:
            children = nodes = start(spec, cache_dir, spec.processes())
            if spec.baseline:
                silos = start(spec.silo(), cache_dir, spec.processes(), prefix="silo")
                children = nodes + silos
            watch(children, console, live, lambda: stopping)
        finally:
            stop(children)
            for s, handler in previous.items():
                signal.signal(s, handler)
        return summarize(spec, nodes, silos, stopping)
