"""`sapo run --bootstrap-only`: a node without a model that serves peer discovery and gossip routing.

It validates and forwards rollout messages like any node (so it never relays what a node would
reject) but trains on nothing; a small VPS with a public address runs it for a swarm or a testnet.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time

from node.config import ConfigError, NodeConfig
from node.lifecycle import StopSignal
from node.status import StatusBoard, StatusServer
from p2p.service import Gossip
from p2p.wire import WireMessage
from rewards.scoring import group_carries_signal

log = logging.getLogger(__name__)
TICK_S = 5.0  # how often the status history gets a point


def run_bootstrap(cfg: NodeConfig, stop: StopSignal, status_socket: socket.socket | None = None) -> None:
    if not cfg.p2p.enabled:
        raise ConfigError("--bootstrap-only needs the p2p layer: drop --p2p.enabled false")
    board = StatusBoard("bootstrap", {"model": None, "rounds": None, "peer_id": None, "network": cfg.p2p.network},
                        cfg.status.history)
    relayed = 0  # groups in the messages it accepted (and forwarded); written on the p2p thread

    def count(message: WireMessage) -> None:
        nonlocal relayed
        relayed += len(message.groups)

    with contextlib.ExitStack() as stack:
        if cfg.status.enabled:
            stack.enter_context(StatusServer(cfg.status, board, status_socket))
        gossip = stack.enter_context(Gossip(cfg.p2p, cfg.key_file(), on_message=count, signal=group_carries_signal))
        board.update_info(peer_id=gossip.peer_id)
        board.set_live(gossip.stats)
        board.set_state("running")
        log.info("bootstrap node on network %r: %s", cfg.p2p.network, " ".join(gossip.addrs))  # each ends in /p2p/<id>
        counted = 0
        while not stop.wait(TICK_S):
            total = relayed
            board.record({"time": time.time(), "peers": gossip.stats()["peers"], "n_external_received": total - counted})
            counted = total
        board.set_state("stopped")
