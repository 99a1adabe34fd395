"""What a node trains with where the user set nothing: by what its model is (node/recipes.py)."""

from __future__ import annotations

import json

import pytest

from node.config import load_config
from node.recipes import KNOBS, LR_ANCHORS, PRETRAINED, RECIPES, learning_rate, settle
from tests.conftest import run_sapo
from tests.test_doctor import WIDE, described_model
from trainer.presets import META_FILE


def settings_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """`sapo doctor`'s settings table: setting -> (value, from)."""
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in stdout.splitlines() if line.count("│") == 4]
    return {r[0]: (r[1], r[2]) for r in rows if r[0] != "setting"}


def test_a_real_models_recipe_fills_only_what_the_user_left_unset(tmp_path, monkeypatch):
    recipe = RECIPES["smollm2-135m"]
    settled = settle(load_config(overrides={"model": {"name": "smollm2-135m"}}), "smollm2-135m", 134.5e6)
    cfg = settled.cfg
    assert cfg.generation.temperature == recipe["generation"]["temperature"] and cfg.grpo.lr == recipe["grpo"]["lr"]
    assert [d.model_dump(exclude={"weight"}) for d in cfg.tasks.datasets] == recipe["tasks"]["datasets"]
    assert cfg.generation.completions_per_group == 8  # not in the recipe: the plain default
    assert settled.sources["grpo.lr"] == "recipe smollm2-135m" and not cfg.grpo.model_fields_set  # still not the user's
    monkeypatch.setenv("SAPO_GRPO__LR", "3e-6")
    config = tmp_path / "node.toml"
    config.write_text('[generation]\nmax_new_tokens = 200\n')
    mine = settle(load_config(config, {"model": {"name": "smollm2-135m"}, "generation": {"temperature": 1.0},
                                       "tasks": {"datasets": "arith"}}), "smollm2-135m", 134.5e6)
    assert (mine.cfg.generation.temperature, mine.cfg.generation.max_new_tokens, mine.cfg.grpo.lr) == (1.0, 200, 3e-6)
    assert [d.name for d in mine.cfg.tasks.datasets] == ["arith"] and mine.cfg.generation.top_p == recipe["generation"]["top_p"]
    assert {mine.sources[k] for k in ("grpo.lr", "generation.max_new_tokens", "tasks.datasets")} == {"user"}
    monkeypatch.delenv("SAPO_GRPO__LR")
    tiny = settle(load_config(overrides={"model": {"name": "tiny-a"}}), "tiny-a", 0.33e6)
    assert tiny.profile == "tiny" and tiny.cfg.generation.temperature == 1.0 and tiny.cfg.grpo.lr == 2e-4


@pytest.mark.parametrize("preset", sorted(RECIPES))
def test_every_recipe_sets_every_knob_so_no_real_model_is_left_a_tiny_default(preset):
    """A recipe that left out the learning rate would hand a real model the tiny presets' 2e-4."""
    settled = settle(load_config(overrides={"model": {"name": preset}}), preset, 1e8)
    assert settled.profile == f"recipe {preset}"
    assert {k: v for k, v in settled.sources.items() if v != settled.profile} == {}
    assert settled.cfg.grpo.lr <= 1e-5 and settled.cfg.generation.temperature < 1.0


def test_a_folder_made_from_a_preset_is_that_preset_and_a_small_unknown_model_is_a_toy(tmp_path):
    made = tmp_path / "smollm2"
    made.mkdir()
    (made / META_FILE).write_text(json.dumps({"preset": "smollm2-135m", "parameters": 134_515_008}))
    by_path = settle(load_config(overrides={"model": {"name": str(made)}}), str(made), 134.5e6)
    assert by_path.profile == "recipe smollm2-135m" and by_path.cfg.grpo.lr == 1e-5
    assert settle(load_config(overrides={"model": {"name": str(made)}}), str(made), 494e6).profile == "pretrained"  # another model in a preset's folder
    toy = settle(load_config(overrides={"model": {"name": str(tmp_path)}}), str(tmp_path), 2e6)
    assert toy.profile == "tiny" and toy.cfg.generation.max_new_tokens == 16


def test_the_learning_rate_falls_with_size_through_its_anchors_and_lora_takes_ten_times_it():
    for parameters, lr in LR_ANCHORS:
        assert learning_rate(parameters, False) == pytest.approx(lr)
    sizes = [1e6, 30e6, 135e6, 360e6, 494e6, 1.5e9, 7e9, 70e9]
    rates = [learning_rate(n, False) for n in sizes]
    assert rates == sorted(rates, reverse=True) and rates[-1] == rates[-2]  # flat past the largest anchor
    assert 1e-6 < learning_rate(494e6, False) < 1e-5  # a 0.5B model: between TRL's default and genrl's
    assert learning_rate(494e6, True) == pytest.approx(10 * learning_rate(494e6, False))


def test_a_pretrained_model_by_path_gets_settings_by_its_size_and_doctor_says_where_each_came_from(tiny_a, tmp_path):
    model = described_model(tmp_path, tiny_a, "0.5B")  # a Qwen2.5-0.5B config and a tokenizer: what the planner reads
    r = run_sapo("doctor", "--model", str(model), "--card", "80", env=WIDE)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = settings_rows(r.stdout)
    assert rows["grpo.lr"] == (f"{learning_rate(494e6, False):g}", "model size (494M parameters, full fine-tuning)")
    assert rows["generation.temperature"] == ("0.7", "pretrained")
    assert rows["generation.max_new_tokens"] == (str(PRETRAINED["generation"]["max_new_tokens"]), "pretrained")
    assert rows["tasks.datasets"] == ("rg/basic_arithmetic, rg/products, arith", "pretrained")
    lora = run_sapo("doctor", "--model", str(model), "--card", "6", "--grpo.lr", "3e-6", env=WIDE)
    assert lora.returncode == 0, lora.stderr[-2000:]
    assert "LoRA" in lora.stdout and settings_rows(lora.stdout)["grpo.lr"] == ("3e-06", "user")
    lora_lr = run_sapo("doctor", "--model", str(model), "--card", "6", env=WIDE)
    assert settings_rows(lora_lr.stdout)["grpo.lr"][1] == "model size (494M parameters, LoRA)"


def test_config_prints_what_a_folder_trains_with_and_as_given_what_its_sources_say(tiny_a, tmp_path):
    """`sapo config` is read to see what will run: a 0.5B folder's rate by its size and the plan's choice of full
    fine-tuning or LoRA, not the tiny presets' 2e-4 it has before the model is read."""
    model = described_model(tmp_path, tiny_a, "0.5B")
    r = run_sapo("config", "--model", str(model), env=WIDE)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads(r.stdout)
    lora = cfg["model"]["lora"]["enabled"]
    assert lora in (True, False) and cfg["grpo"]["lr"] == pytest.approx(learning_rate(494e6, lora))
    assert cfg["generation"]["temperature"] == PRETRAINED["generation"]["temperature"]
    assert "own settings and this machine's plan" in r.stderr
    given = run_sapo("config", "--model", str(model), "--as-given", env=WIDE)
    assert given.returncode == 0 and json.loads(given.stdout)["grpo"]["lr"] == load_config().grpo.lr != cfg["grpo"]["lr"]
    missing = run_sapo("config", "--model", str(tmp_path / "none"))
    assert missing.returncode == 0 and json.loads(missing.stdout)["model"]["name"] == str(tmp_path / "none")
    assert missing.stderr.strip().splitlines() == [f"sapo config: as given, before the model's own settings (no such "
                                                   f"folder: {tmp_path / 'none'}): its learning rate, step size, sampling "
                                                   "and tasks below are the config's, not the model's; sapo doctor shows "
                                                   "the model's"]


def test_a_derived_completion_length_is_halved_until_the_plan_fits_and_a_users_is_not(tiny_a, tmp_path):
    from node.planner import fit
    from trainer.memory import MemoryPlanError
    from trainer.plan import Device

    model = described_model(tmp_path, tiny_a, "7B")
    card = Device.card(12)
    cfg = load_config(overrides={"model": {"name": str(model)}, "generation": {"batch_size": 64},
                                 "run": {"local_groups": 16}})
    fitted = fit(cfg, card)
    assert fitted.cfg.generation.max_new_tokens < PRETRAINED["generation"]["max_new_tokens"]
    assert any("generation.max_new_tokens" in why for why in fitted.plan.why)
    assert fitted.settled.sources["generation.max_new_tokens"] == "pretrained, halved until the plan fits"
    asked = load_config(overrides={"model": {"name": str(model)}, "generation": {"batch_size": 64, "max_new_tokens": 256},
                                   "run": {"local_groups": 16}})
    with pytest.raises(MemoryPlanError):
        fit(asked, card)


def test_the_paper_mix_is_nine_reasoning_gym_families_by_name():
    cfg = load_config(overrides={"tasks": {"datasets": "paper"}})
    assert len(cfg.tasks.datasets) == 9 and all(d.name.startswith("rg/") for d in cfg.tasks.datasets)
    mixed = load_config(overrides={"tasks": {"datasets": "arithmetic:2,reverse"}})
    assert [(d.name, d.weight) for d in mixed.tasks.datasets] == [
        ("rg/basic_arithmetic", 2), ("rg/products", 2), ("arith", 2), ("reverse", 1)]


def test_a_recipes_rate_is_scaled_for_lora_and_a_users_is_not():
    from node.recipes import settle_lr

    recipe = settle(load_config(overrides={"model": {"name": "smollm2-135m"}}), "smollm2-135m", 134.5e6)
    assert settle_lr(recipe, lora=True).cfg.grpo.lr == 1e-4
    assert recipe.sources["grpo.lr"] == "recipe smollm2-135m, x10 under LoRA"
    mine = settle(load_config(overrides={"model": {"name": "smollm2-135m"}, "grpo": {"lr": 3e-5}}), "smollm2-135m", 134.5e6)
    assert settle_lr(mine, lora=True).cfg.grpo.lr == 3e-5
    tiny = settle(load_config(), "tiny-a", 0.33e6)
    assert settle_lr(tiny, lora=True).cfg.grpo.lr == 2e-4


def test_every_setting_a_profile_sets_is_one_doctor_shows():
    for values in [PRETRAINED, *RECIPES.values()]:
        assert all(set(fields) <= set(KNOBS[section]) for section, fields in values.items())


def test_gemmas_rate_is_the_one_its_check_ended_highest_with_and_its_sizes_rate_collapsed_it():
    """docs/bench/gemma-lr-2cpu: Gemma 3 270M alone for 40 rounds at three rates, one seed; expected held-out accuracy
    at its start and end. The recipe takes the best; the rate its size would give fell below where it started."""
    from tests.conftest import ROOT

    def ends(folder):
        evals = [row["eval_expected"] for row in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
                 if row.get("eval_expected") is not None]
        return evals[0], evals[-1]

    runs = {float(f.name.removeprefix("lr").removesuffix("-seed0")): ends(f)
            for f in sorted((ROOT / "docs/bench/gemma-lr-2cpu").iterdir())}
    assert len(runs) == 3 and len({start for start, _ in runs.values()}) == 1  # one start, evaluated once
    assert RECIPES["gemma3-270m"]["grpo"]["lr"] == max(runs, key=lambda lr: runs[lr][1])
    start, end = runs[float(f"{learning_rate(268.1e6, False):.2g}")]
    assert end < start / 1.5


def test_a_folder_of_a_recipes_architecture_gets_that_recipe_and_says_why(tmp_path):
    """A user's own download of Gemma 3 270M (no sapo_preset.json) is the model the recipe was measured on: its
    size's rate (6.7e-6) collapsed it where the recipe's 1e-6 learned."""
    from node.recipes import ARCHITECTURES, TARGET_KL

    folder = str(tmp_path)
    gemma = {**ARCHITECTURES["gemma3-270m"], "num_attention_heads": 4, "max_position_embeddings": 32768}
    settled = settle(load_config(overrides={"model": {"name": folder}}), folder, 268.1e6, gemma)
    assert settled.profile == "recipe gemma3-270m" and settled.cfg.grpo.lr == 1e-6
    assert settled.cfg.generation.max_new_tokens == 64 and settled.cfg.grpo.target_kl == TARGET_KL
    assert "gemma3_text, 18 layers 640 wide" in settled.why
    wider = {**gemma, "hidden_size": 1152}  # another Gemma 3: the size rule, and the controller from it
    other = settle(load_config(overrides={"model": {"name": folder}}), folder, 1e9, wider)
    assert other.profile == "pretrained" and other.why == "" and other.cfg.grpo.target_kl == TARGET_KL


def test_the_step_size_adapts_for_every_real_model_and_never_for_the_tiny_presets():
    from node.recipes import TARGET_KL

    for name, parameters in (("smollm2-135m", 134.5e6), ("gemma3-270m", 268.1e6)):
        settled = settle(load_config(overrides={"model": {"name": name}}), name, parameters)
        assert settled.cfg.grpo.target_kl == TARGET_KL and settled.sources["grpo.target_kl"] == f"recipe {name}"
    tiny = settle(load_config(overrides={"model": {"name": "tiny-a"}}), "tiny-a", 0.33e6)
    assert tiny.cfg.grpo.target_kl is None  # the demo's measured gains were with a fixed rate
    off = settle(load_config(overrides={"model": {"name": "smollm2-135m"}, "grpo": {"target_kl": None}}), "smollm2-135m",
                 134.5e6)
    assert off.cfg.grpo.target_kl is None and off.sources["grpo.target_kl"] == "user"


def test_the_paper_configs_rate_follows_the_rule_of_every_lora_plan():
    """It pinned 1e-6 and trained LoRA at the full fine-tuning rate where the plan chose adapters."""
    from node.recipes import settle_lr
    from tests.conftest import ROOT

    paper = load_config(ROOT / "docs/configs/paper-qwen2.5-0.5b.toml")
    for lora in (False, True):
        settled = settle_lr(settle(paper, paper.model.name, 494e6), lora=lora)
        assert settled.cfg.grpo.lr == learning_rate(494e6, lora) and settled.sources["grpo.lr"].startswith("model size")
        assert settled.cfg.grpo.target_kl is not None
