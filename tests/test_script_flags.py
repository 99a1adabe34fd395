"""The scripts' flags: a bad value is argparse's one-line error naming the flag, before anything starts, and a
harness stopped with SIGTERM stops the processes it started."""

from __future__ import annotations

import argparse
import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.argtypes import bounded, count, fraction, json_of, positive
from p2p.config import ShardConfig
from tests.conftest import ROOT


def test_bounded_numbers_pass_through_and_out_of_range_ones_name_the_bound():
    assert count("3") == 3 and positive("0.5") == 0.5 and fraction("1") == 1.0
    assert bounded(float, gt=0, le=1)("1") == 1.0
    for parse, text, words in [(count, "0", "must be >= 1 (got 0)"), (positive, "0", "must be > 0 (got 0)"),
                               (fraction, "1.5", "must be <= 1 (got 1.5)"), (positive, "inf", "must be finite"),
                               (positive, "nan", "must be finite"), (count, "2.5", "not an integer: '2.5'"),
                               (positive, "x", "not a number: 'x'"), (bounded(float, lt=1), "1", "must be < 1")]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(words)):
            parse(text)


def test_json_of_a_model_returns_the_object_and_names_a_bad_knob():
    shards = json_of(ShardConfig)
    assert shards('{"level": 0}') == {"level": 0}
    for text, words in [("{bad", "not JSON"), ('{"level": 99}', "level: "), ('{"lvl": 1}', "lvl: Extra inputs")]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            shards(text)


@pytest.mark.parametrize("script, flag, value", [
    ("simulate_swarm.py", "--nodes", "0"), ("simulate_swarm.py", "--signal-rate", "2"),
    ("bench_gossip.py", "--shards", '{"level": 99}'), ("bench_gossip.py", "--soak", "-1"),
    ("bench_churn.py", "--period", "0"), ("bench_hostile.py", "--hostile", "-1"),
    ("bench_hostile.py", "--rule", "best"),
    ("sapo_experiment.py", "--seeds", "0"), ("bench_round.py", "--top-p", "0"), ("bench_round.py", "--variants", "full:8:fp8"),
    ("bench_round.py", "--seeds", "0"), ("bench_round.py", "--baseline-step", "full:4"),
    ("bench_generation.py", "--n", "x"), ("pass_rates.py", "--tasks", "0"), ("bench_silo.py", "--minutes", "-1"),
    ("bench_logprobs.py", "--rows", "0"), ("pass_rates.py", "--accept-license", "apache"),
    ("sapo_experiment.py", "--accept-license", "apache"), ("pass_rates.py", "--datasets", "nope"),
    ("bench_contention.py", "--busy", "-1"), ("bench_contention.py", "--rounds", "2"), ("owners.py", "--out", "/nonexistent"),
    ("bench_demo.py", "--repeats", "0"),
])
def test_a_bad_flag_value_is_one_line_naming_the_flag(script, flag, value):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / script), flag, value], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert last.startswith(f"{script}: error: argument {flag}"), last


def test_every_scripts_help_says_what_it_does_in_whole_sentences_without_development_history():
    """A user reads --help: its description is the docstring's whole first paragraph (a first line cut mid-sentence
    read as 'restarted (same'), and it names no issue of ours."""
    scripts = sorted(p for p in (ROOT / "scripts" / "bench").glob("*.py") if p.name != "__init__.py")
    running = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True) for p in scripts}
    for name, proc in running.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (name, err[-2000:])
        description = " ".join(out.split("\n\n")[1].split())
        assert description.endswith((".", ")")) and not re.search(r"(?i)issue \d+", out), (name, description)



@pytest.mark.parametrize("script, args, flag", [
    ("sapo_experiment.py", ["--seed", "3"], "--seed"),  # a prefix of --seeds: it ran three seeds
    ("simulate_swarm.py", ["--node", "3"], "--node"),
    ("gpu_check.py", ["run", "--out", "{tmp}", "--dry"], "--dry"),  # a subcommand's flags too
])
def test_a_scripts_flag_is_taken_whole_never_as_the_prefix_of_another(script, args, flag, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / script), *(a.format(tmp=tmp_path) for a in args)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"error: unrecognized arguments: {flag}" in r.stderr.strip().splitlines()[-1], r.stderr


def test_every_parser_a_script_builds_takes_whole_flags_only():
    """argparse matches prefixes unless told not to, parser by parser (a subcommand's included)."""
    built = []
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        for call in ast.walk(ast.parse(path.read_text())):
            name = getattr(call, "func", None) and getattr(call.func, "attr", getattr(call.func, "id", None))
            if name in ("ArgumentParser", "add_parser"):
                whole = any(k.arg == "allow_abbrev" and getattr(k.value, "value", True) is False for k in call.keywords)
                built.append((path.relative_to(ROOT).as_posix(), call.lineno, whole))
            elif name == "script_parser":  # node/argtypes.py: allow_abbrev=False
                built.append((path.relative_to(ROOT).as_posix(), call.lineno, True))
    assert len(built) >= 20 and [b for b in built if not b[2]] == []


def children(pid: int) -> set[int]:
    try:
        return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


def alive(pid: int) -> bool:
    """Running, not a zombie (a child that died before its parent reaped it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_to_a_benchmark_stops_the_processes_it_started(tmp_path):
    bench = subprocess.Popen([sys.executable, "scripts/bench/bench_gossip.py", "--nodes", "2", "--soak", "600",
                              "--out", str(tmp_path / "out.json")], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    probes: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(probes := children(bench.pid)) < 2 and time.monotonic() < deadline and bench.poll() is None:
            time.sleep(0.2)
        assert len(probes) == 2, f"the benchmark did not start its 2 probes: {bench.poll()}"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        assert "Traceback" not in bench.stderr.read()
        assert not [p for p in probes if alive(p)], "probes left running after the benchmark stopped"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for p in probes:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("script, writes", [("gen_config_docs.py", "docs/CONFIG.md"),
                                            ("gen_protocol_vectors.py", "docs/protocol-vectors.json")])
def test_a_generators_help_prints_its_usage_and_writes_nothing(script, writes):
    before = (ROOT / writes).stat().st_mtime_ns
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "tools" / script), "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"usage: {script}") and "wrote" not in r.stdout, r.stdout + r.stderr
    assert (ROOT / writes).stat().st_mtime_ns == before
