"""`sapo run` refuses what it can check (ports, folders, keys, model names) before it loads anything."""

from __future__ import annotations

import json
import shutil
import socket

import pytest

from node import preflight
from node.config import ConfigError, load_config
from tests.conftest import ROOT, run_sapo

OFFLINE = {"HF_ENDPOINT": "http://127.0.0.1:9"}  # a closed local port: the hub looks unreachable, at once


def busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def test_a_busy_status_port_gives_way_to_the_next_free_one(tmp_path):
    with busy_port() as taken:
        port = taken.getsockname()[1]
        cfg = load_config(overrides={"run": {"out_dir": str(tmp_path)}, "status": {"listen": f"127.0.0.1:{port}"}})
        checked = preflight.check(cfg, model=False)
        try:
            assert port < checked.status_socket.getsockname()[1] <= port + preflight.STATUS_PORT_TRIES
        finally:
            checked.close()


def test_an_unavailable_status_address_is_one_line_naming_the_knob(tmp_path):
    cfg = load_config(overrides={"run": {"out_dir": str(tmp_path)}, "status": {"listen": "192.0.2.1:8080"}})
    with pytest.raises(ConfigError, match=r"^status.listen: cannot listen on 192.0.2.1:8080"):
        preflight.check(cfg, model=False)


def test_a_restarted_node_gets_its_status_port_back_while_the_last_runs_connections_linger():
    with busy_port() as free:
        port = free.getsockname()[1]
    cfg = load_config(overrides={"status": {"listen": f"127.0.0.1:{port}"}})
    server = preflight.bind_status(cfg)  # the last run's endpoint
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
    server.close()
    client.close()
    with preflight.bind_status(cfg) as again:
        assert again.getsockname()[1] == port


def test_a_busy_p2p_port_is_refused_before_any_model_is_built(tmp_path):
    """The model cache stays empty: the tiny-a preset would have been built (a minute) had it got that far."""
    cache = tmp_path / "cache"
    with busy_port() as taken:
        port = taken.getsockname()[1]
        r = run_sapo("run", "--out", str(tmp_path / "out"), "--listen", f"/ip4/127.0.0.1/tcp/{port}",
                     "--model.cache_dir", str(cache), timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"sapo: config error: p2p.listen: cannot listen on /ip4/127.0.0.1/tcp/{port}")
    assert not cache.exists()


def test_a_corrupt_key_is_refused_before_the_model_loads_and_kept(tmp_path):
    key = tmp_path / "node.key"
    key.write_bytes(b"not a key")
    r = run_sapo("run", "--out", str(tmp_path), "--model.cache_dir", str(tmp_path / "cache"), timeout=60)
    assert r.returncode == 2 and "config error: p2p.key_file:" in r.stderr, r.stderr
    assert key.read_bytes() == b"not a key" and not (tmp_path / "cache").exists()


def test_an_out_dir_that_cannot_be_created_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    cfg = load_config(overrides={"run": {"out_dir": str(tmp_path / "file" / "run")}})
    with pytest.raises(ConfigError, match=r"^run.out_dir: cannot create .*file/run"):
        preflight.check(cfg)
    cfg = load_config(overrides={"run": {"out_dir": str(tmp_path / "file")}})
    with pytest.raises(ConfigError, match=rf"^run.out_dir: {tmp_path / 'file'} is a file, not a folder$"):
        preflight.check(cfg)


def test_a_swarm_whose_out_is_a_file_says_so_in_one_line(tmp_path):
    """`sapo swarm --out FILE` printed mkdir's traceback after planning its nodes."""
    (tmp_path / "file").write_text("kept")
    r = run_sapo("swarm", "--nodes", "2", "--rounds", "1", "--out", str(tmp_path / "file"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"sapo: config error: --out: {tmp_path / 'file'} is a file, not a folder")
    assert "Traceback" not in r.stderr and (tmp_path / "file").read_text() == "kept"


@pytest.mark.parametrize("name, says", [
    ("/nonexistent", "no such folder: /nonexistent"),
    ("./models/tiny-bb/", "no such folder: ./models/tiny-bb/ (did you mean tiny-b?"),
    ("smollm2-135", "'smollm2-135' is not a preset or a folder, and the model hub is unreachable from here"),
])
def test_a_model_that_is_not_there_says_so_at_once_with_the_presets(name, says, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", OFFLINE["HF_ENDPOINT"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored afterwards, though model_problem sets it
    problem = preflight.model_problem(name, tmp_path)
    assert problem is not None and says in problem and "presets: tiny-a, tiny-b, smollm2-135m" in problem
    if name == "smollm2-135":
        assert "did you mean smollm2-135m?" in problem


def test_a_folder_that_holds_no_model_is_named(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    assert "has no config.json" in preflight.model_problem(str(tmp_path), tmp_path)
    assert "is a file" in preflight.model_problem(str(tmp_path / "weights.bin"), tmp_path)


def test_a_model_folder_with_no_tokenizer_is_named(tmp_path, tiny_a):
    """An empty tokenizer loaded; generation then failed for half a minute and left a checkpoint of it."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_a, folder, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json"))
    assert preflight.model_problem(str(folder), tmp_path) == (
        f"{folder} holds no tokenizer (tokenizer.json, tokenizer_config.json, ...): copy the model's tokenizer files into it")


def test_presets_folders_and_a_reachable_hub_pass(tmp_path, tiny_a, monkeypatch):
    assert preflight.model_problem("tiny-b", tmp_path) is None  # a preset is built when it is needed
    assert preflight.model_problem(str(tiny_a), tmp_path) is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored afterwards, though model_problem sets it
    with busy_port() as hub:  # something answers there: the hub counts as reachable and has the last word
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.getsockname()[1]}")
        assert preflight.hub_reachable(1.0) and preflight.model_problem("org/model", tmp_path) is None
    assert not preflight.hub_reachable(1.0)  # now nothing listens there


def test_a_typo_in_the_cli_fails_in_one_line_with_no_hub_retries(tmp_path):
    r = run_sapo("run", "--model", "smollm2-135", "--out", str(tmp_path), env=OFFLINE, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "sapo: config error: model.name: 'smollm2-135' is not a preset or a folder, and the model hub is unreachable "
        "from here, so it cannot be fetched (did you mean smollm2-135m? presets: tiny-a, tiny-b, smollm2-135m, gemma3-270m; or a "
        "local model folder)"]


@pytest.mark.slow
def test_a_hub_model_downloaded_before_runs_with_no_network(tmp_path, tiny_a):
    """A hub id found in the local hub cache loads offline (no minute of retries first)."""
    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / "0123abc"
    shutil.copytree(tiny_a, snapshot)
    (tmp_path / "hub" / "models--someone--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny" / "refs" / "main").write_text("0123abc")
    r = run_sapo("run", "--model", "someone/tiny", "--out", str(tmp_path / "out"), "--rounds", "1",
                 "--p2p.enabled", "false", "--tasks.eval_size", "4",
                 env={**OFFLINE, "HF_HUB_CACHE": str(tmp_path / "hub")}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in rows] == [0, 1]


def test_a_node_goes_on_holding_the_lock_its_launcher_took_on_its_folder(tmp_path, monkeypatch):
    """docker/entrypoint.sh claims a slot with the lock every node takes on its folder and execs the node, which
    inherits the descriptor: the node adopts it (refusing it would refuse itself), and it stays exclusive."""
    import fcntl
    import os

    claimed = os.open(tmp_path / preflight.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(claimed, fcntl.LOCK_EX | fcntl.LOCK_NB)
    monkeypatch.setenv(preflight.LOCK_FD_ENV, str(claimed))
    assert preflight.lock_out_dir(tmp_path) == claimed
    assert (tmp_path / preflight.LOCK_FILE).read_text() == f"{os.getpid()}\n"
    assert preflight.LOCK_FD_ENV not in os.environ  # handed down once, not to the node's own children
    with pytest.raises(ConfigError, match=rf"is in use by another node \(pid {os.getpid()}\)"):
        preflight.lock_out_dir(tmp_path)  # any other descriptor of the folder's lock is refused
    os.close(claimed)


@pytest.mark.parametrize("handed", ["other-file", "closed", "not-a-number"])
def test_a_lock_descriptor_that_is_not_this_folders_is_not_adopted(handed, tmp_path, monkeypatch):
    import os

    other = os.open(tmp_path / "other.lock", os.O_RDWR | os.O_CREAT)
    value = {"other-file": str(other), "closed": "987", "not-a-number": "x"}[handed]
    monkeypatch.setenv(preflight.LOCK_FD_ENV, value)
    own = preflight.lock_out_dir(tmp_path)
    assert own != other and os.path.samestat(os.fstat(own), os.stat(tmp_path / preflight.LOCK_FILE))
    os.close(own)
    os.close(other)


@pytest.mark.parametrize("name, folder", [("checkpoints", False), ("metrics.jsonl", True), (".node.lock", True),
                                          ("config.json", True)])
def test_a_run_file_of_the_wrong_kind_is_named_before_any_round(name, folder, tmp_path):
    """A `checkpoints` file was found only when the first checkpoint was written, after the rounds before it
    (and it read as a fresh start, setting every earlier metrics line aside); a folder in place of
    metrics.jsonl or the lock ended the node in a traceback."""
    (tmp_path / name).mkdir() if folder else (tmp_path / name).write_text("")
    cfg = load_config(overrides={"run": {"out_dir": str(tmp_path)}, "p2p": {"enabled": False}, "status": {"enabled": False}})
    with pytest.raises(ConfigError) as e:
        preflight.check(cfg, model=False)
    kind = "folder, where the node writes a file" if folder else "file, where the node keeps its checkpoints in a folder"
    assert str(e.value) == f"run.out_dir: {tmp_path / name} is a {kind} of that name: move it aside"


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_run_folder_is_refused_not_taken_as_the_current_one(value, tmp_path, monkeypatch):
    """`SAPO_RUN__OUT_DIR=$UNSET` (or `out_dir = ""` in a file) wrote a node's files into the current folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SAPO_RUN__OUT_DIR", value)
    with pytest.raises(ConfigError) as e:
        load_config()
    assert str(e.value).startswith("run.out_dir: empty: name the folder ('.' for the current one)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, mode", [("metrics.jsonl", 0o444), ("checkpoints", 0o555)])
def test_a_run_file_that_cannot_be_written_is_named_before_any_round(name, mode, tmp_path):
    """A read-only metrics.jsonl ended the node in a traceback after its first round, and a read-only
    checkpoints/ lost every round up to the first checkpoint."""
    import os
    import subprocess
    import sys

    path = tmp_path / name
    path.mkdir() if name == "checkpoints" else path.write_text("")
    path.chmod(mode)
    prefix = []
    if os.geteuid() == 0:  # root writes anything: drop the capability that lets it
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv (util-linux)")
        prefix = ["setpriv", "--inh-caps=-all", "--bounding-set", "-dac_override,-dac_read_search", "--"]
    r = subprocess.run([*prefix, sys.executable, "-m", "node.cli", "run", "--out", str(tmp_path), "--p2p.enabled", "false",
                        "--status.enabled", "false"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    path.chmod(0o755)
    assert r.returncode == 2 and r.stderr.strip() == f"sapo: config error: run.out_dir: {path} is not readable and writable by this user"
