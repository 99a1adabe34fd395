"""The node's HTTP status endpoint: `/metrics` (Prometheus text), `/status` (JSON), `/` (live dashboard).

The round loop writes into a `StatusBoard`; the server thread only reads snapshots of it, so a slow
or hostile client can never stall training. The exposition is prometheus_client's (its escaping, its
counter conventions, and the process's own RSS, CPU time and open files).
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, Field, field_validator

from node.selection_config import DROP_REASONS as SELECTION_DROPS
from node.supervise import describe
from p2p.pool import DROP_REASONS as POOL_DROPS
from p2p.wire import REASONS as WIRE_REASONS
from trainer.memory import GB

log = logging.getLogger(__name__)

# Per-round fields the dashboard charts and /status returns in `history`.
HISTORY_FIELDS = ("round", "time", "reward_mean", "accuracy_train", "eval_accuracy", "peers", "n_local", "n_external",
                  "n_external_used", "n_external_received", "groups_published", "weight_version",
                  "local_informative", "external_inspected", "external_informative",
                  "seconds_generate", "seconds_train", "seconds_other", "memory_peak_gb", "micro_batch", "lr_next", "step_kl")
PHASES = ("generate", "train", "other")


class StatusConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    enabled: bool = Field(True, description="serve /metrics, /status and the dashboard over HTTP")
    listen: str = Field("127.0.0.1:8080", description="HOST:PORT of the status endpoint (busy: the next free port of the 20 after it; port 0 picks any free one; "
                        "0.0.0.0 exposes it to the network: it has no authentication)")
    history: int = Field(5000, ge=10, description="rounds kept in memory for /status and the dashboard's charts")
    stall_after_s: float = Field(900.0, gt=0, description="a running node that has completed no round for this long "
                                 "is reported stalled and not healthy (/status, /metrics, the container health check)")

    @field_validator("listen")
    @classmethod
    def _host_port(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError("expected HOST:PORT, e.g. 127.0.0.1:8080")
        return v

    def address(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


class StatusBoard:
    """What the node last reported, plus running totals; written by the node, read by the server."""

    def __init__(self, role: str, info: dict[str, Any], history: int, live: Callable[[], dict] | None = None,
                 stall_after_s: float = 900.0):
        self._lock = threading.Lock()
        self._stall_after_s = stall_after_s
        self._progress = time.monotonic()  # last round recorded or state change
        self._info = {"role": role, **info, "started": time.time()}
        self._history: deque[dict] = deque(maxlen=history)
        self._last: dict | None = None
        self._last_eval: float | None = None
        self._totals: Counter[str] = Counter()
        self._state = "starting"
        self._live = live or (lambda: {})  # current gossip/pool counters; read at request time

    def set_live(self, live: Callable[[], dict] | None) -> None:
        self._live = live or (lambda: {})

    def update_info(self, **info: Any) -> None:
        with self._lock:
            self._info.update(info)

    def set_state(self, state: str, detail: str | None = None) -> None:
        with self._lock:
            self._state = state if detail is None else f"{state}: {detail}"
            self._progress = time.monotonic()

    def record(self, row: dict) -> None:
        with self._lock:
            self._progress = time.monotonic()
            self._last = row
            self._history.append({k: row.get(k) for k in HISTORY_FIELDS})
            if row.get("eval_accuracy") is not None:
                self._last_eval = row["eval_accuracy"]
            for phase in PHASES:
                self._totals[f"seconds_{phase}"] += row.get(f"seconds_{phase}") or 0.0
            for key in ("tokens_generated", "n_external_used", "n_local", "n_external", "groups_published",
                        "local_informative", "external_inspected", "external_informative", "external_gated",
                        "external_shaped"):
                self._totals[key] += row.get(key) or 0
            for reason, n in (row.get("external_dropped") or {}).items():
                self._totals[f"external_dropped:{reason}"] += n

    def snapshot(self) -> dict:
        live = self._live()
        with self._lock:
            state, idle = self._state, time.monotonic() - self._progress
            stalled = state == "running" and idle > self._stall_after_s
            if stalled:  # a hang anywhere in the round (a stuck GPU call, a runaway task) shows here
                state = f"stalled: no round completed for {idle:.0f} s"
            return {**self._info, "state": state, "healthy": not (stalled or state.startswith("failed")),
                    "now": time.time(), "last": self._last,
                    "last_eval_accuracy": self._last_eval, "totals": dict(self._totals), "p2p": live,
                    "history": list(self._history)}


class _Families:
    """A prometheus_client collector over one snapshot's metric families."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def prometheus(s: dict) -> str:
    """The snapshot in Prometheus text exposition format (0.0.4), with this process's own metrics."""
    registry = CollectorRegistry()
    registry.register(_Families(families(s)))
    ProcessCollector(registry=registry)
    return generate_latest(registry).decode()


def families(s: dict) -> list[Metric]:
    """One metric family per figure of the snapshot; a figure the node does not have yet is left out."""
    found: list[Metric] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float | None]]) -> None:
        samples = [(labels, v) for labels, v in samples if v is not None]
        if not samples:
            return
        family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
            f"sapo_{name}", help_, labels=list(samples[0][0]))
        for labels, v in samples:
            family.add_metric(list(labels.values()), float(v))
        found.append(family)

    last, totals, p2p = s["last"] or {}, s["totals"], s["p2p"] or {}
    pool = p2p.get("pool") or {}
    metric("up", "gauge", "1 while the node runs", [({"role": s["role"]}, 1)])
    metric("healthy", "gauge", "0 when the node has failed or completed no round for status.stall_after_s",
           [({}, int(s["healthy"]))])
    metric("round", "gauge", "last completed round", [({}, last.get("round"))])
    metric("rounds_target", "gauge", "rounds this run stops after", [({}, s.get("rounds"))])
    metric("reward_mean", "gauge", "mean reward of the last round's local completions", [({}, last.get("reward_mean"))])
    metric("accuracy_train", "gauge", "share of correct local completions in the last round", [({}, last.get("accuracy_train"))])
    metric("eval_accuracy", "gauge", "greedy accuracy on the held-out set at the last evaluation", [({}, s["last_eval_accuracy"])])
    metric("learning_rate", "gauge", "the rate the next training step takes (grpo.lr, adapted by the step-size "
           "controller when grpo.target_kl is set)", [({}, last.get("lr_next"))])
    metric("step_kl", "gauge", "per-token KL between the policy before and after the last step (measured when "
           "grpo.target_kl is set)", [({}, last.get("step_kl"))])
    metric("weight_version", "gauge", "optimizer steps pushed into the generator", [({}, last.get("weight_version"))])
    peak = last.get("memory_peak_gb")
    metric("memory_peak_bytes", "gauge", "the last round's peak memory (resident size on a host, reserved on a CUDA card)",
           [({}, None if peak is None else peak * GB)])
    metric("micro_batch", "gauge", "sequences per forward and backward pass in the last round (halved after a round "
           "past the memory plan)", [({}, last.get("micro_batch"))])
    metric("peers", "gauge", "connected peers", [({}, p2p.get("peers"))])
    metric("mesh_peers", "gauge", "peers in the gossip mesh of our rollout shard topic", [({}, p2p.get("mesh_peers"))])
    metric("shard_level", "gauge", "rollout shard level this node listens at (0: the whole swarm)",
           [({}, p2p.get("shard_level"))])
    metric("shard_authors", "gauge", "authors heard on our shard topic within the shard window, this node included",
           [({}, p2p.get("shard_authors"))])
    metric("shard_topics", "gauge", "rollout shard topics this node reads: its own, the levels it probes, and for a "
           "minute after it changed shard the old one", [({}, p2p.get("shard_topics"))])
    metric("shard_probes", "gauge", "shard levels this node probes because peers subscribe there (never moved to "
           "unless valid rollouts are heard there)", [({}, len(p2p["shard_probes"]) if "shard_probes" in p2p else None)])
    metric("reachable", "gauge", "1 when peers can dial this node, 0 when it is reached through relays (behind NAT)",
           [({}, {"public": 1, "private": 0}.get(p2p.get("reachability")))])
    metric("relays", "gauge", "relays this node holds a reservation with (behind NAT)", [({}, p2p.get("relays"))])
    metric("relayed_peers", "gauge", "peers connected through a relay", [({}, p2p.get("relayed_peers"))])
    metric("punched_peers", "gauge", "peers first reached through a relay, now over a direct connection hole punching "
           "opened", [({}, p2p.get("punched_peers"))])
    metric("punches_total", "counter", "hole punches (DCUtR): succeeded, failed, refused (a CONNECT over a direct "
           "connection, or no address the hint budget allowed)",
           [({"result": r}, p2p.get(k, 0)) for r, k in (("succeeded", "punches"), ("failed", "punches_failed"),
                                                        ("refused", "punches_refused"))])
    metric("gossip_streams_moved_total", "counter", "gossip streams reopened because the connection under them closed "
           "while another to the peer stayed open (a punch, a relay's limit)", [({}, p2p.get("gossip_streams_moved", 0))])
    metric("relay_refused_total", "counter", "relay reservations refused: the asker is not a participant this node "
           "dialed back and could not reach, has taken part for less than p2p.relay_after_s, its address holds its "
           "share, or every slot is taken", [({}, p2p.get("relay_refused", 0))])
    metric("relayed_bytes_total", "counter", "bytes this node relayed between peers behind NAT",
           [({}, p2p.get("relayed_bytes", 0))])
    metric("relay_paced_seconds_total", "counter", "seconds relayed circuits waited for p2p.relay_kib_per_s",
           [({}, p2p.get("relay_paced_s", 0))])
    metric("dialback_answers_total", "counter", "dial-back answers: proven (the nonce came back over a new direct "
           "connection), unreached, unproven (a claim of reaching this node without the nonce)",
           [({"answer": a}, p2p.get(f"dialback_{a}", 0)) for a in ("proven", "unreached", "unproven")])
    metric("dialback_disagreeing_total", "counter", "dial-back answers against the verdict their check left",
           [({}, p2p.get("dialback_disagreeing", 0))])
    metric("reachability_changes_total", "counter", "times this node's reachability verdict changed",
           [({}, p2p.get("reachability_changes", 0))])
    metric("dht_servers_dialed_total", "counter", "DHT servers this node's lookups dialed that it was not given, and "
           "of those the dials that failed (made-up servers cost at most 4 failures a minute)",
           [({"outcome": "dialed"}, p2p.get("dht_servers_dialed", 0)), ({"outcome": "failed"}, p2p.get("dht_servers_failed", 0))])
    metric("publish_paced_seconds_total", "counter", "seconds this node's messages waited for p2p.limits."
           "max_author_kib_per_s (receivers refuse an author's bytes past it)", [({}, p2p.get("publish_paced_s", 0))])
    metric("peers_other_protocol", "gauge", "connected peers gossiping rollouts under another protocol version",
           [({}, p2p.get("peers_other_protocol"))])
    metric("peers_other_network", "gauge", "connected peers gossiping rollouts on another network's topics",
           [({}, p2p.get("peers_other_network"))])
    metric("round_seconds", "gauge", "seconds the last round spent per phase",
           [({"phase": p}, last.get(f"seconds_{p}")) for p in PHASES])
    metric("phase_seconds_total", "counter", "seconds spent per phase since start",
           [({"phase": p}, totals.get(f"seconds_{p}")) for p in PHASES])
    metric("tokens_generated_total", "counter", "completion tokens generated", [({}, totals.get("tokens_generated"))])
    metric("local_groups_total", "counter", "local rollout groups sampled", [({}, totals.get("n_local"))])
    metric("local_groups_informative_total", "counter", "local groups whose rewards differ (the rest carry no gradient)",
           [({}, totals.get("local_informative"))])
    metric("external_groups_inspected_total", "counter", "pool groups regenerated and re-scored by this node",
           [({}, totals.get("external_inspected"))])
    metric("external_groups_informative_total", "counter", "re-scored pool groups whose rewards differ",
           [({}, totals.get("external_informative"))])
    metric("external_groups_total", "counter", "external rollout groups taken into batches", [({}, totals.get("n_external"))])
    metric("external_groups_used_total", "counter", "external groups that carried signal into the loss",
           [({}, totals.get("n_external_used"))])
    metric("external_completions_gated_total", "counter", "external completions to push up that the support gate left "
           "out (text this node would not write)", [({}, totals.get("external_gated"))])
    metric("external_completions_shaped_total", "counter", "external completions below the support gate trained with the "
           "policy-shaped weight (rule scoped: a peer stronger on their family)", [({}, totals.get("external_shaped"))])
    metric("support_cutoff", "gauge", "the support gate's cut-off: mean token log-prob below which external text is not "
           "learned", [({}, last.get("support_cutoff"))])
    metric("rollout_groups_published_total", "counter", "local rollout groups shared with the swarm",
           [({}, totals.get("groups_published"))])
    metric("messages_published_total", "counter", "gossip messages published", [({}, p2p.get("published"))])
    metric("messages_publish_dropped_total", "counter", "own gossip messages dropped unsent: the publish queue was full",
           [({}, p2p.get("publish_dropped", 0))])
    metric("messages_accepted_total", "counter", "gossip messages accepted", [({}, p2p.get("accepted"))])
    # labelled counters export every label from the start, at zero (Prometheus convention: rate() and
    # alerts need the series before the first event)
    rejected = Counter(dict.fromkeys(WIRE_REASONS, 0)) + Counter(p2p.get("rejected") or {})
    metric("messages_rejected_total", "counter", "gossip messages rejected, by reason",
           [({"reason": r}, rejected.get(r, 0)) for r in sorted({*WIRE_REASONS, *rejected})])
    metric("gossip_dropped_total", "counter", "gossip traffic dropped below the message checks: messages not forwarded "
           "past the per-neighbour rate limit, RPCs over py-libp2p's inbound size cap, RPCs that do not parse, "
           "messages on a topic this node does not read",
           [({"reason": r}, p2p.get(f"dropped_{r}") or 0) for r in ("rate_limit", "rpc_too_large", "bad_rpc", "unsubscribed")])
    metric("rollout_groups_received_total", "counter", "rollout groups received from peers", [({}, pool.get("received"))])
    metric("rollout_groups_accepted_total", "counter", "rollout groups that entered the pool", [({}, pool.get("accepted"))])
    dropped = Counter(pool.get("dropped") or {})
    dropped.update({k.split(":", 1)[1]: v for k, v in totals.items() if k.startswith("external_dropped:")})
    metric("rollout_groups_dropped_total", "counter", "rollout groups dropped from the pool or found unusable, by reason",
           [({"reason": r}, dropped.get(r, 0)) for r in sorted({*POOL_DROPS, *SELECTION_DROPS, *dropped})])
    return found


class _Handler(BaseHTTPRequestHandler):
    board: StatusBoard
    server_version = "sapo-node"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        if path == "/status":
            self._send(200, "application/json", json.dumps(self.board.snapshot(), default=str).encode())
        elif path == "/metrics":
            self._send(200, "text/plain; version=0.0.4; charset=utf-8", prometheus(self.board.snapshot()).encode())
        elif path in ("/", "/index.html"):
            self._send(200, "text/html; charset=utf-8", DASHBOARD)
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found: try /, /status or /metrics\n")

    def _send(self, code: int, kind: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("status: %s %s", self.address_string(), fmt % args)


DASHBOARD = files("node").joinpath("dashboard.html").read_bytes()


class StatusError(RuntimeError):
    """The status endpoint could not start (for example: its port is taken)."""


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up before the answer is written (a health check that reads only the status line)
        is routine: one DEBUG line, not http.server's traceback on stderr. Anything else: one WARNING line."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError):
            log.debug("status: %s hung up before the answer was written (%s)", client_address[0], type(error).__name__)
        else:
            log.warning("status: answering %s failed: %s", client_address[0], describe(error))


class StatusServer:
    """Owns the HTTP server thread from start to join."""

    def __init__(self, cfg: StatusConfig, board: StatusBoard, sock: socket.socket | None = None):
        """`sock`: a socket already bound and listening (`node.preflight`), served instead of binding `cfg.listen`."""
        handler = type("Handler", (_Handler,), {"board": board})
        try:
            self._server = _Server(cfg.address(), handler, bind_and_activate=sock is None)
        except OSError as e:
            raise StatusError(f"cannot serve the status endpoint on {cfg.listen}: {e.strerror or e} "
                              "(choose another with --status.listen, or --status.enabled false)") from None
        if sock is not None:
            self._server.socket.close()
            self._server.socket, self._server.server_address = sock, sock.getsockname()
            self._server.server_name, self._server.server_port = sock.getsockname()[:2]  # what server_bind sets
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="sapo-status", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/"

    def __enter__(self) -> "StatusServer":
        self._thread.start()
        log.info("status: dashboard at %s (also /status and /metrics)", self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
