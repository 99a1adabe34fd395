"""`sapo doctor`: the machine, the network and the plan `sapo run` would choose, on this CPU and on described cards."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest

from node.doctor import dht_line, mdns_line, network, upnp_line
from p2p.config import P2PConfig
from tests.conftest import run_sapo
from tests.test_plan import QWEN
from trainer.plan import article

WIDE = {"COLUMNS": "400"}


def described_model(tmp_path, tiny_a, size: str):
    """A folder with a Qwen2.5 config.json and a tokenizer but no weights: all the planner reads."""
    folder = tmp_path / f"qwen2.5-{size}"
    shutil.copytree(tiny_a, folder, ignore=shutil.ignore_patterns("*.safetensors", "sapo_preset.json"))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **QWEN[size]}))
    return folder


def test_doctor_reports_the_machine_and_the_plan_for_this_cpu(tiny_a, cache_dir, tmp_path):
    r = run_sapo("doctor", "--model.cache_dir", str(cache_dir), "--out", str(tmp_path))  # piped, at rich's 80 columns
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in r.stdout.splitlines() if line.count("│") == 3}
    for row in ("cpu", "torch", "host memory", "cuda", "cpu bfloat16", "mps", "vllm", "peft (LoRA)", "bitsandbytes", "p2p.listen", "addresses",
                "DHT rendezvous", "mDNS (LAN)", "port mapping (UPnP, NAT-PMP)", "hole punching (DCUtR)"):
        assert row in rows, row
    # piped, the table keeps its own width: each row one line, not wrapped to 80 columns
    assert rows["cpu"].endswith(f"({os.cpu_count()} cores)") and not rows["cpu"].startswith("unknown")
    assert rows["host memory"].endswith("(what is available now, less a margin for the rest of the machine)")
    assert "its speed on a GPU is unmeasured" in rows["vllm"]  # whether or not it is installed here
    assert "plan for tiny-a: cpu (" in r.stdout and "full fine-tuning, micro-batch 8;" in r.stdout  # the fastest on a CPU
    assert "a node with no run.memory_gb plans in " in r.stdout
    assert not (tmp_path / "node.key").exists()  # it inspects; it creates nothing
    assert rows["DHT rendezvous"].startswith("off: the local network profile lists no DHT peers")
    assert rows["hole punching (DCUtR)"].startswith("on: a peer reached through a relay is punched")


DHT_PEER = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWNm6CjiRDYcvCyd7yRpUp8zBmJhJWAsQ6aDiezxFwCM8o"


@pytest.mark.parametrize("p2p, words", [({"network": "testnet"}, "on: provides and looks up the network's key from 5 DHT "
                                         "peers (the testnet network profile)"),
                                        ({"dht_bootstrap": [DHT_PEER]}, "from 1 DHT peers (--p2p.dht_bootstrap)"),
                                        ({"network": "testnet", "dht": False}, "off (--p2p.dht false)")])
def test_doctor_says_whether_and_from_where_the_node_looks_its_network_up_on_a_dht(p2p, words):
    assert words in dht_line(SimpleNamespace(p2p=P2PConfig(**p2p)))


@pytest.mark.parametrize("p2p, words", [({"listen": ["/ip4/127.0.0.1/tcp/7420"]}, "off: the node listens on no LAN address"),
                                        ({"listen": ["/ip4/192.168.1.20/tcp/7420"]}, "on: announces /ip4/192.168.1.20/tcp/7420"),
                                        ({"mdns": False}, "off (--p2p.mdns false)")])
def test_doctor_says_whether_the_node_announces_itself_on_the_lan(p2p, words):
    assert words in mdns_line(SimpleNamespace(p2p=P2PConfig(**p2p)))


@pytest.mark.parametrize("p2p, words", [({"listen": ["/ip4/192.168.1.20/tcp/7420"]}, "on: asks the LAN's router (UPnP, else NAT-PMP) to forward "
                                         "port 7420 to this machine's address on the router's network"),
                                        ({"listen": ["/ip4/127.0.0.1/tcp/7420"]}, "off: the node listens on no private"),
                                        ({"upnp": False}, "off (--p2p.upnp false)")])
def test_doctor_says_whether_the_node_asks_the_router_for_its_port(p2p, words):
    assert words in upnp_line(SimpleNamespace(p2p=P2PConfig(**p2p)))


@pytest.mark.parametrize("card, expect", [(8, "bfloat16 weights, LoRA"), (80, "float32 weights, full fine-tuning")])
def test_doctor_plans_for_a_described_card(card, expect, tiny_a, tmp_path):
    model = described_model(tmp_path, tiny_a, "0.5B")
    r = run_sapo("doctor", "--model", str(model), "--card", str(card), "--generation.max_new_tokens", "512",
                 "--out", str(tmp_path / "out"), env=WIDE)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"cuda ({article(card)} {card:g} GB CUDA card, {card:.1f} GB free): transformers backend, {expect}" in r.stdout
    assert "expected peak" in r.stdout and "why:" in r.stdout


def test_doctor_plans_a_described_card_within_the_nodes_share_as_run_would(tiny_a, tmp_path):
    model = described_model(tmp_path, tiny_a, "0.5B")
    r = run_sapo("doctor", "--model", str(model), "--card", "80", "--run.memory_gb", "8",
                 "--generation.max_new_tokens", "512", env=WIDE)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "cuda (an 80 GB CUDA card, this node's share 8 GB, 8.0 GB free): transformers backend, bfloat16 weights, LoRA" in r.stdout


def test_doctor_says_what_a_card_too_small_would_need(tiny_a, tmp_path):
    model = described_model(tmp_path, tiny_a, "7B")
    r = run_sapo("doctor", "--model", str(model), "--card", "8", "--generation.max_new_tokens", "512",
                 "--out", str(tmp_path / "out"), env=WIDE)
    assert r.returncode == 1
    assert "no plan fits:" in r.stdout and "use a device with " in r.stdout and "(this one has 7.6B)" in r.stdout


@pytest.mark.parametrize("args, error", [
    (["--card", "-3"], "--card: GB must be a finite number above 0 (got -3.0)"),
    (["--card", "nan"], "--card: GB must be a finite number above 0 (got nan)"),
    (["--card", "inf"], "--card: GB must be a finite number above 0 (got inf)"),
    (["--card", "24", "--model.device", "cpu"], "--card describes a CUDA card, and model.device is cpu: drop one of them"),
    (["--card", "8", "--run.memory_gb", "12"], "run.memory_gb 12 is more than the 8 GB card --card describes"),
    (["--bench", "--bench-timeout", "-5"], "--bench-timeout: seconds must be a finite number above 0 (got -5.0)"),
    # the JSON's place is checked before the runs, which take minutes, not after them
    (["--bench", "--bench-out", "{file}/bench.json"], "--bench-out: {file} is a file, not a folder"),
    (["--bench", "--bench-out", "{tmp}"], "--bench-out: {tmp} is a folder; name the JSON file to write"),
])
def test_doctor_refuses_bad_flags_in_one_line(args, error, tmp_path):
    (tmp_path / "file").write_text("")
    fill = {"file": tmp_path / "file", "tmp": tmp_path}
    r = run_sapo("doctor", *(a.format(**fill) for a in args))
    assert r.returncode == 2 and r.stderr.strip() == "sapo: config error: " + error.format(**fill)


def test_doctor_bench_runs_real_rounds_and_compares_the_peak_with_the_plan(tiny_a, cache_dir, tmp_path):
    from node.bench import judge

    out = tmp_path / ("a-folder-whose-name-outruns-a-terminal-line-" * 2) / "bench.json"  # printed unbroken, created
    r = run_sapo("doctor", "--bench", "--bench-rounds", "3", "--bench-out", str(out), "--model.cache_dir", str(cache_dir),
                 "--run.torch_threads", "1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["model"] == "tiny-a" and report["machine"]["cuda"].startswith("none")
    assert [b["backend"] for b in report["backends"]] == ["transformers"]  # vLLM is not installed in this stage
    (b,) = report["backends"]
    assert b["ok"] and b["rounds"] == 3 and b["steady_rounds"] == [2]  # round 1 warms up, round 3 evaluates
    assert b["rounds_per_minute"] > 0 and b["generate_s"] > 0 and b["train_s"] > b["push_s"] >= 0  # nothing to copy
    assert b["micro_batch"] == [b["plan"]["micro_batch"]] * 3 and "--run.torch_threads" in b["command"]
    assert b["planned_peak_gb"] == b["plan"]["peak_gb"] > 0 and b["peak_gb"] > 0
    assert b["verdict_line"].startswith(judge(b["peak_gb"], b["planned_peak_gb"]).line)
    assert b["groups_per_round"] == 8 and b["completions_per_group"] == 8  # alone, a node fills the external slots
    assert 0 <= b["groups_trained_per_round"] <= b["groups_per_round"]
    assert 0 < b["tokens_per_completion"] <= b["max_new_tokens"]
    assert f"transformers: {b['verdict_line']}" in " ".join(r.stdout.split())
    assert f"saved {out}" in r.stdout and "Traceback" not in r.stdout + r.stderr


def test_doctor_bench_reports_a_run_that_fails_in_one_line_with_its_log(tmp_path):
    out = tmp_path / "bench.json"
    r = run_sapo("doctor", "--bench", "--model", str(tmp_path / "no-such-model"), "--bench-out", str(out))
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    (b,) = json.loads(out.read_text())["backends"]
    assert not b["ok"] and b["error"].startswith("exited with 2: sapo: config error: model.name:")
    assert any("no-such-model" in line for line in b["log_tail"])
    assert "transformers: failed: exited with 2: sapo: config error: model.name:" in " ".join(r.stdout.split())


def test_doctor_bench_stops_a_backend_that_runs_past_its_time(tiny_a, cache_dir, tmp_path):
    out = tmp_path / "bench.json"
    r = run_sapo("doctor", "--bench", "--bench-timeout", "1", "--bench-out", str(out), "--model.cache_dir", str(cache_dir))
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    (b,) = json.loads(out.read_text())["backends"]
    assert not b["ok"] and b["error"] == "not done within 1 s" and b["seconds"] < 120
    assert "transformers: failed: not done within 1 s" in r.stdout


def test_doctor_bench_refuses_too_few_rounds_in_one_line():
    r = run_sapo("doctor", "--bench", "--bench-rounds", "2")
    assert r.returncode == 2 and r.stderr.strip().startswith("sapo: config error: --bench-rounds: at least 3")


@pytest.mark.parametrize("peak, kind, words", [(1.5, "under", "past the 1.00 GB it planned (+50%)"),
                                               (0.3, "over", "a round peaked at 0.30 GB, 30% of the 1.00 GB planned: below the plan by design"),
                                               (0.8, "held", "the plan held: peak 0.80 GB of the 1.00 GB planned"),
                                               (None, "unknown", "cannot be read")])
def test_bench_verdict_says_plainly_which_way_the_plan_was_wrong(peak, kind, words):
    from node.bench import judge

    v = judge(peak, 1.0)
    assert v.kind == kind and words in v.line


@pytest.mark.slow
def test_a_gpt2_folder_is_planned_by_doctor_and_trained_by_run(tiny_a, cache_dir, tmp_path):
    """GPT-2's config names its widths n_embd, n_layer and n_head: the planner read Llama's names only (KeyError)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    tokenizer = AutoTokenizer.from_pretrained(tiny_a)
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=len(tokenizer), n_positions=256,
                               bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    doctor = run_sapo("doctor", "--model", str(folder), env=WIDE)
    assert doctor.returncode == 0 and "Traceback" not in doctor.stderr, doctor.stderr[-2000:]
    assert f"plan for {folder}: cpu (" in doctor.stdout and "what " in doctor.stdout
    r = run_sapo("run", "--model", str(folder), "--out", str(tmp_path / "out"), "--rounds", "2", "--local", "2",
                 "--tasks.eval_size", "10", "--p2p.enabled", "false")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "settings.json").read_text())["profile"] == "tiny"  # 0.1M parameters: a toy


def test_doctor_names_addresses_private_as_the_node_counts_them():
    """CGNAT's 100.64/10 is behind a NAT (Python's is_private says no); 198.18/15, a benchmarking range, is not a
    home network (Python's says yes): doctor followed Python where the node's port mapping and relays do not."""
    rows = dict(network(SimpleNamespace(p2p=P2PConfig(listen=["/ip4/100.64.1.2/tcp/7420", "/ip4/198.18.0.2/tcp/7420"]))))
    assert "/ip4/100.64.1.2/tcp/7420 private" in rows["addresses"] and "/ip4/198.18.0.2/tcp/7420 public" in rows["addresses"]
