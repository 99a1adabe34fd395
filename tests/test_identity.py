"""The node's key file, `sapo id`, and the p2p config's address checks."""

from __future__ import annotations

import random
import stat

import pytest
from libp2p.crypto.secp256k1 import create_new_key_pair as new_secp256k1

from node.config import ConfigError, load_config
from p2p.identity import IdentityError, load, load_or_create, peer_id
from tests.conftest import run_sapo


def test_the_key_is_created_private_and_gives_the_same_peer_id_on_every_load(tmp_path):
    path = tmp_path / "sub" / "node.key"
    first = peer_id(load_or_create(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert first.startswith("12D3KooW")
    assert peer_id(load_or_create(path)) == peer_id(load(path)) == first
    assert list(path.parent.iterdir()) == [path]  # no temp file left behind


@pytest.mark.parametrize("content", [b"", b"garbage", random.Random(0).randbytes(36)])
def test_a_corrupt_key_file_is_an_error_and_is_never_replaced(tmp_path, content):
    path = tmp_path / "node.key"
    path.write_bytes(content)
    with pytest.raises(IdentityError, match="is not a libp2p private key"):
        load_or_create(path)
    assert path.read_bytes() == content


def test_an_unreadable_or_non_ed25519_key_is_an_error(tmp_path):
    (tmp_path / "dir.key").mkdir()
    with pytest.raises(IdentityError, match="cannot read key file"):
        load_or_create(tmp_path / "dir.key")
    other = tmp_path / "secp.key"
    other.write_bytes(new_secp256k1().private_key.serialize())
    with pytest.raises(IdentityError, match="Secp256k1 key; sapo uses Ed25519"):
        load(other)


def test_sapo_id_prints_a_stable_peer_id_and_full_multiaddrs(tmp_path):
    args = ("id", "--out", str(tmp_path), "--p2p.listen", "/ip4/127.0.0.1/tcp/7421",
            "--p2p.announce", "/dns4/node.example.org/tcp/7421")
    first, second = run_sapo(*args), run_sapo(*args)
    assert first.returncode == 0, first.stderr
    pid = first.stdout.splitlines()[0].removeprefix("peer id: ")
    assert pid == peer_id(load(tmp_path / "node.key"))
    assert f"/dns4/node.example.org/tcp/7421/p2p/{pid}" in first.stdout
    assert second.stdout == first.stdout


def test_sapo_id_with_a_corrupt_key_is_one_line_and_exit_1(tmp_path):
    (tmp_path / "node.key").write_bytes(b"junk")
    r = run_sapo("id", "--out", str(tmp_path))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"sapo: key file {tmp_path / 'node.key'} is not a libp2p private key (DecodeError); "
        "move it away to create a new identity (the peer id will change)"]


def test_a_key_that_cannot_be_created_is_one_line_and_exit_1(tmp_path):
    """`sapo id --out` a path that is a file, not a folder, printed mkdir's traceback."""
    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    with pytest.raises(IdentityError, match=rf"^cannot create key file {taken}/k: {taken} is not a folder$"):
        load_or_create(taken / "k")
    r = run_sapo("id", "--out", str(taken))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"sapo: cannot create key file {taken / 'node.key'}: {taken} is not a folder"]
    assert taken.read_text() == "not a folder" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("overrides, message", [
    ({"p2p": {"bootstrap": ["/ip4/127.0.0.1/tcp/1"]}}, "has no /p2p/<peer id> part"),
    ({"p2p": {"listen": ["127.0.0.1:7420"]}}, "not a multiaddr"),
    ({"p2p": {"network": "Has Spaces"}}, "p2p.network"),
    ({"p2p": {"limits": {"max_message_bytes": 2_000_000}}}, "p2p.limits.max_message_bytes"),
])
def test_bad_p2p_settings_are_config_errors_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_address_lists_accept_commas_from_the_environment(monkeypatch):
    monkeypatch.setenv("SAPO_P2P__LISTEN", "/ip4/127.0.0.1/tcp/1, /ip4/127.0.0.1/tcp/2")
    assert load_config().p2p.listen == ["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2"]


def test_an_unset_run_seed_is_the_keys_in_a_swarm_and_zero_for_a_node_alone(tmp_path, monkeypatch):
    """Compose replicas and two users on the defaults drew one stream of tasks and samples: every seed was 0."""
    import node.loop
    from node.loop import with_seed

    def seed(name, **run):
        (tmp_path / name).mkdir(exist_ok=True)
        p2p = {"enabled": name != "alone"}
        return with_seed(load_config(None, {"run": {"out_dir": str(tmp_path / name), **run}, "p2p": p2p})).run.seed

    first, restarted, other = seed("a"), seed("a"), seed("b")
    assert first == restarted != other  # a restart keeps its key's seed; another key draws another stream
    assert first == node.loop.seed_of(load(tmp_path / "a" / "node.key"))
    assert seed("alone") == 0 and not (tmp_path / "alone" / "node.key").exists()  # p2p off makes no key
    assert seed("b", seed=5) == 5
    monkeypatch.setattr(node.loop, "seed_of", lambda key: 7)  # tasks.eval_seed: the held-out set's stream
    assert seed("c") == 8
