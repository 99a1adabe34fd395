"""Every example in the README and the guides runs as written: the short ones here, the rest listed with
why not; and every relative link in them leads somewhere."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from node.config import load_config
from tests.conftest import CACHE, ROOT

BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)

# First line of each fenced block that is not run here -> why (long runs, other machines, or output).
NOT_RUN = {
    "bash scripts/demo.sh": "the main job (minutes); scripts/demo.sh is `sapo swarm`, run by tests/test_swarm.py",
    ".venv/bin/python scripts/bench/pass_rates.py": "benchmark: tens of minutes on the real model",
    ".venv/bin/python scripts/bench/bench_round.py": "benchmark: tens of minutes on the real model",
    ".venv/bin/python scripts/bench/bench_silo.py": "benchmark: 10 minutes",
    ".venv/bin/python scripts/bench/bench_contention.py": "benchmark: 15 minutes of real-model rounds beside busy loops",
    ".venv/bin/python scripts/bench/bench_demo.py": "benchmark: four demos, 15 minutes; tests/test_bench_demo.py reads a "
    "node's pace as it does",
    "OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/bench/bench_contention.py": "benchmark: 5 minutes of real-model rounds",
    ".venv/bin/sapo init-model --preset smollm2-135m --out /tmp/smol": "experiment: three 10-round runs of the real model "
    "(half an hour); tests/test_recipes.py and tests/test_watch.py check what they rest on",
    ".venv/bin/python scripts/bench/bench_logprobs.py": "benchmark: minutes on the real model",
    ".venv/bin/python scripts/bench/bench_heap.py": "benchmark: minutes of real-model steps; tests/test_allocator.py checks "
    "the give-back it measures",
    ".venv/bin/python scripts/bench/sapo_experiment.py": "experiment: hours; tests/test_experiment.py runs its machinery",
    "mkdir -p runs/owners/eval-cache": "the four-owner grid's start, before hours of runs; tests/test_owners.py checks the "
    "kept evaluation is the one every float32 run of the grid started from",
    ".venv/bin/python scripts/bench/bench_gossip.py": "benchmark: minutes",
    ".venv/bin/python scripts/bench/simulate_swarm.py": "simulation: minutes; tests/test_shards.py runs it at 8 and 100 nodes",
    ".venv/bin/python scripts/bench/bench_churn.py": "benchmark: 13 minutes; tests/test_churn.py runs it for 2 minutes",
    ".venv/bin/python scripts/bench/bench_soak.py": "benchmark: 2 hours; tests/test_soak.py runs one 100-second cycle",
    ".venv/bin/python scripts/bench/bench_hostile.py": "benchmark: minutes",
    ".venv/bin/python -m node.cli run --out /tmp/drift/lone": "measurement: a tiny node alone for 4 minutes, read by "
    "round_work.py; tests/test_round_work.py checks how it reads a run's windows",
    ".venv/bin/python scripts/bench/diagnose_peer.py": "diagnosis: an hour and more on the real model",
    ".venv-vllm/bin/python scripts/bench/bench_generation.py": "benchmark; the second line needs a GPU",
    ".venv/bin/sapo swarm --nodes 2 --rounds 20 --presets smollm2-135m": "experiment: four real-model nodes for 20 rounds on one machine",
    ".venv/bin/sapo doctor --bench --model smollm2-135m": "benchmark: minutes of real-model rounds; the H200 rows need a GPU",
    "sapo run --model smollm2-135m --grpo.lr 1e-5 --rounds 6": "measurement: minutes of real-model rounds at pinned rates; "
    "tests/test_step_size.py checks the controller it calibrates",
    ".venv/bin/sapo run --model gemma3-270m --model.accept_license gemma": "experiment: 40 rounds of the real model "
    "(15-25 minutes), under terms a test does not accept for anyone; tests/test_recipes.py checks the rate it chose",
    "bash scripts/setup.sh": "needs the model hub (Qwen2.5-0.5B) and another node's address",
    ".venv/bin/pip install -e '.[vllm]'": "needs a CUDA machine (CI's second stage tests the CPU build of vLLM)",
    "node0 (tiny-a): 300 rounds": "output of the demo, not a command",
    "no plan fits:": "the planner's answer for a described card and model; tests/test_plan.py checks it word for word",
    "docker compose -f docker/compose.yaml up --build": "needs a Docker engine: scripts/test_docker.sh (CI's third stage) runs the compose swarm",
    "docker compose -f docker/compose.yaml --profile gpu": "needs a GPU and the NVIDIA container toolkit",
    "docker build -f docker/Dockerfile.gpu": "needs a GPU to run; the CUDA image is large",
    "SAPO_ANNOUNCE=/dns4/boot1.example.org": "a public host; tests/test_netlab.py runs a testnet bootstrap in a namespace",
    "bash scripts/bench/gpu_check.sh prepare": "downloads 122 MiB of wheels; tests/test_gpu_check.py runs the dry run and "
    "the bundles; the rest needs a GPU",
    "DOCKER_BUILDKIT=1 docker build -f docker/Dockerfile": "needs a Docker engine: scripts/test_docker.sh builds the image this way",
}
# The front door and the guides (each docs page opens with what it covers).
PAGES = ["README.md", "docs/architecture.md", "docs/models.md", "docs/sapo-round.md", "docs/gpu.md", "docs/network.md", "docs/operations.md",
         "docs/bench/README.md", "docs/bench/learning.md", "docs/bench/speed.md", "docs/bench/memory.md",
         "docs/bench/network.md", "docs/bench/hostile.md", "docs/bench/soak.md", "docs/bench/gpu.md", "docker/README.md"]


def blocks() -> list[tuple[str, str]]:
    return [(lang, body) for page in PAGES for lang, body in BLOCK.findall((ROOT / page).read_text())]


def anchors(page) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", m.strip().lower()).replace(" ", "-")
            for m in re.findall(r"(?m)^#+ (.*)$", page.read_text())}


# A checkout, home folder or output folder of the machine that wrote a file: it means nothing on a reader's machine.
MACHINE_PATH = re.compile(rb"(?<![\w.~$/])/(?:work|root|home|Users)/[\w.-]")


def test_no_file_under_docs_names_a_folder_of_the_machine_that_wrote_it():
    files = subprocess.run(["git", "ls-files", "docs", "README.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    named = [f for f in files.stdout.split() if MACHINE_PATH.search((ROOT / f).read_bytes())]
    assert files.stdout and not named, f"paths of one machine in {named}"


def test_every_relative_link_leads_to_a_file_and_heading():
    broken = []
    for page in map(ROOT.joinpath, PAGES + ["docs/PROTOCOL.md", "docs/CONFIG.md"]):
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"\w+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_readme_is_a_front_door():
    """At most about 250 lines, and its first screen holds the two commands and the three ways in."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first_screen = "\n".join(text.splitlines()[:60])
    for must in ("bash scripts/demo.sh", "bash scripts/test.sh", "](docs/gpu.md)", "](docs/network.md)",
                 "](docker/README.md)"):
        assert must in first_screen, must


def sapo_env() -> dict:
    """A user's shell: `sapo` on the PATH, default ports (none of the tests' overrides), the tests' model cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAPO_")}
    env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}"
    return {**env, "SAPO_MODEL__CACHE_DIR": str(CACHE), "COLUMNS": "300"}


def test_every_block_is_run_here_or_listed_with_why_not():
    firsts = [body.splitlines()[0] for _, body in blocks()]
    ran = {"$ sapo run --grpo.lr -1", "[[tasks.datasets]]", "A=$(sapo id --out runs/a --listen /ip4/127.0.0.1/tcp/7420 | tail -n 1)"}
    unknown = [f for f in firsts if not any(f.startswith(k) for k in NOT_RUN) and not any(f.startswith(k) for k in ran)]
    assert unknown == [], "README blocks neither run by tests/test_readme.py nor listed in NOT_RUN"
    stale = [k for k in NOT_RUN if not any(f.startswith(k) for f in firsts)]
    assert stale == [], "NOT_RUN lists blocks the README and guides no longer have"


def test_shell_transcripts_print_what_the_readme_shows(tmp_path):
    transcripts = [body for _, body in blocks() if body.startswith("$ ")]
    assert transcripts
    for body in transcripts:
        command, *expected = body.strip().splitlines()
        r = subprocess.run(command[2:], shell=True, capture_output=True, text=True, env=sapo_env(),
                           cwd=tmp_path, timeout=120)
        assert (r.stdout + r.stderr).strip().splitlines() == expected, command


def test_config_file_examples_load(tmp_path):
    tomls = [body for lang, body in blocks() if lang == "toml"]
    assert tomls
    for k, body in enumerate(tomls):
        path = tmp_path / f"example{k}.toml"
        path.write_text(body)
        load_config(path)


@pytest.mark.slow
def test_the_two_node_example_trains_both_nodes_together(tmp_path, tiny_a):
    body = next(body for lang, body in blocks() if lang == "bash" and body.startswith("A=$(sapo id"))
    proc = subprocess.Popen(["bash", "-c", body], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=sapo_env(), cwd=tmp_path, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the backgrounded node too, whatever happened
    assert proc.returncode == 0, stderr[-3000:]
    assert "[a] round 100/100" in stderr and "[b] round 100/100" in stderr  # which node wrote each line
    assert not re.findall(r"\w*Warning\b.*", stderr)  # a user reads a FutureWarning as something gone wrong
    for node, rounds in (("a", 100), ("b", 100)):
        rows = [json.loads(line) for line in (tmp_path / "runs" / node / "metrics.jsonl").read_text().splitlines()][1:]
        assert len(rows) == rounds and max(m["peers"] for m in rows) == 1
    used = [sum(m["n_external_used"] for m in (json.loads(line) for line in
            (tmp_path / "runs" / node / "metrics.jsonl").read_text().splitlines())) for node in "ab"]
    assert min(used) > 0, f"external groups used by a and b: {used}"
    # both serve status; with 8080 free, one node says it took the next port
    dashboards = re.findall(r"status: dashboard at (http://\S+)", stderr)
    assert len(set(dashboards)) == 2
