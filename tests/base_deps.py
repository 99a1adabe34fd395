"""What a plain `pip install -e .` has: the distributions pyproject.toml's base dependencies bring in, and
the modules that only an extra brings (peft, vllm, pytest, ...). `run_with_base_deps` runs code with those
modules made unimportable, as they are after a plain install; transformers' own checks (for example
`is_accelerate_available`) then say no too, since `importlib.util.find_spec` returns None for them."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _closure(requirements: list[str]) -> set[str]:
    """Canonical names of the installed distributions these requirements pull in, with their extras."""
    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            continue  # not for this platform, or not installed here: nothing of it can be imported either
        name = canonicalize_name(req.name)
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        for sub in dist.requires or []:
            todo += [(Requirement(sub), e) for e in ("", *req.extras)]
    return {k.split("[")[0] for k in seen}


def extra_only_modules() -> list[str]:
    """Top-level modules whose every distribution comes only with an extra of pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _closure(project["dependencies"])
    extras = _closure([r for reqs in project["optional-dependencies"].values() for r in reqs]) - base
    return sorted(m for m, dists in packages_distributions().items()
                  if not m.startswith("_") and all(canonicalize_name(d) in extras for d in dists))


BLOCK = """
import runpy, sys
for name in sys.argv[1].split(","):
    if name:
        sys.modules[name] = None  # `import name` fails, importlib.util.find_spec(name) is None
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def run_with_base_deps(module: str, *args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m module args` with every extra-only module unimportable."""
    return subprocess.run([sys.executable, "-c", BLOCK, ",".join(extra_only_modules()), module, *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
