"""Shared fixtures. Tiny presets build once into a cache under the repo (or $SAPO_TEST_CACHE)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from trainer.policy import Policy

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SAPO_TEST_CACHE", ROOT / ".sapo-cache"))
# Every node a test starts (subprocesses inherit this) listens on loopback only, on a free port.
os.environ["SAPO_P2P__LISTEN"] = "/ip4/127.0.0.1/tcp/0"
os.environ["SAPO_STATUS__LISTEN"] = "127.0.0.1:0"


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return CACHE


@pytest.fixture(scope="session")
def tiny_a(cache_dir: Path) -> Path:
    from trainer.presets import ensure

    return ensure("tiny-a", cache_dir)


@pytest.fixture(scope="session")
def tiny_b(cache_dir: Path) -> Path:
    from trainer.presets import ensure

    return ensure("tiny-b", cache_dir)


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
