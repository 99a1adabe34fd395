"""Shared fixtures. Presets build once into the same cache the demo and `sapo run` use (model.cache_dir:
~/.cache/sapo-node unless SAPO_MODEL__CACHE_DIR says otherwise; $SAPO_TEST_CACHE overrides it for tests)."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.config import default_cache_dir
from trainer.policy import Policy

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SAPO_TEST_CACHE") or os.environ.get("SAPO_MODEL__CACHE_DIR") or default_cache_dir()).expanduser()
# Every node a test starts (subprocesses inherit this) listens on loopback only, on a free port.
os.environ["SAPO_P2P__LISTEN"] = "/ip4/127.0.0.1/tcp/0"
os.environ["SAPO_STATUS__LISTEN"] = "127.0.0.1:0"


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", "no") == "loadgroup" and tuple(map(int, pytest.__version__.split(".")[:2])) >= (9, 2):
        raise pytest.UsageError(f"pytest {pytest.__version__}: pytest-xdist's --dist loadgroup does not group tests on "
                                "pytest 9.2 and later (pytest-xdist issue 1386); scripts/setup.sh installs pytest<9.2")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true",
                     help="run the tests marked `long` too (minutes each; scripts/test.sh runs them in a lane of their own "
                          "under SAPO_TEST_LONG=1, as CI does)")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook turns the mark into the test's group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """scripts/test.sh runs two pytest-xdist workers with `--dist loadgroup`: every slow test goes to one of them,
    one at a time, and the quick tests run beside it on the other. Two slow tests side by side would start nodes that
    fight for the same cores and stretch the bounds each one asserts. A quick test beside one costs it little, and a
    slow one marked `untimed` asserts no bound that a neighbour could stretch: those run in the other lane. A test
    marked `long` runs only with --long."""
    if not config.getoption("long"):
        long = [item for item in items if item.get_closest_marker("long")]
        if long:
            config.hook.pytest_deselected(items=long)
            items[:] = [item for item in items if not item.get_closest_marker("long")]
    if getattr(config.option, "loadgroup", False):  # what pytest-xdist sets in a worker for `--dist loadgroup`
        for item in items:
            if item.get_closest_marker("slow") and not item.get_closest_marker("untimed"):
                item.add_marker(pytest.mark.xdist_group("slow"))


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return CACHE


def cached_preset(request: pytest.FixtureRequest, name: str, accept: tuple[str, ...] = ()) -> Path:
    """The preset's cached folder (`accept`: the terms the calling test accepts for it). A build (a minute or more)
    is announced on the terminal with its progress, past pytest's output capture: a suite that sits silent for
    minutes looks hung."""
    from trainer import presets

    if presets.is_cached(name, CACHE):
        return presets.ensure(name, CACHE)
    capture = request.config.pluginmanager.getplugin("capturemanager")
    trainer_log = logging.getLogger("trainer")
    with capture.global_and_fixture_disabled():
        handler = logging.StreamHandler(sys.stderr)  # the real stderr only while capture is off
        handler.setFormatter(logging.Formatter("  %(message)s"))
        print(f"\nbuilding model preset {name} into {CACHE} (once: the demo and later runs reuse it)", file=sys.stderr)
        started, level = time.monotonic(), trainer_log.level
        trainer_log.addHandler(handler)
        trainer_log.setLevel(logging.INFO)
        try:
            path = presets.ensure(name, CACHE, accepted=accept, how=f"the test {request.node.name}")
        finally:
            trainer_log.removeHandler(handler)
            trainer_log.setLevel(level)
        print(f"built {name} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return path


@pytest.fixture(scope="session")
def tiny_a(request: pytest.FixtureRequest) -> Path:
    return cached_preset(request, "tiny-a")


@pytest.fixture(scope="session")
def tiny_b(request: pytest.FixtureRequest) -> Path:
    return cached_preset(request, "tiny-b")


def untrained_policy(preset: str = "tiny-a", seed: int = 0) -> Policy:
    """A randomly initialised preset-shaped policy: fast, for tests of mechanics rather than learning."""
    from dataclasses import replace

    from trainer.tiny import PRESETS, make_model, train_tokenizer

    spec = replace(PRESETS[preset], seed=seed)
    tokenizer = train_tokenizer(spec)
    model = make_model(spec, tokenizer).eval()
    return Policy(model=model, tokenizer=tokenizer, device=torch.device("cpu"), use_chat_template=False)


@pytest.fixture
def policy() -> Policy:
    return untrained_policy()


def run_sapo(*args: str, env: dict | None = None, timeout: float = 300, cwd: Path | None = None):
    """Run the CLI in a subprocess, as a user would."""
    import subprocess

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd or ROOT)


def node_beside(probe, out: Path, args: list[str], until, timeout: float, describe: str) -> tuple[int, str, list[dict]]:
    """`sapo run --out OUT ARGS` bootstrapped to a lab probe, stopped with SIGTERM once `until(rows)` holds for its
    metrics rows (or when it exits first); the node is killed and the probe stopped however it ends. Returns the
    node's exit code, its stderr and its rows."""
    import json
    import signal
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "node.cli", "run", "--out", str(out), "--bootstrap", probe.addr, *args],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def rows() -> list[dict]:
        path = out / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    try:
        probe.wait_for(lambda: proc.poll() is not None or until(rows()), timeout, describe)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        probe.stop()
    return proc.returncode, err, rows()
