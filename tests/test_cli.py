"""`sapo config`: the config a node would run with, and the rates its step-size controller starts at and stays in."""

from __future__ import annotations

import json

from node.cli import main
from node.config import load_config
from tests.test_doctor import described_model


def test_config_says_the_rate_the_controller_starts_at_and_its_range_where_the_model_is_read(tiny_a, tmp_path, capsys):
    """A 0.5B folder: its rate by size, approached from a tenth of it and held within grpo.lr_range of it, which the
    JSON gives only as factors."""
    assert main(["config", "--model", str(described_model(tmp_path, tiny_a, "0.5B")), "--model.lora.enabled", "false"]) == 0
    out, err = capsys.readouterr()
    grpo = json.loads(out)["grpo"]
    lr, (low, high) = grpo["lr"], grpo["lr_range"]
    assert lr != load_config().grpo.lr and grpo["target_kl"]
    said = err.strip().splitlines()
    assert said[0].startswith("sapo config: with ") and said[1] == (
        f"sapo config: step size: adapts after every step toward a per-token KL of {grpo['target_kl']:g} between the "
        f"policy before and after it, from grpo.lr {lr:g} (approached from {lr / 10:g}) within {lr * low:g}-{lr * high:g}")
    assert main(["config", "--model", str(tmp_path / "none")]) == 0
    _, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"sapo config: as given, before the model's own settings (no such folder: "
                                        f"{tmp_path / 'none'}): its learning rate, step size, sampling and tasks below "
                                        "are the config's, not the model's; sapo doctor shows the model's"]


def test_the_first_rate_is_held_within_the_range_as_the_controller_holds_it():
    from node.doctor import step_size_line
    from trainer.config import GRPOConfig

    line = step_size_line(GRPOConfig(lr=1e-5, target_kl=0.005, lr_range=(0.5, 2.0)))
    assert line.endswith("from grpo.lr 1e-05 (approached from 5e-06) within 5e-06-2e-05")
