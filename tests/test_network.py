"""Network profiles: shipped ones, profile files, and the errors a bad one gives."""

import pytest

from p2p.config import P2PConfig
from p2p.network import load_network, shipped_networks
from tests.conftest import run_sapo

PEER = "/ip4/203.0.113.7/tcp/7420/p2p/12D3KooWCwo9DoPXxg3dgbm9P6fgLrgmssKyUAjHBjqUBMn4FAdh"


def write(tmp_path, text):
    path = tmp_path / "net.toml"
    path.write_text(text)
    return str(path)


def test_local_and_testnet_ship_and_name_their_topics():
    assert {"local", "testnet"} <= set(shipped_networks())
    assert P2PConfig().rollout_topic_base() == "/sapo/local/rollouts/3"
    cfg = P2PConfig(network="testnet")
    assert cfg.rollout_topic_base() == "/sapo/testnet/rollouts/3"
    assert cfg.peer_exchange_protocol() == "/sapo/testnet/peers/1.0.0"
    assert load_network("testnet").protocol == 3


def test_a_profile_file_adds_its_bootstrap_peers_after_the_given_ones(tmp_path):
    other = PEER.replace("203.0.113.7", "203.0.113.8")
    path = write(tmp_path, f'namespace = "lab"\nprotocol = 3\nbootstrap = ["{PEER}", "{other}"]\n')
    cfg = P2PConfig(network=path, bootstrap=[other])
    assert cfg.rollout_topic_base() == "/sapo/lab/rollouts/3"
    assert cfg.bootstrap_peers() == [other, PEER]


@pytest.mark.parametrize("text, message", [
    ('namespace = "lab"\nprotocol = 4\n', "speaks protocol 4; this sapo-node speaks 3 (upgrade sapo-node"),
    ('namespace = "lab"\nprotocol = 2\n', "speaks protocol 2; this sapo-node speaks 3 (an older network"),
    ('namespace = "Lab Net"\nprotocol = 3\n', "namespace: String should match pattern"),
    ('namespace = "lab"\nprotocol = 3\nbootstrap = ["/ip4/1.2.3.4/tcp/1"]\n', "has no /p2p/<peer id> part"),
    ('namespace = "lab"\nprotocol = 3\nbootstrp = []\n', "bootstrp: unknown setting (did you mean bootstrap?)"),
    ('namespace = "lab\n', "cannot read network profile"),
    ('namespace = "lab"\nprotocol = 3\nshard_epoch_s = -5\n',  # the field's value, not the file's name
     "shard_epoch_s: Input should be greater than or equal to 60 (got -5)"),
])
def test_a_bad_profile_file_names_the_problem(tmp_path, text, message):
    with pytest.raises(ValueError, match="network") as e:
        P2PConfig(network=write(tmp_path, text))
    assert message in str(e.value)


def test_network_flag_on_the_command_line(tmp_path):
    ok = run_sapo("config", "--network", "testnet")
    assert ok.returncode == 0 and '"network": "testnet"' in ok.stdout
    bad = run_sapo("config", "--network", "mainnet")
    assert bad.returncode == 2
    assert "p2p.network" in bad.stderr and "unknown network 'mainnet': choose local or testnet" in bad.stderr
    assert "Traceback" not in bad.stderr
    missing = run_sapo("config", "--network", str(tmp_path / "lab.toml"))
    assert missing.returncode == 2 and f"network profile file {tmp_path / 'lab.toml'} does not exist" in missing.stderr


def test_an_operators_bootstrap_list_takes_comments_and_names_a_bad_line(tmp_path):
    listing = tmp_path / "bootstrap.txt"
    other = PEER.replace("203.0.113.7", "203.0.113.8")
    listing.write_text(f"# testnet bootstrap\n{PEER}  # the first\n\n{other}\n")
    assert P2PConfig(network="testnet", bootstrap_file=listing).bootstrap_peers() == [PEER, other]
    listing.write_text(f"{PEER}\n/ip4/203.0.113.9/tcp/7420\n")
    with pytest.raises(ValueError, match=r"bootstrap.txt line 2: .*has no /p2p/<peer id> part"):
        P2PConfig(network="testnet", bootstrap_file=listing)


def test_a_bad_bootstrap_list_is_one_line_at_the_command_line(tmp_path):
    listing = tmp_path / "bootstrap.txt"
    listing.write_text("/ip4/203.0.113.9/tcp/7420\n")
    bad = run_sapo("config", "--network", "testnet", "--p2p.bootstrap_file", str(listing))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert f"{listing} line 1" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    env = run_sapo("config", env={"SAPO_P2P__BOOTSTRAP_FILE": str(tmp_path / "none.txt")})
    assert env.returncode == 2 and f"cannot read {tmp_path / 'none.txt'}" in env.stderr
