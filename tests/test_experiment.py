"""The swarm-vs-silo experiment's bookkeeping: runs paired with the same seed's silo, intervals over
seeds, and a report (table, markdown, figure) drawn from the merged JSON alone."""

from __future__ import annotations

import json
import math
import statistics
import sys

import pytest

from tests.conftest import ROOT

import sapo_experiment as driver
from experiment import grids, paired, report as reports
from experiment.grids import Config
from node.doctor import cpu_model


def fake_run(cfg: Config, seed: int, cumulative: list[float], rounds: int = 5, models: tuple[str, ...] = ("tiny-a",)) -> dict:
    j = 1 if cfg.external else 0
    nodes = [{"name": f"node{k}", "model": models[k % len(models)], "exit_code": 0, "cumulative_reward": c, "tokens_generated": 1000,
              "seconds": 10.0, "external_used": 2 * rounds * j, "external_inspected": 4 * rounds * j,
              "external_informative": 3 * rounds * j, "local_groups": 4 * rounds, "local_informative": 2 * rounds,
              "total_reward": 50.0, "eval_first": 0.3, "eval_last": 0.4, "eval_by_dataset_first": {},
              "eval_by_dataset_last": {},
              "curves": {"reward": [c / rounds] * rounds, "local_informative_share": [0.5] * rounds,
                         "external_informative_share": [0.75] * rounds if cfg.external else [None] * rounds,
                         "eval": [[0, 0.3], [rounds, 0.4]]}}
             for k, c in enumerate(cumulative)]
    return {"config": cfg.name, "testbed": cfg.testbed, "local": cfg.local, "external": cfg.external, "rule": cfg.rule,
            "control": cfg.control, "negatives": cfg.negatives, "seed": seed, "nodes_n": len(nodes), "rounds": rounds,
            "wall_seconds": 1.0, "cpus": 2, "nodes": nodes}


def test_each_configuration_is_compared_with_the_silo_of_its_own_seed():
    silo, swarm = Config("homogeneous", 8, 0), Config("homogeneous", 4, 4, "signal")
    runs = [fake_run(silo, s, [10.0 + s, 10.0 + s]) for s in range(3)]
    runs += [fake_run(swarm, s, [12.0 + 2 * s, 12.0 + 2 * s]) for s in range(3)]
    rows = {r["config"]: r for r in paired.summarize(runs)}
    ratios = [(12 + 2 * s) / (10 + s) - 1 for s in range(3)]
    got = rows["homogeneous 4/4 signal"]
    assert got["vs_silo_per_seed"] == pytest.approx(ratios)
    assert got["vs_silo"] == pytest.approx(statistics.mean(ratios))
    assert got["vs_silo_ci95"] == pytest.approx(4.30 * statistics.stdev(ratios) / math.sqrt(3))
    assert got["cumulative_reward"] == pytest.approx(14.0) and rows["homogeneous 8/0"]["vs_silo"] == 0
    assert got["external_informative_share"] == 0.75 and rows["homogeneous 8/0"]["external_informative_share"] is None
    assert list(rows) == ["homogeneous 8/0", "homogeneous 4/4 signal"]  # the grid's order


def test_a_run_without_its_silo_is_reported_without_a_paired_ratio():
    rows = paired.summarize([fake_run(Config("heterogeneous", 4, 4, "adaptive"), 0, [5.0])])
    assert math.isnan(rows[0]["vs_silo"]) and rows[0]["cumulative_reward"] == 5.0


def test_the_report_merges_per_run_files_and_draws_the_figure_from_the_json(tmp_path):
    from rich.console import Console

    for cfg in (Config("homogeneous", 8, 0), Config("homogeneous", 4, 4, "signal"), Config("homogeneous", 4, 4, control=True)):
        for seed in range(2):
            folder = tmp_path / driver.slug(cfg.name) / f"seed{seed}"
            folder.mkdir(parents=True)
            (folder / "result.json").write_text(json.dumps(fake_run(cfg, seed, [10.0 + seed, 11.0])))
    reports.report(tmp_path, Console(file=open(tmp_path / "table.txt", "w"), width=200))
    merged = json.loads((tmp_path / "results.json").read_text())
    assert len(merged["runs"]) == 6 and [r["config"] for r in merged["configs"]][1] == "homogeneous control 4+4 own"
    md = (tmp_path / "results.md").read_text().splitlines()
    assert len(md) == 2 + 3 + 1 + 2 + 3 and md[3].startswith("| homogeneous control 4+4 own | 10.75 ± ")
    assert md[6].startswith("| configuration | informative groups trained /round |") and md[9].startswith("| homogeneous control")
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "homogeneous 4/4 signal" in (tmp_path / "table.txt").read_text()


def test_the_hetero_grids_report_draws_each_rule_and_peer_tasks_in_its_own_colour(tmp_path):
    """The heterogeneous grid's report ended in a KeyError drawing its figure: `scoped` had no colour."""
    from rich.console import Console

    configs = grids.grid(["signal"], "hetero")
    for cfg in configs:
        for seed in range(2):
            folder = tmp_path / driver.slug(cfg.name) / f"seed{seed}"
            folder.mkdir(parents=True)
            run = fake_run(cfg, seed, [10.0 + seed, 11.0, 12.0], models=("tiny-a", "tiny-b"))
            (folder / "result.json").write_text(json.dumps({**run, "when_short": cfg.when_short}))
    reports.report(tmp_path, Console(file=open(tmp_path / "table.txt", "w"), width=200))
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [r for r in json.loads((tmp_path / "results.json").read_text())["configs"] if r["model"] is None]
    assert [r["config"] for r in rows] == [c.name for c in configs]
    assert len({reports.row_color(r) for r in rows}) == len(configs)


def test_an_empty_output_folder_is_one_line(tmp_path):
    from rich.console import Console

    with pytest.raises(SystemExit, match="no finished runs under"):
        reports.report(tmp_path, Console())


def test_the_testbeds_task_mixes_are_valid_node_configs_and_the_heterogeneous_one_crosses_presets_with_strengths():
    from node.recipes import RECIPES
    from rewards.config import TasksConfig

    for name, bed in grids.TESTBEDS.items():
        if name in ("specialists", "owners", "owners-union"):  # split between owners: tests of their own
            continue
        for preset, mix in zip(bed["presets"] * 2, bed["task_mixes"]):
            names = [d.name for d in TasksConfig(datasets=json.loads(mix)).datasets]
            assert names == (["arith", "reverse"] if preset.startswith("tiny") else
                             [d["name"] for d in RECIPES[preset]["tasks"]["datasets"]])
    het = grids.TESTBEDS["heterogeneous"]
    nodes = [(het["presets"][k % 2], json.loads(het["task_mixes"][k % 4])[0]["weight"]) for k in range(4)]
    assert sorted(nodes) == [("tiny-a", 1), ("tiny-a", 3), ("tiny-b", 1), ("tiny-b", 3)]


def test_a_testbed_of_two_models_also_reports_each_model_against_its_own_silo_nodes(tmp_path):
    from rich.console import Console

    silo, swarm = Config("heterogeneous", 8, 0), Config("heterogeneous", 4, 4, "signal")
    models = ("tiny-a", "tiny-b")
    runs = [fake_run(silo, s, [10.0, 20.0], models=models) for s in range(2)]
    runs += [fake_run(swarm, s, [15.0 + s, 10.0], models=models) for s in range(2)]
    rows = {r["config"]: r for r in paired.summarize(runs)}
    assert list(rows) == ["heterogeneous 8/0", "heterogeneous 8/0 [tiny-a]", "heterogeneous 8/0 [tiny-b]",
                          "heterogeneous 4/4 signal", "heterogeneous 4/4 signal [tiny-a]", "heterogeneous 4/4 signal [tiny-b]"]
    assert rows["heterogeneous 4/4 signal [tiny-a]"]["vs_silo_per_seed"] == pytest.approx([0.5, 0.6])
    assert rows["heterogeneous 4/4 signal [tiny-b]"]["vs_silo_per_seed"] == pytest.approx([-0.5, -0.5])
    assert rows["heterogeneous 4/4 signal"]["vs_silo_per_seed"] == pytest.approx([25 / 30 - 1, 26 / 30 - 1])
    for k, run in enumerate(runs):
        folder = tmp_path / driver.slug(run["config"]) / f"seed{k % 2}"
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps(run))
    reports.report(tmp_path, Console(file=open(tmp_path / "table.txt", "w"), width=250))
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tiny-a, tiny-b; 2 nodes x 5 rounds" in (tmp_path / "table.txt").read_text()


def test_held_out_accuracy_is_compared_with_the_same_seeds_silo_at_every_eval_point():
    silo, swarm = Config("smollm2", 4, 0), Config("smollm2+tiny", 2, 2, "guarded")
    runs = [fake_run(silo, s, [10.0, 10.0], models=("smollm2-135m",)) for s in range(2)]
    runs += [fake_run(swarm, s, [12.0, 100.0], models=("smollm2-135m", "tiny-a")) for s in range(2)]
    for s, evals in enumerate(([[0, 0.4], [5, 0.5], [10, 0.6]], [[0, 0.4], [5, 0.4], [10, 0.5]])):
        for node in runs[s]["nodes"]:  # the silo's two SmolLM2 nodes
            node["curves"]["eval"] = evals
        runs[2 + s]["nodes"][0]["curves"]["eval"] = [[0, 0.4], [5, 0.44], [10, 0.6]]
        runs[2 + s]["nodes"][1]["companion"] = True
    rows = {r["config"]: r for r in paired.summarize(runs)}
    row = rows["smollm2+tiny 2/2 guarded"]  # paired with the SmolLM2 silo: a tiny companion cannot change a silo
    assert row["vs_silo_per_seed"] == pytest.approx([0.2, 0.2])
    # against each seed's silo: seed 0 (0, -0.06, 0), seed 1 (0, +0.04, +0.1)
    assert [k for k, _ in row["eval_vs_silo"]] == [0, 5, 10]
    assert [g for _, g in row["eval_vs_silo"]] == pytest.approx([0.0, -0.01, 0.05])
    assert row["eval_vs_silo_worst"] == pytest.approx(-0.01) and row["eval_last_vs_silo"] == pytest.approx(0.05)
    assert reports.versus_silo(row) == "+0.050 ± 0.635 / -0.010"  # t(1) 12.71 x stdev 0.0707 / sqrt(2)


def test_the_quantized_check_pairs_lora_on_an_nf4_base_with_full_fine_tuning_at_the_same_seed():
    full, nf4 = grids.grid(["signal"], "quantized")
    assert (full.name, nf4.name, nf4.silo) == ("smollm2 4/0", "smollm2-nf4 4/0", full)
    extra = grids.TESTBEDS["smollm2-nf4"]["extra"]
    assert extra[extra.index("--model.quantize") + 1] == "nf4" and extra[extra.index("--model.lora.enabled") + 1] == "true"
    runs = [fake_run(full, s, [10.0], models=("smollm2-135m",)) for s in range(3)]
    runs += [fake_run(nf4, s, [9.0 + s], models=("smollm2-135m",)) for s in range(3)]
    for s in range(3):
        runs[3 + s]["nodes"][0]["curves"]["eval"] = [[0, 0.3], [5, 0.3 + 0.01 * s]]
    rows = {r["config"]: r for r in paired.summarize(runs)}
    assert rows["smollm2-nf4 4/0"]["vs_silo_per_seed"] == pytest.approx([-0.1, 0.0, 0.1])
    assert rows["smollm2-nf4 4/0"]["eval_last_vs_silo"] == pytest.approx(-0.09)  # 0.31 against 0.4
    assert reports.versus_silo(rows["smollm2 4/0"]) == "-"  # the reference itself
    assert reports.versus_silo(rows["smollm2-nf4 4/0"]).startswith("-0.090 ± ")


def test_a_row_whose_silo_did_not_run_says_so_instead_of_nan():
    full, nf4 = grids.grid(["signal"], "quantized")
    alone = [fake_run(nf4, s, [9.0 + s], models=("smollm2-135m",)) for s in range(2)]  # its silo, `full`, never ran
    (row,) = paired.summarize(alone)
    assert reports.reward_vs_silo(row) == "-" and "| - |" in reports.markdown([row])
    (_, paired_row) = paired.summarize([fake_run(full, s, [10.0], models=("smollm2-135m",)) for s in range(2)] + alone)
    assert reports.reward_vs_silo(paired_row) == "-5.0% ± 63.5"  # -10% and 0%: t(1) 12.71 x stdev 7.07 / sqrt(2)


def test_the_real_model_grid_halves_the_round_of_the_tiny_one():
    names = [c.name for c in grids.grid(["signal", "guarded"], "real")]
    assert names == ["smollm2 4/0", "smollm2 2/2 signal", "smollm2 2/2 guarded", "smollm2+tiny 2/2 signal",
                     "smollm2+tiny 2/2 guarded"]  # one silo for both testbeds
    mixed = grids.TESTBEDS["smollm2+tiny"]
    own = [{(d["name"], json.dumps(d.get("config", {}), sort_keys=True)) for d in json.loads(mix)} for mix in mixed["task_mixes"]]
    assert not own[0] & own[1] and mixed["extra"] == ["--selection.accept", "any"]  # "own" would share nothing


def test_the_step_size_grid_runs_gemma_from_its_destructive_rate_also_at_a_lower_target_kl():
    arms = {c.name: c for c in grids.grid([], "step-size")}
    low = arms["gemma-adapt 4/0 lr 6.7e-06 kl 0.001"]
    args = low.node_args(80, 20)
    assert args[args.index("--grpo.target_kl") + 1] == "0.001" and args[args.index("--grpo.lr") + 1] == "6.7e-06"
    assert "--grpo.target_kl" not in arms["gemma-adapt 4/0 lr 6.7e-06"].node_args(80, 20)  # the recipe's target
    assert low.silo == arms["gemma-adapt 4/0 lr 6.7e-06"].silo  # both weighed against the same fixed arm


def test_a_companion_node_is_left_out_of_the_rows():
    silo, swarm = Config("smollm2", 4, 0), Config("smollm2+tiny", 2, 2, "signal")
    runs = [fake_run(silo, 0, [10.0, 10.0], models=("smollm2-135m",)),
            fake_run(swarm, 0, [11.0, 500.0], models=("smollm2-135m", "tiny-a"))]
    runs[1]["nodes"][1]["companion"] = True
    rows = {r["config"]: r for r in paired.summarize(runs)}
    assert list(rows) == ["smollm2 4/0", "smollm2+tiny 2/2 signal"]  # one model left: no rows per model
    assert rows["smollm2+tiny 2/2 signal"]["vs_silo_per_seed"] == pytest.approx([0.1])


KILLED = "node1 (tiny-a) killed by SIGKILL (as the kernel's out-of-memory killer does); its last log line: [12:00:00] round 2"


@pytest.mark.parametrize("stopped, failed", [(True, []), (False, [KILLED])])
def test_a_stopped_run_is_not_saved_and_a_failed_one_is_saved_marked_as_failed_with_no_result(
        tmp_path, monkeypatch, stopped, failed):
    from argparse import Namespace

    from rich.console import Console

    per_node = [{"name": f"node{k}", "companion": False, "exit_code": 0} for k in range(2)]
    monkeypatch.setattr(driver, "run", lambda *a, **k: {"per_node": per_node, "stopped": stopped, "failed": failed})
    args = Namespace(out=tmp_path, nodes=2, rounds=2, eval_every=1, accept_license=[], products="auto")
    cfg = Config("homogeneous", 4, 4, "signal")
    log = tmp_path / "log.txt"
    if stopped:
        with pytest.raises(SystemExit, match="stopped during homogeneous 4/4 signal seed 0; finished runs are kept"):
            driver.run_one(cfg, 0, args, Console(file=open(log, "w")))
        assert not list(tmp_path.glob("*/seed0/result.json"))
        return
    result = driver.run_one(cfg, 0, args, Console(file=open(log, "w"), width=300))
    saved = json.loads((tmp_path / "homogeneous-4-4-signal" / "seed0" / "result.json").read_text())
    assert result == saved and saved["failed"] == [KILLED] and "nodes" not in saved
    assert saved["cpu"] == cpu_model() and saved["cpu"] != "unknown"  # seconds compare only on one named CPU
    assert f"homogeneous 4/4 signal seed 0: failed: {KILLED}" in log.read_text()
    rerun = []  # a failed run is run again, a finished one is not
    monkeypatch.setattr(driver, "run", lambda *a, **k: rerun.append(1) or {"per_node": [], "stopped": True, "failed": []})
    with pytest.raises(SystemExit, match="stopped during"):
        driver.run_one(cfg, 0, args, Console(file=open(log, "w")))
    assert rerun == [1]


def test_the_report_leaves_failed_runs_out_of_every_table_and_figure_and_says_how_many(tmp_path):
    from rich.console import Console

    silo, swarm = Config("homogeneous", 8, 0), Config("homogeneous", 4, 4, "signal")
    runs = [fake_run(silo, 0, [10.0, 10.0]), fake_run(swarm, 0, [12.0, 12.0]),
            {**fake_run(swarm, 1, [1.0, 1.0]), "failed": [KILLED]}]
    for r in runs:
        folder = tmp_path / driver.slug(r["config"]) / f"seed{r['seed']}"
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps(r))
    reports.report(tmp_path, Console(file=open(tmp_path / "table.txt", "w"), width=300))
    merged = json.loads((tmp_path / "results.json").read_text())
    assert merged["failed_runs_left_out"] == 1 and [r["seed"] for r in merged["runs"]] == [0, 0]
    row = next(r for r in merged["configs"] if r["config"] == "homogeneous 4/4 signal")
    assert row["seeds"] == [0] and row["vs_silo"] == pytest.approx(0.2)
    text = (tmp_path / "table.txt").read_text()
    assert "left out 1 failed run" in text and f"homogeneous 4/4 signal seed 1: {KILLED}" in text


def test_a_grid_is_continued_only_with_resume_and_then_skips_what_finished(tmp_path):
    import subprocess

    seed0 = tmp_path / "homogeneous-8-0" / "seed0"
    seed0.mkdir(parents=True)
    (seed0 / "result.json").write_text(json.dumps({**fake_run(Config("homogeneous", 8, 0), 0, [10.0, 10.0]), "failed": []}))
    cmd = [sys.executable, str(ROOT / "scripts" / "bench" / "sapo_experiment.py"), "--out", str(tmp_path), "--quick",
           "--only", "homogeneous 8/0"]
    refused = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        f"sapo_experiment: {tmp_path} already holds 1 run(s) of this grid (homogeneous-8-0/seed0, ...): pass --resume "
        "to continue it, or choose another --out"]
    resumed = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "homogeneous 8/0 seed 0: finished before, skipped" in resumed.stdout
    assert json.loads((tmp_path / "results.json").read_text())["configs"][0]["seeds"] == [0]


def test_the_real_grid_takes_the_papers_round_on_a_gpu_and_groups_outside_it_are_one_line(tmp_path):
    import subprocess

    names = [c.name for c in grids.grid(["guarded"], "real", groups=8)]
    assert names == ["smollm2 8/0", "smollm2 4/4 guarded", "smollm2+tiny 4/4 guarded"]
    assert grids.grid(["guarded"], "real", groups=8)[1].silo == Config("smollm2", 8, 0)
    script = str(ROOT / "scripts" / "bench" / "sapo_experiment.py")
    for flags in (["--groups", "8"], ["--real", "--groups", "3"]):
        refused = subprocess.run([sys.executable, script, "--out", str(tmp_path), *flags], capture_output=True, text=True,
                                 cwd=ROOT, timeout=120)
        assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
            "sapo_experiment: --groups: an even number of groups per round, for the --real grid only"]


def node_folder(folder, peaks: list[float | None], seconds: list[float], device: str):
    """A finished node's run folder: metrics rows (round 0 evaluates), its plan and config, as `sapo run` writes them."""
    folder.mkdir(parents=True)
    rows = [{"round": k, "reward_mean": None if k == 0 else 0.5, "eval_accuracy": 0.3 if k == 0 else None,
             "eval_by_dataset": {}, "n_local": 0 if k == 0 else 4, "n_external": 0, "tokens_generated": 0 if k == 0 else 320,
             "seconds_generate": 0.0 if k == 0 else s / 2, "seconds_train": 0.0 if k == 0 else s / 2, "seconds_other": 0.0,
             "seconds_push": 0.0 if k == 0 else 0.01, "micro_batch": 8, "memory_peak_gb": p, "local_informative": 2,
             "external_inspected": 0, "external_informative": 0}
            for k, (s, p) in enumerate(zip([0.0, *seconds], [None, *peaks]))]
    rows[-1]["eval_accuracy"] = 0.4
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "plan.json").write_text(json.dumps({"summary": f"{device}: transformers backend", "device": device,
                                                  "peak_gb": 6.0}))
    (folder / "config.json").write_text(json.dumps({"generation": {"completions_per_group": 8, "max_new_tokens": 64}}))
    return folder


def test_each_node_reports_seconds_per_round_and_its_peak_beside_the_plan_and_the_table_names_the_card(tmp_path):
    from rich.console import Console

    card = "cuda (NVIDIA H100 80GB HBM3, 79.1 GB free)"
    summary = {"name": "node0", "model": "smollm2-135m", "companion": False, "exit_code": 0, "cumulative_reward": 1.5,
               "tokens_generated": 960, "seconds": 9.0, "external_used": 0, "external_inspected": 0,
               "external_informative": 0, "local_groups": 12, "local_informative": 6}
    # round 1 is the warm-up and round 3 evaluates: round 2 alone is the steady round
    record = driver.node_record(node_folder(tmp_path / "node0", [4.0, 4.5, 5.0], [9.0, 2.0, 3.0], card), summary)
    assert record["timing"]["round_s"] == pytest.approx(2.0) and record["timing"]["peak_gb"] == 5.0
    assert record["timing"]["planned_peak_gb"] == 6.0 and record["timing"]["device"] == card
    older = driver.node_record(node_folder(tmp_path / "older", [4.0, 4.0], [9.0, 2.0], card), summary)
    (tmp_path / "older" / "plan.json").unlink()
    assert driver.node_record(tmp_path / "older", summary)["timing"] is None and older["timing"] is not None
    runs = [fake_run(Config("smollm2", 8, 0), 0, [10.0], models=("smollm2-135m",))]
    runs[0]["nodes"][0]["timing"] = record["timing"]
    row = paired.summarize(runs)[0]
    assert (row["round_s"], row["peak_gb"], row["planned_peak_gb"]) == (pytest.approx(2.0), 5.0, 6.0)
    assert reports.per_round(row) == "2.00 s, 5.00 / 6.00"
    folder = tmp_path / "grid" / "smollm2-8-0" / "seed0"
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps(runs[0]))
    reports.report(tmp_path / "grid", Console(file=open(tmp_path / "table.txt", "w"), width=300))
    assert "NVIDIA H100 80GB HBM3" in json.loads((tmp_path / "grid" / "results.json").read_text())["subtitle"]
    assert (tmp_path / "grid" / "results.md").read_text().splitlines()[2].endswith("| 2.00 s, 5.00 / 6.00 | 1 |")
    assert reports.per_round(paired.summarize([fake_run(Config("smollm2", 8, 0), 0, [10.0])])[0]) == "-"


def test_a_node_beside_a_companion_is_paired_with_the_silo_node_of_its_own_seed():
    silo, swarm = Config("smollm2", 4, 0), Config("smollm2+tiny", 2, 2, "guarded")
    runs = [fake_run(silo, 0, [10.0, 20.0], models=("smollm2-135m",)),
            fake_run(swarm, 0, [11.0, 500.0], models=("smollm2-135m", "tiny-a"))]
    runs[0]["nodes"][1]["curves"]["eval"] = [[0, 0.3], [5, 0.9]]  # node1's seed learns far more alone
    runs[1]["nodes"][1]["companion"] = True
    row = {r["config"]: r for r in paired.summarize(runs)}["smollm2+tiny 2/2 guarded"]
    assert row["vs_silo_per_seed"] == pytest.approx([0.1])  # against node0 alone (10), not the silo's mean (15)
    assert row["eval_vs_silo"] == [[0, 0.0], [5, 0.0]] and row["eval_vs_silo_worst"] == 0.0


def test_the_specialists_split_the_recipes_mix_between_two_owners_and_are_evaluated_on_all_of_it():
    from node.flags import config_from_flags
    from node.recipes import RECIPES

    bed = grids.TESTBEDS["specialists"]
    a, b = ({d["name"] for d in json.loads(mix)} for mix in bed["task_mixes"])
    assert a == {"arith", "rg/basic_arithmetic"} and b == {"rg/products"}
    assert a | b == {d["name"] for d in RECIPES["smollm2-135m"]["tasks"]["datasets"]}
    names = [c.name for c in grids.grid([], "specialists")]
    assert names == ["specialists 4/0", "specialists 2/2 guarded", "specialists-union 4/0"]
    swarm = grids.grid([], "specialists")[1]
    assert swarm.silo.name == "specialists 4/0" and grids.Config("specialists-union", 4, 0).silo.name == "specialists 4/0"
    cfg = config_from_flags(swarm.node_args(30, 30) + bed["extra"] + ["--tasks", bed["task_mixes"][0]])
    assert cfg.selection.accept == "any" and (cfg.tasks.eval_size, cfg.tasks.eval_samples) == (400, 4)
    weights = {d.name: d.weight for d in cfg.tasks.eval_datasets}
    assert weights == {"arith": 1, "rg/basic_arithmetic": 1, "rg/products": 2}  # about 200 of the 400 are products


def test_the_learning_rate_sweep_pairs_each_rate_with_the_recipes_and_sets_it_on_the_node():
    from node.flags import config_from_flags

    configs = grids.grid([], "lr")
    assert [c.name for c in configs] == ["smollm2-sweep 4/0 lr 1e-05", "smollm2-sweep 4/0 lr 3e-05", "smollm2-sweep 4/0 lr 0.0001",
                                         "smollm2-sweep-lora 4/0 lr 0.0001", "smollm2-sweep-lora 4/0 lr 0.0003"]
    assert {c.silo.name for c in configs} == {"smollm2-sweep 4/0 lr 1e-05"}
    lora = configs[-1]
    cfg = config_from_flags(lora.node_args(30, 10) + grids.TESTBEDS[lora.testbed]["extra"])
    assert cfg.grpo.lr == 3e-4 and cfg.model.lora.enabled and cfg.tasks.eval_samples == 4
    runs = [fake_run(c, 0, [10.0 + k], models=("smollm2-135m",)) for k, c in enumerate(configs)]
    rows = {r["config"]: r for r in paired.summarize(runs)}
    assert rows["smollm2-sweep 4/0 lr 0.0001"]["vs_silo"] == pytest.approx(0.2)  # 12 against the recipe rate's 10


def test_the_expected_held_out_gap_is_paired_per_node_and_dataset_with_its_smallest_detectable_effect():
    alone, swarm = Config("specialists", 4, 0), Config("specialists", 2, 2, "guarded")
    runs = []
    for seed, products in enumerate((0.10, 0.12, 0.08)):  # specialist A gains on products; B does not move
        for cfg, gain in ((alone, 0.0), (swarm, products)):
            run = fake_run(cfg, seed, [10.0, 10.0], models=("smollm2-135m",))
            for node, own in zip(run["nodes"], ("arith", "rg/products")):
                last = {"arith": 0.4, "rg/products": 0.6 + (gain if node["name"] == "node0" else 0.0)}
                node.update(expected_first=0.5, expected_last=statistics.mean(last.values()),
                            expected_by_dataset_first={}, expected_by_dataset_last=last)
            runs.append(run)
    rows = {r["config"]: r for r in paired.summarize(runs)}
    gaps = rows["specialists 2/2 guarded"]["expected_vs_silo"]
    assert gaps["node0 rg/products"]["gap"] == pytest.approx(0.10) and gaps["node1 rg/products"]["gap"] == pytest.approx(0.0)
    assert gaps["node0 rg/products"]["ci95"] == pytest.approx(4.30 * 0.02 / math.sqrt(3))
    assert gaps["node0 rg/products"]["mde"] == pytest.approx((4.30 + 1.061) * 0.02 / math.sqrt(3))
    assert gaps["all"]["gap"] == pytest.approx(0.025)  # A's +0.10 on one of two datasets, over two nodes
    assert reports.held_out_gap(gaps["node0 rg/products"]).startswith("+0.100 ± 0.050")
    wobble = {"gap": 0.01, "ci95": 0.05, "mde": 0.07, "seeds": 3}
    assert reports.held_out_gap(wobble) == "+0.010 ± 0.050: no effect seen (detectable: 0.070)"


def test_a_node_records_the_papers_cumulative_reward_its_dose_its_held_out_skips_and_its_rates_from_its_metrics(tmp_path):
    summary = {"name": "node0", "model": "smollm2-135m", "companion": False, "exit_code": 0, "cumulative_reward": 1.0,
               "tokens_generated": 960, "seconds": 9.0, "external_used": 2, "external_inspected": 4,
               "external_informative": 2, "local_groups": 6, "local_informative": 3}
    folder = node_folder(tmp_path / "node0", [4.0, 4.0, 4.0], [2.0, 2.0, 2.0], "cpu")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for row, batch, trained, skipped, lr in zip(rows[1:], (0.5, 0.75, 1.0), (1, 3, 2), (2, 0, 1), (1e-6, 1.5e-6, 1e-6)):
        row.update(batch_reward_mean=batch, groups_trained=trained, n_held_out_skipped=skipped, lr=lr)
    for k, row in enumerate(r for r in rows if r.get("eval_accuracy") is not None):
        row["eval_by_dataset"] = {"arith": 0.1 * k, "rg/products": 0.5 + 0.1 * k}
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = driver.node_record(folder, summary)
    assert record["paper_cumulative_reward"] == pytest.approx(2.25) and record["dose_per_round"] == pytest.approx(2.0)
    assert record["curves"]["lr"] == [1e-6, 1.5e-6, 1e-6]  # the step-size controller's path, a rate a round
    assert [by["arith"] for _, by in record["curves"]["eval_by_dataset"]] == [0.0, 0.1]  # each family's held-out path
    assert record["curves"]["memory_peak_gb"] == [r.get("memory_peak_gb") for r in rows[1:]]
    assert record["held_out_skipped"] == 3  # evaluation questions passed over, counted for the write-up
    del rows[2]["batch_reward_mean"]  # a run from before the nodes recorded it
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert driver.node_record(folder, summary)["paper_cumulative_reward"] is None


@pytest.mark.parametrize("failed", [[], [KILLED]])
def test_a_finished_runs_checkpoints_are_deleted_once_its_result_is_saved_and_a_failed_ones_kept(tmp_path, monkeypatch, failed):
    from argparse import Namespace

    from rich.console import Console

    cfg = Config("homogeneous", 8, 0)
    seed_dir = tmp_path / driver.slug(cfg.name) / "seed0"
    per_node = [{"name": "node0", "companion": False, "exit_code": 0}]
    checkpoints = seed_dir / "node0" / "checkpoints" / "round-000002"
    checkpoints.mkdir(parents=True)
    (checkpoints / "model.safetensors").write_bytes(b"weights")
    monkeypatch.setattr(driver, "run", lambda *a, **k: {"per_node": per_node, "stopped": False, "failed": failed})
    monkeypatch.setattr(driver, "node_record", lambda folder, summary: {"name": summary["name"]})
    driver.run_one(cfg, 0, Namespace(out=tmp_path, nodes=1, rounds=2, eval_every=1, accept_license=[], products="auto"), Console(file=open(tmp_path / "log", "w")))
    assert (seed_dir / "result.json").exists()
    assert checkpoints.exists() == bool(failed)  # a failed run resumes from them


def test_the_hetero_grid_compares_the_rules_for_a_peer_of_another_model_on_the_demos_swarm():
    names = [c.name for c in grids.grid(["signal"], "hetero")]
    assert names == ["demo 8/0", "demo 4/4 signal", "demo 4/4 guarded", "demo 4/4 scoped", "demo 4/4 guarded peer_tasks"]
    shared = grids.grid(["signal"], "hetero")[-1]
    args = shared.node_args(rounds=10, eval_every=5)
    assert args[args.index("--selection.when_short") + 1] == "peer_tasks" and shared.silo == Config("demo", 8, 0)
    assert grids.TESTBEDS["demo"]["presets"] == ["tiny-a", "tiny-b"]


def test_the_gemma_grid_pairs_each_family_with_its_own_silo_node_and_accepts_its_terms_only_from_the_command_line(
        tmp_path, monkeypatch):
    import subprocess
    from argparse import Namespace

    from rich.console import Console

    names = [c.name for c in grids.grid([], "gemma")]
    assert names == ["gemma+smollm2 4/0", "gemma+smollm2 2/2 guarded", "gemma+smollm2 2/2 scoped"]
    assert all(c.silo == Config("gemma+smollm2", 4, 0) for c in grids.grid([], "gemma"))
    bed = grids.TESTBEDS["gemma+smollm2"]
    assert bed["presets"] == ["gemma3-270m", "smollm2-135m"] and "accept_license" not in json.dumps(bed)
    assert bed["extra"][bed["extra"].index("--model.lora.enabled") + 1] == "false"  # every arm fine-tunes fully
    cmd = [sys.executable, str(ROOT / "scripts" / "bench" / "sapo_experiment.py"), "--gemma", "--out", str(tmp_path / "g")]
    refused = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        "sapo_experiment: --accept-license: gemma3-270m is under the Gemma Terms of Use (https://ai.google.dev/gemma/terms), "
        "which gate every use of it: read them, then add --accept-license gemma; nothing accepts them for you"]
    assert not (tmp_path / "g").exists()
    seen = []  # the nodes get the acceptance the command line gave, and no other
    monkeypatch.setattr(driver, "run", lambda spec, **k: seen.append(spec) or {"per_node": [], "stopped": True})
    for accepted in ([], ["gemma"]):
        with pytest.raises(SystemExit, match="stopped during"):
            driver.run_one(grids.grid([], "gemma")[1], 0, Namespace(out=tmp_path, nodes=2, rounds=2, eval_every=1,
                                                                            accept_license=accepted, products="auto"), Console(file=None))
    assert "--model.accept_license" not in seen[0].extra
    assert seen[1].extra[seen[1].extra.index("--model.accept_license") + 1] == "gemma"
    assert [seen[1].node_rounds(k) for k in range(2)] == [2, 4]  # SmolLM2, twice as fast, shares the whole run


def test_a_row_whose_nodes_ran_different_rounds_is_drawn_at_the_evaluations_they_share():
    cfg = Config("gemma+smollm2", 2, 2, "guarded")
    run = fake_run(cfg, 0, [5.0, 9.0], models=("gemma3-270m", "smollm2-135m"))
    run["nodes"][1]["curves"]["eval"].append([10, 0.6])  # the faster model's node ran twice the rounds
    run["nodes"][1]["curves"]["reward"] *= 2
    run["nodes"][1]["external_used"] *= 2
    rounds, means = reports.mean_eval([run], {"run_config": cfg.name, "model": None})
    assert rounds == [0, 5] and means == pytest.approx([0.3, 0.4])
    row = paired.config_row(cfg.name, cfg, [run], {})
    assert row["external_used_per_round"] == pytest.approx(2.0)  # each node's own rounds, not the first's


def test_a_rule_is_weighed_against_the_default_rules_arm_of_the_same_seed_and_the_report_tables_it(tmp_path):
    from rich.console import Console

    silo, default, scoped = (Config("gemma+smollm2", 4, 0), Config("gemma+smollm2", 2, 2, grids.DEFAULT_RULE),
                             Config("gemma+smollm2", 2, 2, "scoped"))
    assert scoped.default_twin == default and default.default_twin is None and silo.default_twin is None
    assert Config("demo", 4, 4, "guarded", when_short="peer_tasks").default_twin == Config("demo", 4, 4, "guarded")
    for seed, gain in enumerate((0.10, 0.20, 0.15)):  # scoped: Gemma earns 10-20% more and 0.02-0.04 held-out
        for cfg, extra in ((silo, 0.0), (default, 0.0), (scoped, gain)):
            run = fake_run(cfg, seed, [10.0 * (1 + extra), 20.0], models=("gemma3-270m", "smollm2-135m"))
            for node in run["nodes"]:
                up = extra / 5 if node["model"] == "gemma3-270m" else 0.0
                node.update(expected_first=0.2, expected_last=0.4 + seed / 100 + up, expected_by_dataset_first={},
                            expected_by_dataset_last={})
            folder = tmp_path / driver.slug(cfg.name) / f"seed{seed}"
            folder.mkdir(parents=True)
            (folder / "result.json").write_text(json.dumps(run))
    rows = {r["config"]: r for r in paired.summarize([json.loads(p.read_text()) for p in tmp_path.glob("*/*/result.json")])}
    gemma = rows["gemma+smollm2 2/2 scoped [gemma3-270m]"]["vs_default"]
    assert gemma["reward"]["gap"] == pytest.approx(0.15) and gemma["held_out"]["gap"] == pytest.approx(0.03)
    assert gemma["held_out_measure"] == "expected_last" and gemma["reward"]["seeds"] == 3
    assert gemma["reward"]["ci95"] == pytest.approx(4.30 * 0.05 / math.sqrt(3))
    assert rows["gemma+smollm2 2/2 scoped [smollm2-135m]"]["vs_default"]["reward"]["gap"] == pytest.approx(0.0)
    assert rows["gemma+smollm2 2/2 guarded"]["vs_default"] is None and rows["gemma+smollm2 4/0"]["vs_default"] is None
    reports.report(tmp_path, Console(file=open(tmp_path / "table.txt", "w"), width=250))
    md = (tmp_path / "results.md").read_text().split("\n\n")
    assert md[-1].splitlines()[0].startswith(f"| configuration | cumulative reward vs {grids.DEFAULT_RULE}, paired |")
    assert [line.split(" | ")[0] for line in md[-1].splitlines()[2:]] == [
        "| gemma+smollm2 2/2 scoped", "| gemma+smollm2 2/2 scoped [gemma3-270m]", "| gemma+smollm2 2/2 scoped [smollm2-135m]"]
    assert "+15.0% ± 12.4%" in md[-1] and "+0.030 ± " in md[-1]


@pytest.mark.parametrize("stopped_at, continues", [((30, 30, 30), 30), ((20, 25, None), None), ((None, None, None), None)])
def test_an_unfinished_run_continues_only_where_every_node_stopped_at_one_checkpoint(tmp_path, stopped_at, continues):
    from rich.console import Console

    seed_dir = tmp_path / "owners-3-1-guarded" / "seed0"
    for k, r in enumerate(stopped_at):
        (seed_dir / f"node{k}").mkdir(parents=True)
        (seed_dir / f"node{k}" / "metrics.jsonl").write_text('{"round": 1}\n')
        if r is not None:
            (seed_dir / f"node{k}" / "checkpoints" / f"round-{r:06d}").mkdir(parents=True)
    log = tmp_path / "log.txt"
    assert driver.in_step(seed_dir, Console(file=open(log, "w"), width=300), "owners 3/1 seed 0") == continues
    aside = tmp_path / "owners-3-1-guarded" / "unfinished-seed0-1"
    if continues is not None:  # nodes in step: left as they are, to continue from the checkpoints
        assert (seed_dir / "node0" / "checkpoints" / "round-000030").is_dir() and not aside.exists()
        assert "every node continues from its checkpoint of round 30" in log.read_text()
        return
    # out of step: the run starts over in an empty folder; what it had measured is kept aside, without checkpoints
    assert not seed_dir.exists() and (aside / "node0" / "metrics.jsonl").exists()
    assert not list(aside.rglob("checkpoints"))
    said = log.read_text()
    assert "owners 3/1 seed 0: starting over" in said and str(aside) in said
    if stopped_at[0] is not None:
        assert "node0 20, node1 25, node2 none" in said
    assert list(tmp_path.glob("*/seed*")) == []  # the folder aside is no seed's run to the report or to --resume


def test_a_run_that_never_started_is_left_alone(tmp_path):
    from rich.console import Console

    assert driver.in_step(tmp_path / "x" / "seed0", Console(file=open(tmp_path / "log", "w")), "x") is None
    assert not (tmp_path / "x").exists()


def test_products_pin_both_users_of_bfloat16_on_every_node_and_each_node_records_what_its_plan_resolved(tmp_path, monkeypatch):
    from argparse import Namespace

    from rich.console import Console

    seen = []
    monkeypatch.setattr(driver, "run", lambda spec, **k: seen.append(spec) or {"per_node": [], "stopped": True})
    for products in ("auto", "model", "bfloat16"):
        with pytest.raises(SystemExit, match="stopped during"):
            driver.run_one(Config("owners", 2, 2, "guarded"), 0, Namespace(out=tmp_path / products, nodes=4, rounds=2, eval_every=1,
                                                                          accept_license=[], products=products), Console(file=None))
    pinned = [{flag: spec.extra[spec.extra.index(flag) + 1] for flag in ("--generation.sampling_dtype", "--grpo.compute_dtype")
               if flag in spec.extra} for spec in seen]
    assert pinned == [{}, {"--generation.sampling_dtype": "model", "--grpo.compute_dtype": "model"},
                      {"--generation.sampling_dtype": "bfloat16", "--grpo.compute_dtype": "bfloat16"}]
    # "model" is recorded as the weights' own dtype, so runs on machines that resolved it alike compare equal
    assert driver.products({"dtype": "float32", "sampling_dtype": "model", "compute_dtype": "bfloat16"}) == {
        "sampling_dtype": "float32", "compute_dtype": "bfloat16"}
    assert driver.products({"summary": "older plan"}) == {"sampling_dtype": None, "compute_dtype": None}
