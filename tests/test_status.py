"""The status endpoint (/metrics, /status, the dashboard in a real headless browser) and bootstrap-only nodes."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from node.status import StatusBoard, StatusConfig, prometheus
from tests.conftest import ROOT, run_sapo

SAMPLE = re.compile(r'^(sapo|process)_[a-z_]+(\{[a-z]+="[^"]*"(,[a-z]+="[^"]*")*\})? -?[0-9.e+-]+$')


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read()


def start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "node.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"), cwd=ROOT, env={**os.environ, "COLUMNS": "200"})


def wait_for(pattern: str, log: Path, proc: subprocess.Popen, timeout: float = 120) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text())
        if m:
            return m
        assert proc.poll() is None, log.read_text()
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not in the log after {timeout} s:\n{log.read_text()}")


def poll_status(url: str, ok, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = json.loads(get(url + "status"))
        if ok(status):
            return status
        time.sleep(0.5)
    raise AssertionError(f"status never satisfied the condition: {status}")


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)


def test_status_listen_must_be_host_and_port():
    assert StatusConfig(listen="0.0.0.0:8080").address() == ("0.0.0.0", 8080)
    for bad in ("8080", "localhost:", ":80", "h:99999"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            StatusConfig(listen=bad)


def test_prometheus_text_has_help_type_and_labelled_samples():
    board = StatusBoard("trainer", {"rounds": 10}, history=10,
                        live=lambda: {"peers": 2, "published": 7, "rejected": {"too_old": 3}, "dropped_rate_limit": 9,
                                      "dropped_bad_rpc": 1, "reachability": "private", "relays": 2, "relayed_peers": 1,
                                      "relay_refused": 6, "relayed_bytes": 4096, "relay_paced_s": 1.5, "publish_paced_s": 0.5,
                                      "publish_dropped": 3,
                                      "pool": {"received": 5, "dropped": {"stale": 1}}})
    board.record({"round": 1, "reward_mean": 0.5, "eval_accuracy": 0.25, "seconds_generate": 1.5,
                  "seconds_train": 0.5, "seconds_other": 0.1, "external_dropped": {"not_accepted": 2}, "n_local": 4,
                  "groups_published": 4, "external_gated": 3, "support_cutoff": -0.9})
    board.record({"round": 2, "reward_mean": 0.75, "eval_accuracy": None, "seconds_generate": 1.0,
                  "seconds_train": 0.5, "seconds_other": 0.1, "n_local": 4, "external_gated": 2,
                  "external_dropped": {"off_support": 1}, "support_cutoff": -0.75, "lr_next": 1.5e-05, "step_kl": 0.004})
    text = prometheus(board.snapshot())
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert samples and all(SAMPLE.match(line) for line in samples), text
    for name in {line.split("{")[0].split(" ")[0] for line in samples}:
        assert f"# TYPE {name} " in text and f"# HELP {name} " in text
    assert {
        "sapo_round 2.0", "sapo_reward_mean 0.75",
        "sapo_eval_accuracy 0.25",  # the last evaluation, not the last round's null
        'sapo_phase_seconds_total{phase="generate"} 2.5',
        'sapo_messages_rejected_total{reason="too_old"} 3.0',
        'sapo_gossip_dropped_total{reason="rate_limit"} 9.0', 'sapo_gossip_dropped_total{reason="bad_rpc"} 1.0',
        "sapo_reachable 0.0", "sapo_relays 2.0", "sapo_relayed_peers 1.0",
        "sapo_relay_refused_total 6.0", "sapo_relayed_bytes_total 4096.0", "sapo_relay_paced_seconds_total 1.5",
        "sapo_publish_paced_seconds_total 0.5", "sapo_messages_publish_dropped_total 3.0",
        'sapo_rollout_groups_dropped_total{reason="not_accepted"} 2.0',
        'sapo_rollout_groups_dropped_total{reason="stale"} 1.0',
        'sapo_rollout_groups_dropped_total{reason="off_support"} 1.0',
        "sapo_peers 2.0", "sapo_local_groups_total 8.0",
        "sapo_rollout_groups_published_total 4.0", "sapo_messages_published_total 7.0",
        "sapo_external_completions_gated_total 5.0", "sapo_support_cutoff -0.75",
        "sapo_learning_rate 1.5e-05", "sapo_step_kl 0.004",  # the step-size controller's rate and the step it measured
    } - set(samples) == set()
    assert board.snapshot()["history"][-1]["lr_next"] == 1.5e-05
    # the process's own figures, from prometheus_client
    assert any(line.startswith("process_resident_memory_bytes ") for line in samples)
    assert any(line.startswith("process_cpu_seconds_total ") for line in samples)


def test_every_label_of_a_labelled_counter_is_exported_at_zero_from_the_first_scrape():
    from node.selection_config import DROP_REASONS as SELECTION_DROPS
    from p2p.pool import DROP_REASONS as POOL_DROPS
    from p2p.wire import REASONS
    from rewards.tasks import TaskError
    from rewards.untrusted import DROP_REASONS as UNTRUSTED_DROPS, SANDBOX_FAILURES

    samples = prometheus(StatusBoard("trainer", {}, history=10).snapshot()).splitlines()
    for reason in REASONS:
        assert f'sapo_messages_rejected_total{{reason="{reason}"}} 0.0' in samples
    for reason in (*POOL_DROPS, *SELECTION_DROPS):
        assert f'sapo_rollout_groups_dropped_total{{reason="{reason}"}} 0.0' in samples
    for reason in ("rate_limit", "rpc_too_large"):
        assert f'sapo_gossip_dropped_total{{reason="{reason}"}} 0.0' in samples
    # the lists hold what the producers count: a task the receiver cannot build, and every sandbox failure
    assert TaskError.reason in UNTRUSTED_DROPS and set(SANDBOX_FAILURES) <= set(UNTRUSTED_DROPS) <= set(SELECTION_DROPS)


def test_a_client_that_hangs_up_mid_answer_leaves_no_traceback_and_the_server_answers_on(caplog, capfd):
    """A health check that closes its connection before reading the answer made every container log start with
    http.server's BrokenPipe traceback."""
    import socket
    import struct

    from node.status import StatusServer

    with StatusServer(StatusConfig(listen="127.0.0.1:0"), StatusBoard("trainer", {}, history=10)) as server:
        host, port = server._server.server_address[:2]
        with caplog.at_level("DEBUG", logger="node.status"):
            try:
                raise BrokenPipeError(32, "Broken pipe")
            except BrokenPipeError:
                server._server.handle_error(None, ("10.0.0.9", 1))
            for _ in range(20):  # real hang-ups: the dashboard page, answered into a reset connection
                with socket.create_connection((host, port), timeout=5) as s:
                    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
            with urllib.request.urlopen(f"{server.url}status", timeout=5) as r:
                assert json.loads(r.read())["role"] == "trainer"
    assert "10.0.0.9 hung up before the answer was written (BrokenPipeError)" in caplog.text
    assert "Traceback" not in capfd.readouterr().err and not [r for r in caplog.records if r.levelno >= 30]


def test_a_running_node_without_a_completed_round_for_too_long_is_stalled_and_unhealthy():
    board = StatusBoard("trainer", {}, history=10, stall_after_s=0.3)
    board.set_state("running")
    board.record({"round": 1})
    assert board.snapshot()["healthy"] and board.snapshot()["state"] == "running"
    time.sleep(0.5)
    stalled = board.snapshot()
    assert not stalled["healthy"] and stalled["state"].startswith("stalled: no round completed for ")
    assert "sapo_healthy 0.0" in prometheus(stalled).splitlines()
    board.record({"round": 2})
    assert board.snapshot()["healthy"] and "sapo_healthy 1.0" in prometheus(board.snapshot()).splitlines()
    board.set_state("done")
    time.sleep(0.5)
    assert board.snapshot()["healthy"]  # a finished node is not stalled
    board.set_state("failed", "generation failed 3 times")
    assert not board.snapshot()["healthy"]


def assert_dashboard_drawn(dom: str) -> None:
    """The page a browser rendered: the node's state and round, four charts with a point per series and round,
    titled axes, and each series' latest value."""
    assert re.search(r'id="state">running<', dom), dom[:2000]
    shown_round = int(re.search(r'id="round">(\d+) / 1000<', dom).group(1))
    assert shown_round >= 4
    drawn = {m.group(1): int(m.group(2)) for m in re.finditer(r'id="chart-(\w+)"[^>]*data-points="(\d+)"', dom)}
    assert drawn.keys() == {"learning", "peers", "signal", "traffic"}, drawn
    assert drawn["learning"] >= 2 * shown_round, drawn
    assert drawn["signal"] >= 2 * shown_round, drawn  # local informative and external counts, every round
    titles = {m.group(1): (m.group(2), m.group(3)) for m in
              re.finditer(r'id="chart-(\w+)"[^>]*data-x-title="([^"]+)"[^>]*data-y-title="([^"]+)"', dom)}
    assert titles == {"learning": ("round", "reward / accuracy (0-1)"), "peers": ("round", "connected peers"),
                      "signal": ("round", "groups per round"), "traffic": ("round", "groups per round")}, titles
    now = dict(re.findall(r'</i>([^<]+?) <b class="now">([^<]+)</b>', dom))  # each series' latest value
    assert now["peers"] == "0" and 0 <= float(now["reward (mean)"]) <= 1 and 0 <= float(now["eval accuracy"]) <= 1
    assert {"train accuracy", "local informative", "external used", "groups in (from peers)"} <= now.keys(), now


@pytest.mark.slow
def test_dashboard_shows_a_running_node_in_a_headless_browser(tiny_a, cache_dir, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        message = "needs Chromium: apt-get install chromium (scripts/test.sh installs it when run as root)"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    log = tmp_path / "node.log"
    proc = start(["run", "--model.cache_dir", str(cache_dir), "--out", str(tmp_path / "out"), "--rounds", "1000",
                  "--run.eval_every", "2", "--status.listen", "127.0.0.1:0"], log)
    try:
        url = wait_for(r"dashboard at (http://127\.0\.0\.1:\d+/)", log, proc).group(1)
        status = poll_status(url, lambda s: (s["last"] or {}).get("round", 0) >= 4)
        assert status["role"] == "trainer" and status["model"] == "tiny-a" and status["state"] == "running"
        assert status["peer_id"].startswith("12D3KooW") and status["network"] == "local"
        assert [h["round"] for h in status["history"][:3]] == [0, 1, 2]
        metrics = get(url + "metrics").decode()
        assert re.search(r"^sapo_round ([4-9]|\d\d+)\.0$", metrics, re.M), metrics
        assert get(url + "").startswith(b"<!doctype html>")
        with pytest.raises(urllib.error.HTTPError, match="404"):
            get(url + "nope")

        browser = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                   "--window-size=1280,900", "--virtual-time-budget=5000"]
        dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=60).stdout
        assert_dashboard_drawn(dom)
        assert status["peer_id"] in dom
        shot = tmp_path / "dashboard.png"
        subprocess.run([*browser, f"--screenshot={shot}", url], capture_output=True, timeout=60)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    finally:
        assert stop(proc) == 0, log.read_text()


def test_a_taken_status_port_gives_way_to_the_next_free_one(tiny_a, cache_dir, tmp_path):
    """Two nodes on one machine with default settings both serve status (the two-node example in docs/network.md)."""
    import re
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_sapo("run", "--model.cache_dir", str(cache_dir), "--out", str(tmp_path), "--rounds", "1",
                     "--p2p.enabled", "false", "--status.listen", f"127.0.0.1:{port}", env={"COLUMNS": "400"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"status port {port} is busy (another node?); serving status on 127.0.0.1:" in r.stderr
    served = int(re.search(r"status: dashboard at http://127\.0\.0\.1:(\d+)/", r.stderr).group(1))
    assert port < served <= port + 20


@pytest.mark.slow
def test_bootstrap_only_node_joins_two_trainers_without_a_model(tiny_a, cache_dir, tmp_path):
    boot_log = tmp_path / "boot.log"
    boot = start(["run", "--bootstrap-only", "--out", str(tmp_path / "boot"), "--status.listen", "127.0.0.1:0",
                  "--model.name", "no-such-model"], boot_log)  # never loaded
    nodes = []
    try:
        url = wait_for(r"dashboard at (http://127\.0\.0\.1:\d+/)", boot_log, boot).group(1)
        addr = wait_for(r"(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", boot_log, boot).group(1)
        for k in (1, 2):
            log = tmp_path / f"node{k}.log"
            nodes.append((start(["run", "--model.cache_dir", str(cache_dir), "--out", str(tmp_path / f"node{k}"),
                                 "--rounds", "1000", "--bootstrap", addr, "--status.listen", "127.0.0.1:0",
                                 "--generation.completions_per_group", "4"], log), log))
        status = poll_status(url, lambda s: s["p2p"]["peers"] >= 2 and s["p2p"]["accepted"] > 0)
        assert status["role"] == "bootstrap" and status["model"] is None and status["state"] == "running"
        assert "libtorch" not in Path(f"/proc/{boot.pid}/maps").read_text()  # a small VPS holds no torch
        # the trainers found each other through it and train on each other's rollouts
        for proc, log in nodes:
            node_url = wait_for(r"dashboard at (http://127\.0\.0\.1:\d+/)", log, proc).group(1)
            poll_status(node_url, lambda s: s["p2p"]["peers"] >= 2 and s["totals"].get("n_external_used", 0) > 0)
        assert 'sapo_up{role="bootstrap"} 1.0' in get(url + "metrics").decode()
        poll_status(url, lambda s: sum(h["n_external_received"] or 0 for h in s["history"]) > 0)  # its traffic chart
    finally:
        codes = [stop(p) for p, _ in nodes] + [stop(boot)]
    assert codes == [0, 0, 0], boot_log.read_text()
    assert "no-such-model" not in boot_log.read_text()
    assert "leaving the swarm" in boot_log.read_text() and "checkpointing" not in boot_log.read_text()  # nothing to save


def test_bootstrap_only_without_p2p_is_a_config_error(tmp_path):
    r = run_sapo("run", "--bootstrap-only", "--out", str(tmp_path), "--p2p.enabled", "false")
    assert r.returncode == 2 and "--bootstrap-only needs the p2p layer" in r.stderr
