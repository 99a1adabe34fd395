"""`sapo doctor`: the machine, the network and the plan `sapo run` would choose, on this CPU and on described cards."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import run_sapo
from tests.test_plan import QWEN

WIDE = {"COLUMNS": "400"}


def described_model(tmp_path, tiny_a, size: str):
    """A folder with a Qwen2.5 config.json and a tokenizer but no weights: all the planner reads."""
    folder = tmp_path / f"qwen2.5-{size}"
    shutil.copytree(tiny_a, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **QWEN[size]}))
    return folder


def test_doctor_reports_the_machine_and_the_plan_for_this_cpu(tiny_a, cache_dir, tmp_path):
    r = run_sapo("doctor", "--model.cache_dir", str(cache_dir), "--out", str(tmp_path), env=WIDE)
    assert r.returncode == 0, r.stderr[-2000:]
    for row in ("torch", "host memory", "cuda", "mps", "vllm", "peft (LoRA)", "p2p.listen", "addresses"):
        assert f"│ {row} " in r.stdout, row
    assert "plan for tiny-a: cpu (" in r.stdout and "full fine-tuning, micro-batch 8;" in r.stdout  # the fastest on a CPU
    assert "a node with no run.memory_gb plans in " in r.stdout
    assert not (tmp_path / "node.key").exists()  # it inspects; it creates nothing


@pytest.mark.parametrize("card, expect", [(8, "bfloat16 weights, LoRA"), (80, "float32 weights, full fine-tuning")])
def test_doctor_plans_for_a_described_card(card, expect, tiny_a, tmp_path):
    model = described_model(tmp_path, tiny_a, "0.5B")
    r = run_sapo("doctor", "--model", str(model), "--card", str(card), "--generation.max_new_tokens", "512",
                 "--out", str(tmp_path / "out"), env=WIDE)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"cuda (a {card:g} GB CUDA card, {card:.1f} GB free): transformers backend, {expect}" in r.stdout
    assert "expected peak" in r.stdout and "why:" in r.stdout


def test_doctor_says_what_a_card_too_small_would_need(tiny_a, tmp_path):
    model = described_model(tmp_path, tiny_a, "7B")
    r = run_sapo("doctor", "--model", str(model), "--card", "24", "--generation.max_new_tokens", "512",
                 "--out", str(tmp_path / "out"), env=WIDE)
    assert r.returncode == 1
    assert "no plan fits:" in r.stdout and "use a device with " in r.stdout and "(this one has 7.6B)" in r.stdout


def test_doctor_refuses_a_bad_card_in_one_line():
    r = run_sapo("doctor", "--card", "-3")
    assert r.returncode == 2 and r.stderr.strip() == "sapo: config error: --card: GB must be positive (got -3.0)"
