"""Interoperability with a second libp2p implementation: a js-libp2p peer (tests/interop/peer.mjs) and a training
sapo node exchange wire protocol 3 rollouts over TCP + Noise + yamux + GossipSub (StrictSign) on 127.0.0.1.

Protocol 3 puts one topic in each GossipSub message so that libp2p implementations other than py-libp2p can publish
and verify rollouts (docs/PROTOCOL.md sections 1 and 7); this is the test that they do."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from libp2p.peer.id import ID

from node.swarm import free_port, wait_listening
from p2p.identity import load_or_create, peer_id
from lab.probe import json_lines
from p2p.shards import epoch_of, shard_key, shard_topic
from rewards import TaskRef, regenerate
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

INTEROP = ROOT / "tests" / "interop"
MIN_NODE_MAJOR = 20  # js-libp2p 3.x with tests/interop/polyfill.mjs; Debian bookworm's nodejs is 18
LEVEL = 1  # pinned, so that the node reads one topic that is not every author's: `wrong_shard` can be sent there
EPOCH_S = 10**9  # shards are not redrawn during the test (the current epoch began in 2001)
BASE = "/sapo/interop/rollouts/3"
# Every rejection the js peer provokes, one message each; each reason is a rule of docs/PROTOCOL.md section 4.
REASONS = ("version", "sender_mismatch", "no_signal", "too_old", "from_future", "wrong_shard")
JS_LIMIT_S = 300  # the js peer exits by itself after this
WAIT_S = 280  # for everything the test needs to see, from the js peer's start
TASKS = 150  # distinct task references the js peer publishes, one valid message a second


def _toolchain_missing(why: str) -> None:
    """Outside CI a machine without Node.js skips this test; CI must have it (scripts/test.sh installs it)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}; CI=true requires it (scripts/test.sh installs Debian's nodejs and npm as root)")
    pytest.skip(f"{why} (Debian/Ubuntu: sudo apt-get install nodejs npm)")


@pytest.fixture(scope="session")
def js_peer() -> list[str]:
    """The command that starts tests/interop/peer.mjs, its packages installed from package-lock.json (`npm ci`) once
    for each version of the lock file."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        _toolchain_missing("node and npm are not installed: the js-libp2p interop test needs them")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    major = re.match(r"v(\d+)\.", version)
    if major is None or int(major[1]) < MIN_NODE_MAJOR:
        _toolchain_missing(f"Node.js {version or '?'} is older than {MIN_NODE_MAJOR}, which js-libp2p 3.x needs")
    lock = INTEROP / "package-lock.json"
    stamp, want = INTEROP / "node_modules" / ".sapo-installed", hashlib.sha256(lock.read_bytes()).hexdigest()
    with lock.open("rb") as held:  # another pytest process (a worker, the long lane) may install at the same time
        fcntl.flock(held, fcntl.LOCK_EX)
        if not stamp.exists() or stamp.read_text() != want:
            r = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=INTEROP, capture_output=True, text=True,
                               timeout=600)
            assert r.returncode == 0, f"npm ci in {INTEROP} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
            stamp.write_text(want)
    return [node, str(INTEROP / "peer.mjs")]


def tasks() -> list[dict]:
    """Task references of a dataset and config the tiny-a node draws itself (`arith`, `{}`), with the answer
    this repository's own regeneration gives: the js peer needs no implementation of section 5."""
    refs = [TaskRef("arith", {}, seed=4242, index=i) for i in range(TASKS)]
    return [{"dataset": r.dataset, "config": {}, "seed": r.seed, "index": r.index, "answer": regenerate(r).answer}
            for r in refs]


def stop(proc: subprocess.Popen, grace: float) -> int:
    """SIGTERM, then SIGKILL past `grace` seconds; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def start_node(out: Path, port: int, cache_dir: Path, profile: Path, log: Path) -> subprocess.Popen:
    """A tiny-a node on the interop network profile; it trains until SIGTERM once the test has seen what it needs."""
    with open(log, "wb") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "node.cli", "run", "--out", str(out), "--model.cache_dir", str(cache_dir),
             "--rounds", "1000", "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--network", str(profile),
             "--p2p.shards.level", str(LEVEL), "--run.wait_for_peers", "1", "--local", "2",
             "--generation.completions_per_group", "4", "--tasks.eval_size", "10", "--run.eval_every", "1000",
             "--run.checkpoint_every", "1000"],
            cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)


def start_js_peer(js_peer: list[str], node_addr: str, events: Path, log: Path) -> subprocess.Popen:
    with open(events, "wb") as events_file, open(log, "wb") as err_file:
        return subprocess.Popen(
            [*js_peer, "--bootstrap", node_addr, "--seconds", str(JS_LIMIT_S), "--topic-base", BASE,
             "--epoch-s", str(EPOCH_S), "--level", str(LEVEL), "--tasks", json.dumps(tasks()), "--invalid", ",".join(REASONS)],
            cwd=INTEROP, stdout=events_file, stderr=err_file)


def exchanged(events: list[dict], rows: list[dict], node_id: str, node_topics: set[str]) -> bool:
    """Both ways done: the node trained on the js peer's groups and rejected each invalid message once, and the
    js peer received the node's rollouts under each topic it reads."""
    ready = [e for e in events if e["event"] == "ready"]
    received = {e["topic"] for e in events if e["event"] == "received" and e["from"] == node_id}
    rejected = (rows[-1].get("p2p") or {}).get("rejected") if rows else None
    trained = bool(ready) and any(ready[0]["peer"] in (r.get("external_sources") or {}) and r["n_external_used"]
                                  for r in rows)
    return trained and received == node_topics and rejected == {r: 1 for r in REASONS}


def assert_the_node_verified_and_rejected(events: list[dict], rows: list[dict], node_id: str, js_id: str, why: str):
    """The js peer's messages went to the node; it accepted the valid ones (signature, topic, schema: every check
    of section 4), rejected each invalid one under the spec's reason and nothing else, and re-scored the js peer's
    groups and trained on them (the stranger's never got in)."""
    published = [e for e in events if e["event"] == "published"]
    assert not [e for e in events if e["event"] == "publish_failed"], why
    assert all(e["recipients"] == [node_id] for e in published), why
    assert sorted(e["kind"] for e in published if e["kind"] != "valid") == sorted(REASONS), why
    p2p = rows[-1]["p2p"]
    assert 0 < p2p["accepted"] <= len([e for e in published if e["kind"] == "valid"]), why
    assert p2p["rejected"] == {r: 1 for r in REASONS}, why
    from_js = [r for r in rows if (r.get("external_sources") or {}).get(js_id)]
    assert sum(r["n_external_received"] for r in rows) > 0, why
    assert any(r["n_external_used"] > 0 for r in from_js), why
    assert all(set(r.get("external_sources") or {}) <= {js_id} for r in rows), why


def assert_the_js_peer_verified_the_node(events: list[dict], node_id: str, node_topics: set[str], why: str):
    """The js peer received the node's own rollouts: signatures verified by js gossipsub (StrictSign), payloads
    decoded and checked by the js peer (v, peer == signer, topic == the signer's shard)."""
    received = [e for e in events if e["event"] == "received"]
    assert received and {e["from"] for e in received} == {node_id}, why
    assert all(e["valid"] and e["v"] == 3 and e["peer"] == e["from"] and e["groups"] > 0 for e in received), why
    assert {e["topic"] for e in received} == node_topics, why  # under each of its shard levels the js peer reads
    assert len({e["round"] for e in received}) >= 2, why
    assert {d for e in received for d in e["datasets"]} <= {"arith", "reverse", "count"}, why  # tiny-a's own mix


def test_a_js_libp2p_peer_and_a_training_node_exchange_verify_and_reject_rollouts(js_peer, tiny_a, cache_dir, tmp_path):
    out, port = tmp_path / "node", free_port()
    out.mkdir()
    node_id = peer_id(load_or_create(out / "node.key"))  # the node runs with this key: its address is known up front
    profile = tmp_path / "interop.toml"
    profile.write_text(f'namespace = "interop"\nprotocol = 3\nshard_epoch_s = {EPOCH_S}\n')
    epoch = epoch_of(time.time(), EPOCH_S)
    node_key = shard_key(ID.from_base58(node_id).to_bytes(), epoch)
    # the node publishes under its shards at levels L-1, L and L+1; the js peer reads the first two
    node_topics = {shard_topic(BASE, node_key, lv) for lv in (LEVEL - 1, LEVEL)}
    node_log, js_events, js_log = out / "node.log", tmp_path / "js.events.jsonl", tmp_path / "js.log"
    node = start_node(out, port, cache_dir, profile, node_log)
    js: subprocess.Popen | None = None
    try:
        assert wait_listening(port, node, timeout=240), f"the node did not listen:\n{node_log.read_text()[-3000:]}"
        js = start_js_peer(js_peer, f"/ip4/127.0.0.1/tcp/{port}/p2p/{node_id}", js_events, js_log)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not exchanged(json_lines(js_events), json_lines(out / "metrics.jsonl"),
                                                             node_id, node_topics):
            assert node.poll() is None, f"the node exited ({node.returncode}):\n{node_log.read_text()[-3000:]}"
            assert js.poll() is None, f"the js peer exited ({js.returncode}):\n{js_events.read_text()[-3000:]}" \
                                      f"\n{js_log.read_text()[-3000:]}"
            time.sleep(1)
        js_rc = stop(js, 10)
        node_rc = stop(node, 120)
    finally:
        for proc in (js, node):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()

    events, rows = json_lines(js_events), json_lines(out / "metrics.jsonl")
    why = (f"\njs peer:\n{js_events.read_text()[-3000:]}\n{js_log.read_text()[-2000:]}"
           f"\nnode:\n{node_log.read_text()[-3000:]}")
    assert js_rc == 0 and (events[-1]["event"], events[-1].get("reason")) == ("stopped", "SIGTERM"), why
    assert node_rc == 0 and "Traceback" not in node_log.read_text() and " ERROR " not in node_log.read_text(), why
    ready = next(e for e in events if e["event"] == "ready")
    # the js peer computed the node's shard key (section 7) as the node does, and saw the node subscribe to its topic
    assert (ready["epoch"], ready["node_shard_key"]) == (epoch, node_key.hex()), why
    assert ready["topic"] in node_topics and set(ready["subscribed"]) == node_topics, why
    assert {e["by"] for e in events if e["event"] == "node_subscribed"} == {ready["peer"], ready["stranger"]}, why
    assert_the_node_verified_and_rejected(events, rows, node_id, ready["peer"], why)
    assert_the_js_peer_verified_the_node(events, node_id, node_topics, why)
