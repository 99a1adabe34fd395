"""A 4-bit (NF4) frozen base under LoRA adapters, through bitsandbytes' CPU backend: what lets a 12 GB card
train a 7B model. The planner's side is arithmetic (tests/test_plan.py); here the real model on this CPU."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.conftest import run_sapo
from trainer.config import ModelConfig
from trainer.policy import ModelLoadError, load_policy

# 4 groups of 6 completions of up to 24 tokens: enough for the untuned model to answer some tasks right and
# others wrong, so that steps carry a gradient (with 8 tokens every reward was 0 and the adapters stayed at zero).
# The seed is fixed: with p2p on it comes from a fresh key, and one CI run drew two rounds whose every group was
# uniform, so nothing trained (seed 0 trains 2 of 4 groups in each of its first two rounds)
SMALL_ROUND = ["--local", "4", "--external", "0", "--generation.completions_per_group", "6",
               "--generation.max_new_tokens", "24", "--tasks.eval_size", "2", "--run.eval_every", "1",
               "--run.seed", "0", "--p2p.enabled", "false"]


def test_a_quantized_base_without_adapters_or_on_vllm_is_refused_in_one_line(tmp_path):
    r = run_sapo("run", "--out", str(tmp_path / "a"), "--model.quantize", "nf4", "--model.lora.enabled", "false")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "quantize nf4 freezes the base in 4 bits: it needs model.lora.enabled true or auto" in r.stderr.splitlines()[-1]
    r = run_sapo("run", "--out", str(tmp_path / "b"), "--model.quantize", "nf4", "--generation.backend", "vllm")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "model.quantize nf4 runs on the transformers backend" in r.stderr.splitlines()[-1]


def test_without_bitsandbytes_the_error_names_the_extra(tiny_a, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"needs bitsandbytes: pip install -e '\.\[quant\]'"):
        load_policy(ModelConfig(name=str(tiny_a), quantize="nf4", lora={"enabled": True}))
    with pytest.raises(ModelLoadError, match="it trains LoRA adapters only"):  # "auto" outside the planner is off
        load_policy(ModelConfig(name=str(tiny_a), quantize="nf4"))


@pytest.mark.parametrize("asked, absent, says", [
    ({"quantize": "nf4"}, ("bitsandbytes", "peft"), "model.quantize nf4 needs peft and bitsandbytes: pip install -e '.[quant]'"),
    ({"quantize": "nf4"}, ("bitsandbytes",), "model.quantize nf4 needs bitsandbytes: pip install -e '.[quant]'"),
    ({"lora": {"enabled": True}}, ("peft",), "model.lora.enabled needs peft: pip install -e '.[lora]'"),
])
def test_adapters_or_a_quantized_base_without_their_packages_are_refused_before_a_plan_is_made(tiny_a, monkeypatch, caplog,
                                                                                             asked, absent, says):
    import importlib.util
    import logging

    from node import planner
    from node.config import load_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a))
    cfg = load_config(None, {"model": {"name": str(tiny_a), **asked}})
    with caplog.at_level(logging.INFO), pytest.raises(ModelLoadError) as refused:
        planner.fit(cfg)
    assert str(refused.value) == f"{says} in the sapo-node checkout"
    assert not any("plan" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
@pytest.mark.untimed  # one node that waits on no peer: its only limit is a generous timeout
def test_smollm2_on_an_nf4_base_trains_its_adapters_generates_checkpoints_and_resumes(request, cache_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from tests.conftest import cached_preset

    cached_preset(request, "smollm2-135m")
    run = ["run", "--model", "smollm2-135m", "--model.cache_dir", str(cache_dir), "--out", str(tmp_path),
           "--model.quantize", "nf4", *SMALL_ROUND]
    first = run_sapo(*run, "--rounds", "2", timeout=900)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "base in NF4" in first.stderr and "LoRA on an NF4 base" in first.stderr
    rows = metrics(tmp_path)
    assert sum(m["groups_trained"] for m in rows) > 0 and rows[-1]["tokens_generated"] > 0
    adapters = tmp_path / "checkpoints" / "round-000002" / "model"
    assert json.loads((adapters / "adapter_config.json").read_text())["r"] == 16
    assert not (adapters / "model.safetensors").exists()  # the base is never saved: it is the preset's
    trained = load_file(adapters / "adapter_model.safetensors")
    assert any("lora_B" in k and t.abs().sum() > 0 for k, t in trained.items())  # B starts at zero: a step moved it

    second = run_sapo(*run, "--rounds", "3", timeout=900)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "round-000002 at round 2" in second.stderr, second.stderr[-2000:]  # "resumed from <ckpt> at round 2"
    later_rows = metrics(tmp_path)[len(rows):]
    assert [m["round"] for m in later_rows] == [3]
    assert later_rows[-1]["weight_version"] >= rows[-1]["weight_version"] > 0  # went on from the first run's weights
    later = load_file(tmp_path / "checkpoints" / "round-000003" / "model" / "adapter_model.safetensors")
    moved = any(not later[k].equal(trained[k]) for k in trained)
    assert moved == (sum(m["groups_trained"] for m in later_rows) > 0)  # resumed adapters, changed only by steps


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
