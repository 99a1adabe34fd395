import re
import sys
import types
import typing

import pytest
from pydantic import BaseModel

from node.config import ConfigError, NodeConfig, load_config
from tests.conftest import ROOT, run_sapo


def test_defaults_work_without_any_input():
    cfg = load_config()
    assert cfg.model.name == "tiny-a" and cfg.run.local_groups == 4 and cfg.selection.external_groups == 4 and cfg.generation.completions_per_group == 8


def test_precedence_is_file_then_env_then_flags(tmp_path, monkeypatch):
    f = tmp_path / "node.toml"
    f.write_text('[grpo]\nlr = 0.1\nepochs = 2\nminibatches = 3\n[run]\nrounds = 5\n')
    monkeypatch.setenv("SAPO_GRPO__EPOCHS", "4")
    monkeypatch.setenv("SAPO_GRPO__MINIBATCHES", "5")
    cfg = load_config(f, {"grpo": {"minibatches": "6"}})
    assert (cfg.grpo.lr, cfg.grpo.epochs, cfg.grpo.minibatches, cfg.run.rounds) == (0.1, 4, 6, 5)


def test_yaml_files_work(tmp_path):
    f = tmp_path / "node.yaml"
    f.write_text("tasks:\n  datasets:\n    - name: arith\n      config: {max_operand: 9}\n      weight: 2\n")
    cfg = load_config(f)
    assert cfg.tasks.datasets[0].config == {"max_operand": 9} and cfg.tasks.datasets[0].weight == 2


@pytest.mark.parametrize("overrides,field", [
    ({"grpo": {"lr": "-1"}}, "grpo.lr"),
    ({"grpo": {"loss_aggregation": "mean"}}, "grpo.loss_aggregation"),
    ({"run": {"rounds": "many"}}, "run.rounds"),
    ({"tasks": {"datasets": "arith,nosuchset"}}, "tasks.datasets.1: unknown dataset 'nosuchset'"),
    ({"tasks": {"datasets": [{"name": "arith", "config": {"max_operand": -3}}]}}, "max_operand"),
    ({"grpo": {"typo_knob": "1"}}, "grpo.typo_knob"),
    # an empty stop string ended every completion at its start: the run trained nothing and said nothing
    ({"generation": {"stop": ["</answer>", ""]}}, "generation.stop.1: String should have at least 1 character"),
    # the node adds its own id: it announced /p2p/<this id>/p2p/<its own>, another node's id accepted alike
    ({"p2p": {"announce": "/ip4/192.0.2.7/tcp/7420/p2p/12D3KooWFZ3JvyLsp62AgRJxGTQrqEi3UB4dWKZJM9YXSj3cJrFn"}},
     "p2p.announce: /ip4/192.0.2.7/tcp/7420/p2p/12D3KooWFZ3JvyLsp62AgRJxGTQrqEi3UB4dWKZJM9YXSj3cJrFn ends in a peer id"),
    # py-libp2p logged the failed listen and went on; the node then stopped with '(see the log above)'
    ({"p2p": {"listen": []}}, "p2p.listen: List should have at least 1 item"),  # p2p on, listening nowhere
    # the training stream drew the held-out tasks themselves
    ({"run": {"seed": 7}}, "run.seed 7 equals tasks.eval_seed: the node would train on its own held-out tasks"),
    ({"run": {"seed": 3}, "tasks": {"eval_seed": 3}}, "run.seed 3 equals tasks.eval_seed"),
    ({"grpo": {"lr_range": [2, 4]}}, "lr_range must be (low, high) with 0 < low <= 1 <= high"),
    ({"p2p": {"listen": "/ip4/127.0.0.1/udp/0/quic"}},
     "p2p.listen: '/ip4/127.0.0.1/udp/0/quic' has no /tcp/<port> part: nodes speak libp2p over TCP only"),
])
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides, line", [
    ({"model": {"lora": {"enabled": "maybe"}}},
     'model.lora.enabled: Input should be \'auto\' or a valid boolean, unable to interpret input (got "maybe")'),
    ({"generation": {"vllm": {"gpu_memory_utilization": "1.5"}}},
     'generation.vllm.gpu_memory_utilization: Input should be \'auto\' or less than or equal to 0.95 (got "1.5")'),
])
def test_a_knob_that_is_auto_or_a_value_is_one_problem_naming_both(overrides, line):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value) == line


def test_task_shorthand_sets_names_and_weights():
    cfg = load_config(None, {"tasks": {"datasets": "arith, reverse:2 ,rg/leg_counting"}})
    assert [(d.name, d.weight) for d in cfg.tasks.datasets] == [("arith", 1.0), ("reverse", 2.0), ("rg/leg_counting", 1.0)]


def test_the_task_shorthand_works_in_the_environment_too(monkeypatch):
    """SAPO_TASKS__DATASETS was decoded as JSON only: 'arith,reverse' and a typo alike were 'error parsing value
    for field "tasks" from source "EnvSettingsSource"'."""
    monkeypatch.setenv("SAPO_TASKS__DATASETS", "arith,reverse:2")
    assert [(d.name, d.weight) for d in load_config().tasks.datasets] == [("arith", 1.0), ("reverse", 2.0)]
    monkeypatch.setenv("SAPO_TASKS__DATASETS", "nope")
    with pytest.raises(ConfigError, match=re.escape("tasks.datasets.0: unknown dataset 'nope'")):
        load_config()


def test_task_text_may_be_a_json_list_with_configs_and_bad_json_is_named():
    cfg = load_config(None, {"tasks": {"datasets": ' [{"name": "arith", "config": {"max_operand": 4}}, {"name": "reverse"}]'}})
    assert [(d.name, d.config) for d in cfg.tasks.datasets] == [("arith", {"max_operand": 4}), ("reverse", {})]
    with pytest.raises(ConfigError, match=re.escape("tasks.datasets: not valid JSON")):
        load_config(None, {"tasks": {"datasets": '[{"name": arith}]'}})
    with pytest.raises(ConfigError, match=re.escape("tasks.datasets: Input should be a valid list")):
        load_config(None, {"tasks": {"datasets": '{"name": "arith"}'}})


@pytest.mark.parametrize("name,text,message", [
    ("absent.toml", None, "cannot read"),
    ("bad.toml", "[grpo\nlr=", "not valid TOML"),
    ("broken.yaml", "grpo:\n  lr: [1\n", "not valid YAML at line 3, column 1: "),
    ("list.yaml", "- 1\n- 2\n", "must hold a mapping"),
    ("unknown.toml", "[grpoo]\nlr = 1\n", "grpoo"),
    ("latin1.toml", "[run]\nrounds = 3 # caf\xe9\n".encode("latin-1"), "latin1.toml is not UTF-8 text (byte 0xe9 at offset 22)"),
])
def test_file_problems_are_one_clear_line(tmp_path, name, text, message):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        load_config(path)
    assert "\n" not in str(e.value)


def test_cli_reports_a_bad_flag_in_one_line_with_status_2():
    r = run_sapo("config", "--grpo.lr", "-1")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["sapo: config error: grpo.lr: Input should be greater than 0 (got \"-1\")"]


def test_cli_reports_a_bad_env_value_with_status_2():
    r = run_sapo("config", env={"SAPO_RUN__ROUNDS": "zero"})
    assert r.returncode == 2 and "run.rounds" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("argv, line", [
    (["run", "--grpo.nope", "1"], "sapo: error: unknown flag --grpo.nope (sapo run --help lists them)"),
    (["run", "--roundz", "3"], "sapo: error: unknown flag --roundz (did you mean --rounds?)"),
    (["run", "--roun", "3"], "sapo: error: unknown flag --roun (did you mean --rounds?)"),  # not taken as --rounds
    (["swarm", "--node", "2"], "sapo: error: unknown flag --node (did you mean --nodes?)"),
    (["doctor", "--grpo.lrr=2"], "sapo: error: unknown flag --grpo.lrr=2 (did you mean --grpo.lr?)"),
    (["config", "stray"], "sapo: error: unknown argument stray (sapo config --help lists them)"),
])
def test_cli_rejects_unknown_flags_with_status_2_and_the_nearest_flag(argv, line):
    r = run_sapo(*argv)
    assert r.returncode == 2 and r.stderr.strip() == line


@pytest.mark.parametrize("toml, env, line", [
    ("[grpoo]\nlr = 0.1\n", {}, "grpoo: unknown setting (did you mean grpo?)"),
    ("[grpo]\nlrr = 0.1\n", {}, "grpo.lrr: unknown setting (did you mean grpo.lr?) (got 0.1)"),
    ("", {"SAPO_P2P__LIMITS__MAX_GROUPZ": "3"}, 'p2p.limits.max_groupz: unknown setting (did you mean p2p.limits.max_groups?) (got "3")'),
    ("[zzz]\na = 1\n", {}, "zzz: unknown setting"),
    # pydantic-settings passes over a section it does not know: without our check this ran with the default lr
    ("", {"SAPO_GRPOO__LR": "0.1"}, "SAPO_GRPOO__LR: unknown section 'grpoo' (did you mean SAPO_GRPO__LR?); sections: "
                                    "model, tasks, generation, grpo, run, selection, p2p, status"),
    ("", {"SAPO_ZZZ__A": "1"}, "SAPO_ZZZ__A: unknown section 'zzz'; sections: model, tasks, generation, grpo, run, "
                               "selection, p2p, status"),
    # one underscore: read by nobody, so the node ran 600 rounds instead of 5
    ("", {"SAPO_RUN_ROUNDS": "5"}, "SAPO_RUN_ROUNDS is not read: a setting takes two underscores after its section, "
                                   "SAPO_RUN__ROUNDS"),
])
def test_a_misspelt_setting_in_a_file_or_the_environment_names_the_nearest_one(toml, env, line, tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(toml)
    r = run_sapo("config", "--config", str(path), env=env)
    assert r.returncode == 2 and r.stderr.strip() == f"sapo: config error: {line}"


def test_the_entrypoints_own_names_are_not_settings(tmp_path):
    r = run_sapo("config", env={"SAPO_SLOT_DIR": str(tmp_path), "SAPO_BOOTSTRAP_WAIT": "5", "SAPO_ROUNDS": "4"})
    assert r.returncode == 0, r.stderr


def test_cli_flags_env_and_file_reach_the_config(tmp_path):
    import json

    f = tmp_path / "n.toml"
    f.write_text("[run]\nrounds = 3\nseed = 9\n")
    r = run_sapo("config", "--config", str(f), "--seed", "11", "--grpo.dual_clip", "null", "--grpo.advantage_scale", "none",
                 "--generation.stop", '["</answer>", "\\n"]', env={"SAPO_RUN__ROUNDS": "4"})
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    assert (cfg["run"]["rounds"], cfg["run"]["seed"], cfg["grpo"]["dual_clip"]) == (4, 11, None)
    assert cfg["grpo"]["advantage_scale"] == "none"
    assert cfg["generation"]["stop"] == ["</answer>", "\n"]


def test_config_reference_is_up_to_date():
    import subprocess
    import sys


    r = subprocess.run([sys.executable, "scripts/tools/gen_config_docs.py", "--check"], cwd=ROOT)
    assert r.returncode == 0, "docs/CONFIG.md is stale: run scripts/tools/gen_config_docs.py"


def test_the_shipped_gpu_config_is_valid_and_set_up_like_the_paper():

    cfg = load_config(ROOT / "docs/configs/paper-qwen2.5-0.5b.toml")
    assert cfg.model.name == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.grpo.kl_coef == 0
    assert cfg.generation.completions_per_group == 8 and (cfg.run.local_groups, cfg.selection.external_groups) == (4, 4)
    assert len(cfg.tasks.datasets) == 9 and all(d.name.startswith("rg/") for d in cfg.tasks.datasets)


def test_reading_a_config_the_cli_help_and_the_preflights_refusals_load_neither_torch_nor_transformers(tmp_path):
    """A bad flag, `sapo --help`, a misspelt model, a run folder in use or `sapo swarm --nodes 0` answers in about
    a second, not after 6 s of imports (node/selection_config.py, trainer/tiny.py's table)."""
    import subprocess

    code = f"""import sys, contextlib, io
from pathlib import Path
import node.config, node.cli
from node import preflight
node.config.load_config()
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
    node.cli.main(['--help'])
assert node.cli.main(['swarm', '--nodes', '0']) == 2
assert 'did you mean tiny-a?' in preflight.model_problem('tiny-aa', Path({str(tmp_path)!r}))
cfg = node.config.load_config(overrides={{'run': {{'out_dir': {str(tmp_path / 'run')!r}}}, 'p2p': {{'enabled': False}},
                                          'status': {{'enabled': False}}}})
cfg.run.out_dir.mkdir()
held = preflight.lock_out_dir(cfg.run.out_dir)
try:
    preflight.check(cfg)
except node.config.ConfigError as e:
    assert 'is in use by another node' in str(e), e
else:
    raise AssertionError('a second node took a run folder in use')
print(sorted(m for m in ('torch', 'transformers', 'libp2p') if m in sys.modules))"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def float_knobs(model: type[BaseModel] = NodeConfig, prefix: str = "") -> list[str]:
    """Every float setting, nested sections included."""
    found = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            found += float_knobs(ann, f"{prefix}{name}.")
        elif ann is float or (typing.get_origin(ann) in (typing.Union, types.UnionType) and float in typing.get_args(ann)):
            found.append(prefix + name)
    return found


@pytest.mark.parametrize("knob", float_knobs())
def test_no_float_knob_takes_infinity(knob):
    """`nan` failed every bound, but `inf` passed `gt=0`: `--grpo.lr inf` trained one round into infinite
    weights, checkpointed them, and every resume failed on them."""
    section, _, key = knob.rpartition(".")
    overrides: dict = {}
    node = overrides
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[key] = "inf"
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(f"{knob}: ") and "finite number" in str(e.value), str(e.value)
